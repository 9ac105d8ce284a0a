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
    /// Self-adversarial negative sampling (Sun et al., ICLR 2019, RotatE's loss):
    /// `softplus(−(γ + pos)) + Σ_j p_j softplus(γ + neg_j)` with `p = softmax(α · neg)` over
    /// the row's negatives, held constant in the gradient (as the paper detaches it): the
    /// negatives the model scores highest weigh most. For distance scores (−‖·‖) `γ + score`
    /// is the paper's `γ − d`. `α = 0` weighs every negative `1/k`: the logistic loss shifted
    /// by γ.
    SelfAdversarial {
        /// γ, added to every score.
        margin: f32,
        /// α, the sharpness of the weights.
        temperature: f32,
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
    /// The configuration name: `softmax_ce`, `logistic`, `ranking` or `self_adversarial`.
    pub fn name(self) -> &'static str {
        match self {
            Loss::SoftmaxCe => "softmax_ce",
            Loss::Logistic => "logistic",
            Loss::Ranking { .. } => "ranking",
            Loss::SelfAdversarial { .. } => "self_adversarial",
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
            Loss::SelfAdversarial {
                margin,
                temperature,
            } => {
                // The weights p = softmax(α · neg), shifted by the largest score; an excluded
                // (−∞) negative weighs 0, and a row of excluded negatives has none.
                let max = vmath::max(f32::MIN, scores);
                let weight = |x: f32| {
                    if x == f32::NEG_INFINITY {
                        0.0
                    } else {
                        vmath::exp_nonpositive(temperature * (x - max))
                    }
                };
                let total: f32 = scores.iter().map(|&x| weight(x)).sum();
                let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
                let mut neg_loss = 0.0f32;
                for x in scores.iter_mut() {
                    let p = weight(*x) * inv;
                    let (softplus, sigmoid) = softplus_sigmoid(margin + *x);
                    neg_loss += p * softplus;
                    *x = p * sigmoid;
                }
                let (pos_loss, pos_sig) = softplus_sigmoid(-(margin + pos));
                RowLoss {
                    loss: pos_loss + neg_loss,
                    grad_pos: -pos_sig,
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
            Loss::SelfAdversarial {
                margin,
                temperature,
            } => write!(
                f,
                "self_adversarial(margin {margin}, temperature {temperature})"
            ),
            other => f.write_str(other.name()),
        }
    }
}

impl FromStr for Loss {
    type Err = crate::UnknownName;

    /// Parses a configuration name; `ranking` takes [`DEFAULT_MARGIN`], `self_adversarial`
    /// that margin and temperature 1.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "softmax_ce" => Ok(Loss::SoftmaxCe),
            "logistic" => Ok(Loss::Logistic),
            "ranking" => Ok(Loss::Ranking {
                margin: DEFAULT_MARGIN,
            }),
            "self_adversarial" => Ok(Loss::SelfAdversarial {
                margin: DEFAULT_MARGIN,
                temperature: 1.0,
            }),
            _ => Err(crate::UnknownName::new(
                "loss",
                s,
                "expected one of softmax_ce, logistic, ranking, self_adversarial",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The self-adversarial loss of `pos` and `neg` with the weights `p` given (the gradient
    /// holds them constant), in f64.
    fn self_adversarial_with(margin: f64, pos: f64, neg: &[f64], p: &[f64]) -> f64 {
        let softplus = |x: f64| x.max(0.0) + (-x.abs()).exp().ln_1p();
        softplus(-(margin + pos))
            + neg
                .iter()
                .zip(p)
                .map(|(x, w)| w * softplus(margin + x))
                .sum::<f64>()
    }

    #[test]
    fn self_adversarial_gradients_match_central_differences_with_the_weights_held() {
        let (margin, temperature) = (2.0f32, 1.5f32);
        let loss = Loss::SelfAdversarial {
            margin,
            temperature,
        };
        let pos = -1.3f32;
        let neg = [-4.0f32, -0.5, -2.2, 1.1, -3.0];
        let mut grads = neg;
        let row = loss.row_in_place(pos, &mut grads, None);
        // The weights: softmax(α · neg).
        let e: Vec<f64> = neg
            .iter()
            .map(|&x| (f64::from(temperature) * f64::from(x)).exp())
            .collect();
        let p: Vec<f64> = e.iter().map(|v| v / e.iter().sum::<f64>()).collect();
        let negs: Vec<f64> = neg.iter().map(|&x| f64::from(x)).collect();
        let (m, pos64) = (f64::from(margin), f64::from(pos));
        let want = self_adversarial_with(m, pos64, &negs, &p);
        assert!(
            (f64::from(row.loss) - want).abs() < 1e-5,
            "{} vs {want}",
            row.loss
        );
        let h = 1e-4;
        let fd_pos = (self_adversarial_with(m, pos64 + h, &negs, &p)
            - self_adversarial_with(m, pos64 - h, &negs, &p))
            / (2.0 * h);
        assert!((f64::from(row.grad_pos) - fd_pos).abs() < 1e-5);
        for j in 0..neg.len() {
            let (mut up, mut down) = (negs.clone(), negs.clone());
            up[j] += h;
            down[j] -= h;
            let fd = (self_adversarial_with(m, pos64, &up, &p)
                - self_adversarial_with(m, pos64, &down, &p))
                / (2.0 * h);
            assert!((f64::from(grads[j]) - fd).abs() < 1e-5, "negative {j}");
        }
        // The highest-scored negative weighs most.
        assert!(grads[3] > grads[1] && grads[1] > grads[0]);
    }

    #[test]
    fn self_adversarial_at_temperature_zero_is_the_logistic_loss_shifted_by_the_margin() {
        let neg = [-4.0f32, -0.5, 2.2, 1.1];
        let (mut a, mut b) = (neg, neg.map(|x| x + 0.7));
        let adv = Loss::SelfAdversarial {
            margin: 0.7,
            temperature: 0.0,
        }
        .row_in_place(0.3, &mut a, None);
        let logistic = Loss::Logistic.row_in_place(1.0, &mut b, None);
        assert!((adv.loss - logistic.loss).abs() < 1e-6);
        assert!((adv.grad_pos - logistic.grad_pos).abs() < 1e-6);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-7);
        }
    }

    #[test]
    fn self_adversarial_excluded_negatives_weigh_nothing() {
        let loss = Loss::SelfAdversarial {
            margin: 1.0,
            temperature: 1.0,
        };
        let mut masked = [0.5f32, 3.0, -1.0];
        let a = loss.row_in_place(0.2, &mut masked, Some(&[false, true, false]));
        let mut kept = [0.5f32, -1.0];
        let b = loss.row_in_place(0.2, &mut kept, None);
        assert_eq!(masked[1], 0.0);
        assert!((a.loss - b.loss).abs() < 1e-6 && masked[0] == kept[0]);
        let mut none = [1.0f32];
        let c = loss.row_in_place(0.2, &mut none, Some(&[true]));
        assert!(c.loss.is_finite() && none[0] == 0.0);
    }

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
        assert!(
            "hinge"
                .parse::<Loss>()
                .unwrap_err()
                .to_string()
                .contains("hinge")
        );
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
