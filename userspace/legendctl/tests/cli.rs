//! End-to-end tests of `legendctl` on a generated knowledge graph: import, partition, plan,
//! train, eval, export and resume, and the errors of each.

mod common;

use common::{argv, fails, graph, json, ok, s, train_args};

use std::path::Path;

#[test]
fn import_json_summary_and_plan_json_keys() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.tsv"), "a\tr\tb\nb\tr\tc\n").unwrap();
    let out = ok(&[
        "import",
        "-o",
        &s(&dir.path().join("ds")),
        "--train",
        &s(&dir.path().join("t.tsv")),
        "--json",
    ]);
    let v = json(out.trim());
    for key in ["entities", "relations", "train", "valid", "test"] {
        assert!(v.get(key).is_some(), "{key} missing from {v}");
    }
    let plan = json(ok(&["plan", "-n", "6", "-c", "3", "--json"]).trim());
    let mut keys: Vec<&str> = plan
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "io_count",
            "order",
            "states",
            "swaps",
            "swaps_without_overlap",
            "volume"
        ]
    );
    assert_eq!(plan["io_count"], 8);
    // The prediction's partitions hold the rows' real bytes: 4·(100 + 100) element-wise,
    // 4·(100 + 1) with row-wise state, 2·100 + 4 with bf16 rows and row-wise state.
    let predicted = |state: &str, dtype: &str| {
        let p = json(
            ok(&[
                "plan", "-n", "8", "-c", "3", "--nodes", "800", "--edges", "9000", "--state",
                state, "--dtype", dtype, "--json",
            ])
            .trim(),
        );
        p["prediction"]["partition_bytes"].as_f64().unwrap()
    };
    assert_eq!(predicted("element", "f32"), 100.0 * 800.0);
    assert_eq!(predicted("row", "f32"), 100.0 * 404.0);
    assert_eq!(predicted("row", "bf16"), 100.0 * 204.0);
    fails(&["plan", "-n", "6", "-c", "4", "--order", "legend"], "4");
    fails(
        &[
            "import",
            "-o",
            &s(&dir.path().join("x")),
            "--train",
            &s(&dir.path().join("missing.tsv")),
        ],
        "missing.tsv",
    );
    assert!(!dir.path().join("x").exists());
}

