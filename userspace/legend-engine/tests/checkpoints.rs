//! When a session commits checkpoints (`training.checkpoint_minutes`, `checkpoint_every`), and
//! that where it commits them, at an epoch's end or inside it, never changes what is trained.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;

use legend_engine::Config;
use legend_engine::session::{Event, Outcome, Position, Session};
use legend_fs::Unguarded;

use common::small_graph;

/// What a run of 3 epochs trained: where it checkpointed, each epoch's loss, and the final
/// evaluation's line.
struct Trained {
    checkpoints: Vec<Position>,
    losses: Vec<f64>,
    result: serde_json::Value,
}

/// The configuration of these runs (3 epochs, d = 8, one thread) with `sets`.
fn config(sets: &[&str]) -> Config {
    let mut all: Vec<String> = [
        "model.dim=8",
        "training.threads=1",
        "training.batch_size=50",
        "training.num_epochs=3",
        "evaluation.protocol=sampled",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.extend(sets.iter().map(|s| s.to_string()));
    Config::parse("", &all).unwrap()
}

fn train(ds: &Path, out: &Path, sets: &[&str]) -> Trained {
    let mut session = Session::create(out, ds, config(sets), &Unguarded).unwrap();
    let mut checkpoints = Vec::new();
    let mut losses = Vec::new();
    let mut result = serde_json::Value::Null;
    let outcome = session
        .run(&AtomicBool::new(false), &mut |event| match event {
            Event::Checkpoint { position } => checkpoints.push(position),
            Event::EpochFinished { report, .. } => losses.push(report.loss),
            Event::Evaluated { line, .. } => result = line.clone(),
            _ => {}
        })
        .unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    Trained {
        checkpoints,
        losses,
        result,
    }
}

fn epochs(checkpoints: &[Position]) -> Vec<u32> {
    checkpoints
        .iter()
        .filter(|p| p.cut.is_none())
        .map(|p| p.epochs_completed)
        .collect()
}

#[test]
fn timed_checkpoints_are_taken_at_the_next_batch_and_change_nothing_trained() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 500, 4000);
    let tables = |run: &str| {
        std::fs::read(
            tmp.path()
                .join(run)
                .join("checkpoints/epoch-00003/entities.bin"),
        )
        .unwrap()
    };
    // The default, 30 minutes: a short run checkpoints only after its last epoch.
    let plain = train(&ds, &tmp.path().join("default"), &[]);
    assert_eq!(epochs(&plain.checkpoints), [3]);
    assert_eq!(plain.checkpoints.len(), 1);
    // An interval shorter than a batch: the first batch's end is due (no checkpoint cost is
    // known yet), inside epoch 1 although the run has one partition and no swaps; later ones
    // wait for 20 times the last checkpoint's duration, and the last epoch's end commits.
    let timed = train(
        &ds,
        &tmp.path().join("timed"),
        &["training.checkpoint_minutes=1e-9"],
    );
    let first = timed.checkpoints[0]
        .cut
        .expect("the first is inside epoch 1");
    assert_eq!((first.epoch, first.edges), (1, 50), "{first:?}");
    assert_eq!(epochs(&timed.checkpoints).last(), Some(&3));
    // By count, none by time.
    let counted = train(
        &ds,
        &tmp.path().join("counted"),
        &[
            "training.checkpoint_every=2",
            "training.checkpoint_minutes=0",
        ],
    );
    assert_eq!(epochs(&counted.checkpoints), [2, 3]);
    for (what, run, trained) in [("timed", "timed", &timed), ("counted", "counted", &counted)] {
        assert_eq!(trained.losses, plain.losses, "{what}");
        assert_eq!(trained.result, plain.result, "{what}");
        assert_eq!(
            tables(run),
            tables("default"),
            "{what} checkpoints changed the training"
        );
    }
}

