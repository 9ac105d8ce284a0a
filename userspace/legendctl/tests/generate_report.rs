//! End-to-end tests of `legendctl generate` and `legendctl report`.

mod common;

use common::{fails, ok, s};

use std::path::Path;

use legend_dataset::{Dataset, Split};

#[test]
fn generate_writes_a_reproducible_dataset_and_refuses_bad_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let args = |out: &Path| {
        [
            "generate",
            "--nodes",
            "2000",
            "--edges",
            "30000",
            "--relations",
            "5",
            "--skew",
            "1.1",
            "--seed",
            "7",
            "--split",
            "0.8,0.1,0.1",
            "--json",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain([s(out)])
        .collect::<Vec<_>>()
    };
    let summary: serde_json::Value =
        serde_json::from_str(ok(&args(&a).iter().map(String::as_str).collect::<Vec<_>>()).trim())
            .unwrap();
    assert_eq!(
        (&summary["train"], &summary["valid"], &summary["test"]),
        (&24_000.into(), &3_000.into(), &3_000.into())
    );
    ok(&args(&b).iter().map(String::as_str).collect::<Vec<_>>());
    let ds = Dataset::open(&a).unwrap();
    assert_eq!((ds.meta().entities, ds.meta().relations), (2000, 5));
    assert_eq!(
        ds.meta().identity(),
        Dataset::open(&b).unwrap().meta().identity()
    );
    assert_eq!(ds.edges(Split::Test).unwrap().len(), 3_000);
    for file in ["edges/train.bin", "edges/valid.bin", "entities.tsv"] {
        assert_eq!(
            std::fs::read(a.join(file)).unwrap(),
            std::fs::read(b.join(file)).unwrap(),
            "{file}"
        );
    }

    let bad = dir.path().join("bad");
    let base = ["generate", "--edges", "10"];
    let with = |extra: &[&str]| {
        let mut v: Vec<String> = base.iter().chain(extra).map(|x| x.to_string()).collect();
        v.push(s(&bad));
        v
    };
    for (extra, needle) in [
        (&["--nodes", "0"][..], "--nodes must be at least 1"),
        (&["--nodes", "1"], "at least 2 nodes"),
        (&["--nodes", "9", "--split", "0.9,0.1"], "three fractions"),
        (&["--nodes", "9", "--split", "0.9,0.1,0.1"], "summing to 1"),
        (&["--nodes", "9", "--skew=-2"], "--skew"),
    ] {
        let v = with(extra);
        fails(&v.iter().map(String::as_str).collect::<Vec<_>>(), needle);
    }
    fails(
        &args(&a).iter().map(String::as_str).collect::<Vec<_>>(),
        "already exists",
    );
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["a", "b"], "failed runs left files behind");
}

/// A swap record of metrics.jsonl.
fn swap(i: u32, start: f64, wait: f64) -> serde_json::Value {
    serde_json::json!({
        "evicted": i, "loaded": i + 3, "start_s": start, "io_s": 0.3,
        "overlap_compute_s": 0.25, "wait_s": wait, "after_compute_s": 0.2, "bytes": 1 << 20
    })
}

/// An epoch record of metrics.jsonl with `swaps` swaps.
fn epoch(epoch: u32, swaps: u32) -> String {
    let list: Vec<_> = (0..swaps)
        .map(|i| {
            swap(
                i,
                0.1 + 0.5 * f64::from(i),
                if i % 2 == 0 { 0.05 } else { 0.0 },
            )
        })
        .collect();
    serde_json::json!({
        "epoch": epoch, "loss": 0.5, "edges": 1000, "seconds": 0.1 + 0.5 * f64::from(swaps),
        "edges_per_sec": 1e4, "negatives_per_positive": 16, "partitions_read": swaps,
        "partitions_written": swaps, "bytes_read": 1 << 20, "bytes_written": 1 << 20,
        "io_s": 0.3 * f64::from(swaps) + 0.05, "io_wait_s": 0.1, "buffer_states": swaps + 1,
        "swaps": list
    })
    .to_string()
}

/// Checks that every element is closed in order: enough XML to catch a broken hand-written SVG.
fn assert_balanced(xml: &str) {
    let mut stack = Vec::new();
    let mut rest = xml;
    while let Some(open) = rest.find('<') {
        let close = rest[open..].find('>').expect("unclosed tag") + open;
        let tag = &rest[open + 1..close];
        rest = &rest[close + 1..];
        if tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(stack.pop(), Some(name.to_owned()), "mismatched </{name}>");
        } else if !tag.ends_with('/') {
            stack.push(tag.split_whitespace().next().unwrap().to_owned());
        }
    }
    assert!(stack.is_empty(), "unclosed elements {stack:?}");
}

fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

#[test]
fn report_draws_one_rect_per_swap_and_lane() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run & co");
    std::fs::create_dir(&run).unwrap();
    let metrics = format!(
        "{}\n{}\n{{\"final\":true,\"split\":\"test\",\"metrics\":{{\"mrr\":0.5}}}}\n",
        epoch(1, 5),
        epoch(2, 3)
    );
    std::fs::write(run.join("metrics.jsonl"), metrics).unwrap();

    let out = ok(&["report", &s(&run)]);
    assert!(
        out.contains("epoch 2:") && out.contains("% of I/O hidden"),
        "{out}"
    );
    let svg = std::fs::read_to_string(run.join("report.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
    assert_balanced(&svg);
    for class in ["io", "overlap", "wait", "after"] {
        assert_eq!(
            count(&svg, &format!("<rect class=\"{class}\"")),
            3,
            "{class}"
        );
    }
    assert!(svg.contains("run &amp; co"), "the title is escaped");

    let html = dir.path().join("one.html");
    ok(&["report", &s(&run), "--epoch", "1", "-o", &s(&html)]);
    let html = std::fs::read_to_string(html).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert_balanced(&html[html.find("<svg").unwrap()..html.find("</body>").unwrap()]);
    assert_eq!(count(&html, "<rect class=\"io\""), 5);
    fails(
        &["report", &s(&run), "--epoch", "9"],
        "no epoch 9 (recorded: 1, 2)",
    );
    fails(
        &["report", &s(&run), "-o", &s(&dir.path().join("x.png"))],
        ".svg or .html",
    );
}

#[test]
fn report_charts_loss_and_rate_per_epoch_for_a_run_without_swaps() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    // An in-memory run: no swaps, no I/O; epoch 2 was repeated by a resume (its last counts).
    let lines: Vec<String> = [(1, 0.9, 1e4), (2, 0.7, 2e4), (2, 0.6, 3e4), (3, 0.5, 4e4)]
        .iter()
        .map(|&(k, loss, rate)| {
            let mut e: serde_json::Value = serde_json::from_str(&epoch(k, 0)).unwrap();
            e["loss"] = loss.into();
            e["edges_per_sec"] = rate.into();
            e.to_string()
        })
        .collect();
    std::fs::write(run.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    ok(&["report", &s(&run)]);
    let svg = std::fs::read_to_string(run.join("report.svg")).unwrap();
    assert_balanced(&svg);
    for class in ["loss", "rate"] {
        let at = svg
            .find(&format!("<polyline class=\"line {class}\" points=\""))
            .unwrap_or_else(|| panic!("no {class} chart"));
        let points = svg[at..].split('"').nth(3).unwrap();
        assert_eq!(points.split(' ').count(), 3, "{class}: {points}");
    }
    for title in [
        "<title>epoch 2: 0.6000</title>",
        "<title>epoch 3: 0.5000</title>",
        "<title>epoch 2: 30000</title>",
    ] {
        assert!(svg.contains(title), "{title}");
    }
    assert!(
        !svg.contains("<title>epoch 2: 0.7000</title>"),
        "the repeated epoch's first record"
    );
}

#[test]
fn gpu_initiated_swaps_get_a_lane_of_io_kernel_launches() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let mut e: serde_json::Value = serde_json::from_str(&epoch(1, 3)).unwrap();
    for (i, sw) in e["swaps"].as_array_mut().unwrap().iter_mut().enumerate() {
        let start = sw["start_s"].as_f64().unwrap();
        sw["io_kernels"] = serde_json::json!([
            {"op": "write", "partition": i, "start_s": start + 0.01, "seconds": 0.1,
             "commands": 64, "bytes": 64 << 20},
            {"op": "read", "partition": i + 3, "start_s": start + 0.12, "seconds": 0.1,
             "commands": 64, "bytes": 64 << 20}
        ]);
    }
    std::fs::write(run.join("metrics.jsonl"), format!("{e}\n")).unwrap();
    ok(&["report", &s(&run)]);
    let svg = std::fs::read_to_string(run.join("report.svg")).unwrap();
    assert_balanced(&svg);
    assert!(svg.contains(">I/O kernels</text>"), "the lane is labelled");
    assert_eq!(count(&svg, "<rect class=\"kwrite\""), 3);
    assert_eq!(count(&svg, "<rect class=\"kread\""), 3);
    assert!(
        svg.contains("I/O kernels: read p5, 64 commands"),
        "hover text"
    );
    // Without launches (the file backend, the CPU engine) there is no such lane.
    std::fs::write(run.join("metrics.jsonl"), format!("{}\n", epoch(1, 3))).unwrap();
    ok(&["report", &s(&run)]);
    let svg = std::fs::read_to_string(run.join("report.svg")).unwrap();
    assert!(!svg.contains("I/O kernels"));
    // A launch with a negative time is refused like any other bad time.
    e["swaps"][0]["io_kernels"][0]["seconds"] = serde_json::json!(-1.0);
    std::fs::write(run.join("metrics.jsonl"), format!("{e}\n")).unwrap();
    fails(&["report", &s(&run)], "not a non-negative number");
}

