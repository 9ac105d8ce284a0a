//! Queries by name on a run: labels resolved through the run's dataset, batches answered in
//! one scan per kind, answers carrying ids, labels and scores.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

use legend_dataset::{Dataset, LabelTable, Split};
use legend_engine::evaluation::open_run_dataset;
use legend_engine::restore::entities_map;
use legend_engine::run::{self, RunError, RunMeta};
use legend_eval::FilterIndex;
use legend_fs::{Dir, Guard};
use legend_model::Side;
use serde::{Deserialize, Serialize};

use crate::QueryError;
use crate::gpu::{GpuOptions, OpenedGpu, StoreRows};
use crate::model::{Completion, GpuPlan, Metric, Model, Nearest};
use crate::names::{FileAccess, Names};
use legend_engine::store::controllers::DeviceModel;

/// Entities a query returns unless told.
pub const DEFAULT_TOP: usize = 10;

fn default_top() -> usize {
    DEFAULT_TOP
}

fn default_metric() -> Metric {
    Metric::Cosine
}

/// A query, naming entities and relations by label (or by id): one line of a batch in JSON,
/// and what a served run is asked over legendd's socket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "query", rename_all = "snake_case", deny_unknown_fields)]
pub enum Query {
    /// The best entities for the missing end: give `head` (tails are predicted) or `tail`
    /// (heads are predicted).
    Predict {
        /// The known head.
        #[serde(default)]
        head: Option<String>,
        /// The relation.
        relation: String,
        /// The known tail.
        #[serde(default)]
        tail: Option<String>,
        /// How many entities (default 10).
        #[serde(default = "default_top")]
        top: usize,
        /// Leave out entities forming a known triple.
        #[serde(default)]
        filtered: bool,
    },
    /// The score of a triple.
    Score {
        /// Its head.
        head: String,
        /// Its relation.
        relation: String,
        /// Its tail.
        tail: String,
    },
    /// The nearest entities of an entity.
    Neighbors {
        /// The entity.
        entity: String,
        /// How many (default 10).
        #[serde(default = "default_top")]
        top: usize,
        /// How rows are compared (default cosine).
        #[serde(default = "default_metric")]
        metric: Metric,
    },
    /// An entity's row.
    Lookup {
        /// The entity.
        entity: String,
    },
}

/// An entity or relation with its label.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Named {
    /// Its id.
    pub id: u32,
    /// Its label in the dataset.
    pub label: String,
}

/// One entity of an answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hit {
    /// Its id.
    pub id: u32,
    /// Its label.
    pub label: String,
    /// Its score (higher is better; for `l2` the negative distance).
    pub score: f32,
}

/// The answer to a [`Query`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    /// To [`Query::Predict`]: the known end, the relation, and the best entities, best first.
    Predict {
        /// The head, when it was given.
        head: Option<Named>,
        /// The relation.
        relation: Named,
        /// The tail, when it was given.
        tail: Option<Named>,
        /// Whether known triples were left out.
        filtered: bool,
        /// The best entities for the missing end.
        hits: Vec<Hit>,
    },
    /// To [`Query::Score`].
    Score {
        /// The head.
        head: Named,
        /// The relation.
        relation: Named,
        /// The tail.
        tail: Named,
        /// The triple's score.
        score: f32,
    },
    /// To [`Query::Neighbors`].
    Neighbors {
        /// The entity.
        entity: Named,
        /// How rows were compared.
        metric: Metric,
        /// The nearest entities, nearest first.
        hits: Vec<Hit>,
    },
    /// To [`Query::Lookup`].
    Lookup {
        /// The entity.
        entity: Named,
        /// Its row.
        row: Vec<f32>,
    },
}

