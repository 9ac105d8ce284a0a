//! Training on several GPUs in one process: one worker a GPU, each a [`Trainer`] of its own
//! (its compute engine, its swap path and slots), running its share of every round of
//! legend-planner's K-GPU schedule ([`GpuSchedule`]: each GPU holding two partitions a round),
//! with partitions handed from worker to worker between rounds over a [`Link`] — NCCL between
//! GPUs; channels between the CPU engine's workers, which run this same coordinator in tests
//! — when N = 2K, or parked in the shared home between rounds when N ≥ 3K.
//!
//! A round: every worker passes the round gate (where they agree whether to stop), takes its
//! hand-overs (the schedule's moves, the same list on every worker, so every send meets its
//! receive) or, parked, writes home what the round drops and takes the partition it read ahead
//! during the round before, queues the read of its next round's partition, then trains its
//! pieces with negatives drawn from its two partitions. The home orders one partition's
//! write-back by one worker before its read by another ([`SharedMemoryStore`]). No partition
//! is on two workers in a round, so the workers' updates never meet, and since every batch is
//! keyed by its bucket (legend-model's `BatchKey`), a bucket trains exactly as it would on one
//! worker with the same resident partitions: the K-worker epoch equals the schedule run one
//! worker after another, bit for bit on the CPU engine.
//!
//! Between epochs the partitions stay where the last round left them (epochs alternate the
//! rounds' direction); they wait in the shared host store ([`SharedMemoryStore`]) only at a
//! layout change (a resume). A failing worker sets the shared give-up flag: the others leave
//! the gate, their NCCL waits abort their communicators, and the error names the worker.
//!
//! On several hosts ([`hosts`]) each process runs its host's workers of one schedule over all
//! GPUs (legend-planner's `plan_hosts`), its round gates agreed with the other hosts', and host
//! 0's `Workers` leads: it tells the others what to train, gathers their reports and streams
//! their partitions for checkpoints and evaluations.

pub mod hosts;
mod link;
pub(crate) mod report;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use legend_dataset::{Buckets, PartitionScheme};
use legend_planner::GpuSchedule;
use serde::{Deserialize, Serialize};

use crate::compute::RowSink;
use crate::config::Config;
use crate::engine::Engine;
use crate::error::TrainError;
use crate::progress::EpochCut;
use crate::relations::Relations;
use crate::store::{MemoryStore, PartitionHome, SharedMemoryStore};
use crate::trainer::{EpochEnd, EpochReport, Trainer};

pub(crate) use link::Link;
use link::{NcclLink, channel_links};
pub use report::{RoundReport, WorkersReport};

use hosts::Hosts;

/// How often the coordinating thread reports progress and looks for a failed worker.
const PUMP: Duration = Duration::from_millis(50);

struct Worker {
    trainer: Trainer,
    link: Box<dyn Link>,
    device: String,
}

impl Worker {
    /// `e`, as worker `g`'s failure (naming its device).
    fn failed(&self, g: usize, e: TrainError) -> TrainError {
        TrainError::Worker {
            worker: g,
            device: self.device.clone(),
            source: Box::new(e),
        }
    }
}

/// K workers training one run (see the module docs): this host's, of all hosts' K.
pub struct Workers {
    /// This host's workers.
    workers: Vec<Worker>,
    /// The schedule's index of `workers[0]` (GPUs are numbered host-major).
    first: usize,
    /// Workers of the run, on every host.
    gpus: usize,
    schedule: GpuSchedule,
    /// Per round, the most batches any worker trains in it: the steps every worker takes
    /// when relation gradients are summed after each (decoders with relations).
    round_steps: Vec<u64>,
    /// The decoder has relations: workers step in lockstep, summing their gradients.
    lockstep: bool,
    scheme: PartitionScheme,
    relations: Relations,
    negatives: usize,
    /// Bytes of one partition as the workers move it (resident f32 rows and state).
    partition_bytes: u64,
    /// Where this host's partitions rest between layouts (its workers' shared store).
    home: SharedMemoryStore,
    /// What each worker (of every host) holds: the layout of the last round entered, once
    /// the partitions were laid out.
    layout: Option<Vec<[u32; 2]>>,
    /// The learning rate set last (host 0 passes it on).
    learning_rate: f32,
    /// The other hosts, on several.
    hosts: Option<Hosts>,
    /// Every worker's device, host-major.
    devices: Vec<String>,
}

