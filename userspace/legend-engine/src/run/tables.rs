//! Reading a run's tables: its store (opened as the run recorded it) or its checkpoint's files,
//! whole, a piece at a time, or row by row, each file's checksum checked.

use std::fs::File;
use std::path::{Path, PathBuf};

use legend_fs::{Access, Dir, Guard};
use legend_model::Dtype;

use crate::restore::TableReader;

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
    stream_rows(run, meta, guard, false, |emb, _| block(emb))
}

/// [`stream_entities`] with the rows' AdaGrad state when `with_state` (else `block` gets an
/// empty state): pieces of whole rows, embeddings and state of the same rows.
pub fn stream_rows(
    run: &Dir,
    meta: &RunMeta,
    guard: &dyn Guard,
    with_state: bool,
    mut block: impl FnMut(&[f32], &[f32]) -> Result<(), RunError>,
) -> Result<(), RunError> {
    if let Some(path) = &meta.store {
        let store = open_run_store(run, path, meta, guard)?;
        let init = read_config(run)?.init();
        return store
            .for_each_partition(init, |part| {
                let state: &[f32] = if with_state { &part.state } else { &[] };
                block(&part.emb, state).map_err(WalkError::Block)
            })
            .map_err(|e| match e {
                WalkError::Store(source) => store_error(path)(source),
                WalkError::Block(e) => e,
            });
    }
    let shape = meta.entity_shape();
    let rows_per_piece = (STREAM_FLOATS / shape.dim.max(1)).max(1);
    let mut table = TableReader::open(run, meta, 0)?;
    let mut state = with_state
        .then(|| TableReader::open(run, meta, 1))
        .transpose()?;
    let mut buf = vec![0f32; (rows_per_piece * shape.dim).min(table.values_left())];
    let mut state_buf = Vec::new();
    while table.values_left() > 0 {
        let rows = (table.values_left() / shape.dim.max(1)).min(rows_per_piece);
        let piece = &mut buf[..rows * shape.dim];
        table.read(piece)?;
        if let Some(state) = &mut state {
            state_buf.resize(rows * shape.state, 0.0);
            state.read(&mut state_buf)?;
        }
        block(piece, &state_buf)?;
    }
    table.finish()?;
    state.map_or(Ok(()), TableReader::finish)
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
                // A 16-bit file's values are widened from a buffer as stored.
                let floats = (STREAM_FLOATS as u64).min(*rows * *dim as u64);
                let stored = if dtype.is_narrow() {
                    floats * dtype.bytes() as u64
                } else {
                    0
                };
                floats * 4 + stored
            }
        }
    }
}

/// The current checkpoint's relation embeddings (small: the rows of each relation).
pub fn load_relations(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<Vec<f32>, RunError> {
    Ok(load_relation_tables(run, meta, guard, false)?.0)
}

/// The current checkpoint's relation embeddings and, when `with_state`, their AdaGrad state
/// (else empty).
pub fn load_relation_tables(
    run: &Dir,
    meta: &RunMeta,
    guard: &dyn Guard,
    with_state: bool,
) -> Result<(Vec<f32>, Vec<f32>), RunError> {
    if meta.relations == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let floats = meta.relation_floats();
    if let Some(path) = &meta.store {
        let mut store = open_run_store(run, path, meta, guard)?;
        return store
            .relations(floats)
            .map(|(emb, state)| (emb, if with_state { state } else { Vec::new() }))
            .map_err(store_error(path));
    }
    let state = if with_state {
        TableReader::open(run, meta, 3)?.read_all()?
    } else {
        Vec::new()
    };
    Ok((TableReader::open(run, meta, 2)?.read_all()?, state))
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
    let table = |i| TableReader::open(run, meta, i)?.read_all();
    Ok(Tables {
        entities: table(0)?,
        entities_state: table(1)?,
        relations: table(2)?,
        relations_state: table(3)?,
    })
}

/// The current checkpoint's entity and relation embeddings, without their AdaGrad state: what
/// ranking them needs (half the memory of [`load_tables`]), checked as it checks them.
pub fn load_embeddings(
    run: &Dir,
    meta: &RunMeta,
    guard: &dyn Guard,
) -> Result<(Vec<f32>, Vec<f32>), RunError> {
    Ok((
        load_entities(run, meta, guard)?,
        load_relations(run, meta, guard)?,
    ))
}

/// The current checkpoint's entity embeddings (widened to f32), checked: a checkpoint file read
/// straight into the table on every core, or a store's partitions one after the other.
pub fn load_entities(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<Vec<f32>, RunError> {
    if meta.store.is_none() {
        return TableReader::open(run, meta, 0)?.read_all();
    }
    let mut all = Vec::with_capacity(meta.entities as usize * meta.dim);
    stream_entities(run, meta, guard, |piece| {
        all.extend_from_slice(piece);
        Ok(())
    })?;
    Ok(all)
}
