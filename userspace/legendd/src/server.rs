//! The Unix socket: connections admitted by their peer's `SO_PEERCRED` credentials (at most
//! `max_connections`, `max_connections_per_uid` a user, a reserve for the admin group), one
//! thread each, answering framed requests. A client that does not send a whole request within
//! `request_timeout_s`, sends a frame over the limit or breaks the framing is disconnected;
//! a malformed request inside a good frame gets an error reply. Nothing a client does can make
//! the daemon wait on it: watches read events from a bounded queue the job fills without
//! blocking, and writes to a client time out.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use legend_daemon_api::{
    DeviceHealth, DeviceInfo, Envelope, ErrorCode, FrameError, JobSpec, JobState, MAX_FRAME,
    NvmeController, PROTOCOL_VERSION, Reply, Request, read_frame, write_message,
};
use legend_engine::Config;
use legend_engine::config::DeviceChoice;
use legend_engine::store::QueueBackend;
use legend_engine::store::StoreFile;
use legend_engine::store::controllers::{self, SharedController};
use legend_fs::Unguarded;
use legend_nvme::Controller as _;

use crate::access::{self, Peer};
use crate::config::DaemonConfig;
use crate::extents;
use crate::jobs::{self, JobError, Jobs};

/// Binds the socket at `path`, replacing a stale one; another daemon listening there is an
/// error. Anyone may connect: requests are authorised by the caller's credentials.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if UnixStream::connect(path).is_ok() {
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
        let jobs = jobs.clone();
        let spawned = std::thread::Builder::new()
            .name("client".into())
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = connection(stream, &peer, timeout, &jobs) {
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

fn connection(
    stream: UnixStream,
    peer: &Peer,
    timeout: Duration,
    jobs: &Jobs,
) -> Result<(), FrameError> {
    let reader = stream.try_clone()?;
    let mut writer = stream;
    loop {
        let mut deadline = Deadline {
            stream: &reader,
            at: Instant::now() + timeout,
        };
        let bytes = match read_frame(&mut deadline, MAX_FRAME) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(()),
            Err(e @ FrameError::TooLarge { .. }) => {
                // The rest of the stream cannot be trusted to be framed: answer and close.
                write_message(&mut writer, &error(ErrorCode::BadRequest, e.to_string()))?;
                return Err(e);
            }
            Err(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                ) =>
            {
                let why = format!(
                    "no complete request within {} s (request_timeout_s): disconnected",
                    timeout.as_secs()
                );
                write_message(&mut writer, &error(ErrorCode::BadRequest, why))?;
                return Err(FrameError::Io(e));
            }
            Err(e) => return Err(e),
        };
        jobs.requests.fetch_add(1, Ordering::Relaxed);
        let envelope: Envelope = match serde_json::from_slice(&bytes) {
            Ok(e) => e,
            Err(e) => {
                write_message(
                    &mut writer,
                    &error(ErrorCode::BadRequest, format!("malformed request: {e}")),
                )?;
                continue;
            }
        };
        if envelope.v != PROTOCOL_VERSION {
            write_message(
                &mut writer,
                &error(
                    ErrorCode::BadRequest,
                    format!(
                        "protocol version {}; this daemon speaks {PROTOCOL_VERSION}",
                        envelope.v
                    ),
                ),
            )?;
            continue;
        }
        match envelope.request {
            Request::Watch { job } => watch(&mut writer, peer, jobs, job)?,
            request => {
                let reply = answer(request, peer, jobs);
                match write_message(&mut writer, &reply) {
                    // Nothing was written: the client hears why instead of a closed socket.
                    Err(FrameError::TooLarge { len, max }) => {
                        let why = format!(
                            "the answer is {len} bytes, over the {max}-byte frame limit (ask \
                             fewer queries or entities at once; delete ended jobs to shorten a \
                             list)"
                        );
                        write_message(&mut writer, &error(ErrorCode::Unavailable, why))?;
                    }
                    written => written?,
                }
            }
        }
    }
}

