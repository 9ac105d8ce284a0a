//! `legendctl train`: a [`Session`] driven from the terminal (a progress bar, log lines,
//! `--json` lines), stopped by SIGINT/SIGTERM before its next batch, with a checkpoint there
//! (`stopping`: what it says when asked).

mod stopping;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use legend_engine::Config;
use legend_engine::evaluation::describe;
use legend_engine::session::{Event, Outcome, Session};
use legend_fs::Unguarded;
use stopping::{Phase, StopNotes};

/// Arguments of `legendctl train`.
#[derive(clap::Args)]
pub struct Args {
    /// The dataset directory (from `legendctl import`); with --resume, defaults to the run's.
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// The run directory to create (or to continue with --resume).
    #[arg(long)]
    out: PathBuf,
    /// Configuration file (TOML); every key has a default.
    config: Option<PathBuf>,
    /// Override a configuration key, e.g. `--set model.dim=100` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long)]
    resume: bool,
    /// Seed the new run from the run RUN, trained on the dataset --dataset extends (`legendctl
    /// import --extend`): its rows and relations (its best validated epoch's when it kept
    /// them) are carried over, the new ones drawn (training.new_rows); training.freeze and
    /// training.replay choose what trains.
    #[arg(long, value_name = "RUN", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Print one JSON object per epoch, and the final evaluation, on stdout.
    #[arg(long)]
    json: bool,
    /// Train on the first K GPUs that CUDA_VISIBLE_DEVICES shows, one worker each (the same
    /// as `--set training.gpus=K`; the table is then in the K GPUs' memory together).
    #[arg(long, value_name = "K")]
    gpus: Option<u32>,
    /// A job on several hosts (see Documentation/admin-guide.md, "Several hosts").
    #[command(flatten)]
    hosts: super::hosts::HostArgs,
}

/// How often progress is logged inside an epoch when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(10);

pub fn run(mut args: Args) -> anyhow::Result<()> {
    if let Some(k) = args.gpus {
        args.sets.push(format!("training.gpus={k}"));
    }
    let launch = super::hosts::launch(&args.hosts)?;
    if let Some(l) = &launch {
        args.sets.push(format!("training.hosts={}", l.hosts));
    }
    // From the start: a signal while the run is being set up stops it before its first batch.
    // A resumed run starts from its checkpoint (corrected once it is read), a new one from
    // nothing.
    let notes = StopNotes::new(&args.out, "scratch (no checkpoint yet)".into());
    let stop = super::stop_on_signals(
        {
            let notes = notes.clone();
            move |signal| notes.first(signal)
        },
        {
            let notes = notes.clone();
            move |signal| notes.second(signal)
        },
    )?;
    let Some(launch) = launch else {
        return train(&args, &stop, None, notes);
    };
    let token = super::hosts::token()?;
    if args.resume && args.config.is_some() {
        bail!("--resume continues with the run's own config.toml; change keys with --set");
    }
    let config = if args.resume {
        None
    } else {
        Some(read_config(&args)?)
    };
    let identity = super::hosts::identity(config.as_ref(), args.dataset.as_deref(), &args.sets)?;
    let cluster = super::hosts::join(&launch, &args.hosts, token, &identity)?;
    cluster.watch_stop(stop.clone());
    if !cluster.is_leader() {
        return super::hosts::follow(cluster, args.dataset.as_deref(), stop);
    }
    // Whatever ends host 0 (an error included) ends every host, told why.
    train(&args, &stop, Some(cluster.clone()), notes).inspect_err(|e| {
        cluster.fail(format!("{} failed: {e:#}", cluster.host(0)));
    })
}

/// The configuration of a new run: the file, then the `--set`s.
fn read_config(args: &Args) -> anyhow::Result<Config> {
    let text = match &args.config {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
        }
        None => String::new(),
    };
    Config::parse(&text, &args.sets).with_context(|| match &args.config {
        Some(p) => format!("{}", p.display()),
        None => "configuration".into(),
    })
}

