//! The rendezvous ([`join`]) and the job's control connections ([`Cluster`]).

use std::collections::{BTreeMap, HashMap};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::ClusterError;
use crate::auth::{SessionKey, Token, nonce};
use crate::launch::Launch;
use crate::wire::{
    self, Abort, Arrive, Challenge, DATA_MAX, Decide, Direction, Finish, FrameError, HANDSHAKE_MAX,
    Heartbeat, Hello, Kind, Opener, Refused, Sealer, VERSION, Welcome, decode, hex, read_header,
    read_payload, unhex, write_json,
};

/// How long the hosts have to find each other by default.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a host may stay silent (no heartbeat, no data) before the others give it up, by
/// default: stopped, dead or cut off.
pub const HOST_TIMEOUT: Duration = Duration::from_secs(30);
/// Heartbeats, each way.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How often waits look at the job's state.
const TICK: Duration = Duration::from_millis(20);
/// How long host 0 gives one connecting peer to complete its part of the handshake.
const HANDSHAKE_IO: Duration = Duration::from_secs(5);
/// What a host waiting for host 0's verdict allows beyond the rendezvous timeout (host 0
/// tells everyone why when its own wait ends).
const VERDICT_GRACE: Duration = Duration::from_secs(10);
/// How long a failing host waits for a connection's writer to tell that host why (a message
/// to a live host ends within it; one to a stopped host never does).
const ABORT_WAIT: Duration = Duration::from_secs(2);

/// What every host of a job must agree on, key by key (`config model.dim`, `dataset`,
/// `binary`, ...): a mismatch is refused naming the host and the key.
pub type Identity = BTreeMap<String, String>;

/// How a host joins and watches a job.
#[derive(Debug, Clone)]
pub struct Options {
    /// The job's shared secret.
    pub token: Token,
    /// How long the hosts have to find each other ([`RENDEZVOUS_TIMEOUT`]).
    pub timeout: Duration,
    /// How long a host may be silent before the job fails ([`HOST_TIMEOUT`]).
    pub host_timeout: Duration,
    /// This host's name, for messages (`/proc/sys/kernel/hostname` by default).
    pub name: String,
}

impl Options {
    /// The default timeouts and this machine's host name.
    pub fn new(token: Token) -> Options {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "unknown".into());
        Options {
            token,
            timeout: RENDEZVOUS_TIMEOUT,
            host_timeout: HOST_TIMEOUT,
            name,
        }
    }
}

/// Joins the job `launch` describes: host 0 runs the rendezvous, the others connect to it.
/// Returns once every host has arrived, proven the token and matched host 0's `identity`.
pub fn join(
    launch: &Launch,
    identity: &Identity,
    options: &Options,
) -> Result<Cluster, ClusterError> {
    if launch.rank == 0 {
        lead(launch, identity, options)
    } else {
        follow(launch, identity, options)
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// The addresses `HOST:PORT` names.
fn resolve(rendezvous: &str) -> Result<Vec<SocketAddr>, ClusterError> {
    let addrs: Vec<SocketAddr> = rendezvous
        .to_socket_addrs()
        .map_err(|e| ClusterError::Launch(format!("rendezvous {rendezvous}: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(ClusterError::Launch(format!(
            "rendezvous {rendezvous}: the name resolves to no address"
        )));
    }
    Ok(addrs)
}

/// A connected host that has not been admitted yet.
struct Candidate {
    stream: TcpStream,
    hello: Hello,
    challenge: [u8; 32],
    client_nonce: Vec<u8>,
}

fn lead(launch: &Launch, identity: &Identity, options: &Options) -> Result<Cluster, ClusterError> {
    let at = &launch.rendezvous;
    let addr = resolve(at)?[0];
    if addr.ip().is_unspecified() {
        return Err(ClusterError::Launch(format!(
            "rendezvous {at}: name the address of host 0 that the other hosts reach; host 0 listens on that address only, not on every interface"
        )));
    }
    let listener = TcpListener::bind(addr).map_err(|source| ClusterError::Bind {
        rendezvous: at.clone(),
        source,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(io("making the rendezvous socket non-blocking"))?;
    tracing::info!(
        "host 0 of {}: rendezvous at {at} ({addr}), waiting up to {} s for the other hosts",
        launch.hosts,
        options.timeout.as_secs()
    );
    let deadline = Instant::now() + options.timeout;
    let mut joined: Vec<Option<Candidate>> = (0..launch.hosts).map(|_| None).collect();
    let refuse_all = |joined: &mut Vec<Option<Candidate>>, reason: &str| {
        for c in joined.iter_mut().flatten() {
            let _ = write_json(
                &mut c.stream,
                Kind::Refused,
                0,
                c.hello.rank,
                &Refused {
                    reason: reason.to_string(),
                },
            );
        }
    };
    loop {
        let missing: Vec<u32> = (1..launch.hosts)
            .filter(|&r| joined[r as usize].is_none())
            .collect();
        if missing.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            let reason = format!(
                "rendezvous at {at}: {} did not arrive within {} s (host 0 waited; check that every host was started with the same --rendezvous, LEGEND_JOB_TOKEN and a reachable network)",
                list_hosts(&missing),
                options.timeout.as_secs()
            );
            refuse_all(&mut joined, &reason);
            return Err(ClusterError::Rendezvous(reason));
        }
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io(format!("accepting at the rendezvous {at}"))(e)),
        };
        let c = match handshake(stream, options) {
            Ok(c) => c,
            Err(why) => {
                tracing::warn!("rendezvous {at}: a connection from {peer} was refused: {why}");
                continue;
            }
        };
        // An admitted peer holds the token: a wrong layout is a mistake of the job's, fatal.
        let rank = c.hello.rank;
        let fatal = if c.hello.hosts != launch.hosts {
            Some(format!(
                "host {rank} ({}) was started for {} hosts, host 0 ({}) for {}: every host needs the same --hosts",
                c.hello.name, c.hello.hosts, options.name, launch.hosts
            ))
        } else if rank == 0 || rank >= launch.hosts {
            Some(format!(
                "a host ({}) says it is host {rank}, which is not in 1 .. {}",
                c.hello.name,
                launch.hosts - 1
            ))
        } else if let Some(first) = &joined[rank as usize] {
            Some(format!(
                "two hosts say they are host {rank}: {} and {}",
                first.hello.name, c.hello.name
            ))
        } else {
            None
        };
        match fatal {
            Some(reason) => {
                let mut c = c;
                let _ = write_json(
                    &mut c.stream,
                    Kind::Refused,
                    0,
                    rank,
                    &Refused {
                        reason: reason.clone(),
                    },
                );
                refuse_all(&mut joined, &reason);
                return Err(ClusterError::Mismatch(reason));
            }
            None => {
                tracing::info!(
                    "rendezvous {at}: host {rank} ({}) arrived from {peer}",
                    c.hello.name
                );
                joined[rank as usize] = Some(c);
            }
        }
    }
    // Every identity against host 0's.
    for c in joined.iter().flatten() {
        if let Some(why) = mismatch(identity, &c.hello.identity) {
            let reason = format!(
                "host {} ({}) does not run the job host 0 ({}) runs: {why}",
                c.hello.rank, c.hello.name, options.name
            );
            refuse_all(&mut joined, &reason);
            return Err(ClusterError::Mismatch(reason));
        }
    }
    let mut names = vec![options.name.clone()];
    names.extend(joined.iter().flatten().map(|c| c.hello.name.clone()));
    let mut streams: Vec<Option<(TcpStream, SessionKey)>> = vec![None];
    for c in joined.into_iter().flatten() {
        let rank = c.hello.rank;
        let mut stream = c.stream;
        let mac = options
            .token
            .mac(&welcome_signed(&c.challenge, &c.client_nonce, rank, &names).as_parts());
        write_json(
            &mut stream,
            Kind::Welcome,
            0,
            rank,
            &Welcome {
                names: names.clone(),
                mac: hex(&mac),
            },
        )
        .map_err(io(format!("welcoming host {rank} at the rendezvous {at}")))?;
        let key = options
            .token
            .session_key(&c.challenge, &c.client_nonce, rank);
        streams.push(Some((stream, key)));
    }
    tracing::info!("rendezvous {at}: all {} hosts arrived", launch.hosts);
    Cluster::start(0, names, at.clone(), streams, options)
}

