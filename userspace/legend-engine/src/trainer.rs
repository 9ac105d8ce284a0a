//! The trainer: walks the planner's bucket order over the partition buffer and trains with
//! synchronous sparse AdaGrad, on the CPU or on a CUDA GPU (the compute backends).
//!
//! A bucket's edges are trained in the order of a counter-based permutation (legend-model's
//! [`Permutation`], keyed by the seed, the epoch and the bucket): batch `b` holds positions
//! `b·B ..` of it, which the GPU gathers on the device and the CPU in parallel on the host.
//! A batch is split into chunks that share negatives. On the CPU each chunk is split further
//! into fixed blocks of rows ([`BLOCK_ROWS`]), the unit of parallel work. Blocks read a
//! snapshot of the parameters; their gradients are summed in block order and applied before
//! the next batch, so updates are synchronous and the result depends only on the seed, never
//! on the thread count. The GPU draws the same negatives from the same streams and takes the
//! same steps with TF32 products.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use legend_dataset::Buckets;
use legend_model::{ChunkModel, Decoder, Init, Permutation, Table};
use legend_planner::{Bucket, Plan};
use serde::{Deserialize, Serialize};

use crate::buffer::{IoStats, PartitionBuffer, StoreError};
use crate::compute::cpu::CpuCompute;
use crate::compute::cuda::CudaCompute;
use crate::compute::{BucketRef, ComputeBackend, RowSink, Step};
use crate::config::{Config, ConfigError};
use crate::device::Device;
use crate::sampler::NegativeSampler;
use legend_model::rng::key;

pub use crate::compute::cpu::BLOCK_ROWS;

/// Relation parameters and their AdaGrad state, always resident.
#[derive(Clone, Debug, PartialEq)]
pub struct Relations {
    /// `relations × width` embeddings, `width` the decoder's
    /// [`Decoder::relation_width`] (empty for Dot).
    pub emb: Vec<f32>,
    /// AdaGrad state of the same shape.
    pub state: Vec<f32>,
}

impl Relations {
    /// Initial relation parameters: `count` rows for node rows of `dim`.
    pub fn init(decoder: Decoder, count: usize, dim: usize, init: &Init) -> Relations {
        if !decoder.uses_relations() {
            return Relations {
                emb: Vec::new(),
                state: Vec::new(),
            };
        }
        let width = decoder.relation_width(dim);
        let mut emb = vec![0.0; count * width];
        for (r, row) in emb.chunks_exact_mut(width).enumerate() {
            init.relation_row(decoder, Table::Relation, r as u64, row);
        }
        Relations {
            state: vec![0.0; emb.len()],
            emb,
        }
    }
}

/// Timing of one swap of an epoch (for the compute-vs-I/O timeline).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SwapReport {
    /// Partition written back.
    pub evicted: u32,
    /// Partition read.
    pub loaded: u32,
    /// Seconds from the epoch start to the start of the swap.
    pub start_s: f64,
    /// Seconds of I/O the swap took on the I/O thread.
    pub io_s: f64,
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

/// Which way an I/O kernel launch moved data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoDirection {
    /// From GPU memory to the store.
    #[default]
    Write,
    /// From the store to GPU memory.
    Read,
}

/// One launch of the GPU I/O kernels: a partition written to the store or read from it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct IoKernelSpan {
    /// Which way the launch moved the partition.
    pub op: IoDirection,
    /// Partition moved.
    pub partition: u32,
    /// Seconds from the epoch start to the launch.
    pub start_s: f64,
    /// Launch to the last completion.
    pub seconds: f64,
    /// NVMe commands submitted (and completed).
    pub commands: u64,
    /// Bytes moved.
    pub bytes: u64,
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
}

/// Where an interrupted epoch stopped: after its initial buckets and `swaps` swaps (each with
/// its buckets), with what it had counted so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochCut {
    /// The epoch (from 1).
    pub epoch: u32,
    /// Swaps finished.
    pub swaps: u32,
    /// Batches trained (negative samples are keyed by the batch number).
    pub batches: u64,
    /// Positive edges trained.
    pub edges: u64,
    /// Loss summed over them.
    pub loss: f64,
}

/// How [`Trainer::run_epoch_from`] ended.
#[derive(Debug)]
pub enum EpochEnd {
    /// The epoch is complete.
    Done(EpochReport),
    /// Stopped between two buffer states, as asked.
    Stopped(EpochCut),
}