/// One host's part of an epoch: what [`Workers::run_part`] returns, and the other hosts send
/// host 0.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct HostEpoch {
    /// Per round trained, per worker of the host.
    rounds: Vec<Vec<RoundReport>>,
    /// Loss summed over what the host trained.
    loss: f64,
    /// Positive edges the host trained (in this part of the epoch).
    edges: u64,
    /// It stopped at a gate, as agreed.
    stopped: bool,
    /// The host's peak resident memory so far.
    peak_rss_bytes: u64,
}

impl Workers {
    /// Workers on `engines` (all GPUs or all CPU engines, at least two) for `config` (whose
    /// `storage.num_partitions` is 2K), the partitions starting in `home`.
    pub fn new(
        config: &Config,
        buckets: Buckets,
        degrees: &[u32],
        home: MemoryStore,
        relations: Relations,
        engines: Vec<Engine>,
    ) -> Result<Workers, TrainError> {
        let k = engines.len();
        assert!(k >= 2, "workers are for several engines");
        let scheme = buckets.scheme();
        let schedule = legend_planner::plan_gpus(
            scheme.num_partitions,
            k as u32,
            &batch_counts(config, &buckets.counts()),
        )
        .map_err(|e| TrainError::Resume(e.to_string()))?;
        let gpus = gpus_of(&engines);
        let links: Vec<Box<dyn Link>> = if gpus.is_empty() {
            channel_links(k)
                .into_iter()
                .map(|l| Box::new(l) as Box<dyn Link>)
                .collect()
        } else {
            assert_eq!(gpus.len(), k, "all workers GPUs, or none");
            legend_cuda::nccl::communicators(&gpus)?
                .into_iter()
                .map(|c| Box::new(NcclLink::new(c)) as Box<dyn Link>)
                .collect()
        };
        let home = SharedMemoryStore::new(home);
        Workers::assemble(
            config, buckets, degrees, home, relations, engines, schedule, links, 0, None,
        )
    }

