//! `legendctl predict`, `score`, `neighbors`: queries on a run, answered here (legend-query),
//! and `legendctl query JOB ...`: the same queries asked of a run a legendd serve job holds.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use legend_daemon_api::{MAX_ANSWER_HITS, MAX_QUERIES, Queries, Reply, Request};
use legend_engine::config::DeviceChoice;
use legend_engine::which_tables::{self, Tables};
use legend_fs::Unguarded;
use legend_query::{
    Answer, DEFAULT_CACHE_FRACTION, DEFAULT_TOP, GpuOptions, LineKind, Metric, Query, QueryRun,
    Residency, parse_line,
};

/// Queries answered together (a batch: one scan of the run's entities); a file of more is
/// answered in several batches.
const BATCH: usize = 1024;

/// What `predict` asks: one of --head, --tail or --queries (a missing one is named with the
/// others, so that `predict` without --head points at --tail too).
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("asked").args(["head", "tail", "queries"]).required(true)))]
pub struct PredictArgs {
    /// The known head: predict tails (label, or id).
    #[arg(long)]
    head: Option<String>,
    /// The known tail: predict heads (label, or id).
    #[arg(long)]
    tail: Option<String>,
    /// The relation.
    #[arg(long, conflicts_with = "queries", required_unless_present = "queries")]
    relation: Option<String>,
    /// Entities to return per query.
    #[arg(long, default_value_t = DEFAULT_TOP)]
    top: usize,
    /// Leave out entities that form a known triple (train, valid or test).
    #[arg(long)]
    filtered: bool,
    /// A file of queries, one a line: `HEAD<TAB>RELATION<TAB>?` or `?<TAB>RELATION<TAB>TAIL`
    /// (`-`: stdin).
    #[arg(long)]
    queries: Option<PathBuf>,
}

/// What `score` asks.
#[derive(clap::Args)]
pub struct ScoreArgs {
    /// Triples, one a line: `HEAD<TAB>RELATION<TAB>TAIL`, by label or id (default, or `-`:
    /// stdin).
    file: Option<PathBuf>,
}

/// What `neighbors` asks.
#[derive(clap::Args)]
pub struct NeighborsArgs {
    /// The entity (label, or id).
    #[arg(long, conflicts_with = "queries", required_unless_present = "queries")]
    entity: Option<String>,
    /// Entities to return per query.
    #[arg(long, default_value_t = DEFAULT_TOP)]
    top: usize,
    /// `cosine`, `dot` or `l2` (scored as the negative distance).
    #[arg(long, default_value = "cosine")]
    metric: Metric,
    /// A file of entities, one a line (`-`: stdin).
    #[arg(long)]
    queries: Option<PathBuf>,
}

/// How answers are printed, and where the run's dataset is.
#[derive(clap::Args)]
pub struct Output {
    /// One JSON object per answer.
    #[arg(long)]
    json: bool,
    /// The run's dataset, only if it moved since training (labels and known triples).
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// Answer with the run's last checkpoint even when it kept a best epoch in `RUN/best`
    /// (by default its tables answer, as they gave the result `legendctl train` printed).
    #[arg(long)]
    last: bool,
    /// Read the run's entities from its checkpoint or store a piece at a time for every batch,
    /// even when they would fit in memory (by default a run whose entity rows take at most
    /// half the memory available is read once into memory).
    #[arg(long)]
    streamed: bool,
    /// Where to answer: `cpu`, `cuda:N`, or `auto` (device 0 when a CUDA driver is present and
    /// it opens, else the CPU), as `training.device`. On a GPU the entity rows go into its
    /// memory when they fit; `predict` and `neighbors` scan there, giving the CPU's answers.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// On a GPU, for a run whose entity rows do not fit its memory: the row cache over the
    /// run's store that `score` reads rows through, as a fraction of the table (0: none).
    #[arg(long, default_value_t = DEFAULT_CACHE_FRACTION)]
    cache_fraction: f64,
}

/// A query with where it came from (for errors).
type Located = (String, Query);

/// Reads queries a line at a time from `path` (`-`: stdin), skipping blank and `#` lines.
fn read_lines(path: &Path, kind: LineKind) -> anyhow::Result<Vec<Located>> {
    let reader: Box<dyn BufRead> = if path == Path::new("-") {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(path).with_context(|| path.display().to_string())?;
        Box::new(std::io::BufReader::new(file))
    };
    let name = if path == Path::new("-") {
        "stdin".to_string()
    } else {
        path.display().to_string()
    };
    let mut out = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        let line = line.with_context(|| name.clone())?;
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let at = format!("{name}:{}", n + 1);
        let query = parse_line(kind, line, &at)?;
        out.push((at, query));
    }
    Ok(out)
}

