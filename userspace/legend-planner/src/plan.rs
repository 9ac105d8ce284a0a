//! The plan type, the bucket scheduler (Algorithm 2, generalised) and the validator.

use serde::Serialize;

use crate::bucket::Bucket;
use crate::error::ValidationError;
use crate::order::Order;

/// One buffer-state change: exactly one partition leaves and one arrives, in the same slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Swap {
    /// Partition written back (and whose slot is reused).
    pub evicted: u32,
    /// Partition read into the freed slot.
    pub loaded: u32,
    /// Buckets computed while the swap's I/O is in flight: both partitions stay resident
    /// across the swap (neither is `evicted` nor `loaded`).
    pub overlap: Vec<Bucket>,
    /// Buckets computed once the I/O has completed; they may use `loaded`.
    pub after: Vec<Bucket>,
}

/// A complete epoch schedule: buffer states, swaps and the execution order of all N² buckets.
///
/// # Engine contract
///
/// 1. Fill the buffer with `states[0]`.
/// 2. Compute the buckets in `initial`.
/// 3. For each entry of `swaps`, in order: start the I/O (write back `evicted`, read `loaded`
///    into its slot); compute `overlap` meanwhile; wait for the I/O; compute `after`.
///
/// After swap `i` the buffer holds `states[i + 1]`. `order` is `initial` followed by each
/// swap's `overlap` and `after`; it lists every bucket exactly once. Buckets that are only
/// computable in the last state (a final flush) are part of the last swap's `after` (or of
/// `initial` when there are no swaps). Plans returned by [`crate::plan`] have passed
/// [`validate`].
///
/// The JSON form has exactly the keys `io_count`, `volume`, `swaps_without_overlap`,
/// `states`, `swaps` and `order`; the other fields are skipped.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Number of buffer states, the initial fill counted once (Legend's Table 8 "I/O times").
    pub io_count: usize,
    /// Partition reads per epoch in units of the whole store: `io_count / N`.
    pub volume: f64,
    /// Swaps whose `overlap` group is empty, so their I/O cannot hide behind compute.
    pub swaps_without_overlap: usize,
    /// Buffer states in order, each a sorted list of resident partitions.
    pub states: Vec<Vec<u32>>,
    /// `states.len() - 1` swaps; swap `i` turns `states[i]` into `states[i + 1]`.
    pub swaps: Vec<Swap>,
    /// Every bucket once, in execution order.
    pub order: Vec<Bucket>,
    /// Buckets computed on `states[0]` before the first swap.
    #[serde(skip)]
    pub initial: Vec<Bucket>,
    /// Ordering that produced the plan.
    #[serde(skip)]
    pub kind: Order,
    /// Number of partitions N.
    #[serde(skip)]
    pub num_partitions: u32,
    /// Buffer capacity C.
    #[serde(skip)]
    pub capacity: u32,
}

/// The one element of `a` missing from `b` (both sorted states of a one-swap change).
fn sole_difference(a: &[u32], b: &[u32]) -> Option<u32> {
    let mut it = a.iter().copied().filter(|p| !b.contains(p));
    match (it.next(), it.next()) {
        (Some(p), None) => Some(p),
        _ => None,
    }
}

/// Turns a buffer-state sequence into a plan by scheduling buckets as late as possible.
///
/// This is Algorithm 2 generalised to any capacity: in each state, compute exactly the
/// outstanding buckets of the partition about to be evicted — those not needing the
/// partition just loaded go to the swap's `overlap`, the rest to `after`. Computing a bucket
/// only when it must be computed leaves the most work for later overlap groups. Called only
/// on one-swap sequences; [`validate`] re-checks everything afterwards.
pub(crate) fn build(kind: Order, n: u32, capacity: u32, states: Vec<Vec<u32>>) -> Plan {
    let nu = n as usize;
    let mut done = vec![false; nu * nu];
    let mut take = |b: Bucket, out: &mut Vec<Bucket>| {
        let cell = &mut done[b[0] as usize * nu + b[1] as usize];
        if !*cell {
            *cell = true;
            out.push(b);
        }
    };
    let mut initial = Vec::new();
    let mut swaps: Vec<Swap> = Vec::with_capacity(states.len().saturating_sub(1));
    for (i, state) in states.iter().enumerate() {
        let loaded = (i > 0).then(|| sole_difference(state, &states[i - 1]).unwrap_or(u32::MAX));
        let mut group = Vec::new();
        match states.get(i + 1) {
            Some(next) => {
                let evict = sole_difference(state, next).unwrap_or(u32::MAX);
                // Lines 7–13 (older residents) then 14–19 (the loaded partition).
                for &k in state.iter().filter(|&&k| Some(k) != loaded) {
                    take([evict, k], &mut group);
                    take([k, evict], &mut group);
                }
                if let Some(l) = loaded {
                    take([evict, l], &mut group);
                    take([l, evict], &mut group);
                }
            }
            None => {
                // Fix (c) of Algorithm 2: flush whatever the last state still owes.
                for &a in state {
                    for &b in state {
                        take([a, b], &mut group);
                    }
                }
            }
        }
        match loaded {
            None => initial = group,
            Some(l) => {
                let (after, overlap) = group.into_iter().partition(|b| b.contains(&l));
                swaps.push(Swap {
                    evicted: sole_difference(&states[i - 1], state).unwrap_or(u32::MAX),
                    loaded: l,
                    overlap,
                    after,
                });
            }
        }
    }
    let order = initial
        .iter()
        .chain(swaps.iter().flat_map(|s| s.overlap.iter().chain(&s.after)))
        .copied()
        .collect();
    Plan {
        io_count: states.len(),
        volume: states.len() as f64 / f64::from(n),
        swaps_without_overlap: swaps.iter().filter(|s| s.overlap.is_empty()).count(),
        states,
        swaps,
        order,
        initial,
        kind,
        num_partitions: n,
        capacity,
    }
}

