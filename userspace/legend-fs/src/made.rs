//! The missing directories above an output, made for it and removed again unless the output
//! came to be: a command refused on bad input (a missing dataset, a run that cannot be read)
//! leaves nothing behind, not even the folders its `--out` named.

use std::io;
use std::path::{Path, PathBuf};

/// Directories [`MadeDirs::create`] made; dropped before [`MadeDirs::keep`], it removes those
/// still empty, the deepest first.
#[derive(Debug)]
#[must_use = "dropping it removes the directories it made"]
pub struct MadeDirs {
    /// The directories made, the deepest first.
    made: Vec<PathBuf>,
}

impl MadeDirs {
    /// Makes `dir` and its missing ancestors (plain paths, as `create_dir_all`). On an error
    /// the ones already made are removed.
    pub fn create(dir: &Path) -> io::Result<MadeDirs> {
        let made = dir
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .map(Path::to_path_buf)
            .collect();
        let dirs = MadeDirs { made };
        std::fs::create_dir_all(dir)?;
        Ok(dirs)
    }

    /// The output is in place: the directories stay.
    pub fn keep(mut self) {
        self.made.clear();
    }
}

impl Drop for MadeDirs {
    fn drop(&mut self) {
        // Only empty ones go (`remove_dir`): whatever else appeared in them meanwhile stays.
        for dir in &self.made {
            if std::fs::remove_dir(dir).is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_what_it_made_unless_kept() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("a/b/c");
        drop(MadeDirs::create(&deep).unwrap());
        assert!(!root.path().join("a").exists());

        MadeDirs::create(&deep).unwrap().keep();
        assert!(deep.is_dir());

        // An existing ancestor stays; a made one holding something else stays too.
        let made = MadeDirs::create(&root.path().join("a/x/y")).unwrap();
        std::fs::write(root.path().join("a/x/note"), "kept").unwrap();
        drop(made);
        assert!(!root.path().join("a/x/y").exists());
        assert!(root.path().join("a/x/note").is_file());
        assert!(deep.is_dir());
    }
}