impl Answer {
    /// The answer as text lines: a `#` line saying what was asked, then one line per entity
    /// (`rank<TAB>label<TAB>id<TAB>score`), or one line for a score or a row.
    pub fn text(&self) -> String {
        let hits = |head: String, hits: &[Hit]| {
            let mut s = head;
            for (rank, h) in hits.iter().enumerate() {
                s.push_str(&format!(
                    "\n{}\t{}\t{}\t{}",
                    rank + 1,
                    h.label,
                    h.id,
                    h.score
                ));
            }
            s
        };
        let end = |n: &Option<Named>| n.as_ref().map_or("?", |n| n.label.as_str()).to_owned();
        match self {
            Answer::Predict {
                head,
                relation,
                tail,
                filtered,
                hits: found,
            } => hits(
                format!(
                    "# {}\t{}\t{}{}",
                    end(head),
                    relation.label,
                    end(tail),
                    if *filtered { "\t(filtered)" } else { "" }
                ),
                found,
            ),
            Answer::Score {
                head,
                relation,
                tail,
                score,
            } => format!(
                "{}\t{}\t{}\t{score}",
                head.label, relation.label, tail.label
            ),
            Answer::Neighbors {
                entity,
                metric,
                hits: found,
            } => hits(format!("# {} ({})", entity.label, metric.name()), found),
            Answer::Lookup { entity, row } => {
                let values: Vec<String> = row.iter().map(f32::to_string).collect();
                format!("{}\t{}", entity.label, values.join("\t"))
            }
        }
    }
}

/// What a line of a batch file asks (`legendctl predict|score|neighbors --queries FILE`).
#[derive(Clone, Copy, Debug)]
pub enum LineKind {
    /// `HEAD<TAB>RELATION<TAB>?` or `?<TAB>RELATION<TAB>TAIL`.
    Predict {
        /// Entities per query.
        top: usize,
        /// Leave out known triples.
        filtered: bool,
    },
    /// `HEAD<TAB>RELATION<TAB>TAIL`.
    Score,
    /// `ENTITY`.
    Neighbors {
        /// Entities per query.
        top: usize,
        /// How rows are compared.
        metric: Metric,
    },
}

/// Parses one line of a batch file (`at` names it in errors): fields separated by tabs (by
/// runs of spaces in a line without a tab), as [`LineKind`] says.
pub fn parse_line(kind: LineKind, line: &str, at: &str) -> Result<Query, QueryError> {
    let fields: Vec<&str> = if line.contains('\t') {
        line.split('\t').map(str::trim).collect()
    } else {
        line.split_whitespace().collect()
    };
    let malformed = |why: String| QueryError::Malformed {
        at: at.to_owned(),
        why,
    };
    let owned = |s: &str| s.to_owned();
    match (kind, fields.as_slice()) {
        (LineKind::Predict { top, filtered }, [h, r, t]) => {
            let (head, tail) = match (*h == "?", *t == "?") {
                (false, true) => (Some(owned(h)), None),
                (true, false) => (None, Some(owned(t))),
                _ => {
                    return Err(malformed(format!(
                        "expected HEAD RELATION ? or ? RELATION TAIL (one end `?`), got {line:?}"
                    )));
                }
            };
            Ok(Query::Predict {
                head,
                relation: owned(r),
                tail,
                top,
                filtered,
            })
        }
        (LineKind::Score, [h, r, t]) => Ok(Query::Score {
            head: owned(h),
            relation: owned(r),
            tail: owned(t),
        }),
        (LineKind::Neighbors { top, metric }, [e]) => Ok(Query::Neighbors {
            entity: owned(e),
            top,
            metric,
        }),
        (LineKind::Neighbors { .. }, _) => Err(malformed(format!(
            "expected one entity, got {} fields",
            fields.len()
        ))),
        _ => Err(malformed(format!(
            "expected three fields (head, relation, tail), got {}",
            fields.len()
        ))),
    }
}

/// `name` for a message: at most [`QUOTED_CHARS`] characters of it (a name comes from whoever
/// asks, and an answer must fit a frame).
fn quoted(name: &str) -> String {
    match name.char_indices().nth(QUOTED_CHARS) {
        Some((cut, _)) => format!("{}…", &name[..cut]),
        None => name.to_owned(),
    }
}

/// Characters of an unknown name quoted back.
const QUOTED_CHARS: usize = 200;

