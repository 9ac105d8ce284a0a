//! GPU-initiated NVMe I/O: the I/O kernels of `kernels/nvme_io.cu` driving queue pairs of a
//! [`Controller`] (an SSD bound to `legend_nvme`, or the userspace proxy) between GPU memory and
//! a namespace, on a stream of their own so that they run beside training.
//!
//! [`GpuIo::open`] creates one queue pair per thread block. Its rings and PRP list pages live
//! in GPU memory for a real controller (which reads and writes them peer to peer) or in pinned
//! host memory mapped into the GPU for the proxy (whose thread reads them); the doorbells are
//! registered with CUDA so the blocks can ring them. [`GpuIo::map`] makes GPU memory reachable
//! by the controller; [`GpuIo::run`] moves transfers with one launch and checks every block's
//! report: a failed command comes back with its LBA and decoded status, a controller that stops
//! answering with the queue's state, after the queue pairs were deleted (which waits for or
//! aborts what they held), so no command can outlive the call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg, ValidAsZeroBits, result, sys,
};
use legend_nvme::{Controller, DeviceMemory, Doorbells, Mapping, uapi};
use legend_nvme_protocol::{CommandError, MAX_DEPTH, QueueLayout, Sqe, Status, max_command_bytes};

use crate::error::DriverContext;
use crate::{Gpu, GpuError};

mod row_cache;

pub use row_cache::{CacheStats, CachedTable, RowCache, RowCacheOptions};

/// `LegendIoQueue` of `kernels/nvme_io.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IoQueue {
    sq: u64,
    cq: u64,
    sq_doorbell: u64,
    cq_doorbell: u64,
    lists: u64,
    lists_bus: u64,
    depth: u32,
    qid: u32,
    sq_tail: u32,
    cq_head: u32,
    phase: u32,
    pad: u32,
    staging: u64,
    staging_pages: u64,
    staging_first: u64,
    staging_bytes: u32,
    staging_page_shift: u32,
}

/// `LegendIoJob`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IoJob {
    pages: u64,
    offset: u64,
    bytes: u64,
    lba: u64,
    command_bytes: u64,
    first_command: u64,
    device: u64,
    page_shift: u32,
    opcode: u32,
    nsid: u32,
    lba_shift: u32,
}

/// `LegendIoResult`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IoResult {
    kind: u32,
    status: u32,
    lba: u64,
    opcode: u32,
    blocks: u32,
    sq_tail: u32,
    cq_head: u32,
    phase: u32,
    in_flight: u32,
    last_cqe: [u32; 4],
    completed: u64,
}

// SAFETY: plain `repr(C)` structs of integers, laid out as their CUDA twins.
unsafe impl DeviceRepr for IoQueue {}
// SAFETY: as above.
unsafe impl DeviceRepr for IoJob {}
// SAFETY: as above.
unsafe impl DeviceRepr for IoResult {}
// SAFETY: all-zero is a report of nothing done.
unsafe impl ValidAsZeroBits for IoResult {}

/// Where the queue pairs' rings and PRP lists live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingPlacement {
    /// Pinned host memory mapped into the GPU: what the proxy controller's thread reads.
    Host,
    /// GPU memory: what a real controller reads and writes peer to peer.
    Device,
}

/// How [`GpuIo::open`] sets the queues up.
#[derive(Clone, Debug)]
pub struct GpuIoOptions {
    /// Queue pairs, one per thread block (the paper: 8).
    pub queues: u32,
    /// Threads a block: commands a batch (the paper: 512).
    pub threads: u32,
    /// Namespace.
    pub namespace: u32,
    /// Where the rings live.
    pub placement: RingPlacement,
    /// How long a block waits for a completion before it stops and reports.
    pub timeout: Duration,
    /// Bytes of a staging slot, one a queue entry, in pinned host memory the GPU maps (0:
    /// none; a multiple of the LBA size, at most the largest command). A command of at most
    /// this many bytes names its slot rather than GPU memory, and the I/O kernels copy its data
    /// in (a Write) or out (a Read) themselves: for the proxy controller, which reaches host
    /// memory with a `memcpy` but GPU memory only with one CUDA copy a command (~80 k
    /// commands/s in all, whatever the queue depth), this is what makes small reads fast.
    pub staging: u32,
}

