//! The chunk path against (1) a naive per-triple f32 reference built from `Decoder::score`,
//! and (2) central finite differences of an independently written f64 chunk loss.

use legend_model::{
    Chunk, ChunkModel, ChunkWorkspace, Decoder, Distribution, Loss, Side, Table, fill_row,
};
use proptest::prelude::*;

/// The self-adversarial loss at temperature 0 (uniform weights, which the chunk's gradient
/// holds constant, as the reference's finite differences then do too).
const LOSSES: [Loss; 4] = [
    Loss::SoftmaxCe,
    Loss::Logistic,
    Loss::Ranking { margin: 0.5 },
    Loss::SelfAdversarial {
        margin: 0.3,
        temperature: 0.0,
    },
];

/// Owned rows of a chunk, filled from the crate's own counter-based generator.
#[derive(Clone, Debug)]
struct Data {
    dim: usize,
    /// Floats of a relation row (`Decoder::relation_width`).
    rw: usize,
    src: Vec<f32>,
    rel: Vec<f32>,
    dst: Vec<f32>,
    neg_src: Vec<f32>,
    neg_dst: Vec<f32>,
    exclude_src: Option<Vec<bool>>,
    exclude_dst: Option<Vec<bool>>,
    /// Inverse relation rows (reciprocal relations), b×rw.
    rel_src: Option<Vec<f32>>,
}

impl Data {
    fn new(decoder: Decoder, dim: usize, b: usize, k_src: usize, k_dst: usize, seed: u64) -> Data {
        let mut id = 0u64;
        let rw = decoder.relation_width(dim);
        let mut rows = |n: usize, width: usize| {
            let mut v = vec![0.0f32; n * width];
            for r in v.chunks_exact_mut(width.max(1)) {
                fill_row(
                    seed,
                    Table::Node,
                    id,
                    Distribution::Uniform { bound: 1.0 },
                    r,
                );
                id += 1;
            }
            v
        };
        let src = rows(b, dim);
        let rel = rows(b, rw);
        let dst = rows(b, dim);
        let neg_src = rows(k_src, dim);
        let neg_dst = rows(k_dst, dim);
        // Exclude roughly one pair in five, deterministically from the seed.
        let mask = |n: usize, salt: u64| {
            (0..n)
                .map(|x| (x as u64 * 2_654_435_761 + seed * 97 + salt).is_multiple_of(5))
                .collect::<Vec<_>>()
        };
        Data {
            dim,
            rw,
            src,
            rel,
            dst,
            neg_src,
            neg_dst,
            exclude_src: Some(mask(b * k_src, 1)),
            exclude_dst: Some(mask(b * k_dst, 2)),
            rel_src: None,
        }
    }

    /// The same chunk with reciprocal relations: inverse rows drawn after all the others.
    fn reciprocal(mut self, seed: u64) -> Data {
        let mut inverse = self.rel.clone();
        for (i, r) in inverse.chunks_exact_mut(self.rw).enumerate() {
            fill_row(
                seed,
                Table::Relation,
                i as u64,
                Distribution::Uniform { bound: 1.0 },
                r,
            );
        }
        self.rel_src = Some(inverse);
        self
    }

    fn chunk(&self) -> Chunk<'_> {
        Chunk {
            src: &self.src,
            rel: &self.rel,
            dst: &self.dst,
            neg_src: &self.neg_src,
            neg_dst: &self.neg_dst,
            exclude_src: self.exclude_src.as_deref(),
            exclude_dst: self.exclude_dst.as_deref(),
            rel_src: self.rel_src.as_deref(),
        }
    }
}

/// Gradients in the same layout as `ChunkGrads`, from the naive reference.
#[derive(Debug, Default)]
struct Naive {
    loss: f64,
    src: Vec<f32>,
    rel: Vec<f32>,
    dst: Vec<f32>,
    neg_src: Vec<f32>,
    neg_dst: Vec<f32>,
    rel_src: Vec<f32>,
}

