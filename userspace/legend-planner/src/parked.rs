//! Rounds for K GPUs over N ≥ 3K partitions: the table no longer needs to fit in the GPUs'
//! memory together, because the partitions no GPU holds in a round wait in the run's home
//! (host memory) — "parked" — and every move goes through it, read ahead.
//!
//! A round gives each GPU a pair of partitions (no partition on two GPUs), as with N = 2K. From
//! one round to the next a GPU keeps one partition and swaps the other for one that was parked
//! during the round before, so the read of the arriving partition runs while the GPU trains
//! the round before (Legend's prefetch, per GPU: two slots training, a third filling), and the
//! partition it gives up is written home while it trains the next. No partition goes GPU to
//! GPU: a partition dropped by one GPU is parked for at least a round before another takes it,
//! which the home orders (a read waits for the write of the same partition).
//!
//! The rounds are built greedily: each GPU's next partition is matched (a bipartite matching of
//! GPUs to parked partitions) so that as many GPUs as possible train a pair not yet trained,
//! preferring the partitions with the most pairs left. When the pairs left all join partitions
//! held by different GPUs, a GPU swaps both partitions (one of the two reads cannot be read
//! ahead: an *exposed* load) or parks one to free it. Several seeded attempts are made and the
//! one with the fewest rounds, then the fewest exposed loads, is kept; the lower bound is
//! ⌈N(N − 1) / 2K⌉ rounds (every pair once, K a round).

/// Attempts, each with its own tie-breaking, at N ≤ 32 (small schedules gain most from a
/// second look); fewer above, so that planning stays well under a second: the schedule is a
/// function of (N, K).
const ATTEMPTS: u64 = 64;

/// Seated rounds (per round, GPU `g`'s pair at `g`) covering every pair of `n` partitions
/// once with `k` GPUs, `n ≥ 3k`, each GPU keeping one partition from a round to the next
/// wherever it can (see the module docs).
pub(crate) fn parked_rounds(n: u32, k: u32) -> Vec<Vec<[u32; 2]>> {
    assert!(k >= 1 && n >= 3 * k, "parked rounds need N ≥ 3K");
    let attempts = (ATTEMPTS * 32 * 32 / u64::from(n * n)).clamp(2, ATTEMPTS);
    (0..attempts)
        .filter_map(|seed| attempt(n, k, seed))
        .min_by_key(|rounds| (rounds.len(), exposed_loads(rounds)))
        .expect("the first attempt never gives up (it breaks ties by index)")
}

/// The most partitions a parked schedule plans (a GPU then holds 3/256 of the table; planning
/// takes about a second there, and grows with N³).
pub const MAX_PARKED_PARTITIONS: u32 = 256;

/// Parked partitions a GPU with no open pair through one considers pairing first.
const FALLBACK_CANDIDATES: usize = 16;

/// Transitions (over consecutive rounds, per GPU) that bring a GPU two partitions: one of them
/// cannot be read ahead into the one free slot.
pub(crate) fn exposed_loads(rounds: &[Vec<[u32; 2]>]) -> usize {
    rounds
        .windows(2)
        .map(|w| {
            w[0].iter()
                .zip(&w[1])
                .filter(|(before, now)| now.iter().all(|p| !before.contains(p)))
                .count()
        })
        .sum()
}

/// Pairs still to train and what each partition has left.
struct Uncovered {
    n: u32,
    pair: Vec<bool>,
    left: Vec<u32>,
    total: u64,
}

impl Uncovered {
    fn new(n: u32) -> Uncovered {
        let mut pair = vec![true; (n * n) as usize];
        for p in 0..n {
            pair[(p * n + p) as usize] = false;
        }
        Uncovered {
            n,
            pair,
            left: vec![n - 1; n as usize],
            total: u64::from(n) * u64::from(n - 1) / 2,
        }
    }

    fn open(&self, a: u32, b: u32) -> bool {
        self.pair[(a * self.n + b) as usize]
    }

