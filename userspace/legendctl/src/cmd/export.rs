//! `legendctl export`: embeddings with labels, as .npy, TSV or raw f32
//! (`legend_engine::export`).

use std::path::PathBuf;

use legend_engine::export::{self, Format};
use legend_fs::Unguarded;

/// Arguments of `legendctl export`.
#[derive(clap::Args)]
pub struct Args {
    /// The run directory.
    run: PathBuf,
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
    let out = args.out.unwrap_or_else(|| args.run.join("export"));
    super::create_parent(&out)?;
    let done = export::export(
        &args.run,
        args.format,
        &out,
        args.dataset.as_deref(),
        &Unguarded,
    )?;
    println!(
        "exported {} entities and {} relations (d = {}) to {}",
        done.entities,
        done.relations,
        done.dim,
        out.display()
    );
    Ok(())
}