/// Adds `g · ∂score(s, r, d)` to the three gradient rows, always through the destination-side
/// operator, whatever side the chunk corrupted.
#[allow(clippy::too_many_arguments)]
fn score_backward(
    decoder: Decoder,
    s: &[f32],
    r: &[f32],
    d: &[f32],
    g: f32,
    gs: &mut [f32],
    gr: &mut [f32],
    gd: &mut [f32],
) {
    let mut q = vec![0.0; s.len()];
    let mut gq = vec![0.0; s.len()];
    decoder.query(Side::Dst, s, r, &mut q);
    decoder.comparator().backward(&q, d, g, &mut gq, gd);
    decoder.query_backward(Side::Dst, s, r, &gq, gs, gr);
}

/// One positive and one negative at a time, with `Decoder::score` for every score.
fn naive(model: &ChunkModel, data: &Data) -> Naive {
    let (dim, rw) = (data.dim, data.rw);
    let dec = model.decoder;
    let b = data.src.len() / dim;
    let row = |v: &[f32], i: usize| v[i * dim..(i + 1) * dim].to_vec();
    let rel_row = |v: &[f32], i: usize| v[i * rw..(i + 1) * rw].to_vec();
    let rel = |i: usize| rel_row(&data.rel, i);
    let mut out = Naive {
        src: vec![0.0; data.src.len()],
        rel: vec![0.0; data.rel.len()],
        dst: vec![0.0; data.dst.len()],
        neg_src: vec![0.0; data.neg_src.len()],
        neg_dst: vec![0.0; data.neg_dst.len()],
        rel_src: vec![0.0; data.rel_src.as_ref().map_or(0, Vec::len)],
        ..Naive::default()
    };
    for side in [Side::Dst, Side::Src] {
        let (negs, exclude) = match side {
            Side::Dst => (&data.neg_dst, &data.exclude_dst),
            Side::Src => (&data.neg_src, &data.exclude_src),
        };
        let k = negs.len() / dim;
        if let (Side::Src, Some(inverse)) = (side, &data.rel_src) {
            // Reciprocal: the inverse triple (d, r⁻¹, s) with its destination corrupted.
            for i in 0..b {
                let (s, r, d) = (row(&data.src, i), rel_row(inverse, i), row(&data.dst, i));
                let pos = dec.score(&d, &r, &s);
                let mut scores: Vec<f32> =
                    (0..k).map(|j| dec.score(&d, &r, &row(negs, j))).collect();
                let ex = exclude.as_ref().map(|m| &m[i * k..(i + 1) * k]);
                let rl = model.loss.row_in_place(pos, &mut scores, ex);
                out.loss += rl.loss as f64;
                let (mut gs, mut gr, mut gd) = (vec![0.0; dim], vec![0.0; rw], vec![0.0; dim]);
                score_backward(dec, &d, &r, &s, rl.grad_pos, &mut gd, &mut gr, &mut gs);
                for (j, &g) in scores.iter().enumerate() {
                    let mut gn = vec![0.0; dim];
                    score_backward(dec, &d, &r, &row(negs, j), g, &mut gd, &mut gr, &mut gn);
                    for (o, x) in out.neg_src[j * dim..(j + 1) * dim].iter_mut().zip(&gn) {
                        *o += x;
                    }
                }
                for t in 0..dim {
                    out.src[i * dim + t] += gs[t];
                    out.dst[i * dim + t] += gd[t];
                }
                for (t, g) in gr.iter().enumerate() {
                    out.rel_src[i * rw + t] += g;
                }
            }
            continue;
        }
        for i in 0..b {
            let (s, r, d) = (row(&data.src, i), rel(i), row(&data.dst, i));
            // The triple with negative j in place of the corrupted end.
            let triple = |j: usize| match side {
                Side::Dst => (s.clone(), row(negs, j)),
                Side::Src => (row(negs, j), d.clone()),
            };
            let pos = dec.score(&s, &r, &d);
            let mut scores: Vec<f32> = (0..k)
                .map(|j| {
                    let (ts, td) = triple(j);
                    dec.score(&ts, &r, &td)
                })
                .collect();
            let ex = exclude.as_ref().map(|m| &m[i * k..(i + 1) * k]);
            let rl = model.loss.row_in_place(pos, &mut scores, ex);
            out.loss += rl.loss as f64;

            let mut gs = vec![0.0; dim];
            let mut gr = vec![0.0; r.len()];
            let mut gd = vec![0.0; dim];
            score_backward(dec, &s, &r, &d, rl.grad_pos, &mut gs, &mut gr, &mut gd);
            for (j, &g) in scores.iter().enumerate() {
                let (ts, td) = triple(j);
                let mut gn = vec![0.0; dim];
                match side {
                    Side::Dst => {
                        score_backward(dec, &ts, &r, &td, g, &mut gs, &mut gr, &mut gn);
                    }
                    Side::Src => {
                        score_backward(dec, &ts, &r, &td, g, &mut gn, &mut gr, &mut gd);
                    }
                }
                let target = match side {
                    Side::Dst => &mut out.neg_dst,
                    Side::Src => &mut out.neg_src,
                };
                for t in 0..dim {
                    target[j * dim + t] += gn[t];
                }
            }
            for t in 0..dim {
                out.src[i * dim + t] += gs[t];
                out.dst[i * dim + t] += gd[t];
            }
            for (t, g) in gr.iter().enumerate() {
                out.rel[i * rw + t] += g;
            }
        }
    }
    out
}

