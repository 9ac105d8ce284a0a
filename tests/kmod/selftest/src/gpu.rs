//! GPU memory through the `nv_p2p_fake` test double of NVIDIA's P2P API: mappings, DMA through
//! them, the free callback and its races, and a threaded fuzz loop over every entry point while
//! mappings are revoked under it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use legend_nvme_protocol::Opcode;

use crate::*;

pub const TESTS: &[(&str, Test)] = &[
    ("gpu-persistent-dma", test_gpu_persistent),
    ("gpu-free-callback", test_gpu_free_callback),
    ("gpu-put-failure-keeps-the-module", test_gpu_put_failure),
    ("gpu-callback-race", test_gpu_callback_race),
    ("gpu-bad-mappings", test_gpu_bad),
    (
        "gpu-map-output-fault-with-live-queue-leaves-nothing",
        test_gpu_output_fault,
    ),
    ("threaded-fuzz-with-revocations", test_threaded_fuzz),
];

const FAKE: &str = "/sys/module/nv_p2p_fake/parameters";
const GPU_PAGE: u64 = uapi::GPU_PAGE_SIZE as u64;
/// Where the GPU test writes (outside what `verify-image` checks).
const GPU_LBA: u64 = 8192;

fn fake_get(name: &str) -> Result<u64, String> {
    let text =
        std::fs::read_to_string(format!("{FAKE}/{name}")).map_err(|e| format!("{name}: {e}"))?;
    text.trim()
        .parse()
        .map_err(|_| format!("{name}: {text:?} is not a number"))
}

fn fake_set(name: &str, value: &str) -> TestResult {
    std::fs::write(format!("{FAKE}/{name}"), value).map_err(|e| format!("set {name}: {e}"))
}

/// MAP of "GPU memory" (the test double's) at `addr`; returns the handle and bus addresses.
fn map_gpu(dev: &Dev, addr: u64, len: u64) -> Result<(u32, Vec<u64>), i32> {
    let mut bus = vec![0u64; (len / GPU_PAGE).max(1) as usize];
    let mut args = uapi::MapArgs {
        addr,
        len,
        bus_addrs: bus.as_mut_ptr() as u64,
        bus_addrs_cap: bus.len() as u32,
        kind: uapi::MAP_KIND_GPU,
        ..Default::default()
    };
    dev.ioctl(uapi::IOCTL_MAP, &mut args)?;
    if args.page_size != uapi::GPU_PAGE_SIZE || args.pages as usize != bus.len() {
        return Err(-1);
    }
    Ok((args.handle, bus))
}

/// Persistent pinning: DMA to and from the GPU pages through a queue; the free callback path
/// does not touch persistent pins; unmapping releases them.
fn test_gpu_persistent() -> TestResult {
    let base = fake_get("va_base")?;
    let dev = Dev::open()?;
    let (h, bus) = map_gpu(&dev, base, 4 * GPU_PAGE).map_err(|e| format!("MAP GPU: errno {e}"))?;
    check(bus.iter().all(|&b| b != 0 && b % GPU_PAGE == 0), || {
        format!("bus addresses {bus:x?}")
    })?;
    let [_, pinned_bytes, _] = counters()?;
    check(
        pinned_bytes == 4 * GPU_PAGE && fake_get("pinned")? == 1,
        || format!("{pinned_bytes} bytes pinned"),
    )?;
    fake_set("revoke", "1")?;
    check(fake_get("pinned")? == 1, || {
        "revoke freed a persistent pin".into()
    })?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut host = Buf::new(&dev, PAGE)?;
    // Image -> GPU page 0 -> LBA GPU_LBA -> host memory.
    for (op, lba) in [(Opcode::Read, 100), (Opcode::Write, GPU_LBA)] {
        let st = q.rw_prp(op, lba, 8, bus[0], 0)?;
        check(st.is_success(), || format!("{op:?} via GPU memory: {st}"))?;
    }
    let st = q.rw(Opcode::Read, GPU_LBA, 8, &host, 0)?;
    check(st.is_success(), || format!("read back: {st}"))?;
    for i in 0..8u64 {
        check(
            host.slice()[i as usize * BLOCK..][..BLOCK] == pattern(100 + i, 0),
            || format!("block {i} did not travel through the GPU pages"),
        )?;
    }
    check(dev.unmap(h) == Err(libc::EBUSY), || {
        "UNMAP GPU with a live queue pair not refused".into()
    })?;
    check(fake_get("pinned")? == 1, || {
        "refused UNMAP dropped the pin".into()
    })?;
    dev.delete_queue_pair(q.qid)
        .map_err(|e| format!("DELETE: errno {e}"))?;
    dev.unmap(h).map_err(|e| format!("UNMAP GPU: errno {e}"))?;
    check(fake_get("pinned")? == 0, || "UNMAP kept the pin".into())
}

