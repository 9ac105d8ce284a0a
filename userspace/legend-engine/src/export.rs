//! Exports a run's embeddings with their labels, as NumPy `.npy`, TSV or raw float32, for
//! `legendctl export` and the daemon's export jobs.
//!
//! The entity rows stream from the checkpoint (or the store) a block at a time into a hidden
//! directory beside the output directory, which then takes the output's place in one step (an
//! exchange with an existing one, whose old export is then removed): a failed or interrupted
//! export leaves the output as it was, or whole, never new tables beside old ones; and a
//! directory never mixes formats.

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use legend_fs::{Access, Dir, Guard};

use crate::evaluation::{EvaluationError, open_run_dataset};
use crate::run::{self, RunError, RunMeta};

/// Output formats.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Format {
    /// NumPy `.npy` arrays (float32, C order) plus label files.
    Npy,
    /// `label<TAB>v1<TAB>v2…` per row.
    Tsv,
    /// Raw little-endian float32, row-major, plus label files.
    Bin,
}

impl FromStr for Format {
    type Err = legend_model::UnknownName;

    fn from_str(s: &str) -> Result<Format, Self::Err> {
        match s {
            "npy" => Ok(Format::Npy),
            "tsv" => Ok(Format::Tsv),
            "bin" => Ok(Format::Bin),
            _ => Err(legend_model::UnknownName::new(
                "export format",
                s,
                "expected npy, tsv or bin",
            )),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Npy => "npy",
            Format::Tsv => "tsv",
            Format::Bin => "bin",
        })
    }
}

