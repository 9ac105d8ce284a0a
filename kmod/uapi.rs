// SPDX-License-Identifier: GPL-2.0-only OR MIT

//! The `legend_nvme` ioctl ABI, shared by the kernel module and userspace.
//!
//! This one file is compiled into both `kmod/` (as `mod uapi`) and the `legend-uapi` crate (through
//! `#[path]`), so the two sides cannot disagree. It uses `core` only and carries no crate attributes.
//! Every struct is `#[repr(C)]` with explicit padding fields (always zero on input), so its layout
//! is the same for every compiler and has no uninitialised bytes to leak.

/// Version of this ABI; [`Info::abi_version`] reports it. Bumped on any incompatible change.
pub const ABI_VERSION: u32 = 2;

/// Most namespaces [`Info`] describes.
pub const MAX_NAMESPACES: usize = 16;

/// Page size, in bytes, of [`MapArgs`] host mappings and of the doorbell `mmap`.
pub const HOST_PAGE_SIZE: u32 = 4096;

/// Page size, in bytes, of GPU mappings (NVIDIA's P2P granularity).
pub const GPU_PAGE_SIZE: u32 = 65536;

/// [`MapArgs::kind`]: pinned host memory of the calling process.
pub const MAP_KIND_HOST: u32 = 0;

/// [`MapArgs::kind`]: GPU memory pinned through NVIDIA's P2P API.
pub const MAP_KIND_GPU: u32 = 1;

/// Admin opcode allowed by [`IOCTL_ADMIN`]: Identify.
pub const ADMIN_OPC_IDENTIFY: u8 = 0x06;

/// Admin opcode allowed by [`IOCTL_ADMIN`]: Get Log Page (only the SMART / health log).
pub const ADMIN_OPC_GET_LOG_PAGE: u8 = 0x02;

/// Log identifier of the SMART / health information log.
pub const LOG_ID_SMART: u8 = 0x02;

/// One namespace as [`Info`] reports it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Namespace identifier (1-based).
    pub nsid: u32,
    /// log2 of the LBA data size in bytes (9 for 512-byte blocks).
    pub lba_shift: u32,
    /// Capacity in logical blocks (NSZE).
    pub blocks: u64,
}

/// Output of [`IOCTL_INFO`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Info {
    /// [`ABI_VERSION`] of the running module.
    pub abi_version: u32,
    /// PCI domain.
    pub pci_domain: u32,
    /// PCI bus number.
    pub pci_bus: u8,
    /// PCI device number.
    pub pci_device: u8,
    /// PCI function number.
    pub pci_function: u8,
    /// Always zero.
    pub _pad0: u8,
    /// The controller's VS register (major << 16 | minor << 8 | tertiary).
    pub nvme_version: u32,
    /// Model number (ASCII, space padded, as Identify Controller reports it).
    pub model: [u8; 40],
    /// Serial number (ASCII, space padded).
    pub serial: [u8; 20],
    /// Firmware revision (ASCII, space padded).
    pub firmware: [u8; 8],
    /// Most entries an I/O queue may have (CAP.MQES + 1).
    pub max_queue_entries: u32,
    /// Distance in bytes between consecutive doorbells (4 << CAP.DSTRD).
    pub doorbell_stride: u32,
    /// Largest data transfer of one command in bytes; 0 means no limit.
    pub max_transfer: u32,
    /// I/O queue pairs the controller granted; valid qids are `1..=queue_pairs`.
    pub queue_pairs: u32,
    /// Length in bytes of the doorbell region that `mmap` at offset 0 accepts.
    pub doorbell_len: u32,
    /// Number of valid entries in [`Info::namespaces`].
    pub num_namespaces: u32,
    /// Always zero.
    pub _pad1: u32,
    /// Active namespaces, the first `num_namespaces` entries valid.
    pub namespaces: [NamespaceInfo; MAX_NAMESPACES],
}

/// Argument of [`IOCTL_MAP`]: pins memory and reports its bus addresses for this controller.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapArgs {
    /// In: virtual address of the buffer, aligned to the kind's page size.
    pub addr: u64,
    /// In: length in bytes, a non-zero multiple of the kind's page size.
    pub len: u64,
    /// In: user pointer to an array of `u64` that receives one bus address per page.
    pub bus_addrs: u64,
    /// In: capacity of `bus_addrs` in entries; must be at least `len / page_size`.
    pub bus_addrs_cap: u32,
    /// In: [`MAP_KIND_HOST`] or [`MAP_KIND_GPU`].
    pub kind: u32,
    /// In: must be zero.
    pub flags: u32,
    /// Out: handle naming this mapping in [`IOCTL_UNMAP`] and [`QueuePairArgs`].
    pub handle: u32,
    /// Out: page size in bytes of the entries written to `bus_addrs`.
    pub page_size: u32,
    /// Out: number of entries written to `bus_addrs`.
    pub pages: u32,
}

