//! A trained run opened from Python: its record, labels, tables (memory-mapped where the file
//! allows) and queries (legend-query, answered without the GIL).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use legend_dataset::Dataset;
use legend_engine::config::DeviceChoice;
use legend_engine::evaluation::open_run_dataset;
use legend_engine::run::{self, RunError, RunMeta, RunReader};
use legend_fs::{Dir, Unguarded};
use legend_query::{GpuOptions, Query, QueryRun, Residency};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::{Kind, OrRaise, ToPy, bad_argument, raise, raise_message};
use crate::table::{Rows, Table};

/// Queries answered in one scan of the run's entities (as `legendctl` batches a file of them).
const BATCH: usize = 1024;

/// Where a run's query engine is.
enum State {
    /// Not opened yet: the first query opens it (reading the rows in, or onto the GPU).
    Unopened,
    /// Open, shared by the queries under way.
    Open(Arc<QueryRun>),
    /// Closed by `close()`.
    Closed,
}

/// A run directory opened for reading (Python's `legend.Run` wraps it).
#[pyclass(frozen, module = "legend._legend")]
pub struct RunHandle {
    path: PathBuf,
    /// The run's dataset, when it moved since training.
    dataset: Option<PathBuf>,
    gpu: GpuOptions,
    residency: Residency,
    state: Mutex<State>,
}

/// Why a copy of the run's entity rows (16-bit at rest, or in a store) is refused, when it
/// would not fit in the memory available.
fn too_large(meta: &RunMeta, path: &Path) -> Option<String> {
    let bytes = meta
        .entities
        .saturating_mul(meta.dim as u64)
        .saturating_mul(4);
    let available = legend_engine::footprint::available_bytes()?;
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    (bytes > available).then(|| {
        format!(
            "{}: its entity rows take {:.2} GiB in f32, more than the {:.2} GiB of memory available \
             (they are {}): read the rows you need with Run.rows(), or export them to a file \
             (legendctl export)",
            path.display(),
            gib(bytes),
            gib(available),
            if meta.store.is_some() {
                "in a store, so they are copied out"
            } else {
                "16-bit at rest, so they are widened into a copy"
            }
        )
    })
}

/// Whether `e` is a file that a newer checkpoint replaced while it was being opened.
fn replaced(e: &RunError) -> bool {
    matches!(e, RunError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// The run's current entity rows: the checkpoint file mapped read-only when it holds f32 rows
/// (no copy), else copied (widened from 16 bits, or streamed from the store). `verify` checks a
/// mapped file's checksum (a pass over it; copies are checked as they are read).
fn entity_rows(path: &Path, verify: bool) -> Result<Table, ReadError> {
    // A training run on the same directory may commit a newer checkpoint (and remove this one)
    // between the record's read and the file's open: read the record again then.
    let mut attempts = 0;
    loop {
        let dir = run::open(path)?;
        let meta = run::read_meta(&dir)?;
        if meta.store.is_none() && meta.checkpoint.is_empty() {
            return Err(ReadError::Run(RunError::Invalid {
                path: path.to_owned(),
                message: "has no checkpoint yet: nothing was trained (resume it with legend.train)"
                    .into(),
            }));
        }
        let result = if meta.store.is_none() && !meta.entity_dtype.is_narrow() {
            mapped_rows(&dir, &meta, verify)
        } else if let Some(why) = too_large(&meta, path) {
            return Err(ReadError::TooLarge(why));
        } else {
            copied_rows(&dir, &meta)
        };
        attempts += 1;
        match result {
            Err(e) if replaced(&e) && attempts < 3 => continue,
            other => return Ok(other?),
        }
    }
}

fn mapped_rows(dir: &Dir, meta: &RunMeta, verify: bool) -> Result<Table, RunError> {
    let (file, path) = run::open_entity_file(dir, meta)?;
    let io = |source| RunError::Io {
        path: path.clone(),
        source,
    };
    let len = file.metadata().map_err(io)?.len();
    if len == 0 {
        return Ok(Table::new(Rows::F32(Vec::new()), meta.dim));
    }
    // SAFETY: a checkpoint's table file is written once, under a temporary directory name,
    // and never changed after the rename that commits it: a later checkpoint is a new file and
    // this one is unlinked, not truncated, so the mapped pages keep their contents.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    if verify && crc32fast::hash(&map) != meta.checksums.entities {
        return Err(RunError::Invalid {
            path,
            message: "checksum mismatch: the checkpoint is damaged".into(),
        });
    }
    Ok(Table::new(Rows::Mapped(map), meta.dim))
}

fn copied_rows(dir: &Dir, meta: &RunMeta) -> Result<Table, RunError> {
    let mut rows = Vec::with_capacity(meta.entities as usize * meta.dim);
    run::stream_entities(dir, meta, &Unguarded, |block| {
        rows.extend_from_slice(block);
        Ok(())
    })?;
    Ok(Table::new(Rows::F32(rows), meta.dim))
}

impl RunHandle {
    /// The query engine, opened on first use (`py` detached: it may read the whole table).
    fn queries(&self) -> Result<Arc<QueryRun>, Opening> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &*state {
            State::Open(q) => Ok(q.clone()),
            State::Closed => Err(Opening::Closed),
            State::Unopened => {
                let q = QueryRun::open_on(
                    &self.path,
                    self.dataset.as_deref(),
                    &Unguarded,
                    self.residency,
                    &self.gpu,
                )
                .map_err(Opening::Failed)?;
                let q = Arc::new(q);
                *state = State::Open(q.clone());
                Ok(q)
            }
        }
    }

    fn check_open(&self, py: Python<'_>) -> PyResult<()> {
        let closed = py.detach(|| {
            matches!(
                *self.state.lock().unwrap_or_else(|e| e.into_inner()),
                State::Closed
            )
        });
        if closed {
            return Err(self.closed_error());
        }
        Ok(())
    }

    fn closed_error(&self) -> PyErr {
        PyValueError::new_err(format!("the run {} is closed", self.path.display()))
    }

    fn dataset(&self) -> Result<Dataset, ReadError> {
        let dir = run::open(&self.path)?;
        let meta = run::read_meta(&dir)?;
        Ok(open_run_dataset(
            &meta,
            self.dataset.as_deref(),
            &Unguarded,
        )?)
    }
}