    /// The workers of `engines` (schedule indices `first ..`) over `links`, following
    /// `schedule`, their partitions resting in `home`; `hosts` on several hosts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assemble(
        config: &Config,
        buckets: Buckets,
        degrees: &[u32],
        home: SharedMemoryStore,
        relations: Relations,
        engines: Vec<Engine>,
        schedule: GpuSchedule,
        mut links: Vec<Box<dyn Link>>,
        first: usize,
        hosts: Option<Hosts>,
    ) -> Result<Workers, TrainError> {
        let k = schedule.gpus as usize;
        let scheme = buckets.scheme();
        // Each worker's swap path: its two partitions, and a third slot for the one arriving
        // (a send and a receive never share a slot).
        let mut worker_config = config.clone();
        worker_config.storage.buffer_capacity = 2;
        worker_config.storage.prefetch = true;
        worker_config.storage.read_ahead = true;
        let shape = config.entity_shape();
        let partition_bytes = scheme.rows_per_partition * (shape.dim + shape.state) as u64 * 4;
        let mut workers = Vec::with_capacity(engines.len());
        for (i, engine) in engines.into_iter().enumerate() {
            let i = first + i;
            let device = engine.describe();
            tracing::info!("worker {i} of {k}: {device}");
            let trainer = Trainer::on_device(
                &worker_config,
                buckets.clone(),
                degrees,
                PartitionHome::Shared(home.clone()),
                relations.clone(),
                engine,
            )
            .map_err(|e| TrainError::Worker {
                worker: i,
                device: device.clone(),
                source: Box::new(e),
            })?;
            workers.push(Worker {
                trainer,
                link: links.remove(0),
                device,
            });
        }
        // Relations: one AdaGrad step a step from the gradients summed over the workers'
        // batches (Documentation/gpu.md, "Relations on several GPUs").
        let lockstep = config.decoder().uses_relations();
        if lockstep {
            for (i, w) in workers.iter_mut().enumerate() {
                w.trainer
                    .defer_relations()
                    .map_err(|e| w.failed(first + i, e))?;
            }
        }
        let round_steps = schedule
            .rounds
            .iter()
            .map(legend_planner::GpuRound::lockstep_steps)
            .collect();
        let moves = if schedule.parks() {
            format!(
                "{} partitions of {:.2} GB read from host memory and as many parked ({} not read ahead)",
                schedule.home_loads,
                partition_bytes as f64 / 1e9,
                schedule.exposed_loads
            )
        } else {
            format!(
                "{} hand-overs of {:.2} GB each",
                schedule.moves_per_epoch(),
                partition_bytes as f64 / 1e9
            )
        };
        tracing::info!(
            "{k} workers, {} rounds an epoch, {moves}; predicted imbalance {:.3}",
            schedule.rounds.len(),
            schedule.predicted_imbalance
        );
        let devices = workers.iter().map(|w| w.device.clone()).collect();
        Ok(Workers {
            workers,
            first,
            gpus: k,
            schedule,
            round_steps,
            lockstep,
            scheme,
            relations,
            negatives: config.training.negatives.negatives_per_positive,
            partition_bytes,
            home,
            layout: None,
            learning_rate: config.optimizer.learning_rate,
            hosts,
            devices,
        })
    }

    /// The schedule the workers follow.
    pub fn schedule(&self) -> &GpuSchedule {
        &self.schedule
    }

    /// The partitioning.
    pub fn scheme(&self) -> PartitionScheme {
        self.scheme
    }

    /// The relation parameters, as of the last [`Workers::sync_relations`] (every worker
    /// holds the same).
    pub fn relations(&self) -> &Relations {
        &self.relations
    }

    /// Makes [`Workers::relations`] current: worker 0's (all workers' are equal, on every
    /// host).
    pub fn sync_relations(&mut self) -> Result<(), TrainError> {
        let w = &mut self.workers[0];
        w.trainer
            .sync_relations()
            .map_err(|e| w.failed(self.first, e))?;
        self.relations = w.trainer.relations().clone();
        Ok(())
    }

    /// Sets every worker's learning rate (on every host: host 0 passes it on with the next
    /// epoch).
    pub fn set_learning_rate(&mut self, lr: f32) {
        self.learning_rate = lr;
        for w in &mut self.workers {
            w.trainer.set_learning_rate(lr);
        }
    }

    /// Calls `f` with partition `p`'s rows from the worker that holds it, on whichever host
    /// (or from the store, before the partitions are laid out).
    pub fn stream_partition(&mut self, p: u32, f: &mut RowSink<'_>) -> Result<(), TrainError> {
        let holder = self
            .layout
            .as_ref()
            .and_then(|l| l.iter().position(|pair| pair.contains(&p)));
        match holder {
            Some(g) if !self.is_local(g) => self.stream_remote(p, g, f),
            Some(g) => self.workers[g - self.first].trainer.stream_partition(p, f),
            None => self.workers[0].trainer.stream_partition(p, f),
        }
    }

    /// Whether worker `g` (a schedule index) runs on this host.
    fn is_local(&self, g: usize) -> bool {
        (self.first..self.first + self.workers.len()).contains(&g)
    }

    /// Settles every worker (on every host) for a checkpoint; the store is host memory, which
    /// keeps no checkpoints itself: returns `false`, the caller saves the tables
    /// ([`Workers::stream_partition`]).
    pub fn checkpoint(&mut self) -> Result<bool, TrainError> {
        self.settle_here()?;
        if let Some(h) = &self.hosts {
            h.settle_others()?;
        }
        Ok(false)
    }

    /// Waits until this host's workers' queued steps have run.
    fn settle_here(&mut self) -> Result<(), TrainError> {
        for w in &mut self.workers {
            w.trainer.synchronize()?;
        }
        Ok(())
    }

    /// Moves the partitions so that worker `g` holds `held[g]`: what a worker gives up goes
    /// back to the shared store first, then each reads what it lacks (on several hosts,
    /// partitions pass through host 0's store: see [`hosts`]).
    fn lay_out(&mut self, held: &[[u32; 2]]) -> Result<(), TrainError> {
        let mine = &held[self.first..self.first + self.workers.len()];
        for (i, (w, keep)) in self.workers.iter_mut().zip(mine).enumerate() {
            w.trainer
                .release_except(keep)
                .map_err(|e| w.failed(self.first + i, e))?;
        }
        if self.hosts.is_some() {
            self.gather_and_scatter(held)?;
        }
        for (i, (w, keep)) in self.workers.iter_mut().zip(mine).enumerate() {
            w.trainer
                .make_resident(keep)
                .map_err(|e| w.failed(self.first + i, e))?;
        }
        if let Some(h) = &self.hosts {
            h.laid_out()?;
        }
        self.layout = Some(held.to_vec());
        Ok(())
    }

    /// Trains epoch `epoch` from the round `from` stopped at (or its start), until it ends or
    /// `stop` is seen set at a round's gate; `progress` is called with the positives done. On
    /// several hosts, host 0 calls it: the other hosts train their part as it says.
    pub fn run_epoch_from(
        &mut self,
        epoch: u32,
        from: Option<EpochCut>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochEnd, TrainError> {
        let started = Instant::now();
        let k = self.gpus;
        let hosts = self.hosts.as_ref().map_or(1, Hosts::count);
        let order = self.schedule.round_order(epoch);
        let from = from.filter(|c| c.epoch == epoch);
        if let Some(cut) = from
            && (cut.workers != Some(k as u32)
                || cut.hosts.unwrap_or(1) != hosts
                || cut.swaps as usize > order.len())
        {
            let had = cut.workers.unwrap_or(1);
            let on = cut.hosts.unwrap_or(1);
            return Err(TrainError::Resume(format!(
                "epoch {epoch} stopped {} on {had} GPU(s) of {on} host(s); this run has {} of {hosts}: resume with training.gpus = {} and training.hosts = {on} to finish that epoch (a new number of GPUs or hosts takes over at an epoch boundary)",
                cut.describe(),
                k as u32 / hosts,
                had / on,
            )));
        }
        if let Some(h) = &self.hosts {
            h.start_epoch(epoch, from, self.learning_rate)?;
        }
        let base = from.map_or(0, |c| c.edges);
        let part = self
            .run_part(epoch, from, stop, &mut |done| progress(base + done))
            .inspect_err(|e| {
                if let Some(h) = &self.hosts {
                    h.failed_here(e);
                }
            })?;
        let first = from.map_or(0, |c| c.swaps as usize);
        let trained_rounds = part.rounds.len();
        let stopped = part.stopped;
        let parts = match &self.hosts {
            Some(h) => h.collect_epoch(part)?,
            None => vec![part],
        };
        let loss = from.map_or(0.0, |c| c.loss) + parts.iter().map(|p| p.loss).sum::<f64>();
        let edges = base + parts.iter().map(|p| p.edges).sum::<u64>();
        if stopped {
            return Ok(EpochEnd::Stopped(EpochCut {
                epoch,
                swaps: (first + trained_rounds) as u32,
                next: None,
                edges,
                loss,
                workers: Some(k as u32),
                hosts: (hosts > 1).then_some(hosts),
            }));
        }
        if !loss.is_finite() {
            return Err(TrainError::Diverged { epoch });
        }
        let seconds = started.elapsed().as_secs_f64();
        // Every host's workers side by side: the schedule's (host-major) order.
        let rounds: Vec<Vec<RoundReport>> = (0..trained_rounds)
            .map(|r| parts.iter().flat_map(|p| p.rounds[r].clone()).collect())
            .collect();
        let busy: f64 = rounds.iter().flatten().map(|r| r.compute_s).sum();
        let slowest: f64 = rounds
            .iter()
            .map(|r| r.iter().map(|w| w.compute_s).fold(0.0, f64::max))
            .sum();
        // Between the rounds trained now (a resume lays its first round out from the store).
        let moves: Vec<legend_planner::HandOver> = (first + 1..first + trained_rounds)
            .flat_map(|i| self.schedule.handovers_between(order[i - 1], order[i]))
            .collect();
        let per_host = k as u32 / hosts;
        let crossing = moves
            .iter()
            .filter(|m| GpuSchedule::crosses_hosts(m.from, m.to, per_host))
            .count() as u64;
        let handovers = moves.len() as u64;
        let home_reads: u64 = (first + 1..first + trained_rounds)
            .flat_map(|i| (0..k).map(move |g| (i, g)))
            .map(|(i, g)| self.schedule.from_home(order[i - 1], order[i], g).len() as u64)
            .sum();
        let trained_now = edges - base;
        let report = EpochReport {
            epoch,
            loss: loss / edges.max(1) as f64,
            edges,
            seconds,
            edges_per_sec: trained_now as f64 / seconds.max(1e-9),
            negatives_per_positive: self.negatives,
            buffer_states: trained_rounds as u64,
            resumed: from.is_some(),
            peak_rss_bytes: crate::footprint::peak_rss_bytes().unwrap_or(0),
            gpu_memory_bytes: self.workers[0].trainer.device_memory_in_use(),
            workers: Some(Box::new(WorkersReport {
                gpus: k as u32,
                devices: self.devices.clone(),
                rounds,
                handovers,
                handover_bytes: handovers * self.partition_bytes,
                home_reads,
                home_read_bytes: home_reads * self.partition_bytes,
                parallel_efficiency: busy / (k as f64 * seconds.max(1e-9)),
                imbalance: if busy > 0.0 {
                    slowest / (busy / k as f64)
                } else {
                    1.0
                },
                predicted_imbalance: self.schedule.predicted_imbalance,
                hosts,
                cross_host_handovers: crossing,
                cross_host_bytes: crossing * self.partition_bytes,
                host_peak_rss_bytes: if hosts > 1 {
                    parts.iter().map(|p| p.peak_rss_bytes).collect()
                } else {
                    Vec::new()
                },
            })),
            ..EpochReport::default()
        };
        Ok(EpochEnd::Done(report))
    }

    /// This host's part of epoch `epoch` from `from`: its workers' rounds, until the epoch
    /// ends or the gate (agreed with the other hosts) says stop; `progress` gets the positives
    /// trained here (and, on host 0, by the others so far).
    pub(crate) fn run_part(
        &mut self,
        epoch: u32,
        from: Option<EpochCut>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<HostEpoch, TrainError> {
        let order = self.schedule.round_order(epoch);
        let first = from.map_or(0, |c| c.swaps as usize);
        if first < order.len() {
            let held = self.schedule.rounds[order[first]].held.clone();
            self.lay_out(&held)?;
        }
        let kl = self.workers.len();
        let agree = self
            .hosts
            .as_ref()
            .map(|h| h.gate(&self.schedule, epoch, &order, first));
        let shared = Shared {
            gate: Gate::new(kl, agree),
            give_up: AtomicBool::new(false),
            edges: AtomicU64::new(0),
            stop,
            batch_ns: self
                .hosts
                .as_ref()
                .map_or_else(Default::default, Hosts::batch_ns),
        };
        // Before the first gate: the caller may raise `stop` (a checkpoint that is due).
        progress(0);
        let schedule = &self.schedule;
        let steps = self.lockstep.then_some(self.round_steps.as_slice());
        let rounds = &order[first..];
        let hosts = self.hosts.as_ref();
        let offset = self.first;
        let home = &self.home;
        home.resume();
        let outcomes: Vec<Result<WorkerEpoch, TrainError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .workers
                .iter_mut()
                .enumerate()
                .map(|(i, w)| {
                    let shared = &shared;
                    let g = offset + i;
                    std::thread::Builder::new()
                        .name(format!("legend-worker-{g}"))
                        .spawn_scoped(s, move || {
                            let r = run_rounds(g, w, schedule, steps, epoch, rounds, shared);
                            if r.is_err() {
                                shared.give_up.store(true, Ordering::Release);
                                shared.gate.fail();
                                // No worker waits for a partition this one will never park.
                                home.abandon();
                            }
                            r
                        })
                        .expect("spawning a worker thread")
                })
                .collect();
            // This thread reports progress (the caller's callback may raise `stop`) and stops
            // the workers when another host fails.
            loop {
                let edges = shared.edges.load(Ordering::Relaxed);
                progress(edges + hosts.map_or(0, Hosts::others_progress));
                if let Some(h) = hosts {
                    h.set_progress(edges);
                    if h.failed() {
                        shared.give_up.store(true, Ordering::Release);
                        shared.gate.fail();
                        home.abandon();
                    }
                }
                if handles.iter().all(|h| h.is_finished()) {
                    break;
                }
                std::thread::sleep(PUMP);
            }
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(TrainError::WorkerStopped)))
                .collect()
        });
        let edges = shared.edges.load(Ordering::Relaxed);
        progress(edges + hosts.map_or(0, Hosts::others_progress));
        let mut done = Vec::with_capacity(kl);
        let mut failure = None;
        for (i, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Ok(d) => done.push(d),
                // The first worker's own failure, not the others' stopping because of it (nor
                // the job's failure elsewhere, reported below as it happened).
                Err(TrainError::WorkerStopped | TrainError::Hosts(_)) => {}
                Err(e) => {
                    failure.get_or_insert(self.workers[i].failed(offset + i, e));
                }
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if let Some(e) = hosts.and_then(Hosts::failure) {
            return Err(e.into());
        }
        if done.len() < kl {
            return Err(TrainError::WorkerStopped);
        }
        let trained = done[0].rounds.len();
        if trained > 0 {
            self.layout = Some(
                self.schedule.rounds[order[first + trained - 1]]
                    .held
                    .clone(),
            );
        }
        Ok(HostEpoch {
            rounds: (0..trained)
                .map(|r| done.iter().map(|d| d.rounds[r].clone()).collect())
                .collect(),
            loss: done.iter().map(|d| d.loss).sum(),
            edges,
            stopped: done[0].stopped,
            peak_rss_bytes: crate::footprint::peak_rss_bytes().unwrap_or(0),
        })
    }
}

