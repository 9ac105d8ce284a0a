//! Copies between host memory and the device through pinned staging, on a stream of their own
//! (an I/O stream), so that they run on the copy engines while the compute stream runs kernels.
//!
//! Host memory handed in is ordinary (pageable) memory: a copy goes through two pinned chunks
//! in turn, the host filling (or draining) one, on several threads, while the DMA engine moves
//! the other. The
//! alternative, registering the caller's memory with `cuMemHostRegister`, saves that host copy
//! but ties a registration to memory whose owner may reallocate or free it (a partition
//! buffer's rows travel between partitions and its I/O thread, and are resized and dropped
//! there); a staging area owned here has one lifetime and a fixed size, whatever is copied.
//!
//! Ordering against the compute stream ([`Gpu::stream`]) is by events: the safe copies order
//! themselves (after the compute work queued so far, and before the compute work queued
//! later); the raw ones, for threads that cannot borrow the device buffers (a partition
//! buffer's I/O thread), leave it to the caller ([`Transfer::wait`], [`Transfer::record`],
//! [`Gpu::wait_for`]).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUevent_flags};
use cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice, PushKernelArg,
    result,
};
use rayon::prelude::*;

use crate::error::DriverContext;
use crate::{Gpu, GpuError};

/// Default staging chunk: large enough that a chunk's DMA (about 0.5 ms at 25-50 GB/s) dwarfs
/// the per-copy overhead, small enough that two stay cheap to pin.
pub const DEFAULT_CHUNK_BYTES: usize = 16 << 20;

/// Piece of a staging chunk one thread copies: one thread moves about 7 GB/s between pageable
/// and pinned memory on the GPU machine (an H100 host), well short of the DMA engines, so the
/// host side of a chunk is split over rayon's threads.
const PIECE: usize = 1 << 20;

/// Writes an upload's source bytes into a staging chunk: `fill(at, chunk)` fills `chunk` with
/// the source's bytes from offset `at`, chunk after chunk in order (a file read straight into
/// pinned memory, or a slice copied there).
pub type Fill<'a, E> = &'a mut dyn FnMut(usize, &mut [u8]) -> Result<(), E>;

