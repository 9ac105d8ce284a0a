//! `legendctl import`: delimited text or a Marius directory to a dataset directory.
//!
//! Import runs in three steps: read every input line into packed edges with provisional ids
//! (labels interned once), decide which valid/test edges to keep, then permute node ids with the
//! seed (so id-range partitions are balanced, as Marius does) and write everything into a
//! temporary directory that is renamed into place only when complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::error::{DatasetError, IoContext, RecordError, Result, invalid};
use crate::header::{self, Header};
use crate::marius;
use crate::meta::{DatasetMeta, FORMAT_VERSION, Split, SplitCounts};
use crate::raw::{RawGraph, UNTYPED_RELATION};
use crate::staging::{Staging, check_new_output};
use crate::text::{Columns, Delimiter, LineReader, parse_fields};
use crate::{EDGES_DIR, ENTITIES_FILE, Edge, RELATIONS_FILE, edge_file};

/// Where the edges come from.
#[derive(Clone, Debug)]
pub enum ImportInput {
    /// Separate files per split; valid and test are optional.
    Files {
        /// Training edges.
        train: PathBuf,
        /// Validation edges.
        valid: Option<PathBuf>,
        /// Test edges.
        test: Option<PathBuf>,
    },
    /// Files whose edges are pooled and split at random by these fractions (train, valid, test).
    Split {
        /// Input files.
        files: Vec<PathBuf>,
        /// Fractions of train, valid and test; they sum to 1.
        fractions: [f64; 3],
    },
    /// A directory preprocessed by Marius (`dataset.yaml`, `edges/*_edges.bin`).
    Marius {
        /// The directory.
        dir: PathBuf,
    },
    /// A dataset directory (`base`) with new edges added (`legendctl import --extend BASE
    /// --add FILE`): every id of the base kept, new labels after them (see
    /// [`crate::Extension`]). Valid and test are optional.
    Extend {
        /// The dataset extended (only read).
        base: PathBuf,
        /// The added training edges.
        train: PathBuf,
        /// Added validation edges.
        valid: Option<PathBuf>,
        /// Added test edges.
        test: Option<PathBuf>,
    },
}

/// Options of [`import`].
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// The inputs.
    pub input: ImportInput,
    /// Field delimiter; detected from the first data line of each file when `None`.
    pub delimiter: Option<Delimiter>,
    /// Column order of text inputs.
    pub columns: Columns,
    /// Seed of the node-id permutation and of fraction splits.
    pub seed: u64,
    /// Keep valid/test edges whose entity or relation never occurs in train.
    pub keep_unseen: bool,
    /// Whether text files start with a header line ([`Header`]).
    pub header: Header,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Set by a signal handler to abandon the import; nothing is written then.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl ImportOptions {
    /// Options with defaults for `input`.
    pub fn new(input: ImportInput) -> Self {
        ImportOptions {
            input,
            delimiter: None,
            columns: Columns::Hrt,
            seed: 0,
            keep_unseen: false,
            header: Header::Auto,
            progress: false,
            cancel: None,
        }
    }
}

/// What an import produced (`legendctl import --json`).
#[derive(Clone, Debug, Serialize)]
pub struct ImportSummary {
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
    /// Valid/test edges dropped for an entity or relation unseen in train.
    pub unseen_dropped: u64,
    /// Valid/test edges kept despite that (`--keep-unseen`).
    pub unseen_kept: u64,
    /// The header lines skipped, as `FILE:LINE` ([`Header`]).
    pub skipped_headers: Vec<String>,
    /// Wall time in seconds.
    pub seconds: f64,
    /// What the dataset was extended from (`ImportInput::Extend`): its counts are the base's,
    /// the edges after them the added ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extends: Option<crate::Extension>,
}

/// Interns labels to dense provisional ids in order of first appearance.
#[derive(Default)]
pub(crate) struct Interner {
    ids: FxHashMap<Box<[u8]>, u32>,
}

