//! Where a trainer's steps run: the CPU engine or the GPU engine, behind one interface that
//! [`crate::Trainer::run_epoch`] drives. Which partition sits in which slot, and every move of a
//! partition in or out, belong to the swap path ([`crate::swap`]); an engine only learns where
//! a partition arrived and says when it is done with one.
//!
//! The contract, in the order the trainer calls it:
//! - [`ComputeBackend::arrive`] once the swap path has a partition's rows in a slot (with the
//!   fence the engine waits on before it uses them), [`ComputeBackend::release`] when a
//!   partition leaves (the fence after which the swap path may write its slot out).
//! - A bucket: [`ComputeBackend::begin_bucket`], then its batches in order through
//!   [`ComputeBackend::train_batch`]; batch `b` holds positions `b·B ..` of the bucket's
//!   [`Permutation`].
//! - [`ComputeBackend::settled`] before a checkpoint writes the resident slots,
//!   [`ComputeBackend::synchronize`] where the trainer times compute,
//!   [`ComputeBackend::take_loss`] once an epoch.

pub(crate) mod cpu;
pub(crate) mod cuda;

use legend_cuda::RowSpan;
use legend_dataset::Edge;
use legend_model::{BatchKey, Permutation};

use crate::error::TrainError;
use crate::relations::{RelationGradients, Relations};
use crate::swap::{Fence, HostRows};

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
    /// The key of every random draw the step makes (negatives, rounding).
    pub(crate) key: BatchKey,
}

impl Step<'_> {
    /// The batch's edges, `[source, relation, destination]`.
    pub(crate) fn edge(&self, j: usize) -> Edge {
        self.bucket.edges[self.bucket.order.at(self.first + j as u64) as usize]
    }
}

/// Receives a partition's rows a piece at a time: embeddings, then the same rows' state. Its
/// error, whatever the receiver's concern, ends the stream as [`TrainError::Sink`].
pub type RowSink<'a> =
    dyn FnMut(&[f32], &[f32]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + 'a;

/// A compute engine driven by the trainer's epoch loop (see the module docs for the order of
/// the calls).
pub(crate) trait ComputeBackend: Send {
    /// Partition `p` is in `slot` once `ready` has passed: compute queued from now on may use it.
    fn arrive(&mut self, p: u32, slot: u32, ready: &Fence) -> Result<(), TrainError>;
    /// Partition `p` leaves compute: work queued from now on does not touch it. Returns the
    /// point after which its slot may be written out.
    fn release(&mut self, p: u32) -> Result<Fence, TrainError>;
    /// The point after which every resident slot holds what the steps queued so far wrote.
    fn settled(&mut self) -> Result<Fence, TrainError>;
    /// The batches of `bucket` follow.
    fn begin_bucket(&mut self, bucket: &BucketRef<'_>) -> Result<(), TrainError>;
    /// Runs (or queues) one synchronous step on a batch of resident rows (`host`: the CPU
    /// engine's); its loss is added to the sum [`ComputeBackend::take_loss`] returns.
    fn train_batch(
        &mut self,
        step: &Step<'_>,
        host: &mut HostRows,
        rels: &mut Relations,
    ) -> Result<(), TrainError>;
    /// Waits until every queued step has run (for the I/O-vs-compute timings).
    fn synchronize(&mut self) -> Result<(), TrainError>;
    /// The loss summed since the last call (waits for queued steps).
    fn take_loss(&mut self) -> Result<f64, TrainError>;
    /// The learning rate of the steps from now on (node and relation rows alike).
    fn set_learning_rate(&mut self, lr: f32);
    /// Makes [`Relations`] current (the relation rows an engine holds elsewhere).
    fn sync_relations(&mut self, _rels: &mut Relations) -> Result<(), TrainError> {
        Ok(())
    }
    /// Calls `f` with partition `p`'s embedding and state rows, a bounded piece at a time,
    /// straight from where the engine holds them; `false` when its rows are not the engine's
    /// own (the CPU engine's are in [`HostRows`]).
    fn stream_partition(&mut self, _p: u32, _f: &mut RowSink<'_>) -> Result<bool, TrainError> {
        Ok(false)
    }
    /// Device memory in use (bytes), for engines with a device.
    fn device_memory_in_use(&self) -> Option<u64> {
        None
    }
    /// The device rows partition `p` takes in `slot`, for moving them between GPUs (GPU
    /// engines; `None` for the CPU engine, whose rows are host rows).
    fn slot_span(&self, _slot: u32, _p: u32) -> Result<Option<RowSpan>, TrainError> {
        Ok(None)
    }
    /// Several workers: from now on a step leaves its relation rows' gradients pending
    /// ([`ComputeBackend::pending_relations`]) until [`ComputeBackend::apply_relations`].
    fn defer_relations(&mut self, rels: &Relations) -> Result<(), TrainError>;
    /// The relation gradients pending since the last apply, for the workers to sum.
    fn pending_relations(&mut self) -> Result<PendingRelations<'_>, TrainError>;
    /// Steps the relation rows with the pending gradients (summed over the workers once
    /// `ready` has passed) and clears them.
    fn apply_relations(&mut self, rels: &mut Relations, ready: &Fence) -> Result<(), TrainError>;
}

/// One step's relation gradients, waiting for the other workers' (see
/// [`ComputeBackend::defer_relations`]): summed in place by the workers' link.
pub(crate) enum PendingRelations<'a> {
    /// The CPU engine's, in host memory.
    Host(&'a mut RelationGradients),
    /// A GPU's relation gradient table: `floats` f32 at `at`, complete once `after` has passed.
    Device {
        /// Its address.
        at: u64,
        /// Its floats (every row's).
        floats: usize,
        /// The step that wrote them.
        after: Fence,
    },
}
