//! A controller thread: polls the SQ tail doorbells of its share of the queues, fetches
//! commands, runs them against the backing file with `io_uring`, moves their data to and from
//! the memory their PRPs name, and posts completions with phase tags.
//!
//! Commands of a thread's queues share its `io_uring` and its pool of bounce buffers (one per
//! command in flight, each `max_transfer` bytes); a Read lands in its bounce buffer and is then copied to
//! the PRP targets, a Write is gathered first. Completions are posted in the order commands
//! finish, as a controller may.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};
use legend_nvme_protocol::{Cqe, Opcode, Sqe, Status, prp};

use crate::memory::AddressSpace;
use crate::{Faults, Shared};

/// A backing I/O slower than this is logged: it is what a submitter's timeout would see.
const SLOW_BACKING_IO: Duration = Duration::from_secs(2);

/// How long a lone ready command waits for others under `Faults::reverse_completions`.
const REVERSE_WAIT: Duration = Duration::from_millis(2);

/// Generic status codes the proxy posts.
const INVALID_OPCODE: Status = Status::new(0, 0x01);
const INVALID_FIELD: Status = Status::new(0, 0x02);
const DATA_TRANSFER_ERROR: Status = Status::new(0, 0x04);
const INTERNAL_ERROR: Status = Status::new(0, 0x06);
const INVALID_NAMESPACE: Status = Status::new(0, 0x0b);
const LBA_OUT_OF_RANGE: Status = Status::new(0, 0x80);

/// A queue pair the host created.
pub(crate) struct Queue {
    pub(crate) qid: u16,
    pub(crate) depth: u16,
    pub(crate) sq: *const Sqe,
    pub(crate) cq: *mut Cqe,
    sq_head: u16,
    cq_tail: u16,
    phase: bool,
    /// Commands fetched and not yet completed.
    in_flight: u32,
    /// A lost doorbell write: the tail value the proxy pretends not to have seen.
    ignored_tail: Option<u16>,
    /// The SQ tail as last seen, and when each entry up to it was first seen: a modelled
    /// device takes a command from when it was there to take, not from when the proxy (short
    /// of command slots, or descheduled on a loaded machine) got round to fetching it.
    seen_tail: u16,
    seen_at: Vec<Option<Instant>>,
    /// Completions waiting for room in the CQ.
    pending: Vec<Cqe>,
    /// The commands fetched and not yet completed, by the SQ entry each was fetched from (for
    /// [`Queue::report`]; indexed so that completing one costs nothing per command held).
    held: Vec<Option<Held>>,
    /// Set by `delete_queue_pair`: fetch nothing more, drop once idle.
    pub(crate) deleting: bool,
}

// SAFETY: the ring pointers name host memory the owner mapped for the proxy and keeps valid
// while the queue exists; only the controller thread accesses the rings.
unsafe impl Send for Queue {}

impl Queue {
    pub(crate) fn new(qid: u16, depth: u16, sq: *const Sqe, cq: *mut Cqe) -> Queue {
        Queue {
            qid,
            depth,
            sq,
            cq,
            sq_head: 0,
            cq_tail: 0,
            phase: true,
            in_flight: 0,
            ignored_tail: None,
            seen_tail: 0,
            seen_at: vec![None; usize::from(depth)],
            pending: Vec::new(),
            held: vec![None; usize::from(depth)],
            deleting: false,
        }
    }

    pub(crate) fn idle(&self) -> bool {
        self.in_flight == 0 && self.pending.is_empty()
    }

    /// Where the queue stands as the controller sees it: the doorbells it last read against its
    /// own heads, each command it holds with its age, the completions waiting for CQ room.
    pub(crate) fn report(&self, shared: &Shared) -> String {
        // SAFETY: aligned dwords of the doorbell page, which the proxy owns.
        let (tail, head) = unsafe {
            (
                ptr::read_volatile(shared.doorbell(2 * self.qid)),
                ptr::read_volatile(shared.doorbell(2 * self.qid + 1)),
            )
        };
        let now = Instant::now();
        let held: Vec<String> = self
            .held
            .iter()
            .flatten()
            .map(|h| {
                let op = Opcode::from_u8(h.opcode).map_or("unknown opcode", Opcode::name);
                format!(
                    "cid {} {op} of {} blocks at LBA {} fetched {:.1} s ago, its backing I/O not done",
                    h.cid,
                    h.blocks,
                    h.lba,
                    now.duration_since(h.fetched).as_secs_f64()
                )
            })
            .collect();
        format!(
            "proxy: SQ tail doorbell {tail}, fetched up to {}; CQ head doorbell {head}, posted up \
             to {} (phase {}); {} completions waiting for CQ room; held: [{}]",
            self.sq_head,
            self.cq_tail,
            u8::from(self.phase),
            self.pending.len(),
            held.join("; ")
        )
    }
}

