//! The swap path: one owner for every move of a partition between the engine's slots and the
//! store, from the plan's swap to the I/O.
//!
//! A *slot* holds one resident partition's rows where the engine computes on them: host memory
//! for the CPU engine ([`HostRows`]), a range of rows of the GPU engine's node table. The
//! [`Swapper`] owns the slots' bookkeeping (which partition is in which slot, which slots are
//! free, which reads are in flight) and an I/O thread that runs one [`Mover`], chosen once by
//! [`path::mover`] for the consumer of the partitions (the trainer's engine, or a run's reader,
//! [`crate::run::RunReader`], a consumer on the CPU) and the store they live in:
//!
//! | consumer | store | mover | a write | a read |
//! |---|---|---|---|---|
//! | CPU | any | [`host::HostMover`] | host rows to the store (a memory store takes them over) | the store into host rows, or drawn |
//! | GPU | memory, `file` | [`gpu::GpuCopyMover`] | the slot through pinned host memory to the store | the store through pinned memory into the slot, or drawn on the GPU |
//! | GPU | `proxy`, `nvme`, striped or not | [`gpu::GpuDirectMover`] | the slot into GPU staging, then the GPU I/O kernels to the SSD | the GPU I/O kernels into staging, then the slot, or drawn on the GPU |
//!
//! Jobs run one at a time in the order they were queued, so a read queued after a write of
//! the same slot or partition finds it done. A swap (see `Trainer::run_epoch_from`): the
//! partition leaving is [`Swapper::evict`]ed once compute has released it (a [`Fence`]: the
//! point in the engine's work after which nothing reads or writes its slot), which queues its
//! write and frees its slot; the arriving partition's read is queued ([`Swapper::load`]); the
//! buckets that need neither train; [`Swapper::arrive`] waits for the read and hands compute
//! the slot and a fence to wait on. With read-ahead (`storage.read_ahead`) there are C + 1
//! slots and the arriving partition's read is queued a buffer state earlier, into the spare
//! slot, so the device reads it while the previous state trains and its write follows at once.

pub(crate) mod gpu;
pub(crate) mod host;
pub(crate) mod path;

use std::collections::VecDeque;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use legend_cuda::CudaEvent;
use legend_dataset::PartitionScheme;
use serde::{Deserialize, Serialize};

pub use host::HostRows;

use crate::rows::Partition;
use crate::store::{PartitionStore, PartitionStoreError, StoredEmbeddings};

/// A point in a device's queued work: a slot may be written out once the work before it has
/// run ([`Swapper::evict`]), and compute may use an arrived partition once its copy has run
/// ([`Swapper::arrive`]). The CPU engine's work is synchronous: its fences have passed already.
#[derive(Default)]
pub struct Fence(Option<CudaEvent>);

impl Fence {
    /// A fence that has passed (the CPU engine's).
    pub fn passed() -> Fence {
        Fence(None)
    }

    /// The point `event` marks.
    pub fn at(event: CudaEvent) -> Fence {
        Fence(Some(event))
    }

    /// The event, if the fence is a device's.
    pub fn event(&self) -> Option<&CudaEvent> {
        self.0.as_ref()
    }
}

// SAFETY: a CUDA event is a handle the driver lets any thread wait on or query; the fence only
// carries it from the thread that recorded it to the one that waits.
unsafe impl Send for Fence {}

/// I/O counters of the swap path.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IoStats {
    /// Partitions read from the store (never-written ones drawn instead are not counted).
    pub reads: u64,
    /// Partitions drawn from the initial distribution instead of read.
    pub initialised: u64,
    /// Partitions written to the store.
    pub writes: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Time the I/O thread spent moving partitions.
    pub io_time: Duration,
    /// Time compute spent waiting for a partition to arrive (or for the I/O to drain).
    pub wait_time: Duration,
    /// Part of `io_time` spent copying between the GPU and host memory or GPU staging.
    pub copy_time: Duration,
}

impl IoStats {
    fn add(&mut self, o: &IoStats) {
        self.reads += o.reads;
        self.initialised += o.initialised;
        self.writes += o.writes;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.io_time += o.io_time;
        self.wait_time += o.wait_time;
        self.copy_time += o.copy_time;
    }

    /// The counts since `before` (an earlier reading of the same counters).
    pub fn since(&self, before: &IoStats) -> IoStats {
        IoStats {
            reads: self.reads - before.reads,
            initialised: self.initialised - before.initialised,
            writes: self.writes - before.writes,
            bytes_read: self.bytes_read - before.bytes_read,
            bytes_written: self.bytes_written - before.bytes_written,
            io_time: self.io_time.saturating_sub(before.io_time),
            wait_time: self.wait_time.saturating_sub(before.wait_time),
            copy_time: self.copy_time.saturating_sub(before.copy_time),
        }
    }
}

