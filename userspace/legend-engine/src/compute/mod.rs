//! Where a trainer's steps run: the CPU engine or the GPU engine, behind one interface that
//! [`crate::Trainer::run_epoch`] drives. The host [`PartitionBuffer`] stays the source of truth
//! for partitions that are not resident; a backend that keeps resident rows elsewhere (the GPU)
//! copies a partition out when it leaves the buffer and in when it arrives.

pub(crate) mod cpu;
pub(crate) mod cuda;

use legend_dataset::Edge;

use crate::buffer::PartitionBuffer;
use crate::trainer::{Relations, TrainError};

/// One batch to train on.
pub(crate) struct Step<'a> {
    /// The positives, shuffled, `[source, relation, destination]`.
    pub(crate) batch: &'a [Edge],
    /// The resident partitions, ascending: negatives are drawn from them.
    pub(crate) resident: &'a [u32],
    /// The epoch, from 1.
    pub(crate) epoch: u32,
    /// The batch's number within the epoch (keys the negatives' streams).
    pub(crate) batch_no: u64,
}

/// A compute engine driven by the trainer's epoch loop.
pub(crate) trait ComputeBackend {
    /// Partition `p` has become resident in `host` (after the fill or a swap).
    fn loaded(&mut self, host: &PartitionBuffer, p: u32) -> Result<(), TrainError>;
    /// Partition `p` is about to leave `host`: its host copy must be made current.
    fn evicting(&mut self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError>;
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
    /// Makes the host copies current: the resident partitions in `host` and `rels`.
    fn sync_host(
        &mut self,
        host: &mut PartitionBuffer,
        rels: &mut Relations,
    ) -> Result<(), TrainError>;
}
