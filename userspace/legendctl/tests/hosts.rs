//! `legendctl train` on two "hosts": two processes on this machine, each with two CPU workers,
//! meeting at a rendezvous on the loopback interface (their partitions travel over the job's
//! connections; on GPUs they go through NCCL). They train exactly what one trainer trains
//! running the same schedule serially; a host stopped or killed stops the other, named; the
//! rendezvous refuses a host of another configuration or token; runs resume on another number
//! of hosts.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{bin, s};
use legend_dataset::{Dataset, GenerateOptions, generate};
use legend_engine::{Config, Engine, MemoryStore, PartitionHome, Relations, Trainer};
use legend_fs::{Dir, Unguarded};

const TOKEN: &str = "a-token-for-the-tests-0123";

fn dataset(dir: &Path) -> PathBuf {
    let ds = dir.join("ds");
    let mut options = GenerateOptions::new(2000, 30_000);
    options.relations = 5;
    generate(&options, &ds).unwrap();
    ds
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The settings of every run here (each host two CPU workers).
const SETS: &[&str] = &[
    "model.decoder=dot",
    "model.dim=16",
    "training.threads=1",
    "training.batch_size=64",
    "training.device=\"cpu\"",
    "training.negatives.degree_fraction=0.5",
    "training.checkpoint_minutes=0",
    "evaluation.protocol=sampled",
];

/// A `legendctl` started here, its output read as it comes (so that it never blocks on a full
/// pipe): stdout's lines, as they come and all of them, and stderr.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: JoinHandle<String>,
    stderr: JoinHandle<String>,
}

impl Running {
    fn start(mut cmd: Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting legendctl");
        let (tx, lines) = mpsc::channel();
        let out = BufReader::new(child.stdout.take().unwrap());
        let stdout = std::thread::spawn(move || {
            let mut all = String::new();
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line.clone());
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut all = String::new();
            let _ = err.read_to_string(&mut all);
            all
        });
        Running {
            child,
            lines,
            stdout,
            stderr,
        }
    }

    /// The first line of stdout (within a minute).
    fn first_line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(60))
            .expect("a line of output within a minute")
    }

    fn signal(&self, sig: i32) {
        // SAFETY: a signal to a child this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// Waits for the end (at most `limit`): the status, stdout and stderr.
    fn finish(mut self, limit: Duration) -> (ExitStatus, String, String) {
        let started = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "legendctl did not end within {limit:?}: {}",
                    self.stderr.join().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (
            status,
            self.stdout.join().unwrap(),
            self.stderr.join().unwrap(),
        )
    }
}

/// `legendctl train` as host `rank` of `hosts` at `port`, with `extra` arguments.
fn host(
    rank: u32,
    hosts: u32,
    port: u16,
    ds: &Path,
    out: &Path,
    extra: &[&str],
    token: &str,
) -> Running {
    let mut cmd = Command::new(bin());
    cmd.args(["train", "--dataset", &s(ds), "--out", &s(out), "--json"]);
    for set in SETS {
        cmd.args(["--set", set]);
    }
    if !extra.contains(&"--gpus") {
        cmd.args(["--gpus", "2"]);
    }
    cmd.args(["--hosts", &hosts.to_string()])
        .args(["--host-rank", &rank.to_string()])
        .args(["--rendezvous", &format!("127.0.0.1:{port}")])
        .args(extra)
        .env("LEGEND_JOB_TOKEN", token)
        .env("LEGEND_LOG", "info")
        .env("LEGEND_LAUNCH", "none");
    Running::start(cmd)
}

/// Two hosts of `extra` arguments each (both `extra_both`), to their end.
fn two_hosts(ds: &Path, run: &Path, extra_both: &[&str]) -> [(ExitStatus, String, String); 2] {
    let port = free_port();
    let other = run.with_extension("host1");
    let zero = host(0, 2, port, ds, run, extra_both, TOKEN);
    let one = host(1, 2, port, ds, &other, extra_both, TOKEN);
    let limit = Duration::from_secs(120);
    let one = one.finish(limit);
    let zero = zero.finish(limit);
    assert!(!other.exists(), "only host 0 writes the run");
    [zero, one]
}

fn tables(run: &Path) -> Vec<f32> {
    let dir = Dir::open(run).unwrap();
    let meta = legend_engine::run::read_meta(&dir).unwrap();
    let t = legend_engine::run::load_tables(&dir, &meta, &Unguarded).unwrap();
    [t.entities, t.entities_state, t.relations, t.relations_state].concat()
}