/// Where a run's entity rows are kept while it answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// Loaded once into memory (a served run answers many batches).
    Resident,
    /// Read from the run's checkpoint or store by each batch, a piece at a time (a run larger
    /// than memory).
    Streamed,
    /// Loaded when the entity rows take at most half the memory available (one read of the
    /// table for every batch that follows), else streamed.
    Fitting,
}

/// Bytes of `meta`'s entity rows in f32 (in host memory).
fn entity_bytes(meta: &RunMeta) -> u64 {
    meta.entities
        .saturating_mul(meta.dim as u64)
        .saturating_mul(4)
}

/// `bytes` in GiB, MiB or KiB, whichever is at least 1, for messages.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..0x10_0000 => format!("{:.1} KiB", b / 1024.0),
        0x10_0000..0x4000_0000 => format!("{:.1} MiB", b / f64::from(1u32 << 20)),
        _ => format!("{:.2} GiB", b / f64::from(1u32 << 30)),
    }
}

/// Why `meta`'s entity rows are streamed rather than read into memory, when they take more
/// than half the memory available now.
fn too_big_for_memory(meta: &RunMeta) -> Option<String> {
    let bytes = entity_bytes(meta);
    let available = legend_engine::footprint::available_bytes()?;
    (bytes > available / 2).then(|| {
        format!(
            "{} of entity rows, more than half the {} of memory available",
            size(bytes),
            size(available)
        )
    })
}

impl Names {
    fn named(&self, id: u32) -> Named {
        Named {
            id,
            label: self.label(id).into_owned(),
        }
    }
}

/// The run at `path` as `guard` admits it, its record, and its dataset (from `dataset` if it
/// moved, checked to be the run's).
fn open_run_files(
    path: &Path,
    dataset: Option<&Path>,
    guard: &dyn Guard,
) -> Result<(Dir, RunMeta, Dataset), QueryError> {
    let dir = run::open(path)?;
    guard.admit(&dir).map_err(|source| RunError::Io {
        path: path.to_owned(),
        source,
    })?;
    // The directory may be someone else's: what is read in it must be theirs to read.
    let dir = dir.reading_as(guard.read_check());
    let meta = run::read_meta(&dir)?;
    let dataset = open_run_dataset(&meta, dataset, guard)?;
    Ok((dir, meta, dataset))
}

/// Indexes the labels of the run at `path` (its dataset from `dataset` if it moved) as a query
/// command would, and keeps the indexes in the run (`RUN/index/`, tables of 2^16 labels or
/// more; an index kept for the same label file is checked and left as it is): `legendctl
/// train` does so when a run ends, so that its first query finds the labels indexed (41.65 M
/// labels take seconds to index).
pub fn keep_label_indexes(
    path: &Path,
    dataset: Option<&Path>,
    guard: &dyn Guard,
) -> Result<(), QueryError> {
    let (dir, _, dataset) = open_run_files(path, dataset, guard)?;
    for table in [LabelTable::Entities, LabelTable::Relations] {
        Names::open(&dataset, table, &dir, FileAccess::MapAndKeep)?;
    }
    Ok(())
}

/// How [`QueryRun::open_with`] opens a run: reads through `guard`, the GPU `gpu` asks for,
/// files mapped or copied, and the check of the run's record.
struct Opening<'g> {
    guard: &'g dyn Guard,
    gpu: &'g GpuOptions,
    access: FileAccess,
    expect: &'g dyn Fn(&RunMeta) -> Result<(), String>,
}

