// SPDX-License-Identifier: GPL-2.0-only

//! One NVMe controller: bring-up, identification, and the resources (mappings, I/O queue pairs,
//! the doorbell mapping) that its one writer creates through the character device.
//!
//! # Isolation
//!
//! The writer builds its own NVMe commands, so the controller DMAs wherever their PRPs point.
//! What keeps that inside the writer's own memory is the IOMMU: probe refuses a controller that
//! is not alone behind a translating, strict IOMMU domain (unless the administrator opted out
//! with a tainting parameter), the admin SQ is read-only for the device and its data pages are
//! mapped per command ([`crate::admin`]), and every unmap invalidates the IOTLB before memory is
//! unpinned or freed ([`crate::mapping`]). What keeps the writer's queues consistent with the
//! memory they use is this module:
//! - one writer at a time ([`State::writer`]), as VFIO has one container per group: no other
//!   process can ring the writer's doorbells, and nobody else's memory is mapped;
//! - the writer's memory is unmapped only when none of its queues exist on the controller, or
//!   after the controller was disabled ([`Controller::quiesce`]); any admin command that fails
//!   where the controller's state matters (a timeout, a completion nobody asked for, a Delete
//!   that is refused) quiesces it first. Completions can be forged by the writer's DMA into the
//!   admin CQ, so none of this is what keeps memory safe: the strict unmap is.
//!
//! # Locking
//!
//! Mappings, queue records and the writer sit in [`Controller::state`]; the admin queue and the
//! BAR in [`Controller::live`], so that an `ADMIN` call waiting on a hung controller holds up no
//! `MAP` or `UNMAP`. Admin commands are issued one at a time under `live`. Pinning runs outside
//! both (a slow fault must not block everyone): host pages are pinned with no device involved
//! and mapped under `state`, so unbind never waits for a page fault; GPU pins need the device,
//! and unbind waits for those in flight ([`State::pins_in_flight`]). The doorbell mapping has its
//! own mutex, taken in the page-fault path (after `mmap_lock`), where nothing may wait for
//! `state`. Order: `state`, then `live`, then `doorbells`.
//!
//! # Lifetime
//!
//! A [`Controller`] is shared (`Arc`) by the PCI driver data and by every open file, so it may
//! outlive the binding; everything that needs the bound device (the BAR, DMA mappings, admin
//! memory) is dropped by [`Controller::shutdown`] during unbind.

