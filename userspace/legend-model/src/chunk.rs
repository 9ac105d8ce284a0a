//! Forward and backward of one chunk of positives that share their negatives.
//!
//! A chunk holds `b` positive triples `(src_i, rel_i, dst_i)` and two sets of negative rows:
//! `k_dst` rows that replace the destinations and `k_src` rows that replace the sources (each
//! may be 0 to disable that side). For each side the operator builds the queries `Q` (b×dim);
//! the positive scores are `compare(Q_i, true candidate_i)` and the negative scores are the
//! b×k matrix `compare(Q_i, N_j)`: `Q·Nᵀ` through sgemm for the dot comparator, distance
//! matrices for TransE. The loss (summed over positives and both sides) is differentiated back
//! through `dQ = G·N`, `dN = Gᵀ·Q` (sgemm again) and then through the operator.
//!
//! With reciprocal relations ([`Chunk::rel_src`]) the source side is scored as the destination
//! side of the inverse triple `(dst, r⁻¹, src)`: the same positives and negatives, only the
//! query of that side is built from the inverse relation's row with the destination operator.
//!
//! All rows are dense row-major `f32` slices gathered by the caller, who scatter-adds the
//! gradients ([`ChunkGrads`]) into the tables. [`ChunkWorkspace`] keeps every buffer between
//! calls, so the training loop does not allocate once the workspace has seen the largest chunk.

use crate::decoder::sign;
use crate::sgemm::sgemm;
use crate::{Comparator, Decoder, Loss, Side, vmath};

/// The model evaluated on chunks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChunkModel {
    /// The score function.
    pub decoder: Decoder,
    /// The loss of each positive against its side's negatives.
    pub loss: Loss,
    /// The embedding dimension (row length) of node rows; relation rows are
    /// [`ChunkModel::relation_width`] floats.
    pub dim: usize,
}

impl ChunkModel {
    /// Floats of one relation row ([`Decoder::relation_width`] of the dimension).
    pub fn relation_width(&self) -> usize {
        self.decoder.relation_width(self.dim)
    }
}

/// The gathered rows of one chunk. `b` positives, `k_src`/`k_dst` negatives, `dim` floats a node
/// row and `rw` ([`ChunkModel::relation_width`]) a relation row.
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    /// Source rows, b×dim.
    pub src: &'a [f32],
    /// Relation rows, b×rw; empty for [`Decoder::Dot`].
    pub rel: &'a [f32],
    /// Destination rows, b×dim.
    pub dst: &'a [f32],
    /// Negatives replacing the source, k_src×dim.
    pub neg_src: &'a [f32],
    /// Negatives replacing the destination, k_dst×dim.
    pub neg_dst: &'a [f32],
    /// b×k_src, row-major: `true` excludes negative `j` from positive `i`'s source-side loss
    /// (the caller's filtering: `training.negatives.filtered` marks a negative that makes a
    /// known train triple with the positive's relation and destination).
    pub exclude_src: Option<&'a [bool]>,
    /// b×k_dst, row-major: as `exclude_src` for the destination side.
    pub exclude_dst: Option<&'a [bool]>,
    /// Reciprocal relations: the inverse relations' rows, b×rw. The source side is then
    /// scored as `(dst, r⁻¹, ?)` through the destination-side operator instead of through the
    /// source-side operator of `rel`. `None`: one relation row serves both sides.
    pub rel_src: Option<&'a [f32]>,
}

/// Gradients of the chunk loss with respect to every gathered row, same shapes as [`Chunk`].
///
/// A row gathered several times gets one gradient per occurrence; the caller scatter-adds.
#[derive(Clone, Debug, Default)]
pub struct ChunkGrads {
    /// ∂L/∂src, b×dim.
    pub src: Vec<f32>,
    /// ∂L/∂rel, b×rw (empty for [`Decoder::Dot`]).
    pub rel: Vec<f32>,
    /// ∂L/∂rel_src, b×rw (empty without reciprocal relations).
    pub rel_src: Vec<f32>,
    /// ∂L/∂dst, b×dim.
    pub dst: Vec<f32>,
    /// ∂L/∂neg_src, k_src×dim.
    pub neg_src: Vec<f32>,
    /// ∂L/∂neg_dst, k_dst×dim.
    pub neg_dst: Vec<f32>,
}

