//! The job table: jobs queued, running and ended, kept in the state directory across restarts
//! (`jobs/<id>.json` and `jobs/<id>.log`); a scheduler that starts queued jobs when their device
//! has room (one queue per GPU and one for the CPU); and the runners, which drive a
//! [`Session`] (train) or an evaluation in a thread of their own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use legend_daemon_api::{JobInfo, JobSpec, JobState, Progress, Reply};
use legend_engine::config::{DeviceChoice, Protocol};
use legend_engine::evaluation::{self, EvalRequest};
use legend_engine::export;
use legend_engine::session::{Event, Outcome, Session};
use legend_engine::{Config, run};
use legend_fs::Guard;
use serde::{Deserialize, Serialize};

use crate::access::{JobGuard, Peer};
use crate::config::DaemonConfig;
use crate::serve::{MetricLines, Served};

/// Events kept for a slow watcher before it misses some (progress is sent again soon).
pub const WATCH_BACKLOG: usize = 256;

/// How often a running job's progress goes to its watchers.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// The format of the job records this daemon writes. Records without one are of the first
/// format (the same fields); a record of a later format is refused at start, naming it.
const RECORD_FORMAT: u32 = 1;

/// Where the highest job id ever given is kept once the newest job is deleted (ids are never
/// reused: the records alone would give a deleted newest job's id again).
const LAST_ID_FILE: &str = "last-id";

/// A job as the state directory keeps it.
#[derive(Serialize, Deserialize)]
struct Record {
    /// [`RECORD_FORMAT`] when written.
    #[serde(default = "first_format")]
    format: u32,
    info: JobInfo,
    /// `cpu` or `cuda:N`.
    queue: String,
    /// A train job's run directory has been made: after a restart the job continues it (the
    /// spec stays as submitted, `resume` included).
    #[serde(default)]
    run_made: bool,
    /// Daemon starts that found this job running: the daemon died under it (killed, a crash,
    /// a power cut). After [`MAX_INTERRUPTIONS`] it is failed instead of started again, so a
    /// job that is itself what kills the daemon cannot keep it down.
    #[serde(default)]
    interruptions: u32,
}

/// Bytes of a job's log before it moves aside (the `logs` call answers with at most this).
const MAX_LOG_BYTES: u64 = 512 << 10;

/// How often at most a running job's record is saved for its progress alone.
const PROGRESS_SAVE_EVERY: Duration = Duration::from_secs(5);

/// How many times a job may be found running at a daemon start before it is failed.
const MAX_INTERRUPTIONS: u32 = 3;

struct Entry {
    record: Record,
    stop: Arc<AtomicBool>,
    watchers: Vec<SyncSender<Reply>>,
    last_progress: Instant,
    /// When the record was last saved for an epoch's progress.
    last_saved: Instant,
    /// Totals over the job's finished epochs, for the metrics.
    io_bytes: u64,
    train_seconds: f64,
}

/// The jobs, with indexes kept alongside so that no request, and no scheduling pass, walks
/// every job: the queued ones by device queue in submission order, how many run on each, the
/// unfinished ones by owner.
#[derive(Default)]
struct Table {
    jobs: BTreeMap<u64, Entry>,
    queued: HashMap<String, BTreeSet<u64>>,
    running: HashMap<String, usize>,
    unfinished: HashMap<u32, usize>,
    /// Ended jobs kept, by owner.
    ended: HashMap<u32, usize>,
    /// Unfinished jobs by the directory they work on (a train job's run, an eval's or an
    /// export's run).
    busy_dirs: HashMap<PathBuf, usize>,
    next_id: u64,
    stopping: bool,
    runners: Vec<JoinHandle<()>>,
}

impl Table {
    /// Puts job `id` at its place in `queue`.
    fn enqueue(&mut self, queue: &str, id: u64) {
        self.queued.entry(queue.to_owned()).or_default().insert(id);
    }

    /// Takes job `id` off `queue`.
    fn dequeue(&mut self, queue: &str, id: u64) {
        if let Some(q) = self.queued.get_mut(queue) {
            q.remove(&id);
        }
    }

    /// Counts a job of `owner` on directory `dir` that is not final yet.
    fn add_unfinished(&mut self, owner: u32, dir: &Path) {
        *self.unfinished.entry(owner).or_default() += 1;
        *self.busy_dirs.entry(dir.to_owned()).or_default() += 1;
    }

    /// Uncounts a job of `owner` on `dir` that became final.
    fn remove_unfinished(&mut self, owner: u32, dir: &Path) {
        fn uncount<K: Eq + std::hash::Hash>(map: &mut HashMap<K, usize>, key: &K) {
            if let Some(n) = map.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    map.remove(key);
                }
            }
        }
        uncount(&mut self.unfinished, &owner);
        uncount(&mut self.busy_dirs, &dir.to_owned());
    }
}

