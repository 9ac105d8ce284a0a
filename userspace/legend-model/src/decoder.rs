//! Score functions f(s, r, d) as query operator + comparator.

use std::fmt;
use std::str::FromStr;

use crate::vmath;

/// Which end of a triple is being scored against candidates (the corrupted side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// Candidates replace the destination: the query is built from (source, relation).
    Dst,
    /// Candidates replace the source: the query is built from (relation, destination).
    Src,
}

/// How a query vector is compared with a candidate row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Comparator {
    /// Inner product.
    Dot,
    /// Negative L1 distance.
    NegL1,
    /// Negative L2 distance.
    NegL2,
    /// Negative sum of the moduli of the complex differences (RotatE's distance): rows are
    /// complex, real parts in the first half and imaginary parts in the second.
    NegModulus,
}

impl Comparator {
    /// The score of `candidate` against `query` (higher is more plausible).
    pub fn compare(self, query: &[f32], candidate: &[f32]) -> f32 {
        debug_assert_eq!(query.len(), candidate.len());
        let pairs = query.iter().zip(candidate);
        match self {
            Comparator::Dot => pairs.map(|(q, c)| q * c).sum(),
            Comparator::NegL1 => -pairs.map(|(q, c)| (q - c).abs()).sum::<f32>(),
            Comparator::NegL2 => -pairs.map(|(q, c)| (q - c) * (q - c)).sum::<f32>().sqrt(),
            Comparator::NegModulus => {
                let h = query.len() / 2;
                -vmath::modulus_distance(query.split_at(h), candidate.split_at(h))
            }
        }
    }

    /// Accumulates (`+=`) the gradient of `grad_score · compare(query, candidate)` into
    /// `grad_query` and `grad_candidate`.
    ///
    /// The non-differentiable points take the zero subgradient: `|x|` at `x = 0` for
    /// [`Comparator::NegL1`], and the whole distance at `query == candidate` for
    /// [`Comparator::NegL2`].
    pub fn backward(
        self,
        query: &[f32],
        candidate: &[f32],
        grad_score: f32,
        grad_query: &mut [f32],
        grad_candidate: &mut [f32],
    ) {
        let dim = query.len();
        debug_assert!(candidate.len() == dim && grad_query.len() == dim);
        debug_assert_eq!(grad_candidate.len(), dim);
        match self {
            Comparator::Dot => {
                for t in 0..dim {
                    grad_query[t] += grad_score * candidate[t];
                    grad_candidate[t] += grad_score * query[t];
                }
            }
            Comparator::NegL1 => {
                for t in 0..dim {
                    let g = grad_score * sign(query[t] - candidate[t]);
                    grad_query[t] -= g;
                    grad_candidate[t] += g;
                }
            }
            Comparator::NegModulus => {
                let h = dim / 2;
                let (gq_re, gq_im) = grad_query.split_at_mut(h);
                let (gc_re, gc_im) = grad_candidate.split_at_mut(h);
                vmath::modulus_backward(
                    grad_score,
                    query.split_at(h),
                    candidate.split_at(h),
                    (gq_re, gq_im),
                    (gc_re, gc_im),
                );
            }
            Comparator::NegL2 => {
                let dist = -Comparator::NegL2.compare(query, candidate);
                if dist > 0.0 {
                    let w = grad_score / dist;
                    for t in 0..dim {
                        let g = w * (query[t] - candidate[t]);
                        grad_query[t] -= g;
                        grad_candidate[t] += g;
                    }
                }
            }
        }
    }
}

/// The sign of `x`, with `sign(0) = 0` (the subgradient of `|x|` that the L1 gradients use).
#[inline]
pub(crate) fn sign(x: f32) -> f32 {
    // Two selects instead of a branch chain, so that loops over it vectorise.
    let pos = if x > 0.0 { 1.0 } else { 0.0 };
    let neg = if x < 0.0 { 1.0 } else { 0.0 };
    pos - neg
}

