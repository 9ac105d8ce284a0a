//! Every ioctl that creates state undoes all of it when a later step fails, the copy of its
//! result back to the caller included. An argument struct the module can read but not write (on
//! a read-only page) makes that last step fail with `EFAULT` after everything else was done:
//! nothing may be left pinned, mapped or created, also while a queue pair of the file lives
//! (when an `UNMAP` of the new mapping would be refused).

use std::ptr;

use legend_nvme_protocol::Opcode;

use crate::{rules::vm_pin_kib, *};

pub const TESTS: &[(&str, Test)] = &[
    ("map-output-fault-with-live-queue-leaves-nothing", test_map),
    ("create-output-fault-deletes-the-queue", test_create),
    ("admin-and-info-output-faults", test_admin_info),
];

/// `value` alone on a page that this process can read but not write (leaked: the tests are
/// short-lived processes).
pub fn read_only<T: Copy>(value: T) -> *mut T {
    assert!(size_of::<T>() <= PAGE);
    let p = anon(PAGE).cast::<T>();
    // SAFETY: a fresh, writable, page-aligned page; made read-only right after.
    unsafe {
        ptr::write(p, value);
        assert_eq!(libc::mprotect(p.cast(), PAGE, libc::PROT_READ), 0);
    }
    p
}

/// The module's `bytes_pinned`, the kernel's pins and this process's `VmPin`.
fn pins() -> Result<(u64, i64, u64), String> {
    Ok((attr("bytes_pinned")?, kernel_pins()?, vm_pin_kib()?))
}

/// `MAP` of host memory whose result cannot be written back, while a queue pair of the file
/// lives: `EFAULT`, the bus addresses written (so every earlier step ran), and nothing pinned.
fn test_map() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let _q = Queue::create(&dev, 1, 16, db.ptr)?;
    let before = pins()?;
    let mut bus = vec![0u64; 4];
    let args = read_only(uapi::MapArgs {
        addr: anon(4 * PAGE) as u64,
        len: 4 * PAGE as u64,
        bus_addrs: bus.as_mut_ptr() as u64,
        bus_addrs_cap: 4,
        kind: uapi::MAP_KIND_HOST,
        ..Default::default()
    });
    let got = dev.ioctl_raw(uapi::IOCTL_MAP, args as usize);
    check(got == Err(libc::EFAULT), || {
        format!("MAP with a read-only argument: {got:?}, want EFAULT")
    })?;
    check(bus.iter().all(|&b| b != 0), || {
        format!("bus addresses {bus:x?}: the MAP did not get as far as its last step")
    })?;
    let after = pins()?;
    check(after == before, || {
        format!(
            "(bytes_pinned, kernel pins, VmPin kB) {after:?} after the failed MAP, {before:?} \
             before: left pinned while the queue pair lives"
        )
    })
}

/// `CREATE_QUEUE_PAIR` whose result cannot be written back: `EFAULT`, the queue pair gone from
/// the controller and the records (so its memory may be unmapped), and the qid free for a queue
/// that works.
fn test_create() -> TestResult {
    let dev = Dev::open()?;
    let db = dev.doorbells()?;
    let mem = Buf::new(&dev, queue_bytes(16))?;
    let queues = attr("queue_pairs")?;
    let args = read_only(uapi::QueuePairArgs {
        qid: 1,
        depth: 16,
        sq_handle: mem.handle,
        cq_handle: mem.handle,
        sq_offset: 0,
        cq_offset: PAGE as u64,
        ..Default::default()
    });
    let got = dev.ioctl_raw(uapi::IOCTL_CREATE_QUEUE_PAIR, args as usize);
    check(got == Err(libc::EFAULT), || {
        format!("CREATE with a read-only argument: {got:?}, want EFAULT")
    })?;
    let now = attr("queue_pairs")?;
    check(now == queues, || {
        format!("{now} queue pairs on the controller after the failed CREATE, {queues} before")
    })?;
    let deleted = dev.delete_queue_pair(1);
    check(deleted == Err(libc::ENOENT), || {
        format!("DELETE of the failed CREATE's qid: {deleted:?}, want ENOENT (no record)")
    })?;
    dev.unmap(mem.handle)
        .map_err(|e| format!("UNMAP of its memory (no queue pair may be left): errno {e}"))?;
    let mut q = Queue::create(&dev, 1, 16, db.ptr)?;
    let data = Buf::new(&dev, PAGE)?;
    let st = q.rw(Opcode::Read, 100, 8, &data, 0)?;
    check(st.is_success(), || format!("I/O on the qid again: {st}"))
}

/// `INFO` and `ADMIN` create nothing; their output faults are `EFAULT`, and the admin queue
/// serves the next caller.
fn test_admin_info() -> TestResult {
    let dev = Dev::open_ro()?;
    // SAFETY: `Info` is plain integers; all-zero is valid.
    let info = read_only(unsafe { std::mem::zeroed::<uapi::Info>() });
    let got = dev.ioctl_raw(uapi::IOCTL_INFO, info as usize);
    check(got == Err(libc::EFAULT), || {
        format!("INFO into a read-only page: {got:?}")
    })?;
    let mut data = vec![0u8; PAGE];
    let mut cmd = uapi::AdminArgs {
        opcode: uapi::ADMIN_OPC_IDENTIFY,
        data: data.as_mut_ptr() as u64,
        data_len: PAGE as u32,
        ..Default::default()
    };
    cmd.cdw[0] = 1;
    let got = dev.ioctl_raw(uapi::IOCTL_ADMIN, read_only(cmd) as usize);
    check(got == Err(libc::EFAULT), || {
        format!("ADMIN with a read-only argument: {got:?}")
    })?;
    let serial = basic::identify_serial(&dev)?;
    check(serial == expect_env("LEGEND_SERIAL"), || {
        format!("identify after the faults: serial {serial:?}")
    })
}
