//! A userspace NVMe controller: the `proxy` storage backend and the GPU I/O kernels' peer on
//! machines without a bindable SSD (the GPU machines, cloud VMs with virtual disks).
//!
//! A [`Proxy`] serves I/O queue pairs exactly as `legend_nvme` hands them out (it implements
//! [`legend_nvme::Controller`]): the user maps memory, creates queue pairs whose rings live in
//! its own memory, and rings doorbells, which here are words of a page the proxy polls. Its
//! controller threads fetch the commands, runs them against a file or block device with
//! `io_uring` (`O_DIRECT` where the file system allows it), moves their data to and from the
//! memory their PRPs name (host memory directly, GPU memory through a [`DeviceMemory`], the
//! GPU's copy engine) and posts completions with phase tags. Several controller threads share
//! the queues out between them (queue `q` to thread `q % threads`), as a controller's engines
//! do, so one busy queue does not hold up the others. The only difference a queue user
//! sees from a real controller is where the rings and doorbells are.
//!
//! Locks: each thread's queues have a lock of their own (a shard), which only the API's queue
//! calls contend for, and the address space a read-write lock the threads share for reading
//! while they move data; a shard's lock is taken before the space's, never after, and `unmap`
//! takes every shard's (in order) before the space's.
//!
//! Faults can be injected ([`Faults`]): error statuses by LBA range or command count, a delay
//! before each completion, lost doorbell writes.

mod memory;
mod model;
mod service;

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use legend_fs::{Access, Dir};
use legend_nvme::{Controller, DeviceMemory, Doorbells, Mapping, QueuePairDoorbells, uapi};
use legend_nvme_protocol::{Cqe, MAX_DEPTH, Sqe, Status};

use memory::{AddressSpace, Kind, Region};
use model::DeviceClock;
pub use model::{DeviceModel, ModelError};
use service::{Queue, Service, lock, read, write};

/// Faults the proxy injects; change them at any time with [`Proxy::set_faults`].
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Reads and writes touching these LBAs complete with this status.
    pub fail_lbas: Option<(Range<u64>, Status)>,
    /// Every n-th command fetched (counting from 1) completes with this status.
    pub fail_every: Option<(u64, Status)>,
    /// Each completion is posted no earlier than this after its command was fetched.
    pub delay: Duration,
    /// SQ tail doorbell writes to lose: the proxy acts as if it had not seen them (until the
    /// queue's doorbell is written again).
    pub lose_doorbells: u32,
    /// Post the completions of commands done together newest first, as a controller whose
    /// later commands overtake earlier ones does (a lone command waits 2 ms for others).
    pub reverse_completions: bool,
}

/// How a proxy presents itself.
#[derive(Clone, Debug)]
pub struct ProxyOptions {
    /// log2 of the LBA size: 9 (512 B) or 12 (4 KiB).
    pub lba_shift: u32,
    /// First byte of the backing file the namespace starts at, in LBAs.
    pub start_lba: u64,
    /// Blocks of the namespace; `None`: what fits in the file after `start_lba`.
    pub blocks: Option<u64>,
    /// Largest transfer of one command, in bytes (MDTS).
    pub max_transfer: u32,
    /// I/O queue pairs offered (qids `1..=queue_pairs`).
    pub queue_pairs: u16,
    /// Commands in flight against the file at once (bounce buffers of `max_transfer` each),
    /// shared out between the threads.
    pub io_depth: u16,
    /// Controller threads (each polls its share of the queues and runs their commands).
    pub threads: u16,
    /// Serve commands at a modelled SSD's rates and latency ([`DeviceModel`]) rather than as
    /// fast as the backing file allows.
    pub model: Option<DeviceModel>,
}

impl Default for ProxyOptions {
    fn default() -> Self {
        ProxyOptions {
            lba_shift: 9,
            start_lba: 0,
            blocks: None,
            max_transfer: 1 << 20,
            queue_pairs: 64,
            io_depth: 128,
            // A quarter of the cores, at most 4: enough to keep a fast SSD or the GPU's copy
            // engine busy, while the submitters and the training keep the rest.
            threads: std::thread::available_parallelism()
                .map_or(1, |n| (n.get() / 4).clamp(1, 4) as u16),
            model: None,
        }
    }
}

