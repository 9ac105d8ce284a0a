//! Legend dataset directories.
//!
//! A dataset directory holds `dataset.toml` ([`DatasetMeta`]), `entities.tsv` and `relations.tsv`
//! (`id<TAB>label`), and `edges/{train,valid,test}.bin`: little-endian u32 triples
//! `[src, rel, dst]`. Node ids are randomly permuted at import so that id-range partitions are
//! balanced. `edges/train.buckets-N.{bin,offsets}` hold the train edges sorted into N×N buckets.
//! See `Documentation/dataset-format.md`.

#[cfg(target_endian = "big")]
compile_error!(
    "edge files are little-endian and read by casting; big-endian hosts are not supported"
);

mod buckets;
mod dataset;
mod error;
mod extend;
mod generate;
mod header;
mod import;
mod marius;
mod meta;
mod raw;
mod read_progress;
mod staging;
mod text;

use std::path::{Path, PathBuf};

pub use buckets::{Buckets, PartitionScheme};
pub use dataset::{Dataset, LabelTable, degrees, label_in_line};
pub use error::{DatasetError, PartitionSchemeError, Result};
pub use extend::Extension;
pub use generate::{GenerateOptions, GenerateSummary, generate};
pub use header::Header;
pub use import::{ImportInput, ImportOptions, ImportSummary, import};
pub use meta::{DatasetMeta, FORMAT_VERSION, META_FILE, Split, SplitCounts};
pub use raw::UNTYPED_RELATION;
pub use text::{Columns, Delimiter};

/// One edge: `[source, relation, destination]` ids.
pub type Edge = [u32; 3];

/// Folder of the edge files inside a dataset directory.
pub const EDGES_DIR: &str = "edges";
/// Entity labels file.
pub const ENTITIES_FILE: &str = "entities.tsv";
/// Relation labels file.
pub const RELATIONS_FILE: &str = "relations.tsv";

/// Path of a split's edge file.
pub fn edge_file(dir: &Path, split: Split) -> PathBuf {
    dir.join(edge_name(split))
}

/// A split's edge file, relative to the dataset directory.
fn edge_name(split: Split) -> PathBuf {
    Path::new(EDGES_DIR).join(format!("{}.bin", split.name()))
}
