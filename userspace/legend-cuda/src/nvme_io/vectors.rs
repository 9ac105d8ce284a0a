//! The SQE test vectors: commands and PRP lists built by the I/O kernels' own functions, for
//! tests to hold against the protocol crate's.

use cudarc::driver::{DeviceRepr, PushKernelArg};

use crate::error::DriverContext;
use crate::{Gpu, GpuError};

/// One SQE test vector's inputs (`LegendSqeVector`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SqeVector {
    /// Device address of the buffer's page table.
    pub pages: u64,
    /// Byte of the buffer.
    pub offset: u64,
    /// First LBA.
    pub lba: u64,
    /// The PRP list page's bus address.
    pub list_bus: u64,
    /// log2 of the buffer's page size.
    pub page_shift: u32,
    /// 1 write, 2 read.
    pub opcode: u32,
    /// Namespace.
    pub nsid: u32,
    /// Logical blocks.
    pub blocks: u32,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// Command identifier.
    pub cid: u32,
}

// SAFETY: a plain `repr(C)` struct of integers, as its CUDA twin.
unsafe impl DeviceRepr for SqeVector {}

/// Builds each vector's SQE (16 dwords) and PRP list (512 entries) with the I/O kernels' own
/// functions (`legend_nvme_sqe_vectors`).
///
/// # Errors
///
/// Driver errors.
pub fn sqe_vectors(gpu: &Gpu, vectors: &[SqeVector]) -> Result<(Vec<u32>, Vec<u64>), GpuError> {
    let stream = gpu.stream();
    let n = vectors.len() as u32;
    let v = stream.clone_htod(vectors).during("uploading vectors")?;
    let mut out = stream
        .alloc_zeros::<u32>(16 * vectors.len())
        .during("allocating SQEs")?;
    let mut lists = stream
        .alloc_zeros::<u64>(512 * vectors.len())
        .during("allocating PRP lists")?;
    let mut b = stream.launch_builder(&gpu.kernels.sqe_vectors);
    b.arg(&v).arg(&n).arg(&mut out).arg(&mut lists);
    // SAFETY: `out` and `lists` hold 16 and 512 entries a vector; the page tables the
    // vectors name are live device memory of the caller.
    unsafe { b.launch(crate::gpu::grid_1d(u64::from(n))?) }
        .during("launching legend_nvme_sqe_vectors")?;
    Ok((
        stream.clone_dtoh(&out).during("reading SQEs")?,
        stream.clone_dtoh(&lists).during("reading PRP lists")?,
    ))
}