/// Host 0's side of one connection's handshake: the challenge, the peer's proof and hello.
fn handshake(mut stream: TcpStream, options: &Options) -> Result<Candidate, String> {
    let setup = |s: &TcpStream| -> std::io::Result<()> {
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(HANDSHAKE_IO))?;
        s.set_write_timeout(Some(HANDSHAKE_IO))?;
        s.set_nodelay(true)
    };
    setup(&stream).map_err(|e| e.to_string())?;
    let challenge = nonce().map_err(|e| e.to_string())?;
    write_json(
        &mut stream,
        Kind::Challenge,
        0,
        0,
        &Challenge {
            version: VERSION,
            nonce: hex(&challenge),
        },
    )
    .map_err(|e| e.to_string())?;
    let head = read_header(&mut stream).map_err(|e| e.to_string())?;
    if head.kind != Kind::Hello {
        return Err(format!("sent {:?} instead of its hello", head.kind));
    }
    let payload = read_payload(&mut stream, head.len, HANDSHAKE_MAX).map_err(|e| e.to_string())?;
    let hello: Hello = decode(&payload).map_err(|e| e.to_string())?;
    let refuse = |stream: &mut TcpStream, reason: String| {
        let _ = write_json(
            stream,
            Kind::Refused,
            0,
            hello.rank,
            &Refused {
                reason: reason.clone(),
            },
        );
        reason
    };
    if hello.version != VERSION {
        return Err(refuse(
            &mut stream,
            format!(
                "host {} speaks rendezvous version {}, host 0 version {VERSION}: run the same Legend on every host",
                hello.rank, hello.version
            ),
        ));
    }
    let client_nonce = unhex(&hello.nonce).unwrap_or_default();
    let proof = unhex(&hello.mac).unwrap_or_default();
    let signed = hello_signed(&challenge, &client_nonce, &hello);
    if client_nonce.len() != 32 || !options.token.verify(&signed.as_parts(), &proof) {
        return Err(refuse(
            &mut stream,
            format!(
                "host {} ({}) does not hold this job's token: its {} differs from host 0's",
                hello.rank,
                hello.name,
                crate::TOKEN_VAR
            ),
        ));
    }
    Ok(Candidate {
        stream,
        hello,
        challenge,
        client_nonce,
    })
}

/// What a MAC of the handshake covers, part by part (each length-prefixed by `Token::mac`).
struct Signed(Vec<Vec<u8>>);

impl Signed {
    fn as_parts(&self) -> Vec<&[u8]> {
        self.0.iter().map(Vec::as_slice).collect()
    }
}

/// What a host's hello proves: both nonces, and all it says (its place, name and identity),
/// so that none of it can be changed on the way.
fn hello_signed(challenge: &[u8], client_nonce: &[u8], hello: &Hello) -> Signed {
    Signed(vec![
        b"hello".to_vec(),
        challenge.to_vec(),
        client_nonce.to_vec(),
        hello.rank.to_le_bytes().to_vec(),
        hello.hosts.to_le_bytes().to_vec(),
        hello.name.as_bytes().to_vec(),
        serde_json::to_vec(&hello.identity).expect("identities serialize"),
    ])
}

/// What host 0's welcome proves: both nonces, the host's rank and the hosts' names.
fn welcome_signed(challenge: &[u8], client_nonce: &[u8], rank: u32, names: &[String]) -> Signed {
    Signed(vec![
        b"welcome".to_vec(),
        challenge.to_vec(),
        client_nonce.to_vec(),
        rank.to_le_bytes().to_vec(),
        serde_json::to_vec(names).expect("names serialize"),
    ])
}

/// The first keys where `theirs` differs from `ours`, in words; `None` when they match.
fn mismatch(ours: &Identity, theirs: &Identity) -> Option<String> {
    let keys: std::collections::BTreeSet<&String> = ours.keys().chain(theirs.keys()).collect();
    let differing: Vec<String> = keys
        .into_iter()
        .filter(|k| ours.get(*k) != theirs.get(*k))
        .map(|k| {
            let show = |v: Option<&String>| v.map_or("(unset)".to_string(), |v| v.clone());
            format!(
                "{k} is {} there and {} on host 0",
                show(theirs.get(k)),
                show(ours.get(k))
            )
        })
        .collect();
    match differing.len() {
        0 => None,
        1..=3 => Some(differing.join("; ")),
        n => Some(format!(
            "{}; and {} more keys",
            differing[..3].join("; "),
            n - 3
        )),
    }
}

/// `host 2`, `hosts 2, 3`.
fn list_hosts(ranks: &[u32]) -> String {
    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
    if ranks.len() == 1 {
        format!("host {}", list[0])
    } else {
        format!("hosts {}", list.join(", "))
    }
}

