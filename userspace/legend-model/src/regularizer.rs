//! Weight regularisation of the rows a batch trains, folded into the optimizer step.
//!
//! N3 (Lacroix, Usunier and Obozinski, ICML 2018) penalises the cubed moduli of the factors of
//! every training triple: `λ Σ_(s, r, d) in batch Σ_k (|s_k|³ + |r_k|³ + |d_k|³)`, where for
//! ComplEx `|x_k|` is the modulus of the k-th complex element (real part at `k`, imaginary at
//! `k + dim/2`) and otherwise the absolute value of the k-th real. L2 penalises `λ Σ θ²` over
//! the same factors. A row that occurs `c` times among the batch's positives gets `c` times the
//! gradient of its penalty, added to its summed loss gradient just before its AdaGrad step: no
//! pass over rows beyond the one the step makes. Rows touched only as negatives are not
//! penalised (the published N3 regularises the factors of the training triples only).
//!
//! A RESCAL relation is a `dim × dim` matrix `R`, penalised entry by entry as the real rows
//! are: L2 is its squared Frobenius norm `Σ_ij R_ij²`, and N3 the entry-wise cubed 3-norm
//! `Σ_ij |R_ij|³`. The latter is not the Schatten 3-norm of `R` (the sum of its cubed
//! singular values, which would need a decomposition of `R` at every step): it is what N3
//! means for a factor that is a plain array of reals, as for DistMult's relation rows.

use std::fmt;
use std::str::FromStr;

use crate::Decoder;

/// Which penalty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Penalty {
    /// No regularisation.
    #[default]
    None,
    /// Weighted nuclear 3-norm: cubed moduli.
    N3,
    /// Squared L2 norm.
    L2,
}

impl Penalty {
    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Penalty::None => "none",
            Penalty::N3 => "n3",
            Penalty::L2 => "l2",
        }
    }
}

impl fmt::Display for Penalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Penalty {
    type Err = crate::UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Penalty::None),
            "n3" => Ok(Penalty::N3),
            "l2" => Ok(Penalty::L2),
            _ => Err(crate::UnknownName::new(
                "regularizer",
                s,
                "expected none, n3 or l2",
            )),
        }
    }
}

/// A penalty with its weight, for rows of one decoder.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Regularizer {
    /// The penalty.
    pub penalty: Penalty,
    /// λ, per occurrence of a row among a batch's positives.
    pub weight: f32,
    /// ComplEx pairs the halves of a row into complex elements (N3 takes their moduli).
    pub complex: bool,
}

impl Regularizer {
    /// `penalty` with `weight` on rows of `decoder`.
    pub fn new(penalty: Penalty, weight: f32, decoder: Decoder) -> Regularizer {
        Regularizer {
            penalty,
            weight,
            complex: decoder.is_complex(),
        }
    }

    /// Whether it changes anything.
    pub fn is_active(&self) -> bool {
        self.penalty != Penalty::None && self.weight != 0.0
    }

    /// The penalty of one occurrence of `row` (for tests and reports).
    pub fn penalty_of(&self, row: &[f32]) -> f64 {
        let w = f64::from(self.weight);
        match self.penalty {
            Penalty::None => 0.0,
            Penalty::L2 => {
                w * row
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>()
            }
            Penalty::N3 => w * moduli(row, self.complex).map(|m| m * m * m).sum::<f64>(),
        }
    }

    /// Adds `occurrences` times the gradient of [`Regularizer::penalty_of`] at `row` into
    /// `grad`.
    pub fn add_gradient(&self, row: &[f32], occurrences: u32, grad: &mut [f32]) {
        debug_assert_eq!(row.len(), grad.len());
        let scale = self.weight * occurrences as f32;
        if scale == 0.0 {
            return;
        }
        match self.penalty {
            Penalty::None => {}
            Penalty::L2 => {
                for (g, &x) in grad.iter_mut().zip(row) {
                    *g += 2.0 * scale * x;
                }
            }
            // d|x|³/dx = 3|x|x; for a complex element of modulus m, d m³/d re = 3 m re.
            Penalty::N3 if self.complex => {
                let h = row.len() / 2;
                let (re, im) = row.split_at(h);
                let (g_re, g_im) = grad.split_at_mut(h);
                for k in 0..h {
                    let m = (re[k] * re[k] + im[k] * im[k]).sqrt();
                    g_re[k] += 3.0 * scale * m * re[k];
                    g_im[k] += 3.0 * scale * m * im[k];
                }
            }
            Penalty::N3 => {
                for (g, &x) in grad.iter_mut().zip(row) {
                    *g += 3.0 * scale * x.abs() * x;
                }
            }
        }
    }
}

