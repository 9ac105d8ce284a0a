//! The trainer: walks the planner's bucket order, moving partitions through the swap path
//! ([`crate::swap`]), and trains with synchronous sparse AdaGrad on the CPU or on a CUDA GPU
//! (the compute backends).
//!
//! A bucket's edges are trained in the order of a counter-based permutation (legend-model's
//! [`Permutation`], keyed by the seed, the epoch and the bucket): batch `b` holds positions
//! `b·B ..` of it, which the GPU gathers on the device and the CPU in parallel on the host.
//! Every random draw of batch `b` (its negatives, the rounding of the rows it updates) comes
//! from its [`BatchKey`] (seed, epoch, bucket, `b`): a bucket trains the same way whatever ran
//! before it, and an epoch can stop before any batch and resume there exactly.
//! A batch is split into chunks that share negatives. On the CPU each chunk is split further
//! into fixed blocks of rows ([`BLOCK_ROWS`]), the unit of parallel work. Blocks read a
//! snapshot of the parameters; their gradients are summed in block order and applied before
//! the next batch, so updates are synchronous and the result depends only on the seed, never
//! on the thread count. The GPU draws the same negatives from the same streams and takes the
//! same steps with TF32 products.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use legend_dataset::Buckets;
use legend_model::rng::bucket_order_key;
use legend_model::{BatchKey, ChunkModel, Permutation};
use legend_planner::{Bucket, Piece, Plan};
use serde::{Deserialize, Serialize};

use crate::compute::cpu::CpuCompute;
use crate::compute::cuda::CudaCompute;
use crate::compute::{BucketRef, ComputeBackend, PendingRelations, RowSink, Step};
use crate::config::Config;
use crate::device::Engine;
use crate::error::TrainError;
use crate::progress::{BatchCursor, EpochCut};
use crate::relations::Relations;
use crate::rows::Partition;
use crate::sampler::NegativeSampler;
use crate::store::PartitionHome;
use crate::swap::gpu::{GpuCopyMover, GpuDirectMover};
use crate::swap::host::{HostMover, HostStore};
use crate::swap::{Fence, IoKernelSpan, Mover, Swapper};

pub use crate::compute::cpu::BLOCK_ROWS;

/// Timing of one swap of an epoch (for the compute-vs-I/O timeline).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SwapReport {
    /// Partition written back.
    pub evicted: u32,
    /// Partition read.
    pub loaded: u32,
    /// Seconds from the epoch start to the start of the swap.
    pub start_s: f64,
    /// Seconds of I/O the swap took on the I/O thread (its write and its read).
    pub io_s: f64,
    /// Seconds from the epoch start to the start of the swap's first I/O: before `start_s`
    /// when its read ran ahead (`storage.read_ahead`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_start_s: Option<f64>,
    /// Part of `io_s` spent copying the partitions between the host and the GPU (the GPU
    /// engine's copies run on the I/O thread; 0 on the CPU).
    #[serde(default)]
    pub copy_s: f64,
    /// Seconds of compute overlapped with the swap.
    pub overlap_compute_s: f64,
    /// Seconds compute waited for the swap.
    pub wait_s: f64,
    /// Seconds of compute after the swap (needing the loaded partition).
    pub after_compute_s: f64,
    /// Bytes read plus written by the swap.
    pub bytes: u64,
    /// The GPU I/O kernels' launches of the swap, when the engine moves partitions with them
    /// (storage.backend = proxy | nvme on a GPU); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub io_kernels: Vec<IoKernelSpan>,
}

