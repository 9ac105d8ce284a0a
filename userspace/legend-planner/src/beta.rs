//! Marius's BETA ordering, plus an exhaustive search for the last few partitions.
//!
//! BETA (Mohoney et al., OSDI'21): fill the buffer with the first C partitions; swap every
//! on-disk partition through the last slot in turn, so the C−1 other slots meet everything;
//! those C−1 are then finished and are replaced one by one from disk; repeat. Marius shuffles
//! the partitions; this planner keeps id order so that plans are reproducible (the number of
//! states does not depend on the permutation).
//!
//! Plain BETA wastes a state at every phase change. Once at most C+3 partitions still owe
//! buckets, an iterative-deepening search looks for a shorter completion and keeps it when it
//! finds one; at C = 3 this saves one state for N ≥ 8 (N = 12: 35 → 34, Legend's Table 8).

use crate::cover::Cover;
use crate::search::{TAIL_MAX, complete};

/// Buffer slots, the on-disk queue and coverage of a BETA run in progress.
#[derive(Clone)]
struct Run {
    slots: Vec<u32>,
    on_disk: Vec<u32>,
    cover: Cover,
    states: Vec<Vec<u32>>,
}

impl Run {
    fn push(&mut self) {
        let mut s = self.slots.clone();
        s.sort_unstable();
        self.cover.mark_state(&s);
        self.states.push(s);
    }

    /// One BETA phase: rotate the disk through the last slot, then retire the other slots.
    fn phase(&mut self) {
        let last = self.slots.len() - 1;
        for i in 0..self.on_disk.len() {
            std::mem::swap(&mut self.on_disk[i], &mut self.slots[last]);
            self.push();
        }
        let replaced = last.min(self.on_disk.len());
        for i in 0..replaced {
            self.slots[i] = self.on_disk[i];
            self.push();
        }
        self.on_disk.drain(..replaced);
    }
}

/// Buffer states for `n > capacity ≥ 2`.
pub(crate) fn states(n: u32, capacity: u32) -> Vec<Vec<u32>> {
    let mut run = Run {
        slots: (0..capacity).collect(),
        on_disk: (capacity..n).collect(),
        cover: Cover::new(n),
        states: Vec::new(),
    };
    run.push();
    while !run.on_disk.is_empty() {
        let open: Vec<u32> = (0..n).filter(|&p| !run.cover.row_full(p)).collect();
        if open.len() <= (capacity as usize + 3).min(TAIL_MAX) {
            let mut plain = run.clone();
            while !plain.on_disk.is_empty() {
                plain.phase();
            }
            let plain_tail = plain.states.len() - run.states.len();
            let current = run
                .states
                .last()
                .expect("at least the initial state")
                .clone();
            return match complete(&current, None, &open, &run.cover, plain_tail - 1) {
                Some(tail) => {
                    run.states.extend(tail);
                    run.states
                }
                None => plain.states,
            };
        }
        run.phase();
    }
    run.states
}
