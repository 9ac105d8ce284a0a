//! The `legend_nvme` kernel module's ioctl ABI.
//!
//! The definitions live in `kmod/uapi.rs`, which the kernel module compiles too, so userspace and
//! the module always agree; this crate only re-exports them and pins their layout in tests.

#![no_std]

#[path = "../../../kmod/uapi.rs"]
mod abi;

pub use abi::*;

#[cfg(test)]
mod tests {
    use core::mem::{offset_of, size_of};

    use super::*;

    #[test]
    fn struct_layouts_are_pinned() {
        assert_eq!(size_of::<NamespaceInfo>(), 16);
        assert_eq!(size_of::<Info>(), 368);
        assert_eq!(offset_of!(Info, nvme_version), 12);
        assert_eq!(offset_of!(Info, model), 16);
        assert_eq!(offset_of!(Info, serial), 56);
        assert_eq!(offset_of!(Info, firmware), 76);
        assert_eq!(offset_of!(Info, max_queue_entries), 84);
        assert_eq!(offset_of!(Info, num_namespaces), 104);
        assert_eq!(offset_of!(Info, namespaces), 112);
        assert_eq!(size_of::<MapArgs>(), 48);
        assert_eq!(offset_of!(MapArgs, bus_addrs_cap), 24);
        assert_eq!(offset_of!(MapArgs, handle), 36);
        assert_eq!(offset_of!(MapArgs, pages), 44);
        assert_eq!(size_of::<UnmapArgs>(), 8);
        assert_eq!(size_of::<QueuePairArgs>(), 40);
        assert_eq!(offset_of!(QueuePairArgs, sq_offset), 16);
        assert_eq!(offset_of!(QueuePairArgs, sq_doorbell), 32);
        assert_eq!(size_of::<DeleteQueuePairArgs>(), 8);
        assert_eq!(size_of::<AdminArgs>(), 56);
        assert_eq!(offset_of!(AdminArgs, nsid), 4);
        assert_eq!(offset_of!(AdminArgs, data), 32);
        assert_eq!(offset_of!(AdminArgs, status), 48);
    }

    #[test]
    fn ioctl_numbers_are_pinned() {
        assert_eq!(IOCTL_INFO, 0x8170_4c40);
        assert_eq!(IOCTL_MAP, 0xc030_4c41);
        assert_eq!(IOCTL_UNMAP, 0x4008_4c42);
        assert_eq!(IOCTL_CREATE_QUEUE_PAIR, 0xc028_4c43);
        assert_eq!(IOCTL_DELETE_QUEUE_PAIR, 0x4008_4c44);
        assert_eq!(IOCTL_ADMIN, 0xc038_4c45);
    }
}
