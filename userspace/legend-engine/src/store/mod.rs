//! Where partitions live while they are not resident: in RAM ([`MemoryStore`]) or in an
//! on-disk store ([`FileStore`]: a file or block device, or an NVMe namespace behind I/O queue
//! pairs of `legend_nvme` or the userspace proxy controller). The swap path
//! ([`crate::swap`]) moves partitions between these and the engine's slots.

pub(crate) mod at_rest;
pub mod controllers;
pub mod file;
pub mod location;
pub(crate) mod memory;

pub use file::{FileStore, FileStoreSpec, MemberFile, PROGRESS_CAPACITY, QueuedMember, StoreFile};
pub use location::{QueueBackend, QueueLocation, StoreMember};
pub use memory::{MemoryStore, SharedMemoryStore, StoredEmbeddings};

/// The store a run's partitions live in while they are not resident, as the session opened
/// it: the trainer picks the path between it and the engine's slots from it.
pub enum PartitionHome {
    /// In RAM (the `memory` backend).
    Memory(MemoryStore),
    /// On disk, or on a namespace behind NVMe queues.
    File(Box<FileStore>),
    /// In RAM, shared by the workers of a K-GPU run.
    Shared(SharedMemoryStore),
}

/// Where partitions live while they are not resident.
///
/// Implemented by the in-RAM store and the on-disk stores.
pub trait PartitionStore: Send + 'static {
    /// Reads partition `p` into `emb`/`state` (already sized). Returns `false`, leaving the
    /// buffers untouched, if the partition was never written: the caller initialises it.
    fn read(
        &mut self,
        p: u32,
        emb: &mut [f32],
        state: &mut [f32],
    ) -> Result<bool, PartitionStoreError>;
    /// Writes partition `p`.
    fn write(&mut self, p: u32, emb: &[f32], state: &[f32]) -> Result<(), PartitionStoreError>;
    /// Makes every write so far durable.
    fn sync(&mut self) -> Result<(), PartitionStoreError> {
        Ok(())
    }
    /// Commits a checkpoint: every partition written so far, `aux` (the relation parameters)
    /// and `progress`, atomically. Stores without their own checkpoints (RAM) do nothing and
    /// return `false`; the caller then saves the checkpoint elsewhere.
    fn commit(&mut self, _progress: &[u8], _aux: &[u8]) -> Result<bool, PartitionStoreError> {
        Ok(false)
    }
    /// The committed rows `ids` (any order, repeats allowed) alone, their embeddings widened
    /// to f32 into `out` (a row per id, in `ids`' order), a row of a partition never written
    /// drawn by `init`: a lookup. Only a store on disk reads rows alone; the others refuse.
    fn read_rows(
        &mut self,
        _init: &legend_model::Init,
        ids: &[u64],
        _out: &mut [f32],
    ) -> Result<(), PartitionStoreError> {
        Err(PartitionStoreError::Invalid(format!(
            "{} rows asked of a store in memory, which is read a partition at a time",
            ids.len()
        )))
    }
    /// Whether the store is process memory: partitions then move in and out of it
    /// ([`PartitionStore::take_stored`], [`PartitionStore::keep_stored`]) instead of being
    /// copied, and a checkpoint leaves the resident partitions where they are (with every
    /// partition resident, a copy would be a second whole table in RAM).
    fn in_memory(&self) -> bool {
        false
    }
    /// For a store in memory: gives partition `p`'s rows away as it keeps them (embeddings in
    /// its format, state); `None` when the store does not hold `p` (never written, or another
    /// store kind).
    fn take_stored(&mut self, _p: u32) -> Option<(StoredEmbeddings, Vec<f32>)> {
        None
    }
    /// For a store in memory: takes partition `p`'s rows over, as a move when they are in its
    /// format (a copy of a 4 GB partition, into memory touched for the first time, costs
    /// seconds per swap); f32 embeddings are narrowed to a 16-bit store's format.
    fn keep_stored(
        &mut self,
        p: u32,
        emb: StoredEmbeddings,
        state: Vec<f32>,
    ) -> Result<(), PartitionStoreError> {
        match emb {
            StoredEmbeddings::F32(values) => self.write(p, &values, &state),
            StoredEmbeddings::Bits16(_) => Err(PartitionStoreError::Invalid(format!(
                "partition {p}: only a memory store keeps rows as 16-bit bits"
            ))),
        }
    }
    /// A slot is about to read partition `p` to train it: a store shared by several swap paths
    /// waits until `p` is home (written back by whichever path held it) and marks it out.
    /// Stores with one reader do nothing.
    fn take_out(&mut self, _p: u32) -> Result<(), PartitionStoreError> {
        Ok(())
    }
    /// Partition `p` is home again (written back, or given back unmodified).
    fn bring_home(&mut self, _p: u32) {}
    /// Waits until partition `p` is home, without taking it out (a checkpoint's or an
    /// evaluation's read of a partition no slot holds).
    fn wait_home(&mut self, _p: u32) -> Result<(), PartitionStoreError> {
        Ok(())
    }
}

/// A partition store failure, with its cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PartitionStoreError {
    /// The on-disk store failed.
    #[error(transparent)]
    Storage(#[from] legend_storage::StoreError),
    /// A file of the store could not be created, opened or sized.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The NVMe controller behind the store could not be opened or attached.
    #[error("{what}")]
    Controller {
        /// What was being done, and what to check.
        what: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Moving a partition between the GPU and the store failed.
    #[error("{what} partition {partition} {path}")]
    Gpu {
        /// `writing`, `reading`, `uploading`, `downloading`.
        what: &'static str,
        /// The partition.
        partition: u32,
        /// `on the GPU` or `through the GPU I/O kernels`.
        path: &'static str,
        /// Why.
        #[source]
        source: legend_cuda::GpuError,
    },
    /// The swap path's I/O thread has stopped (after an earlier failure).
    #[error("the swap's I/O thread has stopped")]
    IoThreadStopped,
    /// The store does not hold what was asked of it (the message says what).
    #[error("{0}")]
    Invalid(String),
    /// A shared store's partition stayed out with a swap path that has stopped.
    #[error(
        "partition {0} was not written back: the worker holding it stopped (another failure stopped the run)"
    )]
    Abandoned(u32),
}
