//! `legendd` run as a process on a temporary socket and state directory, driven through its
//! protocol: a job's results equal the same training run in-process; SIGKILL of the daemon in
//! the middle of a job, then a restart, resumes the job and ends with the uninterrupted run's
//! tables; SIGTERM checkpoints and the job continues at the next start; cancel is prompt and
//! leaves a resumable run; malformed, truncated, oversized and slow requests get errors or
//! disconnects, never a crash or a hang; a bounded load test prints its latency percentiles.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use legend_daemon_api::{
    Envelope, ErrorCode, JobInfo, JobSpec, JobState, MAX_FRAME, PROTOCOL_VERSION, Queries, Reply,
    Request, read_message, write_message,
};
use legend_dataset::{GenerateOptions, generate};
use legend_engine::Config;
use libc::{SIGKILL, SIGTERM};

#[test]
fn a_job_trains_like_an_in_process_run_and_is_watched_to_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let want = reference(&ds, &dir.path().join("reference"), 3);
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let Reply::Hello { version, .. } = c.call(Request::Hello) else {
        panic!("no hello");
    };
    assert_eq!(version, PROTOCOL_VERSION);
    let out = dir.path().join("run");
    let job = c.job(Request::Submit {
        job: train_spec(&ds, &out, 3),
    });
    assert_eq!(job.device.as_deref(), Some("cpu"));
    // Watch: epoch events, then the end.
    let mut w = d.client();
    write_message(
        &mut w.0,
        &Envelope {
            v: PROTOCOL_VERSION,
            request: Request::Watch { job: job.id },
        },
    )
    .unwrap();
    let mut epochs = 0;
    let ended = loop {
        match read_message::<Reply>(&mut w.0, MAX_FRAME).unwrap().unwrap() {
            Reply::Event { event, .. } => epochs += usize::from(event["type"] == "epoch"),
            Reply::Ended { job } => break job,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(ended.state, JobState::Succeeded, "{ended:?}");
    assert!(epochs >= 1, "no epoch event reached the watcher");
    assert!(
        ended
            .result
            .as_ref()
            .is_some_and(|r| r["mrr"].as_f64().is_some())
    );
    assert!(
        tables(&out) == want,
        "the daemon's run differs from the in-process run"
    );
    let Reply::Jobs { jobs } = c.call(Request::List { all: false }) else {
        panic!();
    };
    assert_eq!(jobs.len(), 1);
    // The job is listed as it was submitted: not a resume.
    assert!(
        matches!(jobs[0].spec, JobSpec::Train { resume: false, .. }),
        "{:?}",
        jobs[0].spec
    );
    let Reply::Text { text } = c.call(Request::Logs { job: job.id }) else {
        panic!();
    };
    // Each log line starts with a date a person reads.
    for line in text.lines() {
        let (date, _) = line.split_once(" UTC ").unwrap_or_else(|| panic!("{line}"));
        assert!(date.len() == 19 && date.as_bytes()[4] == b'-', "{line}");
    }
    assert!(
        text.contains("epoch 3:") && text.contains("succeeded"),
        "{text}"
    );
    let Reply::Text { text } = c.call(Request::Metrics) else {
        panic!();
    };
    assert!(
        text.contains("legendd_jobs{state=\"succeeded\"} 1"),
        "{text}"
    );
    // Resubmitting it as a new run is refused at submission, as `legendctl train` refuses it.
    let why = refusal(c.call(Request::Submit {
        job: train_spec(&ds, &out, 3),
    }));
    assert!(why.contains("already exists"), "{why}");
}

#[test]
fn sigkill_of_the_daemon_mid_job_then_restart_resumes_to_the_same_tables() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let want = reference(&ds, &dir.path().join("reference"), 6);
    let out = dir.path().join("run");
    let (_d, _c, done) = killed_mid_job_then_restarted(dir.path(), train_spec(&ds, &out, 6), 2);
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
    assert!(
        tables(&out) == want,
        "the resumed job differs from the uninterrupted run"
    );
}

/// Early stopping with `evaluation.keep_best` through the daemon: the job keeps `best/`, its
/// result names the best epoch whose tables ranked the test split, an export job exports
/// those tables, and a SIGKILL of the daemon after the best epoch resumes the job from the
/// latest checkpoint (not from `best/`) to the uninterrupted run's tables.
#[test]
fn early_stopping_through_the_daemon_keeps_reports_and_exports_the_best_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    // A large learning rate on a random graph: the valid MRR stalls within a few epochs.
    let stopping = [
        "optimizer.learning_rate=0.5",
        "evaluation.epochs_per_eval=1",
        "evaluation.patience=3",
    ];
    let reference_dir = dir.path().join("reference");
    let session = reference_with(&ds, &reference_dir, 40, &stopping);
    let best_epoch = session.best_epoch().expect("a best epoch was kept");
    let epochs = session.position().epochs_completed;
    assert!(
        epochs < 40 && epochs > best_epoch,
        "epoch {epochs}, best {best_epoch}: early stopping should end the run"
    );
    let (want, want_best) = (tables(&reference_dir), tables(&reference_dir.join("best")));
    assert_ne!(
        want, want_best,
        "the last epoch's tables are not the best's"
    );

    let out = dir.path().join("run");
    // Killed after the first best epoch was kept, before the run ends.
    let spec = train_spec_with(&ds, &out, 40, &stopping);
    let (_d, mut c, done) = killed_mid_job_then_restarted(dir.path(), spec, best_epoch.min(2) + 1);
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
    assert!(
        tables(&out) == want,
        "the resumed job differs from the uninterrupted run"
    );
    assert!(
        tables(&out.join("best")) == want_best,
        "the job's best/ differs from the uninterrupted run's"
    );
    let result = done.result.expect("a train job's result");
    assert_eq!(result["best_epoch"], best_epoch, "{result}");
    let final_line = metrics_final_line(&reference_dir);
    assert_eq!(result["mrr"], final_line["metrics"]["mrr"], "{result}");
    // The job says how it went and ended: its validations, the early stop and why, the test
    // line of the best epoch.
    let Reply::Text { text: log } = c.call(Request::Logs { job: done.id }) else {
        panic!("no log");
    };
    for said in [
        "valid: ",
        "early stopping after epoch",
        &format!("test (best epoch {best_epoch}): "),
    ] {
        assert!(log.contains(said), "{said:?} not in the log:\n{log}");
    }

    // The best epoch exported by an export job of RUN/best: its entity rows as trained.
    let export = dir.path().join("export");
    let job = c.job(Request::Submit {
        job: JobSpec::Export {
            run: out.join("best"),
            out: export.clone(),
            format: "npy".into(),
        },
    });
    let ended = wait_for(&mut c, job.id, Duration::from_secs(60), |j| {
        j.state.is_final()
    });
    assert_eq!(ended.state, JobState::Succeeded, "{ended:?}");
    let npy = std::fs::read(export.join("entities.npy")).unwrap();
    let header = 10 + usize::from(u16::from_le_bytes([npy[8], npy[9]]));
    let best = legend_engine::run::open(&out.join("best")).unwrap();
    let meta = legend_engine::run::read_meta(&best).unwrap();
    let t = legend_engine::run::load_tables(&best, &meta, &legend_fs::Unguarded).unwrap();
    assert_eq!(meta.epochs_completed, best_epoch);
    let exported: Vec<f32> = npy[header..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(
        exported == t.entities,
        "the export is not the best epoch's entity table"
    );
}

/// Submits `job` to a daemon on `dir`, SIGKILLs the daemon once the job has started epoch
/// `epoch` (and checks that the run had not ended), starts it again and waits for the job to
/// end: the new daemon, a client of it and the job's final state.
fn killed_mid_job_then_restarted(
    dir: &Path,
    job: JobSpec,
    epoch: u32,
) -> (Daemon, Client, JobInfo) {
    let out = job.dir().clone();
    let id;
    {
        let mut d = Daemon::start(dir);
        let mut c = d.client();
        id = c.job(Request::Submit { job }).id;
        wait_for(&mut c, id, Duration::from_secs(120), |j| {
            j.progress.epoch >= epoch
        });
        d.signal(SIGKILL);
        d.wait();
    }
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default();
    assert!(
        !metrics.contains("\"final\""),
        "the job ended before the daemon was killed: nothing was resumed"
    );
    let d = Daemon::start(dir);
    let mut c = d.client();
    let done = wait_for(&mut c, id, Duration::from_secs(300), |j| j.state.is_final());
    (d, c, done)
}

