//! The job table, with indexes kept alongside so that no request, and no scheduling pass,
//! walks every job: queued jobs by device queue and owner in submission order, running jobs
//! by queue and owner, unfinished and ended jobs by owner, the runs and device nodes in use.
//! Every change of a job's state goes through one method here, so the counts stay right
//! however a job ends (a job cancelled while queued counts among its owner's ended jobs like
//! any other).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Instant;

use legend_daemon_api::{JobSpec, JobState};

use super::record::Record;
use super::watch::Watchers;
use crate::paths::DirId;

/// A job in memory.
pub struct Entry {
    /// Its record.
    pub record: Record,
    /// A stop was asked (cancel, or the daemon stopping).
    pub stop: bool,
    /// Its watchers.
    pub watchers: Watchers,
    /// When the record was last saved for progress alone.
    pub last_saved: Instant,
    /// When progress last went to the watchers.
    pub last_progress: Instant,
    /// Totals over the job's finished epochs, for the metrics.
    pub io_bytes: u64,
    /// Seconds of its epochs.
    pub train_seconds: f64,
    /// Bytes its `JobInfo` takes serialised (what answering with it costs).
    pub bytes: usize,
}

impl Entry {
    /// A job as loaded or submitted.
    pub fn new(record: Record) -> Entry {
        let bytes = serde_json::to_vec(&record.info).map_or(0, |b| b.len());
        Entry {
            record,
            stop: false,
            watchers: Watchers::default(),
            last_saved: Instant::now(),
            last_progress: Instant::now(),
            io_bytes: 0,
            train_seconds: 0.0,
            bytes,
        }
    }
}

/// A run directory: by device and inode once it exists, by its (normalised) path before.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RunKey {
    /// An existing directory.
    Dir(DirId),
    /// A run not made yet.
    Path(PathBuf),
}

impl RunKey {
    /// The key of `record`'s run.
    pub fn of(record: &Record) -> RunKey {
        match record.run_id {
            Some(id) => RunKey::Dir(id),
            None => RunKey::Path(record.info.spec.dir().clone()),
        }
    }
}

/// How many slots a queue has, how many only admins' jobs take, how many one user may hold.
#[derive(Clone, Copy, Debug)]
pub struct Slots {
    /// Jobs at once.
    pub total: usize,
    /// Of those, the admin group's only.
    pub reserved: usize,
    /// Jobs of one user outside the admin group at once.
    pub per_user: usize,
}

/// The jobs and their indexes.
#[derive(Default)]
pub struct Table {
    /// Every job.
    pub jobs: BTreeMap<u64, Entry>,
    queued: HashMap<String, BTreeMap<u32, BTreeSet<u64>>>,
    running: HashMap<String, usize>,
    running_users: HashMap<String, usize>,
    running_by_owner: HashMap<(String, u32), usize>,
    unfinished: HashMap<u32, usize>,
    serving: HashMap<u32, usize>,
    ended: HashMap<u32, usize>,
    busy_runs: HashMap<RunKey, usize>,
    busy_nodes: HashSet<String>,
    /// The highest job id given.
    pub next_id: u64,
    /// The daemon is stopping.
    pub stopping: bool,
    /// The threads that run jobs.
    pub runners: Vec<JoinHandle<()>>,
}

fn count<K: Eq + std::hash::Hash>(map: &mut HashMap<K, usize>, key: K, up: bool) {
    if up {
        *map.entry(key).or_default() += 1;
    } else if let Some(n) = map.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            map.remove(&key);
        }
    }
}

impl Table {
    /// Adds a job as loaded or submitted, counted as its state says.
    pub fn insert(&mut self, entry: Entry) {
        let r = &entry.record;
        let (id, owner, state) = (r.info.id, r.info.owner, r.info.state);
        if state.is_final() {
            count(&mut self.ended, owner, true);
        } else {
            self.count_unfinished(r, true);
            if state == JobState::Queued {
                self.enqueue(r);
            }
        }
        self.jobs.insert(id, entry);
    }

    fn count_unfinished(&mut self, r: &Record, up: bool) {
        let owner = r.info.owner;
        count(&mut self.unfinished, owner, up);
        if matches!(r.info.spec, JobSpec::Serve { .. }) {
            count(&mut self.serving, owner, up);
        }
        count(&mut self.busy_runs, RunKey::of(r), up);
    }

    fn enqueue(&mut self, r: &Record) {
        self.queued
            .entry(r.queue.clone())
            .or_default()
            .entry(r.info.owner)
            .or_default()
            .insert(r.info.id);
    }

    fn dequeue(&mut self, r: &Record) {
        if let Some(q) = self.queued.get_mut(&r.queue) {
            if let Some(ids) = q.get_mut(&r.info.owner) {
                ids.remove(&r.info.id);
                if ids.is_empty() {
                    q.remove(&r.info.owner);
                }
            }
            if q.is_empty() {
                self.queued.remove(&r.queue);
            }
        }
    }

    fn count_running(&mut self, r: &Record, up: bool) {
        count(&mut self.running, r.queue.clone(), up);
        if !r.admin {
            count(&mut self.running_users, r.queue.clone(), up);
        }
        count(
            &mut self.running_by_owner,
            (r.queue.clone(), r.info.owner),
            up,
        );
        if let Some(node) = &r.device_node {
            if up {
                self.busy_nodes.insert(node.clone());
            } else {
                self.busy_nodes.remove(node);
            }
        }
    }

