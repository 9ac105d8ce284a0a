//! Raw access to `/dev/legend-nvme0` for the tests: ioctls with chosen (also bad) arguments,
//! the doorbell mapping, pinned buffers, and I/O queue pairs driven with `legend-nvme-protocol`.

use std::{
    fs::{self, File},
    os::fd::{AsRawFd, RawFd},
    ptr,
    time::{Duration, Instant},
};

use legend_nvme_protocol::{Opcode, QueuePair, Sqe, Status, prp};

use crate::{BLOCK, DEV, PAGE, uapi};

pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// An open device file.
pub struct Dev {
    file: File,
}

impl Dev {
    /// Opens the device as its writer.
    pub fn open() -> Result<Self, String> {
        Self::open_mode(true)
    }

    /// Opens the device read-only (INFO and ADMIN only).
    pub fn open_ro() -> Result<Self, String> {
        Self::open_mode(false)
    }

    fn open_mode(write: bool) -> Result<Self, String> {
        let file = fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(DEV)
            .map_err(|e| format!("open {DEV} (write: {write}): {e}"))?;
        Ok(Self { file })
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Raw ioctl; `Err(errno)` on failure.
    pub fn ioctl_raw(&self, cmd: u32, arg: usize) -> Result<(), i32> {
        // SAFETY: the caller passes an argument pointer sized for `cmd` (or deliberately bad
        // pointers, which the kernel must reject with EFAULT).
        let r = unsafe { libc::ioctl(self.fd(), cmd as libc::c_ulong, arg) };
        if r < 0 { Err(errno()) } else { Ok(()) }
    }

    pub fn ioctl<T>(&self, cmd: u32, arg: &mut T) -> Result<(), i32> {
        self.ioctl_raw(cmd, ptr::from_mut(arg) as usize)
    }

    pub fn info(&self) -> Result<uapi::Info, String> {
        // SAFETY: `Info` is plain integers; all-zero is valid.
        let mut info: uapi::Info = unsafe { std::mem::zeroed() };
        self.ioctl(uapi::IOCTL_INFO, &mut info)
            .map_err(|e| format!("INFO: errno {e}"))?;
        Ok(info)
    }

    /// `mmap` of `len` bytes of the doorbells with `flags` (`MAP_SHARED` normally).
    pub fn mmap_raw(&self, len: usize, flags: i32, offset: i64) -> Result<*mut u8, i32> {
        // SAFETY: a fresh mapping of the device; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                self.fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            Err(errno())
        } else {
            Ok(p.cast())
        }
    }

    /// The whole doorbell mapping.
    pub fn doorbells(&self) -> Result<Doorbells, String> {
        let len = self.info()?.doorbell_len as usize;
        let ptr = self
            .mmap_raw(len, libc::MAP_SHARED, 0)
            .map_err(|e| format!("mmap doorbells: errno {e}"))?;
        Ok(Doorbells { ptr, len })
    }

    pub fn delete_queue_pair(&self, qid: u32) -> Result<(), i32> {
        self.ioctl(
            uapi::IOCTL_DELETE_QUEUE_PAIR,
            &mut uapi::DeleteQueuePairArgs { qid, flags: 0 },
        )
    }

    pub fn unmap(&self, handle: u32) -> Result<(), i32> {
        self.ioctl(uapi::IOCTL_UNMAP, &mut uapi::UnmapArgs { handle, flags: 0 })
    }
}

