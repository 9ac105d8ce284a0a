//! `legendctl import --extend BASE --add DELTA`: a day's new edges added to a dataset as a new
//! dataset directory, with append-only ids.
//!
//! Every entity and relation of the base keeps its id; labels the delta introduces get the ids
//! after the base's, in order of first appearance (so that a run trained on the base carries
//! its rows over as a prefix of the new tables, not as a gather). The delta's labels are
//! matched against the base's label files, which are checked (ids `0..n` in order, each label
//! once). Each split's edge file is the base's, unchanged, followed by the delta's edges, and
//! `dataset.toml` records the base's counts ([`Extension`]): the edges after them are the new
//! ones. The base directory is only read.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, LabelTable, label_in_line};
use crate::error::{DatasetError, IoContext, Result, invalid};
use crate::import::{
    ImportOptions, ImportSummary, Interner, check_cancel, read_text, write_labels_after,
};
use crate::meta::{DatasetMeta, FORMAT_VERSION, Split, SplitCounts};
use crate::staging::{Staging, check_new_output};
use crate::text::Columns;
use crate::{EDGES_DIR, Edge, edge_file};

/// What a dataset extended from another (`legendctl import --extend`) records of its base:
/// the ids below `entities` / `relations` are the base's, and in each split the edges after
/// the base's count are the added ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Extension {
    /// The base dataset directory, as given.
    pub base: String,
    /// The base's identity (32 hex digits, [`DatasetMeta::identity`]): a run trained on it can
    /// seed a run on this dataset (`legendctl train --init-from`).
    pub base_identity: String,
    /// The base's entities: ids `0..entities` are its own.
    pub entities: u64,
    /// The base's relation types.
    pub relations: u64,
    /// The base's edges per split: each split's first edges.
    pub splits: SplitCounts,
}

/// The delta's text files (train, then valid and test when given).
pub(crate) struct Delta<'a> {
    pub train: &'a PathBuf,
    pub valid: Option<&'a PathBuf>,
    pub test: Option<&'a PathBuf>,
}

/// Writes `out`: the dataset in `base` with the edges of `delta` added (see the module).
pub(crate) fn extend(
    options: &ImportOptions,
    base: &Path,
    delta: Delta<'_>,
    out: &Path,
) -> Result<ImportSummary> {
    let started = Instant::now();
    check_new_output(out)?;
    let base_set = Dataset::open(base)?;
    let base_meta = base_set.meta().clone();
    let typed = options.columns != Columns::Sd;
    if typed != base_meta.has_relations {
        return Err(DatasetError::Options(format!(
            "--columns {}: the base {} {} relation types; the delta must be read as it was",
            options.columns.name(),
            base.display(),
            if base_meta.has_relations {
                "has"
            } else {
                "has no"
            }
        )));
    }
    let (entity_file, entity_labels) = base_labels(&base_set, LabelTable::Entities)?;
    let (relation_file, relation_labels) = base_labels(&base_set, LabelTable::Relations)?;
    let interners = (
        seeded(&base_set, LabelTable::Entities, entity_labels)?,
        seeded(&base_set, LabelTable::Relations, relation_labels)?,
    );
    let inputs: Vec<(Split, &PathBuf)> = [
        (Split::Train, Some(delta.train)),
        (Split::Valid, delta.valid),
        (Split::Test, delta.test),
    ]
    .into_iter()
    .filter_map(|(s, p)| p.map(|p| (s, p)))
    .collect();
    let (raw, skipped_headers) = read_text(options, &inputs, interners)?;
    check_cancel(options)?;
    let old_entities = base_meta.entities as usize;
    let old_relations = base_meta.relations as usize;
    let mut added = Added::new(raw.splits, old_entities, old_relations, options.keep_unseen);
    let new_entities = added.compact(
        raw.entity_labels.into_iter().skip(old_entities),
        old_entities,
    );
    let new_relations = added.compact_relations(
        raw.relation_labels.into_iter().skip(old_relations),
        old_relations,
    );
    if added.dropped > 0 {
        tracing::warn!(
            dropped = added.dropped,
            "added valid/test edges dropped: an entity or relation occurs neither in the base nor in the added train edges (use --keep-unseen to keep them)"
        );
    }

    let staging = Staging::new(out, "extending")?;
    let dir = staging.dir();
    let edges_dir = dir.join(EDGES_DIR);
    std::fs::create_dir(&edges_dir).at(&edges_dir)?;
    let mut splits = SplitCounts::default();
    let mut checksums = SplitCounts::default();
    for split in Split::ALL {
        let edges = &added.splits[split as usize];
        *checksums.get_mut(split) = u64::from(append_edges(&base_set, split, edges, dir)?);
        *splits.get_mut(split) = base_meta.splits.get(split) + edges.len() as u64;
        check_cancel(options)?;
    }
    write_labels_after(
        &dir.join(LabelTable::Entities.file()),
        &entity_file,
        old_entities,
        &new_entities,
    )?;
    write_labels_after(
        &dir.join(LabelTable::Relations.file()),
        &relation_file,
        old_relations,
        &new_relations,
    )?;
    let mut sources = base_meta.sources.clone();
    sources.extend(inputs.iter().map(|(_, p)| p.display().to_string()));
    let meta = DatasetMeta {
        format_version: FORMAT_VERSION,
        entities: (old_entities + new_entities.len()) as u64,
        relations: (old_relations + new_relations.len()) as u64,
        has_relations: base_meta.has_relations,
        id_width: 4,
        splits,
        checksums,
        seed: base_meta.seed,
        sources,
        unseen_dropped: base_meta.unseen_dropped + added.dropped,
        unseen_kept: base_meta.unseen_kept + added.kept,
        extends: Some(Extension {
            base: base.display().to_string(),
            base_identity: format!("{:032x}", base_meta.identity()),
            entities: base_meta.entities,
            relations: base_meta.relations,
            splits: base_meta.splits,
        }),
    };
    meta.write(dir)?;
    check_cancel(options)?;
    staging.publish()?;
    Ok(ImportSummary::of(out, meta, skipped_headers, started))
}

