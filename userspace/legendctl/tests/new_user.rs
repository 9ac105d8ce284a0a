//! What a new user hit (issue 16, item 9): sampled negatives beyond the graph's entities,
//! evaluation progress off a terminal, error messages that repeated their cause, `eval` on a
//! directory that is not a run, `device` without the module, and exports mixing formats.

// A test's notes go to the test harness's output: the binary's output rules (clippy.toml)
// are not for it.
#![allow(clippy::disallowed_macros)]

mod common;

use common::{fails, graph, json, legendctl, ok, s};

use std::path::Path;

/// Writes `rows × cols` float32 values as a NumPy 1.0 `.npy` file.
fn write_npy(path: &Path, rows: usize, cols: usize, value: impl Fn(usize, usize) -> f32) {
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for r in 0..rows {
        for c in 0..cols {
            bytes.extend_from_slice(&value(r, c).to_le_bytes());
        }
    }
    std::fs::write(path, bytes).unwrap();
}

/// The test graph in `dir/ds` and, in `dir/emb`, 4-dimensional entity embeddings for it with
/// `value(row, column)`.
fn graph_and_embeddings(
    dir: &Path,
    value: impl Fn(usize, usize) -> f32,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let ds = graph(dir);
    let emb = dir.join("emb");
    std::fs::create_dir(&emb).unwrap();
    write_npy(&emb.join("entities.npy"), 60, 4, value);
    (ds, emb)
}

/// Runs `legendctl args` and returns (success, stdout, stderr).
/// `legendctl eval` of Dot embeddings in `emb` on `dataset`.
fn eval_dot(emb: &Path, dataset: &Path) -> Vec<&'static str> {
    let (emb, dataset) = (s(emb).leak(), s(dataset).leak());
    vec![
        "eval",
        "--embeddings",
        emb,
        "--decoder",
        "dot",
        "--dataset",
        dataset,
    ]
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = legendctl(args);
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn sampled_negatives_are_capped_to_the_graph_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let (ds, emb) = graph_and_embeddings(dir.path(), |r, c| ((r * 7 + c * 3) % 11) as f32 - 5.0);
    let eval = |extra: &[&str]| {
        let mut args = eval_dot(&emb, &ds);
        args.extend_from_slice(&["--protocol", "sampled", "--json"]);
        args.extend_from_slice(extra);
        let (success, stdout, stderr) = run(&args);
        assert!(success, "{stderr}");
        assert_eq!(
            stdout.lines().count(),
            1,
            "stdout is one JSON line: {stdout:?}"
        );
        (json(stdout.trim()), stderr)
    };

    // The defaults, 1000 + 1000, on 60 entities: 30 + 30, and a warning naming the numbers.
    let (m, stderr) = eval(&[]);
    assert_eq!(m["uniform_negatives"], 30, "{m}");
    assert_eq!(m["degree_negatives"], 30, "{m}");
    assert_eq!(
        stderr
            .matches(
                "the graph has 60 entities, fewer than the 1000 uniform + 1000 degree negatives asked for: using 30 uniform + 30 degree"
            )
            .count(),
        1,
        "{stderr}"
    );
    // No rank can exceed 1 + the 60 negatives drawn.
    assert!(m["mean_rank"].as_f64().unwrap() <= 61.0, "{m}");

    // In proportion: 90 + 30 asked becomes 45 + 15.
    let (m, stderr) = eval(&["--uniform-negatives", "90", "--degree-negatives", "30"]);
    assert_eq!(
        (&m["uniform_negatives"], &m["degree_negatives"]),
        (&45.into(), &15.into())
    );
    assert!(stderr.contains("using 45 uniform + 15 degree"), "{stderr}");

    // Within the graph: used as asked, silently.
    let (m, stderr) = eval(&["--uniform-negatives", "20", "--degree-negatives", "10"]);
    assert_eq!(
        (&m["uniform_negatives"], &m["degree_negatives"]),
        (&20.into(), &10.into())
    );
    assert!(!stderr.contains("WARN"), "{stderr}");
}

#[test]
fn progress_stays_off_stdout_and_draws_no_bar_off_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let (ds, emb) = graph_and_embeddings(dir.path(), |r, c| (r + c) as f32 / 60.0);
    let mut args = vec!["--log", "info"];
    args.extend(eval_dot(&emb, &ds));
    args.push("--json");
    let (success, stdout, stderr) = run(&args);
    assert!(success, "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "{stdout:?}");
    assert_eq!(json(stdout.trim())["protocol"], "filtered");
    assert!(
        !stderr.contains('\r') && !stderr.contains("[="),
        "no progress bar when stderr is not a terminal: {stderr:?}"
    );
}

