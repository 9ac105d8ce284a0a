//! `legendctl submit | jobs | watch | cancel | logs` against a `legendd` started here (it is
//! built beside legendctl by `cargo test --workspace`), and the daemon's authorisation with
//! two users: another uid may not see, cancel, delete or read the logs of a job, list
//! everyone's jobs, bind or unbind controllers, or put a run into a directory it does not own. The two-user part needs
//! root to switch uids and says so when it cannot run.

// A test's notes go to the test harness's output: the binary's output rules (clippy.toml)
// are not for it.
#![allow(clippy::disallowed_macros)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{legendctl, ok, s};

/// The uid of `nobody` on Debian and most distributions.
const OTHER_UID: u32 = 65534;

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn legendd() -> PathBuf {
    let path = Path::new(common::bin()).with_file_name("legendd");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build -p legendd` (cargo test --workspace does)",
        path.display()
    );
    path
}

fn start(dir: &Path) -> (Daemon, PathBuf) {
    let socket = dir.join("sock");
    std::fs::write(dir.join("legendd.toml"), "").unwrap();
    let child = Command::new(legendd())
        .args(["--foreground", "--config"])
        .arg(dir.join("legendd.toml"))
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("LEGEND_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "legendd did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (Daemon(child), socket)
}

fn as_other(socket: &Path, args: &[&str]) -> Output {
    Command::new(common::bin())
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env("LEGEND_LOG", "warn")
        .uid(OTHER_UID)
        .gid(OTHER_UID)
        .output()
        .unwrap()
}

fn refused(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(needle),
        "expected a refusal with {needle:?}, got {:?}: {err}",
        out.status
    );
}

#[test]
fn submit_watch_jobs_logs_and_other_users_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Other users must reach the socket: the directory is world-searchable.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ds = dir.path().join("ds");
    ok(&[
        "generate",
        "--nodes",
        "500",
        "--edges",
        "5000",
        "--relations",
        "3",
        &s(&ds),
    ]);
    let (_daemon, socket) = start(dir.path());
    let sock = s(&socket);
    let out = dir.path().join("run");
    let submitted = ok(&[
        "--socket",
        &sock,
        "submit",
        "train",
        "--dataset",
        &s(&ds),
        "--out",
        &s(&out),
        "--set",
        "training.num_epochs=3",
        "--set",
        "model.dim=16",
        "--watch",
    ]);
    assert!(
        submitted.contains("job 1 queued") && submitted.contains("job 1 succeeded"),
        "{submitted}"
    );
    let jobs: serde_json::Value =
        serde_json::from_str(&ok(&["--socket", &sock, "jobs", "--json"])).unwrap();
    assert_eq!(jobs[0]["state"], "succeeded", "{jobs}");
    assert_eq!(jobs[0]["spec"]["out"], s(&out));
    assert_eq!(
        jobs[0]["spec"]["resume"], false,
        "listed as submitted: {jobs}"
    );
    let logs = ok(&["--socket", &sock, "logs", "1"]);
    assert!(logs.contains("epoch 3:"), "{logs}");
    // The run is the user's: evaluable by the local command like any run.
    ok(&["eval", &s(&out)]);
    // Exported by the daemon as by the local command, byte for byte.
    let submit_export = |format: &str, watch: &[&str]| {
        let mut args = vec!["--socket", &sock, "submit", "export", &*s(&out).leak()];
        args.extend(["--format", format]);
        args.extend(watch);
        legendctl(&args)
    };
    let exported = submit_export("npy", &["--watch"]);
    let stdout = String::from_utf8_lossy(&exported.stdout);
    assert!(stdout.contains("job 2 succeeded"), "{stdout}");
    let logs = ok(&["--socket", &sock, "logs", "2"]);
    assert!(
        logs.contains("exported 500 entities and 3 relations"),
        "{logs}"
    );
    let local = dir.path().join("local-export");
    ok(&["export", &s(&out), "--format", "npy", "-o", &s(&local)]);
    for f in ["entities.npy", "relations.npy", "entities.labels.txt"] {
        let daemon = std::fs::read(out.join("export").join(f)).unwrap();
        assert!(
            daemon == std::fs::read(local.join(f)).unwrap(),
            "{f} differs"
        );
    }
    // An unknown format is refused before anything is queued, naming it.
    let bad = submit_export("csv", &[]);
    refused(&bad, "csv");
    // An eval job watched to its end prints its result as `legendctl eval` does.
    let evaluated = ok(&[
        "--socket",
        &sock,
        "submit",
        "eval",
        &s(&out),
        "--protocol",
        "sampled",
        "--watch",
    ]);
    assert!(
        evaluated.contains("sampled (") && evaluated.contains("Hits@10"),
        "{evaluated}"
    );
    // No daemon: one line naming the socket.
    let missing = legendctl(&["--socket", "/nonexistent/legendd.sock", "jobs"]);
    refused(
        &missing,
        "cannot reach legendd at /nonexistent/legendd.sock",
    );
    assert_eq!(String::from_utf8_lossy(&missing.stderr).lines().count(), 1);

    if !nix_is_root() {
        println!("skip: the two-user part needs root to run a client as uid {OTHER_UID}");
        return;
    }
    refused(
        &as_other(&socket, &["jobs", "--all"]),
        "only the admin group",
    );
    refused(&as_other(&socket, &["cancel", "1"]), "not yours");
    refused(&as_other(&socket, &["logs", "1"]), "not yours");
    refused(&as_other(&socket, &["watch", "1"]), "not yours");
    refused(&as_other(&socket, &["delete", "1"]), "not yours");
    // Not root: bind and unbind go to the daemon, which binds for its admin group only.
    refused(
        &as_other(&socket, &["device", "bind", "0000:00:04.0"]),
        "only the admin group",
    );
    refused(
        &as_other(&socket, &["device", "unbind", "0000:00:04.0"]),
        "only the admin group",
    );
    let theirs = as_other(&socket, &["jobs", "--json"]);
    assert!(theirs.status.success());
    assert_eq!(
        String::from_utf8_lossy(&theirs.stdout).trim(),
        "[]",
        "they see no jobs of ours"
    );
    refused(
        &as_other(
            &socket,
            &[
                "submit",
                "train",
                "--dataset",
                &s(&ds),
                "--out",
                &s(&dir.path().join("theirs")),
            ],
        ),
        "not your directory",
    );
    // Their own run, in a directory of theirs: when it ends, everything in it is theirs.
    let home = dir.path().join("other-home");
    std::fs::create_dir(&home).unwrap();
    nix::unistd::chown(
        &home,
        Some(nix::unistd::Uid::from_raw(OTHER_UID)),
        Some(nix::unistd::Gid::from_raw(OTHER_UID)),
    )
    .unwrap();
    let their_run = home.join("run");
    let done = as_other(
        &socket,
        &[
            "submit",
            "train",
            "--dataset",
            &s(&ds),
            "--out",
            &s(&their_run),
            "--set",
            "training.num_epochs=1",
            "--set",
            "model.dim=8",
            "--watch",
        ],
    );
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let mut seen = 0;
    let mut pending = vec![their_run.clone()];
    while let Some(path) = pending.pop() {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::uid(&meta),
            OTHER_UID,
            "{} is not the submitter's",
            path.display()
        );
        seen += 1;
        if meta.is_dir() {
            pending.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        }
    }
    assert!(seen > 5, "the run holds its files ({seen})");

    // Their run moved away and its name made a link to ours: resuming it is refused (the
    // directory the daemon opens is not theirs), and ours is untouched.
    let ours_before = std::fs::read(out.join("run.toml")).unwrap();
    let their_moved = home.join("moved");
    std::fs::rename(&their_run, &their_moved).unwrap();
    std::os::unix::fs::symlink(&out, &their_run).unwrap();
    lchown_to_other(&their_run);
    let resume_theirs = |extra: &[&str]| {
        let mut args = vec!["submit", "train", "--resume", "--out"];
        let run = s(&their_run);
        args.push(&run);
        args.extend_from_slice(extra);
        args.push("--watch");
        as_other(&socket, &args)
    };
    refused(
        &resume_theirs(&["--set", "training.num_epochs=2"]),
        "not the submitter's directory",
    );
    assert_eq!(std::fs::read(out.join("run.toml")).unwrap(), ours_before);
    // Nor does the daemon evaluate or export our run for them, by its path or through their
    // link (the daemon could read what they cannot).
    for run in [s(&out), s(&their_run)] {
        refused(
            &as_other(&socket, &["submit", "eval", &run, "--protocol", "sampled"]),
            "not your run",
        );
        let export_to = s(&home.join("stolen"));
        refused(
            &as_other(
                &socket,
                &[
                    "submit", "export", &run, "--format", "npy", "-o", &export_to,
                ],
            ),
            "not your run",
        );
    }
    assert!(!home.join("stolen").exists());

    // A dataset swapped after submission: their job is queued behind ours with a link to a
    // dataset they may read; before it starts the link points at one in a directory only we
    // may enter. The daemon (which may) must not train on it for them.
    let private = dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    ok(&[
        "generate",
        "--nodes",
        "300",
        "--edges",
        "3000",
        &s(&private.join("ds")),
    ]);
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let blocker = ok(&[
        "--socket",
        &sock,
        "submit",
        "train",
        "--dataset",
        &s(&ds),
        "--out",
        &s(&dir.path().join("blocker")),
        "--set",
        "training.num_epochs=1000000",
    ]);
    let job_id = |text: &str| -> String {
        let at = text.find("job ").expect("a job number") + 4;
        text[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect()
    };
    let ds_link = home.join("ds-link");
    std::os::unix::fs::symlink(&ds, &ds_link).unwrap();
    lchown_to_other(&ds_link);
    let queued = as_other(
        &socket,
        &[
            "submit",
            "train",
            "--dataset",
            &s(&ds_link),
            "--out",
            &s(&home.join("run2")),
        ],
    );
    assert!(queued.status.success(), "{queued:?}");
    let theirs = job_id(&String::from_utf8_lossy(&queued.stdout));
    std::fs::remove_file(&ds_link).unwrap();
    std::os::unix::fs::symlink(private.join("ds"), &ds_link).unwrap();
    lchown_to_other(&ds_link);
    ok(&["--socket", &sock, "cancel", &job_id(&blocker)]);
    let watched = as_other(&socket, &["watch", &theirs]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&watched.stdout),
        String::from_utf8_lossy(&watched.stderr)
    );
    // Their job's process runs as them: the kernel refuses it the directory.
    assert!(
        !watched.status.success() && said.contains("Permission denied"),
        "{said}"
    );
    assert!(
        !home.join("run2").exists(),
        "nothing made for the refused job"
    );
    // Their run back, with its metrics.jsonl a link to a file of ours: the job fails on the
    // link and our file keeps its bytes.
    std::fs::remove_file(&their_run).unwrap();
    std::fs::rename(&their_moved, &their_run).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"ours").unwrap();
    std::fs::remove_file(their_run.join("metrics.jsonl")).unwrap();
    std::os::unix::fs::symlink(&victim, their_run.join("metrics.jsonl")).unwrap();
    lchown_to_other(&their_run.join("metrics.jsonl"));
    refused(
        &resume_theirs(&["--set", "training.num_epochs=2"]),
        "symbolic link",
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"ours");
}

/// Makes the link `path` the other user's, as if they had made it.
fn lchown_to_other(path: &Path) {
    nix::unistd::fchownat(
        nix::fcntl::AT_FDCWD,
        path,
        Some(nix::unistd::Uid::from_raw(OTHER_UID)),
        Some(nix::unistd::Gid::from_raw(OTHER_UID)),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The client's commands end quietly when their reader goes away, as the local ones do
/// (closed_pipe.rs): submit (with --watch), jobs, watch, logs, query, cancel and delete.
#[test]
fn client_commands_end_quietly_when_their_reader_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let ds = common::graph(dir.path());
    let (_daemon, socket) = start(dir.path());
    let sock = s(&socket);
    let run = s(&dir.path().join("run"));
    let small = [
        "--set",
        "model.dim=8",
        "--set",
        "training.num_epochs=2",
        "--set",
        "evaluation.epochs_per_eval=1",
    ];
    let submit_train = |out: &str| {
        let mut args = vec!["submit", "train", "--dataset", &*s(&ds).leak(), "--out"];
        args.push(out.to_owned().leak());
        args.extend(small);
        args.push("--watch");
        args
    };
    ok(&[&["--socket", &sock][..], &submit_train(&run)].concat());
    let served = ok(&["--socket", &sock, "submit", "serve", &run, "--json"]);
    let serving = common::json(served.trim())["id"]
        .as_u64()
        .unwrap()
        .to_string();
    let started = Instant::now();
    while !legendctl(&[
        "--socket", &sock, "query", &serving, "lookup", "--entity", "e0",
    ])
    .status
    .success()
    {
        assert!(started.elapsed() < Duration::from_secs(60), "not serving");
        std::thread::sleep(Duration::from_millis(50));
    }
    let made = std::cell::Cell::new(0);
    let fresh = || {
        made.set(made.get() + 1);
        s(&dir.path().join(format!("out-{}", made.get())))
    };
    let commands: Vec<Box<dyn FnMut() -> Vec<String>>> = vec![
        Box::new(|| vec!["jobs".into()]),
        Box::new(|| vec!["jobs".into(), "--json".into()]),
        Box::new(|| vec!["status".into(), "1".into()]),
        Box::new(|| vec!["watch".into(), "1".into()]),
        Box::new(|| vec!["logs".into(), "1".into()]),
        Box::new(|| {
            let out = fresh();
            submit_train(&out).iter().map(|a| a.to_string()).collect()
        }),
        Box::new(|| {
            ["submit", "eval", &run, "--watch"]
                .map(String::from)
                .to_vec()
        }),
        Box::new(|| {
            let out = fresh();
            [
                "submit", "export", &run, "--format", "tsv", "-o", &out, "--watch",
            ]
            .map(String::from)
            .to_vec()
        }),
        Box::new(|| {
            [
                "query",
                &serving,
                "predict",
                "--head",
                "e0",
                "--relation",
                "r0",
                "--top",
                "20",
            ]
            .map(String::from)
            .to_vec()
        }),
        Box::new(|| {
            [
                "query",
                &serving,
                "neighbors",
                "--entity",
                "e0",
                "--top",
                "20",
                "--json",
            ]
            .map(String::from)
            .to_vec()
        }),
        Box::new(|| ["cancel", &serving].map(String::from).to_vec()),
        // Each run forgets an ended job of its own.
        Box::new(|| {
            let job = ok(&[
                "--socket", &sock, "submit", "eval", &run, "--json", "--watch",
            ]);
            let id = common::json(job.lines().next().unwrap())["id"].to_string();
            vec!["delete".into(), id]
        }),
    ];
    for mut args in commands {
        common::closed_pipe_runs(&mut || {
            let mut a = vec!["--socket".to_string(), sock.clone()];
            a.extend(args());
            a
        });
    }
}
