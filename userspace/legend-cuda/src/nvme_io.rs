//! GPU-initiated NVMe I/O: the I/O kernels of `kernels/nvme_io.cu` driving queue pairs of one
//! or several [`Controller`]s (SSDs bound to `legend_nvme`, or userspace proxies) between GPU
//! memory and their namespaces, on a stream of their own so that they run beside training.
//!
//! [`GpuIo::open`] creates one queue pair per thread block on one controller;
//! [`GpuIo::open_members`] does so on each of several (the members of a striped store), each
//! with its own options. A member's rings and PRP list pages live in GPU memory for a real
//! controller (which reads and writes them peer to peer) or in pinned host memory mapped into
//! the GPU for the proxy (whose thread reads them); the doorbells are registered with CUDA so
//! the blocks can ring them. [`GpuIo::map`] makes GPU memory reachable by every member;
//! [`GpuIo::run`] moves transfers of member 0 with one launch, [`GpuIo::run_members`]
//! transfers of any members with one launch (every member's queue pairs at once, each block
//! on its own controller's jobs). Both check every block's report: a failed command comes
//! back with its controller, LBA and decoded status, a controller that stops answering with
//! the queue's state, after every queue pair was deleted (which waits for or aborts what they
//! held), so no command can outlive the call.
//!
//! A striped store's swap (`legend_storage`'s stripe units dealt round-robin over the members)
//! is one [`GpuIo::run_members`]: a [`MemberJob`] for each piece of the partition, naming its
//! member, the piece's offset in the staging region and its offset on that member.

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

/// One controller of a [`GpuIo`] ([`GpuIo::open_members`]) and how its queue pairs are set up.
/// Every member of one `GpuIo` has the same `threads` (one launch drives them all).
#[derive(Clone)]
pub struct IoMember {
    /// The controller.
    pub controller: Arc<dyn Controller>,
    /// Its queue pairs, namespace, ring placement and staging.
    pub options: GpuIoOptions,
}

/// What one member of a [`GpuIo`] offers ([`GpuIo::member`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberInfo {
    /// The controller's label.
    pub label: String,
    /// Its namespace's LBA size.
    pub block_size: u64,
    /// Its namespace's size in bytes.
    pub namespace_bytes: u64,
    /// Queue pairs (thread blocks of a launch).
    pub queues: usize,
    /// Entries a queue.
    pub depth: u16,
}

/// One transfer of a [`GpuIo::run`] (or, in a [`MemberJob`], of [`GpuIo::run_members`]):
/// `bytes` between byte `offset` of mapped region `region` and the namespace from byte `at`
/// (both multiples of the LBA size).
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

/// A transfer of [`GpuIo::run_members`] on the namespace of member `member` (an index of the
/// members [`GpuIo::open_members`] was given).
#[derive(Clone, Copy, Debug)]
pub struct MemberJob {
    /// The member.
    pub member: usize,
    /// The transfer, `at` on that member's namespace.
    pub job: GpuIoJob,
}