/// The final line of a run's `metrics.jsonl`.
fn metrics_final_line(run: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

#[test]
fn sigterm_checkpoints_running_jobs_and_they_continue_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let want = reference(&ds, &dir.path().join("reference"), 6);
    let out = dir.path().join("run");
    let id;
    {
        let mut d = Daemon::start(dir.path());
        let mut c = d.client();
        id = c
            .job(Request::Submit {
                job: train_spec(&ds, &out, 6),
            })
            .id;
        wait_for(&mut c, id, Duration::from_secs(120), |j| {
            j.progress.epoch >= 1 && j.progress.edges_done > 0
        });
        d.signal(SIGTERM);
        let status = d.wait();
        assert!(status.success(), "legendd exited with {status} on SIGTERM");
    }
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(format!("state/jobs/{id}.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(record["info"]["state"], "queued", "{record}");
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let done = wait_for(&mut c, id, Duration::from_secs(300), |j| j.state.is_final());
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
    assert!(
        tables(&out) == want,
        "the continued job differs from the uninterrupted run"
    );
}

#[test]
fn cancel_is_prompt_and_leaves_a_resumable_run() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let out = dir.path().join("run");
    let running = c.job(Request::Submit {
        job: train_spec(&ds, &out, 50),
    });
    let queued = c.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("second"), 2),
    });
    wait_for(&mut c, running.id, Duration::from_secs(120), |j| {
        j.progress.edges_done > 0
    });
    // One CPU job at a time: the second waits, and is cancelled at once.
    let q = c.job(Request::Cancel { job: queued.id });
    assert_eq!(q.state, JobState::Cancelled);
    let asked = Instant::now();
    c.job(Request::Cancel { job: running.id });
    let ended = wait_for(&mut c, running.id, Duration::from_secs(60), |j| {
        j.state.is_final()
    });
    assert_eq!(ended.state, JobState::Cancelled, "{ended:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "cancel took {:?}",
        asked.elapsed()
    );
    assert!(
        !dir.path().join("second").exists(),
        "a cancelled queued job wrote"
    );
    // The run is resumable: resubmitting it with resume continues where it stopped.
    let resumed = c.job(Request::Submit {
        job: JobSpec::Train {
            dataset: None,
            out: out.clone(),
            config: String::new(),
            sets: vec!["training.num_epochs=2".into()],
            resume: true,
        },
    });
    let done = wait_for(&mut c, resumed.id, Duration::from_secs(120), |j| {
        j.state.is_final()
    });
    // Cancelled within epoch 1 or 2: resuming to 2 epochs finishes them.
    assert!(
        matches!(done.state, JobState::Succeeded | JobState::Failed),
        "{done:?}"
    );
    if done.state == JobState::Failed {
        assert!(
            done.error
                .as_deref()
                .is_some_and(|e| e.contains("set at least")),
            "{done:?}"
        );
    }
    // Cancelling a job that has ended changes nothing, and the daemon keeps answering (it
    // once kept the job table locked here).
    let again = c.job(Request::Cancel { job: resumed.id });
    assert_eq!(again.state, done.state);
    assert_eq!(
        c.job(Request::Status { job: running.id }).state,
        JobState::Cancelled
    );
}

#[test]
fn malformed_truncated_oversized_and_slow_requests_do_no_harm() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("legendd.toml"), "request_timeout_s = 2\n").unwrap();
    let d = Daemon::start(dir.path());
    let bad = |r: Option<Reply>| match r {
        Some(Reply::Error { code, .. }) => code,
        other => panic!("expected an error reply, got {other:?}"),
    };
    assert_eq!(bad(raw(&d, &frame("{not json"))), ErrorCode::BadRequest);
    assert_eq!(
        bad(raw(&d, &frame(r#"{"v":1,"request":{"call":"rm_rf"}}"#))),
        ErrorCode::BadRequest
    );
    assert_eq!(
        bad(raw(&d, &frame(r#"{"v":99,"request":{"call":"hello"}}"#))),
        ErrorCode::BadRequest
    );
    assert_eq!(
        bad(raw(
            &d,
            &frame(r#"{"v":1,"request":{"call":"status","job":424242}}"#)
        )),
        ErrorCode::NotFound
    );
    // Over the limit: an error, then the connection closes.
    let mut huge = ((MAX_FRAME + 1) as u32).to_be_bytes().to_vec();
    huge.extend([b' '; 64]);
    assert_eq!(bad(raw(&d, &huge)), ErrorCode::BadRequest);
    // Cut inside a frame, then gone.
    let mut cut = frame(r#"{"v":1,"request":{"call":"hello"}}"#);
    cut.truncate(10);
    drop(raw_no_reply(&d, &cut));
    // Random bytes of every length.
    let mut z = 0x2545_f491_4f6c_dd1du64;
    for len in [0usize, 1, 3, 4, 5, 17, 100, 1000] {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                z as u8
            })
            .collect();
        drop(raw_no_reply(&d, &bytes));
    }
    // A client that connects and says nothing holds no one up, and is dropped after the
    // request timeout.
    let silent = UnixStream::connect(&d.socket).unwrap();
    let mut c = d.client();
    assert!(matches!(c.call(Request::Hello), Reply::Hello { .. }));
    std::thread::sleep(Duration::from_secs(3));
    let mut probe = [0u8; 1];
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut silent = silent;
    let why = refusal(read_message(&mut silent, MAX_FRAME).unwrap().unwrap());
    assert!(why.contains("request_timeout_s"), "{why}");
    assert_eq!(
        std::io::Read::read(&mut silent, &mut probe).unwrap_or(0),
        0,
        "a silent client was not disconnected"
    );
    // Still serving.
    let mut c = d.client();
    assert!(matches!(c.call(Request::Hello), Reply::Hello { .. }));
    // Relative paths and datasets one may not read are refused at submission.
    let refused = c.call(Request::Submit {
        job: JobSpec::Train {
            dataset: Some("ds".into()),
            out: "run".into(),
            config: String::new(),
            sets: Vec::new(),
            resume: false,
        },
    });
    assert_eq!(bad(Some(refused)), ErrorCode::Refused);
}

#[test]
fn a_thousand_status_requests_a_second_while_a_job_runs() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    // Long enough to be running through the 10 s of requests.
    let job = c.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("run"), 1000),
    });
    let seconds = 10u64;
    let threads = 4u64;
    let per_thread = 1000 / threads;
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let mut c = d.client();
            std::thread::spawn(move || {
                let mut lat = Vec::new();
                let start = Instant::now();
                for i in 0..per_thread * seconds {
                    // Paced: request i of this thread is due at i / per_thread seconds.
                    let due = Duration::from_micros(i * 1_000_000 / per_thread);
                    if let Some(wait) = due.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    let t = Instant::now();
                    let j = c.job(Request::Status { job: job.id });
                    lat.push(t.elapsed());
                    assert_eq!(j.id, job.id);
                }
                (lat, start.elapsed())
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut wall = Duration::ZERO;
    for w in workers {
        let (lat, took) = w.join().unwrap();
        all.extend(lat);
        wall = wall.max(took);
    }
    all.sort();
    let pct = |p: f64| all[((all.len() - 1) as f64 * p) as usize];
    let rate = all.len() as f64 / wall.as_secs_f64();
    println!(
        "{} status requests in {:.1} s ({rate:.0}/s) beside a training job: p50 {:?}, p99 {:?}, max {:?}",
        all.len(),
        wall.as_secs_f64(),
        pct(0.5),
        pct(0.99),
        all[all.len() - 1]
    );
    assert!(
        rate > 800.0,
        "the daemon kept up with only {rate:.0} requests/s"
    );
    assert!(
        pct(0.99) < Duration::from_millis(200),
        "p99 {:?}",
        pct(0.99)
    );
    c.job(Request::Cancel { job: job.id });
}

#[test]
fn the_shipped_unit_passes_systemd_analyze_where_it_exists() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../systemd/legendd.service");
    assert!(unit.exists());
    let Ok(out) = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
    else {
        println!("skip: systemd-analyze is not installed here");
        return;
    };
    let text = String::from_utf8_lossy(&out.stderr);
    // The unit names a binary this machine need not have installed; anything else is a fault.
    let problems: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.contains("is not executable"))
        .collect();
    assert!(problems.is_empty(), "{text}");
}

#[test]
fn device_requests_open_only_the_modules_nodes_and_say_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    for device in ["/etc/passwd", "/dev/legend-nvme0/../../etc/shadow"] {
        match c.call(Request::DeviceInfo {
            device: device.into(),
        }) {
            Reply::Error { code, message } => {
                assert_eq!(code, ErrorCode::BadRequest);
                assert!(message.contains("not a device node"), "{message}");
            }
            other => panic!("{device}: {other:?}"),
        }
    }
    if Path::new("/dev/legend-nvme0").exists() {
        eprintln!("skipped: this machine has /dev/legend-nvme0 (the QEMU suite covers it)");
        return;
    }
    // No module here: the reply says which setup step is left, and the connection goes on.
    for request in [
        Request::DeviceInfo {
            device: "/dev/legend-nvme0".into(),
        },
        Request::DeviceHealth {
            device: "/dev/legend-nvme0".into(),
        },
    ] {
        let why = refusal(c.call(request));
        assert!(why.contains("legend_nvme"), "{why}");
    }
    assert!(matches!(c.call(Request::Hello), Reply::Hello { .. }));
}

