//! `legend.train`: a training [`Session`] in this process, on a thread of its own without the
//! GIL, its events handed to a Python callback (the progress bar) on the caller's thread. Ctrl-C
//! (Python's `KeyboardInterrupt`, seen by `check_signals`) or an exception from the callback sets
//! the session's stop flag: the run ends before its next batch with a checkpoint there, as
//! `legendctl train` does on SIGINT, and can be resumed.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use legend_daemon_api::Progress;
use legend_engine::Config;
use legend_engine::session::{Event, Outcome, Session, SessionError};
use legend_fs::Unguarded;
use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use serde_json::{Value, json};

use crate::errors::{Kind, OrRaise, raise_message};
use crate::interrupt::{self, panic_message};

/// Progress events are sent at most this often (a batch reports progress, thousands a second).
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// How the session ended.
enum Ended {
    /// Every epoch trained and the final evaluation done (its metrics, if there was one).
    Finished(Value),
    /// A resumed run that had nothing left to do.
    AlreadyFinished,
    /// Stopped as asked, checkpointed at this position (in words).
    Stopped(String),
}

/// Turns a session's events into the JSON events legendd's `watch` sends (`progress`, `epoch`,
/// `checkpoint`, `evaluating`, `evaluated`), so that one progress view serves both.
struct Events {
    tx: Sender<Value>,
    progress: Progress,
    sent: Option<Instant>,
}

impl Events {
    fn send(&self, event: Value) {
        // The receiver outlives the session (it is dropped after the join).
        let _ = self.tx.send(event);
    }

    fn progress(&mut self, force: bool) {
        if force || self.sent.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
            self.sent = Some(Instant::now());
            self.send(json!({"type": "progress", "progress": self.progress}));
        }
    }

    fn on(&mut self, event: Event<'_>) {
        match event {
            Event::EpochStarted {
                epoch,
                epochs,
                edges,
                edges_done,
            } => {
                self.progress = Progress {
                    epoch,
                    epochs,
                    edges,
                    edges_done,
                    edges_per_sec: self.progress.edges_per_sec,
                };
                self.progress(true);
            }
            Event::Progress { edges_done, .. } => {
                self.progress.edges_done = edges_done;
                self.progress(false);
            }
            Event::EpochFinished { report, line, .. } => {
                self.progress.edges_per_sec = report.edges_per_sec;
                self.progress.edges_done = self.progress.edges;
                self.send(json!({"type": "epoch", "line": line}));
            }
            Event::Checkpoint { position } => {
                self.send(json!({"type": "checkpoint", "position": position.describe()}));
            }
            Event::Evaluating { split } => {
                self.send(json!({"type": "evaluating", "split": split.name()}));
            }
            Event::Evaluated { line, .. } => self.send(json!({"type": "evaluated", "line": line})),
        }
    }
}

/// What the worker thread is given: a new run's configuration, or a resume's changes.
enum Start {
    Create {
        dataset: PathBuf,
        config: Box<Config>,
    },
    Resume {
        dataset: Option<PathBuf>,
        sets: Vec<String>,
    },
}

fn train_session(
    out: &std::path::Path,
    start: Start,
    stop: &AtomicBool,
    tx: Sender<Value>,
) -> Result<Ended, SessionError> {
    let resuming = matches!(start, Start::Resume { .. });
    let mut session = match start {
        Start::Create { dataset, config } => Session::create(out, &dataset, *config, &Unguarded)?,
        Start::Resume { dataset, sets } => {
            Session::resume(out, dataset.as_deref(), &sets, &Unguarded)?
        }
    };
    if resuming && session.is_finished()? {
        return Ok(Ended::AlreadyFinished);
    }
    tracing::info!("device: {}", session.engine());
    tracing::info!("{}", session.describe());
    let mut events = Events {
        tx,
        progress: Progress::default(),
        sent: None,
    };
    events.send(json!({
        "type": "started",
        "engine": session.engine(),
        "position": session.position().describe(),
        "resumed": resuming,
    }));
    let outcome = session.run(stop, &mut |event| events.on(event))?;
    Ok(match outcome {
        Outcome::Finished(metrics) => Ended::Finished(json!({
            "metrics": metrics,
            "best_epoch": session.best_epoch(),
            "split": session.config().evaluation.split.split().name(),
        })),
        Outcome::Stopped(position) => Ended::Stopped(position.describe()),
    })
}

