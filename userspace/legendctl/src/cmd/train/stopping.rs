//! What `legendctl train` says when it is asked to stop (Ctrl-C, SIGTERM): at once, what it will
//! do and when (the trainer stops before its next batch and commits a checkpoint there), and what
//! a second signal would leave (no new checkpoint: a resume starts from the previous one).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use indicatif::ProgressBar;

/// Where the run is, kept by the progress view for the signal thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Phase {
    /// Before the first epoch starts.
    #[default]
    SettingUp,
    /// Training epoch `epoch` of `epochs`.
    Training { epoch: u32, epochs: u32 },
    /// Epoch `epoch` is trained: its validation, best tables and checkpoint follow.
    EndingEpoch { epoch: u32, epochs: u32 },
    /// The final evaluation.
    Evaluating,
}

/// What the signal thread reads to say what a stop does.
#[derive(Default)]
struct State {
    phase: Phase,
    /// The last committed checkpoint, in words (`the end of epoch 3`).
    checkpoint: String,
    /// The bar on a terminal: a note goes above it, not through it.
    bar: Option<ProgressBar>,
}

/// The run's state shared between the progress view (which updates it) and the signal thread
/// (which reads it to word its notes).
#[derive(Clone)]
pub(super) struct StopNotes {
    run: PathBuf,
    state: Arc<Mutex<State>>,
}

impl StopNotes {
    /// Notes for the run `run`, whose latest checkpoint is `checkpoint` (in words; `the start`
    /// for a new run).
    pub(super) fn new(run: &Path, checkpoint: String) -> StopNotes {
        StopNotes {
            run: run.to_owned(),
            state: Arc::new(Mutex::new(State {
                checkpoint,
                ..State::default()
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The run is now in `phase`.
    pub(super) fn set_phase(&self, phase: Phase) {
        self.lock().phase = phase;
    }

    /// A checkpoint of `position` (in words) is committed.
    pub(super) fn set_checkpoint(&self, position: String) {
        self.lock().checkpoint = position;
    }

    /// The bar that notes go above (none: straight to stderr).
    pub(super) fn set_bar(&self, bar: Option<ProgressBar>) {
        self.lock().bar = bar;
    }

    /// The first signal's note: what the run does now, and what a second signal would leave.
    pub(super) fn first(&self, signal: &str) {
        let state = self.lock();
        say(&state, &self.first_text(&state, signal));
    }

    fn first_text(&self, state: &State, signal: &str) -> String {
        let again = format!(
            "A second {signal} quits at once without it: `legendctl train --out {} --resume` would then start from {}.",
            self.run.display(),
            state.checkpoint
        );
        match state.phase {
            Phase::Evaluating => format!(
                "{signal}: the final evaluation cannot stop midway; it runs to its end and the run is then complete. A second {signal} quits at once: the run keeps its last checkpoint, {}, and `legendctl train --out {} --resume` evaluates it.",
                state.checkpoint,
                self.run.display()
            ),
            Phase::EndingEpoch { epoch, epochs } if epoch == epochs => format!(
                "{signal}: epoch {epoch}, the last, is trained: the run commits its checkpoint and runs its final evaluation to its end. {again}"
            ),
            phase => {
                let when = match phase {
                    Phase::Training { epoch, .. } => {
                        format!("before the next batch of epoch {epoch}")
                    }
                    Phase::EndingEpoch { epoch, .. } => {
                        format!("at the end of epoch {epoch} (after its validation, if it has one)")
                    }
                    _ => "once the set-up is done, before the first batch".into(),
                };
                format!(
                    "{signal}: stopping {when}, with a checkpoint there (`legendctl train --out {} --resume` continues from it). {again}",
                    self.run.display()
                )
            }
        }
    }

    /// The second signal's note, before the process ends.
    pub(super) fn second(&self, signal: &str) {
        let state = self.lock();
        say(
            &state,
            &format!(
                "{signal}, a second signal: quitting at once without a new checkpoint; `legendctl train --out {} --resume` starts from {}",
                self.run.display(),
                state.checkpoint
            ),
        );
    }
}

/// Writes `text` above the bar, or on stderr.
fn say(state: &State, text: &str) {
    match &state.bar {
        Some(bar) => bar.println(text),
        None => errln!("{text}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_note_says_when_the_run_stops_and_what_a_second_leaves() {
        let notes = StopNotes::new(Path::new("runs/x"), "the end of epoch 3".into());
        let text = |phase| {
            notes.set_phase(phase);
            notes.first_text(&notes.lock(), "Ctrl-C")
        };
        let training = text(Phase::Training {
            epoch: 4,
            epochs: 9,
        });
        assert!(
            training.starts_with(
                "Ctrl-C: stopping before the next batch of epoch 4, with a checkpoint there"
            ),
            "{training}"
        );
        assert!(
            training.ends_with("A second Ctrl-C quits at once without it: `legendctl train --out runs/x --resume` would then start from the end of epoch 3."),
            "{training}"
        );
        let ending = text(Phase::EndingEpoch {
            epoch: 4,
            epochs: 9,
        });
        assert!(
            ending.contains("at the end of epoch 4 (after its validation"),
            "{ending}"
        );
        let last = text(Phase::EndingEpoch {
            epoch: 9,
            epochs: 9,
        });
        assert!(
            last.contains("runs its final evaluation to its end"),
            "{last}"
        );
        assert!(text(Phase::Evaluating).contains("cannot stop midway"));
        assert!(text(Phase::SettingUp).contains("once the set-up is done"));
        notes.set_checkpoint("epoch 5 stopped after 2 of its swaps (700 edges trained)".into());
        assert!(
            text(Phase::SettingUp)
                .ends_with("start from epoch 5 stopped after 2 of its swaps (700 edges trained).")
        );
    }
}
