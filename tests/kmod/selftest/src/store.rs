//! Training runs that keep their partitions on the controller through the `nvme` backend:
//! `/bin/legendctl train` with `storage.backend = "nvme"` against the same run on the `file`
//! backend, SIGKILL and `--resume`, the store's handling of a command the controller fails, and
//! a store striped over two controllers (`[[storage.device]]`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use legend_nvme::{Controller, Doorbells, Mapping, QueuePairDoorbells, uapi};
use legend_storage::{
    CreateOptions, DatasetId, Dtype, Expect, IoBuffer, IoConfig, NvmeTarget, Region, Store,
    StoreError, StoreSpec, Target,
};

use crate::*;

pub const TESTS: &[(&str, Test)] = &[
    ("nvme-backend-trains-like-file", test_train_equals_file),
    ("nvme-backend-sigkill-resume", test_sigkill_resume),
    ("nvme-store-command-error", test_command_error),
    (
        "nvme-backend-striped-over-two-controllers-trains-like-file",
        test_striped_equals_file,
    ),
];

const WORK: &str = "/tmp/train";
/// Where the runs' stores start: past every block the other tests use.
const START_LBA: &str = "storage.start_lba=10240";

fn legendctl(args: &[&str]) -> Result<String, String> {
    legendctl_logging(args, "warn").map(|(stdout, _)| stdout)
}

