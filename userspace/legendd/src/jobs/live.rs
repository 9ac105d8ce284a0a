//! A running job's process, as the daemon holds it: the channel's sending end, its pid, uid
//! and cgroup, and a serve job's state.

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use legend_daemon_api::JobProcess;

use crate::channel::{self, ToJob};
use crate::process::cgroup::JobCgroup;
use crate::serve::ServeState;

/// A running job's process.
pub struct LiveJob {
    writer: Mutex<UnixStream>,
    /// What `status` shows of it.
    process: JobProcess,
    cgroup: Option<Arc<JobCgroup>>,
    /// A serve job's state.
    pub serve: Option<ServeState>,
}

impl LiveJob {
    /// A started process.
    pub fn new(
        writer: UnixStream,
        process: JobProcess,
        cgroup: Option<Arc<JobCgroup>>,
        serve: Option<ServeState>,
    ) -> LiveJob {
        LiveJob {
            writer: Mutex::new(writer),
            process,
            cgroup,
            serve,
        }
    }

    /// Sends `message` to the process (a process that went away is noticed by its runner).
    pub fn send(&self, message: &ToJob) -> std::io::Result<()> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        channel::send(&mut *w, message)
    }

    /// Asks the process to stop at its next checkpointable point.
    pub fn stop(&self) {
        if let Err(e) = self.send(&ToJob::Stop) {
            tracing::debug!("asking a job's process {} to stop: {e}", self.process.pid);
        }
    }

    /// What `status` shows now: with the peak memory so far.
    pub fn process(&self) -> JobProcess {
        JobProcess {
            peak_memory: self.peak_memory(),
            ..self.process.clone()
        }
    }

    /// The most memory its cgroup has held.
    pub fn peak_memory(&self) -> Option<u64> {
        self.cgroup.as_ref().and_then(|c| c.peak_memory())
    }

    /// How many times the kernel killed its processes for memory.
    pub fn oom_kills(&self) -> u64 {
        self.cgroup.as_ref().map_or(0, |c| c.oom_kills())
    }
}
