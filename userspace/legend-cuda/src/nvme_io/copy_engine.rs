//! The proxy controller's copies of GPU memory.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream, result, sys};
use legend_nvme::DeviceMemory;

use crate::error::DriverContext;
use crate::{Gpu, GpuError};

/// The proxy controller's DMA engine for GPU memory: synchronous copies, each on a stream that
/// no other thread is using at that moment (the proxy's threads copy at once, and a stream
/// shared between them would make each wait for the others' copies).
pub struct CudaDeviceMemory {
    ctx: Arc<CudaContext>,
    idle_streams: Mutex<Vec<Arc<CudaStream>>>,
}

impl CudaDeviceMemory {
    /// A copy engine for `gpu`'s memory.
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn new(gpu: &Gpu) -> Result<CudaDeviceMemory, GpuError> {
        let ctx = gpu.context().clone();
        let first = ctx
            .new_stream()
            .during("creating the proxy's copy stream")?;
        Ok(CudaDeviceMemory {
            ctx,
            idle_streams: Mutex::new(vec![first]),
        })
    }

    /// Runs `copy` on an idle stream of this engine and waits for it.
    fn copy_sync(
        &self,
        copy: impl FnOnce(sys::CUstream) -> Result<(), cudarc::driver::DriverError>,
    ) -> std::io::Result<()> {
        self.ctx.bind_to_thread().map_err(io_err)?;
        let idle = self
            .idle_streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let stream = match idle {
            Some(s) => s,
            None => self.ctx.new_stream().map_err(io_err)?,
        };
        let done = copy(stream.cu_stream())
            // SAFETY: the stream is live; waiting on it is always sound.
            .and_then(|()| unsafe { result::stream::synchronize(stream.cu_stream()) });
        self.idle_streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(stream);
        done.map_err(io_err)
    }
}

fn io_err(e: cudarc::driver::DriverError) -> std::io::Error {
    std::io::Error::other(format!("CUDA: {e}"))
}

impl DeviceMemory for CudaDeviceMemory {
    fn write(&self, dst: u64, src: &[u8]) -> std::io::Result<()> {
        // SAFETY: `dst..dst + len` lies in GPU memory mapped through the proxy (its region
        // check), `src` is live for the synchronous copy.
        self.copy_sync(|stream| unsafe { result::memcpy_htod_async(dst, src, stream) })
    }

    fn read(&self, src: u64, dst: &mut [u8]) -> std::io::Result<()> {
        // SAFETY: as in `write`.
        self.copy_sync(|stream| unsafe { result::memcpy_dtoh_async(dst, src, stream) })
    }

    fn pin(&self, ptr: *mut u8, len: usize) -> std::io::Result<()> {
        self.ctx.bind_to_thread().map_err(io_err)?;
        // SAFETY: `ptr..ptr + len` is the proxy's own allocation, which it unpins before it
        // frees it (after its threads stopped copying).
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(io_err)
    }

    fn unpin(&self, ptr: *mut u8) -> std::io::Result<()> {
        self.ctx.bind_to_thread().map_err(io_err)?;
        // SAFETY: `ptr` was registered by `pin`; the proxy calls this once its threads stopped.
        unsafe { sys::cuMemHostUnregister(ptr.cast()) }
            .result()
            .map_err(io_err)
    }
}