#[test]
fn train_eval_export_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let run = dir.path().join("run");
    let common = [
        "--set",
        "model.dim=16",
        "--set",
        "training.batch_size=32",
        "--set",
        "training.negatives.negatives_per_positive=16",
        "--set",
        "storage.num_partitions=4",
        "--set",
        "storage.buffer_capacity=3",
    ];
    let mut args = vec![
        "train",
        "--dataset",
        &*s(&ds).leak(),
        "--out",
        &*s(&run).leak(),
        "--json",
        "--set",
        "training.num_epochs=4",
    ];
    args.extend(common);
    let out = ok(&args);
    let lines: Vec<serde_json::Value> = out.lines().map(json).collect();
    assert_eq!(lines.len(), 5, "4 epochs + the final evaluation: {out}");
    assert_eq!(lines[0]["epoch"], 1);
    assert!(
        lines[0]["swaps"].as_array().unwrap().len() > 1,
        "C < N swaps partitions"
    );
    let final_mrr = lines[4]["metrics"]["mrr"].as_f64().unwrap();
    assert!(final_mrr > 0.0 && final_mrr <= 1.0);
    assert_eq!(lines[4]["metrics"]["protocol"], "filtered");

    // eval reproduces the final figure; sampled is deterministic.
    let m = json(ok(&["eval", &s(&run), "--json"]).trim());
    assert_eq!(m["mrr"].as_f64().unwrap(), final_mrr);
    for key in [
        "mrr",
        "mean_rank",
        "hits_at_1",
        "hits_at_3",
        "hits_at_10",
        "protocol",
        "count",
    ] {
        assert!(m.get(key).is_some(), "{key} missing from {m}");
    }
    let a = ok(&["eval", &s(&run), "--protocol", "sampled", "--json"]);
    let b = ok(&["eval", &s(&run), "--protocol", "sampled", "--json"]);
    assert_eq!(a, b);
    assert_eq!(json(a.trim())["protocol"], "sampled");

    // export → eval --embeddings gives the same figure.
    ok(&[
        "export",
        &s(&run),
        "--format",
        "npy",
        "-o",
        &s(&dir.path().join("npy")),
    ]);
    let m2 = json(
        ok(&[
            "eval",
            "--embeddings",
            &s(&dir.path().join("npy")),
            "--decoder",
            "complex",
            "--dataset",
            &s(&ds),
            "--json",
        ])
        .trim(),
    );
    assert_eq!(m2["mrr"], m["mrr"]);
    ok(&[
        "export",
        &s(&run),
        "--format",
        "tsv",
        "-o",
        &s(&dir.path().join("tsv")),
    ]);
    let tsv = std::fs::read_to_string(dir.path().join("tsv/entities.tsv")).unwrap();
    assert_eq!(tsv.lines().count(), 60);
    assert_eq!(
        tsv.lines().next().unwrap().split('\t').count(),
        17,
        "label + 16 values"
    );

    // Two epochs, then two more with --resume, equal four straight epochs bit for bit.
    let half = dir.path().join("half");
    let mut args = vec![
        "train",
        "--dataset",
        &*s(&ds).leak(),
        "--out",
        &*s(&half).leak(),
        "--set",
        "training.num_epochs=2",
    ];
    args.extend(common);
    ok(&args);
    ok(&[
        "train",
        "--out",
        &s(&half),
        "--resume",
        "--set",
        "training.num_epochs=4",
    ]);
    let tables = |r: &Path| -> Vec<u8> {
        let meta = std::fs::read_to_string(r.join("run.toml")).unwrap();
        let ckpt = meta
            .lines()
            .find(|l| l.starts_with("checkpoint"))
            .unwrap()
            .split('"')
            .nth(1)
            .unwrap()
            .to_owned();
        [
            "entities.bin",
            "entities.state.bin",
            "relations.bin",
            "relations.state.bin",
        ]
        .iter()
        .flat_map(|f| std::fs::read(r.join(&ckpt).join(f)).unwrap())
        .collect()
    };
    assert!(
        tables(&run) == tables(&half),
        "resumed training differs from uninterrupted training"
    );
    let again = ok(&["train", "--out", &s(&half), "--resume"]);
    assert!(again.contains("nothing to do"), "{again}");
    fails(
        &[
            "train",
            "--out",
            &s(&half),
            "--resume",
            "--set",
            "training.num_epochs=3",
        ],
        "set at least 4",
    );
    // The refused resume changed nothing: the run still has nothing to do.
    let again = ok(&["train", "--out", &s(&half), "--resume"]);
    assert!(again.contains("nothing to do"), "{again}");
}

#[test]
fn thread_count_does_not_change_results() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let run = |threads: &str| {
        let out = dir.path().join(format!("t{threads}"));
        ok(&[
            "train",
            "--dataset",
            &s(&ds),
            "--out",
            &s(&out),
            "--set",
            "training.num_epochs=2",
            "--set",
            "model.dim=8",
            "--set",
            &format!("training.threads={threads}"),
            "--set",
            "training.batch_size=600",
            "--set",
            "training.negatives.num_chunks=3",
        ]);
        std::fs::read(out.join("checkpoints/epoch-00002/entities.bin")).unwrap()
    };
    // Three threads on fewer cores also interleave the parallel optimizer step differently.
    let one = run("1");
    assert!(one == run("2") && one == run("3"));
}

