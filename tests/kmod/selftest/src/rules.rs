//! What the module refuses: bad arguments, a second writer, read-only files that try to change
//! anything, private or oversized doorbell mappings, overlapping rings, pins beyond
//! `RLIMIT_MEMLOCK`.

use std::ptr;

use crate::{basic::admin, *};

pub const TESTS: &[(&str, Test)] = &[
    ("bad-inputs", test_bad_inputs),
    ("one-writer", test_one_writer),
    ("doorbell-mmap-rules", test_mmap_rules),
    ("overlapping-rings-refused", test_overlap),
    ("memlock-limit", test_memlock),
];

fn test_bad_inputs() -> TestResult {
    let dev = Dev::open()?;
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
    let mut e = Expectations::default();
    e.errno("unknown ioctl", dev.ioctl_raw(0x4c99, 0), libc::ENOTTY);
    e.errno(
        "INFO to NULL",
        dev.ioctl_raw(uapi::IOCTL_INFO, 0),
        libc::EFAULT,
    );
    for (name, mut args, want) in [
        ("MAP flags", map(a, 4096, 16, 0, 1), libc::EINVAL),
        ("MAP kind", map(a, 4096, 16, 7, 0), libc::EINVAL),
        ("MAP len 0", map(a, 0, 16, 0, 0), libc::EINVAL),
        (
            "MAP unaligned addr",
            map(a + 8, 4096, 16, 0, 0),
            libc::EINVAL,
        ),
        ("MAP unaligned len", map(a, 100, 16, 0, 0), libc::EINVAL),
        (
            "MAP overflow",
            map(u64::MAX - 4095, 8192, 16, 0, 0),
            libc::EINVAL,
        ),
        ("MAP too large", map(a, 4 << 30, 1 << 20, 0, 0), libc::E2BIG),
        ("MAP small bus array", map(a, 8192, 1, 0, 0), libc::ENOSPC),
        (
            "MAP unmapped memory",
            map(0x1000, 4096, 16, 0, 0),
            libc::EFAULT,
        ),
        (
            // 64 KiB aligned, as GPU mappings must be; checked before looking for NVIDIA.
            "MAP GPU without NVIDIA",
            map(0x7f00_0000_0000, 65536, 16, uapi::MAP_KIND_GPU, 0),
            libc::EOPNOTSUPP,
        ),
    ] {
        e.errno(name, dev.ioctl(uapi::IOCTL_MAP, &mut args), want);
    }
    let mut bad_out = map(a, 4096, 16, 0, 0);
    bad_out.bus_addrs = 16;
    e.errno(
        "MAP bad output pointer",
        dev.ioctl(uapi::IOCTL_MAP, &mut bad_out),
        libc::EFAULT,
    );
    e.errno("UNMAP unknown", dev.unmap(9999), libc::ENOENT);
    e.errno(
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
    for (name, mut args, want) in [
        ("CREATE qid 0", qp(0, 16, good.handle, 0), libc::EINVAL),
        (
            "CREATE qid too big",
            qp(info.queue_pairs + 1, 16, good.handle, 0),
            libc::EINVAL,
        ),
        ("CREATE depth 1", qp(1, 1, good.handle, 0), libc::EINVAL),
        (
            "CREATE depth > MQES",
            qp(1, info.max_queue_entries + 1, good.handle, 0),
            libc::EINVAL,
        ),
        ("CREATE unknown handle", qp(1, 16, 9999, 0), libc::ENOENT),
        (
            "CREATE unaligned offset",
            qp(1, 16, good.handle, 64),
            libc::EINVAL,
        ),
        (
            "CREATE beyond mapping",
            qp(1, 256, good.handle, 3 * PAGE as u64),
            libc::EINVAL,
        ),
        (
            "CREATE offset overflow",
            qp(1, 16, good.handle, u64::MAX - 4095),
            libc::EINVAL,
        ),
    ] {
        e.errno(
            name,
            dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args),
            want,
        );
    }
    let created = dev.ioctl(
        uapi::IOCTL_CREATE_QUEUE_PAIR,
        &mut qp(1, 16, good.handle, 0),
    );
    e.errno("CREATE valid (control)", created.and(Err(-1)), -1);
    e.errno(
        "CREATE qid in use",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut qp(1, 16, good.handle, 2 * PAGE as u64),
        ),
        libc::EBUSY,
    );
    e.errno("UNMAP in use", dev.unmap(good.handle), libc::EBUSY);
    e.errno(
        "UNMAP data buffer with a live queue pair",
        dev.unmap(data.handle),
        libc::EBUSY,
    );
    e.errno(
        "DELETE flags",
        dev.ioctl(
            uapi::IOCTL_DELETE_QUEUE_PAIR,
            &mut uapi::DeleteQueuePairArgs { qid: 1, flags: 1 },
        ),
        libc::EINVAL,
    );
    e.errno("DELETE unknown", dev.delete_queue_pair(2), libc::ENOENT);
    let mut buf = vec![0u8; 8192];
    for (name, opcode, cdw10, len, want) in [
        ("ADMIN format", 0x80, 0, 4096, libc::EPERM),
        (
            "ADMIN error log",
            uapi::ADMIN_OPC_GET_LOG_PAGE,
            1,
            4096,
            libc::EPERM,
        ),
        ("ADMIN len 0", uapi::ADMIN_OPC_IDENTIFY, 1, 0, libc::EINVAL),
        (
            "ADMIN len 8192",
            uapi::ADMIN_OPC_IDENTIFY,
            1,
            8192,
            libc::EINVAL,
        ),
    ] {
        e.errno(
            name,
            admin(&dev, opcode, 1, cdw10, &mut buf[..len]).map(|_| ()),
            want,
        );
    }
    let mut a = uapi::AdminArgs {
        opcode: uapi::ADMIN_OPC_IDENTIFY,
        data: 16,
        data_len: 4096,
        ..Default::default()
    };
    a.cdw[0] = 1;
    e.errno(
        "ADMIN bad data pointer",
        dev.ioctl(uapi::IOCTL_ADMIN, &mut a),
        libc::EFAULT,
    );
    e.result()
}