/// What a [`GpuIo::run`] or [`GpuIo::run_members`] did.
#[derive(Clone, Debug, Default)]
pub struct IoRun {
    /// Commands completed.
    pub commands: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Launch to completion.
    pub seconds: f64,
    /// Each command's submission-to-completion time (when asked for), the jobs taken member by
    /// member (member 0's in their order, then member 1's, ...).
    pub latencies_ns: Vec<u64>,
    /// Commands completed on each member, in member order.
    pub member_commands: Vec<u64>,
    /// Bytes moved on each member.
    pub member_bytes: Vec<u64>,
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

/// One member's mapping of a region, with its page table on the device.
struct RegionMap {
    mapping: Mapping,
    pages: CudaSlice<u64>,
}

/// A region of GPU memory every member can reach.
struct Region {
    /// Device address of its byte 0.
    start: u64,
    len: u64,
    /// Each member's mapping, in member order.
    maps: Vec<RegionMap>,
    /// The memory, when this object allocated it ([`GpuIo::alloc`]): freed after the unmap.
    owned: Option<(CudaSlice<u8>, usize)>,
}

/// One controller's queue pairs: blocks `first_block ..` of a launch.
struct Member {
    ctrl: Arc<dyn Controller>,
    opts: GpuIoOptions,
    qids: Vec<u32>,
    depth: u16,
    lba_shift: u32,
    blocks: u64,
    max_command: u64,
    first_block: usize,
    rings_map: Mapping,
    /// Whether its queue pairs were deleted (after a timeout, or on drop), and all of them
    /// (false: the controller kept one, whose memory must outlive this object).
    deleted: Option<bool>,
    // Dropped after the queue pairs are deleted: registrations, then memory.
    _doorbells_gpu: Registered,
    _doorbells: Doorbells,
    rings: Rings,
    staging: Option<Staging>,
}

/// Queue pairs of one or several controllers, driven by GPU thread blocks.
pub struct GpuIo {
    /// Dropped after the regions are unmapped (`Drop`): each deletes its queue pairs first.
    members: Vec<Member>,
    stream: Arc<CudaStream>,
    kernel: CudaFunction,
    /// `legend_row_cache_lookup`, for a [`RowCache`] over these queues.
    cache_kernel: CudaFunction,
    /// Threads a block, every member's.
    threads: u32,
    /// Every member's queues, member after member.
    queues: CudaSlice<IoQueue>,
    results: CudaSlice<IoResult>,
    regions: Vec<Region>,
    /// The GPU's count of I/O blocks running (its persistent kernels leave them room).
    io_blocks: Arc<AtomicUsize>,
    /// Once a queue stopped answering: its controller's label and the queue's state.
    broken: Option<(String, String)>,
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

impl Member {
    /// Opens `opts.queues` queue pairs of `ctrl` for blocks `first_block ..`; their queues'
    /// descriptions go to `queues`.
    fn open(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        ctrl: Arc<dyn Controller>,
        opts: &GpuIoOptions,
        first_block: usize,
        queues: &mut Vec<IoQueue>,
    ) -> Result<Member, GpuError> {
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
        let registered = ctrl
            .doorbells()
            .map_err(nvme("doorbells"))
            .and_then(|doorbells| {
                let gpu = Registered::new(
                    doorbells.as_ptr(),
                    doorbells.len(),
                    opts.placement == RingPlacement::Device,
                )?;
                Ok((doorbells, gpu))
            });
        let (doorbells, doorbells_gpu) =
            registered.inspect_err(|_| undo_open(ctrl.as_ref(), &[], &rings_map))?;
        let first_queue = queues.len();
        let mut qids = Vec::new();
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
        let staging = match opts.staging {
            0 => None,
            bytes => Some(
                Staging::new(
                    ctx,
                    stream,
                    ctrl.as_ref(),
                    &mut queues[first_queue..],
                    usize::from(depth),
                    bytes,
                )
                .inspect_err(|_| undo_open(ctrl.as_ref(), &qids, &rings_map))?,
            ),
        };
        tracing::debug!(label = %label, queues = qids.len(), depth, "GPU I/O queues open");
        Ok(Member {
            ctrl,
            opts: opts.clone(),
            qids,
            depth,
            lba_shift: ns.lba_shift,
            blocks: ns.blocks,
            max_command,
            first_block,
            rings_map,
            deleted: None,
            _doorbells_gpu: doorbells_gpu,
            _doorbells: doorbells,
            rings,
            staging,
        })
    }

    /// The namespace's size in bytes.
    fn namespace_bytes(&self) -> u64 {
        self.blocks << self.lba_shift
    }