/// What one epoch did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EpochReport {
    /// Epoch number, from 1.
    pub epoch: u32,
    /// Mean loss per positive edge.
    pub loss: f64,
    /// Positive edges trained on.
    pub edges: u64,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Positive edges per second.
    pub edges_per_sec: f64,
    /// Negatives per positive and side.
    pub negatives_per_positive: usize,
    /// Partitions read (initialised ones excluded).
    pub partitions_read: u64,
    /// Partitions written.
    pub partitions_written: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Seconds of I/O on the I/O thread.
    pub io_s: f64,
    /// Seconds compute waited for I/O.
    pub io_wait_s: f64,
    /// Buffer states this epoch went through (the fill counted once).
    pub buffer_states: u64,
    /// Per-swap timings.
    pub swaps: Vec<SwapReport>,
    /// The process's peak resident memory so far (bytes; 0 where it cannot be read).
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// Device memory in use at the end of the epoch (bytes, the GPU engine only; the whole
    /// device's, other processes included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_bytes: Option<u64>,
    /// The epoch was resumed in its middle: its times and I/O cover only the part trained
    /// after the resume (its loss and edges cover the whole epoch).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resumed: bool,
    /// What the workers did, when K of them trained the epoch (`training.gpus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<crate::workers::WorkersReport>,
}

/// A partition on its way to another worker (see [`Trainer::hand_out`]).
pub(crate) struct Outgoing {
    /// Its host rows (the CPU engine's).
    pub(crate) rows: Option<Partition>,
    /// Its rows in the GPU slot it leaves.
    pub(crate) span: Option<legend_cuda::RowSpan>,
    /// The point after which compute no longer touches the slot.
    pub(crate) after: Fence,
}