impl QueryRun {
    /// Opens the run at `path` to be served (its reads through `guard`, which the run keeps),
    /// answering on the GPU `gpu` asks for. The entity rows go into the GPU's memory when they
    /// fit its budget; else into host memory when they take at most the memory available
    /// (`MemAvailable`, or the cgroup's limit) and at most `host_limit` bytes; else they are
    /// streamed from the run (scans through the swap path, lookups row by row or through the
    /// GPU row cache), and read once now, so that a damaged checkpoint or store fails here.
    /// `expect` checks the run's record, read once: the one the run is then opened by.
    ///
    /// Its files are opened as a query command opens them, through `guard`'s checks, and
    /// mapped in place as the command maps them where no one but this process's own user (or
    /// root) could change them; a file someone else may write is read into memory
    /// ([`QueryRun::copied`] names it). Entity rows that go into GPU memory are read from the
    /// checkpoint straight into pinned staging, either way. Nothing is written in the run (a
    /// label index not kept there is built in memory).
    pub fn open_served(
        path: &Path,
        dataset: Option<&Path>,
        guard: Arc<dyn Guard>,
        gpu: &GpuOptions,
        host_limit: Option<u64>,
        expect: &dyn Fn(&RunMeta) -> Result<(), String>,
    ) -> Result<QueryRun, QueryError> {
        let access = FileAccess::MapOwn;
        let opening = Opening {
            guard: guard.as_ref(),
            gpu,
            access,
            expect,
        };
        let run = Self::open_with(path, dataset, opening, move |meta| {
            let bytes = entity_bytes(meta);
            let available = legend_engine::footprint::available_bytes();
            let (limit, what) = match (available, host_limit) {
                (Some(a), Some(l)) if l < a => (l, "a serve job may hold (serve_host_memory)"),
                (Some(a), _) => (a, "of memory available"),
                (None, Some(l)) => (l, "a serve job may hold (serve_host_memory)"),
                (None, None) => return None,
            };
            (bytes > limit).then(|| {
                let why = format!(
                    "{} of entity rows, more than the {} {what}",
                    size(bytes),
                    size(limit)
                );
                why
            })
        })?;
        if run.model.is_streamed() {
            run.model.check_rows()?;
        }
        Ok(run)
    }
}

/// A run opened for queries: its tables, its dataset's labels, and (built on first use) the
/// index of its known triples.
pub struct QueryRun {
    model: Model,
    dataset: Dataset,
    entities: Names,
    relations: Names,
    filter: Mutex<Option<Arc<FilterIndex>>>,
    placement: String,
    /// Why the entity rows are streamed from the run, when they are.
    streamed: Option<String>,
}

/// What `gpu` asks of the run `meta` describes: the GPU opened, whether the entity rows fit its
/// budget, else a row cache over the run's store; and, when there is no GPU, or a row cache was
/// wanted but none could be had, why (in words, for the placement).
fn gpu_plan(
    meta: &RunMeta,
    reader: &run::RunReader,
    proxy_model: Option<DeviceModel>,
    gpu: &GpuOptions,
) -> Result<(Option<GpuPlan>, String), QueryError> {
    let (opened, note) = crate::gpu::open_device(gpu.device)?;
    let Some(opened) = opened else {
        return Ok((None, note));
    };
    let budget = opened.budget(gpu.budget)?;
    let working = legend_cuda::scan::SCAN_WORKING_BYTES;
    if budget < working {
        let why = format!(
            "{}: {} MiB of its memory may be taken, less than a scan's {} MiB",
            opened.name,
            budget >> 20,
            working >> 20
        );
        if gpu.device == legend_engine::config::DeviceChoice::Auto {
            return Ok((None, format!("cpu (auto: {why})")));
        }
        return Err(QueryError::Tables(why));
    }
    if OpenedGpu::fits(meta.entities, meta.dim, budget) {
        let plan = GpuPlan {
            opened,
            resident: true,
            store_rows: None,
        };
        return Ok((Some(plan), String::new()));
    }
    let mut why_not = String::new();
    let mut store_rows = None;
    if gpu.cache_fraction > 0.0
        && let Some(layout) = reader.store_layout()
    {
        let at_rest = meta.entities * meta.dim as u64 * meta.entity_dtype.bytes() as u64;
        let bytes = ((at_rest as f64 * gpu.cache_fraction) as u64).min(budget - working);
        match StoreRows::open(&opened, layout, proxy_model, bytes) {
            Ok(rows) => store_rows = Some(rows),
            Err(e) => {
                let e = legend_engine::error_chain::with_sources(&e);
                why_not = format!(" (rows looked up on the CPU: {}: {e})", opened.name);
            }
        }
    }
    let plan = GpuPlan {
        opened,
        resident: false,
        store_rows,
    };
    Ok((Some(plan), why_not))
}

