//! One module per subcommand: its clap arguments and its `run`.

pub mod device;
pub mod eval;
pub mod export;
pub mod generate;
pub mod import;
pub mod partition;
pub mod plan;
pub mod report;
pub mod train;

use std::io::Write;

use serde::Serialize;

/// Prints `value` as one line of JSON on stdout.
pub fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}
