//! Errors of the GPU engine.

use cudarc::driver::DriverError;

/// Why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded.
    #[error(
        "no CUDA driver: libcuda.so could not be loaded (is an NVIDIA driver installed, and is \
         this a machine with a GPU?)"
    )]
    NoDriver,
    /// The NVRTC library (`libnvrtc.so.13`) could not be loaded.
    #[error(
        "no NVRTC: libnvrtc.so.13 could not be loaded; install the CUDA 13 toolkit or the \
         nvidia-cuda-nvrtc wheel and add its lib directory to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// The driver loaded but reports no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// The devices present.
        count: usize,
    },
    /// An updated node row left its storage format's range (f16 beyond ±65504).
    #[error("node row {row}, element {element} left the range of storage.dtype = \"{dtype}\"")]
    OutOfRange {
        /// The row's global id.
        row: u64,
        /// The element.
        element: u32,
        /// The format.
        dtype: legend_model::Dtype,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed ({what})")]
    Driver {
        /// What was being done.
        what: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// NVRTC rejected a kernel source or printed a warning for it.
    #[error("NVRTC compiling the Legend kernels for {arch}: {message}")]
    Compile {
        /// The target architecture (`sm_90`, ...).
        arch: String,
        /// The NVRTC status and log.
        message: String,
    },
    /// The kernel cache could not be read or written.
    #[error("kernel cache {path}")]
    Cache {
        /// The cache file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A kernel source named by `LEGEND_KERNELS_DIR` could not be read.
    #[error("kernel source {path} (LEGEND_KERNELS_DIR)")]
    KernelSource {
        /// The source file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A call to the NVMe controller of the GPU I/O queues failed.
    #[error("{label}: {what}")]
    Controller {
        /// The controller.
        label: String,
        /// The call, and what it was for.
        what: String,
        /// Why it failed (boxed: it is large, and rare).
        #[source]
        source: Box<legend_nvme::Error>,
    },
    /// The NVMe controller of the GPU I/O queues cannot serve what was asked.
    #[error("{label}: {what}")]
    Nvme {
        /// The controller.
        label: String,
        /// What was refused, and why.
        what: String,
    },
    /// A command of the GPU I/O kernels failed.
    #[error("{label}: {error}")]
    NvmeCommand {
        /// The controller.
        label: String,
        /// The command and its decoded status.
        error: legend_nvme_protocol::CommandError,
    },
    /// A queue of the GPU I/O kernels stopped answering; the queue pairs were deleted.
    #[error(
        "{label}: the controller stopped answering the GPU I/O queues ({state}); the queue pairs were deleted"
    )]
    NvmeTimeout {
        /// The controller.
        label: String,
        /// The queue's state when the block gave up.
        state: String,
    },
    /// Arguments of inconsistent shapes.
    #[error("shape mismatch: {0}")]
    Shape(String),
}

/// Attaches a description to a driver result.
pub(crate) trait DriverContext<T> {
    /// Maps a driver error into [`GpuError::Driver`] with `what`.
    fn during(self, what: &'static str) -> Result<T, GpuError>;
}

impl<T> DriverContext<T> for Result<T, DriverError> {
    fn during(self, what: &'static str) -> Result<T, GpuError> {
        self.map_err(|source| GpuError::Driver { what, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `e` and its sources, each after a `: `, as the CLI and the daemon print errors.
    fn chain(e: &dyn std::error::Error) -> String {
        let sources = std::iter::successors(Some(e), |e| e.source());
        sources
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(": ")
    }

    #[test]
    fn a_controller_failure_ends_at_the_os_words() {
        let e = GpuError::Controller {
            label: "/dev/legend-nvme0".into(),
            what: "MAP of 4096 bytes of GPU memory".into(),
            source: Box::new(legend_nvme::Error::Ioctl {
                op: "MAP",
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            }),
        };
        let text = chain(&e);
        assert!(
            text.starts_with("/dev/legend-nvme0: MAP of 4096 bytes of GPU memory: MAP"),
            "{text}"
        );
        assert!(
            text.ends_with("Cannot allocate memory (os error 12)"),
            "{text}"
        );
    }
}