#[test]
fn report_errors_name_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let file = run.join("metrics.jsonl");
    let path = s(&file);
    fails(&["report", &s(&run)], &path);
    std::fs::create_dir(&run).unwrap();
    std::fs::write(&file, "").unwrap();
    fails(&["report", &s(&run)], &format!("{path}: no epoch records"));
    std::fs::write(&file, format!("{}\n{{\"epoch\": 2, \"loss\n", epoch(1, 2))).unwrap();
    fails(&["report", &s(&run)], &format!("{path}:2: not JSON"));
    std::fs::write(&file, "\n{\"epoch\": 1, \"seconds\": 3}\n").unwrap();
    fails(
        &["report", &s(&run)],
        &format!("{path}:2: not an epoch record"),
    );
    let negative = epoch(1, 2).replace("\"wait_s\":0.05", "\"wait_s\":-1.0");
    std::fs::write(&file, negative).unwrap();
    fails(
        &["report", &s(&run)],
        &format!("{path}:1: epoch 1: time -1"),
    );
}

/// A generated graph of 400 nodes and 4,000 edges trained one epoch (d = 8, B = 256) with
/// `extra` arguments: the run's directory (in `dir`) and `train --json`'s output.
fn trained_tiny(dir: &Path, extra: &[&str]) -> (std::path::PathBuf, String) {
    let ds = dir.join("ds");
    let run = dir.join("run");
    ok(&[
        "generate",
        "--nodes",
        "400",
        "--edges",
        "4000",
        "--relations",
        "3",
        "--seed",
        "3",
        &s(&ds),
    ]);
    let mut args = vec![
        "train".to_owned(),
        "--dataset".into(),
        s(&ds),
        "--out".into(),
        s(&run),
        "--json".into(),
    ];
    for set in [
        "model.dim=8",
        "training.num_epochs=1",
        "training.batch_size=256",
    ] {
        args.extend(["--set".to_owned(), set.to_owned()]);
    }
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let out = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    (run, out)
}

/// generate → train with fewer buffer slots than partitions → report on the real metrics.
#[test]
fn report_on_a_trained_generated_graph() {
    let dir = tempfile::tempdir().unwrap();
    let (run, out) = trained_tiny(
        dir.path(),
        &[
            "--set",
            "storage.num_partitions=6",
            "--set",
            "storage.buffer_capacity=3",
        ],
    );
    let first: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    let swaps = first["swaps"].as_array().unwrap().len();
    assert!(swaps > 1, "C < N swaps partitions: {first}");
    ok(&["report", &s(&run)]);
    let svg = std::fs::read_to_string(run.join("report.svg")).unwrap();
    assert_balanced(&svg);
    assert_eq!(count(&svg, "<rect class=\"io\""), swaps);
}

#[test]
fn report_draws_a_lane_a_worker_with_each_round() {
    let dir = tempfile::tempdir().unwrap();
    let (run, _) = trained_tiny(
        dir.path(),
        &["--gpus", "2", "--set", "training.device=\"cpu\""],
    );
    let out = ok(&["report", &s(&run)]);
    assert!(out.contains("2 workers: parallel efficiency"), "{out}");
    let svg = std::fs::read_to_string(run.join("report.svg")).unwrap();
    assert_balanced(&svg);
    assert!(svg.contains("2 GPUs per round"), "the K-GPU title");
    // N = 4 on 2 workers: 3 rounds, each drawing every worker's hand-over, training and wait.
    for class in ["handover", "after", "wait"] {
        assert_eq!(
            count(&svg, &format!("<rect class=\"{class}\"")),
            6,
            "{class}"
        );
    }
    assert_eq!(count(&svg, "<title>round 3, "), 2, "round 3 on both lanes");
    assert!(
        svg.contains(">0: cpu<") && svg.contains(">1: cpu<"),
        "lanes named by device"
    );
}
