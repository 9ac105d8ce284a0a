//! The one choice of the path a run's partitions take between their store and whoever uses
//! them (the table in the module docs): the trainer and a run's reader both get their mover
//! here, by naming the consumer and the store.

use legend_cuda::Gpu;
use legend_dataset::PartitionScheme;
use legend_model::Init;

use super::Mover;
use super::gpu::{DeviceSlots, GpuCopyMover, GpuDirectMover};
use super::host::{HostMover, HostStore};
use crate::rows::RowShape;
use crate::store::{PartitionHome, PartitionStoreError};

/// Who uses the partitions a mover brings.
pub(crate) enum Consumer<'g> {
    /// The CPU: partitions in host memory.
    Host,
    /// Slots of a GPU's memory.
    Gpu {
        /// The GPU.
        gpu: &'g Gpu,
        /// Its slots.
        slots: DeviceSlots,
        /// Every partition keeps its slot for good (C = N): a host copy is dropped once
        /// uploaded.
        resident_for_good: bool,
    },
}

/// How the partitions of a store are laid out and drawn: what every mover needs beside it.
#[derive(Clone, Copy)]
pub(crate) struct AtRest {
    pub(crate) scheme: PartitionScheme,
    pub(crate) shape: RowShape,
    pub(crate) init: Init,
}

impl AtRest {
    fn over<S>(self, store: S) -> HostStore<S> {
        HostStore {
            store,
            scheme: self.scheme,
            shape: self.shape,
            init: self.init,
        }
    }
}

/// The mover between `home` and `consumer`: the host mover for the CPU; for a GPU, the GPU I/O
/// kernels straight into its memory from a store behind NVMe queues (`proxy`, `nvme`, striped
/// or not), else copies through pinned host memory.
pub(crate) fn mover(
    consumer: Consumer<'_>,
    home: PartitionHome,
    at_rest: AtRest,
) -> Result<Box<dyn Mover>, PartitionStoreError> {
    let (gpu, slots, for_good) = match consumer {
        Consumer::Host => {
            return Ok(match home {
                PartitionHome::Memory(s) => Box::new(HostMover::new(at_rest.over(s))),
                PartitionHome::File(s) => Box::new(HostMover::new(at_rest.over(*s))),
                PartitionHome::Shared(s) => Box::new(HostMover::new(at_rest.over(s))),
            });
        }
        Consumer::Gpu {
            gpu,
            slots,
            resident_for_good,
        } => (gpu, slots, resident_for_good),
    };
    let copies = |e| PartitionStoreError::Controller {
        what: "setting up the copies between the GPU and host memory".into(),
        source: Box::new(e),
    };
    Ok(match home {
        PartitionHome::File(s) if !s.queued_members().is_empty() => {
            Box::new(GpuDirectMover::new(gpu, at_rest.over(*s), slots)?)
        }
        PartitionHome::File(s) => {
            Box::new(GpuCopyMover::new(gpu, at_rest.over(*s), slots, for_good).map_err(copies)?)
        }
        PartitionHome::Memory(s) => {
            Box::new(GpuCopyMover::new(gpu, at_rest.over(s), slots, for_good).map_err(copies)?)
        }
        // Partitions leave for other GPUs and come back: the store keeps them.
        PartitionHome::Shared(s) => {
            Box::new(GpuCopyMover::new(gpu, at_rest.over(s), slots, false).map_err(copies)?)
        }
    })
}
