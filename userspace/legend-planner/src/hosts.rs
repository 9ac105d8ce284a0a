//! Schedules for H hosts of L GPUs each (K = H·L GPUs, N = 2K partitions): the rounds of
//! [`crate::plan_gpus`] arranged so that partitions cross between hosts as seldom as possible.
//!
//! GPUs are numbered host-major (GPU `g` is on host `g / L`). The N partitions form 2H groups
//! of L; the hosts play a round-robin over the groups (the circle method on 2H groups: 2H − 1
//! host-rounds, each host holding two groups X and Y and training every bucket between them).
//! Inside a host-round the host's L GPUs run a Latin square over X × Y: in sub-round j GPU i
//! holds (X_i, Y_{(i + j) mod L}), so from one sub-round to the next each GPU keeps its X and
//! receives a Y from its neighbour on the same host. The buckets inside a group (X_a, X_b) are
//! trained once, in the first host-round, where every group is on some host: L − 1 sub-rounds
//! of the circle method on each of the host's two groups side by side (hence L even). Rounds:
//! (L − 1) + (2H − 1)·L = 2K − 1, the fewest, as on one host.
//!
//! Between host-rounds each host keeps one of its groups (the host-level matching of
//! [`crate::plan_gpus`]) and receives a whole group from another host: K hand-overs cross
//! hosts at each of the 2H − 2 host transitions, K·(2H − 2) an epoch, against K·(2K − 2)·(K −
//! L)/(K − 1) expected for GPUs placed without regard to hosts — every other hand-over stays on
//! a host's NVLink. One host, one GPU a host, or an odd L > 1 (no circle method inside a group)
//! take [`crate::plan_gpus`]'s flat schedule, with its hand-overs counted the same way.
//!
//! Which data partition plays which role is searched as [`crate::plan_gpus`] searches it (the
//! predicted epoch, diagonals spread over the lighter GPUs), so the host schedule balances
//! unequal buckets the same way; the schedule is a function of its inputs, identical on every
//! host that computes it.

use serde::Serialize;

use crate::bucket::Bucket;
use crate::gpus::{
    GpuPlanError, GpuSchedule, assemble, circle_rounds, labelled, match_pairs, plan_gpus,
    search_labelling, validate_gpus,
};

/// How a schedule's hand-overs fall between hosts of `gpus_per_host` GPUs (GPUs host-major).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostTraffic {
    /// Hosts H.
    pub hosts: u32,
    /// GPUs a host L.
    pub gpus_per_host: u32,
    /// Hand-overs an epoch between GPUs of one host.
    pub within: u64,
    /// Hand-overs an epoch between hosts.
    pub across: u64,
}

impl GpuSchedule {
    /// How this schedule's hand-overs fall on hosts of `gpus_per_host` GPUs.
    pub fn host_traffic(&self, gpus_per_host: u32) -> HostTraffic {
        let l = gpus_per_host.max(1);
        let across = self
            .handovers
            .iter()
            .flatten()
            .filter(|m| m.from / l != m.to / l)
            .count() as u64;
        HostTraffic {
            hosts: self.gpus.div_ceil(l),
            gpus_per_host: l,
            within: self.moves_per_epoch() as u64 - across,
            across,
        }
    }

    /// Whether a hand-over between GPUs `from` and `to` crosses hosts of `gpus_per_host`.
    pub fn crosses_hosts(from: u32, to: u32, gpus_per_host: u32) -> bool {
        from / gpus_per_host.max(1) != to / gpus_per_host.max(1)
    }

    /// The buckets the GPUs of host `host` (of `gpus_per_host` GPUs) train in an epoch,
    /// ascending: the edges that host needs.
    pub fn host_buckets(&self, host: u32, gpus_per_host: u32) -> Vec<Bucket> {
        let l = gpus_per_host.max(1) as usize;
        let first = host as usize * l;
        let mut buckets: Vec<Bucket> = self
            .rounds
            .iter()
            .flat_map(|r| r.work[first..first + l].iter().flatten())
            .map(|p| p.bucket)
            .collect();
        buckets.sort_unstable();
        buckets.dedup();
        buckets
    }
}