/// Batches a bucket of each count has (`training.batch_size` edges a batch): what schedules
/// balance.
pub(crate) fn batch_counts(config: &Config, counts: &[u64]) -> Vec<u64> {
    let batch = config.training.batch_size.max(1) as u64;
    counts.iter().map(|c| c.div_ceil(batch)).collect()
}

/// The devices among `engines` (all or none are GPUs).
pub(crate) fn gpus_of(engines: &[Engine]) -> Vec<&legend_cuda::Gpu> {
    engines
        .iter()
        .filter_map(|e| match e {
            Engine::Cuda { gpu, .. } => Some(&**gpu),
            Engine::Cpu => None,
        })
        .collect()
}

/// What one worker did in an epoch.
struct WorkerEpoch {
    rounds: Vec<RoundReport>,
    /// It stopped at a gate, as asked.
    stopped: bool,
    /// Its loss summed over what it trained (read in its thread: a GPU reports a step's
    /// failure, a row past f16's range, when the loss is read, and it is this worker's).
    loss: f64,
}

/// What the workers of an epoch share.
struct Shared<'a> {
    gate: Gate<'a>,
    /// Set when a worker fails: the others stop waiting for it.
    give_up: AtomicBool,
    /// Positive edges trained so far in this part of the epoch, by this host's workers.
    edges: AtomicU64,
    /// The caller's stop flag, read at the gates.
    stop: &'a AtomicBool,
    /// The slowest seconds per planned batch a round took here so far, in nanoseconds: what
    /// the next rounds' deadlines are planned from (on several hosts).
    batch_ns: std::sync::Arc<AtomicU64>,
}

