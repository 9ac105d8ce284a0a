//! A run's tables and the scans that answer queries on entity ids: the K best completions of
//! `(head, relation, ?)` or `(?, relation, tail)`, the K nearest entities of an entity, triple
//! scores and rows.
//!
//! Scores come from the run's own decoder ([`Decoder::query`]) and legend-eval's [`Kernel`], the
//! scorer the evaluator ranks with, so a predicted score equals the one evaluation counts, bit
//! for bit. A scan splits the entity table into blocks scored on every core (rayon); each
//! thread keeps its own K best per query and the parts are merged in [`Ranked::better_first`]'s
//! total order, so the answer does not depend on the split. On a GPU (`crate::gpu`) the same
//! scan runs as legend-cuda's, which gives the same scores and order; the query vectors are
//! made here either way.

use std::sync::{Mutex, MutexGuard};

use legend_cuda::scan::{EntityRows, SCAN_MAX_QUERIES, Scan, ScanScoring};
use legend_engine::restore::{MappedTable, TableReader, entities_in_checkpoint, map_entities};
use legend_engine::run::{self, RunError, RunMeta, RunReader};
use legend_eval::{FilterIndex, Kernel};
use legend_fs::{Dir, Guard};
use legend_model::{Comparator, Decoder, Side};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::QueryError;
use crate::gpu::{GpuScans, OpenedGpu, StoreRows};
use crate::names::{FileAccess, note_copied};
use crate::topk::{Ranked, TopK};

/// Candidate rows scored at a time by one thread: 256 rows of d = 200 stay in L2 while the
/// batch's queries sweep them (as the evaluator's filtered ranking does).
const CANDIDATE_BLOCK: usize = 256;

/// Bytes of entity rows copied from GPU memory at a time for a scan on the CPU.
const DOWNLOAD_BYTES: usize = 64 << 20;

/// Where the entity rows are.
enum Entities {
    /// In memory, row-major `[entities × dim]` (a served run).
    Resident(Vec<f32>),
    /// The run's checkpoint file mapped in place, its checksum checked: the page cache's
    /// pages, row-major (a query command on a run of the memory backend in f32).
    Mapped(MappedTable),
    /// In the run's checkpoint or store, read a piece at a time by every scan (a run larger
    /// than memory), and row by row by lookups, through the run's one reader.
    Stored {
        /// The reader, opened once: one scan or lookup at a time holds it, so that a run's
        /// host memory stays within [`Model::stream_bytes`] however many batches come at once.
        reader: Mutex<RunReader>,
    },
    /// In GPU memory only (the rows of [`Model::gpu`]).
    OnGpu,
}

/// `m` locked, whether or not a holder panicked (what it guards stays consistent).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a run's GPU will hold: the GPU, whether the entity rows go into its memory, and else
/// a row cache over the run's store.
pub(crate) struct GpuPlan {
    pub(crate) opened: OpenedGpu,
    pub(crate) resident: bool,
    pub(crate) store_rows: Option<StoreRows>,
}

/// The one place that reads a stored run's entity rows for a scan: `piece` gets them in row
/// order, whole rows of `dim` floats a piece at a time (a partition of the store, or a block of
/// the checkpoint file), through the run's reader.
fn read_pieces(
    reader: &mut RunReader,
    dim: usize,
    mut piece: impl FnMut(&[f32]) -> Result<(), RunError>,
) -> Result<(), RunError> {
    // A checkpoint file is read in blocks of a fixed size, which may end inside a row: the
    // row is completed from the next block.
    let mut split_row: Vec<f32> = Vec::with_capacity(dim);
    reader.stream_entities(|mut block| {
        if !split_row.is_empty() {
            let take = (dim - split_row.len()).min(block.len());
            split_row.extend_from_slice(&block[..take]);
            block = &block[take..];
            if split_row.len() < dim {
                return Ok(());
            }
            piece(&split_row)?;
            split_row.clear();
        }
        let whole = block.len() / dim * dim;
        if whole > 0 {
            piece(&block[..whole])?;
        }
        split_row.extend_from_slice(&block[whole..]);
        Ok(())
    })
}