impl Interner {
    /// An interner that already holds `labels` at their indices (the labels of a dataset being
    /// extended: its ids are kept, new labels come after them). A label given twice is
    /// returned as `Err((first id, second id, label))`: it could not be matched to one id.
    pub(crate) fn seeded(
        labels: Vec<Box<[u8]>>,
    ) -> std::result::Result<Interner, (u32, u32, Box<[u8]>)> {
        let mut ids = FxHashMap::default();
        ids.reserve(labels.len());
        for (id, label) in labels.into_iter().enumerate() {
            match ids.entry(label) {
                std::collections::hash_map::Entry::Occupied(e) => {
                    return Err((*e.get(), id as u32, e.key().clone()));
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(id as u32);
                }
            }
        }
        Ok(Interner { ids })
    }

    fn intern(&mut self, label: &[u8]) -> std::result::Result<u32, RecordError> {
        if let Some(&id) = self.ids.get(label) {
            return Ok(id);
        }
        let id = u32::try_from(self.ids.len())
            .ok()
            .filter(|&id| id < u32::MAX)
            .ok_or(RecordError::TooManyLabels)?;
        self.ids.insert(label.into(), id);
        Ok(id)
    }

    /// Labels indexed by id.
    pub(crate) fn into_labels(self) -> Vec<Box<[u8]>> {
        let mut labels = vec![Box::<[u8]>::default(); self.ids.len()];
        for (label, id) in self.ids {
            labels[id as usize] = label;
        }
        labels
    }
}

/// Imports `options.input` into a new dataset directory `out`.
///
/// `out` must not exist. On any error, or when cancelled, nothing is left behind.
pub fn import(options: &ImportOptions, out: &Path) -> Result<ImportSummary> {
    let started = Instant::now();
    check_new_output(out)?;
    let mut skipped_headers = Vec::new();
    let (raw, sources) = match &options.input {
        ImportInput::Extend {
            base,
            train,
            valid,
            test,
        } => {
            let delta = crate::extend::Delta {
                train,
                valid: valid.as_ref(),
                test: test.as_ref(),
            };
            return crate::extend::extend(options, base, delta, out);
        }
        ImportInput::Marius { dir } => (marius::read(dir)?, vec![dir.display().to_string()]),
        ImportInput::Files { train, valid, test } => {
            let inputs: Vec<(Split, &PathBuf)> = [
                (Split::Train, Some(train)),
                (Split::Valid, valid.as_ref()),
                (Split::Test, test.as_ref()),
            ]
            .into_iter()
            .filter_map(|(s, p)| p.map(|p| (s, p)))
            .collect();
            let (raw, headers) = read_text(options, &inputs, Default::default())?;
            skipped_headers = headers;
            (
                raw,
                inputs
                    .iter()
                    .map(|(_, p)| p.display().to_string())
                    .collect(),
            )
        }
        ImportInput::Split { files, fractions } => {
            check_fractions(fractions)?;
            if files.is_empty() {
                return Err(DatasetError::Options("no input files to split".into()));
            }
            let inputs: Vec<(Split, &PathBuf)> = files.iter().map(|p| (Split::Train, p)).collect();
            let (mut raw, headers) = read_text(options, &inputs, Default::default())?;
            skipped_headers = headers;
            split_by_fraction(&mut raw, fractions, options.seed);
            (raw, files.iter().map(|p| p.display().to_string()).collect())
        }
    };
    check_cancel(options)?;
    let graph = finish(raw, options)?;
    let staging = Staging::new(out, "importing")?;
    let meta = graph.write(staging.dir(), options.seed, sources)?;
    check_cancel(options)?;
    staging.publish()?;
    Ok(ImportSummary::of(out, meta, skipped_headers, started))
}