/// Reusable buffers for [`ChunkWorkspace::forward_backward`]; one per worker thread.
#[derive(Clone, Debug, Default)]
pub struct ChunkWorkspace {
    grads: ChunkGrads,
    scratch: Scratch,
}

#[derive(Clone, Debug, Default)]
struct Scratch {
    /// Queries of the current side, b×dim.
    query: Vec<f32>,
    /// ∂L/∂queries, b×dim.
    grad_query: Vec<f32>,
    /// Negative scores, then (in place) ∂L/∂scores, b×k.
    scores: Vec<f32>,
    /// L2 distances, b×k.
    dist: Vec<f32>,
    /// Squared norms of the queries (b) and of the negatives (k).
    query_norm2: Vec<f32>,
    neg_norm2: Vec<f32>,
    /// Row and column sums of the L2 weight matrix.
    row_sum: Vec<f32>,
    col_sum: Vec<f32>,
    /// L2 pairs `(i, j, ∂L/∂score)` too close for the expanded distance formula, whose
    /// gradients are taken pair by pair.
    near: Vec<(usize, usize, f32)>,
}

/// Below this fraction of `|q|² + |n|²`, the expanded squared distance `|q|² + |n|² − 2 q·n`
/// has lost too many digits to cancellation (its error is a few ulp of `|q|² + |n|²`); such
/// pairs are recomputed as `Σ (q − n)²`. Random negatives sit near 1, so few pairs are affected.
const NEAR_FRACTION: f32 = 0.25;

impl ChunkWorkspace {
    /// An empty workspace; buffers grow on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// The gradients of the last [`ChunkWorkspace::forward_backward`] call.
    pub fn grads(&self) -> &ChunkGrads {
        &self.grads
    }

    /// Exchanges the last call's gradients with `out`: the caller keeps them without a copy,
    /// and the workspace writes its next call into `out`'s old buffers (no allocation once
    /// both have seen the largest chunk).
    pub fn swap_grads(&mut self, out: &mut ChunkGrads) {
        std::mem::swap(&mut self.grads, out);
    }

    /// Computes the summed loss of the chunk (both sides, all positives) and its gradients,
    /// readable through [`ChunkWorkspace::grads`] until the next call.
    ///
    /// # Panics
    /// If a slice's length does not fit the shapes described on [`Chunk`] (`b` is taken from
    /// `src`, `k_src`/`k_dst` from the negatives), or `model.dim` does not suit the decoder.
    pub fn forward_backward(&mut self, model: &ChunkModel, chunk: &Chunk<'_>) -> f64 {
        let dim = model.dim;
        model.decoder.check_dim(dim).expect("invalid dimension");
        let whole = |len: usize, what: &str| {
            assert!(
                len.is_multiple_of(dim),
                "{what} has {len} floats, not a multiple of dim {dim}"
            );
            len / dim
        };
        let b = whole(chunk.src.len(), "src");
        let k_src = whole(chunk.neg_src.len(), "neg_src");
        let k_dst = whole(chunk.neg_dst.len(), "neg_dst");
        assert_eq!(chunk.dst.len(), b * dim, "dst and src differ in rows");
        let rel_len = b * model.relation_width();
        assert_eq!(
            chunk.rel.len(),
            rel_len,
            "rel must be b × the relation width (empty for dot)"
        );
        if let Some(m) = chunk.exclude_src {
            assert_eq!(m.len(), b * k_src, "exclude_src must be b×k_src");
        }
        if let Some(m) = chunk.exclude_dst {
            assert_eq!(m.len(), b * k_dst, "exclude_dst must be b×k_dst");
        }
        if let Some(r) = chunk.rel_src {
            assert!(
                model.decoder.uses_relations() && r.len() == rel_len,
                "rel_src must be b × the relation width, for a decoder with relations"
            );
        }

        let g = &mut self.grads;
        reset(&mut g.src, b * dim);
        reset(&mut g.rel, rel_len);
        reset(&mut g.rel_src, chunk.rel_src.map_or(0, <[f32]>::len));
        reset(&mut g.dst, b * dim);
        // The negative gradients are written (not accumulated) by their side's pass.
        g.neg_src.resize(k_src * dim, 0.0);
        g.neg_dst.resize(k_dst * dim, 0.0);

        let dst_side = SideRows {
            side: Side::Dst,
            anchor: chunk.src,
            rel: chunk.rel,
            cand: chunk.dst,
            negs: chunk.neg_dst,
            exclude: chunk.exclude_dst,
        };
        let loss_dst = self.scratch.side_pass(
            model,
            &dst_side,
            SideGrads {
                anchor: &mut g.src,
                rel: &mut g.rel,
                cand: &mut g.dst,
                negs: &mut g.neg_dst,
            },
        );
        let (side, rel, grad_rel) = match chunk.rel_src {
            Some(inverse) => (Side::Dst, inverse, &mut g.rel_src),
            None => (Side::Src, chunk.rel, &mut g.rel),
        };
        let src_side = SideRows {
            side,
            anchor: chunk.dst,
            rel,
            cand: chunk.src,
            negs: chunk.neg_src,
            exclude: chunk.exclude_src,
        };
        let loss_src = self.scratch.side_pass(
            model,
            &src_side,
            SideGrads {
                anchor: &mut g.dst,
                rel: grad_rel,
                cand: &mut g.src,
                negs: &mut g.neg_src,
            },
        );
        loss_dst + loss_src
    }
}