/// How [`Trainer::run_epoch_from`] ended.
#[derive(Debug)]
pub enum EpochEnd {
    /// The epoch is complete.
    Done(EpochReport),
    /// Stopped between two buffer states, as asked.
    Stopped(EpochCut),
}

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
        let (compute, mover, host_rows): (Box<dyn ComputeBackend>, Box<dyn Mover>, bool) =
            match engine {
                Engine::Cpu => {
                    let compute = cpu_compute(config, &buckets, degrees)?;
                    let mover: Box<dyn Mover> = match home {
                        PartitionHome::Memory(s) => {
                            Box::new(HostMover::new(at_rest(s, scheme, config)))
                        }
                        PartitionHome::File(s) => {
                            Box::new(HostMover::new(at_rest(*s, scheme, config)))
                        }
                        PartitionHome::Shared(s) => {
                            Box::new(HostMover::new(at_rest(s, scheme, config)))
                        }
                    };
                    (Box::new(compute), mover, true)
                }
                Engine::Cuda { gpu, .. } => {
                    let compute = CudaCompute::new(*gpu, config, &buckets, degrees, &relations)?;
                    let device_slots = compute.device_slots()?;
                    let gpu = compute.gpu();
                    let for_good = slots == scheme.num_partitions;
                    let mover: Box<dyn Mover> = match home {
                        PartitionHome::Memory(s) => Box::new(GpuCopyMover::new(
                            gpu,
                            at_rest(s, scheme, config),
                            device_slots,
                            for_good,
                        )?),
                        // A store behind NVMe queues (one controller or several): the GPU I/O
                        // kernels.
                        PartitionHome::File(s) if !s.queued_members().is_empty() => Box::new(
                            GpuDirectMover::new(gpu, at_rest(*s, scheme, config), device_slots)?,
                        ),
                        PartitionHome::File(s) => Box::new(GpuCopyMover::new(
                            gpu,
                            at_rest(*s, scheme, config),
                            device_slots,
                            for_good,
                        )?),
                        // Partitions leave for other GPUs and come back: the store keeps them.
                        PartitionHome::Shared(s) => Box::new(GpuCopyMover::new(
                            gpu,
                            at_rest(s, scheme, config),
                            device_slots,
                            false,
                        )?),
                    };
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
            compute,
        })
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
            return f(&part.emb, &part.state);
        }
        self.swapper
            .with_stored(p, |part| f(&part.emb, &part.state))?
    }

    /// A copy of partition `p`'s rows, wherever they are.
    pub fn read_partition(&mut self, p: u32) -> Result<Partition, TrainError> {
        let mut part = Partition::empty(p);
        self.stream_partition(p, &mut |emb, state| {
            part.emb.extend_from_slice(emb);
            part.state.extend_from_slice(state);
            Ok(())
        })?;
        Ok(part)
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

    /// Trains `buckets` of epoch `epoch` in order, their partitions resident, drawing
    /// negatives from the partitions `resident`; returns the positive edges trained. What a
    /// bucket does depends on the parameters, `epoch` and `resident` alone, not on what was
    /// trained before it (the work of one worker of several, or a test's).
    pub fn train_buckets(
        &mut self,
        epoch: u32,
        buckets: &[Bucket],
        resident: &[u32],
    ) -> Result<u64, TrainError> {
        let mut edges = 0;
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut edges,
            progress: &mut |_| {},
            stop: &AtomicBool::new(false),
        };
        self.run_group(buckets, resident, None, &mut ctx)?;
        self.compute.synchronize()?;
        Ok(edges)
    }

    /// Trains `pieces` of epoch `epoch` in order (runs of batches of buckets whose partitions
    /// are resident), drawing negatives from the partitions `resident`; returns the positive
    /// edges trained. A K-GPU worker's share of a round ([`crate::workers`]).
    pub fn train_pieces(
        &mut self,
        epoch: u32,
        pieces: &[Piece],
        resident: &[u32],
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64, TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        let mut edges = 0;
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut edges,
            progress,
            stop: &AtomicBool::new(false),
        };
        for piece in pieces {
            self.run_bucket(
                piece.bucket,
                piece.batches.clone(),
                &sorted_resident,
                &mut ctx,
            )?;
        }
        self.compute.synchronize()?;
        Ok(edges)
    }

    /// Trains `pieces` like [`Trainer::train_pieces`] in lockstep with the other workers of a
    /// run with relations: after every batch the relation gradients are summed over the
    /// workers by `link` and every worker steps the relation rows alike; a worker whose
    /// pieces end first takes empty steps (its share of the sum is zero) until `steps`, the
    /// round's most batches on any worker, so every sum has every worker.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn train_pieces_synced(
        &mut self,
        epoch: u32,
        pieces: &[Piece],
        resident: &[u32],
        steps: u64,
        link: &mut dyn crate::workers::Link,
        give_up: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64, TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        // The edges are shared (a clone is a handle): the bucket borrows this copy, not self.
        let buckets = self.buckets.clone();
        let (mut edges, mut taken) = (0u64, 0u64);
        for piece in pieces {
            let bucket = bucket_ref(&buckets, piece.bucket, self.seed, epoch);
            self.compute.begin_bucket(&bucket)?;
            let end = piece.batches.end.min(self.batches_of(piece.bucket));
            for batch in piece.batches.start..end {
                let step = batch_step(
                    &bucket,
                    batch,
                    self.batch_size,
                    &sorted_resident,
                    self.seed,
                    epoch,
                );
                self.compute
                    .train_batch(&step, self.swapper.host(), &mut self.relations)?;
                edges += step.len as u64;
                progress(edges);
                self.sum_relations(link, give_up)?;
                taken += 1;
            }
        }
        for _ in taken..steps {
            self.sum_relations(link, give_up)?;
        }
        self.compute.synchronize()?;
        Ok(edges)
    }

    /// The K workers' rule for relations run on this one trainer, the CPU reference of
    /// [`Trainer::train_pieces_synced`]: worker `g`'s `shares[g]` (its pieces and the
    /// partitions it holds) step in lockstep, `steps` steps, each step's relation gradients
    /// kept per worker and summed in worker order before the relation rows take one step.
    /// Node rows of different workers never meet (their partitions differ), so this trains
    /// exactly what the workers train. CPU engine only.
    pub fn train_lockstep(
        &mut self,
        epoch: u32,
        shares: &[(&[Piece], [u32; 2])],
        steps: u64,
    ) -> Result<u64, TrainError> {
        self.defer_relations()?;
        let template = match self.compute.pending_relations()? {
            PendingRelations::Host(p) => p.clone(),
            PendingRelations::Device { .. } => {
                return Err(TrainError::Resume(
                    "the lockstep reference runs on the CPU engine".into(),
                ));
            }
        };
        let mut pending = vec![template.clone(); shares.len()];
        let mut batches: Vec<Vec<(Bucket, u64)>> = shares
            .iter()
            .map(|(pieces, _)| {
                pieces
                    .iter()
                    .flat_map(|p| {
                        let end = p.batches.end.min(self.batches_of(p.bucket));
                        (p.batches.start..end).map(move |b| (p.bucket, b))
                    })
                    .rev()
                    .collect()
            })
            .collect();
        let mut edges = 0;
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut edges,
            progress: &mut |_| {},
            stop: &AtomicBool::new(false),
        };
        for _ in 0..steps {
            let mut total = template.clone();
            for (g, (_, held)) in shares.iter().enumerate() {
                let PendingRelations::Host(slot) = self.compute.pending_relations()? else {
                    unreachable!("checked above");
                };
                std::mem::swap(slot, &mut pending[g]);
                if let Some((bucket, batch)) = batches[g].pop() {
                    let mut held = held.to_vec();
                    held.sort_unstable();
                    self.run_bucket(bucket, batch..batch + 1, &held, &mut ctx)?;
                }
                let PendingRelations::Host(slot) = self.compute.pending_relations()? else {
                    unreachable!("checked above");
                };
                std::mem::swap(slot, &mut pending[g]);
                total.add(&pending[g]);
                pending[g].clear();
            }
            let PendingRelations::Host(slot) = self.compute.pending_relations()? else {
                unreachable!("checked above");
            };
            *slot = total;
            self.compute
                .apply_relations(&mut self.relations, &Fence::passed())?;
        }
        Ok(edges)
    }

    /// This step's relation gradients summed over the workers by `link`, then applied.
    fn sum_relations(
        &mut self,
        link: &mut dyn crate::workers::Link,
        give_up: &AtomicBool,
    ) -> Result<(), TrainError> {
        let pending = self.compute.pending_relations()?;
        let ready = link.sum_relations(pending, give_up)?;
        self.compute.apply_relations(&mut self.relations, &ready)
    }

    /// From now on the relation rows step only with the workers' summed gradients
    /// ([`Trainer::train_pieces_synced`]).
    pub(crate) fn defer_relations(&mut self) -> Result<(), TrainError> {
        self.compute.defer_relations(&self.relations)
    }

    /// Partition `p` (resident) leaves for another worker: compute lets it go and its slot is
    /// free, nothing written. Returns how its rows travel: the CPU engine's host rows, or the
    /// GPU slot's rows once the fence has passed (valid until the next partition arrives).
    pub(crate) fn hand_out(&mut self, p: u32) -> Result<Outgoing, TrainError> {
        let after = self.compute.release(p)?;
        let slot = self
            .swapper
            .slot(p)
            .expect("handing out a resident partition");
        let span = self.compute.slot_span(slot, p)?;
        let (_, rows) = self.swapper.give(p);
        Ok(Outgoing { rows, span, after })
    }

    /// A slot for partition `p`, which another worker sends: its device rows (GPU engines)
    /// for the transfer to fill.
    pub(crate) fn hand_in(&mut self, p: u32) -> Result<Option<legend_cuda::RowSpan>, TrainError> {
        let slot = self.swapper.reserve(p);
        self.compute.slot_span(slot, p)
    }

    /// Partition `p` arrived from another worker: its host rows (CPU engine), or its slot
    /// filled once `ready` has passed.
    pub(crate) fn handed_in(
        &mut self,
        p: u32,
        rows: Option<Partition>,
        ready: Fence,
    ) -> Result<(), TrainError> {
        self.swapper.received(p, rows);
        let slot = self.swapper.slot(p).expect("received");
        self.compute.arrive(p, slot, &ready)
    }

    /// Partitions resident, ascending.
    pub fn resident(&self) -> Vec<u32> {
        self.swapper.resident()
    }

    /// Writes back every resident partition outside `keep` (waiting for the writes).
    pub(crate) fn release_except(&mut self, keep: &[u32]) -> Result<(), TrainError> {
        for p in self.swapper.resident() {
            if !keep.contains(&p) {
                let released = self.compute.release(p)?;
                self.swapper.evict(p, released, None)?;
            }
        }
        Ok(self.swapper.drain()?)
    }

    /// Waits until the steps queued so far have run.
    pub(crate) fn synchronize(&mut self) -> Result<(), TrainError> {
        self.compute.synchronize()
    }

    /// The loss summed since the last call (waits for queued steps).
    pub(crate) fn take_loss(&mut self) -> Result<f64, TrainError> {
        self.compute.take_loss()
    }

    /// Device memory in use (GPU engines).
    pub(crate) fn device_memory_in_use(&self) -> Option<u64> {
        self.compute.device_memory_in_use()
    }

    /// Trains one epoch (numbered from 1). `progress` is called with the positives done so far.
    pub fn run_epoch(
        &mut self,
        epoch: u32,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochReport, TrainError> {
        match self.run_epoch_from(epoch, None, &AtomicBool::new(false), progress)? {
            EpochEnd::Done(report) => Ok(report),
            EpochEnd::Stopped(_) => unreachable!("nothing asked the epoch to stop"),
        }
    }

    /// Trains epoch `epoch` from where `from` stopped (or from its start), until it ends or
    /// `stop` is seen set before a batch. Stopping leaves every parameter consistent (nothing
    /// is half-trained: the swap under way, if any, is completed or cancelled), and an epoch
    /// resumed from the returned cut after a checkpoint trains exactly what the uninterrupted
    /// epoch would have.
    pub fn run_epoch_from(
        &mut self,
        epoch: u32,
        from: Option<EpochCut>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochEnd, TrainError> {
        let started = Instant::now();
        let io_before = self.swapper.stats();
        let pi = self.epoch_relabeling(epoch);
        let relabel = |buckets: &[Bucket]| -> Vec<Bucket> {
            buckets
                .iter()
                .map(|b| [pi[b[0] as usize], pi[b[1] as usize]])
                .collect()
        };
        let from = from.filter(|c| c.epoch == epoch);
        if let Some(cut) = from
            && let Some(k) = cut.workers
        {
            return Err(TrainError::Resume(format!(
                "epoch {epoch} stopped {} on {k} GPUs: resume with training.gpus = {k} to finish that epoch (a new number of GPUs takes over at an epoch boundary)",
                cut.describe()
            )));
        }
        let done_swaps = from.map_or(0, |c| c.swaps as usize);
        let plan = self.plan.clone();
        if done_swaps > plan.swaps.len() {
            return Err(TrainError::Resume(format!(
                "epoch {epoch} stopped after {done_swaps} swaps, but its plan has {}",
                plan.swaps.len()
            )));
        }
        // The state the epoch is in: its first, or the one the last finished swap made.
        let first: Vec<u32> = plan.states[done_swaps]
            .iter()
            .map(|&p| pi[p as usize])
            .collect();
        let loaded_by = |i: usize| pi[plan.swaps[i].loaded as usize];
        let mut report = EpochReport {
            epoch,
            negatives_per_positive: self.negatives,
            buffer_states: 1,
            edges: from.map_or(0, |c| c.edges),
            ..EpochReport::default()
        };
        let loss_before = from.map_or(0.0, |c| c.loss);
        self.fill(&first)?;
        let mut resident = first.clone();
        // With read-ahead, each swap's partition is read into the spare slot while the state
        // before it trains: the first swap's now, the next one's as soon as a swap is done.
        if self.read_ahead && done_swaps < plan.swaps.len() {
            self.swapper.load(loaded_by(done_swaps), Some(done_swaps))?;
        }
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut report.edges,
            progress,
            stop,
        };
        // The rest of the bucket group of the state the epoch (re)starts in, unless the cut
        // says it is complete: a fresh epoch's initial buckets, or a resumed swap's overlap and
        // after buckets, the overlap ones with the partitions they drew negatives from then.
        let start = match from {
            None => Some(None),
            Some(cut) => cut.next.map(Some),
        };
        if let Some(start) = start {
            let stopped = if done_swaps == 0 {
                self.run_group(&relabel(&plan.initial), &resident, start, &mut ctx)?
            } else {
                let swap = &plan.swaps[done_swaps - 1];
                let loaded = loaded_by(done_swaps - 1);
                let before_arrival: Vec<u32> = if self.prefetch {
                    resident.iter().copied().filter(|&p| p != loaded).collect()
                } else {
                    resident.clone()
                };
                let overlap = relabel(&swap.overlap);
                let after = relabel(&swap.after);
                let in_overlap = start.is_none_or(|c| overlap.contains(&c.bucket));
                let stopped = if in_overlap {
                    self.run_group(&overlap, &before_arrival, start, &mut ctx)?
                } else {
                    None
                };
                match stopped {
                    Some(cursor) => Some(cursor),
                    None => {
                        let start = start.filter(|_| !in_overlap);
                        self.run_group(&after, &resident, start, &mut ctx)?
                    }
                }
            };
            if let Some(cursor) = stopped {
                return self.stopped(epoch, done_swaps, Some(cursor), &mut report, loss_before);
            }
        }
        for (i, swap) in plan.swaps.iter().enumerate().skip(done_swaps) {
            if stop.load(Ordering::Relaxed) {
                return self.stopped(epoch, i, None, &mut report, loss_before);
            }
            let (evicted, loaded) = (pi[swap.evicted as usize], loaded_by(i));
            let overlap = relabel(&swap.overlap);
            let after = relabel(&swap.after);
            let mut sr = SwapReport {
                evicted,
                loaded,
                start_s: started.elapsed().as_secs_f64(),
                ..SwapReport::default()
            };
            resident.retain(|&p| p != evicted);
            let released = self.compute.release(evicted)?;
            self.swapper.evict(evicted, released, Some(i))?;
            if !self.read_ahead {
                self.swapper.load(loaded, Some(i))?;
            }
            let t = Instant::now();
            let mut stopped = None;
            if self.prefetch {
                stopped = self.run_group(&overlap, &resident, None, &mut ctx)?;
                self.compute.synchronize()?;
            }
            sr.overlap_compute_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let (slot, ready) = self.swapper.arrive(loaded)?;
            sr.wait_s = t.elapsed().as_secs_f64();
            self.compute.arrive(loaded, slot, &ready)?;
            resident.push(loaded);
            report.buffer_states += 1;
            if let Some(cursor) = stopped {
                // Stopped in the overlap buckets: the swap is complete, the rest follows it.
                report.swaps.push(sr);
                return self.stopped(epoch, i + 1, Some(cursor), &mut report, loss_before);
            }
            if self.read_ahead && i + 1 < plan.swaps.len() {
                self.swapper.load(loaded_by(i + 1), Some(i + 1))?;
            }
            let t = Instant::now();
            if !self.prefetch {
                stopped = self.run_group(&overlap, &resident, None, &mut ctx)?;
            }
            if stopped.is_none() {
                stopped = self.run_group(&after, &resident, None, &mut ctx)?;
            }
            self.compute.synchronize()?;
            sr.after_compute_s = t.elapsed().as_secs_f64();
            report.swaps.push(sr);
            if let Some(cursor) = stopped {
                return self.stopped(epoch, i + 1, Some(cursor), &mut report, loss_before);
            }
        }
        // The last swap's write may still run: the epoch's I/O ends with it.
        self.swapper.drain()?;
        self.take_swap_io(&mut report, done_swaps, started);
        let loss = loss_before + self.compute.take_loss()?;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { epoch });
        }
        let io = self.swapper.stats().since(&io_before);
        report.loss = loss / report.edges.max(1) as f64;
        report.seconds = started.elapsed().as_secs_f64();
        let trained_now = report.edges - from.map_or(0, |c| c.edges);
        report.edges_per_sec = trained_now as f64 / report.seconds.max(1e-9);
        report.partitions_read = io.reads;
        report.partitions_written = io.writes;
        report.bytes_read = io.bytes_read;
        report.bytes_written = io.bytes_written;
        report.io_s = io.io_time.as_secs_f64();
        report.io_wait_s = io.wait_time.as_secs_f64();
        report.resumed = from.is_some();
        report.peak_rss_bytes = crate::memory::peak_rss_bytes().unwrap_or(0);
        report.gpu_memory_bytes = self.compute.device_memory_in_use();
        Ok(EpochEnd::Done(report))
    }

    /// Makes exactly `state` resident: the partitions outside it are written back, the
    /// missing ones read (the epoch's first state; between epochs nothing moves, see
    /// [`Trainer::epoch_relabeling`]).
    fn fill(&mut self, state: &[u32]) -> Result<(), TrainError> {
        for p in self.swapper.resident() {
            if !state.contains(&p) {
                let released = self.compute.release(p)?;
                self.swapper.evict(p, released, None)?;
            }
        }
        let missing: Vec<u32> = state
            .iter()
            .copied()
            .filter(|&p| self.swapper.slot(p).is_none())
            .collect();
        for &p in &missing {
            self.swapper.load(p, None)?;
        }
        for &p in &missing {
            let (slot, ready) = self.swapper.arrive(p)?;
            self.compute.arrive(p, slot, &ready)?;
        }
        Ok(())
    }

    /// Adds each swap's I/O, from the swap path's log of the epoch's moves (swap `i` of the
    /// plan is `report.swaps[i - first_swap]`), to `report`.
    fn take_swap_io(&mut self, report: &mut EpochReport, first_swap: usize, started: Instant) {
        let since = |t: Instant| t.saturating_duration_since(started).as_secs_f64();
        for record in self.swapper.take_log() {
            let Some(sr) = record
                .tag
                .and_then(|i| i.checked_sub(first_swap))
                .and_then(|i| report.swaps.get_mut(i))
            else {
                continue;
            };
            let s = record.stats;
            sr.io_s += s.io_time.as_secs_f64();
            sr.copy_s += s.copy_time.as_secs_f64();
            sr.bytes += s.bytes_read + s.bytes_written;
            let start = since(record.started);
            sr.io_start_s = Some(sr.io_start_s.map_or(start, |t: f64| t.min(start)));
            sr.io_kernels
                .extend(record.kernels.into_iter().map(|(at, mut span)| {
                    span.start_s = since(at);
                    span
                }));
        }
    }

    /// Ends the epoch early in buffer state `swaps`, `next` naming where its group continues:
    /// the partition read ahead (unmodified) is dropped, queued steps finish and the swap
    /// path's writes drain, so the resident partitions are what a checkpoint must write.
    fn stopped(
        &mut self,
        epoch: u32,
        swaps: usize,
        next: Option<BatchCursor>,
        report: &mut EpochReport,
        loss_before: f64,
    ) -> Result<EpochEnd, TrainError> {
        self.swapper.cancel_loads()?;
        self.compute.synchronize()?;
        self.swapper.drain()?;
        self.swapper.take_log();
        Ok(EpochEnd::Stopped(EpochCut {
            epoch,
            swaps: swaps as u32,
            next,
            edges: report.edges,
            loss: loss_before + self.compute.take_loss()?,
            workers: None,
        }))
    }

    /// Trains `group`'s buckets in order, from `start` (`None`: its first bucket's first
    /// batch), each batch keyed by its bucket and its place in it (legend-model's
    /// [`BatchKey`]) and drawing negatives from `resident`. Returns where it stopped when
    /// `ctx.stop` was seen set before a batch, `None` once every bucket is trained.
    fn run_group(
        &mut self,
        group: &[Bucket],
        resident: &[u32],
        start: Option<BatchCursor>,
        ctx: &mut EpochCtx<'_>,
    ) -> Result<Option<BatchCursor>, TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        let skip = match start {
            None => 0,
            Some(c) => group.iter().position(|b| *b == c.bucket).ok_or_else(|| {
                TrainError::Resume(format!(
                    "epoch {} stopped in bucket ({}, {}), which its buffer state's group of {} buckets does not hold",
                    ctx.epoch,
                    c.bucket[0],
                    c.bucket[1],
                    group.len()
                ))
            })?,
        };
        for (i, b) in group.iter().enumerate().skip(skip) {
            let first_batch = match start {
                Some(c) if i == skip => c.batch,
                _ => 0,
            };
            let batches = self.batches_of(*b);
            if first_batch > batches {
                return Err(TrainError::Resume(format!(
                    "epoch {} stopped at batch {first_batch} of bucket ({}, {}), which has {batches}",
                    ctx.epoch, b[0], b[1]
                )));
            }
            if let Some(cursor) =
                self.run_bucket(*b, first_batch..batches, &sorted_resident, ctx)?
            {
                return Ok(Some(cursor));
            }
        }
        Ok(None)
    }

    /// Batches of bucket `b` (the last may be short).
    fn batches_of(&self, b: Bucket) -> u64 {
        self.buckets
            .bucket(b[0], b[1])
            .len()
            .div_ceil(self.batch_size) as u64
    }

    /// Trains batches `batches` of bucket `b` (as many as it has), negatives drawn from
    /// `resident` (ascending), checking `ctx.stop` before each; returns where it stopped.
    fn run_bucket(
        &mut self,
        b: Bucket,
        batches: std::ops::Range<u64>,
        resident: &[u32],
        ctx: &mut EpochCtx<'_>,
    ) -> Result<Option<BatchCursor>, TrainError> {
        let batches = batches.start..batches.end.min(self.batches_of(b));
        if batches.is_empty() {
            return Ok(None);
        }
        let bucket = bucket_ref(&self.buckets, b, self.seed, ctx.epoch);
        self.compute.begin_bucket(&bucket)?;
        for batch in batches {
            if ctx.stop.load(Ordering::Relaxed) {
                return Ok(Some(BatchCursor { bucket: b, batch }));
            }
            let step = batch_step(
                &bucket,
                batch,
                self.batch_size,
                resident,
                self.seed,
                ctx.epoch,
            );
            self.compute
                .train_batch(&step, self.swapper.host(), &mut self.relations)?;
            *ctx.edges += step.len as u64;
            (ctx.progress)(*ctx.edges);
        }
        Ok(None)
    }
}

