//! A committed checkpoint's tables read back (the memory backend's: the four files of
//! `RUN/checkpoints/epoch-N/`), front to back and a piece at a time, on every core; each file's
//! CRC-32 is built from its blocks' and checked once its last byte is read.
//!
//! A resumed run fills the engine's slots or its memory store straight from the checkpoint
//! ([`crate::Trainer::restore`]): reading the whole checkpoint into host memory first held a
//! second copy of the tables beside where they went. For the Twitter-shaped graph in GPU memory
//! that copy (embeddings and AdaGrad state, 31 GiB) made a resume peak at 48.2 GiB of host
//! memory against the training run's 33.4 GiB.

use std::fs::File;
use std::path::{Path, PathBuf};

use legend_fs::{Access, Dir};
use legend_model::Dtype;
use rayon::prelude::*;

use crate::run::{RunError, RunMeta, TABLE_FILES};
use crate::store::StoredEmbeddings;

/// Bytes each thread reads and checksums at a time: small enough that a piece of a few tens of
/// MiB keeps every core busy, large enough that a read is one long request.
const READ_BLOCK: usize = 4 << 20;

/// Stored bytes a 16-bit table is widened from at a time.
const WIDEN_BYTES: usize = 32 << 20;

/// One table file of a checkpoint, read front to back: its size checked when opened, its
/// checksum when [`TableReader::finish`]ed.
pub struct TableReader {
    file: File,
    path: PathBuf,
    /// The values' format in the file.
    dtype: Dtype,
    /// The file's length in bytes.
    len: u64,
    /// Bytes read so far.
    offset: u64,
    crc: crc32fast::Hasher,
    /// The checksum the run's record gives.
    want: u32,
}

impl TableReader {
    /// Opens table `index` of [`TABLE_FILES`] in `meta`'s checkpoint, its size checked against
    /// the rows and widths the record gives.
    pub fn open(run: &Dir, meta: &RunMeta, index: usize) -> Result<TableReader, RunError> {
        let rw = meta.relation_width();
        let (rows, width, dtype) = [
            (meta.entities, meta.dim, meta.entity_dtype),
            (meta.entities, meta.entity_shape().state, Dtype::F32),
            (meta.relations, rw, Dtype::F32),
            (meta.relations, rw, Dtype::F32),
        ][index];
        let c = &meta.checksums;
        let want = [c.entities, c.entities_state, c.relations, c.relations_state][index];
        let rel = Path::new(&meta.checkpoint).join(TABLE_FILES[index]);
        let path = run.join(&rel);
        let io = |source| RunError::Io {
            path: path.clone(),
            source,
        };
        let file = run.open_file(&rel, Access::Read).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let expected = rows * width as u64 * dtype.bytes() as u64;
        if len != expected {
            return Err(RunError::Invalid {
                path,
                message: format!(
                    "holds {len} bytes, expected {expected} ({rows} rows × {width} values of {dtype})"
                ),
            });
        }
        Ok(TableReader {
            file,
            path,
            dtype,
            len,
            offset: 0,
            crc: crc32fast::Hasher::new(),
            want,
        })
    }

    /// The values' format in the file.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Values not read yet.
    pub fn values_left(&self) -> usize {
        ((self.len - self.offset) / self.dtype.bytes() as u64) as usize
    }

    /// Tells the kernel that the file's `bytes` stored bytes after the next `skip` will be
    /// read soon: a reader that reads a cold file in pieces keeps the disk busy between them.
    pub fn will_read(&self, skip: u64, bytes: u64) {
        let from = self.offset.saturating_add(skip).min(self.len);
        legend_fs::will_read(&self.file, from, bytes.min(self.len - from));
    }

