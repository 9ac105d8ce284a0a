//! Queries on a GPU (each test needs one: `#[ignore]`d, run with `--include-ignored`): the GPU
//! scan gives the CPU scan's answers exactly (ids, order, score bits; ties by id, -0 scores),
//! with the rows in GPU memory and streamed to it, over several chunks and query groups; rows
//! and scores from GPU memory; and the row cache over a run's store, byte for byte against the
//! store, under concurrent lookups with a cache smaller than the working set, for f32 rows
//! (through the store's own proxy) and 16-bit rows of an odd width (a file store, through a
//! proxy over its file).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use common::grid;
use legend_cuda::nvme_io::RowCacheOptions;
use legend_cuda::scan::SCAN_WORKING_BYTES;
use legend_dataset::{GenerateOptions, generate};
use legend_engine::config::DeviceChoice;
use legend_engine::run;
use legend_engine::session::{Outcome, Session};
use legend_eval::FilterIndex;
use legend_fs::Unguarded;
use legend_model::{Decoder, Side};
use legend_query::{
    Answer, Completion, GpuOptions, Metric, Model, Nearest, Query, QueryRun, Ranked, Residency,
    store_row_cache, store_table,
};

/// A budget that holds any table of these tests: the rows go into GPU memory.
const ROOMY: u64 = 8 << 30;

