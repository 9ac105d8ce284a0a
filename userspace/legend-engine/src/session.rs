//! A training session: one run directory from its creation (or its resumption) through the
//! epochs, checkpoints and the final evaluation, reporting what happens as typed [`Event`]s.
//! `legendctl train` and the daemon's jobs are thin callers: they turn events into a progress
//! bar, JSON lines or a progress stream, and set a flag to stop.
//!
//! A run directory is either absent or resumable: it is assembled under a temporary name
//! (configuration and commit record) and renamed into place before anything is trained. A stop
//! asked for (SIGINT, a cancelled job) ends before the next batch with a checkpoint of that
//! point, and resuming from it trains exactly what the uninterrupted run would have.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use legend_dataset::{Dataset, DatasetError, Split};
use legend_eval::{Metrics, SampledNegatives};
use legend_fs::{Access, Dir, Guard};
use legend_model::Dtype;
use serde::{Deserialize, Serialize};

use crate::config::{Config, ConfigError, Protocol};
use crate::device::Engine;
use crate::error::TrainError;
use crate::evaluation::{self, EvalRequest, EvaluationError};
use crate::memory;
use crate::progress::{BATCH_KEYS_VERSION, EpochCut};
use crate::relations::Relations;
use crate::rows::RowShape;
use crate::run::{self, RunError, RunMeta, TableChecksums, TableWriter};
use crate::schedule::ValidHistory;
use crate::store::controllers::SharedController;
use crate::store::file::encode_relations;
use crate::store::{
    FileStore, FileStoreSpec, MemberFile, MemoryStore, PartitionHome, PartitionStoreError,
};
use crate::trainer::{EpochEnd, EpochReport, Trainer};
use crate::training::Training;
use crate::workers::Workers;

/// How far a run has trained: whole epochs, and where an interrupted epoch stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Position {
    /// Epochs trained to their end.
    pub epochs_completed: u32,
    /// The next epoch's part already trained, if it was interrupted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<EpochCut>,
}

impl Position {
    /// The progress record a store's superblock keeps (TOML; `epochs_completed=N` alone is
    /// the record of stores written before epochs could be cut).
    pub fn encode(&self) -> Vec<u8> {
        toml::to_string(self)
            .expect("a position serializes")
            .into_bytes()
    }

    /// Decodes [`Position::encode`]; an empty record (a new store) is the start.
    pub fn decode(bytes: &[u8]) -> Result<Position, PartitionStoreError> {
        if bytes.is_empty() {
            return Ok(Position::default());
        }
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|t| toml::from_str(t).ok())
            .ok_or_else(|| {
                PartitionStoreError::Invalid(format!(
                    "unreadable progress record {:?}",
                    String::from_utf8_lossy(bytes)
                ))
            })
    }

    /// In words: `the start`, `epoch 3`, `epoch 4 after 5 of its swaps`.
    pub fn describe(&self) -> String {
        match (self.epochs_completed, self.cut) {
            (_, Some(cut)) => format!(
                "epoch {} stopped {} ({} edges trained)",
                cut.epoch,
                cut.describe(),
                cut.edges
            ),
            (0, None) => "the start".into(),
            (n, None) => format!("the end of epoch {n}"),
        }
    }
}

/// What a session reports while it runs.
#[derive(Debug)]
pub enum Event<'a> {
    /// An epoch begins (or continues from a cut: `edges_done` > 0).
    EpochStarted {
        /// The epoch, from 1.
        epoch: u32,
        /// Epochs the run trains.
        epochs: u32,
        /// Train edges of the epoch.
        edges: u64,
        /// Edges already trained in it.
        edges_done: u64,
    },
    /// Positive edges of the epoch trained so far (called often: keep it cheap).
    Progress {
        /// The epoch.
        epoch: u32,
        /// Edges trained so far in it.
        edges_done: u64,
    },
    /// An epoch ended; `line` is what metrics.jsonl got (the report, with `valid` metrics
    /// when the epoch was evaluated).
    EpochFinished {
        /// The epoch's report.
        report: &'a EpochReport,
        /// The validation metrics, if evaluated.
        valid: Option<&'a Metrics>,
        /// The metrics.jsonl line.
        line: &'a serde_json::Value,
    },
    /// A checkpoint was committed.
    Checkpoint {
        /// What it holds.
        position: Position,
    },
    /// The final evaluation starts.
    Evaluating {
        /// The split.
        split: Split,
    },
    /// The final evaluation ended; `line` is what metrics.jsonl got.
    Evaluated {
        /// The split.
        split: Split,
        /// Its metrics.
        metrics: &'a Metrics,
        /// The metrics.jsonl line.
        line: &'a serde_json::Value,
    },
}

/// How [`Session::run`] ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every epoch trained and the final evaluation done (`None` without edges to evaluate).
    Finished(Option<Metrics>),
    /// Stopped as asked, at this checkpointed position.
    Stopped(Position),
}

/// A session error.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The dataset could not be read.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The run directory could not be read or written.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] PartitionStoreError),
    /// An evaluation failed.
    #[error(transparent)]
    Evaluation(#[from] EvaluationError),
    /// The request cannot be carried out as asked (the message says why and what to do).
    #[error("{0}")]
    Refused(String),
}

/// A run being trained.
pub struct Session {
    run: Dir,
    config: Config,
    dataset: Dataset,
    trainer: Training,
    meta: RunMeta,
    position: Position,
    engine: String,
    /// The SMART logs of the `nvme` backend's controllers (one a member of a striped store),
    /// read when the run opened them.
    device_health: Vec<legend_nvme::Health>,
    /// The validation evaluations so far (best epoch, early stopping, learning-rate plateaus).
    history: ValidHistory,
}