/// Which way an I/O kernel launch moved data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoDirection {
    /// From GPU memory to the store.
    #[default]
    Write,
    /// From the store to GPU memory.
    Read,
}

/// One launch of the GPU I/O kernels: a partition written to the store or read from it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct IoKernelSpan {
    /// Which way the launch moved the partition.
    pub op: IoDirection,
    /// Partition moved.
    pub partition: u32,
    /// Seconds from the epoch start to the launch.
    pub start_s: f64,
    /// Launch to the last completion.
    pub seconds: f64,
    /// NVMe commands submitted (and completed).
    pub commands: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// What one move did, for the counters and the epoch's timeline.
#[derive(Default)]
pub(crate) struct Moved {
    /// Its counts (`io_time` is set by the I/O thread).
    pub(crate) stats: IoStats,
    /// The GPU I/O kernel launches it made: when each began, and its span (`start_s` unset).
    pub(crate) kernels: Vec<(Instant, IoKernelSpan)>,
}

/// A write of a resident partition to the store.
pub(crate) struct WriteJob {
    /// The partition.
    pub(crate) p: u32,
    /// Its slot.
    pub(crate) slot: u32,
    /// Its host rows (the CPU engine's slots), travelling with the job.
    pub(crate) rows: Option<Partition>,
    /// Compute has released the slot once this has passed.
    pub(crate) after: Fence,
    /// The partition stays resident (a checkpoint's write): its rows come back.
    pub(crate) keep: bool,
}

/// Moves partitions between the slots and the store along one path (see the module docs).
/// Runs on the swap's I/O thread, one job at a time.
pub(crate) trait Mover: Send {
    /// Writes `job.p` from its slot to the store once `job.after` has passed; returns the host
    /// rows when the job keeps them.
    fn write(
        &mut self,
        job: WriteJob,
        moved: &mut Moved,
    ) -> Result<Option<Partition>, PartitionStoreError>;
    /// Reads partition `p` into `slot`, or draws it there if it was never written; returns its
    /// host rows (the CPU engine's) and the fence compute waits for before it uses the slot.
    fn read(
        &mut self,
        p: u32,
        slot: u32,
        moved: &mut Moved,
    ) -> Result<(Option<Partition>, Fence), PartitionStoreError>;
    /// Partition `p`'s rows (not resident) in host memory: a memory store's own f32 rows, to
    /// come back through [`PartitionStore::keep_stored`] (`true`), else a copy read from the
    /// store or drawn (`false`).
    fn lend(&mut self, p: u32) -> Result<(Partition, bool), PartitionStoreError>;
    /// The committed rows `ids` alone, widened to f32 into `out` (a lookup: see
    /// [`PartitionStore::read_rows`]).
    fn read_rows(&mut self, ids: &[u64], out: &mut [f32]) -> Result<(), PartitionStoreError>;
    /// The store, for what every path does alike: commits and lent rows coming back.
    fn store(&mut self) -> &mut dyn PartitionStore;
}

/// Work for the I/O thread.
enum Job {
    Write {
        job: WriteJob,
        tag: Option<usize>,
    },
    Read {
        p: u32,
        slot: u32,
        tag: Option<usize>,
    },
    Commit {
        progress: Vec<u8>,
        aux: Vec<u8>,
    },
    /// Lends partition `p`'s rows (not resident): a memory store's own, else read or drawn.
    Lend(u32),
    /// Rows of partition `p` for a memory store to keep: a lent partition back, or a restored
    /// one ([`Swapper::keep`]).
    Keep(u32, StoredEmbeddings, Vec<f32>),
    /// Partition `p` left its slot unmodified, its rows already at rest: it is home.
    Home(u32),
    /// Reads rows `ids` alone into the buffer, which comes back ([`Swapper::read_rows`]).
    Rows(Vec<u64>, Vec<f32>),
}

/// What a job did.
enum Done {
    Written {
        rows: Option<Partition>,
    },
    Read {
        p: u32,
        rows: Option<Partition>,
        ready: Fence,
    },
    Committed(bool),
    Lent {
        part: Partition,
        returnable: bool,
    },
    Returned,
    Rows(Vec<f32>),
}

/// One finished move, for the epoch's timeline.
#[derive(Debug)]
pub(crate) struct MoveRecord {
    /// The caller's tag (the epoch's swap it belongs to), if any.
    pub(crate) tag: Option<usize>,
    /// When the I/O thread began it.
    pub(crate) started: Instant,
    /// Its counts.
    pub(crate) stats: IoStats,
    /// Its GPU I/O kernel launches.
    pub(crate) kernels: Vec<(Instant, IoKernelSpan)>,
}

struct Reply {
    done: Result<Done, PartitionStoreError>,
    record: Option<MoveRecord>,
}

