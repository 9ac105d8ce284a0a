//! A table's labels and the index that finds a label's id, built once and kept beside the run,
//! so that a query on a billion-edge run does not spend its time on 41.65 M labels (a map of
//! cloned labels took 25 s to build there; hashed, 3.5 s on 2 cores, every time).
//!
//! The labels are the dataset's file itself, `id<TAB>label` a line, with where every
//! [`BLOCK`]th label's line starts. The index is every label's 64-bit hash ([`label_hash`],
//! fixed for all builds) sorted with its id, ties by id: a lookup finds the hash's run by a
//! binary search and confirms the first id whose label is the name, so a repeated label answers
//! to its first id and a hash another label shares costs one more comparison.
//!
//! Kept as `RUN/index/<file>.index` for tables of at least [`KEPT_FROM_LABELS`] labels, keyed by
//! the label file's length and CRC-32 (read on every core each time: 0.8 GB for 41.65 M labels):
//! a label file changed since (rewritten, replaced, another dataset given) makes a new index,
//! and one whose own checksum fails (damaged) is rebuilt, never trusted. A process that may not
//! write the run (a daemon serving someone's run) uses a kept index and builds one in memory
//! otherwise.

use std::borrow::Cow;
use std::path::Path;

use legend_dataset::{Dataset, LabelTable, label_in_line};
use legend_engine::restore::crc32;
use legend_fs::{Access, Dir};
use rayon::prelude::*;

use crate::QueryError;

/// Labels between two recorded line starts.
const BLOCK: usize = 64;

/// Tables with fewer labels are indexed in memory each time (milliseconds), not kept.
pub(crate) const KEPT_FROM_LABELS: u64 = 1 << 16;

/// The run's folder of kept indexes.
pub(crate) const INDEX_DIR: &str = "index";

/// First word of an index file: `LGNDLBL1`.
const MAGIC: u64 = u64::from_le_bytes(*b"LGNDLBL1");

/// The index layout and [`label_hash`]'s version: an index of another is rebuilt.
const FORMAT: u64 = 1;

/// Words of the header: magic, format, labels, the label file's key (its length and CRC-32),
/// the index's checksum.
const HEADER_WORDS: usize = 6;

/// How a query process reads the files of a run and of its dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileAccess {
    /// Mapped in place, and an index kept in the run when it is missing or stale: a query
    /// command, a process of the run's owner who asked for it.
    MapAndKeep,
    /// Mapped in place where no one but this process's own user (or root) could change the
    /// file, read into memory otherwise; nothing written in the run: a daemon's serve job,
    /// which answers others than its user (its group), from a run its user could also be
    /// training on. A file its user rewrote under the mapping would change (or, truncated, end)
    /// only a process they control anyway; one that someone else may write could be changed
    /// after it was checked, so it is read, checked and kept as read.
    MapOwn,
    /// Read into memory, the run left as it is.
    Copy,
}

impl FileAccess {
    /// Whether `file` is mapped: `Ok`, or why it is read into memory instead.
    pub(crate) fn may_map(self, file: &std::fs::File) -> Result<(), String> {
        match self {
            FileAccess::MapAndKeep => Ok(()),
            FileAccess::Copy => Err("read as asked".into()),
            FileAccess::MapOwn => match legend_fs::writable_by_others(file) {
                Ok(None) => Ok(()),
                Ok(Some(who)) => Err(who),
                Err(e) => Err(format!("its owner and mode unknown ({e})")),
            },
        }
    }

    /// Whether a label index built now is kept in the run.
    fn keeps(self) -> bool {
        self == FileAccess::MapAndKeep
    }
}

/// Notes the file `path` as read into memory because of `why`, where a served run's files
/// could have been mapped (see [`FileAccess::MapOwn`]).
pub(crate) fn note_copied(copied: &mut Vec<String>, path: &Path, why: &str) {
    tracing::info!("{}: {why}: read into memory, not mapped", path.display());
    copied.push(format!("{}: {why}", path.display()));
}

/// Bytes held as a file's pages or as a copy (in whole words, for an index's sake; the
/// length says how many bytes of them).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u64>, usize),
    Empty,
}