#[test]
fn runs_on_one_namespace_get_disjoint_extents_kept_across_restarts_and_freed_on_delete() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    // The shared "device": a 64 MiB namespace of the userspace proxy controller, in memory
    // where the machine has it (the extents are tested, not a disk's latency: a loaded disk can
    // hold one of the proxy's writes past its queues' 30 s timeout).
    let memory = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let device = memory.path().join("namespace.img");
    std::fs::File::create(&device)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let run = |name: &str| dir.path().join(name);
    let finish = |c: &mut Client, spec: JobSpec| {
        let job = c.job(Request::Submit { job: spec });
        let done = wait_for(c, job.id, Duration::from_secs(120), |j| j.state.is_final());
        assert_eq!(done.state, JobState::Succeeded, "{done:?}");
        job.id
    };
    let mut d = Daemon::start(dir.path());
    let mut c = d.client();
    let a = finish(&mut c, on_namespace(train_spec(&ds, &run("a"), 2), &device));
    finish(&mut c, on_namespace(train_spec(&ds, &run("b"), 2), &device));
    let (la, lb) = (start_lba(&run("a")), start_lba(&run("b")));
    let config = Config::parse("", &SETS.map(String::from)).unwrap();
    let meta = legend_dataset::DatasetMeta::read(&ds).unwrap();
    let blocks = legend_engine::store::file::run_store_bytes(&config, &meta, 512).unwrap() / 512;
    assert!(
        la.abs_diff(lb) >= blocks,
        "extents overlap: {la}, {lb} ({blocks} blocks)"
    );
    // b trained after a; a's store is intact, and both equal the same run in memory.
    let want = reference(&ds, &run("in-memory"), 2);
    assert!(tables(&run("a")) == want, "run a's store was disturbed");
    assert!(tables(&run("b")) == want);
    // Users do not pick LBAs on a shared namespace.
    let mut picked = on_namespace(train_spec(&ds, &run("x"), 1), &device);
    if let JobSpec::Train { sets, .. } = &mut picked {
        sets.push(format!("storage.start_lba={la}"));
    }
    let why = refusal(c.call(Request::Submit { job: picked }));
    assert!(why.contains("storage.start_lba"), "{why}");
    // The table is on the namespace: a restarted daemon places a third run clear of both.
    drop(c);
    d.signal(SIGTERM);
    d.wait();
    drop(d);
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    finish(&mut c, on_namespace(train_spec(&ds, &run("c"), 1), &device));
    let lc = start_lba(&run("c"));
    assert!(
        lc.abs_diff(la) >= blocks && lc.abs_diff(lb) >= blocks,
        "{la} {lb} {lc}"
    );
    // Deleting a's only train job frees its extent: a's store is gone (evaluating it is
    // refused), and the next run of the same size takes the hole a left.
    assert_eq!(c.job(Request::Delete { job: a }).id, a);
    let why = refusal(c.call(Request::Status { job: a }));
    assert!(
        why.contains("no job") || why.contains(&a.to_string()),
        "{why}"
    );
    let why = refusal(c.call(Request::Submit {
        job: JobSpec::Eval {
            run: run("a"),
            protocol: "sampled".into(),
            split: "test".into(),
        },
    }));
    assert!(why.contains("no longer"), "{why}");
    finish(&mut c, on_namespace(train_spec(&ds, &run("d"), 1), &device));
    assert_eq!(
        start_lba(&run("d")),
        la,
        "first fit reuses the freed extent"
    );
}

#[test]
fn links_planted_in_a_run_directory_are_never_followed() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let run = dir.path().join("run");
    let first = c.job(Request::Submit {
        job: train_spec(&ds, &run, 1),
    });
    let done = wait_for(&mut c, first.id, Duration::from_secs(120), |j| {
        j.state.is_final()
    });
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
    let resume = |c: &mut Client, epochs: u32| {
        let job = c.job(Request::Submit {
            job: JobSpec::Train {
                dataset: None,
                out: run.clone(),
                config: String::new(),
                sets: vec![format!("training.num_epochs={epochs}")],
                resume: true,
            },
        });
        wait_for(c, job.id, Duration::from_secs(120), |j| j.state.is_final())
    };
    // A link in place of a file the job writes (metrics.jsonl, pointing at a file elsewhere)
    // fails the job, naming the link; the file it points at keeps its bytes.
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    std::fs::remove_file(run.join("metrics.jsonl")).unwrap();
    std::os::unix::fs::symlink(&victim, run.join("metrics.jsonl")).unwrap();
    let refused = resume(&mut c, 2);
    assert_eq!(refused.state, JobState::Failed, "{refused:?}");
    assert!(
        refused
            .error
            .as_deref()
            .is_some_and(|e| e.contains("symbolic link") && e.contains("metrics.jsonl")),
        "{refused:?}"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    // A link planted among the checkpoints (into another directory) goes with the old
    // checkpoints when the next one commits: removed, never followed.
    std::fs::remove_file(run.join("metrics.jsonl")).unwrap();
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("f"), b"keep").unwrap();
    std::os::unix::fs::symlink(&elsewhere, run.join("checkpoints").join("planted")).unwrap();
    let resumed = resume(&mut c, 2);
    assert_eq!(resumed.state, JobState::Succeeded, "{resumed:?}");
    assert!(!run.join("checkpoints").join("planted").exists());
    assert_eq!(std::fs::read(elsewhere.join("f")).unwrap(), b"keep");
    // config.toml made a link to a file the daemon may read: the resume is refused at
    // submission without quoting the file (a parse error would).
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"the secret words\n").unwrap();
    let config = run.join("config.toml");
    std::fs::rename(&config, dir.path().join("config.toml")).unwrap();
    std::os::unix::fs::symlink(&secret, &config).unwrap();
    let why = refusal(c.call(Request::Submit {
        job: JobSpec::Train {
            dataset: None,
            out: run.clone(),
            config: String::new(),
            sets: vec!["training.num_epochs=3".into()],
            resume: true,
        },
    }));
    assert!(
        why.contains("symbolic link") && !why.contains("secret words"),
        "{why}"
    );
}

#[test]
fn a_set_key_deeper_than_the_schema_is_refused_and_the_daemon_lives() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    // 5,000 parts and more once overflowed a client thread's stack and aborted the daemon.
    for parts in [5_000, 100_000, 2_000] {
        let mut spec = train_spec(&ds, &dir.path().join("run"), 1);
        let JobSpec::Train { sets, .. } = &mut spec else {
            unreachable!()
        };
        sets.push(format!("{}.b=1", vec!["a"; parts].join(".")));
        let why = refusal(c.call(Request::Submit { job: spec }));
        // Past 64 KiB the configuration's size refuses it first.
        assert!(
            why.contains("a: not a section") || why.contains("at most 65536"),
            "{parts}: {why}"
        );
    }
    // The other structures a request shapes: TOML values in its configuration and in a
    // `--set`, the JSON of the request itself, a path of many components.
    let deep_n =
        |open: &str, close: &str, n: usize| format!("{}{}", open.repeat(n), close.repeat(n));
    let deep = |open: &str, close: &str| deep_n(open, close, 100_000);
    let mut spec = train_spec(&ds, &dir.path().join("run"), 1);
    if let JobSpec::Train { config, sets, .. } = &mut spec {
        // 8,000 levels: as deep as fits the 64 KiB a configuration may take.
        *config = format!("x = {}\n", deep_n("[", "]", 8_000));
        sets.push(format!("model.dim={}", deep_n("{a=", "}", 8_000)));
    }
    let why = refusal(c.call(Request::Submit { job: spec }));
    assert!(why.contains("invalid configuration"), "{why}");
    let nested = format!(
        r#"{{"v":1,"request":{{"call":"hello","x":{}}}}}"#,
        deep("[", "]")
    );
    assert!(matches!(
        raw(&d, &frame(&nested)),
        Some(Reply::Error {
            code: ErrorCode::BadRequest,
            ..
        })
    ));
    let long = PathBuf::from(format!("/{}", vec!["a"; 100_000].join("/")));
    let why = refusal(c.call(Request::Submit {
        job: train_spec(&long, &long, 1),
    }));
    assert!(!why.is_empty());
    assert!(matches!(c.call(Request::Hello), Reply::Hello { .. }));
}

#[test]
fn submissions_read_only_what_their_submitter_could_and_answer_as_if_they_had_looked() {
    if !may_switch_uids("submissions_read_only_what_their_submitter_could") {
        return;
    }
    let dir = shared_tempdir();
    let d = Daemon::start(dir.path());
    // Root's closed directory: a run-looking directory whose config would quote its secret.
    let closed = dir.path().join("closed");
    own_dir(&closed, 0);
    let secret_run = closed.join("run");
    std::fs::create_dir(&secret_run).unwrap();
    std::fs::write(secret_run.join("run.toml"), "x = 1\n").unwrap();
    std::fs::write(secret_run.join("config.toml"), "password hunter2\n").unwrap();
    std::fs::create_dir(closed.join("there")).unwrap();
    // The other user's own directory, with a link to it.
    let mine = dir.path().join("mine");
    own_dir(&mine, OTHER_UID);
    std::os::unix::fs::symlink(&secret_run, mine.join("run")).unwrap();
    std::os::unix::fs::symlink(&closed, mine.join("closed")).unwrap();
    let mut other = connect_as(&d, OTHER_UID);
    let resume = |out: &Path| JobSpec::Train {
        dataset: None,
        out: out.to_owned(),
        config: String::new(),
        sets: Vec::new(),
        resume: true,
    };
    for out in [mine.join("run"), secret_run.clone()] {
        let why = refusal(other.call(Request::Submit { job: resume(&out) }));
        assert!(
            !why.contains("hunter2") && why.contains("may not"),
            "{}: {why}",
            out.display()
        );
    }
    // Whether a name exists behind a directory the submitter may not search, and whose it
    // is, is not told: the answers for a present and an absent one are the same.
    let answers: Vec<String> = ["there", "absent"]
        .iter()
        .flat_map(|name| {
            let new_run = train_spec(Path::new("/nonexistent"), &closed.join(name).join("run"), 1);
            let eval = JobSpec::Eval {
                run: closed.join(name),
                protocol: "sampled".into(),
                split: "test".into(),
            };
            let dataset = train_spec(&closed.join(name), &mine.join("new"), 1);
            [new_run, eval, dataset]
        })
        .map(|job| refusal(other.call(Request::Submit { job })).replace("absent", "there"))
        .collect();
    assert_eq!(answers[..3], answers[3..], "{answers:#?}");
    assert!(
        answers.iter().all(|a| a.contains("may not search")),
        "{answers:#?}"
    );
}

