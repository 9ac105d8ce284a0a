//! A run seeded from another (`--init-from`) on a grown dataset (`import --extend`): the old
//! rows carried over exactly, `training.freeze = "existing"` leaving every one of them bit for
//! bit on every backend and layout, a seeded run stopped or killed before its first checkpoint
//! resuming as the uninterrupted one, and the refusals.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use legend_dataset::{Dataset, ImportInput, ImportOptions, import};
use legend_engine::Config;
use legend_engine::run::{self, Tables};
use legend_engine::session::{Event, Outcome, Session};
use legend_fs::Unguarded;

use common::{chain, small_graph, train_to_the_end};

fn config(sets: &[&str]) -> Config {
    let mut all: Vec<String> = [
        "model.dim=8",
        "model.decoder=distmult",
        "training.threads=1",
        "training.batch_size=50",
        "training.num_epochs=2",
        "evaluation.protocol=sampled",
        "evaluation.epochs_per_eval=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.extend(sets.iter().map(|s| s.to_string()));
    Config::parse("", &all).unwrap()
}

/// A base graph (500 entities), a run trained on it, and the graph grown by 40 new entities,
/// each with edges to old ones and to each other, and one new relation.
struct Grown {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    base: PathBuf,
    grown: PathBuf,
}

fn grown() -> Grown {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let base = small_graph(&dir, 500, 4000);
    let ds = Dataset::open(&base).unwrap();
    let (ents, rels) = (ds.entity_labels().unwrap(), ds.relation_labels().unwrap());
    let mut delta = String::new();
    for i in 0..40 {
        for j in 0..6 {
            let old = &ents[(i * 37 + j * 101) % ents.len()];
            let rel = &rels[j % rels.len()];
            if j % 2 == 0 {
                delta += &format!("new{i}\t{rel}\t{old}\n");
            } else {
                delta += &format!("{old}\t{rel}\tnew{i}\n");
            }
        }
        delta += &format!("new{i}\tnewrel\tnew{}\n", (i + 1) % 40);
    }
    let delta_path = dir.join("delta.tsv");
    std::fs::write(&delta_path, delta).unwrap();
    let grown = dir.join("grown");
    import(
        &ImportOptions::new(ImportInput::Extend {
            base: base.clone(),
            train: delta_path,
            valid: None,
            test: None,
        }),
        &grown,
    )
    .unwrap();
    Grown {
        _tmp: tmp,
        dir,
        base,
        grown,
    }
}

impl Grown {
    /// The base run `base`: the default configuration trained on the base graph.
    fn base_run(&self) -> PathBuf {
        let run = self.dir.join("base");
        let mut s = Session::create(&run, &self.base, config(&[]), &Unguarded).unwrap();
        train_to_the_end(&mut s);
        run
    }
}

fn tables(run: &Path) -> Tables {
    let dir = run::open(run).unwrap();
    let meta = run::read_meta(&dir).unwrap();
    run::load_tables(&dir, &meta, &Unguarded).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const LAYOUTS: [&[&str]; 6] = [
    &["storage.num_partitions=1"],
    &["storage.num_partitions=4", "storage.buffer_capacity=2"],
    &[
        "storage.backend=file",
        "storage.num_partitions=4",
        "storage.buffer_capacity=2",
    ],
    &[
        "storage.num_partitions=3",
        "storage.buffer_capacity=3",
        "storage.dtype=bf16",
    ],
    // Two workers of the CPU engine, the schedule of two GPUs (relations summed over both).
    &["training.gpus=2"],
    // NVMe queues of the userspace proxy controller (its backing file: `on_proxy`).
    &[
        "storage.backend=proxy",
        "storage.num_partitions=4",
        "storage.buffer_capacity=2",
    ],
];

/// `layout` with, for the proxy backend, a backing file of its own for the run `out`.
fn on_proxy(layout: &[&str], out: &Path) -> Vec<String> {
    let mut sets: Vec<String> = layout.iter().map(|s| s.to_string()).collect();
    if layout.contains(&"storage.backend=proxy") {
        let file = out.with_extension("proxy.bin");
        sets.push(format!("storage.path=\"{}\"", file.display()));
    }
    sets
}

#[test]
fn a_frozen_seeded_run_leaves_every_old_row_bit_for_bit_on_every_backend() {
    let g = grown();
    let (dim, old, old_rel) = (8, 500, 3);
    for (i, layout) in LAYOUTS.iter().enumerate() {
        let base_run = g.dir.join(format!("base{i}"));
        let base_sets = on_proxy(layout, &base_run);
        let base_sets: Vec<&str> = base_sets.iter().map(String::as_str).collect();
        let mut s = Session::create(&base_run, &g.base, config(&base_sets), &Unguarded).unwrap();
        train_to_the_end(&mut s);
        drop(s);
        let before = tables(&base_run);
        for freeze in ["existing", "none"] {
            let out = g.dir.join(format!("seeded{i}-{freeze}"));
            let mut sets = on_proxy(layout, &out);
            sets.push(format!("training.freeze=\"{freeze}\""));
            sets.push("training.new_rows=\"neighbours\"".into());
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let mut s = Session::create_from(&out, &g.grown, config(&sets), &Unguarded, &base_run)
                .unwrap_or_else(|e| panic!("{layout:?}: {}", chain(&e)));
            train_to_the_end(&mut s);
            drop(s);
            let after = tables(&out);
            assert_eq!(after.entities.len(), 540 * dim, "{layout:?}");
            let old_rows = |t: &Tables| bits(&t.entities[..old * dim]);
            let old_state = |t: &Tables| bits(&t.entities_state[..old * dim]);
            let old_rels = |t: &Tables| bits(&t.relations[..old_rel * dim]);
            if freeze == "existing" {
                assert!(
                    old_rows(&after) == old_rows(&before),
                    "{layout:?}: an old row moved"
                );
                assert!(
                    old_state(&after) == old_state(&before),
                    "{layout:?}: old state moved"
                );
                assert!(
                    old_rels(&after) == old_rels(&before),
                    "{layout:?}: a relation moved"
                );
                // The new relation and the new rows trained.
                assert_eq!(after.relations.len(), 4 * dim);
            } else {
                assert!(
                    old_rows(&after) != old_rows(&before),
                    "{layout:?}: nothing trained"
                );
            }
            // New rows started from their neighbours' mean and trained: none is zero.
            assert!(
                after.entities[old * dim..]
                    .chunks(dim)
                    .all(|r| r.iter().any(|&x| x != 0.0)),
                "{layout:?}"
            );
        }
    }
}

#[test]
fn carried_rows_are_the_init_runs_and_new_rows_their_neighbours_mean() {
    let g = grown();
    let dim = 8;
    let base_run = g.base_run();
    let before = tables(&base_run);
    // Stopped before its first batch: the checkpoint then holds exactly the carried rows.
    let out = g.dir.join("seeded");
    let sets = [
        "training.new_rows=\"neighbours\"",
        "training.carry_state=false",
    ];
    let mut s = Session::create_from(&out, &g.grown, config(&sets), &Unguarded, &base_run).unwrap();
    let outcome = s.run(&AtomicBool::new(true), &mut |_| {}).unwrap();
    assert!(matches!(outcome, Outcome::Stopped(_)), "{outcome:?}");
    drop(s);
    let t = tables(&out);
    assert!(bits(&t.entities[..500 * dim]) == bits(&before.entities));
    assert!(
        t.entities_state.iter().all(|&x| x == 0.0),
        "state not carried"
    );
    // new0's neighbours in the delta (old ones only).
    let ds = Dataset::open(&g.grown).unwrap();
    let added = ds.added_edges(legend_dataset::Split::Train).unwrap();
    let new0 = 500u32;
    let neighbours: Vec<u32> = added
        .iter()
        .filter_map(|&[s, _, d]| match (s == new0, d == new0) {
            (true, false) if d < 500 => Some(d),
            (false, true) if s < 500 => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(neighbours.len(), 6);
    for k in 0..dim {
        let mean = neighbours
            .iter()
            .map(|&n| before.entities[n as usize * dim + k])
            .sum::<f32>()
            / 6.0;
        assert!((t.entities[500 * dim + k] - mean).abs() < 1e-6);
    }
}

#[test]
fn a_seeded_run_killed_or_stopped_before_its_first_checkpoint_resumes_as_the_uninterrupted_one() {
    let g = grown();
    let base_run = g.base_run();
    for layout in [LAYOUTS[1], LAYOUTS[2]] {
        let tag = layout.len();
        let plain = g.dir.join(format!("plain{tag}"));
        let mut s =
            Session::create_from(&plain, &g.grown, config(layout), &Unguarded, &base_run).unwrap();
        train_to_the_end(&mut s);
        drop(s);
        // Killed after the set-up (the carry-over done, nothing committed): the resume carries
        // over again.
        let killed = g.dir.join(format!("killed{tag}"));
        drop(
            Session::create_from(&killed, &g.grown, config(layout), &Unguarded, &base_run).unwrap(),
        );
        let mut s = Session::resume(&killed, None, &[], &Unguarded).unwrap();
        train_to_the_end(&mut s);
        drop(s);
        // Stopped inside the first epoch: it resumes from that checkpoint.
        let stopped = g.dir.join(format!("stopped{tag}"));
        let mut s = Session::create_from(&stopped, &g.grown, config(layout), &Unguarded, &base_run)
            .unwrap();
        let stop = AtomicBool::new(false);
        let outcome = s
            .run(&stop, &mut |e| {
                if matches!(e, Event::Progress { .. }) {
                    stop.store(true, Ordering::Relaxed);
                }
            })
            .unwrap();
        assert!(matches!(outcome, Outcome::Stopped(_)), "{outcome:?}");
        drop(s);
        let mut s = Session::resume(&stopped, None, &[], &Unguarded).unwrap();
        train_to_the_end(&mut s);
        drop(s);
        let want = tables(&plain);
        for run in [&killed, &stopped] {
            let got = tables(run);
            assert!(
                bits(&got.entities) == bits(&want.entities),
                "{layout:?} {run:?}"
            );
            assert!(
                bits(&got.relations) == bits(&want.relations),
                "{layout:?} {run:?}"
            );
        }
    }
}

#[test]
fn seeding_is_refused_for_another_model_another_dataset_or_a_run_being_trained() {
    let g = grown();
    let base_run = g.base_run();
    let out = g.dir.join("seeded");
    let refused = |sets: &[&str], dataset: &Path, needles: &[&str]| {
        let e = Session::create_from(&out, dataset, config(sets), &Unguarded, &base_run)
            .err()
            .unwrap_or_else(|| panic!("{sets:?} was not refused"));
        let e = chain(&e);
        for n in needles {
            assert!(e.contains(n), "{sets:?}: {e:?} lacks {n:?}");
        }
        assert!(!out.exists(), "{sets:?}: a refused run left {out:?}");
    };
    refused(&["model.dim=16"], &g.grown, &["d = 8", "model.dim is 16"]);
    refused(
        &["model.decoder=complex"],
        &g.grown,
        &["trained distmult", "complex"],
    );
    refused(
        &["model.reciprocal_relations=true"],
        &g.grown,
        &["reciprocal_relations"],
    );
    // A dataset that does not extend the run's.
    let other = g.dir.join("other");
    let mut o = legend_dataset::GenerateOptions::new(500, 4000);
    o.relations = 3;
    o.seed = 9;
    legend_dataset::generate(&o, &other).unwrap();
    refused(&[], &other, &["does not extend", "import --extend"]);
    // Keys of a seeded run in a run that is not one.
    let e = Session::create(
        &out,
        &g.grown,
        config(&["training.freeze=\"existing\""]),
        &Unguarded,
    )
    .err()
    .unwrap();
    assert!(chain(&e).contains("--init-from"), "{}", chain(&e));
    assert!(!out.exists());
    let e = Config::parse(
        "",
        &[
            "training.freeze=\"existing\"".into(),
            "training.replay=0.5".into(),
        ],
    )
    .unwrap_err();
    assert!(e.to_string().contains("training.replay"), "{e}");
    // A run being trained: another process holds its lock.
    let lock = legend_engine::incremental::lock_exclusive(&base_run).unwrap();
    refused(&[], &g.grown, &["a process is training that run"]);
    drop(lock);
    Session::create_from(&out, &g.grown, config(&[]), &Unguarded, &base_run).unwrap();
}

/// On the GPU engine (memory and file backends): the carried rows reach the GPU exactly (a
/// run stopped before its first batch checkpoints them bit for bit), a seeded run trains to
/// its end, and `training.freeze = "existing"` is refused naming the CPU engine.
#[test]
#[ignore = "needs a GPU"]
fn a_seeded_run_on_the_gpu_carries_every_old_row_and_freezing_there_is_refused() {
    let g = grown();
    let dim = 8;
    let base_run = g.base_run();
    let before = tables(&base_run);
    for (i, layout) in [LAYOUTS[0], LAYOUTS[2]].into_iter().enumerate() {
        let mut sets = layout.to_vec();
        sets.push("training.device=\"cuda:0\"");
        let out = g.dir.join(format!("gpu-stopped{i}"));
        let mut s = Session::create_from(&out, &g.grown, config(&sets), &Unguarded, &base_run)
            .unwrap_or_else(|e| panic!("{layout:?}: {}", chain(&e)));
        let outcome = s.run(&AtomicBool::new(true), &mut |_| {}).unwrap();
        assert!(matches!(outcome, Outcome::Stopped(_)), "{outcome:?}");
        drop(s);
        let t = tables(&out);
        assert!(
            bits(&t.entities[..500 * dim]) == bits(&before.entities),
            "{layout:?}"
        );
        assert!(
            bits(&t.relations[..3 * dim]) == bits(&before.relations),
            "{layout:?}"
        );
        let mut s = Session::resume(&out, None, &[], &Unguarded).unwrap();
        train_to_the_end(&mut s);
    }
    let out = g.dir.join("gpu-frozen");
    let sets = ["training.device=\"cuda:0\"", "training.freeze=\"existing\""];
    let e = Session::create_from(&out, &g.grown, config(&sets), &Unguarded, &base_run)
        .err()
        .expect("freezing on the GPU is refused");
    assert!(chain(&e).contains("CPU engine only"), "{}", chain(&e));
    assert!(!out.exists());
}
