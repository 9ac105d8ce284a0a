//! The daemon's jobs: queued, running and ended, kept in the state directory across restarts
//! (`jobs/ID.json` and `jobs/ID.log`); a scheduler that starts queued jobs when their queue has
//! room, fairly between users ([`table`]); and the runners, each of which starts a job's
//! process and follows it to its end ([`runner`]).

pub mod estimate;
mod live;
pub mod log;
mod metrics;
pub mod record;
mod runner;

pub use runner::check_memlock;
pub mod table;
pub mod watch;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use legend_daemon_api::{JobInfo, JobSpec, JobState, Progress, Reply};
use legend_engine::config::DeviceChoice;

use self::live::LiveJob;
use self::record::{RECORD_FORMAT, Record, private_dir, write_durably};
use self::table::{Entry, GPU_SET_QUEUE, RunKey, Slots, Table};
use self::watch::Watcher;
use crate::access::Peer;
use crate::config::DaemonConfig;
use crate::process::DeviceUids;

/// The queue of serve jobs: they take no CPU or GPU job slot.
pub const SERVE_QUEUE: &str = "serve";

/// Where the highest job id ever given is kept once the newest job is deleted (ids are never
/// reused: the records alone would give a deleted newest job's id again).
const LAST_ID_FILE: &str = "last-id";

/// How many times a job may be found running at a daemon start before it is failed.
const MAX_INTERRUPTIONS: u32 = 3;

/// The policy the daemon's configuration sets.
pub struct Settings {
    /// The GPUs the daemon schedules: those it sees (its `CUDA_VISIBLE_DEVICES`).
    gpu_count: u32,
    cpu: Slots,
    gpu: Slots,
    serve: Slots,
    /// `max_jobs_per_user`.
    max_per_user: usize,
    /// `max_ended_jobs_per_user`.
    max_ended_per_user: usize,
    /// `serve_jobs_per_user`.
    serve_per_user: usize,
    /// `serve_device`, `serve_gpu_memory`, `serve_cache_fraction`.
    pub serve_device: DeviceChoice,
    pub serve_gpu_memory: f64,
    pub serve_cache_fraction: f64,
    /// `serve_host_memory_mib`, in bytes.
    pub serve_host_memory: Option<u64>,
}

/// The daemon's jobs.
pub struct Jobs {
    table: Mutex<Table>,
    changed: Condvar,
    /// `STATE_DIR/jobs`.
    dir: PathBuf,
    /// `STATE_DIR/kernels`: a kernel cache per identity.
    kernels: PathBuf,
    /// Tells this daemon's job cgroups from another's (a hash of its state directory).
    cgroup_tag: String,
    settings: Settings,
    /// Running jobs' processes.
    live: Mutex<HashMap<u64, Arc<LiveJob>>>,
    /// The GPU memory serve jobs hold.
    serve_gpu: crate::serve::GpuShares,
    device_uids: Arc<DeviceUids>,
    /// Requests answered, for the metrics.
    pub requests: AtomicU64,
}

/// Why a job could not be queued or touched.
#[derive(Debug)]
pub enum JobError {
    /// No such job.
    NotFound(u64),
    /// The request cannot be carried out.
    Refused(String),
}

/// A submission that passed its checks.
pub struct Submission {
    /// The job.
    pub spec: JobSpec,
    /// Its queue.
    pub queue: String,
    /// The submitter.
    pub peer: Peer,
    /// Its run's identity, when it exists.
    pub run_id: Option<crate::paths::DirId>,
    /// The store its run names on a namespace.
    pub expect: Option<crate::extents::RecordedStore>,
    /// The device node it holds.
    pub device_node: Option<String>,
    /// GPUs it trains on at once (1 outside the `cuda` queue).
    pub gpus: u32,
}

