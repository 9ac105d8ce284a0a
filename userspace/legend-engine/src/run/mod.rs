//! Run directories: the resolved configuration, metrics and atomically committed checkpoints.
//!
//! ```text
//! RUN/config.toml                 resolved configuration
//! RUN/metrics.jsonl               one JSON object per epoch (and the final evaluation)
//! RUN/run.toml                    the commit record: which checkpoint is current, shapes, CRCs
//! RUN/checkpoints/epoch-NNNNN/    entities.bin, entities.state.bin, relations.bin,
//!                                 relations.state.bin: raw little-endian f32, row-major
//! RUN/index/                      the label index (legend-query: kept when `legendctl train` ends, or by a query)
//! ```
//!
//! A checkpoint is written into `epoch-NNNNN.tmp/`, synced, renamed to a name no directory has
//! (`epoch-NNNNN`, else `epoch-NNNNN-2`, … when one of that epoch count is there: a cut inside
//! the next epoch, or a checkpoint taken again), and committed by replacing `run.toml`
//! (temporary file, fsync, rename); then the others are removed. A crash at any point leaves
//! the previous `run.toml` and the checkpoint it names intact.
//!
//! A store-backed run records its store in `run.toml` before making it (the members and the
//! store's identity, `store_creating = true`: the intent record) and clears the flag once it is
//! made, so that a crash in between leaves a run whose resume makes the store again, knowing
//! its half-made members by the identity and refusing anything else at those paths.
//!
//! Everything in a run directory is reached through its [`Dir`], opened once: beneath it,
//! never through a symbolic link (legendd writes runs that sit in their submitters'
//! directories; see legend-fs).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use legend_fs::{Access, Dir};
use legend_model::{Decoder, Dtype};
use serde::{Deserialize, Serialize};

pub use crate::rows::Tables;
pub use reader::{RunReader, StoreLayout};
pub use tables::{
    load_embeddings, load_entities, load_relations, load_tables, open_entity_file, stream_entities,
};

mod reader;
mod tables;

/// Version of the run directory layout.
pub const RUN_FORMAT_VERSION: u32 = 1;

/// The commit record `run.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunMeta {
    /// [`RUN_FORMAT_VERSION`].
    pub format_version: u32,
    /// The dataset directory (absolute).
    pub dataset: PathBuf,
    /// The dataset identity (hex) the run was trained on.
    pub dataset_identity: String,
    /// `model.decoder`.
    pub decoder: String,
    /// Floats per row.
    pub dim: usize,
    /// AdaGrad accumulators per entity row: `dim` (element-wise) or 1 (row-wise). Absent in
    /// runs from before row-wise state, which are element-wise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entity_state_width: Option<usize>,
    /// The entity embeddings' number format at rest (`storage.dtype`): in the store and in
    /// the checkpoint's `entities.bin`. Absent in f32 runs (and runs from before 16-bit rows).
    #[serde(
        default,
        with = "crate::config::by_name",
        skip_serializing_if = "is_f32"
    )]
    pub entity_dtype: Dtype,
    /// Rows of the entity tables.
    pub entities: u64,
    /// Rows of the relation tables (0 for Dot; twice the dataset's relations when
    /// `reciprocal_relations`).
    pub relations: u64,
    /// The relation tables hold inverse relations in their second half
    /// (`model.reciprocal_relations`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reciprocal_relations: bool,
    /// The version of the keys training draws its random streams from
    /// ([`crate::progress::BATCH_KEYS_VERSION`]); absent (0) in runs written before batch keys.
    #[serde(default)]
    pub batch_keys: u32,
    /// Epochs completed in the current checkpoint.
    pub epochs_completed: u32,
    /// Where the checkpoint stopped inside the next epoch, if it was interrupted there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<crate::progress::EpochCut>,
    /// The current checkpoint directory, relative to the run directory (memory backend).
    pub checkpoint: String,
    /// The store holding the checkpoint (file backend): its superblock is the commit record,
    /// and `epochs_completed` here is informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<PathBuf>,
    /// How the store is reached when it is behind NVMe queues (`nvme`, `proxy`): `store` is
    /// then the device node or the proxy's backing file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_queue: Option<crate::store::location::QueueLocation>,
    /// Every member of a store striped over several devices, in stripe order (`store` and
    /// `store_queue` are then its first); empty for a store on one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub store_members: Vec<crate::store::location::StoreMember>,
    /// The store's identity (32 hex digits), chosen by the run before it creates the store
    /// and written into every member's superblock: the store the run opens must carry it, and
    /// a creation the run did not finish is recognised by it. Absent in runs recorded before
    /// store identities were (their store opens whatever its identity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_id: Option<String>,
    /// The store named here is being created: the intent record, written before the store is
    /// made and cleared once it is. A resume makes it again (see [`RunMeta::store_record`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub store_creating: bool,
    /// CRC-32 of each table file of the checkpoint.
    pub checksums: TableChecksums,
    /// The run whose tables seeded this one (`legendctl train --init-from`), absent in a run
    /// that started from drawn rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<crate::incremental::InitFrom>,
}