    fn cover(&mut self, a: u32, b: u32) {
        if self.open(a, b) {
            self.pair[(a * self.n + b) as usize] = false;
            self.pair[(b * self.n + a) as usize] = false;
            self.left[a as usize] -= 1;
            self.left[b as usize] -= 1;
            self.total -= 1;
        }
    }
}

/// One greedy construction; `None` if it wanders past a generous bound (another attempt then
/// serves; attempt 0 has never been seen to).
fn attempt(n: u32, k: u32, seed: u64) -> Option<Vec<Vec<[u32; 2]>>> {
    let mut open = Uncovered::new(n);
    let mut held: Vec<[u32; 2]> = (0..k).map(|g| [2 * g, 2 * g + 1]).collect();
    for &[a, b] in &held {
        open.cover(a, b);
    }
    let mut rounds = vec![held.clone()];
    let fewest = open.total.div_ceil(u64::from(k)) as usize;
    let limit = 4 * fewest + 4 * n as usize;
    // Ties broken by a fixed hash of (seed, partition): attempts differ, each is repeatable.
    let rank = |p: u32| splitmix(seed ^ u64::from(p).wrapping_mul(0x9e37_79b9));
    while open.total > 0 {
        if rounds.len() > limit {
            return None;
        }
        let mut parked = vec![true; n as usize];
        for &[a, b] in &held {
            parked[a as usize] = false;
            parked[b as usize] = false;
        }
        // Each GPU's options: a parked partition that makes an open pair with one it holds,
        // the neediest first.
        let mut options: Vec<Vec<u32>> = held
            .iter()
            .map(|&[a, b]| {
                let mut o: Vec<u32> = (0..n)
                    .filter(|&y| parked[y as usize] && (open.open(a, y) || open.open(b, y)))
                    .collect();
                o.sort_by_key(|&y| (std::cmp::Reverse(open.left[y as usize]), rank(y)));
                o
            })
            .collect();
        let taken = match_gpus(&mut options, n);
        let mut used = vec![false; n as usize];
        for y in taken.iter().flatten() {
            used[*y as usize] = true;
        }
        let mut next = held.clone();
        for g in 0..k as usize {
            let [a, b] = held[g];
            next[g] = match taken[g] {
                // Keep the held partition the new one pairs with (the needier if both).
                Some(y) => {
                    let keep = match (open.open(a, y), open.open(b, y)) {
                        (true, true) => needier(&open, a, b, rank),
                        (true, false) => a,
                        _ => b,
                    };
                    [keep, y]
                }
                None => fallback(&open, &parked, &mut used, held[g], n, rank),
            };
        }
        for &[a, b] in &next {
            open.cover(a, b);
        }
        held = next;
        rounds.push(held.clone());
    }
    Some(rounds)
}

/// The held partition with more pairs left (ties by `rank`).
fn needier(open: &Uncovered, a: u32, b: u32, rank: impl Fn(u32) -> u64) -> u32 {
    let key = |p: u32| (open.left[p as usize], rank(p));
    if key(a) >= key(b) { a } else { b }
}

/// A GPU with no open pair through a parked partition: it swaps both partitions for an open
/// pair of parked ones (one load exposed); else, if one of its partitions still has pairs
/// left, it parks the other for a partition nobody needs this round (freeing it for a GPU
/// whose partner it is); else it stays.
fn fallback(
    open: &Uncovered,
    parked: &[bool],
    used: &mut [bool],
    held: [u32; 2],
    n: u32,
    rank: impl Fn(u32) -> u64 + Copy,
) -> [u32; 2] {
    let mut free: Vec<u32> = (0..n)
        .filter(|&p| parked[p as usize] && !used[p as usize])
        .collect();
    // The neediest partitions first; pairs among the first few are enough to choose from.
    free.sort_by_key(|&p| (std::cmp::Reverse(open.left[p as usize]), rank(p)));
    let best_pair = free
        .iter()
        .take(FALLBACK_CANDIDATES)
        .flat_map(|&x| free.iter().map(move |&y| (x, y)))
        .filter(|&(x, y)| x != y && open.open(x, y))
        .max_by_key(|&(x, y)| {
            (
                open.left[x as usize] + open.left[y as usize],
                std::cmp::Reverse(rank(x) ^ rank(y)),
            )
        });
    if let Some((x, y)) = best_pair {
        used[x as usize] = true;
        used[y as usize] = true;
        return [x, y];
    }
    let [a, b] = held;
    let keep = needier(open, a, b, rank);
    let drop = a + b - keep;
    if open.left[drop as usize] == 0 && open.left[keep as usize] == 0 {
        return held;
    }
    // The one to park is the one whose pairs left are elsewhere: parked, another GPU may take
    // it. Its replacement is the parked partition with the fewest pairs left (least needed).
    match free
        .iter()
        .min_by_key(|&&y| (open.left[y as usize], rank(y)))
    {
        Some(&y) => {
            used[y as usize] = true;
            [keep, y]
        }
        None => held,
    }
}

