//! The one reader of a run's committed rows: its store opened once (one CPU queue pair for a
//! store behind NVMe queues), every read of it going through the swap path's mover
//! ([`crate::swap::path::mover`]) on the swap's I/O thread; or its checkpoint's files.
//! Whole tables (a resume, an evaluation), scans (an export, a query's scan) and lookups of a
//! few rows (a query) are all a [`RunReader`]'s, and a reader kept open (a queried or served
//! run) reads on without opening anything again.

use std::fs::File;
use std::path::{Path, PathBuf};

use legend_dataset::PartitionScheme;
use legend_fs::{Dir, Guard};
use legend_storage::{IoPiece, StoreSpec};

use crate::restore::TableReader;
use crate::rows::{Partition, RowShape, Tables};
use crate::store::{FileStore, MemberFile, PartitionHome, PartitionStoreError, QueuedMember};
use crate::swap::Swapper;
use crate::swap::path::{self, AtRest, Consumer};

use super::{RunError, RunMeta, StoreRecord, dataset_id, invalid, io, meta_path, read_config};

/// Floats of the checkpoint file a scan reads at a time.
pub(crate) const STREAM_FLOATS: usize = 16 << 20;

/// A run's committed rows opened for reading (see the module docs).
pub struct RunReader {
    source: Source,
    /// The store (its first member) or the checkpoint's entity file, for messages.
    path: PathBuf,
}

enum Source {
    Store(Box<StoreSource>),
    Checkpoint(CheckpointSource),
}

/// A run's store, behind the swap path.
struct StoreSource {
    /// The store's mover on its I/O thread, over two slots: a scan's partition and the next,
    /// read ahead.
    swapper: Swapper,
    /// The checkpoint's relation embeddings and their state, read when the store was opened.
    relations: (Vec<f32>, Vec<f32>),
    layout: StoreLayout,
}

/// A run's checkpoint files.
struct CheckpointSource {
    run: Dir,
    meta: Box<RunMeta>,
    /// The entity file, for lookups at their offsets.
    entities: File,
}

/// Where a run's store keeps its committed rows: what a reader that moves them with its own
/// I/O needs (legend-query's GPU row cache), taken when the store was opened.
pub struct StoreLayout {
    /// The store's parameters (nodes, dimension, dtype, partitions).
    pub spec: StoreSpec,
    /// Its members' files, in stripe order.
    pub members: Vec<MemberFile>,
    /// Its members behind NVMe queues, in stripe order: their controllers (shared with the
    /// reader's store) and namespaces; none for a store on files.
    pub queued: Vec<QueuedMember>,
    /// Each partition holding rows: the pieces of its committed copy (one a stripe unit on its
    /// member; one piece on a store of one member), embeddings first.
    pub committed: Vec<Vec<IoPiece>>,
    /// Bytes the largest partition takes at rest (the store's staging buffer).
    partition_bytes: usize,
}

/// Why a walk over the store's partitions ended early: the store failed, or the caller.
enum WalkError {
    Store(PartitionStoreError),
    Caller(RunError),
}

impl From<PartitionStoreError> for WalkError {
    fn from(e: PartitionStoreError) -> Self {
        WalkError::Store(e)
    }
}

impl RunReader {
    /// Opens the committed rows of the run in `run` (its record `meta`), reading through
    /// `guard` (which admits a store outside the run directory; device nodes are not the
    /// caller's to admit): its store, opened once, or its checkpoint's entity file (its size
    /// checked). A proxy controller the store starts serves at `proxy_model`'s rates (one
    /// already serving the file keeps its own).
    pub fn open(
        run: &Dir,
        meta: &RunMeta,
        guard: &dyn Guard,
        proxy_model: Option<crate::store::controllers::DeviceModel>,
    ) -> Result<RunReader, RunError> {
        let Some(path) = &meta.store else {
            let (entities, path) = super::open_entity_file(run, meta)?;
            return Ok(RunReader {
                source: Source::Checkpoint(CheckpointSource {
                    run: run.try_clone().map_err(io(run.path()))?,
                    meta: Box::new(meta.clone()),
                    entities,
                }),
                path,
            });
        };
        let (store, members) = open_members(run, path, meta, guard, proxy_model)?;
        let source = StoreSource::open(store, members, meta, read_config(run)?.init())
            .map_err(super::store_error(path))?;
        Ok(RunReader {
            source: Source::Store(Box::new(source)),
            path: path.clone(),
        })
    }

    /// Where the run's store keeps its committed rows (`None` for a run whose checkpoint is in
    /// files).
    pub fn store_layout(&self) -> Option<&StoreLayout> {
        match &self.source {
            Source::Store(s) => Some(&s.layout),
            Source::Checkpoint(_) => None,
        }
    }