/// Callback mode: NVIDIA frees the memory under a live queue; the driver deletes the owner's
/// queues before the callback returns, refuses the mapping and any new queue afterwards, and
/// UNMAP still works, after which queues can be created again.
/// legend_nvme's module references (each open file holds one; so does every callback NVIDIA
/// may still call).
fn module_refs() -> Result<u64, String> {
    let text = std::fs::read_to_string("/sys/module/legend_nvme/refcnt")
        .map_err(|e| format!("refcnt: {e}"))?;
    text.trim()
        .parse()
        .map_err(|_| format!("refcnt: {text:?} is not a number"))
}

/// Sets `fail_put` back to 0 however the test ends: the other tests need put_pages.
struct PutFailure;

impl Drop for PutFailure {
    fn drop(&mut self) {
        let _ = fake_set("fail_put", "0");
    }
}

/// A put_pages that fails for a reason of NVIDIA's own (not the callback race) leaves NVIDIA
/// the registration and its free callback: the module must stay referenced until that callback
/// has run, so that it cannot be unloaded under NVIDIA's pointer (issue 30, item 6). On a module
/// that dropped its reference with the mapping, refcnt was back at its baseline at once.
fn test_gpu_put_failure() -> TestResult {
    let base = fake_get("va_base")?;
    fake_set("persistent", "0")?;
    let baseline = module_refs()?;
    {
        let dev = Dev::open()?;
        let (h, _) = map_gpu(&dev, base, GPU_PAGE).map_err(|e| format!("MAP GPU: errno {e}"))?;
        let _restore = PutFailure;
        fake_set("fail_put", "1")?;
        // The mapping goes; NVIDIA keeps its pages and may still call back.
        let _ = dev.unmap(h);
    }
    let held = module_refs()?;
    check(held == baseline + 1 && fake_get("pinned")? == 1, || {
        format!(
            "after a failed put_pages and close: refcnt {held} (baseline {baseline}), {} pins",
            fake_get("pinned").unwrap_or(u64::MAX)
        )
    })?;
    // NVIDIA frees the pages at last: the callback runs on live state and drops the reference.
    fake_set("revoke", "1")?;
    let after = module_refs()?;
    check(after == baseline && fake_get("pinned")? == 0, || {
        format!("after the callback: refcnt {after} (baseline {baseline})")
    })
}

