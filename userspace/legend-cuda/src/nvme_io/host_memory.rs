//! Host memory the GPU reaches: pinned allocations mapped into it (the proxy's rings, the
//! staging slots) and registered ranges (the doorbells).

use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use crate::GpuError;
use crate::error::DriverContext;

/// Pinned host memory mapped into the GPU, freed on drop.
pub(super) struct Pinned {
    pub(super) host: *mut u8,
    pub(super) device: u64,
    pub(super) len: usize,
}

// SAFETY: plain memory, shared by the host threads, the GPU and the controller.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(super) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned, GpuError> {
        ctx.bind_to_thread().during("binding the context")?;
        // SAFETY: a fresh allocation, zeroed below before anyone reads it.
        let host = unsafe {
            result::malloc_host(
                len,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .during("allocating pinned queue memory")?
        .cast::<u8>();
        // SAFETY: `len` bytes were just allocated.
        unsafe { std::ptr::write_bytes(host, 0, len) };
        let device = device_pointer(host).inspect_err(|_| {
            // SAFETY: allocated above, not yet shared.
            let _ = unsafe { result::free_host(host.cast()) };
        })?;
        Ok(Pinned { host, device, len })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`; nothing uses it any more (the owner deleted
        // the queue pairs first).
        let _ = unsafe { result::free_host(self.host.cast()) };
    }
}

/// The device address of pinned or registered host memory.
fn device_pointer(host: *mut u8) -> Result<u64, GpuError> {
    let mut d: sys::CUdeviceptr = 0;
    // SAFETY: `host` is pinned or registered with the current context; `d` is a live local.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host.cast(), 0) }
        .result()
        .during("mapping host memory into the GPU")?;
    Ok(d)
}

/// Host memory (the doorbells) registered with CUDA, unregistered on drop.
pub(super) struct Registered {
    pub(super) host: *mut u8,
    pub(super) device: u64,
}

// SAFETY: the registration is process-wide; the pointer is only handed back to CUDA.
unsafe impl Send for Registered {}

impl Registered {
    pub(super) fn new(host: *mut u8, len: usize, io_memory: bool) -> Result<Registered, GpuError> {
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP
            | sys::CU_MEMHOSTREGISTER_PORTABLE
            | if io_memory {
                sys::CU_MEMHOSTREGISTER_IOMEMORY
            } else {
                0
            };
        // SAFETY: `host..host + len` is mapped for as long as the result lives (the owner
        // keeps the doorbell mapping).
        unsafe { sys::cuMemHostRegister_v2(host.cast(), len, flags) }
            .result()
            .during("registering the doorbells with CUDA")?;
        let device = device_pointer(host).inspect_err(|_| {
            // SAFETY: registered above.
            let _ = unsafe { sys::cuMemHostUnregister(host.cast()) };
        })?;
        Ok(Registered { host, device })
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: registered in `new`.
        let _ = unsafe { sys::cuMemHostUnregister(self.host.cast()) };
    }
}
