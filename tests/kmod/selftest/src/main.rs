//! Selftests of the `legend_nvme` kernel module, run inside QEMU by `tests/kmod/run`.
//!
//! Subcommands:
//! - `gen-image PATH BLOCKS` (host): writes the NVMe backing image with a known pattern;
//! - `verify-image PATH` (host, after the guest ran): checks the blocks the guest wrote;
//! - `guest` (in QEMU): the ioctl, I/O, bad-input, fuzz and cleanup tests;
//! - `unbind BDF` (in QEMU): unbind and rebind with an open file descriptor and live queue;
//! - `legendctl BDF` (in QEMU, controller bound to `nvme`): `legendctl device list|bind|info|
//!   health|unbind` spawned from `/bin/legendctl`, a round trip back to `nvme` (see `legendctl.rs`);
//! - `bind BDF` (in QEMU, controller bound to `nvme`): `legend-nvme`'s `Sysfs::list` and
//!   `Sysfs::bind`, refused while the namespace is open, then forced;
//! - `gpu` (in QEMU, with the `nv_p2p_fake` test double of NVIDIA's P2P API loaded): GPU
//!   mappings, DMA through them, the free callback and its races;
//! - `handback BDF` (in QEMU): `Sysfs::unbind` back to `nvme`, reading through the block device,
//!   and `Sysfs::bind` again.
//!
//! Each test prints `ok NAME` or `FAIL NAME: reason`; the runner counts those lines.

use std::{
    fs::{self, File},
    io::{Read, Seek, SeekFrom, Write},
    os::fd::{AsRawFd, RawFd},
    ptr,
    sync::atomic::{Ordering, fence},
    time::{Duration, Instant},
};

use legend_nvme::Sysfs;
use legend_uapi as uapi;

mod legendctl;

const BLOCK: usize = 512;
const PAGE: usize = 4096;
/// First LBA the guest writes (seed 1); the host checks these after the run.
const WRITE_BASE: u64 = 4096;
/// Blocks written per queue by the concurrent test.
const WRITE_SPAN: u64 = 256;
const QUEUES: u64 = 4;
const DEV: &str = "/dev/legend-nvme0";
/// What QEMU's `-device nvme` emulates (with the runner's serial and image size in the
/// environment): checked through the ioctl by `info` and through `legendctl` by `legendctl-info`.
const QEMU_MODEL: &str = "QEMU NVMe Ctrl";
const QEMU_MQES: u32 = 2048;
const QEMU_DOORBELL_STRIDE: u32 = 4;
const QEMU_PCI_ID: (u16, u16) = (0x1b36, 0x0010);
/// The CLI under test, built statically by the runner.
const LEGENDCTL: &str = "/bin/legendctl";

type TestResult = Result<(), String>;
type Test = fn() -> TestResult;

