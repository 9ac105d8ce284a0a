//! Queries against answers known by construction and against a brute-force reference: every
//! entity scored alone by the evaluator's kernel, all sorted by (score, id), known triples
//! removed. Tables with values on a coarse grid make exact ties common.

mod common;

use std::path::Path;

use common::grid;
use legend_dataset::{ImportInput, ImportOptions, Split, import};
use legend_engine::config::DeviceChoice;
use legend_engine::run::{self, RunMeta};
use legend_eval::{FilterIndex, Kernel};
use legend_fs::Unguarded;
use legend_model::{Decoder, Side};
use legend_query::{
    Answer, Completion, GpuOptions, Metric, Model, Nearest, Query, QueryError, QueryRun, Ranked,
    Residency,
};

/// Seven entities on a line (entity k at k) and one relation "+1", TransE L1 in one dimension.
fn line() -> Model {
    let entities: Vec<f32> = (0..7).map(|k| k as f32).collect();
    Model::in_memory(Decoder::TransEL1, 1, entities, vec![1.0], (1, false)).unwrap()
}

fn ids(found: &[Ranked]) -> Vec<u32> {
    found.iter().map(|r| r.id).collect()
}

/// With reciprocal relations a head is predicted as the evaluator ranks it: `(?, r, t)` as
/// `(t, r⁻¹, ?)` through the inverse's own row, not by inverting r. On the line, r is +1 and
/// its learned inverse +2 (deliberately not -1): heads of 3 are 5 (3 + 2), not 2 (3 - 1).
#[test]
fn a_reciprocal_run_predicts_heads_through_the_inverse_relation() {
    let entities: Vec<f32> = (0..7).map(|k| k as f32).collect();
    let m = Model::in_memory(
        Decoder::TransEL1,
        1,
        entities.clone(),
        vec![1.0, 2.0],
        (1, true),
    )
    .unwrap();
    let ask = |side, anchor| Completion {
        side,
        anchor,
        relation: 0,
        top: 1,
        filtered: false,
    };
    let found = m
        .complete(&[ask(Side::Src, 3), ask(Side::Dst, 3)], None)
        .unwrap();
    assert_eq!(ids(&found[0]), [5], "head of (?, r, 3) through r⁻¹");
    assert_eq!(ids(&found[1]), [4], "tail of (3, r, ?) through r");
    // Without the inverses the same head query inverts r; a table of the wrong size for
    // reciprocal relations is refused.
    assert_eq!(
        ids(&line().complete(&[ask(Side::Src, 3)], None).unwrap()[0]),
        [2]
    );
    assert!(Model::in_memory(Decoder::TransEL1, 1, entities, vec![1.0], (1, true)).is_err());
}

#[test]
fn a_line_predicts_its_next_point_then_the_ties_by_id() {
    let m = line();
    let known = [[2u32, 0, 3], [4, 0, 3]];
    let filter = FilterIndex::build(7, &[&known]).unwrap();
    let ask = |side, anchor, filtered| Completion {
        side,
        anchor,
        relation: 0,
        top: 3,
        filtered,
    };
    let found = m
        .complete(
            &[
                ask(Side::Dst, 2, false),
                ask(Side::Dst, 2, true),
                ask(Side::Src, 3, false),
                ask(Side::Src, 3, true),
            ],
            Some(&filter),
        )
        .unwrap();
    // 2 + 1 = 3 scores 0; 2 and 4 tie at -1 (lower id first); then 1 and 5 at -2.
    assert_eq!(ids(&found[0]), [3, 2, 4]);
    assert_eq!(
        found[0].iter().map(|r| r.score).collect::<Vec<_>>(),
        [0.0, -1.0, -1.0]
    );
    // Known: (2, +1, 3) removes 3.
    assert_eq!(ids(&found[1]), [2, 4, 1]);
    // Heads of (?, +1, 3): 2, then 1 and 3.
    assert_eq!(ids(&found[2]), [2, 1, 3]);
    // Known heads of 3 are 2 and 4.
    assert_eq!(ids(&found[3]), [1, 3, 0]);
    // Scores are the decoder's: (2, +1, 4) is -1.
    assert_eq!(m.score(&[[2, 0, 4], [0, 0, 6]]).unwrap(), [-1.0, -5.0]);
    // Neighbours by L2 of 3: 2 and 4 (tie), then 1 and 5; itself left out.
    let near = m
        .nearest(&[Nearest {
            entity: 3,
            top: 4,
            metric: Metric::L2,
        }])
        .unwrap();
    assert_eq!(ids(&near[0]), [2, 4, 1, 5]);
}