/// Training state: parameters, buffer, plan and data.
pub struct Trainer {
    batch_size: usize,
    negatives: usize,
    prefetch: bool,
    seed: u64,
    buckets: Buckets,
    plan: Plan,
    buffer: PartitionBuffer,
    relations: Relations,
    compute: Box<dyn ComputeBackend>,
}

/// A training error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The plan could not be made.
    #[error("planning")]
    Plan(#[from] legend_planner::PlanError),
    /// A checkpoint's position inside an epoch does not fit the run's plan.
    #[error("resuming: {0}")]
    Resume(String),
    /// An updated node row left its format's range (`storage.dtype = "f16"`: beyond ±65504).
    #[error(
        "node row {row}, element {element} does not fit storage.dtype = \"{dtype}\" after a step; use bf16 (f32's range) or f32, or lower optimizer.learning_rate"
    )]
    OutOfRange {
        /// The row's global id.
        row: u64,
        /// The element.
        element: usize,
        /// The format.
        dtype: legend_model::Dtype,
    },
    /// The loss became NaN or infinite.
    #[error("the loss diverged (not finite) in epoch {epoch}; lower optimizer.learning_rate")]
    Diverged {
        /// The epoch.
        epoch: u32,
    },
    /// The configuration cannot train on the chosen device.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The CUDA device asked for could not be opened.
    #[error("training.device = {device:?}")]
    Device {
        /// `training.device`.
        device: String,
        /// Why.
        #[source]
        error: legend_cuda::GpuError,
    },
    /// The run does not fit in the GPU's memory (the message says what to change).
    #[error("{0}")]
    GpuMemory(String),
    /// The GPU engine failed.
    #[error("GPU engine")]
    Gpu(legend_cuda::GpuError),
    /// The thread pool could not start.
    #[error("starting {threads} worker threads: {message}")]
    Threads {
        /// Requested threads.
        threads: usize,
        /// The error.
        message: String,
    },
    /// Writing a checkpoint's tables failed.
    #[error(transparent)]
    Run(#[from] crate::run::RunError),
}

/// GPU failures, with a row that left its storage format's range reported as the CPU engine
/// reports it.
impl From<legend_cuda::GpuError> for TrainError {
    fn from(e: legend_cuda::GpuError) -> Self {
        match e {
            legend_cuda::GpuError::OutOfRange {
                row,
                element,
                dtype,
            } => TrainError::OutOfRange {
                row,
                element: element as usize,
                dtype,
            },
            other => TrainError::Gpu(other),
        }
    }
}

impl Trainer {
    /// A CPU trainer over `buckets` with `buffer` (nothing resident yet) and starting
    /// `relations`.
    pub fn new(
        config: &Config,
        buckets: Buckets,
        degrees: &[u32],
        buffer: PartitionBuffer,
        relations: Relations,
    ) -> Result<Trainer, TrainError> {
        Trainer::on_device(config, buckets, degrees, buffer, relations, Device::Cpu)
    }

    /// A trainer like [`Trainer::new`] that steps on `device` (see [`Device::open`]).
    pub fn on_device(
        config: &Config,
        buckets: Buckets,
        degrees: &[u32],
        buffer: PartitionBuffer,
        relations: Relations,
        device: Device,
    ) -> Result<Trainer, TrainError> {
        let scheme = buckets.scheme();
        let plan = legend_planner::plan(scheme.num_partitions, config.capacity(), config.order())?;
        let t = &config.training;
        let compute: Box<dyn ComputeBackend> = match device {
            Device::Cpu => Box::new(cpu_compute(config, &buckets, degrees)?),
            Device::Cuda { gpu, .. } => {
                let compute = CudaCompute::new(*gpu, config, &buckets, degrees, &relations)?;
                // The GPU draws never-written partitions itself, where the host's cores
                // would take most of the first epoch at billion-edge scale. In RAM-backed runs:
                // a store's swaps may go through the GPU I/O kernels, which move only what the
                // store holds.
                if !config.uses_store() {
                    buffer.defer_initialisation();
                }
                Box::new(compute)
            }
        };
        Ok(Trainer {
            batch_size: t.batch_size,
            negatives: t.negatives.negatives_per_positive,
            prefetch: config.storage.prefetch,
            seed: t.seed,
            buckets,
            plan,
            buffer,
            relations,
            compute,
        })
    }

    /// The plan of epoch 1 (later epochs relabel partitions, see [`Trainer::epoch_relabeling`]).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The partition buffer. On the GPU its resident partitions are current only after
    /// [`Trainer::sync_host`].
    pub fn buffer(&mut self) -> &mut PartitionBuffer {
        &mut self.buffer
    }