/// The owner of the slots and of every move between them and the store (see the module docs).
pub(crate) struct Swapper {
    scheme: PartitionScheme,
    /// Slot of each partition resident or arriving.
    slot_of: Vec<Option<u32>>,
    /// Whether each partition has arrived (is usable by compute).
    arrived: Vec<bool>,
    /// Slots no partition holds; a read queued into one runs after the write that freed it.
    free: Vec<u32>,
    /// Every partition has a slot of its own, slot p for partition p (no swaps).
    identity: bool,
    /// The CPU engine's resident rows (none for the GPU engine, whose rows are in its table).
    host: HostRows,
    /// Reads queued and not yet arrived, oldest first.
    pending: VecDeque<u32>,
    /// Jobs queued whose replies have not been received.
    outstanding: usize,
    /// Whether the store is process memory (a checkpoint then writes nothing to it).
    in_memory: bool,
    requests: Option<mpsc::Sender<Job>>,
    replies: mpsc::Receiver<Reply>,
    thread: Option<JoinHandle<()>>,
    stats: IoStats,
    log: Vec<MoveRecord>,
}

impl Swapper {
    /// A swapper over `slots` slots (`scheme.num_partitions` of them: slot p holds partition
    /// p), moving partitions with `mover` on an I/O thread of its own; `in_memory`: the mover's
    /// store is process memory.
    pub(crate) fn new(
        scheme: PartitionScheme,
        slots: u32,
        mover: Box<dyn Mover>,
        in_memory: bool,
        host_rows: bool,
    ) -> Swapper {
        let (req_tx, req_rx) = mpsc::channel::<Job>();
        let (rep_tx, rep_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("legend-io".into())
            .spawn(move || {
                let mut mover = mover;
                for job in req_rx {
                    if rep_tx.send(serve(&mut *mover, job)).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning the swap's I/O thread");
        let n = scheme.num_partitions as usize;
        Swapper {
            scheme,
            slot_of: vec![None; n],
            arrived: vec![false; n],
            free: (0..slots).rev().collect(),
            identity: slots == scheme.num_partitions,
            host: HostRows::new(scheme, host_rows),
            pending: VecDeque::new(),
            outstanding: 0,
            in_memory,
            requests: Some(req_tx),
            replies: rep_rx,
            thread: Some(thread),
            stats: IoStats::default(),
            log: Vec::new(),
        }
    }

    /// The partitioning.
    pub(crate) fn scheme(&self) -> PartitionScheme {
        self.scheme
    }

    /// Partitions compute may use, ascending.
    pub(crate) fn resident(&self) -> Vec<u32> {
        (0..self.scheme.num_partitions)
            .filter(|&p| self.arrived[p as usize])
            .collect()
    }

    /// The slot of resident partition `p`.
    pub(crate) fn slot(&self, p: u32) -> Option<u32> {
        self.slot_of[p as usize].filter(|_| self.arrived[p as usize])
    }

    /// The CPU engine's resident rows.
    pub(crate) fn host(&mut self) -> &mut HostRows {
        &mut self.host
    }

    /// The counters so far.
    pub(crate) fn stats(&self) -> IoStats {
        self.stats
    }

    /// The moves finished since the last call, in the order they ran.
    pub(crate) fn take_log(&mut self) -> Vec<MoveRecord> {
        std::mem::take(&mut self.log)
    }

    fn send(&mut self, job: Job) -> Result<(), PartitionStoreError> {
        self.requests
            .as_ref()
            .expect("the I/O thread runs until drop")
            .send(job)
            .map_err(|_| PartitionStoreError::IoThreadStopped)?;
        self.outstanding += 1;
        Ok(())
    }

    /// Receives the next reply, counting the time compute waited for it.
    fn receive(&mut self) -> Result<Done, PartitionStoreError> {
        let started = Instant::now();
        let reply = self
            .replies
            .recv()
            .map_err(|_| PartitionStoreError::IoThreadStopped)?;
        self.outstanding -= 1;
        self.stats.wait_time += started.elapsed();
        if let Some(record) = reply.record {
            self.stats.add(&record.stats);
            self.log.push(record);
        }
        reply.done
    }

    /// Queues the read of partition `p` (not resident, not loading) into a free slot; `tag`
    /// marks its record in the log.
    pub(crate) fn load(&mut self, p: u32, tag: Option<usize>) -> Result<(), PartitionStoreError> {
        assert!(
            self.slot_of[p as usize].is_none(),
            "loading partition {p}, which has a slot"
        );
        let slot = if self.identity {
            self.free.retain(|&s| s != p);
            p
        } else {
            self.free
                .pop()
                .unwrap_or_else(|| panic!("loading partition {p} with no free slot"))
        };
        self.send(Job::Read { p, slot, tag })?;
        self.slot_of[p as usize] = Some(slot);
        self.pending.push_back(p);
        Ok(())
    }

    /// Waits for the read of `p`, the oldest queued, and makes `p` resident; returns its slot
    /// and the fence compute waits for before it uses the slot.
    pub(crate) fn arrive(&mut self, p: u32) -> Result<(u32, Fence), PartitionStoreError> {
        assert_eq!(
            self.pending.front(),
            Some(&p),
            "partition {p} is not the next to arrive"
        );
        loop {
            if let Done::Read {
                p: got,
                rows,
                ready,
            } = self.receive()?
            {
                debug_assert_eq!(got, p);
                self.pending.pop_front();
                self.arrived[p as usize] = true;
                if let Some(rows) = rows {
                    self.host.insert(rows);
                }
                let slot = self.slot_of[p as usize].expect("an arriving partition has a slot");
                return Ok((slot, ready));
            }
        }
    }

    /// Partition `p` (resident) leaves: its write is queued, to run once `after` has passed,
    /// and its slot is free for the reads queued from now on.
    pub(crate) fn evict(
        &mut self,
        p: u32,
        after: Fence,
        tag: Option<usize>,
    ) -> Result<(), PartitionStoreError> {
        let slot = self.slot(p).unwrap_or_else(|| {
            panic!("evicting partition {p}, which is not resident");
        });
        let rows = self.host.remove(p);
        let job = WriteJob {
            p,
            slot,
            rows,
            after,
            keep: false,
        };
        self.send(Job::Write { job, tag })?;
        self.slot_of[p as usize] = None;
        self.arrived[p as usize] = false;
        self.free.push(slot);
        Ok(())
    }

    /// Waits for every read queued and frees their slots unused: the partitions were not
    /// modified, so nothing is written (a stop between two buffer states).
    pub(crate) fn cancel_loads(&mut self) -> Result<(), PartitionStoreError> {
        while let Some(&p) = self.pending.front() {
            self.arrive(p)?;
            self.discard(p)?;
        }
        Ok(())
    }

    /// Resident partition `p` leaves unwritten, its rows only read: its slot is free for the
    /// reads queued from now on, and host rows a memory store gave away go back to it.
    pub(crate) fn discard(&mut self, p: u32) -> Result<(), PartitionStoreError> {
        let slot = self.slot(p).unwrap_or_else(|| {
            panic!("discarding partition {p}, which is not resident");
        });
        // Its reply is taken in turn with the others' (a read may be queued before it).
        match self.host.remove(p) {
            Some(rows) if self.in_memory => self.send(Job::Keep(
                rows.id,
                StoredEmbeddings::F32(rows.emb),
                rows.state,
            ))?,
            _ => self.send(Job::Home(p))?,
        }
        self.slot_of[p as usize] = None;
        self.arrived[p as usize] = false;
        self.free.push(slot);
        Ok(())
    }

    /// Resident partition `p` goes to another worker (see `crate::workers`): nothing is
    /// written, its host rows (the CPU engine's) go with it, and its slot is free for what
    /// arrives from now on. Returns the slot.
    pub(crate) fn give(&mut self, p: u32) -> (u32, Option<Partition>) {
        let slot = self.slot(p).unwrap_or_else(|| {
            panic!("giving partition {p}, which is not resident");
        });
        let rows = self.host.remove(p);
        self.slot_of[p as usize] = None;
        self.arrived[p as usize] = false;
        self.free.push(slot);
        (slot, rows)
    }

    /// A free slot for partition `p`, which another worker sends; it is resident once
    /// [`Swapper::received`].
    pub(crate) fn reserve(&mut self, p: u32) -> u32 {
        assert!(
            self.slot_of[p as usize].is_none(),
            "receiving partition {p}, which has a slot"
        );
        let slot = self
            .free
            .pop()
            .unwrap_or_else(|| panic!("receiving partition {p} with no free slot"));
        self.slot_of[p as usize] = Some(slot);
        slot
    }

    /// Partition `p`, reserved, has arrived from another worker (with its host rows, on the
    /// CPU engine).
    pub(crate) fn received(&mut self, p: u32, rows: Option<Partition>) {
        assert!(
            self.slot_of[p as usize].is_some(),
            "partition {p} was not reserved"
        );
        self.arrived[p as usize] = true;
        if let Some(rows) = rows {
            self.host.insert(rows);
        }
    }

    /// Waits until every queued job has run, reporting the first failure.
    pub(crate) fn drain(&mut self) -> Result<(), PartitionStoreError> {
        assert!(self.pending.is_empty(), "draining with reads in flight");
        while self.outstanding > 0 {
            self.receive()?;
        }
        Ok(())
    }

    /// Commits a checkpoint: every resident partition written (once `after`, the point after
    /// the last step queued, has passed) unless the store is process memory, then `progress`
    /// and `aux` committed with them. Returns whether the store keeps checkpoints itself (see
    /// [`PartitionStore::commit`]).
    pub(crate) fn checkpoint(
        &mut self,
        after: Fence,
        progress: Vec<u8>,
        aux: Vec<u8>,
    ) -> Result<bool, PartitionStoreError> {
        self.drain()?;
        if !self.in_memory {
            let mut after = Some(after);
            for p in self.resident() {
                let job = WriteJob {
                    p,
                    slot: self.slot(p).expect("resident"),
                    rows: self.host.remove(p),
                    // The first write waits for compute; the rest follow it on the I/O thread.
                    after: after.take().unwrap_or_default(),
                    keep: true,
                };
                self.send(Job::Write { job, tag: None })?;
                if let Done::Written { rows: Some(rows) } = self.receive()? {
                    self.host.insert(rows);
                }
            }
        }
        self.send(Job::Commit { progress, aux })?;
        match self.receive()? {
            Done::Committed(c) => Ok(c),
            _ => unreachable!("a commit's reply"),
        }
    }

    /// Calls `f` with partition `p`'s rows, which are not resident: a memory store's own (lent
    /// and taken back), else read from the store (or drawn, if never written).
    pub(crate) fn with_stored<R>(
        &mut self,
        p: u32,
        f: impl FnOnce(&Partition) -> R,
    ) -> Result<R, PartitionStoreError> {
        assert!(
            self.slot_of[p as usize].is_none(),
            "partition {p} is resident or loading"
        );
        self.drain()?;
        self.send(Job::Lend(p))?;
        let Done::Lent { part, returnable } = self.receive()? else {
            unreachable!("a lend's reply")
        };
        let r = f(&part);
        if returnable {
            self.send(Job::Keep(
                part.id,
                StoredEmbeddings::F32(part.emb),
                part.state,
            ))?;
            self.receive()?;
        }
        Ok(r)
    }

    /// Calls `f` with every partition in order, each read (or drawn, if never written) into a
    /// slot while `f` has the one before: a reader's scan (a checkpoint's export, a query's
    /// scan). The swapper's slots hold nothing before and after, even when
    /// `f` or a read fails, so the next scan starts afresh.
    pub(crate) fn stream<E: From<PartitionStoreError>>(
        &mut self,
        mut f: impl FnMut(&Partition) -> Result<(), E>,
    ) -> Result<(), E> {
        assert!(
            self.resident().is_empty() && self.pending.is_empty(),
            "streaming with partitions resident"
        );
        let n = self.scheme.num_partitions;
        let mut walk = || -> Result<(), E> {
            self.load(0, None)?;
            for p in 0..n {
                self.arrive(p)?;
                if p + 1 < n {
                    self.load(p + 1, None)?;
                }
                f(self.host.partition(p).expect("arrived"))?;
                self.discard(p)?;
            }
            Ok(self.drain()?)
        };
        let walked = walk();
        if walked.is_err() {
            self.forget_slots();
        }
        walked
    }

    /// After a failed scan: takes the replies still owed (the failure's consequences) and
    /// frees every slot, its partition home again (a memory store given back its rows).
    fn forget_slots(&mut self) {
        while self.outstanding > 0 {
            let Ok(reply) = self.replies.recv() else {
                break;
            };
            self.outstanding -= 1;
            if let Ok(Done::Read {
                rows: Some(rows), ..
            }) = reply.done
            {
                self.host.insert(rows);
            }
        }
        let slots = (self.free.len() + self.slot_of.iter().flatten().count()) as u32;
        self.pending.clear();
        for p in 0..self.scheme.num_partitions {
            if self.slot_of[p as usize].is_none() {
                continue;
            }
            // Home again, as `discard` sends it. A failure here is the I/O thread's, which the
            // next call reports.
            let back = match self.host.remove(p) {
                Some(rows) if self.in_memory => {
                    Job::Keep(rows.id, StoredEmbeddings::F32(rows.emb), rows.state)
                }
                _ => Job::Home(p),
            };
            let _ = self.send(back).and_then(|()| self.receive());
            self.slot_of[p as usize] = None;
            self.arrived[p as usize] = false;
        }
        self.free = (0..slots).rev().collect();
    }

    /// The committed rows `ids` (any order, repeats allowed) alone, widened to f32 into `out`
    /// (a row of the store's dimension per id), read by the I/O thread's mover: a lookup.
    pub(crate) fn read_rows(
        &mut self,
        ids: &[u64],
        out: &mut [f32],
    ) -> Result<(), PartitionStoreError> {
        self.send(Job::Rows(ids.to_vec(), vec![0.0; out.len()]))?;
        let Done::Rows(rows) = self.receive()? else {
            unreachable!("a lookup's reply")
        };
        out.copy_from_slice(&rows);
        Ok(())
    }

    /// Whether every partition has a slot of its own for the run (C = N): nothing is ever
    /// swapped, and a resumed run's rows go straight into the slots ([`Swapper::place`]).
    pub(crate) fn slots_for_good(&self) -> bool {
        self.identity
    }

    /// Makes partition `p` resident in its own slot (see [`Swapper::slots_for_good`]) without
    /// a read: the caller has filled the slot, or gives its host rows (the CPU engine's).
    /// Returns the slot.
    pub(crate) fn place(&mut self, p: u32, rows: Option<Partition>) -> u32 {
        assert!(
            self.identity && self.slot_of[p as usize].is_none(),
            "placing partition {p} outside a slot of its own"
        );
        self.free.retain(|&s| s != p);
        self.slot_of[p as usize] = Some(p);
        self.arrived[p as usize] = true;
        if let Some(rows) = rows {
            self.host.insert(rows);
        }
        p
    }

    /// Gives partition `p`'s rows (not resident), in the store's own format, to a memory
    /// store to keep: a resumed run's partitions outside the slots. Queued: a failure is
    /// reported by a later call ([`Swapper::drain`]).
    pub(crate) fn keep(
        &mut self,
        p: u32,
        emb: StoredEmbeddings,
        state: Vec<f32>,
    ) -> Result<(), PartitionStoreError> {
        assert!(
            self.in_memory && self.slot_of[p as usize].is_none(),
            "keeping partition {p} in a store that is not memory, or that is resident"
        );
        self.send(Job::Keep(p, emb, state))
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        // Closing the channel ends the I/O thread's loop once its queued jobs have run: the
        // GPU movers address the engine's table, which the trainer drops after this.
        self.requests.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs one job on the I/O thread.
fn serve(mover: &mut dyn Mover, job: Job) -> Reply {
    let started = Instant::now();
    let mut moved = Moved::default();
    // A store shared by several swap paths orders their moves of one partition: a read waits
    // until the partition's last holder has written it home (see `PartitionStore::take_out`).
    let (done, record) = match job {
        Job::Write { job, tag } => {
            let (p, home) = (job.p, !job.keep);
            let done = mover.write(job, &mut moved).map(|rows| {
                if home {
                    mover.store().bring_home(p);
                }
                Done::Written { rows }
            });
            (done, Some(tag))
        }
        Job::Read { p, slot, tag } => {
            let done = mover
                .store()
                .take_out(p)
                .and_then(|()| mover.read(p, slot, &mut moved))
                .map(|(rows, ready)| Done::Read { p, rows, ready });
            (done, Some(tag))
        }
        Job::Commit { progress, aux } => (
            mover.store().commit(&progress, &aux).map(Done::Committed),
            None,
        ),
        Job::Lend(p) => (
            mover
                .store()
                .wait_home(p)
                .and_then(|()| mover.lend(p))
                .map(|(part, returnable)| Done::Lent { part, returnable }),
            None,
        ),
        Job::Keep(p, emb, state) => {
            let store = mover.store();
            let done = store.keep_stored(p, emb, state).map(|()| {
                store.bring_home(p);
                Done::Returned
            });
            (done, None)
        }
        Job::Home(p) => {
            mover.store().bring_home(p);
            (Ok(Done::Returned), None)
        }
        Job::Rows(ids, mut out) => (
            mover.read_rows(&ids, &mut out).map(|()| Done::Rows(out)),
            None,
        ),
    };
    let record = record.map(|tag| {
        moved.stats.io_time = started.elapsed();
        MoveRecord {
            tag,
            started,
            stats: moved.stats,
            kernels: moved.kernels,
        }
    });
    Reply { done, record }
}

#[cfg(test)]
mod tests {
    use super::host::{HostMover, HostStore};
    use super::*;
    use crate::rows::RowShape;
    use crate::store::MemoryStore;
    use legend_model::{Init, StateLayout};

    /// The initialisation of the tests' never-written partitions.
    fn init() -> Init {
        Init {
            seed: 42,
            ..Init::default()
        }
    }

    /// `store` as the rest of the tests' swappers and streams see it.
    fn host_store(
        scheme: PartitionScheme,
        shape: RowShape,
        store: MemoryStore,
    ) -> HostStore<MemoryStore> {
        HostStore {
            store,
            scheme,
            shape,
            init: init(),
        }
    }

    /// A CPU swapper of `slots` slots over `store`.
    fn swapper(
        scheme: PartitionScheme,
        shape: RowShape,
        slots: u32,
        store: MemoryStore,
    ) -> Swapper {
        let rest = host_store(scheme, shape, store);
        Swapper::new(scheme, slots, Box::new(HostMover::new(rest)), true, true)
    }

    fn load_all(s: &mut Swapper, parts: &[u32]) {
        for &p in parts {
            s.load(p, None).unwrap();
        }
        for &p in parts {
            s.arrive(p).unwrap();
        }
    }

    /// Tables whose every value says where it is: embedding `i` of row r is r·dim + i, the
    /// state of row r is −r.
    fn numbered(scheme: PartitionScheme, shape: RowShape) -> MemoryStore {
        let rows = scheme.entities as usize;
        let emb: Vec<f32> = (0..rows * shape.dim).map(|i| i as f32).collect();
        let state: Vec<f32> = (0..rows)
            .flat_map(|r| std::iter::repeat_n(-(r as f32), shape.state))
            .collect();
        MemoryStore::from_tables(scheme, shape, emb, state)
    }

    #[test]
    fn never_written_partitions_hold_the_initial_rows() {
        let (entities, dim) = (10_007u64, 6usize);
        let scheme = PartitionScheme::new(entities, 3).unwrap();
        let shape = RowShape::new(dim, StateLayout::Element);
        let mut s = swapper(scheme, shape, 3, MemoryStore::default());
        load_all(&mut s, &[2, 0]);
        let init = init();
        let mut want = vec![0.0f32; dim];
        for p in [0, 2] {
            let part = s.host().partition(p).expect("resident");
            let range = scheme.range(p);
            assert_eq!(part.emb.len(), (range.end - range.start) as usize * dim);
            for (row, got) in range.zip(part.emb.chunks_exact(dim)) {
                init.node_row(row, &mut want);
                assert_eq!(got, &want[..], "partition {p} row {row}");
            }
            assert!(part.state.iter().all(|&x| x == 0.0));
        }
        assert_eq!(s.stats().initialised, 2);
        assert_eq!(s.resident(), [0, 2]);
    }

    #[test]
    fn row_wise_state_is_one_float_a_row_in_every_accessor() {
        let (entities, dim) = (100u64, 3usize);
        let shape = RowShape::new(dim, StateLayout::Row);
        let scheme = PartitionScheme::new(entities, 4).unwrap();
        let mut s = swapper(scheme, shape, 3, numbered(scheme, shape));
        load_all(&mut s, &[2, 0]);
        let ids = [60u32, 3, 74];
        for (id, (emb, state)) in ids.iter().zip(s.host().disjoint_rows_mut(&ids, dim, 1)) {
            let first = (*id as usize * dim) as f32;
            assert_eq!(*emb, [first, first + 1.0, first + 2.0], "row {id}");
            assert_eq!(*state, [-(*id as f32)], "row {id}");
            state[0] = 7.0;
        }
        assert_eq!(s.host().row(60, dim, 1).unwrap().1, [7.0]);
        assert_eq!(s.host().row(74, dim, 1).unwrap().1, [7.0]);
        // A never-written partition comes with one zero accumulator a row.
        let mut fresh = swapper(scheme, shape, 2, MemoryStore::default());
        load_all(&mut fresh, &[1]);
        let part = fresh.host().partition(1).unwrap();
        assert_eq!((part.emb.len(), part.state.len()), (25 * dim, 25));
    }

    #[test]
    fn disjoint_rows_are_the_rows_asked_for_in_their_order() {
        let (entities, dim) = (100u64, 2usize);
        let shape = RowShape::new(dim, StateLayout::Element);
        let scheme = PartitionScheme::new(entities, 4).unwrap();
        let mut s = swapper(scheme, shape, 2, numbered(scheme, shape));
        load_all(&mut s, &[3, 1]);
        let host = s.host();
        // Unsorted, across both resident partitions, first and last rows of each included.
        let ids = [99u32, 25, 80, 49, 26, 75];
        let rows = host.disjoint_rows_mut(&ids, dim, dim);
        for (&id, (emb, state)) in ids.iter().zip(&rows) {
            let first = (id as usize * dim) as f32;
            assert_eq!(*emb, [first, first + 1.0], "row {id}");
            assert_eq!(*state, [-(id as f32); 2], "row {id}");
        }
        for (emb, state) in rows {
            emb[0] = 0.5;
            state[1] = 0.25;
        }
        for id in ids {
            let (emb, state) = host.row(id, dim, dim).unwrap();
            assert!(
                emb[0] == 0.5 && state[1] == 0.25,
                "row {id} written through"
            );
        }
        let repeated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            host.disjoint_rows_mut(&[30, 26, 30], dim, dim).len()
        }));
        assert!(
            repeated.is_err(),
            "a repeated row must not be handed out twice"
        );
        let absent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            host.disjoint_rows_mut(&[0], dim, dim).len()
        }));
        assert!(absent.is_err(), "partition 0 is not resident");
    }

