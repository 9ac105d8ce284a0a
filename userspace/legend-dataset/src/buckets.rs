//! Partitioned edge buckets: train edges grouped by (source partition, destination partition).

use std::ops::Range;
use std::sync::Arc;

use legend_fs::{Access, Dir};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, PartitionSchemeError, RecordError, Result, invalid};
use crate::import::write_synced;
use crate::read_progress::ReadProgress;
use crate::{EDGES_DIR, Edge};

/// How entity ids are split into partitions ([`legend_model::partition`]): partition `p` covers
/// ids `[p·⌈V/N⌉, min(V, (p+1)·⌈V/N⌉))`.
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
    pub fn new(
        entities: u64,
        num_partitions: u32,
    ) -> std::result::Result<Self, PartitionSchemeError> {
        if num_partitions == 0 {
            return Err(PartitionSchemeError::NoPartitions);
        }
        if entities == 0 {
            return Err(PartitionSchemeError::NoEntities);
        }
        if u64::from(num_partitions) > entities {
            return Err(PartitionSchemeError::MorePartitionsThanEntities {
                partitions: num_partitions,
                entities,
            });
        }
        Ok(PartitionScheme {
            num_partitions,
            entities,
            rows_per_partition: legend_model::partition::rows_per_partition(
                entities,
                num_partitions,
            ),
        })
    }

    /// The partition holding entity `id`.
    pub fn partition_of(&self, id: u32) -> u32 {
        (u64::from(id) / self.rows_per_partition) as u32
    }

    /// The entity ids of partition `p`.
    pub fn range(&self, p: u32) -> Range<u64> {
        legend_model::partition::partition_range(self.entities, self.num_partitions, p)
    }

    /// Index of bucket (src_part, dst_part) in row-major order.
    pub fn bucket_index(&self, src_part: u32, dst_part: u32) -> usize {
        src_part as usize * self.num_partitions as usize + dst_part as usize
    }
}

/// Train edges sorted into N×N buckets; bucket `(i, j)` holds edges with source in partition `i`
/// and destination in partition `j`, in an order fixed by the input order alone. A clone
/// shares the edges (the workers of a K-GPU run read one copy).
#[derive(Clone, Debug)]
pub struct Buckets {
    scheme: PartitionScheme,
    edges: Arc<Vec<Edge>>,
    offsets: Vec<u64>,
}

impl Buckets {
    /// Groups `edges` into buckets, each bucket's edges in their input order (holding the
    /// edges twice: for a graph in memory already; [`Buckets::read`] buckets a file).
    pub fn build(edges: Vec<Edge>, scheme: PartitionScheme) -> Buckets {
        if scheme.num_partitions == 1 {
            // One bucket: the edges as they are, no pass over them.
            let offsets = vec![0, edges.len() as u64];
            return Buckets {
                scheme,
                edges: Arc::new(edges),
                offsets,
            };
        }
        let block = block_edges(edges.len(), scheme);
        Self::build_in_blocks(&edges, scheme, block)
    }

    fn build_in_blocks(edges: &[Edge], scheme: PartitionScheme, block_edges: usize) -> Buckets {
        let block = |i: usize, out: &mut Vec<Edge>| -> Result<()> {
            out.clear();
            out.extend_from_slice(edges.chunks(block_edges).nth(i).unwrap_or_default());
            Ok(())
        };
        Self::from_blocks(scheme, edges.len(), block_edges, block, &|_| true)
            .expect("blocks of memory read")
    }

    /// Reads the edge file `path` (`edges` edges of 12 bytes) into buckets, each bucket's edges
    /// in file order, checking every edge with `check` (an error names the first that fails):
    /// two parallel passes over the file, one to count each block's edges per bucket, one to
    /// place them, so the edges are held once and never swapped around in memory (a billion
    /// edges in 64 buckets: seconds on the GPU machine, where an in-place sort took a minute).
    pub(crate) fn read(
        dir: &Dir,
        name: &Path,
        scheme: PartitionScheme,
        edges: u64,
        check: impl Fn(&Edge) -> std::result::Result<(), RecordError> + Sync,
    ) -> Result<Buckets> {
        Self::read_selected(dir, name, scheme, edges, check, &|_| true)
    }