/// Why an export failed (it left the output directory as it was).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The run could not be read.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The run's dataset (labels) could not be opened.
    #[error(transparent)]
    Dataset(#[from] EvaluationError),
    /// Its labels could not be read.
    #[error(transparent)]
    Labels(#[from] legend_dataset::DatasetError),
    /// An output file could not be written.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The output directory holds something else.
    #[error("{} {message}", dir.display())]
    OutDir {
        /// The directory.
        dir: PathBuf,
        /// What it holds and what to do.
        message: String,
    },
    /// The run's record is not the one the caller expects (a daemon's job: the store recorded
    /// when it was submitted).
    #[error("{}: {message}", path.display())]
    NotExpected {
        /// The record.
        path: PathBuf,
        /// What differs.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ExportError + '_ {
    move |source| ExportError::Io {
        path: path.to_owned(),
        source,
    }
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// Entity rows.
    pub entities: usize,
    /// Relation rows.
    pub relations: usize,
    /// Floats an entity row (a relation row has the decoder's relation width: RESCAL's
    /// `dim²`).
    pub dim: usize,
}

/// Appended to a relation's label to name its inverse's row (reciprocal relations).
pub const INVERSE_SUFFIX: &str = "_inverse";

/// Exports the tables of `run` as `format` into `out` (in its existing parent; it must be new,
/// empty, or hold an export of the same format, which is replaced, and not a mount point);
/// `dataset` names the run's dataset if it moved. `guard` admits the run, `out`'s parent and a
/// store outside the run, and adopts the new `out`; the files are written beneath them
/// (legend-fs).
pub fn export(
    run: &Path,
    format: Format,
    out: &Path,
    dataset: Option<&Path>,
    guard: &dyn Guard,
) -> Result<Exported, ExportError> {
    export_expecting(run, format, out, dataset, guard, &|_| Ok(()))
}

/// [`export`], the run's record first checked by `expect` — the record read once, and the one
/// the export then uses, so that a record rewritten after a caller's own check cannot point
/// the export elsewhere.
pub fn export_expecting(
    run: &Path,
    format: Format,
    out: &Path,
    dataset: Option<&Path>,
    guard: &dyn Guard,
    expect: &dyn Fn(&RunMeta) -> Result<(), String>,
) -> Result<Exported, ExportError> {
    let run = run::open(run)?;
    guard.admit(&run).map_err(io(run.path()))?;
    // The directory is the submitter's; what is read in it must be theirs to read too.
    let run = run.reading_as(guard.read_check());
    let meta = run::read_meta(&run)?;
    expect(&meta).map_err(|message| ExportError::NotExpected {
        path: run.join(run::META_FILE),
        message,
    })?;
    let (parent, name) = Dir::open_parent(out).map_err(io(out))?;
    guard.admit(&parent).map_err(io(parent.path()))?;
    check_out_dir(&parent, name, format)?;
    let dataset = open_run_dataset(&meta, dataset, guard)?;
    // One reader for both tables: a store is opened once.
    let mut reader = run::RunReader::open(&run, &meta, guard, None)?;
    let relations = reader.relations()?;
    let entity_labels = dataset.entity_labels()?;
    let relation_labels = match (meta.relations > 0, meta.reciprocal_relations) {
        (false, _) => Vec::new(),
        (true, false) => dataset.relation_labels()?,
        // The inverse rows follow the relations, labelled after them.
        (true, true) => {
            let labels = dataset.relation_labels()?;
            let inverse = labels.iter().map(|l| format!("{l}{INVERSE_SUFFIX}"));
            labels.iter().cloned().chain(inverse).collect()
        }
    };
    let staging_name = staging_name(name);
    let staging_path = parent.join(&staging_name);
    // What an interrupted export left.
    parent.clear(&staging_name).map_err(io(&staging_path))?;
    let staging = parent
        .create_dir(&staging_name)
        .map_err(io(&staging_path))?;
    guard.adopt(&staging).map_err(io(&staging_path))?;
    let result = (|| -> Result<(), ExportError> {
        // Rows of `width` floats: the dimension, or for relations the decoder's relation
        // width (RESCAL's row-major dim × dim matrices, one a row).
        let table =
            |name: &str,
             labels: &[String],
             width: usize,
             write: &mut dyn FnMut(&mut TableWriter) -> Result<(), ExportError>| {
                let mut w = TableWriter::create(&staging, format, name, labels, width)?;
                write(&mut w)?;
                w.finish()
            };
        table("entities", &entity_labels, meta.dim, &mut |w| {
            let path = w.path.clone();
            Ok(reader.stream_entities(|block| {
                w.rows(block).map_err(|e| RunError::Invalid {
                    path: path.clone(),
                    message: e.to_string(),
                })
            })?)
        })?;
        if !relation_labels.is_empty() {
            table(
                "relations",
                &relation_labels,
                meta.relation_width(),
                &mut |w| {
                    let path = w.path.clone();
                    w.rows(&relations).map_err(io(&path))
                },
            )?;
        }
        staging.sync().map_err(io(&staging_path))
    })();
    if let Err(e) = result {
        let _ = parent.remove_all(&staging_name);
        return Err(e);
    }
    switch_into_place(&parent, &staging_name, name, out)?;
    Ok(Exported {
        entities: entity_labels.len(),
        relations: relation_labels.len(),
        dim: meta.dim,
    })
}

/// One table's export files being written: rows streamed in, labels beside them.
struct TableWriter<'a> {
    format: Format,
    dim: usize,
    out: BufWriter<File>,
    /// The table file's path, for messages.
    path: PathBuf,
    /// The row labels, for TSV, which writes them in each row.
    labels: &'a [String],
    row: usize,
}

impl<'a> TableWriter<'a> {
    /// Opens `name`'s files in `dir` for `labels.len()` rows of `dim` floats: the table's own
    /// (with the .npy header) and, except for TSV, which carries them per row, the labels'.
    fn create(
        dir: &Dir,
        format: Format,
        name: &str,
        labels: &'a [String],
        dim: usize,
    ) -> Result<TableWriter<'a>, ExportError> {
        let ext = match format {
            Format::Npy => "npy",
            Format::Tsv => "tsv",
            Format::Bin => "bin",
        };
        let table = format!("{name}.{ext}");
        if format != Format::Tsv {
            write_labels(dir, &format!("{name}.labels.txt"), labels)?;
        }
        let path = dir.join(&table);
        let mut out = create(dir, &table)?;
        if format == Format::Npy {
            write_npy_header(&mut out, labels.len(), dim).map_err(io(&path))?;
        }
        Ok(TableWriter {
            format,
            dim,
            out,
            path,
            labels,
            row: 0,
        })
    }

    /// Appends whole rows.
    fn rows(&mut self, block: &[f32]) -> std::io::Result<()> {
        match self.format {
            Format::Npy | Format::Bin => self.out.write_all(bytemuck::cast_slice(block))?,
            Format::Tsv => {
                for row in block.chunks_exact(self.dim) {
                    let label = self.labels.get(self.row).map_or("", String::as_str);
                    write!(self.out, "{label}")?;
                    for v in row {
                        write!(self.out, "\t{v}")?;
                    }
                    writeln!(self.out)?;
                    self.row += 1;
                }
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<(), ExportError> {
        self.out.flush().map_err(io(&self.path))?;
        self.out.get_ref().sync_all().map_err(io(&self.path))
    }
}

/// The hidden directory beside the output `name` an export is assembled in.
fn staging_name(name: &Path) -> String {
    format!(".{}.exporting", name.to_string_lossy())
}

/// Puts the assembled export `staging` (in `parent`) in the place of `name` (`out`) in one
/// step, then removes what `name` held before (a warning if that fails: the export is done).
fn switch_into_place(
    parent: &Dir,
    staging: &str,
    name: &Path,
    out: &Path,
) -> Result<(), ExportError> {
    if parent.exists(name).map_err(io(out))? {
        parent.exchange(staging, name).map_err(io(out))?;
        if let Err(e) = parent.remove_all(staging) {
            tracing::warn!(
                "{}: removing the export it replaced: {e}",
                parent.join(staging).display()
            );
        }
    } else {
        parent.rename(staging, name).map_err(io(out))?;
    }
    parent.sync().map_err(io(parent.path()))
}

/// A hidden file an export of an older build left while it wrote (it then wrote into the
/// output directory itself): replaced with the directory.
fn is_partial(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".partial")
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

/// Refuses an output directory (`name` in `parent`) that is neither absent, empty, nor an
/// export of `format` alone, naming what it holds: an export never mixes formats or lands
/// among unrelated files.
fn check_out_dir(parent: &Dir, name: &Path, format: Format) -> Result<(), ExportError> {
    let out = parent.join(name);
    // The export replaces the directory whole, from beside it: not across file systems.
    if let Some(st) = parent.entry(name).map_err(io(&out))?
        && st.st_dev != parent.metadata().map_err(io(&out))?.dev()
    {
        return Err(ExportError::OutDir {
            dir: out,
            message: "is a mount point: an export replaces its directory whole; export into a directory inside it".into(),
        });
    }
    let mut names: Vec<String> = match parent.entries(name) {
        Ok(entries) => entries
            .iter()
            .map(|n| n.to_string_lossy().into_owned())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(&out)(e)),
    };
    names.retain(|n| !is_partial(n));
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
    let message = if others.is_empty() {
        format!(
            "already holds files that are not {} export ({found}); export into a new or empty directory",
            format.a()
        )
    } else {
        format!(
            "already holds {} export ({found}); refusing to mix {} export into it: choose another --out or remove those files",
            others.join(" and "),
            format.a()
        )
    };
    Err(ExportError::OutDir { dir: out, message })
}

fn create(dir: &Dir, name: &str) -> Result<BufWriter<File>, ExportError> {
    let file = dir
        .open_file(name, Access::CreateNew)
        .map_err(io(&dir.join(name)))?;
    Ok(BufWriter::new(file))
}

fn write_labels(dir: &Dir, name: &str, labels: &[String]) -> Result<(), ExportError> {
    let mut w = create(dir, name)?;
    labels
        .iter()
        .try_for_each(|l| writeln!(w, "{l}"))
        .and_then(|()| w.flush())
        .and_then(|()| w.get_ref().sync_all())
        .map_err(io(&dir.join(name)))
}

/// NumPy format 1.0's preamble: magic, header length, a Python-literal dict padded to 64 bytes.
fn write_npy_header(w: &mut impl Write, rows: usize, dim: usize) -> std::io::Result<()> {
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {dim}), }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    w.write_all(b"\x93NUMPY\x01\x00")?;
    w.write_all(&(header.len() as u16).to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_directory_holds_one_format() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let parent = Dir::open(dir.path()).unwrap();
        let check = |f| check_out_dir(&parent, Path::new("out"), f);
        let err = |f| check(f).unwrap_err().to_string();
        check(Format::Tsv).expect("absent is fine");
        std::fs::create_dir(&out).unwrap();
        check(Format::Tsv).expect("empty is fine");
        for f in ["entities.npy", "entities.labels.txt"] {
            std::fs::write(out.join(f), "").unwrap();
        }
        check(Format::Npy).expect("the same format is overwritten");
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
