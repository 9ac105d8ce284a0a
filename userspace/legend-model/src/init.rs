//! Deterministic, counter-based initialisation of embedding rows.
//!
//! Element `t` of row `row` of table `table` is a pure function of `(seed, table, row, t)`, so a
//! row's initial value does not depend on partitioning, on the order rows are touched, or on the
//! thread count, and a GPU kernel (one thread per element) reproduces it. The hash, as a spec
//! for ports (`mix`, `G` and `draw` are [`crate::rng`]'s):
//!
//! ```text
//! row_key  = mix(mix(seed + (tag(table) + 1) * G) ^ row)
//! bits(t)  = draw(row_key, t) = mix(row_key + (t + 1) * G)    (all arithmetic wrapping, u64)
//! ```
//!
//! `tag(Node) = 0`, `tag(Relation) = 1`, `tag(InverseRelation) = 2`. From `bits`:
//! - uniform on (−b, b): `u = ((bits >> 40) + 0.5) / 2^24`, value `b · (2u − 1)`, in f32;
//! - normal: `u1 = ((bits >> 32) + 0.5) / 2^32`, `u2 = (bits & 0xffffffff) / 2^32`,
//!   value `std · sqrt(−2 ln u1) · cos(2π u2)` in f64, rounded to f32 (Box–Muller, one output
//!   per element so elements stay independent). A port using f64 math agrees up to the last-ulp
//!   rounding of its `ln`/`cos`.

use crate::rng::{GOLDEN, draw, mix};

/// Which parameter table a row belongs to; each has its own random stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Table {
    /// Node (entity) embeddings.
    Node,
    /// Relation embeddings (used for destination-side queries, or both sides).
    Relation,
    /// Separate relation embeddings for the inverse direction, where a model keeps them.
    InverseRelation,
}

impl Table {
    fn tag(self) -> u64 {
        match self {
            Table::Node => 0,
            Table::Relation => 1,
            Table::InverseRelation => 2,
        }
    }
}

/// A distribution of independent elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distribution {
    /// Normal with mean 0 and standard deviation `std`.
    Normal {
        /// The standard deviation.
        std: f32,
    },
    /// Uniform on `(−bound, bound)`.
    Uniform {
        /// Half the width of the interval.
        bound: f32,
    },
}

/// How relation rows start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RelationInit {
    /// The identity of the model's operator: ones for DistMult, `1 + 0i` for ComplEx, the
    /// identity matrix for RESCAL, zeros for TransE and RotatE (and nothing to do for Dot).
    ///
    /// This is what PyTorch-BigGraph's `diagonal`, `complex_diagonal` and `translation`
    /// operators start from, and what the GPU anchor system does ("real part = 1"). With node
    /// rows of scale 1e-3, a random relation of the same scale would make DistMult/ComplEx
    /// scores cubic in 1e-3 and their gradients vanish; the identity starts training as the
    /// plain dot model, whose gradients are only quadratic in the node scale.
    Identity,
    /// Random rows, like node rows.
    Random(Distribution),
}

/// The initialisation of all parameter tables.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Init {
    /// The seed shared by all tables.
    pub seed: u64,
    /// The distribution of node rows.
    pub node: Distribution,
    /// How relation rows start.
    pub relation: RelationInit,
    /// The node rows' format at rest: each drawn value is rounded to its nearest (relation
    /// rows stay f32).
    pub node_dtype: crate::Dtype,
}

/// The default node scale: normal with std 0.001, PyTorch-BigGraph's `init_scale = 1e-3` and
/// the GPU anchor system's scale without NVMe (its NVMe path uses 0.01; set
/// [`Init::node`] for that).
pub const DEFAULT_NODE_INIT: Distribution = Distribution::Normal { std: 1e-3 };

impl Default for Init {
    fn default() -> Self {
        Init {
            seed: 0,
            node: DEFAULT_NODE_INIT,
            relation: RelationInit::Identity,
            node_dtype: crate::Dtype::F32,
        }
    }
}

impl Init {
    /// Writes the initial value of node row `row` (global id) into `out`.
    pub fn node_row(&self, row: u64, out: &mut [f32]) {
        fill_row(self.seed, Table::Node, row, self.node, out);
        if self.node_dtype.is_narrow() {
            out.iter_mut()
                .for_each(|x| *x = self.node_dtype.round_nearest(*x));
        }
    }