impl Bytes {
    fn get(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(words, len) => &bytemuck::cast_slice(words)[..*len],
            Bytes::Empty => &[],
        }
    }

    /// An index's words.
    fn words(words: Vec<u64>) -> Bytes {
        let len = words.len() * 8;
        Bytes::Owned(words, len)
    }

    /// `file`'s `len` bytes, mapped or read (into whole words, the tail zeroed) as `access`
    /// allows; a file read though its layout would map is noted in `copied` (as `path`).
    fn of_file(
        file: &std::fs::File,
        len: u64,
        access: FileAccess,
        (path, copied): (&Path, &mut Vec<String>),
    ) -> std::io::Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::Empty);
        }
        match access.may_map(file) {
            // SAFETY: the mapping is read only, and checked when opened (the label file's CRC,
            // the index's checksum). A file changed under it later is read as it is then, and
            // truncated, ends this process only; `may_map` maps only files that this
            // process's own user (or root) may change, or whose user asked (see `FileAccess`).
            Ok(()) => Ok(Bytes::Mapped(unsafe { memmap2::Mmap::map(file) }?)),
            Err(why) => {
                use std::os::unix::fs::FileExt;
                if access != FileAccess::Copy {
                    note_copied(copied, path, &why);
                }
                let mut words = vec![0u64; (len as usize).div_ceil(8)];
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                file.read_exact_at(&mut bytes[..len as usize], 0)?;
                Ok(Bytes::Owned(words, len as usize))
            }
        }
    }
}

/// What identifies a label file's contents: its length and CRC-32. An index built from a file
/// with another key is stale.
fn text_key(text: &[u8]) -> [u64; 2] {
    [text.len() as u64, u64::from(crc32(text).finalize())]
}

