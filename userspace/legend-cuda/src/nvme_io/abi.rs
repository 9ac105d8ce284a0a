//! The I/O kernels' structs (`kernels/nvme_io.cuh`), laid out as their CUDA twins.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

/// `LegendIoQueue` of `kernels/nvme_io.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IoQueue {
    pub(super) sq: u64,
    pub(super) cq: u64,
    pub(super) sq_doorbell: u64,
    pub(super) cq_doorbell: u64,
    pub(super) lists: u64,
    pub(super) lists_bus: u64,
    pub(super) depth: u32,
    pub(super) qid: u32,
    pub(super) sq_tail: u32,
    pub(super) cq_head: u32,
    pub(super) phase: u32,
    pub(super) pad: u32,
    pub(super) staging: u64,
    pub(super) staging_pages: u64,
    pub(super) staging_first: u64,
    pub(super) staging_bytes: u32,
    pub(super) staging_page_shift: u32,
}

/// `LegendIoJob`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IoJob {
    pub(super) pages: u64,
    pub(super) offset: u64,
    pub(super) bytes: u64,
    pub(super) lba: u64,
    pub(super) command_bytes: u64,
    pub(super) first_command: u64,
    pub(super) device: u64,
    pub(super) page_shift: u32,
    pub(super) opcode: u32,
    pub(super) nsid: u32,
    pub(super) lba_shift: u32,
}

/// `LegendIoResult`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IoResult {
    pub(super) kind: u32,
    pub(super) status: u32,
    pub(super) lba: u64,
    pub(super) opcode: u32,
    pub(super) blocks: u32,
    pub(super) sq_tail: u32,
    pub(super) cq_head: u32,
    pub(super) phase: u32,
    pub(super) in_flight: u32,
    pub(super) last_cqe: [u32; 4],
    pub(super) completed: u64,
}

// SAFETY: plain `repr(C)` structs of integers, laid out as their CUDA twins.
unsafe impl DeviceRepr for IoQueue {}
// SAFETY: as above.
unsafe impl DeviceRepr for IoJob {}
// SAFETY: as above.
unsafe impl DeviceRepr for IoResult {}
// SAFETY: all-zero is a report of nothing done.
unsafe impl ValidAsZeroBits for IoResult {}