    #[test]
    fn the_memory_store_moves_partitions_instead_of_copying_them() {
        let (entities, dim) = (9_000u64, 4usize);
        let shape = RowShape::new(dim, StateLayout::Element);
        let scheme = PartitionScheme::new(entities, 3).unwrap();
        let mut s = swapper(scheme, shape, 2, MemoryStore::default());
        load_all(&mut s, &[0, 1]);
        s.host().disjoint_rows_mut(&[5], dim, dim)[0].0[0] = 42.0;
        let at = |s: &mut Swapper, p| s.host().partition(p).unwrap().emb.as_ptr();
        let before = at(&mut s, 0);
        s.evict(0, Fence::passed(), None).unwrap();
        s.load(2, None).unwrap();
        s.arrive(2).unwrap();
        // Read while in the store (a checkpoint, an evaluation): lent, not copied.
        let lent = s.with_stored(0, |p| (p.emb.as_ptr(), p.emb[20])).unwrap();
        assert_eq!(lent, (before, 42.0));
        s.evict(1, Fence::passed(), None).unwrap();
        s.load(0, None).unwrap();
        s.arrive(0).unwrap();
        // Partition 0 went into the store and came back: the same memory, its rows intact.
        assert_eq!(at(&mut s, 0), before);
        assert_eq!(s.host().row(5, dim, dim).unwrap().0[0], 42.0);
        s.drain().unwrap();
        let st = s.stats();
        assert_eq!((st.writes, st.reads, st.initialised), (2, 1, 3));
    }