impl Default for GpuIoOptions {
    fn default() -> Self {
        GpuIoOptions {
            queues: 8,
            threads: 256,
            namespace: 1,
            placement: RingPlacement::Host,
            timeout: Duration::from_secs(10),
            staging: 0,
        }
    }
}

/// One transfer of a [`GpuIo::run`]: `bytes` between byte `offset` of mapped region `region`
/// and the namespace from byte `at` (both multiples of the LBA size).
#[derive(Clone, Copy, Debug)]
pub struct GpuIoJob {
    /// The region, as [`GpuIo::map`] returned it.
    pub region: usize,
    /// First byte in the region.
    pub offset: u64,
    /// Bytes.
    pub bytes: u64,
    /// First byte in the namespace.
    pub at: u64,
    /// Write (GPU memory to the namespace) rather than read.
    pub write: bool,
}

/// What a [`GpuIo::run`] did.
#[derive(Clone, Debug, Default)]
pub struct IoRun {
    /// Commands completed.
    pub commands: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Launch to completion.
    pub seconds: f64,
    /// Each command's submission-to-completion time (when asked for).
    pub latencies_ns: Vec<u64>,
}

/// Pinned host memory mapped into the GPU, freed on drop.
struct Pinned {
    host: *mut u8,
    device: u64,
    len: usize,
}

// SAFETY: plain memory, shared by the host threads, the GPU and the controller.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned, GpuError> {
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
struct Registered {
    host: *mut u8,
    device: u64,
}

// SAFETY: the registration is process-wide; the pointer is only handed back to CUDA.
unsafe impl Send for Registered {}

