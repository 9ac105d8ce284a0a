//! Dataset directories from Python: `legendctl import`'s import (interruptible by Ctrl-C,
//! leaving nothing behind), and a dataset's record, labels and edges.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use legend_dataset::{
    Columns, Dataset, DatasetError, Delimiter, Header, ImportInput, ImportOptions, Split, import,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::errors::{OrRaise, bad_argument};
use crate::interrupt::{self, panic_message};
use crate::table::{Rows, Table};

/// Imports text edge lists (or a Marius directory) into the new dataset directory `out`, as
/// `legendctl import` does: exactly one of `train` (with optional `valid` and `test`),
/// `split_files` (with `fractions`) or `marius`. Returns the summary as JSON. Ctrl-C abandons
/// it; nothing is written then.
#[pyfunction]
#[pyo3(signature = (out, *, train=None, valid=None, test=None, split_files=None, fractions=None, marius=None, columns="hrt", delimiter=None, seed=0, keep_unseen=false))]
#[allow(clippy::too_many_arguments)]
pub fn import_dataset(
    py: Python<'_>,
    out: PathBuf,
    train: Option<PathBuf>,
    valid: Option<PathBuf>,
    test: Option<PathBuf>,
    split_files: Option<Vec<PathBuf>>,
    fractions: Option<[f64; 3]>,
    marius: Option<PathBuf>,
    columns: &str,
    delimiter: Option<&str>,
    seed: u64,
    keep_unseen: bool,
) -> PyResult<String> {
    let input = match (train, split_files, marius) {
        (Some(train), None, None) => ImportInput::Files { train, valid, test },
        (None, Some(files), None) if valid.is_none() && test.is_none() => ImportInput::Split {
            files,
            fractions: fractions
                .ok_or_else(|| PyValueError::new_err("split files need fractions"))?,
        },
        (None, None, Some(dir)) if valid.is_none() && test.is_none() => ImportInput::Marius { dir },
        _ => {
            return Err(PyValueError::new_err(
                "give exactly one of train (with valid and test), split files or a Marius directory",
            ));
        }
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let options = ImportOptions {
        input,
        delimiter: delimiter
            .map(str::parse::<Delimiter>)
            .transpose()
            .map_err(bad_argument)?,
        columns: columns.parse::<Columns>().map_err(bad_argument)?,
        seed,
        keep_unseen,
        // As legendctl import: a first line naming the columns is skipped, with a warning.
        header: Header::Auto,
        progress: false,
        cancel: Some(cancel.clone()),
    };
    let ended = interrupt::run(
        py,
        &cancel,
        |_: std::sync::mpsc::Sender<()>| import(&options, &out),
        |_, ()| Ok(()),
    );
    let summary = match ended.result {
        Ok(summary) => summary,
        Err(panic) => {
            return Err(PyRuntimeError::new_err(format!(
                "the import panicked: {}",
                panic_message(&*panic)
            )));
        }
    };
    // A Ctrl-C that came too late to stop it leaves a complete dataset: say it anyway.
    if let Some(e) = ended.error {
        return Err(e);
    }
    let summary = summary.or_raise(py)?;
    Ok(serde_json::to_string(&summary).expect("a summary serializes"))
}

/// The record (`dataset.toml`) of the dataset in `path`, as JSON.
#[pyfunction]
pub fn dataset_info(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let dataset = py.detach(|| Dataset::open(&path)).or_raise(py)?;
    Ok(serde_json::to_string(dataset.meta()).expect("a dataset record serializes"))
}

/// The entity and relation labels of the dataset in `path`, by id.
#[pyfunction]
pub fn dataset_labels(py: Python<'_>, path: PathBuf) -> PyResult<(Vec<String>, Vec<String>)> {
    py.detach(|| -> Result<_, DatasetError> {
        let dataset = Dataset::open(&path)?;
        Ok((dataset.entity_labels()?, dataset.relation_labels()?))
    })
    .or_raise(py)
}

/// The edges of `split` of the dataset in `path`: `[head, relation, tail]` ids, one a row.
#[pyfunction]
pub fn dataset_edges(py: Python<'_>, path: PathBuf, split: &str) -> PyResult<Table> {
    let split: Split = split.parse().map_err(bad_argument)?;
    let edges = py
        .detach(|| Dataset::open(&path).and_then(|d| d.edges(split)))
        .or_raise(py)?;
    Ok(Table::new(Rows::U32(edges.into_flattened()), 3))
}