/// A label file's bytes and its labels by id.
type LabelFile = (Vec<u8>, Vec<Box<[u8]>>);

/// The bytes of the base's label file of `table` and its labels by id, checked: each line
/// `id<TAB>label` with the ids `0, 1, …` in order, as many as `dataset.toml` counts.
fn base_labels(base: &Dataset, table: LabelTable) -> Result<LabelFile> {
    let (mut file, path) = base.open_labels(table)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).at(&path)?;
    if !bytes.is_empty() && !bytes.ends_with(b"\n") {
        bytes.push(b'\n');
    }
    let mut labels = Vec::new();
    for (line_no, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        let id = line.split(|&b| b == b'\t').next().unwrap_or_default();
        if id != labels.len().to_string().as_bytes() {
            return Err(invalid(
                &path,
                format!(
                    "line {} holds id {:?} where id {} was expected: the labels cannot be matched to the base's ids",
                    line_no + 1,
                    String::from_utf8_lossy(id),
                    labels.len()
                ),
            ));
        }
        labels.push(Box::from(label_in_line(line)));
    }
    base.check_label_count(table, labels.len() as u64)?;
    Ok((bytes, labels))
}

/// An interner holding the base's labels of `table` at their ids; a label given twice there is
/// refused (the delta's use of it could not be matched to one id).
fn seeded(base: &Dataset, table: LabelTable, labels: Vec<Box<[u8]>>) -> Result<Interner> {
    Interner::seeded(labels).map_err(|(first, second, label)| {
        invalid(
            base.dir().join(table.file()),
            format!(
                "label {:?} has two ids, {first} and {second}: the added edges' labels cannot be matched to one id",
                String::from_utf8_lossy(&label)
            ),
        )
    })
}

/// The delta's edges with their final ids: the base's ids kept, new ids compacted after them.
struct Added {
    splits: [Vec<Edge>; 3],
    /// Whether each provisional entity (relation) id is used by an edge that is kept.
    entity_used: Vec<bool>,
    relation_used: Vec<bool>,
    dropped: u64,
    kept: u64,
}

