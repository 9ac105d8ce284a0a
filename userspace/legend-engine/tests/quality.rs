//! The quality options through whole sessions: reciprocal relations and regularisation in
//! memory and out of core, early stopping on the best checkpoint, and resuming such runs.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;

use legend_engine::Config;
use legend_engine::run;
use legend_engine::session::{BEST_DIR, Event, Outcome, Session};
use legend_fs::Unguarded;

use common::small_graph;

fn config(sets: &[&str]) -> Config {
    let mut all: Vec<String> = [
        "model.dim=8",
        "model.decoder=complex",
        "training.threads=1",
        "training.batch_size=50",
        "training.num_epochs=3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.extend(sets.iter().map(|s| s.to_string()));
    Config::parse("", &all).unwrap()
}

/// What a session trained: each epoch's loss and valid MRR, the final metrics.jsonl line.
#[derive(Debug, PartialEq)]
struct Trained {
    losses: Vec<f64>,
    valid: Vec<Option<f64>>,
    result: serde_json::Value,
}

fn run_session(mut session: Session) -> Trained {
    let mut trained = Trained {
        losses: Vec::new(),
        valid: Vec::new(),
        result: serde_json::Value::Null,
    };
    let outcome = session
        .run(&AtomicBool::new(false), &mut |event| match event {
            Event::EpochFinished { report, valid, .. } => {
                trained.losses.push(report.loss);
                trained.valid.push(valid.map(|m| m.mrr));
            }
            Event::Evaluated { line, .. } => trained.result = line.clone(),
            _ => {}
        })
        .unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    trained
}

fn train(ds: &Path, out: &Path, sets: &[&str]) -> Trained {
    run_session(Session::create(out, ds, config(sets), &Unguarded).unwrap())
}

#[test]
fn reciprocal_regularised_training_is_the_same_in_memory_and_out_of_core() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    // ComplEx, and RESCAL, whose relation rows are 8 × 8 matrices: 64 floats a row in the
    // trainer, the store's auxiliary region, the checkpoints and the evaluation.
    for (decoder, width) in [("complex", 8), ("rescal", 64)] {
        let decoder = format!("model.decoder={decoder}");
        let quality = [
            decoder.as_str(),
            "model.reciprocal_relations=true",
            "optimizer.regularizer=n3",
            "optimizer.regularization_weight=0.01",
            "storage.num_partitions=4",
            "storage.buffer_capacity=2",
        ];
        let with = |backend: &str, extra: &[&str]| {
            let mut sets = quality.to_vec();
            let backend = format!("storage.backend={backend}");
            sets.push(&backend);
            sets.extend(extra);
            train(
                &ds,
                &tmp.path()
                    .join(format!("{decoder}-{backend}{}", extra.len())),
                &sets,
            )
        };
        let memory = with("memory", &[]);
        let file = with("file", &[]);
        assert_eq!(
            memory, file,
            "{decoder}: the store changed what was trained"
        );
        // A checkpoint before batches, as often as the spacing allows (the relations, twice as many, travel in
        // the store's auxiliary area) changes nothing either.
        let timed = with("file", &["training.checkpoint_minutes=1e-9"]);
        assert_eq!(timed, file, "{decoder}");
        // The regulariser and the inverse relations do train something different.
        let mut plain_sets = vec![decoder.as_str()];
        plain_sets.extend(&quality[4..]);
        let plain = train(
            &ds,
            &tmp.path().join(format!("{decoder}-plain")),
            &plain_sets,
        );
        assert_ne!(plain.losses, memory.losses, "{decoder}");
        for backend in ["memory", "file"] {
            let dir = run::open(
                &tmp.path()
                    .join(format!("{decoder}-storage.backend={backend}0")),
            )
            .unwrap();
            let meta = run::read_meta(&dir).unwrap();
            assert!(meta.reciprocal_relations);
            assert_eq!(meta.relations, 6, "3 relations and their inverses");
            let tables = run::load_tables(&dir, &meta, &Unguarded).unwrap();
            assert_eq!(tables.relations.len(), 6 * width, "{decoder} {backend}");
            assert_eq!(
                tables.relations_state.len(),
                6 * width,
                "{decoder} {backend}"
            );
        }
    }
}

