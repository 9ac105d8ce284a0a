//! Moving controllers between `nvme` and `legend_nvme`, and what unbind does to open files and
//! doorbell mappings.

use std::{
    fs::{self, File},
    io::{Read, Seek, SeekFrom},
    time::{Duration, Instant},
};

use legend_nvme::Sysfs;
use legend_nvme_protocol::Opcode;

use crate::*;

/// Waits up to 15 s for `path` to appear (the `nvme` driver scans namespaces asynchronously).
pub fn wait_for(path: &str) -> TestResult {
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
pub fn test_device_list(bdf: &str) -> TestResult {
    let list = Sysfs::default().list().map_err(|e| format!("list: {e}"))?;
    let Some(c) = list.iter().find(|c| c.bdf == bdf) else {
        return Err(format!("{bdf} not listed: {list:?}"));
    };
    check(
        c.driver.as_deref() == Some("nvme")
            && c.id == QEMU_PCI_ID
            && c.block_devices == ["nvme0n1"]
            && c.char_device.is_none(),
        || format!("{c:?}"),
    )
}

/// `Sysfs::bind` refuses while a namespace is open, then `force` takes it anyway.
pub fn test_bind_in_use(bdf: &str) -> TestResult {
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
    Dev::open_ro()?.info().map(|_| ())
}

/// What the writer in [`test_unbind`]'s child process does once the controller is unbound:
/// `mmap` and `MAP` fail with `ENODEV`, then a doorbell write must kill it with `SIGBUS`.
fn writer_after_unbind(dev: &Dev, db: &Doorbells) -> i32 {
    if dev.mmap_raw(PAGE, libc::MAP_SHARED, 0).err() != Some(libc::ENODEV) {
        return 3;
    }
    let mut bus = [0u64; 4];
    if crate::dev::map_host(dev, anon(PAGE) as u64, PAGE, &mut bus).err() != Some(libc::ENODEV) {
        return 4;
    }
    // SAFETY: a dword of the (revoked) doorbell mapping.
    unsafe { db.ptr.add(8).cast::<u32>().write_volatile(0) };
    5
}

/// Unbind while a writer (a child process, so its death by `SIGBUS` can be observed) has a live
/// queue and a doorbell mapping: the mapping is revoked, a new `mmap` and `MAP` fail with
/// `ENODEV`, a read-only file's `INFO` still answers; then rebind and use the controller again.
pub fn test_unbind(bdf: &str) -> TestResult {
    let ro = Dev::open_ro()?;
    let (mut ready, mut go) = ([0 as libc::c_int; 2], [0 as libc::c_int; 2]);
    // SAFETY: two pipes for the handshake.
    unsafe {
        libc::pipe(ready.as_mut_ptr());
        libc::pipe(go.as_mut_ptr());
    }
    // SAFETY: the child only uses the device and the pipes, and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| -> Result<i32, String> {
            let dev = Dev::open()?;
            let db = dev.doorbells()?;
            let mut q = Queue::create(&dev, 2, 16, db.ptr)?;
            let b = Buf::new(&dev, 4 * PAGE)?;
            let st = q.rw(Opcode::Read, 0, 1, &b, 0)?;
            if !st.is_success() {
                return Ok(2);
            }
            let mut byte = [1u8];
            // SAFETY: pipe ends of this process.
            unsafe {
                libc::write(ready[1], byte.as_ptr().cast(), 1);
                libc::read(go[0], byte.as_mut_ptr().cast(), 1);
            }
            Ok(writer_after_unbind(&dev, &db))
        })()
        .unwrap_or(1);
        // SAFETY: terminating the child.
        unsafe { libc::_exit(code) };
    }
    let mut byte = [0u8];
    // SAFETY: pipe ends of this process.
    let got = unsafe { libc::read(ready[0], byte.as_mut_ptr().cast(), 1) };
    let unbound = if got == 1 {
        fs::write("/sys/bus/pci/drivers/legend_nvme/unbind", bdf)
            .map_err(|e| format!("unbind: {e}"))
    } else {
        Err("the child did not get ready".into())
    };
    // SAFETY: pipe end of this process.
    unsafe { libc::write(go[1], byte.as_ptr().cast(), 1) };
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let info = ro.info();
    drop(ro);
    // Whatever happened, bind again so the tests after this one find the controller.
    let rebind =
        fs::write("/sys/bus/pci/drivers/legend_nvme/bind", bdf).map_err(|e| format!("bind: {e}"));
    unbound?;
    check(
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS,
        || {
            format!(
                "the writer after unbind: exit {} signal {} (3: mmap not ENODEV, 4: MAP not \
                 ENODEV, 5: no SIGBUS on the doorbell)",
                libc::WEXITSTATUS(status),
                libc::WTERMSIG(status)
            )
        },
    )?;
    check(info.is_ok(), || {
        "INFO should still answer from the cached identity".into()
    })?;
    rebind?;
    wait_for(DEV)?;
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let mut q = Queue::create(&dev, 2, 16, db.ptr)?;
    let buf = Buf::new(&dev, PAGE)?;
    let st = q.rw(Opcode::Read, 0, 1, &buf, 0)?;
    check(st.is_success(), || format!("read after rebind: {st}"))
}

