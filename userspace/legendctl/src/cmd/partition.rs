//! `legendctl partition`.

use std::path::PathBuf;
use std::time::Instant;

use legend_dataset::Dataset;
use serde::Serialize;

/// Arguments of `legendctl partition`.
#[derive(clap::Args)]
pub struct Args {
    /// The dataset directory.
    dataset: PathBuf,
    /// Number of node partitions N (edges go into N×N buckets).
    #[arg(long, short = 'n')]
    partitions: u32,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Summary {
    partitions: u32,
    rows_per_partition: u64,
    edges: u64,
    largest_bucket: u64,
    smallest_bucket: u64,
    seconds: f64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let dataset = Dataset::open(&args.dataset)?;
    let buckets = dataset.partition(args.partitions)?;
    let counts = buckets.counts();
    let summary = Summary {
        partitions: args.partitions,
        rows_per_partition: buckets.scheme().rows_per_partition,
        edges: counts.iter().sum(),
        largest_bucket: counts.iter().copied().max().unwrap_or(0),
        smallest_bucket: counts.iter().copied().min().unwrap_or(0),
        seconds: started.elapsed().as_secs_f64(),
    };
    if args.json {
        super::print_json(&summary)?;
    } else {
        outln!(
            "{} train edges in {}×{} buckets ({} ids per partition; bucket sizes {}..{}) in {:.2} s",
            summary.edges,
            args.partitions,
            args.partitions,
            summary.rows_per_partition,
            summary.smallest_bucket,
            summary.largest_bucket,
            summary.seconds
        )?;
    }
    Ok(())
}