/// CRC-32 of the four table files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableChecksums {
    /// `entities.bin`.
    pub entities: u32,
    /// `entities.state.bin`.
    pub entities_state: u32,
    /// `relations.bin`.
    pub relations: u32,
    /// `relations.state.bin`.
    pub relations_state: u32,
}

/// The four table files of a checkpoint.
pub const TABLE_FILES: [&str; 4] = [
    "entities.bin",
    "entities.state.bin",
    "relations.bin",
    "relations.state.bin",
];

impl RunMeta {
    /// A record of nothing yet: the current format and batch keys, every other field empty or
    /// zero (no epoch completed, no checkpoint, no store) for a new run to fill in what it is.
    pub fn blank() -> RunMeta {
        RunMeta {
            format_version: RUN_FORMAT_VERSION,
            dataset: PathBuf::new(),
            dataset_identity: String::new(),
            decoder: String::new(),
            dim: 0,
            entity_state_width: None,
            entity_dtype: Dtype::F32,
            entities: 0,
            relations: 0,
            reciprocal_relations: false,
            batch_keys: crate::progress::BATCH_KEYS_VERSION,
            epochs_completed: 0,
            cut: None,
            checkpoint: String::new(),
            store: None,
            store_queue: None,
            store_members: Vec::new(),
            store_id: None,
            store_creating: false,
            checksums: TableChecksums::default(),
            init_from: None,
        }
    }

    /// The members of the run's store, when it has one: `store_members`, or the one member
    /// `store` and `store_queue` name.
    pub fn recorded_members(&self) -> Option<Vec<crate::store::location::StoreMember>> {
        if !self.store_members.is_empty() {
            return Some(self.store_members.clone());
        }
        let path = self.store.clone()?;
        Some(vec![crate::store::location::StoreMember {
            path,
            queue: self.store_queue,
        }])
    }

    /// What the record says of the run's store (`run` names run.toml in errors): made (open
    /// it, expecting its identity if recorded), or not yet made, or its creation interrupted
    /// (make it, with the recorded identity, else a new one).
    pub fn store_record(&self, run: &Path) -> Result<StoreRecord, RunError> {
        let id = match &self.store_id {
            Some(hex) => Some(
                u128::from_str_radix(hex, 16)
                    .map_err(|_| invalid(&meta_path(run), format!("bad store_id {hex:?}")))?
                    .to_le_bytes(),
            ),
            None => None,
        };
        Ok(match (&self.store, self.store_creating) {
            (Some(_), false) => StoreRecord::Made(id),
            _ => StoreRecord::ToCreate(id.unwrap_or_else(legend_storage::new_store_id)),
        })
    }

