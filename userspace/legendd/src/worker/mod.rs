//! A job's process (`legendd job`, started by the daemon only): it reads its job from
//! descriptor 3, runs it, and tells the daemon what happens. Everything a job allocates, reads
//! or computes is here, in its own cgroup and with its own identity's rights, so that a job
//! that runs out of memory, panics or is killed costs only itself.

mod read;
mod serve;
mod train;

use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};

use legend_daemon_api::{JobSpec, Queries};
use legend_engine::run::RunMeta;

use crate::access::{JobGuard, Peer};
use crate::channel::{self, CHANNEL_FD, Ended, FromJob, JobStart, ToJob};
use crate::extents::RecordedStore;

/// The daemon's end of the channel, shared by the threads that send.
pub struct Outbox(Mutex<UnixStream>);

impl Outbox {
    /// Sends a message; a daemon that went away ends the process (its parent-death signal
    /// comes too).
    pub fn send(&self, message: &FromJob) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if channel::send(&mut *s, message).is_err() {
            std::process::exit(3);
        }
    }

    /// Sends the answer to query request `id`.
    fn answer(&self, id: u64, queries: u32, reply: &[u8]) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if channel::send_answer(&mut *s, id, queries, reply).is_err() {
            std::process::exit(3);
        }
    }

    /// A line for the job's log.
    pub fn log(&self, line: impl Into<String>) {
        self.send(&FromJob::Log(line.into()));
    }
}

/// The process's entry point.
pub fn main() -> ExitCode {
    if let Err(e) = drop_capabilities() {
        eprintln!("the job's process could not drop its capabilities: {e}");
        return ExitCode::from(2);
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            std::env::var("LEGEND_LOG").unwrap_or_else(|_| "info".into()),
        ))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .without_time()
        .log_internal_errors(false)
        .init();
    // SAFETY: the daemon hands the process its channel on this descriptor, and nothing else in
    // the process owns it.
    let stream = unsafe { UnixStream::from_raw_fd(CHANNEL_FD) };
    let Ok(mut reader) = stream.try_clone() else {
        return ExitCode::from(2);
    };
    let start = match channel::read_to_job(&mut reader) {
        Ok(Some(ToJob::Start(start))) => start,
        _ => {
            eprintln!("the job's process got no job from the daemon");
            return ExitCode::from(2);
        }
    };
    let out = Arc::new(Outbox(Mutex::new(stream)));
    let stop = Arc::new(AtomicBool::new(false));
    let (queries, asked) = channel();
    {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("channel".into())
            .spawn(move || {
                // The daemon's messages until it closes the channel, which asks a stop too.
                while let Ok(Some(message)) = channel::read_to_job(&mut reader) {
                    match message {
                        ToJob::Stop => stop.store(true, Ordering::Relaxed),
                        ToJob::Query { id, queries: q } => {
                            let _ = queries.send((id, q));
                        }
                        ToJob::Start(_) => {}
                    }
                }
                stop.store(true, Ordering::Relaxed);
            })
            .expect("spawning the channel's reader");
    }
    let ended = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(&start, &out, &stop, asked)
    }))
    .unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        Err(format!("the job panicked: {what}"))
    });
    out.send(&FromJob::Ended(match ended {
        Ok(ended) => ended,
        Err(e) => Ended::Failed(e),
    }));
    let _ = std::io::stderr().flush();
    ExitCode::SUCCESS
}

/// Runs the job.
fn run(
    start: &JobStart,
    out: &Outbox,
    stop: &AtomicBool,
    asked: Receiver<(u64, Queries)>,
) -> Result<Ended, String> {
    let guard = guard(start);
    match &start.spec {
        JobSpec::Train { .. } => train::train(start, &guard, out, stop),
        JobSpec::Eval { .. } => read::eval(start, &guard),
        JobSpec::Export { .. } => read::export(start, &guard, out),
        JobSpec::Serve { .. } => serve::serve(start, &guard, out, stop, asked),
    }
}

/// The job's guard: the submitter's directories, reads as the kernel checks them for a process
/// that runs as the submitter.
fn guard(start: &JobStart) -> JobGuard {
    let submitter = Peer {
        uid: start.submitter.uid,
        gid: start.submitter.gid,
        groups: start.submitter.groups.clone(),
        admin: false,
    };
    JobGuard::new(submitter, !start.device_identity)
}

/// An error with its causes, on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    legend_engine::error_chain::with_sources(e)
}

/// Checks that `meta` (a run's `run.toml`, as the job reads it) names the store the daemon
/// recorded at submission: the same device or backing file, namespace and extent, or none.
pub fn check_store(meta: &RunMeta, expect: Option<&RecordedStore>) -> Result<(), String> {
    let named = match (&meta.store, &meta.store_queue) {
        (Some(path), Some(queue)) => Some((path, queue)),
        _ => None,
    };
    match (named, expect) {
        (None, None) => Ok(()),
        (Some((path, queue)), Some(e)) => {
            let same_path = path == &e.path
                || std::fs::canonicalize(path).ok() == std::fs::canonicalize(&e.path).ok();
            if same_path && *queue == e.queue && meta.store_members.len() <= 1 {
                Ok(())
            } else {
                Err(format!(
                    "its store changed since the job was submitted ({} namespace {} from LBA {}, \
                     recorded {} namespace {} from LBA {}): a job uses the store it was \
                     submitted with",
                    path.display(),
                    queue.namespace,
                    queue.start_lba,
                    e.path.display(),
                    e.queue.namespace,
                    e.queue.start_lba
                ))
            }
        }
        (Some((path, _)), None) => Err(format!(
            "it names a store on a namespace ({}) it did not have when the job was submitted",
            path.display()
        )),
        (None, Some(e)) => Err(format!(
            "it no longer names its store ({}) as it did when the job was submitted",
            e.path.display()
        )),
    }
}

/// Drops every capability the process may hold (the daemon's child starts with none, unless
/// something went wrong on the way: then it holds none after this either) and checks it.
fn drop_capabilities() -> std::io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset with a version-3 header and its two data words, all zero: drops all.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a prctl without pointers.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    let status = std::fs::read_to_string("/proc/self/status")?;
    for field in ["CapInh:", "CapPrm:", "CapEff:", "CapAmb:"] {
        let held = status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok());
        if held != Some(0) {
            return Err(std::io::Error::other(format!("{field} {held:?}")));
        }
    }
    Ok(())
}
