//! Reading a run's tables: its store (opened as the run recorded it) or its checkpoint's files,
//! whole, a piece at a time, or row by row, each file's checksum checked.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use legend_fs::{Access, Dir, Guard};
use legend_model::Dtype;

use super::{
    RunError, RunMeta, StoreRecord, TABLE_FILES, Tables, dataset_id, invalid, io, meta_path,
    read_config, store_error,
};

/// Opens the store of a run trained with a store backend (its directory admitted by `guard`
/// unless it is the run's own; device nodes are not the caller's to admit); `path`, its first
/// member, names it in messages.
fn open_run_store(
    run: &Dir,
    path: &Path,
    meta: &RunMeta,
    guard: &dyn Guard,
) -> Result<crate::store::FileStore, RunError> {
    Ok(open_members(run, path, meta, guard, None)?.0)
}

/// The store of a run trained with a store backend, with its members' files (`None` for a run
/// whose checkpoint is in files), opened as [`load_tables`] opens it: for a reader that moves
/// the committed partitions itself (legend-query's GPU row cache, which finds each with
/// [`crate::store::FileStore::io_extent`]). A proxy controller it starts serves at
/// `proxy_model`'s rates (`storage.proxy_model`).
pub fn open_store(
    run: &Dir,
    meta: &RunMeta,
    guard: &dyn Guard,
    proxy_model: Option<crate::store::controllers::DeviceModel>,
) -> Result<Option<StoreAndMembers>, RunError> {
    match &meta.store {
        Some(path) => open_members(run, path, meta, guard, proxy_model).map(Some),
        None => Ok(None),
    }
}

/// A run's store and the files of its members, in stripe order.
pub type StoreAndMembers = (crate::store::FileStore, Vec<crate::store::MemberFile>);

fn open_members(
    run: &Dir,
    path: &Path,
    meta: &RunMeta,
    guard: &dyn Guard,
    proxy_model: Option<crate::store::controllers::DeviceModel>,
) -> Result<StoreAndMembers, RunError> {
    use crate::store::MemberFile;
    let StoreRecord::Made(store_id) = meta.store_record(run.path())? else {
        return Err(invalid(
            &meta_path(run.path()),
            format!(
                "the run stopped while it created its store: it has no checkpoint yet (continue it with `legendctl train --out {} --resume`)",
                run.path().display()
            ),
        ));
    };
    let run_dir = std::fs::canonicalize(run.path()).map_err(io(run.path()))?;
    let members = meta
        .recorded_members()
        .unwrap_or_default()
        .iter()
        .map(|m| MemberFile::of_run(run, &run_dir, m, guard).map_err(store_error(&m.path)))
        .collect::<Result<Vec<_>, _>>()?;
    let spec = crate::store::FileStoreSpec {
        members: &members,
        stripe_bytes: 0,
        dataset: dataset_id(&meta.dataset_identity, path)?,
        num_nodes: meta.entities,
        shape: meta.entity_shape(),
        num_partitions: 0,
        aux_bytes: 0,
        store_id,
        force: false,
        proxy_model,
    };
    let store = crate::store::FileStore::open_any_partitioning(&spec).map_err(store_error(path))?;
    Ok((store, members))
}

/// Why a walk over a store's partitions ended early: the store failed, or the caller's block.
enum WalkError {
    Store(crate::store::PartitionStoreError),
    Block(RunError),
}

impl From<crate::store::PartitionStoreError> for WalkError {
    fn from(e: crate::store::PartitionStoreError) -> Self {
        WalkError::Store(e)
    }
}

/// Floats of the checkpoint file [`stream_entities`] reads at a time.
const STREAM_FLOATS: usize = 16 << 20;

/// Calls `block` with the current checkpoint's entity embeddings in row order, a piece at a
/// time (a partition of the store, or 64 MiB of the checkpoint file), so that an export never
/// holds the table. A checkpoint file's checksum is known only after its last piece: on a
/// mismatch this returns an error after `block` has seen everything, and the caller must
/// discard what it wrote.
pub fn stream_entities(
    run: &Dir,
    meta: &RunMeta,
    guard: &dyn Guard,
    mut block: impl FnMut(&[f32]) -> Result<(), RunError>,
) -> Result<(), RunError> {
    if let Some(path) = &meta.store {
        let store = open_run_store(run, path, meta, guard)?;
        let init = read_config(run)?.init();
        return store
            .for_each_partition(init, |part| block(&part.emb).map_err(WalkError::Block))
            .map_err(|e| match e {
                WalkError::Store(source) => store_error(path)(source),
                WalkError::Block(e) => e,
            });
    }
    let (mut file, path) = open_entity_file(run, meta)?;
    let dtype = meta.entity_dtype;
    let floats = meta.entities * meta.dim as u64;
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0f32; STREAM_FLOATS.min(floats as usize)];
    let mut stored = vec![0u8; buf.len() * dtype.bytes()];
    let mut left = floats as usize;
    while left > 0 {
        let piece = &mut buf[..left.min(STREAM_FLOATS)];
        let bytes = &mut stored[..piece.len() * dtype.bytes()];
        file.read_exact(bytes).map_err(io(&path))?;
        crc.update(bytes);
        dtype.widen(bytes, piece);
        block(piece)?;
        left -= piece.len();
    }
    if crc.finalize() != meta.checksums.entities {
        return Err(invalid(
            &path,
            "checksum mismatch: the checkpoint is damaged",
        ));
    }
    Ok(())
}

