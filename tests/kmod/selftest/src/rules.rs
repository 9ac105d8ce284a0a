//! What the module refuses: bad arguments, a second writer, read-only files that try to change
//! anything, private or oversized doorbell mappings, overlapping rings (also through two
//! mappings of the same memory), pins beyond `RLIMIT_MEMLOCK` (charged to the user, in all its
//! processes, together with io_uring's registered buffers).

use std::ptr;

use crate::{basic::admin, *};

pub const TESTS: &[(&str, Test)] = &[
    ("bad-inputs", test_bad_inputs),
    ("one-writer", test_one_writer),
    ("doorbell-mmap-rules", test_mmap_rules),
    ("overlapping-rings-refused", test_overlap),
    (
        "overlapping-rings-through-two-mappings-refused",
        test_overlap_two_mappings,
    ),
    ("memlock-limit", test_memlock),
    ("pins-charged-to-the-user", test_pins_per_user),
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

/// Arguments of a 64-entry queue pair `qid` whose SQ is on page `sq.1` of mapping `sq.0` and
/// whose CQ is on page `cq.1` of mapping `cq.0`.
fn pair_args(qid: u32, sq: (&Buf, usize), cq: (&Buf, usize)) -> uapi::QueuePairArgs {
    uapi::QueuePairArgs {
        qid,
        depth: 64,
        sq_handle: sq.0.handle,
        cq_handle: cq.0.handle,
        sq_offset: (sq.1 * PAGE) as u64,
        cq_offset: (cq.1 * PAGE) as u64,
        ..Default::default()
    }
}

/// SQ and CQ overlapping each other, or another queue's rings, are refused.
fn test_overlap() -> TestResult {
    let dev = Dev::open()?;
    let mem = Buf::new(&dev, 4 * PAGE)?;
    let args = |qid: u32, sq: usize, cq: usize| pair_args(qid, (&mem, sq), (&mem, cq));
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

/// The same memory mapped twice (two handles, other bus addresses): rings are compared by the
/// memory they are in, so a second queue's rings cannot sit on the first's through the other
/// mapping, nor a queue's SQ on its own CQ.
fn test_overlap_two_mappings() -> TestResult {
    let dev = Dev::open()?;
    let mem = anon(4 * PAGE);
    let a = Buf::at(&dev, mem, 4 * PAGE)?;
    let b = Buf::at(&dev, mem, 4 * PAGE)?;
    check(a.handle != b.handle && a.bus[0] != b.bus[0], || {
        format!(
            "two mappings of one buffer: handles {} {}, bus {:#x} {:#x}",
            a.handle, b.handle, a.bus[0], b.bus[0]
        )
    })?;
    let args = pair_args;
    let mut e = Expectations::default();
    e.errno(
        "SQ and CQ on one page through two mappings",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut args(1, (&a, 0), (&b, 0)),
        ),
        libc::EINVAL,
    );
    dev.ioctl(
        uapi::IOCTL_CREATE_QUEUE_PAIR,
        &mut args(1, (&a, 0), (&a, 1)),
    )
    .map_err(|e| format!("valid queue pair: errno {e}"))?;
    e.errno(
        "a second queue's SQ on the first's SQ, through the other mapping",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut args(2, (&b, 0), (&b, 2)),
        ),
        libc::EINVAL,
    );
    e.errno(
        "a second queue's CQ on the first's CQ, through the other mapping",
        dev.ioctl(
            uapi::IOCTL_CREATE_QUEUE_PAIR,
            &mut args(2, (&b, 2), (&b, 1)),
        ),
        libc::EINVAL,
    );
    dev.ioctl(
        uapi::IOCTL_CREATE_QUEUE_PAIR,
        &mut args(2, (&b, 2), (&a, 3)),
    )
    .map_err(|e| format!("disjoint second queue pair across the mappings: errno {e}"))?;
    e.result()
}

/// Makes this process user and group `uid` with no supplementary groups, which drops every
/// capability (`CAP_IPC_LOCK` too, so `RLIMIT_MEMLOCK` applies), and sets that limit to `pages`
/// pages first. A user of its own: no other process's pins are charged to it.
fn become_user(uid: u32, pages: usize) -> TestResult {
    let limit = (pages * PAGE) as u64;
    let rl = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: plain syscalls with valid arguments.
    unsafe {
        if libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) != 0
            || libc::setgroups(0, std::ptr::null()) != 0
            || libc::setgid(uid) != 0
            || libc::setuid(uid) != 0
        {
            return Err(format!("becoming user {uid}: errno {}", errno()));
        }
    }
    Ok(())
}

