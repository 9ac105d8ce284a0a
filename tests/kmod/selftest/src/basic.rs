//! What the module is for: identification, mappings, queue pairs and I/O through them, counters,
//! and cleanup when a process dies.

use std::time::{Duration, Instant};

use legend_nvme_protocol::Opcode;

use crate::*;

/// What a controller bound without isolation still does.
pub const IO_TESTS: &[(&str, Test)] = &[("io-info", test_info), ("io-read-write", test_io)];

pub const TESTS: &[(&str, Test)] = &[
    ("info", test_info),
    ("sysfs-counters", test_sysfs_counters),
    ("admin-passthrough", test_admin),
    ("map-host", test_map),
    ("io-read-write", test_io),
    ("io-prp-lists", test_prp_lists),
    ("io-concurrent-queues", test_concurrent),
    ("io-rings-of-1024-entries", test_large_rings),
    ("unmap-refused-with-live-queue", test_unmap_live_queue),
    ("fuzz", test_fuzz),
    ("process-death-cleanup", test_process_death),
];

fn test_info() -> TestResult {
    let info = Dev::open_ro()?.info()?;
    check(info.abi_version == uapi::ABI_VERSION, || {
        format!("abi {}", info.abi_version)
    })?;
    check(trimmed(&info.model) == QEMU_MODEL, || {
        format!("model {:?}", trimmed(&info.model))
    })?;
    check(trimmed(&info.serial) == expect_env("LEGEND_SERIAL"), || {
        format!("serial {:?}", trimmed(&info.serial))
    })?;
    check(info.max_queue_entries == QEMU_MQES, || {
        format!("mqes {}", info.max_queue_entries)
    })?;
    check(info.doorbell_stride == QEMU_DOORBELL_STRIDE, || {
        format!("stride {}", info.doorbell_stride)
    })?;
    check(info.queue_pairs >= QUEUES as u32, || {
        format!("queue pairs {}", info.queue_pairs)
    })?;
    // With a 4-byte stride every doorbell is on the first doorbell page.
    check(info.doorbell_len == PAGE as u32, || {
        format!("doorbell_len {}", info.doorbell_len)
    })?;
    check(info.nvme_version >= 0x10400, || {
        format!("version {:#x}", info.nvme_version)
    })?;
    check(info.num_namespaces == 1, || {
        format!("namespaces {}", info.num_namespaces)
    })?;
    let ns = info.namespaces[0];
    let blocks: u64 = expect_env("LEGEND_BLOCKS").parse().unwrap_or(0);
    check(
        ns.nsid == 1 && ns.lba_shift == 9 && ns.blocks == blocks,
        || format!("namespace {ns:?}, want {blocks} blocks"),
    )?;
    let bdf = expect_env("LEGEND_BDF");
    let got = format!(
        "{:04x}:{:02x}:{:02x}.{}",
        info.pci_domain, info.pci_bus, info.pci_device, info.pci_function
    );
    check(got == bdf, || format!("pci address {got}, want {bdf}"))
}

pub fn admin(
    dev: &Dev,
    opcode: u8,
    nsid: u32,
    cdw10: u32,
    buf: &mut [u8],
) -> Result<uapi::AdminArgs, i32> {
    let mut a = uapi::AdminArgs {
        opcode,
        nsid,
        data: buf.as_mut_ptr() as u64,
        data_len: buf.len() as u32,
        ..Default::default()
    };
    a.cdw[0] = cdw10;
    dev.ioctl(uapi::IOCTL_ADMIN, &mut a).map(|()| a)
}

/// Identify Controller through `dev`; its serial number.
pub fn identify_serial(dev: &Dev) -> Result<String, String> {
    let mut buf = vec![0u8; 4096];
    let a = admin(dev, uapi::ADMIN_OPC_IDENTIFY, 0, 1, &mut buf)
        .map_err(|e| format!("identify: errno {e}"))?;
    check(a.status == 0, || format!("identify status {:#x}", a.status))?;
    Ok(trimmed(&buf[4..24]))
}