/// The schedule of `hosts` hosts of `gpus_per_host` GPUs each over `num_partitions` = 2K
/// partitions whose buckets have `batches[i · N + j]` batches (see the module docs). It has
/// passed [`validate_gpus`] (and, when hosts are grouped, [`validate_hosts`]).
pub fn plan_hosts(
    num_partitions: u32,
    hosts: u32,
    gpus_per_host: u32,
    batches: &[u64],
) -> Result<GpuSchedule, GpuPlanError> {
    let (h, l) = (hosts, gpus_per_host);
    if h == 0 || l == 0 {
        return Err(GpuPlanError::NoGpus);
    }
    let k = h * l;
    let n = num_partitions;
    if h > 1 && n != 2 * k {
        // A parked partition would wait on one host while another host's GPU reads it.
        return Err(GpuPlanError::HostsPartitions {
            num_partitions: n,
            gpus: k,
            hosts: h,
        });
    }
    if h == 1 || l == 1 || l % 2 == 1 {
        return plan_gpus(num_partitions, k, batches);
    }
    if batches.len() != (n * n) as usize {
        return Err(GpuPlanError::BatchCounts {
            got: batches.len(),
            num_partitions: n,
        });
    }
    let factors = grouped_rounds(h, l);
    let label = search_labelling(&factors, batches, n);
    let schedule = assemble(&labelled(&factors, &label), batches, n, k);
    validate_gpus(&schedule, batches)?;
    validate_hosts(&schedule, l)?;
    Ok(schedule)
}

/// The rounds of the module docs in roles `0..2K` (group `s` is roles `s·L .. s·L + L`), each
/// round's pairs seated on the GPUs (GPU `g`'s pair at `g`, host-major).
fn grouped_rounds(h: u32, l: u32) -> Vec<Vec<[u32; 2]>> {
    let (k, lu) = ((h * l) as usize, l as usize);
    let group = |s: u32| -> Vec<u32> { (s * l..(s + 1) * l).collect() };
    let host_rounds = circle_rounds(2 * h);
    let mut rounds: Vec<Vec<[u32; 2]>> = Vec::with_capacity(2 * k - 1);
    // Host-round 0, host i holding the groups of pair i: the pairs inside each group, the
    // circle method on both groups side by side (L − 1 sub-rounds).
    let mut groups_held: Vec<[u32; 2]> = host_rounds[0].clone();
    for inner in circle_rounds(l) {
        let mut pairs = vec![[0, 0]; k];
        for (host, &[x, y]) in groups_held.iter().enumerate() {
            let local: Vec<[u32; 2]> = [group(x), group(y)]
                .iter()
                .flat_map(|g| inner.iter().map(|&[a, b]| [g[a as usize], g[b as usize]]))
                .collect();
            let seat = host * lu;
            match rounds.last() {
                None => pairs[seat..seat + lu].copy_from_slice(&local),
                Some(before) => {
                    let before = &before[seat..seat + lu];
                    for (i, g) in match_pairs(before, &local).into_iter().enumerate() {
                        pairs[seat + g] = local[i];
                    }
                }
            }
        }
        rounds.push(pairs);
    }
    // Into the cross sub-rounds: a GPU holding a pair of X keeps one of them (`alpha`, for the
    // whole host-round) and takes a Y no GPU keeps (`beta`, its first); one holding a pair of
    // Y keeps a Y (its first `beta`) and takes an X no GPU keeps (its `alpha`).
    let (mut alpha, mut beta) = (vec![0u32; k], vec![0u32; k]);
    let within = rounds
        .last()
        .expect("L ≥ 2: a sub-round inside the groups")
        .clone();
    for (host, &[x, y]) in groups_held.iter().enumerate() {
        let seat = host * lu;
        let kept: Vec<u32> = within[seat..seat + lu].iter().map(|p| p[0]).collect();
        let mut free_x = group(x).into_iter().filter(|p| !kept.contains(p));
        let mut free_y = group(y).into_iter().filter(|p| !kept.contains(p));
        for (i, &p) in kept.iter().enumerate() {
            (alpha[seat + i], beta[seat + i]) = if p / l == x {
                (p, free_y.next().expect("as many Y free as X kept"))
            } else {
                (free_x.next().expect("as many X free as Y kept"), p)
            };
        }
    }
    push_cross(&mut rounds, &alpha, &beta, lu);
    for next in &host_rounds[1..] {
        // Each host keeps one of its groups (its two groups are in two different next pairs)
        // and receives a whole group from another host; each of its GPUs keeps the partition
        // of the kept group it holds and receives the arriving group's partition of its seat.
        let mut now = vec![[0u32; 2]; h as usize];
        for (i, host) in match_pairs(&groups_held, next).into_iter().enumerate() {
            now[host] = next[i];
        }
        let last = rounds.last().expect("a round").clone();
        for (host, &[a, b]) in now.iter().enumerate() {
            let kept = if groups_held[host].contains(&a) { a } else { b };
            let arriving = group(a + b - kept);
            let seat = host * lu;
            for i in 0..lu {
                let [p, q] = last[seat + i];
                alpha[seat + i] = if p / l == kept { p } else { q };
                beta[seat + i] = arriving[i];
            }
            groups_held[host] = [kept, a + b - kept];
        }
        push_cross(&mut rounds, &alpha, &beta, lu);
    }
    rounds
}