/// What one trainer holding every partition trains running the hosts × GPUs schedule of
/// the run `run` serially for `epochs` epochs (round after round, GPU after GPU; with
/// relations, the GPUs' shares of a round in lockstep, their relation gradients summed): the
/// entity rows and state, then the relations'.
fn serial(ds: &Path, run: &Path, epochs: u32) -> Vec<f32> {
    let text = std::fs::read_to_string(run.join("config.toml")).unwrap();
    let workers = Config::parse(&text, &[]).unwrap();
    let (hosts, gpus) = (workers.training.hosts, workers.training.gpus);
    let k = (hosts * gpus) as usize;
    let n = workers.storage.num_partitions;
    assert_eq!(n as usize, 2 * k, "{hosts} hosts of {gpus} GPUs: N = 2HK");
    let config = Config::parse(
        &text,
        &[
            "training.gpus=1".into(),
            "training.hosts=1".into(),
            format!("storage.num_partitions={n}"),
            format!("storage.buffer_capacity={n}"),
        ],
    )
    .unwrap();
    let dataset = Dataset::open(ds).unwrap();
    let buckets = dataset.buckets(n).unwrap();
    let batch = config.training.batch_size as u64;
    let batches: Vec<u64> = buckets.counts().iter().map(|c| c.div_ceil(batch)).collect();
    let schedule = legend_planner::plan_hosts(n, hosts, gpus, &batches).unwrap();
    let degrees = legend_dataset::degrees(dataset.meta().entities as usize, buckets.edges());
    let rows = config.relation_rows(dataset.meta().relations) as usize;
    let relations = Relations::init(config.decoder(), rows, config.model.dim, &config.init());
    let home = PartitionHome::Memory(MemoryStore::new(config.storage.dtype));
    let engine = Engine::open(&config).unwrap();
    let mut t = Trainer::on_device(&config, buckets, &degrees, home, relations, engine).unwrap();
    t.make_resident(&(0..n).collect::<Vec<_>>()).unwrap();
    for epoch in 1..=epochs {
        for r in schedule.round_order(epoch) {
            let round = &schedule.rounds[r];
            if config.decoder().uses_relations() {
                let shares: Vec<(&[legend_planner::Piece], [u32; 2])> = (0..k)
                    .map(|g| (round.work[g].as_slice(), round.held[g]))
                    .collect();
                let steps = round.lockstep_steps();
                t.train_lockstep(epoch, &shares, steps).unwrap();
                continue;
            }
            for g in 0..k {
                t.train_pieces(epoch, &round.work[g], &round.held[g], &mut |_| {})
                    .unwrap();
            }
        }
    }
    let (mut emb, mut state) = (Vec::new(), Vec::new());
    for p in 0..n {
        t.stream_partition(p, &mut |e, s| {
            emb.extend_from_slice(e);
            state.extend_from_slice(s);
            Ok(())
        })
        .unwrap();
    }
    t.sync_relations().unwrap();
    let r = t.relations();
    [emb, state, r.emb.clone(), r.state.clone()].concat()
}

fn epoch_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(common::json)
        .filter(|v| v.get("epoch").is_some())
        .collect()
}

#[test]
fn two_hosts_train_exactly_the_serialised_schedule_and_only_host_zero_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    // Dot; DistMult's relation gradients summed over the 4 workers of both hosts every step.
    for decoder in ["dot", "distmult"] {
        let run = tmp.path().join(decoder);
        let decoder_set = format!("model.decoder={decoder}");
        let sets = ["--set", "training.num_epochs=2", "--set", &decoder_set];
        let [(zero, out, log0), (one, out1, log1)] = two_hosts(&ds, &run, &sets);
        assert!(zero.success(), "host 0: {log0}");
        assert!(one.success(), "host 1: {log1}");
        assert!(out1.is_empty(), "host 1 prints no results: {out1}");
        assert!(log1.contains("the job completed"), "{log1}");
        let epochs = epoch_lines(&out);
        assert_eq!(epochs.len(), 2, "{out}");
        let train = Dataset::open(&ds).unwrap().meta().splits.train;
        for e in &epochs {
            assert_eq!(e["edges"], train, "every train edge once an epoch: {e}");
            let w = &e["workers"];
            assert_eq!(w["gpus"], 4);
            assert_eq!(w["hosts"], 2);
            // 2 hosts × 2 GPUs: 7 rounds, 6 transitions of 4 hand-overs, 2 of them between
            // host-rounds (K·(2H − 2) = 8 cross hosts).
            assert_eq!(w["handovers"], 24);
            assert_eq!(w["cross_host_handovers"], 8);
            assert_eq!(w["host_peak_rss_bytes"].as_array().unwrap().len(), 2);
            assert_eq!(w["devices"].as_array().unwrap().len(), 4);
        }
        assert!(
            log0.contains("holds the") && log1.contains("holds the"),
            "each host says which buckets it holds"
        );
        let trained = tables(&run);
        let want = serial(&ds, &run, 2);
        assert_eq!(trained.len(), want.len());
        assert!(
            trained == want,
            "{decoder}: the two hosts trained differently from the serialised schedule"
        );
    }
}

