//! Link-prediction evaluation of Legend embeddings: MRR, mean rank and Hits@k under two
//! protocols.
//!
//! * **Filtered** ([`Protocol::Filtered`]): for each triple `[s, r, d]` and each corruption side,
//!   the true entity is ranked against *every* entity, after removing the entities that form
//!   another known true triple (from a [`FilterIndex`] over train + valid + test). This is the
//!   standard protocol for small and medium graphs (FB15k-237, WN18RR, ...).
//! * **Sampled** ([`Protocol::Sampled`]): the true entity is ranked against `uniform` entities
//!   drawn uniformly and `degree` entities drawn proportionally to their degree, from the whole
//!   graph, as PyTorch-BigGraph and Marius do for graphs too large for full ranking. As in those
//!   systems the negatives are **not filtered**: a drawn negative may be a known true entity,
//!   even the true entity itself (which then ties with it). Negatives are drawn with
//!   replacement, once per chunk of [`SAMPLED_CHUNK`] triples and side, from a ChaCha8 stream
//!   fixed by the seed and the chunk number, so the figures depend only on the embeddings, the
//!   triples (and their order) and the seed: never on the thread count. At most as many
//!   negatives as the graph has entities are drawn: larger requests are reduced in proportion
//!   ([`SampledNegatives::capped`]) with a `tracing` warning naming the numbers, and
//!   [`Metrics`] reports the numbers used.
//!
//! Both sides of every triple are ranked (destination first, then source), and the metrics
//! average over all those queries: [`Metrics::count`] is twice [`Metrics::triples`].
//!
//! **Ties** are resolved *realistically*: the rank is the mean of the optimistic rank
//! (1 + candidates scoring strictly higher) and the pessimistic rank (that plus the candidates
//! scoring equally), so a constant model cannot look perfect. Hits@k counts ranks `<= k`
//! with that rank (a two-way tie for first, rank 1.5, is not a hit at 1).
//!
//! **NaN** scores never flatter: a candidate with a NaN score counts as beating the true
//! entity, and a NaN true score is beaten by every candidate (rank = number of candidates).
//! [`Metrics::nan_queries`] counts the queries where any NaN appeared, so a caller can warn.
//!
//! Scoring is blocked: query vectors are built for a block of queries
//! ([`legend_model::Decoder::query`]), then compared with blocks of candidate rows by one
//! register-tiled kernel (AVX2 + FMA where the CPU has them) for the dot product and both TransE
//! distances; ranks are counted, never sorted.

mod error;
mod filter;
mod kernel;
mod rank;

use legend_model::Decoder;
use serde::{Deserialize, Serialize};

pub use error::EvalError;
pub use filter::{FilterIndex, entity_degrees};
pub use kernel::Kernel;
pub use rank::SAMPLED_CHUNK;

/// Trained embeddings to evaluate.
#[derive(Clone, Copy, Debug)]
pub struct Embeddings<'a> {
    /// The model's score function.
    pub decoder: Decoder,
    /// Entity rows, row-major `[num_entities × dim]`.
    pub entities: &'a [f32],
    /// Relation rows, row-major `[num_relations × width]` with `width` the decoder's
    /// [`Decoder::relation_width`] (`dim`; RESCAL's `dim²` matrices); ignored (may be empty)
    /// for [`Decoder::Dot`].
    pub relations: &'a [f32],
    /// Floats per row.
    pub dim: usize,
    /// Reciprocal relations: `relations` holds `2 × R` rows, the inverse of relation `r` at
    /// row `R + r`, and a source query `(?, r, d)` is answered as `(d, r⁻¹, ?)`.
    pub reciprocal: bool,
}

/// The seed of sampled negatives when none is given.
pub const DEFAULT_SEED: u64 = 0x1e6e_d5ee_d000_0001;

/// How many negatives the sampled protocol draws, and from which seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampledNegatives {
    /// Negatives drawn uniformly over all entities (per chunk and side).
    pub uniform: usize,
    /// Negatives drawn proportionally to entity degree (per chunk and side).
    pub degree: usize,
    /// Seed of the draw.
    pub seed: u64,
}

