//! The `nvme` and `proxy` backends' medium: a namespace's LBAs driven from CPU threads through
//! I/O queue pairs of a [`Controller`] (the `legend_nvme` device, or the userspace proxy), with
//! the NVMe protocol of `legend-nvme-protocol`.
//!
//! The store's byte offsets start at `start_lba`. Data buffers are mapped for the controller the
//! first time they are used (in pieces of at most 1 GiB, the module's limit for one mapping) and
//! stay mapped; a transfer is cut into commands of at most the controller's transfer limit, each
//! with its own PRP list page, and up to the queue depth of them are in flight. A command that
//! fails ends the transfer with its decoded status and LBA once the others completed; a
//! controller that stops answering ends it after the timeout with a dump of the queue, having
//! deleted the queue pair first (which waits for, or aborts, what it still held), so no command
//! can write the caller's buffers after the call returned.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use legend_nvme::{Controller, Doorbells, Mapping, uapi};
use legend_nvme_protocol::{
    MAX_DEPTH, Opcode, QueueLayout, QueuePair, Sqe, max_command_bytes, prp,
};

use crate::buffer::{IoBuffer, RawAlloc};
use crate::error::StoreError;
use crate::io::MediumIo;

/// Where a store lives on an NVMe controller.
#[derive(Clone)]
pub struct NvmeTarget {
    /// The controller.
    pub controller: Arc<dyn Controller>,
    /// Namespace identifier.
    pub namespace: u32,
    /// First LBA of the store.
    pub start_lba: u64,
}

impl std::fmt::Debug for NvmeTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeTarget")
            .field("controller", &self.controller.label())
            .field("namespace", &self.namespace)
            .field("start_lba", &self.start_lba)
            .finish()
    }
}

impl NvmeTarget {
    /// How messages name the target: the controller, namespace and start LBA.
    pub fn label(&self) -> PathBuf {
        PathBuf::from(format!(
            "{} namespace {} from LBA {}",
            self.controller.label(),
            self.namespace,
            self.start_lba
        ))
    }
}

/// The largest mapping the kernel module accepts.
const MAX_MAPPING_BYTES: usize = 1 << 30;

/// One mapped piece of a buffer.
struct Mapped {
    raw: Arc<RawAlloc>,
    piece: usize,
    mapping: Mapping,
}

/// What a command's PRP entries are built from: the mapped buffers and the queue memory's list
/// pages (one per SQ slot, at its end). Borrowed apart from the queue pair, which hands out the
/// slot.
struct PrpLists<'a> {
    mapped: &'a [Mapped],
    rings: &'a IoBuffer,
    rings_map: &'a Mapping,
    depth: u16,
}

impl PrpLists<'_> {
    /// The PRP entries of `c`, its list in the page of SQ slot `slot`.
    fn prps(&self, jobs: &[MediumIo<'_>], c: &Command, slot: u16) -> prp::Prp {
        let raw = jobs[c.job].raw;
        let page = prp::PAGE as usize;
        let first = c.buf_offset as usize;
        let piece = first / MAX_MAPPING_BYTES;
        let m = self
            .mapped
            .iter()
            .find(|m| Arc::ptr_eq(&m.raw, raw) && m.piece == piece)
            .expect("mapped in transfer");
        let base = first - piece * MAX_MAPPING_BYTES;
        let list_offset = QueueLayout::new(self.depth).list_offset(slot);
        // SAFETY: slot `slot`'s own list page in the queue memory, used by its command only.
        let list = unsafe {
            std::slice::from_raw_parts_mut(
                self.rings.raw().addr().add(list_offset).cast::<u64>(),
                page / 8,
            )
        };
        prp::build(
            (base % page) as u64,
            c.bytes,
            |i| m.mapping.bus_addrs[base / page + i],
            list,
            self.rings_map.bus(list_offset),
        )
        .expect("commands fit one list page")
    }
}