    /// Records `members` (canonical paths: their directories resolved, the names as given,
    /// which are never followed as links) as the run's store of identity `id`, being created
    /// (the intent record: `store_creating` is cleared once it is made).
    pub fn record_store_intent(
        &mut self,
        members: &[crate::store::location::StoreMember],
        id: [u8; 16],
    ) -> Result<(), RunError> {
        let canonical = members
            .iter()
            .map(|m| {
                let (dir, name) = match (m.path.parent(), m.path.file_name()) {
                    (Some(dir), Some(name)) => (dir, name),
                    _ => return Err(invalid(&m.path, "names no file")),
                };
                let dir = if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                };
                Ok(crate::store::location::StoreMember {
                    path: std::fs::canonicalize(dir).map_err(io(dir))?.join(name),
                    queue: m.queue,
                })
            })
            .collect::<Result<Vec<_>, RunError>>()?;
        self.store = Some(canonical[0].path.clone());
        self.store_queue = canonical[0].queue;
        self.store_members = if canonical.len() > 1 {
            canonical
        } else {
            Vec::new()
        };
        self.store_id = Some(legend_storage::store_id_hex(id));
        self.store_creating = true;
        Ok(())
    }

    /// Floats of a relation row: the decoder's [`Decoder::relation_width`] (RESCAL's
    /// `dim²`), or `dim` for a decoder this build does not know (its tables then fail their
    /// size check, naming the file).
    pub fn relation_width(&self) -> usize {
        self.decoder
            .parse::<Decoder>()
            .map_or(self.dim, |d| d.relation_width(self.dim))
    }

    /// Floats of the relation table: [`RunMeta::relation_width`] times its rows.
    pub fn relation_floats(&self) -> usize {
        self.relations as usize * self.relation_width()
    }

    /// Floats of an entity row: its embedding and its AdaGrad state.
    pub fn entity_shape(&self) -> crate::rows::RowShape {
        crate::rows::RowShape {
            dim: self.dim,
            state: self.entity_state_width.unwrap_or(self.dim),
            dtype: self.entity_dtype,
        }
    }
}

/// What a run's record says of its store ([`RunMeta::store_record`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreRecord {
    /// Made and recorded: open it, expecting this identity (`None`: recorded before store
    /// identities were).
    Made(Option<[u8; 16]>),
    /// Not made, or its creation was interrupted: make it with this identity, recording the
    /// intent first.
    ToCreate([u8; 16]),
}

impl StoreRecord {
    /// The identity the store has or gets.
    pub fn store_id(self) -> Option<[u8; 16]> {
        match self {
            StoreRecord::Made(id) => id,
            StoreRecord::ToCreate(id) => Some(id),
        }
    }
}

fn is_f32(dtype: &Dtype) -> bool {
    *dtype == Dtype::F32
}

/// A run-directory error, naming the path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// An I/O error.
    #[error("{path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A directory without `run.toml`.
    #[error("{} {why}", dir.display())]
    NotARun {
        /// The directory.
        dir: PathBuf,
        /// What it is instead, and what to give.
        why: &'static str,
    },
    /// The run's store failed.
    #[error("{}", path.display())]
    Store {
        /// The store (its first member).
        path: PathBuf,
        /// Why (boxed: a store's errors are large, and rare).
        #[source]
        source: Box<crate::store::PartitionStoreError>,
    },
    /// A damaged or foreign run directory.
    #[error("{path}: {message}")]
    Invalid {
        /// The path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        path: path.to_owned(),
        source,
    }
}