/// Trains the run of `args` (as host 0 of `hosts`, when given); `notes` say what a stop does.
fn train(
    args: &Args,
    stop: &std::sync::atomic::AtomicBool,
    hosts: Option<legend_cluster::Cluster>,
    notes: StopNotes,
) -> anyhow::Result<()> {
    let out = &args.out;
    let finish = |stopped: bool| {
        if let Some(c) = &hosts {
            c.finish(stopped);
        }
    };
    let (mut session, _lock) = if args.resume {
        if args.config.is_some() {
            bail!("--resume continues with the run's own config.toml; change keys with --set");
        }
        let lock = legend_engine::incremental::lock_exclusive(out)?;
        let session = Session::resume_on(
            out,
            args.dataset.as_deref(),
            &args.sets,
            &Unguarded,
            hosts.clone(),
        )?;
        if session.is_finished()? {
            finish(false);
            outln!(
                "{}: all {} epochs are trained and evaluated; nothing to do (raise training.num_epochs with --set to train more)",
                out.display(),
                session.config().training.num_epochs
            )?;
            return Ok(());
        }
        let from = session.position().describe();
        tracing::info!("resuming {} from {from}", out.display());
        notes.set_checkpoint(from);
        (session, lock)
    } else {
        let Some(dataset) = &args.dataset else {
            bail!("--dataset DIR is required (or --resume an existing run)");
        };
        let config = read_config(args)?;
        let made = super::create_parent(out)?;
        let session = match &args.init_from {
            Some(init) if hosts.is_none() => {
                Session::create_from(out, dataset, config, &Unguarded, init)?
            }
            Some(_) => bail!("--init-from seeds a run on one host"),
            None => Session::create_on(out, dataset, config, &Unguarded, hosts.clone())?,
        };
        made.keep();
        let lock = legend_engine::incremental::lock_exclusive(out)?;
        (session, lock)
    };
    // Held while the run trains: `--init-from` refuses a run whose tables are being written.
    tracing::info!("device: {}", session.engine());
    tracing::info!("{}", session.describe());
    let mut view = ProgressView::new(args.json, notes);
    let outcome = session.run(stop, &mut |event| view.show(event))?;
    drop(view);
    finish(matches!(outcome, Outcome::Stopped(_)));
    match outcome {
        Outcome::Finished(Some(m)) if !args.json => {
            let split = session.config().evaluation.split.split();
            // The epoch ranked, in the words of `legendctl eval RUN`, which ranks the same.
            let epoch = match session.best_epoch() {
                Some(e) => format!("epoch {e} (the best validated, in {}/best)", out.display()),
                None => format!("epoch {}", session.position().epochs_completed),
            };
            outln!(
                "{} {}, {epoch}: {}",
                out.display(),
                split.name(),
                describe(&m)
            )?;
        }
        Outcome::Finished(_) => {}
        Outcome::Stopped(position) => {
            // The checkpoint is committed; the process ends as an interrupted one does.
            errln!(
                "interrupted: {} is checkpointed at {}; continue with `legendctl train --out {} --resume`",
                out.display(),
                position.describe(),
                out.display()
            );
            drop(session);
            std::process::exit(130);
        }
    }
    // The trained run's labels indexed now, its tables let go first, so that its first query
    // does not pay for it (seconds at 41.65 M labels). A failure costs that query the time.
    drop(session);
    if let Err(e) = legend_query::keep_label_indexes(out, args.dataset.as_deref(), &Unguarded) {
        tracing::warn!(
            "{}: the labels are not indexed ({e}); the first query indexes them",
            out.display()
        );
    }
    Ok(())
}

/// What the terminal shows of a session. On a terminal: one bar over the whole run (epochs,
/// the last epoch's loss and rate, the time left), so that the result is not buried under a
/// line per epoch; validation results above it. Elsewhere (logs, pipes): a line per epoch and
/// one every [`LOG_EVERY`] inside long epochs. `--json` lines go to stdout either way.
struct ProgressView {
    json: bool,
    /// Where the run is, for what a stop says.
    notes: StopNotes,
    bar: Option<ProgressBar>,
    terminal: bool,
    epoch_edges: u64,
    epochs: u32,
    logged: Instant,
    started: Instant,
    last_loss: Option<f64>,
}

impl ProgressView {
    fn new(json: bool, notes: StopNotes) -> ProgressView {
        ProgressView {
            json,
            notes,
            bar: None,
            terminal: std::io::stderr().is_terminal(),
            epoch_edges: 0,
            epochs: 0,
            logged: Instant::now(),
            started: Instant::now(),
            last_loss: None,
        }
    }

    /// The run's bar: its length is every edge of every epoch, so that its rate and time left
    /// hold for short and long epochs alike. It fits the terminal's width (a wrapped bar
    /// redraws as a scrolling mess).
    fn run_bar(epochs: u32, edges: u64) -> ProgressBar {
        let style =
            ProgressStyle::with_template("{prefix} [{wide_bar}] {percent:>3}% {msg}, eta {eta}")
                .expect("static template")
                .progress_chars("=> ");
        ProgressBar::new(u64::from(epochs) * edges.max(1))
            .with_style(style)
            .with_message("first epoch")
    }