/// Checks every rule a plan must satisfy, returning the first one broken.
///
/// Rules: states are sorted lists of distinct partitions < N holding at most C; consecutive
/// states differ by exactly one evicted and one loaded partition, matching `swaps`; every
/// one of the N² buckets is scheduled exactly once; each bucket runs only while both its
/// partitions are resident (for `overlap`, resident on both sides of the swap); `order` is
/// the concatenation of the groups; the summary fields agree. For [`Order::Legend`] also
/// property (1): a swap never evicts the partition the previous swap loaded.
pub fn validate(plan: &Plan) -> Result<(), ValidationError> {
    let n = plan.num_partitions;
    let nu = n as usize;
    if plan.states.is_empty() {
        return Err(ValidationError::NoStates);
    }
    for (i, s) in plan.states.iter().enumerate() {
        if let Some(&p) = s.iter().find(|&&p| p >= n) {
            return Err(ValidationError::PartitionOutOfRange {
                state: i,
                partition: p,
                num_partitions: n,
            });
        }
        if s.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ValidationError::StateNotSorted { state: i });
        }
        if s.len() > plan.capacity as usize {
            return Err(ValidationError::OverCapacity {
                state: i,
                len: s.len(),
                capacity: plan.capacity,
            });
        }
    }
    if plan.swaps.len() + 1 != plan.states.len() {
        return Err(ValidationError::SwapCount {
            swaps: plan.swaps.len(),
            states: plan.states.len(),
        });
    }
    for (i, (w, swap)) in plan.states.windows(2).zip(&plan.swaps).enumerate() {
        let (Some(out), Some(inn)) = (sole_difference(&w[0], &w[1]), sole_difference(&w[1], &w[0]))
        else {
            return Err(ValidationError::NotOneSwap { state: i });
        };
        if (out, inn) != (swap.evicted, swap.loaded) {
            return Err(ValidationError::SwapMismatch {
                swap: i,
                evicted: swap.evicted,
                loaded: swap.loaded,
            });
        }
    }
    if plan.kind == Order::Legend {
        for (i, pair) in plan.swaps.windows(2).enumerate() {
            if pair[1].evicted == pair[0].loaded {
                return Err(ValidationError::Property1 {
                    swap: i + 1,
                    partition: pair[1].evicted,
                });
            }
        }
    }

    let mut seen = vec![false; nu * nu];
    let mut check = |bucket: Bucket, resident: &dyn Fn(u32) -> bool, group: &dyn Fn() -> String| {
        if bucket.iter().any(|&p| p >= n) {
            return Err(ValidationError::BucketOutOfRange {
                bucket,
                num_partitions: n,
            });
        }
        let cell = &mut seen[bucket[0] as usize * nu + bucket[1] as usize];
        if *cell {
            return Err(ValidationError::DuplicateBucket { bucket });
        }
        *cell = true;
        if !bucket.iter().all(|&p| resident(p)) {
            return Err(ValidationError::NotResident {
                bucket,
                group: group(),
            });
        }
        Ok(())
    };
    for &b in &plan.initial {
        check(b, &|p| plan.states[0].contains(&p), &|| "initial".into())?;
    }
    for (i, swap) in plan.swaps.iter().enumerate() {
        let (before, after) = (&plan.states[i], &plan.states[i + 1]);
        for &b in &swap.overlap {
            let kept = |p| before.contains(&p) && after.contains(&p);
            check(b, &kept, &|| format!("swap {i} overlap"))?;
        }
        for &b in &swap.after {
            check(b, &|p| after.contains(&p), &|| format!("swap {i} after"))?;
        }
    }
    if let Some(idx) = seen.iter().position(|&s| !s) {
        return Err(ValidationError::MissingBucket {
            bucket: [(idx / nu) as u32, (idx % nu) as u32],
        });
    }
    let concat = plan.initial.iter().chain(
        plan.swaps
            .iter()
            .flat_map(|s| s.overlap.iter().chain(&s.after)),
    );
    if !concat.eq(plan.order.iter()) {
        return Err(ValidationError::OrderMismatch);
    }
    if plan.io_count != plan.states.len() {
        return Err(ValidationError::Summary { field: "io_count" });
    }
    if plan.volume != plan.io_count as f64 / f64::from(n) {
        return Err(ValidationError::Summary { field: "volume" });
    }
    let without = plan.swaps.iter().filter(|s| s.overlap.is_empty()).count();
    if plan.swaps_without_overlap != without {
        return Err(ValidationError::Summary {
            field: "swaps_without_overlap",
        });
    }
    Ok(())
}
