//! The Unix socket: connections admitted by their peer's `SO_PEERCRED` credentials (at most
//! `max_connections`, `max_connections_per_uid` a user, a reserve for the admin group), one
//! thread each, answering framed requests. A client that does not send a whole request within
//! `request_timeout_s`, sends a frame over the limit or breaks the framing is disconnected;
//! a malformed request inside a good frame gets an error reply. Every request reserves the
//! memory it may take from the daemon's budget (`request_memory_mib`) before its body is read,
//! and is parsed into bounded, typed structures. Nothing a client does can make the daemon wait
//! on it: watches read events from a bounded queue the job fills without blocking, and writes
//! to a client time out.

mod answer;
mod devices;
pub mod http;
mod submit;
mod watch;

use std::collections::HashMap;
use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use legend_daemon_api::{
    Envelope, ErrorCode, FrameError, MAX_FRAME, PROTOCOL_VERSION, Reply, Request, read_frame_body,
    read_frame_len, write_message,
};

use crate::access::Peer;
use crate::budget::Budget;
use crate::config::DaemonConfig;
use crate::jobs::{JobError, Jobs};

/// Binds the socket at `path`, replacing a stale one; another daemon listening there is an
/// error. Anyone may connect: requests are authorised by the caller's credentials.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if answers(path) {
        bail!("{}: another legendd is listening there", path.display());
    }
    if path.exists() {
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("listening on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .with_context(|| format!("opening {} to clients", path.display()))?;
    Ok(listener)
}

/// Whether a daemon answers `hello` on `path` within a second. A socket that accepts
/// connections but never answers is not a daemon's: a killed daemon's listening socket lives on
/// in a job's process caught between fork and exec until that process dies.
fn answers(path: &Path) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    let second = Some(Duration::from_secs(1));
    if s.set_read_timeout(second).is_err() || s.set_write_timeout(second).is_err() {
        return false;
    }
    let hello = Envelope {
        v: PROTOCOL_VERSION,
        request: Request::Hello,
    };
    write_message(&mut s, &hello).is_ok()
        && matches!(
            legend_daemon_api::read_message::<Reply>(&mut s, MAX_FRAME),
            Ok(Some(Reply::Hello { .. }))
        )
}

/// Connections open now, in all and by uid.
#[derive(Default)]
struct Open {
    total: usize,
    by_uid: HashMap<u32, usize>,
}

/// Who gets a connection: at most `max_connections` at once, of which the last
/// `reserved_connections` only for the admin group (root, the admin group, the daemon's own
/// user always get in), and at most `max_connections_per_uid` for anyone else. Counted after
/// `SO_PEERCRED`, before the connection has a thread: a user holding connections open cannot
/// take the others' nor the administrator's.
struct Admission {
    open: Mutex<Open>,
    max: usize,
    reserved: usize,
    per_uid: usize,
}

/// A connection's place, given back when it closes.
struct Slot {
    admission: Arc<Admission>,
    uid: u32,
}

impl Admission {
    fn new(config: &DaemonConfig) -> Admission {
        Admission {
            open: Mutex::default(),
            max: config.max_connections,
            reserved: config.reserved_connections,
            per_uid: config.max_connections_per_uid,
        }
    }

    /// A place for `peer`'s connection, or why there is none (naming the setting).
    fn admit(self: &Arc<Self>, peer: &Peer) -> Result<Slot, String> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.total >= self.max {
            return Err(format!(
                "too many connections ({} open, max_connections = {}); try again",
                open.total, self.max
            ));
        }
        if !peer.admin {
            let mine = open.by_uid.get(&peer.uid).copied().unwrap_or(0);
            if mine >= self.per_uid {
                return Err(format!(
                    "uid {} has {mine} connections open (max_connections_per_uid = {}); close \
                     one and try again",
                    peer.uid, self.per_uid
                ));
            }
            let for_users = self.max.saturating_sub(self.reserved);
            if open.total >= for_users {
                return Err(format!(
                    "too many connections ({} open; max_connections = {}, of which \
                     reserved_connections = {} are kept for the admin group); try again",
                    open.total, self.max, self.reserved
                ));
            }
        }
        open.total += 1;
        *open.by_uid.entry(peer.uid).or_default() += 1;
        Ok(Slot {
            admission: self.clone(),
            uid: peer.uid,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self
            .admission
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        open.total -= 1;
        if let Some(n) = open.by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                open.by_uid.remove(&self.uid);
            }
        }
    }
}

/// Waits until `listener` has a connection or `wake` a byte (a signal arrived); never spins.
fn wait_for_either(listener: &UnixListener, wake: &UnixStream) -> std::io::Result<bool> {
    let mut fds = [
        libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(fds[0].revents != 0)
}

/// Serves `listener` until `shutdown` is set; `wake` gets a byte when it is (the signal
/// handlers write one), so the loop blocks instead of polling.
pub fn serve(
    listener: UnixListener,
    config: &DaemonConfig,
    jobs: Arc<Jobs>,
    shutdown: &AtomicBool,
    wake: &UnixStream,
) {
    listener
        .set_nonblocking(true)
        .expect("a listening socket can be made non-blocking");
    let admission = Arc::new(Admission::new(config));
    let budget = Budget::new(config.request_memory_mib);
    let timeout = Duration::from_secs(config.request_timeout_s);
    while !shutdown.load(Ordering::Relaxed) {
        match wait_for_either(&listener, wake) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::error!("waiting for connections: {e}");
                return;
            }
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // Out of descriptors, say: the connection waits in the backlog meanwhile.
                tracing::warn!("accepting a connection: {e}");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(timeout));
        let peer = match Peer::of(&stream, &config.admin_group) {
            Ok(peer) => peer,
            Err(e) => {
                tracing::debug!("no credentials for a connection: {e}");
                continue;
            }
        };
        let slot = match admission.admit(&peer) {
            Ok(slot) => slot,
            Err(why) => {
                // A short reply fits the socket's buffer: this never waits on the client.
                let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                let mut s = stream;
                let _ = write_message(&mut s, &error(ErrorCode::Unavailable, why));
                continue;
            }
        };
        let client = Client {
            peer,
            jobs: jobs.clone(),
            budget: budget.clone(),
            timeout,
        };
        let spawned = std::thread::Builder::new()
            .name("client".into())
            // Small: a request is parsed into bounded structures (JSON and TOML nesting bounded
            // by their parsers, 128 and 80 levels).
            .stack_size(512 << 10)
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = client.serve(stream) {
                    tracing::debug!(error = &e as &dyn std::error::Error, "client");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no thread for a client: {e}");
        }
    }
}

