//! What the daemon's tests share: a daemon process on a temporary socket and state directory,
//! clients (also as other uids, forked children that hand their connection back), datasets,
//! specs and reference runs.
#![allow(dead_code)]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use legend_daemon_api::{
    Envelope, ErrorCode, JobInfo, JobSpec, MAX_FRAME, PROTOCOL_VERSION, Queries, Reply, Request,
    read_message, write_message,
};
use legend_dataset::{GenerateOptions, generate};
use legend_engine::Config;
use legend_engine::session::Session;

/// A daemon process on `dir/sock` with its state in `dir/state`; killed on drop.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
}

impl Daemon {
    pub fn start(dir: &Path) -> Daemon {
        Self::start_with(dir, |_| {})
    }

    /// [`Daemon::start`], with `adjust` given the command first.
    pub fn start_with(dir: &Path, adjust: impl FnOnce(&mut Command)) -> Daemon {
        let socket = dir.join("sock");
        let config = dir.join("legendd.toml");
        if !config.exists() {
            std::fs::write(&config, "").unwrap();
        }
        // `LEGEND_TEST_DAEMON=PATH` runs the tests against another build (an older one, to see
        // a test fail where the older daemon had the fault).
        let binary = std::env::var_os("LEGEND_TEST_DAEMON")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_legendd").into());
        let mut command = Command::new(binary);
        command
            .args(["--foreground", "--config"])
            .arg(dir.join("legendd.toml"))
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            // `LEGEND_TEST_DAEMON_LOG=debug cargo test ...` shows what the daemon did.
            .env(
                "LEGEND_LOG",
                std::env::var("LEGEND_TEST_DAEMON_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        adjust(&mut command);
        let child = command.spawn().expect("starting legendd");
        wait_listening(&socket);
        Daemon { child, socket }
    }

    pub fn client(&self) -> Client {
        Client(UnixStream::connect(&self.socket).unwrap())
    }

    pub fn signal(&mut self, signal: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    pub fn wait(&mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }
}

impl Drop for Daemon {
    /// Stops the daemon as systemd would (SIGTERM: its jobs stop, their processes end and
    /// their cgroups go), killing it after a few seconds.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling our own child, not reaped yet.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(5) {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Client(pub UnixStream);

/// Waits (up to 30 s) until a daemon answers on `socket`: one that merely accepts may be the
/// listening socket of a daemon just killed, alive a moment in a job's process between fork
/// and exec.
pub fn wait_listening(socket: &Path) {
    let started = Instant::now();
    let answers = || {
        let Ok(s) = UnixStream::connect(socket) else {
            return false;
        };
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut c = Client(s);
        write_message(
            &mut c.0,
            &Envelope {
                v: PROTOCOL_VERSION,
                request: Request::Hello,
            },
        )
        .is_ok()
            && matches!(
                read_message::<Reply>(&mut c.0, MAX_FRAME),
                Ok(Some(Reply::Hello { .. }))
            )
    };
    while !answers() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "legendd did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Client {
    pub fn call(&mut self, request: Request) -> Reply {
        write_message(
            &mut self.0,
            &Envelope {
                v: PROTOCOL_VERSION,
                request,
            },
        )
        .unwrap();
        read_message(&mut self.0, MAX_FRAME).unwrap().unwrap()
    }

    pub fn job(&mut self, request: Request) -> JobInfo {
        match self.call(request) {
            Reply::Job { job } => job,
            other => panic!("expected a job, got {other:?}"),
        }
    }
}

pub fn dataset(dir: &Path) -> PathBuf {
    let out = dir.join("ds");
    let mut o = GenerateOptions::new(3000, 30_000);
    o.relations = 4;
    generate(&o, &out).unwrap();
    out
}

pub const SETS: [&str; 7] = [
    "model.dim=16",
    "storage.num_partitions=4",
    "storage.buffer_capacity=3",
    "training.threads=1",
    "training.batch_size=100",
    "training.checkpoint_every=1",
    "evaluation.protocol=sampled",
];

pub fn train_spec(ds: &Path, out: &Path, epochs: u32) -> JobSpec {
    let mut sets: Vec<String> = SETS.iter().map(|s| s.to_string()).collect();
    sets.push(format!("training.num_epochs={epochs}"));
    JobSpec::Train {
        dataset: Some(ds.to_owned()),
        out: out.to_owned(),
        config: String::new(),
        sets,
        resume: false,
    }
}

/// [`train_spec`] with `extra` settings after the usual ones.
pub fn train_spec_with(ds: &Path, out: &Path, epochs: u32, extra: &[&str]) -> JobSpec {
    let mut spec = train_spec(ds, out, epochs);
    if let JobSpec::Train { sets, .. } = &mut spec {
        sets.extend(extra.iter().map(|s| s.to_string()));
    }
    spec
}

/// The same run in this process.
pub fn reference(ds: &Path, out: &Path, epochs: u32) -> Vec<f32> {
    reference_with(ds, out, epochs, &[]);
    tables(out)
}

/// [`reference`] with `extra` settings after the usual ones; the session, once run.
pub fn reference_with(ds: &Path, out: &Path, epochs: u32, extra: &[&str]) -> Session {
    let JobSpec::Train { sets, .. } = train_spec_with(ds, out, epochs, extra) else {
        unreachable!("a train spec");
    };
    let config = Config::parse("", &sets).unwrap();
    let mut s = Session::create(out, ds, config, &legend_fs::Unguarded).unwrap();
    s.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    s
}

pub fn tables(run: &Path) -> Vec<f32> {
    let run = legend_engine::run::open(run).unwrap();
    let meta = legend_engine::run::read_meta(&run).unwrap();
    let t = legend_engine::run::load_tables(&run, &meta, &legend_fs::Unguarded).unwrap();
    [t.entities, t.entities_state, t.relations, t.relations_state].concat()
}

/// Polls job `id` until `done` says so (at most `limit`).
pub fn wait_for(
    c: &mut Client,
    id: u64,
    limit: Duration,
    done: impl Fn(&JobInfo) -> bool,
) -> JobInfo {
    let started = Instant::now();
    loop {
        let j = c.job(Request::Status { job: id });
        if done(&j) {
            return j;
        }
        assert!(started.elapsed() < limit, "job {id} stuck: {j:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes raw bytes and reads one reply, if any comes.
pub fn raw(d: &Daemon, bytes: &[u8]) -> Option<Reply> {
    let mut s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(bytes).unwrap();
    read_message(&mut s, MAX_FRAME).ok().flatten()
}

pub fn frame(text: &str) -> Vec<u8> {
    let mut v = (text.len() as u32).to_be_bytes().to_vec();
    v.extend(text.as_bytes());
    v
}

pub fn raw_no_reply(d: &Daemon, bytes: &[u8]) -> UnixStream {
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    s
}

/// A train job of `spec`'s settings whose store is on the proxy namespace over `device`.
pub fn on_namespace(mut spec: JobSpec, device: &Path) -> JobSpec {
    if let JobSpec::Train { sets, .. } = &mut spec {
        sets.push("storage.backend=proxy".into());
        sets.push(format!("storage.path={}", device.display()));
    }
    spec
}

pub fn start_lba(run: &Path) -> u64 {
    let meta = legend_engine::run::read_meta(&legend_engine::run::open(run).unwrap()).unwrap();
    meta.store_queue.expect("a store on a namespace").start_lba
}

pub fn refusal(reply: Reply) -> String {
    match reply {
        Reply::Error { message, .. } => message,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// The uid (and gid) tests act as: `nobody` on Debian and most distributions.
pub const OTHER_UID: u32 = 65534;

/// Whether this process may act as another uid (CI runs as root); a test that needs to says
/// so when it may not, and stops.
pub fn may_switch_uids(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        println!("skip: {test} needs root to act as uid {OTHER_UID}");
    }
    root
}

/// A connection to `d` made by a forked child running as `uid` (the daemon identifies a
/// connection by the credentials of the process that connected), handed back to this process
/// over a socket pair.
pub fn connect_as(d: &Daemon, uid: u32) -> Client {
    connect_as_ids(d, uid, uid)
}

/// [`connect_as`] with group `gid` (the connecting process's group, which the daemon counts
/// among the caller's groups).
pub fn connect_as_ids(d: &Daemon, uid: u32, gid: u32) -> Client {
    use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
    use std::os::fd::{AsRawFd, FromRawFd, RawFd};
    let (ours, theirs) = UnixStream::pair().unwrap();
    // SAFETY: the child switches credentials, connects, sends one message and exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: plain system calls in the child.
        let switched = unsafe {
            libc::setgroups(0, std::ptr::null()) == 0
                && libc::setgid(gid) == 0
                && libc::setuid(uid) == 0
        };
        let sent = switched
            && UnixStream::connect(&d.socket).is_ok_and(|s| {
                let fds = [s.as_raw_fd()];
                sendmsg::<()>(
                    theirs.as_raw_fd(),
                    &[std::io::IoSlice::new(b"c")],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::empty(),
                    None,
                )
                .is_ok()
            });
        // SAFETY: leaving the child without running the parent's destructors.
        unsafe { libc::_exit(if sent { 0 } else { 1 }) };
    }
    drop(theirs);
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!(RawFd);
    let msg = recvmsg::<()>(
        ours.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::empty(),
    )
    .unwrap();
    let fd = msg
        .cmsgs()
        .unwrap()
        .find_map(|c| match c {
            ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
            _ => None,
        })
        .expect("the child connected as the other uid");
    let mut status = 0;
    // SAFETY: reaping our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    // SAFETY: the descriptor just received is ours alone.
    Client(unsafe { UnixStream::from_raw_fd(fd) })
}

/// A directory of `uid`'s own, mode 0700, at `path`.
pub fn own_dir(path: &Path, uid: u32) {
    std::fs::create_dir_all(path).unwrap();
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
}

/// A temporary directory others may pass through (to the daemon's socket, to their own
/// directories in it).
pub fn shared_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    dir
}

/// Calls `hello` on `c`, which must be answered.
pub fn hello(c: &mut Client) {
    assert!(matches!(c.call(Request::Hello), Reply::Hello { .. }));
}

/// The error the daemon sends a connection it refuses, unasked.
pub fn turned_away(mut c: Client) -> String {
    c.0.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    refusal(read_message(&mut c.0, MAX_FRAME).unwrap().unwrap())
}

/// A run directory with an unreadable `run.toml`: export jobs on it are accepted and fail at
/// once (jobs that cost nothing to run).
pub fn broken_run(dir: &Path) -> PathBuf {
    let run = dir.join("broken-run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("run.toml"), "").unwrap();
    run
}

pub fn export_spec(run: &Path, n: usize) -> JobSpec {
    JobSpec::Export {
        run: run.to_owned(),
        out: run.parent().unwrap().join(format!("export-{n}")),
        format: "npy".into(),
    }
}

/// Gives `path` and everything beneath it to `uid`.
pub fn chown_tree(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid)).unwrap();
    if path.is_dir() && !path.is_symlink() {
        for entry in std::fs::read_dir(path).unwrap() {
            chown_tree(&entry.unwrap().path(), uid);
        }
    }
}

/// Asks serve job `job` `queries` until the run is loaded (`unavailable` until then).
pub fn ask_served(c: &mut Client, job: u64, queries: &[legend_query::Query]) -> Reply {
    let wire = Queries::of(queries).unwrap();
    let started = Instant::now();
    loop {
        match c.call(Request::Query {
            job,
            queries: wire.clone(),
        }) {
            Reply::Error {
                code: ErrorCode::Unavailable,
                message,
            } => {
                assert!(started.elapsed() < Duration::from_secs(60), "{message}");
                std::thread::sleep(Duration::from_millis(20));
            }
            reply => return reply,
        }
    }
}

/// The answers of a reply.
pub fn served_answers(reply: Reply) -> Vec<legend_query::Answer> {
    let Reply::Answers { answers, .. } = reply else {
        panic!("expected answers, got {reply:?}");
    };
    answers
        .into_iter()
        .map(|a| serde_json::from_value(a).unwrap())
        .collect()
}

/// Submits a serve job of `run` on the CPU; its id.
pub fn serve(c: &mut Client, run: &Path) -> u64 {
    c.job(Request::Submit {
        job: JobSpec::Serve {
            run: run.to_owned(),
            group: None,
            device: Some("cpu".into()),
        },
    })
    .id
}

/// A graph of 400 entities and 3 relations in `dir/ds` (returned), and a daemon configuration
/// in `dir` whose serve jobs may hold no entity rows in host memory: every served run streams.
pub fn streaming_daemon_setup(dir: &Path) -> PathBuf {
    let ds = dir.join("ds");
    let mut o = GenerateOptions::new(400, 3000);
    o.relations = 3;
    generate(&o, &ds).unwrap();
    std::fs::write(dir.join("legendd.toml"), "serve_host_memory_mib = 0\n").unwrap();
    ds
}

/// A memory cgroup of its own around a daemon (and so its jobs), so that a test that makes it
/// allocate cannot hurt the machine; removed when dropped (with the job cgroups the daemon made
/// in it).
pub struct Cage {
    dir: PathBuf,
    procs: std::ffi::CString,
}

/// The mount point of the cgroup file system that has `controller` (v1), or of v2's.
fn cgroup_mount(v1_controller: Option<&str>) -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let point = left.split(' ').nth(4)?;
        let mut r = right.split(' ');
        let (fstype, _, opts) = (r.next()?, r.next()?, r.next().unwrap_or(""));
        let wanted = match v1_controller {
            Some(c) => fstype == "cgroup" && opts.split(',').any(|o| o == c),
            None => fstype == "cgroup2",
        };
        wanted.then(|| PathBuf::from(point))
    })
}

impl Cage {
    /// A cage of `limit` bytes, or why none can be made here.
    pub fn new(limit: u64) -> Result<Cage, String> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let name = format!(
            "legendd-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let v1 = own.lines().find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, c, path) = (p.next()?, p.next()?, p.next()?);
            c.split(',').any(|c| c == "memory").then_some(path)
        });
        let (dir, limit_file) = match (v1, cgroup_mount(Some("memory"))) {
            (Some(path), Some(mount)) => (
                mount.join(path.trim_start_matches('/')).join(&name),
                "memory.limit_in_bytes",
            ),
            _ => {
                let mount = cgroup_mount(None).ok_or("no cgroup file system is mounted")?;
                let path = own
                    .lines()
                    .find_map(|l| l.strip_prefix("0::"))
                    .ok_or("no cgroup v2 path")?;
                let parent = mount.join(path.trim_start_matches('/'));
                // Fails where this process sits in the parent itself (no internal processes).
                std::fs::write(parent.join("cgroup.subtree_control"), "+memory").map_err(|e| {
                    format!(
                        "cgroup v2: cannot give the children of {} a memory controller ({e})",
                        parent.display()
                    )
                })?;
                (parent.join(&name), "memory.max")
            }
        };
        std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let cage = Cage {
            procs: std::ffi::CString::new(
                dir.join("cgroup.procs")
                    .into_os_string()
                    .into_encoded_bytes(),
            )
            .unwrap(),
            dir,
        };
        std::fs::write(cage.dir.join(limit_file), limit.to_string())
            .map_err(|e| format!("{}: {e}", cage.dir.display()))?;
        Ok(cage)
    }

    /// Starts a daemon on `dir` inside the cage.
    pub fn daemon(&self, dir: &Path) -> Daemon {
        let procs = self.procs.clone();
        Daemon::start_with(dir, move |command| {
            // SAFETY: open and write, async-signal-safe, between fork and exec.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(command, move || {
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                    if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(fd);
                    Ok(())
                })
            };
        })
    }
}

impl Drop for Cage {
    fn drop(&mut self) {
        // The daemon is gone by now (dropped first); its jobs' cgroups may linger a moment.
        for _ in 0..200 {
            if let Ok(entries) = std::fs::read_dir(&self.dir) {
                for e in entries.flatten() {
                    if e.path().is_dir() {
                        let _ = std::fs::remove_dir(e.path());
                    }
                }
            }
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A field of `/proc/PID/status` in bytes (`VmHWM`, `VmRSS`).
pub fn memory_of(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}
