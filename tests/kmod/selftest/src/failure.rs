//! When things go wrong: stray admin doorbell writes, commands whose PRPs point anywhere, and a
//! controller that stops answering (bus mastering cleared under a live queue).

use std::{
    fs,
    os::unix::fs::FileExt,
    time::{Duration, Instant},
};

use legend_nvme_protocol::Opcode;

use crate::{basic::identify_serial, *};

pub const TESTS: &[(&str, Test)] = &[
    ("admin-doorbell-tamper", test_admin_tamper),
    ("wild-prps-fault", test_wild_prps),
    ("failed-delete-quiesces", test_failed_delete),
    ("admin-wait-holds-up-no-map", test_admin_wait),
];

/// The writer can reach the admin queue's doorbells (QEMU's 4-byte stride puts them on the same
/// page as its own); ringing them makes the controller run cleared slots, which it rejects, and
/// the driver notices the completions it did not ask for: at most one admin call fails, the
/// controller is reset, and everything works again.
fn test_admin_tamper() -> TestResult {
    let resets = attr("resets")?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let ro = Dev::open_ro()?;
    let before = identify_serial(&ro)?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    // Offset 0 and 4 of the mapping are the admin SQ tail and CQ head (BAR0 + 0x1000).
    for (offset, value) in [(0usize, 7u32), (0, 8), (4, 3)] {
        // SAFETY: aligned dwords inside the doorbell mapping.
        unsafe { db.ptr.add(offset).cast::<u32>().write_volatile(value) };
    }
    let mut failures = 0;
    let serial = loop {
        match identify_serial(&ro) {
            Ok(s) => break s,
            // The tampered doorbells make the controller either complete something the driver
            // did not ask for (EIO) or leave its command unanswered (ETIMEDOUT, seen when the
            // emulating host is busy): one admin fault either way, and one reset.
            Err(e) if failures == 0 && (e.contains("errno 5") || e.contains("errno 110")) => {
                failures += 1
            }
            Err(e) => return Err(format!("admin after tampering (failure {failures}): {e}")),
        }
    };
    check(serial == before, || {
        format!("serial {serial:?} after tampering")
    })?;
    check(attr("failed")? == 0, || "controller still failed".into())?;
    let reset = attr("resets")? - resets;
    check(reset == failures, || {
        format!("{failures} failed admin calls but {reset} resets")
    })?;
    if failures == 1 {
        // The reset took the writer's queue: deleting it forgets it; a new one works.
        dev.delete_queue_pair(1)
            .map_err(|e| format!("DELETE of a queue the reset removed: errno {e}"))?;
        q = Queue::create(&dev, 1, 16, db.ptr)?;
    }
    let data = Buf::new(&dev, PAGE)?;
    let st = q.rw(Opcode::Read, 0, 8, &data, 0)?;
    check(st.is_success(), || format!("I/O after tampering: {st}"))
}

/// A block no other test reads or checks.
const SCRATCH_LBA: u64 = 9000;

/// Under a translating IOMMU, PRPs that name unmapped addresses (0, the MSI window, a page
/// unmapped just before, with no pause: the domain is strict, so UNMAP returns only after the
/// IOMMU stopped translating it) fault in the IOMMU and reach no memory; the queue and
/// controller live on.
/// QEMU's controller completes such commands successfully (its DMA helpers drop the data),
/// where hardware reports a Data Transfer Error: the evidence here is the IOMMU's fault in the
/// kernel log and the unchanged page.
fn test_wild_prps() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    // Every mapping is made before the freed page's, so its IOVA is not handed out again.
    let qmem = Buf::new(&dev, 3 * PAGE)?;
    let mut data = Buf::new(&dev, 2 * PAGE)?;
    let mut freed = Buf::new(&dev, PAGE)?;
    let freed_bus = freed.bus[0];
    let mut q = Queue::create_in(&dev, 1, 16, db.ptr, qmem)?;
    // A Read into the page first: a lazily flushed IOTLB would keep its translation for
    // milliseconds after UNMAP.
    let st = q.rw(Opcode::Read, 100, 8, &freed, 0)?;
    check(st.is_success(), || format!("read into the page: {st}"))?;
    dev.delete_queue_pair(1)
        .map_err(|e| format!("DELETE: errno {e}"))?;
    dev.unmap(freed.handle)
        .map_err(|e| format!("UNMAP: errno {e}"))?;
    freed.slice().fill(0x5a);
    let Queue { mem, .. } = q;
    let mut q = Queue::create_in(&dev, 1, 16, db.ptr, mem)?;
    let mut e = Expectations::default();
    for (name, op, prp1) in [
        ("read into bus address 0", Opcode::Read, 0u64),
        ("read into an unmapped page", Opcode::Read, freed_bus),
        ("write from the MSI window", Opcode::Write, 0xfee0_0000),
    ] {
        if let Err(err) = q.rw_prp(op, SCRATCH_LBA, 8, prp1, 0) {
            e.fail(format!("{name}: {err}"));
        }
    }
    if freed.slice().iter().any(|&b| b != 0x5a) {
        e.fail("the unmapped page was written".into());
    }
    let log = std::process::Command::new("dmesg")
        .output()
        .map_err(|e| format!("dmesg: {e}"))?;
    let bdf = expect_env("LEGEND_BDF");
    let dev_id = bdf.strip_prefix("0000:").unwrap_or(&bdf);
    if !String::from_utf8_lossy(&log.stdout)
        .lines()
        .any(|l| l.contains("DMAR") && l.contains(dev_id) && l.contains("fault addr 0x0"))
    {
        e.fail(format!("no DMAR fault at address 0 logged for {dev_id}"));
    }
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(
        st.is_success() && data.slice()[..BLOCK] == pattern(100, 0),
        || format!("valid read afterwards: {st}"),
    )?;
    check(attr("failed")? == 0, || {
        "wild PRPs failed the controller".into()
    })?;
    e.result()
}