/// The metrics file of a run.
const METRICS_FILE: &str = "metrics.jsonl";

/// The directory in a run that holds the best validated epoch's tables
/// (`evaluation.keep_best`): a run directory of its own, in the memory backend's format, which
/// `legendctl eval` and `export` read like any run.
pub const BEST_DIR: &str = "best";

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> SessionError + '_ {
    move |source| {
        SessionError::Run(RunError::Io {
            path: path.to_owned(),
            source,
        })
    }
}

impl Session {
    /// Creates the run `out` (which must not exist, or be an empty directory; its parent must
    /// exist) training `config` on the dataset in `dataset`. Everything that can be refused
    /// (configuration, plan, dataset, device, store target) is checked before the directory
    /// appears; after that the directory is always resumable. `guard` admits the directories
    /// opened by path (`out`'s parent, a store's outside the run) and adopts the new run
    /// directory; every file is then reached beneath them (legend-fs).
    pub fn create(
        out: &Path,
        dataset: &Path,
        config: Config,
        guard: &dyn Guard,
    ) -> Result<Session, SessionError> {
        if out.exists()
            && std::fs::read_dir(out)
                .map_err(io_error(out))?
                .next()
                .is_some()
        {
            return Err(SessionError::Refused(format!(
                "{} already exists; choose another --out or continue it with --resume",
                out.display()
            )));
        }
        config.check_new_run()?;
        legend_planner::plan(
            config.storage.num_partitions,
            config.capacity(),
            config.order(),
        )
        .map_err(TrainError::from)?;
        let dataset = Dataset::open_checked(dataset, guard.read_check())?;
        let device = Engine::open_all(&config)?;
        check_memory(&config, dataset.meta(), &device[0], false)?;
        let meta = new_meta(&config, &dataset);
        let (parent, name) = Dir::open_parent(out).map_err(io_error(out))?;
        guard.admit(&parent).map_err(io_error(parent.path()))?;
        let run = assemble_run_dir(&parent, name, out, &config, &meta, guard)?;
        // Nothing is trained until the session starts: a refusal on the way (a store target
        // that holds a file system, say) takes the new directory away again.
        Session::start(run, config, dataset, meta, device, guard).inspect_err(|_| {
            let _ = parent.remove_all(name);
        })
    }

    /// Reopens the run `out` where its last checkpoint left it; `sets` change configuration
    /// keys (e.g. `training.num_epochs`), `dataset` names the dataset if it moved.
    /// `guard` admits the run directory and a store's outside it, as for [`Session::create`].
    pub fn resume(
        out: &Path,
        dataset: Option<&Path>,
        sets: &[String],
        guard: &dyn Guard,
    ) -> Result<Session, SessionError> {
        Self::resume_expecting(out, dataset, sets, guard, &|_| Ok(()))
    }

    /// [`Session::resume`], refusing the run when `expect` refuses its record `run.toml`, read
    /// once: the store it names is opened only after `expect` accepted it (a service checks
    /// it against what it recorded when the job was submitted, so that an edit of the record
    /// in between cannot point the job at another store or extent).
    pub fn resume_expecting(
        out: &Path,
        dataset: Option<&Path>,
        sets: &[String],
        guard: &dyn Guard,
        expect: &dyn Fn(&RunMeta) -> Result<(), String>,
    ) -> Result<Session, SessionError> {
        let not_a_run = || {
            SessionError::Refused(format!(
                "{} is not a run directory (no run.toml): nothing to resume",
                out.display()
            ))
        };
        let run = match Dir::open(out) {
            Ok(run) => run,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(not_a_run()),
            Err(e) => return Err(io_error(out)(e)),
        };
        guard.admit(&run).map_err(io_error(out))?;
        // The directory is the submitter's; what is read in it must be theirs to read too.
        let run = run.reading_as(guard.read_check());
        if !run.is_file(run::META_FILE).map_err(io_error(out))? {
            return Err(not_a_run());
        }
        let meta = run::read_meta(&run)?;
        expect(&meta).map_err(|why| {
            SessionError::Refused(format!("{}: {why}", run.join(run::META_FILE).display()))
        })?;
        let config_path = run.join(run::CONFIG_FILE);
        let text = run
            .read_to_string(run::CONFIG_FILE)
            .map_err(io_error(&config_path))?;
        let config = Config::parse(&text, sets)?;
        let dataset = evaluation::open_run_dataset(&meta, dataset, guard)?;
        let device = Engine::open_all(&config)?;
        // Resuming reads the checkpoint's tables into host memory before they go to the GPU.
        check_memory(&config, dataset.meta(), &device[0], true)?;
        let session = Session::start(run, config, dataset, meta, device, guard)?;
        // The keys changed with `sets` hold from now on.
        run::write_atomically(
            &session.run,
            run::CONFIG_FILE,
            session.config.to_toml().as_bytes(),
        )?;
        Ok(session)
    }