/// Binding `bdf` to `legend_nvme` fails, and the kernel log says `why`.
pub fn test_bind_refused(bdf: &str, why: &str) -> TestResult {
    let dir = format!("/sys/bus/pci/devices/{bdf}");
    fs::write(format!("{dir}/driver_override"), "legend_nvme")
        .map_err(|e| format!("driver_override: {e}"))?;
    if let Ok(drv) = fs::read_link(format!("{dir}/driver")) {
        let name = drv.file_name().map(|n| n.to_string_lossy().into_owned());
        fs::write(
            format!("/sys/bus/pci/drivers/{}/unbind", name.unwrap_or_default()),
            bdf,
        )
        .map_err(|e| format!("unbind: {e}"))?;
    }
    let probe = fs::write("/sys/bus/pci/drivers_probe", bdf);
    let bound = fs::read_link(format!("{dir}/driver")).is_ok_and(|d| d.ends_with("legend_nvme"));
    check(!bound, || format!("{bdf} was bound (probe: {probe:?})"))?;
    let log = std::process::Command::new("dmesg")
        .output()
        .map_err(|e| format!("dmesg: {e}"))?;
    let log = String::from_utf8_lossy(&log.stdout);
    check(
        log.lines().any(|l| l.contains(bdf) && l.contains(why)),
        || format!("no kernel log line for {bdf} saying {why:?}"),
    )
}

/// `Sysfs::unbind` hands the controller back to `nvme`, which sees what the queues wrote; then
/// `Sysfs::bind` (nothing open) takes it again.
pub fn test_handback(bdf: &str) -> TestResult {
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
    Dev::open_ro()?.info().map(|_| ())
}

/// `userfaultfd(2)` memory whose first touch waits for a handler that never answers, until the
/// descriptor is closed (which lets the fault proceed).
struct StuckRange {
    uffd: libc::c_int,
    ptr: *mut u8,
}

// SAFETY: the range is plain memory; the descriptor is only closed by its owner.
unsafe impl Send for StuckRange {}

impl StuckRange {
    fn new(len: usize) -> Result<Self, String> {
        // SAFETY: plain syscalls; results checked.
        unsafe {
            let uffd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) as libc::c_int;
            if uffd < 0 {
                return Err(format!("userfaultfd: errno {}", errno()));
            }
            // struct uffdio_api { api, features, ioctls }: UFFD_API = 0xaa; UFFDIO_API.
            let mut api = [0xaau64, 0, 0];
            if libc::ioctl(uffd, 0xc018_aa3f, api.as_mut_ptr()) < 0 {
                return Err(format!("UFFDIO_API: errno {}", errno()));
            }
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if ptr == libc::MAP_FAILED {
                return Err(format!("mmap: errno {}", errno()));
            }
            // struct uffdio_register { start, len, mode, ioctls }: MODE_MISSING; UFFDIO_REGISTER.
            let mut reg = [ptr as u64, len as u64, 1, 0];
            if libc::ioctl(uffd, 0xc020_aa00, reg.as_mut_ptr()) < 0 {
                return Err(format!("UFFDIO_REGISTER: errno {}", errno()));
            }
            Ok(Self {
                uffd,
                ptr: ptr.cast(),
            })
        }
    }
}

/// Unbind while a `MAP` waits in a userfaultfd fault (the pinning of its first page) completes
/// within a bound; the `MAP` then fails with `ENODEV` once the fault is let go, and leaves no pin.
pub fn test_unbind_stuck_map(bdf: &str) -> TestResult {
    let dev = Dev::open()?;
    let range = StuckRange::new(4 * PAGE)?;
    let addr = range.ptr as u64;
    let map = std::thread::spawn(move || {
        let mut bus = [0u64; 4];
        map_host(&dev, addr, 4 * PAGE, &mut bus).map(|_| ())
    });
    // The MAP is stuck once the fault is queued on the descriptor: poll says it is readable.
    let mut pfd = libc::pollfd {
        fd: range.uffd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pfd, 1, 20_000) };
    check(ready == 1, || "the MAP did not fault on the range".into())?;
    let start = Instant::now();
    let unbound = fs::write("/sys/bus/pci/drivers/legend_nvme/unbind", bdf);
    let took = start.elapsed();
    // Closing the descriptor lets the fault proceed (the page is then allocated normally).
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(range.uffd) };
    let mapped = map
        .join()
        .map_err(|_| "the MAP thread panicked".to_string())?;
    let rebind =
        fs::write("/sys/bus/pci/drivers/legend_nvme/bind", bdf).map_err(|e| format!("bind: {e}"));
    unbound.map_err(|e| format!("unbind: {e}"))?;
    check(took < Duration::from_secs(20), || {
        format!("unbind took {took:?} with a MAP stuck in a fault")
    })?;
    check(mapped == Err(libc::ENODEV), || {
        format!("MAP after unbind: {mapped:?}, want ENODEV")
    })?;
    rebind?;
    wait_for(DEV)
}