/// Reads a client's request against a deadline for the whole of it, not for each read: a
/// client trickling a byte at a time is cut off like a silent one.
struct Deadline<'a, S> {
    stream: &'a S,
    at: Instant,
}

/// A stream whose reads can time out.
trait TimedRead {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
}

impl TimedRead for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
}

impl TimedRead for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
}

impl<'a, S: TimedRead> Read for Deadline<'a, S>
where
    &'a S: Read,
{
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::Error {
        code,
        message: message.into(),
    }
}

fn job_error(e: JobError) -> Reply {
    match e {
        JobError::NotFound(id) => error(ErrorCode::NotFound, format!("no job {id}")),
        JobError::Refused(why) => error(ErrorCode::Refused, why),
    }
}

/// Writes a message already serialised (an event, a serve job's answer) as a frame.
pub fn write_frame(w: &mut UnixStream, bytes: &[u8]) -> Result<(), FrameError> {
    use std::io::Write;
    w.write_all(&(bytes.len() as u32).to_be_bytes())?;
    w.write_all(bytes)?;
    Ok(w.flush()?)
}

/// Reads past `len` bytes of a frame, 64 KiB at a time.
fn skip(r: &mut impl Read, len: usize) -> Result<(), FrameError> {
    let mut scratch = [0u8; 64 << 10];
    let mut left = len;
    while left > 0 {
        let n = scratch.len().min(left);
        r.read_exact(&mut scratch[..n])
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
                _ => FrameError::Io(e),
            })?;
        left -= n;
    }
    Ok(())
}

/// A connected client, served on its own thread.
struct Client {
    peer: Peer,
    jobs: Arc<Jobs>,
    budget: Arc<Budget>,
    timeout: Duration,
}

impl Client {
    fn serve(&self, stream: UnixStream) -> Result<(), FrameError> {
        let reader = stream.try_clone()?;
        let mut writer = stream;
        loop {
            let mut deadline = Deadline {
                stream: &reader,
                at: Instant::now() + self.timeout,
            };
            let len = match read_frame_len(&mut deadline, MAX_FRAME) {
                Ok(Some(len)) => len,
                Ok(None) => return Ok(()),
                Err(e) => return self.broken(&mut writer, e),
            };
            // The frame, and what it parses into (at most about as much again), before the
            // body is read.
            let held = match self.budget.reserve(&self.peer, 2 * len) {
                Ok(held) => held,
                Err(why) => {
                    // Read past, a piece at a time, never held: the connection stays framed.
                    if let Err(e) = skip(&mut deadline, len) {
                        return self.broken(&mut writer, e);
                    }
                    write_message(&mut writer, &error(ErrorCode::Unavailable, why))?;
                    continue;
                }
            };
            let bytes = match read_frame_body(&mut deadline, len) {
                Ok(bytes) => bytes,
                Err(e) => return self.broken(&mut writer, e),
            };
            self.jobs.requests.fetch_add(1, Ordering::Relaxed);
            let envelope: Envelope = match serde_json::from_slice(&bytes) {
                Ok(e) => e,
                Err(e) => {
                    let why = format!(
                        "malformed request: {}",
                        crate::paths::clipped(&e.to_string(), 512)
                    );
                    write_message(&mut writer, &error(ErrorCode::BadRequest, why))?;
                    continue;
                }
            };
            drop(bytes);
            if envelope.v != PROTOCOL_VERSION {
                let why = format!(
                    "protocol version {}; this daemon speaks {PROTOCOL_VERSION}",
                    envelope.v
                );
                write_message(&mut writer, &error(ErrorCode::BadRequest, why))?;
                continue;
            }
            match envelope.request {
                Request::Watch { job } => {
                    drop(held);
                    watch::watch(&mut writer, &self.peer, &self.jobs, job)?;
                }
                request => {
                    let reply = self.answer(request, held);
                    reply.write(&mut writer)?;
                }
            }
        }
    }

    /// Answers a connection whose framing broke (a frame over the limit, a request not sent in
    /// time) and ends it.
    fn broken(&self, writer: &mut UnixStream, e: FrameError) -> Result<(), FrameError> {
        match e {
            FrameError::TooLarge { .. } => {
                // The rest of the stream cannot be trusted to be framed: answer and close.
                write_message(writer, &error(ErrorCode::BadRequest, e.to_string()))?;
                Err(e)
            }
            FrameError::Io(io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                ) =>
            {
                let why = format!(
                    "no complete request within {} s (request_timeout_s): disconnected",
                    self.timeout.as_secs()
                );
                write_message(writer, &error(ErrorCode::BadRequest, why))?;
                Err(FrameError::Io(io))
            }
            e => Err(e),
        }
    }
}
