//! Where a queue pair's parts lie in the memory that holds them, and how large one command may
//! be: the one definition the CPU submitter, the GPU I/O kernels' host side and `bench io` share.

use crate::prp;

/// One queue pair's memory: the SQ, the CQ, then one PRP list page per SQ slot (a command's
/// list lives in its slot's page, so lists never need allocating), each part starting on a
/// page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLayout {
    depth: u16,
}

/// Bytes of an SQ entry and a CQ entry.
const SQE_BYTES: usize = 64;
const CQE_BYTES: usize = 16;
const PAGE: usize = prp::PAGE as usize;

impl QueueLayout {
    /// The layout of a queue pair of `depth` entries per queue.
    pub const fn new(depth: u16) -> Self {
        Self { depth }
    }

    /// Entries per queue.
    pub const fn depth(&self) -> u16 {
        self.depth
    }

    /// Where the SQ starts (the start of the memory).
    pub const fn sq_offset(&self) -> usize {
        0
    }

    /// Where the CQ starts.
    pub const fn cq_offset(&self) -> usize {
        (self.depth as usize * SQE_BYTES).next_multiple_of(PAGE)
    }

    /// Where slot `slot`'s PRP list page starts.
    pub const fn list_offset(&self, slot: u16) -> usize {
        self.cq_offset()
            + (self.depth as usize * CQE_BYTES).next_multiple_of(PAGE)
            + slot as usize * PAGE
    }

    /// Bytes of the whole layout (a multiple of the page).
    pub const fn bytes(&self) -> usize {
        self.list_offset(self.depth)
    }
}

/// The largest command in bytes: the controller's transfer limit (`max_transfer`, 0 for none),
/// what one PRP list page describes, the 16-bit block count of a Read or Write, and 1 MiB,
/// beyond which a command only delays the ones behind it (an SSD's throughput is reached well
/// below it).
pub const fn max_command_bytes(max_transfer: u32, lba_shift: u32) -> u64 {
    let mut bytes = (prp::MAX_PAGES as u64 - 1) * prp::PAGE;
    if max_transfer != 0 && (max_transfer as u64) < bytes {
        bytes = max_transfer as u64;
    }
    let by_count = 65536u64 << lba_shift;
    if by_count < bytes {
        bytes = by_count;
    }
    if bytes > 1 << 20 { 1 << 20 } else { bytes }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_follow_each_other_on_pages() {
        let l = QueueLayout::new(32);
        assert_eq!(
            (l.sq_offset(), l.cq_offset()),
            (0, 2048usize.next_multiple_of(PAGE))
        );
        assert_eq!(l.list_offset(0), 2 * PAGE);
        assert_eq!(l.list_offset(31), 33 * PAGE);
        assert_eq!(l.bytes(), 34 * PAGE);
        let deep = QueueLayout::new(1024);
        assert_eq!(deep.cq_offset(), 16 * PAGE);
        assert_eq!(deep.list_offset(0), 20 * PAGE);
        assert_eq!(deep.bytes(), (20 + 1024) * PAGE);
    }

    #[test]
    fn commands_stay_under_every_limit() {
        assert_eq!(max_command_bytes(0, 9), 1 << 20);
        assert_eq!(max_command_bytes(128 << 10, 12), 128 << 10);
        // 512-byte blocks: 65536 of them are 32 MiB, above the 1 MiB cap.
        assert_eq!(max_command_bytes(u32::MAX, 9), 1 << 20);
    }
}
