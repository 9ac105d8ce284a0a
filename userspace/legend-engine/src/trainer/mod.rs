//! The trainer: walks the planner's bucket order, moving partitions through the swap path
//! ([`crate::swap`]), and trains with synchronous sparse AdaGrad on the CPU or on a CUDA GPU
//! (the compute backends).
//!
//! A bucket's edges are trained in the order of a counter-based permutation (legend-model's
//! [`Permutation`](legend_model::Permutation), keyed by the seed, the epoch and the bucket):
//! batch `b` holds positions `b·B ..` of it, which the GPU gathers on the device and the CPU
//! in parallel on the host. Every random draw of batch `b` (its negatives, the rounding of the
//! rows it updates) comes from its [`BatchKey`](legend_model::BatchKey) (seed, epoch, bucket,
//! `b`): a bucket trains the same way whatever ran before it, and an epoch can stop before
//! any batch and resume there exactly.
//! A batch is split into chunks that share negatives. On the CPU each chunk is split further
//! into fixed blocks of rows ([`BLOCK_ROWS`]), the unit of parallel work. Blocks read a
//! snapshot of the parameters; their gradients are summed in block order and applied before
//! the next batch, so updates are synchronous and the result depends only on the seed, never
//! on the thread count. The GPU draws the same negatives from the same streams and takes the
//! same steps with TF32 products.
//!
//! Laid out by concern: `report` is what an epoch reports, `epoch` walks an epoch's buffer
//! states and buckets, `pieces` trains the pieces of a K-GPU schedule and hands partitions
//! over for the workers; this file the [`Trainer`] itself, its set-up and what it holds.

use legend_dataset::Buckets;
use legend_model::ChunkModel;
use legend_planner::Plan;

use crate::compute::cpu::CpuCompute;
use crate::compute::cuda::CudaCompute;
use crate::compute::{ComputeBackend, RowSink};
use crate::config::Config;
use crate::engine::Engine;
use crate::error::TrainError;
use crate::relations::Relations;
use crate::restore::CheckpointRows;
use crate::rows::{Partition, RowShape};
use crate::sampler::NegativeSampler;
use crate::store::PartitionHome;
use crate::swap::path::{self, AtRest, Consumer};
use crate::swap::{Fence, Mover, Swapper};

mod epoch;
mod pieces;
mod report;

pub use report::{EpochEnd, EpochReport, SwapReport};

pub use crate::compute::cpu::BLOCK_ROWS;

/// Training state: parameters, slots, plan and data.
pub struct Trainer {
    batch_size: usize,
    negatives: usize,
    prefetch: bool,
    read_ahead: bool,
    seed: u64,
    buckets: Buckets,
    plan: Plan,
    relations: Relations,
    /// The node rows' shape (a resumed run's rows are read back in it).
    shape: RowShape,
    // Declared before `compute`, so dropped first: its I/O thread's movers address the GPU
    // engine's node table, which `compute` owns.
    swapper: Swapper,
    compute: Box<dyn ComputeBackend>,
}

impl Trainer {
    /// A CPU trainer over `buckets`, its partitions at rest in `home` (nothing resident yet),
    /// starting from `relations`.
    pub fn new(
        config: &Config,
        buckets: Buckets,
        degrees: &[u32],
        home: PartitionHome,
        relations: Relations,
    ) -> Result<Trainer, TrainError> {
        Trainer::on_device(config, buckets, degrees, home, relations, Engine::Cpu)
    }

