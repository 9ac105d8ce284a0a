//! Helpers shared by the end-to-end tests: run the built `legendctl` and check its outcome.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};

/// Path of the binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_legendctl")
}

/// Runs `legendctl args` with warnings-only logging.
pub fn legendctl(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .env("LEGEND_LOG", "warn")
        .output()
        .expect("running legendctl")
}

/// Runs `legendctl args`, asserts success and returns stdout.
pub fn ok(args: &[&str]) -> String {
    let out = legendctl(args);
    assert!(
        out.status.success(),
        "legendctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `legendctl args` and asserts that it fails with `needle` in its error output.
pub fn fails(args: &[&str], needle: &str) {
    let out = legendctl(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "legendctl {args:?} should fail");
    assert!(
        err.contains(needle),
        "legendctl {args:?}: {err:?} lacks {needle:?}"
    );
}

/// A path as a string argument.
pub fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Parses one line of JSON output.
pub fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

/// Imports into `dir/ds` a 60-entity, 3-relation graph with structure to learn (entity i
/// relates to (i + r + 1) mod 60 by relation r; a tenth held out as test and valid).
pub fn graph(dir: &Path) -> PathBuf {
    let n = 60;
    let mut train = String::new();
    let mut test = String::new();
    for i in 0..n {
        for r in 0..3 {
            let line = format!("e{i}\tr{r}\te{}\n", (i + r + 1) % n);
            if (i * 3 + r) % 10 == 0 {
                &mut test
            } else {
                &mut train
            }
            .push_str(&line);
        }
    }
    std::fs::write(dir.join("train.tsv"), train).unwrap();
    std::fs::write(dir.join("test.tsv"), &test).unwrap();
    std::fs::write(dir.join("valid.tsv"), &test).unwrap();
    let ds = dir.join("ds");
    let d = |f: &str| dir.join(f).display().to_string();
    ok(&[
        "import",
        "-o",
        &d("ds"),
        "--train",
        &d("train.tsv"),
        "--valid",
        &d("valid.tsv"),
        "--test",
        &d("test.tsv"),
    ]);
    ds
}

/// The arguments of `legendctl train --dataset ds --out out --set K=V...`.
pub fn train_args(ds: &Path, out: &Path, sets: &[&str]) -> Vec<String> {
    let mut args = vec![
        "train".into(),
        "--dataset".into(),
        s(ds),
        "--out".into(),
        s(out),
    ];
    for set in sets {
        args.extend(["--set".into(), set.to_string()]);
    }
    args
}

/// Borrows owned arguments for [`ok`], [`fails`] and [`legendctl`].
pub fn argv(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A temporary directory in memory (`/dev/shm`) where the machine has one: for a proxy's
/// backing file, when what is tested is the queues or a modelled SSD, not a disk's latency (a
/// disk shared with a build can hold one write past a command's timeout).
pub fn memory_tempdir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .unwrap()
}

/// Runs `legendctl` with the arguments `args()` gives (fresh ones each run) against three
/// readers of its output that go away, and asserts that it ends quietly each time (exit 0, no
/// panic): one that closed before the command started, for stdout alone and for stdout and
/// stderr together (`2>&1 | head`), and one that reads a line and closes (`| head -1`).
pub fn closed_pipe_runs(args: &mut dyn FnMut() -> Vec<String>) {
    let quiet = |args: &[String], reader: &str, status: ExitStatus, stderr: &[u8]| {
        let stderr = String::from_utf8_lossy(stderr);
        assert!(
            status.success() && !stderr.contains("panicked"),
            "legendctl {args:?} with {reader}: {status}, stderr {stderr:?}"
        );
    };
    let command = |args: &[String]| {
        let mut c = Command::new(bin());
        c.args(args).env("LEGEND_LOG", "info").stdin(Stdio::null());
        c
    };

    let a = args();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = command(&a).stdout(writer).output().unwrap();
    quiet(&a, "stdout's reader gone", out.status, &out.stderr);

    let a = args();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let status = command(&a)
        .stdout(writer.try_clone().unwrap())
        .stderr(writer)
        .status()
        .unwrap();
    quiet(&a, "stdout's and stderr's reader gone", status, b"");

    let a = args();
    let mut child = command(&a)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    stdout.read_line(&mut String::new()).unwrap();
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    quiet(&a, "a reader of one line", out.status, &out.stderr);
}
