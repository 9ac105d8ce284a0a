//! End-to-end tests of both protocols against hand-computed ranks and a naive reference.

use std::collections::HashSet;

use legend_model::{Decoder, Side};
use proptest::prelude::*;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

use super::*;

fn embeddings<'a>(
    decoder: Decoder,
    entities: &'a [f32],
    relations: &'a [f32],
    dim: usize,
) -> Embeddings<'a> {
    Embeddings {
        decoder,
        entities,
        relations,
        dim,
        reciprocal: false,
    }
}

/// Per-query realistic ranks of the filtered protocol (destination, source, per triple).
fn filtered_ranks(e: &Embeddings<'_>, triples: &[[u32; 3]], known: &[[u32; 3]]) -> Vec<f64> {
    let model = validate(e, triples).unwrap();
    let filter = FilterIndex::build(model.num_entities, &[known, triples]).unwrap();
    rank::filtered(&model, triples, &filter, &|_| {})
        .iter()
        .map(|t| t.rank())
        .collect()
}

fn filtered_metrics(e: &Embeddings<'_>, triples: &[[u32; 3]], known: &[[u32; 3]]) -> Metrics {
    let n = e.entities.len() / e.dim;
    let filter = FilterIndex::build(n, &[known, triples]).unwrap();
    evaluate(e, triples, &Protocol::Filtered { filter: &filter }, 1).unwrap()
}

