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

//!
//! Laid out by concern: `abi` holds the kernels' structs, `host_memory` the pinned and
//! registered host memory the GPU reaches, `member` one controller's queue pairs and their
//! set-up, `run` the launches and their reports, `copy_engine` the proxy controller's copies
//! of GPU memory, `vectors` the SQE test vectors, `row_cache` the row cache over the same
//! queues; this file the [`GpuIo`] itself and the regions it maps.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, result};
use legend_nvme::{Controller, Mapping, uapi};

use crate::error::DriverContext;
use crate::{Gpu, GpuError};

mod abi;
mod copy_engine;
mod host_memory;
mod member;
mod row_cache;
mod run;
mod vectors;

use abi::{IoQueue, IoResult};
use member::Member;

pub use copy_engine::CudaDeviceMemory;
pub use row_cache::{CacheStats, CachedTable, RowCache, RowCacheOptions};
pub use vectors::{SqeVector, sqe_vectors};

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
                .map_err(|source| GpuError::Controller {
                    label: m.ctrl.label().to_string(),
                    what: format!("MAP of {len} bytes of GPU memory"),
                    source: Box::new(source),
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