    /// Writes the initial value of relation row `row` of `table` for `decoder` into `out`
    /// ([`crate::Decoder::relation_width`] floats).
    pub fn relation_row(&self, decoder: crate::Decoder, table: Table, row: u64, out: &mut [f32]) {
        match self.relation {
            // RotatE's relations are phases: random ones are uniform over the circle (Sun et
            // al.'s initialisation); the unused second half stays zero.
            RelationInit::Random(_) if decoder == crate::Decoder::RotatE => {
                let half = out.len() / 2;
                let bound = std::f32::consts::PI;
                fill_row(
                    self.seed,
                    table,
                    row,
                    Distribution::Uniform { bound },
                    &mut out[..half],
                );
                out[half..].fill(0.0);
            }
            RelationInit::Random(dist) => fill_row(self.seed, table, row, dist, out),
            // RESCAL: the identity matrix, under which sᵀRd is the plain dot model.
            RelationInit::Identity if decoder == crate::Decoder::Rescal => {
                out.fill(0.0);
                let dim = out.len().isqrt();
                out.iter_mut().step_by(dim + 1).for_each(|x| *x = 1.0);
            }
            RelationInit::Identity => {
                use crate::Decoder;
                let ones = match decoder {
                    // RotatE: zero phases, no rotation.
                    Decoder::Dot | Decoder::TransEL1 | Decoder::TransEL2 | Decoder::RotatE => 0,
                    Decoder::Rescal => unreachable!("the identity matrix, above"),
                    Decoder::DistMult => out.len(),
                    // Real halves first: 1 + 0i in every complex element.
                    Decoder::ComplEx => out.len() / 2,
                };
                out[..ones].fill(1.0);
                out[ones..].fill(0.0);
            }
        }
    }
}

/// Fills `out` with row `row` of `table` drawn from `dist` (see the module docs for the hash).
pub fn fill_row(seed: u64, table: Table, row: u64, dist: Distribution, out: &mut [f32]) {
    let key = row_key(seed, table, row);
    for (t, o) in out.iter_mut().enumerate() {
        let bits = draw(key, t as u64);
        *o = match dist {
            Distribution::Uniform { bound } => {
                let u = ((bits >> 40) as f32 + 0.5) * (1.0 / (1u64 << 24) as f32);
                bound * (2.0 * u - 1.0)
            }
            Distribution::Normal { std } => {
                let scale = 1.0 / (1u64 << 32) as f64;
                let u1 = ((bits >> 32) as f64 + 0.5) * scale;
                let u2 = (bits & 0xffff_ffff) as f64 * scale;
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                (std as f64 * z) as f32
            }
        };
    }
}

#[inline]
fn row_key(seed: u64, table: Table, row: u64) -> u64 {
    mix(mix(seed.wrapping_add((table.tag() + 1).wrapping_mul(GOLDEN))) ^ row)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Decoder;

    #[test]
    fn rows_do_not_depend_on_call_order() {
        let init = Init {
            seed: 42,
            ..Init::default()
        };
        let dim = 16;
        let ids: Vec<u64> = (0..200).map(|i| i * 7919 % 1000).collect();
        let forward: Vec<Vec<f32>> = ids
            .iter()
            .map(|&id| {
                let mut r = vec![0.0; dim];
                init.node_row(id, &mut r);
                r
            })
            .collect();
        for (i, &id) in ids.iter().enumerate().rev() {
            let mut r = vec![0.0; dim];
            init.node_row(id, &mut r);
            assert_eq!(r, forward[i]);
        }
        // A shorter row is a prefix: elements are independent of the row length.
        let mut short = vec![0.0; 5];
        init.node_row(ids[3], &mut short);
        assert_eq!(short[..], forward[3][..5]);
    }

    #[test]
    fn seeds_and_tables_give_different_streams() {
        let d = Distribution::Normal { std: 1.0 };
        let row = |seed, table, id| {
            let mut r = vec![0.0f32; 8];
            fill_row(seed, table, id, d, &mut r);
            r
        };
        let base = row(1, Table::Node, 5);
        assert_ne!(base, row(2, Table::Node, 5));
        assert_ne!(base, row(1, Table::Relation, 5));
        assert_ne!(base, row(1, Table::Node, 6));
    }

    #[test]
    fn moments_match_the_distribution() {
        let n = 200_000usize;
        let mut normal = vec![0.0f32; n];
        let mut uniform = vec![0.0f32; n];
        // One long row of each: elements of a row are as independent as rows are.
        fill_row(
            9,
            Table::Node,
            0,
            Distribution::Normal { std: 2.0 },
            &mut normal,
        );
        fill_row(
            9,
            Table::Node,
            1,
            Distribution::Uniform { bound: 3.0 },
            &mut uniform,
        );
        let moments = |v: &[f32]| {
            let m = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / v.len() as f64;
            (m, var)
        };
        let (m, var) = moments(&normal);
        assert!(m.abs() < 0.02 && (var - 4.0).abs() < 0.06, "{m} {var}");
        let (m, var) = moments(&uniform);
        assert!(m.abs() < 0.02 && (var - 3.0).abs() < 0.05, "{m} {var}");
        assert!(uniform.iter().all(|x| x.abs() < 3.0));
    }

    #[test]
    fn identity_relations_are_neutral() {
        let init = Init::default();
        let (s, d) = ([0.3f32, -0.2, 0.5, 0.1], [0.7f32, 0.4, -0.6, 0.2]);
        for decoder in Decoder::ALL {
            let mut r = vec![9.0; decoder.relation_width(4)];
            init.relation_row(decoder, Table::Relation, 3, &mut r);
            let want = match decoder.comparator() {
                crate::Comparator::Dot => Decoder::Dot.score(&s, &[], &d),
                _ => decoder.score(&s, &[0.0; 4], &d),
            };
            assert_eq!(decoder.score(&s, &r, &d), want, "{decoder}");
        }
    }
}