#[test]
fn bad_configurations_are_refused_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let out = dir.path().join("run");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[model]\ndimension = 3\n").unwrap();
    fails(
        &["train", "--dataset", &s(&ds), "--out", &s(&out), &s(&cfg)],
        "dimension",
    );
    fails(
        &[
            "train",
            "--dataset",
            &s(&ds),
            "--out",
            &s(&out),
            "--set",
            "model.decoder=linear",
        ],
        "model.decoder",
    );
    fails(
        &[
            "train",
            "--dataset",
            &s(&ds),
            "--out",
            &s(&out),
            "--set",
            "training.device=cuda:0",
        ],
        "cuda",
    );
    fails(
        &[
            "train",
            "--dataset",
            &s(&ds),
            "--out",
            &s(&out),
            "--set",
            "storage.num_partitions=1000",
        ],
        "1000 partitions",
    );
    fails(
        &[
            "train",
            "--dataset",
            &s(&dir.path().join("nope")),
            "--out",
            &s(&out),
        ],
        "nope",
    );
    assert!(!out.exists(), "a refused run left its directory behind");
    fails(&["eval", &s(&dir.path().join("nope"))], "run.toml");
}

#[test]
fn any_buffer_capacity_trains_with_the_default_order_and_a_refusal_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    for capacity in ["2", "4"] {
        let out = dir.path().join(format!("c{capacity}"));
        let capacity = format!("storage.buffer_capacity={capacity}");
        let sets = [
            "storage.num_partitions=6",
            &capacity,
            "storage.backend=file",
        ];
        ok(&argv(&train_args(&ds, &out, &sets)));
        assert!(out.join("run.toml").is_file());
    }
    let refused = dir.path().join("refused");
    let sets = [
        "storage.num_partitions=6",
        "storage.buffer_capacity=4",
        "storage.order=legend",
        "storage.backend=file",
    ];
    let out = common::legendctl(&argv(&train_args(&ds, &refused, &sets)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.matches("supports capacity 3 only").count(), 1, "{err}");
    assert!(err.contains("`auto`"), "{err}");
    assert!(
        !refused.exists(),
        "a refused run left {}",
        refused.display()
    );
}

#[test]
fn an_export_of_a_damaged_checkpoint_fails_and_leaves_no_files() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let run = dir.path().join("run");
    ok(&argv(&train_args(&ds, &run, &["training.num_epochs=1"])));
    let meta = legend_engine::run::read_meta(&legend_engine::run::open(&run).unwrap()).unwrap();
    let table = run
        .join(&meta.checkpoint)
        .join(legend_engine::run::TABLE_FILES[0]);
    let mut bytes = std::fs::read(&table).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&table, bytes).unwrap();
    let out = dir.path().join("out");
    fails(
        &["export", &s(&run), "--format", "npy", "-o", &s(&out)],
        "checksum mismatch: the checkpoint is damaged",
    );
    let left: Vec<_> = std::fs::read_dir(&out)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "a failed export left {left:?}");
}

/// Trains `run` on `ds` with `sets` and returns its `--json` result line (the last).
fn train_result(ds: &Path, run: &Path, sets: &[&str]) -> serde_json::Value {
    let mut args = train_args(ds, run, sets);
    args.push("--json".into());
    let out = ok(&argv(&args));
    json(out.lines().last().unwrap())
}

/// `legendctl eval RUN --protocol sampled` ranks with the run's own `[evaluation]` negatives
/// and seed, so it reproduces the run's final figure; flags still override them.
#[test]
fn sampled_eval_of_a_run_reproduces_its_own_figure() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let run = dir.path().join("run");
    let sets = [
        "model.dim=16",
        "training.num_epochs=2",
        "evaluation.protocol=sampled",
        "evaluation.seed=7",
        "evaluation.uniform_negatives=20",
        "evaluation.degree_negatives=10",
    ];
    let last = train_result(&ds, &run, &sets);
    let eval = json(ok(&["eval", &s(&run), "--protocol", "sampled", "--json"]).trim());
    for key in ["mrr", "mean_rank", "hits_at_10"] {
        assert_eq!(eval[key], last["metrics"][key], "{key}: {eval} vs {last}");
    }
    let other = json(
        ok(&[
            "eval",
            &s(&run),
            "--protocol",
            "sampled",
            "--seed",
            "8",
            "--json",
        ])
        .trim(),
    );
    assert_ne!(
        other["mean_rank"], eval["mean_rank"],
        "--seed overrides the run's"
    );
}

