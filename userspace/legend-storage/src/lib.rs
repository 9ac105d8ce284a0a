//! Legend's out-of-core embedding store.
//!
//! Node embeddings and their AdaGrad state live on a file or block device,
//! partition by partition (`[embeddings | AdaGrad state]`, contiguous and
//! aligned), behind a checksummed superblock kept in two alternating copies.
//! On a file or block device the store opens the target with `O_DIRECT` and
//! moves data with `io_uring` using registered buffers and several requests in
//! flight; on an NVMe namespace ([`Target::Nvme`]: the `legend_nvme` device or
//! the userspace proxy) it drives an I/O queue pair from the calling thread.
//! The on-disk format and the commit protocol are described in
//! `Documentation/store-format.md`.
//!
//! Typical use by the training engine:
//! ```no_run
//! # use legend_storage::*;
//! # fn main() -> Result<(), StoreError> {
//! let dataset = DatasetId { id: [0; 16], label: "fb15k".into() };
//! let spec = StoreSpec { dataset, num_nodes: 14_951, dim: 100, dtype: Dtype::Bf16, state_width: 1,
//!     num_partitions: 4, aux_bytes: 1 << 20, progress_capacity: 4096, shadow: true };
//! let mut store = Store::create("store.bin".as_ref(), &spec, &CreateOptions::default())?;
//! let mut slot = IoBuffer::new(store.max_partition_bytes())?;
//! if !store.is_initialized(Region::Partition(0))? {
//!     let rows = store.partition(0)?.rows;
//!     let (emb, state) = slot.split_partition_mut(rows, &spec);
//!     let rows = vec![0.01f32; state.len() * 100]; // the engine's initialiser
//!     spec.dtype.narrow(&rows, emb);
//!     state.fill(0.0);
//! } else {
//!     store.read(Region::Partition(0), &mut slot)?;
//! }
//! store.write(Region::Partition(0), &slot)?;
//! store.commit(b"epoch 1")?;
//! # Ok(()) }
//! ```

mod buffer;
mod error;
mod extents;
mod io;
mod layout;
mod medium;
mod nvme;
mod signature;
mod store;
mod stripe;
mod superblock;
mod target_file;
mod uring;

pub use buffer::{IO_ALIGN, IoBuffer};
pub use error::StoreError;
pub use extents::{EXTENT_ALIGN, ExtentEntry, ExtentTable, Extents};
pub use io::IoConfig;
pub use layout::{
    BASE_ALIGN, DatasetId, Extent, Layout, MAX_LABEL_BYTES, MAX_PARTITIONS, MAX_PROGRESS_BYTES,
    SUPERBLOCK_SLOT_BYTES, StoreSpec,
};
pub use legend_model::Dtype;
pub use medium::Target;
pub use nvme::NvmeTarget;
pub use signature::{HEAD_BYTES, foreign_signature};
pub use store::{
    CreateOptions, DEFAULT_STRIPE_BYTES, Expect, IoPiece, IoRequest, Region, Store, new_store_id,
    store_id_hex,
};
pub use stripe::member_bytes;
