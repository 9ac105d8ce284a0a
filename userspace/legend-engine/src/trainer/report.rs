//! What an epoch reports: its swaps' timing, its figures, how it ended.

use serde::{Deserialize, Serialize};

use crate::progress::EpochCut;
use crate::swap::IoKernelSpan;

/// Timing of one swap of an epoch (for the compute-vs-I/O timeline).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SwapReport {
    /// Partition written back.
    pub evicted: u32,
    /// Partition read.
    pub loaded: u32,
    /// Seconds from the epoch start to the start of the swap.
    pub start_s: f64,
    /// Seconds of I/O the swap took on the I/O thread (its write and its read).
    pub io_s: f64,
    /// Seconds from the epoch start to the start of the swap's first I/O: before `start_s`
    /// when its read ran ahead (`storage.read_ahead`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_start_s: Option<f64>,
    /// Part of `io_s` spent copying the partitions between the host and the GPU (the GPU
    /// engine's copies run on the I/O thread; 0 on the CPU).
    #[serde(default)]
    pub copy_s: f64,
    /// Seconds of compute overlapped with the swap.
    pub overlap_compute_s: f64,
    /// Seconds compute waited for the swap.
    pub wait_s: f64,
    /// Seconds of compute after the swap (needing the loaded partition).
    pub after_compute_s: f64,
    /// Bytes read plus written by the swap.
    pub bytes: u64,
    /// The GPU I/O kernels' launches of the swap, when the engine moves partitions with them
    /// (storage.backend = proxy | nvme on a GPU); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub io_kernels: Vec<IoKernelSpan>,
}

/// What one epoch did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EpochReport {
    /// Epoch number, from 1.
    pub epoch: u32,
    /// Mean loss per positive edge.
    pub loss: f64,
    /// Positive edges trained on.
    pub edges: u64,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Positive edges per second.
    pub edges_per_sec: f64,
    /// Negatives per positive and side.
    pub negatives_per_positive: usize,
    /// Partitions read (initialised ones excluded).
    pub partitions_read: u64,
    /// Partitions written.
    pub partitions_written: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Seconds of I/O on the I/O thread.
    pub io_s: f64,
    /// Seconds compute waited for I/O.
    pub io_wait_s: f64,
    /// Buffer states this epoch went through (the fill counted once).
    pub buffer_states: u64,
    /// Per-swap timings.
    pub swaps: Vec<SwapReport>,
    /// The process's peak resident memory so far (bytes; 0 where it cannot be read).
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// Device memory in use at the end of the epoch (bytes, the GPU engine only; the whole
    /// device's, other processes included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_bytes: Option<u64>,
    /// The epoch was resumed in its middle: its times and I/O cover only the part trained
    /// after the resume (its loss and edges cover the whole epoch).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resumed: bool,
    /// What the workers did, when K of them trained the epoch (`training.gpus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<Box<crate::workers::report::WorkersReport>>,
}

/// How [`Trainer::run_epoch_from`](super::Trainer::run_epoch_from) ended.
#[derive(Debug)]
pub enum EpochEnd {
    /// The epoch is complete.
    Done(EpochReport),
    /// Stopped between two buffer states, as asked.
    Stopped(EpochCut),
}