fn test_admin() -> TestResult {
    // Read-only files run the passthrough too.
    let dev = Dev::open_ro()?;
    let serial = identify_serial(&dev)?;
    check(serial == expect_env("LEGEND_SERIAL"), || {
        format!("identify serial {serial:?}")
    })?;
    let mut smart = vec![0u8; 512];
    let a = admin(
        &dev,
        uapi::ADMIN_OPC_GET_LOG_PAGE,
        0xffff_ffff,
        u32::from(uapi::LOG_ID_SMART),
        &mut smart,
    )
    .map_err(|e| format!("smart: errno {e}"))?;
    // Composite temperature (bytes 1..3, kelvin) is non-zero on QEMU's controller.
    let temp = u16::from_le_bytes([smart[1], smart[2]]);
    check(a.status == 0 && temp > 200, || {
        format!("smart status {} temperature {temp}", a.status)
    })?;
    // A command that fails returns zeros, never what an earlier command left in the driver's
    // buffer: Identify of a namespace id beyond any the controller supports.
    let mut buf = vec![0xa5u8; 4096];
    let a = admin(&dev, uapi::ADMIN_OPC_IDENTIFY, 0xffff_fffe, 0, &mut buf)
        .map_err(|e| format!("identify of a bad nsid: errno {e}"))?;
    check(a.status != 0 && buf.iter().all(|&b| b == 0), || {
        format!(
            "identify of a bad nsid: status {:#x}, {} non-zero bytes returned",
            a.status,
            buf.iter().filter(|&&b| b != 0).count()
        )
    })
}

fn test_map() -> TestResult {
    let dev = Dev::open()?;
    let mut b = Buf::new(&dev, 16 * PAGE)?;
    b.slice()[0] = 1;
    dev.unmap(b.handle)
        .map_err(|e| format!("UNMAP: errno {e}"))?;
    check(dev.unmap(b.handle) == Err(libc::ENOENT), || {
        "double UNMAP accepted".into()
    })
}

fn test_io() -> TestResult {
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 1, 64, db.ptr)?;
    let mut buf = Buf::new(&dev, 4 * PAGE)?;
    // Read 16 blocks (two pages, PRP2) of the generated image and compare.
    let st = q.rw(Opcode::Read, 100, 16, &buf, 0)?;
    check(st.is_success(), || format!("read status {st}"))?;
    for i in 0..16u64 {
        let got = &buf.slice()[i as usize * BLOCK..][..BLOCK];
        check(got == pattern(100 + i, 0).as_slice(), || {
            format!("lba {} differs from the image", 100 + i)
        })?;
    }
    // Write, then read back into other pages.
    for i in 0..8u64 {
        buf.slice()[i as usize * BLOCK..][..BLOCK].copy_from_slice(&pattern(WRITE_BASE + i, 1));
    }
    let st = q.rw(Opcode::Write, WRITE_BASE, 8, &buf, 0)?;
    check(st.is_success(), || format!("write status {st}"))?;
    let st = q.rw(Opcode::Read, WRITE_BASE, 8, &buf, 2 * PAGE)?;
    check(st.is_success(), || format!("read-back status {st}"))?;
    for i in 0..8u64 {
        let got = &buf.slice()[2 * PAGE + i as usize * BLOCK..][..BLOCK];
        check(got == pattern(WRITE_BASE + i, 1).as_slice(), || {
            format!("read-after-write lba {}", WRITE_BASE + i)
        })?;
    }
    // Out of range: LBA Out of Range is generic status 0x80.
    let st = q.rw(Opcode::Read, info.namespaces[0].blocks, 1, &buf, 0)?;
    check((st.sct(), st.sc()) == (0, 0x80), || {
        format!("out-of-range read: {st}, want LBA Out of Range")
    })?;
    dev.delete_queue_pair(1)
        .map_err(|e| format!("DELETE: errno {e}"))
}

/// Transfers over many pages go through PRP lists: 128 KiB from the image, a 64 KiB write
/// starting in the middle of a page, read back through another list, byte for byte.
fn test_prp_lists() -> TestResult {
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut buf = Buf::new(&dev, 72 * PAGE)?;
    let blocks = 256u32;
    check(
        info.max_transfer == 0 || info.max_transfer >= blocks * BLOCK as u32,
        || format!("MDTS {} below 128 KiB", info.max_transfer),
    )?;
    let st = q.rw(Opcode::Read, 1000, blocks, &buf, 0)?;
    check(st.is_success(), || format!("128 KiB read: {st}"))?;
    for i in 0..u64::from(blocks) {
        check(
            buf.slice()[i as usize * BLOCK..][..BLOCK] == pattern(1000 + i, 0),
            || format!("128 KiB read: lba {} differs", 1000 + i),
        )?;
    }
    // 128 blocks from byte 512 of page 33: 17 pages, the first one partly.
    let (lba, n, off) = (WRITE_BASE + 2048, 128u32, 33 * PAGE + BLOCK);
    for i in 0..u64::from(n) {
        buf.slice()[off + i as usize * BLOCK..][..BLOCK].copy_from_slice(&pattern(lba + i, 1));
    }
    let st = q.rw(Opcode::Write, lba, n, &buf, off)?;
    check(st.is_success(), || {
        format!("64 KiB write at an offset: {st}")
    })?;
    buf.slice()[..34 * PAGE].fill(0);
    let st = q.rw(Opcode::Read, lba, n, &buf, 0)?;
    check(st.is_success(), || format!("64 KiB read-back: {st}"))?;
    for i in 0..u64::from(n) {
        check(
            buf.slice()[i as usize * BLOCK..][..BLOCK] == pattern(lba + i, 1),
            || format!("read-back through a PRP list: lba {} differs", lba + i),
        )?;
    }
    dev.delete_queue_pair(1)
        .map_err(|e| format!("DELETE: errno {e}"))
}

