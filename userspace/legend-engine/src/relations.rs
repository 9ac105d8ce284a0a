//! The relation parameters, always resident.

use legend_model::{Decoder, Init, Table};

/// Relation parameters and their AdaGrad state, always resident.
#[derive(Clone, Debug, PartialEq)]
pub struct Relations {
    /// `relations × width` embeddings, `width` the decoder's
    /// [`Decoder::relation_width`] (empty for Dot).
    pub emb: Vec<f32>,
    /// AdaGrad state of the same shape.
    pub state: Vec<f32>,
}

impl Relations {
    /// Initial relation parameters: `count` rows for node rows of `dim`.
    pub fn init(decoder: Decoder, count: usize, dim: usize, init: &Init) -> Relations {
        if !decoder.uses_relations() {
            return Relations {
                emb: Vec::new(),
                state: Vec::new(),
            };
        }
        let width = decoder.relation_width(dim);
        let mut emb = vec![0.0; count * width];
        for (r, row) in emb.chunks_exact_mut(width).enumerate() {
            init.relation_row(decoder, Table::Relation, r as u64, row);
        }
        Relations {
            state: vec![0.0; emb.len()],
            emb,
        }
    }
}