    /// Job `id` (queued) starts.
    pub fn set_running(&mut self, id: u64) {
        let r = self.jobs[&id].record.clone();
        self.dequeue(&r);
        self.count_running(&r, true);
        self.jobs
            .get_mut(&id)
            .expect("a queued job")
            .record
            .info
            .state = JobState::Running;
    }

    /// Job `id` (running) goes back to its queue (the daemon stops; it continues at the next
    /// start).
    pub fn set_requeued(&mut self, id: u64) {
        let r = self.jobs[&id].record.clone();
        self.count_running(&r, false);
        self.enqueue(&r);
        self.jobs.get_mut(&id).expect("a job").record.info.state = JobState::Queued;
    }

    /// Job `id` (queued or running) ends in `state` at `now`.
    pub fn set_ended(&mut self, id: u64, state: JobState, now: u64) {
        let r = self.jobs[&id].record.clone();
        match r.info.state {
            JobState::Queued => self.dequeue(&r),
            JobState::Running => self.count_running(&r, false),
            _ => return,
        }
        self.count_unfinished(&r, false);
        count(&mut self.ended, r.info.owner, true);
        let info = &mut self.jobs.get_mut(&id).expect("a job").record.info;
        info.state = state;
        info.ended = Some(now);
    }

    /// Forgets job `id` (ended).
    pub fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.jobs.remove(&id)?;
        count(&mut self.ended, entry.record.info.owner, false);
        Some(entry)
    }

    /// The run of a job becomes known by its identity (the job made it).
    pub fn set_run_id(&mut self, id: u64, run_id: DirId) {
        let r = self.jobs[&id].record.clone();
        self.count_unfinished(&r, false);
        let entry = self.jobs.get_mut(&id).expect("a job");
        entry.record.run_id = Some(run_id);
        let r = entry.record.clone();
        self.count_unfinished(&r, true);
    }

    /// Jobs `owner` has queued or running.
    pub fn unfinished(&self, owner: u32) -> usize {
        self.unfinished.get(&owner).copied().unwrap_or(0)
    }

    /// Serve jobs `owner` has queued or running.
    pub fn serving(&self, owner: u32) -> usize {
        self.serving.get(&owner).copied().unwrap_or(0)
    }

    /// Ended jobs `owner` keeps.
    pub fn ended(&self, owner: u32) -> usize {
        self.ended.get(&owner).copied().unwrap_or(0)
    }

    /// Whether a job queued or running works on `run`.
    pub fn run_busy(&self, run: &RunKey) -> bool {
        self.busy_runs.contains_key(run)
    }

    /// The queued jobs to start now, at most `slots(queue)` running in each queue: in each, the
    /// first job of the owner with the fewest running there goes first (ties: the earlier
    /// job), so that one user's many jobs take turns with the others'; users' jobs leave the
    /// reserved slots to the admin group's and stop at `per_user`; a job on a device node
    /// another job holds waits. The work is the number of queues, owners and jobs started.
    pub fn to_start(&self, slots: impl Fn(&str) -> Slots) -> Vec<u64> {
        let mut starting = Vec::new();
        for (queue, owners) in &self.queued {
            let s = slots(queue);
            let mut running = self.running.get(queue).copied().unwrap_or(0);
            let mut users = self.running_users.get(queue).copied().unwrap_or(0);
            let mut by_owner: HashMap<u32, usize> = HashMap::new();
            let mut taken: HashSet<u32> = HashSet::new();
            let mut nodes: HashSet<&str> = HashSet::new();
            while running < s.total {
                let mut best: Option<(usize, u64, u32)> = None;
                for (&owner, ids) in owners {
                    if taken.contains(&owner) {
                        continue;
                    }
                    let Some(&id) = ids.iter().next() else {
                        continue;
                    };
                    let r = &self.jobs[&id].record;
                    let mine = self
                        .running_by_owner
                        .get(&(queue.clone(), owner))
                        .copied()
                        .unwrap_or(0)
                        + by_owner.get(&owner).copied().unwrap_or(0);
                    if !r.admin && (users >= s.total - s.reserved || mine >= s.per_user) {
                        continue;
                    }
                    if let Some(node) = &r.device_node
                        && (self.busy_nodes.contains(node) || nodes.contains(node.as_str()))
                    {
                        continue;
                    }
                    if best.is_none_or(|(m, i, _)| (mine, id) < (m, i)) {
                        best = Some((mine, id, owner));
                    }
                }
                let Some((_, id, owner)) = best else {
                    break;
                };
                let r = &self.jobs[&id].record;
                running += 1;
                users += usize::from(!r.admin);
                *by_owner.entry(owner).or_default() += 1;
                if let Some(node) = &r.device_node {
                    nodes.insert(node);
                }
                // One job of an owner a pass: its next is looked at in the next pass.
                taken.insert(owner);
                starting.push(id);
            }
        }
        starting
    }

    /// Queued jobs by queue, for the metrics.
    pub fn queue_depths(&self) -> BTreeMap<&str, usize> {
        self.queued
            .iter()
            .map(|(q, owners)| (q.as_str(), owners.values().map(BTreeSet::len).sum()))
            .collect()
    }
}
