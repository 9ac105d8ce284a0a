//! Serve jobs, the daemon's side: a serve job holds its run in its own process (see
//! `worker::serve`); the daemon forwards queries to it from its submitter, members of a group
//! the submitter named, and root, with the same bounds as any request (the queries pass
//! unparsed, the answer comes back at most a frame long and goes to the client as it is),
//! and keeps the latencies for the metrics and the job's status.
//!
//! A serve job runs in a queue of its own (`serve`, `serve_jobs` at once, `serve_jobs_per_user`
//! of one user, `reserved_serve_jobs` for the admin group): it takes no CPU or GPU job slot. On
//! a GPU it holds at most the daemon's `serve_gpu_memory` share of it, all serve jobs together
//! (the rest is training's).

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::access::Peer;
use crate::channel::Serving;

/// Requests whose latency the metrics' percentiles and rate are taken over.
const WINDOW: usize = 1024;

/// Requests forwarded and not answered yet, by id: where their answer (queries answered, the
/// reply's bytes) goes.
type Pending = HashMap<u64, SyncSender<(u32, Vec<u8>)>>;

/// A serve job's state in the daemon.
pub struct ServeState {
    /// The submitter.
    pub owner: u32,
    /// The group whose members may query too.
    pub group: Option<u32>,
    /// The run as its process loaded it, once it has.
    serving: Mutex<Option<Serving>>,
    stats: Mutex<Stats>,
    pending: Mutex<Pending>,
    next: AtomicU64,
}

/// The GPU memory serve jobs hold, by device ordinal, within the `serve_gpu_memory` share: one
/// job loads onto a GPU at a time, so that each load sees what the ones before it took.
#[derive(Default)]
pub struct GpuShares {
    state: Mutex<HashMap<usize, Share>>,
    idle: Condvar,
}

#[derive(Default)]
struct Share {
    held: u64,
    loading: bool,
}

impl GpuShares {
    /// Waits until no serve job loads onto GPU `ordinal`, then begins a load: what is left of
    /// `share` bytes ([`GpuShares::loaded`] ends it).
    pub fn begin_load(&self, ordinal: usize, share: u64) -> u64 {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut state = self
            .idle
            .wait_while(state, |s| s.get(&ordinal).is_some_and(|s| s.loading))
            .unwrap_or_else(|e| e.into_inner());
        let s = state.entry(ordinal).or_default();
        s.loading = true;
        share.saturating_sub(s.held)
    }

    /// A load onto GPU `ordinal` ended, holding `took` bytes.
    pub fn loaded(&self, ordinal: usize, took: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let s = state.entry(ordinal).or_default();
        s.loading = false;
        s.held += took;
        self.idle.notify_all();
    }

    /// A serve job gave back `bytes` of GPU `ordinal`.
    pub fn release(&self, ordinal: usize, bytes: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let s = state.entry(ordinal).or_default();
        s.held = s.held.saturating_sub(bytes);
    }
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

/// A request on its way to the serve job's process: its answer comes on `answer`.
pub struct Forwarded<'a> {
    state: &'a ServeState,
    /// The request's id on the job's channel.
    pub id: u64,
    answer: Receiver<(u32, Vec<u8>)>,
    sent: Instant,
}

impl Forwarded<'_> {
    /// The answer (a reply, serialised), waiting up to `wait`; `None` when the job's process
    /// ended first or took longer. An answer with answers counts for the metrics.
    pub fn answer(self, wait: Duration) -> Option<Vec<u8>> {
        let Ok((queries, reply)) = self.answer.recv_timeout(wait) else {
            self.state.pending_lock().remove(&self.id);
            return None;
        };
        if queries > 0 {
            self.state.record(self.sent.elapsed(), queries as usize);
        }
        Some(reply)
    }
}

impl ServeState {
    /// The state of a serve job of `owner` (and `group`).
    pub fn new(owner: u32, group: Option<u32>) -> ServeState {
        ServeState {
            owner,
            group,
            serving: Mutex::default(),
            stats: Mutex::default(),
            pending: Mutex::default(),
            next: AtomicU64::new(0),
        }
    }

    fn pending_lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the run is loaded and answers.
    pub fn is_serving(&self) -> bool {
        self.serving
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The run as loaded (or its figures updated).
    pub fn set_serving(&self, serving: Serving) {
        *self.serving.lock().unwrap_or_else(|e| e.into_inner()) = Some(serving);
    }

    /// Registers a request: its id to send with it, and where its answer comes.
    pub fn forward(&self) -> Forwarded<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = sync_channel(1);
        self.pending_lock().insert(id, tx);
        Forwarded {
            state: self,
            id,
            answer: rx,
            sent: Instant::now(),
        }
    }

    /// The job's process answered request `id` (`queries` queries): to its waiting client.
    pub fn deliver(&self, id: u64, queries: u32, reply: Vec<u8>) {
        if let Some(to) = self.pending_lock().remove(&id) {
            let _ = to.try_send((queries, reply));
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

    /// Forgets every request waiting (the job's process ended): their clients hear so.
    pub fn fail_pending(&self) {
        self.pending_lock().clear();
    }

    /// Whether `peer` may query this run: its submitter, a member of the group it named, root.
    pub fn may_query(&self, peer: &Peer) -> bool {
        peer.uid == 0
            || peer.uid == self.owner
            || self.group.is_some_and(|g| peer.groups.contains(&g))
    }

    /// The job's live status: where it answers, queries, rate, latency and the row cache's hit
    /// rate (what a running serve job's `result` shows).
    pub fn status(&self) -> Option<serde_json::Value> {
        let serving = self.serving.lock().unwrap_or_else(|e| e.into_inner());
        let v = serving.as_ref()?;
        let s = self.summary();
        Some(serde_json::json!({
            "placement": v.placement,
            "streamed": v.streamed,
            "host_bytes": v.host_bytes,
            "stream_bytes": v.stream_bytes,
            "gpu_bytes": v.gpu_bytes,
            "queries": s.queries,
            "requests": s.requests,
            "queries_per_second": s.rate,
            "latency_p50_s": s.p50,
            "latency_p99_s": s.p99,
            "cache_hit_rate": v.cache.map(|c| c.0),
            "cache_misses": v.cache.map(|c| c.1),
        }))
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

    /// The metrics lines of job `id`.
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
        let serving = self.serving.lock().unwrap_or_else(|e| e.into_inner());
        let Some(v) = serving.as_ref() else {
            return;
        };
        let _ = writeln!(
            out.resident,
            "legend_serve_resident_bytes{{{job}}} {}",
            v.host_bytes
        );
        let _ = writeln!(
            out.stream,
            "legend_serve_stream_bytes{{{job}}} {}",
            v.stream_bytes
        );
        let _ = writeln!(out.gpu, "legend_serve_gpu_bytes{{{job}}} {}", v.gpu_bytes);
        if let Some((rate, _)) = v.cache {
            let _ = writeln!(out.hit_rate, "legend_serve_cache_hit_ratio{{{job}}} {rate}");
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
