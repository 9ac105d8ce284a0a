//! Each kernel against the CPU reference (legend-model, legend-engine's sampler) on fresh
//! random inputs every run. Needs a GPU: without a driver, NVRTC or device every test prints
//! a skip line and passes.

use legend_cuda::{BatchShape, DeviceTable, Gpu, GpuBatchEngine, GpuError, negative_keys};
use legend_dataset::PartitionScheme;
use legend_engine::sampler::NegativeSampler;
use legend_model::{
    AdaGrad, Chunk, ChunkModel, ChunkWorkspace, Decoder, Distribution, Loss, Table, fill_row,
};

fn gpu() -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e @ (GpuError::NoDriver | GpuError::NoNvrtc | GpuError::NoDevice { .. })) => {
            println!("skip: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// A fresh seed per run (printed, so a failure can be replayed with LEGEND_TEST_SEED).
fn seed(test: &str) -> u64 {
    let s = std::env::var("LEGEND_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("{test}: seed {s}");
    s
}

/// A small counter-based generator for test inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

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
fn init_matches_fill_row() {
    let Some(gpu) = gpu() else { return };
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
fn sampling_matches_the_cpu_sampler() {
    let Some(gpu) = gpu() else { return };
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
        let keys = negative_keys(s, 3, rng.below(1000), chunks);
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
}

/// The CPU reference of one step: per-chunk forward/backward, gradients summed per row.
fn cpu_step(
    case: &Case,
    emb: &[f32],
    rel: &[f32],
    edges: &[[u32; 3]],
    negs: &[u32],
) -> (f64, Vec<f32>, Vec<f32>) {
    let d = case.dim;
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
    let rows = |table: &[f32], ids: &mut dyn Iterator<Item = u32>| -> Vec<f32> {
        ids.flat_map(|i| table[i as usize * d..(i as usize + 1) * d].iter().copied())
            .collect()
    };
    for c in 0..chunks {
        let part = &edges[c * b / chunks..(c + 1) * b / chunks];
        let ns = &negs[2 * c * case.k..(2 * c + 1) * case.k];
        let nd = &negs[(2 * c + 1) * case.k..(2 * c + 2) * case.k];
        let src = rows(emb, &mut part.iter().map(|e| e[0]));
        let dst = rows(emb, &mut part.iter().map(|e| e[2]));
        let r = if case.decoder.uses_relations() {
            rows(rel, &mut part.iter().map(|e| e[1]))
        } else {
            Vec::new()
        };
        let neg_src = rows(emb, &mut ns.iter().copied());
        let neg_dst = rows(emb, &mut nd.iter().copied());
        let chunk = Chunk {
            src: &src,
            rel: &r,
            dst: &dst,
            neg_src: &neg_src,
            neg_dst: &neg_dst,
            exclude_src: None,
            exclude_dst: None,
        };
        loss += ws.forward_backward(&model, &chunk);
        let g = ws.grads();
        let add = |table: &mut [f32], id: u32, grad: &[f32]| {
            for (a, b) in table[id as usize * d..(id as usize + 1) * d]
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
                add(&mut gr, e[1], &g.rel[i * d..(i + 1) * d]);
            }
        }
        for (j, &id) in ns.iter().enumerate() {
            add(&mut gn, id, &g.neg_src[j * d..(j + 1) * d]);
        }
        for (j, &id) in nd.iter().enumerate() {
            add(&mut gn, id, &g.neg_dst[j * d..(j + 1) * d]);
        }
    }
    (loss, gn, gr)
}

fn check_step(gpu: &Gpu, case: &Case, s: u64) {
    let mut rng = Rng(s ^ case.dim as u64 ^ ((case.k as u64) << 20));
    let (entities, relations, d) = (4001usize, 37usize, case.dim);
    let mut value = |scale: f32, exact: bool| {
        if exact {
            (rng.below(17) as f32 - 8.0) * scale / 8.0
        } else {
            rng.uniform(-scale, scale)
        }
    };
    let emb: Vec<f32> = (0..entities * d).map(|_| value(0.25, case.exact)).collect();
    let rel: Vec<f32> = (0..relations * d).map(|_| value(1.0, case.exact)).collect();
    // A non-zero state keeps the AdaGrad step a smooth function of the gradient.
    let state: Vec<f32> = (0..entities * d).map(|_| rng.uniform(0.1, 1.0)).collect();
    let rel_state: Vec<f32> = (0..relations * d).map(|_| rng.uniform(0.1, 1.0)).collect();
    let edges: Vec<[u32; 3]> = (0..case.batch)
        .map(|_| {
            [
                rng.below(entities as u64) as u32,
                rng.below(relations as u64) as u32,
                rng.below(entities as u64) as u32,
            ]
        })
        .collect();
    let chunks = case.chunks.min(case.batch);
    let negs: Vec<u32> = (0..2 * chunks * case.k)
        .map(|_| rng.below(entities as u64) as u32)
        .collect();

    let model = ChunkModel {
        decoder: case.decoder,
        loss: case.loss,
        dim: d,
    };
    let opt = AdaGrad {
        lr: 0.05,
        eps: 1e-9,
    };
    let shape = BatchShape {
        max_batch: case.batch + 5,
        num_chunks: case.chunks,
        negatives: case.k,
        group: case.group,
    };
    let degrees = vec![1u32; entities];
    let mut engine = GpuBatchEngine::new(gpu, model, opt, shape, &degrees, relations).unwrap();
    let mut nodes = DeviceTable::from_host(gpu, d, &emb, &state).unwrap();
    let mut rels = DeviceTable::from_host(gpu, d, &rel, &rel_state).unwrap();
    engine.set_batch(gpu, &edges).unwrap();
    engine.set_negatives(gpu, &negs).unwrap();
    engine.poison_scratch(gpu).unwrap();
    engine
        .forward_backward(gpu, &mut nodes, Some(&mut rels))
        .unwrap();
    let loss = engine.loss(gpu).unwrap();
    let gn = nodes.pending_gradients(gpu).unwrap();
    let gr = rels.pending_gradients(gpu).unwrap();

    let (want_loss, want_gn, want_gr) = cpu_step(case, &emb, &rel, &edges, &negs);
    let what = format!(
        "{} {} d={} B={} C={} k={} group={}",
        case.decoder, case.loss, d, case.batch, case.chunks, case.k, case.group
    );
    let loss_err = (loss - want_loss).abs() / want_loss.abs().max(1e-30);
    let gn_err = rel_err(&gn, &want_gn);
    println!("{what}: loss {loss:.6e} (rel err {loss_err:.2e}), node grad rel err {gn_err:.2e}");
    assert!(loss_err < 1e-3, "{what}: loss {loss} vs {want_loss}");
    assert!(gn_err < 1e-3, "{what}: node gradients, rel err {gn_err:e}");
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
            gr_err < 1e-3,
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
                &mut want_state[r * d..(r + 1) * d],
                g,
            );
        }
    }
    let moved: Vec<f32> = new_emb.iter().zip(&emb).map(|(a, b)| a - b).collect();
    let want_moved: Vec<f32> = want_emb.iter().zip(&emb).map(|(a, b)| a - b).collect();
    let step_err = rel_err(&moved, &want_moved);
    let state_err = rel_err(&new_state, &want_state);
    println!("{what}: AdaGrad step rel err {step_err:.2e}, state rel err {state_err:.2e}");
    assert!(step_err < 1e-5 && state_err < 1e-6, "{what}: AdaGrad");
    assert!(
        nodes
            .pending_gradients(gpu)
            .unwrap()
            .iter()
            .all(|&x| x == 0.0),
        "{what}: gradients not cleared"
    );
    if case.decoder.uses_relations() {
        let (new_rel, _) = rels.download(gpu).unwrap();
        assert!(
            rel_err(&new_rel, &rel) > 0.0 && new_rel.iter().all(|x| x.is_finite()),
            "{what}: relations"
        );
    }
}