    /// Deletes its queue pairs (which waits for or aborts what they hold), once; false if the
    /// controller refused one, whose memory must then outlive this object.
    fn delete_queue_pairs(&mut self) -> bool {
        if let Some(all) = self.deleted {
            return all;
        }
        let mut all = true;
        for &q in &self.qids {
            if let Err(e) = self.ctrl.delete_queue_pair(q) {
                tracing::error!(
                    error = &e as &dyn std::error::Error,
                    "deleting GPU queue pair {q} of {}",
                    self.ctrl.label()
                );
                all = false;
            }
        }
        self.deleted = Some(all);
        all
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if !self.delete_queue_pairs() {
            tracing::error!(
                "leaking the queue memory of {} rather than freeing it under the controller",
                self.ctrl.label()
            );
            // The rings and staging slots must outlive a queue the controller may still use.
            std::mem::forget(std::mem::replace(
                &mut self.rings,
                Rings::Device {
                    base: 0,
                    aligned: 0,
                    len: 0,
                },
            ));
            std::mem::forget(self.staging.take());
            return;
        }
        let _ = self.ctrl.unmap(self.rings_map.handle);
        if let Some(s) = &self.staging {
            let _ = self.ctrl.unmap(s.mapping.handle);
        }
    }
}

impl GpuIo {
    /// Opens `opts.queues` queue pairs of the controller for I/O kernels on `gpu`: a `GpuIo`
    /// of one member, whose transfers [`GpuIo::run`] moves.
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
        Self::open_members(
            gpu,
            &[IoMember {
                controller: ctrl,
                options: opts.clone(),
            }],
        )
    }

    /// Opens the queue pairs of several controllers for I/O kernels on `gpu`, each member with
    /// its own options (queue pairs, namespace, ring placement: pinned host rings for the
    /// proxy, GPU memory for `legend_nvme`; staging), so that one launch
    /// ([`GpuIo::run_members`]) keeps all of them busy. Member `i` is `members[i]`; its queue
    /// pairs are blocks of every launch. Every member must use the same `threads` (one launch,
    /// one block size); a block gives up on its queue after the longest of the members'
    /// timeouts.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for no member, or members of different `threads`;
    /// [`GpuError::Nvme`] naming the controller that refuses (as [`GpuIo::open`]); driver
    /// errors. The members opened before a failure are closed again.
    pub fn open_members(gpu: &Gpu, members: &[IoMember]) -> Result<GpuIo, GpuError> {
        let first = members
            .first()
            .ok_or_else(|| GpuError::Shape("GPU I/O over no controller".into()))?;
        let threads = first.options.threads;
        if let Some(m) = members.iter().find(|m| m.options.threads != threads) {
            return Err(GpuError::Shape(format!(
                "GPU I/O members of {threads} and {} threads a block ({}): one launch drives \
                 them all, with one block size",
                m.options.threads,
                m.controller.label()
            )));
        }
        let ctx = gpu.context();
        ctx.bind_to_thread().during("binding the context")?;
        let stream = ctx.new_stream().during("creating the I/O stream")?;
        let mut queues = Vec::new();
        let mut opened = Vec::with_capacity(members.len());
        for m in members {
            // A failure drops the members opened so far, which closes them.
            opened.push(Member::open(
                ctx,
                &stream,
                m.controller.clone(),
                &m.options,
                queues.len(),
                &mut queues,
            )?);
        }
        let queues_dev = stream.clone_htod(&queues).during("uploading the queues")?;
        let results = stream
            .alloc_zeros::<IoResult>(queues.len())
            .during("allocating the I/O reports")?;
        Ok(GpuIo {
            members: opened,
            stream,
            kernel: gpu.kernels.nvme_io.clone(),
            cache_kernel: gpu.kernels.row_cache_lookup.clone(),
            threads,
            queues: queues_dev,
            results,
            regions: Vec::new(),
            io_blocks: gpu.io_blocks().clone(),
            broken: None,
        })
    }

    /// Member 0's namespace's LBA size (see [`GpuIo::member`] for the others).
    pub fn block_size(&self) -> u64 {
        1 << self.members[0].lba_shift
    }