fn test_gpu_free_callback() -> TestResult {
    let base = fake_get("va_base")?;
    fake_set("persistent", "0")?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let (h, bus) = map_gpu(&dev, base, 2 * GPU_PAGE).map_err(|e| format!("MAP GPU: errno {e}"))?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let st = q.rw_prp(Opcode::Read, 100, 8, bus[1], 0)?;
    check(st.is_success(), || format!("read into GPU memory: {st}"))?;
    fake_set("revoke", "1")?;
    let [queues, bytes, _] = counters()?;
    check(fake_get("pinned")? == 0, || "pin survived revoke".into())?;
    // What is left pinned is the queue's own 3 host pages.
    check(queues == 0 && bytes == 3 * PAGE as u64, || {
        format!("after the free callback: {queues} queue pairs, {bytes} bytes pinned")
    })?;
    let mut args = uapi::QueuePairArgs {
        qid: 2,
        depth: 16,
        sq_handle: h,
        cq_handle: h,
        sq_offset: 0,
        cq_offset: PAGE as u64,
        ..Default::default()
    };
    check(
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args) == Err(libc::ENXIO),
        || "queue in revoked GPU memory not refused with ENXIO".into(),
    )?;
    // The callback deleted the queue: its qid is free again.
    check(dev.delete_queue_pair(1) == Err(libc::ENOENT), || {
        "the revoked queue is still recorded".into()
    })?;
    // No new queue (its commands could name the freed memory's bus addresses) until the owner
    // unmapped the revoked mapping; queue memory of its own does not change that.
    let qmem = Buf::new(&dev, 3 * PAGE)?;
    let mut args = uapi::QueuePairArgs {
        qid: 1,
        depth: 16,
        sq_handle: qmem.handle,
        cq_handle: qmem.handle,
        sq_offset: 0,
        cq_offset: PAGE as u64,
        ..Default::default()
    };
    let got = dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args);
    check(got == Err(libc::ENXIO), || {
        format!("CREATE after the revoke, before UNMAP: {got:?}, want ENXIO")
    })?;
    // Freed memory holds nothing the device could reach: UNMAP is allowed.
    dev.unmap(h)
        .map_err(|e| format!("UNMAP after revoke: errno {e}"))?;
    let mut q = Queue::create_in(&dev, 1, 16, db.ptr, qmem)?;
    let mut host = Buf::new(&dev, PAGE)?;
    let st = q.rw(Opcode::Read, 100, 8, &host, 0)?;
    check(
        st.is_success() && host.slice()[..BLOCK] == pattern(100, 0),
        || format!("read after UNMAP of the revoked mapping: {st}"),
    )?;
    fake_set("persistent", "1")
}