impl SampledNegatives {
    /// These negatives with at most `num_entities` in all (`uniform + degree`), the cap shared
    /// between uniform and degree negatives in the proportion asked for, the seed kept.
    ///
    /// Negatives are drawn with replacement and unfiltered, so asking for more than a graph has
    /// entities draws every entity, the true one and the other known answers included, many
    /// times over, and the sampled figures collapse (UMLS, 135 entities, 1000 + 1000 negatives:
    /// MRR 0.009 where the filtered MRR is 0.94). A caller can compare the result with `self`
    /// to tell the user; full ranking ([`Protocol::Filtered`]) is cheap at that size anyway.
    ///
    /// ```
    /// use legend_eval::SampledNegatives;
    ///
    /// let asked = SampledNegatives::default(); // 1000 + 1000
    /// let fitted = asked.capped(135);
    /// assert_eq!((fitted.uniform, fitted.degree), (67, 68));
    /// assert_eq!(asked.capped(1_000_000), asked);
    /// ```
    #[must_use]
    pub fn capped(self, num_entities: usize) -> SampledNegatives {
        let total = self.uniform as u128 + self.degree as u128;
        if total <= num_entities as u128 {
            return self;
        }
        // Rounded down, so uniform never exceeds its share; degree takes the rest.
        let uniform = (self.uniform as u128 * num_entities as u128 / total) as usize;
        SampledNegatives {
            uniform,
            degree: num_entities - uniform,
            seed: self.seed,
        }
    }
}

impl Default for SampledNegatives {
    /// 1000 uniform + 1000 degree-proportional negatives (the PBG/Marius setting), seed
    /// [`DEFAULT_SEED`].
    fn default() -> Self {
        SampledNegatives {
            uniform: 1000,
            degree: 1000,
            seed: DEFAULT_SEED,
        }
    }
}

/// The evaluation protocol, with the data it needs.
#[derive(Clone, Copy, Debug)]
pub enum Protocol<'a> {
    /// Full ranking over all entities, known true triples removed.
    Filtered {
        /// Known true triples (train + valid + test).
        filter: &'a FilterIndex,
    },
    /// Ranking against sampled negatives, unfiltered.
    Sampled {
        /// How many negatives, and the seed; reduced to the entity count when they exceed it
        /// (see [`SampledNegatives::capped`]).
        negatives: SampledNegatives,
        /// One degree per entity (see [`entity_degrees`]); may be empty when
        /// `negatives.degree` is 0.
        degrees: &'a [u32],
    },
}

/// The most floats of negative rows one chunk and side may gather (1 GiB); more is a typo, not
/// an evaluation protocol.
const MAX_NEGATIVE_FLOATS: usize = 1 << 28;

/// Which protocol produced a [`Metrics`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolKind {
    /// See [`Protocol::Filtered`].
    Filtered,
    /// See [`Protocol::Sampled`].
    Sampled,
}

/// How tied scores were ranked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ties {
    /// Mean of the optimistic and pessimistic rank.
    Realistic,
}

/// Link-prediction metrics, averaged over all ranked queries (both sides of every triple).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// The protocol used.
    pub protocol: ProtocolKind,
    /// Mean reciprocal rank.
    pub mrr: f64,
    /// Mean rank.
    pub mean_rank: f64,
    /// Fraction of queries with rank <= 1.
    pub hits_at_1: f64,
    /// Fraction of queries with rank <= 3.
    pub hits_at_3: f64,
    /// Fraction of queries with rank <= 10.
    pub hits_at_10: f64,
    /// Fraction of queries with rank <= 50.
    pub hits_at_50: f64,
    /// Fraction of queries with rank <= 100.
    pub hits_at_100: f64,
    /// Number of ranked queries: two per triple (destination and source corrupted).
    pub count: u64,
    /// Number of triples evaluated (`count / 2`).
    pub triples: u64,
    /// The tie rule.
    pub ties: Ties,
    /// Queries where a NaN score appeared (they are ranked as the worst case).
    pub nan_queries: u64,
    /// Sampled only: uniform negatives per chunk and side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uniform_negatives: Option<usize>,
    /// Sampled only: degree-proportional negatives per chunk and side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degree_negatives: Option<usize>,
    /// Sampled only: the seed of the draw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