/// Worker `g`'s rounds `rounds` of epoch `epoch`, the partitions laid out for the first; with
/// `steps` (each round's), in lockstep with the other workers, summing relation gradients.
fn run_rounds(
    g: usize,
    w: &mut Worker,
    schedule: &GpuSchedule,
    steps: Option<&[u64]>,
    epoch: u32,
    rounds: &[usize],
    shared: &Shared<'_>,
) -> Result<WorkerEpoch, TrainError> {
    let mut reports = Vec::with_capacity(rounds.len());
    // The partition read ahead for the next round, if any.
    let mut ahead: Option<u32> = None;
    for (i, &r) in rounds.iter().enumerate() {
        let mut report = RoundReport::default();
        let t = Instant::now();
        let go = shared.gate.pass(shared.stop, &shared.give_up)?;
        report.wait_s = t.elapsed().as_secs_f64();
        if !go {
            // The next round will not run: what was read for it goes back home unmodified.
            w.trainer.cancel_read_ahead()?;
            return Ok(WorkerEpoch {
                rounds: reports,
                stopped: true,
                loss: w.trainer.take_loss()?,
            });
        }
        if i > 0 {
            let t = Instant::now();
            if schedule.parks() {
                take_from_home(w, schedule, rounds[i - 1], r, g, &mut ahead)?;
            } else {
                hand_over(w, schedule, rounds[i - 1], r, g, &shared.give_up)?;
            }
            report.handover_s = t.elapsed().as_secs_f64();
        }
        // Parked: the next round's partition is read while this one trains, into the free
        // slot (the third: two train).
        if schedule.parks()
            && let Some(&next) = rounds.get(i + 1)
            && let Some(&p) = schedule.from_home(r, next, g).first()
        {
            w.trainer.read_ahead(p)?;
            ahead = Some(p);
        }
        let round = &schedule.rounds[r];
        let t = Instant::now();
        let mut counted = 0;
        let mut progress = |done| {
            shared.edges.fetch_add(done - counted, Ordering::Relaxed);
            counted = done;
        };
        report.edges = match steps {
            None => w
                .trainer
                .train_pieces(epoch, &round.work[g], &round.held[g], &mut progress)?,
            Some(steps) => w.trainer.train_pieces_synced(
                epoch,
                &round.work[g],
                &round.held[g],
                steps[r],
                &mut *w.link,
                &shared.give_up,
                &mut progress,
            )?,
        };
        report.compute_s = t.elapsed().as_secs_f64();
        let planned = schedule.round_batches[r].max(1);
        shared
            .batch_ns
            .fetch_max((report.compute_s * 1e9) as u64 / planned, Ordering::Relaxed);
        reports.push(report);
    }
    Ok(WorkerEpoch {
        rounds: reports,
        stopped: false,
        loss: w.trainer.take_loss()?,
    })
}

