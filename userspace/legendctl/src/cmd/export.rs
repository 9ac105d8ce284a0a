//! `legendctl export`: embeddings with labels, as .npy, TSV or raw f32.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use legend_engine::evaluation::open_run_dataset;

/// Output formats.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
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
    /// Output directory (created; default RUN/export). It must be new, empty, or hold an export
    /// of the same format (which is overwritten): formats are never mixed in one directory.
    #[arg(long, short = 'o')]
    out: Option<PathBuf>,
    /// The dataset, if it moved since training.
    #[arg(long)]
    dataset: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let meta = legend_engine::run::read_meta(&args.run)?;
    let out = args.out.unwrap_or_else(|| args.run.join("export"));
    check_out_dir(&out, args.format)?;
    let dataset = open_run_dataset(&meta, args.dataset.as_deref())?;
    let tables = legend_engine::run::load_tables(&args.run, &meta)?;
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

impl Format {
    /// The name with its article, as in "an npy export".
    fn a(self) -> &'static str {
        match self {
            Format::Npy => "an npy",
            Format::Tsv => "a tsv",
            Format::Bin => "a bin",
        }
    }

    /// The files an export of this format writes.
    fn files(self) -> &'static [&'static str] {
        match self {
            Format::Npy => &[
                "entities.npy",
                "relations.npy",
                "entities.labels.txt",
                "relations.labels.txt",
            ],
            Format::Tsv => &["entities.tsv", "relations.tsv"],
            Format::Bin => &[
                "entities.bin",
                "relations.bin",
                "entities.labels.txt",
                "relations.labels.txt",
            ],
        }
    }

    /// The format whose table file `name` is, if any.
    fn of_table(name: &str) -> Option<Format> {
        [Format::Npy, Format::Tsv, Format::Bin]
            .into_iter()
            .find(|f| f.files()[..2].contains(&name))
    }
}

/// Refuses an output directory that is neither absent, empty, nor an export of `format` alone,
/// naming what it holds: an export never mixes formats or lands among unrelated files.
fn check_out_dir(out: &Path, format: Format) -> anyhow::Result<()> {
    let entries = match std::fs::read_dir(out) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| out.display().to_string()),
    };
    let mut names = entries
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<Vec<String>>>()
        .with_context(|| out.display().to_string())?;
    names.sort();
    if names.iter().all(|n| format.files().contains(&n.as_str())) {
        return Ok(());
    }
    let mut others: Vec<&str> = names
        .iter()
        .filter_map(|n| Format::of_table(n))
        .filter(|&f| f != format)
        .map(Format::a)
        .collect();
    others.dedup();
    let found = names.join(", ");
    if others.is_empty() {
        bail!(
            "{} already holds files that are not {} export ({found}); export into a new or empty directory",
            out.display(),
            format.a()
        );
    }
    bail!(
        "{} already holds {} export ({found}); refusing to mix {} export into it: choose another --out or remove those files",
        out.display(),
        others.join(" and "),
        format.a()
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_directory_holds_one_format() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let err = |f| format!("{:#}", check_out_dir(&out, f).unwrap_err());
        check_out_dir(&out, Format::Tsv).expect("absent is fine");
        std::fs::create_dir(&out).unwrap();
        check_out_dir(&out, Format::Tsv).expect("empty is fine");
        for f in ["entities.npy", "entities.labels.txt"] {
            std::fs::write(out.join(f), "").unwrap();
        }
        check_out_dir(&out, Format::Npy).expect("the same format is overwritten");
        assert_eq!(
            err(Format::Tsv),
            format!(
                "{} already holds an npy export (entities.labels.txt, entities.npy); refusing to mix a tsv export into it: choose another --out or remove those files",
                out.display()
            )
        );
        assert!(err(Format::Bin).contains("holds an npy export"));
        std::fs::write(out.join("notes.txt"), "").unwrap();
        assert!(
            err(Format::Npy).contains(
                "files that are not an npy export (entities.labels.txt, entities.npy, notes.txt)"
            ),
            "{}",
            err(Format::Npy)
        );
    }
}
