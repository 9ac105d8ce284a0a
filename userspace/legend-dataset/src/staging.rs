//! Writing a dataset directory atomically: everything goes into a hidden temporary directory
//! next to the output, which is synced and renamed into place only when complete. Dropping the
//! [`Staging`] before [`Staging::publish`] (an error, a cancellation) removes it.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result, invalid};

/// A temporary directory that becomes the dataset directory `out` on [`Staging::publish`].
pub(crate) struct Staging {
    tmp: tempfile::TempDir,
    parent: PathBuf,
    out: PathBuf,
}

impl Staging {
    /// Creates `.NAME.{verb}-XXXX` next to `out` (creating `out`'s parent if needed); `out`
    /// itself must not exist.
    pub fn new(out: &Path, verb: &str) -> Result<Staging> {
        check_new_output(out)?;
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = out
            .file_name()
            .ok_or_else(|| invalid(out, "not a usable directory name"))?
            .to_string_lossy()
            .into_owned();
        std::fs::create_dir_all(&parent).at(&parent)?;
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}.{verb}-"))
            .tempdir_in(&parent)
            .at(&parent)?;
        Ok(Staging {
            tmp,
            parent,
            out: out.to_owned(),
        })
    }

    /// The temporary directory to write into.
    pub fn dir(&self) -> &Path {
        self.tmp.path()
    }

    /// Syncs the temporary directory and its `edges/` folder, renames it to `out` and syncs the
    /// parent, so the new directory is durable.
    pub fn publish(self) -> Result<()> {
        let dir = self.tmp.path();
        let edges = dir.join(crate::EDGES_DIR);
        if edges.is_dir() {
            File::open(&edges).and_then(|d| d.sync_all()).at(&edges)?;
        }
        File::open(dir).and_then(|d| d.sync_all()).at(dir)?;
        std::fs::rename(dir, &self.out).at(&self.out)?;
        // The directory now lives at `out`; keep TempDir from deleting it.
        let _ = self.tmp.keep();
        File::open(&self.parent)
            .and_then(|d| d.sync_all())
            .at(&self.parent)
    }
}

/// Refuses an output directory that already exists (checked before any work, and again when
/// staging starts).
pub(crate) fn check_new_output(out: &Path) -> Result<()> {
    if out.exists() {
        return Err(invalid(
            out,
            "already exists; remove it or choose another output directory",
        ));
    }
    Ok(())
}