use core::sync::atomic::{
    AtomicBool,
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
    new_condvar,
    new_mutex,
    pci,
    prelude::*,
    sync::{
        aref::ARef,
        Arc,
        CondVar,
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
    mapping::raw_device,
    p2p::Revoker,
    regs,
    uapi, //
};

#[path = "maps.rs"]
mod maps;
#[path = "queues.rs"]
mod queues;

use maps::Mapping;
use queues::{
    QueuePair,
    OPC_DELETE_CQ,
    OPC_DELETE_SQ, //
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
    fn legend_shim_iommu_isolated(dev: *mut bindings::device, group_id: *mut c_int) -> c_int;
    fn legend_shim_taint_unsafe();
    fn legend_shim_set_master(dev: *mut bindings::device, on: bool);
    fn legend_shim_pci_class(dev: *mut bindings::device) -> u32;
}

const OPC_SET_FEATURES: u8 = 0x09;
const FEAT_NUM_QUEUES: u32 = 0x07;

/// PCI class of an NVM Express controller (mass storage, non-volatile memory, NVMe).
const CLASS_NVME: u32 = 0x010802;

/// I/O queue pairs the driver asks for; more than a GPU-driven pipeline uses.
const WANTED_QUEUE_PAIRS: u32 = 64;

/// Identifies an open file: a number no other open file of this module gets.
pub(crate) type Owner = u64;

/// The resources that exist only while the device is bound.
struct Live {
    bar: DevresBar0,
    admin: AdminQueue,
    /// The controller was disabled after a failure ([`Controller::quiesce`]); it holds no I/O
    /// queue until [`Controller::recover`] enables it again.
    failed: bool,
    /// Bumped whenever the controller forgets its I/O queues (quiesce): a [`QueuePair`] exists on
    /// the controller only while its `epoch` is this one and the controller has not failed.
    epoch: u64,
}

/// What [`Live`] says about the queues, for holders of the state lock alone (`UNMAP`): updated
/// after the controller was stopped, so it may lag (a queue still counts as on the device), never
/// lead.
#[derive(Default)]
struct QueuesSeen {
    failed: AtomicBool,
    epoch: AtomicU64,
}

pub(crate) struct State {
    /// Cleared by unbind ([`Controller::shutdown`]); nothing may be mapped for the device after.
    bound: bool,
    maps: KVec<Mapping>,
    queues: KVec<QueuePair>,
    next_handle: u32,
    /// The open file that may map memory, create queues and map the doorbells.
    writer: Option<Owner>,
    /// `MAP` calls pinning GPU memory outside the lock; unbind waits until none is left.
    pins_in_flight: u32,
}

/// The doorbell mapping's side of the binding.
struct DoorbellState {
    /// Cleared at unbind: faults then raise `SIGBUS` and `mmap` fails with `ENODEV`.
    live: bool,
    /// The writer's file, if it mapped the doorbells; valid while it is open (the file leaves
    /// here in [`Controller::release`] before it is freed).
    file: Option<*mut bindings::file>,
}

// SAFETY: the raw `file` pointer is only dereferenced (by the C shim) under the doorbell mutex
// while the file is open, which is the case on any thread.
unsafe impl Send for DoorbellState {}

/// Counters exported through sysfs.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) queue_pairs: AtomicU32,
    pub(crate) bytes_pinned: AtomicU64,
    pub(crate) admin_commands: AtomicU64,
    /// 1 while the controller is disabled after a failure.
    pub(crate) failed: AtomicU32,
    /// Times the controller was enabled again after a failure.
    pub(crate) resets: AtomicU64,
    /// The admin queue's [`admin::View`], for debugfs: bus addresses of SQ, CQ and the last data
    /// page, then SQ tail, CQ head, phase and next command identifier.
    pub(crate) admin_view: [AtomicU64; 7],
}

impl Stats {
    fn show_admin(&self, admin: &AdminQueue) {
        let v = admin.view();
        let values = [
            v.sq_bus,
            v.cq_bus,
            v.data_bus,
            u64::from(v.sq_tail),
            u64::from(v.cq_head),
            u64::from(v.phase),
            u64::from(v.next_cid),
        ];
        for (slot, value) in self.admin_view.iter().zip(values) {
            slot.store(value, Ordering::Relaxed);
        }
    }
}

/// Capabilities read from CAP during bring-up.
#[derive(Clone, Copy)]
struct Caps {
    mqes: u32,
    stride: usize,
    timeout_ms: i64,
    mpsmin: u32,
}

/// An NVMe controller bound to `legend_nvme`.
#[pin_data]
pub(crate) struct Controller {
    pdev: ARef<pci::Device>,
    info: uapi::Info,
    caps: Caps,
    /// Offset in BAR0 of the doorbell mapping's first page: the page of the first I/O queue's
    /// doorbell.
    doorbell_base: usize,
    /// Physical address of the doorbell mapping's first page.
    doorbell_phys: u64,
    pub(crate) stats: Stats,
    seen: QueuesSeen,
    #[pin]
    state: Mutex<State>,
    /// The admin queue and the BAR, apart from `state` so that an `ADMIN` call (which may wait
    /// for the admin timeout on a hung controller) does not hold up `MAP` and `UNMAP`. `None`
    /// after unbind.
    #[pin]
    live: Mutex<Option<Live>>,
    /// Signalled when [`State::pins_in_flight`] drops to zero.
    #[pin]
    pins_done: CondVar,
    #[pin]
    doorbells: Mutex<DoorbellState>,
}