/// Refuses to load the entity rows of `meta`'s run (in `run`) into host memory when they take
/// more than is available: jobs are threads of the daemon, and an allocation that fails would
/// take it down.
fn fits_in_memory(run: &Dir, meta: &RunMeta) -> Result<(), QueryError> {
    let bytes = u128::from(meta.entities) * (meta.dim as u128) * 4;
    let available = legend_engine::footprint::available_bytes().map_or(u128::MAX, u128::from);
    if bytes > available {
        return Err(QueryError::Tables(format!(
            "{}: the run's entity rows take {:.1} GiB, more than the {:.1} GiB of memory \
             available: query it with legendctl predict|score|neighbors instead, which reads it \
             a piece at a time",
            run.path().display(),
            bytes as f64 / f64::from(1u32 << 30),
            available as f64 / f64::from(1u32 << 30)
        )));
    }
    Ok(())
}

/// Bytes of each staging chunk of a table's upload to the GPU: 16 blocks of the checkpoint
/// file, read on every core straight into pinned memory.
const UPLOAD_CHUNK_BYTES: usize = 64 << 20;

/// Why a table's upload from its checkpoint stopped: the file, or the GPU.
enum UploadError {
    Read(RunError),
    Gpu(legend_cuda::GpuError),
}

impl From<legend_cuda::GpuError> for UploadError {
    fn from(e: legend_cuda::GpuError) -> UploadError {
        UploadError::Gpu(e)
    }
}

/// Reads the entity rows of `meta`'s checkpoint in `run` into `rows` on `gpu`'s device: the
/// file read on every core straight into pinned staging, a chunk at a time, each chunk's DMA
/// running while the next is read and the one after is asked of the disk, so that a cold
/// file is read once at the disk's rate (not read, then staged) and a warm one is one copy out
/// of the page cache. The bytes are checksummed as they are read and checked against the
/// run's record once all are: what the GPU holds is what was checked (staged memory is this
/// process's own, whoever else may write the file). A 16-bit checkpoint is widened as read.
fn upload_checkpoint(
    gpu: &OpenedGpu,
    rows: &mut EntityRows,
    run: &Dir,
    meta: &RunMeta,
) -> Result<(), QueryError> {
    let mut reader = TableReader::open(run, meta, 0)?;
    let mut transfer =
        legend_cuda::Transfer::new(&gpu.gpu, UPLOAD_CHUNK_BYTES).map_err(|e| gpu.error(e))?;
    // Stored bytes a chunk of f32 holds (a 16-bit file's are half as many).
    let stored = |bytes: usize| (bytes / 4 * meta.entity_dtype.bytes()) as u64;
    reader.will_read(0, stored(UPLOAD_CHUNK_BYTES));
    let mut fill = |_: usize, chunk: &mut [u8]| {
        reader.will_read(stored(chunk.len()), stored(UPLOAD_CHUNK_BYTES));
        // Staging chunks are page-aligned, and hold whole floats.
        reader
            .read(bytemuck::cast_slice_mut(chunk))
            .map_err(UploadError::Read)
    };
    match rows.fill(&mut transfer, &mut fill) {
        Ok(()) => Ok(reader.finish()?),
        Err(UploadError::Read(e)) => Err(e.into()),
        Err(UploadError::Gpu(e)) => Err(gpu.error(e)),
    }
}

/// How neighbours are compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Cosine similarity (rows scaled to unit length; a zero row is 0 to everything).
    Cosine,
    /// Inner product.
    Dot,
    /// Euclidean distance, scored as its negative (higher is nearer).
    L2,
}

impl std::str::FromStr for Metric {
    type Err = legend_model::UnknownName;

    fn from_str(s: &str) -> Result<Metric, Self::Err> {
        match s {
            "cosine" => Ok(Metric::Cosine),
            "dot" => Ok(Metric::Dot),
            "l2" => Ok(Metric::L2),
            _ => Err(legend_model::UnknownName::new(
                "metric",
                s,
                "expected cosine, dot or l2",
            )),
        }
    }
}

impl Metric {
    /// The name used on the command line and in answers.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Cosine => "cosine",
            Metric::Dot => "dot",
            Metric::L2 => "l2",
        }
    }

    fn comparator(self) -> Comparator {
        match self {
            Metric::Cosine | Metric::Dot => Comparator::Dot,
            Metric::L2 => Comparator::NegL2,
        }
    }
}

