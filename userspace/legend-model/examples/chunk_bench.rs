//! Single-thread throughput of the chunk forward/backward, the CPU engine's inner loop.
//!
//! `cargo run --release -p legend-model --example chunk_bench [batches]`
//!
//! A batch is 10,000 positives in 10 chunks of 1,000; every chunk shares 1,000 negatives for
//! the destination side and 1,000 for the source side (PBG/Marius' 10 × 1,000 setting).

use std::time::Instant;

use legend_model::{Chunk, ChunkModel, ChunkWorkspace, Decoder, Init, Loss, Table};

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
    ];
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
        let mut rel = vec![0.0f32; CHUNK * dim];
        for (i, r) in rel.chunks_exact_mut(dim).enumerate() {
            init.relation_row(decoder, Table::Relation, i as u64, r);
        }
        if !decoder.uses_relations() {
            rel.clear();
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
            "{:<9} {:<19} dim {dim:>3}: best {:>7.0} pos/s ({:>6.2} ms/chunk, {:>5.1} GFLOP/s), median {:>7.0} pos/s; loss {:.3e}",
            decoder.name(),
            loss.to_string(),
            CHUNK as f64 / best,
            best * 1e3,
            gflop / best,
            CHUNK as f64 / median,
            sink / (times.len() + 1) as f64,
        );
    }
}