    /// The relation parameters (on the GPU, as of the last [`Trainer::sync_host`]).
    pub fn relations(&self) -> &Relations {
        &self.relations
    }

    /// Copies the parameters the compute engine holds (GPU: resident partitions and
    /// relations) into the host buffer and [`Trainer::relations`]; call it before a
    /// checkpoint, an evaluation or an export. A no-op on the CPU.
    pub fn sync_host(&mut self) -> Result<(), TrainError> {
        self.compute
            .sync_host(&mut self.buffer, &mut self.relations)
    }

    /// Whether the compute engine holds partition `p` itself (on the GPU): its host rows are
    /// then current only after [`Trainer::sync_host`].
    pub fn holds_on_device(&self, p: u32) -> bool {
        self.compute.holds(p)
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
    /// time: from the device when the engine holds `p` (nothing is gathered on the host),
    /// else the host buffer's (or the store's) rows in one piece.
    pub fn stream_partition(&mut self, p: u32, f: &mut RowSink<'_>) -> Result<(), TrainError> {
        if self.compute.stream_partition(p, f)? {
            return Ok(());
        }
        self.buffer
            .with_partition(p, |part| f(&part.emb, &part.state))?
    }

    /// Moves the swaps' partitions between the device and `store` with the engine's own I/O
    /// (the GPU I/O kernels over `controller`'s NVMe queues) instead of the buffer's I/O
    /// thread; `store` must be the buffer's store. Returns whether the engine does that (the
    /// CPU engine's store I/O is already its own).
    pub fn use_direct_io(
        &mut self,
        store: &crate::file_store::SharedFileStore,
        controller: &crate::controllers::SharedController,
    ) -> Result<bool, TrainError> {
        self.compute.use_direct_io(store, controller)
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
    /// `stop` is seen set between two buffer states. Stopping there leaves every parameter
    /// consistent (nothing is half-trained), and an epoch resumed from the returned cut after
    /// a checkpoint trains exactly what the uninterrupted epoch would have.
    pub fn run_epoch_from(
        &mut self,
        epoch: u32,
        from: Option<EpochCut>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochEnd, TrainError> {
        let started = Instant::now();
        let io_before = self.buffer.stats();
        let pi = self.epoch_relabeling(epoch);
        let relabel = |b: &Bucket| [pi[b[0] as usize], pi[b[1] as usize]];
        let from = from.filter(|c| c.epoch == epoch).unwrap_or(EpochCut {
            epoch,
            ..EpochCut::default()
        });
        let done_swaps = from.swaps as usize;
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
        let mut report = EpochReport {
            epoch,
            negatives_per_positive: self.negatives,
            buffer_states: 1,
            edges: from.edges,
            ..EpochReport::default()
        };
        let mut batch_counter = from.batches;
        for p in self.buffer.resident() {
            if !first.contains(&p) {
                self.compute.evicting(&mut self.buffer, p)?;
            }
        }
        self.buffer.fill(&first)?;
        for &p in &first {
            self.compute.loaded(&mut self.buffer, p)?;
        }
        let mut resident = first.clone();
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut report.edges,
            batch: &mut batch_counter,
            progress,
        };
        if done_swaps == 0 && from.batches == 0 {
            let initial: Vec<Bucket> = plan.initial.iter().map(relabel).collect();
            self.run_buckets(&initial, &resident, &mut ctx)?;
        }
        for (i, swap) in plan.swaps.iter().enumerate().skip(done_swaps) {
            if stop.load(Ordering::Relaxed) {
                self.compute.synchronize()?;
                let cut = EpochCut {
                    epoch,
                    swaps: i as u32,
                    batches: *ctx.batch,
                    edges: *ctx.edges,
                    loss: from.loss + self.compute.take_loss()?,
                };
                return Ok(EpochEnd::Stopped(cut));
            }
            let (evicted, loaded) = (pi[swap.evicted as usize], pi[swap.loaded as usize]);
            let overlap: Vec<Bucket> = swap.overlap.iter().map(relabel).collect();
            let after: Vec<Bucket> = swap.after.iter().map(relabel).collect();
            let stats_before = self.buffer.stats();
            let mut sr = SwapReport {
                evicted,
                loaded,
                start_s: started.elapsed().as_secs_f64(),
                ..SwapReport::default()
            };
            resident.retain(|&p| p != evicted);
            let hook = self.compute.begin_swap(&mut self.buffer, evicted, loaded)?;
            self.buffer.begin_swap_with(evicted, loaded, hook)?;
            let t = Instant::now();
            if self.prefetch {
                self.run_buckets(&overlap, &resident, &mut ctx)?;
                self.compute.synchronize()?;
            }
            sr.overlap_compute_s = t.elapsed().as_secs_f64();
            self.buffer.finish_swap()?;
            sr.io_kernels = self.compute.take_io_kernels(started);
            self.compute.finish_swap(&self.buffer, loaded)?;
            resident.push(loaded);
            let t = Instant::now();
            if !self.prefetch {
                self.run_buckets(&overlap, &resident, &mut ctx)?;
            }
            self.run_buckets(&after, &resident, &mut ctx)?;
            self.compute.synchronize()?;
            sr.after_compute_s = t.elapsed().as_secs_f64();
            let s = self.buffer.stats();
            sr.io_s = (s.io_time - stats_before.io_time).as_secs_f64();
            sr.wait_s = (s.wait_time - stats_before.wait_time).as_secs_f64();
            sr.copy_s = (s.hook_time - stats_before.hook_time).as_secs_f64();
            sr.bytes = (s.bytes_read + s.bytes_written)
                - (stats_before.bytes_read + stats_before.bytes_written);
            report.swaps.push(sr);
            report.buffer_states += 1;
        }
        let loss = from.loss + self.compute.take_loss()?;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { epoch });
        }
        let io = diff(self.buffer.stats(), io_before);
        report.loss = loss / report.edges.max(1) as f64;
        report.seconds = started.elapsed().as_secs_f64();
        let trained_now = report.edges - from.edges;
        report.edges_per_sec = trained_now as f64 / report.seconds.max(1e-9);
        report.partitions_read = io.reads;
        report.partitions_written = io.writes;
        report.bytes_read = io.bytes_read;
        report.bytes_written = io.bytes_written;
        report.io_s = io.io_time.as_secs_f64();
        report.io_wait_s = io.wait_time.as_secs_f64();
        report.resumed = from.swaps > 0 || from.batches > 0;
        report.peak_rss_bytes = crate::memory::peak_rss_bytes().unwrap_or(0);
        report.gpu_memory_bytes = self.compute.device_memory_in_use();
        Ok(EpochEnd::Done(report))
    }

