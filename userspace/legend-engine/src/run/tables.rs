//! Reading a run's tables at once, each call through a [`RunReader`] of its own: its store
//! (opened as the run recorded it) or its checkpoint's files, whole or a piece at a time, each
//! file's checksum checked.

use std::fs::File;
use std::path::{Path, PathBuf};

use legend_fs::{Access, Dir, Guard};

use super::reader::RunReader;
use super::{RunError, RunMeta, TABLE_FILES, Tables, invalid, io};

/// Calls `block` with the current checkpoint's entity embeddings in row order, a piece at a
/// time (see [`RunReader::stream_entities`]), so that an export never holds the table.
pub fn stream_entities(
    run: &Dir,
    meta: &RunMeta,
    guard: &dyn Guard,
    block: impl FnMut(&[f32]) -> Result<(), RunError>,
) -> Result<(), RunError> {
    RunReader::open(run, meta, guard, None)?.stream_entities(block)
}

/// The current checkpoint's entity file (a run without a store), opened and its size checked
/// against the run's record; with its path, for messages.
pub fn open_entity_file(run: &Dir, meta: &RunMeta) -> Result<(File, PathBuf), RunError> {
    let rel = Path::new(&meta.checkpoint).join(TABLE_FILES[0]);
    let path = run.join(&rel);
    let dtype = meta.entity_dtype;
    let want = meta.entities * meta.dim as u64 * dtype.bytes() as u64;
    let file = run.open_file(&rel, Access::Read).map_err(io(&path))?;
    let len = file.metadata().map_err(io(&path))?.len();
    if len != want {
        return Err(invalid(
            &path,
            format!("holds {len} bytes, expected {want} ({dtype})"),
        ));
    }
    Ok((file, path))
}

/// The current checkpoint's relation embeddings (small: the rows of each relation).
pub fn load_relations(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<Vec<f32>, RunError> {
    RunReader::open(run, meta, guard, None)?.relations()
}

/// Loads the current checkpoint of `run`: from its store (file backend) or from its checkpoint
/// directory, verifying sizes and checksums. `guard` admits a store outside the run directory
/// (a run's record names its store, and records can be edited).
pub fn load_tables(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<Tables, RunError> {
    RunReader::open(run, meta, guard, None)?.tables()
}

/// The current checkpoint's entity and relation embeddings, without their AdaGrad state: what
/// ranking them needs (half the memory of [`load_tables`]), checked as it checks them; the
/// run's store opened once for both.
pub fn load_embeddings(
    run: &Dir,
    meta: &RunMeta,
    guard: &dyn Guard,
) -> Result<(Vec<f32>, Vec<f32>), RunError> {
    let mut reader = RunReader::open(run, meta, guard, None)?;
    Ok((reader.entities()?, reader.relations()?))
}

/// The current checkpoint's entity embeddings (widened to f32), checked: a checkpoint file read
/// straight into the table on every core, or a store's partitions one after the other.
pub fn load_entities(run: &Dir, meta: &RunMeta, guard: &dyn Guard) -> Result<Vec<f32>, RunError> {
    RunReader::open(run, meta, guard, None)?.entities()
}