/// Every entity scored alone, best first by (score, id), `skip` left out, the first `top`.
fn reference(
    kernel: &Kernel,
    query: &[f32],
    rows: &[f32],
    dim: usize,
    top: usize,
    skip: &[u32],
) -> Vec<(u32, f32)> {
    let mut all: Vec<Ranked> = rows
        .chunks_exact(dim)
        .enumerate()
        .filter(|(id, _)| !skip.contains(&(*id as u32)))
        .map(|(id, row)| Ranked {
            id: id as u32,
            score: kernel.one(query, row),
        })
        .collect();
    all.sort_by(Ranked::better_first);
    all.truncate(top);
    all.iter().map(|r| (r.id, r.score)).collect()
}

fn pairs(found: &[Ranked]) -> Vec<(u32, f32)> {
    found.iter().map(|r| (r.id, r.score)).collect()
}

#[test]
fn predictions_and_neighbours_equal_a_brute_force_reference_for_every_decoder() {
    let (ne, nr, dim) = (1500usize, 3usize, 4usize);
    let entities = grid(ne * dim, 1);
    // Known triples: several per (anchor, relation), so filtering removes some of the best.
    let known: Vec<[u32; 3]> = (0..3000u32)
        .map(|i| [i % 40, i % nr as u32, (i * 7919) % ne as u32])
        .collect();
    let filter = FilterIndex::build(ne, &[&known]).unwrap();
    for decoder in Decoder::ALL {
        // RESCAL's relations are dim × dim matrices; Dot has none.
        let rw = decoder.relation_width(dim);
        let relations = grid(nr * rw, 2);
        let m = Model::in_memory(
            decoder,
            dim,
            entities.clone(),
            relations.clone(),
            (nr, false),
        )
        .unwrap();
        let kernel = Kernel::new(decoder.comparator(), dim);
        let mut asked = Vec::new();
        for anchor in [0u32, 1, 7, 39, 1499] {
            for relation in 0..nr as u32 {
                for side in [Side::Dst, Side::Src] {
                    for (top, filtered) in [(1, false), (25, true), (300, false), (ne, true)] {
                        asked.push(Completion {
                            side,
                            anchor,
                            relation,
                            top,
                            filtered,
                        });
                    }
                }
            }
        }
        let found = m.complete(&asked, Some(&filter)).unwrap();
        let mut ties = 0;
        for (c, got) in asked.iter().zip(&found) {
            let anchor = &entities[c.anchor as usize * dim..][..dim];
            let rel = &relations[c.relation as usize * rw..][..rw];
            let mut q = vec![0.0; dim];
            decoder.query(c.side, anchor, rel, &mut q);
            let skip = if c.filtered {
                filter.candidates(c.side, c.anchor, c.relation)
            } else {
                &[]
            };
            let want = reference(&kernel, &q, &entities, dim, c.top, skip);
            assert_eq!(pairs(got), want, "{decoder} {c:?}");
            ties += got.windows(2).filter(|w| w[0].score == w[1].score).count();
        }
        assert!(ties > 100, "{decoder}: the grid should make ties ({ties})");
        // Scores are the model's: compared with the decoder's own formula.
        let triples: Vec<[u32; 3]> = (0..50u32).map(|i| [i, i % 3, (i * 31) % 1500]).collect();
        for (t, s) in triples.iter().zip(m.score(&triples).unwrap()) {
            let row = |e: u32| &entities[e as usize * dim..][..dim];
            let r = &relations[t[1] as usize * rw..][..rw];
            let want = decoder.score(row(t[0]), r, row(t[2]));
            assert!((s - want).abs() < 1e-5, "{decoder} {t:?}: {s} vs {want}");
        }
    }
    let m = Model::in_memory(Decoder::Dot, dim, entities.clone(), Vec::new(), (0, false)).unwrap();
    for metric in [Metric::Cosine, Metric::Dot, Metric::L2] {
        let asked: Vec<Nearest> = [0u32, 5, 1499]
            .iter()
            .map(|&entity| Nearest {
                entity,
                top: 40,
                metric,
            })
            .collect();
        let found = m.nearest(&asked).unwrap();
        let unit = |row: &[f32]| {
            let n = row.iter().map(|x| x * x).sum::<f32>().sqrt();
            row.iter()
                .map(|x| if n > 0.0 { x / n } else { *x })
                .collect::<Vec<f32>>()
        };
        let (rows, comparator) = match metric {
            Metric::Cosine => (
                entities.chunks_exact(dim).flat_map(unit).collect(),
                legend_model::Comparator::Dot,
            ),
            Metric::Dot => (entities.clone(), legend_model::Comparator::Dot),
            Metric::L2 => (entities.clone(), legend_model::Comparator::NegL2),
        };
        let kernel = Kernel::new(comparator, dim);
        for (n, got) in asked.iter().zip(&found) {
            let q = &rows[n.entity as usize * dim..][..dim];
            let want = reference(&kernel, q, &rows, dim, n.top, &[n.entity]);
            assert_eq!(pairs(got), want, "{metric:?} {n:?}");
        }
    }
}

