//! Node rows as the engine holds them: a row's shape (embedding, AdaGrad state, format at rest)
//! and one partition's rows in host memory.

use legend_model::{Dtype, StateLayout};

/// One row: its embedding and its AdaGrad state, and the embedding's format at rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowShape {
    /// Embedding floats, d.
    pub dim: usize,
    /// AdaGrad accumulators: d (element-wise) or 1 (row-wise).
    pub state: usize,
    /// The embedding's number format at rest (`storage.dtype`); in memory rows are f32 whose
    /// values the format represents exactly.
    pub dtype: Dtype,
}

impl RowShape {
    /// f32 rows of dimension `dim` with AdaGrad state of `layout`.
    pub fn new(dim: usize, layout: StateLayout) -> RowShape {
        RowShape {
            dim,
            state: layout.width(dim),
            dtype: Dtype::F32,
        }
    }

    /// The same rows with embeddings of `dtype` at rest.
    pub fn with_dtype(self, dtype: Dtype) -> RowShape {
        RowShape { dtype, ..self }
    }

    /// Bytes of one row at rest (embedding in its format, state f32).
    pub fn bytes(self) -> u64 {
        (self.dim * self.dtype.bytes() + self.state * 4) as u64
    }

    /// Bytes of one row in memory (f32 embedding and state): host rows, the memory store and
    /// the GPU table.
    pub fn memory_bytes(self) -> u64 {
        (self.dim + self.state) as u64 * 4
    }

    /// Bytes of `part`'s rows at rest (what moving it to or from a store moves).
    pub(crate) fn bytes_of(self, part: &Partition) -> u64 {
        (part.emb.len() * self.dtype.bytes() + part.state.len() * 4) as u64
    }
}

/// Rows of one partition in host memory: embeddings (`rows × dim`) and AdaGrad state
/// (`rows × state`).
#[derive(Clone, Debug, PartialEq)]
pub struct Partition {
    /// Partition id.
    pub id: u32,
    /// Embeddings, row-major.
    pub emb: Vec<f32>,
    /// AdaGrad state, row-major ([`RowShape::state`] a row).
    pub state: Vec<f32>,
}

impl Partition {
    /// Partition `id` with no memory yet.
    pub(crate) fn empty(id: u32) -> Partition {
        Partition {
            id,
            emb: Vec::new(),
            state: Vec::new(),
        }
    }
}

/// One row's embedding and AdaGrad state, writable.
pub type RowMut<'a> = (&'a mut [f32], &'a mut [f32]);

/// Every parameter of a checkpoint, in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Tables {
    /// Entity embeddings.
    pub entities: Vec<f32>,
    /// Entity AdaGrad state.
    pub entities_state: Vec<f32>,
    /// Relation embeddings.
    pub relations: Vec<f32>,
    /// Relation AdaGrad state.
    pub relations_state: Vec<f32>,
}