/// Trains with `extra` on the memory, file and proxy backends (the proxy's store also striped
/// over two backing files), N = 4, C = 2, with and without a checkpoint due before batches; `same` compares the two runs. On a GPU the proxy's swaps go through
/// the GPU I/O kernels, over both controllers at once when striped.
fn checkpoints_inside_epochs_change_nothing(
    extra: &[&str],
    same: impl Fn(&str, &Trained, &Trained),
) {
    for backend in ["memory", "file", "proxy", "proxy-striped"] {
        let tmp = tempfile::tempdir().unwrap();
        let ds = small_graph(tmp.path(), 500, 4000);
        // The proxy's backing files in memory where the machine has it: what is tested is the
        // queues, not a disk's latency under a loaded machine (past the queues' 30 s timeout).
        let backing = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        let at = |name: &str| backing.path().join(name).display().to_string();
        let mut sets = vec![format!(
            "storage.backend={}",
            backend.trim_end_matches("-striped")
        )];
        match backend {
            // Both runs use the same files: the second overwrites the first's store.
            "proxy" => sets.extend([
                format!("storage.path=\"{}\"", at("store.bin")),
                "storage.force=true".into(),
            ]),
            "proxy-striped" => sets.extend([
                format!(
                    "storage.device=[{{path=\"{}\"}}, {{path=\"{}\"}}]",
                    at("a.bin"),
                    at("b.bin")
                ),
                "storage.stripe_bytes=65536".into(),
                "storage.force=true".into(),
            ]),
            _ => {}
        }
        let mut swapping: Vec<&str> = sets.iter().map(String::as_str).collect();
        swapping.extend(["storage.num_partitions=4", "storage.buffer_capacity=2"]);
        swapping.extend(extra);
        let backend = backend.to_string();
        let plain = train(&ds, &tmp.path().join("plain"), &swapping);
        let mut sets = swapping.clone();
        sets.push("training.checkpoint_minutes=1e-9");
        let timed = train(&ds, &tmp.path().join("timed"), &sets);
        assert!(
            timed.checkpoints.iter().any(|p| p.cut.is_some()),
            "{backend}: no checkpoint inside an epoch: {:?}",
            timed.checkpoints
        );
        same(&backend, &timed, &plain);
    }
}

#[test]
fn a_checkpoint_due_inside_an_epoch_is_taken_before_a_batch_and_changes_nothing() {
    checkpoints_inside_epochs_change_nothing(&[], |backend, timed, plain| {
        assert_eq!(timed.losses, plain.losses, "{backend}");
        assert_eq!(timed.result, plain.result, "{backend}");
    });
}

/// The same on a GPU: the engine's slots, partitions already on the device and the relations
/// carry on after a checkpoint inside an epoch as a resume would give them. The GPU sums
/// gradients with atomics, so runs agree to rounding, not bit for bit.
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn a_checkpoint_inside_an_epoch_on_the_gpu_changes_nothing() {
    checkpoints_inside_epochs_change_nothing(
        &["training.device=\"cuda:0\""],
        |backend, timed, plain| {
            for (a, b) in timed.losses.iter().zip(&plain.losses) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs(),
                    "{backend}: losses {:?} vs {:?}",
                    timed.losses,
                    plain.losses
                );
            }
            let mrr = |r: &serde_json::Value| r["metrics"]["mrr"].as_f64().unwrap();
            assert!(
                (mrr(&timed.result) - mrr(&plain.result)).abs() < 0.01,
                "{backend}: {} vs {}",
                timed.result,
                plain.result
            );
        },
    );
}

/// Trains 3 epochs with `sets`, stopped (as Ctrl-C stops a run) once `at` positives of epoch 2
/// are trained, then resumed from the checkpoint in a new session: what it trained, with the
/// cut the stop made.
fn stopped_and_resumed(ds: &Path, out: &Path, sets: &[&str], at: u64) -> (Trained, Position) {
    let mut session = Session::create(out, ds, config(sets), &Unguarded).unwrap();
    let stop = AtomicBool::new(false);
    let mut losses = Vec::new();
    let outcome = session
        .run(&stop, &mut |event| match event {
            Event::Progress { epoch, edges_done } if epoch == 2 && edges_done >= at => {
                stop.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            Event::EpochFinished { report, .. } => losses.push(report.loss),
            _ => {}
        })
        .unwrap();
    let Outcome::Stopped(cut) = outcome else {
        panic!("{sets:?}: not stopped: {outcome:?}");
    };
    drop(session);
    let mut session = Session::resume(out, None, &[], &Unguarded).unwrap();
    let mut result = serde_json::Value::Null;
    let outcome = session
        .run(&AtomicBool::new(false), &mut |event| match event {
            Event::EpochFinished { report, .. } => losses.push(report.loss),
            Event::Evaluated { line, .. } => result = line.clone(),
            _ => {}
        })
        .unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    let trained = Trained {
        checkpoints: Vec::new(),
        losses,
        result,
    };
    (trained, cut)
}

/// A run stopped before any batch of an epoch — inside a bucket, in a buffer state's overlap
/// or after buckets, with or without prefetching — and resumed from its checkpoint trains
/// exactly what the uninterrupted run trains, in memory (one partition) and out of core.
#[test]
fn a_run_stopped_inside_a_bucket_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 500, 4000);
    let layouts: [&[&str]; 4] = [
        &[],
        &[
            "storage.backend=file",
            "storage.num_partitions=4",
            "storage.buffer_capacity=2",
        ],
        &[
            "storage.backend=file",
            "storage.num_partitions=4",
            "storage.buffer_capacity=3",
        ],
        &[
            "storage.backend=file",
            "storage.num_partitions=4",
            "storage.buffer_capacity=3",
            "storage.prefetch=false",
        ],
    ];
    for (i, sets) in layouts.into_iter().enumerate() {
        let plain = train(&ds, &tmp.path().join(format!("plain-{i}")), sets);
        let mut inside_groups = 0;
        for at in [1, 620, 1100, 1730, 2400, 3100] {
            let out = tmp.path().join(format!("stopped-{i}-{at}"));
            let (resumed, cut) = stopped_and_resumed(&ds, &out, sets, at);
            let cut = cut.cut.expect("stopped inside epoch 2");
            inside_groups += usize::from(cut.next.is_some());
            // The session sees the stop at the next progress event: a batch or two later.
            assert!(cut.edges >= at && cut.edges < at + 100, "{sets:?}: {cut:?}");
            assert_eq!(
                resumed.losses, plain.losses,
                "{sets:?} stopped at {at}: {cut:?}"
            );
            assert_eq!(
                resumed.result, plain.result,
                "{sets:?} stopped at {at}: {cut:?}"
            );
        }
        // Stops between two buffer states are tested too, but most land inside a group.
        assert!(
            inside_groups >= 4,
            "{sets:?}: {inside_groups} cuts inside a group"
        );
    }
}

