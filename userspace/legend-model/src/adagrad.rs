//! Sparse AdaGrad, with one accumulator per element or per row.
//!
//! Element-wise: `state += g²; θ −= lr · g / (sqrt(state) + eps)` per element, as in the Marius
//! paper and the GPU anchor system. Row-wise (PyTorch-BigGraph's default): one accumulator per
//! row, `state += mean(g²)` over the row, and every element steps by `lr · g / (sqrt(state) +
//! eps)`. A row's state is then 4 bytes instead of 4 × dim, which halves what an out-of-core
//! epoch moves at d = 100.

use std::fmt;
use std::str::FromStr;

use crate::vmath;

/// How many AdaGrad accumulators a row has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StateLayout {
    /// One per element: the state table has the embedding table's shape.
    #[default]
    Element,
    /// One per row.
    Row,
}

impl StateLayout {
    /// Accumulators per row of `dim` elements.
    pub fn width(self, dim: usize) -> usize {
        match self {
            StateLayout::Element => dim,
            StateLayout::Row => 1,
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            StateLayout::Element => "element",
            StateLayout::Row => "row",
        }
    }
}

impl fmt::Display for StateLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for StateLayout {
    type Err = crate::UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "element" => Ok(StateLayout::Element),
            "row" => Ok(StateLayout::Row),
            _ => Err(crate::UnknownName::new(
                "state layout",
                s,
                "expected element or row",
            )),
        }
    }
}

/// AdaGrad hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaGrad {
    /// The learning rate.
    pub lr: f32,
    /// Added to `sqrt(state)` so that a zero state does not divide by zero.
    pub eps: f32,
    /// The layout of the node tables' state. Relation tables are small and always keep one
    /// accumulator per element ([`AdaGrad::for_relations`]).
    pub state: StateLayout,
}

impl Default for AdaGrad {
    /// `lr = 0.1`, `eps = 1e-9`, element-wise: the paper's and the GPU anchor system's values.
    fn default() -> Self {
        AdaGrad {
            lr: 0.1,
            eps: 1e-9,
            state: StateLayout::Element,
        }
    }
}

impl AdaGrad {
    /// The optimizer of the relation tables: the same settings, one accumulator per element.
    pub fn for_relations(self) -> AdaGrad {
        AdaGrad {
            state: StateLayout::Element,
            ..self
        }
    }

    /// Applies the accumulated gradient `grad` of one row to that row's parameters `param` and
    /// AdaGrad state `state` (`param` and `grad` of the same length, `state` of
    /// [`StateLayout::width`] of it).
    ///
    /// Gradients of a row that occurs several times in a batch must be summed first (the chunk
    /// outputs are scatter-added), so the row takes one step per batch.
    pub fn apply_row(&self, param: &mut [f32], state: &mut [f32], grad: &[f32]) {
        assert!(
            param.len() == grad.len() && state.len() == self.state.width(grad.len()),
            "param, state and grad rows do not match the state layout"
        );
        match self.state {
            StateLayout::Element => vmath::wide(|| self.step(param, state, grad)),
            StateLayout::Row => vmath::wide(|| self.row_step(param, &mut state[0], grad)),
        }
    }

    #[inline(always)]
    fn step(&self, param: &mut [f32], state: &mut [f32], grad: &[f32]) {
        for ((p, s), &g) in param.iter_mut().zip(state.iter_mut()).zip(grad) {
            *s += g * g;
            *p -= self.lr * g / (s.sqrt() + self.eps);
        }
    }

    #[inline(always)]
    fn row_step(&self, param: &mut [f32], state: &mut f32, grad: &[f32]) {
        // Eight partial sums in a fixed order: vectorises, and the floats do not depend on
        // the vector width.
        let mut lanes = [0.0f32; 8];
        let mut chunks = grad.chunks_exact(8);
        for c in &mut chunks {
            for (l, &g) in lanes.iter_mut().zip(c) {
                *l += g * g;
            }
        }
        for (l, &g) in lanes.iter_mut().zip(chunks.remainder()) {
            *l += g * g;
        }
        let sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
            + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        *state += sum / grad.len() as f32;
        let scale = self.lr / (state.sqrt() + self.eps);
        for (p, &g) in param.iter_mut().zip(grad) {
            *p -= scale * g;
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
        let opt = AdaGrad::default();
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
        let opt = AdaGrad {
            lr: 0.3,
            ..AdaGrad::default()
        };
        let mut p = [0.0f32; 2];
        let mut s = [0.0f32; 2];
        opt.apply_row(&mut p, &mut s, &[1e-3, -5.0]);
        assert!((p[0] + 0.3).abs() < 1e-5 && (p[1] - 0.3).abs() < 1e-6);
    }

    #[test]
    fn row_wise_state_is_the_mean_of_the_squares() {
        let opt = AdaGrad {
            state: StateLayout::Row,
            ..AdaGrad::default()
        };
        let mut p = [1.0f32, -2.0, 0.5, 0.0];
        let mut s = [1.0f32];
        opt.apply_row(&mut p, &mut s, &[3.0, 0.0, -1.0, 2.0]);
        // mean(g²) = (9 + 0 + 1 + 4) / 4 = 3.5; state 4.5; every element steps by 0.1·g/√4.5.
        assert_eq!(s, [4.5]);
        let scale = 0.1 / 4.5f32.sqrt();
        for (got, want) in p
            .iter()
            .zip([1.0 - 3.0 * scale, -2.0, 0.5 + scale, -2.0 * scale])
        {
            assert!((got - want).abs() < 1e-7, "{p:?}");
        }
    }

    #[test]
    fn a_row_state_of_the_wrong_width_is_refused() {
        let opt = AdaGrad {
            state: StateLayout::Row,
            ..AdaGrad::default()
        };
        let caught = std::panic::catch_unwind(|| {
            opt.apply_row(&mut [0.0; 2], &mut [0.0; 2], &[1.0, 1.0]);
        });
        assert!(caught.is_err());
    }

    #[test]
    fn layout_names_round_trip() {
        for l in [StateLayout::Element, StateLayout::Row] {
            assert_eq!(l.name().parse::<StateLayout>(), Ok(l));
        }
        assert!(
            "col"
                .parse::<StateLayout>()
                .unwrap_err()
                .to_string()
                .contains("element or row")
        );
    }
}
