//! One module per subcommand: its clap arguments and its `run`.

/// `println!` that returns the write's error (an `anyhow::Result<()>`) instead of panicking,
/// so that a reader going away (`legendctl plan | head -1`: a broken pipe) ends the command at
/// its next line; `main` takes a broken pipe for success. `println!` itself is refused by
/// clippy here (`clippy.toml`).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let written = writeln!(std::io::stdout().lock(), $($arg)*);
        written.map_err(anyhow::Error::from)
    }};
}

/// `eprintln!` for notes to the user on stderr, which are lost, not fatal, when stderr is gone
/// (`legendctl ... 2>&1 | head -1`), as log lines are.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

pub mod bench;
pub mod client;
pub mod device;
pub mod eval;
pub mod export;
pub mod generate;
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
use legend_engine::which_tables::Pick;

use serde::Serialize;

/// Prints `value` as one line of JSON on stdout.
pub fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    // Written whole, so that a closed pipe is an `io::Error` that `main` recognises (serde's
    // writer would wrap it in an error whose chain skips it).
    let mut line = serde_json::to_vec(value)?;
    line.push(b'\n');
    std::io::stdout().lock().write_all(&line)?;
    Ok(())
}

/// `--last` as a [`Pick`]: which of a run's tables a command reads.
pub fn pick(last: bool) -> Pick {
    if last { Pick::Last } else { Pick::Best }
}

/// Makes the missing directories above `path` (a run or export directory the engine creates in
/// an existing parent); they go again unless the caller keeps them once its output exists, so
/// that a refused command leaves nothing.
pub fn create_parent(path: &std::path::Path) -> anyhow::Result<legend_fs::MadeDirs> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    legend_fs::MadeDirs::create(parent).with_context(|| format!("creating {}", parent.display()))
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