/// A knowledge-graph embedding model.
///
/// Node rows are `dim` floats. ComplEx stores the real parts in the first half of a row and the
/// imaginary parts in the second half, so one thread (or SIMD lane) can read an element's real
/// and imaginary part at the same offset of two half-rows. Relation rows are
/// [`Decoder::relation_width`] floats: `dim`, except RESCAL's `dim × dim` matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Decoder {
    /// `<s, d>`: graphs without relation types; relation rows are ignored.
    Dot,
    /// `<s, r, d>` (diagonal bilinear).
    DistMult,
    /// `Re(<s, r, conj(d)>)` with complex rows of `dim / 2` elements.
    ComplEx,
    /// `-||s + r - d||_1`.
    TransEL1,
    /// `-||s + r - d||_2`.
    TransEL2,
    /// `-Σ_k |s_k e^(iθ_k) − d_k|` (Sun et al., ICLR 2019): complex rows of `dim / 2` elements
    /// (real parts first), and a relation rotates by the phases `θ` in the first half of its
    /// row (the second half is unused and keeps its initial values).
    RotatE,
    /// `sᵀ R d` with a full `dim × dim` matrix `R` a relation (Nickel et al., ICML 2011;
    /// PyTorch-BigGraph's `linear` operator), stored row-major: `R[i·dim + j]` multiplies
    /// `s_i d_j`.
    Rescal,
}

impl Decoder {
    /// All decoders, for tests and help texts.
    pub const ALL: [Decoder; 7] = [
        Decoder::Dot,
        Decoder::DistMult,
        Decoder::ComplEx,
        Decoder::TransEL1,
        Decoder::TransEL2,
        Decoder::RotatE,
        Decoder::Rescal,
    ];

    /// The comparator that follows this model's query operator.
    pub fn comparator(self) -> Comparator {
        match self {
            Decoder::Dot | Decoder::DistMult | Decoder::ComplEx | Decoder::Rescal => {
                Comparator::Dot
            }
            Decoder::TransEL1 => Comparator::NegL1,
            Decoder::TransEL2 => Comparator::NegL2,
            Decoder::RotatE => Comparator::NegModulus,
        }
    }

    /// Whether the model has relation parameters.
    pub fn uses_relations(self) -> bool {
        self != Decoder::Dot
    }

    /// Floats of one relation row for node rows of `dim`: `dim²` for RESCAL's matrices, 0 for
    /// Dot (no relation parameters), `dim` otherwise. Every relation table (the trainer's,
    /// the store's auxiliary region, checkpoints, the GPU's) is rows of this width.
    pub fn relation_width(self, dim: usize) -> usize {
        match self {
            Decoder::Dot => 0,
            Decoder::Rescal => dim * dim,
            _ => dim,
        }
    }

    /// Whether rows are complex vectors (real parts in the first half).
    pub fn is_complex(self) -> bool {
        matches!(self, Decoder::ComplEx | Decoder::RotatE)
    }

    /// Checks that `dim` suits the model (ComplEx needs an even dimension).
    pub fn check_dim(self, dim: usize) -> Result<(), DimError> {
        if dim == 0 {
            return Err(DimError::Zero);
        }
        if self.is_complex() && !dim.is_multiple_of(2) {
            return Err(DimError::Odd { decoder: self, dim });
        }
        Ok(())
    }

