//! The daemon's client: `legendctl submit`, `jobs`, `status`, `watch`, `cancel`, `logs` talk
//! to `legendd` on its socket (`--socket`, `LEGEND_SOCKET`, else `/run/legend/legendd.sock`).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use legend_daemon_api::{
    DEFAULT_SOCKET, Envelope, JobInfo, JobSpec, JobState, MAX_FRAME, PROTOCOL_VERSION, Reply,
    Request, read_message, write_message,
};
use legend_engine::which_tables::{self, Pick};

/// A connection to `legendd`.
pub struct Client {
    stream: UnixStream,
}

/// The socket to use: `--socket`, `LEGEND_SOCKET`, the default.
fn socket_path(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("LEGEND_SOCKET").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET))
}

impl Client {
    /// Connects, with a one-line error when no daemon answers.
    pub fn connect(flag: Option<&Path>) -> anyhow::Result<Client> {
        let path = socket_path(flag);
        let stream = UnixStream::connect(&path).map_err(|e| {
            anyhow::anyhow!(
                "cannot reach legendd at {} ({e}): is it running? (`systemctl start legendd`, or `legendd --foreground --socket {}`)",
                path.display(),
                path.display()
            )
        })?;
        Ok(Client { stream })
    }

    fn send(&mut self, request: Request) -> anyhow::Result<()> {
        write_message(
            &mut self.stream,
            &Envelope {
                v: PROTOCOL_VERSION,
                request,
            },
        )
        .context("sending to legendd")
    }

    fn receive(&mut self) -> anyhow::Result<Reply> {
        match read_message::<Reply>(&mut self.stream, MAX_FRAME).context("reading from legendd")? {
            Some(Reply::Error { code, message }) => {
                bail!(
                    "legendd refused ({}): {message}",
                    serde_json::to_string(&code)?.trim_matches('"')
                )
            }
            Some(reply) => Ok(reply),
            None => bail!("legendd closed the connection"),
        }
    }

    /// Sends `request` and returns its one reply.
    pub fn call(&mut self, request: Request) -> anyhow::Result<Reply> {
        self.send(request)?;
        self.receive()
    }

    fn job(&mut self, request: Request) -> anyhow::Result<JobInfo> {
        match self.call(request)? {
            Reply::Job { job } => Ok(job),
            other => bail!("unexpected reply from legendd: {other:?}"),
        }
    }
}

/// Arguments of `legendctl submit`.
#[derive(clap::Args)]
pub struct SubmitArgs {
    #[command(subcommand)]
    job: SubmitCommand,
}