fn follow(
    launch: &Launch,
    identity: &Identity,
    options: &Options,
) -> Result<Cluster, ClusterError> {
    let at = &launch.rendezvous;
    let deadline = Instant::now() + options.timeout;
    let mut last = String::from("nothing answered");
    let mut stream = loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(ClusterError::Rendezvous(format!(
                "rendezvous at {at}: host 0 was not there within {} s ({last}); is host 0 started, with this --rendezvous?",
                options.timeout.as_secs()
            )));
        }
        let attempt = resolve(at).and_then(|addrs| {
            let mut err = None;
            for a in addrs {
                match TcpStream::connect_timeout(&a, remaining.min(Duration::from_secs(2))) {
                    Ok(s) => return Ok(s),
                    Err(e) => err = Some(format!("{a}: {e}")),
                }
            }
            Err(ClusterError::Rendezvous(err.unwrap_or_default()))
        });
        match attempt {
            Ok(s) => break s,
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let timed_out = |what: &str| {
        ClusterError::Rendezvous(format!(
            "rendezvous at {at}: host 0 did not {what} within {} s",
            options.timeout.as_secs()
        ))
    };
    let verdict_by = deadline + VERDICT_GRACE;
    let wait = |stream: &TcpStream| {
        let left = verdict_by.saturating_duration_since(Instant::now());
        stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))
    };
    stream
        .set_nodelay(true)
        .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_IO)))
        .and_then(|()| wait(&stream))
        .map_err(io(format!("connecting to the rendezvous {at}")))?;
    let read = |stream: &mut TcpStream, what: &str| -> Result<(Kind, Vec<u8>), ClusterError> {
        let head = read_header(stream).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => timed_out(what),
            _ => ClusterError::Rendezvous(format!(
                "rendezvous at {at}: the connection to host 0 failed: {e}"
            )),
        })?;
        let payload = read_payload(stream, head.len, HANDSHAKE_MAX).map_err(|e| {
            ClusterError::Rendezvous(format!("rendezvous at {at}: reading host 0: {e}"))
        })?;
        Ok((head.kind, payload))
    };
    let bad = |e: std::io::Error| ClusterError::Rendezvous(format!("rendezvous at {at}: {e}"));
    let (kind, payload) = read(&mut stream, "answer")?;
    if kind != Kind::Challenge {
        return Err(ClusterError::Rendezvous(format!(
            "rendezvous at {at}: what answers is not a Legend host 0"
        )));
    }
    let challenge: Challenge = decode(&payload).map_err(bad)?;
    let server_nonce = unhex(&challenge.nonce).unwrap_or_default();
    let client_nonce = nonce()?;
    let mut hello = Hello {
        version: VERSION,
        rank: launch.rank,
        hosts: launch.hosts,
        name: options.name.clone(),
        nonce: hex(&client_nonce),
        mac: String::new(),
        identity: identity.clone(),
    };
    hello.mac = hex(&options
        .token
        .mac(&hello_signed(&server_nonce, &client_nonce, &hello).as_parts()));
    write_json(&mut stream, Kind::Hello, launch.rank, 0, &hello)
        .map_err(io(format!("greeting host 0 at the rendezvous {at}")))?;
    tracing::info!(
        "host {} of {}: joined the rendezvous at {at}, waiting for the other hosts",
        launch.rank,
        launch.hosts
    );
    let (kind, payload) = read(
        &mut stream,
        "admit this host (the other hosts did not all arrive)",
    )?;
    match kind {
        Kind::Welcome => {}
        Kind::Refused => {
            let r: Refused = decode(&payload).map_err(bad)?;
            return Err(ClusterError::Refused(r.reason));
        }
        other => {
            return Err(ClusterError::Rendezvous(format!(
                "rendezvous at {at}: host 0 sent {other:?} instead of its verdict"
            )));
        }
    }
    let welcome: Welcome = decode(&payload).map_err(bad)?;
    let proof = unhex(&welcome.mac).unwrap_or_default();
    let signed = welcome_signed(&server_nonce, &client_nonce, launch.rank, &welcome.names);
    if !options.token.verify(&signed.as_parts(), &proof)
        || welcome.names.len() != launch.hosts as usize
    {
        return Err(ClusterError::Refused(format!(
            "rendezvous at {at}: what answers does not hold this job's token ({})",
            crate::TOKEN_VAR
        )));
    }
    let key = options
        .token
        .session_key(&server_nonce, &client_nonce, launch.rank);
    let mut streams: Vec<Option<(TcpStream, SessionKey)>> =
        (0..launch.hosts).map(|_| None).collect();
    streams[0] = Some((stream, key));
    Cluster::start(launch.rank, welcome.names, at.clone(), streams, options)
}

/// One connection to another host.
struct Peer {
    /// Every frame after the handshake is sealed under the connection's session key.
    writer: Mutex<Sealer<TcpStream>>,
    /// For shutting the connection down while a writer holds `writer`.
    handle: TcpStream,
    /// Milliseconds since the job's start when the peer was last heard from.
    heard: AtomicU64,
}

/// Data for one (channel, sender).
struct Mailbox {
    tx: Sender<Vec<u8>>,
    rx: Arc<Mutex<Receiver<Vec<u8>>>>,
}

#[derive(Default)]
struct GateState {
    /// Host 0: each host's last arrival (gate, stop wanted).
    arrivals: Vec<Option<(u64, bool)>>,
    /// The other hosts: host 0's last decision (gate, go).
    decision: Option<(u64, bool)>,
}

struct Inner {
    rank: u32,
    names: Vec<String>,
    rendezvous: String,
    host_timeout: Duration,
    started: Instant,
    peers: Vec<Option<Peer>>,
    failure: Mutex<Option<String>>,
    /// Held while a failure is told to the other hosts.
    aborting: Mutex<()>,
    failed: AtomicBool,
    /// The job is ending (host 0 finished it): connections closing are expected.
    ending: AtomicBool,
    /// How it ended, once host 0 said (`true`: stopped as asked).
    finished: Mutex<Option<bool>>,
    mail: Mutex<HashMap<(u32, u32), Mailbox>>,
    gate: Mutex<GateState>,
    gate_changed: Condvar,
    progress: AtomicU64,
    peer_progress: Vec<AtomicU64>,
    stop: Mutex<Option<Arc<AtomicBool>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// This host's end of a job's control connections (see the crate docs). Clones share them;
/// when the last clone goes without [`Cluster::finish`], the job fails on the other hosts
/// with "host R ended without finishing".
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
    _owner: Arc<Owner>,
}

/// Ends the job's connections when the last [`Cluster`] goes.
struct Owner(Arc<Inner>);

impl Drop for Owner {
    fn drop(&mut self) {
        let inner = &self.0;
        if !inner.ending.load(Ordering::Acquire) {
            inner.fail(format!(
                "{} ended without finishing the job",
                inner.host(inner.rank)
            ));
        }
        for p in inner.peers.iter().flatten() {
            let _ = p.handle.shutdown(Shutdown::Both);
        }
    }
}