/// Why the query engine is not there.
enum Opening {
    Closed,
    Failed(legend_query::QueryError),
}

/// Why a run's tables or labels could not be read (met without the GIL, raised with it).
pub enum ReadError {
    /// The run's.
    Run(RunError),
    /// Its dataset's.
    Dataset(legend_engine::evaluation::EvaluationError),
    /// A labels file's.
    Labels(legend_dataset::DatasetError),
    /// The entity rows must be copied and do not fit in memory (the message says so).
    TooLarge(String),
}

impl From<RunError> for ReadError {
    fn from(e: RunError) -> Self {
        ReadError::Run(e)
    }
}

impl From<legend_engine::evaluation::EvaluationError> for ReadError {
    fn from(e: legend_engine::evaluation::EvaluationError) -> Self {
        ReadError::Dataset(e)
    }
}

impl From<legend_dataset::DatasetError> for ReadError {
    fn from(e: legend_dataset::DatasetError) -> Self {
        ReadError::Labels(e)
    }
}

impl ToPy for ReadError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        match self {
            ReadError::Run(e) => e.to_py(py),
            ReadError::Dataset(e) => raise(py, Kind::Dataset, e),
            ReadError::Labels(e) => e.to_py(py),
            ReadError::TooLarge(why) => raise_message(py, Kind::Run, why.clone()),
        }
    }
}

