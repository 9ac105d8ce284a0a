// SPDX-License-Identifier: GPL-2.0-only

//! Bring-up of a controller at probe: the platform checks ([`crate::isolation`]), reset and
//! enable with an admin queue, identification, the number of I/O queue pairs and the doorbell
//! mapping; and the register sequences that recovery and unbind reuse (enable, disable, stop).

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
    sync::Arc,
    time::Delta, //
};

use super::{
    Caps,
    Controller,
    DoorbellState,
    Live,
    QueuesSeen,
    State,
    Stats, //
};
use crate::{
    admin::{
        self,
        AdminQueue,
        Command, //
    },
    isolation,
    mapping::raw_device,
    regs::{
        self,
        Bar0, //
    },
    rules::{
        self,
        NoWindow, //
    },
    uapi, //
};

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_pci_address(
        dev: *mut bindings::device,
        domain: *mut u32,
        bus: *mut u8,
        devfn: *mut u8,
    );
    fn legend_shim_set_master(dev: *mut bindings::device, on: bool);
    fn legend_shim_pci_class(dev: *mut bindings::device) -> u32;
}

const OPC_SET_FEATURES: u8 = 0x09;
const FEAT_NUM_QUEUES: u32 = 0x07;

/// PCI class of an NVM Express controller (mass storage, non-volatile memory, NVMe).
const CLASS_NVME: u32 = 0x010802;

/// I/O queue pairs the driver asks for; more than a GPU-driven pipeline uses.
const WANTED_QUEUE_PAIRS: u32 = 64;

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

/// Clears CC.EN and waits until the controller says it stopped.
pub(super) fn disable(bar: &Bar0<'_>, timeout_ms: i64) -> Result {
    let cc = bar.read(regs::CC);
    bar.write_reg(cc.with_en(false));
    wait_ready(bar, false, timeout_ms)
}

/// Resets the controller and enables it with `admin` as its admin queue.
pub(super) fn enable(bar: &Bar0<'_>, admin: &AdminQueue, caps: &Caps) -> Result {
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
pub(super) fn set_queue_count(
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
pub(super) fn stop_dma(pdev: &pci::Device, bar: Option<&Bar0<'_>>, timeout_ms: i64) -> bool {
    if bar.is_some_and(|bar| disable(bar, timeout_ms).is_ok()) {
        return true;
    }
    dev_err!(
        pdev.as_ref(),
        "controller did not disable: bus mastering turned off\n"
    );
    set_bus_master(pdev, false);
    false
}

/// Turns bus mastering on or off (the PCI core's `pci_set_master` / `pci_clear_master`).
pub(super) fn set_bus_master(pdev: &pci::Device, on: bool) {
    // SAFETY: `pdev` is a valid PCI device.
    unsafe { legend_shim_set_master(raw_device(pdev.as_ref()), on) };
}

/// The doorbell mapping for `granted` queue pairs ([`rules::doorbell_window`]): within BAR0 and
/// clear of every page of the MSI-X table and PBA, however the controller lays them out.
///
/// # Errors
///
/// `ENODEV` (logged) if not even queue pair 1's doorbells can be mapped.
fn doorbell_window(
    pdev: &pci::Device,
    bar_len: u64,
    caps: &Caps,
    granted: u32,
) -> Result<rules::DoorbellWindow> {
    let msix = isolation::msix_of(pdev.as_ref());
    let window = rules::doorbell_window(
        bar_len,
        // CAST: at most 4 << 15.
        caps.stride as u64,
        granted,
        u64::from(uapi::HOST_PAGE_SIZE),
        msix.iter().flat_map(|m| m.in_bar(0)),
    );
    match window {
        Ok(w) if w.queue_pairs < granted => {
            dev_info!(
                pdev.as_ref(),
                "{} of the {} granted I/O queue pairs have their doorbells before the MSI-X \
                 table or PBA (or the end of BAR0): the others are not offered\n",
                w.queue_pairs,
                granted
            );
            Ok(w)
        }
        Ok(w) => Ok(w),
        Err(NoWindow::Msix(span)) => {
            dev_err!(
                pdev.as_ref(),
                "the MSI-X table or PBA (BAR0 {:#x}-{:#x}) shares a page with the first I/O queue \
                 doorbells: they cannot be mapped without it\n",
                span.start,
                span.end
            );
            Err(ENODEV)
        }
        Err(NoWindow::BarTooSmall) => {
            dev_err!(
                pdev.as_ref(),
                "BAR0 ({} bytes) ends before the first I/O queue doorbells\n",
                bar_len
            );
            Err(ENODEV)
        }
    }
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
        isolation::check_bind(pdev.as_ref())?;
        pdev.enable_device_mem()?;
        pdev.set_master();
        // SAFETY: probe runs before any DMA allocation or mapping for this device exists.
        unsafe {
            kernel::dma::Device::dma_set_mask_and_coherent(pdev, kernel::dma::DmaMask::new::<64>())?
        };
        let bar = pdev
            .iomap_region_sized::<{ regs::BAR0_MIN }>(0, c"legend_nvme")
            .inspect_err(|_| dev_err!(pdev, "cannot map BAR0\n"))?;
        let bar_len = pdev.resource_len(0)?;

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
        let (mut info, window) = Self::bring_up(pdev, &bar, &mut admin, &caps)
            .and_then(|info| {
                let window = doorbell_window(pdev, bar_len, &caps, info.queue_pairs)?;
                Ok((info, window))
            })
            .inspect_err(|_| {
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
        info.queue_pairs = window.queue_pairs;
        // CAST: bounded by the BAR length.
        info.doorbell_len = window.len as u32;
        // CAST: an offset in BAR0.
        let doorbell_base = window.base as usize;
        let doorbell_phys = pdev.resource_start(0)? + window.base;
        dev_info!(
            pdev,
            "NVMe {}.{}, {} I/O queue pairs, {} namespaces, MQES {}\n",
            info.nvme_version >> 16,
            (info.nvme_version >> 8) & 0xff,
            info.queue_pairs,
            info.num_namespaces,
            caps.mqes
        );
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

        info.queue_pairs = set_queue_count(dev, admin, bar)
            .inspect_err(|e| dev_err!(pdev, "Set Features (number of queues) failed: {:?}\n", e))?;
        Ok(info)
    }
}
