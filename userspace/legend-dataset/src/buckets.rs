//! Partitioned edge buckets: train edges grouped by (source partition, destination partition).

use std::ops::Range;

use rayon::prelude::*;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result, invalid};
use crate::import::write_synced;
use crate::{EDGES_DIR, Edge};

/// How entity ids are split into partitions: partition `p` covers ids
/// `[p·⌈V/N⌉, min(V, (p+1)·⌈V/N⌉))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionScheme {
    /// Number of partitions N.
    pub num_partitions: u32,
    /// Number of entities V.
    pub entities: u64,
    /// ⌈V/N⌉: rows of every partition but possibly the last.
    pub rows_per_partition: u64,
}

impl PartitionScheme {
    /// The scheme for `entities` ids in `num_partitions` partitions.
    pub fn new(entities: u64, num_partitions: u32) -> std::result::Result<Self, String> {
        if num_partitions == 0 {
            return Err("the number of partitions must be at least 1".into());
        }
        if entities == 0 {
            return Err("the dataset has no entities".into());
        }
        if u64::from(num_partitions) > entities {
            return Err(format!(
                "{num_partitions} partitions for {entities} entities: every partition needs at least one entity"
            ));
        }
        Ok(PartitionScheme {
            num_partitions,
            entities,
            rows_per_partition: entities.div_ceil(u64::from(num_partitions)),
        })
    }

    /// The partition holding entity `id`.
    pub fn partition_of(&self, id: u32) -> u32 {
        (u64::from(id) / self.rows_per_partition) as u32
    }

    /// The entity ids of partition `p`.
    pub fn range(&self, p: u32) -> Range<u64> {
        let start = (u64::from(p) * self.rows_per_partition).min(self.entities);
        start..(start + self.rows_per_partition).min(self.entities)
    }

    /// Index of bucket (src_part, dst_part) in row-major order.
    pub fn bucket_index(&self, src_part: u32, dst_part: u32) -> usize {
        src_part as usize * self.num_partitions as usize + dst_part as usize
    }
}

/// Train edges sorted into N×N buckets; bucket `(i, j)` holds edges with source in partition `i`
/// and destination in partition `j`, in an order fixed by the input order alone.
#[derive(Clone, Debug)]
pub struct Buckets {
    scheme: PartitionScheme,
    edges: Vec<Edge>,
    offsets: Vec<u64>,
}

impl Buckets {
    /// Groups `edges` into buckets in place (a counting pass, then each edge swapped into its
    /// bucket's next free slot), so that bucketing a graph never holds its edges twice: at
    /// billion-edge scale the copy a counting sort needs would be gigabytes of peak memory.
    pub fn build(mut edges: Vec<Edge>, scheme: PartitionScheme) -> Buckets {
        let n2 = scheme.num_partitions as usize * scheme.num_partitions as usize;
        let bucket =
            |e: &Edge| scheme.bucket_index(scheme.partition_of(e[0]), scheme.partition_of(e[2]));
        if n2 == 1 {
            // One bucket: the edges as they are, no pass over them.
            let offsets = vec![0, edges.len() as u64];
            return Buckets {
                scheme,
                edges,
                offsets,
            };
        }
        let mut offsets = vec![0u64; n2 + 1];
        for e in &edges {
            offsets[bucket(e) + 1] += 1;
        }
        for i in 0..n2 {
            offsets[i + 1] += offsets[i];
        }
        {
            // `next[b]`: the first slot of bucket b not yet holding one of its own edges.
            let mut next: Vec<usize> = offsets[..n2].iter().map(|&o| o as usize).collect();
            for b in 0..n2 {
                let end = offsets[b + 1] as usize;
                while next[b] < end {
                    let home = bucket(&edges[next[b]]);
                    if home == b {
                        next[b] += 1;
                    } else {
                        edges.swap(next[b], next[home]);
                        next[home] += 1;
                    }
                }
            }
        }
        Buckets {
            scheme,
            edges,
            offsets,
        }
    }

    /// The partitioning these buckets follow.
    pub fn scheme(&self) -> PartitionScheme {
        self.scheme
    }

    /// The edges of bucket (src_part, dst_part).
    pub fn bucket(&self, src_part: u32, dst_part: u32) -> &[Edge] {
        let b = self.scheme.bucket_index(src_part, dst_part);
        &self.edges[self.offsets[b] as usize..self.offsets[b + 1] as usize]
    }

    /// Edge counts of all buckets in row-major order.
    pub fn counts(&self) -> Vec<u64> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// All edges, bucket after bucket.
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    fn paths(dir: &Path, n: u32) -> (PathBuf, PathBuf) {
        let edges = dir.join(EDGES_DIR);
        (
            edges.join(format!("train.buckets-{n}.bin")),
            edges.join(format!("train.buckets-{n}.offsets")),
        )
    }