impl ImportSummary {
    /// The summary of the dataset `meta` describes, written to `out` since `started`.
    pub(crate) fn of(
        out: &Path,
        meta: DatasetMeta,
        skipped_headers: Vec<String>,
        started: Instant,
    ) -> ImportSummary {
        ImportSummary {
            output: out.to_owned(),
            entities: meta.entities,
            relations: meta.relations,
            train: meta.splits.train,
            valid: meta.splits.valid,
            test: meta.splits.test,
            unseen_dropped: meta.unseen_dropped,
            unseen_kept: meta.unseen_kept,
            skipped_headers,
            seconds: started.elapsed().as_secs_f64(),
            extends: meta.extends,
        }
    }
}

pub(crate) fn check_cancel(options: &ImportOptions) -> Result<()> {
    match &options.cancel {
        Some(flag) if flag.load(Ordering::Relaxed) => Err(DatasetError::Interrupted),
        _ => Ok(()),
    }
}

fn check_fractions(f: &[f64; 3]) -> Result<()> {
    if f.iter().any(|x| !x.is_finite() || *x < 0.0) || (f.iter().sum::<f64>() - 1.0).abs() > 1e-6 {
        return Err(DatasetError::Options(format!(
            "--split fractions must be three non-negative numbers summing to 1, got {},{},{}",
            f[0], f[1], f[2]
        )));
    }
    if f[0] == 0.0 {
        return Err(DatasetError::Options(
            "--split: the train fraction must be positive".into(),
        ));
    }
    Ok(())
}

/// Reads text inputs, interning labels after those `interners` (entities, relations) already
/// hold, into per-split edge lists; returns them with the header lines skipped (`FILE:LINE`).
pub(crate) fn read_text(
    options: &ImportOptions,
    inputs: &[(Split, &PathBuf)],
    (mut entities, mut relations): (Interner, Interner),
) -> Result<(RawGraph, Vec<String>)> {
    let total: u64 = inputs
        .iter()
        .map(|(_, p)| std::fs::metadata(p).map(|m| m.len()).at(*p))
        .sum::<Result<u64>>()?;
    let bar = if options.progress {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:>12} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("static template")
            .progress_chars("=> "),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut splits: [Vec<Edge>; 3] = Default::default();
    let mut done_before = 0u64;
    let mut line = Vec::with_capacity(256);
    let mut skipped = Vec::new();
    // First lines imported as edges, checked for being unlike the rest once all are read:
    // (split, index, where, the line).
    let mut first_edges = Vec::new();
    for (split, path) in inputs {
        bar.set_message(split.name());
        let mut reader = LineReader::open(path)?;
        let consumed: Arc<AtomicU64> = reader.consumed();
        let mut delimiter = options.delimiter;
        let edges = &mut splits[*split as usize];
        let before = edges.len();
        let mut first = true;
        while let Some(line_no) = reader.next_data_line(&mut line)? {
            let delim = *delimiter.get_or_insert_with(|| Delimiter::detect(&line));
            let parse_error = |e: RecordError| DatasetError::Parse {
                path: reader.path().to_owned(),
                line: line_no,
                message: e.to_string(),
            };
            let f = parse_fields(&line, delim, options.columns).map_err(parse_error)?;
            if std::mem::take(&mut first) {
                let at = format!("{}:{line_no}", reader.path().display());
                let fields: Vec<&[u8]> = [Some(f.head), f.rel, Some(f.tail)]
                    .into_iter()
                    .flatten()
                    .collect();
                let skip = match options.header {
                    Header::Yes => true,
                    Header::Auto if header::names_columns(&fields) => {
                        tracing::warn!(
                            "{at}: {} names columns: skipped as a header line (--header no imports it as an edge)",
                            quoted_line(&line)
                        );
                        true
                    }
                    Header::Auto => {
                        first_edges.push((
                            *split as usize,
                            edges.len(),
                            at.clone(),
                            quoted_line(&line),
                        ));
                        false
                    }
                    Header::No => false,
                };
                if skip {
                    skipped.push(at);
                    continue;
                }
            }
            let head = entities.intern(f.head).map_err(parse_error)?;
            let tail = entities.intern(f.tail).map_err(parse_error)?;
            let rel = match f.rel {
                Some(r) => relations.intern(r).map_err(parse_error)?,
                None => relations
                    .intern(UNTYPED_RELATION.as_bytes())
                    .map_err(parse_error)?,
            };
            edges.push([head, rel, tail]);
            if line_no % 65536 == 0 {
                bar.set_position(done_before + consumed.load(Ordering::Relaxed));
                check_cancel(options)?;
            }
        }
        if edges.len() == before {
            return Err(invalid(
                *path,
                "no edges: the file is empty or holds only comments, blank lines and a header line",
            ));
        }
        done_before += consumed.load(Ordering::Relaxed);
        bar.set_position(done_before);
    }
    bar.finish_and_clear();
    let typed = options.columns != Columns::Sd;
    for (split, index, at, text) in first_edges {
        if header::is_isolated(&splits, split, index, typed) {
            tracing::warn!(
                "{at}: {text} is unlike the other lines (none of its labels occurs elsewhere): imported as an edge; if it is a header, import with --header yes"
            );
        }
    }
    let raw = RawGraph {
        entity_labels: entities.into_labels(),
        relation_labels: relations.into_labels(),
        has_relations: typed,
        splits,
    };
    Ok((raw, skipped))
}