impl QueryRun {
    /// Opens the run directory `path` (its dataset from `dataset` if it moved), reading
    /// through `guard` (admits the run, checks reads as its owner could).
    pub fn open(
        path: &Path,
        dataset: Option<&Path>,
        guard: &dyn Guard,
        residency: Residency,
    ) -> Result<QueryRun, QueryError> {
        Self::open_on(path, dataset, guard, residency, &GpuOptions::cpu())
    }

    /// [`QueryRun::open`] answering on the GPU `gpu` asks for (none for `cpu`): the entity
    /// rows go into its memory when they fit its budget, else stay where `residency` puts them
    /// and the scans stream them; lookups then go through a row cache over the run's store
    /// when it has one.
    pub fn open_on(
        path: &Path,
        dataset: Option<&Path>,
        guard: &dyn Guard,
        residency: Residency,
        gpu: &GpuOptions,
    ) -> Result<QueryRun, QueryError> {
        let opening = Opening {
            guard,
            gpu,
            access: FileAccess::MapAndKeep,
            expect: &|_| Ok(()),
        };
        Self::open_with(path, dataset, opening, |meta| match residency {
            Residency::Resident => None,
            Residency::Streamed => Some("asked".to_owned()),
            // Rows mapped from the checkpoint are the page cache's, whatever their size.
            Residency::Fitting if entities_map(meta) => None,
            Residency::Fitting => too_big_for_memory(meta),
        })
    }

    /// Opens the run, its entity rows on the GPU `gpu` names when they fit there, else
    /// streamed when `stream_why` gives a reason for its record, or loaded (mapped, when
    /// `access` allows) when it gives none; its files read as `access` says.
    fn open_with(
        path: &Path,
        dataset: Option<&Path>,
        opening: Opening<'_>,
        stream_why: impl FnOnce(&RunMeta) -> Option<String>,
    ) -> Result<QueryRun, QueryError> {
        let Opening {
            guard,
            gpu,
            access,
            expect,
        } = opening;
        let (dir, meta, dataset) = open_run_files(path, dataset, guard)?;
        expect(&meta).map_err(|why| {
            QueryError::NotExpected(format!("{}: {why}", dir.join(run::META_FILE).display()))
        })?;
        let entities = Names::open(&dataset, LabelTable::Entities, &dir, access)?;
        let relations = Names::open(&dataset, LabelTable::Relations, &dir, access)?;
        let why = stream_why(&meta);
        // The run's one reader: every read of its rows (relations, scans, lookups; the GPU row
        // cache reaches its store's controllers through it) goes through it, its store opened
        // once. A GPU's reads of a proxy's store go at the SSD the run modelled.
        let proxy_model = match gpu.device {
            legend_engine::config::DeviceChoice::Cpu => None,
            _ if meta.store.is_some() => run::read_config(&dir)?.proxy_model(),
            _ => None,
        };
        let reader = run::RunReader::open(&dir, &meta, guard, proxy_model)?;
        let (plan, note) = gpu_plan(&meta, &reader, proxy_model, gpu)?;
        let on_gpu = plan.is_some();
        let model = Model::of_run_on(
            (dir, meta, reader),
            relations.len(),
            why.is_some(),
            plan,
            access,
        )?;
        // Rows that went into GPU memory are not streamed, whatever the host's memory.
        let streamed = why.filter(|_| model.is_streamed());
        let mut placement = if on_gpu {
            format!("{}{note}", model.placement())
        } else {
            note
        };
        if let Some(why) = &streamed {
            if !on_gpu {
                placement.push_str("; entity rows streamed from the run by each scan");
            }
            let _ = write!(placement, " (streamed: {why})");
        }
        if model.num_entities() != entities.len() {
            return Err(QueryError::Tables(format!(
                "{}: the run has {} entity rows, its dataset {} labels",
                path.display(),
                model.num_entities(),
                entities.len()
            )));
        }
        Ok(QueryRun {
            model,
            dataset,
            entities,
            relations,
            filter: Mutex::default(),
            placement,
            streamed,
        })
    }

