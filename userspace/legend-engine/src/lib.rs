//! Legend's training engine: configuration, the partition buffer, negative sampling and the
//! CPU engine that walks the planner's bucket order.

pub mod buffer;
pub mod config;
pub mod file_store;
pub mod run;
pub mod sampler;
pub mod trainer;

pub use buffer::{IoStats, MemoryStore, Partition, PartitionBuffer, PartitionStore, StoreError};
pub use config::{Config, ConfigError};
pub use trainer::{EpochReport, Relations, SwapReport, TrainError, Trainer};
