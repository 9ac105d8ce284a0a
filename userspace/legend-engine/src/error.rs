//! What can stop training.

use crate::config::ConfigError;
use crate::store::PartitionStoreError;

/// A training error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] PartitionStoreError),
    /// The plan could not be made.
    #[error("planning")]
    Plan(#[from] legend_planner::PlanError),
    /// A checkpoint's position inside an epoch does not fit the run's plan.
    #[error("resuming: {0}")]
    Resume(String),
    /// An updated node row left its format's range (`storage.dtype = "f16"`: beyond ±65504).
    #[error(
        "node row {row}, element {element} does not fit storage.dtype = \"{dtype}\" after a step; use bf16 (f32's range) or f32, or lower optimizer.learning_rate"
    )]
    OutOfRange {
        /// The row's global id.
        row: u64,
        /// The element.
        element: usize,
        /// The format.
        dtype: legend_model::Dtype,
    },
    /// The loss became NaN or infinite.
    #[error("the loss diverged (not finite) in epoch {epoch}; lower optimizer.learning_rate")]
    Diverged {
        /// The epoch.
        epoch: u32,
    },
    /// The configuration cannot train on the chosen device.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The CUDA device asked for could not be opened.
    #[error("training.device = {device:?}")]
    Device {
        /// `training.device`.
        device: String,
        /// Why.
        #[source]
        error: legend_cuda::GpuError,
    },
    /// The run does not fit in the GPU's memory (the message says what to change).
    #[error("{0}")]
    GpuMemory(String),
    /// The GPU engine failed.
    #[error("GPU engine")]
    Gpu(legend_cuda::GpuError),
    /// The thread pool could not start.
    #[error("starting {threads} worker threads: {message}")]
    Threads {
        /// Requested threads.
        threads: usize,
        /// The error.
        message: String,
    },
    /// Writing a checkpoint's tables failed.
    #[error(transparent)]
    Run(#[from] crate::run::RunError),
    /// GPU-to-GPU traffic failed, or cannot start (NCCL missing).
    #[error("between GPUs")]
    Exchange(#[from] legend_cuda::nccl::NcclError),
    /// A worker of a run on several GPUs (or CPU workers) failed; the others stopped.
    #[error("worker {worker} ({device})")]
    Worker {
        /// The worker.
        worker: usize,
        /// Its device.
        device: String,
        /// Why it failed.
        #[source]
        source: Box<TrainError>,
    },
    /// A worker stopped because another failed (its own error is the other's).
    #[error("stopped because another worker failed")]
    WorkerStopped,
}

/// GPU failures, with a row that left its storage format's range reported as the CPU engine
/// reports it.
impl From<legend_cuda::GpuError> for TrainError {
    fn from(e: legend_cuda::GpuError) -> Self {
        match e {
            legend_cuda::GpuError::OutOfRange {
                row,
                element,
                dtype,
            } => TrainError::OutOfRange {
                row,
                element: element as usize,
                dtype,
            },
            other => TrainError::Gpu(other),
        }
    }
}
