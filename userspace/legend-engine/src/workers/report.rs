//! What the workers did in an epoch: the K-GPU part of an epoch's report.

use serde::{Deserialize, Serialize};

/// What one worker did in one round.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoundReport {
    /// Seconds training its pieces (to the end of their GPU work).
    pub compute_s: f64,
    /// Seconds waiting at the round gate for the other workers.
    pub wait_s: f64,
    /// Seconds handing partitions over before the round.
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
    /// Σ compute ÷ (K × wall time): how much of the K workers' time trained.
    pub parallel_efficiency: f64,
    /// The slowest worker's compute summed over the rounds, over the mean worker's: what the
    /// rounds' imbalance cost.
    pub imbalance: f64,
    /// The planner's prediction of that imbalance, from the buckets' batch counts.
    pub predicted_imbalance: f64,
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
                    "{} trained {:.2} s, waited {:.2} s, handed over {:.2} s",
                    self.devices.get(g).map_or("?", String::as_str),
                    sum(|r| r.compute_s),
                    sum(|r| r.wait_s),
                    sum(|r| r.handover_s)
                )
            })
            .collect();
        format!(
            "{} workers: parallel efficiency {:.1} %, imbalance {:.3} (predicted {:.3}), {} hand-overs ({:.2} GB); {}",
            self.gpus,
            100.0 * self.parallel_efficiency,
            self.imbalance,
            self.predicted_imbalance,
            self.handovers,
            self.handover_bytes as f64 / 1e9,
            per_gpu.join("; ")
        )
    }
}