/// A log that cannot be written (here a pipe nobody reads: every write fails with EPIPE, as
/// a terminal closed under a long run would) loses its lines and nothing else: training runs
/// to its end. The logger's default reports a failed write with `eprintln!`, which panicked
/// on the same stderr at the first line.
#[test]
fn training_survives_a_log_it_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let out = dir.path().join("run");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let status = std::process::Command::new(common::bin())
        .args(train_args(
            &ds,
            &out,
            &["training.num_epochs=2", "model.dim=8"],
        ))
        .env("LEGEND_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(writer)
        .status()
        .unwrap();
    assert!(status.success(), "{status}");
    assert!(out.join("run.toml").exists());
}

/// A trained run's labels are indexed when it ends, kept in the run for its queries: the
/// first `predict` reuses the index (the same file) rather than indexing the labels itself.
#[test]
fn a_finished_run_keeps_its_label_index_for_its_first_query() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds");
    // Enough entities for the index to be kept (2^16 labels or more).
    ok(&[
        "generate",
        "--nodes",
        "70000",
        "--edges",
        "100000",
        "--relations",
        "2",
        &s(&ds),
    ]);
    let run = dir.path().join("run");
    let args = train_args(
        &ds,
        &run,
        &[
            "model.dim=4",
            "training.num_epochs=1",
            "evaluation.protocol=sampled",
        ],
    );
    ok(&argv(&args));
    let index = run.join("index/entities.tsv.index");
    let kept = std::fs::metadata(&index)
        .expect("the run's label index")
        .ino();
    let answer = json(
        ok(&[
            "predict",
            &s(&run),
            "--head",
            "e69999",
            "--relation",
            "r1",
            "--top",
            "3",
            "--device",
            "cpu",
            "--json",
        ])
        .trim(),
    );
    assert_eq!(hits(&answer).len(), 3, "{answer}");
    assert_eq!(std::fs::metadata(&index).unwrap().ino(), kept, "reused");
}