/// Trains the run `out`: a new one on `dataset` with the configuration `config` (TOML text;
/// `config_origin` names it in errors) and the `key=value` changes `sets`, or, with `resume`,
/// the existing one from its last checkpoint. `on_event` is called with each event (a dict) on
/// this thread. Returns how it ended as JSON: `{"outcome": "finished", "metrics": ...}`,
/// `{"outcome": "already_finished"}`, or after Ctrl-C `{"outcome": "stopped", "position": ...}`
/// (the caller raises `legend.Interrupted`). An exception raised by `on_event` stops the run
/// the same way and is raised again once the checkpoint is committed.
#[pyfunction]
#[pyo3(signature = (out, dataset, config, config_origin, sets, resume, on_event))]
#[allow(clippy::too_many_arguments)]
pub fn train(
    py: Python<'_>,
    out: PathBuf,
    dataset: Option<PathBuf>,
    config: Option<String>,
    config_origin: Option<String>,
    sets: Vec<String>,
    resume: bool,
    on_event: Bound<'_, PyAny>,
) -> PyResult<String> {
    let start = if resume {
        if config.is_some() {
            return Err(PyValueError::new_err(
                "resume continues with the run's own config.toml: change keys with overrides",
            ));
        }
        Start::Resume { dataset, sets }
    } else {
        let dataset = dataset.ok_or_else(|| {
            PyValueError::new_err("a dataset is required (or resume an existing run)")
        })?;
        let config = Config::parse(config.as_deref().unwrap_or(""), &sets).map_err(|e| {
            let origin = config_origin.as_deref().unwrap_or("configuration");
            raise_message(py, Kind::Config, format!("{origin}: {e}"))
        })?;
        Start::Create {
            dataset,
            config: Box::new(config),
        }
    };
    let loads = py.import("json")?.getattr("loads")?;
    let stop = AtomicBool::new(false);
    let ended = interrupt::run(
        py,
        &stop,
        |tx| train_session(&out, start, &stop, tx),
        |_, event: Value| {
            on_event.call1((loads.call1((event.to_string(),))?,))?;
            Ok(())
        },
    );
    let result = ended.result.map_err(|panic| {
        PyRuntimeError::new_err(format!("the trainer panicked: {}", panic_message(&*panic)))
    })?;
    let ended_as = result.or_raise(py)?;
    let interrupted = |e: &PyErr| e.is_instance_of::<PyKeyboardInterrupt>(py);
    let outcome = match (ended_as, ended.error) {
        (Ended::Stopped(position), Some(e)) if interrupted(&e) => {
            json!({"outcome": "stopped", "position": position})
        }
        (Ended::Stopped(position), Some(e)) => {
            e.value(py).call_method1(
                "add_note",
                (format!(
                    "training stopped: {} is checkpointed at {position}; continue it with \
                     legend.train(out=..., resume=True)",
                    out.display()
                ),),
            )?;
            return Err(e);
        }
        // Too late to stop anything: the run is complete, and the interruption is Python's.
        (_, Some(e)) => return Err(e),
        (Ended::Finished(result), None) => {
            let mut result = result;
            result["outcome"] = "finished".into();
            result
        }
        (Ended::AlreadyFinished, None) => json!({"outcome": "already_finished"}),
        (Ended::Stopped(_), None) => unreachable!("only a Python error sets the stop flag"),
    };
    Ok(outcome.to_string())
}