/// A namespace's LBAs behind one I/O queue pair.
pub(crate) struct NvmeQueues {
    // Field order matters on drop: the queue pair is deleted (in `Drop`) before any memory it
    // may reach is unmapped and freed.
    ctrl: Arc<dyn Controller>,
    label: PathBuf,
    qid: u32,
    pair: QueuePair,
    /// Where `pair`'s doorbell pointers point; kept for as long as it.
    _doorbells: Doorbells,
    /// SQ, CQ and one PRP list page per slot, in one mapping.
    rings: IoBuffer,
    rings_map: Mapping,
    depth: u16,
    namespace: u32,
    lba_shift: u32,
    start_lba: u64,
    blocks: u64,
    /// Largest command, in bytes.
    max_command: u64,
    mapped: Vec<Mapped>,
    /// A small buffer for superblocks and signature scans.
    scratch: Option<IoBuffer>,
    /// How long a command may go unanswered.
    timeout: Duration,
    /// Set once a command timed out: the queue pair is gone.
    broken: Option<String>,
}

impl std::fmt::Debug for NvmeQueues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeQueues")
            .field("label", &self.label)
            .field("qid", &self.qid)
            .field("depth", &self.depth)
            .finish()
    }
}

/// One command of a transfer.
#[derive(Clone, Copy)]
struct Command {
    op: Opcode,
    /// Index of the transfer's buffer in `mapped` lookups, and the byte offset in it.
    job: usize,
    buf_offset: u64,
    lba: u64,
    bytes: u64,
}

/// Whether the rings of `layout` (its SQ and CQ pages) lie at consecutive bus addresses in
/// `map`, as the controller takes them (physically contiguous queues).
fn rings_contiguous(layout: &QueueLayout, map: &Mapping) -> bool {
    let pages = layout.list_offset(0) / map.page_size as usize;
    map.bus_addrs[..pages]
        .windows(2)
        .all(|w| w[1] == w[0] + u64::from(map.page_size))
}

/// Deepest queue whose rings fit in one page each, so contiguity never matters.
const ONE_PAGE_DEPTH: u16 = 64;

fn nvme_err(label: &Path, what: &'static str) -> impl FnOnce(legend_nvme::Error) -> StoreError {
    let path = label.to_owned();
    move |source| StoreError::Controller { path, what, source }
}

impl NvmeQueues {
    /// Allocates and maps the memory of a queue pair of `depth` entries (within the controller's
    /// and the protocol's limits). Behind an IOMMU one mapping's pages get consecutive bus
    /// addresses, so rings of any depth work; without one (the module's unsafe mode) they are
    /// physical pages, and a queue deeper than [`ONE_PAGE_DEPTH`] falls back to that depth when
    /// its rings are not contiguous.
    fn map_rings(
        ctrl: &Arc<dyn Controller>,
        label: &Path,
        depth: u32,
        info: &uapi::Info,
    ) -> Result<(QueueLayout, IoBuffer, Mapping), StoreError> {
        let mut depth = depth.clamp(2, info.max_queue_entries.min(u32::from(MAX_DEPTH))) as u16;
        loop {
            let layout = QueueLayout::new(depth);
            let rings = IoBuffer::new(layout.bytes())?;
            // SAFETY: `rings` lives in the queues' object until after the queue pair is deleted
            // (`Drop`), or is unmapped below before it is dropped.
            let map = unsafe { ctrl.map_host(rings.raw().addr(), rings.raw().cap()) }
                .map_err(nvme_err(label, "MAP of the queue memory"))?;
            if depth <= ONE_PAGE_DEPTH || rings_contiguous(&layout, &map) {
                return Ok((layout, rings, map));
            }
            if let Err(e) = ctrl.unmap(map.handle) {
                // Still mapped for the controller: the memory must never be reused.
                std::mem::forget(rings);
                return Err(nvme_err(label, "UNMAP of non-contiguous queue memory")(e));
            }
            tracing::debug!(
                label = %label.display(),
                depth,
                "queue memory is not contiguous for the controller (no IOMMU?): {ONE_PAGE_DEPTH} entries"
            );
            depth = ONE_PAGE_DEPTH;
        }
    }

