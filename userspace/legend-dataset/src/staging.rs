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
    /// The folders above `out` made for it: removed with the temporary directory (declared
    /// after it, so dropped after it) unless published.
    made: legend_fs::MadeDirs,
}

impl Staging {
    /// Creates `.NAME.{verb}-XXXX` next to `out` (creating `out`'s parent if needed, until
    /// published); `out` itself must not exist.
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
        let made = legend_fs::MadeDirs::create(&parent).at(&parent)?;
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}.{verb}-"))
            .tempdir_in(&parent)
            .at(&parent)?;
        Ok(Staging {
            tmp,
            parent,
            out: out.to_owned(),
            made,
        })
    }

    /// The temporary directory to write into.
    pub fn dir(&self) -> &Path {
        self.tmp.path()
    }

    /// Syncs the temporary directory and its `edges/` folder, renames it to `out` and syncs the
    /// parent, so the new directory is durable.
    pub fn publish(self) -> Result<()> {
        let Staging {
            tmp,
            parent,
            out,
            made,
        } = self;
        let dir = tmp.path();
        let edges = dir.join(crate::EDGES_DIR);
        if edges.is_dir() {
            File::open(&edges).and_then(|d| d.sync_all()).at(&edges)?;
        }
        File::open(dir).and_then(|d| d.sync_all()).at(dir)?;
        std::fs::rename(dir, &out).at(&out)?;
        // The directory now lives at `out`; keep TempDir from deleting it.
        let _ = tmp.keep();
        made.keep();
        File::open(&parent).and_then(|d| d.sync_all()).at(&parent)
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
