//! Helpers shared by the end-to-end tests: run the built `legendctl` and check its outcome.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::path::Path;
use std::process::{Command, Output};

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