/// Deterministic block contents: `seed` 0 is the image as generated, 1 what the guest writes.
fn pattern(lba: u64, seed: u64) -> Vec<u8> {
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

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

struct Dev {
    file: File,
}

impl Dev {
    fn open() -> Result<Self, String> {
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(DEV)
            .map_err(|e| format!("open {DEV}: {e}"))?;
        Ok(Self { file })
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Raw ioctl; `Err(errno)` on failure.
    fn ioctl_raw(&self, cmd: u32, arg: usize) -> Result<(), i32> {
        // SAFETY: the caller passes an argument pointer sized for `cmd` (or deliberately bad
        // pointers, which the kernel must reject with EFAULT).
        let r = unsafe { libc::ioctl(self.fd(), cmd as libc::c_ulong, arg) };
        if r < 0 { Err(errno()) } else { Ok(()) }
    }

    fn ioctl<T>(&self, cmd: u32, arg: &mut T) -> Result<(), i32> {
        self.ioctl_raw(cmd, ptr::from_mut(arg) as usize)
    }

    fn info(&self) -> Result<uapi::Info, String> {
        // SAFETY: `Info` is plain integers; all-zero is valid.
        let mut info: uapi::Info = unsafe { std::mem::zeroed() };
        self.ioctl(uapi::IOCTL_INFO, &mut info)
            .map_err(|e| format!("INFO: errno {e}"))?;
        Ok(info)
    }

    fn doorbells(&self, len: usize) -> Result<Doorbells, String> {
        // SAFETY: a fresh shared mapping of the device; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            Err(format!("mmap doorbells: errno {}", errno()))
        } else {
            Ok(Doorbells { ptr: p.cast(), len })
        }
    }
}

/// The doorbell mapping; unmapped on drop (a mapping keeps the file, and so its queues, alive).
struct Doorbells {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Doorbells {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; queues using it are dropped first by the tests.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Anonymous page-aligned memory mapped for the controller.
struct Buf {
    ptr: *mut u8,
    len: usize,
    handle: u32,
    bus: Vec<u64>,
}

// SAFETY: the buffer is plain memory owned by this object; threads use disjoint buffers.
unsafe impl Send for Buf {}

fn anon(len: usize) -> *mut u8 {
    // SAFETY: anonymous private mapping; checked below.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    assert!(p != libc::MAP_FAILED, "mmap anonymous");
    p.cast()
}

impl Buf {
    fn new(dev: &Dev, len: usize) -> Result<Self, String> {
        let ptr = anon(len);
        let mut bus = vec![0u64; len / PAGE];
        let mut args = uapi::MapArgs {
            addr: ptr as u64,
            len: len as u64,
            bus_addrs: bus.as_mut_ptr() as u64,
            bus_addrs_cap: bus.len() as u32,
            kind: uapi::MAP_KIND_HOST,
            ..Default::default()
        };
        dev.ioctl(uapi::IOCTL_MAP, &mut args)
            .map_err(|e| format!("MAP: errno {e}"))?;
        if args.pages as usize != bus.len()
            || args.page_size as usize != PAGE
            || bus.iter().any(|&b| b == 0 || b % PAGE as u64 != 0)
        {
            return Err(format!("MAP returned bad output {args:?}"));
        }
        Ok(Self {
            ptr,
            len,
            handle: args.handle,
            bus,
        })
    }

    fn slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live mapping of `len` bytes owned by this object.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// An I/O queue pair driven entirely from userspace.
struct Queue {
    qid: u32,
    depth: u16,
    mem: Buf,
    sq_db: *mut u32,
    cq_db: *mut u32,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    cid: u16,
}

// SAFETY: a queue is used by one thread at a time; the doorbell mapping outlives it.
unsafe impl Send for Queue {}

impl Queue {
    /// Creates queue pair `qid`: SQ in the first page of its memory, CQ in the second.
    fn create(dev: &Dev, qid: u32, depth: u16, doorbells: *mut u8) -> Result<Self, String> {
        let mem = Buf::new(dev, 2 * PAGE)?;
        let mut args = uapi::QueuePairArgs {
            qid,
            depth: u32::from(depth),
            sq_handle: mem.handle,
            cq_handle: mem.handle,
            sq_offset: 0,
            cq_offset: PAGE as u64,
            ..Default::default()
        };
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args)
            .map_err(|e| format!("CREATE_QUEUE_PAIR {qid}: errno {e}"))?;
        // SAFETY: the offsets lie inside the doorbell mapping (checked against doorbell_len by
        // the driver, which computed them).
        let (sq_db, cq_db) = unsafe {
            (
                doorbells.add(args.sq_doorbell as usize).cast(),
                doorbells.add(args.cq_doorbell as usize).cast(),
            )
        };
        Ok(Self {
            qid,
            depth,
            mem,
            sq_db,
            cq_db,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            cid: 0,
        })
    }

    /// Submits one command and polls its completion; returns the status field.
    fn run(&mut self, mut sqe: [u32; 16]) -> Result<u16, String> {
        self.cid = self.cid.wrapping_add(1);
        sqe[0] |= u32::from(self.cid) << 16;
        let sq = self.mem.ptr.cast::<[u32; 16]>();
        // SAFETY: `sq_tail < depth` entries of 64 bytes fit in the SQ page.
        unsafe { ptr::write_volatile(sq.add(usize::from(self.sq_tail)), sqe) };
        self.sq_tail = (self.sq_tail + 1) % self.depth;
        fence(Ordering::SeqCst);
        // SAFETY: the doorbell is a mapped, aligned device register.
        unsafe { ptr::write_volatile(self.sq_db, u32::from(self.sq_tail)) };
        // SAFETY: the CQ is the second page of the queue memory.
        let cq = unsafe { self.mem.ptr.add(PAGE).cast::<[u32; 4]>() };
        let start = Instant::now();
        let cqe = loop {
            // SAFETY: `cq_head < depth` entries of 16 bytes fit in the CQ page.
            let e = unsafe { ptr::read_volatile(cq.add(usize::from(self.cq_head))) };
            if ((e[3] >> 16) & 1 == 1) == self.phase {
                break e;
            }
            if start.elapsed() > Duration::from_secs(20) {
                return Err(format!("queue {}: no completion within 20 s", self.qid));
            }
            std::hint::spin_loop();
        };
        fence(Ordering::SeqCst);
        self.cq_head = (self.cq_head + 1) % self.depth;
        if self.cq_head == 0 {
            self.phase = !self.phase;
        }
        // SAFETY: as above.
        unsafe { ptr::write_volatile(self.cq_db, u32::from(self.cq_head)) };
        if (cqe[3] & 0xffff) as u16 != self.cid {
            return Err(format!(
                "queue {}: completion for cid {} not {}",
                self.qid,
                cqe[3] & 0xffff,
                self.cid
            ));
        }
        Ok(((cqe[3] >> 17) & 0x7ff) as u16)
    }

    /// Read (opcode 2) or write (1) of `blocks` blocks at `lba` to/from `buf` (page aligned).
    fn rw(
        &mut self,
        opcode: u32,
        lba: u64,
        blocks: u32,
        buf: &Buf,
        page: usize,
    ) -> Result<u16, String> {
        let bytes = blocks as usize * BLOCK;
        let prp2 = if bytes > PAGE { buf.bus[page + 1] } else { 0 };
        assert!(
            bytes <= 2 * PAGE,
            "tests use at most two pages (no PRP lists)"
        );
        self.rw_prp(opcode, lba, blocks, buf.bus[page], prp2)
    }

    /// As [`Queue::rw`], with the PRP entries given as bus addresses.
    fn rw_prp(
        &mut self,
        opcode: u32,
        lba: u64,
        blocks: u32,
        prp1: u64,
        prp2: u64,
    ) -> Result<u16, String> {
        let mut sqe = [0u32; 16];
        sqe[0] = opcode;
        sqe[1] = 1;
        sqe[6] = prp1 as u32;
        sqe[7] = (prp1 >> 32) as u32;
        sqe[8] = prp2 as u32;
        sqe[9] = (prp2 >> 32) as u32;
        sqe[10] = lba as u32;
        sqe[11] = (lba >> 32) as u32;
        sqe[12] = blocks - 1;
        self.run(sqe)
    }
}

fn check(cond: bool, msg: impl FnOnce() -> String) -> TestResult {
    if cond { Ok(()) } else { Err(msg()) }
}

fn trimmed(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_end_matches([' ', '\0'])
        .to_string()
}

fn expect_env(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

fn test_info() -> TestResult {
    let info = Dev::open()?.info()?;
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

fn admin(
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

fn test_admin() -> TestResult {
    let dev = Dev::open()?;
    let mut buf = vec![0u8; 4096];
    let a = admin(&dev, uapi::ADMIN_OPC_IDENTIFY, 0, 1, &mut buf)
        .map_err(|e| format!("identify: errno {e}"))?;
    check(
        a.status == 0 && trimmed(&buf[4..24]) == expect_env("LEGEND_SERIAL"),
        || {
            format!(
                "identify status {} serial {:?}",
                a.status,
                trimmed(&buf[4..24])
            )
        },
    )?;
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
    })
}

fn test_map() -> TestResult {
    let dev = Dev::open()?;
    let mut b = Buf::new(&dev, 16 * PAGE)?;
    b.slice()[0] = 1;
    let mut u = uapi::UnmapArgs {
        handle: b.handle,
        flags: 0,
    };
    dev.ioctl(uapi::IOCTL_UNMAP, &mut u)
        .map_err(|e| format!("UNMAP: errno {e}"))?;
    check(
        dev.ioctl(uapi::IOCTL_UNMAP, &mut u) == Err(libc::ENOENT),
        || "double UNMAP accepted".into(),
    )
}

fn test_io() -> TestResult {
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
    let mut q = Queue::create(&dev, 1, 64, db.ptr)?;
    let mut buf = Buf::new(&dev, 4 * PAGE)?;
    // Read 16 blocks (two pages, PRP2) of the generated image and compare.
    let st = q.rw(2, 100, 16, &buf, 0)?;
    check(st == 0, || format!("read status {st:#x}"))?;
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
    let st = q.rw(1, WRITE_BASE, 8, &buf, 0)?;
    check(st == 0, || format!("write status {st:#x}"))?;
    let st = q.rw(2, WRITE_BASE, 8, &buf, 2)?;
    check(st == 0, || format!("read-back status {st:#x}"))?;
    for i in 0..8u64 {
        let got = &buf.slice()[2 * PAGE + i as usize * BLOCK..][..BLOCK];
        check(got == pattern(WRITE_BASE + i, 1).as_slice(), || {
            format!("read-after-write lba {}", WRITE_BASE + i)
        })?;
    }
    // Out of range: LBA Out of Range is generic status 0x80.
    let st = q.rw(2, info.namespaces[0].blocks, 1, &buf, 0)?;
    check(st == 0x80, || {
        format!("out-of-range read status {st:#x}, want 0x80")
    })?;
    let mut d = uapi::DeleteQueuePairArgs { qid: 1, flags: 0 };
    dev.ioctl(uapi::IOCTL_DELETE_QUEUE_PAIR, &mut d)
        .map_err(|e| format!("DELETE: errno {e}"))
}

fn test_concurrent() -> TestResult {
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
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
                    let st = q.rw(1, base + chunk, 8, &b, 0)?;
                    check(st == 0, || format!("queue {}: write status {st:#x}", q.qid))?;
                    b.slice()[PAGE..].fill(0);
                    let st = q.rw(2, base + chunk, 8, &b, 1)?;
                    check(st == 0, || format!("queue {}: read status {st:#x}", q.qid))?;
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

/// The driver's counters in `/sys/bus/pci/devices/<BDF>/legend_nvme/`.
fn counters() -> Result<[u64; 3], String> {
    let dir = format!(
        "/sys/bus/pci/devices/{}/legend_nvme",
        expect_env("LEGEND_BDF")
    );
    let mut out = [0; 3];
    for (v, name) in out
        .iter_mut()
        .zip(["queue_pairs", "bytes_pinned", "admin_commands"])
    {
        let text = fs::read_to_string(format!("{dir}/{name}"))
            .map_err(|e| format!("read {dir}/{name}: {e}"))?;
        *v = text
            .trim()
            .parse()
            .map_err(|_| format!("{name}: {text:?} is not a number"))?;
    }
    Ok(out)
}

fn test_sysfs_counters() -> TestResult {
    let [q0, b0, a0] = counters()?;
    check(q0 == 0 && b0 == 0, || {
        format!("idle controller: {q0} queue pairs, {b0} bytes pinned")
    })?;
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
    let buf = Buf::new(&dev, 4 * PAGE)?;
    let [q, b, a] = counters()?;
    check(q == 0 && b == 4 * PAGE as u64 && a == a0, || {
        format!("after MAP of 4 pages: {q} queue pairs, {b} bytes, {a} admin commands (was {a0})")
    })?;
    // The queue's memory is one more 2-page mapping; creating it issues Create I/O CQ and SQ.
    let q1 = Queue::create(&dev, 1, 16, db.ptr)?;
    let [q, b, a] = counters()?;
    check(q == 1 && b == 6 * PAGE as u64 && a == a0 + 2, || {
        format!(
            "after CREATE_QUEUE_PAIR: {q} queue pairs, {b} bytes, {a} admin commands (was {a0})"
        )
    })?;
    drop((q1, buf, db, dev));
    let [q, b, a] = counters()?;
    // Closing the file deletes the queue pair (Delete I/O SQ and CQ) and releases the mappings.
    check(q == 0 && b == 0 && a == a0 + 4, || {
        format!("after close: {q} queue pairs, {b} bytes, {a} admin commands (was {a0})")
    })
}

/// UNMAP of a data buffer while the file has a live queue pair is refused and changes nothing
/// (the queue keeps working, nothing is unpinned); after DELETE_QUEUE_PAIR it succeeds.
fn test_unmap_live_queue() -> TestResult {
    let [q0, b0, _] = counters()?;
    check(q0 == 0 && b0 == 0, || {
        format!("idle controller: {q0} queue pairs, {b0} bytes pinned")
    })?;
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
    let mut data = Buf::new(&dev, 2 * PAGE)?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let st = q.rw(2, 100, 8, &data, 0)?;
    check(st == 0, || format!("read status {st:#x}"))?;
    let pinned = 4 * PAGE as u64;
    for h in [data.handle, q.mem.handle] {
        check(unmap(&dev, h) == Err(libc::EBUSY), || {
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
    let st = q.rw(2, 100, 8, &data, 1)?;
    check(st == 0, || {
        format!("read after refused UNMAP: status {st:#x}")
    })?;
    check(
        &data.slice()[PAGE..][..BLOCK] == pattern(100, 0).as_slice(),
        || "read after refused UNMAP: wrong data".into(),
    )?;
    dev.ioctl(
        uapi::IOCTL_DELETE_QUEUE_PAIR,
        &mut uapi::DeleteQueuePairArgs { qid: 1, flags: 0 },
    )
    .map_err(|e| format!("DELETE: errno {e}"))?;
    unmap(&dev, data.handle).map_err(|e| format!("UNMAP after DELETE: errno {e}"))?;
    let [queues, bytes, _] = counters()?;
    check(queues == 0 && bytes == 2 * PAGE as u64, || {
        format!("after DELETE and UNMAP: {queues} queue pairs, {bytes} bytes pinned")
    })?;
    unmap(&dev, q.mem.handle).map_err(|e| format!("UNMAP queue memory: errno {e}"))?;
    let [_, bytes, _] = counters()?;
    check(bytes == 0, || format!("{bytes} bytes still pinned"))
}

fn test_bad_inputs() -> TestResult {
    let dev = Dev::open()?;
    let other = Dev::open()?;
    let info = dev.info()?;
    let good = Buf::new(&dev, 4 * PAGE)?;
    // A data buffer no queue lives in: its UNMAP is refused while any queue pair of the file
    // lives (commands may still point into it).
    let data = Buf::new(&dev, PAGE)?;
    let mut bus = vec![0u64; 1 << 20];
    let busp = bus.as_mut_ptr() as u64;
    let map = |addr: u64, len: u64, cap: u32, kind: u32, flags: u32| uapi::MapArgs {
        addr,
        len,
        bus_addrs: busp,
        bus_addrs_cap: cap,
        kind,
        flags,
        ..Default::default()
    };
    let a = anon(2 * PAGE) as u64;
    let qp = |qid: u32, depth: u32, sqh: u32, sqo: u64| uapi::QueuePairArgs {
        qid,
        depth,
        sq_handle: sqh,
        cq_handle: good.handle,
        sq_offset: sqo,
        cq_offset: PAGE as u64,
        ..Default::default()
    };
    let mut fails = Vec::new();
    let mut expect = |name: &str, got: Result<(), i32>, want: i32| {
        if got != Err(want) {
            fails.push(format!("{name}: got {got:?}, want errno {want}"));
        }
    };
    expect("unknown ioctl", dev.ioctl_raw(0x4c99, 0), libc::ENOTTY);
    expect(
        "INFO to NULL",
        dev.ioctl_raw(uapi::IOCTL_INFO, 0),
        libc::EFAULT,
    );
    expect(
        "MAP flags",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(a, 4096, 16, 0, 1)),
        libc::EINVAL,
    );
    expect(
        "MAP kind",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(a, 4096, 16, 7, 0)),
        libc::EINVAL,
    );
    expect(
        "MAP len 0",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(a, 0, 16, 0, 0)),
        libc::EINVAL,
    );
    expect(
        "MAP unaligned addr",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(a + 8, 4096, 16, 0, 0)),
        libc::EINVAL,
    );
    expect(
        "MAP unaligned len",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(a, 100, 16, 0, 0)),
        libc::EINVAL,
    );
    expect(
        "MAP overflow",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(u64::MAX - 4095, 8192, 16, 0, 0)),
        libc::EINVAL,
    );
    expect(
        "MAP too large",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(a, 4 << 30, 1 << 20, 0, 0)),
        libc::E2BIG,
    );
    expect(
        "MAP small bus array",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(a, 8192, 1, 0, 0)),
        libc::ENOSPC,
    );
    expect(
        "MAP unmapped memory",
        dev.ioctl(uapi::IOCTL_MAP, &mut map(0x1000, 4096, 16, 0, 0)),
        libc::EFAULT,
    );
    expect(
        "MAP GPU without NVIDIA",
        dev.ioctl(
            uapi::IOCTL_MAP,
            // 64 KiB aligned, as GPU mappings must be; checked before looking for NVIDIA.
            &mut map(0x7f00_0000_0000, 65536, 16, uapi::MAP_KIND_GPU, 0),
        ),
        libc::EOPNOTSUPP,
    );
    let mut bad_out = map(a, 4096, 16, 0, 0);
    bad_out.bus_addrs = 16;
    expect(
        "MAP bad output pointer",
        dev.ioctl(uapi::IOCTL_MAP, &mut bad_out),
        libc::EFAULT,
    );
    expect(
        "UNMAP unknown",
        dev.ioctl(
            uapi::IOCTL_UNMAP,
            &mut uapi::UnmapArgs {
                handle: 9999,
                flags: 0,
            },
        ),
        libc::ENOENT,
    );
    expect(
        "UNMAP flags",
        dev.ioctl(
            uapi::IOCTL_UNMAP,
            &mut uapi::UnmapArgs {
                handle: good.handle,
                flags: 1,
            },
        ),
        libc::EINVAL,
    );
    expect(
        "UNMAP other file's",
        other.ioctl(
            uapi::IOCTL_UNMAP,
            &mut uapi::UnmapArgs {
                handle: good.handle,
                flags: 0,
            },
        ),
        libc::ENOENT,
    );
    expect(
        "CREATE qid 0",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(0, 16, good.handle, 0),
        ),
        libc::EINVAL,
    );
    expect(
        "CREATE qid too big",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(info.queue_pairs + 1, 16, good.handle, 0),
        ),
        libc::EINVAL,
    );
    expect(
        "CREATE depth 1",
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut qp(1, 1, good.handle, 0)),
        libc::EINVAL,
    );
    expect(
        "CREATE depth > MQES",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(1, info.max_queue_entries + 1, good.handle, 0),
        ),
        libc::EINVAL,
    );
    expect(
        "CREATE unknown handle",
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut qp(1, 16, 9999, 0)),
        libc::ENOENT,
    );
    expect(
        "CREATE other file's handle",
        other.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(1, 16, good.handle, 0),
        ),
        libc::ENOENT,
    );
    expect(
        "CREATE unaligned offset",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(1, 16, good.handle, 64),
        ),
        libc::EINVAL,
    );
    expect(
        "CREATE beyond mapping",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(1, 256, good.handle, 3 * PAGE as u64),
        ),
        libc::EINVAL,
    );
    expect(
        "CREATE offset overflow",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(1, 16, good.handle, u64::MAX - 4095),
        ),
        libc::EINVAL,
    );
    let created = dev.ioctl(
        uapi::IOCTL_CREATE_QUEUE_PAIR,
        &mut qp(1, 16, good.handle, 0),
    );
    expect("CREATE valid (control)", created.and(Err(-1)), -1);
    expect(
        "CREATE qid in use",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(1, 16, good.handle, 2 * PAGE as u64),
        ),
        libc::EBUSY,
    );
    expect(
        "UNMAP in use",
        dev.ioctl(
            uapi::IOCTL_UNMAP,
            &mut uapi::UnmapArgs {
                handle: good.handle,
                flags: 0,
            },
        ),
        libc::EBUSY,
    );
    expect(
        "UNMAP data buffer with a live queue pair",
        dev.ioctl(
            uapi::IOCTL_UNMAP,
            &mut uapi::UnmapArgs {
                handle: data.handle,
                flags: 0,
            },
        ),
        libc::EBUSY,
    );
    expect(
        "DELETE other file's",
        other.ioctl(
            uapi::IOCTL_DELETE_QUEUE_PAIR,
            &mut uapi::DeleteQueuePairArgs { qid: 1, flags: 0 },
        ),
        libc::ENOENT,
    );
    expect(
        "DELETE flags",
        dev.ioctl(
            uapi::IOCTL_DELETE_QUEUE_PAIR,
            &mut uapi::DeleteQueuePairArgs { qid: 1, flags: 1 },
        ),
        libc::EINVAL,
    );
    expect(
        "DELETE unknown",
        dev.ioctl(
            uapi::IOCTL_DELETE_QUEUE_PAIR,
            &mut uapi::DeleteQueuePairArgs { qid: 2, flags: 0 },
        ),
        libc::ENOENT,
    );
    let mut buf = vec![0u8; 8192];
    expect(
        "ADMIN format",
        admin(&dev, 0x80, 1, 0, &mut buf[..4096]).map(|_| ()),
        libc::EPERM,
    );
    expect(
        "ADMIN error log",
        admin(&dev, uapi::ADMIN_OPC_GET_LOG_PAGE, 0, 1, &mut buf[..4096]).map(|_| ()),
        libc::EPERM,
    );
    expect(
        "ADMIN len 0",
        admin(&dev, uapi::ADMIN_OPC_IDENTIFY, 0, 1, &mut buf[..0]).map(|_| ()),
        libc::EINVAL,
    );
    expect(
        "ADMIN len 8192",
        admin(&dev, uapi::ADMIN_OPC_IDENTIFY, 0, 1, &mut buf).map(|_| ()),
        libc::EINVAL,
    );
    let mut a = uapi::AdminArgs {
        opcode: uapi::ADMIN_OPC_IDENTIFY,
        data: 16,
        data_len: 4096,
        ..Default::default()
    };
    a.cdw[0] = 1;
    expect(
        "ADMIN bad data pointer",
        dev.ioctl(uapi::IOCTL_ADMIN, &mut a),
        libc::EFAULT,
    );
    for (name, len, off) in [
        ("mmap offset", PAGE, PAGE as i64),
        ("mmap too long", info.doorbell_len as usize + PAGE, 0),
    ] {
        // SAFETY: a mapping request the driver must refuse; unmapped if it does not.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                dev.fd(),
                off,
            )
        };
        let got = if p == libc::MAP_FAILED {
            Err(errno())
        } else {
            Ok(())
        };
        expect(name, got, libc::EINVAL);
    }
    if fails.is_empty() {
        Ok(())
    } else {
        Err(fails.join("; "))
    }
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
    let dev = Dev::open()?;
    let info = dev.info()?;
    // SAFETY: the child only performs ioctls and exits without unwinding into the parent.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = (|| -> TestResult {
            let d = Dev::open()?;
            let db = d.doorbells(info.doorbell_len as usize)?;
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
    let db = dev.doorbells(info.doorbell_len as usize)?;
    Queue::create(&dev, 3, 16, db.ptr)
        .map(|_| ())
        .map_err(|e| format!("qid 3 not released by process death: {e}"))
}

