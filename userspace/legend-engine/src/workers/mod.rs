//! Training on several GPUs in one process: one worker a GPU, each a [`Trainer`] of its own
//! (its compute engine, its swap path and slots), running its share of every round of
//! legend-planner's K-GPU schedule ([`GpuSchedule`]: N = 2K partitions, each GPU holding two),
//! with partitions handed from worker to worker between rounds over a [`Link`] — NCCL between
//! GPUs; channels between the CPU engine's workers, which run this same coordinator in tests.
//!
//! A round: every worker passes the round gate (where they agree whether to stop), takes its
//! hand-overs (the schedule's moves, the same list on every worker, so every send meets its
//! receive), then trains its pieces with negatives drawn from its two partitions. No partition
//! is on two workers in a round, so the workers' updates never meet, and since every batch is
//! keyed by its bucket (legend-model's `BatchKey`), a bucket trains exactly as it would on one
//! worker with the same resident partitions: the K-worker epoch equals the schedule run one
//! worker after another, bit for bit on the CPU engine.
//!
//! Between epochs the partitions stay where the last round left them (epochs alternate the
//! rounds' direction); they wait in the shared host store ([`SharedMemoryStore`]) only at a
//! layout change (a resume). A failing worker sets the shared give-up flag: the others leave
//! the gate, their NCCL waits abort their communicators, and the error names the worker.

mod link;
pub(crate) mod report;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use legend_dataset::{Buckets, PartitionScheme};
use legend_planner::GpuSchedule;

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