/// The rows of one corrupted side: queries come from `anchor` and `rel`, `cand` holds the true
/// candidates and `negs` the shared negatives.
struct SideRows<'a> {
    side: Side,
    anchor: &'a [f32],
    rel: &'a [f32],
    cand: &'a [f32],
    negs: &'a [f32],
    exclude: Option<&'a [bool]>,
}

struct SideGrads<'a> {
    anchor: &'a mut [f32],
    rel: &'a mut [f32],
    cand: &'a mut [f32],
    negs: &'a mut [f32],
}

impl Scratch {
    fn side_pass(&mut self, model: &ChunkModel, rows: &SideRows<'_>, grads: SideGrads<'_>) -> f64 {
        let (dim, rw) = (model.dim, model.relation_width());
        let b = rows.anchor.len() / dim;
        let k = rows.negs.len() / dim;
        let cmp = model.decoder.comparator();
        let rel_row = |i: usize| &rows.rel[i * rw..(i + 1) * rw];

        reset(&mut self.query, b * dim);
        for i in 0..b {
            let q = &mut self.query[i * dim..(i + 1) * dim];
            model.decoder.query(
                rows.side,
                &rows.anchor[i * dim..(i + 1) * dim],
                rel_row(i),
                q,
            );
        }

        self.scores.resize(b * k, 0.0);
        match cmp {
            Comparator::Dot => sgemm(
                b,
                dim,
                k,
                &self.query,
                false,
                rows.negs,
                true,
                0.0,
                &mut self.scores,
            ),
            Comparator::NegL1 => l1_scores(&self.query, rows.negs, dim, &mut self.scores),
            Comparator::NegL2 => self.l2_scores(rows.negs, dim),
            Comparator::NegModulus => modulus_scores(&self.query, rows.negs, dim, &mut self.scores),
        }

        // Loss per positive; the score matrix turns into ∂L/∂scores in place.
        reset(&mut self.grad_query, b * dim);
        let mut total = 0.0f64;
        for i in 0..b {
            let q = &self.query[i * dim..(i + 1) * dim];
            let cand = &rows.cand[i * dim..(i + 1) * dim];
            let pos = cmp.compare(q, cand);
            let excluded = rows.exclude.map(|m| &m[i * k..(i + 1) * k]);
            let r = model
                .loss
                .row_in_place(pos, &mut self.scores[i * k..(i + 1) * k], excluded);
            total += r.loss as f64;
            cmp.backward(
                q,
                cand,
                r.grad_pos,
                &mut self.grad_query[i * dim..(i + 1) * dim],
                &mut grads.cand[i * dim..(i + 1) * dim],
            );
        }

        match cmp {
            Comparator::Dot => {
                // dQ += G·N, dN = Gᵀ·Q.
                sgemm(
                    b,
                    k,
                    dim,
                    &self.scores,
                    false,
                    rows.negs,
                    false,
                    1.0,
                    &mut self.grad_query,
                );
                sgemm(
                    k,
                    b,
                    dim,
                    &self.scores,
                    true,
                    &self.query,
                    false,
                    0.0,
                    grads.negs,
                );
            }
            Comparator::NegL1 => l1_backward(
                &self.query,
                rows.negs,
                &self.scores,
                dim,
                &mut self.grad_query,
                grads.negs,
            ),
            Comparator::NegL2 => self.l2_backward(rows.negs, dim, grads.negs),
            Comparator::NegModulus => modulus_backward(
                &self.query,
                rows.negs,
                &self.scores,
                dim,
                &mut self.grad_query,
                grads.negs,
            ),
        }

        for i in 0..b {
            let span = i * dim..(i + 1) * dim;
            model.decoder.query_backward(
                rows.side,
                &rows.anchor[span.clone()],
                rel_row(i),
                &self.grad_query[span.clone()],
                &mut grads.anchor[span],
                &mut grads.rel[i * rw..(i + 1) * rw],
            );
        }
        total
    }

