//! The queue writer against the kernel's own admin queue: its DMA aimed exactly at the admin SQ,
//! CQ and data page (whose bus addresses debugfs shows root), and its writes to the admin
//! doorbells. The controller must run nothing the writer injected, the driver must take no
//! completion the writer forged, and a stray doorbell write must cost the next admin caller
//! nothing.

use std::fs;

use legend_nvme_protocol::Opcode;

use crate::{
    basic::{admin, identify_serial},
    *,
};

pub const TESTS: &[(&str, Test)] = &[
    ("admin-sq-not-writable", test_admin_sq),
    ("admin-data-page-unmapped", test_admin_data),
    ("admin-cq-forgery-not-trusted", test_admin_cq),
    ("admin-doorbell-poke-harmless", test_doorbell_poke),
    (
        "admin-doorbell-poke-racing-the-next-call",
        test_doorbell_race,
    ),
];

/// A block no other test reads or checks (next to the wild-PRP test's).
const STAGE_LBA: u64 = 9100;

/// A value from `/sys/kernel/debug/legend_nvme-<BDF>/`.
fn debug(name: &str) -> Result<u64, String> {
    let path = format!(
        "/sys/kernel/debug/legend_nvme-{}/{name}",
        expect_env("LEGEND_BDF")
    );
    let text = fs::read_to_string(&path).map_err(|e| format!("read {path}: {e}"))?;
    u64::from_str_radix(text.trim().trim_start_matches("0x"), 16)
        .map_err(|_| format!("{path}: {text:?} is not a hex number"))
}

/// Whether the kernel logged an IOMMU (DMAR) fault of the test controller in the page at `bus`.
fn dmar_fault_in(bus: u64) -> Result<bool, String> {
    let log = std::process::Command::new("dmesg")
        .output()
        .map_err(|e| format!("dmesg: {e}"))?;
    let bdf = expect_env("LEGEND_BDF");
    let dev_id = bdf.strip_prefix("0000:").unwrap_or(&bdf).to_owned();
    Ok(String::from_utf8_lossy(&log.stdout).lines().any(|l| {
        l.contains("DMAR")
            && l.contains(&dev_id)
            && l.split("fault addr 0x").nth(1).is_some_and(|rest| {
                let hex: String = rest.chars().take_while(char::is_ascii_hexdigit).collect();
                u64::from_str_radix(&hex, 16).is_ok_and(|a| a & !(PAGE as u64 - 1) == bus)
            })
    }))
}

/// Puts `block` on the disk at [`STAGE_LBA`] (through `stage`), then has the controller Read it
/// to bus address `target`; the Read's status, whatever it is.
fn read_block_to(q: &mut Queue, stage: &mut Buf, block: &[u8], target: u64) -> TestResult {
    stage.slice()[..BLOCK].copy_from_slice(block);
    let st = q.rw(Opcode::Write, STAGE_LBA, 1, stage, 0)?;
    check(st.is_success(), || format!("staging write: {st}"))?;
    q.rw_prp(Opcode::Read, STAGE_LBA, 1, target, 0).map(|_| ())
}

/// Writes `value` to the admin SQ tail doorbell, offset 0 of the doorbell mapping where the
/// doorbell stride is 4 bytes (QEMU's).
fn ring_admin_sq(db: &Doorbells, value: u64) {
    // SAFETY: an aligned dword inside the doorbell mapping.
    unsafe { db.ptr.cast::<u32>().write_volatile((value % 16) as u32) };
}

fn dwords(d: &[u32]) -> Vec<u8> {
    d.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A Read aimed at the admin SQ slot the driver uses next, carrying Identify commands that would
/// write into the writer's own page, then the admin SQ tail doorbell rung past that slot: the
/// IOMMU refuses the write (the SQ is mapped read-only for the device: the slot still reads as
/// the driver left it), the controller runs the cleared slot, and the next admin caller gets its
/// answer on the first try.
fn test_admin_sq() -> TestResult {
    let resets = attr("resets")?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let ro = Dev::open_ro()?;
    let serial = identify_serial(&ro)?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut stage = Buf::new(&dev, PAGE)?;
    let mut target = Buf::new(&dev, PAGE)?;
    target.slice().fill(0);
    let (sq, tail) = (debug("admin_sq_bus")?, debug("admin_sq_tail")?);
    // Identify Controller (CNS 1) into the writer's page, eight times: the block covers slots
    // `tail..tail + 8`.
    let mut sqe = [0u32; 16];
    sqe[0] = 0x06 | (0x7777 << 16);
    sqe[6] = target.bus[0] as u32;
    sqe[7] = (target.bus[0] >> 32) as u32;
    sqe[10] = 1;
    let injected = dwords(&sqe).repeat(8);
    read_block_to(&mut q, &mut stage, &injected, sq + tail * 64)?;
    // What the slots hold now, read by the controller (it may read the SQ) onto the disk and back.
    let st = q.rw_prp(Opcode::Write, STAGE_LBA + 1, 1, sq + tail * 64, 0)?;
    check(st.is_success(), || format!("write from the admin SQ: {st}"))?;
    let st = q.rw(Opcode::Read, STAGE_LBA + 1, 1, &stage, 0)?;
    check(st.is_success(), || format!("read back: {st}"))?;
    check(stage.slice()[..BLOCK] != injected[..], || {
        format!("the Read into the admin SQ at {sq:#x} landed")
    })?;
    ring_admin_sq(&db, tail + 1);
    // A round trip on the writer's queue lets the controller take the doorbell first.
    let st = q.rw(Opcode::Read, 100, 1, &stage, 0)?;
    check(st.is_success(), || format!("read after the doorbell: {st}"))?;
    let after = identify_serial(&ro).map_err(|e| format!("next admin caller: {e}"))?;
    check(after == serial, || format!("serial {after:?}"))?;
    check(target.slice().iter().all(|&b| b == 0), || {
        "the injected Identify ran: the writer's page holds identify data".into()
    })?;
    check(attr("resets")? == resets && attr("failed")? == 0, || {
        "the controller was reset".into()
    })
}

/// The admin data page is mapped only while its command runs: a Read aimed at the last one
/// faults in the IOMMU, and admin commands keep returning the controller's data.
fn test_admin_data() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let ro = Dev::open_ro()?;
    // Mapped first: a MAP after the admin command could be given the data page's bus address.
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let serial = identify_serial(&ro)?;
    let data = debug("admin_data_bus")?;
    check(data != 0, || "no admin data page was used".into())?;
    q.rw_prp(Opcode::Read, 100, 8, data, 0)?;
    check(dmar_fault_in(data)?, || {
        format!("no IOMMU fault logged for the Read into the admin data page at {data:#x}")
    })?;
    let after = identify_serial(&ro)?;
    check(after == serial, || format!("serial {after:?}"))
}