    /// The checkpoint's relation embeddings (small: the rows of each relation), checked.
    pub fn relations(&self) -> Result<Vec<f32>, RunError> {
        match &self.source {
            Source::Store(s) => Ok(s.relations.0.clone()),
            Source::Checkpoint(c) if c.meta.relations == 0 => Ok(Vec::new()),
            Source::Checkpoint(c) => TableReader::open(&c.run, &c.meta, 2)?.read_all(),
        }
    }

    /// The checkpoint's relation embeddings and their AdaGrad state (what a run seeded from
    /// this one carries over), checked.
    pub fn relation_tables(&self) -> Result<(Vec<f32>, Vec<f32>), RunError> {
        match &self.source {
            Source::Store(s) => Ok(s.relations.clone()),
            Source::Checkpoint(c) if c.meta.relations == 0 => Ok((Vec::new(), Vec::new())),
            Source::Checkpoint(c) => Ok((
                TableReader::open(&c.run, &c.meta, 2)?.read_all()?,
                TableReader::open(&c.run, &c.meta, 3)?.read_all()?,
            )),
        }
    }

    /// Calls `block` with the committed entity embeddings in row order, a piece at a time (a
    /// partition of the store, through the swap path, the next read while `block` has the
    /// last; or 64 MiB of the checkpoint file), so that a scan never holds the table. A
    /// checkpoint file's checksum is known only after its last piece: on a mismatch this
    /// returns an error after `block` has seen everything, and the caller must discard what
    /// it made of it.
    pub fn stream_entities(
        &mut self,
        mut block: impl FnMut(&[f32]) -> Result<(), RunError>,
    ) -> Result<(), RunError> {
        self.stream_rows(false, |emb, _| block(emb))
    }

    /// [`RunReader::stream_entities`] with the rows' AdaGrad state when `with_state` (else
    /// `block` gets an empty state): pieces of whole rows, embeddings and state of the same
    /// rows (what a run seeded from this one carries over).
    pub fn stream_rows(
        &mut self,
        with_state: bool,
        mut block: impl FnMut(&[f32], &[f32]) -> Result<(), RunError>,
    ) -> Result<(), RunError> {
        let path = self.path.clone();
        match &mut self.source {
            Source::Store(s) => s.walk(&path, |part| {
                block(&part.emb, if with_state { &part.state } else { &[] })
            }),
            Source::Checkpoint(c) => {
                let shape = c.meta.entity_shape();
                let rows_per_piece = (STREAM_FLOATS / shape.dim.max(1)).max(1);
                let mut table = TableReader::open(&c.run, &c.meta, 0)?;
                let mut state = with_state
                    .then(|| TableReader::open(&c.run, &c.meta, 1))
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
        }
    }

    /// The committed entity embeddings (widened to f32), checked: a checkpoint file read
    /// straight into the table on every core, or a store's partitions one after the other.
    pub fn entities(&mut self) -> Result<Vec<f32>, RunError> {
        if let Source::Checkpoint(c) = &self.source {
            return TableReader::open(&c.run, &c.meta, 0)?.read_all();
        }
        let mut all = Vec::new();
        self.stream_entities(|piece| {
            all.extend_from_slice(piece);
            Ok(())
        })?;
        Ok(all)
    }

    /// The whole checkpoint, checked: the entity rows and their state (a store's partitions
    /// one after the other, through the swap path), and the relations.
    pub fn tables(mut self) -> Result<Tables, RunError> {
        let path = self.path.clone();
        match &mut self.source {
            Source::Store(s) => {
                let spec = &s.layout.spec;
                let rows = spec.num_nodes as usize;
                let mut entities = Vec::with_capacity(rows * spec.dim as usize);
                let mut entities_state = Vec::with_capacity(rows * spec.state_width as usize);
                s.walk(&path, |part| {
                    entities.extend_from_slice(&part.emb);
                    entities_state.extend_from_slice(&part.state);
                    Ok(())
                })?;
                let (relations, relations_state) = std::mem::take(&mut s.relations);
                Ok(Tables {
                    entities,
                    entities_state,
                    relations,
                    relations_state,
                })
            }
            Source::Checkpoint(c) => {
                let table = |i| TableReader::open(&c.run, &c.meta, i)?.read_all();
                Ok(Tables {
                    entities: table(0)?,
                    entities_state: table(1)?,
                    relations: table(2)?,
                    relations_state: table(3)?,
                })
            }
        }
    }

    /// The committed rows `ids` (any order), widened to f32 into `out` (one row per id, in
    /// `ids`' order), each read alone: from the store only the blocks that hold them (never
    /// the AdaGrad state; a never-written partition's rows drawn as training draws them), by
    /// its mover; from a checkpoint file at their offsets. A checkpoint file's checksum covers
    /// the whole table and is checked by [`RunReader::stream_entities`] only: a reader of a
    /// few rows relies on the size check at [`RunReader::open`] and on a whole pass having
    /// checked it (a serve job makes one when it loads).
    pub fn read_rows(&mut self, ids: &[u64], out: &mut [f32]) -> Result<(), RunError> {
        let path = &self.path;
        match &mut self.source {
            Source::Store(s) => s
                .swapper
                .read_rows(ids, out)
                .map_err(super::store_error(path)),
            Source::Checkpoint(c) => {
                use std::os::unix::fs::FileExt;
                let (dtype, dim, rows) = (c.meta.entity_dtype, c.meta.dim, c.meta.entities);
                let row_bytes = dim * dtype.bytes();
                let mut stored = vec![0u8; row_bytes];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(dim)) {
                    if id >= rows {
                        return Err(invalid(
                            path,
                            format!("row {id} asked of a table of {rows} rows"),
                        ));
                    }
                    c.entities
                        .read_exact_at(&mut stored, id * row_bytes as u64)
                        .map_err(io(path))?;
                    dtype.widen(&stored, row);
                }
                Ok(())
            }
        }
    }