#[test]
fn reciprocal_source_queries_rank_like_the_inverse_triples() {
    // DistMult, 2 relations and their inverses (rows 2 and 3), 6 entities.
    let dim = 3;
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut table =
        |n: usize| -> Vec<f32> { (0..n * dim).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (ent, rel) = (table(6), table(4));
    let triples = [[0u32, 0, 1], [2, 1, 3], [4, 0, 5], [5, 1, 0]];
    let mut e = embeddings(Decoder::DistMult, &ent, &rel, dim);
    e.reciprocal = true;
    let ranks = filtered_ranks(&e, &triples, &[]);
    // The same table without the flag: (d, r + 2, s) ranked on its destination side.
    let plain = embeddings(Decoder::DistMult, &ent, &rel, dim);
    let inverted: Vec<[u32; 3]> = triples.iter().map(|&[s, r, d]| [d, r + 2, s]).collect();
    let want = filtered_ranks(&plain, &inverted, &[]);
    for i in 0..triples.len() {
        assert_eq!(ranks[2 * i + 1], want[2 * i], "source side of triple {i}");
    }
    // Destination queries still use the forward rows.
    let forward = filtered_ranks(&plain, &triples, &[]);
    for i in 0..triples.len() {
        assert_eq!(
            ranks[2 * i],
            forward[2 * i],
            "destination side of triple {i}"
        );
    }
    // An odd relation table cannot hold the inverses; ids index the forward half only.
    e.relations = &rel[..3 * dim];
    assert!(matches!(
        validate(&e, &triples),
        Err(EvalError::TableSize { .. })
    ));
    e.relations = &rel;
    assert!(matches!(
        validate(&e, &[[0, 2, 1]]),
        Err(EvalError::IdOutOfRange { .. })
    ));
}

#[test]
fn hand_built_ranks_on_both_sides() {
    // Dot, dim 1: the score of (s, d) is e_s * e_d.
    let ent = [3.0, 1.0, 2.0, 2.5, 0.0];
    let e = embeddings(Decoder::Dot, &ent, &[], 1);
    // Destination side of (0, 0, 1): 3 * [3, 1, 2, 2.5, 0]; the true 3 is beaten by 9, 6, 7.5.
    // Source side: 1 * [3, 1, 2, 2.5, 0]; the true 3 is the best.
    assert_eq!(filtered_ranks(&e, &[[0, 0, 1]], &[]), vec![4.0, 1.0]);
    // Knowing (0, 0, 2) removes entity 2 from the destination side only.
    assert_eq!(
        filtered_ranks(&e, &[[0, 0, 1]], &[[0, 0, 2]]),
        vec![3.0, 1.0]
    );
    // A known triple of another relation filters nothing.
    assert_eq!(
        filtered_ranks(&e, &[[0, 0, 1]], &[[0, 1, 2]]),
        vec![4.0, 1.0]
    );
    // (4, 0, 2): the destination side scores 0 everywhere, a four-way tie (rank 3); the source
    // side scores 2 * [3, 1, 2, 2.5, 0] and the true 0 is beaten by all four others.
    // Knowing (0, 0, 2) and (3, 0, 2) removes two of them.
    assert_eq!(filtered_ranks(&e, &[[4, 0, 2]], &[]), vec![3.0, 5.0]);
    assert_eq!(
        filtered_ranks(&e, &[[4, 0, 2]], &[[0, 0, 2], [3, 0, 2]]),
        vec![3.0, 3.0]
    );
}

#[test]
fn ties_are_realistic() {
    // Destination side of (0, 0, 1): scores [1, 2, 2, 2, 0], the true 2 ties with two others:
    // optimistic 1, pessimistic 3, realistic 2. Filtering one of them leaves rank 1.5.
    let ent = [1.0, 2.0, 2.0, 2.0, 0.0];
    let e = embeddings(Decoder::Dot, &ent, &[], 1);
    assert_eq!(filtered_ranks(&e, &[[0, 0, 1]], &[])[0], 2.0);
    assert_eq!(filtered_ranks(&e, &[[0, 0, 1]], &[[0, 0, 3]])[0], 1.5);
    // A constant model cannot look good: every query ties with all n - 1 others.
    let flat = [0.5; 6];
    let e = embeddings(Decoder::Dot, &flat, &[], 1);
    let m = filtered_metrics(&e, &[[0, 0, 1], [2, 0, 3]], &[]);
    assert_eq!(m.mean_rank, 3.5);
    assert_eq!(m.hits_at_1, 0.0);
    assert_eq!(m.hits_at_3, 0.0);
    assert_eq!(m.hits_at_10, 1.0);
    assert_eq!(m.ties, Ties::Realistic);
}

#[test]
fn nan_scores_rank_last_and_are_reported() {
    let nan = f32::NAN;
    let ent = [3.0, 1.0, nan, 2.5, 0.0];
    let e = embeddings(Decoder::Dot, &ent, &[], 1);
    // A NaN candidate beats the true entity: destination side of (0, 0, 1) is beaten by
    // 9, NaN, 7.5; the source side by NaN only.
    assert_eq!(filtered_ranks(&e, &[[0, 0, 1]], &[]), vec![4.0, 2.0]);
    // A NaN true score is beaten by every other candidate (5 entities: rank 5).
    assert_eq!(filtered_ranks(&e, &[[2, 0, 1]], &[]), vec![5.0, 5.0]);
    let m = filtered_metrics(&e, &[[0, 0, 1], [3, 0, 4]], &[]);
    assert_eq!(m.nan_queries, 4);
    // Sampled: the same rule against drawn negatives (all five entities, degree 1 each).
    let p = Protocol::Sampled {
        negatives: SampledNegatives {
            uniform: 0,
            degree: 5,
            seed: 3,
        },
        degrees: &[1; 5],
    };
    let m = evaluate(&e, &[[2, 0, 1]], &p, 1).unwrap();
    assert_eq!((m.mean_rank, m.hits_at_3, m.nan_queries), (6.0, 0.0, 2));
    // The whole model NaN: every query ranks last, never first.
    let all_nan = [nan; 5];
    let e = embeddings(Decoder::Dot, &all_nan, &[], 1);
    let m = filtered_metrics(&e, &[[0, 0, 1]], &[]);
    assert_eq!((m.mean_rank, m.hits_at_1, m.nan_queries), (5.0, 0.0, 2));
}

fn random_table(rng: &mut ChaCha8Rng, rows: usize, dim: usize) -> Vec<f32> {
    (0..rows * dim)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect()
}

fn random_triples(rng: &mut ChaCha8Rng, n: usize, entities: u32, relations: u32) -> Vec<[u32; 3]> {
    (0..n)
        .map(|_| {
            [
                rng.random_range(0..entities),
                rng.random_range(0..relations),
                rng.random_range(0..entities),
            ]
        })
        .collect()
}

/// Scores every entity with `Decoder::score` and counts by definition.
fn naive_ranks(e: &Embeddings<'_>, triples: &[[u32; 3]], known: &[[u32; 3]]) -> Vec<f64> {
    let (dim, rw) = (e.dim, e.decoder.relation_width(e.dim));
    let row = |t: &[f32], i: u32| t[i as usize * dim..][..dim].to_vec();
    let n = (e.entities.len() / dim) as u32;
    let truths: HashSet<[u32; 3]> = known.iter().chain(triples).copied().collect();
    let mut ranks = Vec::new();
    for &[s, r, d] in triples {
        let rel = e.relations[r as usize * rw..][..rw].to_vec();
        let score = |s: u32, d: u32| {
            e.decoder
                .score(&row(e.entities, s), &rel, &row(e.entities, d))
        };
        for side in [Side::Dst, Side::Src] {
            let candidate = |c: u32| match side {
                Side::Dst => [s, r, c],
                Side::Src => [c, r, d],
            };
            let truth = score(s, d);
            let (mut above, mut tied) = (0, 0);
            for c in 0..n {
                let t = candidate(c);
                if t == [s, r, d] || truths.contains(&t) {
                    continue;
                }
                let x = score(t[0], t[2]);
                above += u32::from(x > truth);
                tied += u32::from(x == truth);
            }
            ranks.push(1.0 + f64::from(above) + f64::from(tied) / 2.0);
        }
    }
    ranks
}

#[test]
fn filtered_equals_the_naive_reference_for_every_decoder() {
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    // 300 entities span two candidate blocks; 50 triples make two query blocks; dim 10 leaves
    // a tail after the 8-float lanes.
    let (n, nr, dim) = (300u32, 4u32, 10);
    for decoder in Decoder::ALL {
        let ent = random_table(&mut rng, n as usize, dim);
        let rel = random_table(&mut rng, nr as usize, decoder.relation_width(dim));
        let e = embeddings(decoder, &ent, &rel, dim);
        // Dense known triples so that filtering matters on most queries.
        let known = random_triples(&mut rng, 4000, n, nr);
        let mut test = random_triples(&mut rng, 48, n, nr);
        test.extend_from_slice(&known[..2]);
        let got = filtered_ranks(&e, &test, &known);
        let want = naive_ranks(&e, &test, &known);
        assert_eq!(got, want, "{decoder}");
        let unfiltered = naive_ranks(&e, &test, &[]);
        assert_ne!(got, unfiltered, "{decoder}: filtering changed nothing");
        // The metrics do not depend on how the queries are spread over threads.
        let filter = FilterIndex::build(n as usize, &[&known, &test]).unwrap();
        let p = Protocol::Filtered { filter: &filter };
        let one = evaluate(&e, &test, &p, 1).unwrap();
        assert_eq!(one, evaluate(&e, &test, &p, 3).unwrap(), "{decoder}");
        let mean = want.iter().sum::<f64>() / want.len() as f64;
        assert!((one.mean_rank - mean).abs() < 1e-9, "{decoder}");
    }
}

#[test]
fn a_perfect_model_has_mrr_one() {
    // TransE on a line: entity i at 10 i, relation +10; (i, 0, i + 1) is exact on both sides
    // and every other entity is at least 10 away.
    let n = 40;
    let ent: Vec<f32> = (0..n).map(|i| 10.0 * i as f32).collect();
    let rel = [10.0];
    let triples: Vec<[u32; 3]> = (0..n - 1).map(|i| [i, 0, i + 1]).collect();
    for decoder in [Decoder::TransEL1, Decoder::TransEL2] {
        let e = embeddings(decoder, &ent, &rel, 1);
        let m = filtered_metrics(&e, &triples, &[]);
        assert_eq!((m.mrr, m.mean_rank, m.hits_at_1), (1.0, 1.0, 1.0));
        assert_eq!((m.count, m.triples), (2 * (n as u64 - 1), n as u64 - 1));
        // Sampled negatives are unfiltered and may hit the true entity (a tie), never beat it.
        let degrees = vec![1; n as usize];
        let negatives = SampledNegatives {
            uniform: 5,
            degree: 5,
            seed: 1,
        };
        let model = validate(&e, &triples).unwrap();
        let sampler = rank::DegreeSampler::new(&degrees);
        let tallies = rank::sampled(&model, &triples, &negatives, sampler.as_ref(), &|_| {});
        assert!(tallies.iter().all(|t| t.above == 0));
        let p = Protocol::Sampled {
            negatives,
            degrees: &degrees,
        };
        assert!(evaluate(&e, &triples, &p, 1).unwrap().mrr > 0.85);
    }
}

fn sampled_setup() -> (Vec<f32>, Vec<f32>, Vec<[u32; 3]>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (n, nr, dim) = (500u32, 3u32, 12);
    let ent = random_table(&mut rng, n as usize, dim);
    let rel = random_table(&mut rng, nr as usize, dim);
    // More than two chunks, the last one partial.
    let test = random_triples(&mut rng, 2 * SAMPLED_CHUNK + 321, n, nr);
    let train = random_triples(&mut rng, 5000, n, nr);
    let degrees = entity_degrees(n as usize, &[&train]).unwrap();
    (ent, rel, test, degrees)
}

#[test]
fn sampled_is_deterministic_across_runs_and_threads_and_follows_the_seed() {
    let (ent, rel, test, degrees) = sampled_setup();
    let e = embeddings(Decoder::DistMult, &ent, &rel, 12);
    let run = |seed: u64, threads: usize| {
        let p = Protocol::Sampled {
            negatives: SampledNegatives {
                uniform: 40,
                degree: 60,
                seed,
            },
            degrees: &degrees,
        };
        evaluate(&e, &test, &p, threads).unwrap()
    };
    let first = run(5, 1);
    assert_eq!(first, run(5, 1));
    assert_eq!(first, run(5, 2));
    assert_eq!(first, run(5, 3));
    let other = run(6, 2);
    assert_ne!(first.mrr, other.mrr);
    assert_eq!(
        (
            first.protocol,
            first.uniform_negatives,
            first.degree_negatives
        ),
        (ProtocolKind::Sampled, Some(40), Some(60))
    );
    assert_eq!((first.seed, other.seed), (Some(5), Some(6)));
    assert_eq!(first.count, 2 * test.len() as u64);
    // 100 negatives: no rank above 101, and random embeddings land near the middle.
    assert!(first.hits_at_100 > 0.99 && (30.0..70.0).contains(&first.mean_rank));
}

#[test]
fn degree_negatives_follow_the_degrees() {
    // Only entity 3 has a degree and it scores highest: with degree negatives only, every
    // destination-side query for a weaker entity is beaten by all of them.
    let ent = [1.0, 2.0, 3.0, 10.0];
    let e = embeddings(Decoder::Dot, &ent, &[], 1);
    let degrees = [0, 0, 0, 5];
    let p = Protocol::Sampled {
        negatives: SampledNegatives {
            uniform: 0,
            degree: 3,
            seed: DEFAULT_SEED,
        },
        degrees: &degrees,
    };
    let m = evaluate(&e, &[[0, 0, 1]], &p, 1).unwrap();
    // Destination side: 1 * 10 beats 1 * 2 three times (rank 4); source side: 2 * 10 beats
    // 2 * 1 three times (rank 4).
    assert_eq!(m.mean_rank, 4.0);
}

#[test]
fn default_negatives_are_1000_plus_1000() {
    let d = SampledNegatives::default();
    assert_eq!((d.uniform, d.degree, d.seed), (1000, 1000, DEFAULT_SEED));
}

#[test]
fn capped_negatives_fit_the_graph_in_the_asked_proportion() {
    let asked = |uniform, degree| SampledNegatives {
        uniform,
        degree,
        seed: 7,
    };
    let fit = |n: SampledNegatives, entities| {
        let c = n.capped(entities);
        assert_eq!(c.seed, 7);
        (c.uniform, c.degree)
    };
    assert_eq!(fit(asked(1000, 1000), 135), (67, 68));
    assert_eq!(fit(asked(1000, 0), 135), (135, 0));
    assert_eq!(fit(asked(0, 1000), 135), (0, 135));
    assert_eq!(fit(asked(300, 100), 100), (75, 25));
    // Within the graph: unchanged.
    assert_eq!(fit(asked(60, 75), 135), (60, 75));
    assert_eq!(fit(asked(0, 0), 5), (0, 0));
    // No overflow on absurd requests.
    assert_eq!(fit(asked(usize::MAX, usize::MAX), 10), (5, 5));
    assert_eq!(fit(asked(usize::MAX, 1), 10), (9, 1));
}

#[test]
fn progress_adds_up_to_the_query_count_under_both_protocols() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (ent, rel, test, degrees) = sampled_setup();
    let e = embeddings(Decoder::DistMult, &ent, &rel, 12);
    let filter = FilterIndex::build(500, &[&test]).unwrap();
    let sampled = Protocol::Sampled {
        negatives: SampledNegatives {
            uniform: 10,
            degree: 10,
            seed: 1,
        },
        degrees: &degrees,
    };
    for protocol in [Protocol::Filtered { filter: &filter }, sampled] {
        for threads in [1, 3] {
            let (done, calls) = (AtomicU64::new(0), AtomicU64::new(0));
            let m = evaluate_with_progress(&e, &test, &protocol, threads, &|n| {
                done.fetch_add(n, Ordering::Relaxed);
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert_eq!(done.into_inner(), 2 * test.len() as u64);
            assert!(
                calls.into_inner() > 1,
                "progress comes in steps, not at the end"
            );
            assert_eq!(m, evaluate(&e, &test, &protocol, threads).unwrap());
        }
    }
}

#[test]
fn metrics_serialize_with_their_protocol() {
    let ent = [3.0, 1.0, 2.0];
    let e = embeddings(Decoder::Dot, &ent, &[], 1);
    let m = filtered_metrics(&e, &[[0, 0, 1]], &[]);
    let json = serde_json::to_value(&m).unwrap();
    assert_eq!(json["protocol"], "filtered");
    assert_eq!(json["ties"], "realistic");
    assert_eq!(json["count"], 2);
    assert!(json.get("seed").is_none());
    let back: Metrics = serde_json::from_value(json).unwrap();
    assert_eq!(back, m);

    let degrees = [1, 1, 1];
    let p = Protocol::Sampled {
        negatives: SampledNegatives::default(),
        degrees: &degrees,
    };
    let json = serde_json::to_value(evaluate(&e, &[[0, 0, 1]], &p, 1).unwrap()).unwrap();
    assert_eq!(json["protocol"], "sampled");
    // 1000 + 1000 asked, on 3 entities: the numbers used.
    assert_eq!(json["uniform_negatives"], 1);
    assert_eq!(json["degree_negatives"], 2);
    assert_eq!(json["seed"], DEFAULT_SEED);
}

#[test]
fn bad_inputs_are_errors_that_name_the_problem() {
    let ent = vec![0.5f32; 12]; // 3 entities × 4, or 6 × 2
    let rel = vec![0.5f32; 8]; // 2 relations × 4
    let filter = FilterIndex::build(3, &[]).unwrap();
    let filtered = Protocol::Filtered { filter: &filter };
    let msg = |e: Embeddings<'_>, t: &[[u32; 3]], p: &Protocol<'_>| {
        evaluate(&e, t, p, 1).unwrap_err().to_string()
    };
    let ok = embeddings(Decoder::DistMult, &ent, &rel, 4);
    assert!(evaluate(&ok, &[[0, 1, 2]], &filtered, 1).is_ok());

    let m = msg(ok, &[[0, 1, 3]], &filtered);
    assert!(
        m.contains("triple 0") && m.contains("destination id 3"),
        "{m}"
    );
    let m = msg(ok, &[[0, 1, 2], [5, 0, 0]], &filtered);
    assert!(m.contains("triple 1") && m.contains("source id 5"), "{m}");
    let m = msg(ok, &[[0, 2, 2]], &filtered);
    assert!(m.contains("relation id 2"), "{m}");
    let m = msg(
        embeddings(Decoder::DistMult, &ent, &rel, 5),
        &[[0, 0, 0]],
        &filtered,
    );
    assert!(m.contains("entity table has 12 floats"), "{m}");
    let m = msg(
        embeddings(Decoder::DistMult, &ent, &rel[..7], 4),
        &[[0, 0, 0]],
        &filtered,
    );
    assert!(m.contains("relation table has 7 floats"), "{m}");
    let m = msg(
        embeddings(Decoder::DistMult, &ent, &[], 4),
        &[[0, 0, 0]],
        &filtered,
    );
    assert!(m.contains("relation table has 0 floats"), "{m}");
    // RESCAL's relation rows are dim² floats: 8 is no whole number of 4×4 matrices.
    let m = msg(
        embeddings(Decoder::Rescal, &ent, &rel, 4),
        &[[0, 0, 0]],
        &filtered,
    );
    assert!(
        m.contains("relation table has 8 floats") && m.contains("16"),
        "{m}"
    );
    let m = msg(
        embeddings(Decoder::ComplEx, &ent, &rel, 3),
        &[[0, 0, 0]],
        &filtered,
    );
    assert!(m.contains("even dimension"), "{m}");
    let m = msg(
        embeddings(Decoder::Dot, &ent, &[], 0),
        &[[0, 0, 0]],
        &filtered,
    );
    assert!(m.contains("dimension"), "{m}");
    let m = msg(
        embeddings(Decoder::Dot, &ent, &[], 2),
        &[[0, 0, 0]],
        &filtered,
    );
    assert!(
        m.contains("built for 3 entities") && m.contains("has 6"),
        "{m}"
    );
    let m = msg(ok, &[], &filtered);
    assert!(m.contains("no triples"), "{m}");

    let sampled = |uniform, degree, degrees: &'static [u32]| Protocol::Sampled {
        negatives: SampledNegatives {
            uniform,
            degree,
            seed: 0,
        },
        degrees,
    };
    let m = msg(ok, &[[0, 0, 0]], &sampled(1, 1, &[1, 1]));
    assert!(m.contains("2 entity degrees given for 3 entities"), "{m}");
    let m = msg(ok, &[[0, 0, 0]], &sampled(1, 1, &[0, 0, 0]));
    assert!(m.contains("degree is zero"), "{m}");
    let m = msg(ok, &[[0, 0, 0]], &sampled(0, 0, &[]));
    assert!(m.contains("at least one negative"), "{m}");
    // More negatives than entities are reduced to the entity count, never refused as too many
    // to gather (that needs a table beyond 1 GiB).
    let used = |p: &Protocol<'_>| {
        let m = evaluate(&ok, &[[0, 0, 0]], p, 1).unwrap();
        (m.uniform_negatives, m.degree_negatives)
    };
    assert_eq!(
        used(&sampled(usize::MAX, 1, &[1, 1, 1])),
        (Some(2), Some(1))
    );
    assert_eq!(used(&sampled(1 << 27, 0, &[])), (Some(3), Some(0)));
    // Degrees are not needed without degree negatives.
    assert!(evaluate(&ok, &[[0, 0, 0]], &sampled(3, 0, &[]), 2).is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The index answers exactly the set of known partners of each (anchor, relation).
    #[test]
    fn filter_index_matches_a_set(triples in prop::collection::vec((0u32..12, 0u32..3, 0u32..12), 0..80)) {
        let triples: Vec<[u32; 3]> = triples.into_iter().map(|(s, r, d)| [s, r, d]).collect();
        let (a, b) = triples.split_at(triples.len() / 2);
        let index = FilterIndex::build(12, &[a, b]).unwrap();
        for anchor in 0..12 {
            for rel in 0..3 {
                for side in [Side::Dst, Side::Src] {
                    let mut want: Vec<u32> = triples
                        .iter()
                        .filter_map(|&[s, r, d]| match side {
                            Side::Dst => (s == anchor && r == rel).then_some(d),
                            Side::Src => (d == anchor && r == rel).then_some(s),
                        })
                        .collect();
                    want.sort_unstable();
                    want.dedup();
                    prop_assert_eq!(index.candidates(side, anchor, rel), &want[..]);
                }
            }
        }
    }
}
