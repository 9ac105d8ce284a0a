#![allow(dead_code, unused_imports, clippy::all)]
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use legend_daemon_api::{
    Envelope, ErrorCode, JobInfo, JobSpec, JobState, MAX_FRAME, PROTOCOL_VERSION, Reply, Request,
    read_message, write_message,
};
use legend_dataset::{GenerateOptions, generate};
use legend_engine::Config;
use legend_engine::session::Session;

/// A daemon process on `dir/sock` with its state in `dir/state`; killed on drop.
struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    fn start(dir: &Path) -> Daemon {
        Self::start_with(dir, |_| {})
    }

    /// [`Daemon::start`], with `adjust` given the command first.
    fn start_with(dir: &Path, adjust: impl FnOnce(&mut Command)) -> Daemon {
        let socket = dir.join("sock");
        let config = dir.join("legendd.toml");
        if !config.exists() {
            std::fs::write(&config, "").unwrap();
        }
        let mut command = Command::new(env!("CARGO_BIN_EXE_legendd"));
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
        let started = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "legendd did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon { child, socket }
    }

    fn client(&self) -> Client {
        Client(UnixStream::connect(&self.socket).unwrap())
    }

    fn signal(&mut self, signal: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }
}

use libc::{SIGKILL, SIGTERM};

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Client(UnixStream);

