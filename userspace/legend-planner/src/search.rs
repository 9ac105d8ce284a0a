//! Exhaustive search for the shortest way to finish covering the last few partitions.
//!
//! Used by BETA to shorten its tail and by Legend to repair property (1) near the end.

use crate::cover::Cover;

/// Search budget in visited nodes; beyond it the caller keeps its own completion.
const SEARCH_BUDGET: u32 = 200_000;

/// Most open partitions the search handles: pair sets live in a `u128` (m² bits).
pub(crate) const TAIL_MAX: usize = 11;

/// Who the previous swap loaded, in the search's terms.
#[derive(Clone, Copy, PartialEq)]
enum Last {
    /// No constraint.
    Free,
    /// An open partition (local id): it may not be evicted next.
    Open(usize),
    /// A closed resident: one closed resident is not evictable next.
    Closed,
}

/// The search space: open partitions get local ids `0..m`, residents are a bit mask, and
/// closed residents only matter as free slots.
struct Tail {
    m: usize,
    capacity: usize,
    /// Whether property (1) constrains every swap, not only the first.
    property1: bool,
    budget: u32,
    /// Moves so far: (local partition loaded, local partition evicted or `None` for a closed one).
    path: Vec<(usize, Option<usize>)>,
}

impl Tail {
    fn bit(&self, a: usize, b: usize) -> u128 {
        let (a, b) = if a <= b { (a, b) } else { (b, a) };
        1 << (a * self.m + b)
    }

    /// Lower bound on the swaps still needed: every open non-resident partition must be
    /// loaded, and a swap covers at most C−1 new pairs of distinct partitions.
    fn lower_bound(&self, resident: u16, open: u128) -> usize {
        let mut pending = 0u16;
        let mut cross = 0;
        for a in 0..self.m {
            for b in a..self.m {
                if open & self.bit(a, b) != 0 {
                    pending |= (1 << a) | (1 << b);
                    cross += usize::from(a != b);
                }
            }
        }
        let loads = (pending & !resident).count_ones() as usize;
        loads.max(cross.div_ceil(self.capacity - 1))
    }

    /// `None` when the budget ran out.
    fn dfs(
        &mut self,
        resident: u16,
        closed: usize,
        last: Last,
        open: u128,
        limit: usize,
    ) -> Option<bool> {
        if open == 0 {
            return Some(true);
        }
        if self.path.len() + self.lower_bound(resident, open) > limit {
            return Some(false);
        }
        self.budget = self.budget.checked_sub(1)?;
        let evictable_closed = closed - usize::from(last == Last::Closed);
        for x in (0..self.m).filter(|&x| resident & (1 << x) == 0) {
            let evictions = (evictable_closed > 0).then_some(None).into_iter().chain(
                (0..self.m)
                    .filter(|&y| resident & (1 << y) != 0 && last != Last::Open(y))
                    .map(Some),
            );
            for y in evictions {
                let next = (resident | (1 << x)) & !y.map_or(0, |y| 1 << y);
                let covered = (0..self.m)
                    .filter(|&r| next & (1 << r) != 0)
                    .fold(0, |acc, r| acc | self.bit(x, r));
                self.path.push((x, y));
                let closed = closed - usize::from(y.is_none());
                let last = if self.property1 {
                    Last::Open(x)
                } else {
                    Last::Free
                };
                if self.dfs(next, closed, last, open & !covered, limit)? {
                    return Some(true);
                }
                self.path.pop();
            }
        }
        Some(false)
    }
}

/// A shortest sequence of at most `within` further states that covers every bucket, starting
/// from state `current`. With `last_loaded` (the partition whose arrival made `current`),
/// every swap keeps property (1); without, swaps are unconstrained. `open` lists the
/// partitions that still owe buckets (at most [`TAIL_MAX`]). `None` when there is none or
/// the budget runs out.
pub(crate) fn complete(
    current: &[u32],
    last_loaded: Option<u32>,
    open: &[u32],
    cover: &Cover,
    within: usize,
) -> Option<Vec<Vec<u32>>> {
    debug_assert!(open.len() <= TAIL_MAX);
    let capacity = current.len();
    let mut tail = Tail {
        m: open.len(),
        capacity,
        property1: last_loaded.is_some(),
        budget: SEARCH_BUDGET,
        path: Vec::new(),
    };
    let mut resident = 0u16;
    let mut open_pairs = 0u128;
    for (a, &pa) in open.iter().enumerate() {
        if current.contains(&pa) {
            resident |= 1 << a;
        }
        for (b, &pb) in open.iter().enumerate().skip(a) {
            if !cover.is(pa, pb) {
                open_pairs |= tail.bit(a, b);
            }
        }
    }
    let last = match last_loaded {
        None => Last::Free,
        Some(p) => open
            .iter()
            .position(|&o| o == p)
            .map_or(Last::Closed, Last::Open),
    };
    let closed = capacity - resident.count_ones() as usize;
    for limit in tail.lower_bound(resident, open_pairs)..=within {
        if tail.dfs(resident, closed, last, open_pairs, limit)? {
            let mut buf = current.to_vec();
            let mut avoid = last_loaded;
            let mut out = Vec::with_capacity(tail.path.len());
            for &(x, y) in &tail.path {
                let victim = match y {
                    Some(y) => open[y],
                    None => *buf
                        .iter()
                        .find(|&&p| !open.contains(&p) && Some(p) != avoid)
                        .expect("search evicts a closed partition only when one is evictable"),
                };
                buf.retain(|&p| p != victim);
                buf.push(open[x]);
                buf.sort_unstable();
                avoid = last_loaded.map(|_| open[x]);
                out.push(buf.clone());
            }
            return Some(out);
        }
    }
    None
}
