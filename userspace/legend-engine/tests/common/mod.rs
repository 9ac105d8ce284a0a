//! What legend-engine's integration tests share: a small generated graph, a session trained to
//! its end, an error with its sources. Each test file uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use legend_dataset::{GenerateOptions, generate};
use legend_engine::session::{Outcome, Session};

/// A generated graph of `entities` entities, `edges` edges and 3 relations, in `dir/ds`.
pub fn small_graph(dir: &Path, entities: u64, edges: u64) -> PathBuf {
    let ds = dir.join("ds");
    let mut o = GenerateOptions::new(entities, edges);
    o.relations = 3;
    generate(&o, &ds).unwrap();
    ds
}

/// Trains `session` to its end, which must be a finished run.
pub fn train_to_the_end(session: &mut Session) {
    let outcome = session.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
}

/// `e` and its sources on one line, as the CLI prints errors.
pub fn chain(e: &dyn std::error::Error) -> String {
    legend_engine::error_chain::with_sources(e)
}
