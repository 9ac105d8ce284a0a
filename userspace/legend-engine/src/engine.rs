//! `training.device`: which engine trains, resolved before anything is written, and the one
//! resolution of a [`DeviceChoice`] (the queries of a run use it too).

use legend_cuda::{Gpu, driver_present};

use crate::config::{Config, DeviceChoice};
use crate::error::TrainError;

/// The engine a run trains on.
pub enum Engine {
    /// The CPU engine.
    Cpu,
    /// The GPU engine on an opened CUDA device (kernels loaded).
    Cuda {
        /// The device ordinal.
        ordinal: usize,
        /// The device.
        gpu: Box<Gpu>,
    },
}

/// Opens device `ordinal`, saying in the log how long it took: the first run of a build on a
/// machine compiles the kernels with NVRTC (seconds), later runs load them from the
/// kernel cache.
fn open_gpu(ordinal: usize) -> Result<Gpu, legend_cuda::GpuError> {
    if driver_present() {
        let cache = legend_cuda::nvrtc::cache_dir().map_or_else(
            || "none: neither XDG_CACHE_HOME nor HOME is set".into(),
            |d| d.display().to_string(),
        );
        tracing::info!(
            "opening cuda:{ordinal} (the first run of a build compiles the kernels with \
             NVRTC, seconds; kernel cache {cache})"
        );
    }
    let start = std::time::Instant::now();
    let gpu = Gpu::new(ordinal)?;
    tracing::info!(
        "cuda:{ordinal} ({}, {}) ready in {:.1} s",
        gpu.name(),
        gpu.arch(),
        start.elapsed().as_secs_f64()
    );
    Ok(gpu)
}

/// Where a [`DeviceChoice`] resolved: a GPU opened, or the CPU.
pub enum Resolved {
    /// CUDA device `ordinal`, opened (kernels loaded).
    Gpu {
        /// The device ordinal.
        ordinal: usize,
        /// The device.
        gpu: Box<Gpu>,
    },
    /// The CPU: chosen (`why` is `None`), or what `auto` fell back to, and why.
    Cpu {
        /// Why `auto` found no GPU: no driver, or the device's error.
        why: Option<String>,
    },
}

impl DeviceChoice {
    /// Resolves the choice, the one way every user of `training.device` does: `cpu`;
    /// `cuda:N`, which opens device N or fails with the reason (no driver, no NVRTC, no such
    /// device); `auto`, which opens device 0 when a driver is present and the device opens,
    /// and otherwise picks the CPU, saying why.
    ///
    /// # Errors
    ///
    /// `cuda:N` whose device does not open.
    pub fn resolve(self) -> Result<Resolved, legend_cuda::GpuError> {
        let gpu = |ordinal| {
            open_gpu(ordinal).map(|gpu| Resolved::Gpu {
                ordinal,
                gpu: Box::new(gpu),
            })
        };
        match self {
            DeviceChoice::Cpu => Ok(Resolved::Cpu { why: None }),
            DeviceChoice::Cuda(ordinal) => gpu(ordinal),
            DeviceChoice::Auto if !driver_present() => Ok(Resolved::Cpu {
                why: Some("no CUDA driver".into()),
            }),
            DeviceChoice::Auto => Ok(gpu(0).unwrap_or_else(|e| Resolved::Cpu {
                why: Some(e.to_string()),
            })),
        }
    }
}

impl Engine {
    /// Resolves `training.device` ([`DeviceChoice::resolve`]); `auto` that trains on the CPU
    /// says why in the log.
    pub fn open(config: &Config) -> Result<Engine, TrainError> {
        let resolved = config
            .device()
            .resolve()
            .map_err(|error| TrainError::Device {
                device: config.device().to_string(),
                error,
            })?;
        Ok(match resolved {
            Resolved::Gpu { ordinal, gpu } => Engine::Cuda { ordinal, gpu },
            Resolved::Cpu { why } => {
                if let Some(why) = why {
                    tracing::info!("training.device = \"auto\": training on the CPU ({why})");
                }
                Engine::Cpu
            }
        })
    }

    /// The engines of `training.gpus` workers: `cuda:0 .. cuda:K-1` (with NCCL present, one
    /// GPU model), or K CPU engines with `training.device = "cpu"` (or `auto` without a
    /// driver). One engine, as [`Engine::open`], when K = 1.
    pub fn open_all(config: &Config) -> Result<Vec<Engine>, TrainError> {
        let k = config.training.gpus as usize;
        let first = Engine::open(config)?;
        if k == 1 {
            return Ok(vec![first]);
        }
        let Engine::Cuda { gpu, .. } = &first else {
            return Ok((0..k).map(|_| Engine::Cpu).collect());
        };
        // Before opening more devices: a missing NCCL is said first, with how to get it.
        legend_cuda::nccl::nccl_version()?;
        let model = gpu.name().to_string();
        let mut engines = vec![first];
        for ordinal in 1..k {
            let gpu = open_gpu(ordinal).map_err(|error| TrainError::Device {
                device: format!("cuda:{ordinal} (training.gpus = {k})"),
                error,
            })?;
            if gpu.name() != model {
                return Err(TrainError::Config(crate::config::ConfigError(format!(
                    "training.gpus = {k}: cuda:{ordinal} is a {} and cuda:0 a {model}; the workers share one schedule and need one GPU model (choose them with CUDA_VISIBLE_DEVICES)",
                    gpu.name()
                ))));
            }
            engines.push(Engine::Cuda {
                ordinal,
                gpu: Box::new(gpu),
            });
        }
        Ok(engines)
    }

    /// The engine in words: `cpu`, or `cuda:N (name, sm_XY)`.
    pub fn describe(&self) -> String {
        match self {
            Engine::Cpu => "cpu".into(),
            Engine::Cuda { ordinal, gpu } => {
                format!("cuda:{ordinal} ({}, {})", gpu.name(), gpu.arch())
            }
        }
    }
}