impl Client {
    fn call(&mut self, request: Request) -> Reply {
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

    fn job(&mut self, request: Request) -> JobInfo {
        match self.call(request) {
            Reply::Job { job } => job,
            other => panic!("expected a job, got {other:?}"),
        }
    }
}

fn dataset(dir: &Path) -> PathBuf {
    let out = dir.join("ds");
    let mut o = GenerateOptions::new(3000, 30_000);
    o.relations = 4;
    generate(&o, &out).unwrap();
    out
}

const SETS: [&str; 7] = [
    "model.dim=16",
    "storage.num_partitions=4",
    "storage.buffer_capacity=3",
    "training.threads=1",
    "training.batch_size=100",
    "training.checkpoint_every=1",
    "evaluation.protocol=sampled",
];

fn train_spec(ds: &Path, out: &Path, epochs: u32) -> JobSpec {
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

/// The same run in this process.
fn reference(ds: &Path, out: &Path, epochs: u32) -> Vec<f32> {
    let mut sets: Vec<String> = SETS.iter().map(|s| s.to_string()).collect();
    sets.push(format!("training.num_epochs={epochs}"));
    let config = Config::parse("", &sets).unwrap();
    let mut s = Session::create(out, ds, config, &legend_fs::Unguarded).unwrap();
    s.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    tables(out)
}

fn tables(run: &Path) -> Vec<f32> {
    let run = legend_engine::run::open(run).unwrap();
    let meta = legend_engine::run::read_meta(&run).unwrap();
    let t = legend_engine::run::load_tables(&run, &meta, &legend_fs::Unguarded).unwrap();
    [t.entities, t.entities_state, t.relations, t.relations_state].concat()
}

/// Polls job `id` until `done` says so (at most `limit`).
fn wait_for(c: &mut Client, id: u64, limit: Duration, done: impl Fn(&JobInfo) -> bool) -> JobInfo {
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

const OTHER_UID: u32 = 65534;

/// Whether this process may act as another uid (CI runs as root); a test that needs to says
/// so when it may not, and stops.
fn may_switch_uids(test: &str) -> bool {
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
fn connect_as(d: &Daemon, uid: u32) -> Client {
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
                && libc::setgid(uid) == 0
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
fn own_dir(path: &Path, uid: u32) {
    std::fs::create_dir_all(path).unwrap();
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
}

/// A temporary directory others may pass through (to the daemon's socket, to their own
/// directories in it).
fn shared_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    dir
}

fn rss_kb(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

fn du(path: &Path) -> u64 {
    std::fs::read_dir(path)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

fn user_run(dir: &Path) -> PathBuf {
    let home = dir.join("u");
    own_dir(&home, OTHER_UID);
    let run = home.join("run");
    own_dir(&run, OTHER_UID);
    std::fs::write(run.join("run.toml"), "").unwrap();
    std::os::unix::fs::chown(run.join("run.toml"), Some(OTHER_UID), Some(OTHER_UID)).unwrap();
    run
}

#[test]
fn probe_ended_jobs_unbounded() {
    if !may_switch_uids("p") {
        return;
    }
    let dir = shared_tempdir();
    let run = user_run(dir.path());
    let d = Daemon::start(dir.path());
    let pid = d.child.id();
    let rss0 = rss_kb(pid);
    let mut c = connect_as(&d, OTHER_UID);
    let big = "x".repeat(400_000);
    let n = std::env::var("PROBE_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150usize);
    let started = Instant::now();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sock = d.socket.clone();
    let st = stop.clone();
    let lat = std::thread::spawn(move || {
        let mut root = Client(UnixStream::connect(&sock).unwrap());
        let mut worst = Duration::ZERO;
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            let t = Instant::now();
            root.call(Request::List { all: false });
            worst = worst.max(t.elapsed());
            std::thread::sleep(Duration::from_millis(5));
        }
        worst
    });
    let mut last = 0;
    for _ in 0..n {
        let r = c.call(Request::Submit {
            job: JobSpec::Eval {
                run: run.clone(),
                protocol: big.clone(),
                split: "test".into(),
            },
        });
        match r {
            Reply::Job { job } => last = job.id,
            other => panic!("{other:?}"),
        }
    }
    // wait for the last to end
    loop {
        match c.call(Request::Status { job: last }) {
            Reply::Job { job } if job.state.is_final() => {
                println!(
                    "last job: {:?} error len {}",
                    job.state,
                    job.error.map_or(0, |e| e.len())
                );
                break;
            }
            Reply::Error { message, .. } => {
                println!("status error: {}", &message[..message.len().min(200)]);
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let worst = lat.join().unwrap();
    println!(
        "{n} ended eval jobs by uid {OTHER_UID} in {:?}: daemon RSS {} -> {} KiB; state/jobs {} bytes; worst root list latency {:?}",
        started.elapsed(),
        rss0,
        rss_kb(pid),
        du(&dir.path().join("state/jobs")),
        worst
    );
    let mut root = d.client();
    match root.call(Request::List { all: true }) {
        Reply::Error { code, message } => println!("admin list --all: {code:?}: {message}"),
        Reply::Jobs { jobs } => println!("admin list --all: {} jobs", jobs.len()),
        other => println!("{other:?}"),
    }
    match c.call(Request::List { all: false }) {
        Reply::Error { code, message } => println!("user list: {code:?}: {message}"),
        Reply::Jobs { jobs } => println!("user list: {} jobs", jobs.len()),
        other => println!("{other:?}"),
    }
    let t = Instant::now();
    let r = root.call(Request::Metrics);
    println!(
        "metrics {:?} in {:?}",
        matches!(r, Reply::Text { .. }),
        t.elapsed()
    );
}

#[test]
fn probe_http_slots_held_by_anyone() {
    if !may_switch_uids("p") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::fs::write(
        dir.path().join("legendd.toml"),
        format!("metrics_port = {port}\n"),
    )
    .unwrap();
    let _d = Daemon::start(dir.path());
    std::thread::sleep(Duration::from_millis(500));
    // 8 silent connections made by uid 65534
    let mut held = Vec::new();
    for _ in 0..8 {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe {
                libc::setgid(OTHER_UID);
                libc::setuid(OTHER_UID);
            }
            let s = std::net::TcpStream::connect(("127.0.0.1", port));
            let mut t = theirs;
            let _ = t.write_all(if s.is_ok() { b"1" } else { b"0" });
            std::thread::sleep(Duration::from_secs(8));
            unsafe { libc::_exit(0) };
        }
        held.push((pid, ours));
    }
    for (_, o) in &mut held {
        let mut b = [0u8; 1];
        std::io::Read::read_exact(o, &mut b).unwrap();
        assert_eq!(&b, b"1");
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = std::io::Read::read_to_string(&mut s, &mut text);
    println!(
        "scraper while uid {OTHER_UID} holds 8 silent TCP connections: {:?}",
        text.lines().next()
    );
    for (pid, _) in held {
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            let mut st = 0;
            libc::waitpid(pid, &mut st, 0);
        }
    }
}

#[test]
fn probe_watch_of_queued_job_outlives_client() {
    if !may_switch_uids("p") {
        return;
    }
    let dir = shared_tempdir();
    std::fs::write(
        dir.path().join("legendd.toml"),
        "max_connections_per_uid = 2\nrequest_timeout_s = 2\n",
    )
    .unwrap();
    let ds = dataset(dir.path());
    let run = user_run(dir.path());
    let d = Daemon::start(dir.path());
    let mut root = d.client();
    let long = root.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("rootrun"), 1000),
    });
    wait_for(&mut root, long.id, Duration::from_secs(60), |j| {
        j.state == JobState::Running
    });
    let mut c = connect_as(&d, OTHER_UID);
    let q = c.job(Request::Submit {
        job: JobSpec::Eval {
            run: run.clone(),
            protocol: "filtered".into(),
            split: "test".into(),
        },
    });
    drop(c);
    for _ in 0..2 {
        let mut w = connect_as(&d, OTHER_UID);
        write_message(
            &mut w.0,
            &Envelope {
                v: PROTOCOL_VERSION,
                request: Request::Watch { job: q.id },
            },
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(w); // client gone
    }
    std::thread::sleep(Duration::from_secs(4));
    let mut c = connect_as(&d, OTHER_UID);
    let r: Option<Reply> = read_message(&mut c.0, MAX_FRAME).ok().flatten();
    println!(
        "uid {OTHER_UID} with no connection of its own open, 4 s after closing two watchers: {r:?}"
    );
    root.job(Request::Cancel { job: long.id });
}

#[test]
fn probe_config_values() {
    if !may_switch_uids("p") {
        return;
    }
    let cands: Vec<String> = std::env::var("PROBE_SETS")
        .unwrap()
        .split(';')
        .map(String::from)
        .collect();
    let top = shared_tempdir();
    let ds = dataset(top.path());
    for (i, set) in cands.iter().enumerate() {
        let dir = top.path().join(format!("d{i}"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let home = dir.join("u");
        own_dir(&home, OTHER_UID);
        let mut d = Daemon::start(&dir);
        let mut c = connect_as(&d, OTHER_UID);
        let mut sets: Vec<String> = SETS.iter().map(|s| s.to_string()).collect();
        sets.push("training.num_epochs=1".into());
        sets.extend(set.split(',').map(String::from));
        let r = c.call(Request::Submit {
            job: JobSpec::Train {
                dataset: Some(ds.clone()),
                out: home.join("run"),
                config: String::new(),
                sets,
                resume: false,
            },
        });
        let id = match r {
            Reply::Job { job } => job.id,
            other => {
                println!("[{set}] submit: {other:?}");
                continue;
            }
        };
        let started = Instant::now();
        let mut last = None;
        while started.elapsed() < Duration::from_secs(25) {
            if let Ok(Some(st)) = d.child.try_wait() {
                println!(
                    "[{set}] DAEMON EXITED: {st:?} after {:?}",
                    started.elapsed()
                );
                break;
            }
            let mut r2 = d.client();
            match r2.call(Request::Status { job: id }) {
                Reply::Job { job } => {
                    let fin = job.state.is_final();
                    last = Some((
                        job.state,
                        job.error.map(|e| e.chars().take(300).collect::<String>()),
                    ));
                    if fin {
                        break;
                    }
                }
                other => {
                    last = None;
                    println!("[{set}] status: {other:?}");
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let alive = d.child.try_wait().ok().flatten().is_none();
        println!(
            "[{set}] after {:?}: daemon alive {alive}; job {:?}; rss {}",
            started.elapsed(),
            last,
            if alive { rss_kb(d.child.id()) } else { 0 }
        );
        if alive {
            // can another job (root's) run on the CPU queue now?
            let mut root = d.client();
            let run = broken_run(&dir);
            let j = root.job(Request::Submit {
                job: JobSpec::Export {
                    run: run.clone(),
                    out: dir.join("exp"),
                    format: "npy".into(),
                },
            });
            std::thread::sleep(Duration::from_secs(3));
            let j = root.job(Request::Status { job: j.id });
            println!("[{set}] a later root export job after 3 s: {:?}", j.state);
        }
    }
}
fn broken_run(dir: &Path) -> PathBuf {
    let run = dir.join("broken-run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("run.toml"), "").unwrap();
    run
}