/// A line quoted for a warning, cut at 100 characters.
fn quoted_line(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    match text.char_indices().nth(100) {
        Some((cut, _)) => format!("{:?}…", &text[..cut]),
        None => format!("{text:?}"),
    }
}

/// Moves a random `fractions[1]` / `fractions[2]` of the pooled train edges into valid / test.
fn split_by_fraction(raw: &mut RawGraph, fractions: &[f64; 3], seed: u64) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5b1d_5eed);
    let pool = &mut raw.splits[Split::Train as usize];
    pool.shuffle(&mut rng);
    let n = pool.len() as f64;
    let valid = (n * fractions[1]).floor() as usize;
    let test = (n * fractions[2]).floor() as usize;
    let test_edges = pool.split_off(pool.len() - test);
    let valid_edges = pool.split_off(pool.len() - valid);
    raw.splits[Split::Valid as usize] = valid_edges;
    raw.splits[Split::Test as usize] = test_edges;
}

/// A graph with final ids, ready to write.
struct FinalGraph {
    entity_labels: Vec<Box<[u8]>>,
    relation_labels: Vec<Box<[u8]>>,
    has_relations: bool,
    splits: [Vec<Edge>; 3],
    unseen_dropped: u64,
    unseen_kept: u64,
}

/// Drops (or keeps) unseen valid/test edges, compacts ids and permutes entity ids by the seed.
fn finish(mut raw: RawGraph, options: &ImportOptions) -> Result<FinalGraph> {
    let ne = raw.entity_labels.len();
    let nr = raw.relation_labels.len();
    let mut entity_in_train = vec![false; ne];
    let mut relation_in_train = vec![false; nr];
    for &[s, r, d] in &raw.splits[Split::Train as usize] {
        entity_in_train[s as usize] = true;
        entity_in_train[d as usize] = true;
        relation_in_train[r as usize] = true;
    }
    let mut entity_used = entity_in_train.clone();
    let mut relation_used = relation_in_train.clone();
    let (mut dropped, mut kept) = (0u64, 0u64);
    for split in [Split::Valid, Split::Test] {
        raw.splits[split as usize].retain(|&[s, r, d]| {
            let seen = entity_in_train[s as usize]
                && entity_in_train[d as usize]
                && relation_in_train[r as usize];
            if seen {
                return true;
            }
            if options.keep_unseen {
                kept += 1;
                entity_used[s as usize] = true;
                entity_used[d as usize] = true;
                relation_used[r as usize] = true;
                true
            } else {
                dropped += 1;
                false
            }
        });
    }
    if dropped > 0 {
        tracing::warn!(
            dropped,
            "valid/test edges dropped: an entity or relation never occurs in train (use --keep-unseen to keep them)"
        );
    }
    // Entities: random permutation of the used ones, so that id ranges mix high- and low-degree nodes.
    let mut order: Vec<u32> = (0..ne as u32)
        .filter(|&e| entity_used[e as usize])
        .collect();
    order.shuffle(&mut Xoshiro256PlusPlus::seed_from_u64(options.seed));
    let mut entity_map = vec![u32::MAX; ne];
    for (new, &old) in order.iter().enumerate() {
        entity_map[old as usize] = new as u32;
    }
    // Relations keep their order of first appearance, compacted.
    let mut relation_map = vec![u32::MAX; nr];
    let mut next = 0u32;
    for (old, used) in relation_used.iter().enumerate() {
        if *used {
            relation_map[old] = next;
            next += 1;
        }
    }
    for edges in &mut raw.splits {
        for e in edges.iter_mut() {
            *e = [
                entity_map[e[0] as usize],
                relation_map[e[1] as usize],
                entity_map[e[2] as usize],
            ];
        }
    }
    let mut entity_labels = vec![Box::<[u8]>::default(); order.len()];
    for (old, label) in raw.entity_labels.into_iter().enumerate() {
        if let Some(slot) = entity_labels.get_mut(entity_map[old] as usize) {
            *slot = label;
        }
    }
    let relation_labels = raw
        .relation_labels
        .into_iter()
        .zip(&relation_used)
        .filter_map(|(l, used)| used.then_some(l))
        .collect();
    Ok(FinalGraph {
        entity_labels,
        relation_labels,
        has_relations: raw.has_relations,
        splits: raw.splits,
        unseen_dropped: dropped,
        unseen_kept: kept,
    })
}

