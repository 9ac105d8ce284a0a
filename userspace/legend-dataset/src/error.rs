//! Errors of dataset import and loading.

use std::io;
use std::path::PathBuf;

/// An error while importing, partitioning or reading a dataset.
///
/// Every variant names the file it concerns, and parse errors name the line, so that a user can
/// go straight to the bad input.
///
/// A message never repeats its cause: [`DatasetError::Io`] displays its path only and returns the
/// [`io::Error`] from [`std::error::Error::source`], so a report that walks the chain (such as
/// `anyhow`'s `{:#}`) prints each part once: `nope.tsv: No such file or directory (os error 2)`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DatasetError {
    /// An I/O error on a named file; the message is the path, the cause is the source.
    #[error("{path}")]
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

/// What is wrong with one record of an input, a line or an edge (the caller says which, and
/// in which file).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RecordError {
    /// A line with too few or too many columns.
    #[error("{what}: expected {width} columns ({columns}), found {count}")]
    Columns {
        /// `missing column` or `wrong column count`.
        what: &'static str,
        /// Columns expected.
        width: usize,
        /// Their order's name.
        columns: &'static str,
        /// Columns found.
        count: usize,
    },
    /// A column with nothing in it (1-based).
    #[error("empty field in column {0}")]
    EmptyField(usize),
    /// A label beyond the 32-bit ids.
    #[error("more than 4,294,967,294 distinct labels")]
    TooManyLabels,
    /// An edge whose ids lie outside the dataset's tables.
    #[error("is outside {entities} entities / {relations} relations")]
    OutOfRange {
        /// The dataset's entities.
        entities: u64,
        /// Its relations.
        relations: u64,
    },
}

/// Why entity ids cannot be split into partitions as asked ([`crate::PartitionScheme::new`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PartitionSchemeError {
    /// No partitions.
    #[error("the number of partitions must be at least 1")]
    NoPartitions,
    /// No entities.
    #[error("the dataset has no entities")]
    NoEntities,
    /// More partitions than entities.
    #[error(
        "{partitions} partitions for {entities} entities: every partition needs at least one entity"
    )]
    MorePartitionsThanEntities {
        /// Partitions asked for.
        partitions: u32,
        /// Entities.
        entities: u64,
    },
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

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    /// Displays `err` and its sources as `anyhow`'s `{:#}` does: `a: b: c`.
    fn chain(err: &dyn std::error::Error) -> String {
        let mut out = err.to_string();
        let mut next = err.source();
        while let Some(e) = next {
            out.push_str(": ");
            out.push_str(&e.to_string());
            next = e.source();
        }
        out
    }

    #[test]
    fn an_io_error_names_its_cause_once() {
        let err = std::fs::File::open("/nonexistent/nope.tsv")
            .at("/nonexistent/nope.tsv")
            .unwrap_err();
        assert_eq!(err.to_string(), "/nonexistent/nope.tsv");
        assert!(err.source().is_some(), "the io::Error must stay the source");
        assert_eq!(
            chain(&err),
            "/nonexistent/nope.tsv: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn messages_without_a_source_carry_their_text() {
        let err = invalid("ds/meta.toml", "bad version");
        assert!(err.source().is_none());
        assert_eq!(chain(&err), "ds/meta.toml: bad version");
    }
}