/// The current checkpoint's entity file (a run without a store), opened and its size checked
/// against the run's record; with its path, for messages.
pub fn open_entity_file(run: &Dir, meta: &RunMeta) -> Result<(File, PathBuf), RunError> {
    let rel = Path::new(&meta.checkpoint).join(TABLE_FILES[0]);
    let path = run.join(&rel);
    let dtype = meta.entity_dtype;
    let want = meta.entities * meta.dim as u64 * dtype.bytes() as u64;
    let file = run.open_file(&rel, Access::Read).map_err(io(&path))?;
    let len = file.metadata().map_err(io(&path))?.len();
    if len != want {
        return Err(invalid(
            &path,
            format!("holds {len} bytes, expected {want} ({dtype})"),
        ));
    }
    Ok((file, path))
}

/// A run's current entity rows opened for reads of a few rows at a time (a query's lookups):
/// its store kept open, or its checkpoint file.
pub struct RowReader {
    source: RowSource,
    /// The store or file, for messages.
    path: PathBuf,
}

enum RowSource {
    /// Rows read alone from the store ([`crate::store::FileStore::read_rows`]).
    Store(Box<crate::store::FileStore>, legend_model::Init),
    /// Rows read at their offsets in the checkpoint file.
    File {
        file: File,
        dtype: Dtype,
        dim: usize,
        rows: u64,
    },
}

impl RowReader {
    /// Opens `meta`'s rows in `run`, through `guard`: the store, or the checkpoint's entity file
    /// (its size checked).
    pub fn open(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<RowReader, RunError> {
        if let Some(path) = &meta.store {
            let store = open_run_store(run, path, meta, guard)?;
            return Ok(RowReader {
                source: RowSource::Store(Box::new(store), read_config(run)?.init()),
                path: path.clone(),
            });
        }
        let (file, path) = open_entity_file(run, meta)?;
        Ok(RowReader {
            source: RowSource::File {
                file,
                dtype: meta.entity_dtype,
                dim: meta.dim,
                rows: meta.entities,
            },
            path,
        })
    }

    /// The rows `ids` (any order), widened to f32 into `out` (one row per id, in `ids`' order),
    /// each read alone: from the store only the blocks that hold them (never the AdaGrad state;
    /// a never-written partition's rows drawn as training draws them), from a checkpoint file
    /// at their offsets. A checkpoint file's checksum covers the whole table and is checked by
    /// [`stream_entities`] only: a reader of a few rows relies on the size check at
    /// [`RowReader::open`] and on a whole pass having checked it (a serve job makes one when it
    /// loads).
    pub fn read(&mut self, ids: &[u64], out: &mut [f32]) -> Result<(), RunError> {
        let path = &self.path;
        match &mut self.source {
            RowSource::Store(store, init) => {
                store.read_rows(init, ids, out).map_err(store_error(path))
            }
            RowSource::File {
                file,
                dtype,
                dim,
                rows,
            } => {
                use std::os::unix::fs::FileExt;
                let row_bytes = *dim * dtype.bytes();
                let mut stored = vec![0u8; row_bytes];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(*dim)) {
                    if id >= *rows {
                        return Err(invalid(
                            path,
                            format!("row {id} asked of a table of {rows} rows"),
                        ));
                    }
                    file.read_exact_at(&mut stored, id * row_bytes as u64)
                        .map_err(io(path))?;
                    dtype.widen(&stored, row);
                }
                Ok(())
            }
        }
    }

    /// Bytes of host memory the reader holds: a store's staging buffer (a partition at rest).
    pub fn held_bytes(&self) -> u64 {
        match &self.source {
            RowSource::Store(store, _) => store.max_partition_bytes() as u64,
            RowSource::File { .. } => 0,
        }
    }

    /// Bytes of host memory a [`stream_entities`] pass over the same run holds at most: from a
    /// store, two partitions in f32 (the one being used and the one read ahead, embeddings
    /// and AdaGrad state, as the swap path holds them) and the store's staging buffer; from a
    /// checkpoint file, one block in f32 and as stored.
    pub fn stream_bytes(&self) -> u64 {
        match &self.source {
            RowSource::Store(store, _) => {
                let spec = store.spec();
                let rows = legend_model::partition::rows_per_partition(
                    spec.num_nodes,
                    spec.num_partitions,
                );
                let floats = rows * u64::from(spec.dim + spec.state_width);
                2 * floats * 4 + store.max_partition_bytes() as u64
            }
            RowSource::File {
                dtype, dim, rows, ..
            } => {
                let floats = (STREAM_FLOATS as u64).min(*rows * *dim as u64);
                floats * (4 + dtype.bytes() as u64)
            }
        }
    }
}