#[test]
fn three_hosts_of_one_worker_train_the_serialised_schedule_and_a_lost_host_is_named_on_every_other()
{
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let start = |name: &str, epochs: &str, extra: &[&str]| -> Vec<Running> {
        let port = free_port();
        let mut args = vec!["--gpus", "1", "--set", epochs, "--host-timeout", "3"];
        args.extend_from_slice(extra);
        (0..3)
            .map(|r| {
                let out = tmp.path().join(format!("{name}-{r}"));
                host(r, 3, port, &ds, &out, &args, TOKEN)
            })
            .collect()
    };
    // K = 3 workers on 3 hosts, N = 6: what one trainer trains running the schedule serially.
    let hosts = start(
        "three",
        "training.num_epochs=1",
        &["--set", "model.decoder=distmult"],
    );
    let ended: Vec<_> = hosts
        .into_iter()
        .map(|h| h.finish(Duration::from_secs(120)))
        .collect();
    for (r, (status, _, log)) in ended.iter().enumerate() {
        assert!(status.success(), "host {r}: {log}");
    }
    let epoch = epoch_lines(&ended[0].1).pop().expect("an epoch on 3 hosts");
    assert_eq!(epoch["workers"]["hosts"], 3);
    let run = tmp.path().join("three-0");
    assert!(!tmp.path().join("three-1").exists() && !tmp.path().join("three-2").exists());
    assert!(
        tables(&run) == serial(&ds, &run, 1),
        "3 hosts trained differently"
    );
    // Host 2 killed mid-run: hosts 0 and 1 both fail, naming it, within seconds.
    let mut hosts = start("lost", "training.num_epochs=100000", &[]);
    let line = hosts[0].first_line();
    assert!(line.contains("\"epoch\""), "host 0 trains: {line:?}");
    let two = hosts.pop().unwrap();
    two.signal(libc::SIGKILL);
    let killed_at = Instant::now();
    for (r, h) in hosts.into_iter().enumerate() {
        let (status, _, log) = h.finish(Duration::from_secs(60));
        assert!(!status.success(), "host {r} went on without host 2");
        assert!(
            log.contains("host 2 ("),
            "host {r} does not name host 2: {log}"
        );
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "{:?}",
        killed_at.elapsed()
    );
    let _ = two.finish(Duration::from_secs(10));
}

/// Starts two hosts on a long run and waits until host 0 reported an epoch: the job runs.
fn running(tmp: &Path, ds: &Path, extra: &[&str]) -> (Running, Running) {
    let port = free_port();
    let mut args = vec!["--set", "training.num_epochs=100000", "--host-timeout", "3"];
    args.extend_from_slice(extra);
    let zero = host(0, 2, port, ds, &tmp.join("run"), &args, TOKEN);
    let one = host(1, 2, port, ds, &tmp.join("other"), &args, TOKEN);
    let line = zero.first_line();
    assert!(line.contains("\"epoch\""), "host 0 trains: {line:?}");
    (zero, one)
}

#[test]
fn a_stopped_or_killed_host_stops_the_other_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    // Host 1 stopped (SIGSTOP keeps its sockets open): host 0 gives it up after the host
    // timeout (3 s), naming it.
    let (zero, one) = running(tmp.path(), &ds, &[]);
    one.signal(libc::SIGSTOP);
    let stopped_at = Instant::now();
    let (status, _, log) = zero.finish(Duration::from_secs(60));
    assert!(!status.success());
    assert!(
        log.contains("host 1 (") && log.contains("sent nothing for 3 s"),
        "{log}"
    );
    assert!(
        stopped_at.elapsed() < Duration::from_secs(20),
        "{:?}",
        stopped_at.elapsed()
    );
    one.signal(libc::SIGKILL);
    let _ = one.finish(Duration::from_secs(10));
    // Host 0 killed: host 1 sees its connection close at once.
    let tmp = tempfile::tempdir().unwrap();
    let (zero, one) = running(tmp.path(), &ds, &[]);
    zero.signal(libc::SIGKILL);
    let killed_at = Instant::now();
    let (status, _, log) = one.finish(Duration::from_secs(60));
    assert!(!status.success());
    assert!(
        log.contains("host 0 (") && log.contains("closed its connection"),
        "{log}"
    );
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "{:?}",
        killed_at.elapsed()
    );
    let _ = zero.finish(Duration::from_secs(10));
}