/// A dataset of the line graph with labels `p0`..`p6` and relation `next`, and a run whose
/// tables put `pk` at k: the answers are known by construction.
fn line_run(dir: &Path) -> std::path::PathBuf {
    line_run_with(dir, false)
}

/// [`line_run`], with reciprocal relations when `reciprocal`: `next` is +1, its learned inverse
/// +2 (not -1, so that a head predicted through it tells the two apart).
fn line_run_with(dir: &Path, reciprocal: bool) -> std::path::PathBuf {
    let text = dir.join("train.tsv");
    let lines: String = (0..6)
        .map(|k| format!("p{k}\tnext\tp{}\n", k + 1))
        .collect();
    std::fs::write(&text, lines).unwrap();
    let ds = dir.join("ds");
    import(
        &ImportOptions::new(ImportInput::Files {
            train: text,
            valid: None,
            test: None,
        }),
        &ds,
    )
    .unwrap();
    let dataset = legend_dataset::Dataset::open(&ds).unwrap();
    // Import numbers entities in its own order: row `id` holds the position of its label.
    let rows: Vec<f32> = dataset
        .entity_labels()
        .unwrap()
        .iter()
        .map(|l| l[1..].parse::<f32>().unwrap())
        .collect();
    assert_eq!(dataset.edges(Split::Train).unwrap().len(), 6);
    let out = dir.join("run");
    std::fs::create_dir(&out).unwrap();
    let meta = RunMeta {
        dataset: ds,
        dataset_identity: format!("{:032x}", dataset.meta().identity()),
        decoder: "transe_l1".into(),
        dim: 1,
        entities: 7,
        relations: if reciprocal { 2 } else { 1 },
        reciprocal_relations: reciprocal,
        epochs_completed: 1,
        ..RunMeta::blank()
    };
    let state = vec![0.0; 7];
    let relations = if reciprocal { &[1.0, 2.0][..] } else { &[1.0] };
    run::commit_checkpoint(
        &legend_fs::Dir::open(&out).unwrap(),
        meta,
        (relations, &[0.0; 2][..relations.len()]),
        |e, es| {
            e.write(&rows)?;
            es.write(&state)
        },
    )
    .unwrap();
    out
}

