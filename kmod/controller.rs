// SPDX-License-Identifier: GPL-2.0-only

//! One NVMe controller: the resources (mappings, I/O queue pairs, the doorbell mapping) that its
//! one writer creates through the character device; bring-up is in `bringup.rs`.
//!
//! # Isolation
//!
//! The writer builds its own NVMe commands, so the controller DMAs wherever their PRPs point.
//! What keeps that inside the writer's own memory is the platform and the IOMMU: probe refuses a
//! controller that is not alone behind a translating, strict IOMMU domain with isolated
//! interrupt messages, no ATS and no 1:1 firmware region ([`crate::isolation`]; the
//! administrator may accept some of these gaps with tainting parameters), the doorbell mapping
//! never reaches the MSI-X table ([`crate::rules::doorbell_window`]), the admin SQ is read-only
//! for the device and its data pages are mapped per command ([`crate::admin`]), and every unmap
//! invalidates the IOTLB before memory is unpinned or freed ([`crate::mapping`]). What keeps the
//! writer's queues consistent with the memory they use is this module:
//! - one writer at a time ([`State::writer`]), as VFIO has one container per group: no other
//!   process can ring the writer's doorbells, and nobody else's memory is mapped;
//! - the writer's memory is unmapped only when none of its queues exist on the controller, or
//!   after the controller was disabled ([`Controller::quiesce`]); any admin command that fails
//!   where the controller's state matters (a timeout, a completion nobody asked for, a Delete
//!   that is refused) quiesces it first. Completions can be forged by the writer's DMA into the
//!   admin CQ, so none of this is what keeps memory safe: the strict unmap is;
//! - every ioctl that creates something undoes all of it when a later step fails, the copy of
//!   its result to the caller included (`MAP` publishes a mapping only once that copy is done;
//!   [`Controller::undo_create_queue_pair`]).
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
    pci,
    prelude::*,
    sync::{
        aref::ARef,
        CondVar,
        Mutex, //
    }, //
};

use crate::{
    admin::{
        self,
        AdminQueue,
        Command, //
    },
    isolation,
    owner::Owner,
    p2p::Revoker,
    regs::DevresBar0,
    uapi, //
};

#[path = "bringup.rs"]
mod bringup;
#[path = "maps.rs"]
mod maps;
#[path = "queues.rs"]
mod queues;

use bringup::{
    disable,
    enable,
    set_bus_master,
    set_queue_count,
    stop_dma, //
};
use maps::Mapping;
use queues::{
    QueuePair,
    OPC_DELETE_CQ,
    OPC_DELETE_SQ, //
};

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_zap_file(file: *mut bindings::file);
}

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

impl Controller {
    pub(crate) fn info(&self) -> &uapi::Info {
        &self.info
    }

    pub(crate) fn dev(&self) -> &device::Device {
        self.pdev.as_ref()
    }

    fn bound_live(live: &mut Option<Live>) -> Result<&mut Live> {
        live.as_mut().ok_or(ENODEV)
    }

    /// See [`isolation::check_group_alone`].
    fn check_group_alone(&self) -> Result {
        isolation::check_group_alone(self.dev())
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
        // The controller is disabled.
        set_bus_master(&self.pdev, true);
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
        set_bus_master(&self.pdev, false);
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