/// A train job that ends indexes the run's labels, as `legendctl train` does, so that the
/// run's first query finds the index kept in it.
#[test]
fn a_finished_train_job_keeps_the_label_index() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds");
    // Enough entities for the index to be kept (2^16 labels or more).
    let mut o = GenerateOptions::new(70_000, 100_000);
    o.relations = 2;
    generate(&o, &ds).unwrap();
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let run = dir.path().join("run");
    let job = c.job(Request::Submit {
        job: train_spec_with(&ds, &run, 1, &["model.dim=4", "training.batch_size=10000"]),
    });
    let ended = wait_for(&mut c, job.id, Duration::from_secs(120), |j| {
        j.state.is_final()
    });
    assert_eq!(ended.state, JobState::Succeeded, "{ended:?}");
    assert!(run.join("index/entities.tsv.index").is_file());
}

#[test]
fn a_new_run_over_an_existing_one_is_refused_at_submission() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(run.join("run.toml"), "").unwrap();
    let why = refusal(c.call(Request::Submit {
        job: train_spec(&ds, &run, 1),
    }));
    assert!(
        why.contains("already exists") && why.contains("--resume"),
        "{why}"
    );
}

#[test]
fn a_job_on_more_gpus_than_the_daemon_schedules_is_refused_at_submission() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    // No GPU for this daemon, whatever the machine has.
    let d = Daemon::start_with(dir.path(), |c| {
        c.env("CUDA_VISIBLE_DEVICES", "");
    });
    let mut c = d.client();
    let spec = train_spec_with(
        &ds,
        &dir.path().join("run"),
        1,
        &[
            "training.gpus=4",
            "training.device=\"cuda:0\"",
            "storage.backend=\"memory\"",
        ],
    );
    let why = refusal(c.call(Request::Submit { job: spec }));
    assert!(
        why.contains("training.gpus = 4") && why.contains("schedules 0 GPUs"),
        "{why}"
    );
}

#[test]
fn one_user_cannot_take_the_connections() {
    if !may_switch_uids("one_user_cannot_take_the_connections") {
        return;
    }
    let dir = shared_tempdir();
    // The held connections sit idle while the rest connect: a request timeout shorter than
    // the test (2 s, on a loaded machine) would disconnect the first ones and free their
    // slots, so it is far longer here (idle disconnection has a test of its own).
    std::fs::write(
        dir.path().join("legendd.toml"),
        "request_timeout_s = 600\nmax_connections = 16\nreserved_connections = 4\n\
         max_connections_per_uid = 6\n",
    )
    .unwrap();
    let d = Daemon::start(dir.path());
    let mut held = Vec::new();
    for uid in [OTHER_UID, OTHER_UID - 1] {
        for _ in 0..6 {
            let mut c = connect_as(&d, uid);
            hello(&mut c);
            held.push(c);
        }
    }
    let why = turned_away(connect_as(&d, OTHER_UID));
    assert!(why.contains("max_connections_per_uid = 6"), "{why}");
    // 12 open: what is left is the admin group's reserve.
    let why = turned_away(connect_as(&d, OTHER_UID - 2));
    assert!(why.contains("reserved_connections = 4"), "{why}");
    for _ in 0..4 {
        let mut root = d.client();
        hello(&mut root);
        held.push(root);
    }
    let why = turned_away(d.client());
    assert!(why.contains("max_connections = 16"), "{why}");
}

fn mode(path: &Path) -> u32 {
    std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).unwrap().permissions()) & 0o777
}

#[test]
fn the_state_is_private_ids_are_never_reused_and_records_carry_a_format() {
    let dir = tempfile::tempdir().unwrap();
    let run = broken_run(dir.path());
    let mut d = Daemon::start(dir.path());
    let mut c = d.client();
    let mut ids = Vec::new();
    for n in 0..2 {
        let job = c.job(Request::Submit {
            job: export_spec(&run, n),
        });
        wait_for(&mut c, job.id, Duration::from_secs(30), |j| {
            j.state.is_final()
        });
        ids.push(job.id);
    }
    let jobs = dir.path().join("state/jobs");
    assert_eq!(mode(&dir.path().join("state")), 0o700);
    assert_eq!(mode(&jobs), 0o700);
    for id in &ids {
        assert_eq!(mode(&jobs.join(format!("{id}.json"))), 0o600);
        assert_eq!(mode(&jobs.join(format!("{id}.log"))), 0o600);
    }
    // The newest job deleted, then a restart: its id is not given again.
    c.job(Request::Delete { job: ids[1] });
    d.signal(SIGTERM);
    assert!(d.wait().success());
    // A record of the first format (no `format` key) is read.
    let first = jobs.join(format!("{}.json", ids[0]));
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&first).unwrap()).unwrap();
    assert_eq!(record["format"], 2);
    record.as_object_mut().unwrap().remove("format");
    std::fs::write(&first, serde_json::to_vec(&record).unwrap()).unwrap();
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    assert_eq!(c.job(Request::Status { job: ids[0] }).id, ids[0]);
    let job = c.job(Request::Submit {
        job: export_spec(&run, 3),
    });
    assert!(job.id > ids[1], "id {} given again", job.id);
    drop(d);
    // A record of a later format stops the daemon, naming it.
    record["format"] = 99.into();
    std::fs::write(&first, serde_json::to_vec(&record).unwrap()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_legendd"))
        .args(["--foreground", "--config"])
        .arg(dir.path().join("legendd.toml"))
        .arg("--socket")
        .arg(dir.path().join("sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("legendd started over a record of a later format");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("format 99") && stderr.contains(".json"),
        "{stderr}"
    );
}

#[test]
fn jobs_per_user_are_bounded() {
    let dir = shared_tempdir();
    std::fs::write(dir.path().join("legendd.toml"), "max_jobs_per_user = 40\n").unwrap();
    let ds = dataset(dir.path());
    let run = broken_run(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    // A long job holds the CPU queue; the others wait behind it.
    let long = c.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("run"), 1000),
    });
    wait_for(&mut c, long.id, Duration::from_secs(60), |j| {
        j.state == JobState::Running
    });
    let started = Instant::now();
    let queued: Vec<u64> = (0..39)
        .map(|n| {
            c.job(Request::Submit {
                job: export_spec(&run, n),
            })
            .id
        })
        .collect();
    let submitting = started.elapsed();
    let why = refusal(c.call(Request::Submit {
        job: export_spec(&run, 99),
    }));
    assert!(why.contains("max_jobs_per_user = 40"), "{why}");
    let started = Instant::now();
    for id in queued {
        assert_eq!(
            c.job(Request::Cancel { job: id }).state,
            JobState::Cancelled
        );
    }
    println!(
        "39 submissions behind a running job: {submitting:?}; their cancels: {:?}",
        started.elapsed()
    );
    // Room again.
    c.job(Request::Submit {
        job: export_spec(&run, 100),
    });
    c.job(Request::Cancel { job: long.id });
}

#[test]
fn a_daemon_without_its_configuration_file_says_so() {
    let default = Path::new("/etc/legend/legendd.toml");
    if default.exists() {
        println!("skip: {} exists on this machine", default.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let child = Command::new(env!("CARGO_BIN_EXE_legendd"))
        .arg("--foreground")
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("LEGEND_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_listening(&socket);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no configuration file at /etc/legend/legendd.toml"),
        "{stderr}"
    );
}

#[test]
fn an_idle_daemon_answers_a_new_connection_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    // Each command of legendctl is a new connection: the daemon blocks on its socket and
    // accepts at once (it once slept 20 ms between looks, ~10 ms a command on average).
    let mut took: Vec<Duration> = (0..41)
        .map(|_| {
            let started = Instant::now();
            hello(&mut d.client());
            started.elapsed()
        })
        .collect();
    took.sort();
    println!("connect + hello: median {:?}, max {:?}", took[20], took[40]);
    assert!(took[20] < Duration::from_millis(5), "median {:?}", took[20]);
}

/// `GET /metrics` on `127.0.0.1:port`: the status line and the body.
fn http_metrics(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut s, &mut text).unwrap();
    text
}