/// The daemon's jobs.
pub struct Jobs {
    table: Mutex<Table>,
    changed: Condvar,
    dir: PathBuf,
    cpu_jobs: usize,
    gpu_jobs: usize,
    serve_jobs: usize,
    /// The runs serve jobs hold, by job, once loaded.
    served: Mutex<HashMap<u64, Arc<Served>>>,
    /// `serve_device`, `serve_gpu_memory`, `serve_cache_fraction`.
    serve_device: DeviceChoice,
    serve_gpu_memory: f64,
    serve_cache_fraction: f64,
    /// `serve_host_memory_mib`, in bytes.
    serve_host_memory: Option<u64>,
    /// Bytes of each GPU's memory the serve jobs hold, by device ordinal; held while a serve
    /// job loads onto a GPU, so that each load sees what the ones before it took.
    serve_gpu: Mutex<HashMap<usize, u64>>,
    /// `max_jobs_per_user`.
    max_per_user: usize,
    /// `max_ended_jobs_per_user`.
    max_ended_per_user: usize,
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

fn first_format() -> u32 {
    1
}

/// Creates (or truncates) `path`, private to the daemon whatever the umask, with `bytes` in it,
/// on disk when this returns.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Writes `bytes` to `path` through a synced temporary file and a rename, then syncs the
/// directory: a crash keeps the old contents or the new, and the new are durable.
fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    write_private(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
}

/// Makes `dir` (and its parents) if missing, private to the daemon (0700) whatever the umask.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Seconds since the epoch, by the clock files are stamped with (see
/// [`crate::handover::file_clock_secs`]: a job's outputs are handed over by their birth time
/// against its submission's).
fn now() -> u64 {
    crate::handover::file_clock_secs()
}

/// Unix time `secs` as `YYYY-MM-DD HH:MM:SS UTC`, for the job logs people read.
fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date, in 400-year eras of 146097 days that start on
    // 1 March (so the leap day ends a year).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// An error with its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    legend_engine::error_chain::with_sources(e)
}