/// Argument of [`IOCTL_UNMAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnmapArgs {
    /// In: handle from [`MapArgs::handle`].
    pub handle: u32,
    /// In: must be zero.
    pub flags: u32,
}

/// Argument of [`IOCTL_CREATE_QUEUE_PAIR`].
///
/// The submission queue takes `depth * 64` bytes and the completion queue `depth * 16` bytes, each
/// starting at a page-aligned offset of an earlier mapping of the same file and contiguous in bus
/// address space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueuePairArgs {
    /// In: queue identifier, `1..=Info::queue_pairs`.
    pub qid: u32,
    /// In: entries per queue, `2..=Info::max_queue_entries`.
    pub depth: u32,
    /// In: mapping holding the submission queue.
    pub sq_handle: u32,
    /// In: mapping holding the completion queue.
    pub cq_handle: u32,
    /// In: byte offset of the submission queue in its mapping (page aligned).
    pub sq_offset: u64,
    /// In: byte offset of the completion queue in its mapping (page aligned).
    pub cq_offset: u64,
    /// Out: byte offset of the SQ tail doorbell in the doorbell `mmap`.
    pub sq_doorbell: u32,
    /// Out: byte offset of the CQ head doorbell in the doorbell `mmap`.
    pub cq_doorbell: u32,
}

/// Argument of [`IOCTL_DELETE_QUEUE_PAIR`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeleteQueuePairArgs {
    /// In: queue identifier of a queue pair created through this file.
    pub qid: u32,
    /// In: must be zero.
    pub flags: u32,
}

/// Argument of [`IOCTL_ADMIN`]: an Identify or SMART Get Log Page command.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdminArgs {
    /// In: [`ADMIN_OPC_IDENTIFY`] or [`ADMIN_OPC_GET_LOG_PAGE`].
    pub opcode: u8,
    /// Always zero.
    pub _pad0: [u8; 3],
    /// In: namespace identifier (command dword 1).
    pub nsid: u32,
    /// In: command dwords 10 to 15.
    pub cdw: [u32; 6],
    /// In: user pointer to the data buffer.
    pub data: u64,
    /// In: data buffer length in bytes, `1..=4096`.
    pub data_len: u32,
    /// Out: completion dword 0.
    pub result: u32,
    /// Out: completion status field (status code type << 8 | status code); 0 is success.
    pub status: u32,
    /// Always zero.
    pub _pad1: u32,
}

/// Character of the `legend_nvme` ioctl numbers.
pub const IOCTL_TYPE: u32 = b'L' as u32;

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// Encodes an ioctl number the way Linux's `_IOC` does on x86-64, arm64 and riscv.
pub const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    // CAST: the argument structs are far below the 14-bit size limit (pinned by the layout tests).
    (dir << 30) | ((size as u32) << 16) | (IOCTL_TYPE << 8) | nr
}

/// Fills an [`Info`].
pub const IOCTL_INFO: u32 = ioc(IOC_READ, 0x40, core::mem::size_of::<Info>());
/// Pins and maps memory ([`MapArgs`]).
pub const IOCTL_MAP: u32 = ioc(IOC_READ | IOC_WRITE, 0x41, core::mem::size_of::<MapArgs>());
/// Releases a mapping ([`UnmapArgs`]).
pub const IOCTL_UNMAP: u32 = ioc(IOC_WRITE, 0x42, core::mem::size_of::<UnmapArgs>());
/// Creates an I/O queue pair in caller-supplied memory ([`QueuePairArgs`]).
pub const IOCTL_CREATE_QUEUE_PAIR: u32 = ioc(
    IOC_READ | IOC_WRITE,
    0x43,
    core::mem::size_of::<QueuePairArgs>(),
);
/// Deletes an I/O queue pair ([`DeleteQueuePairArgs`]).
pub const IOCTL_DELETE_QUEUE_PAIR: u32 =
    ioc(IOC_WRITE, 0x44, core::mem::size_of::<DeleteQueuePairArgs>());
/// Runs an allowed admin command ([`AdminArgs`]).
pub const IOCTL_ADMIN: u32 = ioc(
    IOC_READ | IOC_WRITE,
    0x45,
    core::mem::size_of::<AdminArgs>(),
);