impl Registered {
    fn new(host: *mut u8, len: usize, io_memory: bool) -> Result<Registered, GpuError> {
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

/// The queue pairs' memory.
enum Rings {
    Host(Pinned),
    /// GPU memory (raw, 64 KiB aligned inside the allocation at `base`).
    Device {
        base: u64,
        aligned: u64,
        len: usize,
    },
}

impl Rings {
    /// Device address of byte `at`.
    fn device(&self, at: usize) -> u64 {
        match self {
            Rings::Host(p) => p.device + at as u64,
            Rings::Device { aligned, .. } => aligned + at as u64,
        }
    }
}

impl Drop for Rings {
    fn drop(&mut self) {
        if let Rings::Device { base, .. } = self {
            // SAFETY: allocated with `malloc_sync`; the queue pairs are gone.
            let _ = unsafe { result::free_sync(*base) };
        }
    }
}

/// The queues' staging slots: pinned host memory, mapped for the controller, with its page
/// table on the device.
struct Staging {
    mapping: Mapping,
    // Kept while the queues may name them.
    _memory: Pinned,
    _pages: CudaSlice<u64>,
}

/// A region of GPU memory the controller can reach, with its page table on the device.
struct Region {
    /// Device address of its byte 0.
    start: u64,
    len: u64,
    mapping: Mapping,
    pages: CudaSlice<u64>,
    /// The memory, when this object allocated it ([`GpuIo::alloc`]): freed after the unmap.
    owned: Option<(CudaSlice<u8>, usize)>,
}

/// Queue pairs driven by GPU thread blocks.
pub struct GpuIo {
    ctrl: Arc<dyn Controller>,
    stream: Arc<CudaStream>,
    kernel: CudaFunction,
    /// `legend_row_cache_lookup`, for a [`RowCache`] over these queues.
    cache_kernel: CudaFunction,
    opts: GpuIoOptions,
    qids: Vec<u32>,
    depth: u16,
    lba_shift: u32,
    blocks: u64,
    max_command: u64,
    queues: CudaSlice<IoQueue>,
    results: CudaSlice<IoResult>,
    regions: Vec<Region>,
    rings_map: Mapping,
    /// The GPU's count of I/O blocks running (its persistent kernels leave them room).
    io_blocks: Arc<AtomicUsize>,
    // Dropped after the queue pairs are deleted (in `Drop`): registrations, then memory.
    _doorbells_gpu: Registered,
    _doorbells: Doorbells,
    _rings: Rings,
    staging: Option<Staging>,
    broken: Option<String>,
}

/// Counts a launch's blocks in the GPU's I/O block count while it lives.
struct BlocksRunning {
    count: Arc<AtomicUsize>,
    blocks: usize,
}

impl BlocksRunning {
    fn new(count: &Arc<AtomicUsize>, blocks: usize) -> Self {
        count.fetch_add(blocks, Ordering::Relaxed);
        BlocksRunning {
            count: count.clone(),
            blocks,
        }
    }
}

impl Drop for BlocksRunning {
    fn drop(&mut self) {
        self.count.fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

impl GpuIo {
    /// Opens `opts.queues` queue pairs of the controller for I/O kernels on `gpu`.
    ///
    /// # Errors
    ///
    /// [`GpuError::Nvme`] when the controller refuses (no such namespace, not enough queue
    /// pairs, a queue too deep for its limit); driver errors.
    pub fn open(
        gpu: &Gpu,
        ctrl: Arc<dyn Controller>,
        opts: &GpuIoOptions,
    ) -> Result<GpuIo, GpuError> {
        let label = ctrl.label().to_string();
        let nvme = |what: &'static str| {
            let label = label.clone();
            move |source: legend_nvme::Error| GpuError::Nvme {
                label: label.clone(),
                what: format!("{what}: {source}"),
            }
        };
        let refuse = |what: String| GpuError::Nvme {
            label: label.clone(),
            what,
        };
        let info = ctrl.info().map_err(nvme("INFO"))?;
        let ns = info.namespaces[..info.num_namespaces as usize]
            .iter()
            .find(|n| n.nsid == opts.namespace)
            .ok_or_else(|| refuse(format!("no namespace {}", opts.namespace)))?;
        // Two batches of `threads` in flight, and the slot the tail may not catch up with.
        let want = 2 * opts.threads + 1;
        let limit = info.max_queue_entries.min(u32::from(MAX_DEPTH));
        if opts.threads == 0 || opts.threads > 1024 || want > limit {
            return Err(refuse(format!(
                "{} threads a block need queues of {want} entries; the controller allows {limit}",
                opts.threads
            )));
        }
        if opts.queues == 0 || opts.queues > info.queue_pairs {
            return Err(refuse(format!(
                "{} queue pairs asked for; the controller offers {}",
                opts.queues, info.queue_pairs
            )));
        }
        let depth = want as u16;
        let max_command = max_command_bytes(info.max_transfer, ns.lba_shift);
        if opts.staging != 0
            && (!u64::from(opts.staging).is_multiple_of(1 << ns.lba_shift)
                || u64::from(opts.staging) > max_command)
        {
            return Err(refuse(format!(
                "staging slots of {} bytes: not a multiple of the {}-byte LBA, or above the \
                 largest command ({max_command} bytes)",
                opts.staging,
                1u64 << ns.lba_shift
            )));
        }
        let layout = QueueLayout::new(depth);
        let per_queue = layout.bytes();
        let total = (per_queue * opts.queues as usize).next_multiple_of(1 << 16);
        let ctx = gpu.context();
        ctx.bind_to_thread().during("binding the context")?;
        let rings = match opts.placement {
            RingPlacement::Host => Rings::Host(Pinned::new(ctx, total)?),
            RingPlacement::Device => {
                // SAFETY: raw device memory, zeroed below.
                let base = unsafe { result::malloc_sync(total + (1 << 16)) }
                    .during("allocating queue memory on the GPU")?;
                let aligned = base.next_multiple_of(1 << 16);
                // SAFETY: inside the allocation.
                unsafe { result::memset_d8_sync(aligned, 0, total) }
                    .during("clearing queue memory")?;
                Rings::Device {
                    base,
                    aligned,
                    len: total,
                }
            }
        };
        // SAFETY: the ring memory lives in the result until after the queue pairs are deleted.
        let rings_map = unsafe {
            match &rings {
                Rings::Host(p) => ctrl.map_host(p.host, p.len),
                Rings::Device { aligned, len, .. } => ctrl.map_gpu(*aligned, *len),
            }
        }
        .map_err(nvme("MAP of the queue memory"))?;
        let doorbells = ctrl.doorbells().map_err(nvme("doorbells"))?;
        let doorbells_gpu = Registered::new(
            doorbells.as_ptr(),
            doorbells.len(),
            opts.placement == RingPlacement::Device,
        )?;
        let mut qids = Vec::new();
        let mut queues = Vec::new();
        let mut qid = 1;
        while qids.len() < opts.queues as usize {
            if qid > info.queue_pairs {
                undo_open(ctrl.as_ref(), &qids, &rings_map);
                return Err(refuse(format!(
                    "not {} free queue pairs among {}",
                    opts.queues, info.queue_pairs
                )));
            }
            let base = qids.len() * per_queue;
            let (cq_at, lists_at) = (base + layout.cq_offset(), base + layout.list_offset(0));
            let args = uapi::QueuePairArgs {
                qid,
                depth: u32::from(depth),
                sq_handle: rings_map.handle,
                cq_handle: rings_map.handle,
                sq_offset: base as u64,
                cq_offset: cq_at as u64,
                ..Default::default()
            };
            match ctrl.create_queue_pair(args) {
                Ok(q) => {
                    qids.push(qid);
                    queues.push(IoQueue {
                        sq: rings.device(base),
                        cq: rings.device(cq_at),
                        sq_doorbell: doorbells_gpu.device + u64::from(q.sq_doorbell),
                        cq_doorbell: doorbells_gpu.device + u64::from(q.cq_doorbell),
                        lists: rings.device(lists_at),
                        lists_bus: rings_map.bus(lists_at),
                        depth: u32::from(depth),
                        qid,
                        phase: 1,
                        ..IoQueue::default()
                    });
                }
                Err(legend_nvme::Error::Ioctl { ref source, .. })
                    if source.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    undo_open(ctrl.as_ref(), &qids, &rings_map);
                    return Err(nvme("CREATE_QUEUE_PAIR")(e));
                }
            }
            qid += 1;
        }
        let stream = ctx.new_stream().during("creating the I/O stream");
        let staging = stream.and_then(|stream| {
            let staging = match opts.staging {
                0 => None,
                bytes => Some(Staging::new(
                    ctx,
                    &stream,
                    ctrl.as_ref(),
                    &mut queues,
                    usize::from(depth),
                    bytes,
                )?),
            };
            Ok((stream, staging))
        });
        let (stream, staging) =
            staging.inspect_err(|_| undo_open(ctrl.as_ref(), &qids, &rings_map))?;
        let queues_dev = stream.clone_htod(&queues).during("uploading the queues")?;
        let results = stream
            .alloc_zeros::<IoResult>(queues.len())
            .during("allocating the I/O reports")?;
        tracing::debug!(label = %label, queues = qids.len(), depth, "GPU I/O queues open");
        Ok(GpuIo {
            ctrl,
            stream,
            kernel: gpu.kernels.nvme_io.clone(),
            cache_kernel: gpu.kernels.row_cache_lookup.clone(),
            opts: opts.clone(),
            qids,
            depth,
            lba_shift: ns.lba_shift,
            blocks: ns.blocks,
            max_command,
            queues: queues_dev,
            results,
            regions: Vec::new(),
            rings_map,
            io_blocks: gpu.io_blocks().clone(),
            _doorbells_gpu: doorbells_gpu,
            _doorbells: doorbells,
            _rings: rings,
            staging,
            broken: None,
        })
    }

    /// The namespace's LBA size.
    pub fn block_size(&self) -> u64 {
        1 << self.lba_shift
    }

    /// The namespace's size in bytes.
    pub fn namespace_bytes(&self) -> u64 {
        self.blocks << self.lba_shift
    }

    /// Queue depth.
    pub fn depth(&self) -> u16 {
        self.depth
    }

    /// The I/O stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes `len` bytes of GPU memory at `ptr` (64 KiB aligned) reachable by the controller;
    /// returns the region's index for [`GpuIoJob::region`].
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until this object is dropped.
    ///
    /// # Errors
    ///
    /// [`GpuError::Nvme`] when the controller refuses the mapping.
    pub unsafe fn map(&mut self, ptr: u64, len: usize) -> Result<usize, GpuError> {
        // SAFETY: the caller's contract.
        let mapping = unsafe { self.ctrl.map_gpu(ptr, len) }.map_err(|e| GpuError::Nvme {
            label: self.ctrl.label().to_string(),
            what: format!("MAP of {len} bytes of GPU memory: {e}"),
        })?;
        let pages = self
            .stream
            .clone_htod(&mapping.bus_addrs)
            .during("uploading a page table")?;
        self.regions.push(Region {
            start: ptr,
            len: len as u64,
            mapping,
            pages,
            owned: None,
        });
        Ok(self.regions.len() - 1)
    }

    /// Allocates `len` bytes of GPU memory (64 KiB aligned) that the controller can reach;
    /// returns the region's index. The memory lives as long as this object.
    ///
    /// # Errors
    ///
    /// Driver errors, or the controller refusing the mapping.
    pub fn alloc(&mut self, gpu: &Gpu, len: usize) -> Result<usize, GpuError> {
        let align = uapi::GPU_PAGE_SIZE as usize;
        let len = len.next_multiple_of(align);
        let buf = gpu.zeros::<u8>(len + align)?;
        let base = self.addr(&buf);
        let skip = (base.next_multiple_of(align as u64) - base) as usize;
        // SAFETY: the range lies in `buf`, which the region keeps until after the unmap.
        let region = unsafe { self.map(base + skip as u64, len) }?;
        self.regions[region].owned = Some((buf, skip));
        Ok(region)
    }

    /// The bytes of region `region` (one this object allocated).
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for a region it did not allocate; driver errors.
    pub fn download(&self, region: usize) -> Result<Vec<u8>, GpuError> {
        let r = self
            .regions
            .get(region)
            .ok_or_else(|| GpuError::Shape(format!("no region {region}")))?;
        let (buf, skip) = r.owned.as_ref().ok_or_else(|| {
            GpuError::Shape(format!("region {region} was mapped, not allocated, here"))
        })?;
        let all = self.stream.clone_dtoh(buf).during("downloading a region")?;
        Ok(all[*skip..*skip + r.len as usize].to_vec())
    }

    /// Moves `jobs` with one launch of the I/O kernels and waits for it; `latencies` also
    /// returns each command's submission-to-completion time.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for a job outside its region or the namespace, or not aligned to
    /// the LBA size; [`GpuError::NvmeCommand`] for a command the controller failed (its LBA
    /// and decoded status); [`GpuError::NvmeTimeout`] when a queue stopped answering (the queue
    /// pairs are then deleted, and every later call fails the same way).
    pub fn run(&mut self, jobs: &[GpuIoJob], latencies: bool) -> Result<IoRun, GpuError> {
        if let Some(why) = &self.broken {
            return Err(GpuError::NvmeTimeout {
                label: self.ctrl.label().to_string(),
                state: why.clone(),
            });
        }
        let block = self.block_size();
        let mut kernel_jobs = Vec::with_capacity(jobs.len());
        let mut commands = 0u64;
        let mut bytes = 0u64;
        for j in jobs {
            let region = self
                .regions
                .get(j.region)
                .ok_or_else(|| GpuError::Shape(format!("no mapped region {}", j.region)))?;
            if j.bytes == 0
                || j.bytes % block != 0
                || j.at % block != 0
                || j.offset % 4 != 0
                || j.offset + j.bytes > region.len
                || j.at + j.bytes > self.namespace_bytes()
            {
                return Err(GpuError::Shape(format!(
                    "transfer of {} bytes from byte {} of region {} to byte {} of the \
                     namespace: outside either, or not aligned to the {block}-byte LBA",
                    j.bytes, j.offset, j.region, j.at
                )));
            }
            let page_shift = region.mapping.page_size.trailing_zeros();
            kernel_jobs.push(IoJob {
                pages: self.addr(&region.pages),
                device: region.start,
                offset: j.offset,
                bytes: j.bytes,
                lba: j.at >> self.lba_shift,
                command_bytes: self.max_command,
                first_command: commands,
                page_shift,
                opcode: if j.write { 1 } else { 2 },
                nsid: self.opts.namespace,
                lba_shift: self.lba_shift,
            });
            commands += j.bytes.div_ceil(self.max_command);
            bytes += j.bytes;
        }
        if commands == 0 {
            return Ok(IoRun::default());
        }
        let jobs_dev = self
            .stream
            .clone_htod(&kernel_jobs)
            .during("uploading the I/O jobs")?;
        let lat = if latencies {
            Some(
                self.stream
                    .alloc_zeros::<u64>(commands as usize)
                    .during("allocating the latency record")?,
            )
        } else {
            None
        };
        let njobs = kernel_jobs.len() as u32;
        let timeout = self.opts.timeout.as_nanos() as u64;
        let cfg = LaunchConfig {
            grid_dim: (self.qids.len() as u32, 1, 1),
            block_dim: (self.opts.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let start = Instant::now();
        let running = BlocksRunning::new(&self.io_blocks, self.qids.len());
        let mut b = self.stream.launch_builder(&self.kernel);
        b.arg(&mut self.queues)
            .arg(&jobs_dev)
            .arg(&njobs)
            .arg(&commands)
            .arg(&mut self.results)
            .arg(&timeout);
        let null = 0u64;
        match &lat {
            Some(l) => b.arg(l),
            None => b.arg(&null),
        };
        // SAFETY: the queues, jobs, page tables and regions are live device memory of the
        // sizes the kernel indexes (checked above), and the controller's rings and doorbells
        // stay mapped while this object lives.
        unsafe { b.launch(cfg) }.during("launching legend_nvme_io")?;
        self.stream
            .synchronize()
            .during("waiting for the I/O kernels")?;
        drop(running);
        let seconds = start.elapsed().as_secs_f64();
        let reports = self
            .stream
            .clone_dtoh(&self.results)
            .during("reading the I/O reports")?;
        self.check(&reports)?;
        let latencies_ns = match lat {
            Some(l) => self.stream.clone_dtoh(&l).during("reading latencies")?,
            None => Vec::new(),
        };
        Ok(IoRun {
            commands,
            bytes,
            seconds,
            latencies_ns,
        })
    }

    /// The device address of `s` (the engine runs with cudarc's event tracking off).
    fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _guard) = s.device_ptr(&self.stream);
        p
    }

    /// The device address of byte 0 of region `region`.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for an unknown region.
    pub fn region_addr(&self, region: usize) -> Result<u64, GpuError> {
        let r = self
            .regions
            .get(region)
            .ok_or_else(|| GpuError::Shape(format!("no region {region}")))?;
        Ok(r.start)
    }

    /// Queues a copy of `bytes` from device address `src` to `dst` on the I/O stream (before
    /// the next [`GpuIo::run`]'s kernels, after the previous ones).
    ///
    /// # Safety
    ///
    /// Both ranges must be live device memory that nothing else writes meanwhile.
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: the caller's contract.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .during("copying on the I/O stream")
    }

    /// Makes the I/O stream wait for `event` (compute that must finish first).
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn wait(&self, event: &CudaEvent) -> Result<(), GpuError> {
        self.stream.wait(event).during("ordering the I/O stream")
    }

    /// An event that completes when the I/O stream's work so far has run.
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn record(&self) -> Result<CudaEvent, GpuError> {
        self.stream
            .record_event(None)
            .during("recording an I/O event")
    }

    /// Waits until the I/O stream's work has run.
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .during("waiting for the I/O stream")
    }

