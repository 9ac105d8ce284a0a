// SPDX-License-Identifier: GPL-2.0-only

//! What the platform must provide before a controller is handed to a queue writer, whose DMA
//! reaches whatever its commands' PRPs name in the controller's IOMMU domain:
//! - a translating IOMMU domain of the controller's own group (else the writer reaches all
//!   memory, or the group-mates' mappings);
//! - strict IOTLB invalidation (else unmapped memory stays reachable after it was unpinned);
//! - isolated interrupt messages, i.e. interrupt remapping (else a DMA write to the MSI window,
//!   0xfee00000 on x86, sends the host any interrupt: what VFIO refuses without
//!   `allow_unsafe_interrupts`);
//! - no ATS (translated requests bypass the IOMMU);
//! - no region the firmware maps 1:1 in the domain (RMRR, IVMD: memory the writer would reach).
//!
//! [`check_bind`] logs every gap with its fix and refuses the bind unless the administrator
//! accepted it with the module's tainting `enable_unsafe_*` parameter (the first three only).
//! The decision itself is [`rules::gaps`], unit tested on the host.

use kernel::{
    bindings,
    device,
    prelude::*, //
};

use crate::{
    mapping::raw_device,
    rules::{
        self,
        Gap,
        Msix,
        Overrides,
        Platform, //
    },
};

/// `LEGEND_MAX_DIRECT` in `shim.h`.
const MAX_DIRECT: usize = 8;

/// `struct legend_isolation` in `shim.h`.
#[repr(C)]
struct RawIsolation {
    group_id: c_int,
    group_devices: u32,
    translated: u8,
    lazy: u8,
    isolated_msi: u8,
    ats_enabled: u8,
    direct_count: u32,
    direct: [[u64; 2]; MAX_DIRECT],
}

/// Bits of `legend_shim_unsafe_params` (`LEGEND_UNSAFE_*` in `shim.h`).
const UNSAFE_NOIOMMU: u32 = 1;
const UNSAFE_LAZY_IOTLB: u32 = 2;
const UNSAFE_INTERRUPTS: u32 = 4;

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_isolation(dev: *mut bindings::device, out: *mut RawIsolation);
    fn legend_shim_msix(
        dev: *mut bindings::device,
        control: *mut u16,
        table: *mut u32,
        pba: *mut u32,
    ) -> bool;
    fn legend_shim_unsafe_params() -> u32;
    fn legend_shim_taint_unsafe();
}

/// What the platform provides `dev` now.
fn platform_of(dev: &device::Device) -> RawIsolation {
    let mut raw = RawIsolation {
        group_id: -1,
        group_devices: 0,
        translated: 0,
        lazy: 0,
        isolated_msi: 0,
        ats_enabled: 0,
        direct_count: 0,
        direct: [[0; 2]; MAX_DIRECT],
    };
    // SAFETY: `dev` is a valid PCI device; `raw` matches `struct legend_isolation`.
    unsafe { legend_shim_isolation(raw_device(dev), &mut raw) };
    raw
}

impl RawIsolation {
    fn platform(&self) -> Platform {
        Platform {
            translated: self.translated != 0,
            group_devices: self.group_devices,
            lazy: self.lazy != 0,
            isolated_msi: self.isolated_msi != 0,
            ats: self.ats_enabled != 0,
            direct_regions: self.direct_count,
        }
    }
}

fn overrides() -> Overrides {
    // SAFETY: plain C call.
    let bits = unsafe { legend_shim_unsafe_params() };
    Overrides {
        noiommu: bits & UNSAFE_NOIOMMU != 0,
        lazy_iotlb: bits & UNSAFE_LAZY_IOTLB != 0,
        interrupts: bits & UNSAFE_INTERRUPTS != 0,
    }
}

/// Checks, at bind, everything the module's isolation rests on (see the module documentation):
/// logs each gap with its fix, and refuses the bind while a gap is left that no parameter
/// accepts. An accepted gap is logged as `UNSAFE` and taints the kernel.
///
/// # Errors
///
/// `EPERM` (logged) if the bind is refused.
pub(crate) fn check_bind(dev: &device::Device) -> Result {
    let raw = platform_of(dev);
    let group = raw.group_id;
    let gaps = rules::gaps(&raw.platform(), &overrides());
    for (gap, accepted) in gaps.iter() {
        if accepted {
            dev_warn!(
                dev,
                "UNSAFE: bound {} ({}=1); kernel tainted\n",
                gap.accepted(),
                gap.parameter().unwrap_or_default()
            );
            continue;
        }
        if group >= 0 {
            dev_err!(
                dev,
                "refusing to bind: {}; {} (its IOMMU group is {})\n",
                gap.what(),
                gap.fix(),
                group
            );
        } else {
            dev_err!(dev, "refusing to bind: {}; {}\n", gap.what(), gap.fix());
        }
        if let Some(parameter) = gap.parameter() {
            dev_err!(
                dev,
                "or load legend_nvme with {}=1 to accept that, tainting the kernel\n",
                parameter
            );
        }
        if gap == Gap::DirectRegions {
            for [start, len] in raw.direct.iter().take(raw.direct_count as usize) {
                dev_err!(
                    dev,
                    "direct-mapped region {:#x}-{:#x}\n",
                    start,
                    start.saturating_add(len.saturating_sub(1))
                );
            }
        }
    }
    if gaps.refused() {
        return Err(EPERM);
    }
    if gaps.iter().next().is_some() {
        // SAFETY: plain C call.
        unsafe { legend_shim_taint_unsafe() };
    }
    Ok(())
}

/// Checks, before memory is mapped or a queue created, that the controller is still alone in
/// its IOMMU group ([`check_bind`] checked it; a function hot-added to the group later would
/// share its domain, and so the writer's mappings).
///
/// `enable_unsafe_noiommu_mode` accepts a shared group here as at bind.
///
/// # Errors
///
/// `EXDEV` (logged) if another device joined the group.
pub(crate) fn check_group_alone(dev: &device::Device) -> Result {
    let raw = platform_of(dev);
    if raw.group_devices > 1 && !overrides().noiommu {
        dev_err!(
            dev,
            "another device joined IOMMU group {}: refusing new mappings and queues (unbind the \
             controller)\n",
            raw.group_id
        );
        return Err(EXDEV);
    }
    Ok(())
}

/// Where `dev`'s MSI-X capability puts its table and PBA, if it has one.
pub(crate) fn msix_of(dev: &device::Device) -> Option<Msix> {
    let (mut control, mut table, mut pba) = (0u16, 0u32, 0u32);
    // SAFETY: `dev` is a valid PCI device; the out pointers are valid.
    let found = unsafe { legend_shim_msix(raw_device(dev), &mut control, &mut table, &mut pba) };
    found.then(|| Msix::from_config(control, table, pba))
}
