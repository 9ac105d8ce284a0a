//! How far an epoch has trained: what a checkpoint taken between two buffer states records.

use serde::{Deserialize, Serialize};

/// Where an interrupted epoch stopped: after its initial buckets and `swaps` swaps (each with
/// its buckets), with what it had counted so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochCut {
    /// The epoch (from 1).
    pub epoch: u32,
    /// Swaps finished.
    pub swaps: u32,
    /// Batches trained (negative samples are keyed by the batch number).
    pub batches: u64,
    /// Positive edges trained.
    pub edges: u64,
    /// Loss summed over them.
    pub loss: f64,
}
