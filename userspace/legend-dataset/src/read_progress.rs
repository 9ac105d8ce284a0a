//! A log line every 10 s while a large file is read: loading a billion-edge graph's 18 GB of
//! edges (and sorting them into buckets) takes minutes on a busy machine, which must not pass in
//! silence before a run's first epoch.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often a read in progress says how far it is.
const EVERY: Duration = Duration::from_secs(10);

/// Bytes of a read done so far, counted from any thread.
pub(crate) struct ReadProgress {
    /// What is read, for the log line: `reading edges/train.bin`.
    what: String,
    total: u64,
    done: AtomicU64,
    started: Instant,
    logged: Mutex<Instant>,
}

impl ReadProgress {
    /// A read of `total` bytes described by `what`.
    pub(crate) fn new(what: String, total: u64) -> ReadProgress {
        let now = Instant::now();
        ReadProgress {
            what,
            total,
            done: AtomicU64::new(0),
            started: now,
            logged: Mutex::new(now),
        }
    }

    /// `bytes` more are read; logs how far the read is when [`EVERY`] has passed since the
    /// last line (one thread logs, the others go on).
    pub(crate) fn add(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let Ok(mut logged) = self.logged.try_lock() else {
            return;
        };
        if logged.elapsed() >= EVERY {
            *logged = Instant::now();
            tracing::info!(
                "set-up: {}: {:.1} of {:.1} GB ({:.0}%) in {:.0} s",
                self.what,
                done as f64 / 1e9,
                self.total as f64 / 1e9,
                100.0 * done as f64 / self.total.max(1) as f64,
                self.started.elapsed().as_secs_f64()
            );
        }
    }
}