/// A run written before batch keys (run.toml without `batch_keys`) resumes where it stopped
/// with today's keys and is recorded with them; one from a newer version is refused.
#[test]
fn a_run_from_before_batch_keys_resumes_with_them_and_a_newer_one_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 500, 4000);
    let out = tmp.path().join("old");
    train(&ds, &out, &["training.num_epochs=1"]);
    let meta = out.join("run.toml");
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(text.contains("batch_keys = 1\n"), "{text}");
    std::fs::write(&meta, text.replace("batch_keys = 1\n", "")).unwrap();
    let sets = ["training.num_epochs=2".to_string()];
    let mut session = Session::resume(&out, None, &sets, &Unguarded).unwrap();
    let outcome = session.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    drop(session);
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(text.contains("batch_keys = 1\n"), "{text}");
    std::fs::write(&meta, text.replace("batch_keys = 1\n", "batch_keys = 9\n")).unwrap();
    let sets = ["training.num_epochs=3".to_string()];
    let err = Session::resume(&out, None, &sets, &Unguarded)
        .err()
        .expect("a newer run is refused")
        .to_string();
    assert!(err.contains("batch keys version 9"), "{err}");
}

/// A checkpoint of the epoch count run.toml's already has (a run stopped again right after its
/// resume, before a batch; or one cut inside the next epoch) goes to a directory of another
/// name: the one run.toml names is never removed or replaced before run.toml names the new one,
/// so a crash in between leaves it intact. The run still ends as the uninterrupted one.
#[test]
fn a_checkpoint_never_replaces_the_directory_run_toml_names() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 500, 4000);
    let plain = train(&ds, &tmp.path().join("plain"), &[]);
    let out = tmp.path().join("stopped");
    let mut session = Session::create(&out, &ds, config(&[]), &Unguarded).unwrap();
    let stop = AtomicBool::new(false);
    let outcome = session
        .run(&stop, &mut |event| {
            if let Event::EpochFinished { .. } = event {
                stop.store(true, std::sync::atomic::Ordering::Relaxed)
            }
        })
        .unwrap();
    assert!(matches!(outcome, Outcome::Stopped(_)), "{outcome:?}");
    drop(session);
    let recorded = || {
        let dir = legend_fs::Dir::open(&out).unwrap();
        let name = legend_engine::run::read_meta(&dir).unwrap().checkpoint;
        let on_disk: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
            .unwrap()
            .map(|e| format!("checkpoints/{}", e.unwrap().file_name().to_string_lossy()))
            .collect();
        assert_eq!(
            on_disk,
            std::slice::from_ref(&name),
            "the others are removed once committed"
        );
        name
    };
    assert_eq!(recorded(), "checkpoints/epoch-00001");
    for next in ["checkpoints/epoch-00001-2", "checkpoints/epoch-00001"] {
        let mut session = Session::resume(&out, None, &[], &Unguarded).unwrap();
        let outcome = session.run(&AtomicBool::new(true), &mut |_| {}).unwrap();
        assert!(matches!(outcome, Outcome::Stopped(_)), "{outcome:?}");
        assert_eq!(recorded(), next);
    }
    let mut session = Session::resume(&out, None, &[], &Unguarded).unwrap();
    let mut result = serde_json::Value::Null;
    let outcome = session
        .run(&AtomicBool::new(false), &mut |event| {
            if let Event::Evaluated { line, .. } = event {
                result = line.clone()
            }
        })
        .unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    assert_eq!(result, plain.result);
    assert_eq!(recorded(), "checkpoints/epoch-00003");
    let entities = |run: &Path| std::fs::read(run.join("checkpoints/epoch-00003/entities.bin"));
    assert!(entities(&out).unwrap() == entities(&tmp.path().join("plain")).unwrap());
}