/// The reply to every request but `watch`.
fn answer(request: Request, peer: &Peer, jobs: &Jobs) -> Reply {
    // Why the caller may not manage job `id`, as the reply to send; None when it may.
    let refusal = |id: u64| -> Option<Reply> {
        match jobs.get(id) {
            Err(e) => Some(job_error(e)),
            Ok(info) if peer.may_manage(info.owner) => None,
            Ok(_) => Some(error(
                ErrorCode::Forbidden,
                format!("job {id} is not yours"),
            )),
        }
    };
    match request {
        Request::Hello => Reply::Hello {
            version: PROTOCOL_VERSION,
            daemon: env!("CARGO_PKG_VERSION").into(),
            uid: peer.uid,
            admin: peer.admin,
        },
        Request::Submit { job } => submit(job, peer, jobs),
        Request::List { all } => {
            if all && !peer.admin {
                return error(
                    ErrorCode::Forbidden,
                    "only the admin group sees everyone's jobs",
                );
            }
            Reply::Jobs {
                jobs: jobs.list((!all).then_some(peer.uid)),
            }
        }
        Request::Status { job } => match refusal(job) {
            None => jobs
                .get(job)
                .map_or_else(job_error, |job| Reply::Job { job }),
            Some(reply) => reply,
        },
        Request::Cancel { job } => match refusal(job) {
            None => jobs
                .cancel(job)
                .map_or_else(job_error, |job| Reply::Job { job }),
            Some(reply) => reply,
        },
        Request::Logs { job } => match refusal(job) {
            None => Reply::Text {
                text: tail(&jobs.log_path(job), MAX_FRAME / 2),
            },
            Some(reply) => reply,
        },
        Request::Delete { job } => match refusal(job) {
            None => delete(job, jobs),
            Some(reply) => reply,
        },
        Request::Metrics => Reply::Text {
            text: jobs.metrics(|owner| peer.may_manage(owner)),
        },
        Request::Devices => devices(),
        Request::Bind { bdf, force } if peer.admin => {
            device_change(legend_nvme::Sysfs::default().bind(&bdf, force))
        }
        Request::Unbind { bdf } if peer.admin => {
            device_change(legend_nvme::Sysfs::default().unbind(&bdf))
        }
        Request::Bind { .. } | Request::Unbind { .. } => error(
            ErrorCode::Forbidden,
            "only the admin group binds and unbinds devices",
        ),
        Request::DeviceInfo { device } => device_report(&device, |d| {
            d.info()
                .map(|info| serde_json::to_value(DeviceInfo::new(&device, &info)))
        }),
        Request::DeviceHealth { device } => device_report(&device, |d| {
            d.health()
                .map(|h| serde_json::to_value(DeviceHealth::new(&device, &h)))
        }),
        Request::Query { job, queries } => query(job, queries, peer, jobs),
        Request::Watch { .. } => unreachable!("answered by watch()"),
    }
}

/// Answers queries on the run serve job `id` holds, for its submitter, a member of the group it
/// names, or root.
fn query(id: u64, queries: Vec<serde_json::Value>, peer: &Peer, jobs: &Jobs) -> Reply {
    let info = match jobs.get(id) {
        Ok(info) => info,
        Err(e) => return job_error(e),
    };
    let served = jobs.served(id);
    let allowed = match &served {
        Some(s) => s.may_query(peer),
        None => peer.uid == 0 || peer.uid == info.owner,
    };
    if !allowed {
        return error(
            ErrorCode::Forbidden,
            format!("job {id} is not yours, nor served to a group of yours"),
        );
    }
    match (served, &info.spec, info.state) {
        (Some(served), _, _) => served.answer(queries),
        (None, JobSpec::Serve { .. }, JobState::Queued | JobState::Running) => error(
            ErrorCode::Unavailable,
            format!(
                "job {id} is {} (loading its run): try again",
                info.state.name()
            ),
        ),
        (None, JobSpec::Serve { .. }, state) => error(
            ErrorCode::Refused,
            format!("job {id} has ended ({}): submit serve again", state.name()),
        ),
        (None, spec, _) => error(
            ErrorCode::Refused,
            format!("job {id} is a {} job, not a serve job", spec.kind()),
        ),
    }
}

