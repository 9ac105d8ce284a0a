//! `legendctl plan`.

use std::path::PathBuf;

use anyhow::Context;
use legend_dataset::Dataset;
use legend_planner::{Order, PredictionInput, plan, predict};
use serde::Serialize;

/// Arguments of `legendctl plan`.
#[derive(clap::Args)]
pub struct Args {
    /// Number of node partitions N.
    #[arg(long, short = 'n')]
    partitions: u32,
    /// Buffer capacity C (partitions resident at once).
    #[arg(long, short = 'c', required_unless_present = "gpus")]
    buffer: Option<u32>,
    /// Plan rounds for K GPUs instead (N = 2K: each GPU holds two partitions, handed from GPU to
    /// GPU between rounds), balanced by the dataset's bucket sizes with `--dataset`.
    #[arg(long, conflicts_with_all = ["buffer", "order"])]
    gpus: Option<u32>,
    /// With `--gpus`: edges a batch (`training.batch_size`), the unit the rounds balance.
    #[arg(long, default_value_t = 100_000)]
    batch_size: u64,
    /// `auto` (legend at C = 3, else beta), `legend` (Algorithms 1+2, C = 3), `beta` (Marius)
    /// or `sequential`.
    #[arg(long, default_value = "auto")]
    order: Order,
    /// Print the plan as one JSON object.
    #[arg(long)]
    json: bool,
    /// Predict epoch time (Theorem 3) from this dataset's counts and bucket sizes.
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// Prediction: edges (default: the dataset's train edges).
    #[arg(long)]
    edges: Option<u64>,
    /// Prediction: nodes (default: the dataset's entities).
    #[arg(long)]
    nodes: Option<u64>,
    /// Prediction: embedding dimension.
    #[arg(long, default_value_t = 100)]
    dim: u32,
    /// Prediction: AdaGrad's state, `element` (d floats a row) or `row` (one), as
    /// `optimizer.state`.
    #[arg(long, default_value = "element")]
    state: legend_model::StateLayout,
    /// Prediction: the embeddings' format at rest, `f32`, `bf16` or `f16`, as `storage.dtype`.
    #[arg(long, default_value = "f32")]
    dtype: legend_model::Dtype,
    /// Prediction: buffer bytes M (default: C partitions of embeddings + state).
    #[arg(long)]
    buffer_bytes: Option<f64>,
    /// Prediction: compute seconds per edge.
    #[arg(long, default_value_t = 1e-7)]
    seconds_per_edge: f64,
    /// Prediction: write bandwidth, bytes/s.
    #[arg(long, default_value_t = 2e9)]
    write_bw: f64,
    /// Prediction: read bandwidth, bytes/s.
    #[arg(long, default_value_t = 3e9)]
    read_bw: f64,
}

#[derive(Serialize)]
struct WithPrediction<'a> {
    #[serde(flatten)]
    plan: &'a legend_planner::Plan,
    prediction: legend_planner::Prediction,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let Some(buffer) = args.buffer else {
        return run_gpus(&args);
    };
    let plan = plan(args.partitions, buffer, args.order)?;
    let mut bucket_edges = None;
    let (mut edges, mut nodes) = (args.edges, args.nodes);
    if let Some(dir) = &args.dataset {
        let ds = Dataset::open(dir)?;
        let buckets = ds.buckets(args.partitions)?;
        bucket_edges = Some(buckets.counts());
        edges = edges.or(Some(ds.meta().splits.train));
        nodes = nodes.or(Some(ds.meta().entities));
    }
    let prediction = match (edges, nodes) {
        (Some(edges), Some(nodes)) => {
            let dim = args.dim as usize;
            let row_bytes = (dim * args.dtype.bytes() + args.state.width(dim) * 4) as f64;
            let partition_bytes = nodes.div_ceil(u64::from(args.partitions)) as f64 * row_bytes;
            let input = PredictionInput {
                edges,
                nodes,
                row_bytes,
                buffer_bytes: args
                    .buffer_bytes
                    .unwrap_or(partition_bytes * f64::from(buffer)),
                seconds_per_edge: args.seconds_per_edge,
                write_bytes_per_s: args.write_bw,
                read_bytes_per_s: args.read_bw,
                bucket_edges,
            };
            Some(predict(&plan, &input).context("prediction")?)
        }
        _ => None,
    };
    if args.json {
        match prediction {
            Some(prediction) => super::print_json(&WithPrediction {
                plan: &plan,
                prediction,
            })?,
            None => super::print_json(&plan)?,
        }
        return Ok(());
    }
    outln!(
        "order {} with N = {}, C = {buffer}:",
        plan.kind,
        args.partitions
    )?;
    for (i, s) in plan.states.iter().enumerate() {
        outln!("  state {i:>3}: {s:?}")?;
    }
    for (i, s) in plan.swaps.iter().enumerate() {
        outln!(
            "  swap {i:>3}: evict {:>3} load {:>3}  overlap {:?}  after {:?}",
            s.evicted,
            s.loaded,
            s.overlap,
            s.after
        )?;
    }
    outln!(
        "io_count {}  volume {:.3}× the store  swaps_without_overlap {}",
        plan.io_count,
        plan.volume,
        plan.swaps_without_overlap
    )?;
    if let Some(p) = prediction {
        outln!(
            "Theorem 3: density {:.3e} vs threshold {:.3e}: I/O {} hidden; predicted epoch {:.2} s with overlap, {:.2} s without",
            p.density,
            p.threshold,
            if p.theorem3_holds {
                "fully"
            } else {
                "not fully"
            },
            p.epoch_s_with_overlap,
            p.epoch_s_without_overlap
        )?;
    }
    Ok(())
}