/// The hits of a `predict` or `neighbors` answer: (label, score).
fn hits(answer: &serde_json::Value) -> Vec<(String, f64)> {
    answer["hits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["label"].as_str().unwrap().to_owned(),
                h["score"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn predict_score_and_neighbors_by_flag_and_by_file_on_memory_and_store_runs() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    for backend in ["memory", "file"] {
        let run = dir.path().join(format!("run-{backend}"));
        let backend_set = format!("storage.backend=\"{backend}\"");
        let args = train_args(
            &ds,
            &run,
            &[
                "model.dim=8",
                "training.num_epochs=1",
                "storage.num_partitions=3",
                "storage.buffer_capacity=2",
                &backend_set,
            ],
        );
        ok(&argv(&args));
        let run = s(&run);
        let all = json(
            ok(&[
                "predict",
                &run,
                "--head",
                "e1",
                "--relation",
                "r0",
                "--top",
                "100",
                "--json",
            ])
            .trim(),
        );
        let all = hits(&all);
        assert_eq!(all.len(), 60, "every entity, once");
        // Read from the checkpoint or store a piece at a time: the same answer.
        let streamed = json(
            ok(&[
                "predict",
                &run,
                "--head",
                "e1",
                "--relation",
                "r0",
                "--top",
                "100",
                "--json",
                "--streamed",
            ])
            .trim(),
        );
        assert_eq!(hits(&streamed), all);
        // The known tail e2 of (e1, r0) is left out by --filtered, and nothing else.
        let filtered = json(
            ok(&[
                "predict",
                &run,
                "--head",
                "e1",
                "--relation",
                "r0",
                "--top",
                "100",
                "--filtered",
                "--json",
            ])
            .trim(),
        );
        let without: Vec<_> = all.iter().filter(|h| h.0 != "e2").cloned().collect();
        assert_eq!(hits(&filtered), without);
        // A score is the score its entity got in the prediction.
        let triples = dir.path().join("triples.tsv");
        std::fs::write(&triples, format!("e1\tr0\t{}\n", all[7].0)).unwrap();
        let scored = json(ok(&["score", &run, &s(&triples), "--json"]).trim());
        assert_eq!(scored["score"].as_f64().unwrap(), all[7].1);
        // A file of queries answers each as the flags do, in order, one JSON line each.
        let queries = dir.path().join("q.tsv");
        std::fs::write(&queries, "# heads and tails\n?\tr1\te5\ne1\tr0\t?\n").unwrap();
        let out = ok(&[
            "predict",
            &run,
            "--queries",
            &s(&queries),
            "--top",
            "100",
            "--json",
        ]);
        let lines: Vec<serde_json::Value> = out.lines().map(json).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["tail"]["label"], "e5");
        assert_eq!(hits(&lines[1]), all);
        let near = json(ok(&["neighbors", &run, "--entity", "e3", "--top", "5", "--json"]).trim());
        let near = hits(&near);
        assert_eq!(near.len(), 5);
        assert!(near.iter().all(|h| h.0 != "e3"), "{near:?}");
        // Unknown names are named, with the line they are on.
        fails(
            &["predict", &run, "--head", "e99", "--relation", "r0"],
            "the query: unknown entity \"e99\"",
        );
        std::fs::write(&queries, "e1\tr0\t?\ne1\tr7\t?\n").unwrap();
        fails(
            &["predict", &run, "--queries", &s(&queries)],
            "q.tsv:2: unknown relation \"r7\"",
        );
    }
}

/// A run with reciprocal relations and early stopping: its export labels the inverse rows,
/// `eval --embeddings --reciprocal` of the export and `eval RUN/best` reproduce the run's final
/// figure, and `--reciprocal` with the wrong relation table is refused naming its shape. DistMult,
/// and RESCAL, whose relation rows export as dim² floats (8 × 8 matrices, row-major).
#[test]
fn reciprocal_runs_export_and_evaluate_through_their_best_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    for (decoder, width) in [("distmult", 8), ("rescal", 64)] {
        let run = dir.path().join(format!("run-{decoder}"));
        let decoder_set = format!("model.decoder={decoder}");
        let sets = [
            "model.dim=8",
            &decoder_set,
            "model.reciprocal_relations=true",
            "training.num_epochs=6",
            "evaluation.epochs_per_eval=2",
            "evaluation.patience=1",
        ];
        let last = train_result(&ds, &run, &sets);
        let best = last["best_epoch"]
            .as_u64()
            .expect("the final line names the best epoch");
        let best_dir = run.join("best");
        let eval = json(ok(&["eval", &s(&best_dir), "--json"]).trim());
        assert_eq!(eval["mrr"], last["metrics"]["mrr"], "{decoder}");
        // `eval RUN` ranks the same tables (what `train` printed), and says so; `--last` ranks
        // the last epoch's, saying that too.
        let eval = json(ok(&["eval", &s(&run), "--json"]).trim());
        assert_eq!(eval["mrr"], last["metrics"]["mrr"], "{decoder}");
        assert_eq!(eval["tables"]["kind"], "best", "{eval}");
        assert_eq!(eval["tables"]["epoch"], best, "{eval}");
        let text = ok(&["eval", &s(&run)]);
        assert!(
            text.contains(&format!("epoch {best} (the best validated, in ")),
            "{text}"
        );
        let at_last = json(ok(&["eval", &s(&run), "--last", "--json"]).trim());
        assert_eq!(at_last["tables"]["kind"], "last", "{at_last}");
        assert_eq!(at_last["tables"]["other_epoch"], best, "{at_last}");
        assert!(
            at_last["tables"]["epoch"].as_u64() >= Some(best),
            "{at_last}"
        );
        let export = dir.path().join(format!("export-{decoder}"));
        ok(&[
            "export",
            &s(&best_dir),
            "--format",
            "npy",
            "-o",
            &s(&export),
        ]);
        let labels = std::fs::read_to_string(export.join("relations.labels.txt")).unwrap();
        let labels: Vec<&str> = labels.lines().collect();
        assert_eq!(labels.len() % 2, 0);
        let half = labels.len() / 2;
        assert_eq!(format!("{}_inverse", labels[0]), labels[half]);
        let npy = std::fs::read(export.join("relations.npy")).unwrap();
        let header = String::from_utf8_lossy(&npy[..128]).into_owned();
        assert!(
            header.contains(&format!("'shape': ({}, {width})", labels.len())),
            "{decoder}: {header}"
        );
        let embeddings = |extra: &[&str]| {
            let mut a = vec![
                "eval",
                "--embeddings",
                export.to_str().unwrap(),
                "--dataset",
                ds.to_str().unwrap(),
                "--decoder",
                decoder,
            ];
            a.extend(extra);
            a.iter().map(|x| x.to_string()).collect::<Vec<_>>()
        };
        let again = json(ok(&argv(&embeddings(&["--reciprocal", "--json"]))).trim());
        assert_eq!(
            again["mrr"], last["metrics"]["mrr"],
            "{decoder} best epoch {best}"
        );
        fails(&argv(&embeddings(&[])), "relations.npy: shape");
    }
}