/// Largest `|a − b| / max(1, |b|)` over two gradient vectors.
fn max_rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs() / y.abs().max(1.0))
        .fold(0.0, f64::max)
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn check_against_naive(model: &ChunkModel, data: &Data, ws: &mut ChunkWorkspace) -> f64 {
    let loss = ws.forward_backward(model, &data.chunk());
    let want = naive(model, data);
    let g = ws.grads();
    let what = format!("{} {}", model.decoder, model.loss);
    assert!(
        (loss - want.loss).abs() <= 1e-4 * want.loss.abs().max(1.0),
        "{what}: loss {loss} vs {}",
        want.loss
    );
    let pairs = [
        (&g.src, &want.src),
        (&g.rel, &want.rel),
        (&g.dst, &want.dst),
        (&g.neg_src, &want.neg_src),
        (&g.neg_dst, &want.neg_dst),
        (&g.rel_src, &want.rel_src),
    ];
    let mut worst = 0.0f64;
    for (name, (got, exp)) in ["src", "rel", "dst", "neg_src", "neg_dst", "rel_src"]
        .iter()
        .zip(pairs)
    {
        let e = max_rel_err(got, &widen(exp));
        assert!(e < 1e-4, "{what} grad {name}: error {e}");
        worst = worst.max(e);
    }
    worst
}

#[test]
fn chunk_matches_naive_reference_for_every_decoder_and_loss() {
    let mut ws = ChunkWorkspace::new();
    let mut worst = 0.0f64;
    for decoder in Decoder::ALL {
        for loss in LOSSES {
            let model = ChunkModel {
                decoder,
                loss,
                dim: 8,
            };
            // Shapes change between calls on purpose: the workspace must resize correctly.
            for (b, ks, kd, seed) in [(5, 7, 6, 1), (3, 0, 4, 2), (4, 3, 0, 3), (1, 1, 1, 4)] {
                let data = Data::new(decoder, 8, b, ks, kd, seed);
                worst = worst.max(check_against_naive(&model, &data, &mut ws));
                if decoder.uses_relations() {
                    let data = data.reciprocal(seed);
                    worst = worst.max(check_against_naive(&model, &data, &mut ws));
                }
            }
        }
    }
    println!("chunk vs naive: worst relative gradient error {worst:.2e}");
}