/// What the API and the controller thread share.
pub(crate) struct Shared {
    /// The queues, by controller thread: queue `q` in shard `q % shards.len()`.
    pub(crate) shards: Vec<Mutex<Vec<Queue>>>,
    /// What bus addresses name; written only by `map`, `unmap` and `attach_device`.
    pub(crate) space: RwLock<AddressSpace>,
    next_handle: AtomicU32,
    pub(crate) faults: Mutex<Faults>,
    doorbells: NonNull<u32>,
    pub(crate) lba_shift: u32,
    pub(crate) start_lba: u64,
    pub(crate) blocks: u64,
    pub(crate) max_transfer: u32,
    bounce: (usize, usize),
    /// Commands fetched so far, by all threads (`Faults::fail_every` counts them).
    pub(crate) commands: AtomicU64,
    /// I/O queue pairs created so far (deleted ones included).
    pairs_created: AtomicU64,
    /// The modelled device's budgets, shared by all threads.
    pub(crate) clock: Option<Mutex<DeviceClock>>,
}

// SAFETY: the doorbell page and bounce buffers are plain memory owned by the proxy, written by
// the queue users and read by the controller thread with volatile accesses.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// Bytes of the doorbell page.
const DOORBELL_PAGE: usize = 4096;

impl Shared {
    /// The doorbell word `index` (2 qid for the SQ tail, 2 qid + 1 for the CQ head).
    pub(crate) fn doorbell(&self, index: u16) -> *mut u32 {
        // SAFETY: indices stay below 2 (queue_pairs + 1) <= 1024 words of the page (checked
        // at open).
        unsafe { self.doorbells.as_ptr().add(usize::from(index)) }
    }

    /// The shard queue `qid` belongs to.
    fn shard(&self, qid: u16) -> &Mutex<Vec<Queue>> {
        &self.shards[usize::from(qid) % self.shards.len()]
    }
}

/// Anonymous page-aligned memory, zeroed, released on drop.
struct Pages {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain memory.
unsafe impl Send for Pages {}
// SAFETY: plain memory.
unsafe impl Sync for Pages {}

impl Pages {
    fn new(len: usize) -> io::Result<Pages> {
        // SAFETY: a fresh anonymous mapping; checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Pages {
            ptr: NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?,
            len,
        })
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A proxy's I/O queue pairs ([`Proxy::queue_pairs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuePairCount {
    /// Created since the proxy started.
    pub created: u64,
    /// Existing now.
    pub live: u64,
}

/// A userspace NVMe controller over a file or block device. Dropping it stops the controller
/// threads once the commands in flight are done.
pub struct Proxy {
    label: String,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    info: uapi::Info,
    /// The doorbell page and the bounce buffers, released after the threads stopped.
    memory: Arc<(Pages, Pages)>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy").field("label", &self.label).finish()
    }
}