    /// Writes into `out` the query for scoring candidates on `side`.
    ///
    /// `anchor` is the source row for [`Side::Dst`] and the destination row for [`Side::Src`];
    /// `rel` is the relation row of [`Decoder::relation_width`] floats (empty for
    /// [`Decoder::Dot`]). The score of a candidate `c` is then
    /// `self.comparator().compare(out, c)`.
    pub fn query(self, side: Side, anchor: &[f32], rel: &[f32], out: &mut [f32]) {
        let dim = anchor.len();
        debug_assert_eq!(out.len(), dim);
        debug_assert_eq!(rel.len(), self.relation_width(dim));
        match self {
            Decoder::Dot => out.copy_from_slice(anchor),
            Decoder::DistMult => {
                for ((o, a), r) in out.iter_mut().zip(anchor).zip(rel) {
                    *o = a * r;
                }
            }
            Decoder::ComplEx => {
                let h = dim / 2;
                let (a_re, a_im) = anchor.split_at(h);
                let (r_re, r_im) = rel.split_at(h);
                let (o_re, o_im) = out.split_at_mut(h);
                for k in 0..h {
                    match side {
                        // s * r, compared with d through Re(q * conj(d)) = q_re d_re + q_im d_im.
                        Side::Dst => {
                            o_re[k] = a_re[k] * r_re[k] - a_im[k] * r_im[k];
                            o_im[k] = a_re[k] * r_im[k] + a_im[k] * r_re[k];
                        }
                        // Re(s * r * conj(d)) = <s, conj(r) * d> as real vectors.
                        Side::Src => {
                            o_re[k] = r_re[k] * a_re[k] + r_im[k] * a_im[k];
                            o_im[k] = r_re[k] * a_im[k] - r_im[k] * a_re[k];
                        }
                    }
                }
            }
            Decoder::TransEL1 | Decoder::TransEL2 => {
                for ((o, a), r) in out.iter_mut().zip(anchor).zip(rel) {
                    *o = match side {
                        Side::Dst => a + r,
                        Side::Src => a - r,
                    };
                }
            }
            Decoder::RotatE => {
                let h = dim / 2;
                let (a_re, a_im) = anchor.split_at(h);
                let (o_re, o_im) = out.split_at_mut(h);
                for k in 0..h {
                    let (sin, cos) = rel[k].sin_cos();
                    // |s e^(iθ) − d| = |s − d e^(−iθ)|: the source side rotates back.
                    let sin = match side {
                        Side::Dst => sin,
                        Side::Src => -sin,
                    };
                    o_re[k] = a_re[k] * cos - a_im[k] * sin;
                    o_im[k] = a_re[k] * sin + a_im[k] * cos;
                }
            }
            Decoder::Rescal => vmath::wide(|| rescal_query(side, anchor, rel, out)),
        }
    }

    /// Accumulates (`+=`) the gradient through [`Decoder::query`]: given `grad_query` = ∂L/∂query,
    /// adds ∂L/∂anchor into `grad_anchor` and ∂L/∂rel into `grad_rel`.
    ///
    /// `grad_rel` is left untouched (and may be empty) for [`Decoder::Dot`].
    pub fn query_backward(
        self,
        side: Side,
        anchor: &[f32],
        rel: &[f32],
        grad_query: &[f32],
        grad_anchor: &mut [f32],
        grad_rel: &mut [f32],
    ) {
        let dim = anchor.len();
        debug_assert!(grad_query.len() == dim && grad_anchor.len() == dim);
        match self {
            Decoder::Dot => {
                for (ga, g) in grad_anchor.iter_mut().zip(grad_query) {
                    *ga += g;
                }
            }
            Decoder::DistMult => {
                for t in 0..dim {
                    grad_anchor[t] += grad_query[t] * rel[t];
                    grad_rel[t] += grad_query[t] * anchor[t];
                }
            }
            Decoder::ComplEx => {
                let h = dim / 2;
                let (a_re, a_im) = anchor.split_at(h);
                let (r_re, r_im) = rel.split_at(h);
                let (g_re, g_im) = grad_query.split_at(h);
                let (ga_re, ga_im) = grad_anchor.split_at_mut(h);
                let (gr_re, gr_im) = grad_rel.split_at_mut(h);
                for k in 0..h {
                    // Transposes of the 2x2 real Jacobians of the products in `query`.
                    match side {
                        Side::Dst => {
                            ga_re[k] += g_re[k] * r_re[k] + g_im[k] * r_im[k];
                            ga_im[k] += g_im[k] * r_re[k] - g_re[k] * r_im[k];
                            gr_re[k] += g_re[k] * a_re[k] + g_im[k] * a_im[k];
                            gr_im[k] += g_im[k] * a_re[k] - g_re[k] * a_im[k];
                        }
                        Side::Src => {
                            ga_re[k] += g_re[k] * r_re[k] - g_im[k] * r_im[k];
                            ga_im[k] += g_re[k] * r_im[k] + g_im[k] * r_re[k];
                            gr_re[k] += g_re[k] * a_re[k] + g_im[k] * a_im[k];
                            gr_im[k] += g_re[k] * a_im[k] - g_im[k] * a_re[k];
                        }
                    }
                }
            }
            Decoder::TransEL1 | Decoder::TransEL2 => {
                // query = anchor + rel (Dst) or anchor - rel (Src).
                let rel_sign = match side {
                    Side::Dst => 1.0,
                    Side::Src => -1.0,
                };
                for t in 0..dim {
                    grad_anchor[t] += grad_query[t];
                    grad_rel[t] += rel_sign * grad_query[t];
                }
            }
            Decoder::RotatE => {
                let h = dim / 2;
                let (a_re, a_im) = anchor.split_at(h);
                let (g_re, g_im) = grad_query.split_at(h);
                let (ga_re, ga_im) = grad_anchor.split_at_mut(h);
                let sign = match side {
                    Side::Dst => 1.0,
                    Side::Src => -1.0,
                };
                for k in 0..h {
                    let (sin, cos) = rel[k].sin_cos();
                    let sin = sign * sin;
                    // The rotation's transpose, and ∂q/∂θ = ±i·q.
                    ga_re[k] += g_re[k] * cos + g_im[k] * sin;
                    ga_im[k] += g_im[k] * cos - g_re[k] * sin;
                    let q_re = a_re[k] * cos - a_im[k] * sin;
                    let q_im = a_re[k] * sin + a_im[k] * cos;
                    grad_rel[k] += sign * (g_im[k] * q_re - g_re[k] * q_im);
                }
            }
            Decoder::Rescal => vmath::wide(|| {
                rescal_query_backward(side, anchor, rel, grad_query, grad_anchor, grad_rel)
            }),
        }
    }

