//! Errors of dataset import and loading.

use std::io;
use std::path::PathBuf;

/// An error while importing, partitioning or reading a dataset.
///
/// Every variant names the file it concerns, and parse errors name the line, so that a user can
/// go straight to the bad input.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A line of a text input could not be parsed.
    #[error("{path}:{line}: {message}")]
    Parse {
        /// The input file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong with the line.
        message: String,
    },
    /// A file is structurally wrong as a whole (empty, bad size, bad metadata).
    #[error("{path}: {message}")]
    Invalid {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A command-line style option has an unusable value.
    #[error("{0}")]
    Options(String),
    /// The import was interrupted (SIGINT/SIGTERM); nothing was written.
    #[error("interrupted; nothing was written")]
    Interrupted,
}

/// Result alias for this crate.
pub type Result<T, E = DatasetError> = std::result::Result<T, E>;

/// Attaches a path to an [`io::Error`].
pub(crate) trait IoContext<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| DatasetError::Io {
            path: path.into(),
            source,
        })
    }
}

pub(crate) fn invalid(path: impl Into<PathBuf>, message: impl Into<String>) -> DatasetError {
    DatasetError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}
