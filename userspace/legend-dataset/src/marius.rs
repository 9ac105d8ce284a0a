//! Reading a directory preprocessed by Marius (`marius_preprocess`).
//!
//! Layout: `dataset.yaml` (flat `key: value` lines, among them `num_nodes`, `num_relations`,
//! `num_train`, `num_valid`, `num_test`) and `edges/{train,validation,test}_edges.bin`, raw
//! little-endian int32 rows `[src, rel, dst]` or `[src, dst]`. Marius ids are already dense; they
//! become the entity labels, so `entities.tsv` maps our ids back to Marius's.

use std::collections::HashMap;
use std::path::Path;

use crate::Edge;
use crate::error::{IoContext, Result, invalid};
use crate::meta::Split;
use crate::raw::{RawGraph, UNTYPED_RELATION};

fn split_file(split: Split) -> &'static str {
    match split {
        Split::Train => "train_edges.bin",
        Split::Valid => "validation_edges.bin",
        Split::Test => "test_edges.bin",
    }
}

fn count_key(split: Split) -> &'static str {
    match split {
        Split::Train => "num_train",
        Split::Valid => "num_valid",
        Split::Test => "num_test",
    }
}

/// Parses the flat `key: value` lines of `dataset.yaml` that carry integers.
fn read_yaml(path: &Path) -> Result<HashMap<String, u64>> {
    let text = std::fs::read_to_string(path).at(path)?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let (k, v) = line.split_once(':')?;
            let v = v.trim().parse::<u64>().ok()?;
            Some((k.trim().to_owned(), v))
        })
        .collect())
}

pub(crate) fn read(dir: &Path) -> Result<RawGraph> {
    let yaml_path = dir.join("dataset.yaml");
    let yaml = read_yaml(&yaml_path)?;
    let nodes = *yaml
        .get("num_nodes")
        .ok_or_else(|| invalid(&yaml_path, "missing num_nodes"))?;
    let nodes = u32::try_from(nodes)
        .ok()
        .filter(|&n| n < u32::MAX)
        .ok_or_else(|| {
            invalid(
                &yaml_path,
                format!("num_nodes {nodes} exceeds the 32-bit id range"),
            )
        })?;
    let num_relations = yaml.get("num_relations").copied().unwrap_or(1).max(1);
    let mut splits: [Vec<Edge>; 3] = Default::default();
    let mut width_seen = None;
    for split in Split::ALL {
        let path = dir.join("edges").join(split_file(split));
        if !path.exists() {
            if split == Split::Train {
                return Err(invalid(
                    &path,
                    "missing: a Marius dataset needs train edges",
                ));
            }
            continue;
        }
        let bytes = std::fs::read(&path).at(&path)?;
        if bytes.is_empty() {
            if split == Split::Train {
                return Err(invalid(&path, "no edges: the file is empty"));
            }
            continue;
        }
        let width = row_width(
            &path,
            bytes.len(),
            yaml.get(count_key(split)).copied(),
            num_relations,
        )?;
        if let Some(w) = width_seen.filter(|&w| w != width) {
            return Err(invalid(
                &path,
                format!("rows of {width} columns, but other splits have {w}"),
            ));
        }
        width_seen = Some(width);
        let ids: Vec<i32> = bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let edges = &mut splits[split as usize];
        edges.reserve(ids.len() / width);
        for (row, r) in ids.chunks_exact(width).enumerate() {
            let (s, rel, d) = if width == 3 {
                (r[0], r[1], r[2])
            } else {
                (r[0], 0, r[1])
            };
            let bad = |what: &str, v: i32, limit: u64| {
                invalid(
                    &path,
                    format!("row {row}: {what} id {v} outside 0..{limit}"),
                )
            };
            let node = |v: i32| u32::try_from(v).ok().filter(|&v| v < nodes);
            let s = node(s).ok_or_else(|| bad("source", s, nodes.into()))?;
            let d = node(d).ok_or_else(|| bad("destination", d, nodes.into()))?;
            let rel = u32::try_from(rel)
                .ok()
                .filter(|&r| u64::from(r) < num_relations)
                .ok_or_else(|| bad("relation", rel, num_relations))?;
            edges.push([s, rel, d]);
        }
    }
    let has_relations = width_seen == Some(3);
    let relation_labels = if has_relations {
        (0..num_relations)
            .map(|r| r.to_string().into_bytes().into())
            .collect()
    } else {
        vec![UNTYPED_RELATION.as_bytes().into()]
    };
    Ok(RawGraph {
        entity_labels: (0..nodes)
            .map(|n| n.to_string().into_bytes().into())
            .collect(),
        relation_labels,
        has_relations,
        splits,
    })
}

/// Decides whether rows are `[src, rel, dst]` (3) or `[src, dst]` (2) int32 columns.
fn row_width(path: &Path, len: usize, count: Option<u64>, relations: u64) -> Result<usize> {
    if !len.is_multiple_of(4) {
        return Err(invalid(
            path,
            format!("size {len} is not a multiple of 4 bytes (int32 ids)"),
        ));
    }
    let ints = (len / 4) as u64;
    if let Some(count) = count.filter(|&c| c > 0) {
        return match ints / count {
            3 | 2 if ints.is_multiple_of(count) => Ok((ints / count) as usize),
            _ => Err(invalid(
                path,
                format!(
                    "{len} bytes do not hold {count} int32 rows of 2 or 3 columns (int64 or weighted edges are not supported)"
                ),
            )),
        };
    }
    match (ints.is_multiple_of(3), ints.is_multiple_of(2)) {
        (true, false) => Ok(3),
        (false, true) => Ok(2),
        (true, true) if relations > 1 => Ok(3),
        (true, true) => Ok(2),
        (false, false) => Err(invalid(
            path,
            format!("{len} bytes are neither 2- nor 3-column int32 rows"),
        )),
    }
}
