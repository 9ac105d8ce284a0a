//! Running a job: its process started (as its identity, in its cgroup, with what it needs and
//! nothing more), its messages turned into the job's progress, events and log, and its end
//! recorded however it came: as the process said, or as the kernel ended it (out of memory in
//! its cgroup, a signal, a panic).

use std::io::{BufRead, BufReader, Read};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use legend_daemon_api::{JobProcess, JobSpec, JobState, Progress};
use legend_engine::config::DeviceChoice;

use super::Jobs;
use super::estimate::{self, Needs};
use super::live::LiveJob;
use super::record::Record;
use super::table::{Start, Table};
use crate::access::Peer;
use crate::channel::{self, Ended, Frame, FromJob, JobStart, ServeStart, Submitter, ToJob};
use crate::paths::{DirId, clipped};
use crate::process::cgroup::{self, Bounds, JobCgroup};
use crate::process::spawn::{self, Identity, Launch};
use crate::serve::ServeState;

/// How often progress goes to the watchers.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// How often at most a running job's record is saved for its progress alone.
const PROGRESS_SAVE_EVERY: Duration = Duration::from_secs(5);

/// What the runner holds while the job runs.
struct Running {
    /// The submitter.
    submitter: Peer,
    /// The process's identity.
    identity: Identity,
    /// The device uid it holds (a device job).
    device_uid: Option<crate::process::DeviceUid>,
    /// The GPU a serve job loads into, and its budget there, until it says what it took.
    gpu_hold: Option<(usize, u64)>,
    /// The GPU bytes a serve job holds, released at its end.
    gpu_held: Option<(usize, u64)>,
    /// How the process said it ended.
    ended: Option<Ended>,
}

impl Jobs {
    /// Marks job `id` running and starts its runner.
    pub(super) fn start(self: &Arc<Self>, t: &mut Table, start: Start) -> JoinHandle<()> {
        let id = start.id;
        t.set_running(start);
        let entry = t.jobs.get_mut(&id).expect("a queued job");
        let info = &mut entry.record.info;
        info.started = Some(crate::handover::file_clock_secs());
        info.error = None;
        info.process = None;
        entry.stop = false;
        Self::broadcast(
            entry,
            serde_json::json!({"type": "state", "state": "running"}),
        );
        let record = entry.record.clone();
        self.save(t, id);
        self.log(id, "started");
        tracing::info!("job {id}: started");
        let jobs = self.clone();
        std::thread::Builder::new()
            .name(format!("job-{id}"))
            .spawn(move || {
                let result = jobs.run(&record);
                jobs.finish(id, result);
            })
            .expect("spawning a job's runner")
    }

    /// Runs job `record` in a process of its own, to its end.
    fn run(self: &Arc<Self>, record: &Record) -> Result<Ended, String> {
        let id = record.info.id;
        let owner = record.info.owner;
        let submitter = match record.gid {
            Some(gid) => Peer::of_ids(owner, gid),
            None => Peer::of_uid(owner),
        };
        let gid = submitter.gid;
        let device_uid = match &record.device_node {
            Some(_) => Some(self.device_uids.take()?),
            None => None,
        };
        let identity = match &device_uid {
            Some(d) => Identity {
                uid: d.uid,
                gid: nix::unistd::getegid().as_raw(),
                groups: Vec::new(),
            },
            None => Identity {
                uid: owner,
                gid,
                groups: submitter.groups.clone(),
            },
        };
        let resuming =
            record.run_made || matches!(record.info.spec, JobSpec::Train { resume: true, .. });
        let needs = estimate::needs(
            &record.info.spec,
            &submitter,
            &record.queue,
            resuming,
            self.settings.serve_host_memory,
        );
        check_memlock(&needs)?;
        if device_uid.is_some() {
            // What an earlier device job of the run made and could not hand over (the daemon
            // died under it) is the submitter's before this one starts.
            self.hand_over(record, &submitter, |uid| self.device_uids.contains(uid));
        }
        let cgroup = match cgroup::hierarchy() {
            Some(h) => {
                let bounds = Bounds {
                    memory: needs.memory_limit(),
                    cpus: needs.cpus,
                };
                let name = self.cgroup_name(&id.to_string());
                Some(Arc::new(
                    JobCgroup::create(h, &name, bounds)
                        .map_err(|e| format!("making the job's cgroup: {e}"))?,
                ))
            }
            None => None,
        };
        let cache = self.kernel_cache(&identity)?;
        let mut running = Running {
            submitter,
            identity,
            device_uid,
            gpu_hold: None,
            gpu_held: None,
            ended: None,
        };
        let serve = match &record.info.spec {
            JobSpec::Serve { group, device, .. } => {
                let (start, hold) = self.serve_placement(device.as_deref(), group.as_deref())?;
                running.gpu_hold = hold;
                Some(start)
            }
            _ => None,
        };
        let result = self.supervise(record, &mut running, &needs, cgroup, &cache, serve);
        self.release_gpu(&mut running);
        result
    }