    /// Turns the blocks' reports into the first failure, if any.
    fn check(&mut self, reports: &[IoResult]) -> Result<(), GpuError> {
        let label = self.ctrl.label().to_string();
        if let Some((b, r)) = reports.iter().enumerate().find(|(_, r)| r.kind == 2) {
            let state = format!(
                "block {b} (qid {}) saw no completion for {:.1} s: SQ tail {}, CQ head {} \
                 (phase {}), {} commands in flight, {} completed; last CQE {:08x?}",
                self.qids[b],
                self.opts.timeout.as_secs_f64(),
                r.sq_tail,
                r.cq_head,
                r.phase,
                r.in_flight,
                r.completed,
                r.last_cqe
            );
            // Nothing the queues still hold may reach memory after this returns.
            for &q in &self.qids {
                if let Err(e) = self.ctrl.delete_queue_pair(q) {
                    tracing::error!(
                        error = &e as &dyn std::error::Error,
                        "deleting stuck GPU queue pair {q}"
                    );
                }
            }
            self.broken = Some(state.clone());
            return Err(GpuError::NvmeTimeout { label, state });
        }
        if let Some(r) = reports.iter().find(|r| r.kind == 1) {
            // The failed command as the block read it back from its SQ slot.
            let sqe = Sqe {
                cdw0: r.opcode,
                cdw: [
                    r.lba as u32,
                    (r.lba >> 32) as u32,
                    r.blocks.saturating_sub(1),
                    0,
                    0,
                    0,
                ],
                ..Sqe::default()
            };
            let status = Status::from_raw(r.status as u16);
            return Err(GpuError::NvmeCommand {
                label,
                error: CommandError::new(&sqe, status),
            });
        }
        if let Some(r) = reports.iter().find(|r| r.kind == 3) {
            return Err(GpuError::Nvme {
                label,
                what: format!("a completion for no command in flight: {:08x?}", r.last_cqe),
            });
        }
        Ok(())
    }
}