    /// Fills `bytes` with the file's next bytes as stored, reading and checksumming blocks of
    /// them on every core.
    pub fn read_stored(&mut self, bytes: &mut [u8]) -> Result<(), RunError> {
        use std::os::unix::fs::FileExt;
        let at = self.offset;
        assert!(
            at + bytes.len() as u64 <= self.len,
            "reading past the end of {}",
            self.path.display()
        );
        let file = &self.file;
        let sums = bytes
            .par_chunks_mut(READ_BLOCK)
            .enumerate()
            .map(|(i, piece)| {
                file.read_exact_at(piece, at + (i * READ_BLOCK) as u64)?;
                let mut h = crc32fast::Hasher::new();
                h.update(piece);
                Ok(h)
            })
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|source| RunError::Io {
                path: self.path.clone(),
                source,
            })?;
        for h in &sums {
            self.crc.combine(h);
        }
        self.offset += bytes.len() as u64;
        Ok(())
    }

    /// Fills `values` with the file's next values, widened to f32 (a 16-bit file through a
    /// bounded buffer).
    pub fn read(&mut self, values: &mut [f32]) -> Result<(), RunError> {
        if !self.dtype.is_narrow() {
            return self.read_stored(bytemuck::cast_slice_mut(values));
        }
        let bytes = self.dtype.bytes();
        let per = WIDEN_BYTES / bytes;
        let mut stored = vec![0u8; values.len().min(per) * bytes];
        for piece in values.chunks_mut(per) {
            let stored = &mut stored[..piece.len() * bytes];
            self.read_stored(stored)?;
            crate::store::at_rest::widen(self.dtype, stored, piece);
        }
        Ok(())
    }

    /// The whole file's values, widened to f32.
    pub fn read_all(mut self) -> Result<Vec<f32>, RunError> {
        let mut values = vec![0.0; self.values_left()];
        self.read(&mut values)?;
        self.finish()?;
        Ok(values)
    }

    /// The whole file of f32 values mapped into memory in place (the page cache's pages, no
    /// copy), to be checked ([`MappedTable::check`]) before it is trusted.
    pub fn map(self) -> Result<MappedTable, RunError> {
        assert!(
            self.offset == 0 && self.dtype == Dtype::F32,
            "{} mapped after a read, or holds {} values",
            self.path.display(),
            self.dtype
        );
        let map = if self.len == 0 {
            None
        } else {
            // SAFETY: a checkpoint's files are written once, into a directory that is synced
            // and then renamed into place, and never written again: a later checkpoint is a new
            // directory, and removing the old one keeps a mapping's pages. Nothing in Legend
            // truncates or rewrites them; someone who does makes reads of the mapping fault, as
            // with any mapped file.
            let map = unsafe { memmap2::Mmap::map(&self.file) };
            Some(map.map_err(|source| RunError::Io {
                path: self.path.clone(),
                source,
            })?)
        };
        Ok(MappedTable {
            map,
            path: self.path,
            want: self.want,
        })
    }

    /// Checks that every byte was read and that they have the record's checksum: what was read
    /// is to be trusted only after this returns.
    pub fn finish(self) -> Result<(), RunError> {
        assert_eq!(
            self.offset,
            self.len,
            "{} finished before its end",
            self.path.display()
        );
        if self.crc.finalize() != self.want {
            return Err(RunError::Invalid {
                path: self.path,
                message: "checksum mismatch: the checkpoint is damaged".into(),
            });
        }
        Ok(())
    }
}

/// A table file of f32 values of a checkpoint mapped into memory ([`TableReader::map`]): its
/// values are to be trusted once [`MappedTable::check`] said so.
pub struct MappedTable {
    map: Option<memmap2::Mmap>,
    path: PathBuf,
    /// The checksum the run's record gives.
    want: u32,
}

impl MappedTable {
    /// The values in place.
    pub fn values(&self) -> &[f32] {
        // A mapping starts on a page: aligned for f32.
        bytemuck::cast_slice(self.map.as_deref().unwrap_or_default())
    }

    /// Checks the values against the record's checksum, summed on every core.
    pub fn check(&self) -> Result<(), RunError> {
        if crc32(bytemuck::cast_slice(self.values())).finalize() != self.want {
            return Err(RunError::Invalid {
                path: self.path.clone(),
                message: "checksum mismatch: the checkpoint is damaged".into(),
            });
        }
        Ok(())
    }
}

