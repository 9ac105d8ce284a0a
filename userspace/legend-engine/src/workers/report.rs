//! What the workers did in an epoch: the K-GPU part of an epoch's report.

use serde::{Deserialize, Serialize};

/// What one worker did in one round.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoundReport {
    /// Seconds training its pieces (to the end of their GPU work).
    pub compute_s: f64,
    /// Seconds waiting at the round gate for the other workers.
    pub wait_s: f64,
    /// Seconds moving partitions before the round: handing them over (N = 2K), or parking
    /// what the round drops and waiting for what it takes from home (N ≥ 3K; the reads ahead
    /// ran during the round before, so this is the I/O compute did not hide).
    pub handover_s: f64,
    /// Positive edges trained.
    pub edges: u64,
}

/// What the workers did in one epoch (the K-GPU part of an [`EpochReport`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WorkersReport {
    /// Workers (GPUs) K.
    pub gpus: u32,
    /// Their devices, in worker order.
    pub devices: Vec<String>,
    /// Per round trained, per worker.
    pub rounds: Vec<Vec<RoundReport>>,
    /// Partitions handed from worker to worker, and their bytes (resident rows and state).
    pub handovers: u64,
    /// Bytes of those hand-overs.
    pub handover_bytes: u64,
    /// Partitions read from the home (host memory) between rounds, N ≥ 3K: as many are
    /// written back.
    #[serde(default)]
    pub home_reads: u64,
    /// Bytes of those reads (as many written).
    #[serde(default)]
    pub home_read_bytes: u64,
    /// Σ compute ÷ (K × wall time): how much of the K workers' time trained.
    pub parallel_efficiency: f64,
    /// The slowest worker's compute summed over the rounds, over the mean worker's: what the
    /// rounds' imbalance cost.
    pub imbalance: f64,
    /// The planner's prediction of that imbalance, from the buckets' batch counts.
    pub predicted_imbalance: f64,
    /// Hosts the workers ran on (one process each); 1 on one host.
    #[serde(default = "one")]
    pub hosts: u32,
    /// Of the hand-overs, those between hosts (over the network rather than NVLink).
    #[serde(default)]
    pub cross_host_handovers: u64,
    /// Bytes of those hand-overs.
    #[serde(default)]
    pub cross_host_bytes: u64,
    /// Each host's peak resident memory so far (bytes), host 0 first; empty on one host (the
    /// epoch's `peak_rss_bytes` is host 0's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_peak_rss_bytes: Vec<u64>,
}

fn one() -> u32 {
    1
}

impl WorkersReport {
    /// The epoch's figures in words: efficiency, balance, hand-overs, then each GPU's time.
    pub fn describe(&self) -> String {
        let per_gpu: Vec<String> = (0..self.gpus as usize)
            .map(|g| {
                let sum = |f: fn(&RoundReport) -> f64| -> f64 {
                    self.rounds.iter().filter_map(|r| r.get(g)).map(f).sum()
                };
                format!(
                    "{} trained {:.2} s, waited {:.2} s, moved partitions {:.2} s",
                    self.devices.get(g).map_or("?", String::as_str),
                    sum(|r| r.compute_s),
                    sum(|r| r.wait_s),
                    sum(|r| r.handover_s)
                )
            })
            .collect();
        let hosts = if self.hosts > 1 {
            let peak = self.host_peak_rss_bytes.iter().max().copied().unwrap_or(0);
            format!(
                " on {} hosts, {} of them between hosts ({:.2} GB), peak RSS of a host {:.2} GiB",
                self.hosts,
                self.cross_host_handovers,
                self.cross_host_bytes as f64 / 1e9,
                crate::footprint::gib(peak)
            )
        } else {
            String::new()
        };
        let moves = if self.home_reads > 0 {
            format!(
                "{} partitions read from host memory and as many parked ({:.2} GB each way)",
                self.home_reads,
                self.home_read_bytes as f64 / 1e9
            )
        } else {
            format!(
                "{} hand-overs ({:.2} GB)",
                self.handovers,
                self.handover_bytes as f64 / 1e9
            )
        };
        format!(
            "{} workers: parallel efficiency {:.1} %, imbalance {:.3} (predicted {:.3}), {moves}{hosts}; {}",
            self.gpus,
            100.0 * self.parallel_efficiency,
            self.imbalance,
            self.predicted_imbalance,
            per_gpu.join("; ")
        )
    }
}