fn einval(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn errno(op: &'static str, code: i32) -> legend_nvme::Error {
    legend_nvme::Error::Ioctl {
        op,
        source: io::Error::from_raw_os_error(code),
    }
}

impl Proxy {
    /// Starts a proxy controller over `path` (a regular file or block device, opened read-write
    /// with `O_DIRECT` where the file system allows it).
    ///
    /// # Errors
    ///
    /// The file cannot be opened or sized, or the options do not make a namespace (a file
    /// shorter than `start_lba` plus one block, an LBA size other than 512 B or 4 KiB, a
    /// transfer size that is not a multiple of the LBA size).
    pub fn open(path: &Path, opts: &ProxyOptions) -> io::Result<Proxy> {
        let (dir, name) = Dir::open_parent(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        Self::open_in(&dir, name, opts)
    }

    /// [`Proxy::open`] over the file `name` in `dir`, reached beneath it without following
    /// links (legend-fs): how a writer on someone else's behalf opens a backing file.
    ///
    /// # Errors
    ///
    /// As [`Proxy::open`].
    pub fn open_in(dir: &Dir, name: &Path, opts: &ProxyOptions) -> io::Result<Proxy> {
        let path = dir.join(name);
        let path = path.as_path();
        let label = format!("proxy of {}", path.display());
        if opts.lba_shift != 9 && opts.lba_shift != 12 {
            return Err(einval(format!(
                "{label}: LBA size 2^{} B (512 B or 4 KiB)",
                opts.lba_shift
            )));
        }
        let lba = 1u64 << opts.lba_shift;
        if opts.max_transfer == 0 || u64::from(opts.max_transfer) % lba != 0 {
            return Err(einval(format!(
                "{label}: max transfer {} B is not a multiple of the {lba} B LBA",
                opts.max_transfer
            )));
        }
        if opts.queue_pairs == 0 || 2 * (usize::from(opts.queue_pairs) + 1) * 4 > DOORBELL_PAGE {
            return Err(einval(format!(
                "{label}: {} queue pairs (1 to 511)",
                opts.queue_pairs
            )));
        }
        let open = |direct: bool| {
            if direct {
                dir.open_file_direct(name, Access::ReadWrite)
            } else {
                dir.open_file(name, Access::ReadWrite)
            }
        };
        let file = match open(true) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(false)?,
            Err(e) => return Err(io::Error::new(e.kind(), format!("{label}: {e}"))),
        };
        let bytes = file_size(&file)?;
        let fits = (bytes >> opts.lba_shift).saturating_sub(opts.start_lba);
        let blocks = opts.blocks.unwrap_or(fits);
        if blocks == 0 || blocks > fits {
            return Err(einval(format!(
                "{label}: {bytes} bytes hold {fits} blocks of {lba} B after LBA {}, not {blocks}",
                opts.start_lba
            )));
        }
        let threads = usize::from(opts.threads.clamp(1, opts.queue_pairs));
        let slots = usize::from(opts.io_depth).div_ceil(threads).max(1);
        let doorbells = Pages::new(DOORBELL_PAGE)?;
        let bounce = Pages::new(threads * slots * opts.max_transfer as usize)?;
        let shared = Arc::new(Shared {
            shards: (0..threads).map(|_| Mutex::new(Vec::new())).collect(),
            space: RwLock::new(AddressSpace::default()),
            next_handle: AtomicU32::new(1),
            faults: Mutex::new(Faults::default()),
            doorbells: doorbells.ptr.cast(),
            lba_shift: opts.lba_shift,
            start_lba: opts.start_lba,
            blocks,
            max_transfer: opts.max_transfer,
            bounce: (bounce.ptr.as_ptr() as usize, bounce.len),
            commands: AtomicU64::new(0),
            pairs_created: AtomicU64::new(0),
            clock: opts.model.map(|m| Mutex::new(DeviceClock::new(m))),
        });
        let info = info(opts, blocks, path);
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::with_capacity(threads);
        for shard in 0..threads {
            // SAFETY: each thread's slots are its own part of the bounce allocation.
            let bounce = unsafe {
                bounce
                    .ptr
                    .as_ptr()
                    .add(shard * slots * opts.max_transfer as usize)
            };
            let spawned = file.try_clone().and_then(|file| {
                let service = Service::new(shared.clone(), file, shard as u16, slots, bounce)?;
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("nvme-proxy-{shard}"))
                    .spawn(move || service.run(&stop))
            });
            match spawned {
                Ok(t) => workers.push(t),
                Err(e) => {
                    stop.store(true, Ordering::Release);
                    workers.into_iter().for_each(|t| drop(t.join()));
                    return Err(e);
                }
            }
        }
        tracing::debug!(%label, blocks, lba, "proxy controller started");
        Ok(Proxy {
            label,
            shared,
            stop,
            threads: workers,
            info,
            memory: Arc::new((doorbells, bounce)),
        })
    }

    /// Lets the proxy reach GPU memory (`map_gpu`) through `device`, and page-locks its bounce
    /// buffers with it.
    ///
    /// # Errors
    ///
    /// The device's error when pinning the bounce buffers.
    pub fn attach_device(&self, device: Arc<dyn DeviceMemory>) -> io::Result<()> {
        let mut space = write(&self.shared.space);
        if space.device.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{}: a GPU is attached already", self.label),
            ));
        }
        let (ptr, len) = self.shared.bounce;
        device.pin(ptr as *mut u8, len)?;
        space.device = Some(device);
        Ok(())
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, faults: Faults) {
        *lock(&self.shared.faults) = faults;
    }

    /// Its users' I/O queue pairs: how many were ever created, and how many exist now (what a
    /// reader that should open its queues once is checked by).
    pub fn queue_pairs(&self) -> QueuePairCount {
        QueuePairCount {
            created: self.shared.pairs_created.load(Ordering::Relaxed),
            live: self
                .shared
                .shards
                .iter()
                .map(|s| lock(s).len() as u64)
                .sum(),
        }
    }

    /// The namespace's size in blocks.
    pub fn blocks(&self) -> u64 {
        self.shared.blocks
    }

    /// The namespace's block (LBA) size in bytes.
    pub fn block_size(&self) -> u64 {
        1 << self.shared.lba_shift
    }

    fn map(&self, start: u64, len: usize, kind: Kind) -> legend_nvme::Result<Mapping> {
        let page = u64::from(match kind {
            Kind::Host => uapi::HOST_PAGE_SIZE,
            Kind::Gpu => uapi::GPU_PAGE_SIZE,
        });
        if len == 0 || !start.is_multiple_of(page) || !(len as u64).is_multiple_of(page) {
            return Err(errno("MAP", libc::EINVAL));
        }
        let mut space = write(&self.shared.space);
        if kind == Kind::Gpu && space.device.is_none() {
            return Err(errno("MAP", libc::EOPNOTSUPP));
        }
        let end = start + len as u64;
        if space
            .regions
            .iter()
            .any(|r| start < r.start + r.len && r.start < end)
        {
            // One bus address names one region.
            return Err(errno("MAP", libc::EEXIST));
        }
        let handle = self.shared.next_handle.fetch_add(1, Ordering::Relaxed);
        let region = Region {
            handle,
            start,
            len: len as u64,
            kind,
        };
        space.regions.push(region);
        Ok(Mapping {
            handle,
            page_size: region.page_size(),
            bus_addrs: (0..len as u64 / page).map(|i| start + i * page).collect(),
        })
    }
}

