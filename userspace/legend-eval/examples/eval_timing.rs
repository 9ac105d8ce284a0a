//! Times evaluation on synthetic random embeddings.
//!
//! `cargo run --release -p legend-eval --example eval_timing -- [triples] [entities] [dim]
//! [decoder] [threads] [protocol]`, defaults 20000 100000 200 distmult 2 filtered.

use std::time::Instant;

use legend_eval::{Embeddings, FilterIndex, Protocol, SampledNegatives, entity_degrees, evaluate};
use legend_model::Decoder;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let num_triples: usize = arg(0, "20000").parse().expect("triples");
    let num_entities: usize = arg(1, "100000").parse().expect("entities");
    let dim: usize = arg(2, "200").parse().expect("dim");
    let decoder: Decoder = arg(3, "distmult").parse().expect("decoder");
    let threads: usize = arg(4, "2").parse().expect("threads");
    let protocol = arg(5, "filtered");
    let num_relations = 50;

    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut table = |rows: usize| -> Vec<f32> {
        (0..rows * dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect()
    };
    let entities = table(num_entities);
    let relations = table(num_relations);
    let mut triple = |_| {
        [
            rng.random_range(0..num_entities as u32),
            rng.random_range(0..num_relations as u32),
            rng.random_range(0..num_entities as u32),
        ]
    };
    let train: Vec<[u32; 3]> = (0..num_triples * 10).map(&mut triple).collect();
    let test: Vec<[u32; 3]> = (0..num_triples).map(&mut triple).collect();

    let start = Instant::now();
    let filter = FilterIndex::build(num_entities, &[&train, &test]).expect("filter");
    let degrees = entity_degrees(num_entities, &[&train]).expect("degrees");
    let setup = start.elapsed();
    let protocol = match protocol.as_str() {
        "filtered" => Protocol::Filtered { filter: &filter },
        _ => Protocol::Sampled {
            negatives: SampledNegatives::default(),
            degrees: &degrees,
        },
    };
    let embeddings = Embeddings {
        decoder,
        entities: &entities,
        relations: &relations,
        dim,
        reciprocal: false,
    };
    let start = Instant::now();
    let metrics = evaluate(&embeddings, &test, &protocol, threads).expect("evaluate");
    let took = start.elapsed();
    println!(
        "{decoder} {num_triples} triples x {num_entities} entities, d = {dim}, {threads} threads: \
         index + degrees {:.2} s, evaluation {:.2} s",
        setup.as_secs_f64(),
        took.as_secs_f64()
    );
    println!("{}", serde_json::to_string_pretty(&metrics).expect("json"));
}