/// `meta`'s entity embeddings in place, when its checkpoint holds them as queries read them:
/// the memory backend's `entities.bin` in f32, mapped, to be checked (the rows of a
/// billion-edge run are then the page cache's, read by whoever scans them, never copied), and
/// `may_map` allows the opened file (the caller's rule of whose files it maps); `None` for rows
/// in a store or in a 16-bit format, or a file `may_map` refused.
pub fn map_entities(
    run: &Dir,
    meta: &RunMeta,
    may_map: impl FnOnce(&File, &Path) -> bool,
) -> Result<Option<MappedTable>, RunError> {
    if !entities_map(meta) {
        return Ok(None);
    }
    let reader = TableReader::open(run, meta, 0)?;
    if !may_map(&reader.file, &reader.path) {
        return Ok(None);
    }
    reader.map().map(Some)
}

/// Whether [`map_entities`] maps `meta`'s entity embeddings.
pub fn entities_map(meta: &RunMeta) -> bool {
    entities_in_checkpoint(meta) && meta.entity_dtype == Dtype::F32
}

/// Whether `meta`'s entity embeddings are in its checkpoint's files (table 0 of
/// [`TABLE_FILES`], read by [`TableReader`]), not in a store.
pub fn entities_in_checkpoint(meta: &RunMeta) -> bool {
    meta.store.is_none() && !meta.checkpoint.is_empty()
}

/// The CRC-32 state of `bytes`, summed in blocks on every core and combined in order.
pub fn crc32(bytes: &[u8]) -> crc32fast::Hasher {
    let sums: Vec<crc32fast::Hasher> = bytes
        .par_chunks(READ_BLOCK)
        .map(|piece| {
            let mut h = crc32fast::Hasher::new();
            h.update(piece);
            h
        })
        .collect();
    let mut crc = crc32fast::Hasher::new();
    for h in &sums {
        crc.combine(h);
    }
    crc
}

/// A checkpoint's entity rows, embeddings and AdaGrad state, read front to back a run of rows
/// at a time (see [`crate::Trainer::restore`]).
pub struct CheckpointRows {
    emb: TableReader,
    state: TableReader,
}

impl CheckpointRows {
    /// Opens the entity tables of `meta`'s checkpoint in `run`, their sizes checked.
    pub fn open(run: &Dir, meta: &RunMeta) -> Result<CheckpointRows, RunError> {
        Ok(CheckpointRows {
            emb: TableReader::open(run, meta, 0)?,
            state: TableReader::open(run, meta, 1)?,
        })
    }

    /// Fills `emb` and `state` with the next rows' embeddings (widened to f32) and state: the
    /// same rows of each.
    pub fn read(&mut self, emb: &mut [f32], state: &mut [f32]) -> Result<(), RunError> {
        self.emb.read(emb)?;
        self.state.read(state)
    }

    /// The next `emb_values` embedding values and `state_values` state values as a memory store
    /// of `dtype` keeps them: a 16-bit file's values as its bits, never widened.
    pub(crate) fn read_at_rest(
        &mut self,
        dtype: Dtype,
        emb_values: usize,
        state_values: usize,
    ) -> Result<(StoredEmbeddings, Vec<f32>), RunError> {
        let emb = if dtype.is_narrow() && dtype == self.emb.dtype() {
            let mut bits = vec![0u16; emb_values];
            self.emb.read_stored(bytemuck::cast_slice_mut(&mut bits))?;
            StoredEmbeddings::Bits16(bits)
        } else if dtype == self.emb.dtype() {
            let mut values = vec![0.0; emb_values];
            self.emb.read(&mut values)?;
            StoredEmbeddings::F32(values)
        } else {
            // The session refuses a resume whose storage.dtype differs from the run's.
            return Err(RunError::Invalid {
                path: self.emb.path.clone(),
                message: format!("holds {} values, the store keeps {dtype}", self.emb.dtype()),
            });
        };
        let mut state = vec![0.0; state_values];
        self.state.read(&mut state)?;
        Ok((emb, state))
    }

