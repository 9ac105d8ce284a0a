//! Time to initialise never-written partition rows (`Init::node_row`), on one thread and on
//! every core as the partition buffer does it. `cargo run --release -p legend-engine
//! --example init_bench [ROWS] [DIM]` (default 1 000 000 × 100).

use std::time::Instant;

use legend_model::Init;
use rayon::prelude::*;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let rows = args
        .next()
        .transpose()
        .expect("ROWS: a number")
        .unwrap_or(1_000_000);
    let dim = args
        .next()
        .transpose()
        .expect("DIM: a number")
        .unwrap_or(100);
    let init = Init::default();
    let mut rows_out = vec![0.0f32; rows * dim];
    let start = Instant::now();
    for (i, row) in rows_out.chunks_exact_mut(dim).enumerate() {
        init.node_row(i as u64, row);
    }
    let one = start.elapsed().as_secs_f64();
    let start = Instant::now();
    rows_out
        .par_chunks_exact_mut(dim)
        .enumerate()
        .for_each(|(i, row)| init.node_row(i as u64, row));
    let all = start.elapsed().as_secs_f64();
    println!(
        "{rows} rows x {dim}: one thread {one:.2} s ({:.1} ns a value), {} threads {all:.2} s",
        one * 1e9 / (rows * dim) as f64,
        rayon::current_num_threads()
    );
}
