//! Ranking the true entity of each query by counting the candidates that beat or tie it.

use legend_model::{Decoder, Side};
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use rayon::prelude::*;

use crate::kernel::Kernel;
use crate::{FilterIndex, SampledNegatives};

/// Queries scored together against each candidate block (filtered protocol).
const QUERY_BLOCK: usize = 64;
/// Candidate rows per block: 256 rows of d = 200 stay in L2 while 64 queries sweep them.
const CANDIDATE_BLOCK: usize = 256;
/// Test triples that share one draw of sampled negatives per side (as PBG/Marius share
/// negatives within a chunk). Fixed, so results never depend on the thread count.
pub const SAMPLED_CHUNK: usize = 1000;

/// Validated inputs: tables, dimension and the kernel for the decoder's comparator.
pub(crate) struct Model<'a> {
    pub(crate) decoder: Decoder,
    pub(crate) kernel: Kernel,
    pub(crate) entities: &'a [f32],
    pub(crate) relations: &'a [f32],
    pub(crate) dim: usize,
    pub(crate) num_entities: usize,
    /// Reciprocal relations: source queries go through r⁻¹, row `inverse + r`.
    pub(crate) inverse: Option<usize>,
}

impl Model<'_> {
    fn entity(&self, e: u32) -> &[f32] {
        &self.entities[e as usize * self.dim..][..self.dim]
    }

    /// Writes the query of `triple` for `side` into `out`; returns (anchor, rel, true entity).
    fn query(&self, triple: [u32; 3], side: Side, out: &mut [f32]) -> (u32, u32, u32) {
        let [s, r, d] = triple;
        let (anchor, truth) = match side {
            Side::Dst => (s, d),
            Side::Src => (d, s),
        };
        // With reciprocal relations (s, r, ?) and (d, r⁻¹, ?) are both destination queries.
        let (row, side) = match (side, self.inverse) {
            (Side::Src, Some(inverse)) => (inverse + r as usize, Side::Dst),
            _ => (r as usize, side),
        };
        let rw = self.decoder.relation_width(self.dim);
        let rel = &self.relations[row * rw..][..rw];
        self.decoder.query(side, self.entity(anchor), rel, out);
        (anchor, r, truth)
    }
}

/// Candidates that beat (`above`) or tie (`tied`) the true entity in one query.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) above: u64,
    pub(crate) tied: u64,
    /// Some score of the query (the true one or any candidate's) was NaN.
    pub(crate) nan: bool,
}

impl Tally {
    /// The realistic rank: the mean of the optimistic (1 + above) and pessimistic
    /// (1 + above + tied) ranks.
    pub(crate) fn rank(&self) -> f64 {
        1.0 + self.above as f64 + self.tied as f64 / 2.0
    }

    /// Counts a row of candidate scores against the true score.
    fn add_row(&mut self, scores: &[f32], truth: f32) {
        let (mut above, mut tied, mut nan) = (0u64, 0u64, false);
        for &s in scores {
            let (a, t) = classify(s, truth);
            above += u64::from(a);
            tied += u64::from(t);
            nan |= s.is_nan();
        }
        self.above += above;
        self.tied += tied;
        self.nan |= nan;
    }

    /// Takes back one candidate that `add_row` counted with the same score.
    fn remove(&mut self, score: f32, truth: f32) {
        let (a, t) = classify(score, truth);
        self.above -= u64::from(a);
        self.tied -= u64::from(t);
    }
}

/// (beats, ties) for a candidate score against the true score. A NaN on either side counts as
/// beating the true entity, so a NaN never flatters: a NaN true score ranks last.
#[inline(always)]
fn classify(score: f32, truth: f32) -> (bool, bool) {
    (
        score > truth || score.is_nan() || truth.is_nan(),
        score == truth,
    )
}

/// Filtered ranking of both sides of every triple over all entities: query `2 i` corrupts the
/// destination of `triples[i]`, query `2 i + 1` its source.
pub(crate) fn filtered(
    model: &Model<'_>,
    triples: &[[u32; 3]],
    filter: &FilterIndex,
    progress: &(dyn Fn(u64) + Sync),
) -> Vec<Tally> {
    let num_queries = triples.len() * 2;
    let blocks: Vec<Vec<Tally>> = (0..num_queries.div_ceil(QUERY_BLOCK))
        .into_par_iter()
        .map(|b| {
            let first = b * QUERY_BLOCK;
            let count = QUERY_BLOCK.min(num_queries - first);
            let tallies = filtered_block(model, triples, filter, first, count);
            progress(count as u64);
            tallies
        })
        .collect();
    blocks.concat()
}