/// Ranks both sides of every `[src, rel, dst]` triple under `protocol` and averages the
/// metrics, on a rayon pool of `threads` threads (0: one per CPU).
///
/// Fails, naming the problem, on a dimension the decoder rejects, a table whose size is not a
/// multiple of `dim`, an id out of range, a filter index or degree list built for another
/// number of entities, an impossible number of negatives, or an empty triple list.
///
/// ```
/// use legend_eval::{Embeddings, FilterIndex, Protocol, evaluate};
/// use legend_model::Decoder;
///
/// // Three entities on a line, one relation "+1" (TransE, dim 1).
/// let entities = [0.0, 1.0, 2.0];
/// let relations = [1.0];
/// let embeddings = Embeddings { decoder: Decoder::TransEL1, entities: &entities, relations: &relations, dim: 1, reciprocal: false };
/// let train = [[0, 0, 1]];
/// let test = [[1, 0, 2]];
/// let filter = FilterIndex::build(3, &[&train, &test])?;
/// let metrics = evaluate(&embeddings, &test, &Protocol::Filtered { filter: &filter }, 1)?;
/// assert_eq!((metrics.mrr, metrics.count, metrics.triples), (1.0, 2, 1));
/// # Ok::<(), legend_eval::EvalError>(())
/// ```
pub fn evaluate(
    embeddings: &Embeddings<'_>,
    triples: &[[u32; 3]],
    protocol: &Protocol<'_>,
    threads: usize,
) -> Result<Metrics, EvalError> {
    evaluate_with_progress(embeddings, triples, protocol, threads, &|_| {})
}

/// [`evaluate`], calling `progress(n)` each time `n` more queries have been ranked (from the
/// worker threads, in no particular order; the calls add up to `2 × triples.len()`), so that a
/// caller can show how far a long evaluation is. `progress` is not called when the inputs are
/// refused. The metrics do not depend on it.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use legend_eval::{Embeddings, FilterIndex, Protocol, evaluate_with_progress};
/// use legend_model::Decoder;
///
/// let entities = [0.0, 1.0, 2.0];
/// let embeddings = Embeddings { decoder: Decoder::TransEL1, entities: &entities, relations: &[1.0], dim: 1, reciprocal: false };
/// let test = [[0, 0, 1], [1, 0, 2]];
/// let filter = FilterIndex::build(3, &[&test])?;
/// let done = AtomicU64::new(0);
/// let protocol = Protocol::Filtered { filter: &filter };
/// evaluate_with_progress(&embeddings, &test, &protocol, 1, &|n| {
///     done.fetch_add(n, Ordering::Relaxed);
/// })?;
/// assert_eq!(done.into_inner(), 4);
/// # Ok::<(), legend_eval::EvalError>(())
/// ```
pub fn evaluate_with_progress(
    embeddings: &Embeddings<'_>,
    triples: &[[u32; 3]],
    protocol: &Protocol<'_>,
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Metrics, EvalError> {
    let model = validate(embeddings, triples)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let (tallies, kind, sampled) = match protocol {
        Protocol::Filtered { filter } => {
            if filter.num_entities() != model.num_entities {
                return Err(EvalError::FilterSize {
                    index: filter.num_entities(),
                    table: model.num_entities,
                });
            }
            let tallies = pool.install(|| rank::filtered(&model, triples, filter, progress));
            (tallies, ProtocolKind::Filtered, None)
        }
        Protocol::Sampled {
            negatives: asked,
            degrees,
        } => {
            if asked.uniform == 0 && asked.degree == 0 {
                return Err(EvalError::NoNegatives);
            }
            // More negatives than entities only adds copies: see `SampledNegatives::capped`.
            let negatives = &asked.capped(model.num_entities);
            if negatives != asked {
                tracing::warn!(
                    "the graph has {} entities, fewer than the {} uniform + {} degree negatives \
                     asked for: using {} uniform + {} degree (negatives are drawn with \
                     replacement, so more would rank each answer against copies of itself). \
                     Sampled ranks are unfiltered: other known answers count against each query, \
                     so on a small, dense graph they sit far below filtered ranks, and filtered \
                     ranking against every entity is cheap at this size",
                    model.num_entities,
                    asked.uniform,
                    asked.degree,
                    negatives.uniform,
                    negatives.degree
                );
            }
            match negatives.uniform.checked_add(negatives.degree) {
                // Each chunk and side gathers the rows of its negatives.
                Some(n)
                    if n.checked_mul(model.dim)
                        .is_some_and(|f| f <= MAX_NEGATIVE_FLOATS) => {}
                _ => {
                    return Err(EvalError::TooManyNegatives {
                        uniform: asked.uniform,
                        degree: asked.degree,
                    });
                }
            }
            let sampler = if negatives.degree > 0 {
                if degrees.len() != model.num_entities {
                    return Err(EvalError::DegreesLen {
                        len: degrees.len(),
                        table: model.num_entities,
                    });
                }
                Some(rank::DegreeSampler::new(degrees).ok_or(EvalError::ZeroDegrees)?)
            } else {
                None
            };
            let tallies = pool
                .install(|| rank::sampled(&model, triples, negatives, sampler.as_ref(), progress));
            (tallies, ProtocolKind::Sampled, Some(*negatives))
        }
    };
    Ok(summarize(&tallies, kind, sampled))
}

fn validate<'a>(e: &Embeddings<'a>, triples: &[[u32; 3]]) -> Result<rank::Model<'a>, EvalError> {
    e.decoder.check_dim(e.dim).map_err(EvalError::Dim)?;
    let rows = |table: &'static str, len: usize, width: usize| {
        if len == 0 || !len.is_multiple_of(width) {
            Err(EvalError::TableSize {
                table,
                len,
                dim: width,
            })
        } else {
            Ok(len / width)
        }
    };
    let num_entities = rows("entity", e.entities.len(), e.dim)?;
    // Dot has no relation parameters, so relation ids are only labels there.
    let num_relations = if e.decoder.uses_relations() {
        let rw = e.decoder.relation_width(e.dim);
        let rows = rows("relation", e.relations.len(), rw)?;
        if e.reciprocal && !rows.is_multiple_of(2) {
            return Err(EvalError::TableSize {
                table: "reciprocal relation",
                len: e.relations.len(),
                dim: 2 * rw,
            });
        }
        Some(if e.reciprocal { rows / 2 } else { rows })
    } else {
        None
    };
    if triples.is_empty() {
        return Err(EvalError::NoTriples);
    }
    for (index, t) in triples.iter().enumerate() {
        filter::check_entities(t, num_entities, || format!("triple {index}"))?;
        if let Some(limit) = num_relations
            && t[1] as usize >= limit
        {
            return Err(EvalError::IdOutOfRange {
                at: format!("triple {index}"),
                role: "relation",
                id: t[1],
                limit,
            });
        }
    }
    Ok(rank::Model {
        decoder: e.decoder,
        kernel: kernel::Kernel::new(e.decoder.comparator(), e.dim),
        entities: e.entities,
        relations: e.relations,
        dim: e.dim,
        num_entities,
        inverse: (e.reciprocal && e.decoder.uses_relations()).then(|| num_relations.unwrap_or(0)),
    })
}