/// The current checkpoint's relation embeddings (small: the rows of each relation).
pub fn load_relations(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<Vec<f32>, RunError> {
    if meta.relations == 0 {
        return Ok(Vec::new());
    }
    let floats = meta.relation_floats();
    if let Some(path) = &meta.store {
        let mut store = open_run_store(run, path, meta, guard)?;
        return store
            .relations(floats)
            .map(|(emb, _)| emb)
            .map_err(store_error(path));
    }
    {
        let rel = Path::new(&meta.checkpoint).join(TABLE_FILES[2]);
        let path = run.join(&rel);
        let bytes = run.read(&rel).map_err(io(&path))?;
        if bytes.len() != floats * 4 {
            return Err(invalid(
                &path,
                format!("holds {} bytes, expected {}", bytes.len(), floats * 4),
            ));
        }
        if crc32fast::hash(&bytes) != meta.checksums.relations {
            return Err(invalid(
                &path,
                "checksum mismatch: the checkpoint is damaged",
            ));
        }
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}

/// Loads the current checkpoint of `run`: from its store (file backend) or from its checkpoint
/// directory, verifying sizes and checksums. `guard` admits a store outside the run directory
/// (a run's record names its store, and records can be edited).
pub fn load_tables(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<Tables, RunError> {
    if let Some(path) = &meta.store {
        let store = open_run_store(run, path, meta, guard)?;
        return store
            .read_tables(read_config(run)?.init(), meta.relation_floats())
            .map_err(store_error(path));
    }
    let dir = Path::new(&meta.checkpoint);
    let rows = [meta.entities, meta.entities, meta.relations, meta.relations];
    let rw = meta.relation_width();
    let widths = [meta.dim, meta.entity_shape().state, rw, rw];
    let dtypes = [meta.entity_dtype, Dtype::F32, Dtype::F32, Dtype::F32];
    let sums = [
        meta.checksums.entities,
        meta.checksums.entities_state,
        meta.checksums.relations,
        meta.checksums.relations_state,
    ];
    let mut tables = Vec::with_capacity(4);
    for (i, file) in TABLE_FILES.iter().enumerate() {
        let (rows, width, dtype, crc) = (rows[i], widths[i], dtypes[i], sums[i]);
        let path = run.join(dir.join(file));
        let table_file = run
            .open_file(dir.join(file), Access::Read)
            .map_err(io(&path))?;
        let floats = rows as usize * width;
        let want = floats * dtype.bytes();
        let len = table_file.metadata().map_err(io(&path))?.len();
        if len != want as u64 {
            return Err(invalid(
                &path,
                format!(
                    "holds {len} bytes, expected {want} ({rows} rows × {width} values of {dtype})"
                ),
            ));
        }
        let mut table = vec![0f32; floats];
        let sum = if dtype.is_narrow() {
            let mut stored = vec![0u8; want];
            let sum = read_checksummed(&table_file, &mut stored, READ_BLOCK);
            crate::store::at_rest::widen(dtype, &stored, &mut table);
            sum
        } else {
            read_checksummed(
                &table_file,
                bytemuck::cast_slice_mut(&mut table),
                READ_BLOCK,
            )
        }
        .map_err(io(&path))?;
        if sum != crc {
            return Err(invalid(
                &path,
                "checksum mismatch: the checkpoint is damaged",
            ));
        }
        tables.push(table);
    }
    let mut it = tables.into_iter();
    let mut next = || it.next().expect("four tables");
    Ok(Tables {
        entities: next(),
        entities_state: next(),
        relations: next(),
        relations_state: next(),
    })
}

/// Bytes each thread reads and checksums at a time in [`read_checksummed`].
const READ_BLOCK: usize = 64 << 20;

/// Fills `bytes` from the start of `file` and returns their CRC-32: straight into the caller's
/// table (a byte buffer first would hold it twice), `block` bytes at a time on every core, the
/// blocks' checksums combined in order (one thread reads and sums a 17 GB table in tens of
/// seconds).
pub(super) fn read_checksummed(
    file: &File,
    bytes: &mut [u8],
    block: usize,
) -> std::io::Result<u32> {
    use rayon::prelude::*;
    use std::os::unix::fs::FileExt;
    let sums = bytes
        .par_chunks_mut(block)
        .enumerate()
        .map(|(i, piece)| {
            file.read_exact_at(piece, (i * block) as u64)?;
            let mut h = crc32fast::Hasher::new();
            h.update(piece);
            Ok(h)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut total = crc32fast::Hasher::new();
    for h in sums {
        total.combine(&h);
    }
    Ok(total.finalize())
}
