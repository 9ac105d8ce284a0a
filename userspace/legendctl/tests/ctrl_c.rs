//! Ctrl-C on a one-partition in-memory run at d = 2000 (issue 47, item 1): it says at once that
//! it stops and when, stops before its next batch within 2 s with a checkpoint there, and the
//! run resumes from that checkpoint; a second signal quits at once, saying that the run then
//! resumes from the checkpoint before.

mod common;

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use common::{bin, graph, s};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A `legendctl train` running, its stderr lines (with when they came) on a channel.
struct Training {
    child: Child,
    lines: Receiver<(Instant, String)>,
    seen: Vec<String>,
}

impl Training {
    fn start(args: &[&str]) -> Training {
        let mut child = Command::new(bin())
            .args(args)
            .env("LEGEND_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let (send, lines) = channel();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                if send.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Training {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first line containing `needle`, and when it came (within 60 s).
    fn line_with(&mut self, needle: &str) -> (Instant, String) {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(60)) {
                Ok((at, line)) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return (at, line);
                    }
                }
                Err(_) => panic!("no line with {needle:?}; stderr so far: {:#?}", self.seen),
            }
        }
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).unwrap();
    }

    /// Waits for the process to end; its exit code.
    fn wait(&mut self) -> Option<i32> {
        self.child.wait().unwrap().code()
    }
}

/// The checkpoint position `run.toml` records (its `[cut]`, if any, and epochs completed).
fn recorded_position(run: &Path) -> String {
    let meta = std::fs::read_to_string(run.join("run.toml")).unwrap();
    let meta: toml::Table = toml::from_str(&meta).unwrap();
    format!("{:?} {:?}", meta.get("epochs_completed"), meta.get("cut"))
}

#[test]
fn ctrl_c_stops_before_the_next_batch_with_a_checkpoint_and_a_second_quits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let run = dir.path().join("run");
    let (ds, run_arg) = (s(&ds), s(&run));
    let mut training = Training::start(&[
        "train",
        "--dataset",
        &ds,
        "--out",
        &run_arg,
        "--set",
        "model.decoder=complex",
        "--set",
        "model.dim=2000",
        "--set",
        "training.batch_size=20",
        "--set",
        "training.num_epochs=100000",
    ]);
    training.line_with("training complex d=2000");
    // Well inside the training, past the first epochs' start.
    std::thread::sleep(Duration::from_millis(800));
    let asked = Instant::now();
    training.signal(Signal::SIGINT);
    let (noted, note) = training.line_with("Ctrl-C: stopping");
    assert!(
        noted - asked < Duration::from_secs(1),
        "said after {:?}: {note}",
        noted - asked
    );
    // Before the next batch; at an epoch's end (rarely hit: a moment between batches) there.
    assert!(
        (note.contains("before the next batch of epoch") || note.contains("at the end of epoch"))
            && note.contains("with a checkpoint there"),
        "{note}"
    );
    assert!(note.contains("A second Ctrl-C quits at once"), "{note}");
    let (_, stopped) = training.line_with("interrupted:");
    assert_eq!(training.wait(), Some(130));
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(2), "stopped after {took:?}");
    let position = stopped
        .split(" is checkpointed at ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap_or_else(|| panic!("{stopped}"))
        .to_string();
    let recorded = recorded_position(&run);

    // It resumes from that checkpoint; SIGINT then SIGTERM (two signals the handler cannot
    // merge into one, as it may two of the same sent together) quit at once without a new
    // checkpoint, saying that the run resumes from this one.
    let mut resumed = Training::start(&["train", "--out", &run_arg, "--resume"]);
    let (_, resuming) = resumed.line_with("resuming");
    assert!(
        resuming.ends_with(&format!("from {position}")),
        "{resuming}"
    );
    resumed.line_with("training complex d=2000");
    resumed.signal(Signal::SIGINT);
    resumed.signal(Signal::SIGTERM);
    let (_, quit) = resumed.line_with("SIGTERM, a second signal: quitting");
    assert!(
        quit.ends_with(&format!("--resume` starts from {position}")),
        "{quit}"
    );
    assert_eq!(resumed.wait(), Some(130));
    assert_eq!(recorded_position(&run), recorded, "no new checkpoint");
}