/// Appends one host-round's L cross sub-rounds: in sub-round j, GPU i of a host holds
/// (alpha_i, beta_{(i + j) mod L}) of its host's GPUs.
fn push_cross(rounds: &mut Vec<Vec<[u32; 2]>>, alpha: &[u32], beta: &[u32], l: usize) {
    for j in 0..l {
        let pairs = (0..alpha.len())
            .map(|g| [alpha[g], beta[g - g % l + (g % l + j) % l]])
            .collect();
        rounds.push(pairs);
    }
}

/// Checks the host structure of a schedule of hosts of `gpus_per_host` (= L) GPUs grouped as
/// the module docs say: in every round each host's GPUs hold 2L partitions of two groups, and
/// only the first hand-over of a host-round (every L-th transition after the first host-round)
/// crosses hosts, once per GPU.
pub fn validate_hosts(schedule: &GpuSchedule, gpus_per_host: u32) -> Result<(), GpuPlanError> {
    match broken_host_rule(schedule, gpus_per_host) {
        None => Ok(()),
        Some(rule) => Err(GpuPlanError::Invalid {
            num_partitions: schedule.num_partitions,
            gpus: schedule.gpus,
            rule,
        }),
    }
}

/// The first rule of [`validate_hosts`] that `schedule` breaks, in words.
fn broken_host_rule(schedule: &GpuSchedule, gpus_per_host: u32) -> Option<String> {
    let l = gpus_per_host;
    if l == 0 || !schedule.gpus.is_multiple_of(l) {
        return Some(format!("{} GPUs are not hosts of {l}", schedule.gpus));
    }
    let h = schedule.gpus / l;
    // Round L − 1 + t·L starts host-round t: its hand-overs (t ≥ 1) all cross hosts, no other.
    let first_cross = l as usize - 1;
    for (r, moves) in (1..).zip(&schedule.handovers) {
        let starts = r > first_cross && (r - first_cross).is_multiple_of(l as usize);
        for m in moves {
            if GpuSchedule::crosses_hosts(m.from, m.to, l) != starts {
                return Some(format!(
                    "round {r}: the hand-over of partition {} from GPU {} to GPU {} {} hosts",
                    m.partition,
                    m.from,
                    m.to,
                    if starts { "does not cross" } else { "crosses" }
                ));
            }
        }
    }
    let across = schedule.host_traffic(l).across;
    let expected = u64::from(schedule.gpus) * u64::from(2 * h - 2);
    if across != expected {
        return Some(format!(
            "{across} hand-overs cross hosts, expected K·(2H − 2) = {expected}"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpus::tests::uniform;
    use proptest::prelude::*;

    #[test]
    fn hosts_take_two_k_minus_one_rounds_and_cross_only_between_host_rounds() {
        for (h, l) in [(2, 2), (2, 4), (3, 2), (4, 2), (2, 8), (3, 4)] {
            let k = h * l;
            let n = 2 * k;
            let s = plan_hosts(n, h, l, &uniform(n, 10)).unwrap();
            assert_eq!(s.rounds.len() as u32, 2 * k - 1, "{h}×{l}");
            assert!(s.handovers.iter().all(|m| m.len() == k as usize));
            let t = s.host_traffic(l);
            assert_eq!(t.across, u64::from(k * (2 * h - 2)), "{h}×{l}");
            assert_eq!(t.within + t.across, u64::from(k * (2 * k - 2)));
            // 1/L of what GPUs placed without regard to hosts cross on average
            // (K·(2K − 2)·(K − L)/(K − 1)), and fewer than the flat schedule's.
            let random = u64::from(k * (2 * k - 2) * (k - l) / (k - 1));
            assert_eq!(t.across * u64::from(l), random, "{h}×{l}");
            let flat = plan_gpus(n, k, &uniform(n, 10)).unwrap().host_traffic(l);
            assert!(
                t.across < flat.across,
                "{h}×{l}: {} crossing against the flat schedule's {}",
                t.across,
                flat.across
            );
            assert!(
                s.predicted_imbalance < 1.02,
                "{h}×{l}: {}",
                s.predicted_imbalance
            );
        }
    }

    #[test]
    fn one_host_one_gpu_a_host_or_odd_hosts_take_the_flat_schedule() {
        let n = 12;
        let b = uniform(n, 4);
        assert_eq!(
            plan_hosts(n, 1, 6, &b).unwrap(),
            plan_gpus(n, 6, &b).unwrap()
        );
        assert_eq!(
            plan_hosts(n, 6, 1, &b).unwrap(),
            plan_gpus(n, 6, &b).unwrap()
        );
        assert_eq!(
            plan_hosts(n, 2, 3, &b).unwrap(),
            plan_gpus(n, 6, &b).unwrap()
        );
        assert_eq!(plan_hosts(8, 0, 4, &b).unwrap_err(), GpuPlanError::NoGpus);
        assert!(matches!(
            plan_hosts(10, 2, 2, &uniform(10, 1)),
            Err(GpuPlanError::HostsPartitions { gpus: 4, .. })
        ));
    }

    #[test]
    fn every_bucket_is_trained_on_some_host_and_only_diagonals_on_two() {
        let (h, l) = (2, 2);
        let n = 8;
        let batches: Vec<u64> = (0..n * n).map(|i| 1 + u64::from(i % 7)).collect();
        let s = plan_hosts(n, h, l, &batches).unwrap();
        let per_host: Vec<Vec<Bucket>> = (0..h).map(|host| s.host_buckets(host, l)).collect();
        for i in 0..n {
            for j in 0..n {
                let on: usize = per_host.iter().filter(|b| b.contains(&[i, j])).count();
                assert!(on >= 1, "bucket ({i}, {j}) on no host");
                assert!(i == j || on == 1, "bucket ({i}, {j}) on {on} hosts");
            }
        }
        // A host holds about half the buckets, not all.
        for b in &per_host {
            assert!(b.len() < (n * n) as usize * 3 / 4, "{}", b.len());
        }
    }

    #[test]
    fn a_schedule_whose_hand_overs_cross_elsewhere_fails_validation() {
        let n = 8;
        let s = plan_hosts(n, 2, 2, &uniform(n, 3)).unwrap();
        validate_hosts(&s, 2).unwrap();
        // The flat schedule's hand-overs cross hosts inside host-rounds.
        let flat = plan_gpus(n, 4, &uniform(n, 3)).unwrap();
        let e = validate_hosts(&flat, 2).unwrap_err().to_string();
        assert!(e.contains("crosses hosts"), "{e}");
        let e = validate_hosts(&s, 3).unwrap_err().to_string();
        assert!(e.contains("not hosts of 3"), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn host_schedules_validate_and_balance_any_bucket_sizes(
            h in 2u32..=4,
            l in prop::sample::select(vec![2u32, 4]),
            seed in any::<u64>(),
        ) {
            let n = 2 * h * l;
            let mut state = seed;
            let batches: Vec<u64> = (0..n * n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state % 40
                })
                .collect();
            let s = plan_hosts(n, h, l, &batches).unwrap();
            prop_assert!(validate_gpus(&s, &batches).is_ok());
            prop_assert!(validate_hosts(&s, l).is_ok());
            prop_assert!(s.predicted_imbalance >= 1.0 - 1e-9);
            // Reversed (even epochs), the same hand-overs cross.
            let back: usize = (1..s.rounds.len())
                .flat_map(|r| s.handovers_between(r, r - 1))
                .filter(|m| GpuSchedule::crosses_hosts(m.from, m.to, l))
                .count();
            prop_assert_eq!(back as u64, s.host_traffic(l).across);
        }
    }
}
