//! What a session reports while it runs: how far the run has trained, its events, how it ended.

use legend_dataset::Split;
use legend_eval::Metrics;
use serde::{Deserialize, Serialize};

use crate::progress::EpochCut;
use crate::store::PartitionStoreError;
use crate::trainer::EpochReport;

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

/// How [`Session::run`](super::Session::run) ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every epoch trained and the final evaluation done (`None` without edges to evaluate).
    Finished(Option<Metrics>),
    /// Stopped as asked, at this checkpointed position.
    Stopped(Position),
}