/// Worker `g`'s hand-overs from round `from` to round `to` (N = 2K): what it gives to and
/// takes from the other workers, as one exchange.
fn hand_over(
    w: &mut Worker,
    schedule: &GpuSchedule,
    from: usize,
    to: usize,
    g: usize,
    give_up: &AtomicBool,
) -> Result<(), TrainError> {
    let moves = schedule.handovers_between(from, to);
    let out: Vec<(u32, usize)> = moves
        .iter()
        .filter(|m| m.from as usize == g)
        .map(|m| (m.partition, m.to as usize))
        .collect();
    let into: Vec<(u32, usize)> = moves
        .iter()
        .filter(|m| m.to as usize == g)
        .map(|m| (m.partition, m.from as usize))
        .collect();
    w.link.hand_over(&mut w.trainer, &out, &into, give_up)
}

/// Worker `g`'s move from round `from` to round `to` of a parked schedule (N ≥ 3K): parks what
/// `to` drops, takes the partition read ahead (`ahead`), and reads — exposed — a second one
/// when `to` brings two.
fn take_from_home(
    w: &mut Worker,
    schedule: &GpuSchedule,
    from: usize,
    to: usize,
    g: usize,
    ahead: &mut Option<u32>,
) -> Result<(), TrainError> {
    for p in schedule.to_home(from, to, g) {
        w.trainer.park(p)?;
    }
    let arriving = schedule.from_home(from, to, g);
    // The read ahead first: the swap path's reads arrive in the order they were queued.
    if let Some(p) = ahead.take() {
        assert!(
            arriving.contains(&p),
            "partition {p} was read ahead for a round that does not take it"
        );
        w.trainer.take_arrival(p)?;
    }
    for p in arriving {
        if w.trainer.resident().contains(&p) {
            continue;
        }
        w.trainer.read_ahead(p)?;
        w.trainer.take_arrival(p)?;
    }
    w.trainer.forget_moves();
    Ok(())
}