fn invalid(path: &Path, message: impl Into<String>) -> RunError {
    RunError::Invalid {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// A store's error as the run's, naming the store `path`.
fn store_error(path: &Path) -> impl FnOnce(crate::store::PartitionStoreError) -> RunError + '_ {
    move |source| RunError::Store {
        path: path.to_owned(),
        source: Box::new(source),
    }
}

/// The error for a directory without `run.toml`, saying what it is instead where that is clear.
fn not_a_run(dir: &Path) -> RunError {
    let why = if !dir.exists() {
        "does not exist (expected a training run directory, with run.toml)"
    } else if dir.join(legend_dataset::META_FILE).is_file() {
        "is not a training run directory (no run.toml): it is a dataset; give the directory `legendctl train --out` created"
    } else {
        "is not a training run directory (no run.toml)"
    };
    RunError::NotARun {
        dir: dir.to_owned(),
        why,
    }
}

/// The commit record's file name.
pub const META_FILE: &str = "run.toml";

/// The resolved configuration's file name.
pub const CONFIG_FILE: &str = "config.toml";

/// Path of `run.toml` in `run`, for messages.
fn meta_path(run: &Path) -> PathBuf {
    run.join(META_FILE)
}

/// Opens the run directory `run` (to read it: see [`Dir::open`]); a missing directory is
/// [`RunError::NotARun`].
pub fn open(run: &Path) -> Result<Dir, RunError> {
    Dir::open(run).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => not_a_run(run),
        _ => io(run)(e),
    })
}

/// The resolved configuration of `run` (its `config.toml`).
pub fn read_config(run: &Dir) -> Result<crate::Config, RunError> {
    let text = run
        .read_to_string(CONFIG_FILE)
        .map_err(io(&run.join(CONFIG_FILE)))?;
    crate::Config::parse_recorded(&text, &[])
        .map_err(|e| invalid(&run.join(CONFIG_FILE), e.to_string()))
}

/// The sampled negatives run `run` evaluates with (its `[evaluation]` section): what a later
/// evaluation of the run uses unless asked otherwise, so that it reproduces the run's figures.
pub fn evaluation_negatives(run: &Dir) -> Result<legend_eval::SampledNegatives, RunError> {
    let e = read_config(run)?.evaluation;
    Ok(legend_eval::SampledNegatives {
        uniform: e.uniform_negatives,
        degree: e.degree_negatives,
        seed: e.seed,
    })
}

/// Reads the commit record of `run`.
pub fn read_meta(run: &Dir) -> Result<RunMeta, RunError> {
    let path = run.join(META_FILE);
    if !run.is_file(META_FILE).map_err(io(&path))? {
        return Err(not_a_run(run.path()));
    }
    let text = run.read_to_string(META_FILE).map_err(io(&path))?;
    let meta: RunMeta =
        toml::from_str(&text).map_err(|e| invalid(&path, format!("not a run record: {e}")))?;
    if meta.format_version != RUN_FORMAT_VERSION {
        return Err(invalid(
            &path,
            format!("run format {} is not supported", meta.format_version),
        ));
    }
    Ok(meta)
}

/// A table file being written: streamed, checksummed, synced.
pub struct TableWriter {
    path: PathBuf,
    out: BufWriter<File>,
    crc: crc32fast::Hasher,
    /// The file's number format (the entity embeddings': `storage.dtype`; f32 otherwise).
    dtype: Dtype,
    /// Narrowed rows on their way out.
    narrowed: Vec<u8>,
}

impl TableWriter {
    fn create(dir: &Dir, name: &str, dtype: Dtype) -> Result<TableWriter, RunError> {
        let path = dir.join(name);
        let file = dir.open_file(name, Access::CreateNew).map_err(io(&path))?;
        Ok(TableWriter {
            out: BufWriter::with_capacity(1 << 20, file),
            crc: crc32fast::Hasher::new(),
            path,
            dtype,
            narrowed: Vec::new(),
        })
    }

    /// Appends rows (in a 16-bit file, rows the engine rounded: the narrowing is exact).
    pub fn write(&mut self, values: &[f32]) -> Result<(), RunError> {
        let bytes: &[u8] = if self.dtype.is_narrow() {
            self.narrowed.resize(values.len() * self.dtype.bytes(), 0);
            self.dtype.narrow(values, &mut self.narrowed);
            &self.narrowed
        } else {
            bytemuck::cast_slice(values)
        };
        self.crc.update(bytes);
        self.out.write_all(bytes).map_err(io(&self.path))
    }