    fn show(&mut self, event: Event<'_>) {
        match event {
            Event::EpochStarted {
                epoch,
                epochs,
                edges,
                edges_done,
            } => {
                self.epoch_edges = edges;
                self.epochs = epochs;
                self.logged = Instant::now();
                self.notes.set_phase(Phase::Training { epoch, epochs });
                if self.terminal {
                    let prefix = format!("epoch {epoch}/{epochs}");
                    match &self.bar {
                        Some(bar) => bar.set_prefix(prefix),
                        // Everything set before it is first drawn.
                        None => {
                            let bar = Self::run_bar(epochs, edges)
                                .with_prefix(prefix)
                                .with_position(run_position(epoch, edges, edges_done));
                            self.notes.set_bar(Some(bar.clone()));
                            self.bar = Some(bar);
                        }
                    }
                }
            }
            Event::Progress { epoch, edges_done } => {
                if edges_done >= self.epoch_edges {
                    let epochs = self.epochs;
                    self.notes.set_phase(Phase::EndingEpoch { epoch, epochs });
                }
                self.show_progress(epoch, edges_done);
            }
            Event::EpochFinished {
                report,
                valid,
                line,
            } => {
                self.last_loss = Some(report.loss);
                match &self.bar {
                    Some(bar) => {
                        bar.set_position(run_position(report.epoch + 1, self.epoch_edges, 0));
                        bar.set_message(bar_message(report));
                        if let Some(m) = valid {
                            bar.println(format!("epoch {} valid: {}", report.epoch, describe(m)));
                        }
                        if let Some(w) = &report.workers {
                            bar.println(format!("epoch {}: {}", report.epoch, w.describe()));
                        }
                    }
                    None => {
                        if let Some(m) = valid {
                            tracing::info!("epoch {} valid: {}", report.epoch, describe(m));
                        }
                        tracing::info!(
                            "epoch {}: loss {:.4}, {:.0} edges/s ({} negatives per positive and side), {:.2} s, peak RSS {:.2} GiB{}",
                            report.epoch,
                            report.loss,
                            report.edges_per_sec,
                            report.negatives_per_positive,
                            report.seconds,
                            legend_engine::footprint::gib(report.peak_rss_bytes),
                            report.gpu_memory_bytes.map_or(String::new(), |b| format!(
                                ", GPU memory in use {:.2} GiB",
                                legend_engine::footprint::gib(b)
                            ))
                        );
                        if let Some(w) = &report.workers {
                            tracing::info!("epoch {}: {}", report.epoch, w.describe());
                        }
                    }
                }
                self.print(line);
            }
            Event::Checkpoint { position } => {
                self.notes.set_checkpoint(position.describe());
                tracing::debug!("checkpoint committed at {}", position.describe());
            }
            Event::Evaluating { split } => {
                self.notes.set_phase(Phase::Evaluating);
                self.finish_bar();
                tracing::info!("evaluating on {}", split.name());
            }
            Event::Evaluated { line, .. } => self.print(line),
        }
    }

    /// Moves the bar, or logs how far the epoch is every [`LOG_EVERY`].
    fn show_progress(&mut self, epoch: u32, edges_done: u64) {
        match &self.bar {
            Some(bar) => bar.set_position(run_position(epoch, self.epoch_edges, edges_done)),
            None if self.logged.elapsed() >= LOG_EVERY => {
                self.logged = Instant::now();
                tracing::info!(
                    "epoch {epoch}: {edges_done}/{} edges ({:.0}%)",
                    self.epoch_edges,
                    100.0 * edges_done as f64 / self.epoch_edges.max(1) as f64
                );
            }
            None => {}
        }
    }

    /// Replaces the bar by one line saying what the run trained.
    fn finish_bar(&mut self) {
        if let Some(bar) = self.bar.take() {
            self.notes.set_bar(None);
            bar.finish_and_clear();
            let loss = self
                .last_loss
                .map_or(String::new(), |l| format!(", last loss {l:.4}"));
            errln!(
                "trained in {}{loss}",
                indicatif::HumanDuration(self.started.elapsed())
            );
        }
    }

    /// Writes a `--json` line. When stdout's reader has gone (`| head -1`), training goes on,
    /// since the run directory is what it makes, and the lines stop, said once.
    fn print(&mut self, line: &serde_json::Value) {
        if !self.json {
            return;
        }
        if let Err(e) = super::print_json(line) {
            self.json = false;
            tracing::warn!(
                "writing to stdout: {e}; training goes on (every epoch's line is in the run's metrics.jsonl)"
            );
        }
    }
}

/// Edges trained in the whole run when `epoch` (from 1) has trained `edges_done` of its
/// `edges`.
fn run_position(epoch: u32, edges: u64, edges_done: u64) -> u64 {
    u64::from(epoch.saturating_sub(1)) * edges.max(1) + edges_done
}

/// The bar's message after an epoch: its loss and rate (shown while the next one trains).
fn bar_message(report: &legend_engine::trainer::EpochReport) -> String {
    format!(
        "loss {:.4}, {} edges/s",
        report.loss,
        indicatif::HumanCount(report.edges_per_sec as u64)
    )
}

impl Drop for ProgressView {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            self.notes.set_bar(None);
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_bar_counts_every_epoch_s_edges() {
        assert_eq!(run_position(1, 100, 0), 0);
        assert_eq!(run_position(1, 100, 40), 40);
        assert_eq!(run_position(3, 100, 40), 240);
        // The end of the last epoch is the bar's length.
        assert_eq!(
            run_position(201, 100, 0),
            ProgressView::run_bar(200, 100).length().unwrap()
        );
        // A graph without train edges still moves the bar by epochs.
        assert_eq!(run_position(3, 0, 0), 2);
    }
}
