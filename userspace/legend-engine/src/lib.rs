//! Legend's training engine: configuration, the partition buffer, negative sampling and the
//! trainer that walks the planner's bucket order, stepping on the CPU or on a CUDA GPU.

mod at_rest;
pub mod buffer;
mod compute;
pub mod config;
pub mod controllers;
pub mod device;
pub mod evaluation;
pub mod export;
pub mod file_store;
pub mod memory;
pub mod run;
pub mod sampler;
pub mod schedule;
pub mod session;
pub mod trainer;

pub use buffer::{IoStats, MemoryStore, Partition, PartitionBuffer, PartitionStore, StoreError};
pub use config::{Config, ConfigError, DeviceChoice};
pub use device::Device;
pub use trainer::{
    EpochCut, EpochEnd, EpochReport, IoDirection, IoKernelSpan, Relations, SwapReport, TrainError,
    Trainer,
};