#[test]
fn http_metrics_show_totals_only_and_a_silent_client_holds_no_one_up() {
    let dir = tempfile::tempdir().unwrap();
    // A free port (the listener closed just before the daemon binds it).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::fs::write(
        dir.path().join("legendd.toml"),
        format!("metrics_port = {port}\nrequest_timeout_s = 5\n"),
    )
    .unwrap();
    let run = broken_run(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let job = c.job(Request::Submit {
        job: export_spec(&run, 0),
    });
    wait_for(&mut c, job.id, Duration::from_secs(30), |j| {
        j.state.is_final()
    });
    let _silent: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let started = Instant::now();
    let text = http_metrics(port);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(text.starts_with("HTTP/1.0 200 OK"), "{text}");
    assert!(text.contains("legendd_jobs{state=\"failed\"} 1"), "{text}");
    assert!(
        !text.contains("job=\""),
        "jobs shown to an unknown caller:\n{text}"
    );
}

#[test]
fn a_request_trickled_a_byte_at_a_time_is_cut_off_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("legendd.toml"), "request_timeout_s = 2\n").unwrap();
    let d = Daemon::start(dir.path());
    // Each read comes well within the timeout; the whole request does not.
    let mut trickler = d.client();
    let writer = trickler.0.try_clone().unwrap();
    let started = Instant::now();
    let trickle = std::thread::spawn(move || {
        let mut writer = writer;
        for b in (1u32 << 16)
            .to_be_bytes()
            .into_iter()
            .chain(std::iter::repeat(b' '))
        {
            if writer.write_all(&[b]).is_err() || started.elapsed() > Duration::from_secs(20) {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    trickler
        .0
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let why = refusal(read_message(&mut trickler.0, MAX_FRAME).unwrap().unwrap());
    assert!(why.contains("request_timeout_s"), "{why}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    trickle.join().unwrap();
    hello(&mut d.client());
}

#[test]
fn metrics_show_each_user_their_own_jobs_only() {
    if !may_switch_uids("metrics_show_each_user_their_own_jobs_only") {
        return;
    }
    let dir = shared_tempdir();
    let run = broken_run(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let job = c.job(Request::Submit {
        job: export_spec(&run, 0),
    });
    wait_for(&mut c, job.id, Duration::from_secs(30), |j| {
        j.state.is_final()
    });
    let Reply::Text { text } = connect_as(&d, OTHER_UID).call(Request::Metrics) else {
        panic!();
    };
    assert!(text.contains("legendd_jobs{state=\"failed\"} 1"), "{text}");
    assert!(
        !text.contains("job=\""),
        "another user's jobs shown:\n{text}"
    );
    let Reply::Text { text } = c.call(Request::Metrics) else {
        panic!();
    };
    assert!(
        text.contains(&format!("legend_job_io_bytes_total{{job=\"{}\"}}", job.id)),
        "{text}"
    );
}

#[test]
fn a_submission_that_cannot_be_saved_is_refused_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let run = broken_run(dir.path());
    // The daemon may write no file larger than 64 bytes (SIGXFSZ ignored, so writes fail
    // with EFBIG instead): its job records cannot be saved, as on a full disk. Its log goes to
    // a file already past the limit, so that no log line can be written either: the daemon
    // must go on without them (it once panicked on the first, and how the test's own stderr
    // was connected decided whether the test failed).
    let log = dir.path().join("legendd.log");
    std::fs::write(&log, [b'#'; 100]).unwrap();
    let log = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    let d = Daemon::start_with(dir.path(), |command| {
        command.env("LEGEND_LOG", "debug").stderr(log);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(command, || {
                let limit = libc::rlimit {
                    rlim_cur: 64,
                    rlim_max: 64,
                };
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
        };
    });
    let mut c = d.client();
    let why = refusal(c.call(Request::Submit {
        job: export_spec(&run, 0),
    }));
    assert!(
        why.contains("not queued") && why.contains("too large"),
        "{why}"
    );
    let Reply::Jobs { jobs } = c.call(Request::List { all: false }) else {
        panic!();
    };
    assert!(jobs.is_empty(), "{jobs:?}");
}

#[test]
fn an_answer_over_the_frame_limit_is_an_error_not_a_closed_connection() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_dataset = dir.path().join("empty");
    std::fs::create_dir(&not_a_dataset).unwrap();
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    // Jobs whose configurations (a long comment, under the 64 KiB a configuration may take)
    // make a list longer than a frame.
    let comment = format!("# {}\n", "x".repeat(60_000));
    for n in 0..MAX_FRAME / 60_000 + 2 {
        let mut spec = train_spec(&not_a_dataset, &dir.path().join(format!("run-{n}")), 1);
        if let JobSpec::Train { config, .. } = &mut spec {
            config.clone_from(&comment);
        }
        let job = c.job(Request::Submit { job: spec });
        wait_for(&mut c, job.id, Duration::from_secs(30), |j| {
            j.state.is_final()
        });
    }
    let why = refusal(c.call(Request::List { all: false }));
    assert!(why.contains("frame limit"), "{why}");
    hello(&mut c);
}

#[test]
fn submitting_and_cancelling_cost_does_not_grow_with_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("legendd.toml"),
        "max_jobs_per_user = 3000\n",
    )
    .unwrap();
    let ds = dataset(dir.path());
    let run = broken_run(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let long = c.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("run"), 1000),
    });
    wait_for(&mut c, long.id, Duration::from_secs(60), |j| {
        j.state == JobState::Running
    });
    let timed = |c: &mut Client, request: Request| {
        let started = Instant::now();
        let id = c.job(request).id;
        (id, started.elapsed())
    };
    let submitted: Vec<(u64, Duration)> = (0..2000)
        .map(|n| {
            timed(
                &mut c,
                Request::Submit {
                    job: export_spec(&run, n),
                },
            )
        })
        .collect();
    let cancelled: Vec<Duration> = submitted
        .iter()
        .map(|(id, _)| timed(&mut c, Request::Cancel { job: *id }).1)
        .collect();
    c.job(Request::Cancel { job: long.id });
    // The fastest of the first and of the last hundred: what a request costs when nothing else
    // competes (the suite's other tests and a busy machine inflate medians now and then, never
    // the fastest). The daemon once cloned the job list and walked queued × jobs on every
    // request, which every request pays, the fastest too.
    let fastest = |times: &[Duration]| *times.iter().min().expect("a hundred times");
    let submits: Vec<Duration> = submitted.iter().map(|(_, t)| *t).collect();
    // Submissions go from an empty queue to a full one, cancels the other way.
    for (what, times) in [("submit", &submits), ("cancel", &cancelled)] {
        let (first, last) = (fastest(&times[..100]), fastest(&times[1900..]));
        println!("{what}: fastest of the first 100 {first:?}, of the last 100 {last:?}");
        assert!(
            first.max(last) <= first.min(last) * 3 + Duration::from_millis(2),
            "{what}: {first:?} for the first hundred, {last:?} for the last"
        );
    }
}

#[test]
fn a_running_job_reads_in_its_run_only_what_its_submitter_could() {
    if !may_switch_uids("a_running_job_reads_in_its_run_only_what_its_submitter_could") {
        return;
    }
    let dir = shared_tempdir();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mine = dir.path().join("mine");
    own_dir(&mine, OTHER_UID);
    let run = mine.join("run");
    let mut other = connect_as(&d, OTHER_UID);
    let first = other.job(Request::Submit {
        job: train_spec(&ds, &run, 1),
    });
    let done = wait_for(&mut other, first.id, Duration::from_secs(120), |j| {
        j.state.is_final()
    });
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
    // Root's long job holds the queue while the resume waits behind it.
    let mut c = d.client();
    let blocker = c.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("blocker"), 1000),
    });
    wait_for(&mut c, blocker.id, Duration::from_secs(60), |j| {
        j.state == JobState::Running
    });
    let resumed = other.job(Request::Submit {
        job: JobSpec::Train {
            dataset: None,
            out: run.clone(),
            config: String::new(),
            sets: vec!["training.num_epochs=2".into()],
            resume: true,
        },
    });
    // Accepted, then the run's configuration becomes a hard link to root's secret.
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "password hunter2\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::remove_file(run.join("config.toml")).unwrap();
    std::fs::hard_link(&secret, run.join("config.toml")).unwrap();
    c.job(Request::Cancel { job: blocker.id });
    let ended = wait_for(&mut other, resumed.id, Duration::from_secs(120), |j| {
        j.state.is_final()
    });
    // The job's process runs as its submitter: the kernel refuses the file.
    let error = ended.error.as_deref().unwrap_or_default();
    assert_eq!(ended.state, JobState::Failed, "{ended:?}");
    assert!(
        error.contains("config.toml: Permission denied") && !error.contains("hunter2"),
        "{error}"
    );
}

