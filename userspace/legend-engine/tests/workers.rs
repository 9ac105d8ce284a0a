//! K workers (here the CPU engine's, over channels: the coordinator the GPUs run with NCCL)
//! train exactly what one worker trains running the same K-GPU schedule serially, round after
//! round and worker after worker, with the same resident partitions: bit for bit.

use std::sync::atomic::AtomicBool;

use legend_dataset::{Buckets, PartitionScheme};
use legend_engine::trainer::EpochEnd;
use legend_engine::workers::Workers;
use legend_engine::{Config, Engine, MemoryStore, PartitionHome, Relations, Trainer};
use legend_model::rng::{Stream, key};

const ENTITIES: u64 = 300;
/// Relations the edges name.
const RELATIONS: u64 = 5;

fn config(k: u32, sets: &[&str]) -> Config {
    let mut all = vec![
        "model.decoder=dot".to_string(),
        "model.dim=8".into(),
        "training.batch_size=16".into(),
        "training.threads=1".into(),
        "training.negatives.num_chunks=2".into(),
        "training.negatives.negatives_per_positive=8".into(),
        format!("training.gpus={k}"),
    ];
    all.extend(sets.iter().map(|s| s.to_string()));
    Config::parse("", &all).unwrap()
}

/// 3000 edges between random entities (so buckets differ in size), bucketed over 2K parts.
fn buckets(partitions: u32) -> Buckets {
    let scheme = PartitionScheme::new(ENTITIES, partitions).unwrap();
    let mut draws = Stream::new(key(11, &[]));
    let edges = (0..3000)
        .map(|_| {
            let src = draws.below(ENTITIES) as u32;
            // Skewed destinations: low ids more often, so buckets are unequal.
            let dst = (draws.below(ENTITIES) * draws.below(ENTITIES) / ENTITIES) as u32;
            [src, draws.below(RELATIONS) as u32, dst]
        })
        .collect();
    Buckets::build(edges, scheme)
}

fn tables(read: &mut dyn FnMut(u32, &mut Vec<f32>), partitions: u32) -> Vec<f32> {
    let mut out = Vec::new();
    for p in 0..partitions {
        read(p, &mut out);
    }
    out
}

/// `epochs` epochs on `k` workers of `engine` (`cpu`, or `cuda:0` for the first K GPUs):
/// the tables, and each epoch's edges.
fn workers_run(k: u32, sets: &[&str], epochs: u32, engine: &str) -> (Vec<f32>, Vec<u64>) {
    let device = format!("training.device=\"{engine}\"");
    let mut sets = sets.to_vec();
    sets.push(&device);
    let config = config(k, &sets);
    let n = config.storage.num_partitions;
    assert!(
        n == 2 * k || n >= 3 * k,
        "training.gpus sets N = 2K, or keeps N ≥ 3K: {n}"
    );
    let buckets = buckets(n);
    let degrees = legend_dataset::degrees(ENTITIES as usize, buckets.edges());
    let relations = initial_relations(&config);
    let engines = Engine::open_all(&config).unwrap();
    let home = MemoryStore::new(config.storage.dtype);
    let mut w = Workers::new(&config, buckets, &degrees, home, relations, engines).unwrap();
    let mut edges = Vec::new();
    for epoch in 1..=epochs {
        let end = w
            .run_epoch_from(epoch, None, &AtomicBool::new(false), &mut |_| {})
            .unwrap();
        let EpochEnd::Done(report) = end else {
            panic!("nothing asked epoch {epoch} to stop");
        };
        let workers = report.workers.expect("a K-worker report");
        assert_eq!(workers.gpus, k);
        assert_eq!(workers.rounds.len(), w.schedule().rounds.len());
        // Parked partitions move through host memory, never GPU to GPU.
        let parks = n > 2 * k;
        assert_eq!(workers.home_reads > 0, parks, "N = {n}, K = {k}");
        assert_eq!(workers.handovers > 0, !parks, "N = {n}, K = {k}");
        assert!(workers.parallel_efficiency > 0.0 && workers.parallel_efficiency <= 1.0);
        edges.push(report.edges);
    }
    let mut rows = tables(
        &mut |p, out| {
            w.stream_partition(p, &mut |emb, state| {
                out.extend_from_slice(emb);
                out.extend_from_slice(state);
                Ok(())
            })
            .unwrap()
        },
        n,
    );
    w.sync_relations().unwrap();
    rows.extend_from_slice(&w.relations().emb);
    rows.extend_from_slice(&w.relations().state);
    (rows, edges)
}