fn filtered_block(
    model: &Model<'_>,
    triples: &[[u32; 3]],
    filter: &FilterIndex,
    first: usize,
    count: usize,
) -> Vec<Tally> {
    let dim = model.dim;
    let mut queries = vec![0.0f32; count * dim];
    let mut keys = Vec::with_capacity(count);
    let mut truths = Vec::with_capacity(count);
    for (slot, q) in queries.chunks_exact_mut(dim).enumerate() {
        let i = first + slot;
        let side = if i.is_multiple_of(2) {
            Side::Dst
        } else {
            Side::Src
        };
        let (anchor, rel, truth) = model.query(triples[i / 2], side, q);
        let score = model.kernel.one(q, model.entity(truth));
        keys.push((side, anchor, rel));
        truths.push((truth, score));
    }
    let mut tallies: Vec<Tally> = truths
        .iter()
        .map(|&(_, t)| Tally {
            nan: t.is_nan(),
            ..Tally::default()
        })
        .collect();

    let mut scores = vec![0.0f32; count * CANDIDATE_BLOCK];
    for block in model.entities.chunks(CANDIDATE_BLOCK * dim) {
        let width = block.len() / dim;
        let scores = &mut scores[..count * width];
        model.kernel.block(&queries, block, scores);
        for ((tally, row), &(_, truth)) in tallies
            .iter_mut()
            .zip(scores.chunks_exact(width))
            .zip(&truths)
        {
            tally.add_row(row, truth);
        }
    }

    // The sweep counted every entity; take back the true entity itself and the other known
    // true triples. Their scores are recomputed bit-identically (see `kernel`).
    for (slot, tally) in tallies.iter_mut().enumerate() {
        let q = &queries[slot * dim..][..dim];
        let (side, anchor, rel) = keys[slot];
        let (truth, truth_score) = truths[slot];
        tally.remove(truth_score, truth_score);
        for &c in filter.candidates(side, anchor, rel) {
            if c != truth {
                tally.remove(model.kernel.one(q, model.entity(c)), truth_score);
            }
        }
    }
    tallies
}

/// Draws degree-proportional entities: a binary search in the cumulative degrees.
pub(crate) struct DegreeSampler {
    cumulative: Vec<u64>,
}

impl DegreeSampler {
    /// `None` when every degree is zero.
    pub(crate) fn new(degrees: &[u32]) -> Option<DegreeSampler> {
        let mut total = 0u64;
        let cumulative: Vec<u64> = degrees
            .iter()
            .map(|&d| {
                total += u64::from(d);
                total
            })
            .collect();
        (total > 0).then_some(DegreeSampler { cumulative })
    }

    fn draw(&self, rng: &mut ChaCha8Rng) -> u32 {
        let total = *self
            .cumulative
            .last()
            .expect("a sampler has a positive total");
        let x = rng.random_range(0..total);
        // The first entity whose cumulative degree exceeds x; zero-degree entities are skipped.
        self.cumulative.partition_point(|&c| c <= x) as u32
    }
}

/// Sampled ranking: each chunk of [`SAMPLED_CHUNK`] triples and each side draws its own
/// negatives from a ChaCha8 stream numbered `2 × chunk + side` under the seed, so the draw
/// depends only on the seed and the triple order. Negatives are not filtered.
pub(crate) fn sampled(
    model: &Model<'_>,
    triples: &[[u32; 3]],
    negatives: &SampledNegatives,
    degrees: Option<&DegreeSampler>,
    progress: &(dyn Fn(u64) + Sync),
) -> Vec<Tally> {
    let chunks: Vec<Vec<Tally>> = triples
        .par_chunks(SAMPLED_CHUNK)
        .enumerate()
        .map(|(c, chunk)| {
            let mut out = vec![Tally::default(); chunk.len() * 2];
            for (side_index, side) in [Side::Dst, Side::Src].into_iter().enumerate() {
                let mut rng = ChaCha8Rng::seed_from_u64(negatives.seed);
                rng.set_stream(2 * c as u64 + side_index as u64);
                let drawn = draw_negatives(model, negatives, degrees, &mut rng);
                let tallies = sampled_side(model, chunk, side, &drawn);
                for (i, t) in tallies.into_iter().enumerate() {
                    out[2 * i + side_index] = t;
                }
                progress(chunk.len() as u64);
            }
            out
        })
        .collect();
    chunks.concat()
}

/// The rows of `uniform` uniform and `degree` degree-proportional entities, with replacement.
fn draw_negatives(
    model: &Model<'_>,
    negatives: &SampledNegatives,
    degrees: Option<&DegreeSampler>,
    rng: &mut ChaCha8Rng,
) -> Vec<f32> {
    let mut rows = Vec::with_capacity((negatives.uniform + negatives.degree) * model.dim);
    for _ in 0..negatives.uniform {
        let e = rng.random_range(0..model.num_entities) as u32;
        rows.extend_from_slice(model.entity(e));
    }
    if let Some(sampler) = degrees {
        for _ in 0..negatives.degree {
            rows.extend_from_slice(model.entity(sampler.draw(rng)));
        }
    }
    rows
}

fn sampled_side(
    model: &Model<'_>,
    chunk: &[[u32; 3]],
    side: Side,
    negatives: &[f32],
) -> Vec<Tally> {
    let dim = model.dim;
    let width = negatives.len() / dim;
    let mut tallies = Vec::with_capacity(chunk.len());
    let mut queries = vec![0.0f32; QUERY_BLOCK * dim];
    let mut scores = vec![0.0f32; QUERY_BLOCK * width];
    for part in chunk.chunks(QUERY_BLOCK) {
        let queries = &mut queries[..part.len() * dim];
        let mut truths = Vec::with_capacity(part.len());
        for (&t, q) in part.iter().zip(queries.chunks_exact_mut(dim)) {
            let (_, _, truth) = model.query(t, side, q);
            truths.push(model.kernel.one(q, model.entity(truth)));
        }
        let scores = &mut scores[..part.len() * width];
        model.kernel.block(queries, negatives, scores);
        for (row, &truth) in scores.chunks_exact(width).zip(&truths) {
            let mut tally = Tally {
                nan: truth.is_nan(),
                ..Tally::default()
            };
            tally.add_row(row, truth);
            tallies.push(tally);
        }
    }
    tallies
}