impl Drop for GpuIo {
    fn drop(&mut self) {
        if self.broken.is_none() {
            for &q in &self.qids {
                if let Err(e) = self.ctrl.delete_queue_pair(q) {
                    tracing::error!(
                        "deleting GPU queue pair {q}: {e}; leaking its memory rather than freeing it under the controller"
                    );
                    // The rings and staging slots must outlive a queue the controller may still
                    // use.
                    std::mem::forget(std::mem::replace(
                        &mut self._rings,
                        Rings::Device {
                            base: 0,
                            aligned: 0,
                            len: 0,
                        },
                    ));
                    std::mem::forget(self.staging.take());
                    return;
                }
            }
        }
        for r in self.regions.drain(..) {
            let _ = self.ctrl.unmap(r.mapping.handle);
        }
        let _ = self.ctrl.unmap(self.rings_map.handle);
        if let Some(s) = &self.staging {
            let _ = self.ctrl.unmap(s.mapping.handle);
        }
    }
}

/// Gives back what [`GpuIo::open`] got from the controller before it failed: the queue pairs
/// `qids` and the ring memory's mapping.
fn undo_open(ctrl: &dyn Controller, qids: &[u32], rings_map: &Mapping) {
    for &q in qids {
        let _ = ctrl.delete_queue_pair(q);
    }
    let _ = ctrl.unmap(rings_map.handle);
}