fn file_size(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    if meta.file_type().is_block_device() {
        use std::io::Seek;
        let mut f = file.try_clone()?;
        return f.seek(io::SeekFrom::End(0));
    }
    Ok(meta.len())
}

/// The identity a proxy reports.
fn info(opts: &ProxyOptions, blocks: u64, path: &Path) -> uapi::Info {
    let mut model = [b' '; 40];
    let name = b"Legend NVMe proxy";
    model[..name.len()].copy_from_slice(name);
    let mut serial = [b' '; 20];
    let tag = format!("{:016x}", fnv(path.to_string_lossy().as_bytes()));
    serial[..16].copy_from_slice(tag.as_bytes());
    let mut firmware = [b' '; 8];
    firmware[..5].copy_from_slice(b"0.1.0");
    let mut namespaces = [uapi::NamespaceInfo::default(); uapi::MAX_NAMESPACES];
    namespaces[0] = uapi::NamespaceInfo {
        nsid: 1,
        lba_shift: opts.lba_shift,
        blocks,
    };
    uapi::Info {
        abi_version: uapi::ABI_VERSION,
        pci_domain: 0,
        pci_bus: 0,
        pci_device: 0,
        pci_function: 0,
        _pad0: 0,
        nvme_version: 0x0002_0000,
        model,
        serial,
        firmware,
        max_queue_entries: u32::from(MAX_DEPTH),
        doorbell_stride: 4,
        max_transfer: opts.max_transfer,
        queue_pairs: u32::from(opts.queue_pairs),
        doorbell_len: DOORBELL_PAGE as u32,
        num_namespaces: 1,
        _pad1: 0,
        namespaces,
    }
}

/// FNV-1a, for a serial number that follows the backing path.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

impl Controller for Proxy {
    fn label(&self) -> &str {
        &self.label
    }

    fn info(&self) -> legend_nvme::Result<uapi::Info> {
        Ok(self.info)
    }

    unsafe fn map_host(&self, addr: *mut u8, len: usize) -> legend_nvme::Result<Mapping> {
        self.map(addr as u64, len, Kind::Host)
    }

    unsafe fn map_gpu(&self, addr: u64, len: usize) -> legend_nvme::Result<Mapping> {
        self.map(addr, len, Kind::Gpu)
    }

    fn unmap(&self, handle: u32) -> legend_nvme::Result<()> {
        // Every shard (no queue may be created on the region meanwhile), then the space.
        let shards: Vec<_> = self.shared.shards.iter().map(lock).collect();
        let mut space = write(&self.shared.space);
        let i = space
            .regions
            .iter()
            .position(|r| r.handle == handle)
            .ok_or(errno("UNMAP", libc::ENOENT))?;
        // A queue's rings may not go while it exists. Data buffers may: the controller threads
        // move data only under the space's read lock, after looking the address up, so a
        // command in flight that names an unmapped buffer fails with a Data Transfer Error
        // instead of reaching freed memory (what an IOMMU does for the kernel module's users).
        let region = space.regions[i];
        let inside = |p: u64| p >= region.start && p < region.start + region.len;
        if shards
            .iter()
            .flat_map(|s| s.iter())
            .any(|q| inside(q.sq as u64) || inside(q.cq as u64))
        {
            return Err(errno("UNMAP", libc::EBUSY));
        }
        space.regions.remove(i);
        Ok(())
    }