#[derive(clap::Subcommand)]
enum SubmitCommand {
    /// Train, as `legendctl train` does, in the daemon.
    Train {
        /// The dataset directory; with --resume, defaults to the run's.
        #[arg(long)]
        dataset: Option<PathBuf>,
        /// The run directory to create (or to continue with --resume); in a directory you own.
        #[arg(long)]
        out: PathBuf,
        /// Configuration file (TOML), read here and sent with the job.
        config: Option<PathBuf>,
        /// Override a configuration key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Continue the run in --out from its last checkpoint.
        #[arg(long)]
        resume: bool,
        /// Follow the job until it ends (as `legendctl watch`).
        #[arg(long)]
        watch: bool,
        /// Print the job as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Evaluate a run, as `legendctl eval` does, in the daemon.
    Eval {
        /// The run directory: its best validated epoch's tables when it kept them (the job is
        /// then on `RUN/best`), else its last checkpoint's.
        run: PathBuf,
        /// Rank the run's last checkpoint even when it kept a best epoch in `RUN/best`.
        #[arg(long)]
        last: bool,
        /// `filtered` or `sampled`.
        #[arg(long, default_value = "filtered")]
        protocol: String,
        /// `test` or `valid`.
        #[arg(long, default_value = "test")]
        split: String,
        /// Follow the job until it ends.
        #[arg(long)]
        watch: bool,
        /// Print the job as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Keep a run's embeddings in the daemon's memory and answer `legendctl query JOB ...` on
    /// it until cancelled.
    Serve {
        /// The run directory (yours): its best validated epoch's tables when it kept them (the
        /// job is then on `RUN/best`), else its last checkpoint's.
        run: PathBuf,
        /// Serve the run's last checkpoint even when it kept a best epoch in `RUN/best`.
        #[arg(long)]
        last: bool,
        /// Members of this group (one of yours) may query it too.
        #[arg(long)]
        group: Option<String>,
        /// Where to answer: `cpu`, `cuda:N` or `auto` (default: the daemon's `serve_device`);
        /// on a GPU the run's entity rows go into its memory when they fit the daemon's share
        /// for serving (`serve_gpu_memory`).
        #[arg(long)]
        device: Option<legend_engine::config::DeviceChoice>,
        /// Print the job as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Export a run's embeddings, as `legendctl export` does, in the daemon.
    Export {
        /// The run directory: its best validated epoch's tables when it kept them (the job is
        /// then on `RUN/best`), else its last checkpoint's.
        run: PathBuf,
        /// Export the run's last checkpoint even when it kept a best epoch in `RUN/best`.
        #[arg(long)]
        last: bool,
        /// `npy`, `tsv` or `bin`.
        #[arg(long)]
        format: legend_engine::export::Format,
        /// The output directory (default RUN/export), in a directory you own.
        #[arg(long, short = 'o')]
        out: Option<PathBuf>,
        /// Follow the job until it ends.
        #[arg(long)]
        watch: bool,
        /// Print the job as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `path` made absolute against the current directory, its parent resolved (it may not exist
/// yet itself).
fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    let abs = std::path::absolute(path).with_context(|| path.display().to_string())?;
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => Ok(std::fs::canonicalize(parent)
            .with_context(|| parent.display().to_string())?
            .join(name)),
        _ => Ok(abs),
    }
}

/// The tables of `run` that `last` picks, said on stderr: the directory a job on them names.
fn chosen_tables(run: &Path, last: bool) -> anyhow::Result<PathBuf> {
    let tables = which_tables::choose(run, super::pick(last))?;
    errln!("{}: the job reads {}", run.display(), tables.describe());
    absolute(&tables.dir)
}

pub fn submit(socket: Option<&Path>, args: SubmitArgs) -> anyhow::Result<()> {
    let (spec, watch_it, json) = match args.job {
        SubmitCommand::Train {
            dataset,
            out,
            config,
            sets,
            resume,
            watch,
            json,
        } => {
            let config = match config {
                Some(p) => std::fs::read_to_string(&p)
                    .with_context(|| format!("reading {}", p.display()))?,
                None => String::new(),
            };
            let spec = JobSpec::Train {
                dataset: dataset.as_deref().map(absolute).transpose()?,
                out: absolute(&out)?,
                config,
                sets,
                resume,
            };
            (spec, watch, json)
        }
        SubmitCommand::Eval {
            run,
            last,
            protocol,
            split,
            watch,
            json,
        } => (
            JobSpec::Eval {
                run: chosen_tables(&run, last)?,
                protocol,
                split,
            },
            watch,
            json,
        ),
        SubmitCommand::Serve {
            run,
            last,
            group,
            device,
            json,
        } => (
            JobSpec::Serve {
                run: chosen_tables(&run, last)?,
                group,
                device: device.map(|d| d.to_string()),
            },
            false,
            json,
        ),
        SubmitCommand::Export {
            run,
            last,
            format,
            out,
            watch,
            json,
        } => (
            JobSpec::Export {
                out: absolute(&out.unwrap_or_else(|| run.join("export")))?,
                run: chosen_tables(&run, last)?,
                format: format.to_string(),
            },
            watch,
            json,
        ),
    };
    let mut client = Client::connect(socket)?;
    let job = client.job(Request::Submit { job: spec })?;
    if json {
        super::print_json(&job)?;
    } else {
        let queue = match job.device.as_deref() {
            Some(d) if d != job.spec.kind() => format!("{} on {d}", job.spec.kind()),
            _ => job.spec.kind().to_owned(),
        };
        outln!(
            "job {} queued ({queue}): it runs in a process and a memory cgroup of its own, as \
             uid {} (a job that holds an NVMe controller: as a uid of the daemon's); `legendctl \
             status {}` shows its pid, uid, cgroup and memory",
            job.id,
            job.owner,
            job.id
        )?;
    }
    if watch_it {
        return follow(client, job.id, json);
    }
    Ok(())
}

/// Arguments of `legendctl jobs`.
#[derive(clap::Args)]
pub struct JobsArgs {
    /// Everyone's jobs (the daemon's admin group).
    #[arg(long)]
    all: bool,
    /// Print JSON (one array).
    #[arg(long)]
    json: bool,
}

pub fn jobs(socket: Option<&Path>, args: JobsArgs) -> anyhow::Result<()> {
    let mut client = Client::connect(socket)?;
    let Reply::Jobs { jobs } = client.call(Request::List { all: args.all })? else {
        bail!("unexpected reply from legendd");
    };
    if args.json {
        return super::print_json(&jobs);
    }
    outln!(
        "{:>5}  {:<10} {:<6} {:>6}  {:<8} {:<14} {:>8} dir",
        "id",
        "state",
        "kind",
        "owner",
        "device",
        "progress",
        "memory"
    )?;
    for j in &jobs {
        let p = &j.progress;
        let progress = if p.epochs > 0 {
            format!("epoch {}/{}", p.epoch, p.epochs)
        } else {
            "-".into()
        };
        // The job's process's peak memory (in its cgroup), while it runs and after.
        let memory = j
            .process
            .as_ref()
            .and_then(|p| p.peak_memory)
            .map_or("-".to_string(), |b| format!("{}M", b >> 20));
        outln!(
            "{:>5}  {:<10} {:<6} {:>6}  {:<8} {:<14} {:>8} {}",
            j.id,
            j.state.name(),
            j.spec.kind(),
            j.owner,
            j.device.as_deref().unwrap_or("-"),
            progress,
            memory,
            j.spec.dir().display()
        )?;
    }
    Ok(())
}

/// `legendctl status`: one job, its process included.
pub fn status(socket: Option<&Path>, args: JobArgs) -> anyhow::Result<()> {
    let job = Client::connect(socket)?.job(Request::Status { job: args.job })?;
    if args.json {
        return super::print_json(&job);
    }
    outln!(
        "job {}: {} {} of uid {}, {}",
        job.id,
        job.state.name(),
        job.spec.kind(),
        job.owner,
        job.spec.dir().display()
    )?;
    let p = &job.progress;
    if p.epochs > 0 {
        outln!(
            "  epoch {}/{}, {}/{} edges, {:.0} edges/s",
            p.epoch,
            p.epochs,
            p.edges_done,
            p.edges,
            p.edges_per_sec
        )?;
    }
    if let Some(p) = &job.process {
        let mib = |b: Option<u64>| b.map_or("-".to_string(), |b| format!("{} MiB", b >> 20));
        outln!(
            "  process {} as uid {}, cgroup {}, memory limit {}, peak {}",
            p.pid,
            p.uid,
            p.cgroup.as_deref().unwrap_or("none"),
            mib(p.memory_limit),
            mib(p.peak_memory)
        )?;
    }
    if let Some(e) = &job.error {
        outln!("  error: {e}")?;
    }
    if let Some(r) = &job.result {
        outln!("  result: {r}")?;
    }
    Ok(())
}

/// Arguments of `legendctl watch`, `status`, `cancel` and `logs`.
#[derive(clap::Args)]
pub struct JobArgs {
    /// The job id.
    job: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Metrics as `legendctl eval` prints them: protocol, MRR, Hits@k, mean rank.
fn metrics_text(value: &serde_json::Value) -> String {
    match serde_json::from_value::<legend_eval::Metrics>(value.clone()) {
        Ok(m) => legend_engine::evaluation::describe(&m),
        Err(_) => format!("{value}"),
    }
}

pub fn watch(socket: Option<&Path>, args: JobArgs) -> anyhow::Result<()> {
    follow(Client::connect(socket)?, args.job, args.json)
}

/// Shows job `id`'s events until it ends: a progress bar on a terminal, epoch lines, and the
/// end; fails unless the job succeeded.
fn follow(mut client: Client, id: u64, json: bool) -> anyhow::Result<()> {
    client.send(Request::Watch { job: id })?;
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr()) && !json;
    let mut bar: Option<ProgressBar> = None;
    let ended = loop {
        match client.receive()? {
            Reply::Event { event, .. } => {
                if json {
                    super::print_json(&event)?;
                    continue;
                }
                match event["type"].as_str() {
                    Some("progress") if terminal => {
                        let p = &event["progress"];
                        let b = bar.get_or_insert_with(|| {
                            let b = ProgressBar::new(p["edges"].as_u64().unwrap_or(0));
                            b.set_style(
                                ProgressStyle::with_template(
                                    "epoch {prefix:>4} [{bar:30}] {pos}/{len} edges {per_sec} eta {eta}",
                                )
                                .expect("static template")
                                .progress_chars("=> "),
                            );
                            b
                        });
                        b.set_prefix(format!("{}/{}", p["epoch"], p["epochs"]));
                        b.set_length(p["edges"].as_u64().unwrap_or(0));
                        b.set_position(p["edges_done"].as_u64().unwrap_or(0));
                    }
                    Some("epoch") => {
                        if let Some(b) = bar.take() {
                            b.finish_and_clear();
                        }
                        let l = &event["line"];
                        errln!(
                            "epoch {}: loss {:.4}, {:.0} edges/s, {:.2} s",
                            l["epoch"],
                            l["loss"].as_f64().unwrap_or(f64::NAN),
                            l["edges_per_sec"].as_f64().unwrap_or(0.0),
                            l["seconds"].as_f64().unwrap_or(0.0)
                        );
                        if l["valid"].is_object() {
                            errln!("epoch {} valid: {}", l["epoch"], metrics_text(&l["valid"]));
                        }
                    }
                    // What the job's process says (why it stopped early, say).
                    Some("log") => {
                        let line = || errln!("{}", event["text"].as_str().unwrap_or(""));
                        match &bar {
                            Some(b) => b.suspend(line),
                            None => line(),
                        }
                    }
                    Some("evaluated") => {
                        if let Some(b) = bar.take() {
                            b.finish_and_clear();
                        }
                        let line = &event["line"];
                        let split = line["split"].as_str().unwrap_or("?");
                        // Ranked with the best epoch's tables (RUN/best) when they were kept.
                        let best = line["best_epoch"]
                            .as_u64()
                            .map_or(String::new(), |e| format!(" (best epoch {e})"));
                        // The job's result: on stdout, like `legendctl train`'s.
                        outln!("{split}{best}: {}", metrics_text(&line["metrics"]))?;
                    }
                    _ => {}
                }
            }
            Reply::Ended { job } => break job,
            other => bail!("unexpected reply from legendd: {other:?}"),
        }
    };
    if let Some(b) = bar.take() {
        b.finish_and_clear();
    }
    if json {
        super::print_json(&ended)?;
    } else {
        outln!("job {} {}", ended.id, ended.state.name())?;
        // An eval job's result is its metrics (a train job's final ones came as an event),
        // with the epoch its tables hold when they can still be read here.
        if let (JobSpec::Eval { run, split, .. }, Some(result)) = (&ended.spec, &ended.result) {
            let epoch = which_tables::choose(run, Pick::Last)
                .map_or(String::new(), |t| format!(", {}", t.describe()));
            outln!("{} {split}{epoch}: {}", run.display(), metrics_text(result))?;
        }
    }
    match ended.state {
        JobState::Succeeded => Ok(()),
        JobState::Failed => bail!(
            "job {} failed: {}",
            ended.id,
            ended.error.as_deref().unwrap_or("(no reason recorded)")
        ),
        state => bail!("job {} is {}", ended.id, state.name()),
    }
}

pub fn cancel(socket: Option<&Path>, args: JobArgs) -> anyhow::Result<()> {
    let job = Client::connect(socket)?.job(Request::Cancel { job: args.job })?;
    if args.json {
        super::print_json(&job)?;
    } else if job.state == JobState::Running {
        // What each kind does with the stop it was just asked for (legendd's jobs.rs).
        let what = match &job.spec {
            JobSpec::Train { .. } => {
                "stopping at its next checkpointable point, where it commits a checkpoint \
                 (`legendctl submit train --out RUN --resume` continues from there)"
            }
            JobSpec::Serve { .. } => {
                "stops serving within a second: queries are refused from then on, and it ends"
            }
            JobSpec::Eval { .. } | JobSpec::Export { .. } => {
                "cannot stop midway: it runs to its end (an export's files appear only complete)"
            }
        };
        outln!("job {} ({}): {what}", job.id, job.spec.kind())?;
    } else {
        outln!("job {} {}", job.id, job.state.name())?;
    }
    Ok(())
}

pub fn delete(socket: Option<&Path>, args: JobArgs) -> anyhow::Result<()> {
    let job = Client::connect(socket)?.job(Request::Delete { job: args.job })?;
    if args.json {
        super::print_json(&job)?;
    } else {
        outln!("job {} deleted", job.id)?;
    }
    Ok(())
}

pub fn logs(socket: Option<&Path>, args: JobArgs) -> anyhow::Result<()> {
    let Reply::Text { text } = Client::connect(socket)?.call(Request::Logs { job: args.job })?
    else {
        bail!("unexpected reply from legendd");
    };
    use std::io::Write as _;
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(())
}