#[pymethods]
impl RunHandle {
    /// Opens the run directory `path` (its record is read now: a directory that is not a run
    /// fails here); `dataset` names its dataset if it moved; queries answer on `device`
    /// (`cpu`, `cuda:N`, `auto`), their rows `streamed` from the run for every batch if asked.
    #[new]
    #[pyo3(signature = (path, dataset=None, device="auto", streamed=false, cache_fraction=legend_query::DEFAULT_CACHE_FRACTION))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        dataset: Option<PathBuf>,
        device: &str,
        streamed: bool,
        cache_fraction: f64,
    ) -> PyResult<RunHandle> {
        let device: DeviceChoice = device.parse().map_err(bad_argument)?;
        if !(0.0..=1.0).contains(&cache_fraction) {
            return Err(PyValueError::new_err(format!(
                "cache_fraction {cache_fraction} is not between 0 and 1"
            )));
        }
        py.detach(|| run::open(&path).and_then(|dir| run::read_meta(&dir)))
            .or_raise(py)?;
        Ok(RunHandle {
            path,
            dataset,
            gpu: GpuOptions {
                cache_fraction,
                ..GpuOptions::on(device)
            },
            residency: if streamed {
                Residency::Streamed
            } else {
                Residency::Fitting
            },
            state: Mutex::new(State::Unopened),
        })
    }

    /// The run's record (`run.toml`) as JSON.
    fn info(&self, py: Python<'_>) -> PyResult<String> {
        self.check_open(py)?;
        let meta = py
            .detach(|| run::open(&self.path).and_then(|dir| run::read_meta(&dir)))
            .or_raise(py)?;
        Ok(serde_json::to_string(&meta).expect("a run record serializes"))
    }

    /// The entity labels (by id) and the relation labels (by id) of the run's dataset.
    fn labels(&self, py: Python<'_>) -> PyResult<(Vec<String>, Vec<String>)> {
        self.check_open(py)?;
        py.detach(|| -> Result<_, ReadError> {
            let dataset = self.dataset()?;
            Ok((dataset.entity_labels()?, dataset.relation_labels()?))
        })
        .or_raise(py)
    }

    /// The entity embeddings: mapped from the checkpoint file when its rows are f32 (no
    /// copy), else a copy; `verify` checks a mapped file's checksum first.
    #[pyo3(signature = (verify=true))]
    fn embeddings(&self, py: Python<'_>, verify: bool) -> PyResult<Table> {
        self.check_open(py)?;
        py.detach(|| entity_rows(&self.path, verify)).or_raise(py)
    }

    /// The relation embeddings (one row per relation, then per inverse relation with
    /// reciprocal relations; a row has the decoder's relation width), copied.
    fn relation_embeddings(&self, py: Python<'_>) -> PyResult<Table> {
        self.check_open(py)?;
        py.detach(|| -> Result<Table, RunError> {
            let dir = run::open(&self.path)?;
            let meta = run::read_meta(&dir)?;
            let rows = run::load_relations(&dir, &meta, &Unguarded)?;
            Ok(Table::new(Rows::F32(rows), meta.relation_width()))
        })
        .or_raise(py)
    }

    /// The entity rows `ids`, read alone (from the checkpoint file or the store).
    fn rows(&self, py: Python<'_>, ids: Vec<u64>) -> PyResult<Table> {
        self.check_open(py)?;
        py.detach(|| -> Result<Table, RunError> {
            let dir = run::open(&self.path)?;
            let meta = run::read_meta(&dir)?;
            let mut reader = RunReader::open(&dir, &meta, &Unguarded, None)?;
            let mut out = vec![0f32; ids.len() * meta.dim];
            reader.read_rows(&ids, &mut out)?;
            Ok(Table::new(Rows::F32(out), meta.dim))
        })
        .or_raise(py)
    }

    /// Answers `queries` (legend-query's `Query` objects in a JSON array) in their order, in
    /// batches of 1024; the answers as a JSON array of legend-query's `Answer`.
    fn answer(&self, py: Python<'_>, queries: &str) -> PyResult<String> {
        let queries: Vec<Query> = serde_json::from_str(queries)
            .map_err(|e| raise_message(py, Kind::Query, format!("malformed queries: {e}")))?;
        let answered = py.detach(|| -> Result<_, Opening> {
            let run = self.queries()?;
            let mut answers = Vec::with_capacity(queries.len());
            for (b, batch) in queries.chunks(BATCH).enumerate() {
                let at = |i: usize| format!("query {}", b * BATCH + i + 1);
                answers.extend(
                    run.answer(batch, usize::MAX, &at)
                        .map_err(Opening::Failed)?,
                );
            }
            Ok(answers)
        });
        match answered {
            Ok(answers) => Ok(serde_json::to_string(&answers).expect("answers serialize")),
            Err(Opening::Closed) => Err(self.closed_error()),
            Err(Opening::Failed(e)) => Err(e.to_py(py)),
        }
    }

    /// Where queries are answered, in words (`cpu`, or the GPU and where the rows are);
    /// opens the query engine.
    fn placement(&self, py: Python<'_>) -> PyResult<String> {
        match py.detach(|| self.queries()) {
            Ok(run) => Ok(run.placement().to_owned()),
            Err(Opening::Closed) => Err(self.closed_error()),
            Err(Opening::Failed(e)) => Err(e.to_py(py)),
        }
    }

    /// Releases the query engine (its rows, a store, GPU memory); arrays already returned
    /// stay valid. Queries under way finish first.
    fn close(&self, py: Python<'_>) {
        py.detach(|| *self.state.lock().unwrap_or_else(|e| e.into_inner()) = State::Closed);
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        self.check_open(py).is_err()
    }
}