/// A maximum matching of GPUs to parked partitions (`options[g]`: GPU g's, in preference
/// order), by augmenting paths: `result[g]` the partition GPU g takes.
fn match_gpus(options: &mut [Vec<u32>], n: u32) -> Vec<Option<u32>> {
    let mut owner: Vec<Option<usize>> = vec![None; n as usize];
    // GPUs with fewer options choose first: the greedy start leaves fewer paths to augment.
    let mut order: Vec<usize> = (0..options.len()).collect();
    order.sort_by_key(|&g| options[g].len());
    for g in order {
        let mut seen = vec![false; n as usize];
        augment(g, options, &mut owner, &mut seen);
    }
    let mut result = vec![None; options.len()];
    for (p, o) in owner.iter().enumerate() {
        if let Some(g) = o {
            result[*g] = Some(p as u32);
        }
    }
    result
}

/// Kuhn's step: finds GPU `g` a partition, moving others along an augmenting path.
fn augment(g: usize, options: &[Vec<u32>], owner: &mut [Option<usize>], seen: &mut [bool]) -> bool {
    for &y in &options[g] {
        if std::mem::replace(&mut seen[y as usize], true) {
            continue;
        }
        if owner[y as usize].is_none_or(|h| augment(h, options, owner, seen)) {
            owner[y as usize] = Some(g);
            return true;
        }
    }
    false
}

/// splitmix64's finaliser: tie-breaking ranks.
fn splitmix(x: u64) -> u64 {
    let z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_cover_every_pair_once_keeping_one_partition_and_loading_parked_ones() {
        let mut report = Vec::new();
        for k in 1..=8u32 {
            for n in [3 * k, 3 * k + 1, 4 * k, 6 * k + 1, 8 * k] {
                let rounds = parked_rounds(n, k);
                let mut seen = vec![0u32; (n * n) as usize];
                for (r, round) in rounds.iter().enumerate() {
                    let mut on = vec![false; n as usize];
                    for &[a, b] in round {
                        assert!(
                            a != b && !on[a as usize] && !on[b as usize],
                            "N {n} K {k} r {r}"
                        );
                        on[a as usize] = true;
                        on[b as usize] = true;
                        seen[(a.min(b) * n + a.max(b)) as usize] += 1;
                    }
                    if r > 0 {
                        for (g, pair) in round.iter().enumerate() {
                            for p in pair {
                                let before = &rounds[r - 1];
                                assert!(
                                    before[g].contains(p) || before.iter().all(|h| !h.contains(p)),
                                    "N {n} K {k} round {r}: GPU {g} takes {p} from another GPU"
                                );
                            }
                        }
                    }
                }
                for a in 0..n {
                    for b in a + 1..n {
                        assert!(seen[(a * n + b) as usize] >= 1, "N {n} K {k}: ({a}, {b})");
                    }
                }
                let fewest = (n * (n - 1) / 2).div_ceil(k) as usize;
                report.push((n, k, rounds.len(), fewest, exposed_loads(&rounds)));
            }
        }
        for &(n, k, rounds, fewest, exposed) in &report {
            eprintln!("N {n:>3} K {k}: {rounds} rounds (fewest {fewest}), {exposed} exposed");
        }
    }
}