/// The hash labels are indexed by: 64-bit FNV-1a of the label's bytes (as the label reads in
/// UTF-8, invalid bytes replaced), finished by a 64-bit mix so that the high bits vary. Fixed:
/// kept indexes are read by later builds.
pub(crate) fn label_hash(label: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in label.as_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Labels of one table, with the index that finds their ids.
pub(crate) struct Names {
    /// The label file.
    text: Bytes,
    /// The index: header, line starts, hashes, ids (see [`Names::build`]).
    index: Bytes,
    count: usize,
    /// The files read into memory though they could have been mapped, with why.
    copied: Vec<String>,
}

/// Where the sections of an index of `count` labels start, in words: line starts, hashes,
/// ids; and its length.
fn sections(count: usize) -> [usize; 4] {
    let starts = HEADER_WORDS;
    let hashes = starts + count.div_ceil(BLOCK) + 1;
    let ids = hashes + count;
    [starts, hashes, ids, ids + count.div_ceil(2)]
}

/// CRC-32 of an index's words, its checksum word counted as zero, on every core.
fn checksum(words: &[u64]) -> u32 {
    let (head, body) = words.split_at(HEADER_WORDS);
    let mut crc = crc32fast::Hasher::new();
    crc.update(bytemuck::cast_slice(&head[..HEADER_WORDS - 1]));
    crc.update(&[0; 8]);
    crc.combine(&crc32(bytemuck::cast_slice(body)));
    crc.finalize()
}

/// `bytes` as a label: borrowed when it is UTF-8.
fn lossy(bytes: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}

impl Names {
    /// The labels of `table` in `dataset`, and their index: kept in `run`'s [`INDEX_DIR`] when
    /// the table is large, reused while the label file is the one it was built from, else built
    /// (and kept, when `access` allows).
    pub(crate) fn open(
        dataset: &Dataset,
        table: LabelTable,
        run: &Dir,
        access: FileAccess,
    ) -> Result<Names, QueryError> {
        let (file, path) = dataset.open_labels(table)?;
        let io = |source| legend_dataset::DatasetError::Io {
            path: path.clone(),
            source,
        };
        let len = file.metadata().map_err(io)?.len();
        let mut copied = Vec::new();
        let text = Bytes::of_file(&file, len, access, (&path, &mut copied)).map_err(io)?;
        let key = text_key(text.get());
        let want = match table {
            LabelTable::Entities => dataset.meta().entities,
            LabelTable::Relations => dataset.meta().relations,
        };
        let name = format!("{}.index", table.file());
        let kept = Path::new(INDEX_DIR).join(&name);
        if want >= KEPT_FROM_LABELS
            && let Some(index) = Names::reuse(run, &kept, key, want as usize, (access, &mut copied))
        {
            return Ok(Names {
                text,
                index,
                count: want as usize,
                copied,
            });
        }
        let started = std::time::Instant::now();
        let words = Names::build(text.get(), key);
        let names = Names {
            count: words[2] as usize,
            text,
            index: Bytes::words(words),
            copied,
        };
        dataset.check_label_count(table, names.count as u64)?;
        if want >= KEPT_FROM_LABELS {
            tracing::info!(
                "{}: {} labels indexed in {:.2} s",
                path.display(),
                names.count,
                started.elapsed().as_secs_f64()
            );
            if access.keeps() {
                names.keep(run, &name);
            }
        }
        Ok(names)
    }

    /// The index kept at `kept` in `run`, when it is whole (its checksum) and built from the
    /// label file of `key` with `count` labels; `None` otherwise, saying why when it is there.
    /// Mapped or read as `access` allows (noted in `copied` when read though it could map).
    fn reuse(
        run: &Dir,
        kept: &Path,
        key: [u64; 2],
        count: usize,
        (access, copied): (FileAccess, &mut Vec<String>),
    ) -> Option<Bytes> {
        let path = run.join(kept);
        let again = |why: &dyn std::fmt::Display| -> Option<Bytes> {
            tracing::warn!("{}: {why}; indexing the labels again", path.display());
            None
        };
        // Noted as read into memory only once it is used.
        let mut noted = Vec::new();
        let file = match run.open_file(kept, Access::Read) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => return again(&e),
        };
        let index = match file
            .metadata()
            .and_then(|m| Bytes::of_file(&file, m.len(), access, (&path, &mut noted)))
        {
            Ok(index) => index,
            Err(e) => return again(&e),
        };
        let bytes = index.get();
        if bytes.len() % 8 != 0 || bytes.len() < HEADER_WORDS * 8 {
            return again(&format_args!("{} bytes, not an index", bytes.len()));
        }
        let words: &[u64] = bytemuck::cast_slice(bytes);
        if words[0] != MAGIC || words[1] != FORMAT {
            return again(&"not an index of this format");
        }
        if words[3..5] != key || words[2] != count as u64 {
            tracing::info!(
                "{}: built from another label file; indexing the labels again",
                path.display()
            );
            return None;
        }
        if words.len() != sections(count)[3] || u64::from(checksum(words)) != words[5] {
            return again(&"checksum mismatch (the index is damaged)");
        }
        copied.append(&mut noted);
        Some(index)
    }

    /// The index of the labels in `text` (the label file of `key`), as kept: the header, where
    /// every [`BLOCK`]th label's line starts (and the text's end), the labels' hashes in
    /// ascending order, and the id of each (ties in ascending ids).
    fn build(text: &[u8], key: [u64; 2]) -> Vec<u64> {
        let starts = line_starts(text);
        let count = starts.len();
        let mut keyed: Vec<(u64, u32)> = starts
            .par_iter()
            .enumerate()
            .map(|(id, &at)| {
                let label = lossy(label_in_line(line_at(text, at as usize)));
                (label_hash(&label), id as u32)
            })
            .collect();
        keyed.par_sort_unstable();
        let [at_starts, at_hashes, at_ids, end] = sections(count);
        let mut words = vec![0u64; end];
        words[..3].copy_from_slice(&[MAGIC, FORMAT, count as u64]);
        words[3..5].copy_from_slice(&key);
        let (head, rest) = words.split_at_mut(at_hashes);
        for (word, &at) in head[at_starts..]
            .iter_mut()
            .zip(starts.iter().step_by(BLOCK))
        {
            *word = at;
        }
        head[at_hashes - 1] = text.len() as u64;
        let (hashes, ids) = rest.split_at_mut(at_ids - at_hashes);
        hashes
            .par_iter_mut()
            .zip(&keyed)
            .for_each(|(h, &(hash, _))| *h = hash);
        let ids: &mut [u32] = bytemuck::cast_slice_mut(ids);
        ids.par_iter_mut()
            .zip(&keyed)
            .for_each(|(slot, &(_, id))| *slot = id);
        words[HEADER_WORDS - 1] = u64::from(checksum(&words));
        words
    }

    /// Writes the index into `run`'s [`INDEX_DIR`] as `name` (a failure is logged: the next
    /// query builds it again).
    fn keep(&self, run: &Dir, name: &str) {
        let path = run.join(INDEX_DIR).join(name);
        let kept = run
            .create_dir_all(INDEX_DIR)
            .and_then(|dir| dir.write_atomically(name, self.index.get()));
        match kept {
            Ok(()) => tracing::info!("{}: the label index kept for later queries", path.display()),
            Err(e) => tracing::warn!(
                "{}: {e}; the label index is not kept (the next query builds it again)",
                path.display()
            ),
        }
    }

    fn words(&self) -> &[u64] {
        bytemuck::cast_slice(self.index.get())
    }

    /// The files read into memory though they could have been mapped (the label file, the
    /// kept index), each with why.
    pub(crate) fn copied(&self) -> &[String] {
        &self.copied
    }

    /// Labels.
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// Where id `id`'s line starts in the label file.
    fn line_start(&self, id: u32) -> usize {
        debug_assert!((id as usize) < self.count, "label {id} of {}", self.count);
        let [at_starts, ..] = sections(self.count);
        let text = self.text.get();
        let mut at = self.words()[at_starts + id as usize / BLOCK] as usize;
        for _ in 0..id as usize % BLOCK {
            at += line_at(text, at).len() + 1;
            // Empty lines hold no label.
            while text.get(at) == Some(&b'\n') {
                at += 1;
            }
        }
        at
    }

    /// Label `id` (below [`Names::len`]).
    pub(crate) fn label(&self, id: u32) -> Cow<'_, str> {
        lossy(label_in_line(line_at(self.text.get(), self.line_start(id))))
    }

    /// Bytes of the longest label, as it reads (invalid UTF-8 replaced), found on every core.
    pub(crate) fn longest(&self) -> usize {
        self.text
            .get()
            .par_split(|&b| b == b'\n')
            .map(|line| lossy(label_in_line(line)).len())
            .max()
            .unwrap_or(0)
    }

    /// The first id labelled `name`.
    pub(crate) fn id(&self, name: &str) -> Option<u32> {
        let [_, at_hashes, at_ids, end] = sections(self.count);
        let words = self.words();
        let hashes = &words[at_hashes..at_ids];
        let ids = &bytemuck::cast_slice::<u64, u32>(&words[at_ids..end])[..self.count];
        let h = label_hash(name);
        let first = hashes.partition_point(|&x| x < h);
        hashes[first..]
            .iter()
            .zip(&ids[first..])
            .take_while(|&(&x, _)| x == h)
            .map(|(_, &id)| id)
            .find(|&id| self.label(id) == name)
    }
}