    /// Reads every partition of `scheme` in order as a memory store of `shape` keeps it (see
    /// [`CheckpointRows::read_at_rest`]), handing each to `keep`.
    pub(crate) fn partitions_at_rest<E: From<RunError>>(
        &mut self,
        scheme: legend_dataset::PartitionScheme,
        shape: crate::rows::RowShape,
        mut keep: impl FnMut(u32, StoredEmbeddings, Vec<f32>) -> Result<(), E>,
    ) -> Result<(), E> {
        for p in 0..scheme.num_partitions {
            let range = scheme.range(p);
            let rows = (range.end - range.start) as usize;
            let (emb, state) =
                self.read_at_rest(shape.dtype, rows * shape.dim, rows * shape.state)?;
            keep(p, emb, state)?;
        }
        Ok(())
    }

    /// Checks both tables' checksums once every row was read.
    pub fn finish(self) -> Result<(), RunError> {
        self.emb.finish()?;
        self.state.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::TableChecksums;

    /// A record for one checkpoint of `entities` rows of `dim` in `dtype`, no relations.
    fn meta(entities: u64, dim: usize, dtype: Dtype, checksums: TableChecksums) -> RunMeta {
        RunMeta {
            format_version: crate::run::RUN_FORMAT_VERSION,
            dataset: PathBuf::new(),
            dataset_identity: String::new(),
            decoder: "dot".into(),
            dim,
            entity_state_width: None,
            entity_dtype: dtype,
            entities,
            relations: 0,
            reciprocal_relations: false,
            batch_keys: crate::progress::BATCH_KEYS_VERSION,
            epochs_completed: 1,
            cut: None,
            checkpoint: "c".into(),
            store: None,
            store_queue: None,
            store_members: Vec::new(),
            store_id: None,
            store_creating: false,
            checksums,
            init_from: None,
        }
    }

    /// Writes the tables of a checkpoint `c/` in `dir`; returns its record.
    fn write(dir: &Path, emb: &[f32], state: &[f32], dim: usize, dtype: Dtype) -> RunMeta {
        std::fs::create_dir_all(dir.join("c")).unwrap();
        let mut stored = vec![0u8; emb.len() * dtype.bytes()];
        dtype.narrow(emb, &mut stored);
        let state_bytes: &[u8] = bytemuck::cast_slice(state);
        for (name, bytes) in TABLE_FILES.iter().zip([&stored[..], state_bytes, &[], &[]]) {
            std::fs::write(dir.join("c").join(name), bytes).unwrap();
        }
        let checksums = TableChecksums {
            entities: crc32fast::hash(&stored),
            entities_state: crc32fast::hash(state_bytes),
            relations: crc32fast::hash(&[]),
            relations_state: crc32fast::hash(&[]),
        };
        meta((emb.len() / dim) as u64, dim, dtype, checksums)
    }

    #[test]
    fn rows_read_in_runs_of_any_length_are_the_tables_and_check_their_sums() {
        let dir = tempfile::tempdir().unwrap();
        let (rows, dim) = (700_001usize, 3);
        let emb: Vec<f32> = (0..rows * dim)
            .map(|i| Dtype::Bf16.round_nearest(i as f32 * 0.25 - 7.0))
            .collect();
        let state: Vec<f32> = emb.iter().map(|x| x * x).collect();
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let meta = write(dir.path(), &emb, &state, dim, dtype);
            let run = Dir::open(dir.path()).unwrap();
            let mut r = CheckpointRows::open(&run, &meta).unwrap();
            let (mut got_emb, mut got_state) = (Vec::new(), Vec::new());
            // Runs that cross the read blocks and the widening buffer at odd places.
            let mut done = 0;
            for run_rows in (1..).map(|k| (k * 97_003) % 400_000 + 1) {
                let n = run_rows.min(rows - done);
                let (mut e, mut s) = (vec![0.0; n * dim], vec![0.0; n * dim]);
                r.read(&mut e, &mut s).unwrap();
                got_emb.extend(e);
                got_state.extend(s);
                done += n;
                if done == rows {
                    break;
                }
            }
            r.finish().unwrap();
            assert!(got_emb == emb && got_state == state, "{dtype}");
            // As a memory store keeps them: a 16-bit file's bits as they are.
            let mut r = CheckpointRows::open(&run, &meta).unwrap();
            let (at_rest, s) = r.read_at_rest(dtype, rows * dim, rows * dim).unwrap();
            r.finish().unwrap();
            let mut widened = Vec::new();
            crate::store::memory::widen_into(dtype, &at_rest, &mut widened);
            assert!(widened == emb && s == state, "{dtype} at rest");
            assert_eq!(
                matches!(at_rest, StoredEmbeddings::Bits16(_)),
                dtype.is_narrow(),
                "{dtype}"
            );
        }
    }

