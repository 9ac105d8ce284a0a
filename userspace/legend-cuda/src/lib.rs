//! The GPU engine of Legend: CUDA kernels compiled at run time with NVRTC and run through
//! cudarc's driver API (loaded dynamically, so building needs no CUDA).
//!
//! - [`nvrtc`]: the kernel sources (`kernels/*.cu`), their compilation (eleven programs, in parallel, to machine code) and its cache.
//! - [`Gpu`]: a device context, a stream and the loaded kernels; a missing driver, NVRTC or
//!   device is an error ([`GpuError`]), never a panic.
//! - [`GpuBatchEngine`]: one synchronous training step on device-resident tables: negative
//!   sampling, chunked scores and gradients on tensor cores, and in-place AdaGrad; batches
//!   uploaded or gathered on the device from a resident bucket.
//! - [`Transfer`]: copies between host memory and the device through pinned staging on a
//!   stream of their own.
//! - [`scan`]: exact top-K scans of an entity table for queries on a run, bit-identical to the
//!   CPU's scores and order.
//! - [`nvme_io`]: GPU-initiated NVMe I/O: thread blocks driving queue pairs of an SSD or of the
//!   userspace proxy between GPU memory and a namespace.

mod at_rest;
mod error;
pub mod nvrtc;

pub use at_rest::RowConverter;
pub use error::GpuError;
mod batch;
mod engine;
mod gpu;
mod kernel_abi;
pub mod nccl;
pub mod nvme_io;
pub mod scan;
mod transfer;

pub use batch::gather_batch;
pub use engine::{
    BatchShape, DeviceTable, GpuBatchEngine, SlotMap, init_rows, known_edges_bytes, negative_keys,
    rng_vectors,
};
pub use gpu::{Gpu, device_count, device_memory, driver_present};
pub use transfer::{DEFAULT_CHUNK_BYTES, Fill, RowSpan, Transfer, addr};

/// cudarc's types that the engine's API hands out (events ordering streams, device buffers).
pub use cudarc::driver::{CudaEvent, CudaSlice, CudaView};
