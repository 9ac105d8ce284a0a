//! Node rows to and from their 16-bit format at rest, on the GPU: a swap through the GPU I/O
//! kernels narrows the evicted slot into the staging region the kernels write to the store,
//! and widens what they read into the loaded slot (`legend_narrow_rows` and
//! `legend_widen_rows` in `kernels/init.cu`). Exact both ways: the rows' values are already
//! representable (the AdaGrad step and the initialisation round to the format).

use cudarc::driver::{CudaFunction, CudaStream, PushKernelArg};
use legend_model::Dtype;

use crate::error::DriverContext;
use crate::gpu::grid_1d;
use crate::{Gpu, GpuError};

/// The conversion kernels for one 16-bit format.
pub struct RowConverter {
    narrow: CudaFunction,
    widen: CudaFunction,
    dtype: Dtype,
}

impl RowConverter {
    /// The converter of `dtype`'s rows; `None` for f32, which moves as it is.
    pub fn new(gpu: &Gpu, dtype: Dtype) -> Option<RowConverter> {
        dtype.is_narrow().then(|| RowConverter {
            narrow: gpu.kernels.narrow_rows.clone(),
            widen: gpu.kernels.widen_rows.clone(),
            dtype,
        })
    }

    /// Bytes `values` take in the format.
    pub fn bytes(&self, values: usize) -> usize {
        values * self.dtype.bytes()
    }

    /// Queues on `stream` the narrowing of the `values` f32 at device address `src` into
    /// 16-bit values at `dst`.
    ///
    /// # Safety
    /// Both ranges must be live device memory that nothing else touches until the work ran.
    pub unsafe fn narrow(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        values: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract.
        unsafe { self.launch(&self.narrow, stream, src, dst, values) }
    }

    /// Queues on `stream` the widening of `values` 16-bit values at `src` into f32 at `dst`.
    ///
    /// # Safety
    /// As for [`RowConverter::narrow`].
    pub unsafe fn widen(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        values: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract.
        unsafe { self.launch(&self.widen, stream, src, dst, values) }
    }

    unsafe fn launch(
        &self,
        kernel: &CudaFunction,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        values: usize,
    ) -> Result<(), GpuError> {
        let n = values as u64;
        let code = crate::kernel_abi::dtype_code(self.dtype);
        let mut b = stream.launch_builder(kernel);
        b.arg(&src).arg(&dst).arg(&n).arg(&code);
        // SAFETY: the kernel reads `values` elements at src and writes as many at dst, one
        // thread each, ranges the caller guarantees.
        unsafe { b.launch(grid_1d(n)?) }.during("launching a row conversion")?;
        Ok(())
    }
}