    /// Negative L2 distances through `|q|² + |n|² − 2 q·n` (one sgemm), recomputing the pairs
    /// where that expansion cancels.
    fn l2_scores(&mut self, negs: &[f32], dim: usize) {
        let b = self.query.len() / dim;
        let k = negs.len() / dim;
        sgemm(
            b,
            dim,
            k,
            &self.query,
            false,
            negs,
            true,
            0.0,
            &mut self.scores,
        );
        squared_norms(&self.query, dim, &mut self.query_norm2);
        squared_norms(negs, dim, &mut self.neg_norm2);
        self.dist.resize(b * k, 0.0);
        self.near.clear();
        for i in 0..b {
            let qn = self.query_norm2[i];
            for j in 0..k {
                let scale = qn + self.neg_norm2[j];
                let mut d2 = scale - 2.0 * self.scores[i * k + j];
                if d2 < NEAR_FRACTION * scale {
                    let q = &self.query[i * dim..(i + 1) * dim];
                    let n = &negs[j * dim..(j + 1) * dim];
                    d2 = q.iter().zip(n).map(|(a, c)| (a - c) * (a - c)).sum();
                    self.near.push((i, j, 0.0));
                }
                let d = d2.max(0.0).sqrt();
                self.dist[i * k + j] = d;
                self.scores[i * k + j] = -d;
            }
        }
    }

    /// With `W = G / dist`: `dQ += W·N − diag(rowsum W)·Q`, `dN = Wᵀ·Q − diag(colsum W)·N`;
    /// the near pairs go through the exact per-pair gradient instead.
    fn l2_backward(&mut self, negs: &[f32], dim: usize, grad_negs: &mut [f32]) {
        let b = self.query.len() / dim;
        let k = negs.len() / dim;
        // Take the near pairs' gradients out of W before it is formed.
        for (i, j, g) in self.near.iter_mut() {
            let idx = *i * k + *j;
            *g = self.scores[idx];
            self.scores[idx] = 0.0;
        }
        reset(&mut self.row_sum, b);
        reset(&mut self.col_sum, k);
        for i in 0..b {
            for j in 0..k {
                let idx = i * k + j;
                let d = self.dist[idx];
                let w = if d > 0.0 { self.scores[idx] / d } else { 0.0 };
                self.scores[idx] = w;
                self.row_sum[i] += w;
                self.col_sum[j] += w;
            }
        }
        sgemm(
            b,
            k,
            dim,
            &self.scores,
            false,
            negs,
            false,
            1.0,
            &mut self.grad_query,
        );
        sgemm(
            k,
            b,
            dim,
            &self.scores,
            true,
            &self.query,
            false,
            0.0,
            grad_negs,
        );
        for i in 0..b {
            let s = self.row_sum[i];
            for t in 0..dim {
                self.grad_query[i * dim + t] -= s * self.query[i * dim + t];
            }
        }
        for j in 0..k {
            let s = self.col_sum[j];
            for t in 0..dim {
                grad_negs[j * dim + t] -= s * negs[j * dim + t];
            }
        }
        for &(i, j, g) in &self.near {
            Comparator::NegL2.backward(
                &self.query[i * dim..(i + 1) * dim],
                &negs[j * dim..(j + 1) * dim],
                g,
                &mut self.grad_query[i * dim..(i + 1) * dim],
                &mut grad_negs[j * dim..(j + 1) * dim],
            );
        }
    }
}

