// SPDX-License-Identifier: GPL-2.0-only

//! One NVMe controller: bring-up, identification, and the per-file resources (mappings, I/O
//! queue pairs, doorbell mappings) that userspace creates through the character device.
//!
//! # Locking
//!
//! All mutable state sits in [`Controller::state`], one mutex: admin commands are issued one at a
//! time under it, and every ioctl takes it, so concurrent ioctls are serialised. Unbind takes it
//! too and leaves [`State::live`] empty, after which every operation fails with `ENODEV`.
//!
//! # Lifetime
//!
//! A [`Controller`] is shared (`Arc`) by the PCI driver data and by every open file, so it may
//! outlive the binding; everything that needs the bound device (the BAR, DMA mappings, admin
//! memory) is dropped by [`Controller::shutdown`] during unbind.

use core::sync::atomic::{
    AtomicU32,
    AtomicU64,
    Ordering, //
};

use kernel::{
    bindings,
    device,
    io::{
        poll::read_poll_timeout,
        Io, //
    },
    new_mutex,
    pci,
    prelude::*,
    sync::{
        aref::ARef,
        Arc,
        Mutex, //
    },
    time::Delta, //
};

use crate::{
    admin::{
        self,
        AdminQueue,
        Command, //
    },
    mapping::{
        HostPages,
        MAX_HOST_PAGES, //
    },
    p2p::{
        GpuPages,
        Revoker, //
    },
    regs,
    uapi, //
};

pub(crate) type Bar0<'a> = pci::Bar<'a, { regs::BAR0_MIN }>;
type DevresBar0 = pci::DevresBar<{ regs::BAR0_MIN }>;

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_zap_file(file: *mut bindings::file);
    fn legend_shim_pci_address(
        dev: *mut bindings::device,
        domain: *mut u32,
        bus: *mut u8,
        devfn: *mut u8,
    );
}

const OPC_DELETE_SQ: u8 = 0x00;
const OPC_CREATE_SQ: u8 = 0x01;
const OPC_DELETE_CQ: u8 = 0x04;
const OPC_CREATE_CQ: u8 = 0x05;
const OPC_SET_FEATURES: u8 = 0x09;
const FEAT_NUM_QUEUES: u32 = 0x07;

/// I/O queue pairs the driver asks for; more than a GPU-driven pipeline uses.
const WANTED_QUEUE_PAIRS: u32 = 64;

/// Identifies an open file: the address of its pinned state, unique while it is open.
pub(crate) type Owner = usize;

/// The resources that exist only while the device is bound.
struct Live {
    bar: DevresBar0,
    admin: AdminQueue,
}

/// Most 64 KiB pages one GPU mapping may pin (64 GiB).
const MAX_GPU_PAGES: u64 = 1 << 20;

/// Memory behind a mapping.
enum Memory {
    Host(HostPages),
    Gpu(GpuPages),
}

impl Memory {
    fn bus_addrs(&self) -> &[u64] {
        match self {
            Self::Host(p) => p.bus_addrs(),
            Self::Gpu(p) => p.bus_addrs(),
        }
    }

    /// Bytes covered by one entry of [`Memory::bus_addrs`].
    fn page_size(&self) -> u32 {
        match self {
            Self::Host(_) => uapi::HOST_PAGE_SIZE,
            Self::Gpu(_) => uapi::GPU_PAGE_SIZE,
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Host(p) => p.len(),
            Self::Gpu(p) => p.len(),
        }
    }
}

/// A [`uapi::MapArgs`] mapping.
///
/// Dropping one may call into the NVIDIA driver, which may wait for its free callback, which
/// takes the state lock: mappings are dropped only after the state lock is released.
struct Mapping {
    owner: Owner,
    handle: u32,
    memory: Memory,
    /// NVIDIA freed the GPU memory ([`Revoker::revoke`]); no longer counted or usable.
    revoked: bool,
}

/// An I/O queue pair created through [`uapi::IOCTL_CREATE_QUEUE_PAIR`].
struct QueuePair {
    owner: Owner,
    qid: u32,
}

/// A file with a doorbell mapping; its pointer is valid while the file is open, and the file
/// removes itself (see [`Controller::release`]) before it is freed.
struct MappedFile {
    owner: Owner,
    file: *mut bindings::file,
}

