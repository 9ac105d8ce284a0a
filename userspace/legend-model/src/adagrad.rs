//! Sparse, elementwise AdaGrad.
//!
//! `state += g²; θ −= lr · g / (sqrt(state) + eps)` per element, as in the Marius paper and the
//! GPU anchor system. PyTorch-BigGraph's *row-wise* AdaGrad instead keeps one accumulator per
//! row (the mean of `g²` over the row); Legend keeps one per element, so its state table has the
//! shape of the embedding table.

use crate::vmath;

/// AdaGrad hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaGrad {
    /// The learning rate.
    pub lr: f32,
    /// Added to `sqrt(state)` so that a zero state does not divide by zero.
    pub eps: f32,
}

impl Default for AdaGrad {
    /// `lr = 0.1`, `eps = 1e-9`: the paper's and the GPU anchor system's values.
    fn default() -> Self {
        AdaGrad { lr: 0.1, eps: 1e-9 }
    }
}

impl AdaGrad {
    /// Applies the accumulated gradient `grad` of one row to that row's parameters `param` and
    /// AdaGrad state `state` (all three of the same length).
    ///
    /// Gradients of a row that occurs several times in a batch must be summed first (the chunk
    /// outputs are scatter-added), so the row takes one step per batch.
    pub fn apply_row(&self, param: &mut [f32], state: &mut [f32], grad: &[f32]) {
        assert!(
            param.len() == grad.len() && state.len() == grad.len(),
            "param, state and grad rows differ in length"
        );
        vmath::wide(|| self.step(param, state, grad));
    }

    #[inline(always)]
    fn step(&self, param: &mut [f32], state: &mut [f32], grad: &[f32]) {
        for ((p, s), &g) in param.iter_mut().zip(state.iter_mut()).zip(grad) {
            *s += g * g;
            *p -= self.lr * g / (s.sqrt() + self.eps);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_hand_computation() {
        let opt = AdaGrad::default();
        let mut p = [1.0f32, -2.0, 0.5];
        let mut s = [0.0f32, 4.0, 1.0];
        opt.apply_row(&mut p, &mut s, &[3.0, 0.0, -1.0]);
        // Element 0: state 9, step 0.1·3/3 = 0.1. Element 1: no gradient, no move.
        // Element 2: state 2, step −0.1/√2.
        assert_eq!(s, [9.0, 4.0, 2.0]);
        assert!((p[0] - 0.9).abs() < 1e-7);
        assert_eq!(p[1], -2.0);
        assert!((p[2] - (0.5 + 0.1 / 2f32.sqrt())).abs() < 1e-7);
        // A second step sees the accumulated state.
        opt.apply_row(&mut p, &mut s, &[4.0, 0.0, 0.0]);
        assert_eq!(s[0], 25.0);
        assert!((p[0] - (0.9 - 0.1 * 4.0 / 5.0)).abs() < 1e-7);
    }

    #[test]
    fn the_avx2_build_gives_the_same_floats_as_the_portable_one() {
        let opt = AdaGrad { lr: 0.1, eps: 1e-9 };
        let grad: Vec<f32> = (0..203)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut p = [vec![0.5f32; 203], vec![0.5f32; 203]];
        let mut s = [vec![0.0f32; 203], vec![0.0f32; 203]];
        for _ in 0..3 {
            let [(p0, p1), (s0, s1)] = [p.split_at_mut(1), s.split_at_mut(1)];
            opt.apply_row(&mut p0[0], &mut s0[0], &grad);
            opt.step(&mut p1[0], &mut s1[0], &grad);
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p[0]), bits(&p[1]));
        assert_eq!(bits(&s[0]), bits(&s[1]));
    }

    #[test]
    fn first_step_is_lr_times_sign() {
        let opt = AdaGrad { lr: 0.3, eps: 1e-9 };
        let mut p = [0.0f32; 2];
        let mut s = [0.0f32; 2];
        opt.apply_row(&mut p, &mut s, &[1e-3, -5.0]);
        assert!((p[0] + 0.3).abs() < 1e-5 && (p[1] - 0.3).abs() < 1e-6);
    }
}
