//! The `io_uring` engine: a ring per store, the store file registered as
//! fixed file 0, and a small table of registered (fixed) buffers.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use io_uring::{IoUring, opcode, squeue, types};

use crate::buffer::RawAlloc;

/// One request: a contiguous, block-aligned piece of a region.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) offset: u64,
    pub(crate) addr: *mut u8,
    pub(crate) len: u32,
    pub(crate) buf_index: Option<u16>,
    pub(crate) write: bool,
}

/// A registered-buffer table entry. The table keeps the allocation alive
/// (`Arc`), so memory the kernel has pinned is never freed before it is
/// unregistered.
#[derive(Debug)]
struct Registered {
    raw: Arc<RawAlloc>,
    last_use: u64,
}

/// The ring and its registrations.
pub(crate) struct Ring {
    ring: IoUring,
    depth: u32,
    table: Vec<Option<Registered>>,
    /// False once registration failed (e.g. RLIMIT_MEMLOCK); requests then
    /// use plain READ/WRITE.
    fixed_buffers: bool,
    tick: u64,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("depth", &self.depth)
            .field("registered", &self.table.iter().flatten().count())
            .field("fixed_buffers", &self.fixed_buffers)
            .finish()
    }
}

impl Ring {
    /// Creates a ring of `depth` entries for `fd` with room for `slots`
    /// registered buffers.
    pub(crate) fn new(
        fd: RawFd,
        depth: u32,
        slots: u16,
    ) -> Result<Self, (&'static str, io::Error)> {
        let ring = IoUring::new(depth).map_err(|e| ("setup", e))?;
        ring.submitter()
            .register_files(&[fd])
            .map_err(|e| ("register file", e))?;
        let fixed_buffers = match ring.submitter().register_buffers_sparse(u32::from(slots)) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "io_uring: cannot reserve registered buffers ({e}); using unregistered buffers"
                );
                false
            }
        };
        Ok(Self {
            ring,
            depth,
            table: (0..slots).map(|_| None).collect(),
            fixed_buffers,
            tick: 0,
        })
    }

    /// Returns the registered index of `raw`, registering it (and evicting
    /// the least recently used or orphaned entry) if needed. `None` means
    /// the request goes through plain READ/WRITE.
    pub(crate) fn buffer_index(&mut self, raw: &Arc<RawAlloc>) -> Option<u16> {
        if !self.fixed_buffers {
            return None;
        }
        self.tick += 1;
        let tick = self.tick;
        if let Some(i) = self
            .table
            .iter()
            .position(|e| e.as_ref().is_some_and(|r| Arc::ptr_eq(&r.raw, raw)))
        {
            self.table[i].as_mut().expect("found above").last_use = tick;
            return u16::try_from(i).ok();
        }
        // Free slot, else a buffer its owner dropped (we hold the only
        // reference), else the least recently used.
        let victim = self
            .table
            .iter()
            .position(Option::is_none)
            .or_else(|| {
                self.table
                    .iter()
                    .position(|e| e.as_ref().is_some_and(|r| Arc::strong_count(&r.raw) == 1))
            })
            .or_else(|| {
                (0..self.table.len())
                    .min_by_key(|&i| self.table[i].as_ref().map_or(0, |r| r.last_use))
            })?;
        let iov = libc::iovec {
            iov_base: raw.addr().cast(),
            iov_len: raw.cap(),
        };
        // SAFETY: replacing entry `victim` unregisters the old buffer first
        // (the kernel drops its pin), and the new one stays allocated while
        // registered because the table holds an `Arc` to it. No request is
        // in flight between calls to `run`, so the old entry is unused.
        let res = unsafe {
            self.ring
                .submitter()
                .register_buffers_update(victim as u32, &[iov], None)
        };
        match res {
            Ok(()) => {
                self.table[victim] = Some(Registered {
                    raw: Arc::clone(raw),
                    last_use: tick,
                });
                u16::try_from(victim).ok()
            }
            Err(e) => {
                // Typically RLIMIT_MEMLOCK for large buffers without
                // CAP_IPC_LOCK. Stay correct, just slower.
                tracing::warn!(
                    bytes = raw.cap(),
                    "io_uring: cannot register buffer ({e}); using unregistered I/O for it"
                );
                None
            }
        }
    }

    /// Runs all chunks with up to `depth` in flight; returns once every
    /// submitted request has completed, also on error (so no request can
    /// outlive the buffers the caller lent).
    pub(crate) fn run(&mut self, chunks: &mut [Chunk]) -> io::Result<()> {
        let mut todo: Vec<usize> = (0..chunks.len()).rev().collect();
        let mut in_flight = 0u32;
        let mut first_err: Option<io::Error> = None;
        let mut hard_failures = 0;
        while in_flight > 0 || (first_err.is_none() && !todo.is_empty()) {
            while first_err.is_none() && in_flight < self.depth {
                let Some(i) = todo.pop() else { break };
                let entry = sqe(&chunks[i]).user_data(i as u64);
                // SAFETY: the buffer behind `entry` is borrowed by the caller
                // for the whole of `run`, which waits for every completion.
                unsafe { self.ring.submission().push(&entry) }
                    .expect("at most `depth` entries are queued");
                in_flight += 1;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => hard_failures = 0,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                    ) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                    hard_failures += 1;
                    if hard_failures > 1000 {
                        // Returning would free buffers the kernel may still
                        // write into; stopping the process is the only sound
                        // way out of a ring that cannot be waited on.
                        eprintln!("legend-storage: io_uring cannot be waited on; aborting");
                        std::process::abort();
                    }
                }
            }
            for cqe in self.ring.completion() {
                in_flight -= 1;
                let i = cqe.user_data() as usize;
                let res = cqe.result();
                let c = &mut chunks[i];
                if res < 0 {
                    first_err.get_or_insert(io::Error::from_raw_os_error(-res));
                } else if res == 0 {
                    first_err.get_or_insert(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("end of file at byte {}", c.offset),
                    ));
                } else if (res as u32) < c.len {
                    // Short transfer: queue the remainder.
                    let n = res as u32;
                    c.offset += u64::from(n);
                    // SAFETY: `n < len`, so the pointer stays inside the chunk.
                    c.addr = unsafe { c.addr.add(n as usize) };
                    c.len -= n;
                    todo.push(i);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

fn sqe(c: &Chunk) -> squeue::Entry {
    let fd = types::Fixed(0);
    match (c.write, c.buf_index) {
        (false, Some(b)) => opcode::ReadFixed::new(fd, c.addr, c.len, b)
            .offset(c.offset)
            .build(),
        (true, Some(b)) => opcode::WriteFixed::new(fd, c.addr, c.len, b)
            .offset(c.offset)
            .build(),
        (false, None) => opcode::Read::new(fd, c.addr, c.len)
            .offset(c.offset)
            .build(),
        (true, None) => opcode::Write::new(fd, c.addr, c.len)
            .offset(c.offset)
            .build(),
    }
}
