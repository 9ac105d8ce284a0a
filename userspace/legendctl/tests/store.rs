//! The `file` and `proxy` backends end to end: equality with the in-memory run, swap counts,
//! crash safety under SIGKILL, refusals, and peak memory.

// A test's notes go to the test harness's output: the binary's output rules (clippy.toml)
// are not for it.
#![allow(clippy::disallowed_macros)]

mod common;

use common::{argv, bin, legendctl as run, memory_tempdir, ok, s};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A knowledge graph of `n` entities written as TSV and imported (no valid/test split when
/// `eval` is false, so that training skips the final ranking).
fn graph(dir: &Path, n: usize, edges_per_node: usize, eval: bool) -> PathBuf {
    let mut train = String::with_capacity(n * edges_per_node * 16);
    let mut held = String::new();
    for i in 0..n {
        for k in 0..edges_per_node {
            let j = (i * 7919 + k * 104_729 + 1) % n;
            let line = format!("{i}\tr{}\t{j}\n", k % 5);
            if eval && (i + k) % 20 == 0 {
                &mut held
            } else {
                &mut train
            }
            .push_str(&line);
        }
    }
    std::fs::write(dir.join("train.tsv"), train).unwrap();
    let ds = dir.join("ds");
    let mut args = vec![
        "import".to_string(),
        "-o".into(),
        s(&ds),
        "--train".into(),
        s(&dir.join("train.tsv")),
    ];
    if eval {
        std::fs::write(dir.join("test.tsv"), held).unwrap();
        args.extend([
            "--test".into(),
            s(&dir.join("test.tsv")),
            "--keep-unseen".into(),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&args);
    ds
}

const SMALL: [&str; 12] = [
    "--set",
    "model.dim=16",
    "--set",
    "storage.num_partitions=6",
    "--set",
    "storage.buffer_capacity=3",
    "--set",
    "training.threads=1",
    "--set",
    "training.batch_size=64",
    "--set",
    "training.checkpoint_every=1",
];

fn train_args<'a>(ds: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["train", "--dataset", ds, "--out", out];
    a.extend(SMALL);
    a.extend(extra);
    a
}

/// The four tables of a run, via export.
fn tables(run_dir: &Path) -> Vec<u8> {
    let out = run_dir.with_extension("export");
    let _ = std::fs::remove_dir_all(&out);
    ok(&["export", &s(run_dir), "--format", "bin", "-o", &s(&out)]);
    ["entities.bin", "relations.bin"]
        .iter()
        .flat_map(|f| std::fs::read(out.join(f)).unwrap())
        .collect()
}

#[test]
fn file_and_proxy_backends_equal_memory_and_swaps_follow_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let ds = s(&graph(dir.path(), 600, 6, true));
    let mem = dir.path().join("mem");
    let file = dir.path().join("file");
    let proxy = dir.path().join("proxy");
    let a = ok(&train_args(
        &ds,
        &s(&mem),
        &["--set", "training.num_epochs=3", "--json"],
    ));
    let b = ok(&train_args(
        &ds,
        &s(&file),
        &[
            "--set",
            "training.num_epochs=3",
            "--set",
            "storage.backend=file",
            "--json",
        ],
    ));
    // The proxy: the same store through NVMe queues of the userspace controller, its backing
    // file starting 1 MiB in (storage.start_lba), in memory (the queues are tested here).
    let backing = memory_tempdir();
    let c = ok(&train_args(
        &ds,
        &s(&proxy),
        &[
            "--set",
            "training.num_epochs=3",
            "--set",
            "storage.backend=proxy",
            "--set",
            "storage.start_lba=2048",
            "--set",
            &format!("storage.path=\"{}\"", s(&backing.path().join("store.bin"))),
            "--json",
        ],
    ));
    let want = tables(&mem);
    assert!(
        want == tables(&file),
        "file backend differs from the in-memory run"
    );
    assert!(
        want == tables(&proxy),
        "proxy backend differs from the in-memory run"
    );
    let meta = std::fs::read_to_string(proxy.join("run.toml")).unwrap();
    assert!(
        meta.contains("backend = \"proxy\"") && meta.contains("start_lba = 2048"),
        "{meta}"
    );
    let plan: serde_json::Value =
        serde_json::from_str(ok(&["plan", "-n", "6", "-c", "3", "--json"]).trim()).unwrap();
    for out in [&a, &b, &c] {
        let epoch1: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
        assert_eq!(
            epoch1["buffer_states"], plan["io_count"],
            "measured buffer states = planned io_count"
        );
        assert_eq!(
            epoch1["swaps"].as_array().unwrap().len() + 1,
            plan["io_count"].as_u64().unwrap() as usize
        );
    }
    // Epoch 1 reads nothing (every partition starts initialised in memory); later epochs read
    // what earlier ones wrote.
    let last: serde_json::Value = serde_json::from_str(b.lines().nth(2).unwrap()).unwrap();
    assert!(
        last["bytes_read"].as_u64().unwrap() > 0 && last["bytes_written"].as_u64().unwrap() > 0
    );
}

/// Bytes the one epoch of a `file`-backend run of `sets` into `out` wrote to its store.
fn bytes_written_in_one_file_epoch(ds: &str, out: &Path, sets: &[&str]) -> u64 {
    let mut args = vec![
        "--set",
        "storage.backend=file",
        "--set",
        "training.num_epochs=1",
    ];
    args.extend(sets);
    args.push("--json");
    let printed = ok(&train_args(ds, &s(out), &args));
    let epoch: serde_json::Value = serde_json::from_str(printed.lines().next().unwrap()).unwrap();
    epoch["bytes_written"].as_u64().unwrap()
}

/// Runs `extra` for 2 epochs on the memory, file and proxy backends (runs `DIR/NAME-BACKEND`),
/// checks each run's record holds `record`, resumes each for a third epoch, and returns the
/// three runs' tables.
fn resumed_on_every_backend(
    ds: &str,
    dir: &Path,
    name: &str,
    extra: &[&str],
    record: &str,
) -> Vec<Vec<u8>> {
    let backing = memory_tempdir();
    let proxy_path = format!("storage.path=\"{}\"", s(&backing.path().join("store.bin")));
    let backends: [(&str, &[&str]); 3] = [
        ("memory", &["--set", "storage.backend=memory"]),
        ("file", &["--set", "storage.backend=file"]),
        (
            "proxy",
            &["--set", "storage.backend=proxy", "--set", &proxy_path],
        ),
    ];
    let mut all = Vec::new();
    for (backend, sets) in backends {
        let out = dir.join(format!("{name}-{backend}"));
        let mut args = extra.to_vec();
        args.extend(["--set", "training.num_epochs=2"]);
        args.extend(sets);
        ok(&train_args(ds, &s(&out), &args));
        let meta = std::fs::read_to_string(out.join("run.toml")).unwrap();
        assert!(meta.contains(record), "{meta}");
        ok(&[
            "train",
            "--out",
            &s(&out),
            "--resume",
            "--set",
            "training.num_epochs=3",
        ]);
        all.push(tables(&out));
    }
    all
}

/// Row-wise AdaGrad state (one accumulator a row) trains the same on every backend, resumes
/// to the uninterrupted run's tables, stores 4 bytes of state a row, and a resume cannot
/// change the layout under a checkpoint.
#[test]
fn row_wise_state_is_the_same_on_every_backend_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let ds = s(&graph(dir.path(), 600, 6, false));
    let all = resumed_on_every_backend(
        &ds,
        dir.path(),
        "row",
        &["--set", "optimizer.state=row"],
        "entity_state_width = 1",
    );
    let straight = dir.path().join("straight");
    ok(&train_args(
        &ds,
        &s(&straight),
        &[
            "--set",
            "optimizer.state=row",
            "--set",
            "training.num_epochs=3",
        ],
    ));
    let want = tables(&straight);
    for (i, t) in all.iter().enumerate() {
        assert!(
            *t == want,
            "backend {i}: row-wise run differs from the uninterrupted one"
        );
    }
    let element = dir.path().join("element");
    ok(&train_args(
        &ds,
        &s(&element),
        &["--set", "training.num_epochs=3"],
    ));
    assert!(tables(&element) != want, "the state layout changed nothing");
    // A swap writes 16 + 1 floats a row instead of 16 + 16.
    let written = |state: &str, name: &str| {
        bytes_written_in_one_file_epoch(&ds, &dir.path().join(name), &["--set", state])
    };
    let (row, element) = (
        written("optimizer.state=row", "row_file"),
        written("optimizer.state=element", "element_file"),
    );
    assert!(row > 0 && row * 32 == element * 17, "{row} vs {element}");
    let r = run(&[
        "train",
        "--out",
        &s(&dir.path().join("row-file")),
        "--resume",
        "--set",
        "optimizer.state=element",
        "--set",
        "training.num_epochs=4",
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        !r.status.success(),
        "changing the state layout on resume was accepted"
    );
    assert!(
        err.contains("optimizer.state = element but the run's state is row-wise"),
        "{err}"
    );
}

/// 16-bit rows (`storage.dtype`): the same tables on every backend and thread count, a
/// resume repeats the uninterrupted run bit for bit, every exported value is a bf16, a swap
/// writes 2 bytes an element, and neither the format nor an f16 overflow passes silently.
#[test]
fn sixteen_bit_rows_are_the_same_everywhere_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let ds = s(&graph(dir.path(), 600, 6, false));
    let bf16 = [
        "--set",
        "storage.dtype=bf16",
        "--set",
        "optimizer.state=row",
    ];
    let straight = dir.path().join("straight");
    let mut extra = bf16.to_vec();
    extra.extend([
        "--set",
        "training.num_epochs=3",
        "--set",
        "training.threads=1",
    ]);
    ok(&train_args(&ds, &s(&straight), &extra));
    let want = tables(&straight);
    let entities = &want[..600 * 16 * 4];
    let values: &[f32] = bytemuck::cast_slice(entities);
    assert!(
        values.iter().all(|v| v.to_bits() & 0xffff == 0) && values.iter().any(|&v| v != 0.0),
        "an exported value is not a bf16"
    );
    // Resumed on every backend, trained on 3 threads: the uninterrupted 1-thread run's tables.
    let mut extra = bf16.to_vec();
    extra.extend(["--set", "training.threads=3"]);
    let runs = resumed_on_every_backend(&ds, dir.path(), "bf16", &extra, "entity_dtype = \"bf16\"");
    for (i, t) in runs.iter().enumerate() {
        assert!(
            *t == want,
            "backend {i}: the resumed bf16 run differs from the uninterrupted one"
        );
    }
    // The memory backend's checkpoint holds 2 bytes an element.
    let checkpoint = std::fs::read_dir(dir.path().join("bf16-memory/checkpoints"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert_eq!(
        std::fs::metadata(checkpoint.join("entities.bin"))
            .unwrap()
            .len(),
        600 * 16 * 2
    );
    let f32_run = dir.path().join("f32");
    ok(&train_args(
        &ds,
        &s(&f32_run),
        &[
            "--set",
            "optimizer.state=row",
            "--set",
            "training.num_epochs=3",
        ],
    ));
    assert!(tables(&f32_run) != want, "the dtype changed nothing");
    // A swap writes 16 × 2 + 4 bytes a row instead of 16 × 4 + 4.
    let written = |dtype: &str, name: &str| {
        let sets = ["--set", "optimizer.state=row", "--set", dtype];
        bytes_written_in_one_file_epoch(&ds, &dir.path().join(name), &sets)
    };
    let (narrow, wide) = (
        written("storage.dtype=bf16", "bf16_file"),
        written("storage.dtype=f32", "f32_file"),
    );
    assert!(narrow > 0 && narrow * 68 == wide * 36, "{narrow} vs {wide}");
    let refused = |args: &[&str], want: &str| {
        let r = run(args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{err}");
    };
    refused(
        &[
            "train",
            "--out",
            &s(&dir.path().join("bf16-file")),
            "--resume",
            "--set",
            "storage.dtype=f16",
            "--set",
            "training.num_epochs=4",
        ],
        "storage.dtype = f16 but the run's rows are bf16",
    );
    // f16 tops out at 65504: a step past it stops the run naming the row, never an inf.
    let mut huge = vec![
        "--set",
        "storage.dtype=f16",
        "--set",
        "model.init_scale=9000",
    ];
    huge.extend([
        "--set",
        "optimizer.learning_rate=100000",
        "--set",
        "training.num_epochs=1",
    ]);
    refused(
        &train_args(&ds, &s(&dir.path().join("overflow")), &huge),
        "does not fit storage.dtype = \"f16\"",
    );
    refused(
        &train_args(
            &ds,
            &s(&dir.path().join("too-wide")),
            &[
                "--set",
                "storage.dtype=f16",
                "--set",
                "model.init_scale=10000",
            ],
        ),
        "initial rows would overflow storage.dtype",
    );
}

/// A `[[storage.device]]` configuration of `backend` over `members` (with `start_lba`s on the
/// proxy), 64 KiB stripe units.
fn striped_config(dir: &Path, name: &str, backend: &str, members: &[PathBuf]) -> PathBuf {
    let mut text = format!("[storage]\nbackend = \"{backend}\"\nstripe_bytes = 65536\n");
    for (i, m) in members.iter().enumerate() {
        text.push_str(&format!("[[storage.device]]\npath = \"{}\"\n", s(m)));
        if backend == "proxy" {
            text.push_str(&format!("start_lba = {}\n", i * 2048));
        }
    }
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A store striped over two files, and over two proxies' backing files, trains exactly as the
/// in-memory run, resumes from its members, and a missing or swapped member is refused by its
/// path.
#[test]
fn a_store_striped_over_two_files_or_two_proxies_trains_like_memory() {
    let dir = tempfile::tempdir().unwrap();
    let ds = s(&graph(dir.path(), 600, 6, false));
    let mem = dir.path().join("mem");
    ok(&train_args(
        &ds,
        &s(&mem),
        &["--set", "training.num_epochs=3"],
    ));
    let want = tables(&mem);
    let backing = memory_tempdir();
    for backend in ["file", "proxy"] {
        let base = if backend == "proxy" {
            backing.path()
        } else {
            dir.path()
        };
        let members: Vec<PathBuf> = ["a", "b"]
            .iter()
            .map(|m| {
                let d = base.join(format!("{backend}-{m}"));
                std::fs::create_dir_all(&d).unwrap();
                d.join("store.bin")
            })
            .collect();
        let config = striped_config(dir.path(), &format!("{backend}.toml"), backend, &members);
        let out = dir.path().join(format!("striped-{backend}"));
        let (out_s, config) = (s(&out), s(&config));
        let mut args = train_args(&ds, &out_s, &["--set", "training.num_epochs=2"]);
        args.push(&config);
        ok(&args);
        let meta = std::fs::read_to_string(out.join("run.toml")).unwrap();
        assert!(meta.contains("[[store_members]]"), "{meta}");
        // Each member holds a share of the rows.
        for m in &members {
            let len = std::fs::metadata(m).unwrap().len();
            assert!(len > 2 << 20, "{}: {len} bytes", m.display());
        }
        ok(&[
            "train",
            "--out",
            &s(&out),
            "--resume",
            "--set",
            "training.num_epochs=3",
        ]);
        assert!(
            tables(&out) == want,
            "{backend}: the striped run differs from the in-memory run"
        );
        // The second member gone, then back in the first one's place.
        let moved = members[1].with_extension("moved");
        std::fs::rename(&members[1], &moved).unwrap();
        let r = run(&["eval", &s(&out)]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            !r.status.success() && err.contains(&s(&members[1])),
            "{backend}: {err}"
        );
        std::fs::rename(&members[0], &members[1]).unwrap();
        std::fs::rename(&moved, &members[0]).unwrap();
        let r = run(&["eval", &s(&out)]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            !r.status.success()
                && err.contains(&s(&members[0]))
                && err.contains("is member 2 of its store but is given as member 1"),
            "{backend}: {err}"
        );
    }
}

#[test]
fn a_store_of_another_dataset_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d1 = dir.path().join("one");
    let d2 = dir.path().join("two");
    std::fs::create_dir_all(&d1).unwrap();
    std::fs::create_dir_all(&d2).unwrap();
    let ds1 = s(&graph(&d1, 300, 4, false));
    let ds2 = s(&graph(&d2, 300, 5, false));
    let r1 = dir.path().join("r1");
    let r2 = dir.path().join("r2");
    ok(&train_args(
        &ds1,
        &s(&r1),
        &[
            "--set",
            "training.num_epochs=1",
            "--set",
            "storage.backend=file",
        ],
    ));
    ok(&train_args(
        &ds2,
        &s(&r2),
        &[
            "--set",
            "training.num_epochs=1",
            "--set",
            "storage.backend=file",
        ],
    ));
    std::fs::copy(r1.join("store.bin"), r2.join("store.bin")).unwrap();
    let out = run(&[
        "train",
        "--out",
        &s(&r2),
        "--resume",
        "--set",
        "training.num_epochs=2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("dataset"), "{err}");
    // A truncated store is refused too, naming the file.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(r1.join("store.bin"))
        .unwrap();
    f.set_len(4096).unwrap();
    let out = run(&["eval", &s(&r1)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("store.bin"), "{err}");
}

/// SIGKILL at random moments of training and checkpointing; `--resume` must always find the last
/// complete checkpoint and finish with exactly the tables of an uninterrupted run.
#[test]
fn sigkill_at_random_moments_then_resume_matches_an_uninterrupted_run() {
    kill_and_resume("file", &[], 50);
}

/// The same with the memory backend, whose checkpoints stream the tables into a directory of
/// their own: one killed while it is written leaves the one before usable.
#[test]
fn sigkill_then_resume_in_memory() {
    kill_and_resume("memory", &[], 16);
}

/// The same through the proxy controller's queues: a process killed with commands in flight
/// leaves the backing file with the last commit readable.
#[test]
fn sigkill_then_resume_through_the_proxy() {
    kill_and_resume("proxy", &[], 12);
}

/// The same on two workers (CPU engines: the coordinator several GPUs run), whose checkpoints
/// are the memory backend's: a run killed anywhere resumes to the uninterrupted one's tables.
#[test]
fn sigkill_then_resume_on_two_workers() {
    kill_and_resume("memory", &["training.gpus=2", "training.threads=1"], 10);
}

fn kill_and_resume(backend: &str, extra: &[&str], default_trials: u64) {
    let trials: u64 = std::env::var("LEGEND_KILL_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_trials);
    let dir = tempfile::tempdir().unwrap();
    let ds = s(&graph(dir.path(), 2000, 8, false));
    // A proxy's backing files in memory: what is tested is the crash, not a disk's latency
    // (one allocating write held past the queues' 30 s timeout while a test suite loaded the
    // disk failed a resume here once).
    let backing = memory_tempdir();
    let store_at = |run: &str| {
        let path = s(&backing.path().join(format!("{run}.bin")));
        (backend == "proxy").then(|| format!("storage.path=\"{path}\""))
    };
    let backend = format!("storage.backend={backend}");
    let args = |run: &str| {
        let mut a = vec![
            "--set".to_string(),
            "training.num_epochs=4".into(),
            "--set".into(),
            backend.clone(),
        ];
        if let Some(path) = store_at(run) {
            a.extend(["--set".into(), path]);
        }
        for set in extra {
            a.extend(["--set".into(), set.to_string()]);
        }
        a
    };
    let reference = dir.path().join("reference");
    let started = std::time::Instant::now();
    ok(&train_args(&ds, &s(&reference), &argv(&args("reference"))));
    let full = started.elapsed();
    let want = tables(&reference);
    let mut resumed_from_checkpoint = 0;
    for trial in 0..trials {
        let out = dir.path().join(format!("trial{trial}"));
        let trial_args = args(&format!("trial{trial}"));
        let mut child = Command::new(bin())
            .args(train_args(&ds, &s(&out), &argv(&trial_args)))
            .env("LEGEND_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // A deterministic spread of kill times over the whole run (creation, epochs, checkpoints).
        let frac = ((trial * 7919) % 1000) as f64 / 1000.0;
        std::thread::sleep(full.mul_f64(frac * 1.1));
        let _ = child.kill();
        child.wait().unwrap();
        if !out.exists() {
            // Killed before the run directory appeared (it appears whole, with run.toml).
            continue;
        }
        let meta = std::fs::read_to_string(out.join("run.toml")).unwrap();
        if !meta.contains("epochs_completed = 0") {
            resumed_from_checkpoint += 1;
        }
        let r = run(&["train", "--out", &s(&out), "--resume"]);
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert!(r.status.success(), "trial {trial}: resume failed: {stderr}");
        assert!(
            tables(&out) == want,
            "trial {trial}: resumed run differs from the uninterrupted one"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
    assert!(
        resumed_from_checkpoint > 0 || trials < 5,
        "no trial was killed after a checkpoint"
    );
}

/// SIGINT stops training before the next batch with a checkpoint of that point
/// (checkpoint_every = 0: no other checkpoint exists), exit status 130 and a message saying how
/// to continue; resuming trains exactly the rest, so the tables equal the uninterrupted run's,
/// and a second resume has nothing to do. A signal before the handler is in place kills the
/// process, and the run directory is still resumable.
#[test]
fn sigint_checkpoints_where_it_stops_and_resume_finishes_the_same_run() {
    let dir = tempfile::tempdir().unwrap();
    let ds = s(&graph(dir.path(), 3000, 8, false));
    for backend in ["memory", "file"] {
        let backend = format!("storage.backend={backend}");
        let extra = [
            "--set",
            "training.num_epochs=3",
            "--set",
            "training.checkpoint_every=0",
            "--set",
            &backend,
        ];
        let reference = dir.path().join(format!("{backend}-reference"));
        ok(&train_args(&ds, &s(&reference), &extra));
        let want = tables(&reference);
        let mut mid_epoch = 0;
        for trial in 0..6 {
            let out = dir.path().join(format!("{backend}-trial{trial}"));
            let mut child = Command::new(bin())
                .args(train_args(&ds, &s(&out), &extra))
                .env("LEGEND_LOG", "error")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            // Trial 0 signals at once (before training, or before the handler exists); the
            // others inside epoch 2, at a fraction of the time this very process took for
            // epoch 1: timed by the child's own pace, so a loaded machine moves the moment
            // with it instead of past the epoch.
            if trial > 0
                && let Some(epoch1) = first_epoch_seconds(&out.join("metrics.jsonl"), &mut child)
            {
                std::thread::sleep(epoch1.mul_f64(0.1 + 0.16 * (trial - 1) as f64));
            }
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            let r = child.wait_with_output().unwrap();
            let stderr = String::from_utf8_lossy(&r.stderr);
            match r.status.code() {
                Some(130) => {
                    assert!(
                        stderr.contains("--resume") && stderr.contains("checkpointed at"),
                        "trial {trial}: {stderr}"
                    );
                    let meta = std::fs::read_to_string(out.join("run.toml")).unwrap();
                    mid_epoch += usize::from(meta.contains("[cut]"));
                }
                // Finished before the signal, or killed by it before the handler existed.
                Some(0) | None => {}
                other => panic!("trial {trial}: exit {other:?}: {stderr}"),
            }
            if !out.exists() {
                continue;
            }
            let r = run(&["train", "--out", &s(&out), "--resume"]);
            assert!(
                r.status.success(),
                "trial {trial}: resume failed: {}",
                String::from_utf8_lossy(&r.stderr)
            );
            assert!(
                tables(&out) == want,
                "{backend} trial {trial}: resumed run differs from the uninterrupted one"
            );
            let again = ok(&["train", "--out", &s(&out), "--resume"]);
            assert!(again.contains("nothing to do"), "{again}");
            // Each epoch recorded once, in order.
            let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
            let epochs: Vec<u64> = metrics
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter_map(|v| v.get("epoch").and_then(serde_json::Value::as_u64))
                .collect();
            assert_eq!(epochs, [1, 2, 3], "{backend} trial {trial}: {metrics}");
        }
        assert!(mid_epoch > 0, "{backend}: no SIGINT landed inside an epoch");
    }
}

/// How long epoch 1 took, by its line in `metrics` once the run `child` has written it
/// (`None` if it exited without one).
fn first_epoch_seconds(
    metrics: &Path,
    child: &mut std::process::Child,
) -> Option<std::time::Duration> {
    loop {
        let exited = child.try_wait().unwrap().is_some();
        let text = std::fs::read_to_string(metrics).unwrap_or_default();
        // A line being written does not parse yet.
        let epoch1 = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["epoch"] == 1);
        if let Some(v) = epoch1 {
            return Some(std::time::Duration::from_secs_f64(v["seconds"].as_f64()?));
        }
        if exited {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Peak RSS of a training run whose store is 8× its buffer stays within the documented bound
/// (Documentation/store-format.md, "Memory"): (C + 1) partitions + 2 copies of the edges +
/// 12 bytes per node + a fixed allowance, far below the store itself.
#[test]
fn peak_memory_is_bounded_by_the_buffer_not_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let (nodes, dim, n, c) = (384_000u64, 128u64, 24u64, 3u64);
    let ds = s(&graph(dir.path(), nodes as usize, 1, false));
    let out = dir.path().join("run");
    let args = [
        "train",
        "--dataset",
        &ds,
        "--out",
        &s(&out),
        "--set",
        "storage.backend=file",
        "--set",
        &format!("model.dim={dim}"),
        "--set",
        &format!("storage.num_partitions={n}"),
        "--set",
        &format!("storage.buffer_capacity={c}"),
        "--set",
        "training.num_epochs=1",
        "--set",
        "training.negatives.negatives_per_positive=16",
        "--set",
        "training.batch_size=1000",
    ];
    // Reaped with wait4 below, which also returns the child's own peak RSS.
    #[expect(clippy::zombie_processes)]
    let child = Command::new(bin())
        .args(args)
        .env("LEGEND_LOG", "warn")
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: rusage is plain data that wait4 fills in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, passing valid pointers to locals.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "training failed: {status}"
    );
    let peak = usage.ru_maxrss as u64 * 1024;
    let partition = nodes.div_ceil(n) * dim * 8;
    let edges = nodes * 12;
    let bound = (c + 1) * partition + 2 * edges + 12 * nodes + 64 * (1 << 20);
    let store = nodes * dim * 8;
    assert!(store >= 8 * c * partition, "the store is 8× the buffer");
    assert!(peak <= bound, "peak RSS {peak} B above the bound {bound} B");
    assert!(
        peak < store / 2,
        "peak RSS {peak} B is not far below the store ({store} B)"
    );
    eprintln!(
        "peak RSS {:.1} MiB, bound {:.1} MiB, store {:.1} MiB",
        peak as f64 / 1048576.0,
        bound as f64 / 1048576.0,
        store as f64 / 1048576.0
    );
}
