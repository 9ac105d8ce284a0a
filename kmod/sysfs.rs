// SPDX-License-Identifier: GPL-2.0-only

//! Read-only counters of a bound controller in `/sys/bus/pci/devices/<BDF>/legend_nvme/`:
//! `queue_pairs` (I/O queue pairs in use), `bytes_pinned` (memory mapped through `MAP`) and
//! `admin_commands` (admin commands issued since bring-up).

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

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_sysfs_add(
        dev: *mut bindings::device,
        ctx: *const c_void,
        out: *mut *mut RawGroup,
    ) -> c_int;
    fn legend_shim_sysfs_remove(group: *mut RawGroup);
}

/// Indices of the attributes, in the order of `legend_stat_names` in `shim.c`.
const QUEUE_PAIRS: c_uint = 0;
const BYTES_PINNED: c_uint = 1;
const ADMIN_COMMANDS: c_uint = 2;

/// Called by the shim's `show()` for attribute `which` of the controller at `ctx`.
///
/// # Safety
///
/// `ctx` is the controller pointer a live [`StatsFiles`] registered.
#[no_mangle]
unsafe extern "C" fn legend_nvme_stat(ctx: *const c_void, which: c_uint) -> u64 {
    // SAFETY: by the function's contract `ctx` points to a controller, which the `StatsFiles`
    // keeps alive until the group is removed, and removal waits for running `show()` calls.
    let stats = unsafe { &(*ctx.cast::<Controller>()).stats };
    match which {
        QUEUE_PAIRS => u64::from(stats.queue_pairs.load(Ordering::Relaxed)),
        BYTES_PINNED => stats.bytes_pinned.load(Ordering::Relaxed),
        ADMIN_COMMANDS => stats.admin_commands.load(Ordering::Relaxed),
        _ => 0,
    }
}

/// The `legend_nvme` attribute group of one PCI device, removed on drop.
///
/// # Invariants
///
/// `group` was returned by `legend_shim_sysfs_add` for `ctrl` and is not yet removed.
pub(crate) struct StatsFiles {
    group: *mut RawGroup,
    /// Keeps the context of the attributes alive.
    _ctrl: Arc<Controller>,
}

// SAFETY: the group is only touched by `Drop`, and sysfs removal may run on any thread.
unsafe impl Send for StatsFiles {}
// SAFETY: `&StatsFiles` gives no access to the group.
unsafe impl Sync for StatsFiles {}

impl StatsFiles {
    /// Creates the attribute group of `ctrl` on its PCI device.
    ///
    /// # Errors
    ///
    /// `ENOMEM`, or `EEXIST` if the device already has the group.
    pub(crate) fn new(ctrl: Arc<Controller>) -> Result<Self> {
        let mut group = core::ptr::null_mut();
        let ctx = core::ptr::from_ref::<Controller>(&ctrl).cast::<c_void>();
        // SAFETY: the device is valid while `ctrl` holds a reference to it, and `ctx` stays
        // valid until `Drop` removes the group (the `Arc` is kept in `self`).
        let ret = unsafe { legend_shim_sysfs_add(raw_device(ctrl.dev()), ctx, &mut group) };
        if ret != 0 {
            return Err(Error::from_errno(ret));
        }
        // INVARIANT: the shim created `group` for `ctrl`.
        Ok(Self { group, _ctrl: ctrl })
    }
}

impl Drop for StatsFiles {
    fn drop(&mut self) {
        // SAFETY: by the invariants `group` is live; removal waits for running `show()` calls,
        // and `_ctrl`, dropped after this, keeps their context valid until then.
        unsafe { legend_shim_sysfs_remove(self.group) };
    }
}
