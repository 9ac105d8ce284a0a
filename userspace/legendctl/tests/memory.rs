//! Host memory of whole runs (issue 17): the peak resident set of `legendctl train` on a
//! generated graph stays within the edges and host-resident tables (× 1.1, + 2 GiB) and within
//! the session's own estimate, for the memory and file backends, partitioned or not, and when
//! resuming; and a run that cannot fit is refused before anything is written.

// A test's notes go to the test harness's output: the binary's output rules (clippy.toml)
// are not for it.
#![allow(clippy::disallowed_macros)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{argv, bin, s, train_args};
use legend_dataset::{Dataset, Split};
use legend_engine::config::Config;
use legend_engine::footprint::HostEstimate;

const DIM: u64 = 64;

/// Runs `legendctl args` to its end and returns its peak resident set in bytes.
#[expect(
    clippy::zombie_processes,
    reason = "wait4 reaps the child, with its rusage"
)]
fn peak_rss_of(args: &[&str]) -> u64 {
    let child = Command::new(bin())
        .args(args)
        .env("LEGEND_LOG", "warn")
        .spawn()
        .expect("running legendctl");
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, writing into the two locals above.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "legendctl {args:?} failed: status {status}"
    );
    usage.ru_maxrss as u64 * 1024
}

#[test]
fn peak_memory_stays_within_edges_and_resident_tables() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("g");
    common::ok(&[
        "generate",
        "--nodes",
        "300000",
        "--edges",
        "3000000",
        "--split",
        "0.998,0.001,0.001",
        &s(&ds),
    ]);
    let meta = Dataset::open(&ds).unwrap().meta().clone();
    let edge_bytes = meta.splits.get(Split::Train) * 12;
    let table_bytes = meta.entities * DIM * 8;
    let base = [
        "model.decoder=dot",
        "model.dim=64",
        "training.num_epochs=1",
        "training.negatives.negatives_per_positive=10",
        "evaluation.protocol=sampled",
    ];
    let cases: [(&str, &[&str], u64); 3] = [
        (
            "memory, one partition",
            &["storage.num_partitions=1"],
            table_bytes,
        ),
        (
            "memory, 4 partitions, 2 resident",
            &["storage.num_partitions=4", "storage.buffer_capacity=2"],
            table_bytes,
        ),
        (
            "file, 4 partitions, 2 resident",
            &[
                "storage.backend=file",
                "storage.num_partitions=4",
                "storage.buffer_capacity=2",
            ],
            table_bytes / 2,
        ),
    ];
    for (i, (what, sets, resident_tables)) in cases.into_iter().enumerate() {
        let out = dir.path().join(format!("run{i}"));
        let sets: Vec<String> = base.iter().chain(sets).map(|s| s.to_string()).collect();
        let set_refs: Vec<&str> = sets.iter().map(String::as_str).collect();
        let peak = peak_rss_of(&argv(&train_args(&ds, &out, &set_refs)));
        let bound = ((edge_bytes + resident_tables) as f64 * 1.1) as u64 + (2 << 30);
        let estimate = HostEstimate::of(&Config::parse("", &sets).unwrap(), &meta, false).total();
        eprintln!(
            "{what}: peak {:.0} MiB, estimate {:.0} MiB, bound {:.0} MiB",
            peak as f64 / 1048576.0,
            estimate as f64 / 1048576.0,
            bound as f64 / 1048576.0
        );
        assert!(peak <= bound, "{what}: peak {peak} over the bound {bound}");
        assert!(
            peak <= estimate,
            "{what}: peak {peak} over the session's estimate {estimate}: the refusal would let an OOM through"
        );
        // Resuming reads the checkpoint back: still one copy of the tables.
        let mut resume = vec!["train", "--resume", "--out"];
        let out_s = s(&out);
        resume.push(&out_s);
        resume.extend(["--set", "training.num_epochs=2"]);
        let peak = peak_rss_of(&resume);
        assert!(peak <= bound, "{what}, resumed: peak {peak} over {bound}");
        assert!(
            peak <= estimate,
            "{what}, resumed: peak {peak} over {estimate}"
        );
    }
}

#[test]
fn a_run_that_cannot_fit_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let ds = common::graph(dir.path());
    let out = dir.path().join("run");
    // 60 entities at d = 2^28: 120 GiB of tables, beyond this machine's RAM.
    let out_s = s(&out);
    let ds_s = s(&ds);
    let args = [
        "train",
        "--dataset",
        &ds_s,
        "--out",
        &out_s,
        "--set",
        "model.dim=268435456",
        "--set",
        "model.decoder=dot",
    ];
    let result = common::legendctl(&args);
    let err = String::from_utf8_lossy(&result.stderr);
    assert!(!result.status.success());
    assert!(
        err.contains("of host memory") && err.contains("is available"),
        "{err}"
    );
    // Every evaluation gathers the 60 GiB of embeddings: on a machine that cannot hold them
    // the refusal says no setting fits; on a larger one it names the settings that do.
    assert!(
        err.contains("no setting of")
            || err.contains(
                "is available: set storage.backend = \"file\", storage.num_partitions = "
            ),
        "{err}"
    );
    assert!(
        !Path::new(&out).exists(),
        "a refused run left {}",
        out.display()
    );
}