/// Queues `job` once it passed the checks; a new run on an NVMe namespace gets its extent.
fn submit(mut job: JobSpec, peer: &Peer, jobs: &Jobs) -> Reply {
    let assigned = check_submission(&job, peer).and_then(|(queue, config)| {
        let extent = match &config {
            Some(config) => assign_extent(&mut job, config, peer)?,
            None => None,
        };
        Ok((queue, extent))
    });
    let (queue, assigned) = match assigned {
        Ok(a) => a,
        Err(why) => return error(ErrorCode::Refused, why),
    };
    match jobs.submit(peer.uid, job, queue) {
        Ok(info) => Reply::Job { job: info },
        Err(e) => {
            if let Some((place, run)) = assigned
                && let Err(why) = extents::release(&place, &run, peer.uid)
            {
                tracing::warn!(
                    "{}: freeing the extent of a refused job: {why}",
                    run.display()
                );
            }
            job_error(e)
        }
    }
}

/// For a new train run whose store is on an NVMe namespace: its extent, written into the job's
/// settings (`storage.start_lba`).
fn assign_extent(
    job: &mut JobSpec,
    config: &Config,
    peer: &Peer,
) -> Result<Option<(extents::Placement, PathBuf)>, String> {
    let JobSpec::Train {
        dataset: Some(dataset),
        out,
        sets,
        resume: false,
        ..
    } = job
    else {
        return Ok(None);
    };
    let Some(place) = extents::placement(config, out) else {
        return Ok(None);
    };
    let lba = extents::assign(&place, config, dataset, out, peer.uid)?;
    sets.push(format!("storage.start_lba={lba}"));
    // The extent is this run's now: what a deleted run left in it may be overwritten.
    sets.push("storage.force=true".into());
    Ok(Some((place, out.clone())))
}

/// Deletes an ended job; the last train job of a run on a namespace frees the run's extent.
fn delete(id: u64, jobs: &Jobs) -> Reply {
    let info = match jobs.delete(id) {
        Ok(info) => info,
        Err(e) => return job_error(e),
    };
    let run = info.spec.dir();
    let last_of_its_run = matches!(info.spec, JobSpec::Train { .. })
        && !jobs
            .list(None)
            .iter()
            .any(|j| matches!(j.spec, JobSpec::Train { .. }) && j.spec.dir() == run);
    if last_of_its_run
        && let owner = Peer::of_uid(info.owner)
        && let Some(place) = train_placement(
            run,
            &owner,
            jobs::train_config(&info.spec, &owner).ok().as_ref(),
        )
        && let Err(why) = extents::release(&place, run, info.owner)
    {
        return error(
            ErrorCode::Unavailable,
            format!("job {id} deleted, but its run's extent was not freed: {why}"),
        );
    }
    Reply::Job { job: info }
}

/// Where the store of a train job on `run` is, if on a namespace: as the run recorded it (read
/// as `reader` could), else as the job's configuration places it.
fn train_placement(
    run: &Path,
    reader: &Peer,
    config: Option<&Config>,
) -> Option<extents::Placement> {
    let recorded = reader
        .open_dir(run)
        .ok()
        .and_then(|dir| extents::recorded_placement(&dir));
    recorded.or_else(|| extents::placement(config?, run))
}

