//! Serve jobs: a run's tables held in the daemon's memory (the host's, or a GPU's), answering
//! queries (legend-query) from its submitter, members of a group the submitter named, and root,
//! with the latencies kept for the metrics and the job's status.
//!
//! A serve job runs in a queue of its own (`serve`, `serve_jobs` at once): it takes no CPU or
//! GPU job slot. On the CPU its queries run on the daemon's rayon pool, beside whatever trains;
//! on a GPU they hold at most the daemon's `serve_gpu_memory` share of it, all serve jobs
//! together (the rest is training's), and their kernels share the GPU's time with training's.
//! At most [`MAX_IN_FLIGHT`] batches of one served run are answered at once; more are
//! `unavailable`.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use legend_daemon_api::{ErrorCode, MAX_QUERIES, MAX_TOP, Reply};
use legend_query::{Query, QueryRun};

use crate::access::Peer;

/// Batches of one served run answered at once; more are `unavailable` (each batch already uses
/// every core).
pub const MAX_IN_FLIGHT: usize = 8;

/// Requests whose latency the metrics' percentiles and rate are taken over.
const WINDOW: usize = 1024;

/// A run being served.
pub struct Served {
    /// The submitter.
    pub owner: u32,
    /// The group whose members may query too.
    pub group: Option<u32>,
    run: QueryRun<'static>,
    in_flight: AtomicUsize,
    stats: Mutex<Stats>,
}

/// A served run's figures over its last [`WINDOW`] requests.
struct Summary {
    queries: u64,
    requests: u64,
    /// Queries a second, from the first request's end to now.
    rate: f64,
    /// Latency quantiles (seconds), when a request was answered.
    p50: Option<f64>,
    p99: Option<f64>,
}

/// What the metrics report of a served run.
#[derive(Default)]
struct Stats {
    queries: u64,
    requests: u64,
    /// (when answered, how long it took, how many queries) of the last [`WINDOW`] requests.
    recent: VecDeque<(Instant, Duration, usize)>,
}

/// Takes a place among the batches in flight; gives it back when dropped.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::Error {
        code,
        message: message.into(),
    }
}

impl Served {
    /// `run`, served for `owner` (and `group`).
    pub fn new(owner: u32, group: Option<u32>, run: QueryRun<'static>) -> Served {
        Served {
            owner,
            group,
            run,
            in_flight: AtomicUsize::new(0),
            stats: Mutex::default(),
        }
    }

    /// Bytes of the run's tables in host memory.
    pub fn resident_bytes(&self) -> usize {
        self.run.model().resident_bytes()
    }

    /// Bytes of host memory a streamed run's reads hold at most beside its tables (0 for rows
    /// in memory).
    pub fn stream_bytes(&self) -> u64 {
        self.run.model().stream_bytes()
    }

    /// Bytes of GPU memory the run holds (0 on the CPU).
    pub fn gpu_bytes(&self) -> u64 {
        self.run.model().gpu_bytes()
    }

    /// Where the run answers, in words.
    pub fn placement(&self) -> &str {
        self.run.placement()
    }

    /// The job's live status: where it answers, queries, rate, latency and the row cache's hit
    /// rate (what a running serve job's `result` shows).
    pub fn status(&self) -> serde_json::Value {
        let s = self.summary();
        let cache = self.run.model().cache_stats();
        serde_json::json!({
            "placement": self.placement(),
            "streamed": self.run.streamed(),
            "host_bytes": self.resident_bytes(),
            "stream_bytes": self.stream_bytes(),
            "gpu_bytes": self.gpu_bytes(),
            "queries": s.queries,
            "requests": s.requests,
            "queries_per_second": s.rate,
            "latency_p50_s": s.p50,
            "latency_p99_s": s.p99,
            "cache_hit_rate": cache.map(|c| c.hit_rate()),
            "cache_misses": cache.map(|c| c.misses),
        })
    }

    fn summary(&self) -> Summary {
        let s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let rate = match s.recent.front() {
            Some((first, _, _)) => {
                let span = first.elapsed().as_secs_f64();
                let n: usize = s.recent.iter().map(|r| r.2).sum();
                if span > 0.0 { n as f64 / span } else { 0.0 }
            }
            None => 0.0,
        };
        let mut latencies: Vec<f64> = s.recent.iter().map(|r| r.1.as_secs_f64()).collect();
        latencies.sort_by(f64::total_cmp);
        Summary {
            queries: s.queries,
            requests: s.requests,
            rate,
            p50: percentile(&latencies, 0.5),
            p99: percentile(&latencies, 0.99),
        }
    }

    /// Whether `peer` may query this run: its submitter, a member of the group it named, root.
    pub fn may_query(&self, peer: &Peer) -> bool {
        peer.uid == 0
            || peer.uid == self.owner
            || self.group.is_some_and(|g| peer.groups.contains(&g))
    }