    /// [`Buckets::read`] keeping only the buckets `keep` selects (by row-major index): the
    /// others are empty here, and the edges are still checked and counted in one pass, placed
    /// in a second (one host of several holds the buckets its GPUs train).
    pub(crate) fn read_selected(
        dir: &Dir,
        name: &Path,
        scheme: PartitionScheme,
        edges: u64,
        check: impl Fn(&Edge) -> std::result::Result<(), RecordError> + Sync,
        keep: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<Buckets> {
        // Each block is read twice: to count its buckets' edges, then to place them.
        let file = EdgeFile::open(
            dir,
            name,
            scheme,
            edges,
            "sorting into buckets (two reads)",
            2,
        )?;
        let block = |i: usize, out: &mut Vec<Edge>| file.block(i, out, &check);
        Self::from_blocks(scheme, file.total, file.block_edges, block, keep)
    }

    /// The edge counts of `scheme`'s buckets (row-major) of the edge file `name`, in one
    /// checked pass that keeps no edge.
    pub(crate) fn count(
        dir: &Dir,
        name: &Path,
        scheme: PartitionScheme,
        edges: u64,
        check: impl Fn(&Edge) -> std::result::Result<(), RecordError> + Sync,
    ) -> Result<Vec<u64>> {
        let file = EdgeFile::open(dir, name, scheme, edges, "counting bucket edges", 1)?;
        let block = |i: usize, out: &mut Vec<Edge>| file.block(i, out, &check);
        let counts = count_blocks(scheme, file.total.div_ceil(file.block_edges), &block)?;
        let n2 = scheme.num_partitions as usize * scheme.num_partitions as usize;
        let mut all = vec![0u64; n2];
        for c in &counts {
            for (b, &k) in c.iter().enumerate() {
                all[b] += k as u64;
            }
        }
        Ok(all)
    }

    /// Buckets `total` edges that `block(i, out)` puts into `out`, block by block
    /// (`block_edges` each, the last shorter), keeping the buckets `keep` selects: each block's
    /// edges are counted per bucket, then each block places its edges in its own runs of the
    /// buckets, all blocks in parallel.
    fn from_blocks(
        scheme: PartitionScheme,
        total: usize,
        block_edges: usize,
        block: impl Fn(usize, &mut Vec<Edge>) -> Result<()> + Sync,
        keep: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<Buckets> {
        let blocks = total.div_ceil(block_edges);
        let n2 = scheme.num_partitions as usize * scheme.num_partitions as usize;
        let kept: Vec<bool> = (0..n2).map(keep).collect();
        let bucket =
            |e: &Edge| scheme.bucket_index(scheme.partition_of(e[0]), scheme.partition_of(e[2]));
        let mut counts = count_blocks(scheme, blocks, &block)?;
        for c in &mut counts {
            for (b, k) in c.iter_mut().enumerate() {
                if !kept[b] {
                    *k = 0;
                }
            }
        }
        let mut offsets = vec![0u64; n2 + 1];
        for c in &counts {
            for (b, &k) in c.iter().enumerate() {
                offsets[b + 1] += k as u64;
            }
        }
        for b in 0..n2 {
            offsets[b + 1] += offsets[b];
        }
        let mut edges = vec![[0u32; 3]; offsets[n2] as usize];
        // Each block's run of each bucket: the buckets cut into their blocks' runs in block
        // order, so that every block owns the slices it writes.
        let mut runs: Vec<Vec<&mut [Edge]>> = (0..blocks).map(|_| Vec::with_capacity(n2)).collect();
        let mut rest: &mut [Edge] = &mut edges;
        for b in 0..n2 {
            for (i, c) in counts.iter().enumerate() {
                let (run, tail) = std::mem::take(&mut rest).split_at_mut(c[b]);
                runs[i].push(run);
                rest = tail;
            }
        }
        runs.into_par_iter()
            .enumerate()
            .try_for_each_init(Vec::new, |buf, (i, mut runs)| {
                block(i, buf)?;
                let mut next = vec![0usize; n2];
                for e in buf.iter() {
                    let b = bucket(e);
                    if kept[b] {
                        runs[b][next[b]] = *e;
                        next[b] += 1;
                    }
                }
                Ok(())
            })?;
        Ok(Buckets {
            scheme,
            edges: Arc::new(edges),
            offsets,
        })
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
        dir: &Dir,
        scheme: PartitionScheme,
        expected_edges: u64,
    ) -> Result<Option<Buckets>> {
        Self::load_selected(dir, scheme, expected_edges, &|_| true)
    }

    /// [`Buckets::load`] of the buckets `keep` selects (row-major index), the others empty:
    /// only their runs of the saved file are read.
    pub fn load_selected(
        dir: &Dir,
        scheme: PartitionScheme,
        expected_edges: u64,
        keep: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<Option<Buckets>> {
        use std::os::unix::fs::FileExt;
        let Some(saved) = Self::load_offsets(dir, scheme, expected_edges)? else {
            return Ok(None);
        };
        let (edges_name, _) = Self::paths(Path::new(""), scheme.num_partitions);
        let edges_path = dir.join(&edges_name);
        let file = dir.open_file(&edges_name, Access::Read).at(&edges_path)?;
        let n2 = saved.len() - 1;
        let kept: Vec<usize> = (0..n2).filter(|&b| keep(b)).collect();
        let mut offsets = vec![0u64; n2 + 1];
        for b in 0..n2 {
            let count = if keep(b) { saved[b + 1] - saved[b] } else { 0 };
            offsets[b + 1] = offsets[b] + count;
        }
        let mut edges = vec![[0u32; 3]; offsets[n2] as usize];
        // Every kept bucket's run read in place, in parallel.
        let mut runs: Vec<(usize, &mut [Edge])> = Vec::with_capacity(kept.len());
        let mut rest: &mut [Edge] = &mut edges;
        for &b in &kept {
            let (run, tail) =
                std::mem::take(&mut rest).split_at_mut((offsets[b + 1] - offsets[b]) as usize);
            runs.push((b, run));
            rest = tail;
        }
        let edge_bytes = size_of::<Edge>() as u64;
        runs.into_par_iter()
            .try_for_each(|(b, run)| {
                file.read_exact_at(bytemuck::cast_slice_mut(run), saved[b] * edge_bytes)
            })
            .at(&edges_path)?;
        let buckets = Buckets {
            scheme,
            edges: Arc::new(edges),
            offsets,
        };
        for &b in &kept {
            let (i, j) = (
                b as u32 / scheme.num_partitions,
                b as u32 % scheme.num_partitions,
            );
            let misplaced = buckets.bucket(i, j).iter().any(|e| {
                scheme.partition_of(e[0]) != i
                    || scheme.partition_of(e[2]) != j
                    || u64::from(e[0].max(e[2])) >= scheme.entities
            });
            if misplaced {
                return Err(invalid(
                    &edges_path,
                    format!("bucket ({i}, {j}) holds an edge of another bucket; re-run partition"),
                ));
            }
        }
        Ok(Some(buckets))
    }

    /// The saved buckets' edge counts (row-major), read from their offsets alone; `None` if
    /// none are saved for this scheme.
    pub fn load_counts(
        dir: &Dir,
        scheme: PartitionScheme,
        expected_edges: u64,
    ) -> Result<Option<Vec<u64>>> {
        Ok(Self::load_offsets(dir, scheme, expected_edges)?
            .map(|o| o.windows(2).map(|w| w[1] - w[0]).collect()))
    }

    /// The saved offsets for `scheme`, checked against each other, the edge file's size and
    /// `expected_edges`; `None` if none are saved.
    fn load_offsets(
        dir: &Dir,
        scheme: PartitionScheme,
        expected_edges: u64,
    ) -> Result<Option<Vec<u64>>> {
        let (edges_name, offsets_name) = Self::paths(Path::new(""), scheme.num_partitions);
        let (edges_path, offsets_path) = (dir.join(&edges_name), dir.join(&offsets_name));
        let present = |name: &Path| dir.exists(name).at(dir.join(name));
        if !present(&edges_name)? || !present(&offsets_name)? {
            return Ok(None);
        }
        let n2 = scheme.num_partitions as usize * scheme.num_partitions as usize;
        let offsets: Vec<u64> = read_pod(dir, &offsets_name)?;
        let file_edges = dir
            .open_file(&edges_name, Access::Read)
            .and_then(|f| f.metadata())
            .at(&edges_path)?
            .len()
            / size_of::<Edge>() as u64;
        let monotone = offsets.windows(2).all(|w| w[0] <= w[1]);
        if offsets.len() != n2 + 1 || offsets[0] != 0 || !monotone || offsets[n2] != file_edges {
            return Err(invalid(
                &offsets_path,
                format!("not valid offsets for {n2} buckets of {file_edges} edges"),
            ));
        }
        if file_edges != expected_edges {
            return Err(invalid(
                &edges_path,
                format!(
                    "holds {file_edges} edges but the dataset has {expected_edges} train edges; re-run partition"
                ),
            ));
        }
        Ok(Some(offsets))
    }
}

/// The edges of `scheme`'s counting and placing passes, a block at a time.
fn count_blocks(
    scheme: PartitionScheme,
    blocks: usize,
    block: &(impl Fn(usize, &mut Vec<Edge>) -> Result<()> + Sync),
) -> Result<Vec<Vec<usize>>> {
    let n2 = scheme.num_partitions as usize * scheme.num_partitions as usize;
    let bucket =
        |e: &Edge| scheme.bucket_index(scheme.partition_of(e[0]), scheme.partition_of(e[2]));
    (0..blocks)
        .into_par_iter()
        .map_init(Vec::new, |buf, i| {
            block(i, buf)?;
            let mut c = vec![0usize; n2];
            for e in buf.iter() {
                c[bucket(e)] += 1;
            }
            Ok(c)
        })
        .collect()
}

/// An edge file read in blocks of [`block_edges`] edges.
struct EdgeFile {
    file: std::fs::File,
    path: PathBuf,
    total: usize,
    block_edges: usize,
    /// How far the reads are, logged every 10 s (minutes for a billion edges).
    progress: ReadProgress,
}

impl EdgeFile {
    /// `name` in `dir`, which must hold `edges` edges, to be read `reads` times for `task` (in
    /// the progress lines).
    fn open(
        dir: &Dir,
        name: &Path,
        scheme: PartitionScheme,
        edges: u64,
        task: &str,
        reads: u64,
    ) -> Result<EdgeFile> {
        let path = dir.join(name);
        let file = dir.open_file(name, Access::Read).at(&path)?;
        let have = file.metadata().at(&path)?.len();
        let edge_bytes = size_of::<Edge>() as u64;
        if have != edges * edge_bytes {
            return Err(invalid(
                &path,
                format!("holds {have} bytes, expected {edges} edges of {edge_bytes} bytes"),
            ));
        }
        let total = edges as usize;
        Ok(EdgeFile {
            progress: ReadProgress::new(format!("{task}: {}", path.display()), reads * have),
            file,
            path,
            total,
            block_edges: block_edges(total, scheme),
        })
    }

    /// Block `i` into `out`, every edge checked with `check` (an error names the first bad).
    fn block(
        &self,
        i: usize,
        out: &mut Vec<Edge>,
        check: &(impl Fn(&Edge) -> std::result::Result<(), RecordError> + Sync),
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let first = i * self.block_edges;
        out.resize(self.block_edges.min(self.total - first), [0; 3]);
        self.file
            .read_exact_at(
                bytemuck::cast_slice_mut(out),
                first as u64 * size_of::<Edge>() as u64,
            )
            .at(&self.path)?;
        self.progress.add((out.len() * size_of::<Edge>()) as u64);
        if let Some((k, message)) = out
            .iter()
            .enumerate()
            .find_map(|(k, e)| check(e).err().map(|m| (k, m)))
        {
            let e = out[k];
            return Err(invalid(
                &self.path,
                format!("edge {} {e:?} {message}", first + k),
            ));
        }
        Ok(())
    }
}

/// The block each thread reads at a time in [`read_pod`].
const READ_BLOCK: usize = 64 << 20;
/// Edges in a block of [`Buckets::read`] (16 MiB; more with very many buckets): a thread's
/// buffer, and the unit whose edges are counted and placed together.
const BLOCK_EDGES: usize = (16 << 20) / size_of::<Edge>();
/// At most this many (block, bucket) pairs: each has a count and a run to place (24 bytes), so
/// with many buckets (N = 256: 65,536) the blocks grow instead (384 MiB at the most).
const BLOCK_BUCKET_PAIRS: usize = 1 << 24;

/// Edges a block of [`Buckets::read`] or [`Buckets::build`] holds for `total` edges.
fn block_edges(total: usize, scheme: PartitionScheme) -> usize {
    let buckets = scheme.num_partitions as usize * scheme.num_partitions as usize;
    let max_blocks = (BLOCK_BUCKET_PAIRS / buckets).max(1);
    BLOCK_EDGES.max(total.div_ceil(max_blocks))
}

/// Reads the whole file `name` in `dir` of little-endian plain values.
pub(crate) fn read_pod<T: bytemuck::Pod>(dir: &Dir, name: &Path) -> Result<Vec<T>> {
    use std::os::unix::fs::FileExt;
    let path = &dir.join(name);
    let file = dir.open_file(name, Access::Read).at(path)?;
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
    let progress = ReadProgress::new(format!("reading {}", path.display()), len);
    bytes
        .par_chunks_mut(READ_BLOCK)
        .enumerate()
        .try_for_each(|(i, block)| {
            file.read_exact_at(block, (i * READ_BLOCK) as u64)?;
            progress.add(block.len() as u64);
            Ok(())
        })
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
                .to_string()
                .contains("4 partitions for 3 entities")
        );
        assert!(PartitionScheme::new(3, 0).is_err());
    }

    proptest! {
        #[test]
        fn buckets_hold_their_edges_in_input_order(
            v in 1u32..200,
            n in 1u32..9,
            block_edges in 1usize..40,
            raw in prop::collection::vec((0u32..1000, 0u32..5, 0u32..1000), 0..300)
        ) {
            prop_assume!(n <= v);
            let edges: Vec<Edge> = raw.iter().map(|&(s, r, d)| [s % v, r, d % v]).collect();
            let scheme = PartitionScheme::new(u64::from(v), n).unwrap();
            let b = Buckets::build_in_blocks(&edges, scheme, block_edges);
            prop_assert_eq!(b.edges().len(), edges.len());
            for i in 0..n {
                for j in 0..n {
                    let want: Vec<Edge> = edges
                        .iter()
                        .filter(|e| scheme.partition_of(e[0]) == i && scheme.partition_of(e[2]) == j)
                        .copied()
                        .collect();
                    prop_assert_eq!(b.bucket(i, j), &want[..], "bucket ({}, {})", i, j);
                }
            }
        }
    }

    #[test]
    fn blocks_grow_only_when_the_buckets_are_very_many() {
        let twitter = 1_468_365_182usize;
        let scheme = |n| PartitionScheme::new(41_652_230, n).unwrap();
        assert_eq!(block_edges(twitter, scheme(8)), BLOCK_EDGES);
        let big = block_edges(twitter, scheme(256));
        assert!(
            twitter.div_ceil(big) * 256 * 256 <= BLOCK_BUCKET_PAIRS,
            "{big}"
        );
        assert_eq!(block_edges(10, scheme(256)), BLOCK_EDGES);
    }

    #[test]
    fn a_host_reads_only_the_buckets_it_selects_from_the_edges_or_the_saved_buckets() {
        let dir = tempfile::tempdir().unwrap();
        let v = 700u32;
        let total = BLOCK_EDGES + 999;
        let edges: Vec<Edge> = (0..total as u32)
            .map(|i| {
                let h = i.wrapping_mul(2_654_435_761);
                [h % v, 0, (h >> 9) % v]
            })
            .collect();
        std::fs::create_dir(dir.path().join(EDGES_DIR)).unwrap();
        let name = Path::new(EDGES_DIR).join("train.bin");
        std::fs::write(
            dir.path().join(&name),
            bytemuck::cast_slice::<Edge, u8>(&edges),
        )
        .unwrap();
        let scheme = PartitionScheme::new(u64::from(v), 4).unwrap();
        let root = Dir::open(dir.path()).unwrap();
        let all = Buckets::build(edges.clone(), scheme);
        let keep = |b: usize| b % 3 != 1;
        let counts = Buckets::count(&root, &name, scheme, total as u64, |_| Ok(())).unwrap();
        assert_eq!(counts, all.counts());
        let from_file =
            Buckets::read_selected(&root, &name, scheme, total as u64, |_| Ok(()), &keep).unwrap();
        assert!(
            Buckets::load_counts(&root, scheme, total as u64)
                .unwrap()
                .is_none()
        );
        all.save(dir.path()).unwrap();
        assert_eq!(
            Buckets::load_counts(&root, scheme, total as u64)
                .unwrap()
                .unwrap(),
            counts
        );
        let saved = Buckets::load_selected(&root, scheme, total as u64, &keep)
            .unwrap()
            .unwrap();
        for got in [&from_file, &saved] {
            for i in 0..4 {
                for j in 0..4 {
                    let b = scheme.bucket_index(i, j);
                    let want: &[Edge] = if keep(b) { all.bucket(i, j) } else { &[] };
                    assert_eq!(got.bucket(i, j), want, "bucket ({i}, {j})");
                }
            }
            assert!(got.edges().len() < edges.len());
        }
        // A stale save is refused as the whole load refuses it.
        assert!(Buckets::load_selected(&root, scheme, total as u64 + 1, &keep).is_err());
    }

    #[test]
    fn a_file_reads_into_the_buckets_built_in_memory_and_names_a_bad_edge() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        let v = 1000u32;
        // Three blocks of the file reader, the last one short.
        let total = 2 * BLOCK_EDGES + 12_345;
        let bad = BLOCK_EDGES + 7;
        let edges: Vec<Edge> = (0..total as u32)
            .map(|i| {
                let h = i.wrapping_mul(2_654_435_761);
                // Relation 3 marks the one bad edge.
                [
                    h % v,
                    if i as usize == bad { 3 } else { i % 3 },
                    (h >> 7) % v,
                ]
            })
            .collect();
        std::fs::write(&path, bytemuck::cast_slice::<Edge, u8>(&edges)).unwrap();
        let scheme = PartitionScheme::new(u64::from(v), 5).unwrap();
        let ok = |_: &Edge| Ok(());
        let root = Dir::open(dir.path()).unwrap();
        let name = Path::new("train.bin");
        let read = Buckets::read(&root, name, scheme, total as u64, ok).unwrap();
        let built = Buckets::build(edges.clone(), scheme);
        assert_eq!(read.edges(), built.edges());
        assert_eq!(read.counts(), built.counts());

        let err = Buckets::read(&root, name, scheme, total as u64, |e: &Edge| {
            if e[1] == 3 {
                Err(RecordError::OutOfRange {
                    entities: 7,
                    relations: 3,
                })
            } else {
                Ok(())
            }
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(&format!("edge {bad} "))
                && err.contains("is outside 7 entities / 3 relations"),
            "{err}"
        );
        let err = Buckets::read(&root, name, scheme, total as u64 + 1, ok)
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected"), "{err}");
    }
}
