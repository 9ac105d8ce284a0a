//! Legend's Theorem 3 and a simple epoch-time model for a plan.

use serde::Serialize;

use crate::bucket::Bucket;
use crate::error::PredictError;
use crate::plan::Plan;

/// Bytes per node per dimension of the paper's rows (an f32 embedding and an f32 AdaGrad state
/// an element), the unit Theorem 3's constant is written in.
const PAPER_BYTES_PER_NODE_DIM: f64 = 8.0;

/// Theorem 3's constant: 2 overlap buckets per exchange, P = M/6 and n = 8·|V|·d·3/M.
const THEOREM3_CONSTANT: f64 = 96.0;

/// Workload and hardware figures for [`predict`]. Units: bytes, seconds, bytes per second.
#[derive(Debug, Clone, PartialEq)]
pub struct PredictionInput {
    /// |E|: training edges per epoch.
    pub edges: u64,
    /// |V|: nodes.
    pub nodes: u64,
    /// Bytes of one node's row at rest: its embedding and its optimizer state (8·d for f32
    /// rows with element-wise AdaGrad, the paper's; 4·(d + 1) with row-wise state).
    pub row_bytes: f64,
    /// M: GPU buffer bytes (Theorem 3 assumes the C resident partitions fill it).
    pub buffer_bytes: f64,
    /// t: average compute time per edge, in seconds.
    pub seconds_per_edge: f64,
    /// w: partition write-back throughput (GPU → SSD).
    pub write_bytes_per_s: f64,
    /// r: partition read throughput (SSD → GPU).
    pub read_bytes_per_s: f64,
    /// Edges per bucket, row-major (`src * N + dst`), N² entries; `None` assumes |E|/N² each.
    pub bucket_edges: Option<Vec<u64>>,
}

/// What Theorem 3 and the epoch model predict for a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// |E| / |V|², the left side of Theorem 3.
    pub density: f64,
    /// 96·d² / (M·t·(w + r)), the right side of Theorem 3 (d: `row_bytes` / 8).
    pub threshold: f64,
    /// Whether Theorem 3's sufficient condition `density ≥ threshold` holds.
    pub theorem3_holds: bool,
    /// Bytes of one partition: |V|/N · d · 8 (embeddings and AdaGrad state).
    pub partition_bytes: f64,
    /// I/O time of one swap: P/w + P/r.
    pub swap_io_s: f64,
    /// Compute time of all buckets.
    pub compute_s: f64,
    /// Reading the initial state, and writing back the last one; never overlapped.
    pub fill_and_drain_s: f64,
    /// Epoch time when each swap costs max(I/O, its overlap group's compute).
    pub epoch_s_with_overlap: f64,
    /// Epoch time when each swap's I/O and compute run one after the other.
    pub epoch_s_without_overlap: f64,
    /// Swap I/O time not hidden behind compute, with overlap.
    pub exposed_io_s: f64,
}

fn positive(name: &'static str, value: f64) -> Result<f64, PredictError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(PredictError::NonPositive { name, value })
    }
}

/// Predicts whether and how well `plan` hides its I/O (Legend's Theorem 3).
///
/// Model: a bucket computes in `t · edges(bucket)`; a swap's I/O takes `P/w + P/r`. With
/// overlap a swap costs `max(io, overlap compute) + after compute`; without, `io + overlap
/// compute + after compute`. Both add the `initial` group, the initial fill (`C·P/r`) and the
/// final write-back (`C·P/w`).
///
/// # Errors
///
/// [`PredictError::NonPositive`] for a non-positive or non-finite size, time or bandwidth;
/// [`PredictError::BucketCountLength`] when `bucket_edges` does not have N² entries.
pub fn predict(plan: &Plan, input: &PredictionInput) -> Result<Prediction, PredictError> {
    let n = plan.num_partitions as usize;
    let edges = input.edges as f64;
    let nodes = positive("nodes", input.nodes as f64)?;
    let row_bytes = positive("row_bytes", input.row_bytes)?;
    let m = positive("buffer_bytes", input.buffer_bytes)?;
    let t = positive("seconds_per_edge", input.seconds_per_edge)?;
    let w = positive("write_bytes_per_s", input.write_bytes_per_s)?;
    let r = positive("read_bytes_per_s", input.read_bytes_per_s)?;
    if let Some(counts) = &input.bucket_edges
        && counts.len() != n * n
    {
        return Err(PredictError::BucketCountLength {
            expected: n * n,
            got: counts.len(),
        });
    }
    let bucket_s = |b: &Bucket| -> f64 {
        let count = match &input.bucket_edges {
            Some(counts) => counts[b[0] as usize * n + b[1] as usize] as f64,
            None => edges / (n * n) as f64,
        };
        t * count
    };
    let group_s = |g: &[Bucket]| g.iter().map(bucket_s).sum::<f64>();

    let partition_bytes = nodes / n as f64 * row_bytes;
    let swap_io_s = partition_bytes / w + partition_bytes / r;
    let first = plan.states.first().map_or(0, Vec::len) as f64;
    let last = plan.states.last().map_or(0, Vec::len) as f64;
    let fill_and_drain_s = first * partition_bytes / r + last * partition_bytes / w;

    let mut with = fill_and_drain_s + group_s(&plan.initial);
    let mut without = with;
    let mut exposed_io_s = 0.0;
    for swap in &plan.swaps {
        let (overlap, after) = (group_s(&swap.overlap), group_s(&swap.after));
        with += swap_io_s.max(overlap) + after;
        without += swap_io_s + overlap + after;
        exposed_io_s += (swap_io_s - overlap).max(0.0);
    }
    let density = edges / (nodes * nodes);
    // The theorem's d², written for 8·d bytes a row, with the row's real bytes in its place.
    let d = row_bytes / PAPER_BYTES_PER_NODE_DIM;
    let threshold = THEOREM3_CONSTANT * d * d / (m * t * (w + r));
    Ok(Prediction {
        density,
        threshold,
        theorem3_holds: density >= threshold,
        partition_bytes,
        swap_io_s,
        compute_s: group_s(&plan.order),
        fill_and_drain_s,
        epoch_s_with_overlap: with,
        epoch_s_without_overlap: without,
        exposed_io_s,
    })
}