/// Why a job on `wanted` GPUs cannot run under a daemon that schedules `count`.
fn too_many_gpus(wanted: u32, count: u32) -> String {
    format!(
        "training.gpus = {wanted}: this daemon schedules {count} GPUs (those of its \
         CUDA_VISIBLE_DEVICES that the driver reports)"
    )
}

/// FNV-1a of `bytes`, in hex: a short stable name.
fn tag_of(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{:08x}", h as u32)
}

impl Jobs {
    /// Loads the jobs of `config.state_dir`. Jobs that were running when the daemon stopped
    /// are queued again; a train job that had begun resumes from its last checkpoint.
    pub fn open(config: &DaemonConfig) -> anyhow::Result<Arc<Jobs>> {
        use std::os::unix::fs::PermissionsExt;
        let dir = config.state_dir.join("jobs");
        let kernels = config.state_dir.join("kernels");
        // The state directory may be the admin's choice (`--state-dir`), left as it is when it
        // exists; `jobs` and `kernels` in it are the daemon's own, private whatever they were.
        for d in [&dir, &kernels] {
            private_dir(d)
                .and_then(|()| std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)))
                .map_err(|e| anyhow::anyhow!("{}: {e}", d.display()))?;
        }
        let gpu_count = u32::try_from(legend_cuda::device_count()).unwrap_or(u32::MAX);
        let mut table = Table::default();
        let last_id = dir.join(LAST_ID_FILE);
        match std::fs::read_to_string(&last_id) {
            Ok(text) => {
                table.next_id = text
                    .trim()
                    .parse()
                    .map_err(|e| anyhow::anyhow!("{}: not a job id ({e})", last_id.display()))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("{}: {e}", last_id.display()),
        }
        // Jobs whose record changes here: only they are written again.
        let mut changed = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "log") {
                // Logs written by a daemon before they were private.
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            }
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let mut record = match Record::read(&path) {
                Ok(r) => r,
                Err(why) if why.contains("newer legendd") => {
                    anyhow::bail!("{}: {why}", path.display())
                }
                Err(why) => {
                    // Set aside, not lost: the administrator may look at it.
                    let aside = path.with_extension("json.refused");
                    tracing::warn!(
                        "{}: refused ({why}); moved to {}",
                        path.display(),
                        aside.display()
                    );
                    std::fs::rename(&path, &aside)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                    continue;
                }
            };
            table.next_id = table.next_id.max(record.info.id);
            if record.format != RECORD_FORMAT || record.info.state == JobState::Running {
                changed.push(record.info.id);
            }
            if record.info.state == JobState::Running {
                record.interruptions += 1;
                if record.interruptions >= MAX_INTERRUPTIONS {
                    let why = format!(
                        "the daemon stopped {} times while this job ran (the job may be what \
                         stopped it); it is not started again",
                        record.interruptions
                    );
                    tracing::warn!("job {}: {why}", record.info.id);
                    record.info.state = JobState::Failed;
                    record.info.error = Some(why);
                    record.info.ended = Some(crate::handover::file_clock_secs());
                } else {
                    record.info.state = JobState::Queued;
                    tracing::info!("job {} was running: queued again", record.info.id);
                }
            }
            if record.info.state == JobState::Queued
                && record.queue == GPU_SET_QUEUE
                && record.gpus > gpu_count
            {
                // It would wait for ever, and hold GPUs against every later job.
                let why = too_many_gpus(record.gpus, gpu_count);
                tracing::warn!("job {}: {why}", record.info.id);
                record.info.state = JobState::Failed;
                record.info.error = Some(why);
                record.info.ended = Some(crate::handover::file_clock_secs());
                if !changed.contains(&record.info.id) {
                    changed.push(record.info.id);
                }
            }
            table.insert(Entry::new(record));
        }
        let slots = |total: usize, reserved: usize, per_user: usize| Slots {
            total,
            reserved,
            per_user,
        };
        let jobs = Arc::new(Jobs {
            table: Mutex::new(table),
            changed: Condvar::new(),
            cgroup_tag: tag_of(config.state_dir.as_os_str().as_encoded_bytes()),
            dir,
            kernels,
            settings: Settings {
                gpu_count,
                cpu: slots(
                    config.cpu_jobs,
                    config.reserved_job_slots,
                    config.running_jobs_per_user,
                ),
                gpu: slots(
                    config.gpu_jobs,
                    config.reserved_job_slots,
                    config.running_jobs_per_user,
                ),
                serve: slots(
                    config.serve_jobs,
                    config.reserved_serve_jobs,
                    config.serve_jobs_per_user,
                ),
                max_per_user: config.max_jobs_per_user,
                max_ended_per_user: config.max_ended_jobs_per_user,
                serve_per_user: config.serve_jobs_per_user,
                serve_device: config
                    .serve_device
                    .parse()
                    .map_err(|e| anyhow::anyhow!("serve_device: {e}"))?,
                serve_gpu_memory: config.serve_gpu_memory,
                serve_cache_fraction: config.serve_cache_fraction,
                serve_host_memory: config
                    .serve_host_memory_mib
                    .map(|m| m.saturating_mul(1 << 20)),
            },
            live: Mutex::default(),
            serve_gpu: crate::serve::GpuShares::default(),
            device_uids: DeviceUids::new(
                config.device_uid_range().map_err(|e| anyhow::anyhow!(e))?,
            ),
            requests: AtomicU64::new(0),
        });
        for id in changed {
            jobs.persist(&jobs.lock(), id)
                .map_err(|e| anyhow::anyhow!("{}: {e}", jobs.record_path(id).display()))?;
        }
        if let Some(h) = crate::process::cgroup::hierarchy() {
            crate::process::cgroup::remove_left(h, &jobs.cgroup_name(""));
        }
        Ok(jobs)
    }

    /// The cgroup of job `id` (`id` empty: the prefix of this daemon's jobs' cgroups).
    fn cgroup_name(&self, id: &str) -> String {
        format!("legend-{}-job-{id}", self.cgroup_tag)
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Job `id`'s log file.
    pub fn log_path(&self, id: u64) -> PathBuf {
        log::paths(&self.dir, id).0
    }

    /// Appends a line to job `id`'s log.
    fn log(&self, id: u64, text: &str) {
        log::append(&self.dir, id, text);
    }

    /// A line job `id`'s process says (its messages, its standard error): to its log and its
    /// watchers (`log` events), so that a job says how it went and ended.
    fn job_says(&self, id: u64, text: &str) {
        let text = crate::paths::clipped(text.trim_end(), log::MAX_LINE_BYTES);
        self.log(id, &text);
        if let Some(e) = self.lock().jobs.get(&id) {
            Self::broadcast(e, serde_json::json!({"type": "log", "text": text}));
        }
    }

    /// Writes job `id`'s record durably (synced temporary file, rename, synced directory), so
    /// a crash keeps the old or the new.
    fn persist(&self, table: &Table, id: u64) -> std::io::Result<()> {
        let Some(entry) = table.jobs.get(&id) else {
            return Ok(());
        };
        write_durably(&self.record_path(id), &entry.record.to_bytes())
    }

    /// [`Jobs::persist`] for a change already made, which stays made in memory when the disk
    /// fails (the job runs on; the error goes to the daemon's log). The size answers with it
    /// take is updated too.
    fn save(&self, table: &mut Table, id: u64) {
        if let Some(e) = table.jobs.get_mut(&id) {
            e.bytes = serde_json::to_vec(&e.record.info).map_or(0, |b| b.len());
        }
        if let Err(e) = self.persist(table, id) {
            tracing::error!(
                "job {id}: saving its record {}: {e}",
                self.record_path(id).display()
            );
        }
    }

    /// Checks that `peer` may queue `spec` now: their counts, the run's, the serve jobs'.
    fn admit(&self, t: &Table, s: &Submission) -> Result<(), JobError> {
        let owner = s.peer.uid;
        let refuse = |why: String| Err(JobError::Refused(why));
        if t.stopping {
            return refuse("the daemon is stopping".into());
        }
        let unfinished = t.unfinished(owner);
        if unfinished >= self.settings.max_per_user {
            return refuse(format!(
                "uid {owner} has {unfinished} jobs queued or running (max_jobs_per_user = {}): \
                 wait for some to end, or cancel some",
                self.settings.max_per_user
            ));
        }
        let ended = t.ended(owner);
        if ended >= self.settings.max_ended_per_user {
            return refuse(format!(
                "uid {owner} keeps {ended} ended jobs (max_ended_jobs_per_user = {}): delete \
                 some (legendctl delete ID) before submitting more",
                self.settings.max_ended_per_user
            ));
        }
        if matches!(s.spec, JobSpec::Serve { .. }) && !s.peer.admin {
            let serving = t.serving(owner);
            if serving >= self.settings.serve_per_user {
                return refuse(format!(
                    "uid {owner} has {serving} serve jobs queued or running \
                     (serve_jobs_per_user = {}): cancel one first",
                    self.settings.serve_per_user
                ));
            }
        }
        if s.queue == GPU_SET_QUEUE && s.gpus > self.settings.gpu_count {
            return refuse(too_many_gpus(s.gpus, self.settings.gpu_count));
        }
        let dir = s.spec.dir();
        let keys = [s.run_id.map(RunKey::Dir), Some(RunKey::Path(dir.clone()))];
        if matches!(s.spec, JobSpec::Train { .. }) && keys.iter().flatten().any(|k| t.run_busy(k)) {
            return refuse(format!(
                "{}: another job is queued or running on this run",
                dir.display()
            ));
        }
        Ok(())
    }

    /// Queues a submission that passed its checks.
    pub fn submit(&self, s: Submission) -> Result<JobInfo, JobError> {
        let mut t = self.lock();
        self.admit(&t, &s)?;
        t.next_id += 1;
        let id = t.next_id;
        let owner = s.peer.uid;
        let info = JobInfo {
            id,
            owner,
            spec: s.spec,
            state: JobState::Queued,
            device: None,
            submitted: crate::handover::file_clock_secs(),
            started: None,
            ended: None,
            progress: Progress::default(),
            error: None,
            result: None,
            process: None,
        };
        let mut record = Record {
            format: RECORD_FORMAT,
            info,
            queue: s.queue,
            gpus: s.gpus,
            devices: Vec::new(),
            run_made: false,
            interruptions: 0,
            gid: Some(s.peer.gid),
            admin: s.peer.admin,
            run_id: s.run_id,
            expect: s.expect,
            device_node: s.device_node,
        };
        record.info.device = Some(record.device_label());
        let info = record.info.clone();
        t.insert(Entry::new(record));
        // Acknowledged only once on disk: a job the daemon said it queued survives a crash.
        if let Err(e) = self.persist(&t, id) {
            t.set_ended(id, JobState::Failed, 0);
            t.remove(id);
            drop(t);
            let path = self.record_path(id);
            let _ = std::fs::remove_file(path.with_extension("tmp"));
            tracing::error!(
                "job {id} not queued: saving its record {}: {e}",
                path.display()
            );
            return Err(JobError::Refused(format!(
                "not queued: the daemon could not save the job ({}: {e})",
                path.display()
            )));
        }
        drop(t);
        self.log(
            id,
            &format!("submitted by uid {owner}: {}", info.spec.kind()),
        );
        tracing::info!("job {id}: {} by uid {owner} queued", info.spec.kind());
        self.changed.notify_all();
        Ok(info)
    }

    /// One job, with its live figures: a running job's process (its peak memory so far), a
    /// serving job's status as its result.
    pub fn get(&self, id: u64) -> Result<JobInfo, JobError> {
        let info = self
            .lock()
            .jobs
            .get(&id)
            .map(|e| e.record.info.clone())
            .ok_or(JobError::NotFound(id))?;
        Ok(self.with_live(info))
    }

    /// Bytes `get(id)` answers with, before it is built; with its owner.
    pub fn size_of(&self, id: u64) -> Option<(u32, usize)> {
        self.lock()
            .jobs
            .get(&id)
            .map(|e| (e.record.info.owner, e.bytes))
    }

    /// Bytes a list of every job, or of `owner`'s, takes, before it is built.
    pub fn list_size(&self, owner: Option<u32>) -> usize {
        self.lock()
            .jobs
            .values()
            .filter(|e| owner.is_none_or(|o| e.record.info.owner == o))
            .map(|e| e.bytes + 1)
            .sum()
    }

    /// Every job, or those of `owner`.
    pub fn list(&self, owner: Option<u32>) -> Vec<JobInfo> {
        let infos: Vec<JobInfo> = self
            .lock()
            .jobs
            .values()
            .map(|e| &e.record.info)
            .filter(|i| owner.is_none_or(|o| i.owner == o))
            .cloned()
            .collect();
        infos.into_iter().map(|i| self.with_live(i)).collect()
    }

    fn with_live(&self, mut info: JobInfo) -> JobInfo {
        if info.state != JobState::Running {
            return info;
        }
        if let Some(live) = self.live(info.id) {
            info.process = Some(live.process());
            if let Some(status) = live.serve.as_ref().and_then(|s| s.status()) {
                info.result = Some(status);
            }
        }
        info
    }

    /// Job `id`'s process, while it runs.
    pub fn live(&self, id: u64) -> Option<Arc<LiveJob>> {
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Cancels a job: a queued one at once, a running one at its next checkpointable point (a
    /// serve job at once; the runner then marks it ended). An ended job is left as it is.
    pub fn cancel(&self, id: u64) -> Result<JobInfo, JobError> {
        let mut t = self.lock();
        let entry = t.jobs.get_mut(&id).ok_or(JobError::NotFound(id))?;
        match entry.record.info.state {
            JobState::Queued => {
                entry.watchers.close_all();
                t.set_ended(id, JobState::Cancelled, crate::handover::file_clock_secs());
                self.save(&mut t, id);
                drop(t);
                self.log(id, "cancelled while queued");
                self.changed.notify_all();
            }
            JobState::Running => {
                entry.stop = true;
                let serve = matches!(entry.record.info.spec, JobSpec::Serve { .. });
                drop(t);
                if let Some(live) = self.live(id) {
                    live.stop();
                }
                self.log(
                    id,
                    if serve {
                        "cancel asked: stopping"
                    } else {
                        "cancel asked: stopping at the next checkpointable point"
                    },
                );
            }
            // Ended: nothing to stop. The table's lock must go before `get` takes it again.
            _ => drop(t),
        }
        self.get(id)
    }

    /// Refuses a job that needs a device identity when none is configured.
    pub fn check_device_identity(&self) -> Result<(), String> {
        if self.device_uids.configured() {
            Ok(())
        } else {
            self.device_uids.take().map(drop)
        }
    }

    /// Forgets an ended job: its record and log go. Returns it, and the store on a namespace
    /// its run was recorded with.
    pub fn delete(
        &self,
        id: u64,
    ) -> Result<(JobInfo, Option<crate::extents::RecordedStore>), JobError> {
        let mut t = self.lock();
        let entry = t.jobs.get(&id).ok_or(JobError::NotFound(id))?;
        let state = entry.record.info.state;
        if !state.is_final() {
            return Err(JobError::Refused(format!(
                "job {id} is {}: cancel it first",
                state.name()
            )));
        }
        if t.jobs.keys().next_back() == Some(&id) {
            // The newest job's record goes: its id is kept elsewhere, never to be given again.
            let last = t.next_id.to_string();
            write_durably(&self.dir.join(LAST_ID_FILE), last.as_bytes()).map_err(|e| {
                JobError::Refused(format!(
                    "job {id} not deleted: saving the last job id in {}: {e}",
                    self.dir.display()
                ))
            })?;
        }
        let record = t.remove(id).expect("looked up above").record;
        drop(t);
        let (log, old) = log::paths(&self.dir, id);
        let _ = std::fs::remove_file(old);
        for path in [self.record_path(id), log] {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!("deleting job {id}: {}: {e}", path.display());
            }
        }
        tracing::info!("job {id} deleted");
        Ok((record.info, record.expect))
    }

    /// Whether another train job (queued, running or ended) works on `run`.
    pub fn has_train_job_on(&self, run: &std::path::Path) -> bool {
        self.lock().jobs.values().any(|e| {
            matches!(e.record.info.spec, JobSpec::Train { .. }) && e.record.info.spec.dir() == run
        })
    }

    /// Subscribes to job `id`'s events: the watcher and its id (to [`Jobs::unwatch`]), or
    /// `None` if the job has ended (nothing will come).
    pub fn watch(&self, id: u64) -> Result<Option<(u64, Arc<Watcher>)>, JobError> {
        let mut t = self.lock();
        let entry = t.jobs.get_mut(&id).ok_or(JobError::NotFound(id))?;
        if entry.record.info.state.is_final() {
            return Ok(None);
        }
        Ok(Some(entry.watchers.add()))
    }

    /// Takes watcher `watcher` off job `id`: its queue is freed.
    pub fn unwatch(&self, id: u64, watcher: u64) {
        if let Some(e) = self.lock().jobs.get_mut(&id) {
            e.watchers.remove(watcher);
        }
    }

    /// Sends `event` to job `id`'s watchers (serialised once, if anyone watches).
    fn broadcast(entry: &Entry, event: serde_json::Value) {
        if entry.watchers.is_empty() {
            return;
        }
        let reply = Reply::Event {
            job: entry.record.info.id,
            event,
        };
        let bytes: watch::Event = serde_json::to_vec(&reply).expect("events serialise").into();
        entry.watchers.broadcast(&bytes);
    }

    /// Starts the scheduler thread.
    pub fn start_scheduler(self: &Arc<Self>) -> JoinHandle<()> {
        let jobs = self.clone();
        std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || jobs.schedule())
            .expect("spawning the scheduler")
    }

    fn slots(&self, queue: &str) -> Slots {
        match queue {
            "cpu" => self.settings.cpu,
            SERVE_QUEUE => self.settings.serve,
            _ => self.settings.gpu,
        }
    }

    fn schedule(self: Arc<Self>) {
        let mut t = self.lock();
        loop {
            t.runners.retain(|r| !r.is_finished());
            if t.stopping {
                // Wait for the runners themselves, not a poll: the daemon exits as soon as
                // the last job has checkpointed.
                let runners = std::mem::take(&mut t.runners);
                drop(t);
                for r in runners {
                    let _ = r.join();
                }
                return;
            }
            let starting = t.to_start(|q| self.slots(q), self.settings.gpu_count);
            let started = !starting.is_empty();
            for start in starting {
                let runner = self.start(&mut t, start);
                t.runners.push(runner);
            }
            if started {
                continue;
            }
            t = self
                .changed
                .wait_timeout(t, Duration::from_secs(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops every running job at its next checkpointable point and the scheduler once they
    /// have; queued jobs stay queued.
    pub fn shut_down(&self) {
        let mut t = self.lock();
        t.stopping = true;
        let running: Vec<u64> = t
            .jobs
            .values_mut()
            .filter(|e| e.record.info.state == JobState::Running)
            .map(|e| {
                e.stop = true;
                e.record.info.id
            })
            .collect();
        drop(t);
        for id in running {
            if let Some(live) = self.live(id) {
                live.stop();
            }
        }
        self.changed.notify_all();
    }
}
