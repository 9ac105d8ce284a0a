//! `legendctl device list|bind|info|health|unbind`, run as an administrator would: the static
//! `/bin/legendctl` is spawned and its exit status, stderr and `--json` output are checked
//! against sysfs, the ioctls and what QEMU emulates. One round trip, `nvme` → `legend_nvme` →
//! `nvme`; the controller is left on `nvme` for the tests that follow.

use std::{
    fs::{self, File},
    os::unix::fs::FileTypeExt,
    process::Command,
};

use serde_json::{Value, json};

use legend_nvme::Sysfs;

use crate::{basic::admin, bind::wait_for, *};

const NAMESPACE: &str = "/dev/nvme0n1";

struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn legendctl(args: &[&str]) -> Result<Output, String> {
    let o = Command::new(LEGENDCTL)
        .args(args)
        .output()
        .map_err(|e| format!("run {LEGENDCTL}: {e}"))?;
    Ok(Output {
        code: o.status.code(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    })
}

/// `legendctl ARGS` must succeed; its stdout, parsed as JSON.
fn legendctl_json(args: &[&str]) -> Result<Value, String> {
    let o = legendctl(args)?;
    let cmd = args.join(" ");
    if o.code != Some(0) {
        return Err(format!(
            "`legendctl {cmd}` exited with {:?}: {}",
            o.code,
            o.stderr.trim()
        ));
    }
    serde_json::from_str(&o.stdout)
        .map_err(|e| format!("`legendctl {cmd}` printed no JSON ({e}): {:?}", o.stdout))
}

/// Every field of `want` (an object) is in `got` with the same value; `got` may have more.
fn has_fields(what: &str, got: &Value, want: &Value) -> TestResult {
    let Some(want) = want.as_object() else {
        return Err(format!("{what}: expected fields are not an object"));
    };
    for (k, w) in want {
        match got.get(k) {
            Some(g) if g == w => {}
            g => return Err(format!("{what}: {k} is {g:?}, want {w} (all: {got})")),
        }
    }
    Ok(())
}

fn controller(bdf: &str, driver: &str, block: &[&str], legend: Option<&str>) -> Value {
    json!({
        "bdf": bdf,
        "driver": driver,
        "vendor": format!("{:04x}", QEMU_PCI_ID.0),
        "device": format!("{:04x}", QEMU_PCI_ID.1),
        "block_devices": block,
        "legend_device": legend,
    })
}

/// `device list --json` (and the text form) while `nvme` holds the controller.
fn test_list(bdf: &str) -> TestResult {
    let v = legendctl_json(&["device", "list", "--json"])?;
    let all = v.as_array().map(Vec::as_slice).unwrap_or_default();
    let Some(c) = all.iter().find(|c| c.get("bdf") == Some(&json!(bdf))) else {
        return Err(format!("{bdf} not in the list {v}"));
    };
    has_fields("list", c, &controller(bdf, "nvme", &["nvme0n1"], None))?;
    let o = legendctl(&["device", "list"])?;
    check(
        o.code == Some(0)
            && o.stdout.lines().any(|l| {
                l.starts_with(bdf) && l.contains("driver nvme") && l.contains("block nvme0n1")
            }),
        || format!("text list exited {:?}: {:?}", o.code, o.stdout),
    )
}

/// `device bind BDF` while this process holds the namespace open: refused, naming the use.
fn test_bind_refused(bdf: &str) -> TestResult {
    let o = legendctl(&["device", "bind", bdf])?;
    let open_by = format!("{NAMESPACE} is open by process {}", std::process::id());
    check(
        o.code.is_some_and(|c| c != 0)
            && o.stderr.contains("in use")
            && o.stderr.contains(&open_by)
            && o.stderr.contains("--force"),
        || {
            format!(
                "bind while open: exit {:?}, stderr {:?} (want `{open_by}`)",
                o.code, o.stderr
            )
        },
    )?;
    let c = Sysfs::default()
        .controller(bdf)
        .map_err(|e| e.to_string())?;
    check(
        c.driver.as_deref() == Some("nvme") && fs::metadata(NAMESPACE).is_ok(),
        || format!("refused bind still moved the controller: {c:?}"),
    )
}

/// `device bind BDF --force` with the namespace still open: bound, `/dev/legend-nvme0` there.
fn test_bind_forced(bdf: &str) -> TestResult {
    let v = legendctl_json(&["device", "bind", bdf, "--force", "--json"])?;
    has_fields("bind", &v, &controller(bdf, "legend_nvme", &[], Some(DEV)))?;
    let m = fs::metadata(DEV).map_err(|e| format!("{DEV}: {e}"))?;
    check(m.file_type().is_char_device(), || {
        format!("{DEV} is not a character device")
    })
}

/// `device info --json` (default device): what QEMU emulates, as the `info` test checks through
/// the ioctl, and the remaining fields equal to the ioctl's.
fn test_info(bdf: &str) -> TestResult {
    let v = legendctl_json(&["device", "info", "--json"])?;
    let info = Dev::open_ro()?.info()?;
    let blocks: u64 = expect_env("LEGEND_BLOCKS").parse().unwrap_or(0);
    let vs = info.nvme_version;
    has_fields(
        "info",
        &v,
        &json!({
            "device": DEV,
            "abi_version": uapi::ABI_VERSION,
            "pci_address": bdf,
            "model": QEMU_MODEL,
            "serial": expect_env("LEGEND_SERIAL"),
            "max_queue_entries": QEMU_MQES,
            "doorbell_stride": QEMU_DOORBELL_STRIDE,
            "namespaces": [{"nsid": 1, "lba_bytes": BLOCK, "lbas": blocks}],
            "nvme_version": format!("{}.{}.{}", vs >> 16, (vs >> 8) & 0xff, vs & 0xff),
            "firmware": trimmed(&info.firmware),
            "max_transfer": info.max_transfer,
            "queue_pairs": info.queue_pairs,
        }),
    )?;
    check(
        vs >= 0x10400 && info.queue_pairs >= QUEUES as u32 && !trimmed(&info.firmware).is_empty(),
        || {
            format!(
                "ioctl info: version {vs:#x}, {} queue pairs, firmware {:?}",
                info.queue_pairs,
                trimmed(&info.firmware)
            )
        },
    )?;
    let o = legendctl(&["device", "info", DEV])?;
    check(
        o.code == Some(0) && o.stdout.contains(QEMU_MODEL) && o.stdout.contains(bdf),
        || format!("text info exited {:?}: {:?}", o.code, o.stdout),
    )
}

/// `device health --json`: sane values, equal to the SMART log read through the passthrough.
fn test_health() -> TestResult {
    let v = legendctl_json(&["device", "health", "--json"])?;
    let mut log = vec![0u8; 512];
    let a = admin(
        &Dev::open_ro()?,
        uapi::ADMIN_OPC_GET_LOG_PAGE,
        u32::MAX,
        u32::from(uapi::LOG_ID_SMART),
        &mut log,
    )
    .map_err(|e| format!("smart: errno {e}"))?;
    check(a.status == 0, || format!("smart status {}", a.status))?;
    let at = |o: usize| u64::from_le_bytes(log[o..o + 8].try_into().expect("8 bytes"));
    let celsius = i64::from(u16::from_le_bytes([log[1], log[2]])) - 273;
    has_fields(
        "health",
        &v,
        &json!({
            "device": DEV,
            "critical_warning": 0,
            "temperature_celsius": celsius,
            "available_spare_percent": log[3],
            "percentage_used": log[5],
            "power_on_hours": at(128),
            "unsafe_shutdowns": at(144),
            "media_errors": 0,
        }),
    )?;
    check(
        log[0] == 0
            && (1..=100).contains(&celsius)
            && log[3] <= 100
            && log[5] <= 100
            && at(160) == 0,
        || {
            format!(
                "SMART log: warning {:#x}, {celsius} °C, spare {}%, used {}%, {} media errors",
                log[0],
                log[3],
                log[5],
                at(160)
            )
        },
    )?;
    // Counters only grow: what legendctl read is at most what the later read saw.
    for (key, offset) in [("data_units_read", 32), ("data_units_written", 48)] {
        let got = v.get(key).and_then(Value::as_u64);
        check(got.is_some_and(|g| g <= at(offset)), || {
            format!("health: {key} {got:?}, SMART log has {}", at(offset))
        })?;
    }
    Ok(())
}

/// `device unbind BDF`: back on `nvme`, the namespace reappears, the legend node is gone and
/// `device info` says so.
fn test_unbind(bdf: &str) -> TestResult {
    let v = legendctl_json(&["device", "unbind", bdf, "--json"])?;
    has_fields(
        "unbind",
        &v,
        &json!({"bdf": bdf, "driver": "nvme", "legend_device": null}),
    )?;
    wait_for(NAMESPACE)?;
    check(fs::metadata(DEV).is_err(), || format!("{DEV} still exists"))?;
    let list = legendctl_json(&["device", "list", "--json"])?;
    has_fields(
        "list after unbind",
        list.get(0).unwrap_or(&Value::Null),
        &controller(bdf, "nvme", &["nvme0n1"], None),
    )?;
    let o = legendctl(&["device", "info"])?;
    check(
        o.code.is_some_and(|c| c != 0) && o.stderr.contains(&format!("Cannot open {DEV}")),
        || {
            format!(
                "info after unbind: exit {:?}, stderr {:?}",
                o.code, o.stderr
            )
        },
    )
}

/// The controller's driver and `driver_override`, as sysfs shows them.
fn binding(bdf: &str) -> Result<(Option<String>, String), String> {
    let c = Sysfs::default()
        .controller(bdf)
        .map_err(|e| e.to_string())?;
    let path = format!("/sys/bus/pci/devices/{bdf}/driver_override");
    let over = fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    Ok((c.driver, over.trim().to_owned()))
}

/// `device bind BDF` where the platform lacks what the module requires: refused, naming `fix`,
/// before anything changed (the controller keeps its driver and `driver_override`).
pub fn test_refused_by_platform(bdf: &str, fix: &str) -> TestResult {
    let before = binding(bdf)?;
    let o = legendctl(&["device", "bind", bdf])?;
    check(
        o.code.is_some_and(|c| c != 0) && o.stderr.contains(fix),
        || {
            format!(
                "bind: exit {:?}, stderr {:?} (want the fix `{fix}`)",
                o.code, o.stderr
            )
        },
    )?;
    let after = binding(bdf)?;
    check(after == before, || {
        format!("the refused bind changed (driver, driver_override) from {before:?} to {after:?}")
    })
}

/// `device unbind BDF` and `device bind BDF` of a controller that the module bound with an
/// `enable_unsafe_*` parameter: legendctl applies the parameters (shown in
/// `/sys/module/legend_nvme/parameters/`) as the module does, so both succeed.
pub fn test_roundtrip(bdf: &str) -> TestResult {
    let v = legendctl_json(&["device", "unbind", bdf, "--json"])?;
    has_fields("unbind", &v, &json!({"bdf": bdf, "driver": "nvme"}))?;
    wait_for(NAMESPACE)?;
    let v = legendctl_json(&["device", "bind", bdf, "--json"])?;
    has_fields("bind", &v, &json!({"bdf": bdf, "driver": "legend_nvme"}))?;
    Dev::open_ro()?.info().map(|_| ())
}

/// The `legendctl-*` tests, in order; the controller starts and ends on `nvme`.
pub fn run(bdf: &str) {
    report("legendctl-list", || test_list(bdf));
    // Held open across the refused and the forced bind, as a running program would.
    let held = File::open(NAMESPACE).map_err(|e| format!("open {NAMESPACE}: {e}"));
    report("legendctl-bind-refused-in-use", || {
        held.as_ref()
            .map_err(Clone::clone)
            .and_then(|_| test_bind_refused(bdf))
    });
    report("legendctl-bind-force", || test_bind_forced(bdf));
    drop(held);
    report("legendctl-info", || test_info(bdf));
    report("legendctl-health", test_health);
    report("legendctl-unbind", || test_unbind(bdf));
    // Whatever failed above, hand the controller back so the tests after these start as usual.
    let sysfs = Sysfs::default();
    if sysfs
        .controller(bdf)
        .is_ok_and(|c| c.driver.as_deref() != Some("nvme"))
    {
        let _ = sysfs.unbind(bdf);
    }
    let _ = wait_for(NAMESPACE);
}