pub(crate) struct State {
    live: Option<Live>,
    maps: KVec<Mapping>,
    queues: KVec<QueuePair>,
    mmaps: KVec<MappedFile>,
    next_handle: u32,
}

// SAFETY: the raw `file` pointers are only dereferenced (by the C shim) under the state mutex
// while the file is open, which is the case on any thread.
unsafe impl Send for State {}

/// Counters exported through sysfs.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) queue_pairs: AtomicU32,
    pub(crate) bytes_pinned: AtomicU64,
    pub(crate) admin_commands: AtomicU64,
}

/// An NVMe controller bound to `legend_nvme`.
#[pin_data]
pub(crate) struct Controller {
    pdev: ARef<pci::Device>,
    info: uapi::Info,
    /// Physical address of the first doorbell, the start of the doorbell `mmap`.
    doorbell_phys: u64,
    /// CAP.TO in milliseconds.
    timeout_ms: i64,
    pub(crate) stats: Stats,
    #[pin]
    state: Mutex<State>,
}

/// Capabilities read from CAP during bring-up.
struct Caps {
    mqes: u32,
    stride: usize,
    timeout_ms: i64,
    mpsmin: u32,
}

fn wait_ready(bar: &Bar0<'_>, ready: bool, timeout_ms: i64) -> Result {
    // TIMEOUT: CAP.TO is the controller's own worst case for CSTS.RDY to follow CC.EN.
    read_poll_timeout(
        || Ok(bar.read(regs::CSTS)),
        |csts| csts.rdy() == ready || csts.cfs(),
        Delta::from_millis(1),
        Delta::from_millis(timeout_ms),
    )
    .and_then(|csts| if csts.cfs() { Err(EIO) } else { Ok(()) })
}

fn disable(bar: &Bar0<'_>, timeout_ms: i64) -> Result {
    let cc = bar.read(regs::CC);
    bar.write_reg(cc.with_en(false));
    wait_ready(bar, false, timeout_ms)
}

fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn le64(b: &[u8], off: usize) -> u64 {
    u64::from(le32(b, off)) | (u64::from(le32(b, off + 4)) << 32)
}

impl Controller {
    /// Brings the controller up and identifies it.
    pub(crate) fn probe(pdev: &pci::Device<device::Core<'_>>) -> Result<Arc<Self>> {
        pdev.enable_device_mem()?;
        pdev.set_master();
        // SAFETY: probe runs before any DMA allocation or mapping for this device exists.
        unsafe {
            kernel::dma::Device::dma_set_mask_and_coherent(pdev, kernel::dma::DmaMask::new::<64>())?
        };
        let bar = pdev
            .iomap_region_sized::<{ regs::BAR0_MIN }>(0, c"legend_nvme")
            .inspect_err(|_| dev_err!(pdev, "cannot map BAR0\n"))?;
        let bar_len = usize::try_from(pdev.resource_len(0)?)?;

        let (lo, hi) = (bar.read(regs::CAP_LO), bar.read(regs::CAP_HI));
        let caps = Caps {
            mqes: lo.mqes().get() + 1,
            stride: 4usize << hi.dstrd().get(),
            // CAP.TO counts 500 ms units; one more unit covers TO = 0.
            timeout_ms: (i64::from(lo.to().get()) + 1) * 500,
            mpsmin: hi.mpsmin().get(),
        };
        if caps.mpsmin != 0 {
            dev_err!(pdev, "controller does not support 4 KiB pages\n");
            return Err(ENODEV);
        }
        let mut admin = AdminQueue::new(pdev.as_ref(), caps.stride)?;
        let mut info =
            Self::bring_up(pdev, &bar, &mut admin, &caps, bar_len).inspect_err(|_| {
                // The controller must not keep using admin memory that is about to be freed.
                let _ = disable(&bar, caps.timeout_ms);
            })?;

        let (mut domain, mut bus, mut devfn) = (0u32, 0u8, 0u8);
        // SAFETY: `pdev` is a valid, bound PCI device.
        unsafe {
            legend_shim_pci_address(
                crate::mapping::raw_device(pdev.as_ref()),
                &mut domain,
                &mut bus,
                &mut devfn,
            )
        };
        info.pci_domain = domain;
        info.pci_bus = bus;
        info.pci_device = devfn >> 3;
        info.pci_function = devfn & 7;
        let doorbell_phys = pdev.resource_start(0)? + regs::DOORBELLS as u64;
        let bar = bar.into_devres()?;
        let pdev_ref: &pci::Device = pdev;
        Arc::pin_init(
            try_pin_init!(Self {
                pdev: pdev_ref.into(),
                info,
                doorbell_phys,
                timeout_ms: caps.timeout_ms,
                stats: Stats::default(),
                state <- new_mutex!(State {
                    live: Some(Live { bar, admin }),
                    maps: KVec::new(),
                    queues: KVec::new(),
                    mmaps: KVec::new(),
                    next_handle: 1,
                }),
            }),
            GFP_KERNEL,
        )
    }