impl Staging {
    /// `bytes`-byte slots for each entry of each of `queues` (`depth` deep), mapped for the
    /// controller; fills in the queues' staging fields.
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        ctrl: &dyn Controller,
        queues: &mut [IoQueue],
        depth: usize,
        bytes: u32,
    ) -> Result<Staging, GpuError> {
        let per_queue = depth * bytes as usize;
        let len = (per_queue * queues.len()).next_multiple_of(uapi::HOST_PAGE_SIZE as usize);
        let memory = Pinned::new(ctx, len)?;
        // SAFETY: the memory lives in the result, which `GpuIo` drops after deleting its queue
        // pairs and unmapping it.
        let mapping =
            unsafe { ctrl.map_host(memory.host, memory.len) }.map_err(|e| GpuError::Nvme {
                label: ctrl.label().to_string(),
                what: format!("MAP of {len} bytes of staging memory: {e}"),
            })?;
        let pages = match stream.clone_htod(&mapping.bus_addrs) {
            Ok(p) => p,
            Err(e) => {
                let _ = ctrl.unmap(mapping.handle);
                return Err(e).during("uploading the staging page table");
            }
        };
        let table = {
            let (p, _guard) = pages.device_ptr(stream);
            p
        };
        for (i, q) in queues.iter_mut().enumerate() {
            q.staging = memory.device + (i * per_queue) as u64;
            q.staging_pages = table;
            q.staging_first = (i * per_queue) as u64;
            q.staging_bytes = bytes;
            q.staging_page_shift = mapping.page_size.trailing_zeros();
        }
        Ok(Staging {
            mapping,
            _memory: memory,
            _pages: pages,
        })
    }
}

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