/// Unbind with an open fd, a live queue and a doorbell mapping; then rebind and use it again.
fn test_unbind(bdf: &str) -> TestResult {
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
    let _q = Queue::create(&dev, 2, 16, db.ptr)?;
    let _b = Buf::new(&dev, 4 * PAGE)?;
    fs::write("/sys/bus/pci/drivers/legend_nvme/unbind", bdf)
        .map_err(|e| format!("unbind: {e}"))?;
    check(dev.info().is_ok(), || {
        "INFO should still answer from the cached identity".into()
    })?;
    let mut bus = [0u64; 4];
    let a = anon(PAGE);
    let mut m = uapi::MapArgs {
        addr: a as u64,
        len: PAGE as u64,
        bus_addrs: bus.as_mut_ptr() as u64,
        bus_addrs_cap: 4,
        ..Default::default()
    };
    check(
        dev.ioctl(uapi::IOCTL_MAP, &mut m) == Err(libc::ENODEV),
        || "MAP after unbind not ENODEV".into(),
    )?;
    drop(dev);
    fs::write("/sys/bus/pci/drivers/legend_nvme/bind", bdf).map_err(|e| format!("bind: {e}"))?;
    let start = Instant::now();
    while fs::metadata(DEV).is_err() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
    let mut q = Queue::create(&dev, 2, 16, db.ptr)?;
    let buf = Buf::new(&dev, PAGE)?;
    let st = q.rw(2, 0, 1, &buf, 0)?;
    check(st == 0, || format!("read after rebind status {st:#x}"))
}

