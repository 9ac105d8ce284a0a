//! `legendctl generate`: synthetic graphs with power-law degrees, written as a dataset directory.
//!
//! Every edge draws a source rank, a relation rank and a destination rank from Zipf-like power
//! laws (`P(rank k) ∝ (k+1)^-skew`, sampled by inverting the continuous CDF), and maps the entity
//! ranks to ids through two keyed pseudo-random permutations, one for sources and one for
//! destinations, so that hubs are spread over the id space and id-range partitions stay balanced.
//! Edges are generated in fixed-size blocks, each from its own counter-based random stream keyed
//! by (seed, split, block), so the output depends on the seed alone, never on the thread count.
//! Valid and test edges take their source, relation and destination from random train edges:
//! they follow the same distributions and only use entities and relations that occur in train.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use legend_model::Permutation;
use legend_model::rng::{self, Stream};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{DatasetError, IoContext, Result};
use crate::import::write_synced;
use crate::meta::{DatasetMeta, FORMAT_VERSION, Split, SplitCounts};
use crate::raw::UNTYPED_RELATION;
use crate::staging::{Staging, check_new_output};
use crate::{EDGES_DIR, ENTITIES_FILE, Edge, RELATIONS_FILE, edge_file};

/// Edges per block: the unit of parallel work and of random streams. Changing it changes the
/// output for a seed.
const BLOCK: usize = 1 << 16;

/// Label lines formatted per parallel task.
const LABEL_BLOCK: u64 = 1 << 16;

/// Redraws of a destination that equals the source before falling back to a loop-free choice.
const SELF_LOOP_TRIES: u32 = 8;
/// Counters naming the streams of the source and destination id permutations.
const SOURCE_IDS: u64 = 0x5eed_0001;
const DESTINATION_IDS: u64 = 0x5eed_0002;

