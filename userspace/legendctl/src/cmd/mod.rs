//! One module per subcommand: its clap arguments and its `run`.

pub mod bench;
pub mod client;
pub mod device;
pub mod eval;
pub mod export;
pub mod generate;
pub mod hosts;
pub mod import;
pub mod partition;
pub mod plan;
pub mod query;
pub mod report;
pub mod train;

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context;

use serde::Serialize;

/// Prints `value` as one line of JSON on stdout.
pub fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

/// Makes the missing directories above `path` (a run or export directory the engine creates in
/// an existing parent).
pub fn create_parent(path: &std::path::Path) -> anyhow::Result<()> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => {
            std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))
        }
        _ => Ok(()),
    }
}

/// A flag raised by SIGINT/SIGTERM instead of dying, so that import and generate stop at their
/// next check and remove their temporary directory (an interrupted command leaves nothing), and
/// train stops at its next checkpointable point. A second signal ends the process at once.
pub fn cancel_on_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let cancel = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Registered first, so it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(signal, 130, cancel.clone())
            .context("installing a signal handler")?;
        signal_hook::flag::register(signal, cancel.clone())
            .context("installing a signal handler")?;
    }
    Ok(cancel)
}

/// Parses `train,valid,test` fractions such as `0.9,0.05,0.05` (checked further by the library).
pub fn parse_fractions(s: &str) -> Result<[f64; 3], String> {
    let parts: Vec<f64> = s
        .split(',')
        .map(|p| p.trim().parse::<f64>().map_err(|e| format!("{p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    <[f64; 3]>::try_from(parts)
        .map_err(|p| format!("expected three fractions train,valid,test, got {}", p.len()))
}
