//! `legendctl generate`.

use std::path::PathBuf;

use legend_dataset::{GenerateOptions, generate};

/// Arguments of `legendctl generate`.
#[derive(clap::Args)]
pub struct Args {
    /// Entities (node ids 0..N).
    #[arg(long, value_name = "N")]
    nodes: u64,
    /// Edges in all splits together.
    #[arg(long, value_name = "M")]
    edges: u64,
    /// Relation types (1 makes an untyped graph).
    #[arg(long, value_name = "R", default_value_t = 1)]
    relations: u64,
    /// Power-law exponent of degrees and relation frequencies: 0 uniform, 1 Zipf.
    #[arg(long, value_name = "S", default_value_t = 0.8)]
    skew: f64,
    /// Seed; the same options and seed give identical files.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Fractions of train, valid and test edges.
    #[arg(long, value_name = "FRACTIONS", default_value = "0.9,0.05,0.05", value_parser = super::parse_fractions)]
    split: [f64; 3],
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
    /// Output dataset directory (must not exist).
    #[arg(value_name = "OUT")]
    out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let cancel = super::stop_staging_on_signals("the generation", "generating")?;
    let options = GenerateOptions {
        nodes: args.nodes,
        edges: args.edges,
        relations: args.relations,
        skew: args.skew,
        seed: args.seed,
        split: args.split,
        progress: true,
        cancel: Some(cancel),
    };
    let summary = generate(&options, &args.out)?;
    if args.json {
        super::print_json(&summary)?;
    } else {
        outln!(
            "generated {} entities, {} relations, {} train / {} valid / {} test edges into {} in {:.1} s ({:.1} M edges/s drawn)",
            summary.entities,
            summary.relations,
            summary.train,
            summary.valid,
            summary.test,
            summary.output.display(),
            summary.seconds,
            args.edges as f64 / summary.generate_seconds.max(1e-9) / 1e6
        )?;
    }
    Ok(())
}
