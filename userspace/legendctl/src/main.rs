//! `legendctl`: import graphs, partition them, plan swap orders, train and evaluate embeddings.

#[macro_use]
mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Legend: graph embeddings at billion-edge scale on one machine.
#[derive(Parser)]
#[command(name = "legendctl", version, about, propagate_version = true)]
struct Cli {
    /// Log filter (tracing syntax), e.g. `debug` or `legend_dataset=trace`. Also `LEGEND_LOG`.
    #[arg(long, global = true, value_name = "FILTER")]
    log: Option<String>,
    /// The daemon's socket for submit, jobs, watch, cancel and logs. Also `LEGEND_SOCKET`.
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import delimited text or a Marius directory into a dataset directory.
    Import(cmd::import::Args),
    /// Sort a dataset's train edges into N×N partition buckets.
    Partition(cmd::partition::Args),
    /// Compute and validate a partition-swap order.
    Plan(cmd::plan::Args),
    /// Train embeddings on a dataset.
    Train(cmd::train::Args),
    /// Evaluate a run's embeddings (link prediction).
    Eval(cmd::eval::Args),
    /// Export a run's embeddings with labels.
    Export(cmd::export::Args),
    /// The best entities to complete a triple (link prediction) with a run's embeddings.
    Predict(cmd::query::Predict),
    /// Score triples with a run's embeddings.
    Score(cmd::query::Score),
    /// The nearest entities of an entity in a run's embeddings.
    Neighbors(cmd::query::Neighbors),
    /// Generate a synthetic power-law graph as a dataset directory.
    Generate(cmd::generate::Args),
    /// Draw a run's compute-vs-I/O timeline per swap (SVG or HTML).
    Report(cmd::report::Args),
    /// NVMe controllers for GPU-direct I/O: list, bind, unbind, info, health.
    Device(cmd::device::Args),
    /// Benchmarks: `bench io` measures a store target's I/O rate.
    Bench(cmd::bench::Args),
    /// Submit a job to legendd (train, eval, export or serve).
    Submit(cmd::client::SubmitArgs),
    /// Jobs known to legendd.
    Jobs(cmd::client::JobsArgs),
    /// One legendd job: its state, progress, and its process (pid, uid, cgroup, memory).
    Status(cmd::client::JobArgs),
    /// Follow a legendd job until it ends.
    Watch(cmd::client::JobArgs),
    /// Cancel a legendd job: a queued one at once; a running train job at its next
    /// checkpointable point (with a checkpoint); a serve job within a second; eval and export
    /// jobs run to their end.
    Cancel(cmd::client::JobArgs),
    /// A legendd job's log.
    Logs(cmd::client::JobArgs),
    /// Ask a run a legendd serve job holds: predict, score, neighbors, lookup.
    Query(cmd::query::QueryArgs),
    /// Forget an ended legendd job; the last train job of a run on an NVMe namespace frees the
    /// run's extent there (its store is gone).
    Delete(cmd::client::JobArgs),
}

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread starts.
    unsafe { legend_cuda::nccl::keep_multicast_off() };
    let cli = Cli::parse();
    let filter = cli
        .log
        .clone()
        .or_else(|| std::env::var("LEGEND_LOG").ok())
        .unwrap_or_else(|| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal, not in logs and pipes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        // A log line that cannot be written (a closed pipe, a full disk) is lost, never fatal:
        // the default reports it with `eprintln!`, which panics when stderr fails, mid-run.
        .log_internal_errors(false)
        .init();
    let result = match cli.command {
        Command::Import(args) => cmd::import::run(args),
        Command::Partition(args) => cmd::partition::run(args),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Train(args) => cmd::train::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Export(args) => cmd::export::run(args),
        Command::Predict(args) => cmd::query::predict(args),
        Command::Score(args) => cmd::query::score(args),
        Command::Neighbors(args) => cmd::query::neighbors(args),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Report(args) => cmd::report::run(args),
        Command::Device(args) => cmd::device::run(args, cli.socket.as_deref()),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Submit(args) => cmd::client::submit(cli.socket.as_deref(), args),
        Command::Jobs(args) => cmd::client::jobs(cli.socket.as_deref(), args),
        Command::Status(args) => cmd::client::status(cli.socket.as_deref(), args),
        Command::Watch(args) => cmd::client::watch(cli.socket.as_deref(), args),
        Command::Cancel(args) => cmd::client::cancel(cli.socket.as_deref(), args),
        Command::Delete(args) => cmd::client::delete(cli.socket.as_deref(), args),
        Command::Logs(args) => cmd::client::logs(cli.socket.as_deref(), args),
        Command::Query(args) => cmd::query::query(cli.socket.as_deref(), args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) if is_broken_pipe(&err) => ExitCode::SUCCESS,
        Err(err) => {
            errln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// `legendctl ... | head` closing the pipe early is not a failure.
fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