/// Settings sized to make the daemon's process allocate without bound (jobs run as its
/// threads) are refused at submission, naming the key; one within the bounds that needs more
/// memory than the machine has fails its job with the estimate; the daemon lives.
#[test]
fn settings_sized_to_exhaust_the_daemon_are_refused_and_it_lives() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    for set in [
        "training.negatives.negatives_per_positive=1000000000000",
        "training.negatives.negatives_per_positive=4611686018427387904",
        "model.dim=4611686018427387904",
        "training.threads=20000",
        "storage.num_partitions=4294967295",
        "training.batch_size=4611686018427387904",
    ] {
        let key = set.split('=').next().unwrap();
        let why = refusal(c.call(Request::Submit {
            job: train_spec_with(&ds, &dir.path().join("r"), 1, &[set]),
        }));
        assert!(
            why.contains(key) && why.contains("largest allowed"),
            "{set}: {why}"
        );
    }
    // 2 × 100 chunks × 2^20 negatives of 16-float rows: about 27 GiB for one step.
    let big = train_spec_with(
        &ds,
        &dir.path().join("big"),
        1,
        &[
            "training.negatives.negatives_per_positive=1048576",
            "training.negatives.num_chunks=100",
            "training.batch_size=1000",
        ],
    );
    let id = c.job(Request::Submit { job: big }).id;
    let done = wait_for(&mut c, id, Duration::from_secs(60), |j| j.state.is_final());
    assert_eq!(done.state, JobState::Failed, "{done:?}");
    let error = done.error.unwrap_or_default();
    assert!(error.contains("negatives"), "{error}");
    assert!(matches!(c.call(Request::Hello), Reply::Hello { .. }));
}

/// A job the daemon keeps dying under is failed at the third start that finds it running,
/// instead of being started again (a job that kills the daemon would otherwise keep it down);
/// a checkpoint in between shows it was not the job.
#[test]
fn a_job_the_daemon_keeps_dying_under_is_failed_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let out = dir.path().join("run");
    let id;
    {
        let mut d = Daemon::start(dir.path());
        let mut c = d.client();
        id = c
            .job(Request::Submit {
                job: train_spec(&ds, &out, 50),
            })
            .id;
        wait_for(&mut c, id, Duration::from_secs(120), |j| {
            j.state == JobState::Running
        });
        d.signal(SIGKILL);
        d.wait();
    }
    // As if two earlier starts had found it running already, with no checkpoint since.
    let record = dir.path().join(format!("state/jobs/{id}.json"));
    let mut r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    assert_eq!(r["info"]["state"], "running", "{r}");
    r["interruptions"] = 2.into();
    std::fs::write(&record, serde_json::to_vec(&r).unwrap()).unwrap();
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let job = c.job(Request::Status { job: id });
    assert_eq!(job.state, JobState::Failed, "{job:?}");
    assert!(
        job.error.unwrap_or_default().contains("stopped 3 times"),
        "the reason is given"
    );
}

/// A namespace's store path must be one of the module's device nodes: any other path is
/// refused alike whether something lies there or not (the daemon opens it with its rights).
#[test]
fn an_nvme_store_path_that_is_no_device_node_is_refused_unopened() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"x").unwrap();
    let answers: Vec<String> = [secret.clone(), dir.path().join("missing")]
        .iter()
        .map(|path| {
            let store = format!("storage.path=\"{}\"", path.display());
            let spec = train_spec_with(
                &ds,
                &dir.path().join("run"),
                1,
                &["storage.backend=\"nvme\"", &store],
            );
            refusal(c.call(Request::Submit { job: spec }))
        })
        .collect();
    for a in &answers {
        assert!(a.contains("takes a device node of legend_nvme"), "{a}");
    }
    assert_eq!(
        answers[0].replace("secret", "X"),
        answers[1].replace("missing", "X")
    );
    assert_eq!(std::fs::read(&secret).unwrap(), b"x");
}

/// A store striped over namespaces is refused up front (the daemon's extents are of one
/// namespace a job); over files, every member's path is checked like `storage.path`.
#[test]
fn a_job_striped_over_namespaces_is_refused_and_file_members_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let nvme = train_spec_with(
        &ds,
        &dir.path().join("run"),
        1,
        &[
            "storage.backend=\"nvme\"",
            "storage.device=[{path=\"/dev/legend-nvme0\"},{path=\"/dev/legend-nvme1\"}]",
        ],
    );
    let a = refusal(c.call(Request::Submit { job: nvme }));
    assert!(
        a.contains("storage.device: legendd gives a job an extent"),
        "{a}"
    );
    let blocked = dir.path().join("not-a-dir");
    std::fs::write(&blocked, b"x").unwrap();
    let member = blocked.join("store.bin");
    let devices = format!(
        "storage.device=[{{path=\"{}\"}},{{path=\"{}\"}}]",
        dir.path().join("a.bin").display(),
        member.display()
    );
    let file = train_spec_with(
        &ds,
        &dir.path().join("run"),
        1,
        &["storage.backend=\"file\"", &devices],
    );
    let a = refusal(c.call(Request::Submit { job: file }));
    assert!(a.contains(&blocked.display().to_string()), "{a}");
}

/// A watch on a quiet (queued) job whose client went away gives its connection back within
/// moments, not when the job next says something.
#[test]
fn a_closed_watch_on_a_quiet_job_frees_its_connection() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("legendd.toml"),
        "cpu_jobs = 1\nmax_connections = 3\nreserved_connections = 0\n",
    )
    .unwrap();
    let ds = dataset(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let running = c.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("a"), 500),
    });
    let queued = c.job(Request::Submit {
        job: train_spec(&ds, &dir.path().join("b"), 1),
    });
    for _ in 0..2 {
        let mut w = d.client();
        write_message(
            &mut w.0,
            &Envelope {
                v: PROTOCOL_VERSION,
                request: Request::Watch { job: queued.id },
            },
        )
        .unwrap();
        drop(w);
    }
    // Three connections were open (c and two watches); the watches' go back.
    let started = Instant::now();
    loop {
        // A refused connection may be closed before the request is written: any failure is
        // "not admitted".
        let mut probe = d.client();
        let admitted = write_message(
            &mut probe.0,
            &Envelope {
                v: PROTOCOL_VERSION,
                request: Request::Hello,
            },
        )
        .is_ok()
            && matches!(
                read_message::<Reply>(&mut probe.0, MAX_FRAME),
                Ok(Some(Reply::Hello { .. }))
            );
        if admitted {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the closed watches still hold their connections"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    c.job(Request::Cancel { job: running.id });
}

/// What one user can make the daemon keep is bounded: ended jobs (by
/// `max_ended_jobs_per_user`, until they delete some), a job's configuration, an eval's
/// protocol and split (refused at submission, not kept in a record nor quoted back).
#[test]
fn ended_jobs_and_spec_sizes_kept_for_a_user_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("legendd.toml"),
        "max_ended_jobs_per_user = 2\n",
    )
    .unwrap();
    let ds = dataset(dir.path());
    let run = broken_run(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let mut ended = Vec::new();
    for n in 0..2 {
        let id = c
            .job(Request::Submit {
                job: export_spec(&run, n),
            })
            .id;
        wait_for(&mut c, id, Duration::from_secs(30), |j| j.state.is_final());
        ended.push(id);
    }
    let why = refusal(c.call(Request::Submit {
        job: export_spec(&run, 2),
    }));
    assert!(why.contains("max_ended_jobs_per_user = 2"), "{why}");
    c.job(Request::Delete { job: ended[0] });
    c.job(Request::Submit {
        job: export_spec(&run, 3),
    });
    // A 400 KB protocol is refused in a line, a 100 KB configuration by its size.
    let long = "x".repeat(400_000);
    let why = refusal(c.call(Request::Submit {
        job: JobSpec::Eval {
            run: run.clone(),
            protocol: long.clone(),
            split: "test".into(),
        },
    }));
    assert!(why.len() < 200 && why.contains("protocol"), "{why:.200}");
    let mut spec = train_spec(&ds, &dir.path().join("r"), 1);
    if let JobSpec::Train { config, .. } = &mut spec {
        *config = format!("# {}\n", &long[..100_000]);
    }
    let why = refusal(c.call(Request::Submit { job: spec }));
    assert!(why.contains("at most 65536"), "{why:.200}");
}

/// However long a job runs, its log in the daemon's state stays bounded: past 512 KiB it moves
/// to `ID.log.1` and starts again (a tiny graph trains thousands of epochs a minute).
#[test]
fn a_long_jobs_log_in_the_state_directory_stays_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("tiny");
    let mut o = GenerateOptions::new(50, 200);
    o.relations = 1;
    generate(&o, &ds).unwrap();
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let spec = JobSpec::Train {
        dataset: Some(ds),
        out: dir.path().join("run"),
        config: String::new(),
        sets: [
            "model.dim=2",
            "training.threads=1",
            "training.batch_size=200",
            "training.num_epochs=4000000000",
            "evaluation.protocol=sampled",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        resume: false,
    };
    let id = c.job(Request::Submit { job: spec }).id;
    let jobs = dir.path().join("state/jobs");
    let (log, old) = (
        jobs.join(format!("{id}.log")),
        jobs.join(format!("{id}.log.1")),
    );
    let started = Instant::now();
    while !old.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the log never moved aside"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A connection idle past request_timeout_s is closed by the daemon: a new one.
    let mut c = d.client();
    let cancelled = c.call(Request::Cancel { job: id });
    assert!(matches!(cancelled, Reply::Job { .. }), "{cancelled:?}");
    wait_for(&mut c, id, Duration::from_secs(30), |j| j.state.is_final());
    for path in [&log, &old] {
        let len = std::fs::metadata(path).unwrap().len();
        assert!(len <= 512 << 10, "{}: {len} bytes", path.display());
    }
    let deleted = c.call(Request::Delete { job: id });
    assert!(matches!(deleted, Reply::Job { .. }), "{deleted:?}");
    assert!(!old.exists() && !log.exists());
}

