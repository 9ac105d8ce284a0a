//! Single-thread throughput of the chunk forward/backward, the CPU engine's inner loop, against
//! the core's measured FMA peak.
//!
//! `cargo run --release -p legend-model --example chunk_bench [batches]`
//!
//! First the peak (independent FMAs on registers), then each of a side's three matrix products
//! alone (scores `Q·Nᵀ`, `dQ = G·N`, `dN = Gᵀ·Q`) at the chunk shapes, then whole chunks: a
//! batch is 10,000 positives in 10 chunks of 1,000; every chunk shares 1,000 negatives for the
//! destination side and 1,000 for the source side (PBG/Marius' 10 × 1,000 setting).

use std::time::Instant;

use legend_model::{Chunk, ChunkModel, ChunkWorkspace, Decoder, Init, Loss, Table, sgemm};

const CHUNK: usize = 1000;
const CHUNKS: usize = 10;
const NEGS: usize = 1000;

fn main() {
    let batches: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("batches must be a number"))
        .unwrap_or(3);
    let cases = [
        (Decoder::Dot, 100, Loss::SoftmaxCe),
        (Decoder::ComplEx, 100, Loss::SoftmaxCe),
        (Decoder::Dot, 200, Loss::SoftmaxCe),
        (Decoder::ComplEx, 200, Loss::SoftmaxCe),
        (Decoder::ComplEx, 100, Loss::Logistic),
        (Decoder::ComplEx, 100, Loss::Ranking { margin: 0.1 }),
        (Decoder::DistMult, 100, Loss::SoftmaxCe),
        (Decoder::TransEL2, 100, Loss::SoftmaxCe),
        (Decoder::TransEL1, 100, Loss::SoftmaxCe),
        (Decoder::RotatE, 100, Loss::SoftmaxCe),
        (Decoder::Rescal, 100, Loss::SoftmaxCe),
    ];
    let peak = fma_peak();
    match peak {
        Some(p) => println!("FMA peak of one core: {p:.1} GFLOP/s (fp32)"),
        None => println!("FMA peak: not measured (needs x86-64 with AVX2 and FMA)"),
    }
    let share = |gflops: f64| {
        peak.map_or(String::new(), |p| {
            format!(" ({:.0}% of peak)", 100.0 * gflops / p)
        })
    };
    // The engine splits a chunk into blocks of up to 256 rows (250 for a chunk of 1000).
    for (rows, dim) in [(250, 100), (1000, 100), (250, 200), (1000, 200)] {
        let q = vec![0.01f32; rows * dim];
        let n = vec![0.02f32; NEGS * dim];
        let mut g = vec![0.0f32; rows * NEGS];
        let mut dq = vec![0.0f32; rows * dim];
        let mut dn = vec![0.0f32; NEGS * dim];
        let mut best = [f64::MAX; 3];
        for _ in 0..20 {
            let t = Instant::now();
            sgemm(rows, dim, NEGS, &q, false, &n, true, 0.0, &mut g);
            best[0] = best[0].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            sgemm(rows, NEGS, dim, &g, false, &n, false, 1.0, &mut dq);
            best[1] = best[1].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            sgemm(NEGS, rows, dim, &g, true, &q, false, 0.0, &mut dn);
            best[2] = best[2].min(t.elapsed().as_secs_f64());
        }
        let gflop = 2.0 * (rows * NEGS * dim) as f64 / 1e9;
        let [scores, grad_q, grad_n] = best.map(|t| gflop / t);
        println!(
            "products, {rows} rows x {NEGS} negatives, dim {dim:>3}, GFLOP/s: scores {scores:>5.1}{}, dQ {grad_q:>5.1}{}, dN {grad_n:>5.1}{}",
            share(scores),
            share(grad_q),
            share(grad_n)
        );
    }
    println!(
        "batch {} = {CHUNKS} chunks x {CHUNK} positives, {NEGS} dst + {NEGS} src negatives per chunk, 1 thread",
        CHUNKS * CHUNK
    );
    for (decoder, dim, loss) in cases {
        let model = ChunkModel { decoder, loss, dim };
        // Node rows at a trained-like scale so that the losses do real work.
        let init = Init {
            node: legend_model::Distribution::Normal { std: 0.3 },
            ..Init::default()
        };
        let rows = |first: u64, n: usize| {
            let mut v = vec![0.0f32; n * dim];
            for (i, r) in v.chunks_exact_mut(dim).enumerate() {
                init.node_row(first + i as u64, r);
            }
            v
        };
        // Relation rows of the decoder's width (RESCAL: dim², none for Dot).
        let width = decoder.relation_width(dim);
        let mut rel = vec![0.0f32; CHUNK * width];
        for (i, r) in rel.chunks_exact_mut(width.max(1)).enumerate() {
            init.relation_row(decoder, Table::Relation, i as u64, r);
        }
        let (src, dst) = (rows(0, CHUNK), rows(1 << 20, CHUNK));
        let (neg_src, neg_dst) = (rows(2 << 20, NEGS), rows(3 << 20, NEGS));
        let chunk = Chunk {
            src: &src,
            rel: &rel,
            dst: &dst,
            neg_src: &neg_src,
            neg_dst: &neg_dst,
            exclude_src: None,
            exclude_dst: None,
            rel_src: None,
        };
        let mut ws = ChunkWorkspace::new();
        let mut sink = ws.forward_backward(&model, &chunk);
        // Per-chunk times: the best one is what the code costs on an idle core (the cores are
        // shared with other work), the median what a busy machine gave.
        let mut times: Vec<f64> = (0..batches * CHUNKS)
            .map(|_| {
                let start = Instant::now();
                sink += ws.forward_backward(&model, &chunk);
                start.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let (best, median) = (times[0], times[times.len() / 2]);
        // Three b×k×dim products a side (scores, dQ, dN), two sides, 2 flops per multiply-add.
        let gflop = 12.0 * (CHUNK * NEGS * dim) as f64 / 1e9;
        println!(
            "{:<9} {:<19} dim {dim:>3}: best {:>7.0} pos/s ({:>6.2} ms/chunk, {:>5.1} GFLOP/s{}), median {:>7.0} pos/s; loss {:.3e}",
            decoder.name(),
            loss.to_string(),
            CHUNK as f64 / best,
            best * 1e3,
            gflop / best,
            share(gflop / best),
            CHUNK as f64 / median,
            sink / (times.len() + 1) as f64,
        );
    }
}

/// The core's fp32 FMA rate: twelve independent accumulators (enough to cover the FMA latency
/// on two pipes), best of 200 short runs so that a busy machine does not lower it.
fn fma_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        const ITERS: usize = 200_000;
        let mut best = f64::MAX;
        let mut sink = 0.0;
        for _ in 0..200 {
            let t = Instant::now();
            // SAFETY: the CPU reported AVX2 and FMA.
            sink += unsafe { fma_loop(ITERS) };
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(sink);
        // 12 registers × 8 lanes × 2 flops per iteration.
        return Some((ITERS * 12 * 8 * 2) as f64 / best / 1e9);
    }
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_loop(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999);
    let b = _mm256_set1_ps(0.001);
    let mut acc = [a; 12];
    for _ in 0..iters {
        // A fixed-size array of vectors stays in registers once the loop is unrolled.
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut lanes = [0.0f32; 8];
    let mut total = 0.0;
    for x in acc {
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
        total += lanes.iter().sum::<f32>();
    }
    total
}