/// A link-prediction query on ids: the best entities for the missing end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The missing end: [`Side::Dst`] for `(anchor, relation, ?)`, [`Side::Src`] for
    /// `(?, relation, anchor)`.
    pub side: Side,
    /// The known end.
    pub anchor: u32,
    /// The relation.
    pub relation: u32,
    /// How many entities to return.
    pub top: usize,
    /// Leave out entities that form a known triple (train, valid or test).
    pub filtered: bool,
}

/// A nearest-neighbour query on ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nearest {
    /// The entity (left out of its own answer).
    pub entity: u32,
    /// How many entities to return.
    pub top: usize,
    /// How rows are compared.
    pub metric: Metric,
}

/// A run's trained tables, ready for queries.
pub struct Model {
    decoder: Decoder,
    dim: usize,
    num_entities: usize,
    num_relations: usize,
    /// The relation table holds each relation's inverse in its second half
    /// (`model.reciprocal_relations`): a head is predicted as `(tail, r⁻¹, ?)`, as the
    /// evaluator ranks it.
    reciprocal: bool,
    relations: Vec<f32>,
    entities: Entities,
    /// The GPU that scans, holding the entity rows when [`Entities::OnGpu`].
    gpu: Option<GpuScans>,
    /// Rows looked up through the GPU row cache over the run's store (a table out of GPU
    /// memory).
    store_rows: Option<StoreRows>,
    /// The checkpoint file read into memory though it could have been mapped, with why.
    copied: Vec<String>,
}

impl Model {
    /// The tables of `meta`'s run, read through `guard`: relations loaded; entities loaded
    /// too, or, when `streamed`, read by each scan and lookup through the run's reader.
    pub fn of_run(
        run: Dir,
        meta: RunMeta,
        num_relations: usize,
        guard: &dyn Guard,
        streamed: bool,
    ) -> Result<Model, QueryError> {
        if !streamed {
            // Refused before anything of the run is opened.
            fits_in_memory(&run, &meta)?;
        }
        let reader = RunReader::open(&run, &meta, guard, None)?;
        Self::of_run_on(
            (run, meta, reader),
            num_relations,
            streamed,
            None,
            FileAccess::Copy,
        )
    }

    /// [`Model::of_run`] through `reader` (opened on the run, kept when the rows are
    /// streamed: the run's one reader), scanning on the GPU of `plan`: the entity rows read
    /// into its memory (not the host's) when the plan says they fit. With
    /// [`FileAccess::MapAndKeep`], rows not streamed come from the checkpoint file mapped in
    /// place when its layout is theirs.
    pub(crate) fn of_run_on(
        (run, meta, mut reader): (Dir, RunMeta, RunReader),
        num_relations: usize,
        streamed: bool,
        plan: Option<GpuPlan>,
        access: FileAccess,
    ) -> Result<Model, QueryError> {
        let decoder: Decoder = meta
            .decoder
            .parse()
            .map_err(|e: legend_model::UnknownName| RunError::Invalid {
                path: run.join(run::META_FILE),
                message: e.to_string(),
            })?;
        let relations = reader.relations()?;
        let reciprocal = meta.reciprocal_relations;
        let (dim, num_entities) = (meta.dim, meta.entities as usize);
        let (mut gpu, mut store_rows) = (None, None);
        if let Some(plan) = plan {
            if plan.resident {
                let mut rows = EntityRows::new(&plan.opened.gpu, num_entities, dim)
                    .map_err(|e| plan.opened.error(e))?;
                if entities_in_checkpoint(&meta) {
                    upload_checkpoint(&plan.opened, &mut rows, &run, &meta)?;
                } else {
                    let mut first = 0;
                    let mut failed = None;
                    read_pieces(&mut reader, dim, |piece| {
                        if failed.is_none() {
                            failed = rows.write(&plan.opened.gpu, first, piece).err();
                            first += piece.len() / dim;
                        }
                        Ok(())
                    })?;
                    if let Some(e) = failed {
                        return Err(plan.opened.error(e));
                    }
                }
                let gpu = GpuScans::new(plan.opened, Some(rows));
                let mut model = Model::new(
                    decoder,
                    dim,
                    (num_relations, reciprocal),
                    relations,
                    Entities::OnGpu,
                    num_entities,
                )?;
                model.gpu = Some(gpu);
                return Ok(model);
            }
            gpu = Some(GpuScans::new(plan.opened, None));
            store_rows = plan.store_rows;
        }
        let mut copied = Vec::new();
        let mapped = match access {
            _ if streamed => None,
            FileAccess::Copy => None,
            _ => map_entities(&run, &meta, |file, path| match access.may_map(file) {
                Ok(()) => true,
                Err(why) => {
                    note_copied(&mut copied, path, &why);
                    false
                }
            })?,
        };
        let entities = match (streamed, mapped) {
            (false, Some(mapped)) => {
                mapped.check()?;
                Entities::Mapped(mapped)
            }
            (true, _) => Entities::Stored {
                reader: Mutex::new(reader),
            },
            (false, None) => {
                fits_in_memory(&run, &meta)?;
                Entities::Resident(reader.entities()?)
            }
        };
        let mut model = Model::new(
            decoder,
            dim,
            (num_relations, reciprocal),
            relations,
            entities,
            num_entities,
        )?;
        model.gpu = gpu;
        model.store_rows = store_rows;
        model.copied = copied;
        Ok(model)
    }

