//! The engine's `tracing` events as records of Python's `logging`, on the logger `legend`
//! (warnings show as Python shows them; `logging.basicConfig(level=logging.INFO)` shows the
//! set-up lines `legendctl` prints). `LEGEND_LOG` filters them first, as it does for the CLI
//! (default `info`: debug events are not even formatted).
//!
//! A record takes the GIL on the thread that logs (the trainer's, a query's): callers never wait
//! on Rust locks while attached to Python, so that taking it cannot deadlock.

use std::fmt::Write as _;

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Hands events to Python's `logging`.
struct PythonLogging;

/// An event's message and fields as one line (`message key=value ...`).
#[derive(Default)]
struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if !self.0.is_empty() {
            self.0.push(' ');
        }
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, "{}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            if !self.0.is_empty() {
                self.0.push(' ');
            }
            self.0.push_str(value);
        } else {
            self.record_debug(field, &value);
        }
    }
}

/// Python's number for a level.
fn python_level(level: tracing::Level) -> u8 {
    match level {
        tracing::Level::ERROR => 40,
        tracing::Level::WARN => 30,
        tracing::Level::INFO => 20,
        tracing::Level::DEBUG => 10,
        tracing::Level::TRACE => 5,
    }
}

impl<S: tracing::Subscriber> Layer<S> for PythonLogging {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut line = Line::default();
        event.record(&mut line);
        let level = python_level(*event.metadata().level());
        // Not while the interpreter shuts down: the record is dropped then.
        let _ = Python::try_attach(|py| -> PyResult<()> {
            py.import("logging")?
                .call_method1("getLogger", ("legend",))?
                .call_method1("log", (level, line.0))?;
            Ok(())
        });
    }
}

/// Routes the engine's events to Python's `logging`, unless the process already has a
/// `tracing` subscriber (another extension's): then they go there.
pub fn install() {
    let filter = EnvFilter::try_from_env("LEGEND_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::registry()
        .with(PythonLogging.with_filter(filter))
        .try_init();
}
