//! `legendctl export`: embeddings with labels, as .npy, TSV or raw f32.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use legend_engine::run;

use super::eval::open_run_dataset;

/// Output formats.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    /// NumPy `.npy` arrays (float32, C order) plus label files.
    Npy,
    /// `label<TAB>v1<TAB>v2…` per row.
    Tsv,
    /// Raw little-endian float32, row-major, plus label files.
    Bin,
}

/// Arguments of `legendctl export`.
#[derive(clap::Args)]
pub struct Args {
    /// The run directory.
    run: PathBuf,
    /// Output format.
    #[arg(long, value_enum)]
    format: Format,
    /// Output directory (created; default RUN/export).
    #[arg(long, short = 'o')]
    out: Option<PathBuf>,
    /// The dataset, if it moved since training.
    #[arg(long)]
    dataset: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let meta = run::read_meta(&args.run)?;
    let dataset = open_run_dataset(&meta, args.dataset.as_deref())?;
    let tables = run::load_tables(&args.run, &meta)?;
    let out = args.out.unwrap_or_else(|| args.run.join("export"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let entity_labels = dataset.entity_labels()?;
    let relation_labels = if meta.relations > 0 {
        dataset.relation_labels()?
    } else {
        Vec::new()
    };
    for (name, table, labels) in [
        ("entities", &tables.entities, &entity_labels),
        ("relations", &tables.relations, &relation_labels),
    ] {
        if labels.is_empty() {
            continue;
        }
        match args.format {
            Format::Npy => {
                write_npy(
                    &out.join(format!("{name}.npy")),
                    table,
                    labels.len(),
                    meta.dim,
                )?;
                write_labels(&out.join(format!("{name}.labels.txt")), labels)?;
            }
            Format::Bin => {
                let path = out.join(format!("{name}.bin"));
                std::fs::write(&path, bytemuck::cast_slice::<f32, u8>(table))
                    .with_context(|| path.display().to_string())?;
                write_labels(&out.join(format!("{name}.labels.txt")), labels)?;
            }
            Format::Tsv => write_tsv(&out.join(format!("{name}.tsv")), table, labels, meta.dim)?,
        }
    }
    println!(
        "exported {} entities and {} relations (d = {}) to {}",
        entity_labels.len(),
        relation_labels.len(),
        meta.dim,
        out.display()
    );
    Ok(())
}

fn create(path: &Path) -> anyhow::Result<BufWriter<File>> {
    Ok(BufWriter::new(
        File::create(path).with_context(|| path.display().to_string())?,
    ))
}

fn write_labels(path: &Path, labels: &[String]) -> anyhow::Result<()> {
    let mut w = create(path)?;
    for l in labels {
        writeln!(w, "{l}")?;
    }
    w.flush()?;
    Ok(())
}

fn write_tsv(path: &Path, table: &[f32], labels: &[String], dim: usize) -> anyhow::Result<()> {
    let mut w = create(path)?;
    for (label, row) in labels.iter().zip(table.chunks_exact(dim)) {
        write!(w, "{label}")?;
        for v in row {
            write!(w, "\t{v}")?;
        }
        writeln!(w)?;
    }
    w.flush()?;
    Ok(())
}

/// NumPy format 1.0: magic, header length, a Python-literal dict padded to 64 bytes, data.
fn write_npy(path: &Path, table: &[f32], rows: usize, dim: usize) -> anyhow::Result<()> {
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {dim}), }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut w = create(path)?;
    w.write_all(b"\x93NUMPY\x01\x00")?;
    w.write_all(&(header.len() as u16).to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    w.write_all(bytemuck::cast_slice(table))?;
    w.flush()?;
    Ok(())
}