    /// Member 0's namespace's size in bytes.
    pub fn namespace_bytes(&self) -> u64 {
        self.members[0].namespace_bytes()
    }

    /// Member 0's queue depth.
    pub fn depth(&self) -> u16 {
        self.members[0].depth
    }

    /// The number of members (controllers).
    pub fn members(&self) -> usize {
        self.members.len()
    }

    /// What member `member` offers, if there is one.
    pub fn member(&self, member: usize) -> Option<MemberInfo> {
        self.members.get(member).map(|m| MemberInfo {
            label: m.ctrl.label().to_string(),
            block_size: 1 << m.lba_shift,
            namespace_bytes: m.namespace_bytes(),
            queues: m.qids.len(),
            depth: m.depth,
        })
    }

    /// The I/O stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Thread blocks of a launch: every member's queue pairs.
    fn blocks(&self) -> usize {
        self.members.iter().map(|m| m.qids.len()).sum()
    }

    /// Makes `len` bytes of GPU memory at `ptr` (64 KiB aligned) reachable by every member;
    /// returns the region's index for [`GpuIoJob::region`].
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until this object is dropped.
    ///
    /// # Errors
    ///
    /// [`GpuError::Nvme`] when a controller refuses the mapping (the others' are undone).
    pub unsafe fn map(&mut self, ptr: u64, len: usize) -> Result<usize, GpuError> {
        let mut maps: Vec<RegionMap> = Vec::with_capacity(self.members.len());
        for m in &self.members {
            // SAFETY: the caller's contract.
            let mapped = unsafe { m.ctrl.map_gpu(ptr, len) }
                .map_err(|e| GpuError::Nvme {
                    label: m.ctrl.label().to_string(),
                    what: format!("MAP of {len} bytes of GPU memory: {e}"),
                })
                .and_then(|mapping| match self.stream.clone_htod(&mapping.bus_addrs) {
                    Ok(pages) => Ok(RegionMap { mapping, pages }),
                    Err(e) => {
                        let _ = m.ctrl.unmap(mapping.handle);
                        Err(e).during("uploading a page table")
                    }
                });
            match mapped {
                Ok(map) => maps.push(map),
                Err(e) => {
                    for (m, map) in self.members.iter().zip(&maps) {
                        let _ = m.ctrl.unmap(map.mapping.handle);
                    }
                    return Err(e);
                }
            }
        }
        self.regions.push(Region {
            start: ptr,
            len: len as u64,
            maps,
            owned: None,
        });
        Ok(self.regions.len() - 1)
    }

    /// Allocates `len` bytes of GPU memory (64 KiB aligned) that every member can reach;
    /// returns the region's index. The memory lives as long as this object.
    ///
    /// # Errors
    ///
    /// Driver errors, or a controller refusing the mapping.
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

    /// Moves `jobs`, all on member 0's namespace (the controller of [`GpuIo::open`]), with one
    /// launch of the I/O kernels and waits for it; `latencies` also returns each command's
    /// submission-to-completion time. [`GpuIo::run_members`] with every job on member 0.
    ///
    /// # Errors
    ///
    /// As [`GpuIo::run_members`].
    pub fn run(&mut self, jobs: &[GpuIoJob], latencies: bool) -> Result<IoRun, GpuError> {
        let jobs: Vec<MemberJob> = jobs
            .iter()
            .map(|&job| MemberJob { member: 0, job })
            .collect();
        self.run_members(&jobs, latencies)
    }