/// The relation rows a run of `config` starts from (the model's count for RELATIONS).
fn initial_relations(config: &Config) -> Relations {
    let rows = config.relation_rows(RELATIONS) as usize;
    Relations::init(config.decoder(), rows, 8, &config.init())
}

/// The schedule the workers ran, on one trainer of `engine` holding every partition.
fn serial_run(k: u32, sets: &[&str], epochs: u32, engine: &str) -> Vec<f32> {
    let workers = config(k, sets);
    let n = workers.storage.num_partitions;
    let mut sets: Vec<&str> = sets.to_vec();
    let partitions = format!("storage.num_partitions={n}");
    let device = format!("training.device=\"{engine}\"");
    sets.push(&partitions);
    sets.push(&device);
    let config = config(1, &sets);
    let buckets = buckets(n);
    let batch = config.training.batch_size as u64;
    let batches: Vec<u64> = buckets.counts().iter().map(|c| c.div_ceil(batch)).collect();
    let schedule = legend_planner::plan_gpus(n, k, &batches).unwrap();
    let degrees = legend_dataset::degrees(ENTITIES as usize, buckets.edges());
    let relations = initial_relations(&config);
    let home = PartitionHome::Memory(MemoryStore::new(config.storage.dtype));
    let engine = Engine::open(&config).unwrap();
    let mut t = Trainer::on_device(&config, buckets, &degrees, home, relations, engine).unwrap();
    t.make_resident(&(0..n).collect::<Vec<_>>()).unwrap();
    let lockstep = config.decoder().uses_relations();
    for epoch in 1..=epochs {
        for r in schedule.round_order(epoch) {
            let round = &schedule.rounds[r];
            if lockstep {
                // Relations: the workers' rule, one relation step from their summed gradients.
                let shares: Vec<(&[legend_planner::Piece], [u32; 2])> = (0..k as usize)
                    .map(|g| (round.work[g].as_slice(), round.held[g]))
                    .collect();
                let steps = round.lockstep_steps();
                t.train_lockstep(epoch, &shares, steps).unwrap();
                continue;
            }
            for g in 0..k as usize {
                t.train_pieces(epoch, &round.work[g], &round.held[g], &mut |_| {})
                    .unwrap();
            }
        }
    }
    let mut rows = tables(
        &mut |p, out| {
            t.stream_partition(p, &mut |emb, state| {
                out.extend_from_slice(emb);
                out.extend_from_slice(state);
                Ok(())
            })
            .unwrap()
        },
        n,
    );
    t.sync_relations().unwrap();
    rows.extend_from_slice(&t.relations().emb);
    rows.extend_from_slice(&t.relations().state);
    rows
}

#[test]
fn k_workers_train_exactly_the_serialised_schedule() {
    for (k, sets) in [
        (2, &[][..]),
        (3, &[][..]),
        (
            2,
            &[
                "training.negatives.degree_fraction=0.5",
                "storage.dtype=\"bf16\"",
            ][..],
        ),
        // Relations, summed over the workers at every step: ComplEx with reciprocal
        // relations and N3 (regulariser counts summed too), DistMult on 3 workers, RESCAL.
        (
            2,
            &[
                "model.decoder=complex",
                "model.reciprocal_relations=true",
                "optimizer.regularizer=n3",
                "optimizer.regularization_weight=0.05",
            ][..],
        ),
        (3, &["model.decoder=distmult"][..]),
        (2, &["model.decoder=rescal"][..]),
        // Partitions parked in host memory between rounds (N ≥ 3K), read ahead: with an odd
        // N, 16-bit rows at rest, and relations in lockstep.
        (2, &["storage.num_partitions=6"][..]),
        (
            2,
            &["storage.num_partitions=9", "storage.dtype=\"bf16\""][..],
        ),
        (
            3,
            &[
                "storage.num_partitions=10",
                "model.decoder=complex",
                "model.reciprocal_relations=true",
            ][..],
        ),
    ] {
        let (parallel, edges) = workers_run(k, sets, 3, "cpu");
        assert!(
            edges.iter().all(|&e| e == 3000),
            "every edge once an epoch: {edges:?}"
        );
        let serial = serial_run(k, sets, 3, "cpu");
        assert_eq!(parallel.len(), serial.len());
        assert!(
            parallel == serial,
            "K = {k} {sets:?}: the workers trained differently"
        );
    }
}