    /// Starts job `record`'s process and follows it to its end.
    fn supervise(
        self: &Arc<Self>,
        record: &Record,
        running: &mut Running,
        needs: &Needs,
        cgroup: Option<Arc<JobCgroup>>,
        cache: &OwnedFd,
        serve: Option<ServeStart>,
    ) -> Result<Ended, String> {
        let (id, owner) = (record.info.id, record.info.owner);
        let procs = match &cgroup {
            Some(c) => c.procs_files()?,
            None => Vec::new(),
        };
        let env = spawn::job_env(&record.devices);
        let launched = spawn::launch(&Launch {
            program: Path::new("/proc/self/exe"),
            args: &["job"],
            identity: &running.identity,
            cgroup_procs: &procs,
            memlock: needs.memlock(memlock_ceiling()),
            cache_dir: cache,
            env: &env,
            // A device job's files stay writable by the daemon's group (its next job on the
            // run has it); a submitter's job makes files as their own processes would.
            umask: if running.device_uid.is_some() {
                0o002
            } else {
                0o022
            },
        })
        .map_err(|e| format!("starting the job's process: {e}"))?;
        drop(procs);
        let spawn::Launched {
            mut child,
            channel: reader,
            stderr,
        } = launched;
        let pid = child.id();
        let process = JobProcess {
            pid,
            uid: running.identity.uid,
            cgroup: cgroup.as_ref().map(|c| c.shown.clone()),
            memory_limit: cgroup.as_ref().map(|_| needs.memory_limit()),
            peak_memory: None,
        };
        self.describe_start(id, &process, needs);
        let writer = reader
            .try_clone()
            .map_err(|e| format!("the job's channel: {e}"))?;
        let serve_state = serve.as_ref().map(|s| ServeState::new(owner, s.group));
        let live = Arc::new(LiveJob::new(
            writer,
            process.clone(),
            cgroup.clone(),
            serve_state,
        ));
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, live.clone());
        self.update(id, |r| r.info.process = Some(process.clone()));
        let logger = self.log_lines(id, stderr);
        let start = JobStart {
            id,
            spec: record.info.spec.clone(),
            submitter: Submitter {
                uid: owner,
                gid: running.submitter.gid,
                groups: running.submitter.groups.clone(),
            },
            device_identity: running.device_uid.is_some(),
            run_made: record.run_made,
            expect: record.expect.clone(),
            serve,
        };
        let sent = live.send(&ToJob::Start(Box::new(start)));
        if self.lock().jobs.get(&id).is_some_and(|e| e.stop) {
            live.stop();
        }
        let broke = match sent {
            Err(e) => Some(format!("sending the job to its process: {e}")),
            Ok(()) => self.follow(id, &live, reader, running).err(),
        };
        if broke.is_some() {
            let _ = child.kill();
        }
        let status = child
            .wait()
            .map_err(|e| format!("waiting for the job's process: {e}"));
        let _ = logger.join();
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(s) = &live.serve {
            s.fail_pending();
        }
        let peak = live.peak_memory();
        let oom_kills = live.oom_kills();
        self.update(id, |r| {
            if let Some(p) = &mut r.info.process {
                p.peak_memory = peak;
            }
        });
        if running.device_uid.is_some() {
            let uid = running.identity.uid;
            self.hand_over(record, &running.submitter, |u| u == uid);
        }
        drop(live);
        drop(cgroup);
        if let Some(why) = broke {
            return Err(format!(
                "its process broke the daemon's channel ({why}): killed"
            ));
        }
        let status = status?;
        match running.ended.take() {
            Some(ended) if status.success() => Ok(ended),
            _ => Err(why_it_died(status, oom_kills, needs, &process, peak)),
        }
    }

    /// Logs where and how the job's process runs.
    fn describe_start(&self, id: u64, p: &JobProcess, needs: &Needs) {
        let bound = match (&p.cgroup, p.memory_limit) {
            (Some(c), Some(limit)) => format!(
                "in cgroup {c}, memory limit {} MiB (its estimate, {} MiB, × 1.25 + 512 MiB){}",
                limit >> 20,
                needs.estimate >> 20,
                needs.cpus.map_or(String::new(), |n| format!(", {n} CPUs"))
            ),
            _ => "without a cgroup of its own".into(),
        };
        self.log(
            id,
            &format!(
                "process {} as uid {} {bound}; locked memory at most {} MiB",
                p.pid,
                p.uid,
                needs.memlock(memlock_ceiling()) >> 20
            ),
        );
    }

    /// The kernel cache directory of `identity`, opened to hand to its process: its own, so
    /// that no one else's job can plant a kernel it loads.
    fn kernel_cache(&self, identity: &Identity) -> Result<OwnedFd, String> {
        let dir = self.kernels.join(identity.uid.to_string());
        let made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
        if let Err(e) = made
            && e.kind() != std::io::ErrorKind::AlreadyExists
        {
            return Err(format!("{}: {e}", dir.display()));
        }
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let fd = OwnedFd::from(opened);
        let uid = nix::unistd::Uid::from_raw(identity.uid);
        let gid = nix::unistd::Gid::from_raw(identity.gid);
        if nix::sys::stat::fstat(&fd).is_ok_and(|st| st.st_uid != identity.uid) {
            nix::unistd::fchown(&fd, Some(uid), Some(gid))
                .map_err(|e| format!("{}: giving it to uid {}: {e}", dir.display(), uid))?;
        }
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        Ok(fd)
    }

    /// Reads the process's standard error into the job's log, a line at a time (each cut to
    /// `log::MAX_LINE_BYTES`, however long the process makes it).
    fn log_lines(self: &Arc<Self>, id: u64, stderr: impl Read + Send + 'static) -> JoinHandle<()> {
        let jobs = self.clone();
        std::thread::Builder::new()
            .name(format!("job-{id}-log"))
            .spawn(move || {
                let mut r = BufReader::new(stderr);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    let limit = super::log::MAX_LINE_BYTES as u64 + 1;
                    match (&mut r).take(limit).read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {
                            if !line.ends_with(b"\n") {
                                // Cut: the rest of the line goes.
                                let _ = r.skip_until(b'\n');
                            }
                            jobs.job_says(id, &String::from_utf8_lossy(&line));
                        }
                    }
                }
            })
            .expect("spawning a job's log reader")
    }

    /// Follows the process's messages until its channel ends.
    fn follow(
        &self,
        id: u64,
        live: &LiveJob,
        mut reader: std::os::unix::net::UnixStream,
        running: &mut Running,
    ) -> Result<(), String> {
        loop {
            match channel::read_from_job(&mut reader) {
                Ok(Some(Frame::Message(m))) => self.on_message(id, m, live, running),
                Ok(Some(Frame::Answer {
                    id: q,
                    queries,
                    reply,
                })) => {
                    if let Some(s) = &live.serve {
                        s.deliver(q, queries, reply);
                    }
                }
                Ok(None) => return Ok(()),
                // The process died: its status says how.
                Err(channel::ChannelError::Io(_)) => return Ok(()),
                Err(channel::ChannelError::Protocol(why)) => return Err(why),
            }
        }
    }

    /// Changes job `id`'s record with `f` and saves it.
    fn update(&self, id: u64, f: impl FnOnce(&mut Record)) {
        let mut t = self.lock();
        if let Some(e) = t.jobs.get_mut(&id) {
            f(&mut e.record);
            self.save(&mut t, id);
        }
    }

    /// A message of job `id`'s process.
    fn on_message(&self, id: u64, message: FromJob, live: &LiveJob, running: &mut Running) {
        let mut t = self.lock();
        let Some(entry) = t.jobs.get_mut(&id) else {
            return;
        };
        let p = &mut entry.record.info.progress;
        match message {
            FromJob::Engine(engine) => {
                // A job on several GPUs numbers them from cuda:0; the daemon's numbers are
                // the ones its users know: keep those, with the engine's model.
                let shown = match (entry.record.devices.is_empty(), engine.find(" (")) {
                    (false, Some(model)) => {
                        format!("{}{}", entry.record.device_label(), &engine[model..])
                    }
                    _ => engine,
                };
                entry.record.info.device = Some(clipped(&shown, 128));
                self.save(&mut t, id);
            }
            FromJob::RunMade => {
                entry.record.run_made = true;
                let out = entry.record.info.spec.dir().clone();
                let made = running
                    .submitter
                    .open_dir(&out)
                    .ok()
                    .and_then(|d| DirId::of(&d).ok());
                if let Some(run_id) = made {
                    t.set_run_id(id, run_id);
                }
                self.save(&mut t, id);
            }
            FromJob::EpochStarted {
                epoch,
                epochs,
                edges,
                edges_done,
            } => {
                *p = Progress {
                    epoch,
                    epochs,
                    edges,
                    edges_done,
                    edges_per_sec: p.edges_per_sec,
                };
            }
            FromJob::Progress(done) => {
                p.edges_done = done.min(p.edges);
                if entry.last_progress.elapsed() >= PROGRESS_EVERY {
                    entry.last_progress = Instant::now();
                    let progress = *p;
                    Self::broadcast(
                        entry,
                        serde_json::json!({"type": "progress", "progress": progress}),
                    );
                }
            }
            FromJob::Epoch(e) => {
                p.edges_per_sec = e.edges_per_sec;
                p.edges_done = p.edges;
                entry.io_bytes = entry.io_bytes.saturating_add(e.io_bytes);
                entry.train_seconds += e.seconds.max(0.0);
                Self::broadcast(entry, serde_json::json!({"type": "epoch", "line": e.line}));
                // Progress only: saved every few seconds, not at every epoch of a tiny one.
                if entry.last_saved.elapsed() >= PROGRESS_SAVE_EVERY {
                    entry.last_saved = Instant::now();
                    self.save(&mut t, id);
                }
                drop(t);
                self.log(id, &e.text);
            }
            FromJob::Checkpoint(position) => {
                // Progress since the daemon last died under the job: it did not kill it.
                if entry.record.interruptions > 0 {
                    entry.record.interruptions = 0;
                    self.save(&mut t, id);
                }
                let entry = t.jobs.get(&id).expect("looked up above");
                let position = clipped(&position, 256);
                Self::broadcast(
                    entry,
                    serde_json::json!({"type": "checkpoint", "position": position}),
                );
            }
            FromJob::Evaluating(split) => {
                let split = clipped(&split, 32);
                Self::broadcast(
                    entry,
                    serde_json::json!({"type": "evaluating", "split": split}),
                );
            }
            FromJob::Evaluated { line, text } => {
                // Watchers get the line (and print it as the job's result); the log the text.
                Self::broadcast(
                    entry,
                    serde_json::json!({"type": "evaluated", "line": line}),
                );
                drop(t);
                self.log(id, &text);
            }
            FromJob::Log(text) => {
                drop(t);
                self.job_says(id, &text);
            }
            FromJob::Serving(serving) => {
                let Some(state) = &live.serve else {
                    return;
                };
                if !state.is_serving() {
                    entry.record.info.device = Some(clipped(&serving.device, 32));
                    // Loaded since the daemon last died under the job: the job did not kill it.
                    entry.record.interruptions = 0;
                    self.save(&mut t, id);
                    drop(t);
                    if let Some((ordinal, budget)) = running.gpu_hold.take() {
                        let took = serving.gpu_bytes.min(budget);
                        self.serve_gpu.loaded(ordinal, took);
                        running.gpu_held = Some((ordinal, took));
                    }
                }
                state.set_serving(*serving);
            }
            FromJob::Ended(ended) => running.ended = Some(ended),
        }
    }

    /// Gives back the GPU memory a serve job held or was loading into.
    fn release_gpu(&self, running: &mut Running) {
        if let Some((ordinal, _)) = running.gpu_hold.take() {
            self.serve_gpu.loaded(ordinal, 0);
        }
        if let Some((ordinal, bytes)) = running.gpu_held.take() {
            self.serve_gpu.release(ordinal, bytes);
        }
    }

    /// Makes the submitter the owner of what a device job's process made in the job's output
    /// directory (entries owned by a uid `made_by` accepts, born since the job's submission).
    fn hand_over(&self, record: &Record, submitter: &Peer, made_by: impl Fn(u32) -> bool + Sync) {
        let out = match &record.info.spec {
            JobSpec::Train { out, .. } | JobSpec::Export { out, .. } => out,
            JobSpec::Eval { .. } | JobSpec::Serve { .. } => return,
        };
        let id = record.info.id;
        let handed =
            crate::handover::hand_over_outputs(out, submitter.uid, record.info.submitted, &made_by);
        match handed {
            Ok(0) => {}
            Ok(n) => tracing::debug!("job {id}: {n} outputs handed to uid {}", submitter.uid),
            Err(e) => self.log(
                id,
                &format!(
                    "{}: the outputs stay the job's identity's (handing them to uid {}: {e})",
                    out.display(),
                    submitter.uid
                ),
            ),
        }
    }

    /// Where a serve job that asked for `device` (none: `serve_device`) answers, and the GPU
    /// share it loads into (held until it says what it took). A GPU is used only where
    /// `serve_gpu_memory` allows; `auto` falls back to the CPU, a named `cuda:N` is refused.
    fn serve_placement(
        &self,
        device: Option<&str>,
        group: Option<&str>,
    ) -> Result<(ServeStart, Option<(usize, u64)>), String> {
        let s = &self.settings;
        let group = group.map(crate::access::group_id).transpose()?;
        let choice = match device {
            Some(d) => d.parse::<DeviceChoice>()?,
            None => s.serve_device,
        };
        let start = |device: DeviceChoice, budget| ServeStart {
            device: device.to_string(),
            gpu_budget: budget,
            cache_fraction: s.serve_cache_fraction,
            host_limit: s.serve_host_memory,
            group,
        };
        let ordinal = match choice {
            DeviceChoice::Cpu => return Ok((start(DeviceChoice::Cpu, None), None)),
            DeviceChoice::Cuda(n) => n,
            DeviceChoice::Auto => 0,
        };
        if s.serve_gpu_memory == 0.0 {
            return match choice {
                DeviceChoice::Auto => Ok((start(DeviceChoice::Cpu, None), None)),
                _ => Err(format!(
                    "serving on {choice}: this daemon serves runs on the CPU only \
                     (serve_gpu_memory = 0)"
                )),
            };
        }
        let total = match legend_cuda::device_memory(ordinal) {
            Ok(total) => total,
            Err(e) => {
                return match choice {
                    // No GPU to share: the query side finds the same and says why it is on
                    // the CPU.
                    DeviceChoice::Auto => Ok((start(choice, None), None)),
                    _ => Err(format!("serving on {choice}: {e}")),
                };
            }
        };
        let budget = self
            .serve_gpu
            .begin_load(ordinal, (total as f64 * s.serve_gpu_memory) as u64);
        Ok((start(choice, Some(budget)), Some((ordinal, budget))))
    }

    /// Records how job `id` ended and tells its watchers.
    fn finish(&self, id: u64, result: Result<Ended, String>) {
        let mut t = self.lock();
        let stopping = t.stopping;
        let Some(entry) = t.jobs.get_mut(&id) else {
            return;
        };
        let serve = matches!(entry.record.info.spec, JobSpec::Serve { .. });
        let (state, text) = match result {
            // A serve job stopped with the daemon serves again after the next start.
            Ok(Ended::Done(_)) if serve && stopping => (
                JobState::Queued,
                "stopped with the daemon; serves again at the next start".to_string(),
            ),
            Ok(Ended::Done(result)) => {
                let result = result.filter(|r| {
                    serde_json::to_vec(r).map_or(0, |b| b.len()) <= super::record::MAX_RESULT_BYTES
                });
                entry.record.info.result = result;
                (JobState::Succeeded, "succeeded".to_string())
            }
            Ok(Ended::Stopped(at)) if stopping => (
                JobState::Queued,
                format!(
                    "stopped with the daemon at {}; resumes at the next start",
                    clipped(&at, 256)
                ),
            ),
            Ok(Ended::Stopped(at)) => (
                JobState::Cancelled,
                format!("cancelled; checkpointed at {}", clipped(&at, 256)),
            ),
            Ok(Ended::Failed(e)) | Err(e) => {
                let e = clipped(&e, super::record::MAX_ERROR_BYTES);
                entry.record.info.error = Some(e.clone());
                (JobState::Failed, format!("failed: {e}"))
            }
        };
        // Ending the watches makes each report the final state: only once the log says how
        // the job ended, so a watcher that reads it next finds that.
        let mut watchers = std::mem::take(&mut entry.watchers);
        if state == JobState::Queued {
            t.set_requeued(id);
        } else {
            t.set_ended(id, state, crate::handover::file_clock_secs());
        }
        self.save(&mut t, id);
        drop(t);
        self.log(id, &text);
        watchers.close_all();
        tracing::info!("job {id}: {text}");
        self.changed.notify_all();
    }
}

