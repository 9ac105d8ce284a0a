//! A train job: a [`Session`] created or resumed, run until it ends or is stopped, holding a
//! lock on its run directory for as long.

use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use legend_daemon_api::JobSpec;
use legend_engine::Config;
use legend_engine::evaluation::describe;
use legend_engine::session::{Event, Outcome, Session};
use legend_fs::Dir;

use super::{Outbox, chain, check_store};
use crate::access::JobGuard;
use crate::channel::{Ended, EpochEnd, FromJob, JobStart};
use crate::paths::DirId;

/// How often a running job's progress goes to the daemon.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// How long a trainer waits for another process's lock on its run (one dying with a daemon
/// that was killed, say) before it fails.
const LOCK_WAIT: Duration = Duration::from_secs(30);

/// An exclusive lock on a run directory (`flock` on the directory itself, so on its device and
/// inode, whatever path reached it), held by the process that trains it: a process that
/// outlived its daemon, or a second job reaching the run through a link, cannot train it too.
struct RunLock {
    dir: Dir,
    id: DirId,
}

impl RunLock {
    /// Locks the run `path`, waiting up to [`LOCK_WAIT`] for a process that holds it.
    fn take(path: &Path, guard: &JobGuard, out: &Outbox) -> Result<RunLock, String> {
        let dir = Dir::open_guarded(path, guard).map_err(|e| format!("{}: {e}", path.display()))?;
        let id = DirId::of(&dir).map_err(|e| format!("{}: {e}", path.display()))?;
        let started = Instant::now();
        loop {
            // SAFETY: flock on the open directory's descriptor.
            if unsafe { libc::flock(dir.as_fd().as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(RunLock { dir, id });
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(format!("{}: locking the run: {e}", path.display()));
            }
            if started.elapsed() >= LOCK_WAIT {
                return Err(format!(
                    "{}: another process trains this run (it holds the run's lock); a run has \
                     one trainer at a time",
                    path.display()
                ));
            }
            if started.elapsed() < Duration::from_millis(250) {
                out.log("waiting for the run's lock: another process trains it");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Checks that `path` still reaches the locked directory (the session opened it by path).
    fn check_same(&self, path: &Path) -> Result<(), String> {
        let now = Dir::open(path).and_then(|d| DirId::of(&d));
        if now.ok() == Some(self.id) {
            Ok(())
        } else {
            Err(format!(
                "{}: the run directory was replaced while the job started",
                self.dir.path().display()
            ))
        }
    }
}

/// Runs a train job.
pub fn train(
    start: &JobStart,
    guard: &JobGuard,
    out: &Outbox,
    stop: &AtomicBool,
) -> Result<Ended, String> {
    let JobSpec::Train {
        dataset,
        out: run,
        config,
        sets,
        resume,
    } = &start.spec
    else {
        unreachable!("a train job");
    };
    let (mut session, _lock) = if *resume || start.run_made {
        let lock = RunLock::take(run, guard, out)?;
        let expect = |meta: &legend_engine::run::RunMeta| check_store(meta, start.expect.as_ref());
        let session = Session::resume_expecting(run, dataset.as_deref(), sets, guard, &expect)
            .map_err(|e| chain(&e))?;
        lock.check_same(run)?;
        (session, lock)
    } else {
        let dataset = dataset.as_deref().ok_or("a new run needs a dataset")?;
        let config = Config::parse(config, sets).map_err(|e| chain(&e))?;
        let session = Session::create(run, dataset, config, guard).map_err(|e| chain(&e))?;
        // The run exists now: after a restart the job continues it.
        out.send(&FromJob::RunMade);
        let lock = RunLock::take(run, guard, out)?;
        (session, lock)
    };
    if session.is_finished().map_err(|e| chain(&e))? {
        out.log("the run has nothing left to do");
        return Ok(Ended::Done(None));
    }
    out.log(format!(
        "{} from {}",
        session.describe(),
        session.position().describe()
    ));
    out.send(&FromJob::Engine(session.engine().to_string()));
    // The epoch whose kept tables (RUN/best) the final evaluation ranked, if any.
    let mut best_epoch = None;
    let mut last_progress = Instant::now();
    let outcome = session
        .run(stop, &mut |event| match event {
            Event::EpochStarted {
                epoch,
                epochs: total,
                edges,
                edges_done,
            } => {
                out.send(&FromJob::EpochStarted {
                    epoch,
                    epochs: total,
                    edges,
                    edges_done,
                });
            }
            Event::Progress { edges_done, .. } => {
                if last_progress.elapsed() >= PROGRESS_EVERY {
                    last_progress = Instant::now();
                    out.send(&FromJob::Progress(edges_done));
                }
            }
            Event::EpochFinished {
                report,
                valid,
                line,
            } => {
                let mut text = format!(
                    "epoch {}: loss {:.4}, {:.0} edges/s, {:.2} s",
                    report.epoch, report.loss, report.edges_per_sec, report.seconds
                );
                if let Some(m) = valid {
                    text.push_str(&format!("; valid: {}", describe(m)));
                }
                out.send(&FromJob::Epoch(Box::new(EpochEnd {
                    line: line.clone(),
                    epoch: report.epoch,
                    loss: report.loss,
                    edges_per_sec: report.edges_per_sec,
                    seconds: report.seconds,
                    io_bytes: report.bytes_read + report.bytes_written,
                    text,
                })));
            }
            Event::Checkpoint { position } => {
                out.send(&FromJob::Checkpoint(position.describe()));
            }
            Event::Evaluating { split } => {
                out.send(&FromJob::Evaluating(split.name().into()));
            }
            Event::Evaluated {
                split,
                metrics,
                line,
            } => {
                best_epoch = line.get("best_epoch").cloned();
                let best = best_epoch
                    .as_ref()
                    .map_or(String::new(), |e| format!(" (best epoch {e})"));
                out.send(&FromJob::Evaluated {
                    line: line.clone(),
                    text: format!("{}{best}: {}", split.name(), describe(metrics)),
                });
            }
        })
        .map_err(|e| chain(&e))?;
    Ok(match outcome {
        Outcome::Finished(metrics) => Ended::Done(metrics.map(|m| {
            let mut result = serde_json::to_value(m).expect("metrics serialize");
            if let Some(epoch) = best_epoch {
                result["best_epoch"] = epoch;
            }
            result
        })),
        Outcome::Stopped(position) => Ended::Stopped(position.describe()),
    })
}
