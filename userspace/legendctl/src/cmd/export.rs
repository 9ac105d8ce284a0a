//! `legendctl export`: embeddings with labels, as .npy, TSV or raw f32
//! (`legend_engine::export`).

use std::path::PathBuf;

use legend_engine::export::{self, Format};
use legend_engine::which_tables;
use legend_fs::Unguarded;

/// Arguments of `legendctl export`.
#[derive(clap::Args)]
pub struct Args {
    /// The run directory: its best validated epoch's tables when it kept them (`RUN/best`),
    /// else its last checkpoint's.
    run: PathBuf,
    /// Export the run's last checkpoint even when it kept a best epoch in `RUN/best`.
    #[arg(long)]
    last: bool,
    /// Output format: npy (NumPy float32 arrays plus label files), tsv (`label<TAB>v1<TAB>v2…`
    /// per row) or bin (raw little-endian float32, row-major, plus label files).
    #[arg(long)]
    format: Format,
    /// Output directory (created; default RUN/export). It must be new, empty, or hold an export
    /// of the same format (which is overwritten): formats are never mixed in one directory.
    #[arg(long, short = 'o')]
    out: Option<PathBuf>,
    /// The dataset, if it moved since training.
    #[arg(long)]
    dataset: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let tables = which_tables::choose(&args.run, super::pick(args.last))?;
    let out = args.out.unwrap_or_else(|| args.run.join("export"));
    let made = super::create_parent(&out)?;
    let done = export::export(
        &tables.dir,
        args.format,
        &out,
        args.dataset.as_deref(),
        &Unguarded,
    )?;
    made.keep();
    outln!(
        "exported {}: {} entities and {} relations (d = {}) to {}",
        tables.describe(),
        done.entities,
        done.relations,
        done.dim,
        out.display()
    )?;
    Ok(())
}