/// A completion forged in the admin CQ (a Read aimed at the entry the driver reads next, posted
/// with the next command identifier and a marker result) is never returned as the command's: the
/// call fails (and the controller is reset) or returns the controller's answer, and the
/// controller serves the next caller.
fn test_admin_cq() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let ro = Dev::open_ro()?;
    let serial = identify_serial(&ro)?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut stage = Buf::new(&dev, PAGE)?;
    let (cq, head, phase) = (
        debug("admin_cq_bus")?,
        debug("admin_cq_head")?,
        debug("admin_cq_phase")? as u32,
    );
    let (cid, tail) = (
        debug("admin_next_cid")? as u32,
        debug("admin_sq_tail")? as u32,
    );
    const MARK: u32 = 0xdead_beef;
    // The forged entry at the head; the rest of the block keeps the stale phase ("not posted").
    let mut block = dwords(&[MARK, 0, (tail + 1) % 16, cid | (phase << 16)]);
    block.extend(dwords(&[0, 0, 0, (phase ^ 1) << 16]).repeat(BLOCK / 16 - 1));
    read_block_to(&mut q, &mut stage, &block, cq + head * 16)?;
    let mut buf = vec![0u8; PAGE];
    match admin(&ro, uapi::ADMIN_OPC_IDENTIFY, 0, 1, &mut buf) {
        Ok(a) => check(a.result != MARK && trimmed(&buf[4..24]) == serial, || {
            format!("the forged completion was taken: result {:#x}", a.result)
        })?,
        Err(e) => check(e == libc::EIO || e == libc::ETIMEDOUT, || {
            format!("identify after the forgery: errno {e}")
        })?,
    }
    let after = identify_serial(&ro).map_err(|e| format!("the next caller: {e}"))?;
    check(after == serial, || format!("serial {after:?}"))?;
    check(attr("failed")? == 0, || "controller still failed".into())
}

/// The admin SQ tail doorbell rung three slots ahead (the writer maps it where the doorbell
/// stride is 4 bytes): the controller runs three cleared slots, the driver skips their
/// completions, and the next admin caller, the writer's queue and the controller are untouched.
fn test_doorbell_poke() -> TestResult {
    let resets = attr("resets")?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let ro = Dev::open_ro()?;
    let serial = identify_serial(&ro)?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut data = Buf::new(&dev, PAGE)?;
    let tail = debug("admin_sq_tail")?;
    ring_admin_sq(&db, tail + 3);
    // A round trip on the writer's queue lets the controller take the doorbell first.
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(st.is_success(), || format!("read after the poke: {st}"))?;
    let after = identify_serial(&ro).map_err(|e| format!("the next admin caller: {e}"))?;
    check(after == serial, || format!("serial {after:?}"))?;
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(
        st.is_success() && data.slice()[..BLOCK] == pattern(100, 0),
        || format!("the writer's queue after the poke: {st}"),
    )?;
    check(attr("resets")? == resets && attr("failed")? == 0, || {
        format!("resets {:?} (was {resets})", attr("resets"))
    })
}

/// The admin SQ tail doorbell rung one slot ahead right before a monitor's Identify, with no
/// pause, many times: every Identify answers, and the controller is never reset. (QEMU's
/// controller takes the doorbell before the driver fills the slot, so the driver's resubmission,
/// for a controller that fetches the slot too early, is not exercised here.)
fn test_doorbell_race() -> TestResult {
    let resets = attr("resets")?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let ro = Dev::open_ro()?;
    let serial = identify_serial(&ro)?;
    for i in 0..32 {
        ring_admin_sq(&db, debug("admin_sq_tail")? + 1);
        let got = identify_serial(&ro).map_err(|e| format!("Identify {i} after a poke: {e}"))?;
        check(got == serial, || format!("serial {got:?}"))?;
    }
    check(attr("resets")? == resets && attr("failed")? == 0, || {
        format!("resets {:?} (was {resets})", attr("resets"))
    })
}