    /// Resets and enables the controller with the admin queue, then identifies it.
    fn bring_up(
        pdev: &pci::Device<device::Core<'_>>,
        bar: &Bar0<'_>,
        admin: &mut AdminQueue,
        caps: &Caps,
        bar_len: usize,
    ) -> Result<uapi::Info> {
        disable(bar, caps.timeout_ms)
            .inspect_err(|_| dev_err!(pdev, "controller did not disable within CAP.TO\n"))?;
        const Q: u32 = admin::DEPTH as u32 - 1;
        bar.write_reg(
            regs::AQA::zeroed()
                .with_const_asqs::<Q>()
                .with_const_acqs::<Q>(),
        );
        // CAST: splitting the 64-bit addresses into dwords.
        let (sq, cq) = (admin.sq_dma(), admin.cq_dma());
        bar.write_reg(regs::ASQ_LO::zeroed().with_addr(sq as u32));
        bar.write_reg(regs::ASQ_HI::zeroed().with_addr((sq >> 32) as u32));
        bar.write_reg(regs::ACQ_LO::zeroed().with_addr(cq as u32));
        bar.write_reg(regs::ACQ_HI::zeroed().with_addr((cq >> 32) as u32));
        // 64-byte SQ entries, 16-byte CQ entries, 4 KiB pages, NVM command set.
        bar.write_reg(
            regs::CC::zeroed()
                .with_const_iosqes::<6>()
                .with_const_iocqes::<4>()
                .with_en(true),
        );
        wait_ready(bar, true, caps.timeout_ms)
            .inspect_err(|_| dev_err!(pdev, "controller did not become ready within CAP.TO\n"))?;

        let mut buf = KVec::from_elem(0u8, admin::DATA_LEN, GFP_KERNEL)?;
        let run = |admin: &mut AdminQueue, cmd: Command, what: &str| -> Result<u32> {
            let c = admin
                .submit(bar, &cmd)
                .inspect_err(|e| dev_err!(pdev, "{} failed: {:?}\n", what, e))?;
            if c.status != 0 {
                dev_err!(pdev, "{} failed with status {:#x}\n", what, c.status);
                return Err(EIO);
            }
            Ok(c.result)
        };

        // Identify Controller (CNS 1).
        let data = admin.data_dma();
        run(
            admin,
            Command {
                opcode: uapi::ADMIN_OPC_IDENTIFY,
                prp1: data,
                cdw: [1, 0, 0, 0, 0, 0],
                ..Default::default()
            },
            "Identify Controller",
        )?;
        admin.data(&mut buf);
        let mut info = uapi::Info {
            abi_version: uapi::ABI_VERSION,
            pci_domain: 0,
            pci_bus: 0,
            pci_device: 0,
            pci_function: 0,
            _pad0: 0,
            nvme_version: bar.read(regs::VS).value().get(),
            model: [0; 40],
            serial: [0; 20],
            firmware: [0; 8],
            max_queue_entries: caps.mqes,
            // CAST: the stride is at most 4 << 15.
            doorbell_stride: caps.stride as u32,
            max_transfer: match buf[77] {
                0 => 0,
                mdts => 4096u32.checked_shl(u32::from(mdts)).unwrap_or(u32::MAX),
            },
            queue_pairs: 0,
            doorbell_len: 0,
            num_namespaces: 0,
            _pad1: 0,
            namespaces: [uapi::NamespaceInfo::default(); uapi::MAX_NAMESPACES],
        };
        info.serial.copy_from_slice(&buf[4..24]);
        info.model.copy_from_slice(&buf[24..64]);
        info.firmware.copy_from_slice(&buf[64..72]);

        // Active Namespace ID list (CNS 2), then Identify Namespace (CNS 0) for each.
        run(
            admin,
            Command {
                opcode: uapi::ADMIN_OPC_IDENTIFY,
                prp1: data,
                cdw: [2, 0, 0, 0, 0, 0],
                ..Default::default()
            },
            "Identify active namespaces",
        )?;
        admin.data(&mut buf);
        let mut nsids = [0u32; uapi::MAX_NAMESPACES];
        let mut count = 0;
        for (i, slot) in nsids.iter_mut().enumerate() {
            let nsid = le32(&buf, i * 4);
            if nsid == 0 {
                break;
            }
            *slot = nsid;
            count += 1;
        }
        for (i, &nsid) in nsids[..count].iter().enumerate() {
            run(
                admin,
                Command {
                    opcode: uapi::ADMIN_OPC_IDENTIFY,
                    nsid,
                    prp1: data,
                    ..Default::default()
                },
                "Identify Namespace",
            )?;
            admin.data(&mut buf);
            let lbaf = usize::from(buf[26] & 0xf);
            info.namespaces[i] = uapi::NamespaceInfo {
                nsid,
                lba_shift: (le32(&buf, 128 + 4 * lbaf) >> 16) & 0xff,
                blocks: le64(&buf, 0),
            };
        }
        // CAST: `count <= MAX_NAMESPACES`.
        info.num_namespaces = count as u32;

        // Set Features, Number of Queues: both counts are zero based.
        let want = WANTED_QUEUE_PAIRS - 1;
        let granted = run(
            admin,
            Command {
                opcode: OPC_SET_FEATURES,
                cdw: [FEAT_NUM_QUEUES, (want << 16) | want, 0, 0, 0, 0],
                ..Default::default()
            },
            "Set Features (number of queues)",
        )?;
        let mut pairs = (granted & 0xffff).min(granted >> 16).min(want) + 1;
        // Doorbells of qid 0..=pairs must fit in BAR0.
        let room = (bar_len.saturating_sub(regs::DOORBELLS) / (2 * caps.stride)).saturating_sub(1);
        pairs = pairs.min(u32::try_from(room).unwrap_or(u32::MAX));
        info.queue_pairs = pairs;
        let db_bytes = (pairs as usize + 1) * 2 * caps.stride;
        // CAST: bounded by the BAR length checked above.
        info.doorbell_len = db_bytes
            .next_multiple_of(uapi::HOST_PAGE_SIZE as usize)
            .min(bar_len - regs::DOORBELLS) as u32;
        dev_info!(
            pdev,
            "NVMe {}.{}, {} I/O queue pairs, {} namespaces, MQES {}\n",
            info.nvme_version >> 16,
            (info.nvme_version >> 8) & 0xff,
            pairs,
            count,
            caps.mqes
        );
        Ok(info)
    }