fn test_concurrent() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let dbp = db.ptr as usize;
    let workers: Vec<_> = (0..QUEUES)
        .map(|i| {
            let q = Queue::create(&dev, i as u32 + 1, 32, dbp as *mut u8);
            let b = Buf::new(&dev, 2 * PAGE);
            std::thread::spawn(move || -> TestResult {
                let (mut q, mut b) = (q?, b?);
                let base = WRITE_BASE + 8 + i * WRITE_SPAN;
                for chunk in (0..WRITE_SPAN).step_by(8) {
                    for j in 0..8 {
                        b.slice()[j as usize * BLOCK..][..BLOCK]
                            .copy_from_slice(&pattern(base + chunk + j, 1));
                    }
                    let st = q.rw(Opcode::Write, base + chunk, 8, &b, 0)?;
                    check(st.is_success(), || format!("queue {}: write {st}", q.qid))?;
                    b.slice()[PAGE..].fill(0);
                    let st = q.rw(Opcode::Read, base + chunk, 8, &b, PAGE)?;
                    check(st.is_success(), || format!("queue {}: read {st}", q.qid))?;
                    for j in 0..8 {
                        let got = b.slice()[PAGE + j as usize * BLOCK..][..BLOCK].to_vec();
                        check(got == pattern(base + chunk + j, 1), || {
                            format!("queue {}: lba {}", q.qid, base + chunk + j)
                        })?;
                    }
                }
                Ok(())
            })
        })
        .collect();
    for w in workers {
        w.join().map_err(|_| "worker panicked".to_string())??;
    }
    Ok(())
}

fn test_sysfs_counters() -> TestResult {
    let [q0, b0, a0] = counters()?;
    check(q0 == 0 && b0 == 0, || {
        format!("idle controller: {q0} queue pairs, {b0} bytes pinned")
    })?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let buf = Buf::new(&dev, 4 * PAGE)?;
    let [q, b, a] = counters()?;
    check(q == 0 && b == 4 * PAGE as u64 && a == a0, || {
        format!("after MAP of 4 pages: {q} queue pairs, {b} bytes, {a} admin commands (was {a0})")
    })?;
    // The queue's memory is one more 3-page mapping; creating it issues Create I/O CQ and SQ.
    let q1 = Queue::create(&dev, 1, 16, db.ptr)?;
    let [q, b, a] = counters()?;
    check(q == 1 && b == 7 * PAGE as u64 && a == a0 + 2, || {
        format!(
            "after CREATE_QUEUE_PAIR: {q} queue pairs, {b} bytes, {a} admin commands (was {a0})"
        )
    })?;
    drop((q1, buf, db, dev));
    let [q, b, a] = counters()?;
    // Closing the file deletes the queue pair (Delete I/O SQ and CQ) and releases the mappings.
    check(q == 0 && b == 0 && a == a0 + 4, || {
        format!("after close: {q} queue pairs, {b} bytes, {a} admin commands (was {a0})")
    })?;
    check(attr("failed")? == 0, || "controller marked failed".into())
}