#[test]
fn early_stopping_keeps_and_ranks_the_best_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    let sets = [
        "training.num_epochs=40",
        "optimizer.learning_rate=0.5",
        "evaluation.epochs_per_eval=1",
        "evaluation.patience=2",
    ];
    let out = tmp.path().join("stopped");
    let trained = train(&ds, &out, &sets);
    let evaluated: Vec<f64> = trained.valid.iter().map(|v| v.unwrap()).collect();
    let epochs = evaluated.len();
    assert!(
        epochs < 40,
        "random graph, lr 0.5: the valid MRR should stall"
    );
    // The best epoch is the first maximum, followed by exactly `patience` evaluations.
    let best = evaluated
        .iter()
        .enumerate()
        .fold((0, f64::MIN), |b, (i, &m)| if m > b.1 { (i, m) } else { b });
    assert_eq!(epochs, best.0 + 1 + 2, "{evaluated:?}");
    assert_eq!(trained.result["best_epoch"], best.0 as u64 + 1);
    // best/ is a run directory holding that epoch; ranked on valid it gives the recorded MRR.
    let best_dir = run::open(&out.join(BEST_DIR)).unwrap();
    let meta = run::read_meta(&best_dir).unwrap();
    assert_eq!(meta.epochs_completed as usize, best.0 + 1);
    let tables = run::load_tables(&best_dir, &meta, &Unguarded).unwrap();
    let dataset = legend_dataset::Dataset::open(&ds).unwrap();
    let request = legend_engine::evaluation::EvalRequest {
        protocol: legend_engine::config::Protocol::Filtered,
        split: legend_dataset::Split::Valid,
        negatives: legend_eval::SampledNegatives::default(),
        threads: 1,
    };
    let again = legend_engine::evaluation::evaluate(
        &dataset,
        meta.decoder.parse().unwrap(),
        meta.dim,
        &tables.entities,
        &tables.relations,
        false,
        &request,
    )
    .unwrap();
    assert_eq!(again.mrr, best.1);
    // The run is finished: a resume has nothing to train.
    let session = Session::resume(&out, None, &[], &Unguarded).unwrap();
    assert!(session.is_finished().unwrap());
}

#[test]
fn a_resumed_run_continues_from_the_latest_checkpoint_with_the_same_decisions() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    let sets = [
        "training.num_epochs=8",
        "evaluation.epochs_per_eval=1",
        "evaluation.patience=100",
        "optimizer.plateau_factor=0.5",
        "optimizer.plateau_patience=1",
        "optimizer.warmup_epochs=2",
    ];
    let whole = train(&ds, &tmp.path().join("whole"), &sets);
    // The same run in two sessions: 5 epochs, then resumed to 8.
    let out = tmp.path().join("parts");
    let mut first = sets.to_vec();
    first[0] = "training.num_epochs=5";
    let head = train(&ds, &out, &first);
    let session =
        Session::resume(&out, None, &["training.num_epochs=8".into()], &Unguarded).unwrap();
    assert_eq!(session.position().epochs_completed, 5);
    let tail = run_session(session);
    let losses: Vec<f64> = head.losses.iter().chain(&tail.losses).copied().collect();
    assert_eq!(losses, whole.losses, "the schedule was not replayed");
    assert_eq!(tail.result, whole.result);
}

#[test]
fn validation_during_training_can_sample_while_the_final_evaluation_filters() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    let out = tmp.path().join("run");
    let sets = [
        "evaluation.epochs_per_eval=1",
        "evaluation.valid_protocol=sampled",
        "evaluation.uniform_negatives=50",
        "evaluation.degree_negatives=0",
    ];
    let trained = train(&ds, &out, &sets);
    assert_eq!(trained.result["metrics"]["protocol"], "filtered");
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["valid"]["protocol"], "sampled", "{first}");
    let err = Config::parse("", &["evaluation.valid_protocol=ranked".into()]).unwrap_err();
    assert!(
        err.to_string().starts_with("evaluation.valid_protocol"),
        "{err}"
    );
}

/// Every recipe in the repository's configs/ is a valid configuration (a misspelt key would
/// otherwise surface only when someone trains it).
#[test]
fn every_recipe_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let config =
                Config::parse(&text, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(
                config.evaluation.patience > 0,
                "{}: no early stopping",
                path.display()
            );
            seen += 1;
        }
    }
    assert!(seen >= 5, "{seen} recipes in {}", dir.display());
}