/// Each query's answer as (id, score bits): equal only if bit for bit.
fn bits(found: &[Vec<Ranked>]) -> Vec<Vec<(u32, u32)>> {
    found
        .iter()
        .map(|hits| hits.iter().map(|r| (r.id, r.score.to_bits())).collect())
        .collect()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn the_gpu_scan_answers_as_the_cpu_scan_resident_and_streamed() {
    let nr = 3usize;
    // d = 4: no group of eight, all tail; d = 13: a group and a tail of 5; d = 100. 40 000
    // rows and 1100 queries: several chunks, two query groups.
    for (ne, dim, nq) in [
        (1500usize, 4usize, 60usize),
        (40_000, 13, 1100),
        (3000, 100, 60),
    ] {
        let entities = grid(ne * dim, 1);
        // Rows of the widest decoder's relations (RESCAL's dim x dim), each taking its prefix.
        let relations = grid(2 * nr * dim * dim, 2);
        let known: Vec<[u32; 3]> = (0..3000u32)
            .map(|i| [i % 40, i % nr as u32, (i * 7919) % ne as u32])
            .collect();
        let filter = FilterIndex::build(ne, &[&known]).unwrap();
        let asked: Vec<Completion> = (0..nq)
            .map(|i| Completion {
                side: if i % 2 == 0 { Side::Dst } else { Side::Src },
                anchor: ((i * 37) % 40 + i / 40 * 97) as u32 % ne as u32,
                relation: (i % nr) as u32,
                top: [1, 25, 300, 2048.min(ne)][i % 4],
                filtered: i % 3 == 0,
            })
            .collect();
        for decoder in Decoder::ALL {
            if decoder.check_dim(dim).is_err() {
                continue;
            }
            for reciprocal in [false, true] {
                let rows = if reciprocal { 2 } else { 1 } * nr;
                let rel = relations[..rows * decoder.relation_width(dim)].to_vec();
                let model = || {
                    Model::in_memory(
                        decoder,
                        dim,
                        entities.clone(),
                        rel.clone(),
                        (nr, reciprocal),
                    )
                    .unwrap()
                };
                let want = bits(&model().complete(&asked, Some(&filter)).unwrap());
                for budget in [ROOMY, SCAN_WORKING_BYTES] {
                    let mut gpu = model();
                    gpu.use_gpu(0, budget).unwrap();
                    let placement = gpu.placement();
                    assert_eq!(
                        placement.contains("in GPU memory"),
                        budget == ROOMY,
                        "{placement}"
                    );
                    let got = bits(&gpu.complete(&asked, Some(&filter)).unwrap());
                    assert_eq!(
                        got, want,
                        "{decoder} d{dim} reciprocal {reciprocal}: {placement}"
                    );
                }
            }
        }
        // Neighbours by every metric (equal rows on the grid: L2 scores of -0).
        let model =
            || Model::in_memory(Decoder::Dot, dim, entities.clone(), Vec::new(), (0, false));
        let near: Vec<Nearest> = (0..nq)
            .flat_map(|i| {
                [Metric::Cosine, Metric::Dot, Metric::L2].map(|metric| Nearest {
                    entity: ((i * 131) % ne) as u32,
                    top: [1, 40, 2048.min(ne - 1)][i % 3],
                    metric,
                })
            })
            .collect();
        let cpu = model().unwrap();
        let want = bits(&cpu.nearest(&near).unwrap());
        // At d = 4 the grid repeats rows (5^4 of them): L2 scores of -0.
        let negative_zero = want
            .iter()
            .flatten()
            .any(|&(_, s)| s == (-0.0f32).to_bits());
        assert!(
            negative_zero || dim > 4,
            "d{dim}: the grid should give -0 scores"
        );
        for budget in [ROOMY, SCAN_WORKING_BYTES] {
            let mut gpu = model().unwrap();
            gpu.use_gpu(0, budget).unwrap();
            assert_eq!(bits(&gpu.nearest(&near).unwrap()), want, "d{dim} {budget}");
            // Rows and scores from wherever the rows are.
            let ids: Vec<u32> = (0..500).map(|i| (i * 7) % ne as u32).collect();
            assert_eq!(gpu.rows(&ids).unwrap(), cpu.rows(&ids).unwrap());
        }
        let scored = Model::in_memory(
            Decoder::DistMult,
            dim,
            entities.clone(),
            relations[..nr * dim].to_vec(),
            (nr, false),
        );
        let triples: Vec<[u32; 3]> = (0..300u32)
            .map(|i| [i % ne as u32, i % nr as u32, (i * 31) % ne as u32])
            .collect();
        let want: Vec<u32> = scored
            .as_ref()
            .unwrap()
            .score(&triples)
            .unwrap()
            .iter()
            .map(|s| s.to_bits())
            .collect();
        let mut gpu = scored.unwrap();
        gpu.use_gpu(0, ROOMY).unwrap();
        let got: Vec<u32> = gpu
            .score(&triples)
            .unwrap()
            .iter()
            .map(|s| s.to_bits())
            .collect();
        assert_eq!(got, want, "d{dim}");
    }
}

/// Trains a run of `dim` on a generated graph with `sets` (its store's backend and dtype), on
/// the CPU, one epoch: 20 000 entities in 3 partitions (the last shorter).
fn store_run(dir: &Path, name: &str, dim: usize, sets: &[&str]) -> PathBuf {
    let ds = dir.join("ds");
    if !ds.exists() {
        let mut o = GenerateOptions::new(20_000, 60_000);
        o.relations = 3;
        generate(&o, &ds).unwrap();
    }
    let mut all: Vec<String> = [
        "training.device=cpu",
        "training.num_epochs=1",
        "model.decoder=distmult",
        "storage.num_partitions=3",
        "storage.buffer_capacity=2",
        "evaluation.protocol=sampled",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(std::iter::once(format!("model.dim={dim}")))
    .collect();
    all.extend(sets.iter().map(|s| s.to_string()));
    let config = legend_engine::Config::parse("", &all).unwrap();
    let out = dir.join(name);
    let mut session = Session::create(&out, &ds, config, &Unguarded).unwrap();
    let outcome = session.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    out
}

/// `n` ids over `rows`, three in four from the hottest 2 % (rows reused, as the degree
/// distribution's hubs are), the rest anywhere; by seed.
fn skewed(rows: u64, n: usize, seed: u64) -> Vec<u64> {
    (0..n as u64)
        .map(|i| {
            let x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 7;
            x % if x.is_multiple_of(4) { rows } else { rows / 50 }
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn the_row_cache_over_a_runs_store_returns_its_rows_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    // f32 rows through the proxy of a proxy-backed store; bf16 rows of an odd width (26 bytes:
    // copied 2 bytes at a time) of a file store, through a proxy started over its file.
    for (name, dim, sets) in [
        ("proxy-f32", 16, &["storage.backend=proxy"][..]),
        (
            "file-bf16",
            13,
            &["storage.backend=file", "storage.dtype=bf16"][..],
        ),
    ] {
        let path = store_run(dir.path(), name, dim, sets);
        // Served: the table does not fit a budget of a scan's buffers and 1 MiB, so rows are
        // looked up through a cache of a quarter of the table.
        let options = GpuOptions {
            device: DeviceChoice::Cuda(0),
            budget: Some(SCAN_WORKING_BYTES + (1 << 20)),
            cache_fraction: 0.25,
        };
        let served =
            QueryRun::open_on(&path, None, &Unguarded, Residency::Resident, &options).unwrap();
        assert!(
            served.placement().contains("row cache"),
            "{}",
            served.placement()
        );
        let cpu = QueryRun::open(&path, None, &Unguarded, Residency::Resident).unwrap();
        let lookups = |seed: u64| -> Vec<Query> {
            skewed(20_000, 700, seed)
                .into_iter()
                .map(|id| Query::Lookup {
                    entity: id.to_string(),
                })
                .collect()
        };
        let at = |i: usize| format!("query {}", i + 1);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (served, cpu) = (&served, &cpu);
                s.spawn(move || {
                    for round in 0..3 {
                        let asked = lookups(t * 10 + round);
                        let got = served.answer(&asked, 1, &at).unwrap();
                        assert_eq!(got, cpu.answer(&asked, 1, &at).unwrap(), "{name} {t}");
                    }
                });
            }
        });
        let stats = served.model().cache_stats().unwrap();
        println!(
            "{name}: served lookups, {stats:?}, hit rate {:.3}",
            stats.hit_rate()
        );
        assert!(stats.hits > 0 && stats.misses > 0, "{stats:?}");
        // Scores through the cache are the CPU's.
        let score: Vec<Query> = (0..200u32)
            .map(|i| Query::Score {
                head: (i * 97 % 20_000).to_string(),
                relation: (i % 3).to_string(),
                tail: (i * 7919 % 20_000).to_string(),
            })
            .collect();
        assert_eq!(
            served.answer(&score, 1, &at).unwrap(),
            cpu.answer(&score, 1, &at).unwrap()
        );
        let rows_served = served.answer(&lookups(99), 1, &at).unwrap();
        assert!(matches!(rows_served[0], Answer::Lookup { .. }));
        drop(served);
        // The raw rows, byte for byte against the store's file, four threads sharing a cache
        // of 8 lines (far fewer than the lines the lookups touch).
        let run_dir = run::open(&path).unwrap();
        let meta = run::read_meta(&run_dir).unwrap();
        let reader = run::RunReader::open(&run_dir, &meta, &Unguarded, None).unwrap();
        let layout = reader.store_layout().expect("a store-backed run");
        let table = store_table(layout).unwrap();
        let file = std::fs::read(layout.members[0].file.path()).unwrap();
        let gpu = legend_cuda::Gpu::new(0).unwrap();
        let opts = RowCacheOptions {
            requesters: 128,
            ..RowCacheOptions::default()
        };
        let cache = store_row_cache(&gpu, layout, None, 1, (4, &opts)).unwrap();
        assert_eq!(cache.capacity_bytes(), 8 * u64::from(cache.line_bytes()));
        let cache = Mutex::new(cache);
        let rb = table.row_bytes as usize;
        assert_eq!(rb, dim * if name.ends_with("bf16") { 2 } else { 4 });
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (cache, table, file) = (&cache, &table, &file);
                s.spawn(move || {
                    for round in 0..4 {
                        let ids = skewed(table.rows, 20_000, 1000 + t * 10 + round);
                        let (got, _) = cache.lock().unwrap().lookup(&ids).unwrap();
                        for (i, &id) in ids.iter().enumerate() {
                            let at = table.byte_of(id) as usize;
                            assert!(
                                got[i * rb..(i + 1) * rb] == file[at..at + rb],
                                "{name}: row {id} differs from the store"
                            );
                        }
                    }
                });
            }
        });
        let stats = cache.lock().unwrap().stats().unwrap();
        println!("{name}: raw lookups, {stats:?}");
        assert!(stats.misses > 8 && stats.hits > 0, "{stats:?}");
    }
}