#[test]
fn a_served_run_answers_its_owner_and_its_group_and_refuses_anyone_else() {
    if !may_switch_uids("a_served_run_answers_its_owner_and_its_group") {
        return;
    }
    use legend_query::{Answer, Query, QueryRun, Residency};
    let dir = shared_tempdir();
    let ds = dir.path().join("ds");
    let mut o = GenerateOptions::new(400, 3000);
    o.relations = 3;
    generate(&o, &ds).unwrap();
    let run = dir.path().join("run");
    reference(&ds, &run, 1);
    chown_tree(&run, OTHER_UID);
    // The run's rows (the owner's) and the dataset's labels (root's), which no one else may
    // write: mapped by the serve job as a query command maps them.
    let meta = legend_engine::run::read_meta(&legend_engine::run::open(&run).unwrap()).unwrap();
    let rows = run.join(&meta.checkpoint).join("entities.bin");
    let mode = |path: &Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    for file in [&rows, &ds.join("entities.tsv"), &ds.join("relations.tsv")] {
        mode(file, 0o644);
    }
    let d = Daemon::start(dir.path());
    // The owner's primary group: a second user in it may query, a third may not.
    let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(OTHER_UID))
        .unwrap()
        .expect("the other uid's group exists")
        .name;
    let mut owner = connect_as(&d, OTHER_UID);
    let job = owner.job(Request::Submit {
        job: JobSpec::Serve {
            run: run.clone(),
            group: Some(group),
            device: None,
        },
    });
    let queries: Vec<Query> = serde_json::from_str(
        r#"[
        {"query": "predict", "head": "e1", "relation": "r0", "top": 5},
        {"query": "predict", "tail": "e2", "relation": "r2", "top": 7, "filtered": true},
        {"query": "score", "head": "e3", "relation": "r1", "tail": "e4"},
        {"query": "neighbors", "entity": "e5", "top": 4, "metric": "cosine"},
        {"query": "lookup", "entity": "e6"}
    ]"#,
    )
    .unwrap();
    let wire = Queries::of(&queries).unwrap();
    let ask = |c: &mut Client| {
        c.call(Request::Query {
            job: job.id,
            queries: wire.clone(),
        })
    };
    // Answered once the run is loaded (`unavailable` until then).
    let first = ask_served(&mut owner, job.id, &queries);
    let want = QueryRun::open(&run, None, &legend_fs::Unguarded, Residency::Streamed)
        .unwrap()
        .answer(&queries, 1000, &|i| i.to_string())
        .unwrap();
    let answers = |reply: Reply| -> Vec<Answer> {
        let Reply::Answers { answers, seconds } = reply else {
            panic!("expected answers, got {reply:?}");
        };
        assert!(seconds >= 0.0);
        answers
            .into_iter()
            .map(|a| serde_json::from_value(a).unwrap())
            .collect()
    };
    assert_eq!(answers(first), want);
    // Two clients at once, the owner and a member of the group, get the same answers.
    let mut member = connect_as_ids(&d, 4242, OTHER_UID);
    std::thread::scope(|s| {
        for c in [&mut owner, &mut member] {
            let (ask, answers, want) = (&ask, &answers, &want);
            s.spawn(move || {
                for _ in 0..20 {
                    assert_eq!(&answers(ask(c)), want);
                }
            });
        }
    });
    // A third user is refused, the owner's unknown label is named.
    let mut stranger = connect_as(&d, 4243);
    match ask(&mut stranger) {
        Reply::Error {
            code: ErrorCode::Forbidden,
            message,
        } => assert!(message.contains("not yours"), "{message}"),
        other => panic!("a stranger was answered: {other:?}"),
    }
    let unknown =
        Queries::of(&[serde_json::json!({"query": "neighbors", "entity": "e4000"})]).unwrap();
    let why = refusal(owner.call(Request::Query {
        job: job.id,
        queries: unknown,
    }));
    assert!(why.contains("query 1: unknown entity \"e4000\""), "{why}");
    // The metrics count the queries answered, with their latency percentiles.
    let Reply::Text { text } = owner.call(Request::Metrics) else {
        panic!();
    };
    let line = format!(
        "legend_serve_queries_total{{job=\"{}\",owner=\"{OTHER_UID}\"}} 205",
        job.id
    );
    assert!(text.contains(&line), "{text}");
    assert!(text.contains("quantile=\"0.99\"}"), "{text}");
    let Reply::Text { text } = stranger.call(Request::Metrics) else {
        panic!();
    };
    assert!(!text.contains("legend_serve_queries_total{"), "{text}");
    // The job's status says where it answers (the daemon's `serve_device`, auto: the CPU
    // without a GPU, the answers above the same as the CPU's) and its figures.
    let status = owner.job(Request::Status { job: job.id });
    let serving = status.result.expect("a serving job shows its figures");
    assert_eq!(serving["queries"], 205, "{serving}");
    assert!(
        serving["latency_p99_s"].as_f64().unwrap() > 0.0,
        "{serving}"
    );
    let placement = serving["placement"].as_str().unwrap();
    if !legend_cuda::driver_present() {
        assert_eq!(placement, "cpu (auto: no CUDA driver)");
        assert_eq!(status.device.as_deref(), Some("cpu"));
    }
    // A device that is not one is refused when submitted, naming it.
    let why = refusal(owner.call(Request::Submit {
        job: JobSpec::Serve {
            run: run.clone(),
            group: None,
            device: Some("gpu".into()),
        },
    }));
    assert!(why.contains("unknown device \"gpu\""), "{why}");
    // Serving takes no CPU job slot: an eval job (cpu_jobs = 1) runs to its end beside it.
    let eval = owner.job(Request::Submit {
        job: JobSpec::Eval {
            run: run.clone(),
            protocol: "sampled".into(),
            split: "test".into(),
        },
    });
    let eval = wait_for(&mut owner, eval.id, Duration::from_secs(60), |j| {
        j.state.is_final()
    });
    assert_eq!(eval.state, JobState::Succeeded, "{eval:?}");
    assert_eq!(
        owner.job(Request::Status { job: job.id }).state,
        JobState::Running
    );
    // Cancelled, it ends and answers no more.
    owner.job(Request::Cancel { job: job.id });
    let ended = wait_for(&mut owner, job.id, Duration::from_secs(30), |j| {
        j.state.is_final()
    });
    assert_eq!(ended.state, JobState::Succeeded);
    assert!(refusal(ask(&mut owner)).contains("has ended"));
    let log = |c: &mut Client, job: u64| {
        let Reply::Text { text } = c.call(Request::Logs { job }) else {
            panic!("no log");
        };
        text
    };
    let text = log(&mut owner, job.id);
    assert!(
        text.contains("no file copied (mapped where their layout allows)"),
        "{text}"
    );
    // Rows its group may write could change under a mapping after they were checked: a serve
    // job reads them into its memory, says so, and answers the same.
    mode(&rows, 0o664);
    let copied = serve(&mut owner, &run);
    assert_eq!(answers(ask_served(&mut owner, copied, &queries)), want);
    let text = log(&mut owner, copied);
    assert!(
        text.contains(&format!(
            "read into memory, not mapped: {}: writable by its group (mode 664)",
            rows.display()
        )),
        "{text}"
    );
    owner.job(Request::Cancel { job: copied });
    wait_for(&mut owner, copied, Duration::from_secs(30), |j| {
        j.state.is_final()
    });
    // A GPU the machine does not have fails the job, naming it.
    let missing = owner.job(Request::Submit {
        job: JobSpec::Serve {
            run: run.clone(),
            group: None,
            device: Some("cuda:7".into()),
        },
    });
    let failed = wait_for(&mut owner, missing.id, Duration::from_secs(30), |j| {
        j.state.is_final()
    });
    assert_eq!(failed.state, JobState::Failed, "{failed:?}");
    let error = failed.error.unwrap_or_default();
    assert!(error.contains("serving on cuda:7"), "{error}");
    // Its rows swapped for a hard link to root's own file (of their size, mode 600), or for a
    // symbolic link to one anyone may read: the job, which opens what it maps or reads as its
    // submitter would, beneath the run's directory without following links, fails naming the
    // file, having read nothing of it.
    let bytes = std::fs::read(&rows).unwrap();
    let secret = dir.path().join("secret-rows");
    std::fs::write(&secret, &bytes).unwrap();
    mode(&secret, 0o600);
    let public = dir.path().join("public-rows");
    std::fs::write(&public, &bytes).unwrap();
    mode(&public, 0o644);
    for hard in [true, false] {
        std::fs::remove_file(&rows).unwrap();
        let why = if hard {
            std::fs::hard_link(&secret, &rows).unwrap();
            "Permission denied"
        } else {
            std::os::unix::fs::symlink(&public, &rows).unwrap();
            "a symbolic link: not followed"
        };
        let refused = serve(&mut owner, &run);
        let ended = wait_for(&mut owner, refused, Duration::from_secs(30), |j| {
            j.state.is_final()
        });
        assert_eq!(ended.state, JobState::Failed, "{ended:?}");
        let error = ended.error.unwrap_or_default();
        assert!(
            error.contains(&format!("{}: {why}", rows.display())),
            "{error}"
        );
    }
}