/// Two "hosts" in network namespaces of their own, joined by a veth pair (10.46.0.1 and .2),
/// inside a user namespace (no privilege needed beyond creating one): `sh` runs this with the
/// directory for its records, then the `legendctl train` command both hosts share. Once host 0
/// reports its first epoch, the link goes down (packets are dropped, no connection is closed:
/// what a cut cable or a dead switch does). Each host's output, and its exit status with the
/// time it ended, go to files; so does the time the link went down.
const LINK_GOES_DOWN: &str = r#"
set -eu
dir=$1; shift
mount -t tmpfs tmpfs /run
ip netns add h0; ip netns add h1
ip link add v0 netns h0 type veth peer name v1 netns h1
for r in 0 1; do
    ip -n h$r addr add 10.46.0.$((r + 1))/24 dev v$r
    ip -n h$r link set v$r up
    ip -n h$r link set lo up
done
for r in 0 1; do
    ( set +e
      ip netns exec h$r "$@" --host-rank $r --out "$dir/run$r" --rendezvous 10.46.0.1:29400 \
          >"$dir/out$r" 2>"$dir/err$r"
      echo "$? $(date +%s%N)" >"$dir/end$r" ) &
done
tries=0
until grep -q '"epoch"' "$dir/out0"; do
    if [ -e "$dir/end0" ] || [ $tries -ge 1200 ]; then
        echo "host 0 reported no epoch"; cat "$dir/err0" "$dir/err1"; exit 1
    fi
    sleep 0.05; tries=$((tries + 1))
done
date +%s%N >"$dir/down"
ip -n h0 link set v0 down
wait
"#;

#[test]
fn the_network_going_down_mid_run_stops_both_hosts_within_the_host_timeout_naming_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let mut cmd = Command::new("unshare");
    cmd.args(["--user", "--map-root-user", "--net", "--mount", "sh", "-c"])
        .args([LINK_GOES_DOWN, "sh", &s(tmp.path()), bin()])
        .args([
            "train",
            "--dataset",
            &s(&ds),
            "--json",
            "--gpus",
            "2",
            "--hosts",
            "2",
        ])
        .args(["--host-timeout", "3", "--set", "training.num_epochs=100000"]);
    for set in SETS {
        cmd.args(["--set", set]);
    }
    cmd.env("LEGEND_JOB_TOKEN", TOKEN)
        .env("LEGEND_LOG", "info")
        .env("LEGEND_LAUNCH", "none");
    let (status, out, err) = Running::start(cmd).finish(Duration::from_secs(90));
    assert!(
        status.success(),
        "network namespaces (unshare --user --net --mount, ip netns, veth) must work here: {out}{err}"
    );
    let read = |name: &str| std::fs::read_to_string(tmp.path().join(name)).unwrap();
    let nanos = |text: &str| text.trim().parse::<u64>().unwrap();
    let down = nanos(&read("down"));
    for (r, other) in [(0, 1), (1, 0)] {
        let end = read(&format!("end{r}"));
        let (code, at) = end.trim().split_once(' ').unwrap();
        let log = read(&format!("err{r}"));
        assert_ne!(code, "0", "host {r} failed: {log}");
        // The host timeout (3 s), a heartbeat's period and the time to end the process.
        let took = Duration::from_nanos(nanos(at) - down);
        assert!(
            took < Duration::from_secs(10),
            "host {r} ended {took:?} after the link went down: {log}"
        );
        assert!(
            log.contains(&format!("host {other} (")) && log.contains("sent nothing for 3 s"),
            "host {r}: {log}"
        );
    }
    assert!(
        !tmp.path().join("run1").exists(),
        "only host 0 writes the run"
    );
}