    /// Tables in memory: `entities` rows of `dim` floats, `relations` rows (none for
    /// [`Decoder::Dot`]; `num_relations` is then what ids are checked against), twice as many
    /// when `reciprocal` (the inverses in the second half).
    pub fn in_memory(
        decoder: Decoder,
        dim: usize,
        entities: Vec<f32>,
        relations: Vec<f32>,
        (num_relations, reciprocal): (usize, bool),
    ) -> Result<Model, QueryError> {
        let num_entities = entities.len() / dim.max(1);
        Model::new(
            decoder,
            dim,
            (num_relations, reciprocal),
            relations,
            Entities::Resident(entities),
            num_entities,
        )
    }

    /// `(num_relations, reciprocal)`: the relations queries name, and whether the table holds
    /// their inverses too.
    fn new(
        decoder: Decoder,
        dim: usize,
        (num_relations, reciprocal): (usize, bool),
        relations: Vec<f32>,
        entities: Entities,
        num_entities: usize,
    ) -> Result<Model, QueryError> {
        decoder
            .check_dim(dim)
            .map_err(|e| QueryError::Tables(e.to_string()))?;
        if let Entities::Resident(rows) = &entities
            && rows.len() != num_entities * dim
        {
            return Err(QueryError::Tables(format!(
                "the entity table holds {} floats, not whole rows of {dim}",
                rows.len()
            )));
        }
        if num_entities == 0 {
            return Err(QueryError::Tables("the run has no entities".into()));
        }
        let rows = num_relations * if reciprocal { 2 } else { 1 };
        let rw = decoder.relation_width(dim);
        if decoder.uses_relations() && relations.len() != rows * rw {
            return Err(QueryError::Tables(format!(
                "the relation table holds {} floats, expected {rows} rows of {rw}",
                relations.len()
            )));
        }
        Ok(Model {
            decoder,
            dim,
            num_entities,
            num_relations,
            reciprocal,
            relations,
            entities,
            gpu: None,
            store_rows: None,
            copied: Vec::new(),
        })
    }

    /// Moves the scans to `gpu` and, when they fit in `budget` bytes of its memory with a
    /// scan's buffers, the entity rows too (out of host memory); else the scans stream them
    /// from where they are. Tables in memory only ([`Model::in_memory`]): a run opened from
    /// its directory gets its GPU when opened.
    ///
    /// # Errors
    ///
    /// [`QueryError::Gpu`] when the device cannot be opened or the rows not copied;
    /// [`QueryError::Tables`] for a model whose rows are not in memory.
    pub fn use_gpu(&mut self, ordinal: usize, budget: u64) -> Result<(), QueryError> {
        let opened = crate::gpu::open_device(legend_engine::config::DeviceChoice::Cuda(ordinal))?
            .0
            .expect("a CUDA device opens or fails");
        let Some(rows) = self.host_rows() else {
            return Err(QueryError::Tables(
                "only a model whose rows are in memory moves to a GPU".into(),
            ));
        };
        if !OpenedGpu::fits(self.num_entities as u64, self.dim, budget) {
            self.gpu = Some(GpuScans::new(opened, None));
            return Ok(());
        }
        let mut table = EntityRows::new(&opened.gpu, self.num_entities, self.dim)
            .map_err(|e| opened.error(e))?;
        table
            .write(&opened.gpu, 0, rows)
            .map_err(|e| opened.error(e))?;
        self.entities = Entities::OnGpu;
        self.gpu = Some(GpuScans::new(opened, Some(table)));
        Ok(())
    }