    /// Where the run answers, in words: `cpu` (with why, when `auto` found no GPU), or the GPU
    /// with where the entity rows are and how rows are looked up (and why not through a row
    /// cache, when one was wanted and could not be had).
    pub fn placement(&self) -> &str {
        &self.placement
    }

    /// Why the entity rows are streamed from the run (read by each scan and lookup, not held),
    /// when they are: `asked`, or their size against the memory they may take.
    pub fn streamed(&self) -> Option<&str> {
        self.streamed.as_deref()
    }

    /// The tables.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The run's and its dataset's files read into this process's memory though they could
    /// have been mapped (a served run's files that someone other than its process's user may
    /// write), each as `PATH: why`; empty when every file that could be mapped was.
    pub fn copied(&self) -> Vec<String> {
        [
            self.entities.copied(),
            self.relations.copied(),
            self.model.copied(),
        ]
        .concat()
    }

    /// Bytes of the longest entity or relation label: what bounds the size of an answer
    /// before it is computed (a pass over the labels: call it once).
    pub fn longest_label(&self) -> usize {
        self.entities.longest().max(self.relations.longest())
    }

    /// The index of known triples (train, valid, test), built on first use.
    fn filter(&self) -> Result<Arc<FilterIndex>, QueryError> {
        let mut slot = self.filter.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = &*slot {
            return Ok(f.clone());
        }
        let parts: Vec<Vec<[u32; 3]>> = Split::ALL
            .iter()
            .map(|&s| self.dataset.edges(s))
            .collect::<Result<_, _>>()?;
        let refs: Vec<&[[u32; 3]]> = parts.iter().map(Vec::as_slice).collect();
        let f = Arc::new(FilterIndex::build(self.entities.len(), &refs)?);
        *slot = Some(f.clone());
        Ok(f)
    }

    fn resolve(
        &self,
        names: &Names,
        kind: &'static str,
        name: &str,
        at: &dyn Fn() -> String,
    ) -> Result<u32, QueryError> {
        if let Some(id) = names.id(name) {
            return Ok(id);
        }
        match name.parse::<u32>() {
            Ok(id) if (id as usize) < names.len() => Ok(id),
            _ => {
                let near = names.near(name);
                let hint = if near.is_empty() {
                    String::new()
                } else {
                    let quoted: Vec<String> = near.iter().map(|l| format!("{l:?}")).collect();
                    format!("; did you mean {}?", quoted.join(" or "))
                };
                Err(QueryError::Unknown {
                    at: at(),
                    kind,
                    name: quoted(name),
                    why: format!(
                        "not one of the {kind} labels of the dataset {} nor an id below {}{hint}",
                        self.dataset.dir().display(),
                        names.len()
                    ),
                })
            }
        }
    }

    fn entity(&self, name: &str, at: &dyn Fn() -> String) -> Result<u32, QueryError> {
        self.resolve(&self.entities, "entity", name, at)
    }

    fn relation(&self, name: &str, at: &dyn Fn() -> String) -> Result<u32, QueryError> {
        self.resolve(&self.relations, "relation", name, at)
    }

    fn hits(&self, ranked: Vec<crate::Ranked>) -> Vec<Hit> {
        ranked
            .into_iter()
            .map(|r| Hit {
                id: r.id,
                label: self.entities.label(r.id).into_owned(),
                score: r.score,
            })
            .collect()
    }