/// One query of each kind on the line run, by label.
fn line_queries() -> Vec<Query> {
    serde_json::from_str(
        r#"[
        {"query": "predict", "head": "p2", "relation": "next", "top": 3},
        {"query": "predict", "head": "p2", "relation": "next", "top": 3, "filtered": true},
        {"query": "predict", "tail": "p3", "relation": "next", "top": 2},
        {"query": "score", "head": "p2", "relation": "next", "tail": "p4"},
        {"query": "neighbors", "entity": "p3", "top": 2, "metric": "l2"},
        {"query": "lookup", "entity": "p5"}
    ]"#,
    )
    .unwrap()
}

#[test]
fn a_run_answers_by_label_from_memory_and_from_its_checkpoint_alike() {
    let dir = tempfile::tempdir().unwrap();
    let run = line_run(dir.path());
    let queries = line_queries();
    let mut answers = Vec::new();
    for residency in [Residency::Resident, Residency::Streamed] {
        let q = QueryRun::open(&run, None, &Unguarded, residency).unwrap();
        assert_eq!(q.model().is_resident(), residency == Residency::Resident);
        answers.push(
            q.answer(&queries, 100, &|i| format!("query {}", i + 1))
                .unwrap(),
        );
    }
    assert_eq!(answers[0], answers[1]);
    let labels = |a: &Answer| match a {
        Answer::Predict { hits, .. } | Answer::Neighbors { hits, .. } => hits
            .iter()
            .map(|h| h.label.clone())
            .collect::<Vec<_>>()
            .join(" "),
        Answer::Score { score, .. } => score.to_string(),
        Answer::Lookup { row, .. } => format!("{row:?}"),
    };
    let got: Vec<String> = answers[0].iter().map(labels).collect();
    // Ties go to the lower id, and import numbers the labels in an order of its own.
    let q = QueryRun::open(&run, None, &Unguarded, Residency::Streamed).unwrap();
    let id = |label: &str| common::id_of(&q, label);
    let tie = |a: &'static str, b: &'static str| {
        if id(a) < id(b) { [a, b] } else { [b, a] }
    };
    let want = [
        format!("p3 {}", tie("p2", "p4").join(" ")),
        format!("{} {}", tie("p2", "p4").join(" "), tie("p1", "p5")[0]),
        format!("p2 {}", tie("p1", "p3")[0]),
        "-1".into(),
        tie("p2", "p4").join(" "),
        "[5.0]".into(),
    ];
    assert_eq!(got, want, "{:#?}", answers[0]);
}

/// `auto` answers where it can: on a machine without a GPU, on the CPU (the GPU path's
/// fallback), saying why, with the CPU path's answers; a GPU named but missing is an error
/// naming it.
#[test]
fn auto_falls_back_to_the_cpu_with_its_answers_and_a_missing_gpu_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = line_run(dir.path());
    let queries = line_queries();
    let at = |i: usize| format!("query {}", i + 1);
    let cpu = QueryRun::open(&run, None, &Unguarded, Residency::Resident).unwrap();
    assert_eq!(cpu.placement(), "cpu");
    let want = cpu.answer(&queries, 100, &at).unwrap();
    for residency in [Residency::Resident, Residency::Streamed] {
        let auto = GpuOptions::on(DeviceChoice::Auto);
        let q = QueryRun::open_on(&run, None, &Unguarded, residency, &auto).unwrap();
        assert_eq!(q.answer(&queries, 100, &at).unwrap(), want, "{residency:?}");
        if !legend_cuda::driver_present() {
            let placement = match residency {
                Residency::Streamed => {
                    "cpu (auto: no CUDA driver); entity rows streamed from the run by each \
                     scan (streamed: asked)"
                }
                _ => "cpu (auto: no CUDA driver)",
            };
            assert_eq!(q.placement(), placement);
            assert_eq!(q.model().gpu_bytes(), 0);
        }
    }
    if legend_cuda::driver_present() {
        return;
    }
    let named = GpuOptions::on(DeviceChoice::Cuda(0));
    let e = QueryRun::open_on(&run, None, &Unguarded, Residency::Resident, &named)
        .err()
        .expect("no GPU here");
    assert!(matches!(&e, QueryError::Gpu { device, .. } if device == "cuda:0"));
    assert!(e.to_string().starts_with("cuda:0: no CUDA driver"), "{e}");
}