    #[test]
    fn an_f32_table_maps_in_place_and_a_damaged_one_fails_its_check() {
        let dir = tempfile::tempdir().unwrap();
        let emb: Vec<f32> = (0..3_000_003).map(|i| i as f32 * 0.5).collect();
        let meta = write(dir.path(), &emb, &emb, 3, Dtype::F32);
        let run = Dir::open(dir.path()).unwrap();
        let any = |_: &File, _: &Path| true;
        let mapped = map_entities(&run, &meta, any)
            .unwrap()
            .expect("f32 rows map");
        mapped.check().unwrap();
        assert_eq!(mapped.values(), &emb[..]);
        // A file the caller's rule refuses is not mapped; the rule sees the file and its path.
        let refused = map_entities(&run, &meta, |file, path| {
            assert!(path.ends_with("c/entities.bin"), "{}", path.display());
            assert_eq!(file.metadata().unwrap().len(), 4 * emb.len() as u64);
            false
        });
        assert!(refused.unwrap().is_none());
        // Its files are rewritten below: a mapping must not outlive them (see `map`).
        drop(mapped);
        // 16-bit rows are widened by whoever reads them: not mapped.
        let narrow = write(dir.path(), &emb, &emb, 3, Dtype::Bf16);
        assert!(map_entities(&run, &narrow, any).unwrap().is_none());
        // One bit flipped in the last block: refused, naming the file.
        let meta = write(dir.path(), &emb, &emb, 3, Dtype::F32);
        let path = dir.path().join("c").join("entities.bin");
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let mapped = map_entities(&run, &meta, any)
            .unwrap()
            .expect("f32 rows map");
        let err = mapped.check().unwrap_err().to_string();
        assert!(
            err.contains("entities.bin") && err.contains("checksum mismatch"),
            "{err}"
        );
    }

    #[test]
    fn a_damaged_or_resized_table_is_refused_naming_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let emb: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        let meta = write(dir.path(), &emb, &emb, 3, Dtype::F32);
        let run = Dir::open(dir.path()).unwrap();
        let path = dir.path().join("c").join("entities.state.bin");
        // One bit flipped: every row reads, and the sum says no.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[5000] ^= 4;
        std::fs::write(&path, &bytes).unwrap();
        let mut r = CheckpointRows::open(&run, &meta).unwrap();
        let (mut e, mut s) = (vec![0.0; 3000], vec![0.0; 3000]);
        r.read(&mut e, &mut s).unwrap();
        let err = r.finish().unwrap_err().to_string();
        assert!(
            err.contains("entities.state.bin") && err.contains("checksum mismatch"),
            "{err}"
        );
        // A row short: refused when opened.
        std::fs::write(&path, &bytes[..bytes.len() - 12]).unwrap();
        let err = CheckpointRows::open(&run, &meta)
            .err()
            .expect("a short table is refused")
            .to_string();
        assert!(
            err.contains("entities.state.bin") && err.contains("expected 12000"),
            "{err}"
        );
    }
}