    pub(crate) fn info(&self) -> &uapi::Info {
        &self.info
    }

    pub(crate) fn doorbell_phys(&self) -> u64 {
        self.doorbell_phys
    }

    pub(crate) fn dev(&self) -> &device::Device {
        self.pdev.as_ref()
    }

    fn live<'a>(state: &'a mut State) -> Result<&'a mut Live> {
        state.live.as_mut().ok_or(ENODEV)
    }

    /// Runs an admin command, counting it.
    fn admin(&self, live: &mut Live, cmd: &Command) -> Result<admin::Completion> {
        self.stats.admin_commands.fetch_add(1, Ordering::Relaxed);
        // SAFETY: a `Live` exists only while the device is bound: `shutdown` takes it, under the
        // state lock that the caller holds, before unbind completes.
        let dev = unsafe { self.dev().as_bound() };
        let Live { bar, admin } = live;
        // `access` rather than `try_access`: polling sleeps, which an RCU read section forbids.
        admin.submit(bar.access(dev)?, cmd)
    }

    /// Pins `args.len` bytes at `args.addr` for `owner` and returns the mapping's handle, its page
    /// size and its bus addresses.
    ///
    /// # Errors
    ///
    /// `EINVAL` for bad arguments, `E2BIG` above [`MAX_HOST_PAGES`] or [`MAX_GPU_PAGES`],
    /// `ENOSPC` for a short `bus_addrs` array, `ENODEV` after unbind, `ENXIO` if NVIDIA freed the
    /// GPU memory while it was being mapped, plus [`HostPages::pin`]'s and [`GpuPages::pin`]'s.
    pub(crate) fn map(
        this: &Arc<Self>,
        owner: Owner,
        args: &uapi::MapArgs,
    ) -> Result<(u32, u32, KVec<u64>)> {
        if args.flags != 0 {
            return Err(EINVAL);
        }
        let (page, max) = match args.kind {
            uapi::MAP_KIND_HOST => (uapi::HOST_PAGE_SIZE, MAX_HOST_PAGES as u64),
            uapi::MAP_KIND_GPU => (uapi::GPU_PAGE_SIZE, MAX_GPU_PAGES),
            _ => return Err(EINVAL),
        };
        let page = u64::from(page);
        if args.len == 0 || args.len % page != 0 || args.addr % page != 0 {
            return Err(EINVAL);
        }
        args.addr.checked_add(args.len).ok_or(EINVAL)?;
        let npages = args.len / page;
        if npages > max {
            return Err(E2BIG);
        }
        if u64::from(args.bus_addrs_cap) < npages {
            return Err(ENOSPC);
        }
        let memory = if args.kind == uapi::MAP_KIND_HOST {
            let guard = this.state.lock();
            if guard.live.is_none() {
                return Err(ENODEV);
            }
            // SAFETY: `live` is `Some`, so unbind has not run `shutdown` yet, which it does
            // under this lock before the device is unbound; the reference does not outlive the
            // guard.
            let dev = unsafe { this.dev().as_bound() };
            // CAST: `npages <= MAX_HOST_PAGES`.
            Memory::Host(HostPages::pin(dev, args.addr, npages as usize)?)
        } else {
            let handle = this.new_handle()?;
            let revoker: Arc<dyn Revoker> = this.clone();
            // Without the state lock: NVIDIA may run a free callback meanwhile, which takes it.
            let gpu = GpuPages::pin(&this.pdev, args.addr, args.len, revoker, owner, handle)?;
            return this.insert(owner, handle, Memory::Gpu(gpu));
        };
        let handle = this.new_handle()?;
        this.insert(owner, handle, memory)
    }

    /// Allocates a mapping handle.
    fn new_handle(&self) -> Result<u32> {
        let mut state = self.state.lock();
        let handle = state.next_handle;
        state.next_handle = handle.checked_add(1).ok_or(ENOSPC)?;
        Ok(handle)
    }

    /// Records a new mapping; on failure it is dropped after the state lock is released.
    fn insert(&self, owner: Owner, handle: u32, memory: Memory) -> Result<(u32, u32, KVec<u64>)> {
        let mut bus = KVec::with_capacity(memory.bus_addrs().len(), GFP_KERNEL)?;
        bus.extend_from_slice(memory.bus_addrs(), GFP_KERNEL)?;
        let page_size = memory.page_size();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if state.live.is_none() {
            drop(guard);
            drop(memory);
            return Err(ENODEV);
        }
        // Under the state lock, a free callback that has not revoked the memory yet will find
        // the mapping once it is recorded.
        if let Memory::Gpu(g) = &memory {
            if g.revoked() {
                drop(guard);
                drop(memory);
                return Err(ENXIO);
            }
        }
        if let Err(e) = state.maps.reserve(1, GFP_KERNEL) {
            drop(guard);
            drop(memory);
            return Err(e.into());
        }
        self.stats
            .bytes_pinned
            .fetch_add(memory.len() as u64, Ordering::Relaxed);
        state.maps.push(
            Mapping {
                owner,
                handle,
                memory,
                revoked: false,
            },
            GFP_KERNEL,
        )?;
        Ok((handle, page_size, bus))
    }

    /// Releases mapping `handle` of `owner`.
    ///
    /// Refused while `owner` has any queue pair, not only one whose SQ or CQ lies in the mapping:
    /// commands already submitted may carry PRPs (data buffers, PRP lists) that point into any of
    /// the owner's mappings, and the driver never sees them, so it cannot tell which memory the
    /// controller may still write. Deleting the queue pairs is what stops that: Delete I/O SQ
    /// completes only after the controller has completed or aborted the SQ's commands. The
    /// alternative, deleting the owner's queues here before unmapping, would silently tear down
    /// queues the process is still polling; refusing changes nothing and tells it to delete
    /// them first. A mapping NVIDIA already freed ([`Revoker::revoke`], which deleted the owner's
    /// queues at that time) holds nothing the device could reach, and may always be forgotten.
    ///
    /// # Errors
    ///
    /// `ENOENT` if `owner` has no such mapping, `EBUSY` while `owner` has a queue pair.
    pub(crate) fn unmap(&self, owner: Owner, handle: u32) -> Result {
        let m = self.take_mapping(owner, handle)?;
        // Dropped here, after the state lock is released.
        drop(m);
        Ok(())
    }

    fn take_mapping(&self, owner: Owner, handle: u32) -> Result<Mapping> {
        let mut state = self.state.lock();
        let i = state
            .maps
            .iter()
            .position(|m| m.owner == owner && m.handle == handle)
            .ok_or(ENOENT)?;
        if !state.maps[i].revoked && state.queues.iter().any(|q| q.owner == owner) {
            return Err(EBUSY);
        }
        let m = state.maps.remove(i)?;
        if !m.revoked {
            self.stats
                .bytes_pinned
                .fetch_sub(m.memory.len() as u64, Ordering::Relaxed);
        }
        Ok(m)
    }

    /// Bus address of `bytes` at `offset` of mapping `handle`, which must be contiguous.
    ///
    /// # Errors
    ///
    /// `ENOENT` for an unknown handle, `ENXIO` if NVIDIA freed its memory, `EINVAL` otherwise.
    fn queue_memory(
        state: &State,
        owner: Owner,
        handle: u32,
        offset: u64,
        bytes: u64,
    ) -> Result<u64> {
        let m = state
            .maps
            .iter()
            .find(|m| m.owner == owner && m.handle == handle)
            .ok_or(ENOENT)?;
        if m.revoked {
            return Err(ENXIO);
        }
        let len = m.memory.len() as u64;
        if offset % u64::from(uapi::HOST_PAGE_SIZE) != 0
            || offset.checked_add(bytes).ok_or(EINVAL)? > len
        {
            return Err(EINVAL);
        }
        let page = u64::from(m.memory.page_size());
        let bus = m.memory.bus_addrs();
        // CAST: both indices are below the number of pages, which fits in a `usize`.
        let first = (offset / page) as usize;
        let last = ((offset + bytes - 1) / page) as usize;
        // NVMe queues in this driver are physically contiguous (PC = 1).
        for i in first..last {
            if bus[i + 1] != bus[i] + page {
                return Err(EINVAL);
            }
        }
        Ok(bus[first] + offset % page)
    }

    /// Creates I/O queue pair `args.qid` in memory of `owner`'s mappings.
    ///
    /// # Errors
    ///
    /// `EINVAL` for a bad qid, depth, offset or non-contiguous queue memory, `EBUSY` if the qid is
    /// in use, `ENOENT` for unknown handles, `EIO` if the controller refuses the command.
    pub(crate) fn create_queue_pair(
        &self,
        owner: Owner,
        args: &uapi::QueuePairArgs,
    ) -> Result<(u32, u32)> {
        if args.qid == 0
            || args.qid > self.info.queue_pairs
            || args.depth < 2
            || args.depth > self.info.max_queue_entries
        {
            return Err(EINVAL);
        }
        let mut guard = self.state.lock();
        let state = &mut *guard;
        Self::live(state)?;
        if state.queues.iter().any(|q| q.qid == args.qid) {
            return Err(EBUSY);
        }
        let depth = u64::from(args.depth);
        let sq = Self::queue_memory(state, owner, args.sq_handle, args.sq_offset, depth * 64)?;
        let cq = Self::queue_memory(state, owner, args.cq_handle, args.cq_offset, depth * 16)?;
        state.queues.reserve(1, GFP_KERNEL)?;
        let live = Self::live(state)?;
        let size_qid = ((args.depth - 1) << 16) | args.qid;
        // Polled queue: physically contiguous, interrupts disabled.
        let c = self.admin(
            live,
            &Command {
                opcode: OPC_CREATE_CQ,
                prp1: cq,
                cdw: [size_qid, 1, 0, 0, 0, 0],
                ..Default::default()
            },
        )?;
        if c.status != 0 {
            dev_err!(
                self.dev(),
                "Create I/O CQ {} failed with status {:#x}\n",
                args.qid,
                c.status
            );
            return Err(EIO);
        }
        let c = self.admin(
            live,
            &Command {
                opcode: OPC_CREATE_SQ,
                prp1: sq,
                cdw: [size_qid, (args.qid << 16) | 1, 0, 0, 0, 0],
                ..Default::default()
            },
        )?;
        if c.status != 0 {
            dev_err!(
                self.dev(),
                "Create I/O SQ {} failed with status {:#x}\n",
                args.qid,
                c.status
            );
            let _ = self.admin(
                live,
                &Command {
                    opcode: OPC_DELETE_CQ,
                    cdw: [args.qid, 0, 0, 0, 0, 0],
                    ..Default::default()
                },
            );
            return Err(EIO);
        }
        state.queues.push(
            QueuePair {
                owner,
                qid: args.qid,
            },
            GFP_KERNEL,
        )?;
        self.stats.queue_pairs.fetch_add(1, Ordering::Relaxed);
        let stride = self.info.doorbell_stride;
        Ok((2 * args.qid * stride, (2 * args.qid + 1) * stride))
    }

    /// Deletes a queue pair on the controller (SQ first, as the specification requires).
    fn delete_on_device(&self, live: &mut Live, qid: u32) {
        for opcode in [OPC_DELETE_SQ, OPC_DELETE_CQ] {
            match self.admin(
                live,
                &Command {
                    opcode,
                    cdw: [qid, 0, 0, 0, 0, 0],
                    ..Default::default()
                },
            ) {
                Ok(c) if c.status == 0 => {}
                Ok(c) => dev_warn!(
                    self.dev(),
                    "deleting queue {} failed with status {:#x}\n",
                    qid,
                    c.status
                ),
                Err(e) => dev_warn!(self.dev(), "deleting queue {} failed: {:?}\n", qid, e),
            }
        }
        self.stats.queue_pairs.fetch_sub(1, Ordering::Relaxed);
    }

    /// Deletes queue pair `qid` of `owner`.
    ///
    /// # Errors
    ///
    /// `ENOENT` if `owner` has no such queue pair.
    pub(crate) fn delete_queue_pair(&self, owner: Owner, qid: u32) -> Result {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let i = state
            .queues
            .iter()
            .position(|q| q.owner == owner && q.qid == qid)
            .ok_or(ENOENT)?;
        state.queues.remove(i)?;
        if let Some(live) = state.live.as_mut() {
            self.delete_on_device(live, qid);
        }
        Ok(())
    }

    /// Runs an allowed admin command with a kernel buffer of `data.len()` bytes.
    ///
    /// # Errors
    ///
    /// `EPERM` for other commands or log pages, `EINVAL` for a bad length.
    pub(crate) fn admin_passthrough(
        &self,
        args: &uapi::AdminArgs,
        data: &mut [u8],
    ) -> Result<admin::Completion> {
        match args.opcode {
            uapi::ADMIN_OPC_IDENTIFY => {}
            uapi::ADMIN_OPC_GET_LOG_PAGE if (args.cdw[0] & 0xff) as u8 == uapi::LOG_ID_SMART => {}
            _ => return Err(EPERM),
        }
        if data.is_empty() || data.len() > admin::DATA_LEN {
            return Err(EINVAL);
        }
        let mut cdw = args.cdw;
        if args.opcode == uapi::ADMIN_OPC_GET_LOG_PAGE {
            // Number of dwords (zero based) follows the buffer, not the caller's value.
            // CAST: at most 1024 dwords.
            cdw[0] = (cdw[0] & 0xffff) | ((((data.len() + 3) / 4 - 1) as u32) << 16);
            cdw[1] = 0;
        }
        let mut guard = self.state.lock();
        let live = Self::live(&mut guard)?;
        let prp1 = live.admin.data_dma();
        let c = self.admin(
            live,
            &Command {
                opcode: args.opcode,
                nsid: args.nsid,
                prp1,
                cdw,
            },
        )?;
        live.admin.data(data);
        Ok(c)
    }

    /// Records that `file` maps the doorbells, so unbind can revoke the mapping.
    pub(crate) fn add_mmap(&self, owner: Owner, file: *mut bindings::file) -> Result {
        let mut state = self.state.lock();
        Self::live(&mut state)?;
        if !state.mmaps.iter().any(|m| m.owner == owner) {
            state.mmaps.push(MappedFile { owner, file }, GFP_KERNEL)?;
        }
        Ok(())
    }

    /// Releases everything `owner` created; called when its file is closed.
    pub(crate) fn release(&self, owner: Owner) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        self.delete_queues_of(state, owner);
        // Queues are gone, so the device no longer accesses the mappings. They are dropped
        // after the lock is released (see `Mapping`).
        let mut gone = KVec::new();
        let mut i = 0;
        while i < state.maps.len() {
            if state.maps[i].owner != owner {
                i += 1;
                continue;
            }
            if gone.reserve(1, GFP_KERNEL).is_err() {
                // Out of memory: drop this one under the lock rather than leak it.
                let _ = state.maps.remove(i);
                continue;
            }
            if let Ok(m) = state.maps.remove(i) {
                if !m.revoked {
                    self.stats
                        .bytes_pinned
                        .fetch_sub(m.memory.len() as u64, Ordering::Relaxed);
                }
                let _ = gone.push(m, GFP_KERNEL);
            }
        }
        state.mmaps.retain(|m| m.owner != owner);
        drop(guard);
        drop(gone);
    }

    /// Deletes every queue pair of `owner` on the device.
    fn delete_queues_of(&self, state: &mut State, owner: Owner) {
        while let Some(i) = state.queues.iter().position(|q| q.owner == owner) {
            if let Ok(q) = state.queues.remove(i) {
                if let Some(live) = state.live.as_mut() {
                    self.delete_on_device(live, q.qid);
                }
            }
        }
    }

    /// Quiesces the controller and drops every resource that needs the bound device; called from
    /// unbind. Open files keep working objects that answer `ENODEV`.
    pub(crate) fn shutdown(&self) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(mut live) = state.live.take() else {
            return;
        };
        while let Some(q) = state.queues.pop() {
            self.delete_on_device(&mut live, q.qid);
        }
        for m in state.mmaps.iter() {
            // SAFETY: `file` is open: it leaves `mmaps` in `release` before it is freed, and
            // that needs this lock.
            unsafe { legend_shim_zap_file(m.file) };
        }
        state.mmaps.clear();
        // SAFETY: called from unbind, so the device is still bound.
        let dev = unsafe { self.dev().as_bound() };
        if live
            .bar
            .access(dev)
            .and_then(|bar| disable(bar, self.timeout_ms))
            .is_err()
        {
            dev_warn!(self.dev(), "controller did not disable cleanly\n");
        }
        self.stats.bytes_pinned.store(0, Ordering::Relaxed);
        let maps = core::mem::take(&mut state.maps);
        // Still bound (this is unbind), and the lock is released first (see `Mapping`).
        drop(guard);
        drop(maps);
    }
}

impl Revoker for Controller {
    fn revoke(&self, owner: Owner, handle: u32) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        // Any queue of the owner may have commands pointing into the memory.
        self.delete_queues_of(state, owner);
        if let Some(m) = state
            .maps
            .iter_mut()
            .find(|m| m.owner == owner && m.handle == handle && !m.revoked)
        {
            m.revoked = true;
            self.stats
                .bytes_pinned
                .fetch_sub(m.memory.len() as u64, Ordering::Relaxed);
        }
        dev_warn!(
            self.dev(),
            "NVIDIA freed the GPU memory of mapping {}: deleted its owner's queue pairs\n",
            handle
        );
    }
}