impl Jobs {
    /// Loads the jobs of `config.state_dir`. Jobs that were running when the daemon stopped
    /// are queued again; a train job that had begun resumes from its last checkpoint.
    pub fn open(config: &DaemonConfig) -> anyhow::Result<Arc<Jobs>> {
        let dir = config.state_dir.join("jobs");
        // The state directory may be the admin's choice (`--state-dir`), left as it is when it
        // exists; `jobs` in it is the daemon's own, private whatever it was before.
        private_dir(&dir)
            .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
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
        let mut requeued = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "log") {
                // Logs written by a daemon before they were private.
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            }
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let text = std::fs::read_to_string(&path)?;
            let mut record: Record = match serde_json::from_str(&text) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("{}: not a job record, skipped: {e}", path.display());
                    continue;
                }
            };
            if record.format > RECORD_FORMAT {
                anyhow::bail!(
                    "{}: a job record of format {}, written by a newer legendd; this one reads \
                     formats up to {RECORD_FORMAT} (run the newer legendd, or move the record away)",
                    path.display(),
                    record.format
                );
            }
            record.format = RECORD_FORMAT;
            table.next_id = table.next_id.max(record.info.id);
            if record.info.state == JobState::Running {
                record.interruptions += 1;
                requeued.push(record.info.id);
                if record.interruptions >= MAX_INTERRUPTIONS {
                    let why = format!(
                        "the daemon stopped {} times while this job ran (the job may be what \
                         stopped it); it is not started again",
                        record.interruptions
                    );
                    tracing::warn!("job {}: {why}", record.info.id);
                    record.info.state = JobState::Failed;
                    record.info.error = Some(why);
                    record.info.ended = Some(now());
                } else {
                    record.info.state = JobState::Queued;
                    tracing::info!("job {} was running: queued again", record.info.id);
                }
            }
            if record.info.state == JobState::Queued {
                table.enqueue(&record.queue, record.info.id);
            }
            if record.info.state.is_final() {
                *table.ended.entry(record.info.owner).or_default() += 1;
            } else {
                table.add_unfinished(record.info.owner, record.info.spec.dir());
            }
            table.jobs.insert(
                record.info.id,
                Entry {
                    record,
                    stop: Arc::default(),
                    watchers: Vec::new(),
                    last_progress: Instant::now(),
                    last_saved: Instant::now(),
                    io_bytes: 0,
                    train_seconds: 0.0,
                },
            );
        }
        let jobs = Arc::new(Jobs {
            table: Mutex::new(table),
            changed: Condvar::new(),
            dir,
            cpu_jobs: config.cpu_jobs,
            gpu_jobs: config.gpu_jobs,
            serve_jobs: config.serve_jobs,
            served: Mutex::default(),
            serve_device: config
                .serve_device
                .parse()
                .map_err(|e| anyhow::anyhow!("serve_device: {e}"))?,
            serve_gpu_memory: config.serve_gpu_memory,
            serve_cache_fraction: config.serve_cache_fraction,
            serve_host_memory: config
                .serve_host_memory_mib
                .map(|m| m.saturating_mul(1 << 20)),
            serve_gpu: Mutex::default(),
            max_per_user: config.max_jobs_per_user,
            max_ended_per_user: config.max_ended_jobs_per_user,
            requests: AtomicU64::new(0),
        });
        for id in requeued {
            jobs.persist(&jobs.lock(), id)
                .map_err(|e| anyhow::anyhow!("{}: {e}", jobs.record_path(id).display()))?;
        }
        Ok(jobs)
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// The job's log file.
    pub fn log_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.log"))
    }

    /// Where the older part of a long log is kept.
    fn old_log_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.log.1"))
    }

    /// Writes the job's record durably (synced temporary file, rename, synced directory), so a
    /// crash keeps the old or the new.
    fn persist(&self, table: &Table, id: u64) -> std::io::Result<()> {
        let Some(entry) = table.jobs.get(&id) else {
            return Ok(());
        };
        let text = serde_json::to_vec_pretty(&entry.record).expect("a job record serializes");
        write_durably(&self.record_path(id), &text)
    }

    /// [`Jobs::persist`] for a change already made, which stays made in memory when the disk
    /// fails (the job runs on; the error goes to the daemon's log).
    fn save(&self, table: &Table, id: u64) {
        if let Err(e) = self.persist(table, id) {
            tracing::error!(
                "job {id}: saving its record {}: {e}",
                self.record_path(id).display()
            );
        }
    }

    /// Appends a line to the job's log (private to the daemon: it may name its paths).
    fn log(&self, id: u64, text: &str) {
        let line = format!("{} {text}\n", utc(now()));
        let path = self.log_path(id);
        // A log in the daemon's state takes at most twice MAX_LOG_BYTES, however long its job
        // runs: past it the log moves to `ID.log.1` (the older part goes) and starts again.
        let full =
            std::fs::metadata(&path).is_ok_and(|m| m.len() + line.len() as u64 > MAX_LOG_BYTES);
        if full && let Err(e) = std::fs::rename(&path, self.old_log_path(id)) {
            tracing::warn!("job {id}: moving its full log aside: {e}");
        }
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            tracing::warn!("job {id}: writing its log: {e}");
        }
    }

    /// Queues `spec` for `owner`; `queue` is the device it runs on.
    pub fn submit(&self, owner: u32, spec: JobSpec, queue: String) -> Result<JobInfo, JobError> {
        let mut t = self.lock();
        if t.stopping {
            return Err(JobError::Refused("the daemon is stopping".into()));
        }
        let unfinished = t.unfinished.get(&owner).copied().unwrap_or(0);
        if unfinished >= self.max_per_user {
            return Err(JobError::Refused(format!(
                "uid {owner} has {unfinished} jobs queued or running (max_jobs_per_user = {}): \
                 wait for some to end, or cancel some",
                self.max_per_user
            )));
        }
        let ended = t.ended.get(&owner).copied().unwrap_or(0);
        if ended >= self.max_ended_per_user {
            return Err(JobError::Refused(format!(
                "uid {owner} keeps {ended} ended jobs (max_ended_jobs_per_user = {}): delete \
                 some (legendctl delete ID) before submitting more",
                self.max_ended_per_user
            )));
        }
        if let JobSpec::Train { out, .. } = &spec
            && t.busy_dirs.contains_key(out)
        {
            return Err(JobError::Refused(format!(
                "{}: another job is queued or running on this run",
                out.display()
            )));
        }
        t.next_id += 1;
        let id = t.next_id;
        let info = JobInfo {
            id,
            owner,
            spec,
            state: JobState::Queued,
            device: Some(queue.clone()),
            submitted: now(),
            started: None,
            ended: None,
            progress: Progress::default(),
            error: None,
            result: None,
        };
        t.jobs.insert(
            id,
            Entry {
                record: Record {
                    format: RECORD_FORMAT,
                    info: info.clone(),
                    queue: queue.clone(),
                    run_made: false,
                    interruptions: 0,
                },
                stop: Arc::default(),
                watchers: Vec::new(),
                last_progress: Instant::now(),
                last_saved: Instant::now(),
                io_bytes: 0,
                train_seconds: 0.0,
            },
        );
        let dir = info.spec.dir().clone();
        t.add_unfinished(owner, &dir);
        t.enqueue(&queue, id);
        // Acknowledged only once on disk: a job the daemon said it queued survives a crash.
        if let Err(e) = self.persist(&t, id) {
            t.jobs.remove(&id);
            t.remove_unfinished(owner, &dir);
            t.dequeue(&queue, id);
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

    /// One job.
    pub fn get(&self, id: u64) -> Result<JobInfo, JobError> {
        let info = self
            .lock()
            .jobs
            .get(&id)
            .map(|e| e.record.info.clone())
            .ok_or(JobError::NotFound(id))?;
        Ok(self.with_serving(info))
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
        infos.into_iter().map(|i| self.with_serving(i)).collect()
    }

    /// `info` with, for a serve job that is serving, its live status as its result (where it
    /// answers, queries, rate, latency, the row cache's hit rate).
    fn with_serving(&self, mut info: JobInfo) -> JobInfo {
        if matches!(info.spec, JobSpec::Serve { .. })
            && info.state == JobState::Running
            && let Some(served) = self.served(info.id)
        {
            info.result = Some(served.status());
        }
        info
    }

    /// Cancels a job: a queued one at once, a running one at its next checkpointable point
    /// (the runner then marks it cancelled). An ended job is left as it is.
    pub fn cancel(&self, id: u64) -> Result<JobInfo, JobError> {
        let mut t = self.lock();
        let entry = t.jobs.get_mut(&id).ok_or(JobError::NotFound(id))?;
        match entry.record.info.state {
            JobState::Queued => {
                entry.record.info.state = JobState::Cancelled;
                entry.record.info.ended = Some(now());
                entry.watchers.clear();
                let (owner, queue) = (entry.record.info.owner, entry.record.queue.clone());
                let dir = entry.record.info.spec.dir().clone();
                t.dequeue(&queue, id);
                t.remove_unfinished(owner, &dir);
                self.save(&t, id);
                drop(t);
                self.log(id, "cancelled while queued");
                self.changed.notify_all();
            }
            JobState::Running => {
                entry.stop.store(true, Ordering::Relaxed);
                drop(t);
                // A serve job waits for this, not for a checkpointable point.
                self.changed.notify_all();
                self.log(
                    id,
                    "cancel asked: stopping at the next checkpointable point",
                );
            }
            // Ended: nothing to stop. The table's lock must go before `get` takes it again.
            _ => drop(t),
        }
        self.get(id)
    }

    /// Forgets an ended job: its record and log go.
    pub fn delete(&self, id: u64) -> Result<JobInfo, JobError> {
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
        let info = t.jobs.remove(&id).expect("looked up above").record.info;
        if let Some(n) = t.ended.get_mut(&info.owner) {
            *n = n.saturating_sub(1);
        }
        drop(t);
        let _ = std::fs::remove_file(self.old_log_path(id));
        for path in [self.record_path(id), self.log_path(id)] {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!("deleting job {id}: {}: {e}", path.display());
            }
        }
        tracing::info!("job {id} deleted");
        Ok(info)
    }

    /// Subscribes `to` to the job's events; `false` if the job has ended (nothing will come).
    pub fn watch(&self, id: u64, to: SyncSender<Reply>) -> Result<bool, JobError> {
        let mut t = self.lock();
        let entry = t.jobs.get_mut(&id).ok_or(JobError::NotFound(id))?;
        if entry.record.info.state.is_final() {
            return Ok(false);
        }
        entry.watchers.push(to);
        Ok(true)
    }

    /// Sends `event` to the job's watchers without ever waiting: a watcher whose backlog is
    /// full misses it, one that went away is dropped.
    fn broadcast(entry: &mut Entry, event: serde_json::Value) {
        let id = entry.record.info.id;
        entry.watchers.retain(|w| {
            !matches!(
                w.try_send(Reply::Event {
                    job: id,
                    event: event.clone(),
                }),
                Err(std::sync::mpsc::TrySendError::Disconnected(_))
            )
        });
    }

    /// Starts the scheduler thread.
    pub fn start_scheduler(self: &Arc<Self>) -> JoinHandle<()> {
        let jobs = self.clone();
        std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || jobs.schedule())
            .expect("spawning the scheduler")
    }

    fn limit(&self, queue: &str) -> usize {
        match queue {
            "cpu" => self.cpu_jobs,
            SERVE_QUEUE => self.serve_jobs,
            _ => self.gpu_jobs,
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
            self.start_what_fits(&mut t);
            t = self
                .changed
                .wait_timeout(t, Duration::from_secs(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Starts the first queued jobs of each device queue with room: the work of a pass is the
    /// number of queues and of jobs started, however many wait.
    fn start_what_fits(self: &Arc<Self>, t: &mut Table) {
        let mut starting = Vec::new();
        for (queue, ids) in &t.queued {
            let running = t.running.get(queue).copied().unwrap_or(0);
            let room = self.limit(queue).saturating_sub(running);
            starting.extend(ids.iter().take(room).copied());
        }
        for id in starting {
            let runner = self.start(t, id);
            t.runners.push(runner);
        }
    }

    fn start(self: &Arc<Self>, t: &mut Table, id: u64) -> JoinHandle<()> {
        let queue = t.jobs[&id].record.queue.clone();
        t.dequeue(&queue, id);
        *t.running.entry(queue).or_default() += 1;
        let entry = t.jobs.get_mut(&id).expect("a queued job");
        entry.record.info.state = JobState::Running;
        entry.record.info.started = Some(now());
        entry.record.info.error = None;
        entry.stop.store(false, Ordering::Relaxed);
        let spec = entry.record.info.spec.clone();
        let owner = entry.record.info.owner;
        let stop = entry.stop.clone();
        Self::broadcast(
            entry,
            serde_json::json!({"type": "state", "state": "running"}),
        );
        self.save(t, id);
        self.log(id, "started");
        tracing::info!("job {id}: started");
        let jobs = self.clone();
        std::thread::Builder::new()
            .name(format!("job-{id}"))
            .spawn(move || {
                // Everything the job writes is beneath directories its submitter owns.
                let guard = JobGuard::new(Peer::of_uid(owner));
                // A panic ends the job, not its queue: the job fails and its slot is freed.
                let result =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &spec {
                        JobSpec::Train { .. } => jobs.run_train(id, &spec, &stop, &guard),
                        JobSpec::Eval { .. } => jobs.run_eval(&spec, &guard),
                        JobSpec::Export { run, out, format } => {
                            jobs.run_export(id, run, out, format, &guard)
                        }
                        JobSpec::Serve { run, group, device } => {
                            let asked = (group.as_deref(), device.as_deref());
                            jobs.run_serve(id, run, asked, owner, &stop, &guard)
                        }
                    }))
                    .unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<String>()
                            .map(String::as_str)
                            .or_else(|| panic.downcast_ref::<&str>().copied())
                            .unwrap_or("a panic");
                        Err(format!("the job failed inside the daemon: {what}"))
                    });
                jobs.hand_over(id, &spec, owner, &guard);
                jobs.finish(id, result);
            })
            .expect("spawning a job thread")
    }

    fn run_train(
        &self,
        id: u64,
        spec: &JobSpec,
        stop: &AtomicBool,
        guard: &JobGuard,
    ) -> Result<Ended, String> {
        let JobSpec::Train {
            dataset,
            out,
            config,
            sets,
            resume,
        } = spec
        else {
            unreachable!("a train job");
        };
        let run_made = self.lock().jobs.get(&id).is_some_and(|e| e.record.run_made);
        let mut session = if *resume || run_made {
            Session::resume(out, dataset.as_deref(), sets, guard).map_err(|e| chain(&e))?
        } else {
            let dataset = dataset.as_deref().ok_or("a new run needs a dataset")?;
            let config = Config::parse(config, sets).map_err(|e| chain(&e))?;
            let session = Session::create(out, dataset, config, guard).map_err(|e| chain(&e))?;
            // The run exists now: after a restart the job continues it.
            self.update(id, |e| e.record.run_made = true);
            session
        };
        if session.is_finished().map_err(|e| chain(&e))? {
            self.log(id, "the run has nothing left to do");
            return Ok(Ended::Done(None));
        }
        self.log(
            id,
            &format!(
                "{} from {}",
                session.describe(),
                session.position().describe()
            ),
        );
        self.update(id, |e| {
            e.record.info.device = Some(session.engine().to_string())
        });
        // The epoch whose kept tables (RUN/best) the final evaluation ranked, if any.
        let mut best_epoch = None;
        let outcome = session
            .run(stop, &mut |event| {
                if let Event::Evaluated { line, .. } = &event {
                    best_epoch = line.get("best_epoch").cloned();
                }
                self.on_event(id, event)
            })
            .map_err(|e| chain(&e))?;
        Ok(match outcome {
            Outcome::Finished(metrics) => Ended::Done(metrics.map(|m| {
                let mut result = serde_json::to_value(m).expect("metrics serialize");
                if let Some(epoch) = best_epoch {
                    result["best_epoch"] = epoch;
                }
                result
            })),
            Outcome::Stopped(position) => Ended::Stopped(position.describe()),
        })
    }

    fn run_eval(&self, spec: &JobSpec, guard: &JobGuard) -> Result<Ended, String> {
        let JobSpec::Eval {
            run: dir,
            protocol,
            split,
        } = spec
        else {
            unreachable!("an eval job");
        };
        let protocol: Protocol = protocol.parse()?;
        let split: legend_dataset::Split = split.parse()?;
        let dir = run::open(dir).map_err(|e| chain(&e))?;
        guard
            .admit(&dir)
            .map_err(|e| format!("{}: {e}", dir.path().display()))?;
        // The run is the submitter's; what is read in it must be theirs to read too.
        let dir = dir.reading_as(guard.read_check());
        let meta = run::read_meta(&dir).map_err(|e| chain(&e))?;
        let dataset = evaluation::open_run_dataset(&meta, None, guard).map_err(|e| chain(&e))?;
        let (entities, relations) =
            run::load_embeddings(&dir, &meta, guard).map_err(|e| chain(&e))?;
        let decoder = meta.decoder.parse()?;
        let request = EvalRequest {
            protocol,
            split,
            negatives: run::evaluation_negatives(&dir).map_err(|e| chain(&e))?,
            threads: 0,
        };
        let m = evaluation::evaluate(
            &dataset,
            decoder,
            meta.dim,
            &entities,
            &relations,
            meta.reciprocal_relations,
            &request,
        )
        .map_err(|e| chain(&e))?;
        Ok(Ended::Done(Some(
            serde_json::to_value(m).expect("metrics serialize"),
        )))
    }

    fn run_export(
        &self,
        id: u64,
        run: &Path,
        out: &Path,
        format: &str,
        guard: &JobGuard,
    ) -> Result<Ended, String> {
        let format = format.parse()?;
        let done = export::export(run, format, out, None, guard).map_err(|e| chain(&e))?;
        self.log(
            id,
            &format!(
                "exported {} entities and {} relations (d = {}) to {}",
                done.entities,
                done.relations,
                done.dim,
                out.display()
            ),
        );
        Ok(Ended::Done(None))
    }

    /// Loads `run` into memory (a GPU's, as [`Jobs::serve_gpu`] allows; else the host's, up to
    /// `serve_host_memory_mib`; else streamed from the run) and answers queries on it ([`Jobs::served`]) until the job is cancelled (it then succeeds) or the daemon stops
    /// (it is queued again, to serve after the next start). `(group, device)` as submitted.
    fn run_serve(
        &self,
        id: u64,
        run: &Path,
        (group, device): (Option<&str>, Option<&str>),
        owner: u32,
        stop: &AtomicBool,
        guard: &JobGuard,
    ) -> Result<Ended, String> {
        let gid = group.map(crate::access::group_id).transpose()?;
        let started = Instant::now();
        let (options, ordinal) = self.serve_gpu(device)?;
        // Loads onto a GPU one at a time: each sees what the ones before it hold.
        let mut held = ordinal.map(|_| self.serve_gpu.lock().unwrap_or_else(|e| e.into_inner()));
        let budget = match (&held, ordinal) {
            (Some(held), Some(o)) => {
                Some(self.serve_budget(o, held.get(&o).copied().unwrap_or(0))?)
            }
            _ => None,
        };
        let options = legend_query::GpuOptions { budget, ..options };
        // The run keeps the guard: a streamed run reads through it for as long as it serves.
        let reads: Arc<dyn legend_fs::Guard> = Arc::new(guard.clone());
        let loaded =
            legend_query::QueryRun::open_served(run, None, reads, &options, self.serve_host_memory)
                .map_err(|e| chain(&e))?;
        let served = Arc::new(Served::new(owner, gid, loaded));
        let gpu_bytes = served.gpu_bytes();
        let on = match (held.as_mut(), ordinal) {
            (Some(held), Some(o)) if gpu_bytes > 0 => {
                *held.entry(o).or_default() += gpu_bytes;
                format!("cuda:{o}")
            }
            _ => "cpu".into(),
        };
        drop(held);
        self.update(id, |e| e.record.info.device = Some(on.clone()));
        self.log(
            id,
            &format!(
                "serving {}: {} MiB of tables in host memory (and at most {} MiB while \
                 streaming), {} MiB on the GPU; answering on {}; loaded in {:.1} s",
                run.display(),
                served.resident_bytes() >> 20,
                served.stream_bytes() >> 20,
                gpu_bytes >> 20,
                served.placement(),
                started.elapsed().as_secs_f64()
            ),
        );
        self.served
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, served);
        // Loaded since the daemon last died under the job: the job did not kill it.
        self.update(id, |e| e.record.interruptions = 0);
        let mut t = self.lock();
        while !stop.load(Ordering::Relaxed) {
            t = self
                .changed
                .wait_timeout(t, Duration::from_secs(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let stopping = t.stopping;
        drop(t);
        self.served
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(o) = ordinal.filter(|_| gpu_bytes > 0) {
            let mut held = self.serve_gpu.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(b) = held.get_mut(&o) {
                *b = b.saturating_sub(gpu_bytes);
            }
        }
        Ok(if stopping {
            Ended::Stopped("serving".into())
        } else {
            Ended::Done(None)
        })
    }

    /// Where a serve job that asked for `device` (none: `serve_device`) answers: the GPU
    /// options and the device whose memory it takes, or the CPU. A GPU is used only where
    /// `serve_gpu_memory` allows; `auto` falls back to the CPU, a named `cuda:N` is refused.
    fn serve_gpu(
        &self,
        device: Option<&str>,
    ) -> Result<(legend_query::GpuOptions, Option<usize>), String> {
        let choice = match device {
            Some(d) => d.parse::<DeviceChoice>()?,
            None => self.serve_device,
        };
        let cpu = Ok((legend_query::GpuOptions::cpu(), None));
        let ordinal = match choice {
            DeviceChoice::Cpu => return cpu,
            DeviceChoice::Cuda(n) => n,
            DeviceChoice::Auto => 0,
        };
        if self.serve_gpu_memory == 0.0 {
            return match choice {
                DeviceChoice::Auto => cpu,
                _ => Err(format!(
                    "serving on {choice}: this daemon serves runs on the CPU only \
                     (serve_gpu_memory = 0)"
                )),
            };
        }
        if let Err(e) = legend_cuda::device_memory(ordinal) {
            return match choice {
                // No GPU to share: the query side finds the same and says why it is on the CPU.
                DeviceChoice::Auto => Ok((legend_query::GpuOptions::on(choice), None)),
                _ => Err(format!("serving on {choice}: {e}")),
            };
        }
        let options = legend_query::GpuOptions {
            cache_fraction: self.serve_cache_fraction,
            ..legend_query::GpuOptions::on(choice)
        };
        Ok((options, Some(ordinal)))
    }

    /// Bytes of device `ordinal`'s memory a serve job may take when the serve jobs already
    /// hold `held`: the `serve_gpu_memory` share, less that.
    fn serve_budget(&self, ordinal: usize, held: u64) -> Result<u64, String> {
        let total =
            legend_cuda::device_memory(ordinal).map_err(|e| format!("cuda:{ordinal}: {e}"))?;
        Ok(((total as f64 * self.serve_gpu_memory) as u64).saturating_sub(held))
    }

    /// The run serve job `id` holds, once loaded.
    pub fn served(&self, id: u64) -> Option<Arc<Served>> {
        self.served
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut Entry)) {
        let mut t = self.lock();
        if let Some(e) = t.jobs.get_mut(&id) {
            f(e);
            self.save(&t, id);
        }
    }

    /// A session event of job `id`: progress for `status` and the watchers, epoch lines for
    /// the log and the metrics.
    fn on_event(&self, id: u64, event: Event<'_>) {
        let mut t = self.lock();
        let Some(entry) = t.jobs.get_mut(&id) else {
            return;
        };
        let p = &mut entry.record.info.progress;
        let out = match event {
            Event::EpochStarted {
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
                None
            }
            Event::Progress { edges_done, .. } => {
                p.edges_done = edges_done;
                if entry.last_progress.elapsed() < PROGRESS_EVERY {
                    return;
                }
                entry.last_progress = Instant::now();
                Some(serde_json::json!({"type": "progress", "progress": *p}))
            }
            Event::EpochFinished { report, line, .. } => {
                p.edges_per_sec = report.edges_per_sec;
                p.edges_done = p.edges;
                entry.io_bytes += report.bytes_read + report.bytes_written;
                entry.train_seconds += report.seconds;
                let text = format!(
                    "epoch {}: loss {:.4}, {:.0} edges/s, {:.2} s",
                    report.epoch, report.loss, report.edges_per_sec, report.seconds
                );
                let event = serde_json::json!({"type": "epoch", "line": line});
                Self::broadcast(entry, event);
                // Progress only: saved every few seconds, not at every epoch of a tiny one
                // (each save is synced under the table's lock).
                if entry.last_saved.elapsed() >= PROGRESS_SAVE_EVERY {
                    entry.last_saved = Instant::now();
                    self.save(&t, id);
                }
                drop(t);
                self.log(id, &text);
                return;
            }
            Event::Checkpoint { position } => {
                // Progress since the daemon last died under the job: it did not kill it.
                if entry.record.interruptions > 0 {
                    entry.record.interruptions = 0;
                    self.save(&t, id);
                }
                let entry = t.jobs.get_mut(&id).expect("looked up above");
                Self::broadcast(
                    entry,
                    serde_json::json!({"type": "checkpoint", "position": position.describe()}),
                );
                return;
            }
            Event::Evaluating { split } => {
                Some(serde_json::json!({"type": "evaluating", "split": split.name()}))
            }
            Event::Evaluated { line, .. } => {
                Some(serde_json::json!({"type": "evaluated", "line": line}))
            }
        };
        if let Some(event) = out {
            Self::broadcast(entry, event);
        }
    }

    /// Makes the submitter the owner of what the job wrote (before its end is announced).
    fn hand_over(&self, id: u64, spec: &JobSpec, owner: u32, guard: &JobGuard) {
        let out = match spec {
            JobSpec::Train { out, .. } | JobSpec::Export { out, .. } => out,
            JobSpec::Eval { .. } | JobSpec::Serve { .. } => return,
        };
        let submitted = self
            .lock()
            .jobs
            .get(&id)
            .map_or(0, |e| e.record.info.submitted);
        let handed = match legend_fs::Dir::open_guarded(out, guard) {
            Ok(dir) => crate::handover::hand_over(&dir, owner, submitted),
            // A job refused before it made its directory.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => Err(e),
        };
        match handed {
            Ok(0) => {}
            Ok(n) => tracing::debug!("job {id}: {n} outputs handed to uid {owner}"),
            Err(e) => self.log(
                id,
                &format!(
                    "{}: the outputs stay the daemon's (handing them to uid {owner}: {e})",
                    out.display()
                ),
            ),
        }
    }

    /// Records how job `id` ended and tells its watchers.
    fn finish(&self, id: u64, result: Result<Ended, String>) {
        let mut t = self.lock();
        let stopping = t.stopping;
        let Some(entry) = t.jobs.get_mut(&id) else {
            return;
        };
        let info = &mut entry.record.info;
        let text = match result {
            Ok(Ended::Done(result)) => {
                info.state = JobState::Succeeded;
                info.result = result;
                "succeeded".to_string()
            }
            Ok(Ended::Stopped(at)) if stopping => {
                // The daemon is stopping: the job continues at the next start.
                info.state = JobState::Queued;
                format!("stopped with the daemon at {at}; resumes at the next start")
            }
            Ok(Ended::Stopped(at)) => {
                info.state = JobState::Cancelled;
                format!("cancelled; checkpointed at {at}")
            }
            Err(e) => {
                info.state = JobState::Failed;
                info.error = Some(e.clone());
                format!("failed: {e}")
            }
        };
        let (owner, queue, state) = (info.owner, entry.record.queue.clone(), info.state);
        let dir = info.spec.dir().clone();
        if state.is_final() {
            entry.record.info.ended = Some(now());
        }
        // Dropping the senders ends the watches, each then reporting the final state: only
        // once the log says how the job ended, so a watcher that reads it next finds that.
        let watchers = std::mem::take(&mut entry.watchers);
        if let Some(n) = t.running.get_mut(&queue) {
            *n = n.saturating_sub(1);
        }
        if state.is_final() {
            t.remove_unfinished(owner, &dir);
            *t.ended.entry(owner).or_default() += 1;
        } else {
            t.enqueue(&queue, id);
        }
        self.save(&t, id);
        drop(t);
        self.log(id, &text);
        drop(watchers);
        tracing::info!("job {id}: {text}");
        self.changed.notify_all();
    }

    /// Stops every running job at its next checkpointable point and the scheduler once they
    /// have; queued jobs stay queued.
    pub fn shut_down(&self) {
        let mut t = self.lock();
        t.stopping = true;
        for e in t.jobs.values() {
            if e.record.info.state == JobState::Running {
                e.stop.store(true, Ordering::Relaxed);
            }
        }
        drop(t);
        self.changed.notify_all();
    }

    /// The metrics in the Prometheus text format: the daemon's totals, and the lines of each
    /// job whose owner `shows` (a user sees their own jobs, the admin group everyone's, the
    /// HTTP endpoint, which knows no caller, none).
    pub fn metrics(&self, shows: impl Fn(u32) -> bool) -> String {
        let t = self.lock();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP legendd_jobs Jobs by state.\n# TYPE legendd_jobs gauge"
        );
        for state in [
            JobState::Queued,
            JobState::Running,
            JobState::Succeeded,
            JobState::Failed,
            JobState::Cancelled,
        ] {
            let n = t
                .jobs
                .values()
                .filter(|e| e.record.info.state == state)
                .count();
            let _ = writeln!(s, "legendd_jobs{{state=\"{}\"}} {n}", state.name());
        }
        let _ = writeln!(
            s,
            "# HELP legendd_queue_depth Jobs waiting, by device.\n# TYPE legendd_queue_depth gauge"
        );
        let mut queues: BTreeMap<&str, usize> = BTreeMap::new();
        for e in t.jobs.values() {
            let n = queues.entry(e.record.queue.as_str()).or_default();
            *n += usize::from(e.record.info.state == JobState::Queued);
        }
        for (q, n) in queues {
            let _ = writeln!(s, "legendd_queue_depth{{device=\"{q}\"}} {n}");
        }
        let _ = writeln!(
            s,
            "# HELP legendd_requests_total Requests answered.\n# TYPE legendd_requests_total counter\nlegendd_requests_total {}",
            self.requests.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "# HELP legend_job_edges_per_second Edges per second of the job's last epoch.\n# TYPE legend_job_edges_per_second gauge"
        );
        let shown = || t.jobs.values().filter(|e| shows(e.record.info.owner));
        for e in shown().filter(|e| e.record.info.state == JobState::Running) {
            let i = &e.record.info;
            let _ = writeln!(
                s,
                "legend_job_edges_per_second{{job=\"{}\",owner=\"{}\"}} {}",
                i.id, i.owner, i.progress.edges_per_sec
            );
        }
        let _ = writeln!(
            s,
            "# HELP legend_job_io_bytes_total Bytes the job's swaps moved.\n# TYPE legend_job_io_bytes_total counter"
        );
        for e in shown() {
            let _ = writeln!(
                s,
                "legend_job_io_bytes_total{{job=\"{}\"}} {}",
                e.record.info.id, e.io_bytes
            );
        }
        let _ = writeln!(
            s,
            "# HELP legend_job_train_seconds_total Seconds the job's epochs took (on its GPU or CPU).\n# TYPE legend_job_train_seconds_total counter"
        );
        for e in shown() {
            let _ = writeln!(
                s,
                "legend_job_train_seconds_total{{job=\"{}\"}} {}",
                e.record.info.id, e.train_seconds
            );
        }
        drop(t);
        let mut lines = MetricLines::default();
        let served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        let mut ids: Vec<&u64> = served.keys().collect();
        ids.sort_unstable();
        for id in ids {
            let run = &served[id];
            if shows(run.owner) {
                run.write_metrics(*id, &mut lines);
            }
        }
        lines.finish(&mut s);
        s
    }
}