    #[test]
    fn a_read_ahead_lands_in_the_spare_slot_and_a_cancelled_one_goes_back_to_the_store() {
        let (entities, dim) = (40u64, 2usize);
        let shape = RowShape::new(dim, StateLayout::Element);
        let scheme = PartitionScheme::new(entities, 4).unwrap();
        // C = 2 with read-ahead: three slots.
        let mut s = swapper(scheme, shape, 3, numbered(scheme, shape));
        load_all(&mut s, &[0, 1]);
        s.host().disjoint_rows_mut(&[15], dim, dim)[0].0[0] = -1.0;
        // The next swap's partition is read while 0 and 1 are still resident...
        s.load(2, Some(0)).unwrap();
        let (slot, _) = s.arrive(2).unwrap();
        assert_eq!(s.resident(), [0, 1, 2]);
        assert!(slot != s.slot(0).unwrap() && slot != s.slot(1).unwrap());
        // ...then 1 leaves, and a read queued after its write sees what it wrote.
        s.evict(1, Fence::passed(), Some(0)).unwrap();
        s.load(1, Some(1)).unwrap();
        s.arrive(1).unwrap();
        assert_eq!(s.host().row(15, dim, dim).unwrap().0[0], -1.0);
        // A stop with a read ahead in flight: the rows it took from the memory store go back.
        s.evict(2, Fence::passed(), None).unwrap();
        s.load(3, None).unwrap();
        s.cancel_loads().unwrap();
        assert_eq!(s.resident(), [0, 1]);
        let row = s.with_stored(3, |p| (p.emb[0], p.state[0])).unwrap();
        assert_eq!(row, (60.0, -30.0), "partition 3's rows are lost");
        s.drain().unwrap();
        let tags: Vec<_> = s.take_log().iter().map(|r| r.tag).collect();
        assert_eq!(tags[..5], [None, None, Some(0), Some(0), Some(1)]);
    }