/// Negative L1 distances between every query and every negative, straight loops (no product
/// form exists); the inner loop over `dim` vectorises.
fn l1_scores(query: &[f32], negs: &[f32], dim: usize, scores: &mut [f32]) {
    let k = negs.len() / dim;
    if k == 0 {
        return;
    }
    for (q, srow) in query.chunks_exact(dim).zip(scores.chunks_exact_mut(k)) {
        for (n, s) in negs.chunks_exact(dim).zip(srow) {
            *s = -vmath::l1_distance(q, n);
        }
    }
}

/// `dQ_i −= Σ_j G_ij sign(q_i − n_j)`, `dN_j = Σ_i G_ij sign(q_i − n_j)`.
fn l1_backward(
    query: &[f32],
    negs: &[f32],
    grad_scores: &[f32],
    dim: usize,
    grad_query: &mut [f32],
    grad_negs: &mut [f32],
) {
    let k = negs.len() / dim;
    grad_negs.fill(0.0);
    for (i, q) in query.chunks_exact(dim).enumerate() {
        let gq = &mut grad_query[i * dim..(i + 1) * dim];
        for (j, n) in negs.chunks_exact(dim).enumerate() {
            let g = grad_scores[i * k + j];
            // Softmax makes G dense, but ranking and masking leave many exact zeros.
            if g == 0.0 {
                continue;
            }
            let gn = &mut grad_negs[j * dim..(j + 1) * dim];
            for t in 0..dim {
                let s = g * sign(q[t] - n[t]);
                gq[t] -= s;
                gn[t] += s;
            }
        }
    }
}

/// RotatE's negative distances between every query and every negative (no product form),
/// pair by pair, the inner loop over the complex elements in vector lanes.
fn modulus_scores(query: &[f32], negs: &[f32], dim: usize, scores: &mut [f32]) {
    let k = negs.len() / dim;
    if k == 0 {
        return;
    }
    vmath::wide(|| {
        for (q, srow) in query.chunks_exact(dim).zip(scores.chunks_exact_mut(k)) {
            let q = q.split_at(dim / 2);
            for (n, s) in negs.chunks_exact(dim).zip(srow) {
                *s = -vmath::modulus_distance(q, n.split_at(dim / 2));
            }
        }
    })
}

/// The gradients of [`modulus_scores`] given ∂L/∂scores, pair by pair.
fn modulus_backward(
    query: &[f32],
    negs: &[f32],
    grad_scores: &[f32],
    dim: usize,
    grad_query: &mut [f32],
    grad_negs: &mut [f32],
) {
    let (k, h) = (negs.len() / dim, dim / 2);
    grad_negs.fill(0.0);
    vmath::wide(|| {
        for (i, q) in query.chunks_exact(dim).enumerate() {
            let gq = &mut grad_query[i * dim..(i + 1) * dim];
            for (j, n) in negs.chunks_exact(dim).enumerate() {
                let g = grad_scores[i * k + j];
                // Softmax makes G dense, but masking leaves exact zeros.
                if g == 0.0 {
                    continue;
                }
                let (gq_re, gq_im) = gq.split_at_mut(h);
                let (gn_re, gn_im) = grad_negs[j * dim..(j + 1) * dim].split_at_mut(h);
                vmath::modulus_backward(
                    g,
                    q.split_at(h),
                    n.split_at(h),
                    (gq_re, gq_im),
                    (gn_re, gn_im),
                );
            }
        }
    })
}

fn squared_norms(rows: &[f32], dim: usize, out: &mut Vec<f32>) {
    out.clear();
    out.extend(rows.chunks_exact(dim).map(vmath::squared_norm));
}

/// Sets `v` to `len` zeros, keeping its allocation.
fn reset(v: &mut Vec<f32>, len: usize) {
    v.clear();
    v.resize(len, 0.0);
}
