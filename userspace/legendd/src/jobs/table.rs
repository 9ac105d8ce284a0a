//! The job table, with indexes kept alongside so that no request, and no scheduling pass,
//! walks every job: queued jobs by device queue and owner in submission order, running jobs
//! by queue and owner, unfinished and ended jobs by owner, the runs and device nodes in use.
//! A job on several GPUs waits in one queue of its own ([`GPU_SET_QUEUE`]) and takes a slot of
//! each of its GPUs' queues at once, or none: no job ever holds one GPU while waiting for
//! another, so two such jobs cannot deadlock; the earliest waiting one holds the GPUs it
//! waits for against later jobs, so a stream of one-GPU jobs cannot starve it.
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

/// The queue of jobs that train on several GPUs (`training.gpus` > 1) until they start: they
/// are then given that many GPUs, the first ones with room.
pub const GPU_SET_QUEUE: &str = "cuda";

/// The queue of GPU `ordinal` (the daemon's numbering, in its `CUDA_VISIBLE_DEVICES`).
pub fn gpu_queue(ordinal: u32) -> String {
    format!("cuda:{ordinal}")
}

/// A job a scheduling pass starts, with the GPUs it is given (empty outside the `cuda` queue).
#[derive(Debug, PartialEq, Eq)]
pub struct Start {
    /// The job.
    pub id: u64,
    /// Its GPUs, by the daemon's ordinal.
    pub devices: Vec<u32>,
}

/// The GPUs the earliest waiting job of the `cuda` queue holds: later jobs start on others.
struct Held {
    id: u64,
    devices: Vec<u32>,
}

/// What a scheduling pass has started so far, on top of the table's running counts.
#[derive(Default)]
struct Pass<'a> {
    running: HashMap<String, usize>,
    users: HashMap<String, usize>,
    by_owner: HashMap<(String, u32), usize>,
    nodes: HashSet<&'a str>,
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