    #[test]
    fn streaming_reads_every_partition_in_order_and_draws_the_unwritten() {
        let (entities, dim) = (50u64, 3usize);
        let shape = RowShape::new(dim, StateLayout::Element);
        let scheme = PartitionScheme::new(entities, 5).unwrap();
        let mut store = numbered(scheme, shape);
        store.take_stored(3);
        let mut s = swapper(scheme, shape, 2, store);
        let check = |part: &Partition| {
            for (i, row) in part.emb.chunks_exact(dim).enumerate() {
                let id = scheme.range(part.id).start + i as u64;
                let mut want = vec![id as f32 * dim as f32, 0.0, 0.0];
                want[1] = want[0] + 1.0;
                want[2] = want[0] + 2.0;
                if part.id == 3 {
                    init().node_row(id, &mut want);
                }
                assert_eq!(row, want, "row {id}");
            }
        };
        // A scan that fails half-way (its block refuses partition 2) leaves the slots free and
        // the store whole: the next scans see every partition, the same rows.
        let failed = s.stream(|part| {
            if part.id == 2 {
                return Err(PartitionStoreError::Invalid("stop".into()));
            }
            check(part);
            Ok(())
        });
        assert!(matches!(failed, Err(PartitionStoreError::Invalid(_))));
        for _ in 0..2 {
            let mut seen = Vec::new();
            s.stream(|part| {
                seen.push(part.id);
                check(part);
                Ok::<_, PartitionStoreError>(())
            })
            .unwrap();
            assert_eq!(seen, [0, 1, 2, 3, 4]);
        }
        // A memory store reads whole partitions only: a lookup is refused, and the swapper
        // goes on.
        let mut out = vec![0.0; dim];
        let refused = s.read_rows(&[7], &mut out).unwrap_err();
        assert!(refused.to_string().contains("in memory"), "{refused}");
        assert_eq!(s.resident(), [] as [u32; 0]);
    }
}