/// The doorbell mapping; unmapped on drop (a mapping keeps the file, and so its queues, alive).
pub struct Doorbells {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Drop for Doorbells {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; queues using it are dropped first by the tests.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Anonymous, populated, page-aligned memory (leaked: the tests are short-lived processes).
pub fn anon(len: usize) -> *mut u8 {
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

/// Anonymous memory mapped for the controller.
pub struct Buf {
    pub ptr: *mut u8,
    pub len: usize,
    pub handle: u32,
    pub bus: Vec<u64>,
}

// SAFETY: the buffer is plain memory owned by this object; threads use disjoint buffers.
unsafe impl Send for Buf {}

/// `MAP` of host memory at `addr`; returns the arguments as the kernel filled them.
pub fn map_host(dev: &Dev, addr: u64, len: usize, bus: &mut [u64]) -> Result<uapi::MapArgs, i32> {
    let mut args = uapi::MapArgs {
        addr,
        len: len as u64,
        bus_addrs: bus.as_mut_ptr() as u64,
        bus_addrs_cap: bus.len() as u32,
        kind: uapi::MAP_KIND_HOST,
        ..Default::default()
    };
    dev.ioctl(uapi::IOCTL_MAP, &mut args).map(|()| args)
}

impl Buf {
    pub fn new(dev: &Dev, len: usize) -> Result<Self, String> {
        Self::at(dev, anon(len), len)
    }

    /// Maps `len` bytes of this process's memory at `ptr` (page aligned, kept mapped).
    pub fn at(dev: &Dev, ptr: *mut u8, len: usize) -> Result<Self, String> {
        let mut bus = vec![0u64; len / PAGE];
        let args =
            map_host(dev, ptr as u64, len, &mut bus).map_err(|e| format!("MAP: errno {e}"))?;
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

    pub fn slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live mapping of `len` bytes owned by this object.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// An I/O queue pair driven entirely from userspace: SQ at the start of its memory, then the CQ,
/// then a PRP list page, each ring page aligned (one page each up to 64 entries).
pub struct Queue {
    pub qid: u32,
    pub mem: Buf,
    /// Byte offset of the PRP list page in `mem`.
    list: usize,
    pair: QueuePair,
}

/// Bytes of memory a queue of `depth` entries takes: SQ, CQ, PRP list page.
pub fn queue_bytes(depth: u16) -> usize {
    let d = usize::from(depth);
    (d * 64).next_multiple_of(PAGE) + (d * 16).next_multiple_of(PAGE) + PAGE
}

// SAFETY: a queue is used by one thread at a time; the doorbell mapping outlives it.
unsafe impl Send for Queue {}

impl Queue {
    pub fn create(dev: &Dev, qid: u32, depth: u16, doorbells: *mut u8) -> Result<Self, String> {
        Self::create_in(
            dev,
            qid,
            depth,
            doorbells,
            Buf::new(dev, queue_bytes(depth))?,
        )
    }

    /// As [`Queue::create`], in `mem` (at least [`queue_bytes`]) mapped before.
    pub fn create_in(
        dev: &Dev,
        qid: u32,
        depth: u16,
        doorbells: *mut u8,
        mut mem: Buf,
    ) -> Result<Self, String> {
        assert!(mem.len >= queue_bytes(depth), "queue memory too small");
        let cq = (usize::from(depth) * 64).next_multiple_of(PAGE);
        let list = queue_bytes(depth) - PAGE;
        // Entries left from an earlier queue would read as completions of the first pass.
        mem.slice()[..list].fill(0);
        let mut args = uapi::QueuePairArgs {
            qid,
            depth: u32::from(depth),
            sq_handle: mem.handle,
            cq_handle: mem.handle,
            sq_offset: 0,
            cq_offset: cq as u64,
            ..Default::default()
        };
        dev.ioctl(uapi::IOCTL_CREATE_QUEUE_PAIR, &mut args)
            .map_err(|e| format!("CREATE_QUEUE_PAIR {qid}: errno {e}"))?;
        // SAFETY: the rings lie in `mem`, which this queue owns; the doorbell offsets lie inside
        // the doorbell mapping (the driver computed them), which the caller keeps mapped.
        let pair = unsafe {
            QueuePair::new(
                depth,
                mem.ptr.cast(),
                mem.ptr.add(cq).cast(),
                doorbells.add(args.sq_doorbell as usize).cast(),
                doorbells.add(args.cq_doorbell as usize).cast(),
            )
        };
        Ok(Self {
            qid,
            mem,
            list,
            pair,
        })
    }

    /// Submits one command and polls its completion (20 s at most); returns its status.
    pub fn run(&mut self, sqe: Sqe) -> Result<Status, String> {
        let cid = self
            .pair
            .push(sqe)
            .ok_or_else(|| format!("queue {}: full", self.qid))?;
        self.pair.ring_sq();
        let start = Instant::now();
        loop {
            if let Some(done) = self.pair.poll() {
                self.pair.ring_cq();
                let (slot, cqe) = done.map_err(|e| format!("queue {}: {e}", self.qid))?;
                if slot != cid {
                    return Err(format!(
                        "queue {}: completion for {slot}, not {cid}",
                        self.qid
                    ));
                }
                return Ok(cqe.status());
            }
            if start.elapsed() > Duration::from_secs(20) {
                return Err(format!("queue {}: no completion within 20 s", self.qid));
            }
            std::hint::spin_loop();
        }
    }

    /// A Read or Write of `blocks` blocks at `lba` with the data at byte `offset` of `buf`
    /// (a PRP list in the queue's third page where the transfer spans more than two pages).
    pub fn rw(
        &mut self,
        op: Opcode,
        lba: u64,
        blocks: u32,
        buf: &Buf,
        offset: usize,
    ) -> Result<Status, String> {
        let first = offset / PAGE;
        let list_bus = self.mem.bus[self.list / PAGE];
        // SAFETY: the last page of the queue's own memory holds the list.
        let list = unsafe {
            std::slice::from_raw_parts_mut(self.mem.ptr.add(self.list).cast::<u64>(), PAGE / 8)
        };
        let p = prp::build(
            (offset % PAGE) as u64,
            u64::from(blocks) * BLOCK as u64,
            |i| buf.bus[first + i],
            list,
            list_bus,
        )
        .map_err(|e| format!("PRPs: {e}"))?;
        self.run(Sqe::read_write(op, 1, lba, blocks, p))
    }

    /// As [`Queue::rw`] for at most two pages, with the PRP entries given as bus addresses.
    pub fn rw_prp(
        &mut self,
        op: Opcode,
        lba: u64,
        blocks: u32,
        prp1: u64,
        prp2: u64,
    ) -> Result<Status, String> {
        self.run(Sqe::read_write(op, 1, lba, blocks, prp::Prp { prp1, prp2 }))
    }
}
