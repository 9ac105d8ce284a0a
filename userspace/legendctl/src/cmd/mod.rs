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
pub mod hosts;
pub mod import;
pub mod partition;
pub mod plan;
pub mod query;
pub mod report;
pub mod train;

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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

/// Makes SIGINT (Ctrl-C) and SIGTERM ask the command to stop instead of killing it: the first
/// raises the returned flag, which the command checks (import and generate then remove their
/// temporary directory; train stops at its next batch with a checkpoint), and `first` says at
/// once what will happen; a second ends the process at once, with status 130, after `second`
/// has said what that leaves. Both are told the signal's name (`Ctrl-C`, `SIGTERM`).
pub fn stop_on_signals(
    first: impl Fn(&str) + Send + 'static,
    second: impl Fn(&str) + Send + 'static,
) -> anyhow::Result<Arc<AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("installing a signal handler")?;
    let raised = stop.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for (n, signal) in signals.forever().enumerate() {
                let name = if signal == SIGINT {
                    "Ctrl-C"
                } else {
                    "SIGTERM"
                };
                if n == 0 {
                    raised.store(true, Ordering::SeqCst);
                    first(name);
                } else {
                    second(name);
                    std::process::exit(130);
                }
            }
        })
        .context("starting the signal thread")?;
    Ok(stop)
}

/// [`stop_on_signals`] for a command that writes a dataset through a hidden temporary directory
/// beside its output (import, generate): the first signal stops `work` (`the import`) and the
/// directory (`.NAME.{staging}-*`) is removed; a second quits at once, which may leave it.
pub fn stop_staging_on_signals(
    work: &'static str,
    staging: &'static str,
) -> anyhow::Result<Arc<AtomicBool>> {
    stop_on_signals(
        move |signal| {
            errln!(
                "{signal}: stopping {work}; its temporary directory is removed and nothing is written (press it again to quit at once, which may leave a hidden .NAME.{staging}-* directory beside the output)"
            )
        },
        |signal| errln!("{signal} again: quitting at once"),
    )
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
