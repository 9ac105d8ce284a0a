//! One controller's queue pairs for the I/O kernels: their rings, doorbells and staging slots,
//! set up and given back.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, result};
use legend_nvme::{Controller, Doorbells, Mapping, uapi};
use legend_nvme_protocol::{MAX_DEPTH, QueueLayout, max_command_bytes};

use super::abi::IoQueue;
use super::host_memory::{Pinned, Registered};
use super::{GpuIoOptions, RingPlacement};
use crate::GpuError;
use crate::error::DriverContext;

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

/// One controller's queue pairs: blocks `first_block ..` of a launch.
pub(super) struct Member {
    pub(super) ctrl: Arc<dyn Controller>,
    pub(super) opts: GpuIoOptions,
    pub(super) qids: Vec<u32>,
    pub(super) depth: u16,
    pub(super) lba_shift: u32,
    blocks: u64,
    pub(super) max_command: u64,
    pub(super) first_block: usize,
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

impl Member {
    /// Opens `opts.queues` queue pairs of `ctrl` for blocks `first_block ..`; their queues'
    /// descriptions go to `queues`.
    pub(super) fn open(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        ctrl: Arc<dyn Controller>,
        opts: &GpuIoOptions,
        first_block: usize,
        queues: &mut Vec<IoQueue>,
    ) -> Result<Member, GpuError> {
        let geometry = Geometry::of(ctrl.as_ref(), opts)?;
        let layout = QueueLayout::new(geometry.depth);
        let total = (layout.bytes() * opts.queues as usize).next_multiple_of(1 << 16);
        let rings = Rings::new(ctx, opts.placement, total)?;
        // SAFETY: the ring memory lives in the result until after the queue pairs are deleted.
        let rings_map = unsafe {
            match &rings {
                Rings::Host(p) => ctrl.map_host(p.host, p.len),
                Rings::Device { aligned, len, .. } => ctrl.map_gpu(*aligned, *len),
            }
        }
        .map_err(controller_error(ctrl.as_ref(), "MAP of the queue memory"))?;
        let registered = ctrl
            .doorbells()
            .map_err(controller_error(ctrl.as_ref(), "doorbells"))
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
        let mapped = MappedRings {
            rings: &rings,
            map: &rings_map,
            doorbells: &doorbells_gpu,
            layout,
        };
        let qids = create_queue_pairs(ctrl.as_ref(), &geometry, opts.queues, &mapped, queues)?;
        let staging = match opts.staging {
            0 => None,
            bytes => Some(
                Staging::new(
                    ctx,
                    stream,
                    ctrl.as_ref(),
                    &mut queues[first_queue..],
                    usize::from(geometry.depth),
                    bytes,
                )
                .inspect_err(|_| undo_open(ctrl.as_ref(), &qids, &rings_map))?,
            ),
        };
        tracing::debug!(label = %ctrl.label(), queues = qids.len(), depth = geometry.depth, "GPU I/O queues open");
        Ok(Member {
            ctrl,
            opts: opts.clone(),
            qids,
            depth: geometry.depth,
            lba_shift: geometry.lba_shift,
            blocks: geometry.blocks,
            max_command: geometry.max_command,
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
    pub(super) fn namespace_bytes(&self) -> u64 {
        self.blocks << self.lba_shift
    }

    /// Deletes its queue pairs (which waits for or aborts what they hold), once; false if the
    /// controller refused one, whose memory must then outlive this object.
    pub(super) fn delete_queue_pairs(&mut self) -> bool {
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

/// A member's namespace and queues, checked against what its controller allows.
struct Geometry {
    /// Entries a queue.
    depth: u16,
    /// Bytes of the largest command.
    max_command: u64,
    lba_shift: u32,
    /// The namespace's LBAs.
    blocks: u64,
    /// Queue pairs the controller offers.
    queue_pairs: u32,
}

impl Geometry {
    /// The geometry of `opts` on `ctrl`, or why the controller cannot serve it.
    fn of(ctrl: &dyn Controller, opts: &GpuIoOptions) -> Result<Geometry, GpuError> {
        let refuse = |what: String| GpuError::Nvme {
            label: ctrl.label().to_string(),
            what,
        };
        let info = ctrl.info().map_err(controller_error(ctrl, "INFO"))?;
        let ns = legend_nvme::namespace(&info, opts.namespace)
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
        Ok(Geometry {
            depth: want as u16,
            max_command,
            lba_shift: ns.lba_shift,
            blocks: ns.blocks,
            queue_pairs: info.queue_pairs,
        })
    }
}

/// The error of controller call `what` on `ctrl`.
fn controller_error(
    ctrl: &dyn Controller,
    what: &'static str,
) -> impl FnOnce(legend_nvme::Error) -> GpuError {
    let label = ctrl.label().to_string();
    move |source| GpuError::Controller {
        label,
        what: what.to_string(),
        source: Box::new(source),
    }
}

impl Rings {
    /// `total` bytes of zeroed queue memory where `placement` puts it.
    fn new(
        ctx: &Arc<CudaContext>,
        placement: RingPlacement,
        total: usize,
    ) -> Result<Rings, GpuError> {
        ctx.bind_to_thread().during("binding the context")?;
        Ok(match placement {
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
        })
    }
}

/// A member's queue memory as its controller and the GPU reach it.
struct MappedRings<'a> {
    rings: &'a Rings,
    map: &'a Mapping,
    doorbells: &'a Registered,
    layout: QueueLayout,
}

/// Creates `wanted` queue pairs of `ctrl` in `mem` (skipping the queue ids another owner holds)
/// and describes them in `queues`; returns their ids. On failure, gives back what it and the
/// caller got from the controller ([`undo_open`]).
fn create_queue_pairs(
    ctrl: &dyn Controller,
    geometry: &Geometry,
    wanted: u32,
    mem: &MappedRings<'_>,
    queues: &mut Vec<IoQueue>,
) -> Result<Vec<u32>, GpuError> {
    let depth = geometry.depth;
    let mut qids = Vec::new();
    let mut qid = 1;
    while qids.len() < wanted as usize {
        if qid > geometry.queue_pairs {
            undo_open(ctrl, &qids, mem.map);
            return Err(GpuError::Nvme {
                label: ctrl.label().to_string(),
                what: format!(
                    "not {wanted} free queue pairs among {}",
                    geometry.queue_pairs
                ),
            });
        }
        let base = qids.len() * mem.layout.bytes();
        let (cq_at, lists_at) = (
            base + mem.layout.cq_offset(),
            base + mem.layout.list_offset(0),
        );
        let args = uapi::QueuePairArgs {
            qid,
            depth: u32::from(depth),
            sq_handle: mem.map.handle,
            cq_handle: mem.map.handle,
            sq_offset: base as u64,
            cq_offset: cq_at as u64,
            ..Default::default()
        };
        match ctrl.create_queue_pair(args) {
            Ok(q) => {
                qids.push(qid);
                queues.push(IoQueue {
                    sq: mem.rings.device(base),
                    cq: mem.rings.device(cq_at),
                    sq_doorbell: mem.doorbells.device + u64::from(q.sq_doorbell),
                    cq_doorbell: mem.doorbells.device + u64::from(q.cq_doorbell),
                    lists: mem.rings.device(lists_at),
                    lists_bus: mem.map.bus(lists_at),
                    depth: u32::from(depth),
                    qid,
                    phase: 1,
                    ..IoQueue::default()
                });
            }
            Err(legend_nvme::Error::Ioctl { ref source, .. })
                if source.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => {
                undo_open(ctrl, &qids, mem.map);
                return Err(controller_error(ctrl, "CREATE_QUEUE_PAIR")(e));
            }
        }
        qid += 1;
    }
    Ok(qids)
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
        let mapping = unsafe { ctrl.map_host(memory.host, memory.len) }.map_err(|source| {
            GpuError::Controller {
                label: ctrl.label().to_string(),
                what: format!("MAP of {len} bytes of staging memory"),
                source: Box::new(source),
            }
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
