//! Incremental training: a run on a dataset grown by `legendctl import --extend` seeded from a
//! run on its base (`legendctl train --init-from RUN`).
//!
//! The grown dataset keeps every id of its base and numbers the new entities and relations
//! after them, so the carry-over is a prefix copy: the init run's rows are streamed in id
//! order (a checkpoint file a piece at a time, a store a partition at a time) into the new
//! run's partitions, laid out for the new entity count, and each partition is written to the
//! new run's store as soon as it is complete; only one partition is held. The new rows are
//! drawn as a new run's would be (`training.new_rows = "init"`), or are the mean of the rows of
//! their neighbours in the added train edges that the init run trained (`"neighbours"`).
//! Relations are carried the same way (their inverse half moved after the new relations).
//!
//! What then trains (`training.freeze`, `training.replay`): every row on every edge (the
//! default); the new rows only, on the added edges that touch one (`freeze = "existing"`: a
//! row or relation below the init run's counts is never stepped, which with append-only ids
//! is a comparison, [`Frozen`]); or the added edges with a sample of the base's.
//!
//! The carry-over happens whenever the run starts from its beginning (created, or resumed
//! before its first checkpoint): it is idempotent, so a run stopped in it resumes.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use legend_dataset::{Dataset, Edge, PartitionScheme, Split};
use legend_fs::Guard;
use serde::{Deserialize, Serialize};

use crate::config::{Config, Freeze, NewRows};
use crate::relations::Relations;
use crate::run::{self, RunMeta};
use crate::session::SessionError;
use crate::store::PartitionStore;
use crate::which_tables::{self, Pick};

/// What a seeded run records of its init run (`run.toml`'s `init_from`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitFrom {
    /// The init run's directory (absolute): the one whose lock is checked.
    pub run: PathBuf,
    /// The directory holding the tables carried over: the run's, or its best validated
    /// epoch's (`RUN/best`).
    pub tables: PathBuf,
    /// The epoch of those tables.
    pub epoch: u32,
    /// The init run's entities: ids below are carried over (and frozen with
    /// `training.freeze = "existing"`).
    pub entities: u64,
    /// The init run's relation types (the dataset's, not the table's rows).
    pub relations: u64,
    /// The base's train edges: the dataset's train edges after them are the added ones.
    pub base_train_edges: u64,
}

/// The rows `training.freeze = "existing"` keeps fixed: entity ids below `entities`, and the
/// relation rows of relation types below `relations` (forward and, with reciprocal relations,
/// inverse: row `i` is type `i % relation_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frozen {
    /// Entities below this id are fixed.
    pub entities: u32,
    /// Relation types below this are fixed.
    pub relations: u32,
    /// The dataset's relation types: a relation row's type is its index modulo this.
    pub relation_types: u32,
}

impl Frozen {
    /// Whether entity row `id` stays fixed.
    pub fn entity(&self, id: u32) -> bool {
        id < self.entities
    }

    /// Whether relation row `row` stays fixed.
    pub fn relation_row(&self, row: u32) -> bool {
        row % self.relation_types.max(1) < self.relations
    }
}

