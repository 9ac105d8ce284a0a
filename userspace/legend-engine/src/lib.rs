//! Legend's training engine: configuration, the swap path between the engine's slots and the
//! partition stores, negative sampling and the trainer that walks the planner's bucket order,
//! stepping on the CPU or on a CUDA GPU.

mod compute;
pub mod config;
pub mod engine;
pub mod error;
pub mod error_chain;
pub mod evaluation;
pub mod export;
pub mod footprint;
pub mod incremental;
pub mod progress;
pub mod relations;
pub mod restore;
pub mod rows;
pub mod run;
pub mod sampler;
pub mod schedule;
pub mod session;
pub mod store;
pub mod swap;
pub mod trainer;
mod training;
pub mod which_tables;
pub mod workers;

pub use config::{Config, ConfigError, DeviceChoice};
pub use engine::Engine;
pub use error::TrainError;
pub use progress::EpochCut;
pub use relations::Relations;
pub use rows::{Partition, RowShape};
pub use store::{MemoryStore, PartitionHome, PartitionStore, PartitionStoreError};
pub use swap::{IoDirection, IoKernelSpan, IoStats};
pub use trainer::{EpochEnd, EpochReport, SwapReport, Trainer};
