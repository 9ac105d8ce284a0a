//! When a session commits checkpoints (`training.checkpoint_minutes`, `checkpoint_every`), and
//! that where it commits them never changes what is trained.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use legend_dataset::{GenerateOptions, generate};
use legend_engine::Config;
use legend_engine::session::{Event, Outcome, Session};
use legend_fs::Unguarded;

/// Trains a new run of 3 epochs in `out` with `sets`; the epochs after which it checkpointed,
/// and its final entity table.
fn train(ds: &Path, out: &Path, sets: &[&str]) -> (Vec<u32>, Vec<u8>) {
    let mut all: Vec<String> = [
        "model.dim=8",
        "training.threads=1",
        "training.batch_size=200",
        "training.num_epochs=3",
        "evaluation.protocol=sampled",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.extend(sets.iter().map(|s| s.to_string()));
    let config = Config::parse("", &all).unwrap();
    let mut session = Session::create(out, ds, config, &Unguarded).unwrap();
    let mut at = Vec::new();
    let outcome = session
        .run(&AtomicBool::new(false), &mut |event| {
            if let Event::Checkpoint { position } = event {
                assert!(position.cut.is_none(), "{position:?}");
                at.push(position.epochs_completed);
            }
        })
        .unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    drop(session);
    let entities = std::fs::read(out.join("checkpoints/epoch-00003/entities.bin")).unwrap();
    (at, entities)
}

#[test]
fn timed_checkpoints_are_taken_at_epoch_ends_and_change_nothing_trained() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds");
    let mut o = GenerateOptions::new(500, 4000);
    o.relations = 3;
    generate(&o, &ds).unwrap();
    // The default, 30 minutes: a short run checkpoints only after its last epoch.
    let (plain, tables) = train(&ds, &tmp.path().join("default"), &[]);
    assert_eq!(plain, [3]);
    // An interval shorter than an epoch: the first epoch end is due (no checkpoint cost is
    // known yet); later ones wait for 20 times the last checkpoint's duration.
    let (timed, timed_tables) = train(
        &ds,
        &tmp.path().join("timed"),
        &["training.checkpoint_minutes=1e-9"],
    );
    assert_eq!(timed.first(), Some(&1), "{timed:?}");
    assert_eq!(timed.last(), Some(&3), "{timed:?}");
    assert!(timed.windows(2).all(|w| w[0] < w[1]), "{timed:?}");
    // By count, none by time.
    let (counted, counted_tables) = train(
        &ds,
        &tmp.path().join("counted"),
        &[
            "training.checkpoint_every=2",
            "training.checkpoint_minutes=0",
        ],
    );
    assert_eq!(counted, [2, 3]);
    assert_eq!(
        timed_tables, tables,
        "timed checkpoints changed the training"
    );
    assert_eq!(
        counted_tables, tables,
        "counted checkpoints changed the training"
    );
}
