//! Configurations given as Python dicts (sent here as JSON): a whole configuration as TOML
//! text, and overrides as the `key=value` changes `--set` takes, their values TOML literals.

use pyo3::prelude::*;

use crate::errors::{Kind, raise_message};

fn to_toml(py: Python<'_>, json: &str, what: &str) -> PyResult<toml::Value> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| raise_message(py, Kind::Config, format!("{what}: {e}")))?;
    toml::Value::try_from(value).map_err(|e| {
        raise_message(
            py,
            Kind::Config,
            format!("{what}: not expressible in TOML ({e}); use numbers, strings, booleans, lists and dicts"),
        )
    })
}

/// A configuration dict (as JSON) as TOML text: `{"model": {"dim": 100}}` → `[model]\ndim = 100`.
#[pyfunction]
pub fn config_toml(py: Python<'_>, json: &str) -> PyResult<String> {
    let value = to_toml(py, json, "config")?;
    toml::to_string(&value).map_err(|e| {
        raise_message(
            py,
            Kind::Config,
            format!("config: {e} (a configuration is a dict of sections)"),
        )
    })
}

/// Overrides (a JSON object of dotted keys and values) as `key=value` settings:
/// `{"training.batch_size": 1000, "model.decoder": "distmult"}` →
/// `["training.batch_size=1000", "model.decoder=\"distmult\""]`.
#[pyfunction]
pub fn override_settings(py: Python<'_>, json: &str) -> PyResult<Vec<String>> {
    let toml::Value::Table(table) = to_toml(py, json, "overrides")? else {
        return Err(raise_message(
            py,
            Kind::Config,
            "overrides: expected a dict of dotted keys, e.g. {\"training.num_epochs\": 10}".into(),
        ));
    };
    Ok(table
        .into_iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect())
}
