//! Selftests of the `legend_nvme` kernel module, run inside QEMU by `tests/kmod/run`.
//!
//! Subcommands:
//! - `gen-image PATH BLOCKS` (host): writes the NVMe backing image with a known pattern;
//! - `verify-image PATH` (host, after the guest ran): checks the blocks the guest wrote;
//! - `guest` (in QEMU): the ioctl, I/O, isolation (also against the admin queue), bad-input,
//!   failure, undo (output faults after pinning or creating) and cleanup tests, and
//!   training runs whose store is on the controller (`storage.backend = "nvme"`);
//! - `unbind BDF` (in QEMU): unbind and rebind with an open file descriptor and live queue;
//! - `legendctl BDF` (in QEMU, controller bound to `nvme`): `legendctl device list|bind|info|
//!   health|unbind` spawned from `/bin/legendctl`, a round trip back to `nvme` (see `legendctl.rs`);
//! - `bind BDF` (in QEMU, controller bound to `nvme`): `legend-nvme`'s `Sysfs::list` and
//!   `Sysfs::bind`, refused while the namespace is open, then forced;
//! - `bind-refused BDF NAME WHY` (in QEMU): binding `BDF` fails, and the kernel log says `WHY`;
//! - `legendctl-refused BDF NAME FIX` (in QEMU): `legendctl device bind BDF` refuses before it
//!   changes anything, naming `FIX` (the platform lacks what the module requires);
//! - `legendctl-roundtrip BDF` (in QEMU, controller bound with an unsafe parameter):
//!   `legendctl device unbind` and `bind`, which applies the module's parameters;
//! - `io` (in QEMU): identification and I/O only (the boot without an IOMMU);
//! - `gpu` (in QEMU, with the `nv_p2p_fake` test double of NVIDIA's P2P API loaded): GPU
//!   mappings, DMA through them, the free callback and its races, the threaded fuzz loop;
//! - `handback BDF` (in QEMU): `Sysfs::unbind` back to `nvme`, reading through the block device,
//!   and `Sysfs::bind` again.
//!
//! Each test prints `ok NAME` or `FAIL NAME: reason`; the runner counts those lines. Every test
//! also checks that it left no pins behind: the module's `bytes_pinned` and the kernel's own
//! FOLL_PIN counters (`/proc/vmstat`) are where they were before it.

use std::{
    fs::{self, File},
    io::{Read, Seek, SeekFrom, Write},
};

use legend_uapi as uapi;

mod basic;
mod bind;
mod dev;
mod failure;
mod gpu;
mod isolation;
mod legendctl;
mod rules;
mod store;
mod undo;

use dev::*;

pub const BLOCK: usize = 512;
pub const PAGE: usize = 4096;
/// First LBA the guest writes (seed 1); the host checks these after the run.
pub const WRITE_BASE: u64 = 4096;
/// Blocks written per queue by the concurrent test.
pub const WRITE_SPAN: u64 = 256;
pub const QUEUES: u64 = 4;
pub const DEV: &str = "/dev/legend-nvme0";
/// What QEMU's `-device nvme` emulates (with the runner's serial and image size in the
/// environment): checked through the ioctl by `info` and through `legendctl` by `legendctl-info`.
pub const QEMU_MODEL: &str = "QEMU NVMe Ctrl";
pub const QEMU_MQES: u32 = 2048;
pub const QEMU_DOORBELL_STRIDE: u32 = 4;
pub const QEMU_PCI_ID: (u16, u16) = (0x1b36, 0x0010);
/// The CLI under test, built statically by the runner.
pub const LEGENDCTL: &str = "/bin/legendctl";

pub type TestResult = Result<(), String>;
pub type Test = fn() -> TestResult;