    /// A trainer like [`Trainer::new`] that steps on `engine` (see [`Engine::open`]). The
    /// path its partitions take between the slots and `home` is chosen here, once.
    pub fn on_device(
        config: &Config,
        buckets: Buckets,
        degrees: &[u32],
        home: PartitionHome,
        relations: Relations,
        engine: Engine,
    ) -> Result<Trainer, TrainError> {
        let scheme = buckets.scheme();
        let plan = legend_planner::plan(scheme.num_partitions, config.capacity(), config.order())?;
        let t = &config.training;
        let slots = config.slots();
        let memory_dtype = match &home {
            PartitionHome::Memory(s) => Some(s.dtype()),
            PartitionHome::Shared(s) => Some(s.dtype()),
            PartitionHome::File(_) => None,
        };
        if let Some(dtype) = memory_dtype {
            assert_eq!(
                dtype, config.storage.dtype,
                "a memory store keeps the run's storage.dtype"
            );
        }
        let in_memory = memory_dtype.is_some();
        let at_rest = AtRest {
            scheme,
            shape: config.entity_shape(),
            init: config.init(),
        };
        let (compute, mover, host_rows): (Box<dyn ComputeBackend>, Box<dyn Mover>, bool) =
            match engine {
                Engine::Cpu => {
                    let compute = cpu_compute(config, &buckets, degrees)?;
                    let mover = path::mover(Consumer::Host, home, at_rest)?;
                    (Box::new(compute), mover, true)
                }
                Engine::Cuda { gpu, .. } => {
                    let compute = CudaCompute::new(*gpu, config, &buckets, degrees, &relations)?;
                    let consumer = Consumer::Gpu {
                        gpu: compute.gpu(),
                        slots: compute.device_slots()?,
                        resident_for_good: slots == scheme.num_partitions,
                    };
                    let mover = path::mover(consumer, home, at_rest)?;
                    (Box::new(compute), mover, false)
                }
            };
        Ok(Trainer {
            batch_size: t.batch_size,
            negatives: t.negatives.negatives_per_positive,
            prefetch: config.storage.prefetch,
            read_ahead: config.read_ahead(),
            seed: t.seed,
            buckets,
            swapper: Swapper::new(scheme, slots, mover, in_memory, host_rows),
            plan,
            relations,
            shape: config.entity_shape(),
            compute,
        })
    }

    /// Fills every partition from `rows`, a checkpoint read front to back (a resumed run of
    /// the memory backend, before its first epoch), then checks the checkpoint's checksums:
    /// straight into the slots when every partition keeps its own for the run (C = N: the
    /// GPU's table a piece at a time, the CPU's host rows), else into the memory store in its
    /// own format. So the rows are never in host memory twice, nor whole where they go to the
    /// GPU. A checksum that fails leaves the trainer unusable: the caller drops it.
    pub fn restore(&mut self, mut rows: CheckpointRows) -> Result<(), TrainError> {
        let scheme = self.scheme();
        if !self.swapper.slots_for_good() {
            let swapper = &mut self.swapper;
            rows.partitions_at_rest(scheme, self.shape, |p, emb, state| {
                Ok::<(), TrainError>(swapper.keep(p, emb, state)?)
            })?;
            self.swapper.drain()?;
            return Ok(rows.finish()?);
        }
        for p in 0..scheme.num_partitions {
            let range = scheme.range(p);
            let n = (range.end - range.start) as usize;
            let slot = p;
            let filled = self
                .compute
                .fill_partition(p, slot, &mut |emb, state| Ok(rows.read(emb, state)?))?;
            let host = if filled {
                None
            } else {
                let mut part = Partition {
                    id: p,
                    emb: vec![0.0; n * self.shape.dim],
                    state: vec![0.0; n * self.shape.state],
                };
                rows.read(&mut part.emb, &mut part.state)?;
                Some(part)
            };
            self.swapper.place(p, host);
            self.compute.arrive(p, slot, &Fence::passed())?;
        }
        Ok(rows.finish()?)
    }

    /// The plan of epoch 1 (later epochs relabel partitions, see [`Trainer::epoch_relabeling`]).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The partitioning.
    pub fn scheme(&self) -> legend_dataset::PartitionScheme {
        self.swapper.scheme()
    }

    /// The relation parameters (on the GPU, as of the last [`Trainer::sync_relations`]).
    pub fn relations(&self) -> &Relations {
        &self.relations
    }

    /// Resident partition `p`'s rows when they are in host memory (the CPU engine's), for
    /// reading them in place.
    pub fn host_partition(&mut self, p: u32) -> Option<&Partition> {
        self.swapper.host().partition(p)
    }

    /// Sets the learning rate of the steps from now on (a schedule's, between epochs).
    pub fn set_learning_rate(&mut self, lr: f32) {
        self.compute.set_learning_rate(lr);
    }

