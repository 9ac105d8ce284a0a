//! A table's labels and the index that finds a label's id. The index keeps each label's 64-bit
//! hash, not a copy of the label: a map of cloned strings took 25 s and 1.3 GB more to build for
//! the 41.65 M labels of a Twitter-sized run, most of the time a query command spent loading.
//! A hash only says where to look: a hit is confirmed against the label itself, and the rare
//! labels whose hash another label already holds keep their own entry.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

use rayon::prelude::*;

/// Labels of one table, with their ids.
pub(crate) struct Names {
    /// The labels by id.
    pub(crate) labels: Vec<String>,
    /// The index in [`SHARDS`] parts by the hash's top bits, built in parallel.
    shards: Vec<Shard>,
    hash: fn(&str) -> u64,
}

/// The index's parts: 64, so that every core has several to build.
const SHARDS: usize = 64;

/// The shard of a label's hash.
fn shard_of(hash: u64) -> usize {
    (hash >> (64 - SHARDS.trailing_zeros())) as usize
}

/// One part of the index.
#[derive(Default)]
struct Shard {
    /// A label's hash → the first id with that label (or with another of the same hash).
    by_hash: HashMap<u64, u32>,
    /// The labels whose hash `by_hash` gives to a different label: the first id of each.
    collided: HashMap<String, u32>,
}

/// SipHash with fixed keys: the same hash in every process.
fn label_hash(label: &str) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(label)
}

impl Names {
    /// The index of `labels`; the first of repeated labels keeps the name, the others answer
    /// to their ids only.
    pub(crate) fn new(labels: Vec<String>) -> Names {
        Names::with_hash(labels, label_hash)
    }

    fn with_hash(labels: Vec<String>, hash: fn(&str) -> u64) -> Names {
        let hashes: Vec<u64> = labels.par_iter().map(|l| hash(l)).collect();
        let mut members = vec![Vec::new(); SHARDS];
        for (id, &h) in hashes.iter().enumerate() {
            members[shard_of(h)].push(id as u32);
        }
        let shards = members
            .into_par_iter()
            .map(|ids| {
                let mut shard = Shard {
                    by_hash: HashMap::with_capacity(ids.len()),
                    collided: HashMap::new(),
                };
                // From the last id down, so that the first id of a label is the one kept.
                for &id in ids.iter().rev() {
                    let label = &labels[id as usize];
                    match shard.by_hash.entry(hashes[id as usize]) {
                        Entry::Vacant(slot) => {
                            slot.insert(id);
                        }
                        Entry::Occupied(mut slot) if labels[*slot.get() as usize] == *label => {
                            slot.insert(id);
                        }
                        // Another label has this hash: it keeps the slot, this one goes aside.
                        Entry::Occupied(_) => {
                            shard.collided.insert(label.clone(), id);
                        }
                    }
                }
                shard
            })
            .collect();
        Names {
            labels,
            shards,
            hash,
        }
    }

    /// The first id labelled `name`.
    pub(crate) fn id(&self, name: &str) -> Option<u32> {
        let h = (self.hash)(name);
        let shard = &self.shards[shard_of(h)];
        match shard.by_hash.get(&h) {
            Some(&id) if self.labels[id as usize] == name => Some(id),
            Some(_) => shard.collided.get(name).copied(),
            None => None,
        }
    }
}

/// Labels [`Names::near`] names at most.
const NEAR_LABELS: usize = 3;

/// Tables of at most this many labels are searched for misspellings too (an edit distance
/// per label: about 0.1 s for a million on a busy core); larger ones for case only.
const SPELLING_SEARCH_LABELS: usize = 1 << 20;

