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
    #[arg(long, short = 'c')]
    buffer: u32,
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
    let plan = plan(args.partitions, args.buffer, args.order)?;
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
                    .unwrap_or(partition_bytes * f64::from(args.buffer)),
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
        "order {} with N = {}, C = {}:",
        plan.kind,
        args.partitions,
        args.buffer
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
