//! Blocked scoring of many query vectors against many candidate rows.
//!
//! One kernel serves all three comparators. Its key property is that the score of a pair
//! (query, candidate) is bit-for-bit the same whether it is computed inside a large block or
//! alone through [`Kernel::one`]: every pair has its own accumulators, updated by the same
//! operations in the same order, and floating-point operations are never reassociated. Ranking
//! relies on this: the true entity's score (the threshold) and the scores of filtered
//! candidates are recomputed alone and must equal what the block counted, or exact ties would
//! be missed and filtered triples would be subtracted from the wrong bucket. An external sgemm
//! gives no such guarantee, which is why the dot product lives here too.

use std::marker::PhantomData;

use legend_model::Comparator;

/// Accumulator lanes per pair: one AVX register of f32.
const LANES: usize = 8;
/// Queries per register tile.
const TILE_Q: usize = 4;
/// Candidates per register tile (4 × 2 tiles keep 8 accumulators plus operands in 16 registers).
const TILE_C: usize = 2;

/// A comparator fixed for one evaluation, with the instruction set chosen once.
///
/// Public so that other consumers of trained tables (queries on a run: legend-query) score
/// candidates exactly as the evaluator does, bit for bit.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    comparator: Comparator,
    dim: usize,
    /// AVX2 + FMA available; chosen once so every score of a run takes the same path.
    wide: bool,
}

impl Kernel {
    /// A kernel for rows of `dim` floats.
    pub fn new(comparator: Comparator, dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        let wide = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        Kernel {
            comparator,
            dim,
            wide,
        }
    }