/// Deterministic block contents: `seed` 0 is the image as generated, 1 what the guest writes.
pub fn pattern(lba: u64, seed: u64) -> Vec<u8> {
    let mut x =
        lba.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (seed + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
    let mut out = Vec::with_capacity(BLOCK);
    while out.len() < BLOCK {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

pub fn check(cond: bool, msg: impl FnOnce() -> String) -> TestResult {
    if cond { Ok(()) } else { Err(msg()) }
}

pub fn trimmed(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_end_matches([' ', '\0'])
        .to_string()
}

pub fn expect_env(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

/// Collects `expect` failures of a table of bad calls.
#[derive(Default)]
pub struct Expectations(Vec<String>);

impl Expectations {
    /// `got` must be `Err(want)`.
    pub fn errno(&mut self, name: &str, got: Result<(), i32>, want: i32) {
        if got != Err(want) {
            self.0
                .push(format!("{name}: got {got:?}, want errno {want}"));
        }
    }

    pub fn fail(&mut self, msg: String) {
        self.0.push(msg);
    }

    pub fn result(self) -> TestResult {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self.0.join("; "))
        }
    }
}

/// A sysfs attribute of the bound controller in `/sys/bus/pci/devices/<BDF>/legend_nvme/`.
pub fn attr(name: &str) -> Result<u64, String> {
    let path = format!(
        "/sys/bus/pci/devices/{}/legend_nvme/{name}",
        expect_env("LEGEND_BDF")
    );
    let text = fs::read_to_string(&path).map_err(|e| format!("read {path}: {e}"))?;
    text.trim()
        .parse()
        .map_err(|_| format!("{name}: {text:?} is not a number"))
}

/// The driver's `queue_pairs`, `bytes_pinned` and `admin_commands`.
pub fn counters() -> Result<[u64; 3], String> {
    Ok([
        attr("queue_pairs")?,
        attr("bytes_pinned")?,
        attr("admin_commands")?,
    ])
}

/// Pages the kernel holds FOLL_PIN pins on (acquired minus released).
pub fn kernel_pins() -> Result<i64, String> {
    // Per-CPU counter deltas reach /proc/vmstat lazily; a write here folds them in first.
    fs::write("/proc/sys/vm/stat_refresh", "1").map_err(|e| format!("stat_refresh: {e}"))?;
    let text = fs::read_to_string("/proc/vmstat").map_err(|e| format!("/proc/vmstat: {e}"))?;
    let get = |key: &str| -> Result<i64, String> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .ok_or_else(|| format!("/proc/vmstat has no {key}"))
    };
    Ok(get("nr_foll_pin_acquired ")? - get("nr_foll_pin_released ")?)
}

/// What a test must give back: the module's pinned bytes (while bound) and the kernel's pins.
#[derive(Debug, PartialEq, Eq)]
struct Pins {
    module: Option<u64>,
    kernel: i64,
}

impl Pins {
    fn now() -> Result<Self, String> {
        Ok(Self {
            module: attr("bytes_pinned").ok(),
            kernel: kernel_pins()?,
        })
    }
}

/// Runs `t`, and prints `ok NAME` if it passed and left no pins behind.
pub fn report(name: &str, t: impl FnOnce() -> TestResult + std::panic::UnwindSafe) {
    let before = Pins::now();
    let r = std::panic::catch_unwind(t).unwrap_or_else(|_| Err("panicked".into()));
    let r = r.and_then(|()| {
        let (before, after) = (before?, Pins::now()?);
        // The module's counter is compared only while the controller is bound before and after.
        let module_ok =
            before.module.is_none() || after.module.is_none() || before.module == after.module;
        check(module_ok && before.kernel == after.kernel, || {
            format!("pins leaked: before {before:?}, after {after:?}")
        })
    });
    match r {
        Ok(()) => println!("ok {name}"),
        Err(e) => println!("FAIL {name}: {e}"),
    }
}

fn run_all(tests: &[(&str, Test)]) {
    for &(name, t) in tests {
        report(name, t);
    }
}

fn gen_image(path: &str, blocks: u64) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(File::create(path)?);
    for lba in 0..blocks {
        f.write_all(&pattern(lba, 0))?;
    }
    f.flush()
}

fn verify_image(path: &str) -> TestResult {
    let mut f = File::open(path).map_err(|e| e.to_string())?;
    let mut block = vec![0u8; BLOCK];
    let end = WRITE_BASE + 8 + QUEUES * WRITE_SPAN;
    for lba in WRITE_BASE..end {
        f.seek(SeekFrom::Start(lba * BLOCK as u64))
            .map_err(|e| e.to_string())?;
        f.read_exact(&mut block).map_err(|e| e.to_string())?;
        check(block == pattern(lba, 1), || {
            format!("lba {lba} does not hold what the guest wrote")
        })?;
    }
    // A block next to the written range keeps the generated contents.
    f.seek(SeekFrom::Start(end * BLOCK as u64))
        .map_err(|e| e.to_string())?;
    f.read_exact(&mut block).map_err(|e| e.to_string())?;
    check(block == pattern(end, 0), || format!("lba {end} changed"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    match arg(1).as_str() {
        "gen-image" => {
            gen_image(&arg(2), arg(3).parse().expect("block count")).expect("write image")
        }
        // On the host, whose pin counters other processes move.
        "verify-image" => match verify_image(&arg(2)) {
            Ok(()) => println!("ok image-contents"),
            Err(e) => println!("FAIL image-contents: {e}"),
        },
        "guest" => {
            run_all(basic::TESTS);
            run_all(rules::TESTS);
            run_all(failure::TESTS);
            run_all(undo::TESTS);
            run_all(isolation::TESTS);
            run_all(store::TESTS);
        }
        "unbind" => {
            report("unbind-rebind-open-fd", || bind::test_unbind(&arg(2)));
            report("unbind-with-map-stuck-in-userfaultfd", || {
                bind::test_unbind_stuck_map(&arg(2))
            });
        }
        "legendctl" => legendctl::run(&arg(2)),
        "legendctl-refused" => report(&format!("legendctl-bind-refused-{}", arg(3)), || {
            legendctl::test_refused_by_platform(&arg(2), &arg(4))
        }),
        "legendctl-roundtrip" => report("legendctl-roundtrip-with-override", || {
            legendctl::test_roundtrip(&arg(2))
        }),
        "bind" => {
            report("device-list", || bind::test_device_list(&arg(2)));
            report("bind-refused-in-use-then-forced", || {
                bind::test_bind_in_use(&arg(2))
            });
        }
        "bind-refused" => report(&format!("bind-refused-{}", arg(3)), || {
            bind::test_bind_refused(&arg(2), &arg(4))
        }),
        "gpu" => run_all(gpu::TESTS),
        "io" => run_all(basic::IO_TESTS),
        "handback" => report("unbind-to-nvme-and-rebind", || bind::test_handback(&arg(2))),
        _ => {
            eprintln!(
                "usage: legend-kmod-selftest gen-image PATH BLOCKS | verify-image PATH | guest | io | unbind BDF | legendctl BDF | legendctl-refused BDF NAME FIX | legendctl-roundtrip BDF | bind BDF | bind-refused BDF NAME LOG | handback BDF | gpu"
            );
            std::process::exit(2);
        }
    }
}