impl PredictArgs {
    fn queries(&self) -> anyhow::Result<Vec<Located>> {
        let kind = LineKind::Predict {
            top: self.top,
            filtered: self.filtered,
        };
        if let Some(path) = &self.queries {
            return read_lines(path, kind);
        }
        let query = Query::Predict {
            head: self.head.clone(),
            relation: self.relation.clone().expect("required by clap"),
            tail: self.tail.clone(),
            top: self.top,
            filtered: self.filtered,
        };
        Ok(vec![("the query".into(), query)])
    }
}

impl ScoreArgs {
    fn queries(&self) -> anyhow::Result<Vec<Located>> {
        read_lines(
            self.file.as_deref().unwrap_or(Path::new("-")),
            LineKind::Score,
        )
    }
}

impl NeighborsArgs {
    fn queries(&self) -> anyhow::Result<Vec<Located>> {
        let kind = LineKind::Neighbors {
            top: self.top,
            metric: self.metric,
        };
        if let Some(path) = &self.queries {
            return read_lines(path, kind);
        }
        let query = Query::Neighbors {
            entity: self.entity.clone().expect("required by clap"),
            top: self.top,
            metric: self.metric,
        };
        Ok(vec![("the query".into(), query)])
    }
}

/// Prints `answers` as text or JSON lines; a JSON line names the epoch of the `tables` that
/// answered, when known here.
fn print(answers: &[Answer], json: bool, tables: Option<&Tables>) -> anyhow::Result<()> {
    for a in answers {
        match tables {
            Some(t) if json => {
                let mut line = serde_json::to_value(a)?;
                line["epoch"] = t.epoch.into();
                line["tables"] = t.kind.into();
                super::print_json(&line)?;
            }
            None if json => super::print_json(a)?,
            _ => outln!("{}", a.text())?,
        }
    }
    Ok(())
}

/// Answers `queries` on the run `run`, a batch of [`BATCH`] at a time: from memory when the
/// run's entity rows fit in half the memory available (read once), else (or with `--streamed`)
/// each batch reading them from the checkpoint or store a piece at a time, once for the rows the
/// batch names and once to score every entity. Each batch's time goes to stderr.
fn answer_here(run: &Path, queries: &[Located], out: &Output) -> anyhow::Result<()> {
    if queries.is_empty() {
        bail!("no queries given");
    }
    let residency = if out.streamed {
        Residency::Streamed
    } else {
        Residency::Fitting
    };
    if !(0.0..=1.0).contains(&out.cache_fraction) {
        bail!(
            "--cache-fraction {} is not between 0 and 1",
            out.cache_fraction
        );
    }
    let gpu = GpuOptions {
        cache_fraction: out.cache_fraction,
        ..GpuOptions::on(out.device)
    };
    let tables = which_tables::choose(run, super::pick(out.last))?;
    errln!("{}: answering with {}", run.display(), tables.describe());
    let loading = Instant::now();
    let q = QueryRun::open_on(
        &tables.dir,
        out.dataset.as_deref(),
        &Unguarded,
        residency,
        &gpu,
    )?;
    if q.model().is_resident() {
        errln!(
            "{} entity rows {} in {:.3} s (the run opened)",
            q.model().num_entities(),
            if q.model().is_mapped() {
                "mapped from the checkpoint"
            } else {
                "read into memory"
            },
            loading.elapsed().as_secs_f64()
        );
    }
    errln!("answering on {}", q.placement());
    for (b, batch) in queries.chunks(BATCH).enumerate() {
        let started = Instant::now();
        let asked: Vec<Query> = batch.iter().map(|(_, q)| q.clone()).collect();
        let answers = q.answer(&asked, usize::MAX, &|i| batch[i].0.clone())?;
        errln!(
            "batch {}: {} queries in {:.3} s ({} entities)",
            b + 1,
            batch.len(),
            started.elapsed().as_secs_f64(),
            q.model().num_entities()
        );
        print(&answers, out.json, Some(&tables))?;
    }
    Ok(())
}

/// Arguments of `legendctl predict`.
#[derive(clap::Args)]
pub struct Predict {
    /// The run directory.
    run: PathBuf,
    #[command(flatten)]
    ask: PredictArgs,
    #[command(flatten)]
    out: Output,
}