/// The line of `text` that starts at `at`, without its newline.
fn line_at(text: &[u8], at: usize) -> &[u8] {
    let rest = &text[at..];
    &rest[..rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len())]
}

/// Where each non-empty line of `text` starts, found on every core.
fn line_starts(text: &[u8]) -> Vec<u64> {
    const PIECE: usize = 8 << 20;
    // Pieces end after a newline (or at the end), so that no line spans two.
    let mut cuts = vec![0];
    while let Some(&last) = cuts.last().filter(|&&c| c < text.len()) {
        let mut cut = (last + PIECE).min(text.len());
        cut += text[cut..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(text.len() - cut, |i| i + 1);
        cuts.push(cut);
    }
    cuts.par_windows(2)
        .map(|w| {
            let mut starts = Vec::new();
            let mut at = w[0];
            while at < w[1] {
                let len = line_at(&text[..w[1]], at).len();
                if len > 0 {
                    starts.push(at as u64);
                }
                at += len + 1;
            }
            starts
        })
        .collect::<Vec<_>>()
        .concat()
}

/// Labels [`Names::near`] names at most.
const NEAR_LABELS: usize = 3;

/// Tables of at most this many labels are searched for misspellings too (an edit distance
/// per label: about 0.1 s for a million on a busy core); larger ones for case only.
const SPELLING_SEARCH_LABELS: usize = 1 << 20;

impl Names {
    /// Labels close to `name`, which names none, for the hint of an unknown-label error: those
    /// equal to it but for case, else (on tables of at most [`SPELLING_SEARCH_LABELS`]) those
    /// one or two edits away; at most [`NEAR_LABELS`], the closest first. It reads every
    /// label in order (an error's path: a second or so for tens of millions).
    pub(crate) fn near(&self, name: &str) -> Vec<String> {
        let lower = name.to_lowercase();
        // Label ids count the non-empty lines, as the index does.
        let labels = || {
            self.text
                .get()
                .split(|&b| b == b'\n')
                .filter(|line| !line.is_empty())
                .map(|line| lossy(label_in_line(line)))
                .enumerate()
        };
        let mut found: Vec<(usize, u32)> = labels()
            .filter(|(_, l)| l.len() == name.len() && l.to_lowercase() == lower)
            .map(|(id, _)| (0, id as u32))
            .collect();
        if found.is_empty() && self.count <= SPELLING_SEARCH_LABELS {
            let wanted: Vec<char> = lower.chars().collect();
            // Two edits at most, and fewer than a third of the name's characters: a short
            // name is not "near" every other short label.
            let most = 2.min(wanted.len().saturating_sub(1) / 3);
            found = labels()
                .filter_map(|(id, l)| {
                    let d = edit_distance(&wanted, &l.to_lowercase(), most)?;
                    Some((d, id as u32))
                })
                .collect();
        }
        found.sort_unstable();
        let mut near: Vec<String> = Vec::new();
        for (_, id) in found {
            let label = self.label(id).into_owned();
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

    /// Labels indexed in memory from the text of a label file.
    fn of_text(text: &str) -> Names {
        let words = Names::build(text.as_bytes(), [0; 2]);
        let mut owned = vec![0u64; text.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut owned)[..text.len()]
            .copy_from_slice(text.as_bytes());
        Names {
            count: words[2] as usize,
            text: Bytes::Owned(owned, text.len()),
            index: Bytes::words(words),
            copied: Vec::new(),
        }
    }

    fn file(labels: &[&str]) -> String {
        labels
            .iter()
            .enumerate()
            .map(|(i, l)| format!("{i}\t{l}\n"))
            .collect()
    }

    #[test]
    fn finds_the_first_id_of_each_label_and_each_ids_label() {
        let all = ["a", "b", "a", "c", "b", "", "é"];
        let names = of_text(&file(&all));
        assert_eq!(names.len(), all.len());
        for (label, first) in [("a", 0), ("b", 1), ("c", 3), ("", 5), ("é", 6)] {
            assert_eq!(names.id(label), Some(first), "{label:?}");
        }
        assert_eq!(names.id("d"), None);
        for (id, label) in all.iter().enumerate() {
            assert_eq!(names.label(id as u32), *label);
        }
    }

    #[test]
    fn lines_read_as_the_dataset_reads_them() {
        // Empty lines hold no label; a line without a tab has an empty one; a CR stays; bytes
        // that are not UTF-8 read replaced, and the label answers to its replaced form.
        let text = b"\n0\tx\n\n\n1\ty\r\nz\n3\t\xff\xfeq\n4\tlast";
        let words = Names::build(text, [0; 2]);
        let mut owned = vec![0u64; text.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut owned)[..text.len()].copy_from_slice(text);
        let names = Names {
            count: words[2] as usize,
            text: Bytes::Owned(owned, text.len()),
            index: Bytes::words(words),
            copied: Vec::new(),
        };
        let labels: Vec<String> = (0..names.len() as u32)
            .map(|id| names.label(id).into_owned())
            .collect();
        assert_eq!(labels, ["x", "y\r", "", "\u{fffd}\u{fffd}q", "last"]);
        for (id, label) in labels.iter().enumerate() {
            assert_eq!(names.id(label), Some(id as u32), "{label:?}");
        }
        assert_eq!(names.longest(), "\u{fffd}\u{fffd}q".len());
        assert_eq!(of_text("").len(), 0);
        assert_eq!(of_text("").longest(), 0);
        assert_eq!(of_text("").id("x"), None);
    }

    #[test]
    fn agrees_with_a_map_of_every_label_across_blocks_and_pieces() {
        // 200 000 labels, a third of them repeats, against the map they replace.
        let all: Vec<String> = (0..200_000u32)
            .map(|i| format!("e{}", if i % 3 == 0 { i / 7 } else { i }))
            .collect();
        let mut want = std::collections::HashMap::new();
        for (id, label) in all.iter().enumerate().rev() {
            want.insert(label.clone(), id as u32);
        }
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        let names = of_text(&file(&refs));
        for (label, &id) in &want {
            assert_eq!(names.id(label), Some(id), "{label}");
        }
        for (id, label) in all.iter().enumerate().step_by(997) {
            assert_eq!(names.label(id as u32), *label);
        }
        assert_eq!(names.id("e200000"), None);
    }

    #[test]
    fn the_hash_is_the_one_kept_indexes_were_built_with() {
        // Kept indexes outlive builds: a change here must come with a new FORMAT.
        // 64-bit FNV-1a, then MurmurHash3's 64-bit finalizer (computed apart from this code).
        assert_eq!(label_hash(""), 0xefd0_1f60_ba99_2926);
        assert_eq!(label_hash("/m/02mjmr"), 0x48d9_6d7d_b730_be4a);
    }

    #[test]
    fn near_labels_differ_in_case_or_spelling() {
        let names = of_text(&file(&[
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