/// MAP, UNMAP and close race with the free callback for a while; nothing may leak or hang.
fn test_gpu_callback_race() -> TestResult {
    let base = fake_get("va_base")?;
    fake_set("persistent", "0")?;
    let stop = Arc::new(AtomicBool::new(false));
    let revoker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let _ = fake_set("revoke", "1");
                n += 1;
            }
            n
        })
    };
    let (start, mut maps, mut other) = (Instant::now(), 0u32, Vec::new());
    let mut dev = Some(Dev::open()?);
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(3) {
        i += 1;
        if i.is_multiple_of(16) {
            // Close with live (or revoked) mappings; the next writer may open only then.
            drop(dev.take());
            dev = Some(Dev::open()?);
        }
        let d = dev.as_ref().expect("open");
        match map_gpu(d, base + (i % 8) * GPU_PAGE, GPU_PAGE) {
            Ok((h, _)) => {
                maps += 1;
                if !i.is_multiple_of(3) && d.unmap(h).is_err() {
                    other.push(format!("UNMAP {h} failed"));
                }
            }
            // The free raced with MAP: the callback ran before the mapping was recorded
            // (ENXIO), or NVIDIA refused to map pages being freed (the double's EINVAL).
            Err(libc::ENXIO | libc::EINVAL) => {}
            Err(e) => other.push(format!("MAP errno {e}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let revokes = revoker.join().map_err(|_| "revoker panicked")?;
    drop(dev);
    fake_set("revoke", "1")?;
    fake_set("persistent", "1")?;
    let [queues, bytes, _] = counters()?;
    check(other.is_empty(), || other.join("; "))?;
    check(maps > 10 && revokes > 10, || {
        format!("only {maps} maps and {revokes} revokes")
    })?;
    check(
        queues == 0 && bytes == 0 && fake_get("pinned")? == 0,
        || {
            format!(
                "leak: {queues} queue pairs, {bytes} bytes, {} pins",
                fake_get("pinned").unwrap_or(99)
            )
        },
    )
}

/// Bad GPU mappings: alignment, memory NVIDIA does not know, incompatible page-table version.
fn test_gpu_bad() -> TestResult {
    let base = fake_get("va_base")?;
    let dev = Dev::open()?;
    let mut e = Expectations::default();
    let mut expect = |name: &str, got: Result<(u32, Vec<u64>), i32>, want: i32| {
        e.errno(name, got.map(|_| ()), want)
    };
    expect(
        "unaligned address",
        map_gpu(&dev, base + 4096, GPU_PAGE),
        libc::EINVAL,
    );
    expect("4 KiB length", map_gpu(&dev, base, 4096), libc::EINVAL);
    expect(
        "not GPU memory",
        map_gpu(&dev, base - GPU_PAGE, GPU_PAGE),
        libc::EINVAL,
    );
    fake_set("table_version", &0x0002_0002u32.to_string())?;
    expect(
        "page table major version 2",
        map_gpu(&dev, base, GPU_PAGE),
        libc::EPROTO,
    );
    fake_set("table_version", &0x0001_0003u32.to_string())?;
    let newer = map_gpu(&dev, base, GPU_PAGE);
    fake_set("table_version", &0x0001_0002u32.to_string())?;
    if newer.is_err() {
        e.fail(format!("newer minor version refused: {newer:?}"));
    }
    drop(dev);
    check(fake_get("pinned")? == 0, || {
        "a refused MAP leaked a pin".into()
    })?;
    e.result()
}

/// `MAP` of GPU memory whose result cannot be written back (a read-only argument), while a
/// queue pair of the file lives: `EFAULT`, and the GPU pages are released (persistent and
/// callback pinning alike).
fn test_gpu_output_fault() -> TestResult {
    let base = fake_get("va_base")?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let _q = Queue::create(&dev, 1, 16, db.ptr)?;
    let bytes = attr("bytes_pinned")?;
    let mut e = Expectations::default();
    for persistent in ["1", "0"] {
        fake_set("persistent", persistent)?;
        let mut bus = vec![0u64; 2];
        let args = crate::undo::read_only(uapi::MapArgs {
            addr: base,
            len: 2 * GPU_PAGE,
            bus_addrs: bus.as_mut_ptr() as u64,
            bus_addrs_cap: 2,
            kind: uapi::MAP_KIND_GPU,
            ..Default::default()
        });
        e.errno(
            &format!("MAP GPU (persistent {persistent}) with a read-only argument"),
            dev.ioctl_raw(uapi::IOCTL_MAP, args as usize),
            libc::EFAULT,
        );
        if bus.contains(&0) {
            e.fail(format!(
                "bus addresses {bus:x?}: the MAP did not get as far as its last step"
            ));
        }
        let (pins, now) = (fake_get("pinned")?, attr("bytes_pinned")?);
        if pins != 0 || now != bytes {
            e.fail(format!(
                "persistent {persistent}: {pins} GPU pins and {now} bytes pinned (was {bytes}) \
                 after the failed MAP, while the queue pair lives"
            ));
        }
    }
    fake_set("persistent", "1")?;
    e.result()
}

/// One xorshift stream per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Several threads hammer every entry point for a bounded time: a writer thread maps host and
/// GPU memory, creates and deletes queues, submits I/O and maps/unmaps the doorbells; another
/// closes and reopens the writer's file under it; readers run INFO and ADMIN; the test double
/// revokes GPU mappings throughout. Afterwards nothing is pinned, no queue exists, and the
/// controller works (the runner checks dmesg for WARN/BUG/oops).
fn test_threaded_fuzz() -> TestResult {
    let base = fake_get("va_base")?;
    fake_set("persistent", "0")?;
    let stop = Arc::new(AtomicBool::new(false));
    let until = Instant::now() + Duration::from_secs(6);
    let mut threads = Vec::new();
    // The writer's file lives in a slot other threads may close and replace.
    let slot: Arc<std::sync::Mutex<Option<Arc<Dev>>>> = Arc::new(std::sync::Mutex::new(None));
    for t in 0..2u64 {
        let (slot, stop) = (slot.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng(0x9e37_79b9 + t);
            let mut ops = 0u64;
            // Host memory comes from one arena per thread (nothing grows); each thread uses and
            // deletes only its own two qids, so no thread waits on a queue another deleted.
            // Pages 0..6 hold the rings of the thread's two queues, the rest data.
            let arena = anon(64 * PAGE) as usize;
            let piece = |rng: &mut Rng, pages: usize| {
                (arena + (6 + rng.next() as usize % (58 - pages)) * PAGE) as *mut u8
            };
            let rings = |i: u32| (arena + 3 * i as usize * PAGE) as *mut u8;
            while !stop.load(Ordering::Relaxed) {
                let dev = {
                    let mut s = slot.lock().expect("slot");
                    if s.is_none() {
                        *s = Dev::open().ok().map(Arc::new);
                    }
                    s.clone()
                };
                let Some(dev) = dev else { continue };
                match rng.next() % 8 {
                    0 => {
                        let _ = map_gpu(&dev, base + (rng.next() % 8) * GPU_PAGE, GPU_PAGE);
                    }
                    1 => {
                        let pages = 1 + rng.next() as usize % 8;
                        let _ = Buf::at(&dev, piece(&mut rng, pages), pages * PAGE);
                    }
                    2 => {
                        let _ = dev.unmap(1 + (rng.next() % 64) as u32);
                    }
                    3 => {
                        let _ = dev.delete_queue_pair(1 + 2 * t as u32 + (rng.next() % 2) as u32);
                    }
                    4 => {
                        let i = (rng.next() % 2) as u32;
                        if let Ok(db) = dev.doorbells()
                            && let Ok(mem) = Buf::at(&dev, rings(i), 3 * PAGE)
                            && let Ok(mut q) =
                                Queue::create_in(&dev, 1 + 2 * t as u32 + i, 8, db.ptr, mem)
                            && let Ok(b) = Buf::at(&dev, piece(&mut rng, 1), PAGE)
                        {
                            let _ = q.rw(Opcode::Read, rng.next() % 1000, 8, &b, 0);
                        }
                    }
                    5 => {
                        // Close (the last reference goes with the other thread's, if any).
                        slot.lock().expect("slot").take();
                    }
                    _ => {
                        let _ = dev.info();
                    }
                }
                ops += 1;
            }
            ops
        }));
    }
    {
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(ro) = Dev::open_ro() {
                    let _ = basic::identify_serial(&ro);
                }
                n += 1;
            }
            n
        }));
    }
    {
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let _ = fake_set("revoke", "1");
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            n
        }));
    }
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let counts: Vec<u64> = threads
        .into_iter()
        .map(|t| t.join().map_err(|_| "a fuzz thread panicked".to_string()))
        .collect::<Result<_, _>>()?;
    slot.lock().expect("slot").take();
    fake_set("revoke", "1")?;
    fake_set("persistent", "1")?;
    let [queues, bytes, _] = counters()?;
    check(
        queues == 0 && bytes == 0 && fake_get("pinned")? == 0,
        || {
            format!(
                "after the fuzz ({counts:?} operations): {queues} queue pairs, {bytes} bytes, {} GPU pins",
                fake_get("pinned").unwrap_or(99)
            )
        },
    )?;
    // Progress, not speed: each revocation deletes the writer's queues with admin commands,
    // which the emulated controller runs slowly.
    check(counts.iter().all(|&n| n >= 3), || {
        format!("too few operations per thread: {counts:?}")
    })?;
    // Still a working controller.
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let b = Buf::new(&dev, PAGE)?;
    let st = q.rw(Opcode::Read, 0, 8, &b, 0)?;
    check(st.is_success(), || format!("I/O after the fuzz: {st}"))
}
