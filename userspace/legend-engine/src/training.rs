//! What a session trains with: one [`Trainer`], or K [`Workers`] (`training.gpus`), behind the
//! calls the session makes.

use std::sync::atomic::AtomicBool;

use legend_dataset::PartitionScheme;

use crate::compute::RowSink;
use crate::error::TrainError;
use crate::progress::EpochCut;
use crate::relations::Relations;
use crate::rows::Partition;
use crate::trainer::{EpochEnd, Trainer};
use crate::workers::Workers;

/// One trainer, or K workers.
pub(crate) enum Training {
    /// One engine.
    One(Box<Trainer>),
    /// K engines, one a GPU.
    Workers(Box<Workers>),
}

impl Training {
    /// The one trainer's plan (`None` for workers, whose schedule is rounds).
    pub(crate) fn plan(&self) -> Option<&legend_planner::Plan> {
        match self {
            Training::One(t) => Some(t.plan()),
            Training::Workers(_) => None,
        }
    }

    /// The workers' schedule.
    pub(crate) fn schedule(&self) -> Option<&legend_planner::GpuSchedule> {
        match self {
            Training::One(_) => None,
            Training::Workers(w) => Some(w.schedule()),
        }
    }

    pub(crate) fn scheme(&self) -> PartitionScheme {
        match self {
            Training::One(t) => t.scheme(),
            Training::Workers(w) => w.scheme(),
        }
    }

    pub(crate) fn relations(&self) -> &Relations {
        match self {
            Training::One(t) => t.relations(),
            Training::Workers(w) => w.relations(),
        }
    }

    pub(crate) fn sync_relations(&mut self) -> Result<(), TrainError> {
        match self {
            Training::One(t) => t.sync_relations(),
            Training::Workers(w) => w.sync_relations(),
        }
    }

    pub(crate) fn set_learning_rate(&mut self, lr: f32) {
        match self {
            Training::One(t) => t.set_learning_rate(lr),
            Training::Workers(w) => w.set_learning_rate(lr),
        }
    }

    /// Partition `p`'s rows in host memory, when one trainer holds them there (the CPU
    /// engine's); read in place.
    pub(crate) fn host_partition(&mut self, p: u32) -> Option<&Partition> {
        match self {
            Training::One(t) => t.host_partition(p),
            Training::Workers(_) => None,
        }
    }

    pub(crate) fn stream_partition(
        &mut self,
        p: u32,
        f: &mut RowSink<'_>,
    ) -> Result<(), TrainError> {
        match self {
            Training::One(t) => t.stream_partition(p, f),
            Training::Workers(w) => w.stream_partition(p, f),
        }
    }

    /// Commits a checkpoint where the store keeps them (see [`Trainer::checkpoint`]).
    pub(crate) fn checkpoint(
        &mut self,
        progress: Vec<u8>,
        aux: Vec<u8>,
    ) -> Result<bool, TrainError> {
        match self {
            Training::One(t) => t.checkpoint(progress, aux),
            Training::Workers(w) => w.checkpoint(),
        }
    }

    pub(crate) fn run_epoch_from(
        &mut self,
        epoch: u32,
        from: Option<EpochCut>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochEnd, TrainError> {
        match self {
            Training::One(t) => t.run_epoch_from(epoch, from, stop, progress),
            Training::Workers(w) => w.run_epoch_from(epoch, from, stop, progress),
        }
    }
}