const FAKE: &str = "/sys/module/nv_p2p_fake/parameters";
const GPU_PAGE: u64 = uapi::GPU_PAGE_SIZE as u64;
/// Where the GPU test writes (outside what `verify-image` checks).
const GPU_LBA: u64 = 8192;

fn fake_get(name: &str) -> Result<u64, String> {
    let text = fs::read_to_string(format!("{FAKE}/{name}")).map_err(|e| format!("{name}: {e}"))?;
    text.trim()
        .parse()
        .map_err(|_| format!("{name}: {text:?} is not a number"))
}

fn fake_set(name: &str, value: &str) -> TestResult {
    fs::write(format!("{FAKE}/{name}"), value).map_err(|e| format!("set {name}: {e}"))
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

fn unmap(dev: &Dev, handle: u32) -> Result<(), i32> {
    dev.ioctl(uapi::IOCTL_UNMAP, &mut uapi::UnmapArgs { handle, flags: 0 })
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
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let mut host = Buf::new(&dev, PAGE)?;
    // Image -> GPU page 0 -> LBA GPU_LBA -> host memory.
    for (op, lba, prp) in [(2, 100, bus[0]), (1, GPU_LBA, bus[0])] {
        let st = q.rw_prp(op, lba, 8, prp, 0)?;
        check(st == 0, || {
            format!("opcode {op} via GPU memory: status {st:#x}")
        })?;
    }
    let st = q.rw(2, GPU_LBA, 8, &host, 0)?;
    check(st == 0, || format!("read back status {st:#x}"))?;
    for i in 0..8u64 {
        check(
            host.slice()[i as usize * BLOCK..][..BLOCK] == pattern(100 + i, 0),
            || format!("block {i} did not travel through the GPU pages"),
        )?;
    }
    check(unmap(&dev, h) == Err(libc::EBUSY), || {
        "UNMAP GPU with a live queue pair not refused".into()
    })?;
    check(fake_get("pinned")? == 1, || {
        "refused UNMAP dropped the pin".into()
    })?;
    dev.ioctl(
        uapi::IOCTL_DELETE_QUEUE_PAIR,
        &mut uapi::DeleteQueuePairArgs {
            qid: q.qid,
            flags: 0,
        },
    )
    .map_err(|e| format!("DELETE: errno {e}"))?;
    unmap(&dev, h).map_err(|e| format!("UNMAP GPU: errno {e}"))?;
    check(fake_get("pinned")? == 0, || "UNMAP kept the pin".into())
}

/// Callback mode: NVIDIA frees the memory under a live queue; the driver deletes the owner's
/// queues before the callback returns, refuses the mapping afterwards, and UNMAP still works
/// (even with a queue pair created since).
fn test_gpu_free_callback() -> TestResult {
    let base = fake_get("va_base")?;
    fake_set("persistent", "0")?;
    let dev = Dev::open()?;
    let info = dev.info()?;
    let db = dev.doorbells(info.doorbell_len as usize)?;
    let (h, bus) = map_gpu(&dev, base, 2 * GPU_PAGE).map_err(|e| format!("MAP GPU: errno {e}"))?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let st = q.rw_prp(2, 100, 8, bus[1], 0)?;
    check(st == 0, || format!("read into GPU memory: status {st:#x}"))?;
    fake_set("revoke", "1")?;
    let [queues, bytes, _] = counters()?;
    check(fake_get("pinned")? == 0, || "pin survived revoke".into())?;
    // What is left pinned is the queue's own 2 host pages.
    check(queues == 0 && bytes == 2 * PAGE as u64, || {
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
    // Freed memory holds nothing the device could reach: UNMAP is allowed with a live queue.
    let _q2 = Queue::create(&dev, 2, 16, db.ptr)?;
    unmap(&dev, h).map_err(|e| format!("UNMAP after revoke, with a live queue: errno {e}"))?;
    fake_set("persistent", "1")
}

/// MAP, UNMAP and close race with the free callback for a while; nothing may leak or hang.
fn test_gpu_callback_race() -> TestResult {
    let base = fake_get("va_base")?;
    fake_set("persistent", "0")?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
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
    let mut dev = Dev::open()?;
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(3) {
        i += 1;
        if i % 16 == 0 {
            // Close with live (or revoked) mappings.
            dev = Dev::open()?;
        }
        match map_gpu(&dev, base + (i % 8) * GPU_PAGE, GPU_PAGE) {
            Ok((h, _)) => {
                maps += 1;
                if i % 3 != 0 && unmap(&dev, h).is_err() {
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
    let mut fails = Vec::new();
    let mut expect = |name: &str, got: Result<(u32, Vec<u64>), i32>, want: i32| {
        let got = got.map(|_| ());
        if got != Err(want) {
            fails.push(format!("{name}: got {got:?}, want errno {want}"));
        }
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
        fails.push(format!("newer minor version refused: {newer:?}"));
    }
    drop(dev);
    check(fake_get("pinned")? == 0, || {
        "a refused MAP leaked a pin".into()
    })?;
    if fails.is_empty() {
        Ok(())
    } else {
        Err(fails.join("; "))
    }
}

/// Waits up to 15 s for `path` to appear (the `nvme` driver scans namespaces asynchronously).
fn wait_for(path: &str) -> TestResult {
    let start = Instant::now();
    while fs::metadata(path).is_err() {
        if start.elapsed() > Duration::from_secs(15) {
            return Err(format!("{path} did not appear within 15 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// `Sysfs::list` while the stock driver holds the controller.
fn test_device_list(bdf: &str) -> TestResult {
    let list = Sysfs::default().list().map_err(|e| format!("list: {e}"))?;
    let [c] = list.as_slice() else {
        return Err(format!("want one controller, got {list:?}"));
    };
    check(
        c.bdf == bdf
            && c.driver.as_deref() == Some("nvme")
            && c.id == QEMU_PCI_ID
            && c.block_devices == ["nvme0n1"]
            && c.char_device.is_none(),
        || format!("{c:?}"),
    )
}

/// `Sysfs::bind` refuses while a namespace is open, then `force` takes it anyway.
fn test_bind_in_use(bdf: &str) -> TestResult {
    let sysfs = Sysfs::default();
    let held = File::open("/dev/nvme0n1").map_err(|e| format!("open /dev/nvme0n1: {e}"))?;
    match sysfs.bind(bdf, false) {
        Err(legend_nvme::Error::InUse { reason, .. }) if reason.contains("open by process") => {}
        other => return Err(format!("bind while open: {other:?}")),
    }
    let c = sysfs.controller(bdf).map_err(|e| e.to_string())?;
    check(c.driver.as_deref() == Some("nvme"), || {
        format!("refused bind still moved the controller: {c:?}")
    })?;
    let c = sysfs
        .bind(bdf, true)
        .map_err(|e| format!("forced bind: {e}"))?;
    drop(held);
    check(
        c.driver.as_deref() == Some("legend_nvme")
            && c.char_device.as_deref() == Some(DEV)
            && c.block_devices.is_empty(),
        || format!("after forced bind: {c:?}"),
    )?;
    Dev::open()?.info().map(|_| ())
}

/// `Sysfs::unbind` hands the controller back to `nvme`, which sees what the queues wrote; then
/// `Sysfs::bind` (nothing open) takes it again.
fn test_handback(bdf: &str) -> TestResult {
    let sysfs = Sysfs::default();
    let c = sysfs.unbind(bdf).map_err(|e| format!("unbind: {e}"))?;
    check(c.driver.as_deref() == Some("nvme"), || {
        format!("after unbind: {c:?}")
    })?;
    wait_for("/dev/nvme0n1")?;
    let mut f = File::open("/dev/nvme0n1").map_err(|e| format!("open /dev/nvme0n1: {e}"))?;
    let mut block = vec![0u8; BLOCK];
    for (lba, seed) in [(0, 0), (100, 0), (WRITE_BASE, 1), (WRITE_BASE + 7, 1)] {
        f.seek(SeekFrom::Start(lba * BLOCK as u64))
            .and_then(|_| f.read_exact(&mut block))
            .map_err(|e| format!("read lba {lba} through nvme: {e}"))?;
        check(block == pattern(lba, seed), || {
            format!("lba {lba} through nvme differs")
        })?;
    }
    drop(f);
    let c = sysfs
        .bind(bdf, false)
        .map_err(|e| format!("bind again: {e}"))?;
    check(
        c.driver.as_deref() == Some("legend_nvme") && c.char_device.as_deref() == Some(DEV),
        || format!("after bind: {c:?}"),
    )?;
    Dev::open()?.info().map(|_| ())
}

fn report(name: &str, r: TestResult) {
    match r {
        Ok(()) => println!("ok {name}"),
        Err(e) => println!("FAIL {name}: {e}"),
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
        "verify-image" => report("image-contents", verify_image(&arg(2))),
        "guest" => {
            let tests: [(&str, Test); 10] = [
                ("info", test_info),
                ("sysfs-counters", test_sysfs_counters),
                ("admin-passthrough", test_admin),
                ("map-host", test_map),
                ("io-read-write", test_io),
                ("io-concurrent-queues", test_concurrent),
                ("unmap-refused-with-live-queue", test_unmap_live_queue),
                ("bad-inputs", test_bad_inputs),
                ("fuzz", test_fuzz),
                ("process-death-cleanup", test_process_death),
            ];
            for (name, t) in tests {
                report(
                    name,
                    std::panic::catch_unwind(t).unwrap_or_else(|_| Err("panicked".into())),
                );
            }
        }
        "unbind" => report("unbind-rebind-open-fd", test_unbind(&arg(2))),
        "legendctl" => legendctl::run(&arg(2)),
        "bind" => {
            report("device-list", test_device_list(&arg(2)));
            report("bind-refused-in-use-then-forced", test_bind_in_use(&arg(2)));
        }
        "gpu" => {
            let tests: [(&str, Test); 4] = [
                ("gpu-persistent-dma", test_gpu_persistent),
                ("gpu-free-callback", test_gpu_free_callback),
                ("gpu-callback-race", test_gpu_callback_race),
                ("gpu-bad-mappings", test_gpu_bad),
            ];
            for (name, t) in tests {
                report(
                    name,
                    std::panic::catch_unwind(t).unwrap_or_else(|_| Err("panicked".into())),
                );
            }
        }
        "handback" => report("unbind-to-nvme-and-rebind", test_handback(&arg(2))),
        _ => {
            eprintln!(
                "usage: legend-kmod-selftest gen-image PATH BLOCKS | verify-image PATH | guest | unbind BDF | legendctl BDF | bind BDF | handback BDF | gpu"
            );
            std::process::exit(2);
        }
    }
}