/// The most `RLIMIT_MEMLOCK` the daemon may give a process: its own hard limit (the unit's
/// `LimitMEMLOCK`), unless it may raise it (`CAP_SYS_RESOURCE`); `None`: no bound.
pub fn memlock_ceiling() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct.
    let read = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0;
    (read && limit.rlim_max != libc::RLIM_INFINITY && !spawn::holds(spawn::CAP_SYS_RESOURCE))
        .then_some(limit.rlim_max)
}

/// Refuses a job whose store's pins exceed what the daemon may give a process.
pub fn check_memlock(needs: &Needs) -> Result<(), String> {
    match memlock_ceiling() {
        Some(hard) if needs.pins > hard => Err(format!(
            "the job's store would lock {} MiB of memory (its buffers and mappings), more than \
             the daemon's LimitMEMLOCK allows a process ({} MiB): raise LimitMEMLOCK in the \
             unit, or use a smaller storage.buffer_capacity",
            needs.pins >> 20,
            hard >> 20
        )),
        _ => Ok(()),
    }
}

/// Why a job's process ended without saying how, from its exit status.
fn why_it_died(
    status: std::process::ExitStatus,
    oom_kills: u64,
    needs: &Needs,
    p: &JobProcess,
    peak: Option<u64>,
) -> String {
    match status.signal() {
        Some(libc::SIGKILL) if oom_kills > 0 => {
            let (limit, peak) = (p.memory_limit.unwrap_or(0), peak.unwrap_or(0));
            let why = if peak >= limit / 100 * 95 {
                format!("when its cgroup reached its limit of {} MiB", limit >> 20)
            } else {
                // Its own limit was not reached: the daemon's cgroup (the service's MemoryMax),
                // or the machine, ran out, and the kernel took a job first.
                format!(
                    "when the memory around it ran out (the daemon's cgroup, or the machine's; \
                     its own limit is {} MiB)",
                    limit >> 20
                )
            };
            format!(
                "ran out of memory: the kernel killed its process {why}; its estimate was {} MiB \
                 (its limit: × 1.25 + 512 MiB), its peak {} MiB",
                needs.estimate >> 20,
                peak >> 20
            )
        }
        Some(signal) => format!(
            "its process {} was killed by signal {signal} ({}){}",
            p.pid,
            signal_name(signal),
            if signal == libc::SIGKILL {
                " (by the kernel's OOM killer when the machine ran out of memory, or by hand)"
            } else {
                ""
            }
        ),
        None => match status.code() {
            Some(101) => "its process panicked (the job's log has the message)".into(),
            Some(code) => format!(
                "its process exited with status {code} without saying how the job ended (the \
                 job's log may say why)"
            ),
            None => "its process ended without a status".into(),
        },
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGBUS => "SIGBUS",
        libc::SIGINT => "SIGINT",
        _ => "a signal",
    }
}
