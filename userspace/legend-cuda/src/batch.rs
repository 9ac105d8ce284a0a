//! Batches gathered on the device in the order of legend-model's [`Permutation`]
//! (`legend_gather_batch` in `kernels/batch.cu`).

use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use legend_model::{PERMUTATION_ROUNDS, Permutation};

use crate::error::DriverContext;
use crate::gpu::grid_1d;
use crate::{Gpu, GpuError};

/// A permutation as the kernels take it (`LegendPermutation` in `kernels/batch.cu`, field for
/// field).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PermutationArgs {
    n: u64,
    keys: [u64; PERMUTATION_ROUNDS],
    half_bits: u32,
    unused: u32,
}

// SAFETY: plain #[repr(C)] data laid out as the kernel's struct (u64 fields, then two u32).
unsafe impl DeviceRepr for PermutationArgs {}

/// Queues the gather of edges `order(first) .. order(first + count − 1)` of `bucket` (three
/// ids an edge, `order.len()` edges, in device memory) into the start of `out`: a batch in the
/// bucket's training order, as the trainers define it.
pub fn gather_batch(
    gpu: &Gpu,
    bucket: &CudaView<'_, u32>,
    order: &Permutation,
    first: u64,
    count: u32,
    out: &mut CudaSlice<u32>,
) -> Result<(), GpuError> {
    let end = first.checked_add(u64::from(count));
    if end.is_none_or(|end| end > order.len())
        || bucket.len() as u64 != 3 * order.len()
        || out.len() < 3 * count as usize
    {
        return Err(GpuError::Shape(format!(
            "positions {first}+{count} of a permutation of {} over {} ids into {}",
            order.len(),
            bucket.len(),
            out.len()
        )));
    }
    let args = PermutationArgs {
        n: order.len(),
        keys: *order.round_keys(),
        half_bits: order.half_bits(),
        unused: 0,
    };
    let mut b = gpu.stream().launch_builder(&gpu.kernels.gather_batch);
    b.arg(bucket).arg(&args).arg(&first).arg(&count).arg(out);
    // SAFETY: the permutation maps positions below n into 0..n, bucket holds 3n ids and out
    // at least 3 · count (checked above).
    unsafe { b.launch(grid_1d(u64::from(count))?) }.during("launching legend_gather_batch")?;
    Ok(())
}