/// The chunk loss in f64, written from the formulas (no query/comparator split).
fn reference_loss(model: &ChunkModel, d: &Data, p: &Params) -> f64 {
    let (dim, rw) = (d.dim, d.rw);
    let b = p.src.len() / dim;
    let row = |v: &[f64], i: usize| v[i * dim..(i + 1) * dim].to_vec();
    let rel_row = |v: &[f64], i: usize| v[i * rw..(i + 1) * rw].to_vec();
    let score = |s: &[f64], r: &[f64], t: &[f64]| -> f64 {
        match model.decoder {
            Decoder::Dot => (0..dim).map(|k| s[k] * t[k]).sum(),
            Decoder::DistMult => (0..dim).map(|k| s[k] * r[k] * t[k]).sum(),
            Decoder::ComplEx => {
                let h = dim / 2;
                (0..h)
                    .map(|k| {
                        let (pr, pi) = (
                            s[k] * r[k] - s[k + h] * r[k + h],
                            s[k] * r[k + h] + s[k + h] * r[k],
                        );
                        pr * t[k] + pi * t[k + h]
                    })
                    .sum()
            }
            Decoder::TransEL1 => -(0..dim).map(|k| (s[k] + r[k] - t[k]).abs()).sum::<f64>(),
            Decoder::TransEL2 => -(0..dim)
                .map(|k| (s[k] + r[k] - t[k]).powi(2))
                .sum::<f64>()
                .sqrt(),
            Decoder::RotatE => {
                let h = dim / 2;
                -(0..h)
                    .map(|k| {
                        let (c, n) = (r[k].cos(), r[k].sin());
                        let re = s[k] * c - s[k + h] * n - t[k];
                        let im = s[k] * n + s[k + h] * c - t[k + h];
                        (re * re + im * im).sqrt()
                    })
                    .sum::<f64>()
            }
            Decoder::Rescal => (0..dim)
                .map(|i| (0..dim).map(|j| s[i] * r[i * dim + j] * t[j]).sum::<f64>())
                .sum(),
        }
    };
    let mut total = 0.0;
    for side in [Side::Dst, Side::Src] {
        let (negs, exclude) = match side {
            Side::Dst => (&p.neg_dst, &d.exclude_dst),
            Side::Src => (&p.neg_src, &d.exclude_src),
        };
        let k = negs.len() / dim;
        for i in 0..b {
            let (s, t) = (row(&p.src, i), row(&p.dst, i));
            let r = if p.rel.is_empty() {
                vec![0.0; dim]
            } else {
                rel_row(&p.rel, i)
            };
            let inverse =
                (side == Side::Src && !p.rel_src.is_empty()).then(|| rel_row(&p.rel_src, i));
            let pos = match &inverse {
                Some(ri) => score(&t, ri, &s),
                None => score(&s, &r, &t),
            };
            let negs: Vec<f64> = (0..k)
                .filter(|&j| !exclude.as_ref().is_some_and(|m| m[i * k + j]))
                .map(|j| match (side, &inverse) {
                    (Side::Dst, _) => score(&s, &r, &row(negs, j)),
                    (Side::Src, None) => score(&row(negs, j), &r, &t),
                    (Side::Src, Some(ri)) => score(&t, ri, &row(negs, j)),
                })
                .collect();
            let softplus = |x: f64| (1.0 + x.exp()).ln();
            total += match model.loss {
                Loss::SoftmaxCe => {
                    -pos + (pos.exp() + negs.iter().map(|n| n.exp()).sum::<f64>()).ln()
                }
                Loss::Logistic => {
                    softplus(-pos) + negs.iter().map(|&n| softplus(n)).sum::<f64>() / k as f64
                }
                Loss::Ranking { margin } => negs
                    .iter()
                    .map(|n| (margin as f64 - pos + n).max(0.0))
                    .sum(),
                // The weights softmax(α · neg) enter as constants: only at α = 0 (LOSSES) is
                // this loss's derivative the gradient the chunk computes.
                Loss::SelfAdversarial {
                    margin,
                    temperature,
                } => {
                    let (m, a) = (f64::from(margin), f64::from(temperature));
                    let e: Vec<f64> = negs.iter().map(|&n| (a * n).exp()).collect();
                    let total: f64 = e.iter().sum();
                    softplus(-(m + pos))
                        + negs
                            .iter()
                            .zip(&e)
                            .map(|(&n, w)| w / total * softplus(m + n))
                            .sum::<f64>()
                }
            };
        }
    }
    total
}

#[derive(Clone)]
struct Params {
    src: Vec<f64>,
    rel: Vec<f64>,
    dst: Vec<f64>,
    neg_src: Vec<f64>,
    neg_dst: Vec<f64>,
    rel_src: Vec<f64>,
}