/// A run trained with reciprocal relations, opened from its directory (its record says so),
/// predicts heads through r⁻¹'s own row whether its rows are in memory or streamed: heads of
/// `p3` are `p5` (3 + 2, the inverse's learned offset), not `p2`; tails through r.
#[test]
fn a_reciprocal_run_from_its_directory_predicts_heads_through_the_inverse() {
    let dir = tempfile::tempdir().unwrap();
    let run = line_run_with(dir.path(), true);
    let queries: Vec<Query> = serde_json::from_str(
        r#"[
        {"query": "predict", "tail": "p3", "relation": "next", "top": 1},
        {"query": "predict", "head": "p3", "relation": "next", "top": 1}
    ]"#,
    )
    .unwrap();
    for residency in [Residency::Resident, Residency::Streamed] {
        let q = QueryRun::open(&run, None, &Unguarded, residency).unwrap();
        let answers = q.answer(&queries, 100, &|i| i.to_string()).unwrap();
        let top: Vec<&str> = answers
            .iter()
            .map(|a| match a {
                Answer::Predict { hits, .. } => hits[0].label.as_str(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(top, ["p5", "p4"], "{residency:?}");
    }
}

#[test]
fn unknown_labels_ids_and_relations_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = line_run(dir.path());
    let q = QueryRun::open(&run, None, &Unguarded, Residency::Streamed).unwrap();
    let ask = |query: Query| {
        q.answer(&[query], 100, &|i| format!("line {}", i + 7))
            .unwrap_err()
    };
    let e = ask(Query::Score {
        head: "p2".into(),
        relation: "next".into(),
        tail: "p99".into(),
    });
    assert!(matches!(e, QueryError::Unknown { .. }));
    let msg = e.to_string();
    assert!(
        msg.starts_with("line 7: unknown entity \"p99\"") && msg.contains("id below 7"),
        "{msg}"
    );
    let msg = ask(Query::Predict {
        head: Some("p1".into()),
        relation: "previous".into(),
        tail: None,
        top: 3,
        filtered: false,
    })
    .to_string();
    assert!(msg.contains("unknown relation \"previous\""), "{msg}");
    // Ids answer where no label has that name; past the table they are unknown too.
    assert!(
        q.answer(&[Query::Lookup { entity: "6".into() }], 100, &|i| i
            .to_string())
            .is_ok()
    );
    let long = "x".repeat(1 << 20);
    let msg = ask(Query::Lookup { entity: long }).to_string();
    assert!(
        msg.len() < 1000 && msg.contains("xxx…\""),
        "{}",
        &msg[..1000.min(msg.len())]
    );
    let msg = ask(Query::Lookup { entity: "7".into() }).to_string();
    assert!(msg.contains("unknown entity \"7\""), "{msg}");
    let msg = ask(Query::Neighbors {
        entity: "p1".into(),
        top: 101,
        metric: Metric::Cosine,
    })
    .to_string();
    assert!(msg.contains("top 101: ask for 1 to 100"), "{msg}");
    // None asked for: the range named is the run's entities, below the limit.
    let msg = ask(Query::Neighbors {
        entity: "p1".into(),
        top: 0,
        metric: Metric::Cosine,
    })
    .to_string();
    assert!(msg.contains("top 0: ask for 1 to 7 entities"), "{msg}");
}

/// A run of `entities` rows of `dim` floats from [`grid`], DistMult, written as a checkpoint
/// (no dataset: for the id-level [`Model`]).
fn grid_run(dir: &Path, entities: usize, dim: usize) -> (legend_fs::Dir, RunMeta) {
    let out = dir.join("grid-run");
    std::fs::create_dir(&out).unwrap();
    let meta = RunMeta {
        dataset: dir.to_owned(),
        dataset_identity: "0".repeat(32),
        decoder: "distmult".into(),
        dim,
        entities: entities as u64,
        relations: 2,
        epochs_completed: 1,
        ..RunMeta::blank()
    };
    let rows = grid(entities * dim, 3);
    let meta = run::commit_checkpoint(
        &legend_fs::Dir::open(&out).unwrap(),
        meta,
        (&grid(2 * dim, 4), &vec![0.0; 2 * dim]),
        |e, es| {
            e.write(&rows)?;
            es.write(&rows)
        },
    )
    .unwrap();
    (legend_fs::Dir::open(&out).unwrap(), meta)
}

#[test]
fn a_checkpoint_read_in_blocks_that_split_rows_answers_as_from_memory() {
    // 64 MiB blocks of 3-float rows: every block ends inside a row.
    let (entities, dim) = (5_600_000, 3);
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, meta) = grid_run(dir.path(), entities, dim);
    let resident = Model::of_run(run_dir, meta.clone(), 2, &Unguarded, false).unwrap();
    let run_dir = legend_fs::Dir::open(&dir.path().join("grid-run")).unwrap();
    let streamed = Model::of_run(run_dir, meta, 2, &Unguarded, true).unwrap();
    assert!(resident.is_resident() && !streamed.is_resident());
    // The rows around the first block's end, and the last.
    let boundary = ((16 << 20) / dim) as u32;
    let ids = [0, boundary - 1, boundary, boundary + 1, entities as u32 - 1];
    assert_eq!(resident.rows(&ids).unwrap(), streamed.rows(&ids).unwrap());
    let asked: Vec<Completion> = ids
        .iter()
        .map(|&anchor| Completion {
            side: Side::Dst,
            anchor,
            relation: 1,
            top: 5,
            filtered: false,
        })
        .collect();
    assert_eq!(
        pairs_all(&resident.complete(&asked, None).unwrap()),
        pairs_all(&streamed.complete(&asked, None).unwrap())
    );
    let triples: Vec<[u32; 3]> = ids.iter().map(|&e| [e, 0, boundary]).collect();
    assert_eq!(
        resident.score(&triples).unwrap(),
        streamed.score(&triples).unwrap()
    );
}