    /// Makes [`Trainer::relations`] current, leaving the node partitions where they are.
    pub fn sync_relations(&mut self) -> Result<(), TrainError> {
        self.compute.sync_relations(&mut self.relations)
    }

    /// Calls `f` with partition `p`'s embedding and state rows in order, a bounded piece at a
    /// time: from the device when the GPU engine holds `p` (nothing is gathered on the host),
    /// else the host rows (resident, or the store's) in one piece.
    pub fn stream_partition(&mut self, p: u32, f: &mut RowSink<'_>) -> Result<(), TrainError> {
        if self.compute.stream_partition(p, f)? {
            return Ok(());
        }
        if let Some(part) = self.swapper.host().partition(p) {
            return Ok(f(&part.emb, &part.state)?);
        }
        Ok(self
            .swapper
            .with_stored(p, |part| f(&part.emb, &part.state))??)
    }

    /// Commits a checkpoint at the current buffer-state boundary: the resident partitions
    /// written to the store once the queued steps have run, with `progress` and `aux` (the
    /// relation parameters). Returns whether the store keeps checkpoints itself; if not
    /// (memory backend), the caller saves the tables ([`Trainer::stream_partition`]).
    pub fn checkpoint(&mut self, progress: Vec<u8>, aux: Vec<u8>) -> Result<bool, TrainError> {
        let after = self.compute.settled()?;
        Ok(self.swapper.checkpoint(after, progress, aux)?)
    }

    /// The partition relabeling used in epoch `epoch` (from 1): epoch e+1 starts in the buffer
    /// state epoch e ended in, so no I/O is spent between epochs, and it is a function of the
    /// epoch number alone, so a resumed run follows the same schedule.
    pub fn epoch_relabeling(&self, epoch: u32) -> Vec<u32> {
        let n = self.plan.num_partitions as usize;
        let first = &self.plan.states[0];
        let last = self.plan.states.last().expect("a plan has a state");
        let mut pi: Vec<u32> = (0..n as u32).collect();
        for _ in 1..epoch {
            // The next epoch's first state is this epoch's last state, relabeled by pi.
            let target: Vec<u32> = last.iter().map(|&p| pi[p as usize]).collect();
            let mut next = vec![u32::MAX; n];
            for (&f, &t) in first.iter().zip(&target) {
                next[f as usize] = t;
            }
            let mut free = (0..n as u32).filter(|p| !target.contains(p));
            for slot in next.iter_mut().filter(|s| **s == u32::MAX) {
                *slot = free.next().expect("a permutation");
            }
            pi = next;
        }
        pi
    }

    /// Makes exactly the partitions `state` resident (what is not in it written back first).
    pub fn make_resident(&mut self, state: &[u32]) -> Result<(), TrainError> {
        self.fill(state)?;
        self.compute.synchronize()
    }
}

/// The CPU engine for `config`.
fn cpu_compute(
    config: &Config,
    buckets: &Buckets,
    degrees: &[u32],
) -> Result<CpuCompute, TrainError> {
    let t = &config.training;
    let threads = match t.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("legend-cpu-{i}"))
        .build()
        .map_err(|e| TrainError::Threads {
            threads,
            message: e.to_string(),
        })?;
    Ok(CpuCompute {
        model: ChunkModel {
            decoder: config.decoder(),
            loss: config.loss(),
            dim: config.model.dim,
        },
        optimizer: config.adagrad(),
        regularizer: config.regularizer(),
        dtype: config.storage.dtype,
        reciprocal: config.model.reciprocal_relations,
        dim: config.model.dim,
        num_chunks: t.negatives.num_chunks,
        negatives: t.negatives.negatives_per_positive,
        sampler: NegativeSampler::new(buckets.scheme(), degrees, t.negatives.degree_fraction),
        known: t
            .negatives
            .filtered
            .then(|| buckets.edges().iter().copied().collect()),
        pool,
        loss: 0.0,
        neg_rows: Vec::new(),
        block_grads: Vec::new(),
        pending_relations: None,
        frozen: config.frozen,
    })
}