/// `import --extend --add` keeps every id and `train --init-from` seeds a run from the base's,
/// frozen or not; a mismatched model and a run being trained are refused, leaving nothing.
#[test]
fn a_day_of_edges_added_and_trained_from_the_base_run() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let base_run = dir.path().join("base-run");
    let sets = ["model.dim=8", "training.num_epochs=2"];
    ok(&argv(&train_args(&ds, &base_run, &sets)));
    let delta = dir.path().join("day2.tsv");
    std::fs::write(
        &delta,
        "e0\tr0\tnewcomer\nnewcomer\tr1\te5\ne7\tr2\tnewcomer\n",
    )
    .unwrap();
    let grown = dir.path().join("grown");
    let out = ok(&[
        "import",
        "-o",
        &s(&grown),
        "--extend",
        &s(&ds),
        "--add",
        &s(&delta),
        "--json",
    ]);
    let v = json(out.trim());
    assert_eq!(v["entities"], 61, "{v}");
    assert_eq!(v["extends"]["entities"], 60, "{v}");
    let labels = |d: &Path| std::fs::read_to_string(d.join("entities.tsv")).unwrap();
    assert!(labels(&grown).starts_with(&labels(&ds)));
    assert!(labels(&grown).ends_with("60\tnewcomer\n"));
    // --add needs --extend; --init-from cannot be a resume.
    fails(
        &[
            "import",
            "-o",
            &s(&dir.path().join("x")),
            "--add",
            &s(&delta),
        ],
        "--extend",
    );
    let seeded = dir.path().join("seeded");
    let mut args = train_args(&grown, &seeded, &sets);
    args.extend(["--init-from".into(), s(&base_run)]);
    args.extend(["--set".into(), "training.freeze=\"existing\"".into()]);
    ok(&argv(&args));
    let record = std::fs::read_to_string(seeded.join("run.toml")).unwrap();
    assert!(record.contains("[init_from]"), "{record}");
    // Another dimension is refused before the run exists.
    let refused = dir.path().join("refused");
    let mut args = train_args(&grown, &refused, &["model.dim=16"]);
    args.extend(["--init-from".into(), s(&base_run)]);
    fails(&argv(&args), "model.dim is 16");
    assert!(!refused.exists());
}