#[test]
fn a_stop_asked_on_host_one_checkpoints_and_the_run_resumes_on_one_host_or_two() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let run = tmp.path().join("run");
    let (zero, one) = running(tmp.path(), &ds, &["--set", "storage.dtype=\"bf16\""]);
    one.signal(libc::SIGINT);
    let (s1, _, log1) = one.finish(Duration::from_secs(60));
    let (s0, _, log0) = zero.finish(Duration::from_secs(60));
    assert_eq!(s1.code(), Some(130), "{log1}");
    assert_eq!(s0.code(), Some(130), "{log0}");
    assert!(
        log0.contains("interrupted") && log0.contains("checkpointed"),
        "{log0}"
    );
    let dir = Dir::open(&run).unwrap();
    let meta = legend_engine::run::read_meta(&dir).unwrap();
    let trained = meta.epochs_completed + u32::from(meta.cut.is_some());
    // On one host (its 2 workers) from an epoch boundary: a cut inside an epoch on 2 hosts
    // finishes on 2 hosts only.
    let resume_one = |epochs: u32| {
        let mut cmd = Command::new(bin());
        cmd.args([
            "train",
            "--out",
            &s(&run),
            "--resume",
            "--gpus",
            "2",
            "--json",
        ])
        .args(["--set", &format!("training.num_epochs={epochs}")])
        .env("LEGEND_LAUNCH", "none");
        cmd.output().unwrap()
    };
    let two_hosts_resume = |epochs: u32| {
        let port = free_port();
        let sets = [
            "--resume",
            "--set",
            &format!("training.num_epochs={epochs}"),
        ];
        let zero = host(0, 2, port, &ds, &run, &sets, TOKEN);
        let one = host(1, 2, port, &ds, &tmp.path().join("other"), &sets, TOKEN);
        let (s1, _, log1) = one.finish(Duration::from_secs(120));
        let (s0, out0, log0) = zero.finish(Duration::from_secs(120));
        assert!(s0.success() && s1.success(), "{log0}\n{log1}");
        out0
    };
    if meta.cut.is_some() {
        let refused = resume_one(trained + 1);
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success());
        assert!(err.contains("training.hosts = 2"), "{err}");
        // Finished on two hosts (the checkpoint's partitions laid out over both).
        two_hosts_resume(trained);
    }
    let done = resume_one(trained + 1);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    // And back on two hosts: the one host's tables scattered over both.
    let out0 = two_hosts_resume(trained + 2);
    let last = epoch_lines(&out0)
        .pop()
        .expect("an epoch trained on 2 hosts");
    assert_eq!(last["workers"]["hosts"], 2);
    assert!(last["loss"].as_f64().unwrap().is_finite());
}

#[test]
fn the_rendezvous_refuses_another_configuration_or_token_naming_why() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let port = free_port();
    let base = [
        "--set",
        "training.num_epochs=1",
        "--rendezvous-timeout",
        "20",
    ];
    let zero = host(0, 2, port, &ds, &tmp.path().join("a"), &base, TOKEN);
    let mut other = base.to_vec();
    other.extend(["--set", "model.dim=32"]);
    let one = host(1, 2, port, &ds, &tmp.path().join("b"), &other, TOKEN);
    let (s1, _, log1) = one.finish(Duration::from_secs(60));
    let (s0, _, log0) = zero.finish(Duration::from_secs(60));
    assert!(!s0.success() && !s1.success());
    for log in [&log0, &log1] {
        assert!(
            log.contains("host 1 (")
                && log.contains("config model.dim is 32 there and 16 on host 0"),
            "{log}"
        );
    }
    assert!(
        !tmp.path().join("a").exists(),
        "a refused job writes nothing"
    );
    // A wrong token is refused; host 0 waits on for the real host 1, then names it.
    let port = free_port();
    let short = [
        "--set",
        "training.num_epochs=1",
        "--rendezvous-timeout",
        "3",
    ];
    let zero = host(0, 2, port, &ds, &tmp.path().join("c"), &short, TOKEN);
    let one = host(
        1,
        2,
        port,
        &ds,
        &tmp.path().join("d"),
        &short,
        "another-token-entirely",
    );
    let (s1, _, log1) = one.finish(Duration::from_secs(60));
    let (s0, _, log0) = zero.finish(Duration::from_secs(60));
    assert!(
        !s1.success() && log1.contains("does not hold this job's token"),
        "{log1}"
    );
    assert!(
        !s0.success()
            && log0.contains(&format!("rendezvous at 127.0.0.1:{port}"))
            && log0.contains("host 1 did not arrive within 3 s"),
        "{log0}"
    );
    // No token at all: refused before anything, saying how to set one.
    let mut cmd = Command::new(bin());
    cmd.args([
        "train",
        "--dataset",
        &s(&ds),
        "--out",
        &s(&tmp.path().join("e")),
    ])
    .args([
        "--hosts",
        "2",
        "--host-rank",
        "1",
        "--rendezvous",
        "127.0.0.1:9",
    ])
    .env_remove("LEGEND_JOB_TOKEN")
    .env("LEGEND_LAUNCH", "none");
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("LEGEND_JOB_TOKEN"),
        "{err}"
    );
}
