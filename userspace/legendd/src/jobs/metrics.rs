//! The daemon's metrics in the Prometheus text format.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use legend_daemon_api::JobState;

use super::Jobs;
use crate::serve::MetricLines;

/// Bytes of the metrics lines of one job, at most (what a metrics answer is bounded with).
pub const BYTES_PER_JOB: usize = 1024;

impl Jobs {
    /// Bytes the metrics take at most for a caller `shows` lets see `shown` jobs.
    pub fn metrics_size(&self, shows: impl Fn(u32) -> bool) -> usize {
        let shown = self
            .lock()
            .jobs
            .values()
            .filter(|e| shows(e.record.info.owner))
            .count();
        4096 + shown * BYTES_PER_JOB
    }

    pub fn metrics(&self, shows: impl Fn(u32) -> bool) -> String {
        let t = self.lock();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP legendd_jobs Jobs by state.\n# TYPE legendd_jobs gauge"
        );
        for state in [
            JobState::Queued,
            JobState::Running,
            JobState::Succeeded,
            JobState::Failed,
            JobState::Cancelled,
        ] {
            let n = t
                .jobs
                .values()
                .filter(|e| e.record.info.state == state)
                .count();
            let _ = writeln!(s, "legendd_jobs{{state=\"{}\"}} {n}", state.name());
        }
        let _ = writeln!(
            s,
            "# HELP legendd_queue_depth Jobs waiting, by device.\n# TYPE legendd_queue_depth gauge"
        );
        for (q, n) in t.queue_depths() {
            let _ = writeln!(s, "legendd_queue_depth{{device=\"{q}\"}} {n}");
        }
        let _ = writeln!(
            s,
            "# HELP legendd_running_slots Job slots taken, by device (a job on K GPUs takes one on each).\n# TYPE legendd_running_slots gauge"
        );
        for (q, n) in t.running_slots() {
            let _ = writeln!(s, "legendd_running_slots{{device=\"{q}\"}} {n}");
        }
        let _ = writeln!(
            s,
            "# HELP legendd_requests_total Requests answered.\n# TYPE legendd_requests_total counter\nlegendd_requests_total {}",
            self.requests.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "# HELP legend_job_edges_per_second Edges per second of the job's last epoch.\n# TYPE legend_job_edges_per_second gauge"
        );
        let shown = || t.jobs.values().filter(|e| shows(e.record.info.owner));
        for e in shown().filter(|e| e.record.info.state == JobState::Running) {
            let i = &e.record.info;
            let _ = writeln!(
                s,
                "legend_job_edges_per_second{{job=\"{}\",owner=\"{}\"}} {}",
                i.id, i.owner, i.progress.edges_per_sec
            );
        }
        let _ = writeln!(
            s,
            "# HELP legend_job_io_bytes_total Bytes the job's swaps moved.\n# TYPE legend_job_io_bytes_total counter"
        );
        for e in shown() {
            let _ = writeln!(
                s,
                "legend_job_io_bytes_total{{job=\"{}\"}} {}",
                e.record.info.id, e.io_bytes
            );
        }
        let _ = writeln!(
            s,
            "# HELP legend_job_train_seconds_total Seconds the job's epochs took (on its GPU or CPU).\n# TYPE legend_job_train_seconds_total counter"
        );
        for e in shown() {
            let _ = writeln!(
                s,
                "legend_job_train_seconds_total{{job=\"{}\"}} {}",
                e.record.info.id, e.train_seconds
            );
        }
        let shown_serving: Vec<u64> = shown()
            .filter(|e| e.record.info.state == JobState::Running)
            .map(|e| e.record.info.id)
            .collect();
        drop(t);
        let mut lines = MetricLines::default();
        for id in shown_serving {
            if let Some(state) = self.live(id).as_ref().and_then(|l| l.serve.as_ref()) {
                state.write_metrics(id, &mut lines);
            }
        }
        lines.finish(&mut s);
        s
    }
}
