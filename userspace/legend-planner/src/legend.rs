//! Legend's Algorithm 1 (buffer states for capacity 3) with the digest's fixes (a)–(f).
//!
//! The pseudo-code as printed does not reproduce the paper's own Figure 5; each fix below is
//! marked where it is applied. See `Documentation/planner.md`.

use crate::cover::Cover;
use crate::search::{TAIL_MAX, complete};

/// How many states fix (g) may back up before a violation when searching for a repair.
const BACKTRACK: usize = 4;

/// Replaces `out` by `inn` in the sorted state `buf`.
fn replace(buf: &mut Vec<u32>, out: u32, inn: u32) {
    buf.retain(|&p| p != out);
    buf.push(inn);
    buf.sort_unstable();
}

/// Buffer states for `n > 3` partitions and capacity 3, satisfying property (1).
pub(crate) fn states(n: u32) -> Vec<Vec<u32>> {
    let mut states = algorithm1(n);
    // Fix (g): a column that completes on arrival is evicted by the very next swap (N = 8,
    // 12, 17, …), breaking property (1). Repair each violation, first by searching for an
    // equally long completion, else by a two-swap detour.
    while let Some(v) = (2..states.len()).find(|&i| evicted(&states, i) == loaded(&states, i - 1)) {
        states = repair(n, states, v);
    }
    states
}

/// The partition whose arrival made `states[i]`.
fn loaded(states: &[Vec<u32>], i: usize) -> u32 {
    *states[i]
        .iter()
        .find(|p| !states[i - 1].contains(p))
        .expect("one-swap sequence")
}

/// The partition evicted on the way to `states[i]`.
fn evicted(states: &[Vec<u32>], i: usize) -> u32 {
    *states[i - 1]
        .iter()
        .find(|p| !states[i].contains(p))
        .expect("one-swap sequence")
}

/// Removes the property-(1) violation at `states[v]` (whose swap evicts what the previous
/// swap loaded).
fn repair(n: u32, states: Vec<Vec<u32>>, v: usize) -> Vec<Vec<u32>> {
    for j in (v.saturating_sub(BACKTRACK).max(2)..=v).rev() {
        let prefix = &states[..j];
        let mut cover = Cover::new(n);
        for s in prefix {
            cover.mark_state(s);
        }
        let open: Vec<u32> = (0..n).filter(|&p| !cover.row_full(p)).collect();
        if open.len() > TAIL_MAX {
            break;
        }
        let current = &prefix[j - 1];
        let last = loaded(prefix, j - 1);
        if let Some(tail) = complete(current, Some(last), &open, &cover, states.len() - j) {
            let mut out = prefix.to_vec();
            out.extend(tail);
            return out;
        }
    }
    // Detour: {l, a, b} → {x, a, b} evicts l, just loaded. Instead evict c ∈ {a, b} for x,
    // then l for c; c is chosen so that the following swap does not evict it.
    let (l, x) = (loaded(&states, v - 1), loaded(&states, v));
    let next_evict = (v + 1 < states.len()).then(|| evicted(&states, v + 1));
    let keep: Vec<u32> = states[v - 1].iter().copied().filter(|&p| p != l).collect();
    let c = *keep
        .iter()
        .find(|&&p| Some(p) != next_evict)
        .expect("two candidates, at most one excluded");
    let mut detour: Vec<u32> = states[v - 1]
        .iter()
        .copied()
        .filter(|&p| p != c)
        .chain([x])
        .collect();
    detour.sort_unstable();
    let mut out = states;
    out.insert(v, detour);
    out
}

/// Algorithm 1 with fixes (a)–(f).
fn algorithm1(n: u32) -> Vec<Vec<u32>> {
    debug_assert!(n > 3);
    let mut buf = vec![0, 1, 2];
    let mut states = vec![buf.clone()];
    // Column-0 phase: partition 0 stays, the rest stream through the other two slots.
    for i in 3..n {
        replace(&mut buf, i - 2, i);
        states.push(buf.clone());
    }
    let mut cover = Cover::new(n);
    for s in &states {
        cover.mark_state(s);
    }

    let mut cur = 0;
    // Fix (a): the eviction chosen at a column change is used by the next swap, not dropped.
    let mut carried = None;
    while !cover.all() {
        if cover.row_full(cur) {
            // Fix (f): skip columns that are already complete. Columns before `cur` are all
            // complete, so an uncovered bucket implies an incomplete column after `cur`.
            let next = (cur + 1..n)
                .find(|&c| !cover.row_full(c))
                .expect("uncovered bucket implies an incomplete later column");
            let candidates: Vec<u32> = if buf.contains(&next) {
                // No swap needed; still never pick the partition loaded last (property 1).
                let prev = &states[states.len() - 2];
                buf.iter()
                    .copied()
                    .filter(|&p| p != next && prev.contains(&p))
                    .collect()
            } else {
                replace(&mut buf, cur, next);
                cover.mark_state(&buf);
                states.push(buf.clone());
                buf.iter().copied().filter(|&p| p != next).collect()
            };
            carried = Some(next_eviction(&cover, n, next, &candidates));
            cur = next;
        } else {
            let evict = carried.take().unwrap_or_else(|| {
                // Line 20: the resident kept across the last swap that is not the column.
                let prev = &states[states.len() - 2];
                *buf.iter()
                    .find(|&&p| p != cur && prev.contains(&p))
                    .expect("a capacity-3 swap keeps two partitions")
            });
            let rest = *buf
                .iter()
                .find(|&&p| p != cur && p != evict)
                .expect("capacity 3 leaves one partition besides column and eviction");
            let load = best_load(&cover, n, cur, rest);
            replace(&mut buf, evict, load);
            cover.mark_state(&buf);
            states.push(buf.clone());
        }
    }
    states
}

/// Lines 13–17: which partition the first swap of column `col` evicts.
fn next_eviction(cover: &Cover, n: u32, col: u32, candidates: &[u32]) -> u32 {
    let max = *candidates.iter().max().expect("non-empty candidates");
    // Fix (b): the test is "some bucket (col, x) with x beyond the largest resident is open",
    // not the off-by-one slice sum. Fix (c): the minimum never picks the column itself
    // (`candidates` excludes it).
    if (max + 1..n).any(|x| !cover.is(col, x)) {
        max
    } else {
        *candidates.iter().min().expect("non-empty candidates")
    }
}

/// Lines 22–24: the partition to load next to `col` and `rest`.
fn best_load(cover: &Cover, n: u32, col: u32, rest: u32) -> u32 {
    // Fix (d): the circular scan starts at (rest + col + 1) mod n.
    let begin = (rest + col + 1) % n;
    let mut best: Option<(u32, usize)> = None;
    for k in 0..n {
        let x = (begin + k) % n;
        // Fix (e): only partitions that still owe a bucket to the current column qualify;
        // the score counts every newly covered bucket, ties go to the first in scan order.
        if cover.is(col, x) {
            continue;
        }
        let gain = cover.gain(x, &[col, rest]);
        if best.is_none_or(|(_, g)| gain > g) {
            best = Some((x, gain));
        }
    }
    best.expect("an incomplete column has an uncovered bucket")
        .0
}