impl Params {
    fn field(&mut self, f: usize) -> &mut Vec<f64> {
        [
            &mut self.src,
            &mut self.rel,
            &mut self.dst,
            &mut self.neg_src,
            &mut self.neg_dst,
            &mut self.rel_src,
        ]
        .into_iter()
        .nth(f)
        .unwrap()
    }
}

#[test]
fn chunk_gradients_match_f64_finite_differences() {
    let mut ws = ChunkWorkspace::new();
    let mut worst = 0.0f64;
    let h = 1e-6;
    for decoder in Decoder::ALL {
        for loss in LOSSES {
            let dim = 6;
            let model = ChunkModel { decoder, loss, dim };
            let plain = Data::new(decoder, dim, 3, 4, 5, 11);
            let variants = if decoder.uses_relations() {
                vec![plain.clone(), plain.reciprocal(12)]
            } else {
                vec![plain]
            };
            for data in variants {
                ws.forward_backward(&model, &data.chunk());
                let g = ws.grads().clone();
                let analytic = [&g.src, &g.rel, &g.dst, &g.neg_src, &g.neg_dst, &g.rel_src];
                let base = Params {
                    src: widen(&data.src),
                    rel: widen(&data.rel),
                    dst: widen(&data.dst),
                    neg_src: widen(&data.neg_src),
                    neg_dst: widen(&data.neg_dst),
                    rel_src: widen(data.rel_src.as_deref().unwrap_or(&[])),
                };
                for (f, grad) in analytic.into_iter().enumerate() {
                    let mut p = base.clone();
                    let mut fd = Vec::new();
                    for x in 0..grad.len() {
                        let v = p.field(f)[x];
                        p.field(f)[x] = v + h;
                        let up = reference_loss(&model, &data, &p);
                        p.field(f)[x] = v - h;
                        let down = reference_loss(&model, &data, &p);
                        p.field(f)[x] = v;
                        fd.push((up - down) / (2.0 * h));
                    }
                    let e = max_rel_err(grad, &fd);
                    assert!(e < 2e-4, "{decoder} {loss} field {f}: error {e}");
                    worst = worst.max(e);
                }
            }
        }
    }
    println!("chunk vs f64 finite differences: worst relative gradient error {worst:.2e}");
}

#[test]
fn l2_near_pairs_use_the_exact_distance() {
    // A negative equal to a query up to 1e-4: the expanded formula would lose every digit.
    let dim = 4;
    let model = ChunkModel {
        decoder: Decoder::TransEL2,
        loss: Loss::SoftmaxCe,
        dim,
    };
    let src = [100.0f32, -50.0, 25.0, 10.0];
    let rel = [0.5f32; 4];
    let dst = [0.0f32; 4];
    let neg_dst = [100.5f32, -49.5, 25.5, 10.5001];
    let chunk = Chunk {
        src: &src,
        rel: &rel,
        dst: &dst,
        neg_src: &[],
        neg_dst: &neg_dst,
        exclude_src: None,
        exclude_dst: None,
        rel_src: None,
    };
    let mut ws = ChunkWorkspace::new();
    ws.forward_backward(&model, &chunk);
    let g = ws.grads().neg_dst.clone();
    // The gradient through a distance of 1e-4 is a unit vector times ∂L/∂score (≈ 1 − tiny).
    assert!(g[3].abs() > 0.9 && g[0].abs() < 1e-2, "{g:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_shapes_match_naive(
        decoder in prop::sample::select(Decoder::ALL.to_vec()),
        loss in prop::sample::select(LOSSES.to_vec()),
        half_dim in 1usize..6,
        b in 1usize..6,
        k_src in 0usize..7,
        k_dst in 0usize..7,
        masked in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let dim = 2 * half_dim;
        let mut data = Data::new(decoder, dim, b, k_src, k_dst, seed);
        if !masked {
            data.exclude_src = None;
            data.exclude_dst = None;
        }
        let model = ChunkModel { decoder, loss, dim };
        check_against_naive(&model, &data, &mut ChunkWorkspace::new());
    }
}