/// Checks that `run` is a training run of its submitter's own (the job opens it again and
/// checks the opened directory: access::JobGuard), and that a store it keeps on a namespace is
/// still in the run's extent there.
fn check_run_to_read(peer: &Peer, run: &Path) -> Result<(), String> {
    let dir = access::open_own(peer, run)?;
    if !dir.is_file(legend_engine::run::META_FILE).unwrap_or(false) {
        return Err(format!(
            "{} is not a training run directory (no run.toml)",
            run.display()
        ));
    }
    match extents::recorded_placement(&dir) {
        Some(place) => extents::check(&place, run, peer),
        None => Ok(()),
    }
}

/// Checks the store paths a train job names (`storage.path`, `[[storage.device]]`): the
/// submitter must be able to write each file, or create it. Device nodes (`nvme`) are the
/// daemon's; their extents keep users apart, on one namespace a job.
fn check_store_path(peer: &Peer, config: &Config) -> Result<(), String> {
    let s = &config.storage;
    if s.backend == legend_engine::config::Backend::Nvme {
        if !s.device.is_empty() {
            return Err(
                "storage.device: legendd gives a job an extent of one namespace; a store \
                 striped over several devices ([[storage.device]]) runs with legendctl train"
                    .into(),
            );
        }
        return Ok(());
    }
    s.path
        .iter()
        .chain(s.device.iter().map(|d| &d.path))
        .try_for_each(|path| access::check_may_write_or_create(peer, path))
}

/// Whether a new run may be made at `out` in its opened `parent`: nothing there, or an empty
/// directory.
fn is_free_for_a_run(parent: &legend_fs::Dir, out: &Path) -> bool {
    let Some(name) = out.file_name() else {
        return false;
    };
    match parent.entry(name) {
        Ok(None) => true,
        Ok(Some(_)) => parent.entries(name).is_ok_and(|e| e.is_empty()),
        Err(_) => false,
    }
}

/// Checks what a submission names against what its submitter may touch, and finds its queue;
/// a train job's configuration comes with it, parsed once.
/// Bytes a train job's configuration text and `--set` values may take together.
const MAX_CONFIG_BYTES: usize = 64 << 10;

fn check_submission(job: &JobSpec, peer: &Peer) -> Result<(String, Option<Config>), String> {
    let dir = job.dir();
    if !dir.is_absolute() {
        return Err(format!("{}: give an absolute path", dir.display()));
    }
    match job {
        JobSpec::Train {
            dataset,
            out,
            resume,
            config,
            sets,
        } => {
            // A job's record keeps its spec until deleted: its size is bounded like its count.
            let bytes = config.len() + sets.iter().map(String::len).sum::<usize>();
            if bytes > MAX_CONFIG_BYTES {
                return Err(format!(
                    "the job's configuration and --set values take {bytes} bytes (at most \
                     {MAX_CONFIG_BYTES})"
                ));
            }
            let parent = out
                .parent()
                .ok_or_else(|| format!("{}: not a run directory path", out.display()))?;
            let parent = access::open_to_create_in(peer, parent)?;
            if !*resume && !is_free_for_a_run(&parent, out) {
                // As `legendctl train` says it, up front rather than when the job starts.
                return Err(format!(
                    "{} already exists; choose another --out or continue it with --resume",
                    out.display()
                ));
            }
            if let Some(d) = dataset {
                if !d.is_absolute() {
                    return Err(format!("{}: give an absolute path", d.display()));
                }
                peer.open_dir(d)?;
            }
            let config = jobs::train_config(job, peer)?;
            check_store_path(peer, &config)?;
            if *resume && let Some(place) = train_placement(out, peer, Some(&config)) {
                extents::check(&place, out, peer)?;
            }
            return Ok((jobs::queue_of(&config), Some(config)));
        }
        JobSpec::Eval {
            run,
            protocol,
            split,
        } => {
            // Checked here, not when the job runs: a bad value is refused, never kept in a
            // record nor quoted back at length.
            for (what, value) in [("protocol", protocol), ("split", split)] {
                if value.len() > 32 {
                    return Err(format!(
                        "{what}: {} bytes is not a {what} name",
                        value.len()
                    ));
                }
            }
            protocol.parse::<legend_engine::config::Protocol>()?;
            split.parse::<legend_dataset::Split>()?;
            check_run_to_read(peer, run)?;
        }
        JobSpec::Serve { run, group, device } => {
            check_run_to_read(peer, run)?;
            if let Some(d) = device {
                // Checked here, not when the job runs, as an eval's protocol is.
                if d.len() > 32 {
                    return Err(format!("device: {} bytes is not a device name", d.len()));
                }
                d.parse::<DeviceChoice>()?;
            }
            if let Some(name) = group {
                let gid = access::group_id(name)?;
                // Like chgrp: a run is shared only with a group its owner is in.
                if peer.uid != 0 && !peer.groups.contains(&gid) {
                    return Err(format!(
                        "uid {} is not in group {name}: a run is served only to a group of \
                         its submitter's",
                        peer.uid
                    ));
                }
            }
            return Ok((jobs::SERVE_QUEUE.into(), None));
        }
        JobSpec::Export { run, out, format } => {
            check_run_to_read(peer, run)?;
            format.parse::<legend_engine::export::Format>()?;
            if !out.is_absolute() {
                return Err(format!("{}: give an absolute path", out.display()));
            }
            let parent = out
                .parent()
                .ok_or_else(|| format!("{}: not a directory path", out.display()))?;
            access::open_to_create_in(peer, parent)?;
        }
    }
    Ok(("cpu".into(), None))
}