/// Waits for CSTS.RDY to become `ready`. A fatal status (CSTS.CFS) fails an enable at once; a
/// disable is the reset that clears it, so it waits for RDY alone.
fn wait_ready(bar: &Bar0<'_>, ready: bool, timeout_ms: i64) -> Result {
    // TIMEOUT: CAP.TO is the controller's own worst case for CSTS.RDY to follow CC.EN.
    read_poll_timeout(
        || Ok(bar.read(regs::CSTS)),
        |csts| csts.rdy() == ready || (ready && csts.cfs()),
        Delta::from_millis(1),
        Delta::from_millis(timeout_ms),
    )
    .and_then(|csts| {
        if ready && csts.cfs() {
            Err(EIO)
        } else {
            Ok(())
        }
    })
}

fn disable(bar: &Bar0<'_>, timeout_ms: i64) -> Result {
    let cc = bar.read(regs::CC);
    bar.write_reg(cc.with_en(false));
    wait_ready(bar, false, timeout_ms)
}

/// Resets the controller and enables it with `admin` as its admin queue.
fn enable(bar: &Bar0<'_>, admin: &AdminQueue, caps: &Caps) -> Result {
    disable(bar, caps.timeout_ms)?;
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
}

/// Runs a bring-up or recovery admin command, with a data page copied to `data` if given; any
/// failure is an error.
fn run_admin(
    dev: &device::Device<device::Bound>,
    admin: &mut AdminQueue,
    bar: &Bar0<'_>,
    cmd: Command,
    data: Option<&mut [u8]>,
) -> Result<u32> {
    let c = admin.submit(dev, bar, &cmd, data)?;
    if c.status != 0 {
        return Err(EIO);
    }
    Ok(c.result)
}

/// Set Features, Number of Queues: the I/O queue pairs granted (both counts are zero based).
fn set_queue_count(
    dev: &device::Device<device::Bound>,
    admin: &mut AdminQueue,
    bar: &Bar0<'_>,
) -> Result<u32> {
    let want = WANTED_QUEUE_PAIRS - 1;
    let granted = run_admin(
        dev,
        admin,
        bar,
        Command {
            opcode: OPC_SET_FEATURES,
            cdw: [FEAT_NUM_QUEUES, (want << 16) | want, 0, 0, 0, 0],
            idempotent: true,
            ..Default::default()
        },
        None,
    )?;
    Ok((granted & 0xffff).min(granted >> 16).min(want) + 1)
}

/// The first [`uapi::MAX_NAMESPACES`] IDs of an Active Namespace ID list, zero-terminated. The
/// list must ascend and stay within `max_nsid` (Identify Controller's NN); it ends at the first
/// ID that does not.
fn active_nsids(list: &[u8], max_nsid: u32) -> [u32; uapi::MAX_NAMESPACES] {
    let mut out = [0u32; uapi::MAX_NAMESPACES];
    let mut last = 0;
    for (i, slot) in out.iter_mut().enumerate() {
        let nsid = le32(list, i * 4);
        if nsid <= last || nsid > max_nsid {
            break;
        }
        *slot = nsid;
        last = nsid;
    }
    out
}

/// What Identify Namespace data says about namespace `nsid`, or `None` where its format is not
/// usable: no blocks, a format index beyond NLBAF, or a block size outside 2^9 to 2^16 bytes.
fn namespace_info(nsid: u32, id: &[u8]) -> Option<uapi::NamespaceInfo> {
    let blocks = le64(id, 0);
    let (nlbaf, lbaf) = (usize::from(id[25]), usize::from(id[26] & 0xf));
    if blocks == 0 || lbaf > nlbaf {
        return None;
    }
    let lba_shift = (le32(id, 128 + 4 * lbaf) >> 16) & 0xff;
    (9..=16)
        .contains(&lba_shift)
        .then_some(uapi::NamespaceInfo {
            nsid,
            lba_shift,
            blocks,
        })
}

fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn le64(b: &[u8], off: usize) -> u64 {
    u64::from(le32(b, off)) | (u64::from(le32(b, off + 4)) << 32)
}

/// Stops a controller that may still be running from reaching memory: CC.EN = 0, and bus
/// mastering off if it does not obey.
fn stop_dma(pdev: &pci::Device, bar: Option<&Bar0<'_>>, timeout_ms: i64) -> bool {
    if bar.is_some_and(|bar| disable(bar, timeout_ms).is_ok()) {
        return true;
    }
    dev_err!(
        pdev.as_ref(),
        "controller did not disable: bus mastering turned off\n"
    );
    // SAFETY: `pdev` is a valid PCI device.
    unsafe { legend_shim_set_master(raw_device(pdev.as_ref()), false) };
    false
}

/// Checks that the controller's DMA is confined by a translating IOMMU to its own group, in a
/// domain that invalidates the IOTLB when a mapping is undone (strict), so memory can be unpinned
/// right after its unmap.
fn check_isolation(pdev: &pci::Device) -> Result {
    let mut group = -1;
    // SAFETY: `pdev` is a valid PCI device.
    let ret = unsafe { legend_shim_iommu_isolated(raw_device(pdev.as_ref()), &mut group) };
    if ret == 0 {
        return Ok(());
    }
    if ret == EAGAIN.to_errno() {
        if !crate::module_parameters::enable_unsafe_lazy_iotlb.value() {
            dev_err!(
                pdev.as_ref(),
                "refusing to bind: its IOMMU domain invalidates lazily (DMA-FQ), so memory it \
                 unmapped stays reachable for milliseconds after it is unpinned; make the group \
                 strict while no driver is bound: echo DMA > /sys/kernel/iommu_groups/{}/type \
                 (legendctl device bind does), or boot with iommu.strict=1 (or load \
                 legend_nvme with enable_unsafe_lazy_iotlb=1 to accept that, tainting the \
                 kernel)\n",
                group
            );
            return Err(EPERM);
        }
        // SAFETY: plain C call.
        unsafe { legend_shim_taint_unsafe() };
        dev_warn!(
            pdev.as_ref(),
            "UNSAFE: bound with lazy IOTLB invalidation (/sys/kernel/iommu_groups/{}/type is \
             DMA-FQ): the queue writer can reach memory for milliseconds after it was unpinned; \
             kernel tainted\n",
            group
        );
        return Ok(());
    }
    let (why, fix) = if ret == EXDEV.to_errno() {
        (
            "its IOMMU group holds other devices",
            "move it to a slot with a group of its own (ACS)",
        )
    } else {
        (
            "it is not behind a translating IOMMU (none, or an identity/passthrough domain)",
            "boot with intel_iommu=on or amd_iommu=on and without iommu=pt",
        )
    };
    if !crate::module_parameters::enable_unsafe_noiommu_mode.value() {
        dev_err!(
            pdev.as_ref(),
            "refusing to bind: {}; whoever opens the device could DMA to any memory ({}, or \
             load legend_nvme with enable_unsafe_noiommu_mode=1 to accept that, tainting the \
             kernel)\n",
            why,
            fix
        );
        return Err(EPERM);
    }
    // SAFETY: plain C call.
    unsafe { legend_shim_taint_unsafe() };
    dev_warn!(
        pdev.as_ref(),
        "UNSAFE: bound without DMA isolation ({}): access to /dev/legend-nvme* now equals root; \
         kernel tainted\n",
        why
    );
    Ok(())
}