/// Averages in query order, so the figures do not depend on how the work was split.
fn summarize(
    tallies: &[rank::Tally],
    protocol: ProtocolKind,
    sampled: Option<SampledNegatives>,
) -> Metrics {
    let (mut rr, mut ranks, mut nan) = (0.0f64, 0.0f64, 0u64);
    let mut hits = [0u64; 5];
    const KS: [f64; 5] = [1.0, 3.0, 10.0, 50.0, 100.0];
    for t in tallies {
        let rank = t.rank();
        rr += 1.0 / rank;
        ranks += rank;
        nan += u64::from(t.nan);
        for (h, k) in hits.iter_mut().zip(KS) {
            *h += u64::from(rank <= k);
        }
    }
    let n = tallies.len() as f64;
    let frac = |h: u64| h as f64 / n;
    Metrics {
        protocol,
        mrr: rr / n,
        mean_rank: ranks / n,
        hits_at_1: frac(hits[0]),
        hits_at_3: frac(hits[1]),
        hits_at_10: frac(hits[2]),
        hits_at_50: frac(hits[3]),
        hits_at_100: frac(hits[4]),
        count: tallies.len() as u64,
        triples: tallies.len() as u64 / 2,
        ties: Ties::Realistic,
        nan_queries: nan,
        uniform_negatives: sampled.map(|s| s.uniform),
        degree_negatives: sampled.map(|s| s.degree),
        seed: sampled.map(|s| s.seed),
    }
}

#[cfg(test)]
mod tests;
