//! What a newcomer's first hour met (issue 47): a TSV header imported as an edge, settings and
//! paths accepted silently or leaving folders behind, and query errors that did not point at
//! the way out.

mod common;

use std::path::Path;

use common::{argv, fails, graph, json, legendctl, ok, s, train_args};

/// Imports `train` (with the test graph's valid and test files) into `dir/NAME` with `extra`
/// arguments; returns the `--json` summary and stderr.
fn import(dir: &Path, name: &str, train: &str, extra: &[&str]) -> (serde_json::Value, String) {
    let path = dir.join(format!("{name}.tsv"));
    std::fs::write(&path, train).unwrap();
    let (out, valid, test) = (dir.join(name), dir.join("valid.tsv"), dir.join("test.tsv"));
    let mut args = vec![
        "import".to_string(),
        "-o".into(),
        s(&out),
        "--train".into(),
        s(&path),
        "--valid".into(),
        s(&valid),
        "--test".into(),
        s(&test),
        "--json".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let done = legendctl(&argv(&args));
    let stderr = String::from_utf8_lossy(&done.stderr).into_owned();
    assert!(done.status.success(), "{stderr}");
    (json(String::from_utf8_lossy(&done.stdout).trim()), stderr)
}

#[test]
fn a_header_line_is_skipped_or_named() {
    let dir = tempfile::tempdir().unwrap();
    graph(dir.path());
    let edges = std::fs::read_to_string(dir.path().join("train.tsv")).unwrap();

    // Column names: skipped, named, and listed.
    let (summary, stderr) = import(
        dir.path(),
        "named",
        &format!("head\trelation\ttail\n{edges}"),
        &[],
    );
    assert_eq!(summary["relations"], 3, "{summary}");
    assert!(
        stderr.contains("named.tsv:1") && stderr.contains("--header no"),
        "{stderr}"
    );
    let skipped = summary["skipped_headers"][0].as_str().unwrap();
    assert!(skipped.ends_with("named.tsv:1"), "{summary}");
    // `--header no` imports it as the edge it asks for.
    let (summary, _) = import(
        dir.path(),
        "kept",
        &format!("head\trelation\ttail\n{edges}"),
        &["--header", "no"],
    );
    assert_eq!(summary["relations"], 4, "{summary}");

    // Other names: imported, but named as unlike the rest; `--header yes` skips them.
    let odd = format!("From Node\tLink Kind\tTo Node\n{edges}");
    let (summary, stderr) = import(dir.path(), "odd", &odd, &[]);
    assert_eq!(summary["relations"], 4, "{summary}");
    assert!(
        stderr.contains("odd.tsv:1") && stderr.contains("--header yes"),
        "{stderr}"
    );
    let (summary, stderr) = import(dir.path(), "odd-skipped", &odd, &["--header", "yes"]);
    assert_eq!(summary["relations"], 3, "{summary}");
    assert!(!stderr.contains("unlike"), "{stderr}");

    // An ordinary first edge draws no warning.
    let (summary, stderr) = import(dir.path(), "plain", &edges, &[]);
    assert_eq!(summary["relations"], 3, "{summary}");
    assert!(!stderr.contains("WARN"), "{stderr}");
}

#[test]
fn refused_commands_create_no_folders() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let out = dir.path().join("a/b/run");
    fails(
        &argv(&train_args(&dir.path().join("nope"), &out, &[])),
        "nope",
    );
    assert!(
        !dir.path().join("a").exists(),
        "a missing dataset made --out's folders"
    );
    // A buffer larger than the partitions is refused naming both keys, leaving nothing.
    fails(
        &argv(&train_args(&ds, &out, &["storage.buffer_capacity=20"])),
        "storage.buffer_capacity: 20 is more than storage.num_partitions = 1",
    );
    assert!(!dir.path().join("a").exists());
    fails(
        &["export", &s(&ds), "--format", "npy", "-o", &s(&out)],
        "is not a training run directory",
    );
    assert!(
        !dir.path().join("a").exists(),
        "a refused export made -o's folders"
    );
}

#[test]
fn query_errors_point_at_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let run = dir.path().join("run");
    ok(&argv(&train_args(
        &ds,
        &run,
        &["model.dim=8", "training.num_epochs=1"],
    )));
    let run = s(&run);
    // Without --head, the other ways to ask are named too.
    fails(&["predict", &run, "--relation", "r0"], "--tail <TAIL>");
    fails(
        &["predict", &run, "--head", "E0", "--relation", "r0"],
        "did you mean \"e0\"?",
    );
    fails(
        &["predict", &run, "--head", "e0", "--relation", "R1"],
        "did you mean \"r1\"?",
    );
    fails(
        &[
            "predict",
            &run,
            "--head",
            "e0",
            "--relation",
            "r0",
            "--top",
            "0",
        ],
        "top 0: ask for 1 to 60 entities",
    );
}