impl Added {
    /// Keeps the added valid/test edges whose entities and relations are the base's or occur
    /// in the added train edges (or every one, `keep_unseen`).
    fn new(
        mut splits: [Vec<Edge>; 3],
        old_entities: usize,
        old_relations: usize,
        keep_unseen: bool,
    ) -> Added {
        let max_entity = splits
            .iter()
            .flatten()
            .map(|e| e[0].max(e[2]) as usize + 1)
            .max()
            .unwrap_or(0)
            .max(old_entities);
        let max_relation = splits
            .iter()
            .flatten()
            .map(|e| e[1] as usize + 1)
            .max()
            .unwrap_or(0)
            .max(old_relations);
        let mut entity_seen = vec![false; max_entity];
        let mut relation_seen = vec![false; max_relation];
        entity_seen[..old_entities].fill(true);
        relation_seen[..old_relations].fill(true);
        for &[s, r, d] in &splits[Split::Train as usize] {
            entity_seen[s as usize] = true;
            entity_seen[d as usize] = true;
            relation_seen[r as usize] = true;
        }
        let mut entity_used = entity_seen.clone();
        let mut relation_used = relation_seen.clone();
        let (mut dropped, mut kept) = (0, 0);
        for split in [Split::Valid, Split::Test] {
            splits[split as usize].retain(|&[s, r, d]| {
                if entity_seen[s as usize] && entity_seen[d as usize] && relation_seen[r as usize] {
                    return true;
                }
                if !keep_unseen {
                    dropped += 1;
                    return false;
                }
                kept += 1;
                entity_used[s as usize] = true;
                entity_used[d as usize] = true;
                relation_used[r as usize] = true;
                true
            });
        }
        Added {
            splits,
            entity_used,
            relation_used,
            dropped,
            kept,
        }
    }

    /// Renumbers the new entities that kept edges use to follow the base's `old` ids in order
    /// of first appearance; returns their labels (`labels`: every new label, from id `old`).
    fn compact(&mut self, labels: impl Iterator<Item = Box<[u8]>>, old: usize) -> Vec<Box<[u8]>> {
        let (map, kept) = renumber(&self.entity_used, labels, old);
        for e in self.splits.iter_mut().flatten() {
            e[0] = map[e[0] as usize];
            e[2] = map[e[2] as usize];
        }
        kept
    }

    /// [`Added::compact`] for relations.
    fn compact_relations(
        &mut self,
        labels: impl Iterator<Item = Box<[u8]>>,
        old: usize,
    ) -> Vec<Box<[u8]>> {
        let (map, kept) = renumber(&self.relation_used, labels, old);
        for e in self.splits.iter_mut().flatten() {
            e[1] = map[e[1] as usize];
        }
        kept
    }
}

/// The id map keeping ids below `old` and numbering the used ones above it consecutively, and
/// the labels of those.
fn renumber(
    used: &[bool],
    labels: impl Iterator<Item = Box<[u8]>>,
    old: usize,
) -> (Vec<u32>, Vec<Box<[u8]>>) {
    let mut map: Vec<u32> = (0..old as u32).collect();
    let mut kept = Vec::new();
    for (i, label) in labels.enumerate() {
        if used.get(old + i).copied().unwrap_or(false) {
            map.push((old + kept.len()) as u32);
            kept.push(label);
        } else {
            map.push(u32::MAX);
        }
    }
    (map, kept)
}

/// Writes `split`'s edge file into `dir`: the base's file, copied as it is, then `added`;
/// returns its CRC-32. The base's part is checked against the base's recorded checksum.
fn append_edges(base: &Dataset, split: Split, added: &[Edge], dir: &Path) -> Result<u32> {
    let from = edge_file(base.dir(), split);
    let to = edge_file(dir, split);
    let want = base.meta().splits.get(split) * std::mem::size_of::<Edge>() as u64;
    let mut input = File::open(&from).at(&from)?;
    let have = input.metadata().at(&from)?.len();
    if have != want {
        return Err(invalid(
            &from,
            format!("holds {have} bytes, the base's dataset.toml says {want}"),
        ));
    }
    let mut out = BufWriter::with_capacity(1 << 20, File::create(&to).at(&to)?);
    let mut crc = crc32fast::Hasher::new();
    let mut block = vec![0u8; 16 << 20];
    loop {
        let n = input.read(&mut block).at(&from)?;
        if n == 0 {
            break;
        }
        crc.update(&block[..n]);
        out.write_all(&block[..n]).at(&to)?;
    }
    if u64::from(crc.clone().finalize()) != base.meta().checksums.get(split) {
        return Err(invalid(
            &from,
            "its checksum is not the one the base's dataset.toml records: the base changed since it was imported",
        ));
    }
    let bytes: &[u8] = bytemuck::cast_slice(added);
    crc.update(bytes);
    out.write_all(bytes).at(&to)?;
    let file = out.into_inner().map_err(|e| e.into_error()).at(&to)?;
    file.sync_all().at(&to)?;
    Ok(crc.finalize())
}