    fn run_buckets(
        &mut self,
        buckets: &[Bucket],
        resident: &[u32],
        ctx: &mut EpochCtx<'_>,
    ) -> Result<(), TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        for b in buckets {
            let scheme = self.buckets.scheme();
            let edges = self.buckets.bucket(b[0], b[1]);
            if edges.is_empty() {
                continue;
            }
            let index = scheme.bucket_index(b[0], b[1]);
            let order = key(self.seed, &[1, u64::from(ctx.epoch), index as u64]);
            let bucket = BucketRef {
                parts: *b,
                index,
                edges,
                order: Permutation::new(edges.len() as u64, order),
            };
            self.compute.begin_bucket(&bucket)?;
            for first in (0..edges.len()).step_by(self.batch_size) {
                let step = Step {
                    bucket: &bucket,
                    first: first as u64,
                    len: self.batch_size.min(edges.len() - first),
                    resident: &sorted_resident,
                    epoch: ctx.epoch,
                    batch_no: *ctx.batch,
                };
                self.compute
                    .train_batch(&step, &mut self.buffer, &mut self.relations)?;
                *ctx.batch += 1;
                *ctx.edges += step.len as u64;
                (ctx.progress)(*ctx.edges);
            }
        }
        Ok(())
    }
}

struct EpochCtx<'a> {
    epoch: u32,
    edges: &'a mut u64,
    batch: &'a mut u64,
    progress: &'a mut dyn FnMut(u64),
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
        seed: t.seed,
        sampler: NegativeSampler::new(buckets.scheme(), degrees, t.negatives.degree_fraction),
        known: t
            .negatives
            .filtered
            .then(|| buckets.edges().iter().copied().collect()),
        pool,
        loss: 0.0,
        neg_rows: Vec::new(),
        block_grads: Vec::new(),
    })
}

fn diff(a: IoStats, b: IoStats) -> IoStats {
    IoStats {
        reads: a.reads - b.reads,
        initialised: a.initialised - b.initialised,
        writes: a.writes - b.writes,
        bytes_read: a.bytes_read - b.bytes_read,
        bytes_written: a.bytes_written - b.bytes_written,
        io_time: a.io_time.saturating_sub(b.io_time),
        wait_time: a.wait_time.saturating_sub(b.wait_time),
        hook_time: a.hook_time.saturating_sub(b.hook_time),
        swaps: a.swaps - b.swaps,
    }
}