    /// Saves the buckets next to the train edges of dataset `dir`, each file atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let (edges_path, offsets_path) = Self::paths(dir, self.scheme.num_partitions);
        for (path, bytes) in [
            (&edges_path, bytemuck::cast_slice::<Edge, u8>(&self.edges)),
            (
                &offsets_path,
                bytemuck::cast_slice::<u64, u8>(&self.offsets),
            ),
        ] {
            let tmp = path.with_extension("partial");
            write_synced(&tmp, bytes)?;
            std::fs::rename(&tmp, path).at(path)?;
        }
        Ok(())
    }

    /// Loads buckets saved by [`Buckets::save`], or `None` if there are none for this scheme.
    ///
    /// `expected_edges` is the dataset's train edge count: files that disagree with it are stale
    /// or damaged and are rejected.
    pub fn load(
        dir: &Path,
        scheme: PartitionScheme,
        expected_edges: u64,
    ) -> Result<Option<Buckets>> {
        let (edges_path, offsets_path) = Self::paths(dir, scheme.num_partitions);
        if !edges_path.exists() || !offsets_path.exists() {
            return Ok(None);
        }
        let n2 = scheme.num_partitions as usize * scheme.num_partitions as usize;
        let offsets: Vec<u64> = read_pod(&offsets_path)?;
        let edges: Vec<Edge> = read_pod(&edges_path)?;
        let monotone = offsets.windows(2).all(|w| w[0] <= w[1]);
        if offsets.len() != n2 + 1
            || offsets[0] != 0
            || !monotone
            || offsets[n2] != edges.len() as u64
        {
            return Err(invalid(
                &offsets_path,
                format!(
                    "not valid offsets for {n2} buckets of {} edges",
                    edges.len()
                ),
            ));
        }
        if edges.len() as u64 != expected_edges {
            return Err(invalid(
                &edges_path,
                format!(
                    "holds {} edges but the dataset has {expected_edges} train edges; re-run partition",
                    edges.len()
                ),
            ));
        }
        let buckets = Buckets {
            scheme,
            edges,
            offsets,
        };
        for i in 0..scheme.num_partitions {
            for j in 0..scheme.num_partitions {
                let misplaced = buckets.bucket(i, j).iter().any(|e| {
                    scheme.partition_of(e[0]) != i
                        || scheme.partition_of(e[2]) != j
                        || u64::from(e[0].max(e[2])) >= scheme.entities
                });
                if misplaced {
                    return Err(invalid(
                        &edges_path,
                        format!(
                            "bucket ({i}, {j}) holds an edge of another bucket; re-run partition"
                        ),
                    ));
                }
            }
        }
        Ok(Some(buckets))
    }
}

/// Reads a whole file of little-endian plain values.
/// The block each thread reads at a time in [`read_pod`].
const READ_BLOCK: usize = 64 << 20;

pub(crate) fn read_pod<T: bytemuck::Pod>(path: &Path) -> Result<Vec<T>> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).at(path)?;
    let len = file.metadata().at(path)?.len();
    let size = std::mem::size_of::<T>() as u64;
    if len % size != 0 {
        return Err(invalid(
            path,
            format!("size {len} is not a multiple of {size} bytes"),
        ));
    }
    // Read straight into the typed vector (a byte buffer first would hold the data twice), in
    // blocks on every core: one thread reads tmpfs at a few GB/s, a billion-edge file is 18 GB.
    let mut items = vec![T::zeroed(); (len / size) as usize];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut items);
    bytes
        .par_chunks_mut(READ_BLOCK)
        .enumerate()
        .try_for_each(|(i, block)| file.read_exact_at(block, (i * READ_BLOCK) as u64))
        .at(path)?;
    Ok(items)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn ranges_cover_ids() {
        let s = PartitionScheme::new(10, 4).unwrap();
        assert_eq!(s.rows_per_partition, 3);
        assert_eq!(
            [s.range(0), s.range(1), s.range(2), s.range(3)],
            [0..3, 3..6, 6..9, 9..10]
        );
        assert!(
            PartitionScheme::new(3, 4)
                .unwrap_err()
                .contains("4 partitions for 3 entities")
        );
        assert!(PartitionScheme::new(3, 0).is_err());
    }

    proptest! {
        #[test]
        fn buckets_hold_each_edge_once_in_its_bucket(
            v in 1u32..200, n in 1u32..9, raw in prop::collection::vec((0u32..1000, 0u32..5, 0u32..1000), 0..300)
        ) {
            prop_assume!(n <= v);
            let edges: Vec<Edge> = raw.iter().map(|&(s, r, d)| [s % v, r, d % v]).collect();
            let scheme = PartitionScheme::new(u64::from(v), n).unwrap();
            let b = Buckets::build(edges.clone(), scheme);
            let mut seen = Vec::new();
            for i in 0..n {
                for j in 0..n {
                    for e in b.bucket(i, j) {
                        prop_assert_eq!(scheme.partition_of(e[0]), i);
                        prop_assert_eq!(scheme.partition_of(e[2]), j);
                        seen.push(*e);
                    }
                }
            }
            let mut want = edges.clone();
            want.sort();
            seen.sort();
            prop_assert_eq!(seen, want);
        }
    }
}