/// Issue 50: a query command, and a daemon's serve job, on a memory-backend run read the
/// checkpoint's rows once, straight into pinned staging on their way to the GPU (a 16-bit file
/// widened as read), summing them on the way (no pass of its own to check them): the answers
/// are the CPU's (over the mapped rows in f32), and a checkpoint damaged since it was written
/// is refused on the GPU as on the CPU. (Chunk after chunk, in order, a fill's error ending it:
/// legend-cuda's pipeline tests.)
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn a_checkpoint_goes_to_the_gpu_checked_and_answers_as_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let gpu = GpuOptions {
        budget: Some(ROOMY),
        ..GpuOptions::on(DeviceChoice::Cuda(0))
    };
    for (name, dtype) in [("memory", "f32"), ("memory-bf16", "bf16")] {
        // 20 000 rows of 100 floats: 8 MB in f32, two 4 MiB blocks read on two cores.
        let sets = ["storage.backend=memory", &format!("storage.dtype={dtype}")];
        let path = store_run(dir.path(), name, 100, &sets);
        checkpoint_to_the_gpu(&path, &gpu, dtype == "f32");
    }
}

/// [`a_checkpoint_goes_to_the_gpu_checked_and_answers_as_on_the_cpu`] on the run at `path`,
/// whose rows a query command on the CPU maps when `mapped`.
fn checkpoint_to_the_gpu(path: &Path, gpu: &GpuOptions, mapped: bool) {
    // As a query command opens it, and as a daemon's serve job does.
    let command = || QueryRun::open_on(path, None, &Unguarded, Residency::Fitting, gpu);
    let serve = || {
        let unguarded = std::sync::Arc::new(Unguarded);
        QueryRun::open_served(path, None, unguarded, gpu, None, &|_| Ok(()))
    };
    let on_gpu = command().unwrap();
    let served = serve().unwrap();
    for run in [&on_gpu, &served] {
        assert!(
            run.placement().contains("entity rows in GPU memory"),
            "{}",
            run.placement()
        );
        assert_eq!(run.copied(), Vec::<String>::new());
    }
    let cpu = QueryRun::open(path, None, &Unguarded, Residency::Fitting).unwrap();
    assert_eq!(cpu.model().is_mapped(), mapped);
    let asked: Vec<Query> = (0..300u32)
        .map(|i| {
            let e = (i * 7919 % 20_000).to_string();
            if i % 2 == 0 {
                Query::Predict {
                    head: Some(e),
                    relation: (i % 3).to_string(),
                    tail: None,
                    top: 10,
                    filtered: i % 4 == 0,
                }
            } else {
                Query::Neighbors {
                    entity: e,
                    top: 10,
                    metric: Metric::Cosine,
                }
            }
        })
        .collect();
    let at = |i: usize| format!("query {}", i + 1);
    let want = cpu.answer(&asked, 10, &at).unwrap();
    assert_eq!(on_gpu.answer(&asked, 10, &at).unwrap(), want);
    assert_eq!(served.answer(&asked, 10, &at).unwrap(), want, "served");
    drop((on_gpu, served, cpu));
    // One bit of the last row flipped: the upload's sum says so.
    let meta = run::read_meta(&run::open(path).unwrap()).unwrap();
    let file = path.join(&meta.checkpoint).join("entities.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 2;
    bytes[last] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    for (how, opened) in [
        ("command, GPU", command()),
        ("served, GPU", serve()),
        (
            "command, CPU",
            QueryRun::open(path, None, &Unguarded, Residency::Fitting),
        ),
    ] {
        let Err(e) = opened else {
            panic!(
                "{}, {how}: answered from a damaged checkpoint",
                path.display()
            );
        };
        let msg = e.to_string();
        assert!(
            msg.contains("entities.bin") && msg.contains("checksum mismatch"),
            "{msg}"
        );
    }
}