fn pairs_all(found: &[Vec<Ranked>]) -> Vec<Vec<(u32, f32)>> {
    found.iter().map(|f| pairs(f)).collect()
}

#[test]
fn a_run_larger_than_memory_is_refused_before_loading_and_checked_when_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, mut meta) = grid_run(dir.path(), 10, 3);
    // As a record claiming 2^40 rows says: far more than any machine's memory.
    meta.entities = 1 << 40;
    let Err(e) = Model::of_run(run_dir, meta.clone(), 2, &Unguarded, false) else {
        panic!("loaded 12 TiB");
    };
    let msg = e.to_string();
    assert!(
        msg.contains("12288.0 GiB, more than the") && msg.contains("a piece at a time"),
        "{msg}"
    );
    // Streamed, nothing is loaded: the checkpoint is checked against the record instead, and
    // this one's entity file is far too short for it.
    let run_dir = legend_fs::Dir::open(&dir.path().join("grid-run")).unwrap();
    let Err(e) = Model::of_run(run_dir, meta, 2, &Unguarded, true) else {
        panic!("streamed a checkpoint shorter than its record");
    };
    let msg = e.to_string();
    assert!(
        msg.contains("entities.bin") && msg.contains("holds 120 bytes, expected 13194139533312"),
        "{msg}"
    );
}
