//! Where a trainer's steps run: the CPU engine or the GPU engine, behind one interface that
//! [`crate::Trainer::run_epoch`] drives. The host [`PartitionBuffer`] stays the source of truth
//! for partitions that are not resident; a backend that keeps resident rows elsewhere (the GPU)
//! copies a partition out when it leaves the buffer and in when it arrives.
//!
//! The contract, in the order the trainer calls it:
//! - [`ComputeBackend::loaded`] / [`ComputeBackend::evicting`] around the buffer's fill (the
//!   epoch's first state) and [`ComputeBackend::sync_host`] before the host copies are read:
//!   synchronous, the host copy is current when they return.
//! - A swap: [`ComputeBackend::begin_swap`] (the evicted partition leaves compute; the backend
//!   may hand the buffer a [`SwapHook`] that its I/O thread runs before writing the partition
//!   back and after reading the next), the buffer's `begin_swap_with`, the overlap buckets
//!   (which touch neither partition), the buffer's `finish_swap`, then
//!   [`ComputeBackend::finish_swap`], after which compute may use the loaded partition.
//! - A bucket: [`ComputeBackend::begin_bucket`], then its batches in order through
//!   [`ComputeBackend::train_batch`]; batch `b` holds positions `b·B ..` of the bucket's
//!   [`Permutation`].
//! - [`ComputeBackend::synchronize`] where the trainer times compute, [`ComputeBackend::take_loss`]
//!   once an epoch.

pub(crate) mod cpu;
pub(crate) mod cuda;

use std::time::Instant;

use legend_dataset::Edge;
use legend_model::Permutation;

use crate::buffer::{PartitionBuffer, SwapHook};
use crate::controllers::SharedController;
use crate::file_store::SharedFileStore;
use crate::trainer::{IoKernelSpan, Relations, TrainError};

/// A bucket about to be trained.
pub(crate) struct BucketRef<'a> {
    /// Its partitions: sources in the first, destinations in the second.
    pub(crate) parts: [u32; 2],
    /// Its index in the row-major order of the buckets (legend-dataset's `bucket_index`).
    pub(crate) index: usize,
    /// Its edges as stored.
    pub(crate) edges: &'a [Edge],
    /// The order they are trained in (a permutation of the edge indices).
    pub(crate) order: Permutation,
}

/// One batch to train on.
pub(crate) struct Step<'a> {
    /// The bucket the batch comes from.
    pub(crate) bucket: &'a BucketRef<'a>,
    /// Positions `first .. first + len` of the bucket's order make the batch, in that order.
    pub(crate) first: u64,
    /// Edges in the batch.
    pub(crate) len: usize,
    /// The resident partitions, ascending: negatives are drawn from them.
    pub(crate) resident: &'a [u32],
    /// The epoch, from 1.
    pub(crate) epoch: u32,
    /// The batch's number within the epoch (keys the negatives' streams).
    pub(crate) batch_no: u64,
}

impl Step<'_> {
    /// The batch's edges, `[source, relation, destination]`.
    pub(crate) fn edge(&self, j: usize) -> Edge {
        self.bucket.edges[self.bucket.order.at(self.first + j as u64) as usize]
    }
}

/// Receives a partition's rows a piece at a time: embeddings, then the same rows' state.
pub type RowSink<'a> = dyn FnMut(&[f32], &[f32]) -> Result<(), TrainError> + 'a;

/// A compute engine driven by the trainer's epoch loop (see the module docs for the order of
/// the calls).
pub(crate) trait ComputeBackend {
    /// Partition `p` has become resident in `host` (after the fill). An engine that keeps the
    /// rows itself for the whole run may give the host copy's memory back (see
    /// [`ComputeBackend::evicting`], which fills it again).
    fn loaded(&mut self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError>;
    /// Partition `p` is about to leave `host` outside a swap (the fill): its host copy must be
    /// made current.
    fn evicting(&mut self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError>;
    /// A swap begins: `evicted` leaves compute now (work queued so far may still use it) and
    /// will leave `host` when the buffer starts the swap; `loaded` arrives at
    /// [`ComputeBackend::finish_swap`]. Either `host`'s copy of `evicted` is current when this
    /// returns, or the returned hook makes it current on the I/O thread before the write-back.
    fn begin_swap(
        &mut self,
        host: &mut PartitionBuffer,
        evicted: u32,
        loaded: u32,
    ) -> Result<Option<Box<dyn SwapHook>>, TrainError>;
    /// The swap has finished: `loaded` is resident in `host`; compute queued from now on may
    /// use it.
    fn finish_swap(&mut self, host: &PartitionBuffer, loaded: u32) -> Result<(), TrainError>;
    /// The batches of `bucket` follow.
    fn begin_bucket(&mut self, bucket: &BucketRef<'_>) -> Result<(), TrainError>;
    /// Runs (or queues) one synchronous step on a batch of resident rows; its loss is added
    /// to the sum [`ComputeBackend::take_loss`] returns.
    fn train_batch(
        &mut self,
        step: &Step<'_>,
        host: &mut PartitionBuffer,
        rels: &mut Relations,
    ) -> Result<(), TrainError>;
    /// Waits until every queued step has run (for the I/O-vs-compute timings).
    fn synchronize(&mut self) -> Result<(), TrainError>;
    /// The loss summed since the last call (waits for queued steps).
    fn take_loss(&mut self) -> Result<f64, TrainError>;
    /// The learning rate of the steps from now on (node and relation rows alike).
    fn set_learning_rate(&mut self, lr: f32);
    /// Makes the host copies current: the resident partitions in `host` and `rels`.
    fn sync_host(
        &mut self,
        host: &mut PartitionBuffer,
        rels: &mut Relations,
    ) -> Result<(), TrainError>;
    /// From now on swaps move partitions between the device and `store` with I/O the engine
    /// runs itself (the GPU I/O kernels over `controller`'s queues). Engines without such I/O
    /// return `false` and keep the buffer's I/O thread moving them.
    fn use_direct_io(
        &mut self,
        _store: &SharedFileStore,
        _controller: &SharedController,
    ) -> Result<bool, TrainError> {
        Ok(false)
    }
    /// Whether the engine holds partition `p` in memory of its own (a GPU's).
    fn holds(&self, _p: u32) -> bool {
        false
    }
    /// Makes [`Relations`] current (the relation rows the engine holds), leaving the node
    /// partitions where they are.
    fn sync_relations(&mut self, _rels: &mut Relations) -> Result<(), TrainError> {
        Ok(())
    }
    /// Calls `f` with partition `p`'s embedding and state rows, a bounded piece at a time,
    /// straight from where the engine holds them; `false` when it does not hold `p` (the host
    /// buffer's rows are current then).
    fn stream_partition(&mut self, _p: u32, _f: &mut RowSink<'_>) -> Result<bool, TrainError> {
        Ok(false)
    }
    /// Device memory in use (bytes), for engines with a device.
    fn device_memory_in_use(&self) -> Option<u64> {
        None
    }
    /// The I/O kernel launches since the last call, timed from `epoch_start` (engines without
    /// direct I/O have none).
    fn take_io_kernels(&mut self, _epoch_start: Instant) -> Vec<IoKernelSpan> {
        Vec::new()
    }
}