fn watch(writer: &mut UnixStream, peer: &Peer, jobs: &Jobs, id: u64) -> Result<(), FrameError> {
    let info = match jobs.get(id) {
        Ok(info) => info,
        Err(e) => return write_message(writer, &job_error(e)),
    };
    if !peer.may_manage(info.owner) {
        return write_message(
            writer,
            &error(ErrorCode::Forbidden, format!("job {id} is not yours")),
        );
    }
    let (tx, rx) = sync_channel(jobs::WATCH_BACKLOG);
    if jobs.watch(id, tx).unwrap_or(false) {
        loop {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(reply) => write_message(writer, &reply)?,
                Err(RecvTimeoutError::Timeout) => {
                    if jobs.get(id).is_ok_and(|j| j.state.is_final()) {
                        break;
                    }
                    // A quiet job writes nothing that would find the client gone: ask the
                    // socket, so a closed watch frees its connection slot.
                    if hung_up(writer) {
                        return Ok(());
                    }
                }
                // The job ended, or went back to the queue with a stopping daemon.
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
    }
    let job = jobs.get(id).map_err(|_| FrameError::Truncated)?;
    write_message(writer, &Reply::Ended { job })
}

/// Whether the peer of `stream` closed its end (or the connection failed).
fn hung_up(stream: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd of an open socket, no wait.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// The last `max` bytes of the file at `path` (from a line start), or nothing: only they are
/// read, however long the log has grown.
fn tail(path: &Path, max: usize) -> String {
    use std::io::{Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let start = len.saturating_sub(max as u64);
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(start)).is_err()
        || file.take(max as u64).read_to_end(&mut bytes).is_err()
    {
        return String::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    match (start, text.find('\n')) {
        (0, _) | (_, None) => text.into_owned(),
        (_, Some(nl)) => text[nl + 1..].to_owned(),
    }
}

fn controller_json(c: legend_nvme::PciController) -> serde_json::Value {
    serde_json::to_value(NvmeController::from(c)).expect("plain fields serialise")
}

fn devices() -> Reply {
    match legend_nvme::Sysfs::default().list() {
        Ok(list) => Reply::Data {
            data: serde_json::Value::Array(list.into_iter().map(controller_json).collect()),
        },
        Err(e) => error(ErrorCode::Refused, e.to_string()),
    }
}

/// What `read` reports of the module's device `node`, opened as the jobs open it (one writer
/// per controller: a running job's handle is shared, not fought over).
fn device_report(
    node: &str,
    read: impl FnOnce(
        &legend_nvme::Device,
    ) -> legend_nvme::Result<serde_json::Result<serde_json::Value>>,
) -> Reply {
    if !legend_daemon_api::is_device_node(node) {
        return error(
            ErrorCode::BadRequest,
            format!("{node}: not a device node of legend_nvme (/dev/legend-nvmeN)"),
        );
    }
    let file = StoreFile::open(Path::new(node), &Unguarded);
    let controller = match file.and_then(|file| controllers::open(QueueBackend::Nvme, &file, None))
    {
        Ok(c) => c,
        Err(e) => return error(ErrorCode::Refused, e.to_string()),
    };
    let SharedController::Device(device) = controller else {
        unreachable!("an nvme controller is a device");
    };
    match read(&device) {
        Ok(Ok(data)) => Reply::Data { data },
        Ok(Err(e)) => error(ErrorCode::Unavailable, e.to_string()),
        Err(e) => error(ErrorCode::Unavailable, format!("{node}: {e}")),
    }
}

fn device_change(result: legend_nvme::Result<legend_nvme::PciController>) -> Reply {
    match result {
        Ok(c) => Reply::Data {
            data: controller_json(c),
        },
        Err(e) => error(ErrorCode::Refused, e.to_string()),
    }
}

/// HTTP connections to the metrics served at once; more are answered 503.
const HTTP_CONNECTIONS: usize = 8;

/// Serves `GET /metrics` on `127.0.0.1:port`, for the life of the process. Anyone on the machine
/// may connect and no credentials come with TCP: it shows the daemon's totals only, no job nor
/// owner (see `Jobs::metrics`). Each request must arrive whole within `timeout`, and at most
/// [`HTTP_CONNECTIONS`] are served at once, each on its own thread.
pub fn serve_metrics_http(port: u16, jobs: Arc<Jobs>, timeout: Duration) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("serving metrics on 127.0.0.1:{port}"))?;
    let open = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else {
                    continue;
                };
                let _ = s.set_write_timeout(Some(timeout));
                if open.fetch_add(1, Ordering::Relaxed) >= HTTP_CONNECTIONS {
                    open.fetch_sub(1, Ordering::Relaxed);
                    let _ = s.write_all(
                        b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
                    );
                    continue;
                }
                let (jobs, open) = (jobs.clone(), open.clone());
                let spawned = std::thread::Builder::new()
                    .name("metrics-client".into())
                    .spawn(move || {
                        answer_http(s, &jobs, timeout);
                        open.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    tracing::warn!("no thread for a metrics client");
                }
            }
        })?;
    Ok(())
}

/// Reads one HTTP request head (at most 1 KiB, whole within `timeout`) and answers it.
fn answer_http(s: TcpStream, jobs: &Jobs, timeout: Duration) {
    let mut head = Vec::new();
    let mut reader = Deadline {
        stream: &s,
        at: Instant::now() + timeout,
    };
    let mut buf = [0u8; 1024];
    while head.len() < buf.len() && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match reader.read(&mut buf[..1024 - head.len()]) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let response = if head.starts_with(b"GET /metrics ") {
        let body = jobs.metrics(|_| false);
        format!(
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    } else {
        "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_string()
    };
    let mut s = s;
    let _ = s.write_all(response.as_bytes());
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_log_tail_starts_at_a_line_and_reads_only_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("1.log");
        let lines: String = (0..100_000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, &lines).unwrap();
        let text = super::tail(&path, 30);
        assert_eq!(text, "line 99998\nline 99999\n");
        assert_eq!(super::tail(&path, 1 << 30), lines);
        assert_eq!(super::tail(&dir.path().join("none"), 30), "");
    }
}