#[test]
fn training_step_matches_the_cpu_engine() {
    let Some(gpu) = gpu() else { return };
    let s = seed("step");
    let cases = [
        Case {
            decoder: Decoder::ComplEx,
            loss: Loss::SoftmaxCe,
            dim: 100,
            batch: 3001,
            chunks: 3,
            k: 260,
            group: 2,
            exact: false,
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
        },
        Case {
            decoder: Decoder::DistMult,
            loss: Loss::Logistic,
            dim: 64,
            batch: 999,
            chunks: 4,
            k: 129,
            group: 1,
            exact: false,
        },
        Case {
            decoder: Decoder::ComplEx,
            loss: Loss::Ranking { margin: 0.1 },
            dim: 36,
            batch: 1500,
            chunks: 5,
            k: 64,
            group: 3,
            exact: true,
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
        },
    ];
    for case in &cases {
        check_step(&gpu, case, s);
    }
}

#[test]
fn transe_is_refused_with_a_clear_error() {
    let Some(gpu) = gpu() else { return };
    let model = ChunkModel {
        decoder: Decoder::TransEL2,
        loss: Loss::SoftmaxCe,
        dim: 8,
    };
    let shape = BatchShape {
        max_batch: 8,
        num_chunks: 1,
        negatives: 4,
        group: 2,
    };
    let err = GpuBatchEngine::new(&gpu, model, AdaGrad::default(), shape, &[1; 10], 1)
        .err()
        .expect("refused");
    assert!(matches!(err, GpuError::Unsupported(_)), "{err}");
}
