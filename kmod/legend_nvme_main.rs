// SPDX-License-Identifier: GPL-2.0-only

//! `legend_nvme`: hands NVMe I/O queue pairs in caller-supplied memory to a trusted process, so a
//! GPU (or the process itself) can drive the SSD directly.

mod admin;
mod chardev;
mod controller;
mod driver;
mod mapping;
mod p2p;
mod regs;
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
    params: {
        enable_unsafe_noiommu_mode: bool {
            default: false,
            description: "Bind controllers that no translating IOMMU isolates (taints the kernel): whoever opens the device can then DMA to any memory",
        },
        enable_unsafe_lazy_iotlb: bool {
            default: false,
            description: "Bind controllers whose IOMMU domain invalidates lazily (DMA-FQ; taints the kernel): unmapped and unpinned memory then stays reachable by the queue writer's DMA for up to ~10 ms",
        },
    },
}