    /// Answers `queries` in their order, each kind in one batch (one scan of the entities);
    /// a query asking for more than `max_top` entities, or none, is refused. The first bad
    /// query fails the batch, named by its position (`query N`, counted from 1) or by
    /// `at(N)` when given.
    pub fn answer(
        &self,
        queries: &[Query],
        max_top: usize,
        at: &dyn Fn(usize) -> String,
    ) -> Result<Vec<Answer>, QueryError> {
        let mut completions = Vec::new();
        let mut triples = Vec::new();
        let mut nearest = Vec::new();
        let mut lookups = Vec::new();
        let entities = self.model.num_entities();
        for (i, q) in queries.iter().enumerate() {
            let here = || at(i);
            let top = |top: usize| {
                if top == 0 || top > max_top {
                    // Past `max_top` (a daemon's limit), that limit; for none, a sane range:
                    // up to the run's entities (more return them all), not `usize::MAX`.
                    let most = if top == 0 {
                        max_top.min(entities).max(1)
                    } else {
                        max_top
                    };
                    return Err(QueryError::Malformed {
                        at: here(),
                        why: format!("top {top}: ask for 1 to {most} entities"),
                    });
                }
                // Every entity but none twice.
                Ok(top.min(entities))
            };
            match q {
                Query::Predict {
                    head,
                    relation,
                    tail,
                    top: k,
                    filtered,
                } => {
                    let (side, anchor) = match (head, tail) {
                        (Some(h), None) => (Side::Dst, self.entity(h, &here)?),
                        (None, Some(t)) => (Side::Src, self.entity(t, &here)?),
                        _ => {
                            return Err(QueryError::Malformed {
                                at: here(),
                                why: "give the head (to predict tails) or the tail (to \
                                      predict heads), not both"
                                    .into(),
                            });
                        }
                    };
                    completions.push((
                        i,
                        Completion {
                            side,
                            anchor,
                            relation: self.relation(relation, &here)?,
                            top: top(*k)?,
                            filtered: *filtered,
                        },
                    ));
                }
                Query::Score {
                    head,
                    relation,
                    tail,
                } => triples.push((
                    i,
                    [
                        self.entity(head, &here)?,
                        self.relation(relation, &here)?,
                        self.entity(tail, &here)?,
                    ],
                )),
                Query::Neighbors {
                    entity,
                    top: k,
                    metric,
                } => nearest.push((
                    i,
                    Nearest {
                        entity: self.entity(entity, &here)?,
                        top: top(*k)?,
                        metric: *metric,
                    },
                )),
                Query::Lookup { entity } => lookups.push((i, self.entity(entity, &here)?)),
            }
        }
        let mut answers: Vec<Option<Answer>> = vec![None; queries.len()];
        if !completions.is_empty() {
            let filter = if completions.iter().any(|(_, c)| c.filtered) {
                Some(self.filter()?)
            } else {
                None
            };
            let asked: Vec<Completion> = completions.iter().map(|&(_, c)| c).collect();
            let found = self.model.complete(&asked, filter.as_deref())?;
            for ((i, c), ranked) in completions.into_iter().zip(found) {
                let known = Some(self.entities.named(c.anchor));
                let (head, tail) = match c.side {
                    Side::Dst => (known, None),
                    Side::Src => (None, known),
                };
                answers[i] = Some(Answer::Predict {
                    head,
                    relation: self.relations.named(c.relation),
                    tail,
                    filtered: c.filtered,
                    hits: self.hits(ranked),
                });
            }
        }
        if !triples.is_empty() {
            let asked: Vec<[u32; 3]> = triples.iter().map(|&(_, t)| t).collect();
            let scores = self.model.score(&asked)?;
            for ((i, [h, r, t]), score) in triples.into_iter().zip(scores) {
                answers[i] = Some(Answer::Score {
                    head: self.entities.named(h),
                    relation: self.relations.named(r),
                    tail: self.entities.named(t),
                    score,
                });
            }
        }
        if !nearest.is_empty() {
            let asked: Vec<Nearest> = nearest.iter().map(|&(_, n)| n).collect();
            let found = self.model.nearest(&asked)?;
            for ((i, n), ranked) in nearest.into_iter().zip(found) {
                answers[i] = Some(Answer::Neighbors {
                    entity: self.entities.named(n.entity),
                    metric: n.metric,
                    hits: self.hits(ranked),
                });
            }
        }
        if !lookups.is_empty() {
            let ids: Vec<u32> = lookups.iter().map(|&(_, id)| id).collect();
            let rows = self.model.rows(&ids)?;
            for ((i, id), row) in lookups.into_iter().zip(rows) {
                answers[i] = Some(Answer::Lookup {
                    entity: self.entities.named(id),
                    row,
                });
            }
        }
        Ok(answers
            .into_iter()
            .map(|a| a.expect("every query was answered"))
            .collect())
    }
}
