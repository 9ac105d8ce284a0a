//! The Unix socket: one thread per connection (at most `max_connections`), each identifying
//! its peer by `SO_PEERCRED` and answering framed requests. A client that sends nothing for
//! `request_timeout_s`, sends a frame over the limit or breaks the framing is disconnected;
//! a malformed request inside a good frame gets an error reply. Nothing a client does can make
//! the daemon wait on it: watches read events from a bounded queue the job fills without
//! blocking, and writes to a client time out.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::time::Duration;

use anyhow::{Context, bail};
use legend_daemon_api::{
    DeviceHealth, DeviceInfo, Envelope, ErrorCode, FrameError, JobSpec, MAX_FRAME, NvmeController,
    PROTOCOL_VERSION, Reply, Request, read_frame, write_message,
};
use legend_engine::Config;
use legend_engine::controllers::{self, QueueBackend, SharedController};
use legend_engine::file_store::StoreFile;
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

/// Counts a connection while it lives.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves `listener` until `shutdown` is set.
pub fn serve(
    listener: UnixListener,
    config: &DaemonConfig,
    jobs: Arc<Jobs>,
    shutdown: &AtomicBool,
) {
    listener
        .set_nonblocking(true)
        .expect("a listening socket can be made non-blocking");
    let active = Arc::new(AtomicUsize::new(0));
    while !shutdown.load(Ordering::Relaxed) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                tracing::warn!("accepting a connection: {e}");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let timeout = Duration::from_secs(config.request_timeout_s);
        let _ = stream.set_write_timeout(Some(timeout));
        if active.fetch_add(1, Ordering::Relaxed) >= config.max_connections {
            active.fetch_sub(1, Ordering::Relaxed);
            let mut s = stream;
            let _ = write_message(
                &mut s,
                &error(ErrorCode::Unavailable, "too many connections; try again"),
            );
            continue;
        }
        let slot = Slot(active.clone());
        let jobs = jobs.clone();
        let admin_group = config.admin_group.clone();
        let spawned = std::thread::Builder::new()
            .name("client".into())
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = connection(stream, &admin_group, timeout, &jobs) {
                    tracing::debug!(error = &e as &dyn std::error::Error, "client");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no thread for a client: {e}");
        }
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
    admin_group: &str,
    timeout: Duration,
    jobs: &Jobs,
) -> Result<(), FrameError> {
    stream.set_read_timeout(Some(timeout))?;
    let peer = Peer::of(&stream, admin_group)?;
    let mut reader = stream.try_clone()?;
    let mut writer = stream;
    loop {
        let bytes = match read_frame(&mut reader, MAX_FRAME) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(()),
            Err(e @ FrameError::TooLarge { .. }) => {
                // The rest of the stream cannot be trusted to be framed: answer and close.
                write_message(&mut writer, &error(ErrorCode::BadRequest, e.to_string()))?;
                return Err(e);
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
            Request::Watch { job } => watch(&mut writer, &peer, jobs, job)?,
            request => {
                let reply = answer(request, &peer, jobs);
                write_message(&mut writer, &reply)?;
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
            text: jobs.metrics(),
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
        Request::Watch { .. } => unreachable!("answered by watch()"),
    }
}

/// Queues `job` once it passed the checks; a new run on an NVMe namespace gets its extent.
fn submit(mut job: JobSpec, peer: &Peer, jobs: &Jobs) -> Reply {
    let assigned = check_submission(&job, peer, jobs).and_then(|(queue, config)| {
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
        && let Some(place) = train_placement(run, jobs::train_config(&info.spec).ok().as_ref())
        && let Err(why) = extents::release(&place, run, info.owner)
    {
        return error(
            ErrorCode::Unavailable,
            format!("job {id} deleted, but its run's extent was not freed: {why}"),
        );
    }
    Reply::Job { job: info }
}

/// Where the store of a train job on `run` is, if on a namespace: as the run recorded it, else
/// as the job's configuration places it.
fn train_placement(run: &Path, config: Option<&Config>) -> Option<extents::Placement> {
    extents::recorded_placement(run).or_else(|| extents::placement(config?, run))
}

/// Checks that `run` is a training run of its submitter's own (the job opens it again and
/// checks the opened directory: access::JobGuard), and that a store it keeps on a namespace is
/// still in the run's extent there.
fn check_run_to_read(peer: &Peer, run: &Path) -> Result<(), String> {
    access::check_may_read(peer, run)?;
    access::check_owns(peer, run)?;
    if !legend_engine::run::meta_path(run).exists() {
        return Err(format!(
            "{} is not a training run directory (no run.toml)",
            run.display()
        ));
    }
    match extents::recorded_placement(run) {
        Some(place) => extents::check(&place, run, peer),
        None => Ok(()),
    }
}

/// Checks a store path a train job names (`storage.path`): the submitter must be able to write
/// the file, or create it. Device nodes (`nvme`) are the daemon's; their extents keep users
/// apart.
fn check_store_path(peer: &Peer, config: &Config) -> Result<(), String> {
    let Some(path) = &config.storage.path else {
        return Ok(());
    };
    if config.storage.backend == legend_engine::config::Backend::Nvme {
        return Ok(());
    }
    if path.exists() {
        access::check_may_write(peer, path)
    } else {
        let parent = path
            .parent()
            .ok_or_else(|| format!("{}: not a file path", path.display()))?;
        access::check_may_create_in(peer, parent)
    }
}

/// Checks what a submission names against what its submitter may touch, and finds its queue;
/// a train job's configuration comes with it, parsed once.
fn check_submission(
    job: &JobSpec,
    peer: &Peer,
    jobs: &Jobs,
) -> Result<(String, Option<Config>), String> {
    let dir = job.dir();
    if !dir.is_absolute() {
        return Err(format!("{}: give an absolute path", dir.display()));
    }
    match job {
        JobSpec::Train {
            dataset,
            out,
            resume,
            ..
        } => {
            let parent = out
                .parent()
                .ok_or_else(|| format!("{}: not a run directory path", out.display()))?;
            access::check_may_create_in(peer, parent)?;
            if *resume && !legend_engine::run::meta_path(out).exists() {
                return Err(format!(
                    "{}: not a run directory (no run.toml)",
                    out.display()
                ));
            }
            if let Some(d) = dataset {
                if !d.is_absolute() {
                    return Err(format!("{}: give an absolute path", d.display()));
                }
                access::check_may_read(peer, d)?;
            }
            let config = jobs::train_config(job)?;
            check_store_path(peer, &config)?;
            if *resume && let Some(place) = train_placement(out, Some(&config)) {
                extents::check(&place, out, peer)?;
            }
            let busy = jobs
                .list(None)
                .into_iter()
                .any(|j| !j.state.is_final() && j.spec.dir() == out);
            if busy {
                return Err(format!(
                    "{}: another job is queued or running on this run",
                    out.display()
                ));
            }
            return Ok((jobs::queue_of(&config), Some(config)));
        }
        JobSpec::Eval { run, .. } => check_run_to_read(peer, run)?,
        JobSpec::Export { run, out, format } => {
            check_run_to_read(peer, run)?;
            format.parse::<legend_engine::export::Format>()?;
            if !out.is_absolute() {
                return Err(format!("{}: give an absolute path", out.display()));
            }
            let parent = out
                .parent()
                .ok_or_else(|| format!("{}: not a directory path", out.display()))?;
            access::check_may_create_in(peer, parent)?;
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
                }
                // The job ended, or went back to the queue with a stopping daemon.
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
    }
    let job = jobs.get(id).map_err(|_| FrameError::Truncated)?;
    write_message(writer, &Reply::Ended { job })
}

/// The last `max` bytes of the file at `path` (from a line start), or a note that it is empty.
fn tail(path: &Path, max: usize) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    let start = bytes.len().saturating_sub(max);
    let text = String::from_utf8_lossy(&bytes[start..]);
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

/// Serves `GET /metrics` on `127.0.0.1:port` until `shutdown` is set.
pub fn serve_metrics_http(
    port: u16,
    jobs: Arc<Jobs>,
    shutdown: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("serving metrics on 127.0.0.1:{port}"))?;
    listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            while !shutdown.load(Ordering::Relaxed) {
                let Ok((mut s, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                };
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                let mut head = [0u8; 1024];
                let n = s.read(&mut head).unwrap_or(0);
                let response = if head[..n].starts_with(b"GET /metrics ") {
                    let body = jobs.metrics();
                    format!(
                        "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_string()
                };
                let _ = s.write_all(response.as_bytes());
            }
        })?;
    Ok(())
}