impl Names {
    /// Labels close to `name`, which names none, for the hint of an unknown-label error: those
    /// equal to it but for case, else (on tables of at most [`SPELLING_SEARCH_LABELS`]) those
    /// one or two edits away; at most [`NEAR_LABELS`], the closest first.
    pub(crate) fn near(&self, name: &str) -> Vec<&str> {
        let lower = name.to_lowercase();
        let mut found: Vec<(usize, u32)> = self
            .labels
            .par_iter()
            .enumerate()
            .filter(|(_, l)| l.len() == name.len() && l.to_lowercase() == lower)
            .map(|(id, _)| (0, id as u32))
            .collect();
        if found.is_empty() && self.labels.len() <= SPELLING_SEARCH_LABELS {
            let wanted: Vec<char> = lower.chars().collect();
            // Two edits at most, and fewer than a third of the name's characters: a short
            // name is not "near" every other short label.
            let most = 2.min(wanted.len().saturating_sub(1) / 3);
            found = self
                .labels
                .par_iter()
                .enumerate()
                .filter_map(|(id, l)| {
                    let d = edit_distance(&wanted, &l.to_lowercase(), most)?;
                    Some((d, id as u32))
                })
                .collect();
        }
        found.sort_unstable();
        let mut near: Vec<&str> = Vec::new();
        for (_, id) in found {
            let label = self.labels[id as usize].as_str();
            if label != name && !near.contains(&label) {
                near.push(label);
            }
            if near.len() == NEAR_LABELS {
                break;
            }
        }
        near
    }
}

/// The edit distance (insertions, deletions, substitutions of characters) from `a` to `b` when
/// it is at most `most`, else `None` (computed only that far).
fn edit_distance(a: &[char], b: &str, most: usize) -> Option<usize> {
    let b: Vec<char> = b.chars().collect();
    if a.len().abs_diff(b.len()) > most {
        return None;
    }
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substituted = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substituted.min(row[j] + 1).min(diagonal + 1);
        }
        if row.iter().min().is_some_and(|&m| m > most) {
            return None;
        }
    }
    Some(row[b.len()]).filter(|&d| d <= most)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn finds_the_first_id_of_each_label() {
        let names = Names::new(labels(&["a", "b", "a", "c", "b"]));
        assert_eq!(names.id("a"), Some(0));
        assert_eq!(names.id("b"), Some(1));
        assert_eq!(names.id("c"), Some(3));
        assert_eq!(names.id("d"), None);
        assert_eq!(names.id(""), None);
    }

    #[test]
    fn labels_sharing_a_hash_are_told_apart() {
        // Every label hashes alike, the worst case: each still finds its first id.
        let all = labels(&["x", "y", "x", "z", "y", "w"]);
        let names = Names::with_hash(all.clone(), |_| 7);
        for (label, first) in [("x", 0), ("y", 1), ("z", 3), ("w", 5)] {
            assert_eq!(names.id(label), Some(first), "{label}");
        }
        assert_eq!(names.id("v"), None);
        // Two hashes, in two shards (the top bits) and colliding within each.
        let names = Names::with_hash(all, |l| u64::from(l.as_bytes()[0] % 2) << 63);
        for (label, first) in [("x", 0), ("y", 1), ("z", 3), ("w", 5)] {
            assert_eq!(names.id(label), Some(first), "{label}");
        }
    }

    #[test]
    fn agrees_with_a_map_of_every_label_over_all_shards() {
        // 200 000 labels, a third of them repeats, against the map they replace.
        let all: Vec<String> = (0..200_000u32)
            .map(|i| format!("e{}", if i % 3 == 0 { i / 7 } else { i }))
            .collect();
        let mut want = HashMap::new();
        for (id, label) in all.iter().enumerate().rev() {
            want.insert(label.clone(), id as u32);
        }
        let names = Names::new(all);
        for (label, &id) in &want {
            assert_eq!(names.id(label), Some(id), "{label}");
        }
        assert!(names.shards.iter().all(|s| !s.by_hash.is_empty()));
        assert_eq!(names.id("e200000"), None);
    }

    #[test]
    fn near_labels_differ_in_case_or_spelling() {
        let names = Names::new(labels(&[
            "alga",
            "bacterium",
            "Bacterium",
            "virus",
            "fungus",
        ]));
        assert_eq!(names.near("Alga"), ["alga"]);
        assert_eq!(names.near("BACTERIUM"), ["bacterium", "Bacterium"]);
        // No label in other case: the ones a few edits away.
        assert_eq!(names.near("bacterum"), ["bacterium", "Bacterium"]);
        assert_eq!(names.near("fungi"), Vec::<&str>::new());
        assert_eq!(names.near("funguss"), ["fungus"]);
        // Short names are near nothing but their case variants.
        assert_eq!(names.near("vir"), Vec::<&str>::new());
        assert_eq!(edit_distance(&['a', 'b'], "ba", 2), Some(2));
        assert_eq!(edit_distance(&['a', 'b', 'c'], "xyz", 2), None);
    }
}