    /// Writes the score of every query row against every candidate row into `out`
    /// (row-major, one row of `candidates.len() / dim` scores per query).
    ///
    /// `queries` and `candidates` hold whole rows of `dim` floats, and `out` has room for
    /// every pair.
    pub fn block(&self, queries: &[f32], candidates: &[f32], out: &mut [f32]) {
        debug_assert_eq!(
            out.len(),
            queries.len() / self.dim * (candidates.len() / self.dim)
        );
        if self.comparator == Comparator::NegModulus {
            // RotatE: no tiled kernel yet; each pair by the comparator itself, which gives
            // the same floats wherever the pair sits.
            let pairs = queries
                .chunks_exact(self.dim)
                .flat_map(|q| candidates.chunks_exact(self.dim).map(move |c| (q, c)));
            for (o, (q, c)) in out.iter_mut().zip(pairs) {
                *o = self.comparator.compare(q, c);
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.wide {
            // SAFETY: `wide` is set only when the CPU reports AVX2 and FMA.
            unsafe { block_wide(self.comparator, self.dim, queries, candidates, out) };
            return;
        }
        block_portable(self.comparator, self.dim, queries, candidates, out);
    }

    /// The comparator it scores with.
    pub fn comparator(&self) -> Comparator {
        self.comparator
    }

    /// Whether each element's step is a fused multiply-add (the AVX2 + FMA path) rather than a
    /// rounded multiply and a rounded add: what another implementation must do to give the
    /// same scores bit for bit (legend-cuda's query scan).
    pub fn fused(&self) -> bool {
        self.wide
    }

    /// The score of one pair, bit-identical to the value [`Kernel::block`] gives for it.
    pub fn one(&self, query: &[f32], candidate: &[f32]) -> f32 {
        let mut out = [0.0];
        self.block(query, candidate, &mut out);
        out[0]
    }
}

/// The per-element update and final transform of a comparator.
trait Op {
    /// Selects the vector form of `step` in the wide kernel (a constant, folded away).
    const KIND: Comparator;
    fn step<const FMA: bool>(acc: f32, q: f32, c: f32) -> f32;
    fn finish(sum: f32) -> f32;
}

struct DotOp;
struct L1Op;
struct L2Op;

impl Op for DotOp {
    const KIND: Comparator = Comparator::Dot;
    #[inline(always)]
    fn step<const FMA: bool>(acc: f32, q: f32, c: f32) -> f32 {
        // Without hardware FMA, `mul_add` becomes a slow library call.
        if FMA { q.mul_add(c, acc) } else { q * c + acc }
    }
    #[inline(always)]
    fn finish(sum: f32) -> f32 {
        sum
    }
}

impl Op for L1Op {
    const KIND: Comparator = Comparator::NegL1;
    #[inline(always)]
    fn step<const FMA: bool>(acc: f32, q: f32, c: f32) -> f32 {
        acc + (q - c).abs()
    }
    #[inline(always)]
    fn finish(sum: f32) -> f32 {
        -sum
    }
}

impl Op for L2Op {
    const KIND: Comparator = Comparator::NegL2;
    #[inline(always)]
    fn step<const FMA: bool>(acc: f32, q: f32, c: f32) -> f32 {
        let d = q - c;
        if FMA { d.mul_add(d, acc) } else { d * d + acc }
    }
    #[inline(always)]
    fn finish(sum: f32) -> f32 {
        -sum.sqrt()
    }
}

/// Computes one register tile of scores.
trait Micro {
    fn tile<const Q: usize, const C: usize>(
        dim: usize,
        qs: [&[f32]; Q],
        cs: [&[f32]; C],
    ) -> [[f32; C]; Q];
}

/// Plain Rust, any CPU.
struct Portable<O>(PhantomData<O>);

impl<O: Op> Micro for Portable<O> {
    #[inline(always)]
    fn tile<const Q: usize, const C: usize>(
        dim: usize,
        qs: [&[f32]; Q],
        cs: [&[f32]; C],
    ) -> [[f32; C]; Q] {
        let qv: [&[[f32; LANES]]; Q] = std::array::from_fn(|a| qs[a][..dim].as_chunks().0);
        let cv: [&[[f32; LANES]]; C] = std::array::from_fn(|b| cs[b][..dim].as_chunks().0);
        let nk = dim / LANES;
        let mut acc = [[[0.0f32; LANES]; C]; Q];
        for k in 0..nk {
            for a in 0..Q {
                for b in 0..C {
                    for l in 0..LANES {
                        acc[a][b][l] = O::step::<false>(acc[a][b][l], qv[a][k][l], cv[b][k][l]);
                    }
                }
            }
        }
        let mut out = [[0.0f32; C]; Q];
        for a in 0..Q {
            for b in 0..C {
                out[a][b] = reduce::<O, false>(&acc[a][b], qs[a], cs[b], nk * LANES, dim);
            }
        }
        out
    }
}

/// Sums the lanes in a fixed order, adds the elements past the last full lane group, and
/// applies the comparator's final transform.
#[inline(always)]
fn reduce<O: Op, const FMA: bool>(
    v: &[f32; LANES],
    q: &[f32],
    c: &[f32],
    from: usize,
    dim: usize,
) -> f32 {
    let sum = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
    let mut tail = 0.0;
    for k in from..dim {
        tail = O::step::<FMA>(tail, q[k], c[k]);
    }
    O::finish(sum + tail)
}

/// AVX2 + FMA intrinsics; only instantiated under `block_wide`.
#[cfg(target_arch = "x86_64")]
struct Wide<O>(PhantomData<O>);

#[cfg(target_arch = "x86_64")]
impl<O: Op> Micro for Wide<O> {
    #[inline(always)]
    fn tile<const Q: usize, const C: usize>(
        dim: usize,
        qs: [&[f32]; Q],
        cs: [&[f32]; C],
    ) -> [[f32; C]; Q] {
        // SAFETY: `Wide` is used only by `block_wide`, which runs only on CPUs that reported
        // AVX2 and FMA.
        unsafe { micro_wide::<O, Q, C>(dim, qs, cs) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn micro_wide<O: Op, const Q: usize, const C: usize>(
    dim: usize,
    qs: [&[f32]; Q],
    cs: [&[f32]; C],
) -> [[f32; C]; Q] {
    use std::arch::x86_64::*;
    let nk = dim / LANES;
    let mut qv: [&[[f32; LANES]]; Q] = [&[]; Q];
    for a in 0..Q {
        qv[a] = qs[a][..dim].as_chunks().0;
    }
    let mut cv: [&[[f32; LANES]]; C] = [&[]; C];
    for b in 0..C {
        cv[b] = cs[b][..dim].as_chunks().0;
    }
    let sign = _mm256_set1_ps(-0.0);
    let mut acc = [[_mm256_setzero_ps(); C]; Q];
    let mut q = [_mm256_setzero_ps(); Q];
    let mut c = [_mm256_setzero_ps(); C];
    for k in 0..nk {
        for a in 0..Q {
            // SAFETY: a `[f32; 8]` is valid for an unaligned 8-float load.
            q[a] = unsafe { _mm256_loadu_ps(qv[a][k].as_ptr()) };
        }
        for b in 0..C {
            // SAFETY: as above.
            c[b] = unsafe { _mm256_loadu_ps(cv[b][k].as_ptr()) };
        }
        for a in 0..Q {
            for b in 0..C {
                // The same operations, in the same order, as `Op::step::<true>` on each lane.
                acc[a][b] = match O::KIND {
                    Comparator::Dot => _mm256_fmadd_ps(q[a], c[b], acc[a][b]),
                    Comparator::NegL1 => {
                        let d = _mm256_andnot_ps(sign, _mm256_sub_ps(q[a], c[b]));
                        _mm256_add_ps(acc[a][b], d)
                    }
                    Comparator::NegL2 => {
                        let d = _mm256_sub_ps(q[a], c[b]);
                        _mm256_fmadd_ps(d, d, acc[a][b])
                    }
                    Comparator::NegModulus => unreachable!("no Op has this kind"),
                };
            }
        }
    }
    let mut out = [[0.0f32; C]; Q];
    for a in 0..Q {
        for b in 0..C {
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` is valid for an unaligned 8-float store.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[a][b]) };
            out[a][b] = reduce::<O, true>(&lanes, qs[a], cs[b], nk * LANES, dim);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn block_wide(cmp: Comparator, dim: usize, queries: &[f32], cands: &[f32], out: &mut [f32]) {
    match cmp {
        Comparator::Dot => tiles::<Wide<DotOp>>(dim, queries, cands, out),
        Comparator::NegL1 => tiles::<Wide<L1Op>>(dim, queries, cands, out),
        Comparator::NegL2 => tiles::<Wide<L2Op>>(dim, queries, cands, out),
        Comparator::NegModulus => unreachable!("scored pair by pair in Kernel::block"),
    }
}

fn block_portable(cmp: Comparator, dim: usize, queries: &[f32], cands: &[f32], out: &mut [f32]) {
    match cmp {
        Comparator::Dot => tiles::<Portable<DotOp>>(dim, queries, cands, out),
        Comparator::NegL1 => tiles::<Portable<L1Op>>(dim, queries, cands, out),
        Comparator::NegL2 => tiles::<Portable<L2Op>>(dim, queries, cands, out),
        Comparator::NegModulus => unreachable!("scored pair by pair in Kernel::block"),
    }
}

/// Walks the query × candidate grid in register tiles, with narrower tiles at the edges.
#[inline(always)]
fn tiles<M: Micro>(dim: usize, queries: &[f32], cands: &[f32], out: &mut [f32]) {
    let nq = queries.len() / dim;
    let nc = cands.len() / dim;
    let q_row = |i: usize| &queries[i * dim..(i + 1) * dim];
    let mut i = 0;
    while i < nq {
        if i + TILE_Q <= nq {
            let qs: [&[f32]; TILE_Q] = std::array::from_fn(|a| q_row(i + a));
            row_of_tiles::<M, TILE_Q>(dim, qs, cands, &mut out[i * nc..]);
            i += TILE_Q;
        } else {
            row_of_tiles::<M, 1>(dim, [q_row(i)], cands, &mut out[i * nc..]);
            i += 1;
        }
    }
}

#[inline(always)]
fn row_of_tiles<M: Micro, const Q: usize>(
    dim: usize,
    qs: [&[f32]; Q],
    cands: &[f32],
    out: &mut [f32],
) {
    let nc = cands.len() / dim;
    let c_row = |j: usize| &cands[j * dim..(j + 1) * dim];
    let mut j = 0;
    while j + TILE_C <= nc {
        let cs: [&[f32]; TILE_C] = std::array::from_fn(|b| c_row(j + b));
        let s = M::tile::<Q, TILE_C>(dim, qs, cs);
        for (a, row) in s.iter().enumerate() {
            out[a * nc + j..a * nc + j + TILE_C].copy_from_slice(row);
        }
        j += TILE_C;
    }
    while j < nc {
        let s = M::tile::<Q, 1>(dim, qs, [c_row(j)]);
        for (a, row) in s.iter().enumerate() {
            out[a * nc + j] = row[0];
        }
        j += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, dim: usize, salt: u32) -> Vec<f32> {
        (0..n * dim)
            .map(|k| (((k as u32).wrapping_mul(2654435761) ^ salt) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn block_matches_the_comparator_and_is_bit_identical_to_one() {
        for dim in [1, 7, 8, 13, 24] {
            let (nq, nc) = (7, 5);
            let q = rows(nq, dim, 3);
            let c = rows(nc, dim, 11);
            let modulus = dim.is_multiple_of(2).then_some(Comparator::NegModulus);
            let comparators = [Comparator::Dot, Comparator::NegL1, Comparator::NegL2];
            for cmp in comparators.into_iter().chain(modulus) {
                // Both paths: the portable one is what CPUs without AVX2 + FMA run.
                for wide in [false, Kernel::new(cmp, dim).wide] {
                    let kernel = Kernel {
                        comparator: cmp,
                        dim,
                        wide,
                    };
                    let mut out = vec![0.0; nq * nc];
                    kernel.block(&q, &c, &mut out);
                    for i in 0..nq {
                        for j in 0..nc {
                            let (qi, cj) = (&q[i * dim..][..dim], &c[j * dim..][..dim]);
                            let got = out[i * nc + j];
                            assert_eq!(got.to_bits(), kernel.one(qi, cj).to_bits());
                            let want = cmp.compare(qi, cj);
                            assert!((got - want).abs() < 1e-4, "{cmp:?} d{dim}: {got} {want}");
                        }
                    }
                }
            }
        }
    }
}