    fn create_queue_pair(
        &self,
        args: uapi::QueuePairArgs,
    ) -> legend_nvme::Result<QueuePairDoorbells> {
        let fail = |code| Err(errno("CREATE_QUEUE_PAIR", code));
        let depth = match u16::try_from(args.depth) {
            Ok(d) if (2..=MAX_DEPTH).contains(&d) => d,
            _ => return fail(libc::EINVAL),
        };
        let qid = match u16::try_from(args.qid) {
            Ok(q) if q >= 1 && u32::from(q) <= self.info.queue_pairs => q,
            _ => return fail(libc::EINVAL),
        };
        let mut queues = lock(self.shared.shard(qid));
        if queues.iter().any(|q| q.qid == qid) {
            return fail(libc::EBUSY);
        }
        let space = read(&self.shared.space);
        let ring = |handle: u32, offset: u64, bytes: u64| -> Option<u64> {
            let r = space.regions.iter().find(|r| r.handle == handle)?;
            (r.kind == Kind::Host
                && offset.is_multiple_of(4096)
                && offset.checked_add(bytes)? <= r.len)
                .then_some(r.start + offset)
        };
        let sq = ring(args.sq_handle, args.sq_offset, u64::from(depth) * 64);
        let cq = ring(args.cq_handle, args.cq_offset, u64::from(depth) * 16);
        let (Some(sq), Some(cq)) = (sq, cq) else {
            return fail(libc::EINVAL);
        };
        // Fresh doorbells: the CQ head and SQ tail start at 0.
        for i in [2 * qid, 2 * qid + 1] {
            // SAFETY: a doorbell word of the proxy's page.
            unsafe { self.shared.doorbell(i).write_volatile(0) };
        }
        queues.push(Queue::new(qid, depth, sq as *const Sqe, cq as *mut Cqe));
        self.shared.pairs_created.fetch_add(1, Ordering::Relaxed);
        let stride = self.info.doorbell_stride;
        Ok(QueuePairDoorbells {
            qid: u32::from(qid),
            sq_doorbell: 2 * u32::from(qid) * stride,
            cq_doorbell: (2 * u32::from(qid) + 1) * stride,
        })
    }

    fn delete_queue_pair(&self, qid: u32) -> legend_nvme::Result<()> {
        let Ok(qid) = u16::try_from(qid) else {
            return Err(errno("DELETE_QUEUE_PAIR", libc::ENOENT));
        };
        let shard = self.shared.shard(qid);
        {
            let mut queues = lock(shard);
            let q = queues
                .iter_mut()
                .find(|q| q.qid == qid)
                .ok_or(errno("DELETE_QUEUE_PAIR", libc::ENOENT))?;
            q.deleting = true;
        }
        // As Delete I/O SQ: returns once the queue's commands completed.
        loop {
            let mut queues = lock(shard);
            let i = queues
                .iter()
                .position(|q| q.qid == qid)
                .expect("marked above");
            if queues[i].idle() {
                queues.remove(i);
                return Ok(());
            }
            drop(queues);
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    fn queue_report(&self, qid: u32) -> Option<String> {
        let qid = u16::try_from(qid).ok()?;
        let queues = lock(self.shared.shard(qid));
        let q = queues.iter().find(|q| q.qid == qid)?;
        Some(q.report(&self.shared))
    }

    fn doorbells(&self) -> legend_nvme::Result<Doorbells> {
        let keep: Box<dyn Send + Sync> = Box::new(self.memory.clone());
        // SAFETY: the doorbell page is valid for writes while `keep` holds it.
        Ok(unsafe { Doorbells::shared(self.memory.0.ptr, DOORBELL_PAGE, keep) })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // The bounce buffers are freed once the last doorbell user lets go of them; no copy
        // runs through them any more, so the GPU's lock on them goes now.
        if let Some(device) = write(&self.shared.space).device.take()
            && let Err(e) = device.unpin(self.shared.bounce.0 as *mut u8)
        {
            tracing::warn!(label = %self.label, error = &e as &dyn std::error::Error, "proxy: unpinning the bounce buffers");
        }
    }
}
