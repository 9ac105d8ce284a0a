//! Each kernel against the CPU reference (legend-model, legend-engine's sampler) on fresh
//! random inputs every run.
//! Needs a GPU: the tests are `#[ignore]`d, so a plain `cargo test` reports them skipped;
//! `--include-ignored` runs them (scripts/gpu/run-all.sh).

use std::collections::HashSet;

use legend_cuda::{BatchShape, DeviceTable, Gpu, GpuBatchEngine, SlotMap, negative_keys};
use legend_dataset::PartitionScheme;
use legend_engine::sampler::NegativeSampler;
use legend_model::{
    AdaGrad, BatchKey, Chunk, ChunkModel, ChunkWorkspace, Decoder, Distribution, Dtype, Loss,
    Penalty, Regularizer, StateLayout, StepRounding, Table, fill_row,
};

mod common;

use common::{Rng, gpu, seed};

/// ‖a − b‖ / ‖b‖ in f64; infinite when `a` holds a NaN (an unwritten, poisoned element).
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    if a.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn the_kernels_compute_the_shared_rng_vectors() {
    let vectors = legend_model::rng::test_vectors();
    let inputs: Vec<[u64; 3]> = vectors.iter().map(|v| [v[0], v[1], v[2]]).collect();
    let gpu = gpu();
    let got = legend_cuda::rng_vectors(&gpu, &inputs).unwrap();
    for (v, g) in vectors.iter().zip(&got) {
        assert_eq!(g, &[v[3], v[4], v[5], v[6]], "inputs {:x?}", &v[..3]);
    }
    // A batch's rounding streams as the kernels derive them from its key (legend_round_key).
    let batches = legend_model::rng::batch_key_vectors();
    let inputs: Vec<[u64; 3]> = batches
        .iter()
        .map(|b| [b[4], legend_model::rng::ROUNDING_TAG, 41_652_229])
        .collect();
    let got = legend_cuda::rng_vectors(&gpu, &inputs).unwrap();
    for (b, g) in batches.iter().zip(&got) {
        assert_eq!(g[3], b[8], "the rounding stream of batch key {:#x}", b[4]);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn init_matches_fill_row() {
    let gpu = gpu();
    let s = seed("init");
    let (rows, dim, first) = (777usize, 100usize, 1_000_003u64);
    for (table, dist) in [
        (Table::Node, Distribution::Normal { std: 0.3 }),
        (Table::Relation, Distribution::Uniform { bound: 0.7 }),
    ] {
        let t = DeviceTable::init(&gpu, rows, dim, first, s, table, dist).unwrap();
        let (emb, state) = t.download(&gpu).unwrap();
        let mut want = vec![0.0f32; rows * dim];
        for (r, row) in want.chunks_exact_mut(dim).enumerate() {
            fill_row(s, table, first + r as u64, dist, row);
        }
        for (i, (g, w)) in emb.iter().zip(&want).enumerate() {
            // The GPU's double-precision log/cos may differ from libm's in the last ulp.
            assert!(
                (g - w).abs() <= 2e-7 * w.abs().max(1e-3),
                "{table:?} element {i}: {g} vs {w}"
            );
        }
        assert!(state.iter().all(|&x| x == 0.0));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn sampling_matches_the_cpu_sampler() {
    let gpu = gpu();
    let s = seed("sample");
    let mut rng = Rng(s);
    let entities = 10_007u64;
    let scheme = PartitionScheme::new(entities, 4).unwrap();
    // Skewed degrees with zeros, so that empty degree intervals are exercised.
    let degrees: Vec<u32> = (0..entities)
        .map(|_| {
            if rng.below(3) == 0 {
                0
            } else {
                rng.below(50) as u32
            }
        })
        .collect();
    let chunks = 3;
    let k = 1000;
    let model = ChunkModel {
        decoder: Decoder::Dot,
        loss: Loss::SoftmaxCe,
        dim: 8,
    };
    let shape = BatchShape {
        max_batch: 30,
        num_chunks: chunks,
        negatives: k,
        group: 2,
    };
    let mut engine =
        GpuBatchEngine::new(&gpu, model, AdaGrad::default(), shape, &degrees, 1).unwrap();
    let edges: Vec<[u32; 3]> = (0..30).map(|i| [i, 0, i + 1]).collect();
    engine.set_batch(&gpu, &edges).unwrap();
    for (parts, fraction) in [
        (vec![1u32, 3], 0.5),
        (vec![0, 1, 2, 3], 0.0),
        (vec![2], 1.0),
    ] {
        let keys = negative_keys(BatchKey::new(s, 3, 0, rng.below(1000)), chunks);
        let ranges: Vec<_> = parts.iter().map(|&p| scheme.range(p)).collect();
        engine
            .sample_negatives(&gpu, &ranges, &keys, fraction)
            .unwrap();
        let got = engine.negatives(&gpu).unwrap();
        let sampler = NegativeSampler::new(scheme, &degrees, fraction);
        let mut want = vec![0u32; 2 * chunks * k];
        for (l, out) in want.chunks_exact_mut(k).enumerate() {
            sampler.sample(&parts, keys[l], out);
        }
        assert_eq!(
            got, want,
            "partitions {parts:?}, degree fraction {fraction}"
        );
    }
}

#[derive(Clone, Copy)]
struct Case {
    decoder: Decoder,
    loss: Loss,
    dim: usize,
    batch: usize,
    chunks: usize,
    k: usize,
    group: usize,
    /// Inputs on a coarse grid (multiples of 1/32 and 1/8), so that TF32 products are exact:
    /// the ranking loss's hinge is discontinuous, and a score within TF32 rounding of the
    /// margin would otherwise flip a whole gradient term.
    exact: bool,
    /// Scale of the inputs (1: nodes in ±0.25, relations in ±1). Small scales are the
    /// usual initialisation (1e-3): the fused kernels' FP16 operands must keep their
    /// digits there (query products near 1e-6 are FP16 subnormals unless scaled).
    scale: f32,
    /// Relations all zero and every 37th edge a self-loop: TransE's queries are then their
    /// anchors, so a negative drawn as the anchor and a self-loop's truth lie at distance 0,
    /// where no gradient flows (and the other pairs of their rows keep theirs).
    zero_relations: bool,
    /// Every 101st node 10⁻⁴ times the others' scale: negatives nearer the origin (a
    /// padding row's zero query) than any query is to its negatives.
    tiny_rows: bool,
    /// Largest relative error of the gradients against the CPU's. 1e-3, but where the scores
    /// reach ~10^6 FP32 cannot resolve the softmax: both engines' probabilities then carry
    /// errors of about |score|·2^-24, a few percent, which no FP32 engine avoids.
    grad_tolerance: f64,
}

/// What a step test varies beyond its [`Case`].
#[derive(Clone, Copy, Default)]
struct Variant {
    /// The step filters its negatives against a set of known edges that holds the batch and,
    /// for each positive, about a tenth of its chunk's negatives on each side.
    filtered: bool,
    /// The node table's AdaGrad state.
    layout: StateLayout,
    /// Reciprocal relations: the relation table doubled, side 0 through the inverse rows.
    reciprocal: bool,
    /// A regulariser (penalty and weight) of the positives' rows.
    penalty: Option<(Penalty, f32)>,
}

impl Variant {
    fn regularizer(&self, decoder: Decoder) -> Option<Regularizer> {
        self.penalty
            .map(|(penalty, weight)| Regularizer::new(penalty, weight, decoder))
    }
}

/// Floats of the relation table's rows in the step tests: the decoder's relation width (RESCAL's
/// d²), or d for Dot, whose table the kernels never read.
fn relation_width(case: &Case) -> usize {
    if case.decoder.uses_relations() {
        case.decoder.relation_width(case.dim)
    } else {
        case.dim
    }
}

/// The CPU reference of one step: per-chunk forward/backward, gradients summed per row, and
/// the regulariser's gradient added once per occurrence of a row among the positives (the
/// CPU engine's `RowSums::apply`). With reciprocal relations, `rel` holds `2R` rows and the
/// edges' relations lie below `R`.
fn cpu_step(
    case: &Case,
    variant: &Variant,
    emb: &[f32],
    rel: &[f32],
    edges: &[[u32; 3]],
    negs: &[u32],
    known: Option<&HashSet<[u32; 3]>>,
) -> (f64, Vec<f32>, Vec<f32>) {
    let (d, rw) = (case.dim, relation_width(case));
    let model = ChunkModel {
        decoder: case.decoder,
        loss: case.loss,
        dim: d,
    };
    let mut ws = ChunkWorkspace::new();
    let mut gn = vec![0.0f32; emb.len()];
    let mut gr = vec![0.0f32; rel.len()];
    let mut loss = 0.0;
    let b = edges.len();
    let chunks = case.chunks.min(b);
    let rows_of = |table: &[f32], w: usize, ids: &mut dyn Iterator<Item = u32>| -> Vec<f32> {
        ids.flat_map(|i| table[i as usize * w..(i as usize + 1) * w].iter().copied())
            .collect()
    };
    let rows = |table: &[f32], ids: &mut dyn Iterator<Item = u32>| rows_of(table, d, ids);
    for c in 0..chunks {
        let part = &edges[c * b / chunks..(c + 1) * b / chunks];
        let ns = &negs[2 * c * case.k..(2 * c + 1) * case.k];
        let nd = &negs[(2 * c + 1) * case.k..(2 * c + 2) * case.k];
        let src = rows(emb, &mut part.iter().map(|e| e[0]));
        let dst = rows(emb, &mut part.iter().map(|e| e[2]));
        let r = if case.decoder.uses_relations() {
            rows_of(rel, rw, &mut part.iter().map(|e| e[1]))
        } else {
            Vec::new()
        };
        let neg_src = rows(emb, &mut ns.iter().copied());
        let neg_dst = rows(emb, &mut nd.iter().copied());
        // The CPU engine's exclusion masks: a negative that makes a known edge in place of
        // the positive's source (destination).
        let mask = |side: &[u32], edge: fn(&[u32; 3], u32) -> [u32; 3]| -> Option<Vec<bool>> {
            let known = known?;
            Some(
                part.iter()
                    .flat_map(|e| side.iter().map(move |&n| known.contains(&edge(e, n))))
                    .collect(),
            )
        };
        let exclude_src = mask(ns, |e, n| [n, e[1], e[2]]);
        let exclude_dst = mask(nd, |e, n| [e[0], e[1], n]);
        let inverse = rel.len() / rw / 2;
        let rel_src = variant
            .reciprocal
            .then(|| rows_of(rel, rw, &mut part.iter().map(|e| e[1] + inverse as u32)));
        let chunk = Chunk {
            src: &src,
            rel: &r,
            dst: &dst,
            neg_src: &neg_src,
            neg_dst: &neg_dst,
            exclude_src: exclude_src.as_deref(),
            exclude_dst: exclude_dst.as_deref(),
            rel_src: rel_src.as_deref(),
        };
        loss += ws.forward_backward(&model, &chunk);
        let g = ws.grads();
        let add = |table: &mut [f32], id: u32, grad: &[f32]| {
            let w = grad.len();
            for (a, b) in table[id as usize * w..(id as usize + 1) * w]
                .iter_mut()
                .zip(grad)
            {
                *a += b;
            }
        };
        for (i, e) in part.iter().enumerate() {
            add(&mut gn, e[0], &g.src[i * d..(i + 1) * d]);
            add(&mut gn, e[2], &g.dst[i * d..(i + 1) * d]);
            if case.decoder.uses_relations() {
                add(&mut gr, e[1], &g.rel[i * rw..(i + 1) * rw]);
            }
            if variant.reciprocal {
                add(
                    &mut gr,
                    e[1] + inverse as u32,
                    &g.rel_src[i * rw..(i + 1) * rw],
                );
            }
        }
        for (j, &id) in ns.iter().enumerate() {
            add(&mut gn, id, &g.neg_src[j * d..(j + 1) * d]);
        }
        for (j, &id) in nd.iter().enumerate() {
            add(&mut gn, id, &g.neg_dst[j * d..(j + 1) * d]);
        }
    }
    if let Some(reg) = variant.regularizer(case.decoder) {
        let inverse = rel.len() / rw / 2;
        let mut node_uses = vec![0u32; emb.len() / d];
        let mut rel_uses = vec![0u32; rel.len() / rw];
        for e in edges {
            node_uses[e[0] as usize] += 1;
            node_uses[e[2] as usize] += 1;
            if case.decoder.uses_relations() {
                rel_uses[e[1] as usize] += 1;
            }
            if variant.reciprocal {
                rel_uses[e[1] as usize + inverse] += 1;
            }
        }
        for (table, grad, uses, w) in [(emb, &mut gn, node_uses, d), (rel, &mut gr, rel_uses, rw)] {
            for (r, &n) in uses.iter().enumerate() {
                let at = r * w..(r + 1) * w;
                reg.add_gradient(&table[at.clone()], n, &mut grad[at]);
            }
        }
    }
    (loss, gn, gr)
}

/// How far each parameter moved from `before` to `after`.
fn moves(after: &[f32], before: &[f32]) -> Vec<f32> {
    after.iter().zip(before).map(|(a, b)| a - b).collect()
}

/// Whether every value of `a` lies within `ulps` units in the last place of `b`'s: two
/// updates of large values that agree up to their rounding (their moves, at 2^18, are
/// rounded to a good part of themselves).
fn within_ulps(a: &[f32], b: &[f32], ulps: f32) -> bool {
    a.iter().zip(b).all(|(x, y)| {
        let ulp = f32::from_bits(y.abs().to_bits() + 1) - y.abs();
        (x - y).abs() <= ulps * ulp
    })
}

/// Whether a table's gradients and use counts are all back to zero after a step.
fn cleared(gpu: &Gpu, t: &DeviceTable) -> bool {
    t.pending_gradients(gpu).unwrap().iter().all(|&x| x == 0.0)
        && t.pending_uses(gpu).unwrap().iter().all(|&u| u == 0)
}

fn check_step(gpu: &Gpu, case: &Case, s: u64) {
    check_variant(gpu, case, s, &Variant::default());
}

fn check_step_with(gpu: &Gpu, case: &Case, s: u64, filtered: bool, layout: StateLayout) {
    let variant = Variant {
        filtered,
        layout,
        ..Variant::default()
    };
    check_variant(gpu, case, s, &variant);
}

/// The model, optimizer (lr 0.05, eps 1e-9, `layout`) and shapes of a step test's engine, for
/// batches of up to `max_batch` positives.
fn step_engine(
    case: &Case,
    layout: StateLayout,
    max_batch: usize,
) -> (ChunkModel, AdaGrad, BatchShape) {
    let model = ChunkModel {
        decoder: case.decoder,
        loss: case.loss,
        dim: case.dim,
    };
    let opt = AdaGrad {
        lr: 0.05,
        eps: 1e-9,
        state: layout,
    };
    let shape = BatchShape {
        max_batch,
        num_chunks: case.chunks,
        negatives: case.k,
        group: case.group,
    };
    (model, opt, shape)
}

fn check_variant(gpu: &Gpu, case: &Case, s: u64, variant: &Variant) {
    let Variant {
        filtered, layout, ..
    } = *variant;
    let mut rng = Rng(s ^ case.dim as u64 ^ ((case.k as u64) << 20));
    let (entities, relations, d) = (4001usize, 37usize, case.dim);
    let rw = relation_width(case);
    // The relation table's rows: the inverses follow the relations when reciprocal.
    let relation_rows = if variant.reciprocal {
        2 * relations
    } else {
        relations
    };
    let mut value = |scale: f32, exact: bool| {
        if exact {
            (rng.below(17) as f32 - 8.0) * scale / 8.0
        } else {
            rng.uniform(-scale, scale)
        }
    };
    let emb: Vec<f32> = (0..entities * d)
        .map(|i| {
            let tiny = case.tiny_rows && (i / d) % 101 == 0;
            value(0.25 * case.scale, case.exact) * if tiny { 1e-4 } else { 1.0 }
        })
        .collect();
    let rel: Vec<f32> = (0..relation_rows * rw)
        .map(|_| value(case.scale, case.exact))
        .map(|v| if case.zero_relations { 0.0 } else { v })
        .collect();
    // A non-zero state keeps the AdaGrad step a smooth function of the gradient.
    let width = layout.width(d);
    let state: Vec<f32> = (0..entities * width)
        .map(|_| rng.uniform(0.1, 1.0))
        .collect();
    let rel_state: Vec<f32> = (0..relation_rows * rw)
        .map(|_| rng.uniform(0.1, 1.0))
        .collect();
    let edges: Vec<[u32; 3]> = (0..case.batch)
        .map(|i| {
            let e = [
                rng.below(entities as u64) as u32,
                rng.below(relations as u64) as u32,
                rng.below(entities as u64) as u32,
            ];
            if case.zero_relations && i % 37 == 0 {
                [e[0], e[1], e[0]]
            } else {
                e
            }
        })
        .collect();
    let chunks = case.chunks.min(case.batch);
    let negs: Vec<u32> = (0..2 * chunks * case.k)
        .map(|_| rng.below(entities as u64) as u32)
        .collect();

    let (model, opt, shape) = step_engine(case, layout, case.batch + 5);
    let known = filtered.then(|| {
        let mut known: HashSet<[u32; 3]> = edges.iter().copied().collect();
        let b = edges.len();
        for (i, e) in edges.iter().enumerate() {
            let c = (0..chunks)
                .find(|&c| i < (c + 1) * b / chunks)
                .expect("every row is in a chunk");
            for j in (i % 10..case.k).step_by(10) {
                known.insert([negs[2 * c * case.k + j], e[1], e[2]]);
                known.insert([e[0], e[1], negs[(2 * c + 1) * case.k + j]]);
            }
        }
        known
    });
    let degrees = vec![1u32; entities];
    let mut engine = GpuBatchEngine::new(gpu, model, opt, shape, &degrees, relation_rows).unwrap();
    engine.set_reciprocal_relations(variant.reciprocal).unwrap();
    engine.set_regularizer(variant.regularizer(case.decoder));
    if let Some(known) = &known {
        let list: Vec<[u32; 3]> = known.iter().copied().collect();
        engine.set_known_edges(gpu, &list).unwrap();
    }
    let mut nodes = DeviceTable::from_host(gpu, d, &emb, &state).unwrap();
    let mut rels = DeviceTable::from_host(gpu, rw, &rel, &rel_state).unwrap();
    engine.set_batch(gpu, &edges).unwrap();
    engine.set_negatives(gpu, &negs).unwrap();
    engine.poison_scratch(gpu).unwrap();
    engine
        .forward_backward(gpu, &mut nodes, Some(&mut rels))
        .unwrap();
    let loss = engine.loss(gpu).unwrap();
    let gn = nodes.pending_gradients(gpu).unwrap();
    let gr = rels.pending_gradients(gpu).unwrap();

    let (want_loss, want_gn, want_gr) =
        cpu_step(case, variant, &emb, &rel, &edges, &negs, known.as_ref());
    let what = format!(
        "{} {} d={} B={} C={} k={} group={} scale={}{}",
        case.decoder,
        case.loss,
        d,
        case.batch,
        case.chunks,
        case.k,
        case.group,
        case.scale,
        if filtered { " filtered" } else { "" }
    ) + &format!(" state {layout}")
        + if variant.reciprocal {
            " reciprocal"
        } else {
            ""
        }
        + &variant
            .penalty
            .map_or(String::new(), |(p, w)| format!(" {p} {w}"));
    if filtered {
        // The filter must matter: the same step unfiltered has another loss.
        let (unfiltered, _, _) = cpu_step(case, variant, &emb, &rel, &edges, &negs, None);
        let change = (unfiltered - want_loss).abs() / want_loss.abs().max(1e-30);
        println!("{what}: filtering changes the CPU loss by {change:.2e}");
        assert!(change > 1e-2, "{what}: too few negatives filtered to test");
    }
    if variant.penalty.is_some() {
        // The regulariser must matter: without it the CPU's gradients are others.
        let plain = Variant {
            penalty: None,
            ..*variant
        };
        let (_, gn_plain, gr_plain) =
            cpu_step(case, &plain, &emb, &rel, &edges, &negs, known.as_ref());
        let change = rel_err(&gn_plain, &want_gn).max(rel_err(&gr_plain, &want_gr));
        println!("{what}: the regulariser changes the CPU gradients by {change:.2e}");
        assert!(change > 1e-2, "{what}: the regulariser too weak to test");
    }
    let loss_err = (loss - want_loss).abs() / want_loss.abs().max(1e-30);
    let gn_err = rel_err(&gn, &want_gn);
    println!("{what}: loss {loss:.6e} (rel err {loss_err:.2e}), node grad rel err {gn_err:.2e}");
    assert!(loss_err < 1e-3, "{what}: loss {loss} vs {want_loss}");
    assert!(
        gn_err < case.grad_tolerance,
        "{what}: node gradients, rel err {gn_err:e}"
    );
    // Rows nobody touched get no gradient at all.
    for (r, (g, w)) in gn.chunks_exact(d).zip(want_gn.chunks_exact(d)).enumerate() {
        if w.iter().all(|&x| x == 0.0) {
            let touched = edges
                .iter()
                .any(|e| e[0] as usize == r || e[2] as usize == r)
                || negs.contains(&(r as u32));
            if !touched {
                assert!(
                    g.iter().all(|&x| x == 0.0),
                    "{what}: untouched row {r} got a gradient"
                );
            }
        }
    }
    if case.decoder.uses_relations() {
        let gr_err = rel_err(&gr, &want_gr);
        println!("{what}: relation grad rel err {gr_err:.2e}");
        assert!(
            gr_err < case.grad_tolerance,
            "{what}: relation gradients, rel err {gr_err:e}"
        );
    }

    // AdaGrad in place on the GPU's summed gradients against the CPU optimizer applied to
    // the same gradients: checks the update, the single step per row and the clearing.
    engine.apply(gpu, &mut nodes, Some(&mut rels)).unwrap();
    let (new_emb, new_state) = nodes.download(gpu).unwrap();
    let (mut want_emb, mut want_state) = (emb.clone(), state.clone());
    for r in 0..entities {
        let g = &gn[r * d..(r + 1) * d];
        if g.iter().any(|&x| x != 0.0) {
            opt.apply_row(
                &mut want_emb[r * d..(r + 1) * d],
                &mut want_state[r * width..(r + 1) * width],
                g,
            );
        }
    }
    let moved = moves(&new_emb, &emb);
    let want_moved = moves(&want_emb, &emb);
    let step_err = rel_err(&moved, &want_moved);
    let state_err = rel_err(&new_state, &want_state);
    println!("{what}: AdaGrad step rel err {step_err:.2e}, state rel err {state_err:.2e}");
    assert!(
        (step_err < 1e-5 || within_ulps(&new_emb, &want_emb, 2.0)) && state_err < 1e-6,
        "{what}: AdaGrad"
    );
    assert!(
        cleared(gpu, &nodes),
        "{what}: gradients or use counts not cleared"
    );
    let new_rel = if case.decoder.uses_relations() {
        let (new_rel, _) = rels.download(gpu).unwrap();
        assert!(
            rel_err(&new_rel, &rel) > 0.0 && new_rel.iter().all(|x| x.is_finite()),
            "{what}: relations"
        );
        Some(new_rel)
    } else {
        None
    };

    // The trainer's path from the same tables: `step` gives the rows used once their
    // AdaGrad step in the backward kernels; it must end where forward_backward then apply
    // ended, with the gradients and use counts cleared.
    let mut nodes = DeviceTable::from_host(gpu, d, &emb, &state).unwrap();
    let mut rels = DeviceTable::from_host(gpu, rw, &rel, &rel_state).unwrap();
    engine.step(gpu, &mut nodes, Some(&mut rels)).unwrap();
    let (step_emb, step_state) = nodes.download(gpu).unwrap();
    let step_moved = moves(&step_emb, &emb);
    let (path_err, path_state_err) = (
        rel_err(&step_moved, &moved),
        rel_err(&step_state, &new_state),
    );
    println!(
        "{what}: step vs forward_backward + apply: moves {path_err:.2e}, state {path_state_err:.2e}"
    );
    assert!(path_err < 1e-5 && path_state_err < 1e-6, "{what}: step");
    assert!(
        cleared(gpu, &nodes),
        "{what}: gradients or use counts not cleared after step"
    );
    if let Some(new_rel) = new_rel {
        let (step_rel, _) = rels.download(gpu).unwrap();
        let (a, b) = (moves(&step_rel, &rel), moves(&new_rel, &rel));
        // Relations take the gradient table on both paths; their sums (many atomics, much
        // cancellation at small scales) differ by the atomics' order, as the gradient
        // check's tolerance allows.
        let err = rel_err(&a, &b);
        println!("{what}: step vs forward_backward + apply: relation moves {err:.2e}");
        assert!(err < 1e-3, "{what}: relations after step");
    }
}

/// The first case of the step tests, which the others vary.
const COMPLEX: Case = Case {
    decoder: Decoder::ComplEx,
    loss: Loss::SoftmaxCe,
    dim: 100,
    batch: 3001,
    chunks: 3,
    k: 260,
    group: 2,
    exact: false,
    scale: 1.0,
    zero_relations: false,
    tiny_rows: false,
    grad_tolerance: 1e-3,
};

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn training_step_matches_the_cpu_engine() {
    let gpu = gpu();
    let s = seed("step");
    let cases = [
        COMPLEX,
        Case {
            scale: 4e-3,
            ..COMPLEX
        },
        Case {
            decoder: Decoder::Dot,
            loss: Loss::SoftmaxCe,
            dim: 100,
            batch: 2000,
            chunks: 2,
            k: 300,
            group: 4,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        // d = 50: the per-row kernels move float2 pieces (float4 needs d % 4 == 0).
        Case {
            decoder: Decoder::DistMult,
            loss: Loss::Logistic,
            dim: 50,
            batch: 999,
            chunks: 4,
            k: 129,
            group: 1,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        // Many negatives: the logistic loss's G (about 0.5 / k = 1.5e-5) is below FP16's
        // smallest normal, so the fused kernels' G scale must keep its digits.
        Case {
            decoder: Decoder::Dot,
            loss: Loss::Logistic,
            dim: 64,
            batch: 500,
            chunks: 1,
            k: 32768,
            group: 2,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        // h = 17: ComplEx's halves one float at a time.
        Case {
            decoder: Decoder::ComplEx,
            loss: Loss::Ranking { margin: 0.1 },
            dim: 34,
            batch: 1500,
            chunks: 5,
            k: 64,
            group: 3,
            exact: true,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        // d = 128: the widest fused kernels.
        Case {
            decoder: Decoder::DistMult,
            loss: Loss::SoftmaxCe,
            dim: 128,
            batch: 1000,
            chunks: 2,
            k: 200,
            group: 2,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        // d > 128: the unfused path (score matrices through device memory).
        Case {
            decoder: Decoder::ComplEx,
            loss: Loss::SoftmaxCe,
            dim: 160,
            batch: 800,
            chunks: 2,
            k: 100,
            group: 4,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        Case {
            decoder: Decoder::Dot,
            loss: Loss::Logistic,
            dim: 17,
            batch: 7,
            chunks: 10,
            k: 33,
            group: 2,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
    ];
    for case in &cases {
        check_step(&gpu, case, s);
    }
}

/// Filtered negatives (`set_known_edges`): the fused decoders switch to the unfused products,
/// whose scores the filter reaches; every loss and TransE, against the CPU's exclusion masks.
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn filtered_negatives_match_the_cpu_engine() {
    let gpu = gpu();
    let s = seed("filtered");
    let cases = [
        COMPLEX,
        Case {
            decoder: Decoder::Dot,
            loss: Loss::Logistic,
            dim: 64,
            batch: 999,
            chunks: 4,
            k: 129,
            group: 4,
            ..COMPLEX
        },
        Case {
            decoder: Decoder::DistMult,
            loss: Loss::Ranking { margin: 0.1 },
            dim: 36,
            exact: true,
            ..COMPLEX
        },
        Case {
            decoder: Decoder::TransEL2,
            loss: Loss::SoftmaxCe,
            dim: 40,
            batch: 1200,
            chunks: 2,
            k: 100,
            ..COMPLEX
        },
        // 70 known negatives a row: more than a warp holds, so the rows' ranges are searched.
        Case {
            batch: 1000,
            chunks: 2,
            k: 700,
            ..COMPLEX
        },
    ];
    for case in &cases {
        check_step_with(&gpu, case, s, true, StateLayout::Element);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn row_wise_adagrad_matches_the_cpu_engine() {
    let gpu = gpu();
    let s = seed("row-wise");
    let dot = Case {
        decoder: Decoder::Dot,
        dim: 100,
        batch: 2000,
        chunks: 2,
        k: 300,
        group: 4,
        ..COMPLEX
    };
    // Fused (ComplEx, Dot at d = 100), unfused (d = 36) and filtered steps.
    for (case, filtered) in [
        (COMPLEX, false),
        (dot, false),
        (Case { dim: 36, ..dot }, false),
        (COMPLEX, true),
    ] {
        check_step_with(&gpu, &case, s, filtered, StateLayout::Row);
    }
}

/// The largest distance between two neighbours of `x` in `dtype` (its gap above |x|).
fn gap16(x: f32, dtype: Dtype) -> f32 {
    let bits = match dtype {
        Dtype::Bf16 => 8,
        _ => 11,
    };
    // Subnormal halves have the spacing of the smallest normal one's.
    let magnitude = x.abs().max(if dtype == Dtype::F16 { 6.1e-5 } else { 0.0 });
    2f32.powi(magnitude.log2().floor() as i32 + 1 - bits)
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn rounded_rows_take_their_step_in_place() {
    // Every node row of the batch used once (sources, destinations and negatives all
    // distinct), so every node row takes its step in the backward kernels: with 16-bit rows
    // that step must round as legend_adagrad does. Fused ComplEx and Dot, both state layouts.
    let gpu = gpu();
    let s = seed("rounded in place");
    let mut rng = Rng(s);
    let (entities, relations) = (20_000usize, 37usize);
    let dot = Case {
        decoder: Decoder::Dot,
        ..COMPLEX
    };
    for (case, layout, dtype) in [
        (COMPLEX, StateLayout::Element, Dtype::Bf16),
        (COMPLEX, StateLayout::Row, Dtype::Bf16),
        (dot, StateLayout::Element, Dtype::F16),
        (dot, StateLayout::Row, Dtype::F16),
    ] {
        let case = Case {
            batch: 300,
            chunks: 3,
            k: 50,
            ..case
        };
        let d = case.dim;
        let what = format!("{} state {layout} {dtype}", case.decoder);
        let width = layout.width(d);
        // Rows representable in the format, as a 16-bit run's are.
        let emb: Vec<f32> = (0..entities * d)
            .map(|_| dtype.round_nearest(rng.uniform(-0.25, 0.25)))
            .collect();
        let rel: Vec<f32> = (0..relations * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let state: Vec<f32> = (0..entities * width)
            .map(|_| rng.uniform(0.1, 1.0))
            .collect();
        let rel_state: Vec<f32> = (0..relations * d).map(|_| rng.uniform(0.1, 1.0)).collect();
        // Distinct node ids: a partial shuffle of all of them.
        let used = 2 * case.batch + 2 * case.chunks * case.k;
        let mut ids: Vec<u32> = (0..entities as u32).collect();
        for i in 0..used {
            let j = i + rng.below((entities - i) as u64) as usize;
            ids.swap(i, j);
        }
        let edges: Vec<[u32; 3]> = (0..case.batch)
            .map(|i| {
                let r = rng.below(relations as u64) as u32;
                [ids[2 * i], r, ids[2 * i + 1]]
            })
            .collect();
        let negs = ids[2 * case.batch..used].to_vec();
        let (model, opt, shape) = step_engine(&case, layout, case.batch);
        let rounding = StepRounding {
            dtype,
            batch: BatchKey::new(s, 3, 0, rng.below(1000)),
        };
        let degrees = vec![1u32; entities];
        let mut engine = GpuBatchEngine::new(&gpu, model, opt, shape, &degrees, relations).unwrap();
        engine.set_rounding(Some(rounding));
        engine.set_batch(&gpu, &edges).unwrap();
        engine.set_negatives(&gpu, &negs).unwrap();
        // The in-place path (step) and the gradient table's (forward_backward, then
        // legend_adagrad) from the same tables.
        let tables = || {
            (
                DeviceTable::from_host(&gpu, d, &emb, &state).unwrap(),
                DeviceTable::from_host(&gpu, d, &rel, &rel_state).unwrap(),
            )
        };
        let (mut nodes, mut rels) = tables();
        engine.step(&gpu, &mut nodes, Some(&mut rels)).unwrap();
        let (step_emb, step_state) = nodes.download(&gpu).unwrap();
        assert!(cleared(&gpu, &nodes), "{what}: not cleared after step");
        let (mut nodes, mut rels) = tables();
        engine
            .forward_backward(&gpu, &mut nodes, Some(&mut rels))
            .unwrap();
        let gn = nodes.pending_gradients(&gpu).unwrap();
        engine.apply(&gpu, &mut nodes, Some(&mut rels)).unwrap();
        let (table_emb, table_state) = nodes.download(&gpu).unwrap();
        engine.check_range(&gpu).unwrap();

        // The CPU's step: AdaGrad, then StepRounding on every updated row, from the given
        // gradients.
        let cpu_rows = |grads: &[f32]| {
            let (mut emb_out, mut state_out) = (emb.clone(), state.clone());
            for r in 0..entities {
                let g = &grads[r * d..(r + 1) * d];
                if g.iter().any(|&x| x != 0.0) {
                    let row = &mut emb_out[r * d..(r + 1) * d];
                    opt.apply_row(row, &mut state_out[r * width..(r + 1) * width], g);
                    rounding.round(r as u64, row).unwrap();
                }
            }
            (emb_out, state_out)
        };
        let (_, want_gn, _) = cpu_step(&case, &Variant::default(), &emb, &rel, &edges, &negs, None);
        let (want_emb, want_state) = cpu_rows(&want_gn);
        // The same step from the GPU's gradients: only the two AdaGrads' last bits differ.
        let (same_emb, _) = cpu_rows(&gn);
        let touched = (0..entities)
            .filter(|&r| gn[r * d..(r + 1) * d].iter().any(|&x| x != 0.0))
            .count();
        assert_eq!(touched, used, "{what}: rows with a gradient");
        // Every value a 16-bit one: an in-place step that did not round leaves f32 values.
        let unrepresentable = step_emb
            .iter()
            .filter(|&&v| dtype.round_nearest(v) != v)
            .count();
        assert_eq!(unrepresentable, 0, "{what}: step values not {dtype}");
        // Both GPU paths: the same stream for a row, the same bits.
        let differ = |a: &[f32], b: &[f32]| a.iter().zip(b).filter(|(x, y)| x != y).count();
        let (paths, paths_state) = (
            differ(&step_emb, &table_emb),
            differ(&step_state, &table_state),
        );
        // Against the CPU's step from the same gradients: equal but for the few values whose
        // AdaGrad results (a last bit apart) a rounding boundary separates, one step apart.
        let same_differ = differ(&step_emb, &same_emb);
        let beyond_one = step_emb
            .iter()
            .zip(&same_emb)
            .filter(|(x, y)| (*x - *y).abs() > gap16(x.abs().max(y.abs()), dtype) + 1e-7)
            .count();
        // Against the CPU's own gradients (the fused kernels' FP16 products give the GPU's an
        // error near 1e-5): more values a step or more apart, near 0 several steps (H200,
        // 2026-11-27: 159 and 171 of 90 000 differed, 16 and 9 by more than a step).
        let cpu_differ = differ(&step_emb, &want_emb);
        let move_err = rel_err(&moves(&step_emb, &emb), &moves(&want_emb, &emb));
        let state_err = rel_err(&step_state, &want_state);
        println!(
            "{what}: {used} rows in place; step vs legend_adagrad: {paths} values and \
             {paths_state} states differ; vs the CPU's step from the GPU's gradients: \
             {same_differ} values differ ({beyond_one} by more than a {dtype} step); vs the CPU: \
             {cpu_differ} of {} values differ, moves rel err {move_err:.2e}, state {state_err:.2e}",
            step_emb.len()
        );
        assert_eq!((paths, paths_state), (0, 0), "{what}: the two GPU paths");
        assert!(
            beyond_one == 0 && same_differ * 1000 < used * d,
            "{what}: against the CPU's step from the GPU's gradients"
        );
        // The moves are mostly the rounding's (a step is smaller than the format's gap), so a
        // value one step off moves a whole gap: the moves' error is printed, not bounded. A
        // gradient error flips a rounding in proportion to error / gap, and f16's gap is 8 times
        // narrower than bf16's (H200, 2026-11-27: bf16 180 and 185 of 90 000 values apart, f16
        // 1035), hence 1 % of the values for bf16 and 4 % for f16.
        let percent = if dtype == Dtype::F16 { 4 } else { 1 };
        assert!(
            cpu_differ * 100 < percent * used * d && state_err < 1e-5,
            "{what}: against the CPU"
        );
    }
}

/// TransE on the CUDA cores: distances summed elementwise, so no TF32 rounding, and the zero
/// subgradients (L1 ties, L2 at distance 0) as the CPU takes them.
/// Reciprocal relations (side 0 through the inverse rows) and the N3 / L2 regularisers (their
/// gradient once per occurrence of a row among the positives, in the rows backward: the
/// gradient table and the in-place step alike), on the fused and unfused paths, every
/// decoder with its own backward, both state layouts, filtered negatives.
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn reciprocal_relations_and_regularisers_match_the_cpu_engine() {
    let gpu = gpu();
    let s = seed("reciprocal-regularised");
    let recip = |penalty: Option<(Penalty, f32)>| Variant {
        reciprocal: true,
        penalty,
        ..Variant::default()
    };
    let n3 = Some((Penalty::N3, 0.1));
    let l2 = Some((Penalty::L2, 0.1));
    let distmult = Case {
        decoder: Decoder::DistMult,
        loss: Loss::Logistic,
        dim: 50,
        batch: 999,
        chunks: 4,
        k: 129,
        group: 1,
        ..COMPLEX
    };
    let transe = Case {
        decoder: Decoder::TransEL2,
        dim: 40,
        batch: 1200,
        chunks: 2,
        k: 100,
        ..COMPLEX
    };
    let cases = [
        // Fused ComplEx (d = 100), with and without a regulariser.
        (COMPLEX, recip(None)),
        (COMPLEX, recip(n3)),
        (
            COMPLEX,
            Variant {
                penalty: n3,
                ..Variant::default()
            },
        ),
        // h = 17 (one float at a time) and d > 128 (unfused).
        (
            Case {
                dim: 34,
                loss: Loss::Ranking { margin: 0.1 },
                exact: true,
                ..COMPLEX
            },
            recip(n3),
        ),
        (
            Case {
                dim: 160,
                batch: 800,
                chunks: 2,
                k: 100,
                ..COMPLEX
            },
            recip(l2),
        ),
        (distmult, recip(l2)),
        (
            Case {
                dim: 128,
                ..distmult
            },
            recip(n3),
        ),
        // Dot: the nodes' regulariser alone.
        (
            Case {
                decoder: Decoder::Dot,
                dim: 64,
                ..distmult
            },
            Variant {
                penalty: l2,
                ..Variant::default()
            },
        ),
        // TransE L2 fused (d = 40), L1 unfused.
        (transe, recip(n3)),
        (
            Case {
                decoder: Decoder::TransEL1,
                dim: 36,
                ..transe
            },
            recip(l2),
        ),
        // Row-wise state (the in-place row step) and filtered negatives.
        (
            COMPLEX,
            Variant {
                layout: StateLayout::Row,
                ..recip(n3)
            },
        ),
        (
            Case {
                dim: 36,
                ..distmult
            },
            Variant {
                layout: StateLayout::Row,
                ..recip(l2)
            },
        ),
        (
            COMPLEX,
            Variant {
                filtered: true,
                ..recip(n3)
            },
        ),
    ];
    for (case, variant) in &cases {
        check_variant(&gpu, case, s, variant);
    }
}

/// RotatE (its own queries and rows backward, the modulus-distance products) and RESCAL (its
/// own queries and rows backward over d × d relation matrices, the gemm products), and the
/// self-adversarial loss (on the unfused path, whatever the decoder), against the CPU engine:
/// reciprocal relations, N3 and L2 (RESCAL), both state layouts and filtered negatives.
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn rotate_rescal_and_the_self_adversarial_loss_match_the_cpu_engine() {
    let gpu = gpu();
    let s = seed("rotate-rescal-adversarial");
    let adversarial = Loss::SelfAdversarial {
        margin: 6.0,
        temperature: 1.0,
    };
    let rotate = Case {
        decoder: Decoder::RotatE,
        dim: 100,
        batch: 1000,
        chunks: 2,
        k: 100,
        group: 2,
        ..COMPLEX
    };
    let rescal = Case {
        decoder: Decoder::Rescal,
        dim: 16,
        batch: 999,
        chunks: 3,
        k: 129,
        group: 2,
        ..COMPLEX
    };
    let plain = Variant::default();
    let recip = Variant {
        reciprocal: true,
        ..plain
    };
    let cases = [
        (rotate, plain),
        (rotate, recip),
        // h = 35: a partial pair tile; the self-adversarial loss with its weights.
        (
            Case {
                dim: 70,
                loss: adversarial,
                ..rotate
            },
            recip,
        ),
        (
            Case {
                loss: adversarial,
                ..rotate
            },
            Variant {
                layout: StateLayout::Row,
                ..plain
            },
        ),
        // Filtered negatives (−∞ scores, zero weights in the modulus gradients). Not with the
        // self-adversarial loss: its weights renormalise over the negatives left, so filtering
        // a tenth of them hardly changes its loss, which the test asks of a filtered case.
        (
            rotate,
            Variant {
                filtered: true,
                ..plain
            },
        ),
        // Zero phases and self-loops: queries at distance 0 from their truths, where no
        // gradient flows.
        (
            Case {
                zero_relations: true,
                ..rotate
            },
            plain,
        ),
        (rescal, plain),
        (
            Case {
                dim: 24,
                loss: Loss::Logistic,
                ..rescal
            },
            Variant {
                penalty: Some((Penalty::N3, 0.1)),
                ..recip
            },
        ),
        (
            rescal,
            Variant {
                layout: StateLayout::Row,
                filtered: true,
                penalty: Some((Penalty::L2, 0.1)),
                ..plain
            },
        ),
        // The self-adversarial loss on decoders the fused kernels would otherwise take.
        (
            Case {
                loss: adversarial,
                ..COMPLEX
            },
            plain,
        ),
        (
            Case {
                decoder: Decoder::DistMult,
                loss: Loss::SelfAdversarial {
                    margin: 1.0,
                    temperature: 0.5,
                },
                dim: 64,
                ..COMPLEX
            },
            recip,
        ),
    ];
    for (case, variant) in &cases {
        check_variant(&gpu, case, s, variant);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn transe_l1_step_matches_the_cpu_engine() {
    let gpu = gpu();
    let s = seed("transe l1");
    let cases = [
        Case {
            decoder: Decoder::TransEL1,
            ..COMPLEX
        },
        // Grid inputs: many exact ties between query and negative elements (sign 0), and the
        // ranking hinge decided identically on both engines.
        Case {
            decoder: Decoder::TransEL1,
            loss: Loss::Ranking { margin: 0.5 },
            dim: 36,
            batch: 1501,
            chunks: 5,
            k: 64,
            group: 3,
            exact: true,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        // More than 128 columns (two gradient column tiles and a partial one).
        Case {
            decoder: Decoder::TransEL1,
            loss: Loss::SoftmaxCe,
            dim: 130,
            batch: 999,
            chunks: 4,
            k: 129,
            group: 1,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
        // B < C. (At d = 130 the logistic loss saturates: L1 distances near 65 leave the
        // negatives no gradient to check.)
        Case {
            decoder: Decoder::TransEL1,
            loss: Loss::Logistic,
            dim: 9,
            batch: 7,
            chunks: 10,
            k: 33,
            group: 2,
            exact: false,
            scale: 1.0,
            zero_relations: false,
            tiny_rows: false,
            grad_tolerance: 1e-3,
        },
    ];
    for case in &cases {
        check_step(&gpu, case, s);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn transe_l2_step_matches_the_cpu_engine() {
    let gpu = gpu();
    let s = seed("transe l2");
    let softmax = Case {
        decoder: Decoder::TransEL2,
        loss: Loss::SoftmaxCe,
        dim: 100,
        batch: 2002,
        chunks: 4,
        k: 300,
        group: 4,
        ..COMPLEX
    };
    let cases = [
        softmax,
        Case {
            loss: Loss::Logistic,
            dim: 17,
            batch: 999,
            k: 129,
            group: 1,
            ..softmax
        },
        // The usual initialisation's scale, jobs whose rows end inside a tile (as a
        // trainer's do), and nodes near the origin.
        Case {
            dim: 32,
            batch: 700,
            chunks: 3,
            k: 50,
            group: 3,
            scale: 1e-3,
            tiny_rows: true,
            grad_tolerance: 1e-3,
            ..softmax
        },
        // Negatives at distance 0 from their queries (about 1 in 4001 pairs) and
        // self-loops: the fused path's pairs without a gradient, amid the others.
        Case {
            dim: 62,
            batch: 2501,
            chunks: 3,
            k: 250,
            group: 2,
            zero_relations: true,
            ..softmax
        },
        Case {
            loss: Loss::Logistic,
            dim: 40,
            batch: 1201,
            chunks: 2,
            k: 200,
            group: 2,
            zero_relations: true,
            ..softmax
        },
        // At the widest fused kernel's largest d: the expansion's rounding of a pair at
        // distance 0 against the zero threshold.
        Case {
            dim: 126,
            batch: 1200,
            chunks: 2,
            k: 250,
            group: 2,
            zero_relations: true,
            ..softmax
        },
        // The same at distances near 100 (exact on the grid): a pair at distance 0 then
        // outweighs the others by e^100, past FP32 unless softmax's shift counts it.
        Case {
            batch: 1500,
            chunks: 3,
            group: 2,
            exact: true,
            scale: 64.0,
            zero_relations: true,
            ..softmax
        },
        // Queries far below FP16's normals (they need their own FP16 scale: at scale 1 a
        // pair at distance 0 would come out well above the zero threshold)...
        Case {
            dim: 48,
            batch: 900,
            chunks: 2,
            k: 200,
            group: 2,
            scale: 1e-6,
            zero_relations: true,
            ..softmax
        },
        // ...and far above FP16's largest (2^20: queries up to 2^18), on the grid (distances
        // near 10^6, too far for FP32 to resolve the softmax to 1e-3).
        Case {
            dim: 24,
            batch: 900,
            chunks: 2,
            k: 150,
            group: 2,
            exact: true,
            scale: 1048576.0,
            grad_tolerance: 0.1,
            ..softmax
        },
        Case {
            loss: Loss::Ranking { margin: 0.25 },
            dim: 20,
            batch: 803,
            chunks: 2,
            k: 100,
            exact: true,
            ..softmax
        },
    ];
    for case in &cases {
        check_step(&gpu, case, s);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn slot_indexed_table_matches_the_global_table() {
    let gpu = gpu();
    let s = seed("slots");
    let mut rng = Rng(s);
    let (entities, relations, d, k, batch) = (4001u64, 13usize, 100usize, 200usize, 1000usize);
    let scheme = PartitionScheme::new(entities, 4).unwrap();
    let rpp = scheme.rows_per_partition;
    // Partitions 2 and 0 resident, in slots 0 and 1.
    let resident = [2u32, 0];
    let map = SlotMap {
        rows_per_partition: rpp,
        slot_of: vec![1, SlotMap::ABSENT, 0, SlotMap::ABSENT],
    };
    let n = entities as usize * d;
    let emb: Vec<f32> = (0..n).map(|_| rng.uniform(-0.5, 0.5)).collect();
    let state: Vec<f32> = (0..n).map(|_| rng.uniform(0.1, 1.0)).collect();
    let rel: Vec<f32> = (0..relations * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let rel_state = vec![0.5f32; relations * d];
    let degrees: Vec<u32> = (0..entities).map(|_| rng.below(20) as u32).collect();
    let pick = |rng: &mut Rng| {
        let r = scheme.range(resident[rng.below(2) as usize]);
        (r.start + rng.below(r.end - r.start)) as u32
    };
    let edges: Vec<[u32; 3]> = (0..batch)
        .map(|_| {
            [
                pick(&mut rng),
                rng.below(relations as u64) as u32,
                pick(&mut rng),
            ]
        })
        .collect();
    let ranges: Vec<_> = resident.iter().map(|&p| scheme.range(p)).collect();
    let keys = negative_keys(BatchKey::new(s, 1, 0, 0), 2);
    let model = ChunkModel {
        decoder: Decoder::ComplEx,
        loss: Loss::SoftmaxCe,
        dim: d,
    };
    let shape = BatchShape {
        max_batch: batch,
        num_chunks: 2,
        negatives: k,
        group: 4,
    };
    let opt = AdaGrad::default();
    let run = |slots: Option<SlotMap>, emb: &[f32], state: &[f32]| {
        let mut engine = GpuBatchEngine::new(&gpu, model, opt, shape, &degrees, relations).unwrap();
        engine.set_slots(&gpu, slots).unwrap();
        let mut nodes = DeviceTable::from_host(&gpu, d, emb, state).unwrap();
        let mut rels = DeviceTable::from_host(&gpu, d, &rel, &rel_state).unwrap();
        engine.set_batch(&gpu, &edges).unwrap();
        engine.sample_negatives(&gpu, &ranges, &keys, 0.5).unwrap();
        let negs = engine.negatives(&gpu).unwrap();
        engine.step(&gpu, &mut nodes, Some(&mut rels)).unwrap();
        (
            engine.loss(&gpu).unwrap(),
            nodes.download(&gpu).unwrap().0,
            negs,
        )
    };
    let (loss_a, emb_a, negs_a) = run(None, &emb, &state);
    // The same rows, gathered into a two-slot table.
    let rows = map.table_rows() as usize;
    let (mut slot_emb, mut slot_state) = (vec![0.0f32; rows * d], vec![0.0f32; rows * d]);
    for id in ranges.iter().flat_map(|r| r.clone()) {
        let row = map.row(id).unwrap() as usize;
        let g = id as usize;
        slot_emb[row * d..(row + 1) * d].copy_from_slice(&emb[g * d..(g + 1) * d]);
        slot_state[row * d..(row + 1) * d].copy_from_slice(&state[g * d..(g + 1) * d]);
    }
    let (loss_b, emb_b, negs_b) = run(Some(map.clone()), &slot_emb, &slot_state);
    let want_negs: Vec<u32> = negs_a
        .iter()
        .map(|&id| map.row(u64::from(id)).unwrap() as u32)
        .collect();
    assert_eq!(
        negs_b, want_negs,
        "slot negatives are the global ones, remapped"
    );
    assert!(
        (loss_a - loss_b).abs() <= 1e-6 * loss_a.abs(),
        "loss {loss_a} vs {loss_b}"
    );
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for id in ranges.iter().flat_map(|r| r.clone()) {
        let row = map.row(id).unwrap() as usize;
        let g = id as usize;
        got.extend_from_slice(&emb_b[row * d..(row + 1) * d]);
        want.extend_from_slice(&emb_a[g * d..(g + 1) * d]);
    }
    let err = rel_err(&got, &want);
    println!(
        "slot table vs global table: loss {loss_a:.6e} / {loss_b:.6e}, rows rel err {err:.2e}"
    );
    assert!(err < 1e-6, "rows differ: {err:e}");
    // Rows of partitions that were not resident stay untouched in the global run.
    for p in [1u32, 3] {
        let r = scheme.range(p);
        let span = r.start as usize * d..r.end as usize * d;
        assert_eq!(emb_a[span.clone()], emb[span], "partition {p} moved");
    }
    // A batch touching a partition that is not resident is refused.
    let mut engine = GpuBatchEngine::new(&gpu, model, opt, shape, &degrees, relations).unwrap();
    engine.set_slots(&gpu, Some(map)).unwrap();
    let outside = scheme.range(1).start as u32;
    assert!(
        engine
            .set_batch(&gpu, &[[outside, 0, edges[0][2]]])
            .is_err()
    );
}
