//! Ranking trained tables on a split of their dataset: legend-eval's filtered and sampled
//! protocols, as `legendctl eval`, a session's evaluations and the daemon's eval jobs run them.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use legend_fs::Guard;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use legend_dataset::{Dataset, DatasetError, Split};
use legend_eval::{Embeddings, EvalError, FilterIndex, Metrics, SampledNegatives};
use legend_model::Decoder;

use crate::config::Protocol;
use crate::run::RunMeta;

/// What to evaluate and how.
#[derive(Clone, Copy, Debug)]
pub struct EvalRequest {
    /// Filtered or sampled ranking.
    pub protocol: Protocol,
    /// The split to rank.
    pub split: Split,
    /// The sampled protocol's negatives.
    pub negatives: SampledNegatives,
    /// Worker threads (0 = one per core).
    pub threads: usize,
}

/// Why an evaluation could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvaluationError {
    /// The dataset could not be read.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The ranking failed.
    #[error(transparent)]
    Eval(#[from] EvalError),
    /// The split has nothing to rank.
    #[error("{dir}: the {split} split has no edges to evaluate")]
    EmptySplit {
        /// The dataset directory.
        dir: PathBuf,
        /// The split's name.
        split: &'static str,
    },
    /// The run's dataset could not be opened.
    #[error("opening the run's dataset {dir} (use --dataset if it moved)")]
    RunDataset {
        /// Where the run says its dataset is.
        dir: PathBuf,
        /// Why it did not open.
        #[source]
        source: DatasetError,
    },
    /// A dataset other than the run's.
    #[error("{dir} is not the dataset this run was trained on (identity {found}, run has {want})")]
    OtherDataset {
        /// The dataset directory given.
        dir: PathBuf,
        /// Its identity.
        found: String,
        /// The run's.
        want: String,
    },
}

/// Ranks `request.split` of `dataset` with `decoder` over the given tables (`dim` floats a row;
/// with `reciprocal` relations the relation table holds the inverses in its second half),
/// showing its progress on stderr (a long evaluation never looks hung, and stdout stays the
/// caller's): a bar on a terminal, else an `info` line every [`PROGRESS_LOG_EVERY`].
///
/// Sampled negatives beyond the graph's entity count are reduced to it, with a warning (see
/// [`SampledNegatives::capped`]).
pub fn evaluate(
    dataset: &Dataset,
    decoder: Decoder,
    dim: usize,
    entities: &[f32],
    relations: &[f32],
    reciprocal: bool,
    request: &EvalRequest,
) -> Result<Metrics, EvaluationError> {
    let triples = dataset.edges(request.split)?;
    if triples.is_empty() {
        return Err(EvaluationError::EmptySplit {
            dir: dataset.dir().to_owned(),
            split: request.split.name(),
        });
    }
    let embeddings = Embeddings {
        decoder,
        entities,
        relations,
        dim,
        reciprocal,
    };
    let ne = dataset.meta().entities as usize;
    let metrics = match request.protocol {
        Protocol::Filtered => {
            let parts: Vec<Vec<[u32; 3]>> = Split::ALL
                .iter()
                .map(|&s| dataset.edges(s))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&[[u32; 3]]> = parts.iter().map(Vec::as_slice).collect();
            let filter = FilterIndex::build(ne, &refs)?;
            let progress = ProgressLog::new("filtered", 2 * triples.len() as u64);
            legend_eval::evaluate_with_progress(
                &embeddings,
                &triples,
                &legend_eval::Protocol::Filtered { filter: &filter },
                request.threads,
                &|n| progress.add(n),
            )?
        }
        Protocol::Sampled => {
            let degrees = dataset.degrees(Split::Train)?;
            let protocol = legend_eval::Protocol::Sampled {
                negatives: request.negatives,
                degrees: &degrees,
            };
            let progress = ProgressLog::new("sampled", 2 * triples.len() as u64);
            legend_eval::evaluate_with_progress(
                &embeddings,
                &triples,
                &protocol,
                request.threads,
                &|n| progress.add(n),
            )?
        }
    };
    Ok(metrics)
}

/// How often a running evaluation logs its progress.
pub const PROGRESS_LOG_EVERY: Duration = Duration::from_secs(10);