/// One writer at a time; read-only files may only read `INFO` and run `ADMIN`.
fn test_one_writer() -> TestResult {
    let mut e = Expectations::default();
    let writer = Dev::open()?;
    let buf = Buf::new(&writer, 2 * PAGE)?;
    match Dev::open() {
        Err(msg) if msg.contains("busy") => {}
        other => e.fail(format!(
            "second writer: {:?}, want EBUSY",
            other.map(|_| ())
        )),
    }
    let ro = Dev::open_ro()?;
    let mut bus = [0u64; 4];
    let a = anon(PAGE) as u64;
    e.errno(
        "read-only MAP",
        crate::dev::map_host(&ro, a, PAGE, &mut bus).map(|_| ()),
        libc::EBADF,
    );
    e.errno(
        "read-only UNMAP of the writer's",
        ro.unmap(buf.handle),
        libc::EBADF,
    );
    e.errno(
        "read-only CREATE in the writer's memory",
        ro.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut uapi::QueuePairArgs {
                qid: 1,
                depth: 16,
                sq_handle: buf.handle,
                cq_handle: buf.handle,
                cq_offset: PAGE as u64,
                ..Default::default()
            },
        ),
        libc::EBADF,
    );
    e.errno("read-only DELETE", ro.delete_queue_pair(1), libc::EBADF);
    // PROT_WRITE on a read-only file is refused by the kernel itself; a read-only mapping by
    // the module.
    e.errno(
        "read-only mmap (writable)",
        ro.mmap_raw(PAGE, libc::MAP_SHARED, 0).map(|_| ()),
        libc::EACCES,
    );
    // SAFETY: a read-only shared mapping request that must fail; unmapped if it does not.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            PAGE,
            libc::PROT_READ,
            libc::MAP_SHARED,
            ro.fd(),
            0,
        )
    };
    if p != libc::MAP_FAILED {
        // SAFETY: the mapping just made.
        unsafe { libc::munmap(p, PAGE) };
        e.fail("read-only mmap (PROT_READ) accepted".into());
    } else if errno() != libc::EBADF {
        e.fail(format!(
            "read-only mmap (PROT_READ): errno {}, want EBADF",
            errno()
        ));
    }
    if ro.info().is_err() || basic::identify_serial(&ro).is_err() {
        e.fail("read-only INFO or ADMIN failed beside a writer".into());
    }
    drop((buf, writer));
    // The place is free once the writer closed.
    if let Err(msg) = Dev::open() {
        e.fail(format!("writer after the first closed: {msg}"));
    }
    e.result()
}

fn test_mmap_rules() -> TestResult {
    let dev = Dev::open()?;
    let len = dev.info()?.doorbell_len as usize;
    let mut e = Expectations::default();
    for (name, len, flags, off, want) in [
        (
            "mmap offset",
            PAGE,
            libc::MAP_SHARED,
            PAGE as i64,
            libc::EINVAL,
        ),
        (
            "mmap too long",
            len + PAGE,
            libc::MAP_SHARED,
            0,
            libc::EINVAL,
        ),
        ("mmap private", PAGE, libc::MAP_PRIVATE, 0, libc::EINVAL),
    ] {
        let got = dev.mmap_raw(len, flags, off);
        if let Ok(p) = got {
            // SAFETY: a mapping that should not exist; removed.
            unsafe { libc::munmap(p.cast(), len) };
        }
        e.errno(name, got.map(|_| ()), want);
    }
    e.result()
}