/// `dst.copy_from_slice(src)` on several threads.
fn copy(dst: &mut [u8], src: &[u8]) {
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// A stream for copies with its pinned staging (see the module docs).
pub struct Transfer {
    compute: Arc<CudaStream>,
    /// `legend_init_rows`, for partitions drawn on this stream.
    init_kernel: CudaFunction,
    stream: Arc<CudaStream>,
    stage: [PinnedHostSlice<u8>; 2],
    /// Recorded after the last DMA that used each staging chunk: the host may touch the chunk
    /// again once it has completed.
    done: [CudaEvent; 2],
}

/// Rows of a `DeviceTable` (embeddings and AdaGrad state) as raw device addresses, for copies
/// queued where the table cannot be borrowed: see [`Transfer::download_span`].
#[derive(Clone, Copy, Debug)]
pub struct RowSpan {
    emb: CUdeviceptr,
    state: CUdeviceptr,
    /// Floats of embeddings and of state.
    floats: usize,
    state_floats: usize,
    dim: usize,
}

impl RowSpan {
    /// The floats `emb_range` of `emb` and `state_range` of `state`: the same rows of
    /// embeddings of `dim` floats and of their state.
    pub(crate) fn new(
        emb: &CudaSlice<f32>,
        emb_range: Range<usize>,
        state: &CudaSlice<f32>,
        state_range: Range<usize>,
        dim: usize,
    ) -> Self {
        let at = |s: &CudaSlice<f32>, start: usize| addr(s) + (start * size_of::<f32>()) as u64;
        RowSpan {
            emb: at(emb, emb_range.start),
            state: at(state, state_range.start),
            floats: emb_range.len(),
            state_floats: state_range.len(),
            dim,
        }
    }

    /// Device addresses and bytes of the embedding rows, then of their state.
    pub fn addrs(&self) -> [(u64, usize); 2] {
        [
            (self.emb, self.floats * size_of::<f32>()),
            (self.state, self.state_floats * size_of::<f32>()),
        ]
    }

    /// Rows in the span.
    pub fn rows(&self) -> usize {
        self.floats / self.dim.max(1)
    }

    /// The span's first `rows` rows (a partition smaller than the slot that holds it).
    ///
    /// # Errors
    /// [`GpuError::Shape`] when the span has fewer rows.
    pub fn first_rows(&self, rows: usize) -> Result<RowSpan, GpuError> {
        let all = self.rows();
        if rows > all {
            return Err(GpuError::Shape(format!("{rows} rows of a span of {all}")));
        }
        Ok(RowSpan {
            floats: rows * self.dim,
            state_floats: self.state_floats / all.max(1) * rows,
            ..*self
        })
    }
}

/// The device address of a buffer, for the raw copies ([`Transfer::upload_raw`]). Event
/// tracking is off (see `Gpu::new`): the guard records nothing.
pub fn addr<T>(s: &CudaSlice<T>) -> CUdeviceptr {
    let (p, _guard) = s.device_ptr(s.stream());
    p
}

impl Transfer {
    /// A transfer stream on `gpu` with two pinned chunks of `chunk_bytes`.
    pub fn new(gpu: &Gpu, chunk_bytes: usize) -> Result<Transfer, GpuError> {
        let ctx = gpu.context();
        let stream = ctx.new_stream().during("creating a transfer stream")?;
        let chunk = chunk_bytes.max(4096);
        let pinned = || {
            // SAFETY: bytes need no initialisation. Flags 0, not write-combined: the host reads
            // downloaded data from these chunks, which write-combined memory makes slow.
            unsafe { ctx.alloc_pinned_with_flags::<u8>(chunk, 0) }
                .during("allocating pinned staging memory")
        };
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
                .during("creating a transfer event")
        };
        Ok(Transfer {
            compute: gpu.stream().clone(),
            init_kernel: gpu.kernels.init_rows.clone(),
            stream,
            stage: [pinned()?, pinned()?],
            done: [event()?, event()?],
        })
    }

    /// The transfer stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copies queued after this call wait for `event`.
    pub fn wait(&self, event: &CudaEvent) -> Result<(), GpuError> {
        self.stream
            .wait(event)
            .during("ordering the transfer stream after an event")
    }

    /// An event recorded on the transfer stream now: it completes when the copies queued so far
    /// have run.
    pub fn record(&self) -> Result<CudaEvent, GpuError> {
        record_on(&self.stream)
    }

    /// Copies queued after this call wait for the work queued so far on the compute stream.
    fn after_compute(&self) -> Result<(), GpuError> {
        self.wait(&record_on(&self.compute)?)
    }

    /// Compute work queued after this call waits for the copies queued so far.
    fn before_compute(&self) -> Result<(), GpuError> {
        self.compute
            .wait(&self.record()?)
            .during("ordering compute after the transfer stream")
    }

    /// Queues the copy of `src` into the device bytes at `dst` and returns once `src` has been
    /// staged (the caller may reuse it); the last chunks may still be on their way.
    ///
    /// # Safety
    /// `dst .. dst + size_of_val(src)` must be device memory that stays allocated until the
    /// copies have run, and that no work unordered with the transfer stream uses meanwhile.
    pub unsafe fn upload_raw<T: bytemuck::Pod>(
        &mut self,
        src: &[T],
        dst: CUdeviceptr,
    ) -> Result<(), GpuError> {
        let src: &[u8] = bytemuck::cast_slice(src);
        let mut from_src = |at: usize, stage: &mut [u8]| {
            copy(stage, &src[at..at + stage.len()]);
            Ok(())
        };
        // SAFETY: this function's contract.
        unsafe { self.upload_filled_raw(src.len(), dst, &mut from_src) }
    }

    /// Queues the copy of `bytes` bytes that `fill` writes into the staging chunks, one chunk
    /// after the other, into the device bytes at `dst`: each chunk's DMA runs while `fill`
    /// writes the next. Returns once the last chunk is staged, or with `fill`'s first error
    /// (the chunks before it still on their way).
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be device memory that stays allocated until the copies have
    /// run, and that no work unordered with the transfer stream uses meanwhile.
    unsafe fn upload_filled_raw<E: From<GpuError>>(
        &mut self,
        bytes: usize,
        dst: CUdeviceptr,
        fill: Fill<'_, E>,
    ) -> Result<(), E> {
        self.bind()?;
        let chunk = self.stage[0].len();
        for (c, at) in (0..bytes).step_by(chunk).enumerate() {
            let len = chunk.min(bytes - at);
            let i = c % 2;
            // The chunk's previous DMA must have read it before the host overwrites it.
            self.done[i]
                .synchronize()
                .during("waiting for a staging chunk")?;
            let stage = self.stage[i]
                .as_mut_slice()
                .during("mapping a staging chunk")?;
            fill(at, &mut stage[..len])?;
            // SAFETY: the staged bytes stay untouched until `done[i]` completes (waited for
            // above before every reuse); the destination is valid by the caller's contract.
            unsafe {
                result::memcpy_htod_async(dst + at as u64, &stage[..len], self.stream.cu_stream())
            }
            .during("copying a staging chunk to the device")?;
            self.done[i]
                .record(&self.stream)
                .during("recording a staging event")?;
        }
        Ok(())
    }

    /// Copies the device bytes at `src` into `dst`; returns when `dst` holds them.
    ///
    /// # Safety
    /// `src .. src + size_of_val(dst)` must be device memory that stays allocated until the
    /// call returns, and that no work unordered with the transfer stream writes meanwhile.
    pub unsafe fn download_raw<T: bytemuck::Pod>(
        &mut self,
        src: CUdeviceptr,
        dst: &mut [T],
    ) -> Result<(), GpuError> {
        let dst: &mut [u8] = bytemuck::cast_slice_mut(dst);
        self.bind()?;
        let chunk = self.stage[0].len();
        let total = dst.len();
        let chunks = total.div_ceil(chunk);
        let len = |c: usize| chunk.min(total - c * chunk);
        for c in 0..chunks.min(2) {
            // SAFETY: as this function's contract.
            unsafe { self.queue_download(src, c, len(c)) }?;
        }
        for c in 0..chunks {
            let i = c % 2;
            self.done[i]
                .synchronize()
                .during("waiting for a staging chunk")?;
            let stage = self.stage[i].as_slice().during("mapping a staging chunk")?;
            copy(&mut dst[c * chunk..c * chunk + len(c)], &stage[..len(c)]);
            if c + 2 < chunks {
                // SAFETY: as this function's contract.
                unsafe { self.queue_download(src, c + 2, len(c + 2)) }?;
            }
        }
        Ok(())
    }

    /// Queues the DMA of chunk `c` (`len` bytes) of `src` into staging chunk `c % 2`, whose
    /// previous contents the host has consumed.
    ///
    /// # Safety
    /// As [`Transfer::download_raw`].
    unsafe fn queue_download(
        &mut self,
        src: CUdeviceptr,
        c: usize,
        len: usize,
    ) -> Result<(), GpuError> {
        let i = c % 2;
        let chunk = self.stage[0].len();
        self.done[i]
            .synchronize()
            .during("waiting for a staging chunk")?;
        let stage = self.stage[i]
            .as_mut_slice()
            .during("mapping a staging chunk")?;
        // SAFETY: the host reads the chunk only after `done[i]` completes; the source is valid
        // by the caller's contract.
        unsafe {
            result::memcpy_dtoh_async(
                &mut stage[..len],
                src + (c * chunk) as u64,
                self.stream.cu_stream(),
            )
        }
        .during("copying device memory into a staging chunk")?;
        self.done[i]
            .record(&self.stream)
            .during("recording a staging event")
    }

    /// Queues the copy of `emb` and `state` into the rows of `span` (see
    /// [`Transfer::upload_raw`]).
    ///
    /// # Safety
    /// The table `span` came from must stay allocated until the copies have run, and no work
    /// unordered with the transfer stream may use those rows meanwhile.
    pub unsafe fn upload_span(
        &mut self,
        emb: &[f32],
        state: &[f32],
        span: &RowSpan,
    ) -> Result<(), GpuError> {
        check_span(emb.len(), state.len(), span)?;
        // SAFETY: the span's rows, by the caller's contract.
        unsafe {
            self.upload_raw(emb, span.emb)?;
            self.upload_raw(state, span.state)
        }
    }

    /// Copies the rows of `span` into `emb` and `state`; returns when they hold them.
    ///
    /// # Safety
    /// The table `span` came from must stay allocated until the call returns, and no work
    /// unordered with the transfer stream may write those rows meanwhile.
    pub unsafe fn download_span(
        &mut self,
        span: &RowSpan,
        emb: &mut [f32],
        state: &mut [f32],
    ) -> Result<(), GpuError> {
        check_span(emb.len(), state.len(), span)?;
        // SAFETY: the span's rows, by the caller's contract.
        unsafe {
            self.download_raw(span.emb, emb)?;
            self.download_raw(span.state, state)
        }
    }

    /// Copies `src` into the start of `dst` after the compute work queued so far and the
    /// events passed to [`Transfer::wait`]; compute work queued later waits for it. Returns
    /// once `src` is staged.
    pub fn upload<T: bytemuck::Pod>(
        &mut self,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), GpuError> {
        self.after_compute()?;
        self.upload_unordered(src, dst)
    }

    /// Copies `bytes` bytes that `fill` writes into the staging chunks into the start of
    /// `dst`, ordered like [`Transfer::upload`]: a source read straight into pinned memory (a
    /// table's file), each chunk's DMA running while the next chunk is read, so that a file
    /// read from the disk is read once, at the disk's rate, and not first into memory of its
    /// own.
    pub fn upload_filled<T: bytemuck::Pod, E: From<GpuError>>(
        &mut self,
        dst: &mut CudaSlice<T>,
        bytes: usize,
        fill: Fill<'_, E>,
    ) -> Result<(), E> {
        let room = dst.len() * size_of::<T>();
        if bytes > room {
            return Err(GpuError::Shape(format!(
                "uploading {bytes} bytes into a buffer of {room}"
            ))
            .into());
        }
        self.after_compute()?;
        // SAFETY: `dst` holds at least `bytes`; it is freed stream-ordered on the compute
        // stream, which waits for these copies (below) before anything queued later.
        let filled = unsafe { self.upload_filled_raw(bytes, addr(dst), fill) };
        // Also after a failed fill: the chunks queued before it must land before `dst` is
        // used or freed.
        self.before_compute()?;
        filled
    }

    /// Like [`Transfer::upload`], but not after the compute work queued so far: only after the
    /// events passed to [`Transfer::wait`] (for a buffer the caller knows compute is done with).
    pub fn upload_unordered<T: bytemuck::Pod>(
        &mut self,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), GpuError> {
        if src.len() > dst.len() {
            return Err(GpuError::Shape(format!(
                "uploading {} elements into a buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        // SAFETY: `dst` is at least as long as `src`; it is freed stream-ordered on the compute
        // stream, which waits for these copies (below) before anything queued later.
        unsafe { self.upload_raw(src, addr(dst)) }?;
        self.before_compute()
    }

    /// Copies `emb` and `state` into `span`'s rows after the compute work queued so far;
    /// compute work queued later waits for them. Returns once the host data is staged.
    pub fn upload_rows(
        &mut self,
        table: &mut crate::DeviceTable,
        row0: usize,
        emb: &[f32],
        state: &[f32],
    ) -> Result<(), GpuError> {
        let span = table.row_span(row0, emb.len() / table.dim())?;
        self.after_compute()?;
        // SAFETY: the table is borrowed mutably for the call and freed stream-ordered on the
        // compute stream, which waits for the copies (below); compute work queued before them
        // runs first (above).
        unsafe { self.upload_span(emb, state, &span) }?;
        self.before_compute()
    }

    /// Draws node rows `first_id..first_id + rows` as legend-model's `fill_row` does (`init`'s
    /// seed and node distribution) into `table`'s rows from `row0`, with zero optimizer state,
    /// ordered like [`Transfer::upload_rows`]: after the compute work queued so far and the
    /// copies before it, before the compute work queued later. A partition that was never
    /// written starts here instead of being drawn on the host and uploaded.
    pub fn init_rows(
        &mut self,
        table: &mut crate::DeviceTable,
        row0: usize,
        first_id: u64,
        rows: usize,
        init: &legend_model::Init,
    ) -> Result<(), GpuError> {
        let span = table.row_span(row0, rows)?;
        self.after_compute()?;
        // SAFETY: the table is borrowed mutably for the call and freed stream-ordered after
        // this stream's work (the compute stream waits for it, below).
        unsafe { self.init_span(&span, first_id, init) }?;
        self.before_compute()
    }

    /// Queues the drawing of the node rows `first_id ..` that fill `span`, as
    /// [`Transfer::init_rows`] does, with no ordering against the compute stream: a swap's
    /// never-written partition, drawn into its slot.
    ///
    /// # Safety
    /// The table `span` came from must stay allocated until the kernels have run, and no work
    /// unordered with the transfer stream may use those rows meanwhile.
    pub unsafe fn init_span(
        &mut self,
        span: &RowSpan,
        first_id: u64,
        init: &legend_model::Init,
    ) -> Result<(), GpuError> {
        let (rows, dim) = (span.rows(), span.dim);
        let (tag, normal, scale) = crate::engine::init_params(legend_model::Table::Node, init.node);
        let rows32 = u32::try_from(rows)
            .map_err(|_| GpuError::Shape(format!("{rows} rows in one launch")))?;
        let mut b = self.stream.launch_builder(&self.init_kernel);
        let normal = i32::from(normal);
        let dim32 = dim as u32;
        let dtype = crate::kernel_abi::dtype_code(init.node_dtype);
        b.arg(&span.emb)
            .arg(&first_id)
            .arg(&rows32)
            .arg(&dim32)
            .arg(&init.seed)
            .arg(&tag)
            .arg(&normal)
            .arg(&scale)
            .arg(&dtype);
        // SAFETY: the kernel writes the span's rows × dim floats, which the caller keeps
        // allocated and to itself.
        unsafe { b.launch(crate::gpu::grid_1d(span.floats as u64)?) }
            .during("launching legend_init_rows")?;
        // SAFETY: as above, for the state half of the span.
        unsafe {
            result::memset_d8_async(
                span.state,
                0,
                span.state_floats * size_of::<f32>(),
                self.stream.cu_stream(),
            )
        }
        .during("zeroing the optimizer state")
    }

    /// Copies rows from `row0` on into `emb` and `state`, after the compute work queued so
    /// far; returns when they hold them.
    pub fn download_rows(
        &mut self,
        table: &crate::DeviceTable,
        row0: usize,
        emb: &mut [f32],
        state: &mut [f32],
    ) -> Result<(), GpuError> {
        let span = table.row_span(row0, emb.len() / table.dim())?;
        self.after_compute()?;
        // SAFETY: the table is borrowed for the call, which returns after the copies ran, and
        // the compute work that writes it was queued before them (above).
        unsafe { self.download_span(&span, emb, state) }
    }

    fn bind(&self) -> Result<(), GpuError> {
        self.stream
            .context()
            .bind_to_thread()
            .during("making the context current on this thread")
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // The staging chunks are freed next: no DMA may still use them.
        let _ = self.stream.synchronize();
    }
}

fn record_on(stream: &CudaStream) -> Result<CudaEvent, GpuError> {
    let ev = stream
        .context()
        .new_event(None)
        .during("creating an ordering event")?;
    ev.record(stream).during("recording an ordering event")?;
    Ok(ev)
}

fn check_span(emb: usize, state: usize, span: &RowSpan) -> Result<(), GpuError> {
    if emb != span.floats || state != span.state_floats {
        return Err(GpuError::Shape(format!(
            "{emb} floats of embeddings and {state} of state for a span of {} and {}",
            span.floats, span.state_floats
        )));
    }
    Ok(())
}