    /// The score f(s, r, d) of one triple.
    pub fn score(self, src: &[f32], rel: &[f32], dst: &[f32]) -> f32 {
        let mut q = vec![0.0; src.len()];
        self.query(Side::Dst, src, rel, &mut q);
        self.comparator().compare(&q, dst)
    }

    /// The configuration name (`model.decoder`).
    pub fn name(self) -> &'static str {
        match self {
            Decoder::Dot => "dot",
            Decoder::DistMult => "distmult",
            Decoder::ComplEx => "complex",
            Decoder::TransEL1 => "transe_l1",
            Decoder::TransEL2 => "transe_l2",
            Decoder::RotatE => "rotate",
            Decoder::Rescal => "rescal",
        }
    }
}

/// RESCAL's query: `q = sᵀR` (row `i` of `R` scaled by `s_i`, summed) for [`Side::Dst`], and
/// `q = R d` (a dot product of each row of `R` with `d`) for [`Side::Src`]; both loops run
/// along rows of `R`, which vectorise.
#[inline(always)]
fn rescal_query(side: Side, anchor: &[f32], rel: &[f32], out: &mut [f32]) {
    let dim = anchor.len();
    match side {
        Side::Dst => {
            out.fill(0.0);
            for (&a, row) in anchor.iter().zip(rel.chunks_exact(dim)) {
                for (o, &r) in out.iter_mut().zip(row) {
                    *o += a * r;
                }
            }
        }
        Side::Src => {
            for (o, row) in out.iter_mut().zip(rel.chunks_exact(dim)) {
                *o = vmath::dot(row, anchor);
            }
        }
    }
}

/// The transpose of [`rescal_query`]: for `q = sᵀR`, `∂s_i += R_i·g` and `∂R_ij += s_i g_j`;
/// for `q = R d`, `∂d += Σ_i g_i R_i` and `∂R_ij += g_i d_j`.
#[inline(always)]
fn rescal_query_backward(
    side: Side,
    anchor: &[f32],
    rel: &[f32],
    grad_query: &[f32],
    grad_anchor: &mut [f32],
    grad_rel: &mut [f32],
) {
    let dim = anchor.len();
    match side {
        Side::Dst => {
            for (((ga, &a), row), grow) in grad_anchor
                .iter_mut()
                .zip(anchor)
                .zip(rel.chunks_exact(dim))
                .zip(grad_rel.chunks_exact_mut(dim))
            {
                *ga += vmath::dot(row, grad_query);
                for (gr, &g) in grow.iter_mut().zip(grad_query) {
                    *gr += a * g;
                }
            }
        }
        Side::Src => {
            let rows = rel.chunks_exact(dim).zip(grad_rel.chunks_exact_mut(dim));
            for ((row, grow), &g) in rows.zip(grad_query) {
                for ((ga, gr), (&r, &a)) in grad_anchor
                    .iter_mut()
                    .zip(grow.iter_mut())
                    .zip(row.iter().zip(anchor))
                {
                    *ga += g * r;
                    *gr += g * a;
                }
            }
        }
    }
}

