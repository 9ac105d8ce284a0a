//! How entity ids are split into partitions, the one definition every crate shares (a dataset's
//! edge buckets, a store's layout): partition `p` of `N` over `V` ids covers
//! `[p·⌈V/N⌉, min(V, (p+1)·⌈V/N⌉))`.

use std::ops::Range;

/// Rows of every partition but possibly the last: ⌈V/N⌉ (`num_partitions` ≥ 1).
pub fn rows_per_partition(entities: u64, num_partitions: u32) -> u64 {
    entities.div_ceil(u64::from(num_partitions))
}

/// The ids of partition `p`; empty for a trailing partition that holds none.
pub fn partition_range(entities: u64, num_partitions: u32, p: u32) -> Range<u64> {
    let q = rows_per_partition(entities, num_partitions);
    let start = (u64::from(p) * q).min(entities);
    start..(start + q).min(entities)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_ids_in_order() {
        assert_eq!(rows_per_partition(10, 4), 3);
        assert_eq!(partition_range(10, 4, 0), 0..3);
        assert_eq!(partition_range(10, 4, 3), 9..10);
        assert_eq!(partition_range(9, 4, 3), 9..9);
        for (v, n) in [(1, 1), (7, 3), (100, 7), (1 << 33, 12)] {
            let ends: Vec<_> = (0..n).map(|p| partition_range(v, n, p)).collect();
            assert_eq!(ends[0].start, 0);
            assert_eq!(ends[n as usize - 1].end, v);
            assert!(ends.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}