impl Controller {
    /// Brings the controller up and identifies it.
    pub(crate) fn probe(pdev: &pci::Device<device::Core<'_>>) -> Result<Arc<Self>> {
        // SAFETY: `pdev` is a valid PCI device.
        let class = unsafe { legend_shim_pci_class(raw_device(pdev.as_ref())) };
        if class != CLASS_NVME {
            dev_err!(pdev, "class {:#08x} is not an NVMe controller\n", class);
            return Err(ENODEV);
        }
        check_isolation(pdev)?;
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
                stop_dma(pdev, Some(&bar), caps.timeout_ms);
            })?;

        let (mut domain, mut bus, mut devfn) = (0u32, 0u8, 0u8);
        // SAFETY: `pdev` is a valid, bound PCI device.
        unsafe {
            legend_shim_pci_address(raw_device(pdev.as_ref()), &mut domain, &mut bus, &mut devfn)
        };
        info.pci_domain = domain;
        info.pci_bus = bus;
        info.pci_device = devfn >> 3;
        info.pci_function = devfn & 7;
        let page = uapi::HOST_PAGE_SIZE as usize;
        // The mapping starts at the page of qid 1's SQ doorbell: where the stride puts the I/O
        // doorbells on pages of their own, the admin queue's are out of reach.
        let doorbell_base = (regs::DOORBELLS + 2 * caps.stride) / page * page;
        let doorbell_phys = pdev.resource_start(0)? + doorbell_base as u64;
        // CAST: bounded by the BAR length.
        info.doorbell_len = (regs::DOORBELLS + (2 * info.queue_pairs as usize + 2) * caps.stride)
            .next_multiple_of(page)
            .saturating_sub(doorbell_base)
            .min(bar_len - doorbell_base) as u32;
        let bar = bar.into_devres().inspect_err(|_| {
            stop_dma(pdev, None, caps.timeout_ms);
        })?;
        let pdev_ref: &pci::Device = pdev;
        let stats = Stats::default();
        stats.show_admin(&admin);
        Arc::pin_init(
            try_pin_init!(Self {
                pdev: pdev_ref.into(),
                info,
                caps,
                doorbell_base,
                doorbell_phys,
                stats,
                seen: QueuesSeen::default(),
                state <- new_mutex!(State {
                    bound: true,
                    maps: KVec::new(),
                    queues: KVec::new(),
                    next_handle: 1,
                    writer: None,
                    pins_in_flight: 0,
                }),
                live <- new_mutex!(Some(Live { bar, admin, failed: false, epoch: 0 })),
                pins_done <- new_condvar!(),
                doorbells <- new_mutex!(DoorbellState { live: true, file: None }),
            }),
            GFP_KERNEL,
        )
        .inspect_err(|_| {
            stop_dma(pdev, None, caps.timeout_ms);
        })
    }

    /// Resets and enables the controller with the admin queue, then identifies it.
    fn bring_up(
        pdev: &pci::Device<device::Core<'_>>,
        bar: &Bar0<'_>,
        admin: &mut AdminQueue,
        caps: &Caps,
        bar_len: usize,
    ) -> Result<uapi::Info> {
        enable(bar, admin, caps).inspect_err(|_| {
            dev_err!(
                pdev,
                "controller did not reset and become ready within CAP.TO\n"
            )
        })?;
        let mut buf = KVec::from_elem(0u8, admin::DATA_LEN, GFP_KERNEL)?;
        let dev: &device::Device<device::Bound> = pdev.as_ref();
        let run = |admin: &mut AdminQueue, cmd: Command, buf: &mut [u8], what: &str| {
            run_admin(dev, admin, bar, cmd, Some(buf))
                .inspect_err(|e| dev_err!(pdev, "{} failed: {:?}\n", what, e))
        };

        // Identify Controller (CNS 1).
        run(
            admin,
            Command {
                opcode: uapi::ADMIN_OPC_IDENTIFY,
                cdw: [1, 0, 0, 0, 0, 0],
                idempotent: true,
                ..Default::default()
            },
            &mut buf,
            "Identify Controller",
        )?;
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
            // MDTS counts minimum memory pages (4 KiB, checked above); large values saturate.
            max_transfer: match buf[77] {
                0 => 0,
                mdts => 4096u64
                    .checked_shl(u32::from(mdts))
                    .and_then(|b| u32::try_from(b).ok())
                    .unwrap_or(u32::MAX),
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
        // Number of Namespaces: the largest valid namespace ID.
        let max_nsid = le32(&buf, 516);

        // Active Namespace ID list (CNS 2), then Identify Namespace (CNS 0) for each.
        run(
            admin,
            Command {
                opcode: uapi::ADMIN_OPC_IDENTIFY,
                cdw: [2, 0, 0, 0, 0, 0],
                idempotent: true,
                ..Default::default()
            },
            &mut buf,
            "Identify active namespaces",
        )?;
        let nsids = active_nsids(&buf, max_nsid);
        let mut count = 0;
        for &nsid in nsids.iter().take_while(|&&n| n != 0) {
            run(
                admin,
                Command {
                    opcode: uapi::ADMIN_OPC_IDENTIFY,
                    nsid,
                    idempotent: true,
                    ..Default::default()
                },
                &mut buf,
                "Identify Namespace",
            )?;
            match namespace_info(nsid, &buf) {
                Some(ns) => {
                    info.namespaces[count] = ns;
                    count += 1;
                }
                None => dev_warn!(
                    pdev,
                    "namespace {} has no usable format (size 0, LBA format beyond NLBAF, or \
                     block size outside 512 B to 64 KiB): skipped\n",
                    nsid
                ),
            }
        }
        // CAST: `count <= MAX_NAMESPACES`.
        info.num_namespaces = count as u32;

        let mut pairs = set_queue_count(dev, admin, bar)
            .inspect_err(|e| dev_err!(pdev, "Set Features (number of queues) failed: {:?}\n", e))?;
        // Doorbells of qid 0..=pairs must fit in BAR0.
        let room = bar_len
            .saturating_sub(regs::DOORBELLS)
            .checked_div(2 * caps.stride)
            .unwrap_or(0)
            .saturating_sub(1);
        pairs = pairs.min(u32::try_from(room).unwrap_or(u32::MAX));
        info.queue_pairs = pairs;
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

    pub(crate) fn dev(&self) -> &device::Device {
        self.pdev.as_ref()
    }

    fn bound_live(live: &mut Option<Live>) -> Result<&mut Live> {
        live.as_mut().ok_or(ENODEV)
    }

    /// Checks, before memory is mapped or a queue created, that the controller is still alone in
    /// its IOMMU group (probe checked it; a function hot-added to the group later would share its
    /// domain, and so the writer's mappings).
    ///
    /// # Errors
    ///
    /// `EXDEV` (logged) if another device joined the group.
    fn check_group_alone(&self) -> Result {
        let mut group = -1;
        // SAFETY: the device is valid while `self` holds a reference to it.
        let ret = unsafe { legend_shim_iommu_isolated(raw_device(self.dev()), &mut group) };
        if ret == EXDEV.to_errno() {
            dev_err!(
                self.dev(),
                "another device joined IOMMU group {}: refusing new mappings and queues (unbind \
                 the controller)\n",
                group
            );
            return Err(EXDEV);
        }
        Ok(())
    }

    /// Makes `owner` the controller's one writer.
    ///
    /// # Errors
    ///
    /// `EBUSY` while another open file is the writer.
    pub(crate) fn claim_writer(&self, owner: Owner) -> Result {
        let mut state = self.state.lock();
        if state.writer.is_some() {
            return Err(EBUSY);
        }
        state.writer = Some(owner);
        Ok(())
    }

    /// Stops the controller after a failure that leaves its state unknown, so that memory it may
    /// reach can be released: CC.EN = 0 (which deletes every I/O queue), or bus mastering off if
    /// the controller does not obey. Its queue records stay, no longer on the device.
    fn quiesce(&self, live: &mut Live, why: &str) {
        if live.failed {
            return;
        }
        live.failed = true;
        live.epoch += 1;
        dev_err!(
            self.dev(),
            "{}: controller disabled, its I/O queues are gone\n",
            why
        );
        // SAFETY: a `Live` exists only while the device is bound (see `admin`).
        let dev = unsafe { self.dev().as_bound() };
        stop_dma(&self.pdev, live.bar.access(dev).ok(), self.caps.timeout_ms);
        // Only now, with the controller stopped, may `UNMAP` see the queues gone.
        self.seen.epoch.store(live.epoch, Ordering::Release);
        self.seen.failed.store(true, Ordering::Release);
        self.stats.queue_pairs.store(0, Ordering::Relaxed);
        self.stats.failed.store(1, Ordering::Relaxed);
    }

    /// Enables a controller that [`Controller::quiesce`] stopped, with a fresh admin queue.
    ///
    /// # Errors
    ///
    /// `EIO` if the controller does not reset (it is then hung: unbind and reset the slot).
    fn recover(&self, live: &mut Live) -> Result {
        if !live.failed {
            return Ok(());
        }
        // SAFETY: as in `quiesce`.
        let dev = unsafe { self.dev().as_bound() };
        let bar = live.bar.access(dev)?;
        // Disabled first, so the controller uses no admin memory while it is replaced.
        disable(bar, self.caps.timeout_ms).map_err(|_| {
            dev_err!(
                self.dev(),
                "controller does not reset: unbind it and reset the slot\n"
            );
            EIO
        })?;
        // SAFETY: `dev` is a valid PCI device; the controller is disabled.
        unsafe { legend_shim_set_master(raw_device(self.dev()), true) };
        let mut admin = AdminQueue::new(dev, self.caps.stride)?;
        let granted = enable(bar, &admin, &self.caps)
            .and_then(|()| set_queue_count(dev, &mut admin, bar))
            .inspect_err(|_| {
                stop_dma(&self.pdev, Some(bar), self.caps.timeout_ms);
            })?;
        if granted < self.info.queue_pairs {
            stop_dma(&self.pdev, Some(bar), self.caps.timeout_ms);
            dev_err!(
                self.dev(),
                "after reset the controller grants {} queue pairs, not {}\n",
                granted,
                self.info.queue_pairs
            );
            return Err(EIO);
        }
        live.admin = admin;
        self.stats.show_admin(&live.admin);
        live.failed = false;
        self.seen.failed.store(false, Ordering::Release);
        self.stats.failed.store(0, Ordering::Relaxed);
        self.stats.resets.fetch_add(1, Ordering::Relaxed);
        dev_info!(self.dev(), "controller enabled again after a failure\n");
        Ok(())
    }

    /// Runs an admin command, counting it, with a data page copied to `data` if given. A timeout
    /// or a completion that does not match quiesces the controller.
    fn admin(
        &self,
        live: &mut Live,
        cmd: &Command,
        data: Option<&mut [u8]>,
    ) -> Result<admin::Completion> {
        if live.failed {
            return Err(EIO);
        }
        self.stats.admin_commands.fetch_add(1, Ordering::Relaxed);
        // SAFETY: a `Live` exists only while the device is bound: `shutdown` takes it, under the
        // lock that the caller holds, before unbind completes.
        let dev = unsafe { self.dev().as_bound() };
        let Live { bar, admin, .. } = &mut *live;
        // `access` rather than `try_access`: polling sleeps, which an RCU read section forbids.
        let result = admin.submit(dev, bar.access(dev)?, cmd, data);
        self.stats.show_admin(&live.admin);
        result.map_err(|fault| {
            if fault != admin::Fault::NoMemory {
                self.quiesce(live, "admin queue failed");
            }
            fault.into()
        })
    }

    /// Runs an allowed admin command with a kernel buffer of `data.len()` bytes, which receives
    /// the command's data if it succeeded (and stays as it is otherwise).
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
        // The admin lock alone: the writer's `MAP` and `UNMAP` do not wait for this command.
        let mut guard = self.live.lock();
        let live = Self::bound_live(&mut guard)?;
        self.recover(live)?;
        // The command's data lands in a kernel page first: `data` changes only on success.
        let mut page = KVec::from_elem(0u8, data.len(), GFP_KERNEL)?;
        let c = self.admin(
            live,
            &Command {
                opcode: args.opcode,
                nsid: args.nsid,
                prp1: 0,
                cdw,
                idempotent: true,
            },
            Some(&mut page),
        )?;
        if c.status == 0 {
            data.copy_from_slice(&page);
        }
        Ok(c)
    }

    /// Records that `file` (the writer's) maps the doorbells, so unbind can revoke the mapping.
    ///
    /// # Errors
    ///
    /// `ENODEV` after unbind.
    pub(crate) fn add_mmap(&self, file: *mut bindings::file) -> Result {
        let mut db = self.doorbells.lock();
        if !db.live {
            return Err(ENODEV);
        }
        db.file = Some(file);
        Ok(())
    }

    /// Length and physical address of the doorbell mapping.
    pub(crate) fn doorbell_region(&self) -> (usize, u64) {
        (self.info.doorbell_len as usize, self.doorbell_phys)
    }

    /// Resolves a fault on page `pgoff` of a doorbell mapping by calling `insert` with its
    /// physical address, under the doorbell lock; does nothing (the fault raises `SIGBUS`) after
    /// unbind or beyond the region.
    pub(crate) fn doorbell_fault(&self, pgoff: usize, insert: impl FnOnce(u64)) {
        let db = self.doorbells.lock();
        let page = uapi::HOST_PAGE_SIZE as usize;
        if db.live && pgoff < self.info.doorbell_len as usize / page {
            insert(self.doorbell_phys + (pgoff * page) as u64);
        }
    }

    /// Releases everything `owner` created; called when its file is closed.
    pub(crate) fn release(&self, owner: Owner) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        self.delete_queues_of(state, owner);
        // Queues are gone (or the controller is stopped), so the device no longer accesses the
        // mappings. They are dropped after the lock is released (see `Mapping`).
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
        if state.writer == Some(owner) {
            state.writer = None;
            self.doorbells.lock().file = None;
        }
        drop(guard);
        drop(gone);
    }

    /// Quiesces the controller and drops every resource that needs the bound device; called from
    /// unbind. Open files keep working objects that answer `ENODEV`.
    pub(crate) fn shutdown(&self) {
        let mut guard = self.state.lock();
        {
            let mut db = self.doorbells.lock();
            db.live = false;
            if let Some(file) = db.file.take() {
                // SAFETY: `file` is open: it leaves `doorbells` in `release` before it is freed,
                // and that needs the doorbell lock.
                unsafe { legend_shim_zap_file(file) };
            }
        }
        if !guard.bound {
            return;
        }
        guard.bound = false;
        // GPU memory being pinned is dropped by its `MAP` (which sees `bound` cleared) while the
        // device is still bound; host memory being pinned is not mapped yet and needs no device.
        while guard.pins_in_flight > 0 {
            self.pins_done.wait(&mut guard);
        }
        let Some(mut live) = self.live.lock().take() else {
            return;
        };
        let state = &mut *guard;
        for q in state.queues.iter() {
            if !live.failed && live.epoch == q.epoch {
                // A failure quiesces; the controller is disabled below anyway.
                let _ = self.delete_on_device(&mut live, q.qid, &[OPC_DELETE_SQ, OPC_DELETE_CQ]);
            }
        }
        state.queues.clear();
        self.stats.queue_pairs.store(0, Ordering::Relaxed);
        // SAFETY: called from unbind, so the device is still bound.
        let dev = unsafe { self.dev().as_bound() };
        stop_dma(&self.pdev, live.bar.access(dev).ok(), self.caps.timeout_ms);
        // As the in-tree driver's disable does: no DMA at all until the next probe.
        // SAFETY: `dev` is a valid PCI device.
        unsafe { legend_shim_set_master(raw_device(self.dev()), false) };
        self.stats.bytes_pinned.store(0, Ordering::Relaxed);
        let maps = core::mem::take(&mut state.maps);
        // Still bound (this is unbind), and the lock is released first (see `Mapping`).
        drop(guard);
        drop(maps);
        drop(live);
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
