//! What can stop training.

use crate::config::ConfigError;
use crate::store::PartitionStoreError;

/// A training error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    #[error(transparent)]
    GpuMemory(crate::footprint::DoesNotFit),
    /// The GPU engine failed.
    #[error("GPU engine")]
    Gpu(#[source] legend_cuda::GpuError),
    /// The thread pool could not start.
    #[error("starting {threads} worker threads: {message}")]
    Threads {
        /// Requested threads.
        threads: usize,
        /// The error.
        message: String,
    },
    /// The receiver of a partition's streamed rows (a checkpoint's writer) failed.
    #[error("receiving a partition's rows")]
    Sink(#[from] Box<dyn std::error::Error + Send + Sync>),
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
    /// A host of several could not read its part of the dataset.
    #[error(transparent)]
    Dataset(#[from] legend_dataset::DatasetError),
    /// A run on several hosts failed on some host, or lost one (the message names it).
    #[error(transparent)]
    Hosts(#[from] legend_cluster::ClusterError),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::with_sources;

    #[test]
    fn a_gpu_failure_in_training_ends_at_the_os_words() {
        let gpu = legend_cuda::GpuError::Controller {
            label: "/dev/legend-nvme0".into(),
            what: "CREATE_QUEUE_PAIR".into(),
            source: Box::new(legend_nvme::Error::Ioctl {
                op: "CREATE_QUEUE_PAIR",
                // EBUSY: the queue pair is another owner's.
                source: std::io::Error::from_raw_os_error(16),
            }),
        };
        let text = with_sources(&TrainError::from(gpu));
        assert!(text.starts_with("GPU engine: /dev/legend-nvme0"), "{text}");
        assert!(text.contains("Device or resource busy"), "{text}");
    }

    #[test]
    fn a_store_failure_reading_a_run_ends_at_the_os_words() {
        let store = PartitionStoreError::Io {
            path: "/runs/r/store.bin".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        let run = crate::run::RunError::Store {
            path: "/runs/r/store.bin".into(),
            source: Box::new(store),
        };
        let text = with_sources(&run);
        assert!(
            text.starts_with("/runs/r/store.bin: /runs/r/store.bin"),
            "{text}"
        );
        assert!(text.ends_with("entity not found"), "{text}");
    }
}