    fn start(
        run: Dir,
        config: Config,
        dataset: Dataset,
        mut meta: RunMeta,
        mut device: Vec<Engine>,
        guard: &dyn Guard,
    ) -> Result<Session, SessionError> {
        let meta_ds = dataset.meta();
        let decoder = config.decoder();
        let dim = config.model.dim;
        let shape = config.entity_shape();
        check_tables_match(&config, &meta)?;
        if !meta_ds.has_relations && decoder.uses_relations() {
            tracing::warn!(
                "the dataset has no relation types; {decoder} learns one relation for all edges"
            );
        }
        let started = Instant::now();
        let buckets = dataset.buckets(config.storage.num_partitions)?;
        let scheme = buckets.scheme();
        let degrees = legend_dataset::degrees(meta_ds.entities as usize, buckets.edges());
        tracing::info!(
            "set-up: {} train edges loaded into {} buckets and entity degrees counted in {:.1} s",
            buckets.edges().len(),
            buckets.counts().len(),
            started.elapsed().as_secs_f64()
        );
        let init = config.init();
        let relation_floats = meta.relation_floats();
        let relation_rows = meta.relations as usize;
        let fresh_relations = || Relations::init(decoder, relation_rows, dim, &init);
        let engine = match device.as_slice() {
            [one] => one.describe(),
            all => format!("{} × {}", all.len(), all[0].describe()),
        };
        let mut device_health = Vec::new();
        let (home, relations, position) = if config.uses_store() {
            let record = meta.store_record(run.path())?;
            let run_dir = std::fs::canonicalize(run.path()).map_err(io_error(run.path()))?;
            let members = meta
                .recorded_members()
                .unwrap_or_else(|| config.store_members(&run_dir));
            let path = members[0].path.clone();
            let files = members
                .iter()
                .map(|m| MemberFile::of_run(&run, &run_dir, m, guard))
                .collect::<Result<Vec<_>, _>>()?;
            let spec = FileStoreSpec {
                members: &files,
                stripe_bytes: config.storage.stripe_bytes,
                dataset: run::dataset_id(&meta.dataset_identity, &path)?,
                num_nodes: meta_ds.entities,
                shape,
                num_partitions: scheme.num_partitions,
                aux_bytes: (relation_floats * 8) as u64,
                store_id: record.store_id(),
                force: config.storage.force,
                proxy_model: config.proxy_model(),
            };
            let mut store = match record {
                run::StoreRecord::Made(_) => FileStore::open(&spec)?,
                run::StoreRecord::ToCreate(id) => {
                    // The intent first: after a crash from here on, the resume makes the store
                    // again, knowing its half-made members by `id` and nothing else by it.
                    meta.record_store_intent(&members, id)?;
                    write_meta(&run, &meta)?;
                    let store = FileStore::create(&spec)?;
                    // From here on the run's commit record is the store's superblock.
                    meta.store_creating = false;
                    write_meta(&run, &meta)?;
                    store
                }
            };
            let position = Position::decode(store.progress())?;
            device_health = store
                .queued_members()
                .iter()
                .filter_map(|m| read_health(&m.controller))
                .collect();
            let relations = match store.aux(relation_floats * 8)? {
                Some(bytes) if position != Position::default() => {
                    let all: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
                    let (emb, state) = all.split_at(relation_floats);
                    Relations {
                        emb: emb.to_vec(),
                        state: state.to_vec(),
                    }
                }
                _ => fresh_relations(),
            };
            (PartitionHome::File(Box::new(store)), relations, position)
        } else if !meta.checkpoint.is_empty() {
            let t = run::load_tables(&run, &meta, guard)?;
            let store = MemoryStore::from_tables(scheme, shape, t.entities, t.entities_state);
            let relations = Relations {
                emb: t.relations,
                state: t.relations_state,
            };
            let position = Position {
                epochs_completed: meta.epochs_completed,
                cut: meta.cut,
            };
            (PartitionHome::Memory(store), relations, position)
        } else {
            let home = PartitionHome::Memory(MemoryStore::new(config.storage.dtype));
            (home, fresh_relations(), Position::default())
        };
        let epochs = config.training.num_epochs;
        if position.epochs_completed > epochs
            || (position.epochs_completed == epochs && position.cut.is_some())
        {
            return Err(SessionError::Refused(format!(
                "the run has trained to {}; training.num_epochs = {epochs} would undo that (set at least {})",
                position.describe(),
                position.epochs_completed + u32::from(position.cut.is_some())
            )));
        }
        adopt_batch_keys(&mut meta, &position)?;
        let trainer = match (device.len(), home) {
            (1, home) => {
                let engine = device.pop().expect("one engine");
                Training::One(Box::new(Trainer::on_device(
                    &config, buckets, &degrees, home, relations, engine,
                )?))
            }
            (_, PartitionHome::Memory(store)) => Training::Workers(Box::new(Workers::new(
                &config, buckets, &degrees, store, relations, device,
            )?)),
            _ => unreachable!(
                "training.gpus > 1 keeps partitions in memory (its configuration says)"
            ),
        };
        tracing::info!(
            "set-up: the {engine} engine ready (edges and relations placed) in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        keep_metrics_up_to(&run, position.epochs_completed)?;
        let history = ValidHistory::replay(&metrics_lines(&run)?, &config);
        Ok(Session {
            run,
            config,
            dataset,
            trainer,
            meta,
            position,
            engine,
            device_health,
            history,
        })
    }

    /// The best validated epoch so far, when its tables are kept (`evaluation.keep_best`):
    /// the epoch the final evaluation ranks.
    pub fn best_epoch(&self) -> Option<u32> {
        let best = self.history.best?;
        self.config.evaluation.keep_best.then_some(best.0)
    }

    /// Where training continues from.
    pub fn position(&self) -> Position {
        self.position
    }

    /// The resolved configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The dataset.
    pub fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    /// The engine in words (`cpu`, `cuda:0 (NVIDIA H100 …, sm_90a)`).
    pub fn engine(&self) -> &str {
        &self.engine
    }

    /// Whether the run has nothing left to do: every epoch trained, and evaluated if the
    /// dataset has edges to evaluate.
    pub fn is_finished(&self) -> Result<bool, SessionError> {
        let split = self.config.evaluation.split.split();
        Ok(self.position.cut.is_none()
            && (self.position.epochs_completed >= self.config.training.num_epochs
                || self.history.exhausted(&self.config))
            && (self.dataset.meta().splits.get(split) == 0 || has_final_line(&self.run)?))
    }

    /// A one-line summary of what the run trains, for the log; with a store, what an epoch
    /// writes to it (users weigh SSD wear).
    pub fn describe(&self) -> String {
        let m = self.dataset.meta();
        let what = format!(
            "training {} d={} on {} ({} entities, {} relations, {} train edges); engine {}, {} backend",
            self.config.decoder(),
            self.config.model.dim,
            self.dataset.dir().display(),
            m.entities,
            m.relations,
            m.splits.train,
            self.engine,
            self.config.storage.backend,
        );
        let Some(plan) = self.trainer.plan() else {
            let schedule = self.trainer.schedule().expect("workers have a schedule");
            return format!(
                "{what}, {} partitions on {} workers, {} rounds per epoch ({} hand-overs; predicted imbalance {:.3})",
                schedule.num_partitions,
                schedule.gpus,
                schedule.rounds.len(),
                schedule.moves_per_epoch(),
                schedule.predicted_imbalance
            );
        };
        let writes = if self.config.uses_store() {
            let bytes = store_bytes_per_epoch(m.entities, self.config.entity_shape(), plan) as f64;
            if bytes >= 1e9 {
                format!(
                    "; about {:.1} GB written to the store an epoch",
                    bytes / 1e9
                )
            } else {
                format!(
                    "; about {:.1} MB written to the store an epoch",
                    bytes / 1e6
                )
            }
        } else {
            String::new()
        };
        let wear: String = self.device_health.iter().map(describe_wear).collect();
        format!(
            "{what}, {} partitions, buffer {}, order {} ({} buffer states per epoch){writes}{wear}",
            plan.num_partitions,
            self.config.capacity(),
            plan.kind,
            plan.io_count
        )
    }

    /// Trains the remaining epochs, checkpointing as configured, then evaluates. When `stop`
    /// is set it ends before the next batch with a checkpoint of that point.
    pub fn run(
        &mut self,
        stop: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Outcome, SessionError> {
        let epochs = self.config.training.num_epochs;
        let mut metrics = self
            .run
            .open_file(METRICS_FILE, Access::Append)
            .map_err(io_error(&self.run.join(METRICS_FILE)))?;
        let total = self.dataset.meta().splits.train;
        // Finite and ≥ 0 (checked); beyond what a Duration holds means never.
        let interval = Duration::try_from_secs_f64(self.config.training.checkpoint_minutes * 60.0)
            .unwrap_or(Duration::MAX);
        // The session's start counts as a checkpoint: a resumed run has just read one.
        let mut last_checkpoint = Instant::now();
        let mut checkpoint_cost = Duration::ZERO;
        for epoch in self.position.epochs_completed + 1..=epochs {
            if self.history.exhausted(&self.config) {
                break;
            }
            let learning_rate = self.history.learning_rate(epoch, &self.config);
            self.trainer.set_learning_rate(learning_rate);
            let mut cut = self.position.cut.take();
            on_event(Event::EpochStarted {
                epoch,
                epochs,
                edges: total,
                edges_done: cut.map_or(0, |c| c.edges),
            });
            let report = loop {
                // Raised on a stop, or when a timed checkpoint falls due inside a long epoch:
                // the trainer then ends this part of the epoch before its next batch.
                let pause = AtomicBool::new(stop.load(Ordering::Relaxed));
                let since = last_checkpoint;
                let end = self
                    .trainer
                    .run_epoch_from(epoch, cut, &pause, &mut |done| {
                        if stop.load(Ordering::Relaxed)
                            || checkpoint_due(since.elapsed(), checkpoint_cost, interval)
                        {
                            pause.store(true, Ordering::Relaxed);
                        }
                        on_event(Event::Progress {
                            epoch,
                            edges_done: done,
                        })
                    })?;
                let part = match end {
                    EpochEnd::Done(report) => break report,
                    EpochEnd::Stopped(part) => part,
                };
                self.position = Position {
                    epochs_completed: epoch - 1,
                    cut: Some(part),
                };
                checkpoint_cost = self.committed_checkpoint(on_event)?;
                last_checkpoint = Instant::now();
                if stop.load(Ordering::Relaxed) {
                    return Ok(Outcome::Stopped(self.position));
                }
                // Continued in this process exactly as a resume from the checkpoint would.
                cut = Some(part);
            };
            let mut line = serde_json::to_value(&report).expect("a report serializes");
            line["learning_rate"] = serde_json::json!(learning_rate);
            let e = &self.config.evaluation;
            let mut improved = false;
            let valid = if e.epochs_per_eval > 0
                && epoch % e.epochs_per_eval == 0
                && self.dataset.meta().splits.valid > 0
            {
                let protocol = e.valid_protocol.unwrap_or(e.protocol);
                let m = self.evaluate_with(Split::Valid, protocol)?;
                line["valid"] = serde_json::to_value(&m).expect("metrics serialize");
                improved = self.history.record(epoch, m.mrr, &self.config);
                Some(m)
            } else {
                None
            };
            // The best tables are written before the checkpoint that follows (a crash between
            // the two resumes before this epoch, which then writes them again).
            if improved && self.config.evaluation.keep_best {
                self.save_best(epoch)?;
            }
            let early_stop = self.history.exhausted(&self.config);
            if early_stop {
                let (best, mrr) = self
                    .history
                    .best
                    .expect("patience counts from a best epoch");
                tracing::info!(
                    "early stopping after epoch {epoch}: no better validation MRR in {} evaluations since epoch {best} ({mrr:.4})",
                    self.history.since_best
                );
            }
            append_line(&mut metrics, &self.run, &line)?;
            on_event(Event::EpochFinished {
                report: &report,
                valid: valid.as_ref(),
                line: &line,
            });
            self.position = Position {
                epochs_completed: epoch,
                cut: None,
            };
            let every = self.config.training.checkpoint_every;
            let stopping = stop.load(Ordering::Relaxed);
            // A kept improvement is checkpointed, so that a resume never starts before the best
            // epoch (whose tables it could not rebuild from an older checkpoint).
            let kept = improved && self.config.evaluation.keep_best;
            if epoch == epochs
                || stopping
                || early_stop
                || kept
                || (every > 0 && epoch % every == 0)
                || checkpoint_due(last_checkpoint.elapsed(), checkpoint_cost, interval)
            {
                checkpoint_cost = self.committed_checkpoint(on_event)?;
                last_checkpoint = Instant::now();
            }
            if stopping && epoch < epochs {
                return Ok(Outcome::Stopped(self.position));
            }
        }
        if has_final_line(&self.run)? {
            return Ok(Outcome::Finished(None));
        }
        let split = self.config.evaluation.split.split();
        if self.dataset.meta().splits.get(split) == 0 {
            tracing::warn!("no {} edges: skipping the final evaluation", split.name());
            return Ok(Outcome::Finished(None));
        }
        on_event(Event::Evaluating { split });
        let (m, best_epoch) = match self.evaluate_best(split)? {
            Some((m, epoch)) => (m, Some(epoch)),
            None => (self.evaluate(split)?, None),
        };
        let mut line = serde_json::json!({ "final": true, "split": split.name(), "metrics": m });
        if let Some(epoch) = best_epoch {
            line["best_epoch"] = serde_json::json!(epoch);
        }
        append_line(&mut metrics, &self.run, &line)?;
        on_event(Event::Evaluated {
            split,
            metrics: &m,
            line: &line,
        });
        Ok(Outcome::Finished(Some(m)))
    }

    /// How `[evaluation]` ranks `split`.
    fn eval_request(&self, split: Split, protocol: Protocol) -> EvalRequest {
        let e = &self.config.evaluation;
        EvalRequest {
            protocol,
            split,
            negatives: SampledNegatives {
                uniform: e.uniform_negatives,
                degree: e.degree_negatives,
                seed: e.seed,
            },
            threads: self.config.training.threads,
        }
    }

    /// Evaluates the current parameters on `split` as `[evaluation]` says.
    pub fn evaluate(&mut self, split: Split) -> Result<Metrics, SessionError> {
        self.evaluate_with(split, self.config.evaluation.protocol)
    }

    /// Evaluates the current parameters on `split` with `protocol`.
    fn evaluate_with(&mut self, split: Split, protocol: Protocol) -> Result<Metrics, SessionError> {
        let dim = self.config.model.dim;
        let request = self.eval_request(split, protocol);
        let decoder = self.config.decoder();
        self.trainer.sync_relations()?;
        let relations = self.trainer.relations().emb.clone();
        let scheme = self.trainer.scheme();
        let evaluate = |entities: &[f32]| {
            evaluation::evaluate(
                &self.dataset,
                decoder,
                dim,
                entities,
                &relations,
                self.meta.reciprocal_relations,
                &request,
            )
        };
        let in_place = if scheme.num_partitions == 1 {
            // One partition in host memory is the whole table: ranked in place, not copied.
            self.trainer
                .host_partition(0)
                .map(|part| evaluate(&part.emb))
        } else {
            None
        };
        let metrics = if let Some(metrics) = in_place {
            metrics?
        } else {
            // The embeddings alone, gathered from wherever each partition is (from the GPU
            // a piece at a time: its optimizer state never comes to the host).
            let mut emb = Vec::with_capacity(scheme.entities as usize * dim);
            for p in 0..scheme.num_partitions {
                self.trainer.stream_partition(p, &mut |rows, _| {
                    emb.extend_from_slice(rows);
                    Ok(())
                })?;
            }
            evaluate(&emb)?
        };
        Ok(metrics)
    }

    /// Writes the current tables into [`BEST_DIR`] as the checkpoint of `epoch`.
    fn save_best(&mut self, epoch: u32) -> Result<(), SessionError> {
        let path = self.run.join(BEST_DIR);
        let best = self.run.create_dir_all(BEST_DIR).map_err(io_error(&path))?;
        run::write_atomically(&best, run::CONFIG_FILE, self.config.to_toml().as_bytes())?;
        self.trainer.sync_relations()?;
        let relations = self.trainer.relations().clone();
        let meta = RunMeta {
            epochs_completed: epoch,
            cut: None,
            checkpoint: String::new(),
            store: None,
            store_queue: None,
            store_members: Vec::new(),
            store_id: None,
            store_creating: false,
            ..self.meta.clone()
        };
        let trainer = &mut self.trainer;
        run::commit_checkpoint(&best, meta, (&relations.emb, &relations.state), |e, s| {
            write_entity_tables(trainer, &path, e, s)
        })?;
        tracing::info!(
            "epoch {epoch} is the best so far: its tables are in {}",
            path.display()
        );
        Ok(())
    }

    /// Ranks `split` with the best epoch's tables, when `evaluation.keep_best` kept them;
    /// `None` without them (no validation evaluations, or `best/` from an epoch the resumed run
    /// has not reached).
    fn evaluate_best(&mut self, split: Split) -> Result<Option<(Metrics, u32)>, SessionError> {
        let Some((epoch, _)) = self.history.best else {
            return Ok(None);
        };
        if !self.config.evaluation.keep_best {
            return Ok(None);
        }
        let path = self.run.join(BEST_DIR);
        if !self
            .run
            .is_file(Path::new(BEST_DIR).join(run::META_FILE))
            .map_err(io_error(&path))?
        {
            tracing::warn!(
                "{}: no best tables; ranking the last epoch's",
                path.display()
            );
            return Ok(None);
        }
        let best = self.run.dir(BEST_DIR).map_err(io_error(&path))?;
        let meta = run::read_meta(&best)?;
        if meta.epochs_completed != epoch {
            tracing::warn!(
                "{} holds epoch {}, not the best epoch {epoch}; ranking the last epoch's tables",
                path.display(),
                meta.epochs_completed
            );
            return Ok(None);
        }
        let tables = run::load_tables(&best, &meta, &legend_fs::Unguarded)?;
        let m = evaluation::evaluate(
            &self.dataset,
            self.config.decoder(),
            meta.dim,
            &tables.entities,
            &tables.relations,
            meta.reciprocal_relations,
            &self.eval_request(split, self.config.evaluation.protocol),
        )?;
        Ok(Some((m, epoch)))
    }

    /// [`Session::checkpoint`], then tells `on_event`; returns what the commit took (the next
    /// timed checkpoint is spaced by it).
    fn committed_checkpoint(
        &mut self,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Duration, SessionError> {
        let started = Instant::now();
        self.checkpoint()?;
        let cost = started.elapsed();
        on_event(Event::Checkpoint {
            position: self.position,
        });
        Ok(cost)
    }

    /// Commits the parameters at `self.position`: in the store (its superblock is the commit
    /// record) or as a checkpoint directory named by run.toml (memory backend).
    fn checkpoint(&mut self) -> Result<(), SessionError> {
        self.trainer.sync_relations()?;
        let relations = self.trainer.relations().clone();
        let position = self.position;
        self.meta.epochs_completed = position.epochs_completed;
        self.meta.cut = position.cut;
        let aux = encode_relations(&relations.emb, &relations.state);
        if self.trainer.checkpoint(position.encode(), aux)? {
            // The store committed; run.toml only mirrors the position for people.
            return write_meta(&self.run, &self.meta);
        }
        let meta = std::mem::replace(&mut self.meta, new_placeholder_meta());
        self.meta = run::commit_checkpoint(
            &self.run,
            meta,
            (&relations.emb, &relations.state),
            |e, s| write_entity_tables(&mut self.trainer, self.run.path(), e, s),
        )?;
        tracing::debug!("checkpoint {} committed", self.meta.checkpoint);
        Ok(())
    }
}

/// Bytes an epoch of `plan` writes to a store: every swap writes one partition's rows (an
/// embedding in `shape.dtype` and its AdaGrad state a row) back before the next is read into
/// its slot; the state the epoch ends in is written at the checkpoint, not counted here.
pub fn store_bytes_per_epoch(entities: u64, shape: RowShape, plan: &legend_planner::Plan) -> u64 {
    let n = u64::from(plan.num_partitions.max(1));
    let partition = entities.div_ceil(n) * shape.bytes();
    plan.io_count.saturating_sub(1) as u64 * partition
}

/// The SMART log of an `nvme` store's controller (a warning, and nothing, if it cannot be
/// read: the run does not depend on it).
fn read_health(controller: &SharedController) -> Option<legend_nvme::Health> {
    match controller {
        SharedController::Device(d) => d
            .health()
            .inspect_err(|e| tracing::warn!("reading the controller's SMART log: {e}"))
            .ok(),
        SharedController::Proxy(_) => None,
    }
}

/// What a controller's SMART log says of its wear, for the run's first log line: users weigh
/// what an epoch writes against it.
fn describe_wear(h: &legend_nvme::Health) -> String {
    // A data unit is 1000 blocks of 512 bytes.
    let written = h.data_units_written as f64 * 512_000.0;
    format!(
        "; the device reports {}% of its rated endurance used, {:.2} TB written in its life",
        h.percentage_used,
        written / 1e12
    )
}

/// Training time per second of checkpoint writing, at the least: checkpoints take at most
/// 1/20 = 5 % of a run's wall time.
const CHECKPOINT_SPACING: u32 = 20;

/// Whether a timed checkpoint (`training.checkpoint_minutes`) is due `since_last` after the
/// last checkpoint (or the session's start): once `interval` has passed (zero: never), and once
/// 20 times the last checkpoint's `cost` has passed, so that slow checkpoints (a billion-edge
/// table written to a slow disk) are spaced out rather than eating the run. It is taken before
/// the next batch, so a crash loses at most about `interval`.
pub fn checkpoint_due(since_last: Duration, cost: Duration, interval: Duration) -> bool {
    !interval.is_zero() && since_last >= interval.max(cost * CHECKPOINT_SPACING)
}

/// Refuses a run whose estimated peak host memory exceeds what the machine has (see
/// [`memory::check_fits`]), before anything is allocated or written.
fn check_memory(
    config: &Config,
    dataset: &legend_dataset::DatasetMeta,
    device: &Engine,
    resuming: bool,
) -> Result<(), SessionError> {
    let Some(available) = memory::available_bytes() else {
        tracing::warn!("cannot read the available memory; the run's memory is not checked");
        return Ok(());
    };
    let on_cuda = matches!(device, Engine::Cuda { .. });
    let estimate = memory::check_fits(config, dataset, on_cuda, resuming, available)
        .map_err(SessionError::Refused)?;
    tracing::info!(
        "host memory: about {:.1} GiB at the peak, {:.1} GiB available",
        memory::gib(estimate.total()),
        memory::gib(available)
    );
    Ok(())
}

/// Refuses a configuration whose tables differ from the run's (a resume's `--set` of
/// `model.dim`, `model.decoder`, `storage.dtype` or `optimizer.state`): its checkpoint cannot
/// be read as them.
fn check_tables_match(config: &Config, meta: &RunMeta) -> Result<(), SessionError> {
    let recorded = meta.entity_shape();
    let mismatch = if config.model.dim != meta.dim {
        Some(format!(
            "model.dim = {} but the run's tables have {}",
            config.model.dim, meta.dim
        ))
    } else if config.decoder().name() != meta.decoder {
        Some(format!(
            "model.decoder = {} but the run trained {}",
            config.decoder(),
            meta.decoder
        ))
    } else if config.storage.dtype != recorded.dtype {
        Some(format!(
            "storage.dtype = {} but the run's rows are {}",
            config.storage.dtype, recorded.dtype
        ))
    } else if config.entity_shape() != recorded {
        let name = |width: usize| if width == meta.dim { "element" } else { "row" };
        Some(format!(
            "optimizer.state = {} but the run's state is {}-wise",
            config.optimizer.state,
            name(recorded.state)
        ))
    } else {
        None
    };
    match mismatch {
        Some(why) => Err(SessionError::Refused(format!(
            "{why}: a run keeps the tables it started with (start a new run to change them)"
        ))),
        None => Ok(()),
    }
}

/// Moves a run recorded with older batch keys to [`BATCH_KEYS_VERSION`] (a run from a newer
/// version is refused): it continues from `position` exactly where it stopped, cuts inside an
/// epoch included (they were all taken between buffer states), drawing with today's keys.
fn adopt_batch_keys(meta: &mut RunMeta, position: &Position) -> Result<(), SessionError> {
    if meta.batch_keys > BATCH_KEYS_VERSION {
        return Err(SessionError::Refused(format!(
            "the run was written with batch keys version {} and this build knows {BATCH_KEYS_VERSION}: resume it with the Legend that wrote it",
            meta.batch_keys
        )));
    }
    if meta.batch_keys < BATCH_KEYS_VERSION && *position != Position::default() {
        tracing::warn!(
            "the run was written before training keyed its random draws by bucket (run.toml has no batch_keys): it continues from {} with the new keys, so what it trains from here differs from what the version that started it would have trained (its checkpoints, evaluations and exports are unaffected)",
            position.describe()
        );
    }
    meta.batch_keys = BATCH_KEYS_VERSION;
    Ok(())
}

/// The commit record of a new run of `config` on `dataset`.
fn new_meta(config: &Config, dataset: &Dataset) -> RunMeta {
    let m = dataset.meta();
    let decoder = config.decoder();
    RunMeta {
        format_version: run::RUN_FORMAT_VERSION,
        dataset: std::fs::canonicalize(dataset.dir()).unwrap_or_else(|_| dataset.dir().to_owned()),
        dataset_identity: format!("{:032x}", m.identity()),
        decoder: decoder.name().into(),
        dim: config.model.dim,
        entity_state_width: Some(config.entity_shape().state),
        entity_dtype: config.storage.dtype,
        entities: m.entities,
        relations: config.relation_rows(m.relations),
        reciprocal_relations: config.model.reciprocal_relations && decoder.uses_relations(),
        batch_keys: BATCH_KEYS_VERSION,
        epochs_completed: 0,
        cut: None,
        checkpoint: String::new(),
        store: None,
        store_queue: None,
        store_members: Vec::new(),
        store_id: None,
        store_creating: false,
        checksums: TableChecksums::default(),
    }
}

/// A stand-in while the real record is moved through `commit_checkpoint`.
fn new_placeholder_meta() -> RunMeta {
    RunMeta {
        format_version: run::RUN_FORMAT_VERSION,
        dataset: PathBuf::new(),
        dataset_identity: String::new(),
        decoder: String::new(),
        dim: 0,
        entity_state_width: None,
        entity_dtype: Dtype::F32,
        entities: 0,
        relations: 0,
        reciprocal_relations: false,
        batch_keys: BATCH_KEYS_VERSION,
        epochs_completed: 0,
        cut: None,
        checkpoint: String::new(),
        store: None,
        store_queue: None,
        store_members: Vec::new(),
        store_id: None,
        store_creating: false,
        checksums: TableChecksums::default(),
    }
}

/// Streams every partition's embedding and state rows from wherever `trainer` holds them into
/// a checkpoint's two entity tables (`path` names the directory in errors).
fn write_entity_tables(
    trainer: &mut Training,
    path: &Path,
    e: &mut TableWriter,
    s: &mut TableWriter,
) -> Result<(), RunError> {
    for p in 0..trainer.scheme().num_partitions {
        trainer
            .stream_partition(p, &mut |emb, state| {
                e.write(emb)?;
                Ok(s.write(state)?)
            })
            .map_err(|err| match err {
                TrainError::Run(err) => err,
                other => RunError::Invalid {
                    path: path.to_owned(),
                    message: other.to_string(),
                },
            })?;
    }
    Ok(())
}

fn write_meta(run: &Dir, meta: &RunMeta) -> Result<(), SessionError> {
    let text = toml::to_string_pretty(meta).expect("a run record serializes");
    Ok(run::write_atomically(run, run::META_FILE, text.as_bytes())?)
}

/// Makes `name` in `parent` (the run `out`) with config.toml and run.toml in one rename, so
/// that it never exists without them; returns it, opened.
fn assemble_run_dir(
    parent: &Dir,
    name: &Path,
    out: &Path,
    config: &Config,
    meta: &RunMeta,
    guard: &dyn Guard,
) -> Result<Dir, SessionError> {
    let tmp_name = format!(
        ".{}.creating-{}",
        name.to_string_lossy(),
        std::process::id()
    );
    let tmp_path = parent.join(&tmp_name);
    parent.clear(&tmp_name).map_err(io_error(&tmp_path))?;
    let tmp = parent.create_dir(&tmp_name).map_err(io_error(&tmp_path))?;
    let assembled = guard
        .adopt(&tmp)
        .map_err(io_error(&tmp_path))
        .and_then(|()| {
            Ok(run::write_atomically(
                &tmp,
                run::CONFIG_FILE,
                config.to_toml().as_bytes(),
            )?)
        })
        .and_then(|()| write_meta(&tmp, meta))
        // An empty `out` is replaced; a non-empty one was refused before.
        .and_then(|()| parent.rename(&tmp_name, name).map_err(io_error(out)));
    match assembled {
        Ok(()) => Ok(tmp.with_path(out.to_owned())),
        Err(e) => {
            let _ = parent.remove_all(&tmp_name);
            Err(e)
        }
    }
}

fn append_line(
    metrics: &mut File,
    run: &Dir,
    line: &serde_json::Value,
) -> Result<(), SessionError> {
    writeln!(metrics, "{line}").map_err(io_error(&run.join(METRICS_FILE)))
}

/// The lines of metrics.jsonl (none if it does not exist yet).
fn metrics_lines(run: &Dir) -> Result<String, SessionError> {
    match run.read_to_string(METRICS_FILE) {
        Ok(text) => Ok(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(io_error(&run.join(METRICS_FILE))(e)),
    }
}

fn is_final(line: &serde_json::Value) -> bool {
    line.get("final").and_then(serde_json::Value::as_bool) == Some(true)
}

/// Whether the last record of metrics.jsonl is a final evaluation: nothing was trained after
/// the run was last evaluated.
fn has_final_line(run: &Dir) -> Result<bool, SessionError> {
    Ok(metrics_lines(run)?
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .is_some_and(|v| is_final(&v)))
}

/// Drops the metrics.jsonl records of epochs after `epochs` (trained after the checkpoint the
/// run resumes from, so they will be trained again), the final evaluations that followed them,
/// and lines a crash cut short, so that each epoch is recorded once.
fn keep_metrics_up_to(run: &Dir, epochs: u32) -> Result<(), SessionError> {
    let text = metrics_lines(run)?;
    let mut dropped_epoch = false;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
                return false;
            };
            if is_final(&v) {
                return !dropped_epoch;
            }
            let keep = v
                .get("epoch")
                .and_then(serde_json::Value::as_u64)
                .is_some_and(|e| e <= u64::from(epochs));
            dropped_epoch |= !keep;
            keep
        })
        .collect();
    if kept.len() == text.lines().count() {
        return Ok(());
    }
    let mut new = kept.join("\n");
    if !new.is_empty() {
        new.push('\n');
    }
    Ok(run::write_atomically(run, METRICS_FILE, new.as_bytes())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use legend_model::StateLayout;

    #[test]
    fn an_epochs_store_writes_are_its_swaps_partitions() {
        // The Twitter-shaped run from a modelled SSD (benchmarks.md): N = 8, C = 3, the Legend
        // order's 16 buffer states; epoch 2 measured 62.48 GB written.
        let plan = legend_planner::plan(8, 3, legend_planner::Order::Legend).unwrap();
        assert_eq!(plan.io_count, 16);
        let element = RowShape::new(100, StateLayout::Element);
        let bytes = store_bytes_per_epoch(41_652_230, element, &plan);
        assert_eq!(bytes, 15 * 5_206_529 * 800);
        assert!((bytes as f64 / 1e9 - 62.48).abs() < 0.01);
        // Row-wise state: 404 bytes a row.
        let row = RowShape::new(100, StateLayout::Row);
        assert_eq!(
            store_bytes_per_epoch(41_652_230, row, &plan),
            15 * 5_206_529 * 404
        );
        // One partition: nothing moves.
        let one = legend_planner::plan(1, 1, legend_planner::Order::Auto).unwrap();
        assert_eq!(store_bytes_per_epoch(1000, element, &one), 0);
    }

    #[test]
    fn the_wear_line_says_percent_used_and_bytes_written() {
        let h = legend_nvme::Health {
            critical_warning: 0,
            temperature_kelvin: 300,
            available_spare: 100,
            percentage_used: 3,
            data_units_read: 0,
            // 1.5 TB in 1000 × 512-byte units.
            data_units_written: 2_929_688,
            power_on_hours: 0,
            unsafe_shutdowns: 0,
            media_errors: 0,
        };
        assert_eq!(
            describe_wear(&h),
            "; the device reports 3% of its rated endurance used, 1.50 TB written in its life"
        );
    }

    #[test]
    fn timed_checkpoints_bound_the_work_lost_and_their_own_cost() {
        let min = |m: u64| Duration::from_secs(60 * m);
        let half_hour = min(30);
        // The first one half an hour in (no cost known yet), not before.
        assert!(!checkpoint_due(min(29), Duration::ZERO, half_hour));
        assert!(checkpoint_due(min(30), Duration::ZERO, half_hour));
        // A 16 s checkpoint (33 GB at 2 GB/s) keeps the half hour: 0.9 % of the time.
        assert!(checkpoint_due(min(30), Duration::from_secs(16), half_hour));
        // A 165 s one (33 GB at 200 MB/s) waits 55 minutes: 5 % of the time.
        assert!(!checkpoint_due(
            min(54),
            Duration::from_secs(165),
            half_hour
        ));
        assert!(checkpoint_due(min(55), Duration::from_secs(165), half_hour));
        // 0 minutes: never by time.
        assert!(!checkpoint_due(min(600), Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn the_default_checkpoints_every_half_hour() {
        let c = Config::default();
        assert_eq!(
            (c.training.checkpoint_minutes, c.training.checkpoint_every),
            (30.0, 0)
        );
        let c = Config::parse("[training]\ncheckpoint_minutes = 5\n", &[]).unwrap();
        assert_eq!(
            c.training.checkpoint_minutes, 5.0,
            "a whole number of minutes"
        );
    }
}