/// How a runner ended without an error.
enum Ended {
    /// Done, with its result.
    Done(Option<serde_json::Value>),
    /// Stopped as asked, checkpointed at this position.
    Stopped(String),
}

/// The configuration a train job runs with: its own for a new run, the run's `config.toml` with
/// the job's overrides when it resumes, read as `reader` (its submitter) could read it: the
/// daemon never reads, and so never quotes back in a parse error, what they could not.
pub fn train_config(spec: &JobSpec, reader: &Peer) -> Result<Config, String> {
    let JobSpec::Train {
        out,
        config,
        sets,
        resume,
        ..
    } = spec
    else {
        return Err("not a train job".into());
    };
    if *resume {
        // Through the run's directory: not through a link, not a FIFO, not a huge file.
        let dir = reader.open_dir(out)?;
        if !dir.is_file(run::META_FILE).unwrap_or(false) {
            return Err(format!(
                "{}: not a run directory (no run.toml)",
                out.display()
            ));
        }
        let text = dir
            .read_to_string(run::CONFIG_FILE)
            .map_err(|e| format!("{}: {e}", dir.join(run::CONFIG_FILE).display()))?;
        Config::parse(&text, sets)
    } else {
        Config::parse(config, sets)
    }
    .map_err(|e| e.to_string())
}

/// The queue of serve jobs: they take no CPU or GPU job slot (`serve_jobs` at once).
pub const SERVE_QUEUE: &str = "serve";

/// The device queue a train job of `config` runs in: `cpu` or `cuda:N` (eval and export jobs
/// run on the CPU).
pub fn queue_of(config: &Config) -> String {
    match config.device() {
        DeviceChoice::Cpu => "cpu".into(),
        DeviceChoice::Cuda(n) => format!("cuda:{n}"),
        DeviceChoice::Auto if legend_cuda::driver_present() => "cuda:0".into(),
        DeviceChoice::Auto => "cpu".into(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn log_times_read_as_dates() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(super::utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(super::utc(1_795_737_599), "2026-11-26 23:59:59 UTC");
    }
}