/// The same on K GPUs over NCCL (K = 2, and 4 where there are 4), whose float atomics make
/// two runs of one schedule differ in the last bits: the workers agree with the serialised
/// run on one GPU within a few times the spread of two serialised runs, measured here.
#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn k_gpus_agree_with_the_serialised_schedule_within_the_gpu_spread() {
    let gpus = legend_cuda::device_count();
    assert!(gpus >= 2, "this test needs 2 GPUs; the machine has {gpus}");
    let max_diff = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    for k in [2, 4].into_iter().filter(|&k| k <= gpus as u32) {
        // In the GPUs' memory (N = 2K), and parked in host memory (N = 3K + 1).
        for parked in [false, true] {
            let partitions = format!("storage.num_partitions={}", 3 * k + 1);
            let sets: Vec<&str> = if parked { vec![&partitions] } else { vec![] };
            let serial = serial_run(k, &sets, 3, "cuda:0");
            let again = serial_run(k, &sets, 3, "cuda:0");
            let spread = max_diff(&serial, &again);
            let (parallel, edges) = workers_run(k, &sets, 3, "cuda:0");
            assert!(edges.iter().all(|&e| e == 3000), "{edges:?}");
            let apart = max_diff(&parallel, &serial);
            println!(
                "K = {k}{}: workers vs serial {apart:.3e}, two serial runs {spread:.3e}",
                if parked { ", parked" } else { "" }
            );
            assert!(
                apart <= 4.0 * spread.max(1e-6),
                "K = {k} {sets:?}: the GPUs trained differently: {apart:e} apart, two runs {spread:e}"
            );
        }
    }
}

/// Relations on K GPUs: the relation sums go through NCCL (its own summation order), so the
/// GPU workers agree with the CPU workers to rounding, as one GPU agrees with the CPU (row-wise
/// state, where AdaGrad's first steps do not turn rounding into whole steps).
#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn k_gpus_with_relations_agree_with_k_cpu_workers() {
    let gpus = legend_cuda::device_count();
    assert!(gpus >= 2, "this test needs 2 GPUs; the machine has {gpus}");
    let sets = [
        "model.decoder=complex",
        "model.reciprocal_relations=true",
        "optimizer.regularizer=n3",
        "optimizer.regularization_weight=0.05",
        "optimizer.state=row",
    ];
    let rel_err = |a: &[f32], b: &[f32]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
        (num / den.max(1e-300)).sqrt()
    };
    for k in [2, 4].into_iter().filter(|&k| k <= gpus as u32) {
        let (gpu, _) = workers_run(k, &sets, 3, "cuda:0");
        let (cpu, _) = workers_run(k, &sets, 3, "cpu");
        let e = rel_err(&gpu, &cpu);
        println!("K = {k}: GPU workers vs CPU workers, relative error {e:.2e}");
        assert!(e < 1e-2, "K = {k}: {e:e}");
    }
}

mod sessions {
    use std::path::Path;
    use std::sync::atomic::AtomicBool;

    use legend_dataset::{GenerateOptions, generate};
    use legend_engine::Config;
    use legend_engine::session::{Event, Outcome, Session};
    use legend_fs::Unguarded;

    fn dataset(dir: &Path) -> std::path::PathBuf {
        let ds = dir.join("ds");
        generate(&GenerateOptions::new(2000, 40_000), &ds).unwrap();
        ds
    }

    fn sets(extra: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = [
            "model.decoder=dot",
            "model.dim=16",
            "training.threads=1",
            "training.batch_size=64",
            "evaluation.protocol=sampled",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        all.extend(extra.iter().map(|s| s.to_string()));
        all
    }

    /// Runs `session` to its end; returns the epochs' losses and whether a checkpoint was
    /// committed inside an epoch.
    fn finish(mut session: Session) -> (Vec<f64>, bool) {
        let mut losses = Vec::new();
        let mut inside = false;
        let outcome = session
            .run(&AtomicBool::new(false), &mut |event| match event {
                Event::EpochFinished { report, .. } => losses.push(report.loss),
                Event::Checkpoint { position } => inside |= position.cut.is_some(),
                _ => {}
            })
            .unwrap();
        assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
        (losses, inside)
    }

    fn entities(run: &Path, epoch: u32) -> Vec<u8> {
        std::fs::read(run.join(format!("checkpoints/epoch-{epoch:05}/entities.bin"))).unwrap()
    }

    /// Checkpoints between rounds (one falls due before every round, as often as their
    /// spacing allows) change nothing the workers train.
    /// With partitions parked between rounds, each stop also gives back what was read ahead,
    /// and a checkpoint streams the parked partitions from the home once they are written.
    #[test]
    fn checkpoints_between_rounds_change_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let ds = dataset(tmp.path());
        for partitions in ["storage.num_partitions=4", "storage.num_partitions=7"] {
            let run = |name: &str, extra: &[&str]| {
                let out = tmp.path().join(format!("{name}-{partitions}"));
                let mut all = vec!["training.gpus=2", "training.num_epochs=3", partitions];
                all.extend_from_slice(extra);
                let config = Config::parse("", &sets(&all)).unwrap();
                let (losses, inside) =
                    finish(Session::create(&out, &ds, config, &Unguarded).unwrap());
                (losses, inside, entities(&out, 3))
            };
            let (plain, _, plain_rows) = run("plain", &[]);
            let (timed, inside, timed_rows) = run("timed", &["training.checkpoint_minutes=1e-9"]);
            assert!(
                inside,
                "{partitions}: a checkpoint was due before the first round"
            );
            assert_eq!(timed, plain, "{partitions}");
            assert!(
                timed_rows == plain_rows,
                "{partitions}: checkpoints between rounds changed the tables"
            );
        }
    }

