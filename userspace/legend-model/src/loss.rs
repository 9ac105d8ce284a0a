//! Losses of one positive score against the scores of its chunk's negatives.
//!
//! Every loss is a *sum* over positives (the reduction of PyTorch-BigGraph and of Marius'
//! default), and each side of a triple (destination and source corruption) contributes one
//! term, as in both systems. An excluded negative contributes nothing, as if its score were −∞
//! (PBG's masking). The caller decides what is excluded: `training.negatives.filtered` excludes
//! every sampled negative that makes a known train triple with the positive's relation and
//! other end (the true candidate and every other train answer), not only the true candidate.

use std::fmt;
use std::str::FromStr;

use crate::vmath;

/// The default margin of [`Loss::Ranking`]: 0.1 in both PyTorch-BigGraph (`margin`) and
/// Marius (`RANKING` `margin`).
pub const DEFAULT_MARGIN: f32 = 0.1;

/// A training loss for one positive against `k` negatives.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Loss {
    /// Softmax cross-entropy: `−pos + log(exp(pos) + Σ_j exp(neg_j))` (Marius `SOFTMAX_CE`,
    /// PBG `softmax`).
    SoftmaxCe,
    /// Logistic: `softplus(−pos) + (1/k) Σ_j softplus(neg_j)`.
    ///
    /// The negatives are weighted by `1/k`, `k` being the number of negative columns (masked
    /// ones included), exactly as PyTorch-BigGraph's `LogisticLossFunction` sets its negative
    /// weight to `1 / num_neg`, so that positives and negatives weigh the same overall.
    Logistic,
    /// Margin ranking: `Σ_j max(0, margin − pos + neg_j)` (PBG `ranking`, Marius `RANKING`).
    Ranking {
        /// The margin by which a positive should beat each negative.
        margin: f32,
    },
}

/// The loss of one positive and the gradient with respect to its score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowLoss {
    /// The loss value.
    pub loss: f32,
    /// ∂loss/∂pos.
    pub grad_pos: f32,
}

impl Loss {
    /// The configuration name: `softmax_ce`, `logistic` or `ranking`.
    pub fn name(self) -> &'static str {
        match self {
            Loss::SoftmaxCe => "softmax_ce",
            Loss::Logistic => "logistic",
            Loss::Ranking { .. } => "ranking",
        }
    }

    /// Computes the loss of positive score `pos` against the negative scores in `scores`, and
    /// overwrites `scores` with ∂loss/∂score (in place, so the chunk's score matrix becomes its
    /// gradient matrix without a second b×k buffer).
    ///
    /// `excluded[j] == true` removes negative `j` from the loss (its gradient is 0).
    pub fn row_in_place(self, pos: f32, scores: &mut [f32], excluded: Option<&[bool]>) -> RowLoss {
        vmath::wide(|| self.row_in_place_inline(pos, scores, excluded))
    }

    #[inline(always)]
    fn row_in_place_inline(
        self,
        pos: f32,
        scores: &mut [f32],
        excluded: Option<&[bool]>,
    ) -> RowLoss {
        if let Some(m) = excluded {
            assert_eq!(
                m.len(),
                scores.len(),
                "mask row and score row differ in length"
            );
            // A −∞ score drops out of every loss below with a zero gradient, so the kernels
            // themselves need no mask.
            for (s, &out) in scores.iter_mut().zip(m) {
                if out {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        match self {
            Loss::SoftmaxCe => {
                // Shift by the maximum so that no exponential overflows; the largest term is 1,
                // so the sum cannot underflow either.
                let max = vmath::max(pos, scores);
                for s in scores.iter_mut() {
                    *s = vmath::exp_nonpositive(*s - max);
                }
                let pos_e = vmath::exp_nonpositive(pos - max);
                let total = vmath::sum(scores) + pos_e;
                let inv = 1.0 / total;
                for s in scores.iter_mut() {
                    *s *= inv;
                }
                RowLoss {
                    loss: ((max - pos) as f64 + (total as f64).ln()) as f32,
                    grad_pos: pos_e * inv - 1.0,
                }
            }
            Loss::Logistic => {
                let w = 1.0 / scores.len().max(1) as f32;
                // Blocks through a stack buffer: a map with two outputs vectorises, a map fused
                // with a float reduction does not (strict FP order).
                let mut neg_loss = 0.0f32;
                let mut buf = [0.0f32; BLOCK];
                for block in scores.chunks_mut(BLOCK) {
                    let sp = &mut buf[..block.len()];
                    for (x, s) in block.iter_mut().zip(sp.iter_mut()) {
                        let (softplus, sigmoid) = softplus_sigmoid(*x);
                        *s = softplus;
                        *x = w * sigmoid;
                    }
                    neg_loss += vmath::sum(sp);
                }
                let (pos_loss, pos_sig) = softplus_sigmoid(-pos);
                RowLoss {
                    loss: pos_loss + w * neg_loss,
                    grad_pos: -pos_sig,
                }
            }
            Loss::Ranking { margin } => {
                let (mut loss, mut active) = (0.0f32, 0.0f32);
                let mut buf = [0.0f32; BLOCK];
                for block in scores.chunks_mut(BLOCK) {
                    let hinge = &mut buf[..block.len()];
                    for (x, h) in block.iter_mut().zip(hinge.iter_mut()) {
                        let v = margin - pos + *x;
                        *h = if v > 0.0 { v } else { 0.0 };
                        // The gradient is 1 where the hinge is active.
                        *x = if v > 0.0 { 1.0 } else { 0.0 };
                    }
                    loss += vmath::sum(hinge);
                    active += vmath::sum(block);
                }
                RowLoss {
                    loss,
                    grad_pos: -active,
                }
            }
        }
    }
}

/// Elements per block of the two-pass loss kernels (a stack buffer of this many floats).
const BLOCK: usize = 128;

/// `(softplus(x), sigmoid(x))` = `(log(1 + eˣ), 1 / (1 + e⁻ˣ))` from one `exp(−|x|)`, stable
/// on both tails; `(0, 0)` at `x = −∞`.
#[inline(always)]
fn softplus_sigmoid(x: f32) -> (f32, f32) {
    let e = vmath::exp_nonpositive(-x.abs());
    let softplus = if x > 0.0 { x } else { 0.0 } + vmath::ln_1p_unit(e);
    let sigmoid = if x >= 0.0 { 1.0 } else { e } / (1.0 + e);
    (softplus, sigmoid)
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loss::Ranking { margin } => write!(f, "ranking(margin {margin})"),
            other => f.write_str(other.name()),
        }
    }
}