    fn finish(self) -> Result<u32, RunError> {
        let file = self.out.into_inner().map_err(|e| RunError::Io {
            path: self.path.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io(&self.path))?;
        Ok(self.crc.finalize())
    }
}

/// Writes and commits a checkpoint of `meta.epochs_completed` epochs.
///
/// `write_entities` streams the entity embeddings and state into the two writers (partition
/// by partition, so the whole table never needs to be in memory).
pub fn commit_checkpoint<E: From<RunError>>(
    run: &Dir,
    mut meta: RunMeta,
    relations: (&[f32], &[f32]),
    write_entities: impl FnOnce(&mut TableWriter, &mut TableWriter) -> Result<(), E>,
) -> Result<RunMeta, E> {
    let dir = run
        .create_dir_all("checkpoints")
        .map_err(io(&run.join("checkpoints")))?;
    // A name no directory has, so that the checkpoint run.toml names is never removed or
    // replaced before run.toml names the new one (a crash there would leave a record naming
    // nothing, or tables its checksums do not match): a checkpoint cut inside the next epoch,
    // or one taken again at the same point after a resume, has the same epoch count.
    let base = format!("epoch-{:05}", meta.epochs_completed);
    let mut name = base.clone();
    for n in 2.. {
        if !dir.exists(&name).map_err(io(&dir.join(&name)))? {
            break;
        }
        name = format!("{base}-{n}");
    }
    let tmp_name = format!("{name}.tmp");
    dir.clear(&tmp_name).map_err(io(&dir.join(&tmp_name)))?;
    let tmp = dir
        .create_dir(&tmp_name)
        .map_err(io(&dir.join(&tmp_name)))?;
    let dtypes = [meta.entity_dtype, Dtype::F32, Dtype::F32, Dtype::F32];
    let [e, es, r, rs] = [0, 1, 2, 3].map(|i| TableWriter::create(&tmp, TABLE_FILES[i], dtypes[i]));
    let (mut e, mut es, mut r, mut rs) = (e?, es?, r?, rs?);
    write_entities(&mut e, &mut es)?;
    r.write(relations.0)?;
    rs.write(relations.1)?;
    meta.checksums = TableChecksums {
        entities: e.finish()?,
        entities_state: es.finish()?,
        relations: r.finish()?,
        relations_state: rs.finish()?,
    };
    tmp.sync().map_err(io(tmp.path()))?;
    dir.rename(&tmp_name, &name).map_err(io(&dir.join(&name)))?;
    dir.sync().map_err(io(dir.path()))?;
    meta.checkpoint = format!("checkpoints/{name}");
    write_atomically(
        run,
        META_FILE,
        toml::to_string_pretty(&meta)
            .expect("serializes")
            .as_bytes(),
    )?;
    // Older checkpoints are no longer named by run.toml.
    for entry in dir.entries(".").map_err(io(dir.path()))? {
        if entry != name.as_str() {
            dir.remove_all(&entry).map_err(io(&dir.join(&entry)))?;
        }
    }
    Ok(meta)
}

/// Writes `bytes` to `name` in `dir` through a synced temporary file and a rename.
pub fn write_atomically(dir: &Dir, name: &str, bytes: &[u8]) -> Result<(), RunError> {
    dir.write_atomically(name, bytes)
        .map_err(io(&dir.join(name)))
}

/// The store identity of a dataset identity in hex.
pub fn dataset_id(hex: &str, context: &Path) -> Result<legend_storage::DatasetId, RunError> {
    let id = u128::from_str_radix(hex, 16)
        .map_err(|_| invalid(context, format!("bad dataset identity {hex:?}")))?;
    Ok(legend_storage::DatasetId {
        id: id.to_le_bytes(),
        label: hex.chars().take(12).collect(),
    })
}