/// Bucket `b` of epoch `epoch` as the engines train it: its edges and their order.
fn bucket_ref(buckets: &Buckets, b: Bucket, seed: u64, epoch: u32) -> BucketRef<'_> {
    let edges = buckets.bucket(b[0], b[1]);
    let index = buckets.scheme().bucket_index(b[0], b[1]);
    BucketRef {
        parts: b,
        index,
        edges,
        order: Permutation::new(
            edges.len() as u64,
            bucket_order_key(seed, epoch, index as u64),
        ),
    }
}

/// Batch `batch` of `bucket` (batches of `batch_size` edges), negatives from `resident`.
fn batch_step<'a>(
    bucket: &'a BucketRef<'a>,
    batch: u64,
    batch_size: usize,
    resident: &'a [u32],
    seed: u64,
    epoch: u32,
) -> Step<'a> {
    let first = batch * batch_size as u64;
    Step {
        bucket,
        first,
        len: batch_size.min(bucket.edges.len() - first as usize),
        resident,
        key: BatchKey::new(seed, epoch, bucket.index as u64, batch),
    }
}

struct EpochCtx<'a> {
    epoch: u32,
    edges: &'a mut u64,
    progress: &'a mut dyn FnMut(u64),
    /// Raised to stop before the next batch.
    stop: &'a AtomicBool,
}

/// `store` with what moving its rows to and from host memory takes, for `config`'s runs over
/// `scheme`.
fn at_rest<S>(store: S, scheme: legend_dataset::PartitionScheme, config: &Config) -> HostStore<S> {
    HostStore {
        store,
        scheme,
        shape: config.entity_shape(),
        init: config.init(),
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
    })
}
