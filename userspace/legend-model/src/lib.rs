//! Embedding models of Legend: score functions, their gradients, losses and the optimizer.
//!
//! Every model is written as an *operator* that turns an anchor row and a relation row into a
//! query vector, followed by a *comparator* between that query and a candidate row (the
//! PyTorch-BigGraph decomposition). Scoring one positive against many negatives is then a
//! matrix product (dot comparator) or a distance matrix (TransE), which is how both the CPU
//! engine and the GPU kernels batch the work.

mod adagrad;
mod chunk;
mod decoder;
mod dtype;
mod init;
mod loss;
pub mod partition;
mod permutation;
mod regularizer;
pub mod rng;
mod sgemm;
mod unknown;
mod vmath;

pub use adagrad::{AdaGrad, StateLayout};
pub use chunk::{Chunk, ChunkGrads, ChunkModel, ChunkWorkspace};
pub use decoder::{Comparator, Decoder, DimError, Side};
pub use dtype::{Dtype, OutOfRange, StepRounding};
pub use init::{DEFAULT_NODE_INIT, Distribution, Init, RelationInit, Table, fill_row};
pub use loss::{DEFAULT_MARGIN, Loss, RowLoss};
pub use permutation::{PERMUTATION_ROUNDS, Permutation};
pub use regularizer::{Penalty, Regularizer};
pub use rng::BatchKey;
pub use sgemm::sgemm;
pub use unknown::UnknownName;