/// A command the proxy fetched and has not completed.
#[derive(Clone, Copy)]
struct Held {
    cid: u16,
    opcode: u8,
    lba: u64,
    blocks: u32,
    fetched: Instant,
}

/// A command between fetch and completion.
struct Active {
    qid: u16,
    sqe: Sqe,
    sq_head: u16,
    /// Offset in the backing file and bytes.
    offset: u64,
    len: u64,
    /// Bytes of the I/O done so far (short transfers are resubmitted).
    done: u64,
    /// Set once the status is known (an early failure skips the I/O).
    status: Option<Status>,
    /// When the command may complete (injected delay).
    due: Instant,
    /// When it was fetched (slow backing I/O is logged).
    fetched: Instant,
}

/// One controller thread's executor state.
pub(crate) struct Service {
    shared: Arc<Shared>,
    /// This thread's shard of the queues (`Shared::shards`).
    shard: u16,
    file: File,
    ring: IoUring,
    /// One bounce buffer per command slot, `max_transfer` bytes each, page aligned.
    bounce: *mut u8,
    slots: Vec<Option<Active>>,
    /// Commands done with I/O, waiting to be completed (after a delay, or at once).
    ready: Vec<usize>,
    /// Requests on the ring (submitted or queued, not reaped).
    in_ring: usize,
}

// SAFETY: `bounce` is this service's own allocation, used by the controller thread only.
unsafe impl Send for Service {}

impl Service {
    pub(crate) fn new(
        shared: Arc<Shared>,
        file: File,
        shard: u16,
        slots: usize,
        bounce: *mut u8,
    ) -> std::io::Result<Self> {
        let ring = IoUring::new(slots.next_power_of_two() as u32)?;
        Ok(Service {
            shared,
            shard,
            file,
            ring,
            bounce,
            slots: (0..slots).map(|_| None).collect(),
            ready: Vec::new(),
            in_ring: 0,
        })
    }

    fn buffer(&self, slot: usize) -> *mut u8 {
        // SAFETY: `slots` buffers of `max_transfer` bytes were allocated.
        unsafe { self.bounce.add(slot * self.shared.max_transfer as usize) }
    }