/// K workers training one run (see the module docs).
pub struct Workers {
    workers: Vec<Worker>,
    schedule: GpuSchedule,
    /// Per round, the most batches any worker trains in it: the steps every worker takes
    /// when relation gradients are summed after each (decoders with relations).
    round_steps: Vec<u64>,
    /// The decoder has relations: workers step in lockstep, summing their gradients.
    lockstep: bool,
    scheme: PartitionScheme,
    relations: Relations,
    negatives: usize,
    /// Bytes of one partition as the workers hand it over (resident f32 rows and state).
    partition_bytes: u64,
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
        let batch = config.training.batch_size.max(1) as u64;
        let batches: Vec<u64> = buckets.counts().iter().map(|c| c.div_ceil(batch)).collect();
        let schedule = legend_planner::plan_gpus(scheme.num_partitions, k as u32, &batches)
            .map_err(|e| TrainError::Resume(e.to_string()))?;
        // Each worker's swap path: its two partitions, and a third slot for the one arriving
        // (a send and a receive never share a slot).
        let mut worker_config = config.clone();
        worker_config.storage.buffer_capacity = 2;
        worker_config.storage.prefetch = true;
        worker_config.storage.read_ahead = true;
        let home = SharedMemoryStore::new(home);
        let gpus: Vec<&legend_cuda::Gpu> = engines
            .iter()
            .filter_map(|e| match e {
                Engine::Cuda { gpu, .. } => Some(&**gpu),
                Engine::Cpu => None,
            })
            .collect();
        let mut links: Vec<Box<dyn Link>> = if gpus.is_empty() {
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
        let shape = config.entity_shape();
        let partition_bytes = scheme.rows_per_partition * (shape.dim + shape.state) as u64 * 4;
        let mut workers = Vec::with_capacity(k);
        for (i, engine) in engines.into_iter().enumerate() {
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
            for (g, w) in workers.iter_mut().enumerate() {
                w.trainer.defer_relations().map_err(|e| w.failed(g, e))?;
            }
        }
        let round_steps = schedule
            .rounds
            .iter()
            .map(|round| {
                round
                    .work
                    .iter()
                    .map(|pieces| pieces.iter().map(|p| p.batches.end - p.batches.start).sum())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        tracing::info!(
            "{k} workers, {} rounds an epoch, {} hand-overs of {:.2} GB each; predicted imbalance {:.3}",
            schedule.rounds.len(),
            schedule.moves_per_epoch(),
            partition_bytes as f64 / 1e9,
            schedule.predicted_imbalance
        );
        Ok(Workers {
            workers,
            schedule,
            round_steps,
            lockstep,
            scheme,
            relations,
            negatives: config.training.negatives.negatives_per_positive,
            partition_bytes,
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

    /// Makes [`Workers::relations`] current: worker 0's (all workers' are equal).
    pub fn sync_relations(&mut self) -> Result<(), TrainError> {
        let w = &mut self.workers[0];
        w.trainer.sync_relations().map_err(|e| w.failed(0, e))?;
        self.relations = w.trainer.relations().clone();
        Ok(())
    }

    /// Sets every worker's learning rate.
    pub fn set_learning_rate(&mut self, lr: f32) {
        for w in &mut self.workers {
            w.trainer.set_learning_rate(lr);
        }
    }

    /// Calls `f` with partition `p`'s rows from the worker that holds it (or the store).
    pub fn stream_partition(&mut self, p: u32, f: &mut RowSink<'_>) -> Result<(), TrainError> {
        let holder = self
            .workers
            .iter()
            .position(|w| w.trainer.resident().contains(&p))
            .unwrap_or(0);
        self.workers[holder].trainer.stream_partition(p, f)
    }

    /// Settles every worker for a checkpoint; the store is host memory, which keeps no
    /// checkpoints itself: returns `false`, the caller saves the tables
    /// ([`Workers::stream_partition`]).
    pub fn checkpoint(&mut self) -> Result<bool, TrainError> {
        for w in &mut self.workers {
            w.trainer.synchronize()?;
        }
        Ok(false)
    }

    /// Moves the partitions so that worker `g` holds `held[g]`: what a worker gives up goes
    /// back to the shared store first, then each reads what it lacks.
    fn lay_out(&mut self, held: &[[u32; 2]]) -> Result<(), TrainError> {
        for (g, (w, keep)) in self.workers.iter_mut().zip(held).enumerate() {
            w.trainer.release_except(keep).map_err(|e| w.failed(g, e))?;
        }
        for (g, (w, keep)) in self.workers.iter_mut().zip(held).enumerate() {
            w.trainer.make_resident(keep).map_err(|e| w.failed(g, e))?;
        }
        Ok(())
    }

    /// Trains epoch `epoch` from the round `from` stopped at (or its start), until it ends or
    /// `stop` is seen set at a round's gate; `progress` is called with the positives done.
    pub fn run_epoch_from(
        &mut self,
        epoch: u32,
        from: Option<EpochCut>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochEnd, TrainError> {
        let started = Instant::now();
        let k = self.workers.len();
        let order = self.schedule.round_order(epoch);
        let from = from.filter(|c| c.epoch == epoch);
        if let Some(cut) = from
            && (cut.workers != Some(k as u32) || cut.swaps as usize > order.len())
        {
            let had = cut.workers.unwrap_or(1);
            return Err(TrainError::Resume(format!(
                "epoch {epoch} stopped {} on {had} GPU(s); this run has {k}: resume with training.gpus = {had} to finish that epoch (a new number of GPUs takes over at an epoch boundary)",
                cut.describe(),
            )));
        }
        let first = from.map_or(0, |c| c.swaps as usize);
        if first < order.len() {
            let held = self.schedule.rounds[order[first]].held.clone();
            self.lay_out(&held)?;
        }
        let shared = Shared {
            gate: Gate::new(k),
            give_up: AtomicBool::new(false),
            edges: AtomicU64::new(from.map_or(0, |c| c.edges)),
            stop,
        };
        // Before the first gate: the caller may raise `stop` (a checkpoint that is due).
        progress(shared.edges.load(Ordering::Relaxed));
        let schedule = &self.schedule;
        let steps = self.lockstep.then_some(self.round_steps.as_slice());
        let rounds = &order[first..];
        let outcomes: Vec<Result<WorkerEpoch, TrainError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .workers
                .iter_mut()
                .enumerate()
                .map(|(g, w)| {
                    let shared = &shared;
                    std::thread::Builder::new()
                        .name(format!("legend-worker-{g}"))
                        .spawn_scoped(s, move || {
                            let r = run_rounds(g, w, schedule, steps, epoch, rounds, shared);
                            if r.is_err() {
                                shared.give_up.store(true, Ordering::Release);
                                shared.gate.fail();
                            }
                            r
                        })
                        .expect("spawning a worker thread")
                })
                .collect();
            // This thread reports progress (the caller's callback may raise `stop`).
            while handles.iter().any(|h| !h.is_finished()) {
                progress(shared.edges.load(Ordering::Relaxed));
                std::thread::sleep(PUMP);
            }
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(TrainError::WorkerStopped)))
                .collect()
        });
        progress(shared.edges.load(Ordering::Relaxed));
        let mut done = Vec::with_capacity(k);
        let mut failure = None;
        for (g, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Ok(d) => done.push(d),
                // The first worker's own failure, not the others' stopping because of it.
                Err(TrainError::WorkerStopped) => {}
                Err(e) => {
                    failure.get_or_insert(self.workers[g].failed(g, e));
                }
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if done.len() < k {
            return Err(TrainError::WorkerStopped);
        }
        let loss = from.map_or(0.0, |c| c.loss) + done.iter().map(|d| d.loss).sum::<f64>();
        let edges = shared.edges.load(Ordering::Relaxed);
        let trained_rounds = done[0].rounds.len();
        if done[0].stopped {
            return Ok(EpochEnd::Stopped(EpochCut {
                epoch,
                swaps: (first + trained_rounds) as u32,
                next: None,
                edges,
                loss,
                workers: Some(k as u32),
            }));
        }
        if !loss.is_finite() {
            return Err(TrainError::Diverged { epoch });
        }
        let seconds = started.elapsed().as_secs_f64();
        let rounds: Vec<Vec<RoundReport>> = (0..trained_rounds)
            .map(|r| done.iter().map(|d| d.rounds[r].clone()).collect())
            .collect();
        let busy: f64 = rounds.iter().flatten().map(|r| r.compute_s).sum();
        let slowest: f64 = rounds
            .iter()
            .map(|r| r.iter().map(|w| w.compute_s).fold(0.0, f64::max))
            .sum();
        // Between the rounds trained now (a resume lays its first round out from the store).
        let handovers = trained_rounds.saturating_sub(1) as u64 * k as u64;
        let trained_now = edges - from.map_or(0, |c| c.edges);
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
            workers: Some(WorkersReport {
                gpus: k as u32,
                devices: self.workers.iter().map(|w| w.device.clone()).collect(),
                rounds,
                handovers,
                handover_bytes: handovers * self.partition_bytes,
                parallel_efficiency: busy / (k as f64 * seconds.max(1e-9)),
                imbalance: if busy > 0.0 {
                    slowest / (busy / k as f64)
                } else {
                    1.0
                },
                predicted_imbalance: self.schedule.predicted_imbalance,
            }),
            ..EpochReport::default()
        };
        Ok(EpochEnd::Done(report))
    }
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
    gate: Gate,
    /// Set when a worker fails: the others stop waiting for it.
    give_up: AtomicBool,
    /// Positive edges trained so far in the epoch, by all workers.
    edges: AtomicU64,
    /// The caller's stop flag, read at the gates.
    stop: &'a AtomicBool,
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
    for (i, &r) in rounds.iter().enumerate() {
        let mut report = RoundReport::default();
        let t = Instant::now();
        let go = shared.gate.pass(shared.stop, &shared.give_up)?;
        report.wait_s = t.elapsed().as_secs_f64();
        if !go {
            return Ok(WorkerEpoch {
                rounds: reports,
                stopped: true,
                loss: w.trainer.take_loss()?,
            });
        }
        if i > 0 {
            let t = Instant::now();
            let moves = schedule.handovers_between(rounds[i - 1], r);
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
            w.link
                .hand_over(&mut w.trainer, &out, &into, &shared.give_up)?;
            report.handover_s = t.elapsed().as_secs_f64();
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
        reports.push(report);
    }
    Ok(WorkerEpoch {
        rounds: reports,
        stopped: false,
        loss: w.trainer.take_loss()?,
    })
}

/// Where the workers meet before each round and agree whether to go on: the last to arrive
/// reads the stop flag for all. A failed worker opens it for good, with an error.
struct Gate {
    workers: usize,
    state: Mutex<GateState>,
    opened: Condvar,
}

#[derive(Default)]
struct GateState {
    arrived: usize,
    generation: u64,
    go: bool,
    failed: bool,
}

impl Gate {
    fn new(workers: usize) -> Gate {
        Gate {
            workers,
            state: Mutex::new(GateState::default()),
            opened: Condvar::new(),
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
            s.arrived = 0;
            s.generation += 1;
            s.go = !stop.load(Ordering::Relaxed);
            self.opened.notify_all();
            return Ok(s.go);
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