    /// Opens namespace `target.namespace` of the controller from `target.start_lba`: one queue
    /// pair of `depth` entries (the first free qid).
    pub(crate) fn open(
        target: &NvmeTarget,
        depth: u32,
        timeout: Duration,
    ) -> Result<NvmeQueues, StoreError> {
        let label = target.label();
        let ctrl = target.controller.clone();
        let info = ctrl.info().map_err(nvme_err(&label, "INFO"))?;
        let ns = legend_nvme::namespace(&info, target.namespace).ok_or_else(|| {
            StoreError::InvalidSpec(format!(
                "{}: the controller has no namespace {} (it has {:?})",
                label.display(),
                target.namespace,
                legend_nvme::namespaces(&info)
                    .iter()
                    .map(|n| n.nsid)
                    .collect::<Vec<_>>()
            ))
        })?;
        if ns.lba_shift < 9 || ns.lba_shift > 12 {
            return Err(StoreError::InvalidSpec(format!(
                "{}: LBA size 2^{} B is not supported (512 B to 4 KiB)",
                label.display(),
                ns.lba_shift
            )));
        }
        if target.start_lba >= ns.blocks {
            return Err(StoreError::InvalidSpec(format!(
                "{}: start LBA {} is past the namespace's {} blocks",
                label.display(),
                target.start_lba,
                ns.blocks
            )));
        }
        let max_command = max_command_bytes(info.max_transfer, ns.lba_shift);
        let (layout, rings, rings_map) = Self::map_rings(&ctrl, &label, depth, &info)?;
        let depth = layout.depth();
        let doorbells = ctrl
            .doorbells()
            .map_err(nvme_err(&label, "mmap of the doorbells"))?;
        let cq_offset = layout.cq_offset() as u64;
        let mut created = None;
        for qid in 1..=info.queue_pairs {
            let args = uapi::QueuePairArgs {
                qid,
                depth: u32::from(depth),
                sq_handle: rings_map.handle,
                cq_handle: rings_map.handle,
                sq_offset: 0,
                cq_offset,
                ..Default::default()
            };
            match ctrl.create_queue_pair(args) {
                Ok(q) => {
                    created = Some(q);
                    break;
                }
                Err(legend_nvme::Error::Ioctl { ref source, .. })
                    if source.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    let _ = ctrl.unmap(rings_map.handle);
                    return Err(nvme_err(&label, "CREATE_QUEUE_PAIR")(e));
                }
            }
        }
        let Some(q) = created else {
            let _ = ctrl.unmap(rings_map.handle);
            return Err(StoreError::InvalidSpec(format!(
                "{}: all {} queue pairs are in use",
                label.display(),
                info.queue_pairs
            )));
        };
        // SAFETY: the rings lie in `rings`, the doorbells in `doorbells`, both owned by the
        // result, which deletes the queue pair before dropping either; only this object drives
        // the queue pair.
        let pair = unsafe {
            QueuePair::new(
                depth,
                rings.raw().addr().cast(),
                rings.raw().addr().add(cq_offset as usize).cast(),
                doorbells.register(q.sq_doorbell),
                doorbells.register(q.cq_doorbell),
            )
        };
        tracing::debug!(label = %label.display(), qid = q.qid, depth, max_command, "opened NVMe queue pair");
        Ok(NvmeQueues {
            ctrl,
            qid: q.qid,
            pair,
            _doorbells: doorbells,
            rings,
            rings_map,
            depth,
            namespace: target.namespace,
            lba_shift: ns.lba_shift,
            start_lba: target.start_lba,
            blocks: ns.blocks,
            max_command,
            mapped: Vec::new(),
            scratch: None,
            timeout,
            broken: None,
            label,
        })
    }

    pub(crate) fn label(&self) -> &Path {
        &self.label
    }

    pub(crate) fn block_size(&self) -> u64 {
        1 << self.lba_shift
    }

    /// The namespace byte of the start LBA.
    pub(crate) fn start_byte(&self) -> u64 {
        self.start_lba << self.lba_shift
    }

    /// Bytes from the start LBA to the end of the namespace.
    pub(crate) fn size(&self) -> u64 {
        (self.blocks - self.start_lba) << self.lba_shift
    }

    /// The mapping of piece `piece` of `raw`, mapping it on first use.
    fn mapping(&mut self, raw: &Arc<RawAlloc>, piece: usize) -> Result<usize, StoreError> {
        if let Some(i) = self
            .mapped
            .iter()
            .position(|m| Arc::ptr_eq(&m.raw, raw) && m.piece == piece)
        {
            return Ok(i);
        }
        let start = piece * MAX_MAPPING_BYTES;
        let len = (raw.cap() - start).min(MAX_MAPPING_BYTES);
        // SAFETY: the piece lies in the allocation, which `mapped` keeps alive (`Arc`) until
        // `Drop` deleted the queue pair.
        let mapping = unsafe { self.ctrl.map_host(raw.addr().add(start), len) }
            .map_err(nvme_err(&self.label, "MAP of an I/O buffer"))?;
        self.mapped.push(Mapped {
            raw: raw.clone(),
            piece,
            mapping,
        });
        Ok(self.mapped.len() - 1)
    }

    /// Runs the transfers with up to the queue depth of commands in flight.
    pub(crate) fn transfer(&mut self, jobs: &[MediumIo<'_>]) -> Result<(), StoreError> {
        if let Some(why) = &self.broken {
            return Err(StoreError::ControllerTimeout {
                path: self.label.clone(),
                state: why.clone(),
            });
        }
        let block = self.block_size();
        let mut commands = Vec::new();
        for (j, job) in jobs.iter().enumerate() {
            if job.offset % block != 0 || job.len % block != 0 {
                return Err(StoreError::InvalidSpec(format!(
                    "{}: transfer of {} bytes at {} is not aligned to the {block}-byte LBA",
                    self.label.display(),
                    job.len,
                    job.offset
                )));
            }
            let first = self.start_lba + job.offset / block;
            if first + job.len / block > self.blocks {
                return Err(StoreError::DeviceTooSmall {
                    path: self.label.clone(),
                    needed: job.offset + job.len,
                    available: self.size(),
                    limit: "namespace size",
                });
            }
            let buf_end = (job.buf_offset + job.len) as usize;
            for piece in
                job.buf_offset as usize / MAX_MAPPING_BYTES..buf_end.div_ceil(MAX_MAPPING_BYTES)
            {
                self.mapping(job.raw, piece)?;
            }
            let mut done = 0;
            while done < job.len {
                // Commands never straddle a 1 GiB mapping piece.
                let at = job.buf_offset + done;
                let piece_end = ((at as usize / MAX_MAPPING_BYTES + 1) * MAX_MAPPING_BYTES) as u64;
                let bytes = (job.len - done).min(self.max_command).min(piece_end - at);
                commands.push(Command {
                    op: if job.write {
                        Opcode::Write
                    } else {
                        Opcode::Read
                    },
                    job: j,
                    buf_offset: at,
                    lba: first + done / block,
                    bytes,
                });
                done += bytes;
            }
        }
        self.run(jobs, &commands)
    }

    fn run(&mut self, jobs: &[MediumIo<'_>], commands: &[Command]) -> Result<(), StoreError> {
        let mut next = 0;
        let mut in_flight = 0usize;
        let mut by_slot: Vec<Option<usize>> = vec![None; usize::from(self.depth)];
        let mut first_error: Option<StoreError> = None;
        let mut last_progress = Instant::now();
        while in_flight > 0 || (first_error.is_none() && next < commands.len()) {
            let mut pushed = false;
            while first_error.is_none() && next < commands.len() {
                let c = &commands[next];
                let (namespace, blocks) = (self.namespace, (c.bytes >> self.lba_shift) as u32);
                let lists = PrpLists {
                    mapped: &self.mapped,
                    rings: &self.rings,
                    rings_map: &self.rings_map,
                    depth: self.depth,
                };
                let prps = |slot| lists.prps(jobs, c, slot);
                // The PRP list goes into the slot's page only once `push` found the slot free.
                let Some(cid) = self
                    .pair
                    .push_with(|slot| Sqe::read_write(c.op, namespace, c.lba, blocks, prps(slot)))
                else {
                    break;
                };
                by_slot[usize::from(cid)] = Some(next);
                next += 1;
                in_flight += 1;
                pushed = true;
            }
            if pushed {
                self.pair.ring_sq();
            }
            let mut reaped = false;
            while let Some(done) = self.pair.poll() {
                reaped = true;
                in_flight -= 1;
                match done {
                    Ok((slot, cqe)) => {
                        let i = by_slot[usize::from(slot)].take();
                        let status = cqe.status();
                        if !status.is_success() && first_error.is_none() {
                            let c = &commands[i.expect("a command in every busy slot")];
                            let sqe = self.pair.sqe(slot);
                            first_error = Some(StoreError::Command {
                                path: self.label.clone(),
                                region_offset: jobs[c.job].offset + c.buf_offset
                                    - jobs[c.job].buf_offset,
                                error: legend_nvme_protocol::CommandError::new(&sqe, status),
                            });
                        }
                    }
                    Err(e) => {
                        first_error.get_or_insert(StoreError::Protocol {
                            path: self.label.clone(),
                            message: e.to_string(),
                        });
                    }
                }
            }
            if reaped {
                self.pair.ring_cq();
                last_progress = Instant::now();
            } else if in_flight > 0 && last_progress.elapsed() > self.timeout {
                return Err(self.give_up(in_flight));
            } else if !pushed {
                std::hint::spin_loop();
                if last_progress.elapsed() > Duration::from_micros(100) {
                    std::thread::yield_now();
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// After a timeout: describes the queue, deletes it (so nothing it held can still write
    /// the caller's memory) and refuses all later I/O.
    fn give_up(&mut self, in_flight: usize) -> StoreError {
        let r = self.pair.ring();
        let state = format!(
            "qid {} depth {}: SQ tail {}, CQ head {} (phase {}), {} commands in flight, none \
             completed for {:.1} s; last CQE {:x?}",
            self.qid,
            self.depth,
            r.sq_tail(),
            r.cq_head(),
            u8::from(r.phase()),
            in_flight,
            self.timeout.as_secs_f64(),
            // SAFETY: the CQ lies in the queue memory; a plain read of what the controller
            // wrote last before the head.
            unsafe {
                let cq_offset = QueueLayout::new(self.depth).cq_offset();
                let cq = self.rings.raw().addr().add(cq_offset).cast::<[u32; 4]>();
                let last = (r.cq_head() + self.depth - 1) % self.depth;
                std::ptr::read_volatile(cq.add(usize::from(last)))
            }
        );
        // The controller's side, where it can tell: a doorbell it never saw, a command still
        // in its backing I/O, or a completion it posted that was missed here.
        let state = match self.ctrl.queue_report(self.qid) {
            Some(report) => format!("{state}; {report}"),
            None => state,
        };
        tracing::error!(label = %self.label.display(), "NVMe command timed out: {state}");
        if let Err(e) = self.ctrl.delete_queue_pair(self.qid) {
            tracing::error!(
                error = &e as &dyn std::error::Error,
                "deleting the stuck queue pair failed too"
            );
        }
        self.broken = Some(state.clone());
        StoreError::ControllerTimeout {
            path: self.label.clone(),
            state,
        }
    }

    /// Reads `len` bytes at `offset` (block aligned) through a scratch buffer.
    pub(crate) fn read_at(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, StoreError> {
        let io_len = (len as u64).next_multiple_of(self.block_size());
        let end = (offset + io_len).min(self.size());
        let n = end.saturating_sub(offset);
        let scratch = self.scratch_of(n as usize)?;
        self.transfer(&[MediumIo {
            raw: &scratch,
            buf_offset: 0,
            offset,
            len: n,
            write: false,
        }])?;
        let s = self.scratch.as_ref().expect("scratch");
        Ok(s.as_bytes()[..(n as usize).min(len)].to_vec())
    }

    /// Writes `bytes` at `offset`, padded with zeros to the block size.
    pub(crate) fn write_at(&mut self, offset: u64, bytes: &[u8]) -> Result<(), StoreError> {
        let len = (bytes.len() as u64).next_multiple_of(self.block_size());
        let scratch = self.scratch_of(len as usize)?;
        {
            let s = self.scratch.as_mut().expect("scratch");
            let b = s.as_bytes_mut();
            b[..bytes.len()].copy_from_slice(bytes);
            b[bytes.len()..len as usize].fill(0);
        }
        self.transfer(&[MediumIo {
            raw: &scratch,
            buf_offset: 0,
            offset,
            len,
            write: true,
        }])
    }

    /// The scratch buffer, grown to `len` bytes.
    fn scratch_of(&mut self, len: usize) -> Result<Arc<RawAlloc>, StoreError> {
        if self.scratch.as_ref().is_none_or(|s| s.capacity() < len) {
            // The old one's mapping stays until drop (unmapping needs the queue gone).
            self.scratch = Some(IoBuffer::new(len.next_multiple_of(1 << 16))?);
        }
        Ok(self.scratch.as_ref().expect("scratch").raw().clone())
    }

    /// Flush: everything written so far is durable when this returns.
    pub(crate) fn sync(&mut self) -> Result<(), StoreError> {
        let Some(cid) = self.pair.push(Sqe::flush(self.namespace)) else {
            return Err(StoreError::InvalidSpec("flush with a full queue".into()));
        };
        self.pair.ring_sq();
        let start = Instant::now();
        loop {
            if let Some(done) = self.pair.poll() {
                self.pair.ring_cq();
                let (slot, cqe) = done.map_err(|e| StoreError::Protocol {
                    path: self.label.clone(),
                    message: e.to_string(),
                })?;
                debug_assert_eq!(slot, cid);
                if cqe.status().is_success() {
                    return Ok(());
                }
                return Err(StoreError::Command {
                    path: self.label.clone(),
                    region_offset: 0,
                    error: legend_nvme_protocol::CommandError::new(
                        &Sqe::flush(self.namespace),
                        cqe.status(),
                    ),
                });
            }
            if start.elapsed() > self.timeout {
                return Err(self.give_up(1));
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for NvmeQueues {
    fn drop(&mut self) {
        if self.broken.is_none()
            && let Err(e) = self.ctrl.delete_queue_pair(self.qid)
        {
            // The memory stays mapped (and allocated: leaked) rather than freed under a queue
            // the controller may still use.
            tracing::error!(label = %self.label.display(), error = &e as &dyn std::error::Error, "deleting queue pair {}; leaking its memory", self.qid);
            std::mem::forget(std::mem::take(&mut self.mapped));
            let rings = std::mem::replace(&mut self.rings, IoBuffer::new(1).expect("small buffer"));
            std::mem::forget(rings);
            return;
        }
        // Another queue pair on the controller (another store of this process) makes the
        // controller refuse: the memory then stays allocated, since it stays mapped.
        for m in self.mapped.drain(..) {
            if self.ctrl.unmap(m.mapping.handle).is_err() {
                std::mem::forget(m.raw);
            }
        }
        if self.ctrl.unmap(self.rings_map.handle).is_err() {
            std::mem::forget(self.rings.raw().clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(bus_addrs: Vec<u64>) -> Mapping {
        Mapping {
            handle: 1,
            page_size: uapi::HOST_PAGE_SIZE,
            bus_addrs,
        }
    }

    #[test]
    fn deep_rings_need_consecutive_bus_addresses_and_list_pages_do_not() {
        // 1024 entries: a 16-page SQ and a 4-page CQ, then the PRP list pages.
        let layout = QueueLayout::new(1024);
        let rings = layout.list_offset(0) / 4096;
        let mut bus: Vec<u64> = (0..layout.bytes() as u64 / 4096)
            .map(|i| 0x10_0000 + i * 4096)
            .collect();
        // A list page elsewhere does not matter.
        bus[rings + 3] = 0x9000;
        assert!(rings_contiguous(&layout, &mapping(bus.clone())));
        // A CQ page elsewhere does (physical pages without an IOMMU).
        bus[rings - 1] = 0x9000;
        assert!(!rings_contiguous(&layout, &mapping(bus)));
    }
}