/// `legendctl` with its log at `level`: its standard output and its log.
fn legendctl_logging(args: &[&str], level: &str) -> Result<(String, String), String> {
    let o = Command::new(LEGENDCTL)
        .args(args)
        .env("LEGEND_LOG", level)
        .output()
        .map_err(|e| format!("run {LEGENDCTL}: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "`legendctl {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok((
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    ))
}

/// The dataset every run here trains (made once).
fn dataset() -> Result<String, String> {
    let ds = format!("{WORK}/ds");
    if !Path::new(&ds).exists() {
        std::fs::create_dir_all(WORK).map_err(|e| e.to_string())?;
        legendctl(&[
            "generate",
            "--nodes",
            "1000",
            "--edges",
            "8000",
            "--relations",
            "4",
            "--split",
            "1,0,0",
            &ds,
        ])?;
    }
    Ok(ds)
}

fn train_args(out: &str, backend: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--out",
        out,
        "--set",
        "model.dim=16",
        "--set",
        "storage.num_partitions=4",
        "--set",
        "storage.buffer_capacity=3",
        "--set",
        "training.num_epochs=3",
        "--set",
        "training.batch_size=128",
        "--set",
        "training.negatives.negatives_per_positive=16",
        "--set",
        "training.checkpoint_every=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(["--set".into(), format!("storage.backend={backend}")]);
    if backend == "nvme" {
        a.extend([
            "--set".into(),
            format!("storage.path={DEV}"),
            "--set".into(),
            START_LBA.into(),
            // Each run here overwrites the store the one before left at the same LBAs.
            "--set".into(),
            "storage.force=true".into(),
        ]);
    }
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// A fresh run (with `--dataset`): how long it took, and its log.
fn train(out: &str, backend: &str) -> Result<(Duration, String), String> {
    let ds = dataset()?;
    let mut a = train_args(out, backend, &[]);
    a.splice(1..1, ["--dataset".to_string(), ds]);
    let start = Instant::now();
    let (_, log) = legendctl_logging(&a.iter().map(String::as_str).collect::<Vec<_>>(), "info")?;
    Ok((start.elapsed(), log))
}

/// The exported entity and relation tables of a run.
fn tables(run: &str) -> Result<Vec<u8>, String> {
    let out = format!("{run}.export");
    let _ = std::fs::remove_dir_all(&out);
    legendctl(&["export", run, "--format", "bin", "-o", &out])?;
    let mut all = Vec::new();
    for f in ["entities.bin", "relations.bin"] {
        all.extend(std::fs::read(format!("{out}/{f}")).map_err(|e| format!("{out}/{f}: {e}"))?);
    }
    Ok(all)
}

/// The reference: the same run on the file backend.
fn reference() -> Result<Vec<u8>, String> {
    let run = format!("{WORK}/file");
    if !Path::new(&run).exists() {
        train(&run, "file")?;
    }
    tables(&run)
}

fn test_train_equals_file() -> TestResult {
    let want = reference()?;
    let run = format!("{WORK}/nvme");
    let (took, log) = train(&run, "nvme")?;
    let got = tables(&run)?;
    println!(
        "[guest] nvme backend: 3 epochs in {:.1} s",
        took.as_secs_f64()
    );
    check(got == want, || {
        "the nvme backend's tables differ from the file backend's".into()
    })?;
    let meta = std::fs::read_to_string(format!("{run}/run.toml")).map_err(|e| e.to_string())?;
    check(meta.contains("backend = \"nvme\""), || {
        format!("run.toml does not record the nvme store: {meta}")
    })?;
    // The first line says what an epoch writes and how worn the device says it is.
    check(
        log.contains("written to the store an epoch")
            && log.contains("of its rated endurance used"),
        || format!("the run's log does not report the device's wear: {log}"),
    )
}

/// Killed at two moments of training or checkpointing, then resumed: the tables of an
/// uninterrupted run, every time.
fn test_sigkill_resume() -> TestResult {
    let want = reference()?;
    let ds = dataset()?;
    let (full, _) = train(&format!("{WORK}/nvme-timing"), "nvme")?;
    for (trial, frac) in [0.35, 0.7].into_iter().enumerate() {
        let out = format!("{WORK}/kill{trial}");
        let mut a = train_args(&out, "nvme", &[]);
        a.splice(1..1, ["--dataset".to_string(), ds.clone()]);
        let mut child = Command::new(LEGENDCTL)
            .args(&a)
            .env("LEGEND_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        std::thread::sleep(full.mul_f64(frac));
        let _ = child.kill();
        let _ = child.wait();
        if !Path::new(&format!("{out}/run.toml")).exists() {
            // Killed before the store was recorded: a fresh run.
            let _ = std::fs::remove_dir_all(&out);
            train(&out, "nvme")?;
        } else {
            let r = Command::new(LEGENDCTL)
                .args(["train", "--out", &out, "--resume"])
                .env("LEGEND_LOG", "warn")
                .output()
                .map_err(|e| e.to_string())?;
            let err = String::from_utf8_lossy(&r.stderr);
            check(
                r.status.success() || err.contains("already has 3 epochs"),
                || format!("trial {trial}: resume failed: {err}"),
            )?;
        }
        check(tables(&out)? == want, || {
            format!(
                "trial {trial} (killed at {:.0}%): resumed tables differ",
                frac * 100.0
            )
        })?;
    }
    Ok(())
}

/// The real controller behind a view that doubles the namespace: the store lays partitions out
/// past the real end, and the controller refuses the commands that reach there.
struct Oversized(legend_nvme::Device);

impl Controller for Oversized {
    fn label(&self) -> &str {
        self.0.label()
    }
    fn info(&self) -> legend_nvme::Result<uapi::Info> {
        let mut info = self.0.info()?;
        info.namespaces[0].blocks *= 2;
        Ok(info)
    }
    unsafe fn map_host(&self, addr: *mut u8, len: usize) -> legend_nvme::Result<Mapping> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.map_host(addr, len) }
    }
    unsafe fn map_gpu(&self, addr: u64, len: usize) -> legend_nvme::Result<Mapping> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.map_gpu(addr, len) }
    }
    fn unmap(&self, handle: u32) -> legend_nvme::Result<()> {
        self.0.unmap(handle)
    }
    fn create_queue_pair(&self, args: uapi::QueuePairArgs) -> legend_nvme::Result<QueuePairDoorbells> {
        self.0.create_queue_pair(args)
    }
    fn delete_queue_pair(&self, qid: u32) -> legend_nvme::Result<()> {
        self.0.delete_queue_pair(qid)
    }
    fn doorbells(&self) -> legend_nvme::Result<Doorbells> {
        self.0.doorbells()
    }
}

/// A write the controller fails (LBA Out of Range, past its real end) ends the store's transfer
/// with the decoded status and the LBA, and nothing of it is committed.
fn test_command_error() -> TestResult {
    let device = legend_nvme::Device::open(DEV).map_err(|e| e.to_string())?;
    let blocks = device.info().map_err(|e| e.to_string())?.namespaces[0].blocks;
    let target = NvmeTarget {
        controller: Arc::new(Oversized(device)),
        namespace: 1,
        // 3 MiB before the real end: the two superblock slots (1 MiB each) and two of the four
        // 512 KiB partitions fit, the others do not.
        start_lba: blocks - 6144,
    };
    let spec = StoreSpec {
        dataset: DatasetId {
            id: [9; 16],
            label: "selftest".into(),
        },
        num_nodes: 8192,
        dim: 32,
        dtype: Dtype::F32,
        state_width: 32,
        num_partitions: 4,
        aux_bytes: 64,
        progress_capacity: 64,
        shadow: false,
    };
    let opts = CreateOptions {
        force: true,
        ..CreateOptions::default()
    };
    let mut store = Store::create_on(&Target::Nvme(&target), &spec, &opts)
        .map_err(|e| format!("create: {e}"))?;
    let mut b = IoBuffer::new(store.max_partition_bytes()).map_err(|e| e.to_string())?;
    b.as_f32_mut().fill(1.5);
    let mut failed = None;
    for p in 0..4 {
        if let Err(e) = store.write(Region::Partition(p), &b) {
            failed = Some((p, e));
            break;
        }
    }
    let Some((p, e)) = failed else {
        return Err("every partition was written past the namespace's end".into());
    };
    let msg = e.to_string();
    check(
        matches!(e, StoreError::Command { .. })
            && msg.contains("LBA Out of Range")
            && msg.contains("write of"),
        || format!("partition {p}: {msg}"),
    )?;
    // Closed (the controller goes with its last reference), then opened again.
    let start_lba = target.start_lba;
    drop((store, target));
    let device = legend_nvme::Device::open(DEV).map_err(|e| e.to_string())?;
    let target = NvmeTarget {
        controller: Arc::new(Oversized(device)),
        namespace: 1,
        start_lba,
    };
    let store = Store::open_on(
        &Target::Nvme(&target),
        &Expect::default(),
        &IoConfig::default(),
    )
    .map_err(|e| format!("reopen: {e}"))?;
    check(
        store.generation() == 0 && !store.is_initialized(Region::Partition(0)).unwrap_or(true),
        || format!("generation {} after a failed write", store.generation()),
    )
}

/// A store striped over the test controller and a second one (`$LEGEND_STRIPE_BDF`, kept from
/// every driver until here): the second is bound to legend_nvme, a run over both gives the
/// `file` backend's tables, each controller holds a share, and the second is unbound again
/// (left to no driver) so the tests after this one see the controllers as before.
fn test_striped_equals_file() -> TestResult {
    let want = reference()?;
    let bdf = expect_env("LEGEND_STRIPE_BDF");
    let bound = legend_nvme::Sysfs::default()
        .bind(&bdf, false)
        .map_err(|e| format!("binding {bdf}: {e}"))?;
    let result = (|| {
        let second = bound
            .char_device
            .clone()
            .ok_or_else(|| format!("{bdf} bound without a device node: {bound:?}"))?;
        let devices = format!(
            "storage.device=[{{path=\"{DEV}\",start_lba=10240}},{{path=\"{second}\",start_lba=2048}}]"
        );
        let ds = dataset()?;
        let run = format!("{WORK}/striped");
        let mut a = train_args(&run, "file", &[]);
        a.splice(1..1, ["--dataset".to_string(), ds]);
        a.extend(
            [
                "--set",
                "storage.backend=nvme",
                "--set",
                &devices,
                "--set",
                "storage.stripe_bytes=65536",
                "--set",
                "storage.force=true",
            ]
            .map(String::from),
        );
        let start = Instant::now();
        legendctl(&a.iter().map(String::as_str).collect::<Vec<_>>())?;
        println!(
            "[guest] nvme backend striped over two controllers: 3 epochs in {:.1} s",
            start.elapsed().as_secs_f64()
        );
        check(tables(&run)? == want, || {
            "the striped nvme store's tables differ from the file backend's".into()
        })?;
        let meta = std::fs::read_to_string(format!("{run}/run.toml")).map_err(|e| e.to_string())?;
        check(
            meta.contains(&second) && meta.contains("[[store_members]]"),
            || format!("run.toml does not record both members: {meta}"),
        )
    })();
    // Off legend_nvme, to no driver (its override stays legend_nvme): nothing else takes it.
    let unbound = std::fs::write("/sys/bus/pci/drivers/legend_nvme/unbind", &bdf)
        .map_err(|e| format!("unbinding {bdf}: {e}"));
    result.and(unbound)
}
