//! The `io_uring` engine: a ring per store, the store file registered as
//! fixed file 0, and a small table of registered (fixed) buffers.
//!
//! The kernel registers at most 1 GiB as one buffer (larger ones fail with
//! `EFAULT`), and partitions of billion-edge graphs are several GiB, so a
//! buffer is registered in pieces of up to 1 GiB, each a table entry of its
//! own, and no request straddles two pieces.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use io_uring::{IoUring, opcode, squeue, types};

use crate::buffer::RawAlloc;
use crate::io::MediumIo;

/// One request: a contiguous, block-aligned piece of a region.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) offset: u64,
    pub(crate) addr: *mut u8,
    pub(crate) len: u32,
    pub(crate) buf_index: Option<u16>,
    pub(crate) write: bool,
}

/// The largest buffer the kernel registers as one entry (io_uring's
/// `io_buffer_validate`).
const MAX_REGISTERED_BYTES: usize = 1 << 30;

/// A registered-buffer table entry: piece `piece` of an allocation. The
/// table keeps the allocation alive (`Arc`), so memory the kernel has pinned
/// is never freed before it is unregistered.
#[derive(Debug)]
struct Registered {
    raw: Arc<RawAlloc>,
    piece: usize,
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
    /// Bytes of a registered piece ([`MAX_REGISTERED_BYTES`]; smaller in
    /// tests, to cover the splitting without GiB buffers).
    piece_bytes: usize,
    tick: u64,
    /// The tick at which the requests being planned began: entries used
    /// since are referenced by planned chunks and must not be replaced.
    plan_start: u64,
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
            piece_bytes: MAX_REGISTERED_BYTES,
            tick: 0,
            plan_start: 1,
        })
    }

    /// Appends to `chunks` the requests of transfer `t` (between its buffer from byte
    /// `t.buf_offset` and the file at `t.offset`): at most
    /// `request_bytes` each, none straddling two registered pieces of the buffer,
    /// each with its piece's registered index where it has one. The chunks
    /// of one [`run`](Self::run) must be planned after
    /// [`begin_plan`](Self::begin_plan), so that planning one does not
    /// replace a registration another refers to.
    pub(crate) fn plan(&mut self, t: &MediumIo<'_>, request_bytes: u64, chunks: &mut Vec<Chunk>) {
        let (raw, buf_offset, offset, len) = (t.raw, t.buf_offset, t.offset, t.len);
        let mut done = 0;
        while done < len {
            let at = buf_offset + done;
            let piece = at as usize / self.piece_bytes;
            let piece_end = ((piece + 1) * self.piece_bytes) as u64;
            let n = (len - done).min(request_bytes).min(piece_end - at);
            let buf_index = self.buffer_index(raw, piece);
            chunks.push(Chunk {
                offset: offset + done,
                // SAFETY: `buf_offset + done < buf_offset + len <= cap` (the
                // caller's check), inside the allocation.
                addr: unsafe { raw.addr().add(at as usize) },
                len: n as u32,
                buf_index,
                write: t.write,
            });
            done += n;
        }
    }

    /// Starts planning the chunks of one [`run`](Self::run).
    pub(crate) fn begin_plan(&mut self) {
        self.plan_start = self.tick + 1;
    }

    /// Returns the registered index of piece `piece` of `raw`, registering
    /// it (in place of a free, orphaned or least recently used entry) if
    /// needed. `None` means the request goes through plain READ/WRITE: no
    /// registration, or every entry is in use by the chunks being planned.
    fn buffer_index(&mut self, raw: &Arc<RawAlloc>, piece: usize) -> Option<u16> {
        if !self.fixed_buffers {
            return None;
        }
        self.tick += 1;
        let tick = self.tick;
        if let Some(i) = self.table.iter().position(|e| {
            e.as_ref()
                .is_some_and(|r| Arc::ptr_eq(&r.raw, raw) && r.piece == piece)
        }) {
            self.table[i].as_mut().expect("found above").last_use = tick;
            return u16::try_from(i).ok();
        }
        // Free slot, else a buffer its owner dropped (we hold the only
        // reference), else the least recently used, unless the chunks being
        // planned use it.
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
            })
            .filter(|&i| {
                self.table[i]
                    .as_ref()
                    .is_none_or(|r| r.last_use < self.plan_start)
            })?;
        let start = piece * self.piece_bytes;
        let iov = libc::iovec {
            // SAFETY: callers pass pieces that start inside the allocation.
            iov_base: unsafe { raw.addr().add(start) }.cast(),
            iov_len: (raw.cap() - start).min(self.piece_bytes),
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
                    piece,
                    last_use: tick,
                });
                u16::try_from(victim).ok()
            }
            Err(e) => {
                // Typically RLIMIT_MEMLOCK for large buffers without
                // CAP_IPC_LOCK. Stay correct, just slower.
                tracing::warn!(
                    bytes = iov.iov_len,
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;
    use crate::buffer::IoBuffer;

    fn file_of(bytes: usize) -> (tempfile::TempDir, std::fs::File) {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("store"))
            .unwrap();
        file.set_len(bytes as u64).unwrap();
        (dir, file)
    }

    #[test]
    fn transfers_split_at_pieces_and_round_trip() {
        const BYTES: usize = 64 << 10;
        const PIECE: usize = 16 << 10;
        let (_dir, file) = file_of(BYTES);
        let mut ring = Ring::new(file.as_raw_fd(), 4, 8).unwrap();
        ring.piece_bytes = PIECE;
        let mut out = IoBuffer::new(BYTES).unwrap();
        for (i, b) in out.as_bytes_mut().iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        ring.begin_plan();
        let mut chunks = Vec::new();
        ring.plan(
            &MediumIo {
                raw: out.raw(),
                buf_offset: 0,
                offset: 0,
                len: BYTES as u64,
                write: true,
            },
            12 << 10,
            &mut chunks,
        );
        // 12 KiB requests cut at each 16 KiB piece: 12 + 4 KiB a piece.
        let lens: Vec<u32> = chunks.iter().map(|c| c.len).collect();
        assert_eq!(lens, [12 << 10, 4 << 10].repeat(4));
        for c in &chunks {
            let start = c.addr as usize - out.raw().addr() as usize;
            assert_eq!(start / PIECE, (start + c.len as usize - 1) / PIECE, "{c:?}");
        }
        if ring.fixed_buffers {
            let pieces: Vec<Option<u16>> = chunks.iter().map(|c| c.buf_index).collect();
            assert!(pieces.iter().all(Option::is_some), "{pieces:?}");
            for pair in chunks.chunks(2) {
                assert_eq!(pair[0].buf_index, pair[1].buf_index, "one piece, one entry");
            }
            assert_eq!(ring.table.iter().flatten().count(), 4);
        } else {
            println!("registered buffers unavailable here: checked the data only");
        }
        ring.run(&mut chunks).unwrap();

        let back = IoBuffer::new(BYTES).unwrap();
        ring.begin_plan();
        let mut chunks = Vec::new();
        ring.plan(
            &MediumIo {
                raw: back.raw(),
                buf_offset: 0,
                offset: 0,
                len: BYTES as u64,
                write: false,
            },
            12 << 10,
            &mut chunks,
        );
        ring.run(&mut chunks).unwrap();
        assert_eq!(back.as_bytes(), out.as_bytes());
    }

    #[test]
    fn planned_entries_are_not_replaced_while_planning() {
        let (_dir, file) = file_of(64 << 10);
        // Two entries for four pieces: the last two pieces go unregistered
        // rather than take the entries the first two chunks refer to.
        let mut ring = Ring::new(file.as_raw_fd(), 4, 2).unwrap();
        if !ring.fixed_buffers {
            println!("skip: registered buffers unavailable here");
            return;
        }
        ring.piece_bytes = 16 << 10;
        let buf = IoBuffer::new(64 << 10).unwrap();
        ring.begin_plan();
        let mut chunks = Vec::new();
        ring.plan(
            &MediumIo {
                raw: buf.raw(),
                buf_offset: 0,
                offset: 0,
                len: 64 << 10,
                write: false,
            },
            16 << 10,
            &mut chunks,
        );
        let got: Vec<Option<u16>> = chunks.iter().map(|c| c.buf_index).collect();
        assert_eq!(got, [Some(0), Some(1), None, None]);
        ring.run(&mut chunks).unwrap();
        // A later plan may replace them.
        let other = IoBuffer::new(32 << 10).unwrap();
        ring.begin_plan();
        let mut chunks = Vec::new();
        ring.plan(
            &MediumIo {
                raw: other.raw(),
                buf_offset: 0,
                offset: 0,
                len: 32 << 10,
                write: false,
            },
            16 << 10,
            &mut chunks,
        );
        let got: Vec<Option<u16>> = chunks.iter().map(|c| c.buf_index).collect();
        assert_eq!(got, [Some(0), Some(1)]);
        ring.run(&mut chunks).unwrap();
    }

    #[test]
    fn buffers_past_one_gib_register_in_pieces() {
        // The kernel's own limit: 1 GiB and 4 KiB become a 1 GiB entry and a
        // 4 KiB one, and a read lands through the second.
        let (_dir, file) = file_of(4096);
        let mut ring = Ring::new(file.as_raw_fd(), 4, 4).unwrap();
        if !ring.fixed_buffers {
            println!("skip: registered buffers unavailable here");
            return;
        }
        let buf = IoBuffer::new(MAX_REGISTERED_BYTES + 4096).unwrap();
        ring.begin_plan();
        let first = ring.buffer_index(buf.raw(), 0);
        let second = ring.buffer_index(buf.raw(), 1);
        if first.is_none() {
            println!("skip: 1 GiB cannot be pinned here (RLIMIT_MEMLOCK)");
            return;
        }
        assert!(second.is_some() && second != first, "{first:?} {second:?}");
        let mut chunks = vec![Chunk {
            offset: 0,
            // SAFETY: 1 GiB is inside the allocation of 1 GiB + 4 KiB.
            addr: unsafe { buf.raw().addr().add(MAX_REGISTERED_BYTES) },
            len: 4096,
            buf_index: second,
            write: false,
        }];
        ring.run(&mut chunks).unwrap();
    }
}