    /// Answers `queries` (JSON of legend-query's `Query`), at most [`MAX_QUERIES`], each asking
    /// for at most [`MAX_TOP`] entities.
    pub fn answer(&self, queries: Vec<serde_json::Value>) -> Reply {
        if queries.is_empty() || queries.len() > MAX_QUERIES {
            return error(
                ErrorCode::BadRequest,
                format!(
                    "{} queries: send 1 to {MAX_QUERIES} in a request",
                    queries.len()
                ),
            );
        }
        let mut asked = Vec::with_capacity(queries.len());
        for (i, q) in queries.into_iter().enumerate() {
            match serde_json::from_value::<Query>(q) {
                Ok(q) => asked.push(q),
                Err(e) => {
                    return error(ErrorCode::BadRequest, format!("query {}: {e}", i + 1));
                }
            }
        }
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= MAX_IN_FLIGHT {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return error(
                ErrorCode::Unavailable,
                format!("the run answers {MAX_IN_FLIGHT} batches at once; try again"),
            );
        }
        let _place = InFlight(&self.in_flight);
        let started = Instant::now();
        let answered = self
            .run
            .answer(&asked, MAX_TOP, &|i| format!("query {}", i + 1));
        let took = started.elapsed();
        match answered {
            Ok(answers) => {
                self.record(took, answers.len());
                Reply::Answers {
                    answers: answers
                        .iter()
                        .map(|a| serde_json::to_value(a).expect("answers serialise"))
                        .collect(),
                    seconds: took.as_secs_f64(),
                }
            }
            Err(e) => error(ErrorCode::Refused, e.to_string()),
        }
    }

    fn record(&self, took: Duration, queries: usize) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.queries += queries as u64;
        s.requests += 1;
        if s.recent.len() == WINDOW {
            s.recent.pop_front();
        }
        s.recent.push_back((Instant::now(), took, queries));
    }

    /// The metrics lines of job `id` (Prometheus text, after the HELP/TYPE lines
    /// [`write_help`] writes once).
    pub fn write_metrics(&self, id: u64, out: &mut MetricLines) {
        let s = self.summary();
        let job = format!("job=\"{id}\",owner=\"{}\"", self.owner);
        let _ = writeln!(
            out.queries,
            "legend_serve_queries_total{{{job}}} {}",
            s.queries
        );
        let _ = writeln!(
            out.requests,
            "legend_serve_requests_total{{{job}}} {}",
            s.requests
        );
        let _ = writeln!(
            out.rate,
            "legend_serve_queries_per_second{{{job}}} {}",
            s.rate
        );
        for (name, v) in [("0.5", s.p50), ("0.99", s.p99)] {
            if let Some(v) = v {
                let _ = writeln!(
                    out.latency,
                    "legend_serve_latency_seconds{{{job},quantile=\"{name}\"}} {v}"
                );
            }
        }
        let _ = writeln!(
            out.resident,
            "legend_serve_resident_bytes{{{job}}} {}",
            self.resident_bytes()
        );
        let _ = writeln!(
            out.stream,
            "legend_serve_stream_bytes{{{job}}} {}",
            self.stream_bytes()
        );
        let _ = writeln!(
            out.gpu,
            "legend_serve_gpu_bytes{{{job}}} {}",
            self.gpu_bytes()
        );
        if let Some(c) = self.run.model().cache_stats() {
            let _ = writeln!(
                out.hit_rate,
                "legend_serve_cache_hit_ratio{{{job}}} {}",
                c.hit_rate()
            );
        }
    }
}

/// The value at quantile `q` of sorted `values` (nearest rank), `None` when empty.
fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// Each serve metric's lines, gathered over the served runs so that each metric's lines
/// follow its own HELP and TYPE.
#[derive(Default)]
pub struct MetricLines {
    queries: String,
    requests: String,
    rate: String,
    latency: String,
    resident: String,
    stream: String,
    gpu: String,
    hit_rate: String,
}

impl MetricLines {
    /// Appends every metric, with its HELP and TYPE, to `s`.
    pub fn finish(self, s: &mut String) {
        for (name, kind, help, lines) in [
            (
                "legend_serve_queries_total",
                "counter",
                "Queries a serve job answered.",
                self.queries,
            ),
            (
                "legend_serve_requests_total",
                "counter",
                "Query requests (batches) a serve job answered.",
                self.requests,
            ),
            (
                "legend_serve_queries_per_second",
                "gauge",
                "Queries per second over a serve job's last 1024 requests.",
                self.rate,
            ),
            (
                "legend_serve_latency_seconds",
                "summary",
                "Latency of a serve job's requests (the last 1024).",
                self.latency,
            ),
            (
                "legend_serve_resident_bytes",
                "gauge",
                "Bytes of a served run's tables in host memory.",
                self.resident,
            ),
            (
                "legend_serve_stream_bytes",
                "gauge",
                "Bytes of host memory a streamed run's reads hold at most beside its tables (0: rows in memory).",
                self.stream,
            ),
            (
                "legend_serve_gpu_bytes",
                "gauge",
                "Bytes of GPU memory a served run holds (rows, row cache, scan buffers).",
                self.gpu,
            ),
            (
                "legend_serve_cache_hit_ratio",
                "gauge",
                "Hit rate of a served run's GPU row cache since it loaded (coalesced requests count as hits).",
                self.hit_rate,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
            s.push_str(&lines);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn percentiles_take_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(super::percentile(&v, 0.5), Some(50.0));
        assert_eq!(super::percentile(&v, 0.99), Some(99.0));
        assert_eq!(super::percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(super::percentile(&[], 0.5), None);
    }
}