/// Options of [`generate`].
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Entities; ids are `0..nodes`. At least 2, at most 2³²−1.
    pub nodes: u64,
    /// Edges in all splits together.
    pub edges: u64,
    /// Relation types, at least 1.
    pub relations: u64,
    /// Power-law exponent of source, destination and relation ranks: 0 is uniform, 1 is Zipf's
    /// law; larger values concentrate more edges on fewer hubs.
    pub skew: f64,
    /// Seed of everything random.
    pub seed: u64,
    /// Fractions of train, valid and test edges; they sum to 1 and train is positive.
    pub split: [f64; 3],
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Set by a signal handler to abandon the generation; nothing is written then.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl GenerateOptions {
    /// Options for `nodes` and `edges` with one relation, skew 0.8, seed 0 and a 90/5/5 split.
    pub fn new(nodes: u64, edges: u64) -> Self {
        GenerateOptions {
            nodes,
            edges,
            relations: 1,
            skew: 0.8,
            seed: 0,
            split: [0.9, 0.05, 0.05],
            progress: false,
            cancel: None,
        }
    }

    fn check(&self) -> Result<()> {
        let fail = |m: String| Err(DatasetError::Options(m));
        let max = u64::from(u32::MAX);
        if self.nodes == 0 {
            return fail("--nodes must be at least 1".into());
        }
        if self.nodes > max {
            return fail(format!(
                "--nodes {} exceeds the {max} entities that 4-byte ids can hold",
                self.nodes
            ));
        }
        if self.edges == 0 {
            return fail("--edges must be at least 1".into());
        }
        if self.nodes < 2 {
            return fail(format!(
                "{} edges need at least 2 nodes: self-loops are not generated",
                self.edges
            ));
        }
        if self.relations == 0 || self.relations > max {
            return fail(format!(
                "--relations must be between 1 and {max}, got {}",
                self.relations
            ));
        }
        if !self.skew.is_finite() || self.skew < 0.0 {
            return fail(format!(
                "--skew must be a non-negative number (0 = uniform, 1 = Zipf), got {}",
                self.skew
            ));
        }
        let f = &self.split;
        if f.iter().any(|x| !x.is_finite() || *x < 0.0)
            || (f.iter().sum::<f64>() - 1.0).abs() > 1e-6
        {
            return fail(format!(
                "--split fractions must be three non-negative numbers summing to 1, got {},{},{}",
                f[0], f[1], f[2]
            ));
        }
        if f[0] == 0.0 {
            return fail("--split: the train fraction must be positive".into());
        }
        Ok(())
    }

    /// Edges per split, cut like `import --split`: valid and test are rounded down.
    fn counts(&self) -> SplitCounts {
        let m = self.edges as f64;
        let valid = (m * self.split[1]).floor() as u64;
        let test = (m * self.split[2]).floor() as u64;
        SplitCounts {
            train: self.edges - valid - test,
            valid,
            test,
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    }
}

/// What a generation produced (`legendctl generate --json`).
#[derive(Clone, Debug, Serialize)]
pub struct GenerateSummary {
    /// The dataset directory written.
    pub output: PathBuf,
    /// Entities.
    pub entities: u64,
    /// Relation types.
    pub relations: u64,
    /// Training edges.
    pub train: u64,
    /// Validation edges.
    pub valid: u64,
    /// Test edges.
    pub test: u64,
    /// Seconds spent drawing the edges.
    pub generate_seconds: f64,
    /// Wall time in seconds, writing and syncing included.
    pub seconds: f64,
}

/// Writes a synthetic graph described by `options` into a new dataset directory `out`.
///
/// `out` must not exist. On any error, or when cancelled, nothing is left behind. The same
/// options always produce byte-identical files, whatever the number of threads.
pub fn generate(options: &GenerateOptions, out: &Path) -> Result<GenerateSummary> {
    let started = Instant::now();
    options.check()?;
    check_new_output(out)?;
    let counts = options.counts();
    let bar = progress_bar(options);
    let model = Model::new(options);
    let train = draw_train(&model, options, counts.train as usize, &bar);
    let valid = draw_held_out(&train, options, Split::Valid, counts.valid as usize, &bar);
    let test = draw_held_out(&train, options, Split::Test, counts.test as usize, &bar);
    bar.finish_and_clear();
    if options.cancelled() {
        return Err(DatasetError::Interrupted);
    }
    let generate_seconds = started.elapsed().as_secs_f64();

    let staging = Staging::new(out, "generating")?;
    let dir = staging.dir();
    let edges_dir = dir.join(EDGES_DIR);
    std::fs::create_dir(&edges_dir).at(&edges_dir)?;
    let mut checksums = SplitCounts::default();
    for (split, edges) in Split::ALL.into_iter().zip([&train, &valid, &test]) {
        let path = edge_file(dir, split);
        *checksums.get_mut(split) = u64::from(write_synced(&path, bytemuck::cast_slice(edges))?);
    }
    write_labels(&dir.join(ENTITIES_FILE), options.nodes, |buf, id| {
        writeln!(buf, "{id}\te{id}")
    })?;
    let untyped = options.relations == 1;
    write_labels(&dir.join(RELATIONS_FILE), options.relations, |buf, id| {
        if untyped {
            writeln!(buf, "{id}\t{UNTYPED_RELATION}")
        } else {
            writeln!(buf, "{id}\tr{id}")
        }
    })?;
    let [t, v, s] = options.split;
    let meta = DatasetMeta {
        format_version: FORMAT_VERSION,
        entities: options.nodes,
        relations: options.relations,
        // One relation is the convention of graphs without relation types (`--columns sd`).
        has_relations: !untyped,
        id_width: 4,
        splits: counts,
        checksums,
        seed: options.seed,
        sources: vec![format!(
            "legendctl generate --nodes {} --edges {} --relations {} --skew {} --seed {} --split {t},{v},{s}",
            options.nodes, options.edges, options.relations, options.skew, options.seed
        )],
        unseen_dropped: 0,
        unseen_kept: 0,
        extends: None,
    };
    meta.write(dir)?;
    if options.cancelled() {
        return Err(DatasetError::Interrupted);
    }
    staging.publish()?;
    Ok(GenerateSummary {
        output: out.to_owned(),
        entities: options.nodes,
        relations: options.relations,
        train: counts.train,
        valid: counts.valid,
        test: counts.test,
        generate_seconds,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn progress_bar(options: &GenerateOptions) -> ProgressBar {
    if !options.progress {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(options.edges);
    bar.set_style(
        ProgressStyle::with_template("generating [{bar:30}] {pos}/{len} edges {per_sec} eta {eta}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar
}

/// Train edges: every block draws from the model with its own stream.
fn draw_train(
    model: &Model,
    options: &GenerateOptions,
    count: usize,
    bar: &ProgressBar,
) -> Vec<Edge> {
    // vec! of zeros is a lazily zeroed allocation, first touched by the parallel workers.
    let mut edges = vec![[0u32; 3]; count];
    edges
        .par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(block, chunk)| {
            if options.cancelled() {
                return;
            }
            let mut rng = block_stream(options.seed, Split::Train, block);
            for e in chunk.iter_mut() {
                *e = model.edge(&mut rng);
            }
            bar.inc(chunk.len() as u64);
        });
    edges
}

/// Valid or test edges: source, relation and destination of three random train edges, which
/// samples each by its train frequency, the same law as the model's but restricted to what train
/// holds.
fn draw_held_out(
    train: &[Edge],
    options: &GenerateOptions,
    split: Split,
    count: usize,
    bar: &ProgressBar,
) -> Vec<Edge> {
    let mut edges = vec![[0u32; 3]; count];
    edges
        .par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(block, chunk)| {
            if options.cancelled() {
                return;
            }
            let mut rng = block_stream(options.seed, split, block);
            let mut pick = || train[rng.below(train.len() as u64) as usize];
            for e in chunk.iter_mut() {
                let first = pick();
                let rel = pick()[1];
                let mut dst = pick()[2];
                for _ in 0..SELF_LOOP_TRIES {
                    if dst != first[0] {
                        break;
                    }
                    dst = pick()[2];
                }
                if dst == first[0] {
                    // Train edges are loop-free, so the first edge's own destination always is.
                    dst = first[2];
                }
                *e = [first[0], rel, dst];
            }
            bar.inc(chunk.len() as u64);
        });
    edges
}

/// Writes `count` lines `id<TAB>label`, formatted in parallel and written in order.
fn write_labels(
    path: &Path,
    count: u64,
    line: impl Fn(&mut Vec<u8>, u64) -> std::io::Result<()> + Sync,
) -> Result<()> {
    let file = File::create(path).at(path)?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    let blocks = count.div_ceil(LABEL_BLOCK);
    // A bounded batch of blocks at a time keeps memory small for billions of ids.
    let batch = rayon::current_num_threads() as u64 * 4;
    for first in (0..blocks).step_by(batch as usize) {
        let texts: Vec<Vec<u8>> = (first..(first + batch).min(blocks))
            .into_par_iter()
            .map(|b| {
                let ids = b * LABEL_BLOCK..((b + 1) * LABEL_BLOCK).min(count);
                let mut buf = Vec::with_capacity(ids.clone().count() * 24);
                for id in ids {
                    line(&mut buf, id).expect("formatting into a Vec cannot fail");
                }
                buf
            })
            .collect();
        for text in &texts {
            w.write_all(text).at(path)?;
        }
    }
    let file = w.into_inner().map_err(|e| e.into_error()).at(path)?;
    file.sync_all().at(path)
}

/// The edge distribution.
struct Model {
    nodes: u64,
    sources: PowerLaw,
    destinations: PowerLaw,
    relations: PowerLaw,
    source_ids: Permutation,
    destination_ids: Permutation,
}

impl Model {
    fn new(options: &GenerateOptions) -> Model {
        Model {
            nodes: options.nodes,
            sources: PowerLaw::new(options.nodes, options.skew),
            destinations: PowerLaw::new(options.nodes, options.skew),
            relations: PowerLaw::new(options.relations, options.skew),
            // Separate permutations make out- and in-hubs different nodes, as in real graphs
            // where the most cited and the most citing entities differ.
            source_ids: Permutation::new(options.nodes, rng::key(options.seed, &[SOURCE_IDS])),
            destination_ids: Permutation::new(
                options.nodes,
                rng::key(options.seed, &[DESTINATION_IDS]),
            ),
        }
    }

    fn edge(&self, rng: &mut Stream) -> Edge {
        let src = self.source_ids.at(self.sources.sample(rng.unit()));
        let rel = self.relations.sample(rng.unit());
        let mut dst = src;
        for _ in 0..SELF_LOOP_TRIES {
            dst = self
                .destination_ids
                .at(self.destinations.sample(rng.unit()));
            if dst != src {
                break;
            }
        }
        if dst == src {
            // Only reached on tiny or extremely skewed graphs; the neighbour id keeps it loop-free.
            dst = (src + 1) % self.nodes;
        }
        [src as u32, rel as u32, dst as u32]
    }
}

/// A Zipf-like law over ranks `0..n`: the continuous density `x^-s` on `[1, n+1)`, inverted.
#[derive(Clone, Copy)]
enum PowerLaw {
    Uniform {
        n: f64,
    },
    /// s = 1: x = (n+1)^u.
    Log {
        n: f64,
        ln_top: f64,
    },
    /// s ≠ 1, with a = 1 − s: x = (1 + u·((n+1)^a − 1))^(1/a).
    Power {
        n: f64,
        a: f64,
        span: f64,
    },
}

impl PowerLaw {
    fn new(n: u64, s: f64) -> PowerLaw {
        let n = n as f64;
        let ln_top = (n + 1.0).ln();
        let a = 1.0 - s;
        if s == 0.0 {
            PowerLaw::Uniform { n }
        } else if a.abs() < 1e-9 {
            PowerLaw::Log { n, ln_top }
        } else {
            // exp_m1 keeps (n+1)^a − 1 exact for a near 0.
            PowerLaw::Power {
                n,
                a,
                span: (a * ln_top).exp_m1(),
            }
        }
    }

    /// The rank for a uniform `u` in [0, 1).
    fn sample(self, u: f64) -> u64 {
        let (rank, n) = match self {
            PowerLaw::Uniform { n } => (u * n, n),
            PowerLaw::Log { n, ln_top } => ((u * ln_top).exp() - 1.0, n),
            PowerLaw::Power { n, a, span } => (((u * span).ln_1p() / a).exp() - 1.0, n),
        };
        // Rounding can land on n at the very top of the range.
        (rank as u64).min(n as u64 - 1)
    }
}

/// The draws of `split`'s block `block` (each block of edges draws from its own stream, so
/// the graph does not depend on the thread count).
fn block_stream(seed: u64, split: Split, block: usize) -> Stream {
    Stream::new(rng::key(seed, &[split as u64, block as u64]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dataset, degrees};

    fn options(nodes: u64, edges: u64) -> GenerateOptions {
        GenerateOptions {
            relations: 7,
            skew: 1.0,
            seed: 42,
            ..GenerateOptions::new(nodes, edges)
        }
    }

    fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut names = vec![
            "dataset.toml".to_owned(),
            ENTITIES_FILE.to_owned(),
            RELATIONS_FILE.to_owned(),
        ];
        names.extend(Split::ALL.map(|s| format!("{EDGES_DIR}/{}.bin", s.name())));
        names
            .into_iter()
            .map(|n| {
                let bytes = std::fs::read(dir.join(&n)).unwrap();
                (n, bytes)
            })
            .collect()
    }

    fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    #[test]
    fn power_law_stays_in_range_and_favours_low_ranks() {
        for s in [0.0, 0.5, 1.0, 1.0 + 1e-12, 2.5] {
            let law = PowerLaw::new(10, s);
            assert_eq!(law.sample(0.0), 0);
            assert_eq!(law.sample(1.0 - f64::EPSILON), 9, "skew {s}");
        }
        let law = PowerLaw::new(1000, 1.0);
        let mut rng = Stream::new(1);
        let low = (0..10_000).filter(|_| law.sample(rng.unit()) < 10).count();
        // ln(11)/ln(1001) ≈ 35% of the mass sits on the top 1% of ranks.
        assert!((3000..4000).contains(&low), "{low}");
    }

    #[test]
    fn reproducible_for_any_thread_count_and_seed_dependent() {
        let dir = tempfile::tempdir().unwrap();
        let opts = options(5_000, 3 * BLOCK as u64 + 123);
        let one = dir.path().join("one");
        let four = dir.path().join("four");
        in_pool(1, || generate(&opts, &one)).unwrap();
        in_pool(4, || generate(&opts, &four)).unwrap();
        assert_eq!(files(&one), files(&four));

        let other = dir.path().join("other");
        generate(&GenerateOptions { seed: 43, ..opts }, &other).unwrap();
        for ((name, a), (_, b)) in files(&one).into_iter().zip(files(&other)).skip(3) {
            assert_ne!(a, b, "{name} does not depend on the seed");
        }
    }

    #[test]
    fn counts_are_exact_and_the_dataset_loads() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("g");
        let summary = generate(&options(1_000, 20_001), &out).unwrap();
        assert_eq!(
            (summary.train, summary.valid, summary.test),
            (18_001, 1_000, 1_000)
        );
        let ds = Dataset::open(&out).unwrap();
        let meta = ds.meta();
        assert_eq!((meta.entities, meta.relations), (1_000, 7));
        assert!(meta.has_relations);
        assert_eq!(ds.entity_labels().unwrap()[17], "e17");
        assert_eq!(ds.relation_labels().unwrap()[6], "r6");
        let train = ds.edges(Split::Train).unwrap();
        assert_eq!(train.len(), 18_001);
        // Counted from the file in blocks (18 001 edges: two), as from the loaded edges.
        assert_eq!(ds.degrees(Split::Train).unwrap(), degrees(1_000, &train));
        assert!(train.iter().all(|e| e[0] != e[2]), "self-loop in train");
        let mut entity_in_train = [false; 1_000];
        let mut relation_in_train = [false; 7];
        for &[s, r, d] in &train {
            entity_in_train[s as usize] = true;
            entity_in_train[d as usize] = true;
            relation_in_train[r as usize] = true;
        }
        for split in [Split::Valid, Split::Test] {
            let edges = ds.edges(split).unwrap();
            assert_eq!(edges.len(), 1_000);
            for &[s, r, d] in &edges {
                assert_ne!(s, d, "self-loop in {}", split.name());
                assert!(entity_in_train[s as usize] && entity_in_train[d as usize]);
                assert!(relation_in_train[r as usize]);
            }
        }
        // The edges train on: buckets build for id-range partitions.
        assert_eq!(ds.buckets(4).unwrap().edges().len(), 18_001);
        // Nothing but the dataset is left in the parent.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn one_relation_is_untyped() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("g");
        generate(&GenerateOptions::new(10, 100), &out).unwrap();
        let ds = Dataset::open(&out).unwrap();
        assert!(!ds.meta().has_relations);
        assert_eq!(ds.relation_labels().unwrap(), [UNTYPED_RELATION]);
        assert!(ds.edges(Split::Train).unwrap().iter().all(|e| e[1] == 0));
    }

    /// Share of all endpoints held by the top 1% of nodes by degree, and the largest share of
    /// endpoints in one of 4 id-range partitions.
    fn skew_figures(skew: f64) -> (f64, f64) {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("g");
        let nodes = 10_000;
        let opts = GenerateOptions {
            skew,
            split: [1.0, 0.0, 0.0],
            ..options(nodes, 200_000)
        };
        generate(&opts, &out).unwrap();
        let edges = Dataset::open(&out).unwrap().edges(Split::Train).unwrap();
        let mut deg = degrees(nodes as usize, &edges);
        let total = 2.0 * edges.len() as f64;
        let quarter = nodes as usize / 4;
        let widest = deg
            .chunks(quarter)
            .map(|c| c.iter().map(|&d| f64::from(d)).sum::<f64>() / total)
            .fold(0.0, f64::max);
        deg.sort_unstable_by(|a, b| b.cmp(a));
        let top: u64 = deg[..nodes as usize / 100]
            .iter()
            .map(|&d| u64::from(d))
            .sum();
        (top as f64 / total, widest)
    }

    #[test]
    fn degrees_are_skewed_and_partitions_balanced() {
        let (top, widest) = skew_figures(1.0);
        assert!(top > 0.25, "top 1% of nodes hold {top:.3} of endpoints");
        assert!(
            widest < 0.35,
            "one partition holds {widest:.3} of endpoints"
        );
        let (top, widest) = skew_figures(0.0);
        assert!(top < 0.03, "uniform: top 1% hold {top:.3}");
        assert!(widest < 0.26, "uniform: one partition holds {widest:.3}");
    }

    #[test]
    fn bad_options_are_refused_and_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("g");
        let cases = [
            (GenerateOptions::new(0, 10), "--nodes must be at least 1"),
            (GenerateOptions::new(1, 10), "at least 2 nodes"),
            (GenerateOptions::new(10, 0), "--edges must be at least 1"),
            (GenerateOptions::new(1 << 32, 10), "4-byte ids"),
            (
                GenerateOptions {
                    relations: 0,
                    ..GenerateOptions::new(10, 10)
                },
                "--relations",
            ),
            (
                GenerateOptions {
                    skew: -1.0,
                    ..GenerateOptions::new(10, 10)
                },
                "--skew",
            ),
            (
                GenerateOptions {
                    split: [0.5, 0.2, 0.2],
                    ..GenerateOptions::new(10, 10)
                },
                "summing to 1",
            ),
            (
                GenerateOptions {
                    split: [0.0, 0.5, 0.5],
                    ..GenerateOptions::new(10, 10)
                },
                "train fraction",
            ),
        ];
        for (opts, needle) in cases {
            let err = generate(&opts, &out).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
        let cancel = Arc::new(AtomicBool::new(true));
        let opts = GenerateOptions {
            cancel: Some(cancel),
            ..GenerateOptions::new(10, 100)
        };
        assert!(matches!(
            generate(&opts, &out),
            Err(DatasetError::Interrupted)
        ));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        std::fs::create_dir(&out).unwrap();
        let err = generate(&GenerateOptions::new(10, 100), &out).unwrap_err();
        assert!(err.to_string().contains("already exists"), "{err}");
    }
}
