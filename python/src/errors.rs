//! Rust errors as the Python exceptions of `legend.errors`: the message is the error with its
//! sources on one line (as `legendctl` prints it, [`legend_engine::error_chain::with_sources`]),
//! and the exception's `chain` attribute lists the error and each source apart.

use std::error::Error;

use legend_dataset::DatasetError;
use legend_engine::run::RunError;
use legend_engine::session::SessionError;
use legend_query::QueryError;
use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The classes of `legend.errors` a Rust error is raised as.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `ConfigError` (also a `ValueError`).
    Config,
    /// `DatasetError`.
    Dataset,
    /// `RunError`.
    Run,
    /// `QueryError` (also a `ValueError`).
    Query,
    /// `UnknownNameError` (also a `KeyError`): a label that is not in the dataset.
    UnknownName,
    /// `TrainingError`.
    Training,
    /// `DaemonError`.
    Daemon,
}

impl Kind {
    fn class_name(self) -> &'static str {
        match self {
            Kind::Config => "ConfigError",
            Kind::Dataset => "DatasetError",
            Kind::Run => "RunError",
            Kind::Query => "QueryError",
            Kind::UnknownName => "UnknownNameError",
            Kind::Training => "TrainingError",
            Kind::Daemon => "DaemonError",
        }
    }
}

/// `e` and its sources, outermost first.
fn chain(e: &dyn Error) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        out.push(s.to_string());
        source = s.source();
    }
    out
}

/// The exception `kind` for `e`, its message the whole chain.
pub fn raise(py: Python<'_>, kind: Kind, e: &dyn Error) -> PyErr {
    let message = legend_engine::error_chain::with_sources(e);
    with_chain(py, kind, message, chain(e))
}

/// The exception `kind` for a message without a Rust error behind it.
pub fn raise_message(py: Python<'_>, kind: Kind, message: String) -> PyErr {
    let chain = vec![message.clone()];
    with_chain(py, kind, message, chain)
}

fn with_chain(py: Python<'_>, kind: Kind, message: String, chain: Vec<String>) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let class = py.import("legend.errors")?.getattr(kind.class_name())?;
        let value = class.call1((message.clone(),))?;
        value.setattr("chain", chain)?;
        Ok(PyErr::from_value(value))
    })();
    // Only a broken installation (legend.errors missing) gets here: say so, with the message.
    made.unwrap_or_else(|e| {
        PyRuntimeError::new_err(format!("{message} (and legend.errors failed to load: {e})"))
    })
}

/// A `ValueError` for an argument the crates refuse (an unknown device, split, delimiter...),
/// in their words.
pub fn bad_argument(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// How each crate's errors are raised.
pub trait ToPy {
    /// The Python exception for this error.
    fn to_py(&self, py: Python<'_>) -> PyErr;
}

impl ToPy for RunError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise(py, Kind::Run, self)
    }
}

impl ToPy for DatasetError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        match self {
            // Nothing was written: the interruption is the user's Ctrl-C, raised as Python does.
            DatasetError::Interrupted => PyKeyboardInterrupt::new_err(self.to_string()),
            _ => raise(py, Kind::Dataset, self),
        }
    }
}

impl ToPy for QueryError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let kind = match self {
            QueryError::Unknown { .. } => Kind::UnknownName,
            QueryError::Run(_) => Kind::Run,
            QueryError::RunDataset(_) | QueryError::Dataset(_) => Kind::Dataset,
            _ => Kind::Query,
        };
        raise(py, kind, self)
    }
}

impl ToPy for SessionError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let kind = match self {
            SessionError::Config(_) => Kind::Config,
            SessionError::Dataset(_) => Kind::Dataset,
            SessionError::Run(_) => Kind::Run,
            _ => Kind::Training,
        };
        raise(py, kind, self)
    }
}

impl ToPy for legend_engine::ConfigError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise(py, Kind::Config, self)
    }
}

/// `Result::map_err` to the Python exception, for any error with a [`ToPy`].
pub trait OrRaise<T> {
    /// The value, or the error raised in Python.
    fn or_raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T, E: ToPy> OrRaise<T> for Result<T, E> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| e.to_py(py))
    }
}