    /// Where the model answers: `cpu`, or the GPU, where the entity rows are and how rows are
    /// looked up.
    pub fn placement(&self) -> String {
        let Some(gpu) = &self.gpu else {
            return "cpu".into();
        };
        let rows = match &self.entities {
            Entities::OnGpu => format!(
                "entity rows in GPU memory ({:.2} GiB)",
                EntityRows::bytes(self.num_entities, self.dim) as f64 / f64::from(1u32 << 30)
            ),
            Entities::Resident(_) => "entity rows in host memory, streamed by each scan".into(),
            Entities::Mapped(_) => {
                "entity rows mapped from the checkpoint, streamed by each scan".into()
            }
            Entities::Stored { .. } => "entity rows streamed from the run by each scan".into(),
        };
        let lookups = match &self.store_rows {
            Some(cache) => format!(
                "; rows looked up through a {:.0} MiB row cache over the store",
                cache.capacity_bytes() as f64 / f64::from(1u32 << 20)
            ),
            None => String::new(),
        };
        format!("{}: {rows}{lookups}", gpu.name())
    }

    /// Bytes of GPU memory the model holds: entity rows, row cache and a scan's buffers.
    pub fn gpu_bytes(&self) -> u64 {
        if self.gpu.is_none() {
            return 0;
        }
        let rows = match &self.entities {
            Entities::OnGpu => EntityRows::bytes(self.num_entities, self.dim),
            _ => 0,
        };
        let cache = self
            .store_rows
            .as_ref()
            .map_or(0, StoreRows::capacity_bytes);
        rows + cache + legend_cuda::scan::SCAN_WORKING_BYTES
    }

    /// The row cache's counters, when rows are looked up through it.
    pub fn cache_stats(&self) -> Option<legend_cuda::nvme_io::CacheStats> {
        self.store_rows.as_ref().and_then(StoreRows::stats)
    }

    /// The score function.
    pub fn decoder(&self) -> Decoder {
        self.decoder
    }

    /// Floats per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Entity rows.
    pub fn num_entities(&self) -> usize {
        self.num_entities
    }

    /// Whether the entity rows are in memory (the host's, mapped, or the GPU's).
    pub fn is_resident(&self) -> bool {
        matches!(
            self.entities,
            Entities::Resident(_) | Entities::Mapped(_) | Entities::OnGpu
        )
    }

    /// Whether the entity rows are the checkpoint file's pages, mapped in place.
    pub fn is_mapped(&self) -> bool {
        matches!(self.entities, Entities::Mapped(_))
    }

    /// The checkpoint file, when its rows were read into memory though they could have been
    /// mapped, with why (a served run's file that someone else may write).
    pub(crate) fn copied(&self) -> &[String] {
        &self.copied
    }

    /// The entity rows in host memory (held, or mapped), row-major.
    fn host_rows(&self) -> Option<&[f32]> {
        match &self.entities {
            Entities::Resident(rows) => Some(rows),
            Entities::Mapped(mapped) => Some(mapped.values()),
            Entities::Stored { .. } | Entities::OnGpu => None,
        }
    }

    /// Whether the entity rows are read from the run by each scan and lookup.
    pub fn is_streamed(&self) -> bool {
        matches!(self.entities, Entities::Stored { .. })
    }

    /// Bytes of host memory a streamed run's reads hold at most beside its tables (none for
    /// rows in memory): the lookups' open store (a partition's staging buffer) and one scan's
    /// pieces (two partitions and a staging buffer, or a block of a checkpoint file); scans
    /// take turns.
    pub fn stream_bytes(&self) -> u64 {
        match &self.entities {
            Entities::Stored { reader, .. } => {
                let reader = lock(reader);
                reader.held_bytes() + reader.stream_bytes()
            }
            Entities::Resident(_) | Entities::Mapped(_) | Entities::OnGpu => 0,
        }
    }

    /// Reads every entity row once, as a scan does, and drops them: a streamed run's check
    /// when it is served (a damaged checkpoint or an unreadable partition fails then, not at
    /// the first query).
    pub(crate) fn check_rows(&self) -> Result<(), QueryError> {
        self.scan(|_, _| {})
    }