impl Cluster {
    fn start(
        rank: u32,
        names: Vec<String>,
        rendezvous: String,
        streams: Vec<Option<(TcpStream, SessionKey)>>,
        options: &Options,
    ) -> Result<Cluster, ClusterError> {
        let hosts = names.len();
        let mut peers = Vec::with_capacity(hosts);
        let mut readers = Vec::new();
        for (r, stream) in streams.into_iter().enumerate() {
            let Some((stream, key)) = stream else {
                peers.push(None);
                continue;
            };
            let what = format!("setting up the connection to host {r}");
            stream
                .set_read_timeout(None)
                .and_then(|()| stream.set_write_timeout(Some(options.host_timeout)))
                .map_err(io(what.clone()))?;
            let reader = stream.try_clone().map_err(io(what.clone()))?;
            let handle = stream.try_clone().map_err(io(what))?;
            let out = Direction::outgoing(rank);
            peers.push(Some(Peer {
                writer: Mutex::new(Sealer::new(stream, key.clone(), out)),
                handle,
                heard: AtomicU64::new(0),
            }));
            readers.push((r as u32, Opener::new(reader, key, out.reverse())));
        }
        let inner = Arc::new(Inner {
            rank,
            names,
            rendezvous,
            host_timeout: options.host_timeout,
            started: Instant::now(),
            peers,
            failure: Mutex::new(None),
            aborting: Mutex::new(()),
            failed: AtomicBool::new(false),
            ending: AtomicBool::new(false),
            finished: Mutex::new(None),
            mail: Mutex::new(HashMap::new()),
            gate: Mutex::new(GateState {
                arrivals: vec![None; hosts],
                decision: None,
            }),
            gate_changed: Condvar::new(),
            progress: AtomicU64::new(0),
            peer_progress: (0..hosts).map(|_| AtomicU64::new(0)).collect(),
            stop: Mutex::new(None),
        });
        for (r, stream) in readers {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name(format!("legend-host-{r}"))
                .spawn(move || inner.read_from(r, stream))
                .map_err(io("starting a connection's reader"))?;
        }
        let watched = inner.clone();
        std::thread::Builder::new()
            .name("legend-heartbeat".into())
            .spawn(move || watched.watch())
            .map_err(io("starting the heartbeat"))?;
        Ok(Cluster {
            _owner: Arc::new(Owner(inner.clone())),
            inner,
        })
    }

    /// This host's rank.
    pub fn rank(&self) -> u32 {
        self.inner.rank
    }

    /// Hosts in the job.
    pub fn hosts(&self) -> u32 {
        self.inner.names.len() as u32
    }

    /// Whether this host is host 0 (the rendezvous, the run directory, the decisions).
    pub fn is_leader(&self) -> bool {
        self.inner.rank == 0
    }

    /// `host R (name)`, for messages.
    pub fn host(&self, rank: u32) -> String {
        self.inner.host(rank)
    }

    /// The rendezvous address.
    pub fn rendezvous(&self) -> &str {
        &self.inner.rendezvous
    }

    /// The host timeout in force.
    pub fn host_timeout(&self) -> Duration {
        self.inner.host_timeout
    }

    /// Raised once the job has failed anywhere: what waits poll.
    pub fn failed_flag(&self) -> &AtomicBool {
        &self.inner.failed
    }

    /// Why the job failed, if it did.
    pub fn failure(&self) -> Option<ClusterError> {
        // Once the other hosts were told (a caller may end the process on the answer).
        let _told = lock(&self.inner.aborting);
        lock(&self.inner.failure).clone().map(ClusterError::Failed)
    }

    /// Fails the job on every host with `reason` (which should name this host: see
    /// [`Cluster::host`]); the first reason anywhere is the one every host reports.
    pub fn fail(&self, reason: String) {
        self.inner.fail(reason);
    }

    /// Host 0: ends the job, telling every host whether it `stopped` as asked (with a
    /// checkpoint) or completed. The other hosts: marks the end, so that host 0 closing its
    /// connection is no failure.
    pub fn finish(&self, stopped: bool) {
        let inner = &self.inner;
        inner.ending.store(true, Ordering::Release);
        // Waits here end too.
        lock(&inner.finished).get_or_insert(stopped);
        if inner.rank != 0 {
            return;
        }
        for (r, p) in inner.peers.iter().enumerate() {
            if let Some(p) = p {
                let mut w = lock(&p.writer);
                let finish = serde_json::to_vec(&Finish { stopped }).expect("serializes");
                if w.send(Kind::Finish, 0, r as u32, 0, &[&finish]).is_ok() {
                    let _ = w.get_ref().shutdown(Shutdown::Write);
                }
            }
        }
    }

    /// Sends `parts` (one message, back to back) to host `to` on `channel` (through host 0
    /// when neither end is host 0). A failure to send fails the job.
    pub fn send(&self, to: u32, channel: u32, parts: &[&[u8]]) -> Result<(), ClusterError> {
        let inner = &self.inner;
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let via = if inner.rank == 0 { to } else { 0 };
        let peer = inner.peers.get(via as usize).and_then(Option::as_ref);
        let Some(peer) = peer else {
            panic!("host {} has no connection to host {via}", inner.rank);
        };
        let mut w = lock(&peer.writer);
        w.send(Kind::Data, inner.rank, to, channel, parts)
            .map_err(|e| {
                drop(w);
                let reason = closed(&inner.host(via), &e);
                inner.fail(reason.clone());
                ClusterError::Failed(reason)
            })
    }

