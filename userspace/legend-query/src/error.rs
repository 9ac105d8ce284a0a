//! Why a query could not be answered.

use legend_dataset::DatasetError;
use legend_engine::evaluation::EvaluationError;
use legend_engine::run::RunError;
use legend_eval::EvalError;

/// Why a query (or a batch of them) could not be answered; the message names the input.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueryError {
    /// The run could not be read.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The run's dataset (labels, known triples) could not be opened.
    #[error(transparent)]
    RunDataset(#[from] EvaluationError),
    /// The dataset's labels or triples could not be read.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The index of known triples could not be built.
    #[error(transparent)]
    Filter(#[from] EvalError),
    /// The run's record is not the one the caller expects (a daemon's job: the store recorded
    /// when it was submitted): the record, and what differs.
    #[error("{0}")]
    NotExpected(String),
    /// The tables do not fit together.
    #[error("{0}")]
    Tables(String),
    /// A name that is neither a label of the dataset nor an id in range.
    #[error("{at}: unknown {kind} {name:?} ({why})")]
    Unknown {
        /// Which query or line.
        at: String,
        /// `entity` or `relation`.
        kind: &'static str,
        /// The name as given.
        name: String,
        /// What was looked for.
        why: String,
    },
    /// An id past the end of its table.
    #[error("{what}: id {id} is out of range (the table has {limit} rows)")]
    IdOutOfRange {
        /// What it names.
        what: String,
        /// The id.
        id: u32,
        /// The table's rows.
        limit: usize,
    },
    /// The GPU asked for could not be opened or failed (the device and the driver's words).
    #[error("{device}: {source}")]
    Gpu {
        /// `cuda:N`, with its name once opened.
        device: String,
        /// What failed.
        source: legend_cuda::GpuError,
    },
    /// A query that is malformed (its position and what is wrong).
    #[error("{at}: {why}")]
    Malformed {
        /// Which query or line.
        at: String,
        /// What is wrong.
        why: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_read_failure_ends_at_the_os_words() {
        let e = QueryError::Run(RunError::Io {
            path: "/runs/r/run.toml".into(),
            source: std::io::Error::from_raw_os_error(13),
        });
        let text = legend_engine::error_chain::with_sources(&e);
        assert_eq!(text, "/runs/r/run.toml: Permission denied (os error 13)");
    }
}
