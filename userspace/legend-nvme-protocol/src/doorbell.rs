//! Doorbell offsets in BAR0 (NVMe Base 2.0, 3.1.4): the SQ tail doorbell of queue `qid` sits at
//! `0x1000 + 2 qid stride`, its CQ head doorbell one stride later; the stride is `4 << CAP.DSTRD`.

/// Offset in BAR0 of the first doorbell (the admin SQ tail).
pub const BASE: usize = 0x1000;

/// Offset in BAR0 of queue `qid`'s SQ tail doorbell.
pub fn sq_tail(qid: u16, stride: usize) -> usize {
    BASE + 2 * usize::from(qid) * stride
}

/// Offset in BAR0 of queue `qid`'s CQ head doorbell.
pub fn cq_head(qid: u16, stride: usize) -> usize {
    BASE + (2 * usize::from(qid) + 1) * stride
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_the_stride() {
        assert_eq!(sq_tail(0, 4), 0x1000);
        assert_eq!(cq_head(0, 4), 0x1004);
        assert_eq!(sq_tail(3, 4), 0x1018);
        assert_eq!(cq_head(3, 4096), 0x1000 + 7 * 4096);
    }
}