/// A daemon whose serve jobs may hold no entity rows in host memory (`serve_host_memory_mib =
/// 0`) serves every run streamed, answering exactly as the same run in memory: a file store of
/// 4 partitions in f32 (with reciprocal relations: heads predicted through r⁻¹'s rows) and in
/// bf16, and a run whose checkpoint is in files. Its status and metrics say so and count the
/// relations only as held.
#[test]
fn a_run_over_the_serve_jobs_host_memory_is_served_streamed_with_the_resident_answers() {
    use legend_query::{Answer, Completion, Model, Query, QueryRun, Residency};
    let dir = tempfile::tempdir().unwrap();
    let ds = streaming_daemon_setup(dir.path());
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let queries: Vec<Query> = serde_json::from_str(
        r#"[
        {"query": "predict", "head": "e1", "relation": "r0", "top": 10},
        {"query": "predict", "tail": "e2", "relation": "r2", "top": 10},
        {"query": "predict", "tail": "e350", "relation": "r1", "top": 7, "filtered": true},
        {"query": "score", "head": "e3", "relation": "r1", "tail": "e399"},
        {"query": "score", "head": "e250", "relation": "r0", "tail": "e3"},
        {"query": "neighbors", "entity": "e5", "top": 4, "metric": "cosine"},
        {"query": "neighbors", "entity": "e305", "top": 4, "metric": "dot"},
        {"query": "neighbors", "entity": "e105", "top": 4, "metric": "l2"},
        {"query": "lookup", "entity": "e0"},
        {"query": "lookup", "entity": "e99"},
        {"query": "lookup", "entity": "e100"},
        {"query": "lookup", "entity": "e399"}
    ]"#,
    )
    .unwrap();
    for (name, extra) in [
        (
            "file-f32",
            &["storage.backend=file", "model.reciprocal_relations=true"][..],
        ),
        (
            "file-bf16",
            &["storage.backend=file", "storage.dtype=bf16"][..],
        ),
        ("memory", &[][..]),
    ] {
        let run = dir.path().join(name);
        let mut sets = vec!["training.device=cpu"];
        sets.extend_from_slice(extra);
        reference_with(&ds, &run, 2, &sets);
        let job = serve(&mut c, &run);
        let got = served_answers(ask_served(&mut c, job, &queries));
        let resident = QueryRun::open(&run, None, &legend_fs::Unguarded, Residency::Resident)
            .unwrap()
            .answer(&queries, 1000, &|i| i.to_string())
            .unwrap();
        assert_eq!(got, resident, "{name}");
        let status = c.job(Request::Status { job });
        let serving = status.result.expect("a serving job shows its figures");
        let placement = serving["placement"].as_str().unwrap();
        assert_eq!(
            placement,
            "cpu; entity rows streamed from the run by each scan (streamed: 25.0 KiB of entity \
             rows, more than the 0.0 KiB a serve job may hold (serve_host_memory))",
            "{name}"
        );
        assert!(
            serving["streamed"]
                .as_str()
                .unwrap()
                .contains("serve_host_memory"),
            "{serving}"
        );
        // Held: the relation rows only (3 relations, twice with their inverses, of 16 floats);
        // a scan's partitions (or blocks) come and go within stream_bytes.
        let relations = if name == "file-f32" { 6 } else { 3 } * 16 * 4;
        assert_eq!(serving["host_bytes"], relations, "{serving}");
        assert!(serving["stream_bytes"].as_u64().unwrap() > 0, "{serving}");
        let Reply::Text { text } = c.call(Request::Metrics) else {
            panic!();
        };
        let line = format!("legend_serve_resident_bytes{{job=\"{job}\",owner=\"0\"}} {relations}");
        assert!(text.contains(&line), "{text}");
        assert!(text.contains("legend_serve_stream_bytes{"), "{text}");
        if name == "file-f32" {
            // The head of (?, r2, e2) through r⁻¹: the tail side of (e2, r2⁻¹, ?), computed
            // here on the same rows with r2⁻¹ named as a relation of its own (row 3 + 2).
            let dir = legend_engine::run::open(&run).unwrap();
            let mut meta = legend_engine::run::read_meta(&dir).unwrap();
            meta.reciprocal_relations = false;
            let plain = Model::of_run(dir, meta, 6, &legend_fs::Unguarded, false).unwrap();
            let e2 = served_label_id(&got[1]);
            let ask = |side, relation| Completion {
                side,
                anchor: e2,
                relation,
                top: 10,
                filtered: false,
            };
            let found = plain
                .complete(
                    &[
                        ask(legend_model::Side::Dst, 5),
                        ask(legend_model::Side::Src, 2),
                    ],
                    None,
                )
                .unwrap();
            let Answer::Predict { hits, .. } = &got[1] else {
                panic!("{:?}", got[1]);
            };
            let served: Vec<(u32, u32)> = hits.iter().map(|h| (h.id, h.score.to_bits())).collect();
            let pairs = |f: &[legend_query::Ranked]| -> Vec<(u32, u32)> {
                f.iter().map(|r| (r.id, r.score.to_bits())).collect()
            };
            assert_eq!(served, pairs(&found[0]), "heads through r⁻¹");
            assert_ne!(served, pairs(&found[1]), "not through r's source side");
        }
        c.job(Request::Cancel { job });
        let ended = wait_for(&mut c, job, Duration::from_secs(30), |j| j.state.is_final());
        assert_eq!(ended.state, JobState::Succeeded, "{ended:?}");
    }
}

/// The id of the known end of a predict answer.
fn served_label_id(answer: &legend_query::Answer) -> u32 {
    match answer {
        legend_query::Answer::Predict { head: Some(n), .. }
        | legend_query::Answer::Predict { tail: Some(n), .. } => n.id,
        other => panic!("{other:?}"),
    }
}

/// A streamed run whose store or checkpoint is missing or damaged fails its serve job when it
/// loads, naming the file; a store damaged while it serves fails the requests that read it,
/// naming it, and the daemon lives on.
#[test]
fn a_streamed_run_with_a_missing_or_damaged_store_fails_naming_it() {
    use legend_query::Query;
    let dir = tempfile::tempdir().unwrap();
    let ds = streaming_daemon_setup(dir.path());
    let store_run = |name: &str| {
        let run = dir.path().join(name);
        let sets = ["training.device=cpu", "storage.backend=file"];
        reference_with(&ds, &run, 1, &sets);
        run
    };
    let (gone, damaged) = (store_run("gone"), store_run("damaged"));
    let memory = dir.path().join("memory");
    reference_with(&ds, &memory, 1, &["training.device=cpu"]);
    let d = Daemon::start(dir.path());
    let mut c = d.client();
    let failed = |c: &mut Client, run: &Path| {
        let job = serve(c, run);
        let ended = wait_for(c, job, Duration::from_secs(30), |j| j.state.is_final());
        assert_eq!(ended.state, JobState::Failed, "{ended:?}");
        ended.error.unwrap_or_default()
    };
    // A store that is not there.
    let store = gone.join("store.bin");
    std::fs::remove_file(&store).unwrap();
    let error = failed(&mut c, &gone);
    assert!(
        error.contains(&store.display().to_string()) && error.contains("No such file"),
        "{error}"
    );
    // A checkpoint file with a flipped byte: its checksum, checked by the load's pass.
    let checkpoint = memory.join(
        legend_engine::run::read_meta(&legend_engine::run::open(&memory).unwrap())
            .unwrap()
            .checkpoint,
    );
    let entities = checkpoint.join("entities.bin");
    let mut bytes = std::fs::read(&entities).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&entities, bytes).unwrap();
    let error = failed(&mut c, &memory);
    assert!(
        error.contains("entities.bin") && error.contains("checksum mismatch"),
        "{error}"
    );
    // A store cut short while it serves: scans and lookups of its last rows fail, naming it.
    let job = serve(&mut c, &damaged);
    let lookup: Vec<Query> =
        serde_json::from_str(r#"[{"query": "lookup", "entity": "e399"}]"#).unwrap();
    served_answers(ask_served(&mut c, job, &lookup));
    let store = damaged.join("store.bin");
    let len = std::fs::metadata(&store).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&store)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let predict: Vec<Query> =
        serde_json::from_str(r#"[{"query": "predict", "head": "e1", "relation": "r0", "top": 3}]"#)
            .unwrap();
    for queries in [&predict, &lookup] {
        match ask_served(&mut c, job, queries) {
            Reply::Error {
                code: ErrorCode::Refused,
                message,
            } => assert!(
                message.contains(&store.display().to_string()) && message.contains("end of file"),
                "{message}"
            ),
            other => panic!("a cut store answered: {other:?}"),
        }
    }
    assert_eq!(
        c.job(Request::Status { job }).state,
        JobState::Running,
        "the job keeps serving"
    );
}