/// SQ and CQ overlapping each other, or another queue's rings, are refused.
fn test_overlap() -> TestResult {
    let dev = Dev::open()?;
    let mem = Buf::new(&dev, 4 * PAGE)?;
    let args = |qid: u32, sq: usize, cq: usize| uapi::QueuePairArgs {
        qid,
        depth: 64,
        sq_handle: mem.handle,
        cq_handle: mem.handle,
        sq_offset: (sq * PAGE) as u64,
        cq_offset: (cq * PAGE) as u64,
        ..Default::default()
    };
    let mut e = Expectations::default();
    e.errno(
        "SQ and CQ on the same page",
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args(1, 0, 0)),
        libc::EINVAL,
    );
    dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args(1, 0, 1))
        .map_err(|e| format!("valid queue pair: errno {e}"))?;
    e.errno(
        "a second queue's CQ on the first's SQ",
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args(2, 2, 0)),
        libc::EINVAL,
    );
    e.errno(
        "a second queue's SQ on the first's CQ",
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args(2, 1, 3)),
        libc::EINVAL,
    );
    dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args(2, 2, 3))
        .map_err(|e| format!("disjoint second queue pair: errno {e}"))?;
    e.result()
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Drops `CAP_IPC_LOCK` from this process, so `RLIMIT_MEMLOCK` applies to it.
fn drop_ipc_lock() -> TestResult {
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut hdr = CapHeader {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: header and two data structs, as capget/capset take them for version 3.
    unsafe {
        if libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) != 0 {
            return Err(format!("capget: errno {}", errno()));
        }
        data[0].effective &= !(1 << CAP_IPC_LOCK);
        data[0].permitted &= !(1 << CAP_IPC_LOCK);
        if libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) != 0 {
            return Err(format!("capset: errno {}", errno()));
        }
    }
    Ok(())
}

/// This process's `VmPin` (pinned memory) in KiB.
fn vm_pin_kib() -> Result<u64, String> {
    let s = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    s.lines()
        .find_map(|l| {
            l.strip_prefix("VmPin:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .ok_or_else(|| "no VmPin in /proc/self/status".into())
}

/// Pins count against the caller's `RLIMIT_MEMLOCK` (as `VmPin`) without `CAP_IPC_LOCK`.
fn memlock_in_child() -> TestResult {
    drop_ipc_lock()?;
    let limit = 16 * PAGE as u64;
    let rl = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: a valid rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) } != 0 {
        return Err(format!("setrlimit: errno {}", errno()));
    }
    let dev = Dev::open()?;
    let mut bus = vec![0u64; 64];
    let mut e = Expectations::default();
    e.errno(
        "MAP of 32 pages under a 16-page limit",
        crate::dev::map_host(&dev, anon(32 * PAGE) as u64, 32 * PAGE, &mut bus).map(|_| ()),
        libc::ENOMEM,
    );
    let small = crate::dev::map_host(&dev, anon(8 * PAGE) as u64, 8 * PAGE, &mut bus)
        .map_err(|e| format!("MAP of 8 pages under the limit: errno {e}"))?;
    let pinned = vm_pin_kib()?;
    if pinned != 32 {
        e.fail(format!("VmPin {pinned} kB after pinning 32 KiB"));
    }
    e.errno(
        "MAP of 9 more pages",
        crate::dev::map_host(&dev, anon(9 * PAGE) as u64, 9 * PAGE, &mut bus).map(|_| ()),
        libc::ENOMEM,
    );
    dev.unmap(small.handle)
        .map_err(|e| format!("UNMAP: errno {e}"))?;
    let pinned = vm_pin_kib()?;
    if pinned != 0 {
        e.fail(format!("VmPin {pinned} kB after UNMAP"));
    }
    e.result()
}

fn test_memlock() -> TestResult {
    // SAFETY: the child runs the test and exits without returning into the parent's state.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let r = memlock_in_child();
        if let Err(e) = &r {
            eprintln!("memlock child: {e}");
            println!("[guest] memlock child: {e}");
        }
        // SAFETY: terminating the child.
        unsafe { libc::_exit(i32::from(r.is_err())) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    check(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        || "the child's checks failed (see its [guest] line)".into(),
    )
}
