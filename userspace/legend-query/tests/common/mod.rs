//! What the query tests share.

#![allow(dead_code)] // Each test binary uses its own subset.

use legend_engine::run::RunMeta;
use legend_query::{Answer, Query, QueryRun};

/// Values on a grid of 0.5 in [-1, 1]: dot products and L1 sums are exact, so ties abound (and
/// equal rows, whose L2 distance is 0: a score of -0).
pub fn grid(n: usize, salt: u64) -> Vec<f32> {
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 5) as f32 * 0.5 - 1.0
        })
        .collect()
}

/// The commit record of a run of `decoder` on the dataset at `dataset` (identity
/// `dataset_identity`): `entities` rows of `dim` floats, `relations` relation rows (the inverses
/// in their second half when `reciprocal`), one epoch trained, f32, no checkpoint yet.
pub fn run_meta(
    (dataset, dataset_identity): (std::path::PathBuf, String),
    decoder: &str,
    (entities, dim): (u64, usize),
    (relations, reciprocal): (u64, bool),
) -> RunMeta {
    RunMeta {
        dataset,
        dataset_identity,
        decoder: decoder.into(),
        dim,
        entities,
        relations,
        reciprocal_relations: reciprocal,
        epochs_completed: 1,
        ..RunMeta::blank()
    }
}

/// The id `q` gives the entity `label`, through a lookup.
pub fn id_of(q: &QueryRun, label: &str) -> u32 {
    let asked = [Query::Lookup {
        entity: label.into(),
    }];
    match &q.answer(&asked, 1, &|i| i.to_string()).unwrap()[0] {
        Answer::Lookup { entity, .. } => entity.id,
        other => panic!("{other:?}"),
    }
}