impl FromStr for Loss {
    type Err = String;

    /// Parses a configuration name; `ranking` takes [`DEFAULT_MARGIN`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "softmax_ce" => Ok(Loss::SoftmaxCe),
            "logistic" => Ok(Loss::Logistic),
            "ranking" => Ok(Loss::Ranking {
                margin: DEFAULT_MARGIN,
            }),
            _ => Err(format!(
                "unknown loss {s:?}: expected one of softmax_ce, logistic, ranking"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_avx2_build_gives_the_same_floats_as_the_portable_one() {
        // `row_in_place` runs the AVX2 build where the CPU has it; `row_in_place_inline`, called
        // here from plain code, the SSE2 one.
        let mut state = 7u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 8) as f32 / (1 << 24) as f32 * 20.0 - 10.0
        };
        for loss in [
            Loss::SoftmaxCe,
            Loss::Logistic,
            Loss::Ranking { margin: 0.5 },
        ] {
            for len in [1usize, 7, 8, 33, 1000] {
                let scores: Vec<f32> = (0..len).map(|_| next()).collect();
                let excluded: Vec<bool> = (0..len).map(|j| j % 5 == 3).collect();
                let pos = next();
                for mask in [None, Some(&excluded[..])] {
                    let (mut wide, mut plain) = (scores.clone(), scores.clone());
                    let a = loss.row_in_place(pos, &mut wide, mask);
                    let b = loss.row_in_place_inline(pos, &mut plain, mask);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&wide), bits(&plain), "{loss} len {len}");
                    assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{loss} len {len}");
                    assert_eq!(a.grad_pos.to_bits(), b.grad_pos.to_bits());
                }
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for l in [
            Loss::SoftmaxCe,
            Loss::Logistic,
            Loss::Ranking {
                margin: DEFAULT_MARGIN,
            },
        ] {
            assert_eq!(l.name().parse::<Loss>().unwrap(), l);
        }
        assert!("hinge".parse::<Loss>().unwrap_err().contains("hinge"));
    }

    #[test]
    fn softmax_is_stable_for_huge_scores() {
        let mut row = vec![1e4f32, -1e4, 1e4 - 1.0];
        let r = Loss::SoftmaxCe.row_in_place(1e4, &mut row, None);
        // log(2 + e^-1) with the positive tied to the largest negative.
        let want = (2.0f64 + (-1.0f64).exp()).ln();
        assert!((r.loss as f64 - want).abs() < 1e-5, "{}", r.loss);
        assert!(row.iter().all(|g| g.is_finite()));
        let total: f32 = row.iter().sum::<f32>() + r.grad_pos + 1.0;
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn masked_negatives_do_not_count() {
        for loss in [
            Loss::SoftmaxCe,
            Loss::Logistic,
            Loss::Ranking { margin: 0.5 },
        ] {
            let mut full = vec![0.3f32, 2.0, -0.7];
            let mut masked = full.clone();
            let a = loss.row_in_place(0.1, &mut masked, Some(&[false, true, false]));
            assert_eq!(masked[1], 0.0);
            // Dropping the masked column is the same as a −∞ score.
            full[1] = -1e30;
            let b = loss.row_in_place(0.1, &mut full, None);
            assert!((a.loss - b.loss).abs() < 1e-6, "{loss}");
            assert!((a.grad_pos - b.grad_pos).abs() < 1e-6, "{loss}");
        }
    }

    #[test]
    fn softplus_and_sigmoid_tails() {
        assert_eq!(softplus_sigmoid(100.0), (100.0, 1.0));
        let (sp, sig) = softplus_sigmoid(-100.0);
        // exp(−100) is flushed to 0 (it is below f32::MIN_POSITIVE anyway).
        assert!((0.0..1e-37).contains(&sp) && sig < 1e-37);
        assert_eq!(softplus_sigmoid(f32::NEG_INFINITY), (0.0, 0.0));
        for x in [-3.0f32, -0.5, 0.0, 0.7, 4.0] {
            let (sp, sig) = softplus_sigmoid(x);
            let x = x as f64;
            assert!((sp as f64 - x.exp().ln_1p()).abs() < 1e-6);
            assert!((sig as f64 - 1.0 / (1.0 + (-x).exp())).abs() < 1e-6);
        }
    }
}
