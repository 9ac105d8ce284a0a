//! The K best candidates of a query, in one total order so that the answer never depends on
//! how the scan was split between threads.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A candidate and its score.
#[derive(Clone, Copy, Debug)]
pub struct Ranked {
    /// The entity id.
    pub id: u32,
    /// Its score (higher is better).
    pub score: f32,
}

impl Ranked {
    /// The answer order: higher score first; equal scores (`-0.0 == 0.0`) by lower id; a NaN
    /// score after every number (a broken model never looks good).
    pub fn better_first(&self, other: &Ranked) -> Ordering {
        let (a, b) = (self.score, other.score);
        match (a.is_nan(), b.is_nan()) {
            (false, true) => Ordering::Less,
            (true, false) => Ordering::Greater,
            (true, true) => Ordering::Equal,
            (false, false) => b.partial_cmp(&a).expect("neither is NaN"),
        }
        .then(self.id.cmp(&other.id))
    }
}

/// Heap order: the worst candidate on top, so that it is the one a better candidate replaces.
struct Worst(Ranked);

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Worst {}

impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Worst {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.better_first(&other.0)
    }
}

/// The best `k` candidates seen so far.
pub struct TopK {
    k: usize,
    heap: BinaryHeap<Worst>,
}

impl TopK {
    /// Keeps the best `k`.
    pub fn new(k: usize) -> TopK {
        // Grown as candidates come: each thread of a scan keeps one per query, and most of a
        // large K is never reached by a thread's share of the table.
        TopK {
            k,
            heap: BinaryHeap::new(),
        }
    }

    /// Offers a candidate.
    #[inline]
    pub fn offer(&mut self, candidate: Ranked) {
        if self.heap.len() < self.k {
            self.heap.push(Worst(candidate));
        } else if let Some(worst) = self.heap.peek()
            && candidate.better_first(&worst.0) == Ordering::Less
        {
            self.heap.pop();
            self.heap.push(Worst(candidate));
        }
    }

    /// Takes in what another part of the scan kept.
    pub fn merge(&mut self, other: TopK) {
        for Worst(c) in other.heap {
            self.offer(c);
        }
    }

    /// The kept candidates, best first.
    pub fn into_sorted(self) -> Vec<Ranked> {
        let mut out: Vec<Ranked> = self.heap.into_iter().map(|w| w.0).collect();
        out.sort_by(Ranked::better_first);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_best_with_ties_by_id_and_nan_last() {
        let scores = [1.0, f32::NAN, 3.0, 3.0, -0.0, 0.0, 2.0];
        for k in 0..=scores.len() + 1 {
            // Offered in two halves merged in either order: the same answer.
            for split in 0..=scores.len() {
                let (mut a, mut b) = (TopK::new(k), TopK::new(k));
                for (id, &score) in scores.iter().enumerate() {
                    let r = Ranked {
                        id: id as u32,
                        score,
                    };
                    if id < split { a.offer(r) } else { b.offer(r) }
                }
                a.merge(b);
                let ids: Vec<u32> = a.into_sorted().iter().map(|r| r.id).collect();
                let all = [2, 3, 6, 0, 4, 5, 1];
                assert_eq!(ids, all[..k.min(all.len())], "k {k} split {split}");
            }
        }
    }
}