/// Arguments of `legendctl score`.
#[derive(clap::Args)]
pub struct Score {
    /// The run directory.
    run: PathBuf,
    #[command(flatten)]
    ask: ScoreArgs,
    #[command(flatten)]
    out: Output,
}

/// Arguments of `legendctl neighbors`.
#[derive(clap::Args)]
pub struct Neighbors {
    /// The run directory.
    run: PathBuf,
    #[command(flatten)]
    ask: NeighborsArgs,
    #[command(flatten)]
    out: Output,
}

pub fn predict(args: Predict) -> anyhow::Result<()> {
    answer_here(&args.run, &args.ask.queries()?, &args.out)
}

pub fn score(args: Score) -> anyhow::Result<()> {
    answer_here(&args.run, &args.ask.queries()?, &args.out)
}

pub fn neighbors(args: Neighbors) -> anyhow::Result<()> {
    answer_here(&args.run, &args.ask.queries()?, &args.out)
}

/// Arguments of `legendctl query`.
#[derive(clap::Args)]
pub struct QueryArgs {
    /// The serve job (`legendctl submit serve RUN`).
    job: u64,
    #[command(subcommand)]
    ask: Asked,
    /// One JSON object per answer.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(clap::Subcommand)]
enum Asked {
    /// The best entities for the missing end of a triple.
    Predict(PredictArgs),
    /// Scores of triples.
    Score(ScoreArgs),
    /// The nearest entities of an entity.
    Neighbors(NeighborsArgs),
    /// Entities' rows.
    Lookup {
        /// The entity (label, or id); repeatable.
        #[arg(long = "entity", required = true)]
        entities: Vec<String>,
    },
}

/// `queries` in requests of at most [`MAX_QUERIES`] queries asking for at most
/// [`MAX_ANSWER_HITS`] entities together (what the daemon answers in a frame).
fn batches<T>(queries: &[(T, Query)]) -> impl Iterator<Item = &[(T, Query)]> {
    let mut rest = queries;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let (mut n, mut hits) = (0, 0);
        while n < rest.len() && n < MAX_QUERIES {
            let top = match &rest[n].1 {
                Query::Predict { top, .. } | Query::Neighbors { top, .. } => *top,
                _ => 0,
            };
            if n > 0 && hits + top > MAX_ANSWER_HITS {
                break;
            }
            hits += top;
            n += 1;
        }
        let (batch, left) = rest.split_at(n);
        rest = left;
        Some(batch)
    })
}

/// Asks the serve job `args.job` the queries, in requests the daemon answers in a frame (see
/// `batches`); each request's time in the daemon goes to stderr.
pub fn query(socket: Option<&Path>, args: QueryArgs) -> anyhow::Result<()> {
    let queries = match &args.ask {
        Asked::Predict(a) => a.queries()?,
        Asked::Score(a) => a.queries()?,
        Asked::Neighbors(a) => a.queries()?,
        Asked::Lookup { entities } => entities
            .iter()
            .map(|e| ("--entity".to_string(), Query::Lookup { entity: e.clone() }))
            .collect(),
    };
    if queries.is_empty() {
        bail!("no queries given");
    }
    let mut client = super::client::Client::connect(socket)?;
    for (b, batch) in batches(&queries).enumerate() {
        let asked: Vec<&Query> = batch.iter().map(|(_, q)| q).collect();
        let asked = Queries::of(&asked)?;
        let started = Instant::now();
        let reply = client.call(Request::Query {
            job: args.job,
            queries: asked,
        });
        // The daemon names a bad query by its place in the request: say where it came from.
        let reply = reply.map_err(|e| {
            let first = batch.first().map_or("", |(at, _)| at.as_str());
            e.context(format!("batch {} (from {first})", b + 1))
        })?;
        let Reply::Answers { answers, seconds } = reply else {
            bail!("unexpected reply from legendd: {reply:?}");
        };
        errln!(
            "batch {}: {} queries in {:.3} s in the daemon, {:.3} s here",
            b + 1,
            batch.len(),
            seconds,
            started.elapsed().as_secs_f64()
        );
        let answers = answers
            .into_iter()
            .map(serde_json::from_value)
            .collect::<Result<Vec<Answer>, _>>()
            .context("reading legendd's answers")?;
        print(&answers, args.json, None)?;
    }
    Ok(())
}