    /// Bytes of host memory the reader holds between reads: a store's staging buffer (a
    /// partition at rest, which lookups read through).
    pub fn held_bytes(&self) -> u64 {
        match &self.source {
            Source::Store(s) => s.layout.partition_bytes as u64,
            Source::Checkpoint(_) => 0,
        }
    }

    /// Bytes of host memory a scan ([`RunReader::stream_entities`]) holds at most beside
    /// [`RunReader::held_bytes`]: from a store, two partitions in f32 (the one being used and
    /// the one read ahead, embeddings and AdaGrad state, as the swap path holds them); from a
    /// checkpoint file, one block in f32 and as stored.
    pub fn stream_bytes(&self) -> u64 {
        match &self.source {
            Source::Store(s) => {
                let spec = &s.layout.spec;
                let rows = legend_model::partition::rows_per_partition(
                    spec.num_nodes,
                    spec.num_partitions,
                );
                2 * rows * u64::from(spec.dim + spec.state_width) * 4
            }
            Source::Checkpoint(c) => {
                let (dtype, dim, rows) = (c.meta.entity_dtype, c.meta.dim, c.meta.entities);
                // A 16-bit file's values are widened from a buffer as stored.
                let floats = (STREAM_FLOATS as u64).min(rows * dim as u64);
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

impl StoreSource {
    /// The reader of `store` (whose members' files are `members`): its relations read and its
    /// layout taken now, then the store handed to the host mover of a swapper of its own.
    fn open(
        mut store: FileStore,
        members: Vec<MemberFile>,
        meta: &RunMeta,
        init: legend_model::Init,
    ) -> Result<StoreSource, PartitionStoreError> {
        // Refuses a store without a checkpoint, as every read after would.
        let relations = store.relations(meta.relation_floats())?;
        let spec = store.spec().clone();
        let scheme = PartitionScheme::new(spec.num_nodes, spec.num_partitions)
            .map_err(|e| PartitionStoreError::Invalid(e.to_string()))?;
        // Trailing partitions may hold no rows.
        let holding = spec.num_nodes.div_ceil(scheme.rows_per_partition) as u32;
        let committed = (0..holding)
            .map(|p| store.io_pieces(p, false))
            .collect::<Result<Vec<_>, _>>()?;
        let layout = StoreLayout {
            queued: store.queued_members().to_vec(),
            partition_bytes: store.max_partition_bytes(),
            spec,
            members,
            committed,
        };
        let at_rest = AtRest {
            scheme,
            shape: RowShape {
                dim: layout.spec.dim as usize,
                state: layout.spec.state_width as usize,
                dtype: layout.spec.dtype,
            },
            init,
        };
        let mover = path::mover(
            Consumer::Host,
            PartitionHome::File(Box::new(store)),
            at_rest,
        )?;
        Ok(StoreSource {
            swapper: Swapper::new(scheme, 2, mover, false, true),
            relations,
            layout,
        })
    }

    /// Calls `f` with every partition in order through the swap path; `path` names the store.
    fn walk(
        &mut self,
        path: &Path,
        mut f: impl FnMut(&Partition) -> Result<(), RunError>,
    ) -> Result<(), RunError> {
        self.swapper
            .stream(|part| f(part).map_err(WalkError::Caller))
            .map_err(|e| match e {
                WalkError::Store(source) => super::store_error(path)(source),
                WalkError::Caller(e) => e,
            })
    }
}

/// Opens the store of the run in `run` at `path` (its first member) as the record `meta` says:
/// its members' directories admitted by `guard` unless they are the run's own.
fn open_members(
    run: &Dir,
    path: &Path,
    meta: &RunMeta,
    guard: &dyn Guard,
    proxy_model: Option<crate::store::controllers::DeviceModel>,
) -> Result<(FileStore, Vec<MemberFile>), RunError> {
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
        .map(|m| MemberFile::of_run(run, &run_dir, m, guard).map_err(super::store_error(&m.path)))
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
    let store = FileStore::open_any_partitioning(&spec).map_err(super::store_error(path))?;
    Ok((store, members))
}