#[test]
fn a_missing_input_names_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.tsv");
    let (success, _, stderr) = run(&[
        "import",
        "--out",
        &s(&dir.path().join("ds")),
        "--train",
        &s(&missing),
    ]);
    assert!(!success);
    assert_eq!(
        stderr,
        format!(
            "error: {}: No such file or directory (os error 2)\n",
            missing.display()
        )
    );
    assert!(!dir.path().join("ds").exists());

    // A dataset that is not there, through `eval --embeddings --dataset`.
    let emb = dir.path().join("emb");
    std::fs::create_dir(&emb).unwrap();
    let (success, _, stderr) = run(&eval_dot(&emb, &dir.path().join("no-ds")));
    assert!(!success);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("no-ds"), "{stderr}");
    assert_eq!(
        stderr.matches("not a dataset directory").count(),
        1,
        "{stderr}"
    );
}

#[test]
fn eval_and_export_say_plainly_when_a_directory_is_not_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let expected = format!(
        "error: {} is not a training run directory (no run.toml)\n",
        empty.display()
    );
    let (success, _, stderr) = run(&["eval", &s(&empty)]);
    assert!(!success);
    assert_eq!(stderr, expected);
    let (success, _, stderr) = run(&["export", &s(&empty), "--format", "tsv"]);
    assert!(!success);
    assert_eq!(stderr, expected);
    assert!(
        !empty.join("export").exists(),
        "a refused export created its directory"
    );
    // A dataset given where a run belongs.
    fails(
        &["eval", &s(&ds)],
        "is not a training run directory (no run.toml): it is a dataset",
    );
    let missing = dir.path().join("missing");
    fails(
        &["eval", &s(&missing)],
        &format!(
            "{} does not exist (expected a training run directory, with run.toml)",
            missing.display()
        ),
    );
}

#[test]
fn device_commands_hint_at_modprobe_and_bind_without_the_module() {
    if Path::new("/sys/module/legend_nvme").exists() {
        eprintln!(
            "SKIPPED: the legend_nvme module is loaded here; the hint is for hosts without it"
        );
        return;
    }
    let hint = "`modprobe legend_nvme`, then `legendctl device bind BDF`";
    let (success, _, stderr) = run(&["device", "info", "/nonexistent/legend-nvme7"]);
    assert!(!success);
    assert_eq!(stderr.matches(hint).count(), 1, "{stderr}");
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );
    let (success, stdout, stderr) = run(&["device", "list", "--json"]);
    assert!(success, "{stderr}");
    assert!(
        json(stdout.trim()).is_array(),
        "the hint stays off stdout: {stdout:?}"
    );
    assert_eq!(stderr.matches(hint).count(), 1, "{stderr}");
    fails(
        &["device", "bind", "0000:00:00.0"],
        "the legend_nvme module is not loaded: `modprobe legend_nvme` first",
    );
}

#[test]
fn export_refuses_to_mix_formats_in_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ds = graph(dir.path());
    let run_dir = dir.path().join("run");
    ok(&[
        "train",
        "--dataset",
        &s(&ds),
        "--out",
        &s(&run_dir),
        "--set",
        "training.num_epochs=1",
        "--set",
        "model.dim=8",
    ]);
    let out = dir.path().join("out");
    let export = |format: &str| run(&["export", &s(&run_dir), "--format", format, "-o", &s(&out)]);
    assert!(export("npy").0);
    let listing = || {
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let npy_files = listing();
    assert!(
        npy_files.contains(&"entities.npy".to_string()),
        "{npy_files:?}"
    );

    let (success, _, stderr) = export("tsv");
    assert!(!success);
    assert_eq!(
        stderr,
        format!(
            "error: {} already holds an npy export ({}); refusing to mix a tsv export into it: choose another --out or remove those files\n",
            out.display(),
            npy_files.join(", ")
        )
    );
    assert_eq!(listing(), npy_files, "a refused export wrote files");
    let (success, _, stderr) = export("bin");
    assert!(
        !success && stderr.contains("holds an npy export"),
        "{stderr}"
    );
    // The same format again overwrites it.
    assert!(export("npy").0);
    assert_eq!(listing(), npy_files);

    // The other way round, and a directory of unrelated files.
    std::fs::remove_dir_all(&out).unwrap();
    assert!(export("tsv").0);
    let (success, _, stderr) = export("npy");
    assert!(!success);
    assert!(
        stderr.contains("already holds a tsv export (entities.tsv, relations.tsv)"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.md"), "mine").unwrap();
    fails(
        &["export", &s(&run_dir), "--format", "tsv", "-o", &s(&out)],
        "already holds files that are not a tsv export (notes.md)",
    );
}