impl fmt::Display for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An embedding dimension that a decoder cannot use ([`Decoder::check_dim`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DimError {
    /// No dimension at all.
    Zero,
    /// An odd dimension for a decoder of complex rows.
    Odd {
        /// The decoder.
        decoder: Decoder,
        /// The dimension.
        dim: usize,
    },
}

impl fmt::Display for DimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DimError::Zero => f.write_str("the embedding dimension must be at least 1"),
            DimError::Odd { decoder, dim } => write!(
                f,
                "{decoder} needs an even dimension (real and imaginary halves), got {dim}"
            ),
        }
    }
}

impl std::error::Error for DimError {}

impl FromStr for Decoder {
    type Err = crate::UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Decoder::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                crate::UnknownName::new(
                    "decoder",
                    s,
                    "expected one of dot, distmult, complex, transe_l1, transe_l2, rotate, rescal",
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct formulas, written independently of the query/comparator split.
    fn reference(decoder: Decoder, s: &[f32], r: &[f32], d: &[f32]) -> f64 {
        let f = |x: f32| x as f64;
        match decoder {
            Decoder::Dot => s.iter().zip(d).map(|(a, b)| f(*a) * f(*b)).sum(),
            Decoder::DistMult => (0..s.len()).map(|k| f(s[k]) * f(r[k]) * f(d[k])).sum(),
            Decoder::ComplEx => {
                let h = s.len() / 2;
                (0..h)
                    .map(|k| {
                        let (sr, si) = (f(s[k]), f(s[k + h]));
                        let (rr, ri) = (f(r[k]), f(r[k + h]));
                        let (dr, di) = (f(d[k]), f(d[k + h]));
                        // Re((sr + i si)(rr + i ri)(dr - i di))
                        let (pr, pi) = (sr * rr - si * ri, sr * ri + si * rr);
                        pr * dr + pi * di
                    })
                    .sum()
            }
            Decoder::TransEL1 => -(0..s.len())
                .map(|k| (f(s[k]) + f(r[k]) - f(d[k])).abs())
                .sum::<f64>(),
            Decoder::TransEL2 => -(0..s.len())
                .map(|k| (f(s[k]) + f(r[k]) - f(d[k])).powi(2))
                .sum::<f64>()
                .sqrt(),
            Decoder::RotatE => {
                let h = s.len() / 2;
                -(0..h)
                    .map(|k| {
                        let (c, n) = (f(r[k]).cos(), f(r[k]).sin());
                        let re = f(s[k]) * c - f(s[k + h]) * n - f(d[k]);
                        let im = f(s[k]) * n + f(s[k + h]) * c - f(d[k + h]);
                        (re * re + im * im).sqrt()
                    })
                    .sum::<f64>()
            }
            Decoder::Rescal => {
                let n = s.len();
                (0..n)
                    .flat_map(|i| (0..n).map(move |j| (i, j)))
                    .map(|(i, j)| f(s[i]) * f(r[i * n + j]) * f(d[j]))
                    .sum()
            }
        }
    }

    #[test]
    fn both_sides_agree_with_the_direct_formula() {
        let dim = 6;
        let row = |seed: u32, len: usize| -> Vec<f32> {
            (0..len)
                .map(|k| ((seed * 7 + k as u32 * 13) % 11) as f32 / 5.0 - 1.0)
                .collect()
        };
        let (s, d) = (row(1, dim), row(3, dim));
        for decoder in Decoder::ALL {
            let r = row(2, decoder.relation_width(dim));
            let want = reference(decoder, &s, &r, &d);
            let mut q = vec![0.0; dim];
            decoder.query(Side::Dst, &s, &r, &mut q);
            let via_dst = decoder.comparator().compare(&q, &d) as f64;
            decoder.query(Side::Src, &d, &r, &mut q);
            let via_src = decoder.comparator().compare(&q, &s) as f64;
            assert!(
                (via_dst - want).abs() < 1e-5,
                "{decoder} dst: {via_dst} vs {want}"
            );
            assert!(
                (via_src - want).abs() < 1e-5,
                "{decoder} src: {via_src} vs {want}"
            );
        }
    }

    #[test]
    fn names_round_trip() {
        for d in Decoder::ALL {
            assert_eq!(d.name().parse::<Decoder>().unwrap(), d);
        }
        assert!(
            "linear"
                .parse::<Decoder>()
                .unwrap_err()
                .to_string()
                .contains("rescal")
        );
    }
}
