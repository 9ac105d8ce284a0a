//! One I/O queue pair: the bookkeeping ([`Ring`]) and a driver over rings and doorbells in shared
//! memory ([`QueuePair`]).
//!
//! Command identifiers are SQ slot numbers: a slot is reused only once the command written there
//! has completed, so an identifier is never in flight twice and a completion names its slot.

use core::{
    ptr,
    sync::atomic::{Ordering, fence},
};

use crate::{Cqe, Sqe};

/// Deepest queue a [`Ring`] tracks (its in-flight set is a fixed bitmap).
pub const MAX_DEPTH: u16 = 1024;

/// Why a completion was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unexpected {
    /// The completion's command identifier, which names no command in flight.
    pub cid: u16,
}

impl core::fmt::Display for Unexpected {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "completion for command {} that is not in flight",
            self.cid
        )
    }
}

/// Tail, head, phase and the commands in flight of one queue pair.
#[derive(Clone, Debug)]
pub struct Ring {
    depth: u16,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    in_flight: u16,
    busy: [u64; MAX_DEPTH as usize / 64],
}

impl Ring {
    /// A ring of `depth` entries per queue, nothing in flight; the first pass expects phase 1.
    ///
    /// # Panics
    ///
    /// If `depth` is below 2 or above [`MAX_DEPTH`].
    pub fn new(depth: u16) -> Self {
        assert!(
            (2..=MAX_DEPTH).contains(&depth),
            "queue depth {depth} outside 2..={MAX_DEPTH}"
        );
        Self {
            depth,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            in_flight: 0,
            busy: [0; MAX_DEPTH as usize / 64],
        }
    }

    /// Entries per queue.
    pub fn depth(&self) -> u16 {
        self.depth
    }

    /// The SQ tail: the value for the SQ tail doorbell.
    pub fn sq_tail(&self) -> u16 {
        self.sq_tail
    }

    /// The CQ head: the value for the CQ head doorbell.
    pub fn cq_head(&self) -> u16 {
        self.cq_head
    }

    /// The phase tag a new entry at the CQ head carries.
    pub fn phase(&self) -> bool {
        self.phase
    }

    /// Commands submitted and not yet completed.
    pub fn in_flight(&self) -> u16 {
        self.in_flight
    }

    fn is_busy(&self, slot: u16) -> bool {
        self.busy[usize::from(slot / 64)] & (1 << (slot % 64)) != 0
    }

    fn set_busy(&mut self, slot: u16, busy: bool) {
        let (w, b) = (usize::from(slot / 64), 1u64 << (slot % 64));
        if busy {
            self.busy[w] |= b;
        } else {
            self.busy[w] &= !b;
        }
    }

    /// Takes the slot at the SQ tail for a new command and advances the tail; `None` while the
    /// queue is full (depth - 1 in flight) or the tail's previous command is still in flight.
    pub fn push(&mut self) -> Option<u16> {
        let slot = self.sq_tail;
        if self.in_flight >= self.depth - 1 || self.is_busy(slot) {
            return None;
        }
        self.set_busy(slot, true);
        self.in_flight += 1;
        self.sq_tail = (slot + 1) % self.depth;
        Some(slot)
    }

    /// Whether `cqe`, read at the CQ head, is a new completion.
    pub fn is_new(&self, cqe: &Cqe) -> bool {
        cqe.phase() == self.phase
    }

    /// Consumes the new completion `cqe` at the CQ head; returns its command's slot.
    ///
    /// # Errors
    ///
    /// [`Unexpected`] if its identifier names no command in flight (the head still advances: the
    /// entry is consumed either way).
    pub fn complete(&mut self, cqe: &Cqe) -> Result<u16, Unexpected> {
        self.cq_head = (self.cq_head + 1) % self.depth;
        if self.cq_head == 0 {
            self.phase = !self.phase;
        }
        let slot = cqe.cid;
        if slot >= self.depth || !self.is_busy(slot) {
            return Err(Unexpected { cid: slot });
        }
        self.set_busy(slot, false);
        self.in_flight -= 1;
        Ok(slot)
    }
}

/// A queue pair whose rings and doorbells live in memory this process can reach: the device's
/// (host or GPU memory with a BAR mapping of the doorbells) or a proxy controller's.
///
/// # Invariants
///
/// `sq` and `cq` point to `ring.depth()` entries each, and `sq_doorbell` / `cq_doorbell` to
/// writable 32-bit registers, all valid for as long as this object lives.
#[derive(Debug)]
pub struct QueuePair {
    ring: Ring,
    sq: *mut Sqe,
    cq: *const Cqe,
    sq_doorbell: *mut u32,
    cq_doorbell: *mut u32,
}