/// UNMAP of a data buffer while the file has a live queue pair is refused and changes nothing
/// (the queue keeps working, nothing is unpinned); after DELETE_QUEUE_PAIR it succeeds.
fn test_unmap_live_queue() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let mut data = Buf::new(&dev, 2 * PAGE)?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(st.is_success(), || format!("read {st}"))?;
    let pinned = 5 * PAGE as u64;
    for h in [data.handle, q.mem.handle] {
        check(dev.unmap(h) == Err(libc::EBUSY), || {
            format!("UNMAP {h} with a live queue pair not refused with EBUSY")
        })?;
    }
    let [queues, bytes, _] = counters()?;
    check(queues == 1 && bytes == pinned, || {
        format!(
            "after refused UNMAPs: {queues} queue pairs, {bytes} bytes pinned, want 1, {pinned}"
        )
    })?;
    // Still mapped: the buffer takes DMA and the data arrives.
    data.slice().fill(0);
    let st = q.rw(Opcode::Read, 100, 8, &data, PAGE)?;
    check(st.is_success(), || {
        format!("read after refused UNMAP: {st}")
    })?;
    check(
        &data.slice()[PAGE..][..BLOCK] == pattern(100, 0).as_slice(),
        || "read after refused UNMAP: wrong data".into(),
    )?;
    dev.delete_queue_pair(1)
        .map_err(|e| format!("DELETE: errno {e}"))?;
    dev.unmap(data.handle)
        .map_err(|e| format!("UNMAP after DELETE: errno {e}"))?;
    let [queues, bytes, _] = counters()?;
    check(queues == 0 && bytes == 3 * PAGE as u64, || {
        format!("after DELETE and UNMAP: {queues} queue pairs, {bytes} bytes pinned")
    })?;
    dev.unmap(q.mem.handle)
        .map_err(|e| format!("UNMAP queue memory: errno {e}"))?;
    let [_, bytes, _] = counters()?;
    check(bytes == 0, || format!("{bytes} bytes still pinned"))
}

fn test_fuzz() -> TestResult {
    let dev = Dev::open()?;
    let cmds = [
        uapi::IOCTL_INFO,
        uapi::IOCTL_MAP,
        uapi::IOCTL_UNMAP,
        uapi::IOCTL_CREATE_QUEUE_PAIR,
        uapi::IOCTL_DELETE_QUEUE_PAIR,
        uapi::IOCTL_ADMIN,
        0x4c46,
        0xc0ff_4c41,
    ];
    let arena = anon(64 * PAGE);
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut arg = [0u64; 64];
    let (start, mut n) = (Instant::now(), 0u32);
    while start.elapsed() < Duration::from_secs(3) {
        let cmd = cmds[(next() % cmds.len() as u64) as usize];
        for w in arg.iter_mut() {
            // Mix random words with plausible values: pointers into the arena, small numbers.
            *w = match next() % 4 {
                0 => next(),
                1 => arena as u64 + (next() % 64) * PAGE as u64,
                2 => next() % 8,
                _ => (next() % 16) * PAGE as u64,
            };
        }
        let _ = dev.ioctl_raw(cmd, arg.as_mut_ptr() as usize);
        n += 1;
    }
    dev.info()
        .map(|_| ())
        .map_err(|e| format!("after {n} calls: {e}"))
}

fn test_process_death() -> TestResult {
    // SAFETY: the child only performs ioctls and exits without unwinding into the parent.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = (|| -> TestResult {
            let d = Dev::open()?;
            let db = d.doorbells()?;
            let q = Queue::create(&d, 3, 16, db.ptr)?;
            std::mem::forget((q, db, d));
            Ok(())
        })()
        .is_ok();
        // Die without closing anything: the kernel must clean up.
        // SAFETY: terminating the child process.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    check(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        || "child failed to create queue 3".into(),
    )?;
    let [queues, bytes, _] = counters()?;
    check(queues == 0 && bytes == 0, || {
        format!("after the child died: {queues} queue pairs, {bytes} bytes pinned")
    })?;
    let dev = Dev::open().map_err(|e| format!("writer's place not released: {e}"))?;
    let db = dev.doorbells()?;
    Queue::create(&dev, 3, 16, db.ptr)
        .map(|_| ())
        .map_err(|e| format!("qid 3 not released by process death: {e}"))
}

/// Rings of 1024 entries (64 KiB SQ, 16 KiB CQ) in host memory: one mapping's pages get
/// consecutive bus addresses, so the controller takes them as physically contiguous queues, and
/// I/O runs through more than one pass of the rings.
fn test_large_rings() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 3, 1024, db.ptr)?;
    check(
        q.mem.bus.windows(2).all(|w| w[1] == w[0] + PAGE as u64),
        || "the ring mapping's bus addresses are not consecutive".into(),
    )?;
    let mut data = Buf::new(&dev, PAGE)?;
    for i in 0..1100u64 {
        let lba = 100 + i % 8;
        let st = q.rw(Opcode::Read, lba, 1, &data, 0)?;
        check(
            st.is_success() && data.slice()[..BLOCK] == pattern(lba, 0),
            || format!("read {i} of lba {lba}: {st}"),
        )?;
    }
    Ok(())
}