/// The run `init` names for seeding a run of `config` on `dataset`, checked: its tables (its
/// best validated epoch's when it kept them) match `config`'s model, `dataset` extends the
/// dataset it was trained on, and no process trains it now. Nothing is written.
pub fn check_init_run(
    init: &Path,
    config: &Config,
    dataset: &Dataset,
) -> Result<InitFrom, SessionError> {
    let refuse =
        |why: String| SessionError::Refused(format!("--init-from {}: {why}", init.display()));
    let _lock = lock_shared(init)?;
    let tables = which_tables::choose(init, Pick::Best)?;
    let meta = run::read_meta(&run::open(&tables.dir)?)?;
    if meta.checkpoint.is_empty() && meta.store.is_none() {
        return Err(refuse(
            "the run has no checkpoint yet: nothing to carry over".into(),
        ));
    }
    if tables.cut.is_some() {
        tracing::warn!(
            "--init-from {}: its last checkpoint was taken inside epoch {}: the rows carried over are that point's",
            init.display(),
            tables.epoch + 1
        );
    }
    let mismatch = if meta.decoder != config.decoder().name() {
        Some(format!(
            "it trained {} and this run's model.decoder is {}",
            meta.decoder,
            config.decoder()
        ))
    } else if meta.dim != config.model.dim {
        Some(format!(
            "its rows have d = {} and this run's model.dim is {}",
            meta.dim, config.model.dim
        ))
    } else if meta.reciprocal_relations
        != (config.model.reciprocal_relations && config.decoder().uses_relations())
    {
        Some(format!(
            "its model.reciprocal_relations is {} and this run's is {}",
            meta.reciprocal_relations, config.model.reciprocal_relations
        ))
    } else {
        None
    };
    if let Some(why) = mismatch {
        return Err(refuse(format!(
            "{why}: a run seeds only a run of the same model (storage.dtype and optimizer.state may differ: rows are converted)"
        )));
    }
    let m = dataset.meta();
    let (entities, relations, base_train_edges) = match &m.extends {
        Some(base) if base.base_identity == meta.dataset_identity => {
            (base.entities, base.relations, base.splits.train)
        }
        // The same dataset: every row is carried, none is new.
        _ if format!("{:032x}", m.identity()) == meta.dataset_identity => {
            (m.entities, m.relations, m.splits.train)
        }
        _ => {
            return Err(refuse(format!(
                "it was trained on {} (identity {}), which {} does not extend: grow that dataset with `legendctl import --extend {} --add FILE -o NEW` (ids must be kept for rows to be carried over)",
                meta.dataset.display(),
                meta.dataset_identity,
                dataset.dir().display(),
                meta.dataset.display()
            )));
        }
    };
    if meta.entities != entities {
        return Err(refuse(format!(
            "its tables have {} entity rows but its dataset {entities} entities",
            meta.entities
        )));
    }
    let run = std::fs::canonicalize(init).map_err(|source| run::RunError::Io {
        path: init.to_owned(),
        source,
    })?;
    let tables_dir = std::fs::canonicalize(&tables.dir).unwrap_or(tables.dir);
    Ok(InitFrom {
        run,
        tables: tables_dir,
        epoch: tables.epoch,
        entities,
        relations,
        base_train_edges,
    })
}

/// A shared lock on the run directory `run`, refused at once when a process trains it (it
/// holds the run's lock: `legendctl train` and `legendd`'s train jobs): its tables are still
/// being written. Held while they are read.
pub fn lock_shared(run: &Path) -> Result<File, SessionError> {
    lock(run, File::try_lock_shared, || {
        format!(
            "--init-from {}: a process is training that run (it holds the run's lock): its tables are still being written; seed from it once it has stopped",
            run.display()
        )
    })
}

/// The exclusive lock of a process that trains the run `run` (see [`lock_shared`]); refused
/// when another process holds it.
pub fn lock_exclusive(run: &Path) -> Result<File, SessionError> {
    lock(run, File::try_lock, || {
        format!(
            "{}: another process trains or reads this run (it holds the run's lock); a run has one trainer at a time",
            run.display()
        )
    })
}

/// `run` opened and locked by `try_lock` (`flock` on the directory), or refused with `busy`.
fn lock(
    run: &Path,
    try_lock: fn(&File) -> Result<(), std::fs::TryLockError>,
    busy: impl FnOnce() -> String,
) -> Result<File, SessionError> {
    let io = |source| run::RunError::Io {
        path: run.to_owned(),
        source,
    };
    let dir = File::open(run).map_err(io)?;
    match try_lock(&dir) {
        Ok(()) => Ok(dir),
        Err(std::fs::TryLockError::WouldBlock) => Err(SessionError::Refused(busy())),
        Err(std::fs::TryLockError::Error(source)) => Err(io(source).into()),
    }
}

/// The rows `config` freezes in a run seeded by `init` on `dataset` (`None`: every row trains).
pub fn frozen(config: &Config, init: Option<&InitFrom>, dataset: &Dataset) -> Option<Frozen> {
    let init = init?;
    (config.training.freeze == Freeze::Existing).then(|| Frozen {
        entities: init.entities as u32,
        relations: init.relations as u32,
        relation_types: dataset.meta().relations as u32,
    })
}

/// The train edges a seeded run trains, when not all of them (`None`): with
/// `training.freeze = "existing"` the added edges that touch a new entity or relation; with
/// `training.replay` < 1 the added edges and that fraction of the base's, drawn once with
/// `training.seed`.
pub fn selected_edges(
    config: &Config,
    init: &InitFrom,
    dataset: &Dataset,
) -> Result<Option<Vec<Edge>>, SessionError> {
    let t = &config.training;
    if t.freeze == Freeze::Existing {
        let (e, r) = (init.entities as u32, init.relations as u32);
        let mut added = dataset.added_edges(Split::Train)?;
        added.retain(|&[s, rel, d]| s >= e || d >= e || rel >= r);
        return Ok(Some(added));
    }
    if t.replay >= 1.0 {
        return Ok(None);
    }
    let all = dataset.edges(Split::Train)?;
    let base = init.base_train_edges as usize;
    // A fixed draw per edge index: the same sample on every resume.
    let threshold = (t.replay * u64::MAX as f64) as u64;
    let keep = |i: usize| mix(t.seed ^ 0x7265_706c_6179, i as u64) < threshold;
    let mut edges: Vec<Edge> = all[..base]
        .iter()
        .enumerate()
        .filter(|&(i, _)| keep(i))
        .map(|(_, e)| *e)
        .collect();
    edges.extend_from_slice(&all[base..]);
    Ok(Some(edges))
}

