//! `legend._legend`: the extension module behind the `legend` Python package (python/legend).
//! It wraps Legend's crates, not the CLI's output: training sessions (legend-engine), queries
//! (legend-query), dataset import (legend-dataset) and legendd's protocol (legend-daemon-api).
//! The Python package turns what it returns into NumPy arrays, pandas DataFrames and iterators;
//! Documentation/python.md is the reference.
//!
//! Every call that reads, trains or waits releases the GIL; rows are handed to NumPy through
//! the buffer protocol, memory-mapped where the run's files allow ([`table`]).

mod client;
mod config;
mod dataset;
mod errors;
mod interrupt;
mod logs;
mod run;
mod table;
mod train;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _legend(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logs::install();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<table::Table>()?;
    m.add_class::<run::RunHandle>()?;
    m.add_class::<client::Connection>()?;
    m.add_class::<client::Watch>()?;
    m.add_function(wrap_pyfunction!(train::train, m)?)?;
    m.add_function(wrap_pyfunction!(dataset::import_dataset, m)?)?;
    m.add_function(wrap_pyfunction!(dataset::dataset_info, m)?)?;
    m.add_function(wrap_pyfunction!(dataset::dataset_labels, m)?)?;
    m.add_function(wrap_pyfunction!(dataset::dataset_edges, m)?)?;
    m.add_function(wrap_pyfunction!(config::config_toml, m)?)?;
    m.add_function(wrap_pyfunction!(config::override_settings, m)?)?;
    Ok(())
}