/// Where the workers meet before each round and agree whether to go on: the last to arrive
/// reads the stop flag for all (and, on several hosts, agrees with the other hosts' gates).
/// A failed worker opens it for good, with an error.
struct Gate<'a> {
    workers: usize,
    state: Mutex<GateState>,
    opened: Condvar,
    /// The hosts' agreement at the gate of each generation, given whether this host stops.
    agree: Option<Agree<'a>>,
}

/// Whether every host goes on past this host's gate `generation`, given that this host wants
/// to stop or not.
pub(crate) type Agree<'a> = Box<dyn Fn(u64, bool) -> Result<bool, TrainError> + Sync + 'a>;

#[derive(Default)]
struct GateState {
    arrived: usize,
    generation: u64,
    go: bool,
    failed: bool,
}

impl<'a> Gate<'a> {
    fn new(workers: usize, agree: Option<Agree<'a>>) -> Gate<'a> {
        Gate {
            workers,
            state: Mutex::new(GateState::default()),
            opened: Condvar::new(),
            agree,
        }
    }

    /// Waits for all workers; `true` to train the round, `false` to stop before it.
    fn pass(&self, stop: &AtomicBool, give_up: &AtomicBool) -> Result<bool, TrainError> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.failed {
            return Err(TrainError::WorkerStopped);
        }
        s.arrived += 1;
        if s.arrived == self.workers {
            let stopping = stop.load(Ordering::Relaxed);
            let go = match &self.agree {
                None => !stopping,
                Some(agree) => match agree(s.generation, stopping) {
                    Ok(go) => go,
                    Err(e) => {
                        s.failed = true;
                        self.opened.notify_all();
                        return Err(e);
                    }
                },
            };
            s.arrived = 0;
            s.generation += 1;
            s.go = go;
            self.opened.notify_all();
            return Ok(go);
        }
        let generation = s.generation;
        while s.generation == generation && !s.failed {
            s = self
                .opened
                .wait_timeout(s, PUMP)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            if give_up.load(Ordering::Acquire) {
                s.failed = true;
            }
        }
        if s.failed {
            return Err(TrainError::WorkerStopped);
        }
        Ok(s.go)
    }

    /// A worker failed: every wait ends, and every later one fails.
    fn fail(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.failed = true;
        self.opened.notify_all();
    }
}