    /// The next message from host `from` on `channel`. Fails when the job fails, when host 0
    /// ends it, or (failing the job, naming `what` and the host) when nothing came by
    /// `deadline`.
    pub fn recv(
        &self,
        channel: u32,
        from: u32,
        deadline: Option<Instant>,
        what: &str,
    ) -> Result<Vec<u8>, ClusterError> {
        let inner = &self.inner;
        let rx = inner.mailbox(channel, from);
        let rx = lock(&rx);
        loop {
            match rx.recv_timeout(TICK) {
                Ok(m) => return Ok(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => unreachable!("the mailbox keeps a sender"),
            }
            if let Some(e) = self.failure() {
                return Err(e);
            }
            if let Some(stopped) = *lock(&inner.finished) {
                return Err(ClusterError::Finished { stopped });
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let reason = format!(
                    "{} did not send {what} in time: it is stuck or too slow",
                    inner.host(from)
                );
                inner.fail(reason.clone());
                return Err(ClusterError::Failed(reason));
            }
        }
    }

    /// The gate `seq` (`what`, e.g. "round 3 of epoch 2"): every host arrives, saying whether
    /// it wants to `stop` there; host 0 decides for all (go on unless anyone wants to stop) once
    /// every host has arrived. A host that does not arrive within `deadline` of host 0's own
    /// arrival fails the job, named; the others give host 0 `deadline` plus the host timeout.
    /// Returns whether to go on.
    pub fn agree(
        &self,
        seq: u64,
        stop: bool,
        deadline: Duration,
        what: &str,
    ) -> Result<bool, ClusterError> {
        let inner = &self.inner;
        let started = Instant::now();
        if inner.rank != 0 {
            let stop = stop || inner.stop_wanted();
            let bytes = serde_json::to_vec(&Arrive { seq, stop }).expect("serializes");
            inner.write_control(0, Kind::Arrive, &bytes)?;
            let mut g = lock(&inner.gate);
            loop {
                if let Some((s, go)) = g.decision
                    && s == seq
                {
                    return Ok(go);
                }
                if let Some(e) = self.failure() {
                    return Err(e);
                }
                if started.elapsed() > deadline + inner.host_timeout {
                    drop(g);
                    let reason = format!(
                        "{} did not open {what} within {:.1} s",
                        inner.host(0),
                        (deadline + inner.host_timeout).as_secs_f64()
                    );
                    inner.fail(reason.clone());
                    return Err(ClusterError::Failed(reason));
                }
                g = inner
                    .gate_changed
                    .wait_timeout(g, TICK)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
        }
        let mut g = lock(&inner.gate);
        let wanted = loop {
            let missing: Vec<u32> = (1..self.hosts())
                .filter(|&r| g.arrivals[r as usize].is_none_or(|(s, _)| s != seq))
                .collect();
            if missing.is_empty() {
                break (1..self.hosts() as usize).any(|r| g.arrivals[r].is_some_and(|a| a.1));
            }
            if let Some(e) = self.failure() {
                return Err(e);
            }
            if started.elapsed() > deadline {
                drop(g);
                let reason = format!(
                    "{} did not reach {what} within {:.1} s of host 0",
                    list_hosts(&missing),
                    deadline.as_secs_f64()
                );
                inner.fail(reason.clone());
                return Err(ClusterError::Failed(reason));
            }
            g = inner
                .gate_changed
                .wait_timeout(g, TICK)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        };
        drop(g);
        if wanted && let Some(flag) = lock(&inner.stop).as_ref() {
            // Another host was asked to stop: so is the job.
            flag.store(true, Ordering::Relaxed);
        }
        let go = !stop && !wanted;
        let bytes = serde_json::to_vec(&Decide { seq, go }).expect("serializes");
        for r in 1..self.hosts() {
            inner.write_control(r, Kind::Decide, &bytes)?;
        }
        Ok(go)
    }

    /// What this host has trained in the current epoch, for host 0's progress (sent with
    /// the heartbeats).
    pub fn set_progress(&self, edges: u64) {
        self.inner.progress.store(edges, Ordering::Relaxed);
    }

    /// Host 0: the other hosts' progress, summed, as their last heartbeats said.
    pub fn others_progress(&self) -> u64 {
        self.inner
            .peer_progress
            .iter()
            .map(|p| p.load(Ordering::Relaxed))
            .sum()
    }

    /// The flag a signal raises on this host: the other hosts send it with their heartbeats
    /// and gates; host 0 raises its own when another host's is raised, so that a stop asked on
    /// any host stops the job (with a checkpoint).
    pub fn watch_stop(&self, flag: Arc<AtomicBool>) {
        *lock(&self.inner.stop) = Some(flag);
    }
}

impl Inner {
    fn host(&self, rank: u32) -> String {
        match self.names.get(rank as usize) {
            Some(name) => format!("host {rank} ({name})"),
            None => format!("host {rank}"),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn stop_wanted(&self) -> bool {
        lock(&self.stop)
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    fn mailbox(&self, channel: u32, from: u32) -> Arc<Mutex<Receiver<Vec<u8>>>> {
        let mut mail = lock(&self.mail);
        mail.entry((channel, from))
            .or_insert_with(|| {
                let (tx, rx) = mpsc::channel();
                Mailbox {
                    tx,
                    rx: Arc::new(Mutex::new(rx)),
                }
            })
            .rx
            .clone()
    }

    fn deliver(&self, channel: u32, from: u32, payload: Vec<u8>) {
        let mut mail = lock(&self.mail);
        let tx = &mail
            .entry((channel, from))
            .or_insert_with(|| {
                let (tx, rx) = mpsc::channel();
                Mailbox {
                    tx,
                    rx: Arc::new(Mutex::new(rx)),
                }
            })
            .tx;
        let _ = tx.send(payload);
    }

    /// Writes a control message to `to` (through host 0 for the others: only host 0 talks to
    /// every host), failing the job when the connection is gone.
    fn write_control(&self, to: u32, kind: Kind, payload: &[u8]) -> Result<(), ClusterError> {
        let peer = self.peers[to as usize]
            .as_ref()
            .expect("control messages go between host 0 and another host");
        let mut w = lock(&peer.writer);
        w.send(kind, self.rank, to, 0, &[payload]).map_err(|e| {
            drop(w);
            let reason = closed(&self.host(to), &e);
            self.fail(reason.clone());
            ClusterError::Failed(reason)
        })
    }

    fn fail(&self, reason: String) {
        // Held while the abort goes out: a second failure (this process ending on the first,
        // a send that failed meanwhile) waits for it, and waits see the flag only once it is
        // out, so that no host learns of a failure only from a closed connection.
        let _aborting = lock(&self.aborting);
        {
            let mut f = lock(&self.failure);
            if f.is_some() {
                return;
            }
            *f = Some(reason.clone());
        }
        let abort = serde_json::to_vec(&Abort { reason }).expect("serializes");
        let deadline = Instant::now() + ABORT_WAIT;
        for (r, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            // A writer busy with a message to a live host ends soon; one blocked on a stopped
            // host would hold the lock for ever: past the deadline that connection is cut
            // instead (the peer then sees it close).
            let writer = loop {
                match p.writer.try_lock() {
                    Ok(w) => break Some(w),
                    Err(_) if Instant::now() < deadline => std::thread::sleep(TICK),
                    Err(_) => break None,
                }
            };
            match writer {
                Some(mut w) => {
                    let _ = w.send(Kind::Abort, self.rank, r as u32, 0, &[&abort]);
                    let _ = w.get_ref().shutdown(Shutdown::Write);
                }
                None => {
                    let _ = p.handle.shutdown(Shutdown::Both);
                }
            }
        }
        self.failed.store(true, Ordering::Release);
        self.gate_changed.notify_all();
    }

    /// Reads host `from`'s frames until its connection ends. A frame that is not authentic,
    /// out of sequence or cut short fails the job, naming the host: nothing of it is acted on.
    fn read_from(&self, from: u32, mut frames: Opener<TcpStream>) {
        let peer = self.peers[from as usize].as_ref().expect("a peer");
        let touch = || peer.heard.store(self.now_ms(), Ordering::Relaxed);
        loop {
            let (head, payload) = match frames.next_frame(DATA_MAX, &touch) {
                Ok(f) => f,
                Err(FrameError::Closed(e)) => {
                    if !self.ending.load(Ordering::Acquire) {
                        self.fail(closed(&self.host(from), &e));
                    }
                    return;
                }
                // The job is over: a connection cut then is no failure.
                Err(FrameError::Truncated { .. }) if self.ending.load(Ordering::Acquire) => {
                    return;
                }
                Err(e) => {
                    self.fail(format!(
                        "{}: {e}; the job stops rather than act on it",
                        self.host(from)
                    ));
                    return;
                }
            };
            if let Err(e) = self.handle(from, head, payload) {
                self.fail(format!("{} sent a bad message: {e}", self.host(from)));
                return;
            }
        }
    }

    fn handle(&self, from: u32, head: wire::Header, payload: Vec<u8>) -> std::io::Result<()> {
        match head.kind {
            Kind::Heartbeat => {
                let beat: Heartbeat = decode(&payload)?;
                self.peer_progress[from as usize].store(beat.progress, Ordering::Relaxed);
                if beat.stop
                    && self.rank == 0
                    && let Some(flag) = lock(&self.stop).as_ref()
                    && !flag.swap(true, Ordering::Relaxed)
                {
                    tracing::info!(
                        "{} was asked to stop: the job stops at its next round, with a checkpoint",
                        self.host(from)
                    );
                }
            }
            Kind::Arrive if self.rank == 0 => {
                let a: Arrive = decode(&payload)?;
                lock(&self.gate).arrivals[from as usize] = Some((a.seq, a.stop));
                self.gate_changed.notify_all();
            }
            Kind::Decide if self.rank != 0 => {
                let d: Decide = decode(&payload)?;
                lock(&self.gate).decision = Some((d.seq, d.go));
                self.gate_changed.notify_all();
            }
            Kind::Abort => {
                let a: Abort = decode(&payload)?;
                self.fail(a.reason);
            }
            Kind::Finish if self.rank != 0 => {
                let f: Finish = decode(&payload)?;
                self.ending.store(true, Ordering::Release);
                *lock(&self.finished) = Some(f.stopped);
            }
            Kind::Data if head.to == self.rank => self.deliver(head.channel, head.from, payload),
            // Host 0 passes data between two other hosts on.
            Kind::Data
                if self.rank == 0 && head.to != 0 && (head.to as usize) < self.names.len() =>
            {
                let peer = self.peers[head.to as usize].as_ref().expect("a peer");
                let mut w = lock(&peer.writer);
                if let Err(e) = w.send(Kind::Data, head.from, head.to, head.channel, &[&payload]) {
                    drop(w);
                    self.fail(closed(&self.host(head.to), &e));
                }
            }
            other => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("an unexpected {other:?} frame"),
                ));
            }
        }
        Ok(())
    }

    /// Heartbeats out, silence in: a peer silent for the host timeout fails the job.
    fn watch(&self) {
        let mut beat_at = Instant::now();
        let timeout_ms = self.host_timeout.as_millis() as u64;
        loop {
            if self.failed.load(Ordering::Acquire) || self.ending.load(Ordering::Acquire) {
                return;
            }
            let now = self.now_ms();
            for (r, p) in self.peers.iter().enumerate() {
                let Some(p) = p else { continue };
                let heard = p.heard.load(Ordering::Relaxed);
                if now.saturating_sub(heard) > timeout_ms {
                    self.fail(format!(
                        "{} sent nothing for {} s: it was stopped, hangs, died or lost its network",
                        self.host(r as u32),
                        self.host_timeout.as_secs()
                    ));
                    return;
                }
            }
            if beat_at.elapsed() >= HEARTBEAT {
                beat_at = Instant::now();
                let beat = serde_json::to_vec(&Heartbeat {
                    progress: self.progress.load(Ordering::Relaxed),
                    stop: self.rank != 0 && self.stop_wanted(),
                })
                .expect("serializes");
                for (r, p) in self.peers.iter().enumerate() {
                    let Some(p) = p else { continue };
                    // A writer busy with a large message keeps the peer hearing from us.
                    if let Ok(mut w) = p.writer.try_lock()
                        && let Err(e) = w.send(Kind::Heartbeat, self.rank, r as u32, 0, &[&beat])
                    {
                        drop(w);
                        if !self.ending.load(Ordering::Acquire) {
                            self.fail(closed(&self.host(r as u32), &e));
                        }
                        return;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Why the job fails when the connection to `host` ended, in the same words whichever end
/// noticed first: a read that found it closed, or a write that found the pipe broken (both
/// race when a host dies).
fn closed(host: &str, e: &std::io::Error) -> String {
    format!("{host} closed its connection ({e}): its process ended or its network failed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::LaunchSource;

    const TOKEN: &str = "0123456789abcdef-test";

    fn options(name: &str, timeout: Duration, host_timeout: Duration) -> Options {
        Options {
            token: Token::new(TOKEN).unwrap(),
            timeout,
            host_timeout,
            name: name.into(),
        }
    }

    fn launch(hosts: u32, rank: u32, port: u16) -> Launch {
        Launch {
            hosts,
            rank,
            rendezvous: format!("127.0.0.1:{port}"),
            source: LaunchSource::CommandLine,
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn identity(dim: &str) -> Identity {
        [("config model.dim".to_string(), dim.to_string())]
            .into_iter()
            .collect()
    }

    const LONG: Duration = Duration::from_secs(30);

    /// A host's end of the rendezvous.
    type Joined = Result<Cluster, ClusterError>;

    /// Three hosts of the same identity, joined: host 0, then hosts 1 and 2.
    fn three_joined() -> (Cluster, Vec<Cluster>) {
        let (leader, others) = start(3, &["8", "8", "8"]);
        let others = others
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        (leader.unwrap(), others)
    }

    /// Hosts 1 .. H−1 joining in threads with `identity(dims[r])`, host 0 in this thread.
    fn start(hosts: u32, dims: &[&str]) -> (Joined, Vec<std::thread::JoinHandle<Joined>>) {
        let port = free_port();
        let others: Vec<_> = (1..hosts)
            .map(|r| {
                let dim = dims[r as usize].to_string();
                std::thread::spawn(move || {
                    join(
                        &launch(hosts, r, port),
                        &identity(&dim),
                        &options(&format!("n{r}"), LONG, LONG),
                    )
                })
            })
            .collect();
        let leader = join(
            &launch(hosts, 0, port),
            &identity(dims[0]),
            &options("n0", LONG, LONG),
        );
        (leader, others)
    }

    #[test]
    fn hosts_meet_pass_data_between_any_two_agree_and_finish() {
        let (leader, others) = three_joined();
        assert_eq!(leader.host(2), "host 2 (n2)");
        assert_eq!(others[1].host(0), "host 0 (n0)");
        // Host 1 to host 2, through host 0; host 0 to host 1.
        others[0].send(2, 5, &[b"to ", b"two"]).unwrap();
        leader.send(1, 5, &[b"to one"]).unwrap();
        assert_eq!(others[1].recv(5, 1, None, "data").unwrap(), b"to two");
        assert_eq!(others[0].recv(5, 0, None, "data").unwrap(), b"to one");
        // A gate everyone passes, then one where host 2 wants to stop: no host goes on.
        let gate = |seq: u64, stops: [bool; 3]| {
            let hs: Vec<_> = others
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let c = c.clone();
                    std::thread::spawn(move || c.agree(seq, stops[i + 1], LONG, "a round").unwrap())
                })
                .collect();
            let mut all = vec![leader.agree(seq, stops[0], LONG, "a round").unwrap()];
            all.extend(hs.into_iter().map(|h| h.join().unwrap()));
            all
        };
        assert_eq!(gate(1, [false; 3]), [true; 3]);
        assert_eq!(gate(2, [false, false, true]), [false; 3]);
        leader.finish(true);
        for c in &others {
            match c.recv(5, 0, None, "data") {
                Err(ClusterError::Finished { stopped: true }) => {}
                other => panic!("{:?}", other.map(|_| ())),
            }
            c.finish(true);
        }
        assert!(leader.failure().is_none());
        drop(others);
        drop(leader);
    }

    #[test]
    fn a_host_of_another_configuration_is_refused_naming_it_and_the_key() {
        let (leader, others) = start(2, &["100", "64"]);
        let e = leader.err().unwrap().to_string();
        assert!(
            e.contains("host 1 (n1)")
                && e.contains("config model.dim is 64 there and 100 on host 0"),
            "{e}"
        );
        let f = others
            .into_iter()
            .next()
            .unwrap()
            .join()
            .unwrap()
            .err()
            .unwrap()
            .to_string();
        assert_eq!(f, e, "every host reports the same");
    }

    #[test]
    fn missing_hosts_and_an_absent_host_zero_fail_within_the_timeout_naming_the_rendezvous() {
        let port = free_port();
        let short = Duration::from_millis(800);
        let one = std::thread::spawn(move || {
            join(
                &launch(3, 1, port),
                &identity("8"),
                &options("n1", short, LONG),
            )
        });
        let started = Instant::now();
        let e = join(
            &launch(3, 0, port),
            &identity("8"),
            &options("n0", short, LONG),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(started.elapsed() < short + Duration::from_secs(5));
        assert!(
            e.contains(&format!("rendezvous at 127.0.0.1:{port}"))
                && e.contains("host 2 did not arrive"),
            "{e}"
        );
        assert_eq!(one.join().unwrap().err().unwrap().to_string(), e);
        // Nobody at the rendezvous.
        let started = Instant::now();
        let e = join(
            &launch(2, 1, free_port()),
            &identity("8"),
            &options("n1", short, LONG),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(started.elapsed() < short + Duration::from_secs(5));
        assert!(
            e.contains("rendezvous at 127.0.0.1:") && e.contains("host 0 was not there"),
            "{e}"
        );
    }

    /// Host 0 of a job of two at `port`, joining in a thread, waiting `timeout` for host 1.
    fn leader_in_thread(port: u16, timeout: Duration) -> std::thread::JoinHandle<Joined> {
        std::thread::spawn(move || {
            join(
                &launch(2, 0, port),
                &identity("8"),
                &options("n0", timeout, LONG),
            )
        })
    }

    /// A connection to the rendezvous at `port` (host 0 may not listen yet).
    fn connect(port: u16) -> TcpStream {
        loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    #[test]
    fn a_wrong_token_is_refused_and_the_job_waits_for_the_real_host() {
        let port = free_port();
        let leader = leader_in_thread(port, LONG);
        let mut wrong = options("intruder", LONG, LONG);
        wrong.token = Token::new("another-token-of-16").unwrap();
        let e = join(&launch(2, 1, port), &identity("8"), &wrong)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("does not hold this job's token") && e.contains(crate::TOKEN_VAR),
            "{e}"
        );
        let host = join(
            &launch(2, 1, port),
            &identity("8"),
            &options("n1", LONG, LONG),
        )
        .unwrap();
        let leader = leader.join().unwrap().unwrap();
        assert_eq!(leader.host(1), "host 1 (n1)");
        leader.finish(false);
        host.finish(false);
    }

    #[test]
    fn an_unspecified_address_is_not_a_rendezvous() {
        let mut l = launch(2, 0, free_port());
        l.rendezvous = l.rendezvous.replace("127.0.0.1", "0.0.0.0");
        let e = join(&l, &identity("8"), &options("n0", LONG, LONG))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("listens on that address only"), "{e}");
    }

    /// A host that completes the rendezvous by hand and then behaves as told: its
    /// connection, and the session key host 0 derived for it.
    fn raw_host(port: u16) -> (TcpStream, SessionKey) {
        let mut s = connect(port);
        let head = read_header(&mut s).unwrap();
        let ch: Challenge =
            decode(&read_payload(&mut s, head.len, HANDSHAKE_MAX).unwrap()).unwrap();
        let server = unhex(&ch.nonce).unwrap();
        let client = [7u8; 32];
        let token = Token::new(TOKEN).unwrap();
        let mut hello = Hello {
            version: VERSION,
            rank: 1,
            hosts: 2,
            name: "raw".into(),
            nonce: hex(&client),
            mac: String::new(),
            identity: identity("8"),
        };
        hello.mac = hex(&token.mac(&hello_signed(&server, &client, &hello).as_parts()));
        write_json(&mut s, Kind::Hello, 1, 0, &hello).unwrap();
        let head = read_header(&mut s).unwrap();
        assert_eq!(head.kind, Kind::Welcome);
        read_payload(&mut s, head.len, HANDSHAKE_MAX).unwrap();
        (s, token.session_key(&server, &client, 1))
    }

    /// `frames` as host 1 seals them under `key` from the connection's start, each frame's
    /// bytes apart.
    fn sealed_by(key: &SessionKey, frames: &[(Kind, &[u8])]) -> Vec<Vec<u8>> {
        let mut sealer = Sealer::new(Vec::new(), key.clone(), Direction::ToHostZero);
        let mut at = 0;
        frames
            .iter()
            .map(|(kind, payload)| {
                sealer.send(*kind, 1, 0, 3, &[payload]).unwrap();
                let frame = sealer.get_ref()[at..].to_vec();
                at = sealer.get_ref().len();
                frame
            })
            .collect()
    }

    /// Host 0 of a job of two whose host 1 is a raw host: host 0, host 1's connection and key.
    fn with_raw_host() -> (Cluster, TcpStream, SessionKey) {
        let port = free_port();
        let raw = std::thread::spawn(move || raw_host(port));
        let leader = join(
            &launch(2, 0, port),
            &identity("8"),
            &options("n0", LONG, LONG),
        )
        .unwrap();
        let (stream, key) = raw.join().unwrap();
        (leader, stream, key)
    }

    /// Why host 0 failed after host 1 wrote what `write` makes of its session key (and
    /// closed its connection if `close`), once the `delivered` messages before the bad frame
    /// came through on channel 3.
    fn refused(write: impl Fn(&SessionKey) -> Vec<u8>, close: bool, delivered: usize) -> String {
        use std::io::Write;
        let (leader, mut stream, key) = with_raw_host();
        stream.write_all(&write(&key)).unwrap();
        if close {
            stream.shutdown(Shutdown::Write).unwrap();
        }
        for _ in 0..delivered {
            assert!(leader.recv(3, 1, None, "data").is_ok());
        }
        let e = leader.recv(3, 1, None, "data").err().unwrap().to_string();
        assert!(leader.failed_flag().load(Ordering::Acquire));
        e
    }

    #[test]
    fn a_host_of_the_previous_protocol_is_told_to_run_the_same_legend() {
        let port = free_port();
        let leader = leader_in_thread(port, Duration::from_secs(2));
        let mut s = connect(port);
        let head = read_header(&mut s).unwrap();
        read_payload(&mut s, head.len, HANDSHAKE_MAX).unwrap();
        // Version 1's handshake frames have the same layout.
        let hello = Hello {
            version: 1,
            rank: 1,
            hosts: 2,
            name: "old".into(),
            nonce: hex(&[7; 32]),
            mac: String::new(),
            identity: identity("8"),
        };
        write_json(&mut s, Kind::Hello, 1, 0, &hello).unwrap();
        let head = read_header(&mut s).unwrap();
        assert_eq!(head.kind, Kind::Refused);
        let r: Refused = decode(&read_payload(&mut s, head.len, HANDSHAKE_MAX).unwrap()).unwrap();
        assert_eq!(
            r.reason,
            "host 1 speaks rendezvous version 1, host 0 version 2: run the same Legend on every host"
        );
        assert!(leader.join().unwrap().is_err());
    }

    #[test]
    fn a_tampered_replayed_foreign_or_cut_frame_fails_the_job_naming_the_host() {
        let two =
            |key: &SessionKey| sealed_by(key, &[(Kind::Data, b"rows"), (Kind::Data, b"more")]);
        let then = "; the job stops rather than act on it";
        // Tampered: a bit of the second frame's payload.
        let e = refused(
            |key| {
                let mut f = two(key);
                let at = f[1].len() - 33;
                f[1][at] ^= 4;
                f.concat()
            },
            false,
            1,
        );
        assert_eq!(
            e,
            format!(
                "host 1 (raw): frame 1 on its connection fails authentication (its payload's MAC does not match): tampered with, injected, or sealed under another connection's session key{then}"
            )
        );
        // Replayed: the first frame again.
        let e = refused(
            |key| [two(key)[0].clone(), two(key)[0].clone()].concat(),
            false,
            1,
        );
        assert_eq!(
            e,
            format!(
                "host 1 (raw): frame 0 of its connection arrived where frame 1 was due: replayed or reordered{then}"
            )
        );
        // Sealed under the session key of another connection (another job, the same token).
        let (_other_job, _, other_key) = with_raw_host();
        let e = refused(|_| two(&other_key).concat(), false, 0);
        assert!(
            e.starts_with(
                "host 1 (raw): frame 0 on its connection fails authentication (its header's MAC does not match)"
            ),
            "{e}"
        );
        // Cut short: the first frame but its last 10 bytes, then the connection closes.
        let e = refused(
            |key| {
                let f = &two(key)[0];
                f[..f.len() - 10].to_vec()
            },
            true,
            0,
        );
        assert!(
            e.starts_with(
                "host 1 (raw): its connection ended inside a frame, after 98 of its 108 bytes"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_silent_host_or_a_closed_connection_fails_the_job_naming_the_host() {
        // Silent: admitted, then nothing (a stopped process keeps its socket open).
        let port = free_port();
        let raw = std::thread::spawn(move || raw_host(port));
        let started = Instant::now();
        let leader = join(
            &launch(2, 0, port),
            &identity("8"),
            &options("n0", LONG, Duration::from_millis(700)),
        )
        .unwrap();
        let (_silent, _) = raw.join().unwrap();
        let e = leader.recv(1, 1, None, "data").err().unwrap().to_string();
        assert!(e.contains("host 1 (raw) sent nothing for"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(leader.failed_flag().load(Ordering::Acquire));
        // Closed: the process died.
        let (leader, stream, _) = with_raw_host();
        drop(stream);
        let e = leader.recv(1, 1, None, "data").err().unwrap().to_string();
        assert!(e.contains("host 1 (raw) closed its connection"), "{e}");
    }

    #[test]
    fn a_failure_anywhere_reaches_every_host_with_its_reason() {
        let (leader, others) = three_joined();
        others[0].fail("host 1 (n1) failed: worker 0 diverged".into());
        for c in [&leader, &others[1]] {
            let e = c.recv(9, 0, None, "data").err().unwrap().to_string();
            assert_eq!(e, "host 1 (n1) failed: worker 0 diverged");
        }
        // A host that ends without finishing is named too.
        let (leader, others) = start(2, &["8", "8"]);
        let leader = leader.unwrap();
        drop(others.into_iter().next().unwrap().join().unwrap().unwrap());
        let e = leader.recv(9, 1, None, "data").err().unwrap().to_string();
        assert!(e.contains("host 1 (n1) ended without finishing"), "{e}");
    }

    #[test]
    fn a_host_that_does_not_reach_a_gate_in_time_is_named_and_stops_every_host() {
        let (leader, others) = three_joined();
        // Host 1 arrives; host 2 is alive but never does.
        let one = others[0].clone();
        let waiting =
            std::thread::spawn(move || one.agree(4, false, Duration::from_millis(500), "round 4"));
        let started = Instant::now();
        let e = leader
            .agree(4, false, Duration::from_millis(500), "round 4 of epoch 1")
            .err()
            .unwrap()
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(
            e,
            "host 2 did not reach round 4 of epoch 1 within 0.5 s of host 0"
        );
        assert_eq!(waiting.join().unwrap().err().unwrap().to_string(), e);
        assert_eq!(
            others[1].recv(1, 0, None, "x").err().unwrap().to_string(),
            e
        );
    }

    #[test]
    fn a_stop_asked_on_any_host_reaches_host_zero() {
        let (leader, others) = start(2, &["8", "8"]);
        let leader = leader.unwrap();
        let other = others.into_iter().next().unwrap().join().unwrap().unwrap();
        let (here, there) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        leader.watch_stop(here.clone());
        other.watch_stop(there.clone());
        there.store(true, Ordering::Relaxed);
        let started = Instant::now();
        while !here.load(Ordering::Relaxed) {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the stop never arrived"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        other.set_progress(42);
        leader.finish(true);
        other.finish(true);
    }
}
