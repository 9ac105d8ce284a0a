//! A training session: one run directory from its creation (or its resumption) through the
//! epochs, checkpoints and the final evaluation, reporting what happens as typed [`Event`]s.
//! `legendctl train` and the daemon's jobs are thin callers: they turn events into a progress
//! bar, JSON lines or a progress stream, and set a flag to stop.
//!
//! A run directory is either absent or resumable: it is assembled under a temporary name
//! (configuration and commit record) and renamed into place before anything is trained. A stop
//! asked for (SIGINT, a cancelled job) ends before the next batch with a checkpoint of that
//! point, and resuming from it trains exactly what the uninterrupted run would have.
//!
//! Laid out by concern: `setup` creates or resumes a run (its directory, store, engine and
//! trainer), `run_loop` trains the epochs with their checkpoints and evaluations, `events` is
//! what a session reports, `metrics` the run's metrics.jsonl; this file the [`Session`] itself.

use std::path::Path;

use legend_dataset::{Dataset, DatasetError};
use legend_fs::Dir;

use crate::config::{Config, ConfigError};
use crate::error::TrainError;
use crate::evaluation::EvaluationError;
use crate::rows::RowShape;
use crate::run::{self, RunError, RunMeta};
use crate::schedule::ValidHistory;
use crate::store::PartitionStoreError;
use crate::training::Training;

mod events;
mod metrics;
mod run_loop;
mod setup;

pub use events::{Event, Outcome, Position};
use metrics::has_final_line;
pub use run_loop::checkpoint_due;

/// A session error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// The train edges an epoch trains: the dataset's, or those a seeded run selects
    /// (`training.freeze`, `training.replay`).
    epoch_edges: u64,
}

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
        let trained = if self.epoch_edges == m.splits.train {
            String::new()
        } else {
            format!(", {} of them trained an epoch", self.epoch_edges)
        };
        let what = format!(
            "training {} d={} on {} ({} entities, {} relations, {} train edges{trained}); engine {}, {} backend",
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
            let moves = if schedule.parks() {
                format!(
                    "partitions parked in host memory between rounds: {} read ahead, {} not",
                    schedule.home_loads - schedule.exposed_loads,
                    schedule.exposed_loads
                )
            } else {
                format!("{} hand-overs", schedule.moves_per_epoch())
            };
            return format!(
                "{what}, {} partitions on {} workers, {} rounds per epoch ({moves}; predicted imbalance {:.3})",
                schedule.num_partitions,
                schedule.gpus,
                schedule.rounds.len(),
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
}

/// Bytes an epoch of `plan` writes to a store: every swap writes one partition's rows (an
/// embedding in `shape.dtype` and its AdaGrad state a row) back before the next is read into
/// its slot; the state the epoch ends in is written at the checkpoint, not counted here.
pub fn store_bytes_per_epoch(entities: u64, shape: RowShape, plan: &legend_planner::Plan) -> u64 {
    let n = u64::from(plan.num_partitions.max(1));
    let partition = entities.div_ceil(n) * shape.bytes();
    plan.io_count.saturating_sub(1) as u64 * partition
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

fn write_meta(run: &Dir, meta: &RunMeta) -> Result<(), SessionError> {
    let text = toml::to_string_pretty(meta).expect("a run record serializes");
    Ok(run::write_atomically(run, run::META_FILE, text.as_bytes())?)
}

#[cfg(test)]
mod tests;
