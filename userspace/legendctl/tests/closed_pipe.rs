//! Every local subcommand's output ends quietly when its reader goes away (`legendctl plan |
//! head -1`): exit status 0, no panic, nothing left half-done. Three readers: one that closed
//! before the command wrote anything (stdout alone, then stdout and stderr both, as `2>&1 |
//! head`), and one that reads a line and closes. The daemon's client commands are checked the
//! same way in daemon_client.rs, which starts a legendd.

mod common;

use std::path::Path;

use common::{argv, closed_pipe_runs, graph, ok, s, train_args};

/// `legendctl ARGS` for every subcommand that prints, on a trained run of the test graph; each
/// list is run afresh against each reader (`{fresh}` is replaced by a new path each time).
fn commands(dir: &Path) -> Vec<Vec<String>> {
    let ds = graph(dir);
    let run = dir.join("run");
    ok(&argv(&train_args(
        &ds,
        &run,
        &[
            "model.dim=8",
            "training.num_epochs=2",
            "evaluation.epochs_per_eval=1",
        ],
    )));
    assert!(run.join("best/run.toml").is_file());
    let triples = dir.join("triples.tsv");
    std::fs::write(&triples, "e0\tr0\te1\ne1\tr1\te3\n").unwrap();
    // A target for the I/O and row-cache benchmarks (file backend, CPU submitters).
    let target = dir.join("bench.bin");
    std::fs::write(&target, vec![0u8; 4 << 20]).unwrap();
    let target = s(&target);
    let tsv = |name: &str| s(&dir.join(name));
    let (ds, run) = (s(&ds), s(&run));
    let lines: &[&[&str]] = &[
        &["--help"],
        &["--version"],
        &["help", "train"],
        &[
            "import",
            "-o",
            "{fresh}",
            "--train",
            &tsv("train.tsv"),
            "--valid",
            &tsv("valid.tsv"),
        ],
        &["partition", &ds, "--partitions", "2"],
        &["plan", "--partitions", "6", "--buffer", "3"],
        &["plan", "--partitions", "6", "--buffer", "3", "--json"],
        &["generate", "--nodes", "100", "--edges", "1000", "{fresh}"],
        &[
            "train",
            "--dataset",
            &ds,
            "--out",
            "{fresh}",
            "--set",
            "model.dim=8",
        ],
        &[
            "train",
            "--dataset",
            &ds,
            "--out",
            "{fresh}",
            "--set",
            "training.num_epochs=3",
            "--set",
            "evaluation.epochs_per_eval=1",
            "--json",
        ],
        &["eval", &run],
        &["eval", &run, "--last", "--json"],
        &["export", &run, "--format", "tsv", "-o", "{fresh}"],
        &[
            "predict",
            &run,
            "--head",
            "e0",
            "--relation",
            "r0",
            "--top",
            "20",
        ],
        &[
            "predict",
            &run,
            "--tail",
            "e0",
            "--relation",
            "r0",
            "--top",
            "20",
            "--json",
        ],
        &["score", &run, &s(&triples)],
        &["neighbors", &run, "--entity", "e0", "--top", "20", "--json"],
        &["report", &run, "-o", "{fresh}.svg"],
        &["device", "list"],
        &["bench", "io", "--path", &target, "--seconds", "0.2"],
        &[
            "bench",
            "cache",
            "--mode",
            "pread",
            "--path",
            &target,
            "--row-bytes",
            "400",
            "--batch",
            "100",
            "--batches",
            "2",
        ],
    ];
    lines
        .iter()
        .map(|l| l.iter().map(|a| a.to_string()).collect())
        .collect()
}

#[test]
fn every_command_ends_quietly_when_its_reader_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let commands = commands(dir.path());
    let mut fresh = 0;
    for args in &commands {
        closed_pipe_runs(&mut || {
            fresh += 1;
            let path = s(&dir.path().join(format!("out-{fresh}")));
            args.iter().map(|a| a.replace("{fresh}", &path)).collect()
        });
    }
}