/// A 64-bit hash of `(seed, i)` (SplitMix64's finaliser).
fn mix(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a carry-over did, for the log.
#[derive(Clone, Copy, Debug, Default)]
pub struct Carried {
    /// Entity rows carried over.
    pub rows: u64,
    /// New entity rows.
    pub new_rows: u64,
    /// New rows started from their neighbours' mean.
    pub from_neighbours: u64,
    /// Bytes read from the init run (embeddings and state at rest).
    pub bytes_read: u64,
    /// Partitions written.
    pub partitions: u32,
    /// Seconds it took.
    pub seconds: f64,
}

/// Writes every partition of `scheme` into `store` (the run `target`'s), the init run's rows
/// carried over and the new ones drawn (see the module), and returns the relations to start
/// from.
pub fn carry_over(
    target: &Path,
    store: &mut dyn PartitionStore,
    scheme: PartitionScheme,
    config: &Config,
    dataset: &Dataset,
    init: &InitFrom,
    guard: &dyn Guard,
) -> Result<(Relations, Carried), SessionError> {
    let started = Instant::now();
    let _lock = lock_shared(&init.run)?;
    let dir = run::open(&init.tables)?;
    let meta = run::read_meta(&dir)?;
    if meta.entities != init.entities || meta.epochs_completed != init.epoch {
        return Err(SessionError::Refused(format!(
            "--init-from {}: its tables changed since this run recorded them (epoch {} of {} rows, now epoch {} of {}): start the new run again",
            init.tables.display(),
            init.epoch,
            init.entities,
            meta.epochs_completed,
            meta.entities
        )));
    }
    let shape = config.entity_shape();
    let old_shape = meta.entity_shape();
    let t = &config.training;
    let draw = config.init();
    let old = init.entities;
    let mut means = match t.new_rows {
        NewRows::Init => None,
        NewRows::Neighbours => Some(NeighbourMeans::new(
            &dataset.added_edges(Split::Train)?,
            old,
            shape.dim,
        )),
    };
    let mut carried = Carried::default();
    let mut part = PartitionFill::new(target, scheme, shape);
    let mut reader = run::RunReader::open(&dir, &meta, guard, None)?;
    reader.stream_rows(t.carry_state, |emb, state| {
        let rows = emb.len() / shape.dim;
        for r in 0..rows {
            let id = part.next_id;
            let row = &emb[r * shape.dim..(r + 1) * shape.dim];
            if let Some(m) = &mut means {
                m.add(id, row);
            }
            let old_state =
                (!state.is_empty()).then(|| &state[r * old_shape.state..(r + 1) * old_shape.state]);
            part.push(row, old_state, store)?;
        }
        carried.rows += rows as u64;
        carried.bytes_read += (emb.len() * old_shape.dtype.bytes() + state.len() * 4) as u64;
        Ok(())
    })?;
    if carried.rows != old {
        return Err(run::RunError::Invalid {
            path: init.tables.clone(),
            message: format!("streamed {} rows, expected {old}", carried.rows),
        }
        .into());
    }
    let mut row = vec![0.0f32; shape.dim];
    for id in old..scheme.entities {
        draw.node_row(id, &mut row);
        if let Some(m) = &means
            && m.mean(id, &mut row)
        {
            carried.from_neighbours += 1;
        }
        part.push(&row, None, store)?;
    }
    carried.new_rows = scheme.entities - old;
    carried.partitions = scheme.num_partitions;
    let relations = carry_relations(&reader, &meta, config, dataset)?;
    carried.seconds = started.elapsed().as_secs_f64();
    Ok((relations, carried))
}

/// One partition of the new run being filled row by row in id order, written to the store
/// when complete.
struct PartitionFill {
    /// The new run, named in a store's error.
    target: PathBuf,
    scheme: PartitionScheme,
    shape: crate::rows::RowShape,
    p: u32,
    next_id: u64,
    emb: Vec<f32>,
    state: Vec<f32>,
}

impl PartitionFill {
    fn new(target: &Path, scheme: PartitionScheme, shape: crate::rows::RowShape) -> PartitionFill {
        PartitionFill {
            target: target.to_owned(),
            scheme,
            shape,
            p: 0,
            next_id: 0,
            emb: Vec::new(),
            state: Vec::new(),
        }
    }

    /// Appends the next row (`state`: the init run's, in its width; `None`: fresh, zero),
    /// writing the partition once it is complete.
    fn push(
        &mut self,
        emb: &[f32],
        state: Option<&[f32]>,
        store: &mut dyn PartitionStore,
    ) -> Result<(), run::RunError> {
        self.emb.extend_from_slice(emb);
        let width = self.shape.state;
        match state {
            None => self.state.resize(self.state.len() + width, 0.0),
            Some(s) if s.len() == width => self.state.extend_from_slice(s),
            // Element-wise to row-wise: one accumulator, the mean of the row's.
            Some(s) if width == 1 => self.state.push(s.iter().sum::<f32>() / s.len() as f32),
            // Row-wise to element-wise: the row's accumulator for each element.
            Some(s) => self.state.resize(self.state.len() + width, s[0]),
        }
        self.next_id += 1;
        if self.next_id == self.scheme.range(self.p).end {
            store
                .write(self.p, &self.emb, &self.state)
                .map_err(|e| run::RunError::Store {
                    path: self.target.clone(),
                    source: Box::new(e),
                })?;
            self.emb.clear();
            self.state.clear();
            self.p += 1;
        }
        Ok(())
    }
}

/// The sums of the old rows adjacent to each new entity in the added train edges.
struct NeighbourMeans {
    old: u64,
    dim: usize,
    /// `(old neighbour, new entity - old)`, sorted by neighbour: rows stream in id order.
    pairs: Vec<(u32, u32)>,
    next: usize,
    sums: Vec<f32>,
    counts: Vec<u32>,
}

impl NeighbourMeans {
    fn new(added: &[Edge], old: u64, dim: usize) -> NeighbourMeans {
        let o = old as u32;
        let mut pairs: Vec<(u32, u32)> = added
            .iter()
            .filter_map(|&[s, _, d]| match (s < o, d < o) {
                (true, false) => Some((s, d - o)),
                (false, true) => Some((d, s - o)),
                _ => None,
            })
            .collect();
        pairs.sort_unstable();
        let new = pairs.iter().map(|p| p.1 as usize + 1).max().unwrap_or(0);
        NeighbourMeans {
            old,
            dim,
            pairs,
            next: 0,
            sums: vec![0.0; new * dim],
            counts: vec![0; new],
        }
    }

    /// Adds old row `id` to the sums of the new entities it neighbours.
    fn add(&mut self, id: u64, row: &[f32]) {
        while let Some(&(n, new)) = self.pairs.get(self.next) {
            if u64::from(n) != id {
                break;
            }
            let sum = &mut self.sums[new as usize * self.dim..(new as usize + 1) * self.dim];
            for (a, b) in sum.iter_mut().zip(row) {
                *a += b;
            }
            self.counts[new as usize] += 1;
            self.next += 1;
        }
    }

    /// Writes new entity `id`'s mean into `row` when it has old neighbours.
    fn mean(&self, id: u64, row: &mut [f32]) -> bool {
        let new = (id - self.old) as usize;
        let Some(&count) = self.counts.get(new).filter(|&&c| c > 0) else {
            return false;
        };
        let sum = &self.sums[new * self.dim..(new + 1) * self.dim];
        for (r, s) in row.iter_mut().zip(sum) {
            *r = s / count as f32;
        }
        true
    }
}

/// The new run's relations: the init run's rows at their types (a reciprocal table's inverse
/// half moved after the new forward rows), the new types' rows drawn.
fn carry_relations(
    reader: &run::RunReader,
    meta: &RunMeta,
    config: &Config,
    dataset: &Dataset,
) -> Result<Relations, SessionError> {
    let types = dataset.meta().relations;
    let rows = config.relation_rows(types) as usize;
    let mut fresh = Relations::init(config.decoder(), rows, config.model.dim, &config.init());
    if rows == 0 {
        return Ok(fresh);
    }
    let width = meta.relation_width();
    let (emb, mut state) = reader.relation_tables()?;
    if !config.training.carry_state {
        state.clear();
    }
    let old_rows = meta.relations as usize;
    let (old_types, new_types) = if meta.reciprocal_relations {
        (old_rows / 2, types as usize)
    } else {
        (old_rows, types as usize)
    };
    for old_row in 0..old_rows {
        let new_row = if old_row < old_types {
            old_row
        } else {
            new_types + (old_row - old_types)
        };
        let (from, to) = (
            old_row * width..(old_row + 1) * width,
            new_row * width..(new_row + 1) * width,
        );
        fresh.emb[to.clone()].copy_from_slice(&emb[from.clone()]);
        if !state.is_empty() {
            fresh.state[to].copy_from_slice(&state[from]);
        }
    }
    Ok(fresh)
}