impl FinalGraph {
    fn write(&self, dir: &Path, seed: u64, sources: Vec<String>) -> Result<DatasetMeta> {
        let edges_dir = dir.join(EDGES_DIR);
        std::fs::create_dir(&edges_dir).at(&edges_dir)?;
        let mut splits = SplitCounts::default();
        let mut checksums = SplitCounts::default();
        for split in Split::ALL {
            let edges = &self.splits[split as usize];
            let path = edge_file(dir, split);
            *checksums.get_mut(split) =
                u64::from(write_synced(&path, bytemuck::cast_slice(edges))?);
            *splits.get_mut(split) = edges.len() as u64;
        }
        write_labels(&dir.join(ENTITIES_FILE), &self.entity_labels)?;
        write_labels(&dir.join(RELATIONS_FILE), &self.relation_labels)?;
        let meta = DatasetMeta {
            format_version: FORMAT_VERSION,
            entities: self.entity_labels.len() as u64,
            relations: self.relation_labels.len() as u64,
            has_relations: self.has_relations,
            id_width: 4,
            splits,
            checksums,
            seed,
            sources,
            unseen_dropped: self.unseen_dropped,
            unseen_kept: self.unseen_kept,
            extends: None,
        };
        meta.write(dir)?;
        Ok(meta)
    }
}

/// Writes `bytes` to a new file, syncs it and returns its CRC-32.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<u32> {
    let mut file = File::create(path).at(path)?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .at(path)?;
    Ok(crc32fast::hash(bytes))
}

pub(crate) fn write_labels(path: &Path, labels: &[Box<[u8]>]) -> Result<()> {
    write_labels_after(path, &[], 0, labels)
}

/// Writes a label file: the lines `head` (a label file's bytes, `first_id` labels) as they are,
/// then `labels` with the ids from `first_id` on.
pub(crate) fn write_labels_after(
    path: &Path,
    head: &[u8],
    first_id: usize,
    labels: &[Box<[u8]>],
) -> Result<()> {
    let file = File::create(path).at(path)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(head).at(path)?;
    for (id, label) in labels.iter().enumerate() {
        write!(w, "{}\t", first_id + id).at(path)?;
        w.write_all(label).at(path)?;
        w.write_all(b"\n").at(path)?;
    }
    let file = w.into_inner().map_err(|e| e.into_error()).at(path)?;
    file.sync_all().at(path)
}
