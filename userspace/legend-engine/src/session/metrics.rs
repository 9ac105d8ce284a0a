//! The run's metrics.jsonl: an epoch a line, and the final evaluations.

use std::fs::File;
use std::io::Write;

use legend_fs::Dir;

use crate::run;

use super::{SessionError, io_error};

/// The metrics file of a run.
pub(super) const METRICS_FILE: &str = "metrics.jsonl";

pub(super) fn append_line(
    metrics: &mut File,
    run: &Dir,
    line: &serde_json::Value,
) -> Result<(), SessionError> {
    writeln!(metrics, "{line}").map_err(io_error(&run.join(METRICS_FILE)))
}

/// The lines of metrics.jsonl (none if it does not exist yet).
pub(super) fn metrics_lines(run: &Dir) -> Result<String, SessionError> {
    match run.read_to_string(METRICS_FILE) {
        Ok(text) => Ok(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(io_error(&run.join(METRICS_FILE))(e)),
    }
}

fn is_final(line: &serde_json::Value) -> bool {
    line.get("final").and_then(serde_json::Value::as_bool) == Some(true)
}

/// Whether the last record of metrics.jsonl is a final evaluation: nothing was trained after
/// the run was last evaluated.
pub(super) fn has_final_line(run: &Dir) -> Result<bool, SessionError> {
    Ok(metrics_lines(run)?
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .is_some_and(|v| is_final(&v)))
}

/// Drops the metrics.jsonl records of epochs after `epochs` (trained after the checkpoint the
/// run resumes from, so they will be trained again), the final evaluations that followed them,
/// and lines a crash cut short, so that each epoch is recorded once.
pub(super) fn keep_metrics_up_to(run: &Dir, epochs: u32) -> Result<(), SessionError> {
    let text = metrics_lines(run)?;
    let mut dropped_epoch = false;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
                return false;
            };
            if is_final(&v) {
                return !dropped_epoch;
            }
            let keep = v
                .get("epoch")
                .and_then(serde_json::Value::as_u64)
                .is_some_and(|e| e <= u64::from(epochs));
            dropped_epoch |= !keep;
            keep
        })
        .collect();
    if kept.len() == text.lines().count() {
        return Ok(());
    }
    let mut new = kept.join("\n");
    if !new.is_empty() {
        new.push('\n');
    }
    Ok(run::write_atomically(run, METRICS_FILE, new.as_bytes())?)
}