    /// Moves `jobs`, each on its member's namespace, with one launch of the I/O kernels and
    /// waits for it: every member's queue pairs take part at once, each block serving its own
    /// controller's jobs (a member's commands split evenly over its queue pairs, its jobs in
    /// their order). `latencies` also returns each command's submission-to-completion time
    /// (the jobs taken member by member).
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for a job naming no member or region, outside its region or its
    /// member's namespace, or not aligned to that namespace's LBA size;
    /// [`GpuError::NvmeCommand`] for a command a controller failed (its LBA and decoded
    /// status); [`GpuError::NvmeTimeout`] when a queue stopped answering (every queue pair is
    /// then deleted, and every later call fails the same way); both name the controller.
    pub fn run_members(&mut self, jobs: &[MemberJob], latencies: bool) -> Result<IoRun, GpuError> {
        if let Some((label, state)) = &self.broken {
            return Err(GpuError::NvmeTimeout {
                label: label.clone(),
                state: state.clone(),
            });
        }
        // A member's commands must be consecutive: its queue pairs split them.
        let mut ordered: Vec<&MemberJob> = jobs.iter().collect();
        ordered.sort_by_key(|j| j.member);
        let mut kernel_jobs = Vec::with_capacity(jobs.len());
        // Each member's first command and command count, and its bytes.
        let mut spans = vec![(0u64, 0u64); self.members.len()];
        let mut member_bytes = vec![0u64; self.members.len()];
        let mut commands = 0u64;
        let mut bytes = 0u64;
        for MemberJob { member, job: j } in ordered {
            let m = self.members.get(*member).ok_or_else(|| {
                GpuError::Shape(format!(
                    "a transfer on member {member} of {}",
                    self.members.len()
                ))
            })?;
            let region = self
                .regions
                .get(j.region)
                .ok_or_else(|| GpuError::Shape(format!("no mapped region {}", j.region)))?;
            let block = 1u64 << m.lba_shift;
            if j.bytes == 0
                || j.bytes % block != 0
                || j.at % block != 0
                || j.offset % 4 != 0
                || j.offset + j.bytes > region.len
                || j.at + j.bytes > m.namespace_bytes()
            {
                return Err(GpuError::Shape(format!(
                    "transfer of {} bytes from byte {} of region {} to byte {} of the \
                     namespace of {}: outside either, or not aligned to the {block}-byte LBA",
                    j.bytes,
                    j.offset,
                    j.region,
                    j.at,
                    m.ctrl.label()
                )));
            }
            let map = &region.maps[*member];
            let n = j.bytes.div_ceil(m.max_command);
            if spans[*member].1 == 0 {
                spans[*member].0 = commands;
            }
            spans[*member].1 += n;
            member_bytes[*member] += j.bytes;
            kernel_jobs.push(IoJob {
                pages: self.addr(&map.pages),
                device: region.start,
                offset: j.offset,
                bytes: j.bytes,
                lba: j.at >> m.lba_shift,
                command_bytes: m.max_command,
                first_command: commands,
                page_shift: map.mapping.page_size.trailing_zeros(),
                opcode: if j.write { 1 } else { 2 },
                nsid: m.opts.namespace,
                lba_shift: m.lba_shift,
            });
            commands += n;
            bytes += j.bytes;
        }
        if commands == 0 {
            return Ok(IoRun::default());
        }
        let ranges: Vec<u64> = self
            .members
            .iter()
            .zip(&spans)
            .flat_map(|(m, &(first, n))| block_ranges(first, n, m.qids.len()))
            .collect();
        let jobs_dev = self
            .stream
            .clone_htod(&kernel_jobs)
            .during("uploading the I/O jobs")?;
        let ranges_dev = self
            .stream
            .clone_htod(&ranges)
            .during("uploading the blocks' commands")?;
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
        let timeout = self.timeout().as_nanos() as u64;
        let blocks = self.blocks();
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let start = Instant::now();
        let running = BlocksRunning::new(&self.io_blocks, blocks);
        let mut b = self.stream.launch_builder(&self.kernel);
        b.arg(&mut self.queues)
            .arg(&jobs_dev)
            .arg(&njobs)
            .arg(&ranges_dev)
            .arg(&mut self.results)
            .arg(&timeout);
        let null = 0u64;
        match &lat {
            Some(l) => b.arg(l),
            None => b.arg(&null),
        };
        // SAFETY: the queues (one a block), jobs, ranges (two a block, each block's commands
        // those of its own controller's jobs), page tables and regions are live device memory
        // of the sizes the kernel indexes (checked above), and the controllers' rings and
        // doorbells stay mapped while this object lives.
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
            member_commands: spans.iter().map(|&(_, n)| n).collect(),
            member_bytes,
        })
    }

    /// How long a block waits for a completion: the longest of the members' timeouts.
    fn timeout(&self) -> Duration {
        (self.members.iter().map(|m| m.opts.timeout))
            .max()
            .unwrap_or_default()
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

    /// The member whose queue pair block `b` of a launch drives.
    fn member_of_block(&self, b: usize) -> &Member {
        let i = self
            .members
            .partition_point(|m| m.first_block + m.qids.len() <= b);
        &self.members[i.min(self.members.len() - 1)]
    }

    /// Turns the blocks' reports into the first failure, if any.
    fn check(&mut self, reports: &[IoResult]) -> Result<(), GpuError> {
        if let Some((b, r)) = reports.iter().enumerate().find(|(_, r)| r.kind == 2) {
            let m = self.member_of_block(b);
            let label = m.ctrl.label().to_string();
            let state = format!(
                "block {b} (qid {}) saw no completion for {:.1} s: SQ tail {}, CQ head {} \
                 (phase {}), {} commands in flight, {} completed; last CQE {:08x?}",
                m.qids[b - m.first_block],
                m.opts.timeout.as_secs_f64(),
                r.sq_tail,
                r.cq_head,
                r.phase,
                r.in_flight,
                r.completed,
                r.last_cqe
            );
            // Nothing the queues still hold may reach memory after this returns.
            for m in &mut self.members {
                m.delete_queue_pairs();
            }
            self.broken = Some((label.clone(), state.clone()));
            return Err(GpuError::NvmeTimeout { label, state });
        }
        if let Some((b, r)) = reports.iter().enumerate().find(|(_, r)| r.kind == 1) {
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
                label: self.member_of_block(b).ctrl.label().to_string(),
                error: CommandError::new(&sqe, status),
            });
        }
        if let Some((b, r)) = reports.iter().enumerate().find(|(_, r)| r.kind == 3) {
            return Err(GpuError::Nvme {
                label: self.member_of_block(b).ctrl.label().to_string(),
                what: format!("a completion for no command in flight: {:08x?}", r.last_cqe),
            });
        }
        Ok(())
    }
}

/// The commands `[first, first + n)` of one member split over its `blocks` queue pairs: each
/// block's `[start, end)`, as the kernel's `ranges` take them.
fn block_ranges(first: u64, n: u64, blocks: usize) -> Vec<u64> {
    let per = n.div_ceil(blocks.max(1) as u64);
    (0..blocks as u64)
        .flat_map(|i| [first + (i * per).min(n), first + ((i + 1) * per).min(n)])
        .collect()
}

impl Drop for GpuIo {
    fn drop(&mut self) {
        // The queue pairs first, so that nothing reaches a region after its unmap; a member
        // whose queue pair the controller kept leaks its memory, and the regions stay mapped.
        let mut all = true;
        for m in &mut self.members {
            all &= m.delete_queue_pairs();
        }
        if !all {
            for (buf, _) in self.regions.drain(..).filter_map(|r| r.owned) {
                std::mem::forget(buf);
            }
            return;
        }
        for r in self.regions.drain(..) {
            for (m, map) in self.members.iter().zip(&r.maps) {
                let _ = m.ctrl.unmap(map.mapping.handle);
            }
        }
        // The members then unmap their rings and staging slots as they drop.
    }
}

/// Gives back what [`Member::open`] got from the controller before it failed: the queue pairs
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