/// The PCI command register's bus master bit, through sysfs.
fn set_bus_master(on: bool) -> TestResult {
    let path = format!("/sys/bus/pci/devices/{}/config", expect_env("LEGEND_BDF"));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| format!("{path}: {e}"))?;
    let mut cmd = [0u8; 2];
    f.read_exact_at(&mut cmd, 4).map_err(|e| e.to_string())?;
    let v = u16::from_le_bytes(cmd);
    let v = if on { v | 4 } else { v & !4 };
    f.write_all_at(&v.to_le_bytes(), 4)
        .map_err(|e| e.to_string())
}

/// A Delete I/O SQ the controller never answers (its bus mastering was cleared, so it cannot
/// fetch the command): `EIO` after the admin timeout, the controller disabled, and nothing
/// unpinned until the owner lets go; then the controller comes back for the next user.
fn test_failed_delete() -> TestResult {
    let resets = attr("resets")?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let data = Buf::new(&dev, 2 * PAGE)?;
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(st.is_success(), || format!("read {st}"))?;
    let [_, pinned, _] = counters()?;
    set_bus_master(false)?;
    let start = Instant::now();
    let got = dev.delete_queue_pair(1);
    let took = start.elapsed().as_secs_f64();
    check(got == Err(libc::EIO), || {
        format!("DELETE without bus mastering: {got:?}, want EIO")
    })?;
    let [queues, bytes, _] = counters()?;
    check(attr("failed")? == 1 && queues == 0, || {
        format!(
            "after the failed DELETE ({took:.1} s): failed {:?}, {queues} queue pairs",
            attr("failed")
        )
    })?;
    check(bytes == pinned, || {
        format!("after the failed DELETE: {bytes} bytes pinned, want {pinned} (nothing released)")
    })?;
    // The controller is disabled: its queue is gone, so the record can go and the memory too.
    dev.delete_queue_pair(1)
        .map_err(|e| format!("second DELETE: errno {e}"))?;
    dev.unmap(data.handle)
        .map_err(|e| format!("UNMAP after the controller stopped: errno {e}"))?;
    drop((q, db, dev));
    let [_, bytes, _] = counters()?;
    check(bytes == 0, || format!("{bytes} bytes pinned after close"))?;
    // The next writer gets a working controller.
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut data = Buf::new(&dev, PAGE)?;
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(
        st.is_success() && data.slice()[..BLOCK] == pattern(100, 0),
        || format!("read after recovery: {st}"),
    )?;
    check(
        attr("resets")? == resets + 1 && attr("failed")? == 0,
        || {
            format!(
                "resets {:?} (was {resets}), failed {:?}",
                attr("resets"),
                attr("failed")
            )
        },
    )
}

/// An `ADMIN` call waiting for a controller that cannot answer (bus mastering cleared: it never
/// fetches the command) holds up neither `MAP` nor `UNMAP` of the writer, since the admin queue
/// has a lock of its own; the call then fails after the admin timeout, and the controller comes
/// back for the writer's next queue.
fn test_admin_wait() -> TestResult {
    let dev = Dev::open()?;
    let ro = Dev::open_ro()?;
    let before = attr("admin_commands")?;
    set_bus_master(false)?;
    let waiter = std::thread::spawn(move || identify_serial(&ro));
    // The driver counts the command as it submits it.
    let start = Instant::now();
    while attr("admin_commands")? == before && start.elapsed() < Duration::from_secs(10) {
        std::thread::yield_now();
    }
    let t = Instant::now();
    let mapped = Buf::new(&dev, 4 * PAGE)
        .and_then(|b| dev.unmap(b.handle).map_err(|e| format!("UNMAP: errno {e}")));
    let took = t.elapsed();
    let answered = waiter
        .join()
        .map_err(|_| "the ADMIN thread panicked".to_string())?;
    set_bus_master(true)?;
    mapped?;
    // Milliseconds normally; the bound leaves room for a loaded host, well below the 10 s the
    // ADMIN call waits.
    check(took < Duration::from_secs(5), || {
        format!("MAP and UNMAP took {took:?} while an ADMIN call waited")
    })?;
    check(answered.is_err(), || {
        format!("Identify without bus mastering answered: {answered:?}")
    })?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut data = Buf::new(&dev, PAGE)?;
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(
        st.is_success() && data.slice()[..BLOCK] == pattern(100, 0),
        || format!("read after recovery: {st}"),
    )
}