// SAFETY: the pointers name shared device-visible memory; one thread at a time drives a queue
// pair (`&mut self`).
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Drives the queue pair of `depth` entries at `sq` / `cq` with the given doorbells.
    ///
    /// # Safety
    ///
    /// `sq` and `cq` must point to `depth` zero-initialised (or consumed) entries each, and the
    /// doorbells to writable 32-bit registers; all must stay valid while the result lives, and
    /// nothing else may submit to or consume from this queue pair.
    pub unsafe fn new(
        depth: u16,
        sq: *mut Sqe,
        cq: *const Cqe,
        sq_doorbell: *mut u32,
        cq_doorbell: *mut u32,
    ) -> Self {
        // INVARIANT: the caller's contract.
        Self {
            ring: Ring::new(depth),
            sq,
            cq,
            sq_doorbell,
            cq_doorbell,
        }
    }

    /// The bookkeeping.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Writes `sqe` into the next SQ slot with that slot as its command identifier, without
    /// ringing the doorbell; returns the identifier, or `None` while the queue is full.
    pub fn push(&mut self, sqe: Sqe) -> Option<u16> {
        self.push_with(|_| sqe)
    }

    /// As [`QueuePair::push`], with the command built by `build(slot)` once the slot is known to
    /// be free: what a command keeps per slot (its PRP list page) may be written only then, as
    /// the slot at the tail can still hold a command in flight when completions come out of
    /// order.
    pub fn push_with(&mut self, build: impl FnOnce(u16) -> Sqe) -> Option<u16> {
        let slot = self.ring.push()?;
        let mut sqe = build(slot);
        sqe.set_cid(slot);
        // SAFETY: `slot < depth` (invariants); the controller does not read the slot, whose
        // previous command completed.
        unsafe { ptr::write_volatile(self.sq.add(usize::from(slot)), sqe) };
        Some(slot)
    }

    /// Rings the SQ tail doorbell for everything pushed so far.
    pub fn ring_sq(&self) {
        // The entries must be visible to the controller before it learns of them.
        fence(Ordering::SeqCst);
        // SAFETY: a writable register (invariants).
        unsafe { ptr::write_volatile(self.sq_doorbell, u32::from(self.ring.sq_tail())) };
    }

    /// The next completion, if one was posted; the caller rings [`QueuePair::ring_cq`] after
    /// taking a batch.
    ///
    /// # Errors
    ///
    /// [`Unexpected`] for a completion naming no command in flight (it is consumed).
    pub fn poll(&mut self) -> Option<Result<(u16, Cqe), Unexpected>> {
        // SAFETY: `cq_head < depth` (invariants); a volatile read of memory the controller writes.
        let cqe = unsafe { ptr::read_volatile(self.cq.add(usize::from(self.ring.cq_head()))) };
        if !self.ring.is_new(&cqe) {
            return None;
        }
        // Read the rest of the entry only after its phase tag said it is complete: re-read it
        // behind a fence, as the tag and the fields may have been observed out of order.
        fence(Ordering::Acquire);
        // SAFETY: as above.
        let cqe = unsafe { ptr::read_volatile(self.cq.add(usize::from(self.ring.cq_head()))) };
        Some(self.ring.complete(&cqe).map(|slot| (slot, cqe)))
    }

    /// Tells the controller the completions consumed so far may be overwritten.
    pub fn ring_cq(&self) {
        fence(Ordering::SeqCst);
        // SAFETY: a writable register (invariants).
        unsafe { ptr::write_volatile(self.cq_doorbell, u32::from(self.ring.cq_head())) };
    }

    /// The SQ entry in `slot` (what was submitted there last).
    pub fn sqe(&self, slot: u16) -> Sqe {
        assert!(slot < self.ring.depth(), "slot {slot} out of range");
        // SAFETY: `slot < depth` (checked).
        unsafe { ptr::read_volatile(self.sq.add(usize::from(slot))) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    #[test]
    fn slots_wait_for_their_completion() {
        let mut r = Ring::new(4);
        assert_eq!((r.push(), r.push(), r.push()), (Some(0), Some(1), Some(2)));
        // depth - 1 in flight.
        assert_eq!(r.push(), None);
        // Slot 1 completes first; the tail (3) is free, then slot 0 is still busy.
        let c = Cqe::new(1, 0, 1, Status::SUCCESS, true);
        assert!(r.is_new(&c));
        assert_eq!(r.complete(&c), Ok(1));
        assert_eq!(r.push(), Some(3));
        assert_eq!(r.push(), None, "slot 0 still in flight");
        assert_eq!(r.complete(&Cqe::new(1, 0, 0, Status::SUCCESS, true)), Ok(0));
        assert_eq!(r.push(), Some(0));
        assert_eq!(
            r.complete(&Cqe::new(1, 0, 1, Status::SUCCESS, true)),
            Err(Unexpected { cid: 1 })
        );
    }

    #[test]
    fn phase_flips_at_the_wrap() {
        let mut r = Ring::new(2);
        for round in 0..4 {
            let slot = r.push().unwrap();
            // The phase flips each time the head wraps: every `depth` completions.
            let c = Cqe::new(1, 0, slot, Status::SUCCESS, (round / 2) % 2 == 0);
            assert!(r.is_new(&c), "round {round}");
            r.complete(&c).unwrap();
        }
        // Two wraps: back at phase 1, where an entry left from the last pass is stale.
        assert!(r.phase());
        assert!(!r.is_new(&Cqe::new(1, 0, 0, Status::SUCCESS, false)));
    }

    #[test]
    fn queue_pair_over_plain_memory() {
        let mut sq = [Sqe::default(); 4];
        let mut cq = [Cqe::default(); 4];
        let (mut sdb, mut cdb) = (0u32, 0u32);
        // SAFETY: all four live until the end of the test and only this queue pair uses them.
        let mut qp = unsafe { QueuePair::new(4, sq.as_mut_ptr(), cq.as_ptr(), &mut sdb, &mut cdb) };
        let cid = qp.push(Sqe::flush(1)).unwrap();
        qp.ring_sq();
        assert!(qp.poll().is_none());
        // SAFETY: as above; the "controller" posts the completion.
        unsafe {
            ptr::write_volatile(&raw mut cq[0], Cqe::new(1, 1, cid, Status::SUCCESS, true));
        }
        let (slot, cqe) = qp.poll().unwrap().unwrap();
        qp.ring_cq();
        assert_eq!((slot, cqe.cid), (0, 0));
        // SAFETY: reading what the queue pair wrote.
        let (s, c) = unsafe {
            (
                ptr::read_volatile(&raw const sdb),
                ptr::read_volatile(&raw const cdb),
            )
        };
        assert_eq!((s, c), (1, 1));
        assert_eq!(qp.sqe(0).opcode(), 0);
        assert_eq!(sq[1], Sqe::default());
    }
}