    /// Bytes of the tables in host memory (mapped rows are the page cache's: not counted).
    pub fn resident_bytes(&self) -> usize {
        let entities = match &self.entities {
            Entities::Resident(rows) => rows.len(),
            Entities::Mapped(_) | Entities::Stored { .. } | Entities::OnGpu => 0,
        };
        (entities + self.relations.len()) * 4
    }

    /// Relation `r`'s row: the decoder's relation width (RESCAL's `dim²` matrix), empty for
    /// Dot.
    fn relation(&self, r: u32) -> &[f32] {
        let rw = self.decoder.relation_width(self.dim);
        &self.relations[r as usize * rw..][..rw]
    }

    fn check_entity(&self, id: u32, what: impl FnOnce() -> String) -> Result<(), QueryError> {
        if id as usize >= self.num_entities {
            return Err(QueryError::IdOutOfRange {
                what: what(),
                id,
                limit: self.num_entities,
            });
        }
        Ok(())
    }

    fn check_relation(&self, id: u32, what: impl FnOnce() -> String) -> Result<(), QueryError> {
        if id as usize >= self.num_relations {
            return Err(QueryError::IdOutOfRange {
                what: what(),
                id,
                limit: self.num_relations,
            });
        }
        Ok(())
    }

    /// Calls `piece(first_id, rows)` with every entity row in order, a piece at a time.
    fn scan(&self, mut piece: impl FnMut(usize, &[f32])) -> Result<(), QueryError> {
        match &self.entities {
            Entities::Resident(rows) => piece(0, rows),
            Entities::Mapped(mapped) => piece(0, mapped.values()),
            Entities::Stored { reader, .. } => {
                let mut first = 0;
                read_pieces(&mut lock(reader), self.dim, |rows| {
                    piece(first, rows);
                    first += rows.len() / self.dim;
                    Ok(())
                })?;
            }
            Entities::OnGpu => {
                let gpu = self.gpu.as_ref().expect("rows on a GPU have one");
                let state = gpu.lock();
                let table = state.rows.as_ref().expect("rows on a GPU are there");
                let per = (DOWNLOAD_BYTES / (self.dim * 4)).max(1);
                for first in (0..self.num_entities).step_by(per) {
                    let n = per.min(self.num_entities - first);
                    let rows = table.read(&state.gpu, first, n).map_err(|e| gpu.error(e))?;
                    piece(first, &rows);
                }
            }
        }
        Ok(())
    }