/// Counts ranked queries from the worker threads and shows how far the evaluation is: a bar
/// when stderr is a terminal, else a log line every `every` (nothing for an evaluation shorter
/// than that).
struct ProgressLog {
    bar: Option<ProgressBar>,
    what: &'static str,
    total: u64,
    done: AtomicU64,
    started: Instant,
    every: Duration,
    next_log: Mutex<Instant>,
}

impl ProgressLog {
    fn new(what: &'static str, total: u64) -> ProgressLog {
        let mut log = ProgressLog::with_interval(what, total, PROGRESS_LOG_EVERY);
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg} evaluation [{wide_bar}] {pos}/{len} queries, eta {eta}",
                )
                .expect("static template")
                .progress_chars("=> "),
            );
            bar.set_message(what);
            log.bar = Some(bar);
        }
        log
    }

    fn with_interval(what: &'static str, total: u64, every: Duration) -> ProgressLog {
        let started = Instant::now();
        ProgressLog {
            bar: None,
            what,
            total,
            done: AtomicU64::new(0),
            started,
            every,
            next_log: Mutex::new(started + every),
        }
    }

    fn add(&self, n: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(n);
            return;
        }
        if let Some(line) = self.advance(n) {
            tracing::info!("{line}");
        }
    }

    /// Counts `n` more queries; the line due now, if any.
    fn advance(&self, n: u64) -> Option<String> {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        let now = Instant::now();
        // One thread logs; the others go on without waiting.
        let mut next = self.next_log.try_lock().ok()?;
        // The last step is not logged: the result follows it.
        if now < *next || done >= self.total {
            return None;
        }
        *next = now + self.every;
        let elapsed = now.duration_since(self.started).as_secs_f64();
        let fraction = done as f64 / self.total.max(1) as f64;
        let left = elapsed / fraction.max(f64::MIN_POSITIVE) - elapsed;
        Some(format!(
            "{} evaluation: {done}/{} queries ranked ({:.0}%) in {elapsed:.0} s, about {left:.0} s left",
            self.what,
            self.total,
            100.0 * fraction
        ))
    }
}

impl Drop for ProgressLog {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            // The metrics follow on the lines the bar held.
            bar.finish_and_clear();
        }
    }
}

/// Opens the dataset a run was trained on (or `override_dir`, if it moved) and checks that it
/// is the same data; `guard`'s read check (if any) must allow what is read.
pub fn open_run_dataset(
    meta: &RunMeta,
    override_dir: Option<&Path>,
    guard: &dyn Guard,
) -> Result<Dataset, EvaluationError> {
    let dir = override_dir.unwrap_or(&meta.dataset);
    let dataset = Dataset::open_checked(dir, guard.read_check()).map_err(|source| {
        EvaluationError::RunDataset {
            dir: dir.to_owned(),
            source,
        }
    })?;
    let found = format!("{:032x}", dataset.meta().identity());
    if found != meta.dataset_identity {
        return Err(EvaluationError::OtherDataset {
            dir: dir.to_owned(),
            found,
            want: meta.dataset_identity.clone(),
        });
    }
    Ok(dataset)
}

/// One line of human-readable metrics.
pub fn describe(m: &Metrics) -> String {
    let protocol = match m.protocol {
        legend_eval::ProtocolKind::Filtered => "filtered".to_string(),
        legend_eval::ProtocolKind::Sampled => format!(
            "sampled ({} uniform + {} degree negatives)",
            m.uniform_negatives.unwrap_or(0),
            m.degree_negatives.unwrap_or(0)
        ),
    };
    format!(
        "{protocol} MRR {:.4}  Hits@1 {:.4}  Hits@3 {:.4}  Hits@10 {:.4}  mean rank {:.1}  ({} queries, both sides; realistic ties)",
        m.mrr, m.hits_at_1, m.hits_at_3, m.hits_at_10, m.mean_rank, m.count
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_logs_only_when_due_and_counts_every_query() {
        let p = ProgressLog::with_interval("filtered", 100, Duration::ZERO);
        let line = p.advance(40).expect("due at once with a zero interval");
        assert!(
            line.starts_with("filtered evaluation: 40/100 queries ranked (40%) in "),
            "{line}"
        );
        assert_eq!(
            p.advance(60),
            None,
            "the last step is followed by the result"
        );
        assert_eq!(p.done.load(Ordering::Relaxed), 100);

        let quiet = ProgressLog::with_interval("sampled", 100, Duration::from_secs(3600));
        assert_eq!(quiet.advance(10), None);
        assert_eq!(quiet.advance(10), None);
    }
}
