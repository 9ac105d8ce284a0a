// SPDX-License-Identifier: GPL-2.0-only

//! Read-only attributes of a bound controller in `/sys/bus/pci/devices/<BDF>/legend_nvme/`:
//! `queue_pairs` (I/O queue pairs on the controller), `bytes_pinned` (memory mapped through
//! `MAP`), `admin_commands` (admin commands issued since bring-up), `index` (`N` of its
//! `/dev/legend-nvme<N>`, which has no parent device to link it to the PCI device), `failed` (1
//! while the controller is disabled after a failure) and `resets` (times it was enabled again).
//!
//! For root, `/sys/kernel/debug/legend_nvme-<BDF>/` shows where the admin queue is
//! (`admin_sq_bus`, `admin_cq_bus`, `admin_data_bus`: bus addresses; `admin_sq_tail`,
//! `admin_cq_head`, `admin_cq_phase`, `admin_next_cid`): the selftests aim the queue writer's
//! DMA at them.

use core::{
    ffi::c_void,
    sync::atomic::Ordering, //
};

use kernel::{
    bindings,
    prelude::*,
    sync::Arc, //
};

use crate::{
    controller::Controller,
    mapping::raw_device, //
};

/// The C shim's per-device attribute group; only handled by pointer.
#[repr(C)]
struct RawGroup {
    _opaque: [u8; 0],
}

/// The C shim's per-device debugfs directory; only handled by pointer.
#[repr(C)]
struct RawDebugfs {
    _opaque: [u8; 0],
}

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_sysfs_add(
        dev: *mut bindings::device,
        ctx: *const c_void,
        out: *mut *mut RawGroup,
    ) -> c_int;
    fn legend_shim_sysfs_remove(group: *mut RawGroup);
    fn legend_shim_debugfs_add(
        dev: *mut bindings::device,
        ctx: *const c_void,
        out: *mut *mut RawDebugfs,
    );
    fn legend_shim_debugfs_remove(dir: *mut RawDebugfs);
}

/// Indices of the attributes, in the order of `legend_stat_names` in `shim.c`.
const QUEUE_PAIRS: c_uint = 0;
const BYTES_PINNED: c_uint = 1;
const ADMIN_COMMANDS: c_uint = 2;
const INDEX: c_uint = 3;
const FAILED: c_uint = 4;
const RESETS: c_uint = 5;
/// The debugfs files follow, in the order of `Stats::admin_view`.
const ADMIN_VIEW: c_uint = 6;

/// What the attributes show: the controller and the index of its character device.
struct Context {
    ctrl: Arc<Controller>,
    index: usize,
}

/// Called by the shim's `show()` for attribute `which` of the context at `ctx`.
///
/// # Safety
///
/// `ctx` is the context pointer of a live [`StatsFiles`].
#[no_mangle]
unsafe extern "C" fn legend_nvme_stat(ctx: *const c_void, which: c_uint) -> u64 {
    // SAFETY: by the function's contract `ctx` points to the `Context` that the `StatsFiles`
    // keeps alive until the group is removed, and removal waits for running `show()` calls.
    let ctx = unsafe { &*ctx.cast::<Context>() };
    let stats = &ctx.ctrl.stats;
    match which {
        QUEUE_PAIRS => u64::from(stats.queue_pairs.load(Ordering::Relaxed)),
        BYTES_PINNED => stats.bytes_pinned.load(Ordering::Relaxed),
        ADMIN_COMMANDS => stats.admin_commands.load(Ordering::Relaxed),
        // CAST: an index into the driver's eight names.
        INDEX => ctx.index as u64,
        FAILED => u64::from(stats.failed.load(Ordering::Relaxed)),
        RESETS => stats.resets.load(Ordering::Relaxed),
        // CAST: a small index.
        w if w >= ADMIN_VIEW => stats
            .admin_view
            .get((w - ADMIN_VIEW) as usize)
            .map_or(0, |v| v.load(Ordering::Relaxed)),
        _ => 0,
    }
}

/// The `legend_nvme` attribute group of one PCI device, removed on drop.
///
/// # Invariants
///
/// `group` was returned by `legend_shim_sysfs_add` for `ctx` and is not yet removed; `debug`
/// is null or was returned by `legend_shim_debugfs_add` for `ctx` and is not yet removed.
pub(crate) struct StatsFiles {
    group: *mut RawGroup,
    debug: *mut RawDebugfs,
    /// The attributes' context; boxed so its address stays fixed.
    _ctx: KBox<Context>,
}

// SAFETY: the group is only touched by `Drop`, and sysfs removal may run on any thread.
unsafe impl Send for StatsFiles {}
// SAFETY: `&StatsFiles` gives no access to the group.
unsafe impl Sync for StatsFiles {}

impl StatsFiles {
    /// Creates the attribute group of `ctrl`, whose character device is `/dev/legend-nvme<index>`,
    /// on its PCI device.
    ///
    /// # Errors
    ///
    /// `ENOMEM`, or `EEXIST` if the device already has the group.
    pub(crate) fn new(ctrl: Arc<Controller>, index: usize) -> Result<Self> {
        let ctx = KBox::new(Context { ctrl, index }, GFP_KERNEL)?;
        let mut group = core::ptr::null_mut();
        let raw = core::ptr::from_ref::<Context>(&ctx).cast::<c_void>();
        // SAFETY: the device is valid while `ctx.ctrl` holds a reference to it, and `raw` stays
        // valid until `Drop` removes the group (the box is kept in `self`).
        let ret = unsafe { legend_shim_sysfs_add(raw_device(ctx.ctrl.dev()), raw, &mut group) };
        if ret != 0 {
            return Err(Error::from_errno(ret));
        }
        let mut debug = core::ptr::null_mut();
        // SAFETY: as above.
        unsafe { legend_shim_debugfs_add(raw_device(ctx.ctrl.dev()), raw, &mut debug) };
        // INVARIANT: the shim created `group` and `debug` (or nothing) for `ctx`.
        Ok(Self {
            group,
            debug,
            _ctx: ctx,
        })
    }
}

impl Drop for StatsFiles {
    fn drop(&mut self) {
        // SAFETY: by the invariants `group` is live; removal waits for running `show()` calls,
        // and `_ctx`, dropped after this, keeps their context valid until then.
        unsafe { legend_shim_sysfs_remove(self.group) };
        // SAFETY: likewise for the debugfs files (the shim ignores null).
        unsafe { legend_shim_debugfs_remove(self.debug) };
    }
}