    /// The rows of `ids`, in their order.
    pub fn rows(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>, QueryError> {
        for (i, &id) in ids.iter().enumerate() {
            self.check_entity(id, || format!("row {i}"))?;
        }
        let dim = self.dim;
        if let (Entities::OnGpu, Some(gpu)) = (&self.entities, &self.gpu) {
            let state = gpu.lock();
            let table = state.rows.as_ref().expect("rows on a GPU are there");
            let rows = table.gather(&state.gpu, ids).map_err(|e| gpu.error(e))?;
            return Ok(rows.chunks_exact(dim).map(<[f32]>::to_vec).collect());
        }
        // A table out of GPU memory is looked up through the row cache over its store, even
        // when its rows are in host memory too (for the scans): the path that scales past host
        // memory, whose hit rate the serve job reports.
        if let Some(cache) = &self.store_rows {
            return cache.rows(ids);
        }
        match &self.entities {
            Entities::Resident(_) | Entities::Mapped(_) => {
                let rows = self.host_rows().expect("rows in host memory");
                Ok(ids
                    .iter()
                    .map(|&id| rows[id as usize * dim..][..dim].to_vec())
                    .collect())
            }
            // Only the rows asked for are read, not the table.
            Entities::Stored { reader, .. } => {
                let wide: Vec<u64> = ids.iter().map(|&id| u64::from(id)).collect();
                let mut flat = vec![0.0; ids.len() * dim];
                lock(reader).read_rows(&wide, &mut flat)?;
                Ok(flat.chunks_exact(dim).map(<[f32]>::to_vec).collect())
            }
            Entities::OnGpu => unreachable!("rows on a GPU are gathered there"),
        }
    }

    /// The score of each `[head, relation, tail]` triple: the score the evaluator gives the
    /// tail when it ranks the triple's destination side.
    pub fn score(&self, triples: &[[u32; 3]]) -> Result<Vec<f32>, QueryError> {
        for (i, &[h, r, t]) in triples.iter().enumerate() {
            self.check_entity(h, || format!("triple {i}, head"))?;
            self.check_relation(r, || format!("triple {i}, relation"))?;
            self.check_entity(t, || format!("triple {i}, tail"))?;
        }
        let ends: Vec<u32> = triples.iter().flat_map(|t| [t[0], t[2]]).collect();
        let rows = self.rows(&ends)?;
        let kernel = Kernel::new(self.decoder.comparator(), self.dim);
        let mut q = vec![0.0; self.dim];
        Ok(triples
            .iter()
            .zip(rows.chunks_exact(2))
            .map(|(t, ends)| {
                self.decoder
                    .query(Side::Dst, &ends[0], self.relation(t[1]), &mut q);
                kernel.one(&q, &ends[1])
            })
            .collect())
    }

    /// The `top` best entities for each completion, best first; with `filtered`, entities
    /// forming a triple of `filter` are left out (`filter` is needed then).
    pub fn complete(
        &self,
        queries: &[Completion],
        filter: Option<&FilterIndex>,
    ) -> Result<Vec<Vec<Ranked>>, QueryError> {
        for (i, c) in queries.iter().enumerate() {
            self.check_entity(c.anchor, || format!("query {i}, known end"))?;
            self.check_relation(c.relation, || format!("query {i}, relation"))?;
        }
        let anchors: Vec<u32> = queries.iter().map(|c| c.anchor).collect();
        let rows = self.rows(&anchors)?;
        let mut vectors = vec![0.0; queries.len() * self.dim];
        for ((c, row), q) in queries
            .iter()
            .zip(&rows)
            .zip(vectors.chunks_exact_mut(self.dim))
        {
            match (self.reciprocal, c.side) {
                (true, Side::Src) => self.decoder.query(
                    Side::Dst,
                    row,
                    self.relation(c.relation + self.num_relations as u32),
                    q,
                ),
                _ => self
                    .decoder
                    .query(c.side, row, self.relation(c.relation), q),
            }
        }
        let mut excluded: Vec<&[u32]> = Vec::with_capacity(queries.len());
        for c in queries {
            excluded.push(match (c.filtered, filter) {
                (false, _) => &[],
                (true, Some(f)) => f.candidates(c.side, c.anchor, c.relation),
                (true, None) => {
                    return Err(QueryError::Tables(
                        "a filtered query needs the index of known triples".into(),
                    ));
                }
            });
        }
        let tops: Vec<usize> = queries.iter().map(|c| c.top).collect();
        let kernel = Kernel::new(self.decoder.comparator(), self.dim);
        self.top_k(&vectors, &tops, &excluded, kernel, false)
    }

    /// The `top` nearest entities of each query's entity (itself left out), nearest first.
    pub fn nearest(&self, queries: &[Nearest]) -> Result<Vec<Vec<Ranked>>, QueryError> {
        let mut out = vec![Vec::new(); queries.len()];
        // One scan per metric in the batch: each compares rows its own way.
        for metric in [Metric::Cosine, Metric::Dot, Metric::L2] {
            let picked: Vec<usize> = (0..queries.len())
                .filter(|&i| queries[i].metric == metric)
                .collect();
            if picked.is_empty() {
                continue;
            }
            let ids: Vec<u32> = picked.iter().map(|&i| queries[i].entity).collect();
            let mut vectors = self.rows(&ids)?.concat();
            if metric == Metric::Cosine {
                vectors.chunks_exact_mut(self.dim).for_each(unit);
            }
            let singles: Vec<[u32; 1]> = ids.iter().map(|&id| [id]).collect();
            let excluded: Vec<&[u32]> = singles.iter().map(|s| &s[..]).collect();
            let tops: Vec<usize> = picked.iter().map(|&i| queries[i].top).collect();
            let kernel = Kernel::new(metric.comparator(), self.dim);
            let found = self.top_k(&vectors, &tops, &excluded, kernel, metric == Metric::Cosine)?;
            for (i, hits) in picked.into_iter().zip(found) {
                out[i] = hits;
            }
        }
        Ok(out)
    }

    /// The best `tops[q]` entities for each query vector, leaving out the sorted ids
    /// `excluded[q]`; candidate rows scaled to unit length first with `unit_rows`.
    fn top_k(
        &self,
        vectors: &[f32],
        tops: &[usize],
        excluded: &[&[u32]],
        kernel: Kernel,
        unit_rows: bool,
    ) -> Result<Vec<Vec<Ranked>>, QueryError> {
        if let Some(gpu) = &self.gpu
            && GpuScans::can_rank(&kernel, tops, self.num_entities)
        {
            let scoring = ScanScoring {
                comparator: kernel.comparator(),
                fused: kernel.fused(),
                unit_rows,
            };
            return self.top_k_gpu(gpu, scoring, vectors, (tops, excluded));
        }
        let dim = self.dim;
        let nq = tops.len();
        let fresh = || tops.iter().map(|&k| TopK::new(k)).collect::<Vec<_>>();
        let mut kept = fresh();
        self.scan(|first, rows| {
            let part = rows
                .par_chunks(CANDIDATE_BLOCK * dim)
                .enumerate()
                .fold(
                    || (fresh(), Vec::new(), Vec::new()),
                    |(mut tops, mut scores, mut scaled), (b, block)| {
                        let width = block.len() / dim;
                        let base = first + b * CANDIDATE_BLOCK;
                        let block = if unit_rows {
                            scaled.clear();
                            scaled.extend_from_slice(block);
                            scaled.chunks_exact_mut(dim).for_each(unit);
                            &scaled[..]
                        } else {
                            block
                        };
                        scores.resize(nq * width, 0.0);
                        kernel.block(vectors, block, &mut scores);
                        for ((top, row), skip) in tops
                            .iter_mut()
                            .zip(scores.chunks_exact(width))
                            .zip(excluded)
                        {
                            offer_row(top, row, base, skip);
                        }
                        (tops, scores, scaled)
                    },
                )
                .map(|(tops, _, _)| tops)
                .reduce(fresh, |mut a, b| {
                    a.iter_mut().zip(b).for_each(|(a, b)| a.merge(b));
                    a
                });
            kept.iter_mut().zip(part).for_each(|(a, b)| a.merge(b));
        })?;
        Ok(kept.into_iter().map(TopK::into_sorted).collect())
    }
}

impl Model {
    /// [`Model::top_k`] on the GPU: the resident table scanned there, or the rows streamed to
    /// it from where they are; at most [`SCAN_MAX_QUERIES`] queries a scan.
    fn top_k_gpu(
        &self,
        gpu: &GpuScans,
        scoring: ScanScoring,
        vectors: &[f32],
        (tops, excluded): (&[usize], &[&[u32]]),
    ) -> Result<Vec<Vec<Ranked>>, QueryError> {
        let dim = self.dim;
        let mut state = gpu.lock();
        let state = &mut *state;
        let mut out = Vec::with_capacity(tops.len());
        for (g, group) in tops.chunks(SCAN_MAX_QUERIES).enumerate() {
            let q = g * SCAN_MAX_QUERIES..g * SCAN_MAX_QUERIES + group.len();
            let queries = &vectors[q.start * dim..q.end * dim];
            let mut scan = Scan::new(&state.gpu, scoring, queries, dim, group, &excluded[q])
                .map_err(|e| gpu.error(e))?;
            match state.rows.as_mut() {
                Some(table) => scan.resident(table).map_err(|e| gpu.error(e))?,
                None => {
                    let mut failed = None;
                    self.scan(|_, rows| {
                        if failed.is_none() {
                            failed = scan.host_rows(rows).err();
                        }
                    })?;
                    if let Some(e) = failed {
                        return Err(gpu.error(e));
                    }
                }
            }
            let found = scan.finish().map_err(|e| gpu.error(e))?;
            out.extend(found.into_iter().map(|hits| {
                hits.into_iter()
                    .map(|(id, score)| Ranked { id, score })
                    .collect::<Vec<_>>()
            }));
        }
        Ok(out)
    }
}

/// Offers the scores of candidates `base..base + row.len()` to `top`, except the sorted ids in
/// `skip`.
fn offer_row(top: &mut TopK, row: &[f32], base: usize, skip: &[u32]) {
    let mut skip = &skip[skip.partition_point(|&e| (e as usize) < base)..];
    for (j, &score) in row.iter().enumerate() {
        let id = (base + j) as u32;
        if skip.first() == Some(&id) {
            skip = &skip[1..];
            continue;
        }
        top.offer(Ranked { id, score });
    }
}

/// Scales `row` to unit length (a zero row stays zero).
fn unit(row: &mut [f32]) {
    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        row.iter_mut().for_each(|x| *x /= norm);
    }
}