/// This process's `VmPin` (pinned memory) in KiB.
pub fn vm_pin_kib() -> Result<u64, String> {
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

/// Pins count against the caller's `RLIMIT_MEMLOCK` (and show as `VmPin`) without
/// `CAP_IPC_LOCK`.
fn memlock_in_child() -> TestResult {
    let dev = Dev::open()?;
    become_user(4241, 16)?;
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

/// Runs `test` in a child process (it changes its identity and limits); its result.
fn in_child(name: &str, test: fn() -> TestResult) -> TestResult {
    // SAFETY: the child runs the test and exits without returning into the parent's state.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let r = test();
        if let Err(e) = &r {
            println!("[guest] {name} child: {e}");
        }
        // SAFETY: terminating the child.
        unsafe { libc::_exit(i32::from(r.is_err())) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    check(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        || format!("the child's checks failed (see its [guest] {name} line)"),
    )
}

fn test_memlock() -> TestResult {
    in_child("memlock", memlock_in_child)
}

/// `MAP` of `pages` pages of fresh memory through `dev`: the handle, or the errno.
fn map_pages(dev: &Dev, pages: usize) -> Result<u32, i32> {
    let mut bus = vec![0u64; pages];
    crate::dev::map_host(dev, anon(pages * PAGE) as u64, pages * PAGE, &mut bus).map(|a| a.handle)
}

/// io_uring registered buffers of `pages` pages (raw syscalls: `io_uring_setup`,
/// `IORING_REGISTER_BUFFERS`); the ring's descriptor.
fn register_uring_buffers(pages: usize) -> Result<i32, String> {
    let mut params = [0u8; 120];
    // SAFETY: `params` is a zeroed `struct io_uring_params` (120 bytes).
    let ring = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1, params.as_mut_ptr()) };
    if ring < 0 {
        return Err(format!("io_uring_setup: errno {}", errno()));
    }
    let iov = libc::iovec {
        iov_base: anon(pages * PAGE).cast(),
        iov_len: pages * PAGE,
    };
    // SAFETY: one valid iovec; IORING_REGISTER_BUFFERS is 0.
    let r = unsafe { libc::syscall(libc::SYS_io_uring_register, ring, 0, &iov, 1) };
    if r < 0 {
        return Err(format!("IORING_REGISTER_BUFFERS: errno {}", errno()));
    }
    Ok(ring as i32)
}

/// Pins are charged to the user (as io_uring's registered buffers and iommufd's pins are), not
/// to one process: under a 16-page `RLIMIT_MEMLOCK`, a second process of the user (the writer's
/// descriptor inherited) gets only what the first left, and io_uring's registered buffers count
/// in the same budget.
fn pins_per_user_in_child() -> TestResult {
    let dev = Dev::open()?;
    become_user(4242, 16)?;
    let mut e = Expectations::default();
    let first = map_pages(&dev, 8).map_err(|e| format!("MAP of 8 pages: errno {e}"))?;
    let pinned = vm_pin_kib()?;
    if pinned != 32 {
        e.fail(format!("VmPin {pinned} kB after pinning 32 KiB"));
    }
    let (mut fds, mut handle) = ([0 as libc::c_int; 2], [0u8; 4]);
    // SAFETY: a pipe for the second process's handle.
    unsafe { libc::pipe(fds.as_mut_ptr()) };
    // SAFETY: the second process only maps, reports and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = match (map_pages(&dev, 9), map_pages(&dev, 8)) {
            (Err(libc::ENOMEM), Ok(h)) => {
                // SAFETY: the pipe's write end.
                unsafe { libc::write(fds[1], h.to_ne_bytes().as_ptr().cast(), 4) };
                0
            }
            (Ok(_), _) => 2,
            _ => 3,
        };
        // SAFETY: terminating the second process.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: our own child; the pipe's ends. With the write end closed here, the read ends at
    // once if the second process wrote nothing.
    unsafe {
        libc::close(fds[1]);
        libc::waitpid(pid, &mut status, 0);
        libc::read(fds[0], handle.as_mut_ptr().cast(), 4);
        libc::close(fds[0]);
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        e.fail(format!(
            "a second process of the user (exit {}; 2: MAP of 9 more pages accepted beyond the \
             user's 16, 3: MAP of the 8 left refused)",
            libc::WEXITSTATUS(status)
        ));
        return e.result();
    }
    // The second process's pages stay mapped (its mapping is the file's) and charged.
    e.errno(
        "MAP of a 17th page of the user",
        map_pages(&dev, 1).map(|_| ()),
        libc::ENOMEM,
    );
    for h in [first, u32::from_ne_bytes(handle)] {
        dev.unmap(h).map_err(|e| format!("UNMAP {h}: errno {e}"))?;
    }
    let ring = register_uring_buffers(12)?;
    e.errno(
        "MAP of 5 pages beside 12 pages of io_uring buffers",
        map_pages(&dev, 5).map(|_| ()),
        libc::ENOMEM,
    );
    let last = map_pages(&dev, 4).map_err(|e| format!("MAP of the 4 pages left: errno {e}"))?;
    dev.unmap(last).map_err(|e| format!("UNMAP: errno {e}"))?;
    // SAFETY: IORING_UNREGISTER_BUFFERS (1) on our ring, which unpins them now, then closed.
    unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring,
            1,
            std::ptr::null::<u8>(),
            0,
        );
        libc::close(ring);
    }
    e.result()
}

fn test_pins_per_user() -> TestResult {
    in_child("pins-per-user", pins_per_user_in_child)
}