/// The moduli of a row's elements in f64: complex pairs `(k, k + dim/2)`, or reals.
fn moduli(row: &[f32], complex: bool) -> Box<dyn Iterator<Item = f64> + '_> {
    if complex {
        let (re, im) = row.split_at(row.len() / 2);
        Box::new(
            re.iter()
                .zip(im)
                .map(|(&a, &b)| (f64::from(a).powi(2) + f64::from(b).powi(2)).sqrt()),
        )
    } else {
        Box::new(row.iter().map(|&x| f64::from(x).abs()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradients_match_central_differences() {
        let row: Vec<f32> = (0..8).map(|k| (k as f32 - 3.5) / 2.7).collect();
        for decoder in [Decoder::DistMult, Decoder::ComplEx] {
            for penalty in [Penalty::N3, Penalty::L2] {
                let reg = Regularizer::new(penalty, 0.3, decoder);
                let mut grad = vec![0.0f32; row.len()];
                reg.add_gradient(&row, 2, &mut grad);
                for k in 0..row.len() {
                    let h = 1e-3f32;
                    let (mut up, mut down) = (row.clone(), row.clone());
                    up[k] += h;
                    down[k] -= h;
                    let fd = 2.0 * (reg.penalty_of(&up) - reg.penalty_of(&down))
                        / (f64::from(up[k]) - f64::from(down[k]));
                    let err = (f64::from(grad[k]) - fd).abs() / fd.abs().max(1.0);
                    assert!(
                        err < 1e-3,
                        "{decoder} {penalty} element {k}: {} vs {fd}",
                        grad[k]
                    );
                }
            }
        }
    }

    #[test]
    fn a_rescal_matrix_is_penalised_entry_by_entry() {
        // [[1, -2], [0, 3]]: Frobenius² 14, entry-wise cubes 1 + 8 + 27 = 36.
        let matrix = [1.0f32, -2.0, 0.0, 3.0];
        let l2 = Regularizer::new(Penalty::L2, 1.0, Decoder::Rescal);
        let n3 = Regularizer::new(Penalty::N3, 1.0, Decoder::Rescal);
        assert_eq!(l2.penalty_of(&matrix), 14.0);
        assert_eq!(n3.penalty_of(&matrix), 36.0);
        let mut grad = [0.0f32; 4];
        n3.add_gradient(&matrix, 1, &mut grad);
        assert_eq!(grad, [3.0, -12.0, 0.0, 27.0]);
    }

    #[test]
    fn complex_n3_takes_moduli() {
        // (3 + 4i) has modulus 5: the penalty is 125, not 27 + 64.
        let reg = Regularizer::new(Penalty::N3, 1.0, Decoder::ComplEx);
        assert_eq!(reg.penalty_of(&[3.0, 4.0]), 125.0);
        let reg = Regularizer::new(Penalty::N3, 1.0, Decoder::DistMult);
        assert_eq!(reg.penalty_of(&[3.0, 4.0]), 91.0);
    }

    #[test]
    fn none_and_zero_weight_leave_the_gradient_alone() {
        let mut grad = [1.0f32, 2.0];
        Regularizer::new(Penalty::None, 1.0, Decoder::DistMult).add_gradient(
            &[5.0, 5.0],
            3,
            &mut grad,
        );
        Regularizer::new(Penalty::N3, 0.0, Decoder::DistMult).add_gradient(
            &[5.0, 5.0],
            3,
            &mut grad,
        );
        assert_eq!(grad, [1.0, 2.0]);
        assert!(!Regularizer::new(Penalty::L2, 0.0, Decoder::DistMult).is_active());
    }

    #[test]
    fn names_round_trip() {
        for p in [Penalty::None, Penalty::N3, Penalty::L2] {
            assert_eq!(p.name().parse::<Penalty>(), Ok(p));
        }
        assert!(
            "l1".parse::<Penalty>()
                .unwrap_err()
                .to_string()
                .contains("n3 or l2")
        );
    }
}
