// SPDX-License-Identifier: GPL-2.0-only

//! `legend_nvme`: hands NVMe I/O queue pairs in caller-supplied memory to a trusted process, so a
//! GPU (or the process itself) can drive the SSD directly.

mod admin;
mod chardev;
mod controller;
mod driver;
mod isolation;
mod mapping;
mod owner;
mod p2p;
mod regs;
mod rules;
mod sysfs;
// The ABI file is shared with userspace: some items are used only there, and `pub` is its API.
#[allow(dead_code, unreachable_pub)]
#[path = "uapi.rs"]
mod uapi;

kernel::module_pci_driver! {
    type: driver::LegendNvme,
    name: "legend_nvme",
    authors: ["The Legend authors"],
    description: "NVMe queue pairs in caller-supplied memory for GPU-direct I/O",
    license: "GPL",
    // The `enable_unsafe_*` parameters are declared in shim.c, where they can be shown in sysfs.
}