/// What `legendctl plan --gpus K --json` prints: the schedule and its figures.
#[derive(Serialize)]
struct GpuPlanReport<'a> {
    #[serde(flatten)]
    schedule: &'a legend_planner::GpuSchedule,
    /// Partitions moved an epoch (handed from GPU to GPU with N = 2K, read from the home when
    /// parked), and the fewest any schedule of as many rounds can do (every GPU's pair changes
    /// at every transition).
    moves_per_epoch: usize,
    fewest_moves: usize,
    /// Bytes those moves carry (resident f32 rows and their state), with `--dataset` or
    /// `--nodes`.
    bytes_per_epoch: Option<f64>,
    /// The fewest rounds: 2K − 1 with N = 2K (a partition meets one other a round);
    /// ⌈N(N − 1) / 2K⌉ when parked (every pair once, K a round).
    fewest_rounds: u32,
}

/// `legendctl plan --gpus K`: the rounds, hand-overs and predicted balance of K GPUs.
fn run_gpus(args: &Args) -> anyhow::Result<()> {
    let k = args.gpus.expect("clap requires --gpus without --buffer");
    let n = args.partitions;
    let (batches, nodes) = match &args.dataset {
        Some(dir) => {
            let ds = Dataset::open(dir)?;
            let counts = ds.buckets(n)?.counts();
            let b = args.batch_size.max(1);
            let batches: Vec<u64> = counts.iter().map(|c| c.div_ceil(b)).collect();
            (batches, args.nodes.or(Some(ds.meta().entities)))
        }
        // Equal buckets of one batch each: the schedule's shape alone.
        None => (vec![1; (n * n) as usize], args.nodes),
    };
    let schedule = legend_planner::plan_gpus(n, k, &batches)?;
    let dim = args.dim as usize;
    let row_bytes = (dim + args.state.width(dim)) as f64 * 4.0;
    let parks = schedule.parks();
    let (moves, fewest_rounds) = if parks {
        let pairs = u64::from(n) * u64::from(n - 1) / 2;
        (schedule.home_loads, pairs.div_ceil(u64::from(k)) as u32)
    } else {
        (schedule.moves_per_epoch(), (2 * k).saturating_sub(1))
    };
    let report = GpuPlanReport {
        schedule: &schedule,
        moves_per_epoch: moves,
        fewest_moves: (k * fewest_rounds.saturating_sub(1)) as usize,
        bytes_per_epoch: nodes
            .map(|nodes| moves as f64 * nodes.div_ceil(u64::from(n)) as f64 * row_bytes),
        fewest_rounds,
    };
    if args.json {
        return super::print_json(&report);
    }
    outln!(
        "{k} GPUs over N = {n} partitions: {} rounds (fewest possible {})",
        schedule.rounds.len(),
        report.fewest_rounds
    )?;
    for (r, round) in schedule.rounds.iter().enumerate() {
        for (g, held) in round.held.iter().enumerate() {
            let pieces: Vec<String> = round.work[g]
                .iter()
                .map(|p| {
                    format!(
                        "({}, {})[{}..{}]",
                        p.bucket[0], p.bucket[1], p.batches.start, p.batches.end
                    )
                })
                .collect();
            outln!(
                "  round {r:>3} GPU {g}: holds {held:?}  trains {}",
                pieces.join(" ")
            )?;
        }
        if parks && r + 1 < schedule.rounds.len() {
            let loads: Vec<String> = (0..k as usize)
                .flat_map(|g| {
                    schedule
                        .from_home(r, r + 1, g)
                        .into_iter()
                        .map(move |p| format!("{p} → GPU {g}"))
                })
                .collect();
            outln!("  then read from home: {}", loads.join(", "))?;
        } else if let Some(moves) = schedule.handovers.get(r) {
            let moves: Vec<String> = moves
                .iter()
                .map(|m| format!("{} GPU {}→{}", m.partition, m.from, m.to))
                .collect();
            outln!("  then hand over: {}", moves.join(", "))?;
        }
    }
    if parks {
        outln!(
            "partitions parked in host memory between rounds: {} reads from home an epoch, {} of them exposed (a GPU taking two partitions at once), the others read while the round before trains",
            schedule.home_loads,
            schedule.exposed_loads
        )?;
    }
    outln!(
        "{} {moves} an epoch (fewest possible {}){}; predicted imbalance {:.3} (slowest GPU's batches over a perfect split{})",
        if parks { "moves" } else { "hand-overs" },
        report.fewest_moves,
        report
            .bytes_per_epoch
            .map(|b| format!(", {:.2} GB", b / 1e9))
            .unwrap_or_default(),
        schedule.predicted_imbalance,
        if args.dataset.is_some() {
            ", from the dataset's buckets"
        } else {
            "; give --dataset for its buckets"
        }
    )?;
    Ok(())
}
