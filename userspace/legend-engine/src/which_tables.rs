//! Which epoch's tables a command on a run reads (`legendctl eval`, `export`, `predict`,
//! `score`, `neighbors`, and the daemon jobs they submit).
//!
//! A run that validates keeps its best epoch's tables in `RUN/best/`
//! ([`crate::session::BEST_DIR`]), and its final evaluation ranks them: the result `legendctl
//! train` prints is the best epoch's. So `RUN` means those tables when `RUN/best/` exists, and
//! the last checkpoint's otherwise or when asked for ([`Pick::Last`]); every command says which
//! epoch it read, so that a figure is never taken for another epoch's.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::progress::EpochCut;
use crate::run::{self, RunError};
use crate::session::BEST_DIR;

/// Which tables of a run to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The best validated epoch's (`RUN/best/`) when the run kept one, else the last.
    Best,
    /// The last checkpoint's, even when `RUN/best/` exists.
    Last,
}

/// The tables chosen, and what they are.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Tables {
    /// The run directory that holds them: `RUN` or `RUN/best`.
    pub dir: PathBuf,
    /// Epochs trained into them.
    pub epoch: u32,
    /// The checkpoint was taken inside the next epoch (a stopped run): how far it got.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cut: Option<EpochCut>,
    /// `best` (the best validated epoch, kept in `RUN/best/`) or `last` (the last checkpoint).
    pub kind: &'static str,
    /// The other tables of the run, when there are: the last epoch of a run read at its best,
    /// or the best epoch of a run read at its last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub other_epoch: Option<u32>,
}

/// The tables of the run `run` that `pick` names (see the module's documentation). `run` may
/// also be a run's `best/` directory itself: its tables are then the best epoch's.
pub fn choose(run: &Path, pick: Pick) -> Result<Tables, RunError> {
    let dir = run::open(run)?;
    let meta = run::read_meta(&dir)?;
    let io = |path: PathBuf| move |source| RunError::Io { path, source };
    let record = Path::new(BEST_DIR).join(run::META_FILE);
    let best = if dir.is_file(&record).map_err(io(run.join(&record)))? {
        let best = dir.dir(BEST_DIR).map_err(io(run.join(BEST_DIR)))?;
        Some(run::read_meta(&best)?)
    } else {
        None
    };
    Ok(match (pick, best) {
        (Pick::Best, Some(best)) => Tables {
            dir: run.join(BEST_DIR),
            epoch: best.epochs_completed,
            cut: None,
            kind: "best",
            other_epoch: Some(meta.epochs_completed),
        },
        (_, best) => Tables {
            dir: run.to_owned(),
            epoch: meta.epochs_completed,
            cut: meta.cut,
            kind: if best.is_none() && is_a_best_dir(run) {
                "best"
            } else {
                "last"
            },
            other_epoch: best.map(|b| b.epochs_completed),
        },
    })
}

/// `dir` is a run's `best/` (a run directory named so inside another).
fn is_a_best_dir(dir: &Path) -> bool {
    dir.file_name().is_some_and(|n| n == BEST_DIR)
        && dir
            .parent()
            .is_some_and(|p| p.join(run::META_FILE).is_file())
}

impl Tables {
    /// In words, after the run's name: `epoch 12 (the best validated, in runs/x/best; --last
    /// for the last, epoch 40)`, `epoch 40 (the last; the best validated, epoch 12, is in
    /// runs/x/best)`, `epoch 40`.
    pub fn describe(&self) -> String {
        let mut notes = Vec::new();
        let epoch = match self.cut {
            Some(cut) => {
                notes.push("stopped there".to_string());
                format!(
                    "epoch {} and {} edges of epoch {}",
                    self.epoch, cut.edges, cut.epoch
                )
            }
            None => format!("epoch {}", self.epoch),
        };
        match (self.kind, self.other_epoch) {
            ("best", last) => {
                notes.push(format!("the best validated, in {}", self.dir.display()));
                if let Some(last) = last {
                    notes.push(format!("--last for the last, epoch {last}"));
                }
            }
            (_, Some(best)) => {
                notes.push("the last".into());
                notes.push(format!(
                    "the best validated, epoch {best}, is in {}",
                    self.dir.join(BEST_DIR).display()
                ));
            }
            _ => {}
        }
        if notes.is_empty() {
            epoch
        } else {
            format!("{epoch} ({})", notes.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(kind: &'static str, other_epoch: Option<u32>) -> Tables {
        Tables {
            dir: PathBuf::from("runs/x"),
            epoch: 12,
            cut: None,
            kind,
            other_epoch,
        }
    }

    #[test]
    fn the_description_names_the_epoch_and_the_other_tables() {
        assert_eq!(
            tables("best", Some(40)).describe(),
            "epoch 12 (the best validated, in runs/x; --last for the last, epoch 40)"
        );
        assert_eq!(
            tables("last", Some(9)).describe(),
            "epoch 12 (the last; the best validated, epoch 9, is in runs/x/best)"
        );
        assert_eq!(tables("last", None).describe(), "epoch 12");
        let cut = Tables {
            cut: Some(EpochCut {
                epoch: 13,
                swaps: 2,
                next: None,
                edges: 700,
                loss: 1.0,
                workers: None,
                hosts: None,
            }),
            ..tables("last", None)
        };
        assert_eq!(
            cut.describe(),
            "epoch 12 and 700 edges of epoch 13 (stopped there)"
        );
    }
}
