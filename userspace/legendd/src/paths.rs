//! Paths as the daemon records them, and what it reads of its users' files: only through
//! directories opened as the user could, only regular files, only up to a small bound.

use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use legend_daemon_api::MAX_PATH_BYTES;

/// The most the daemon reads of one of its users' text files (a run's `config.toml` and
/// `run.toml`, a dataset's `dataset.toml`): the engine writes them a few KiB long, and many
/// requests may read one at once.
pub const USER_TEXT_LIMIT: u64 = 64 << 10;

/// `path` as the daemon records it: absolute, without `.` components or repeated separators,
/// at most [`MAX_PATH_BYTES`]. A `..` is refused rather than resolved: which directory it
/// leads back to depends on the links on the way, which the daemon never follows for its user.
pub fn normalise(path: &Path) -> Result<PathBuf, String> {
    if !path.is_absolute() {
        return Err(format!("{}: give an absolute path", shown(path)));
    }
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                return Err(format!(
                    "{}: a path with `..` in it; give the directory's own path",
                    shown(path)
                ));
            }
            Component::Prefix(_) => unreachable!("no prefixes on Unix"),
        }
    }
    if out.as_os_str().len() > MAX_PATH_BYTES {
        return Err(format!(
            "{}: {} bytes long (at most {MAX_PATH_BYTES})",
            shown(path),
            out.as_os_str().len()
        ));
    }
    Ok(out)
}

/// Normalises every path of `spec` ([`normalise`]).
pub fn normalise_spec(spec: &mut legend_daemon_api::JobSpec) -> Result<(), String> {
    use legend_daemon_api::JobSpec;
    let one = |p: &mut PathBuf| -> Result<(), String> {
        *p = normalise(p)?;
        Ok(())
    };
    match spec {
        JobSpec::Train { dataset, out, .. } => {
            one(out)?;
            if let Some(d) = dataset {
                one(d)?;
            }
        }
        JobSpec::Export { run, out, .. } => {
            one(run)?;
            one(out)?;
        }
        JobSpec::Eval { run, .. } | JobSpec::Serve { run, .. } => one(run)?,
    }
    Ok(())
}

/// `path` for a message: at most 256 bytes of it.
pub fn shown(path: &Path) -> String {
    let text = path.to_string_lossy();
    match text.char_indices().nth(256) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.into_owned(),
    }
}

/// `text` cut to at most `max` bytes (at a character boundary), saying so.
pub fn clipped(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut at = max.saturating_sub(3);
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    format!("{}…", &text[..at])
}

/// A directory told apart by what it is, not by the path that reached it: two spellings, or a
/// symbolic link, reach one run.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct DirId {
    /// Device.
    pub dev: u64,
    /// Inode.
    pub ino: u64,
}

impl DirId {
    /// The identity of the opened directory `dir`.
    pub fn of(dir: &legend_fs::Dir) -> std::io::Result<DirId> {
        let m = dir.metadata()?;
        Ok(DirId {
            dev: m.dev(),
            ino: m.ino(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_recorded_in_one_spelling() {
        let long = format!("/{}", "./".repeat(300_000));
        assert_eq!(normalise(Path::new(&long)).unwrap(), Path::new("/"));
        assert_eq!(
            normalise(Path::new("/a//./b/./c/")).unwrap(),
            Path::new("/a/b/c")
        );
        assert!(normalise(Path::new("/a/../b")).unwrap_err().contains(".."));
        assert!(
            normalise(Path::new("a/b"))
                .unwrap_err()
                .contains("absolute")
        );
        let deep = format!("/{}", "abcdefgh/".repeat(600));
        let e = normalise(Path::new(&deep)).unwrap_err();
        assert!(e.contains("at most 4096") && e.len() < 400, "{e}");
        assert_eq!(clipped("héllo wörld", 6), "hé…");
    }
}