impl Pass<'_> {
    /// Job `r` takes a slot of `queue` in this pass.
    fn take(&mut self, queue: &str, r: &Record) {
        *self.running.entry(queue.to_owned()).or_default() += 1;
        if !r.admin {
            *self.users.entry(queue.to_owned()).or_default() += 1;
        }
        *self
            .by_owner
            .entry((queue.to_owned(), r.info.owner))
            .or_default() += 1;
    }
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
    /// Adds a job as loaded or submitted, counted as its state says (a queued job holds no
    /// GPUs, whatever an earlier start gave it).
    pub fn insert(&mut self, mut entry: Entry) {
        if entry.record.info.state == JobState::Queued {
            Self::give_back_devices(&mut entry.record);
        }
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
        for queue in r.running_queues() {
            count(&mut self.running, queue.clone(), up);
            if !r.admin {
                count(&mut self.running_users, queue.clone(), up);
            }
            count(&mut self.running_by_owner, (queue, r.info.owner), up);
        }
        if let Some(node) = &r.device_node {
            if up {
                self.busy_nodes.insert(node.clone());
            } else {
                self.busy_nodes.remove(node);
            }
        }
    }

    /// Job `start.id` (queued) starts, on the GPUs the pass gave it.
    pub fn set_running(&mut self, start: Start) {
        let record = &mut self.jobs.get_mut(&start.id).expect("a queued job").record;
        record.devices = start.devices;
        record.info.device = Some(record.device_label());
        record.info.state = JobState::Running;
        let r = record.clone();
        self.dequeue(&r);
        self.count_running(&r, true);
    }

    /// Job `id` (running) goes back to its queue (the daemon stops; it continues at the next
    /// start), giving its GPUs back.
    pub fn set_requeued(&mut self, id: u64) {
        let r = self.jobs[&id].record.clone();
        self.count_running(&r, false);
        self.enqueue(&r);
        let record = &mut self.jobs.get_mut(&id).expect("a job").record;
        Self::give_back_devices(record);
        record.info.state = JobState::Queued;
    }

    fn give_back_devices(record: &mut Record) {
        record.devices.clear();
        record.info.device = Some(record.device_label());
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
    /// another job holds waits. Jobs of the `cuda` queue go first, each given `gpus` of the
    /// daemon's `gpu_count` GPUs with room where no earlier job waits, all at once; the first
    /// that cannot start holds the GPUs it will get (the least busy, idle ones included)
    /// against every job submitted after it: no backfilling, as the daemon cannot tell how
    /// long a job would keep a GPU. The work is the
    /// number of queues, owners, GPUs and jobs started.
    pub fn to_start(&self, slots: impl Fn(&str) -> Slots, gpu_count: u32) -> Vec<Start> {
        let mut pass = Pass::default();
        let mut starting = Vec::new();
        let held = self.start_gpu_sets(&mut pass, &slots, gpu_count, &mut starting);
        for (queue, owners) in &self.queued {
            if queue == GPU_SET_QUEUE {
                continue;
            }
            let s = slots(queue);
            // Jobs after the holder wait for the GPUs it holds.
            let held_after = held
                .as_ref()
                .filter(|h| h.devices.iter().any(|&d| gpu_queue(d) == *queue))
                .map_or(u64::MAX, |h| h.id);
            let mut taken: HashSet<u32> = HashSet::new();
            loop {
                let mut best: Option<(usize, u64, u32)> = None;
                for (&owner, ids) in owners {
                    if taken.contains(&owner) {
                        continue;
                    }
                    let Some(&id) = ids.iter().next() else {
                        continue;
                    };
                    let r = &self.jobs[&id].record;
                    if id > held_after || !self.has_room(&pass, queue, s, r) {
                        continue;
                    }
                    if let Some(node) = &r.device_node
                        && (self.busy_nodes.contains(node) || pass.nodes.contains(node.as_str()))
                    {
                        continue;
                    }
                    let mine = self.owner_running(&pass, queue, owner);
                    if best.is_none_or(|(m, i, _)| (mine, id) < (m, i)) {
                        best = Some((mine, id, owner));
                    }
                }
                let Some((_, id, owner)) = best else {
                    break;
                };
                let r = &self.jobs[&id].record;
                pass.take(queue, r);
                if let Some(node) = &r.device_node {
                    pass.nodes.insert(node);
                }
                // One job of an owner a pass: its next is looked at in the next pass.
                taken.insert(owner);
                starting.push(Start {
                    id,
                    devices: Vec::new(),
                });
            }
        }
        starting
    }

    /// Starts the jobs of the `cuda` queue that find room on enough GPUs, the owner with the
    /// fewest GPU slots running first (ties: the earlier job); returns what the first one that
    /// cannot start holds.
    fn start_gpu_sets<'a>(
        &'a self,
        pass: &mut Pass<'a>,
        slots: &impl Fn(&str) -> Slots,
        gpu_count: u32,
        starting: &mut Vec<Start>,
    ) -> Option<Held> {
        let owners = self.queued.get(GPU_SET_QUEUE)?;
        let mut held: Option<Held> = None;
        let mut taken: HashSet<u32> = HashSet::new();
        loop {
            let next = owners
                .iter()
                .filter(|(owner, _)| !taken.contains(owner))
                .filter_map(|(&owner, ids)| {
                    let id = *ids.iter().next()?;
                    Some((self.owner_gpu_slots(pass, owner, gpu_count), id, owner))
                })
                .min();
            let Some((_, id, owner)) = next else {
                return held;
            };
            taken.insert(owner);
            let r = &self.jobs[&id].record;
            let wanted = r.gpus as usize;
            if wanted > gpu_count as usize {
                // Never held for: the daemon fails such jobs when it loads them.
                continue;
            }
            // A GPU is free for it if it has room and no job submitted before it waits there.
            let free: Vec<u32> = (0..gpu_count)
                .filter(|d| held.as_ref().is_none_or(|h| !h.devices.contains(d)))
                .filter(|&d| {
                    let queue = gpu_queue(d);
                    self.has_room(pass, &queue, slots(&queue), r)
                        && self.first_waiting(&queue).is_none_or(|first| first > id)
                })
                .collect();
            if free.len() >= wanted {
                let devices = free[..wanted].to_vec();
                for &d in &devices {
                    pass.take(&gpu_queue(d), r);
                }
                starting.push(Start { id, devices });
            } else if held.is_none() {
                held = Some(Held {
                    id,
                    devices: self.least_busy_gpus(pass, gpu_count, wanted),
                });
            }
        }
    }

    /// The `wanted` GPUs with the fewest jobs running (ties: the lower ordinal): those that
    /// free first when no job starts on them.
    fn least_busy_gpus(&self, pass: &Pass, gpu_count: u32, wanted: usize) -> Vec<u32> {
        let mut gpus: Vec<(usize, u32)> = (0..gpu_count)
            .map(|d| (self.queue_running(pass, &gpu_queue(d)), d))
            .collect();
        gpus.sort_unstable();
        gpus.into_iter().take(wanted).map(|(_, d)| d).collect()
    }

    /// The earliest job waiting in `queue` (each owner's waiting jobs are in id order).
    fn first_waiting(&self, queue: &str) -> Option<u64> {
        self.queued
            .get(queue)?
            .values()
            .filter_map(|ids| ids.first().copied())
            .min()
    }

    fn queue_running(&self, pass: &Pass, queue: &str) -> usize {
        self.running.get(queue).copied().unwrap_or(0)
            + pass.running.get(queue).copied().unwrap_or(0)
    }

    fn owner_running(&self, pass: &Pass, queue: &str, owner: u32) -> usize {
        let key = (queue.to_owned(), owner);
        self.running_by_owner.get(&key).copied().unwrap_or(0)
            + pass.by_owner.get(&key).copied().unwrap_or(0)
    }

    fn owner_gpu_slots(&self, pass: &Pass, owner: u32, gpu_count: u32) -> usize {
        (0..gpu_count)
            .map(|d| self.owner_running(pass, &gpu_queue(d), owner))
            .sum()
    }

    /// Whether job `r` may take a slot of `queue` now: the queue has one, and, for a user
    /// outside the admin group, one outside the reserved slots and within `per_user`.
    fn has_room(&self, pass: &Pass, queue: &str, s: Slots, r: &Record) -> bool {
        if self.queue_running(pass, queue) >= s.total {
            return false;
        }
        if r.admin {
            return true;
        }
        let users = self.running_users.get(queue).copied().unwrap_or(0)
            + pass.users.get(queue).copied().unwrap_or(0);
        users < s.total - s.reserved && self.owner_running(pass, queue, r.info.owner) < s.per_user
    }

    /// Job slots taken, by queue (a job on several GPUs in each of theirs), for the metrics.
    pub fn running_slots(&self) -> BTreeMap<&str, usize> {
        self.running.iter().map(|(q, &n)| (q.as_str(), n)).collect()
    }

    /// Queued jobs by queue, for the metrics.
    pub fn queue_depths(&self) -> BTreeMap<&str, usize> {
        self.queued
            .iter()
            .map(|(q, owners)| (q.as_str(), owners.values().map(BTreeSet::len).sum()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legend_daemon_api::{JobInfo, Progress};

    /// A queued train job `id` of `owner` in `queue`, on `gpus` GPUs.
    fn job(id: u64, owner: u32, queue: &str, gpus: u32) -> Entry {
        Entry::new(Record {
            format: super::super::record::RECORD_FORMAT,
            info: JobInfo {
                id,
                owner,
                spec: JobSpec::Train {
                    dataset: None,
                    out: PathBuf::from(format!("/runs/{id}")),
                    config: String::new(),
                    sets: Vec::new(),
                    resume: false,
                },
                state: JobState::Queued,
                device: None,
                submitted: id,
                started: None,
                ended: None,
                progress: Progress::default(),
                error: None,
                result: None,
                process: None,
            },
            queue: queue.into(),
            gpus,
            devices: Vec::new(),
            run_made: false,
            interruptions: 0,
            gid: None,
            admin: false,
            run_id: None,
            expect: None,
            device_node: None,
        })
    }

    /// The scheduler's passes over `gpu_count` GPUs of one slot each (a user may hold
    /// `per_user` of each) until nothing more starts: what each pass started.
    fn schedule(t: &mut Table, gpu_count: u32, per_user: usize) -> Vec<Vec<Start>> {
        schedule_slots(t, gpu_count, 1, per_user)
    }

    /// As [`schedule`], with `total` slots a GPU.
    fn schedule_slots(
        t: &mut Table,
        gpu_count: u32,
        total: usize,
        per_user: usize,
    ) -> Vec<Vec<Start>> {
        let slots = |_: &str| Slots {
            total,
            reserved: 0,
            per_user,
        };
        let mut passes = Vec::new();
        loop {
            let starting = t.to_start(slots, gpu_count);
            if starting.is_empty() {
                return passes;
            }
            let shown = starting
                .iter()
                .map(|s| Start {
                    id: s.id,
                    devices: s.devices.clone(),
                })
                .collect();
            for start in starting {
                t.set_running(start);
            }
            passes.push(shown);
        }
    }

    fn started(passes: &[Vec<Start>]) -> Vec<u64> {
        let mut ids: Vec<u64> = passes.iter().flatten().map(|s| s.id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn a_gpu_set_takes_all_its_gpus_at_once_or_none() {
        let mut t = Table::default();
        t.insert(job(1, 10, "cuda:1", 1));
        t.insert(job(2, 11, GPU_SET_QUEUE, 2));
        t.insert(job(3, 12, GPU_SET_QUEUE, 2));
        let passes = schedule(&mut t, 4, 4);
        // Job 1 was first on GPU 1: job 2 gets GPUs 0 and 2, job 3 finds one GPU and waits
        // without taking it.
        assert_eq!(started(&passes), [1, 2]);
        assert_eq!(t.jobs[&2].record.devices, [0, 2]);
        assert_eq!(t.jobs[&2].record.info.device.as_deref(), Some("cuda:0,2"));
        let slots = t.running_slots();
        assert_eq!(
            [
                slots.get("cuda:0"),
                slots.get("cuda:1"),
                slots.get("cuda:2")
            ],
            [Some(&1), Some(&1), Some(&1)]
        );
        assert_eq!(slots.get("cuda:3"), None);
        assert!(t.jobs[&3].record.devices.is_empty());
        assert_eq!(t.jobs[&3].record.info.device.as_deref(), Some("2 GPUs"));
        // Two sets each waiting for the other's GPU cannot happen: job 3 starts once job 1
        // ends, on GPU 1 and the one left.
        t.set_ended(1, JobState::Succeeded, 0);
        assert_eq!(started(&schedule(&mut t, 4, 4)), [3]);
        assert_eq!(t.jobs[&3].record.devices, [1, 3]);
        // Its GPUs count for it until it ends, on every one.
        t.set_ended(2, JobState::Succeeded, 0);
        t.insert(job(4, 10, "cuda:3", 1));
        t.insert(job(5, 10, "cuda:0", 1));
        assert_eq!(started(&schedule(&mut t, 4, 4)), [5]);
    }

    #[test]
    fn a_waiting_gpu_set_is_not_starved_by_later_one_gpu_jobs() {
        let mut t = Table::default();
        for (id, gpu) in [(1, 0), (2, 1), (3, 2), (4, 3)] {
            t.insert(job(id, 20 + id as u32, &gpu_queue(gpu), 1));
        }
        assert_eq!(started(&schedule(&mut t, 4, 1)), [1, 2, 3, 4]);
        t.insert(job(5, 30, GPU_SET_QUEUE, 2));
        // A stream of one-GPU jobs on every GPU, submitted after the set.
        let mut next = 6;
        let mut submit_stream = |t: &mut Table| {
            for gpu in 0..4 {
                t.insert(job(next, 40 + next as u32, &gpu_queue(gpu), 1));
                next += 1;
            }
        };
        submit_stream(&mut t);
        // GPU 2 frees: the set holds it (with GPU 0, as busy as the rest), though six jobs
        // submitted after the set wait for it.
        t.set_ended(3, JobState::Succeeded, 0);
        assert!(schedule(&mut t, 4, 1).is_empty());
        submit_stream(&mut t);
        // GPU 0 frees: the set starts on GPUs 0 and 2, ahead of the later jobs there.
        t.set_ended(1, JobState::Succeeded, 0);
        assert_eq!(started(&schedule(&mut t, 4, 1)), [5]);
        assert_eq!(t.jobs[&5].record.devices, [0, 2]);
        // The stream goes on where the set is not: GPU 1's first job once GPU 1 frees.
        t.set_ended(2, JobState::Succeeded, 0);
        assert_eq!(started(&schedule(&mut t, 4, 1)), [7]);
    }

    #[test]
    fn earlier_one_gpu_jobs_keep_their_turn() {
        let mut t = Table::default();
        t.insert(job(1, 50, "cuda:0", 1));
        t.insert(job(2, 51, GPU_SET_QUEUE, 2));
        t.insert(job(3, 52, "cuda:0", 1));
        // Job 1 was first on GPU 0: it starts, and the set waits holding GPUs 0 and 1; job 3
        // (after the set) waits too.
        assert_eq!(started(&schedule(&mut t, 2, 1)), [1]);
        t.set_ended(1, JobState::Succeeded, 0);
        assert_eq!(started(&schedule(&mut t, 2, 1)), [2]);
        t.set_ended(2, JobState::Succeeded, 0);
        // Jobs 3 and 4 came before the new set 5: they go first.
        t.insert(job(4, 51, "cuda:1", 1));
        t.insert(job(5, 51, GPU_SET_QUEUE, 2));
        assert_eq!(started(&schedule(&mut t, 2, 1)), [3, 4]);
        assert!(t.jobs[&5].record.devices.is_empty());
    }

    #[test]
    fn a_gpu_set_counts_in_its_owners_limits_on_every_gpu() {
        let mut t = Table::default();
        t.insert(job(1, 80, GPU_SET_QUEUE, 2));
        // Two slots a GPU, one a user: the set's owner runs on both GPUs.
        assert_eq!(started(&schedule_slots(&mut t, 2, 2, 1)), [1]);
        t.insert(job(2, 80, "cuda:1", 1));
        t.insert(job(3, 80, GPU_SET_QUEUE, 2));
        t.insert(job(4, 81, "cuda:1", 1));
        t.insert(job(5, 81, GPU_SET_QUEUE, 2));
        // Owner 80's next jobs wait for their set; owner 81's run beside it, as far as slots go.
        let passes = schedule_slots(&mut t, 2, 2, 1);
        assert_eq!(started(&passes), [4]);
        t.set_ended(1, JobState::Succeeded, 0);
        assert_eq!(started(&schedule_slots(&mut t, 2, 2, 1)), [2]);
    }

    #[test]
    fn a_requeued_or_reloaded_gpu_set_gives_its_gpus_back() {
        let mut t = Table::default();
        t.insert(job(1, 60, GPU_SET_QUEUE, 2));
        assert_eq!(started(&schedule(&mut t, 2, 1)), [1]);
        t.set_requeued(1);
        assert!(t.jobs[&1].record.devices.is_empty());
        t.insert(job(2, 61, "cuda:1", 1));
        // Job 1 is earlier: it holds GPUs 0 and 1 and starts again.
        assert_eq!(started(&schedule(&mut t, 2, 1)), [1]);
        let mut loaded = t.jobs.remove(&1).expect("job 1");
        loaded.record.info.state = JobState::Queued;
        let mut fresh = Table::default();
        fresh.insert(loaded);
        assert!(fresh.jobs[&1].record.devices.is_empty());
        assert_eq!(fresh.jobs[&1].record.info.device.as_deref(), Some("2 GPUs"));
    }

    #[test]
    fn a_set_wanting_more_gpus_than_there_are_holds_none() {
        let mut t = Table::default();
        t.insert(job(1, 70, GPU_SET_QUEUE, 4));
        t.insert(job(2, 71, "cuda:0", 1));
        assert_eq!(started(&schedule(&mut t, 2, 1)), [2]);
    }
}