    /// A run trained on 2 workers resumes on 3 and then on 1 (a new count takes over at an
    /// epoch boundary); a cut inside an epoch resumes only on its own count, naming it.
    #[test]
    fn a_run_resumes_on_another_number_of_workers_at_an_epoch_boundary() {
        let tmp = tempfile::tempdir().unwrap();
        let ds = dataset(tmp.path());
        let out = tmp.path().join("run");
        let config =
            Config::parse("", &sets(&["training.gpus=2", "training.num_epochs=1"])).unwrap();
        let (first, _) = finish(Session::create(&out, &ds, config, &Unguarded).unwrap());
        let resume = |extra: &[&str]| Session::resume(&out, None, &sets(extra), &Unguarded);
        let (three, _) = finish(resume(&["training.gpus=3", "training.num_epochs=2"]).unwrap());
        let (one, _) = finish(resume(&["training.gpus=1", "training.num_epochs=3"]).unwrap());
        let losses: Vec<f64> = first.into_iter().chain(three).chain(one).collect();
        assert_eq!(losses.len(), 3);
        assert!(
            losses[2] < losses[0],
            "training goes on learning: {losses:?}"
        );
        // Stopped inside epoch 4 on 2 workers: 3 workers refuse to finish that epoch.
        let mut session = resume(&["training.gpus=2", "training.num_epochs=5"]).unwrap();
        let stop = AtomicBool::new(true);
        let outcome = session.run(&stop, &mut |_| {}).unwrap();
        let Outcome::Stopped(position) = outcome else {
            panic!("{outcome:?}");
        };
        assert_eq!(
            position.cut.map(|c| c.workers),
            Some(Some(2)),
            "{position:?}"
        );
        drop(session);
        let err = resume(&["training.gpus=3"])
            .and_then(|mut s| s.run(&AtomicBool::new(false), &mut |_| {}).map(|_| ()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("training.gpus = 2"), "{err}");
    }

    /// Trains with `extra` until a step overflows f16 (a worker fails): returns the error's
    /// text, once the run has stopped within a minute.
    fn a_failing_run(extra: &[&str]) -> String {
        let tmp = tempfile::tempdir().unwrap();
        let ds = dataset(tmp.path());
        let mut all = vec![
            "training.gpus=2",
            "storage.dtype=\"f16\"",
            "optimizer.learning_rate=1e9",
        ];
        all.extend_from_slice(extra);
        let config = Config::parse("", &sets(&all)).unwrap();
        let out = tmp.path().join("run");
        let mut session = Session::create(&out, &ds, config, &Unguarded).unwrap();
        let started = std::time::Instant::now();
        let err = session
            .run(&AtomicBool::new(false), &mut |_| {})
            .unwrap_err();
        let text = legend_engine::error_chain::with_sources(&err);
        assert!(text.contains("does not fit storage.dtype"), "{text}");
        assert!(started.elapsed().as_secs() < 60, "{text}");
        text
    }

    /// A worker that fails (a step past f16's range) stops the others at once: the run ends
    /// with an error naming the worker and the cause, and nothing hangs. Parked (N = 9), the
    /// others may be waiting for a partition the failed worker held: the home lets them go too.
    #[test]
    fn a_failing_worker_stops_the_others_and_is_named() {
        for partitions in ["storage.num_partitions=4", "storage.num_partitions=9"] {
            let text = a_failing_run(&[partitions]);
            assert!(text.contains("worker ") && text.contains("(cpu)"), "{text}");
        }
    }

    /// The same on GPUs: a failing GPU worker's error names its device; NCCL waits end.
    #[test]
    #[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (scripts/gpu/run-all.sh does)"]
    fn a_failing_gpu_worker_stops_the_others_and_is_named() {
        let text = a_failing_run(&["training.device=\"cuda:0\""]);
        assert!(text.contains("worker ") && text.contains("cuda:"), "{text}");
    }
}