    /// The controller loop; returns when `stop` is set and nothing is in flight.
    pub(crate) fn run(mut self, stop: &AtomicBool) {
        let mut idle_since = Instant::now();
        loop {
            let mut progress = self.fetch();
            progress |= self.reap();
            progress |= self.complete_ready();
            if progress {
                idle_since = Instant::now();
            } else if stop.load(Ordering::Acquire) && self.slots.iter().all(Option::is_none) {
                return;
            } else if idle_since.elapsed() > Duration::from_micros(200) {
                // Idle: poll less often, so an idle proxy does not hold a core.
                std::thread::sleep(Duration::from_micros(100));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Fetches new commands from this thread's queues while command slots are free.
    fn fetch(&mut self) -> bool {
        let mut progress = false;
        let shared = self.shared.clone();
        let mut queues = lock(&shared.shards[usize::from(self.shard)]);
        // Taken once there is a command (an idle thread's polling touches no shared lock).
        let mut faults = None;
        let mut space = None;
        for q in queues.iter_mut() {
            // Completions waiting for room first.
            progress |= post_pending(q, &shared);
            if q.deleting {
                continue;
            }
            // SAFETY: an aligned dword of the doorbell page, which the proxy owns.
            let tail = unsafe { ptr::read_volatile(shared.doorbell(2 * q.qid)) } as u16;
            fence(Ordering::Acquire);
            if tail == q.sq_head || tail >= q.depth {
                continue;
            }
            let faults = faults.get_or_insert_with(|| lock(&shared.faults));
            let space = &**space.get_or_insert_with(|| read(&shared.space));
            if q.ignored_tail != Some(tail) && faults.lose_doorbells > 0 {
                faults.lose_doorbells -= 1;
                q.ignored_tail = Some(tail);
                tracing::debug!(qid = q.qid, tail, "proxy: doorbell write lost (injected)");
            }
            if q.ignored_tail == Some(tail) {
                continue;
            }
            q.ignored_tail = None;
            let seen = Instant::now();
            while q.seen_tail != tail {
                q.seen_at[usize::from(q.seen_tail)] = Some(seen);
                q.seen_tail = (q.seen_tail + 1) % q.depth;
            }
            while q.sq_head != tail {
                let Some(slot) = self.slots.iter().position(Option::is_none) else {
                    return progress;
                };
                // SAFETY: `sq_head < depth`, inside the SQ the host mapped.
                let sqe = unsafe { ptr::read_volatile(q.sq.add(usize::from(q.sq_head))) };
                let entry = usize::from(q.sq_head);
                q.sq_head = (q.sq_head + 1) % q.depth;
                q.in_flight += 1;
                let count = shared.commands.fetch_add(1, Ordering::Relaxed) + 1;
                let status = check(&sqe, &shared, faults, count);
                let fetched = Instant::now();
                let arrived = q.seen_at[entry].take().unwrap_or(fetched);
                q.held[entry] = Some(Held {
                    cid: sqe.cid(),
                    opcode: sqe.opcode(),
                    lba: sqe.lba(),
                    blocks: sqe.blocks(),
                    fetched,
                });
                let mut due = fetched + faults.delay;
                if let Some(clock) = &shared.clock
                    && status.is_none()
                {
                    let op = Opcode::from_u8(sqe.opcode());
                    let bytes = match op {
                        Some(Opcode::Read | Opcode::Write) => {
                            u64::from(sqe.blocks()) << shared.lba_shift
                        }
                        _ => 0,
                    };
                    due =
                        due.max(lock(clock).complete_at(arrived, bytes, op == Some(Opcode::Write)));
                }
                self.start(slot, q.qid, q.sq_head, sqe, status, due, space);
                progress = true;
            }
        }
        progress
    }

    /// Begins command `sqe` in `slot`: gathers a Write's data, submits its I/O, or marks it
    /// ready when it failed a check (or is a Flush, which is submitted as `fdatasync`).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        slot: usize,
        qid: u16,
        sq_head: u16,
        sqe: Sqe,
        mut status: Option<Status>,
        due: Instant,
        space: &AddressSpace,
    ) {
        let lba_shift = self.shared.lba_shift;
        let op = Opcode::from_u8(sqe.opcode());
        let (offset, len) = match op {
            Some(Opcode::Read | Opcode::Write) => (
                (self.shared.start_lba + sqe.lba()) << lba_shift,
                u64::from(sqe.blocks()) << lba_shift,
            ),
            _ => (0, 0),
        };
        if status.is_none() && op == Some(Opcode::Write) {
            // SAFETY: the slot's bounce buffer holds `max_transfer >= len` bytes (checked).
            let buf = unsafe { std::slice::from_raw_parts_mut(self.buffer(slot), len as usize) };
            if transfer(&sqe, len, space, buf, false).is_err() {
                status = Some(DATA_TRANSFER_ERROR);
            }
        }
        self.slots[slot] = Some(Active {
            qid,
            sqe,
            sq_head,
            offset,
            len,
            done: 0,
            status,
            due,
            fetched: Instant::now(),
        });
        if status.is_some() {
            self.ready.push(slot);
        } else {
            self.submit(slot);
        }
    }

    /// Queues the (rest of the) I/O of `slot` on the ring.
    fn submit(&mut self, slot: usize) {
        let a = self.slots[slot].as_ref().expect("active slot");
        let fd = types::Fd(self.file.as_raw_fd());
        let entry = match Opcode::from_u8(a.sqe.opcode()) {
            Some(Opcode::Flush) => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            op => {
                // SAFETY: `done < len <= max_transfer`: inside the slot's bounce buffer.
                let buf = unsafe { self.buffer(slot).add(a.done as usize) };
                let (len, offset) = ((a.len - a.done) as u32, a.offset + a.done);
                if op == Some(Opcode::Read) {
                    opcode::Read::new(fd, buf, len).offset(offset).build()
                } else {
                    opcode::Write::new(fd, buf, len).offset(offset).build()
                }
            }
        };
        // SAFETY: the bounce buffer outlives the request: the slot is reused only after its
        // completion was reaped, and `Drop` waits for the ring.
        unsafe {
            self.ring
                .submission()
                .push(&entry.user_data(slot as u64))
                .expect("one entry per slot fits the ring");
        }
        self.in_ring += 1;
    }

    /// Submits queued I/O and takes finished I/O off the ring.
    fn reap(&mut self) -> bool {
        if self.in_ring == 0 {
            return false;
        }
        let _ = self.ring.submit();
        let mut progress = false;
        let done: Vec<(usize, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, res) in done {
            progress = true;
            self.in_ring -= 1;
            let a = self.slots[slot].as_mut().expect("active slot");
            let took = a.fetched.elapsed();
            if took > SLOW_BACKING_IO {
                tracing::warn!(
                    qid = a.qid,
                    cid = a.sqe.cid(),
                    seconds = took.as_secs_f64(),
                    "proxy: the backing file's I/O for a command was slow"
                );
            }
            if res < 0 {
                tracing::warn!(
                    error = %std::io::Error::from_raw_os_error(-res),
                    "proxy: backing I/O failed"
                );
                a.status = Some(INTERNAL_ERROR);
            } else if Opcode::from_u8(a.sqe.opcode()) != Some(Opcode::Flush) {
                a.done += res as u64;
                if res == 0 {
                    a.status = Some(INTERNAL_ERROR);
                } else if a.done < a.len {
                    self.submit(slot);
                    continue;
                }
            }
            self.ready.push(slot);
        }
        progress
    }

    /// Completes the ready commands whose delay has passed: scatters a Read's data, posts the
    /// completion.
    fn complete_ready(&mut self) -> bool {
        if self.ready.is_empty() {
            return false;
        }
        let now = Instant::now();
        let shared = self.shared.clone();
        let reverse = lock(&shared.faults).reverse_completions;
        let active = |slot: usize| self.slots[slot].as_ref().expect("ready slot");
        let (mut due, waiting): (Vec<usize>, Vec<usize>) = self
            .ready
            .iter()
            .partition(|&&slot| active(slot).due <= now);
        if reverse {
            // Newest first; a lone command waits a moment for company, so there is an order
            // to reverse.
            let oldest = due.iter().map(|&slot| active(slot).fetched).min();
            if due.len() < 2 && oldest.is_some_and(|t| now.duration_since(t) < REVERSE_WAIT) {
                return false;
            }
            due.sort_by_key(|&slot| std::cmp::Reverse(active(slot).fetched));
        }
        self.ready = waiting;
        if due.is_empty() {
            return false;
        }
        // The Reads' data first, under the space's read lock only (the threads move data side
        // by side), then the completions under this thread's shard lock.
        let mut done = Vec::with_capacity(due.len());
        {
            let space = read(&shared.space);
            for &slot in &due {
                let a = self.slots[slot].take().expect("ready slot");
                let mut status = a.status.unwrap_or(Status::SUCCESS);
                if status.is_success() && Opcode::from_u8(a.sqe.opcode()) == Some(Opcode::Read) {
                    // SAFETY: the slot's I/O is done: its bounce buffer holds `len` bytes.
                    let buf = unsafe {
                        std::slice::from_raw_parts_mut(self.buffer(slot), a.len as usize)
                    };
                    if transfer(&a.sqe, a.len, &space, buf, true).is_err() {
                        status = DATA_TRANSFER_ERROR;
                    }
                }
                done.push((a, status));
            }
        }
        let mut queues = lock(&shared.shards[usize::from(self.shard)]);
        for (a, status) in done {
            if let Some(q) = queues.iter_mut().find(|q| q.qid == a.qid) {
                q.in_flight -= 1;
                // The entry it was fetched from: its SQ head is the one after it.
                q.held[usize::from((a.sq_head + q.depth - 1) % q.depth)] = None;
                q.pending
                    .push(Cqe::new(a.qid, a.sq_head, a.sqe.cid(), status, false));
                post_pending(q, &shared);
            }
        }
        true
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // No request may outlive the bounce buffers.
        while self.in_ring > 0 {
            if self.ring.submit_and_wait(1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.in_ring -= self.ring.completion().count();
        }
    }
}

/// Posts the queue's waiting completions while its CQ has room.
fn post_pending(q: &mut Queue, shared: &Shared) -> bool {
    let mut progress = false;
    while let Some(mut cqe) = q.pending.first().copied() {
        // SAFETY: an aligned dword of the doorbell page, which the proxy owns.
        let head = unsafe { ptr::read_volatile(shared.doorbell(2 * q.qid + 1)) } as u16;
        if (q.cq_tail + 1) % q.depth == head % q.depth {
            break;
        }
        q.pending.remove(0);
        cqe.status_phase = (cqe.status_phase & !1) | u16::from(q.phase);
        // SAFETY: `cq_tail < depth`, inside the CQ the host mapped. The entry is written
        // before its last dword, which carries the phase tag the host polls.
        unsafe {
            let slot = q.cq.add(usize::from(q.cq_tail)).cast::<u32>();
            let words: [u32; 4] = std::mem::transmute(cqe);
            ptr::write_volatile(slot, words[0]);
            ptr::write_volatile(slot.add(1), words[1]);
            ptr::write_volatile(slot.add(2), words[2]);
            fence(Ordering::Release);
            ptr::write_volatile(slot.add(3), words[3]);
        }
        q.cq_tail = (q.cq_tail + 1) % q.depth;
        if q.cq_tail == 0 {
            q.phase = !q.phase;
        }
        progress = true;
    }
    progress
}

/// The status a command fails with before any I/O, if any: unknown opcode or namespace, a
/// transfer above MDTS, LBAs beyond the namespace, or an injected fault.
fn check(sqe: &Sqe, shared: &Shared, faults: &Faults, count: u64) -> Option<Status> {
    let op = Opcode::from_u8(sqe.opcode());
    if op.is_none() {
        return Some(INVALID_OPCODE);
    }
    if sqe.nsid != 1 {
        return Some(INVALID_NAMESPACE);
    }
    if let Some((n, status)) = faults.fail_every
        && n > 0
        && count.is_multiple_of(n)
    {
        return Some(status);
    }
    if op == Some(Opcode::Flush) {
        return None;
    }
    let (lba, blocks) = (sqe.lba(), u64::from(sqe.blocks()));
    if blocks << shared.lba_shift > u64::from(shared.max_transfer) {
        return Some(INVALID_FIELD);
    }
    if lba
        .checked_add(blocks)
        .is_none_or(|end| end > shared.blocks)
    {
        return Some(LBA_OUT_OF_RANGE);
    }
    if let Some((range, status)) = &faults.fail_lbas
        && range.start < lba + blocks
        && lba < range.end
    {
        return Some(*status);
    }
    None
}

/// Moves a command's `len` bytes between `buf` and the memory its PRPs name: into memory when
/// `to_memory` (a Read), out of it otherwise. Pages that follow each other in bus addresses move
/// as one copy: a copy out of GPU memory costs microseconds whatever its size, and a 1 MiB
/// command names 256 pages.
fn transfer(
    sqe: &Sqe,
    len: u64,
    space: &AddressSpace,
    buf: &mut [u8],
    to_memory: bool,
) -> Result<(), ()> {
    let p = prp::Prp {
        prp1: sqe.prp1,
        prp2: sqe.prp2,
    };
    // The run of contiguous pages not yet copied: its bus address, its first byte in `buf`, and
    // its length.
    let mut run = (0u64, 0usize, 0usize);
    let mut failed = false;
    let mut copy = |(bus, at, n): (u64, usize, usize)| {
        if n == 0 || failed {
            return;
        }
        let piece = &mut buf[at..at + n];
        let r = if to_memory {
            space.write(bus, piece)
        } else {
            space.read(bus, piece)
        };
        failed |= r.is_err();
    };
    prp::walk(
        p,
        len,
        |bus| space.read_u64(bus),
        |bus, n| {
            let (start, at, run_len) = run;
            if run_len > 0 && start + run_len as u64 == bus {
                run.2 += n as usize;
            } else {
                copy(run);
                run = (bus, at + run_len, n as usize);
            }
        },
    )
    .map_err(|_| ())?;
    copy(run);
    if failed { Err(()) } else { Ok(()) }
}

/// Locks `m`, ignoring poisoning (the state stays consistent between statements).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `lock` for reading a `RwLock`.
pub(crate) fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

/// `lock` for writing a `RwLock`.
pub(crate) fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}
