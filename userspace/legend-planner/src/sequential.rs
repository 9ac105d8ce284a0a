//! Naive baseline: rows in order, first-in-first-out eviction.

use std::collections::VecDeque;

use crate::cover::Cover;

/// Buffer states that pin partition `i` for rows `i = 0, 1, …` and load every partition it
/// still owes a bucket, evicting the resident loaded longest ago. No lookahead at all, so
/// it needs roughly twice BETA's I/O at capacity 3; it exists for ablations.
pub(crate) fn states(n: u32, capacity: u32) -> Vec<Vec<u32>> {
    let mut fifo: VecDeque<u32> = (0..capacity).collect();
    let mut cover = Cover::new(n);
    let mut states = Vec::new();
    let mut push = |fifo: &VecDeque<u32>, cover: &mut Cover| {
        let mut s: Vec<u32> = fifo.iter().copied().collect();
        s.sort_unstable();
        cover.mark_state(&s);
        states.push(s);
    };
    push(&fifo, &mut cover);
    for i in 0..n {
        for j in i..n {
            if cover.is(i, j) {
                continue;
            }
            for want in [i, j] {
                if !fifo.contains(&want) {
                    let victim = fifo
                        .iter()
                        .position(|&p| p != i)
                        .expect("capacity ≥ 2 leaves an unpinned slot");
                    fifo.remove(victim);
                    fifo.push_back(want);
                    push(&fifo, &mut cover);
                }
            }
        }
    }
    states
}
