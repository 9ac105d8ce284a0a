//! `legendd`: Legend's training service. It owns `/dev/legend-nvme*` and the GPUs, runs users'
//! jobs (train, eval, export, serve) in queues per device, each in a process of its own
//! (`legendd job`, see `worker` and `process`), and answers `legendctl` on a Unix socket,
//! identifying callers by their credentials (`SO_PEERCRED`). `Documentation/daemon-api.md`
//! describes the protocol, the service and its threat model.

mod access;
mod budget;
mod channel;
mod config;
mod extents;
mod handover;
mod jobs;
mod notify;
mod paths;
mod process;
mod serve;
mod server;
mod worker;

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use clap::Parser;

use crate::config::DaemonConfig;

/// Legend's training service.
#[derive(Parser)]
#[command(name = "legendd", version, about)]
struct Args {
    /// Configuration file.
    #[arg(long, default_value = "/etc/legend/legendd.toml")]
    config: PathBuf,
    /// Stay in the foreground and log to stderr (the service does too; systemd keeps it).
    #[arg(long)]
    foreground: bool,
    /// Listen here instead of the configured socket.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Keep jobs here instead of the configured state directory.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Log filter (tracing syntax). Also `LEGEND_LOG`.
    #[arg(long)]
    log: Option<String>,
}

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread starts (a job's process keeps it too).
    unsafe { legend_cuda::nccl::keep_multicast_off() };
    // A job's process: the daemon's own binary, started by the daemon with its job on
    // descriptor 3 (never by hand).
    if std::env::args_os().nth(1).is_some_and(|a| a == "job") {
        return worker::main();
    }
    let args = Args::parse();
    let filter = args
        .log
        .clone()
        .or_else(|| std::env::var("LEGEND_LOG").ok())
        .unwrap_or_else(|| "info".into());
    // journald adds its own timestamps; plain lines without colour read well there.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        // A log line that cannot be written (a full disk, a file over its size limit, a closed
        // pipe) is lost, never fatal: the default reports it with `eprintln!`, which panics
        // when stderr fails, and the daemon with it.
        .log_internal_errors(false)
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    // What jobs create is group-writable: handed to their submitters when they end, the files
    // stay writable by the daemon through the group of the directory they are in, for resumes.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o002));
    let explicit = args.config != std::path::Path::new("/etc/legend/legendd.toml");
    let mut config = DaemonConfig::load(&args.config, explicit)?;
    if !explicit && !args.config.exists() {
        tracing::warn!(
            "no configuration file at {}: every setting at its default (systemd/legendd.toml \
             lists them)",
            args.config.display()
        );
    }
    if let Some(s) = args.socket {
        config.socket = s;
    }
    if let Some(d) = args.state_dir {
        config.state_dir = d;
    }
    if !args.foreground && std::env::var_os("NOTIFY_SOCKET").is_none() {
        tracing::info!("running in the foreground (legendd does not fork; systemd supervises it)");
    }
    let shutdown = Arc::new(AtomicBool::new(false));
    // The flag says a signal came; the byte wakes the accept loop, which blocks until then.
    let (wake, waker) = UnixStream::pair().context("a socket pair for signals")?;
    waker.set_nonblocking(true)?;
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, shutdown.clone())
            .context("installing signal handlers")?;
        signal_hook::low_level::pipe::register(signal, waker.try_clone()?)
            .context("installing signal handlers")?;
    }
    // Jobs' cgroups: found (and, under cgroup v2, the daemon moved into its leaf) before any
    // thread starts.
    process::cgroup::hierarchy();
    let jobs = jobs::Jobs::open(&config).context("opening the state directory")?;
    let listener = server::bind(&config.socket)?;
    tracing::info!(
        "legendd {} listening on {} (state in {})",
        env!("CARGO_PKG_VERSION"),
        config.socket.display(),
        config.state_dir.display()
    );
    let scheduler = jobs.start_scheduler();
    if let Some(port) = config.metrics_port {
        let timeout = std::time::Duration::from_secs(config.request_timeout_s);
        server::http::serve_metrics_http(port, jobs.clone(), timeout)?;
    }
    notify::ready();
    server::serve(listener, &config, jobs.clone(), &shutdown, &wake);
    notify::stopping();
    tracing::info!("stopping: running jobs checkpoint and will resume at the next start");
    jobs.shut_down();
    let _ = scheduler.join();
    let _ = std::fs::remove_file(&config.socket);
    shutdown.store(true, Ordering::Relaxed);
    Ok(())
}
