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

/// One step's relation gradients on the CPU engine, summed per row, held back from the
/// relation rows while several workers add theirs up (`crate::workers`): dense, since relation
/// tables are small and every worker must end with the same sum.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RelationGradients {
    /// Floats of a relation row.
    pub width: usize,
    /// `rows × width` summed gradients (zero where no positive used the row).
    pub grads: Vec<f32>,
    /// How often each row occurs among the step's positives (what the regulariser weighs).
    pub positives: Vec<u32>,
}

impl RelationGradients {
    /// Zero gradients for `rows` rows of `width` floats.
    pub fn zeros(rows: usize, width: usize) -> RelationGradients {
        RelationGradients {
            width,
            grads: vec![0.0; rows * width],
            positives: vec![0; rows],
        }
    }

    /// Sets every gradient and count back to zero.
    pub fn clear(&mut self) {
        self.grads.fill(0.0);
        self.positives.fill(0);
    }

    /// Adds `other`'s gradients and counts (workers' sums are taken in worker order, so every
    /// worker computes the same floats).
    pub fn add(&mut self, other: &RelationGradients) {
        assert_eq!(
            self.grads.len(),
            other.grads.len(),
            "relation tables differ"
        );
        for (a, b) in self.grads.iter_mut().zip(&other.grads) {
            *a += b;
        }
        for (a, b) in self.positives.iter_mut().zip(&other.positives) {
            *a += b;
        }
    }

    /// One AdaGrad step of every row a positive used, with its summed gradient plus the
    /// regulariser's for its occurrences; the gradients are cleared for the next step.
    pub fn apply(
        &mut self,
        rels: &mut Relations,
        optimizer: legend_model::AdaGrad,
        regularizer: &legend_model::Regularizer,
    ) {
        let w = self.width.max(1);
        let rows = rels
            .emb
            .chunks_exact_mut(w)
            .zip(rels.state.chunks_exact_mut(w))
            .zip(self.grads.chunks_exact_mut(w).zip(&self.positives));
        for ((emb, state), (grad, &count)) in rows {
            if count == 0 {
                continue;
            }
            regularizer.add_gradient(emb, count, grad);
            optimizer.apply_row(emb, state, grad);
        }
        self.clear();
    }
}
