//! The partition buffer: C resident partitions of node embeddings + AdaGrad state, swapped with
//! a [`PartitionStore`] on a dedicated I/O thread so that a swap overlaps with compute.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use legend_dataset::PartitionScheme;
use legend_model::{Dtype, Init, StateLayout};
use rayon::prelude::*;
use rustc_hash::FxHashMap;

/// One row: its embedding and its AdaGrad state, and the embedding's format at rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowShape {
    /// Embedding floats, d.
    pub dim: usize,
    /// AdaGrad accumulators: d (element-wise) or 1 (row-wise).
    pub state: usize,
    /// The embedding's number format at rest (`storage.dtype`); in memory rows are f32 whose
    /// values the format represents exactly.
    pub dtype: Dtype,
}

impl RowShape {
    /// f32 rows of dimension `dim` with AdaGrad state of `layout`.
    pub fn new(dim: usize, layout: StateLayout) -> RowShape {
        RowShape {
            dim,
            state: layout.width(dim),
            dtype: Dtype::F32,
        }
    }

    /// The same rows with embeddings of `dtype` at rest.
    pub fn with_dtype(self, dtype: Dtype) -> RowShape {
        RowShape { dtype, ..self }
    }

    /// Bytes of one row at rest (embedding in its format, state f32).
    pub fn bytes(self) -> u64 {
        (self.dim * self.dtype.bytes() + self.state * 4) as u64
    }

    /// Bytes of one row in memory (f32 embedding and state): the host buffer, the memory
    /// store and the GPU table.
    pub fn memory_bytes(self) -> u64 {
        (self.dim + self.state) as u64 * 4
    }

    /// Bytes of `part`'s rows at rest (what a swap of it moves).
    fn bytes_of(self, part: &Partition) -> u64 {
        (part.emb.len() * self.dtype.bytes() + part.state.len() * 4) as u64
    }
}

/// Rows of one partition: embeddings (`rows × dim`) and AdaGrad state (`rows × state`).
#[derive(Clone, Debug, PartialEq)]
pub struct Partition {
    /// Partition id.
    pub id: u32,
    /// Embeddings, row-major.
    pub emb: Vec<f32>,
    /// AdaGrad state, row-major ([`RowShape::state`] a row).
    pub state: Vec<f32>,
    /// Never written and not drawn yet: the engine that holds the partition initialises its
    /// rows (see [`PartitionBuffer::defer_initialisation`]); `emb` and `state` mean nothing
    /// until the engine hands them back.
    pub fresh: bool,
}

/// Where partitions live while they are not in the buffer.
///
/// Implemented by the in-RAM store here and by the on-disk stores.
pub trait PartitionStore: Send + 'static {
    /// Reads partition `p` into `emb`/`state` (already sized). Returns `false`, leaving the
    /// buffers untouched, if the partition was never written: the caller initialises it.
    fn read(&mut self, p: u32, emb: &mut [f32], state: &mut [f32]) -> Result<bool, StoreError>;
    /// Writes partition `p`.
    fn write(&mut self, p: u32, emb: &[f32], state: &[f32]) -> Result<(), StoreError>;
    /// Makes every write so far durable.
    fn sync(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
    /// Commits a checkpoint: every partition written so far, `aux` (the relation parameters)
    /// and `progress`, atomically. Stores without their own checkpoints (RAM) do nothing and
    /// return `false`; the caller then saves the checkpoint elsewhere.
    fn commit(&mut self, _progress: &[u8], _aux: &[u8]) -> Result<bool, StoreError> {
        Ok(false)
    }
    /// Whether the store is process memory, like the buffer: partitions then move between the
    /// two ([`PartitionStore::take`], [`PartitionStore::keep`]) instead of being copied, and a
    /// checkpoint leaves the resident partitions where they are (with every partition
    /// resident, a copy would be a second whole table in RAM).
    fn in_memory(&self) -> bool {
        false
    }
    /// For a store in memory: gives partition `p`'s rows (embeddings, state) to the buffer,
    /// which hands them back through [`PartitionStore::keep`]; `None` when the store does not
    /// hold `p` (the buffer reads it, or initialises a never-written one).
    fn take(&mut self, _p: u32) -> Option<(Vec<f32>, Vec<f32>)> {
        None
    }
    /// For a store in memory: takes an evicted partition's rows over, as a move (a copy of a
    /// 4 GB partition, into memory touched for the first time, costs seconds per swap).
    fn keep(&mut self, p: u32, emb: Vec<f32>, state: Vec<f32>) -> Result<(), StoreError> {
        self.write(p, &emb, &state)
    }
}

/// Work a compute engine that keeps resident rows elsewhere (the GPU) has the buffer's I/O
/// thread do around one swap, so that its copies overlap with compute rather than stall it.
pub trait SwapHook: Send {
    /// Runs before the evicted partition `part` is written back: makes its rows current
    /// (waiting for the device's copy of them).
    fn before_write(&mut self, part: &mut Partition) -> Result<(), StoreError>;
    /// Runs once the loaded partition `part` has been read or initialised, before the swap is
    /// reported finished: starts its copy to where compute reads it.
    fn after_read(&mut self, part: &Partition) -> Result<(), StoreError>;
}

/// A partition store failure, with its cause.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The on-disk store failed.
    #[error(transparent)]
    Storage(#[from] legend_storage::StoreError),
    /// A file of the store could not be created, opened or sized.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The NVMe controller behind the store could not be opened or attached.
    #[error("{what}")]
    Controller {
        /// What was being done, and what to check.
        what: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Moving a partition between the GPU and the store failed.
    #[error("{what} partition {partition} {path}")]
    Gpu {
        /// `writing`, `reading`, `uploading`, `downloading`.
        what: &'static str,
        /// The partition.
        partition: u32,
        /// `on the GPU` or `through the GPU I/O kernels`.
        path: &'static str,
        /// Why.
        #[source]
        source: legend_cuda::GpuError,
    },
    /// The partition buffer's I/O thread has stopped (after an earlier failure).
    #[error("the partition buffer's I/O thread has stopped")]
    IoThreadStopped,
    /// The store does not hold what was asked of it (the message says what).
    #[error("{0}")]
    Invalid(String),
}

/// Partitions kept in RAM outside the buffer: the `memory` backend when C < N.
#[derive(Default)]
pub struct MemoryStore {
    parts: FxHashMap<u32, (Vec<f32>, Vec<f32>)>,
}

impl Partition {
    /// A partition with no memory yet.
    fn empty(id: u32) -> Partition {
        Partition {
            id,
            emb: Vec::new(),
            state: Vec::new(),
            fresh: false,
        }
    }
}

impl MemoryStore {
    /// A store holding whole tables (`entities` rows of `shape` each), split by `scheme`:
    /// resuming a run.
    /// The tables are cut from their ends, each partition copied out and the rest shrunk, and
    /// what remains is partition 0 itself, so that resuming holds the tables once and at most
    /// one partition twice (none with one partition).
    pub fn from_tables(
        scheme: PartitionScheme,
        shape: RowShape,
        mut emb: Vec<f32>,
        mut state: Vec<f32>,
    ) -> MemoryStore {
        let mut parts = FxHashMap::default();
        for p in (1..scheme.num_partitions).rev() {
            let start = scheme.range(p).start as usize;
            let part = (
                emb.split_off(start * shape.dim),
                state.split_off(start * shape.state),
            );
            emb.shrink_to_fit();
            state.shrink_to_fit();
            parts.insert(p, part);
        }
        parts.insert(0, (emb, state));
        MemoryStore { parts }
    }
}

impl PartitionStore for MemoryStore {
    fn read(&mut self, p: u32, emb: &mut [f32], state: &mut [f32]) -> Result<bool, StoreError> {
        match self.parts.get(&p) {
            Some((e, s)) => {
                emb.copy_from_slice(e);
                state.copy_from_slice(s);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn in_memory(&self) -> bool {
        true
    }

    fn take(&mut self, p: u32) -> Option<(Vec<f32>, Vec<f32>)> {
        self.parts.remove(&p)
    }

    fn keep(&mut self, p: u32, emb: Vec<f32>, state: Vec<f32>) -> Result<(), StoreError> {
        self.parts.insert(p, (emb, state));
        Ok(())
    }

    fn write(&mut self, p: u32, emb: &[f32], state: &[f32]) -> Result<(), StoreError> {
        let entry = self.parts.entry(p).or_default();
        entry.0.clear();
        entry.0.extend_from_slice(emb);
        entry.1.clear();
        entry.1.extend_from_slice(state);
        Ok(())
    }
}

/// I/O counters of a buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IoStats {
    /// Partitions read from the store (never-written ones initialised instead are not counted).
    pub reads: u64,
    /// Partitions initialised in memory instead of read.
    pub initialised: u64,
    /// Partitions written to the store.
    pub writes: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Time the I/O thread spent on I/O.
    pub io_time: Duration,
    /// Time compute spent waiting for a swap to finish.
    pub wait_time: Duration,
    /// Part of `io_time` the I/O thread spent in [`SwapHook`]s (the GPU's copies).
    pub hook_time: Duration,
    /// Swaps (buffer state changes), the initial fill not included.
    pub swaps: u64,
}

enum Request {
    /// Write `evict` back (if any), then load partition `load` into its buffers, running
    /// `hook` around both.
    Swap {
        evict: Option<Partition>,
        load: u32,
        hook: Option<Box<dyn SwapHook>>,
    },
    /// Write these partitions back and sync; hand them back.
    Flush(Vec<Partition>),
    /// Write these partitions back (a store in memory keeps them): they leave the buffer.
    Evict(Vec<Partition>),
    /// Read a copy of a partition that is not resident (initialising a never-written one); a
    /// store in memory lends its own instead, which comes back with `Return`.
    Read(u32),
    /// A partition a store in memory lent for a `Read`.
    Return(Partition),
    /// Write these partitions back, then commit a checkpoint with this progress and aux data.
    Checkpoint {
        parts: Vec<Partition>,
        progress: Vec<u8>,
        aux: Vec<u8>,
    },
}

struct Reply {
    loaded: Option<Partition>,
    /// `loaded` is the store's own (a `Read` from a store in memory): it goes back after use.
    lent: bool,
    flushed: Vec<Partition>,
    committed: bool,
    stats: IoStats,
}

impl Reply {
    /// A reply that carries nothing but the request's I/O counters.
    fn stats(stats: IoStats) -> Reply {
        Reply {
            loaded: None,
            lent: false,
            flushed: Vec::new(),
            committed: false,
            stats,
        }
    }
}

/// One row's embedding and AdaGrad state, writable.
pub type RowMut<'a> = (&'a mut [f32], &'a mut [f32]);

/// The partition buffer.
///
/// Compute reads and updates rows of resident partitions through [`PartitionBuffer::row`] and
/// [`PartitionBuffer::rows_mut`]. A swap hands the evicted partition to the I/O thread, which
/// writes it back and reuses its memory for the partition being loaded, so the buffer never
/// holds more than C partitions.
pub struct PartitionBuffer {
    scheme: PartitionScheme,
    shape: RowShape,
    resident: Vec<Option<Partition>>,
    requests: Option<mpsc::Sender<Request>>,
    // Behind a mutex only so that the buffer is `Sync` and compute threads can share `&self`.
    replies: std::sync::Mutex<mpsc::Receiver<Result<Reply, StoreError>>>,
    thread: Option<JoinHandle<()>>,
    in_flight: Option<u32>,
    stats: IoStats,
    /// Shared with the I/O thread: see [`PartitionBuffer::defer_initialisation`].
    defer_init: Arc<AtomicBool>,
}

impl PartitionBuffer {
    /// A buffer over `store` with nothing resident yet. `init` initialises never-written
    /// partitions, row by global id, so results do not depend on which partitions are resident.
    pub fn new(
        scheme: PartitionScheme,
        shape: RowShape,
        init: Init,
        mut store: impl PartitionStore,
    ) -> Self {
        let (req_tx, req_rx) = mpsc::channel::<Request>();
        let (rep_tx, rep_rx) = mpsc::channel();
        let defer_init = Arc::new(AtomicBool::new(false));
        let defer = Arc::clone(&defer_init);
        let thread = std::thread::Builder::new()
            .name("legend-io".into())
            .spawn(move || {
                for request in req_rx {
                    let reply = serve(&mut store, scheme, shape, &init, &defer, request);
                    if rep_tx.send(reply).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning the I/O thread");
        PartitionBuffer {
            scheme,
            shape,
            resident: (0..scheme.num_partitions).map(|_| None).collect(),
            requests: Some(req_tx),
            replies: std::sync::Mutex::new(rep_rx),
            thread: Some(thread),
            in_flight: None,
            stats: IoStats::default(),
            defer_init,
        }
    }

    /// From now on a never-written partition that becomes resident comes [`Partition::fresh`]
    /// instead of drawn on the host: for an engine that draws the same rows itself (the GPU
    /// engine draws 41.6 M rows in well under a second, where the host's cores take half a
    /// minute). Only an engine that keeps the resident rows and hands them back may ask.
    pub fn defer_initialisation(&self) {
        self.defer_init.store(true, Ordering::Relaxed);
    }

    /// The partitioning.
    pub fn scheme(&self) -> PartitionScheme {
        self.scheme
    }

    /// Row width.
    pub fn dim(&self) -> usize {
        self.shape.dim
    }

    /// Floats of a row.
    pub fn shape(&self) -> RowShape {
        self.shape
    }

    /// Resident partitions, ascending.
    pub fn resident(&self) -> Vec<u32> {
        (0..self.scheme.num_partitions)
            .filter(|&p| self.resident[p as usize].is_some())
            .collect()
    }

    /// Whether partition `p` is resident (and not being swapped).
    pub fn is_resident(&self, p: u32) -> bool {
        self.resident[p as usize].is_some()
    }

    /// I/O counters so far.
    pub fn stats(&self) -> IoStats {
        self.stats
    }

    fn send(&self, request: Request) -> Result<(), StoreError> {
        self.requests
            .as_ref()
            .expect("I/O thread alive until drop")
            .send(request)
            .map_err(|_| StoreError::IoThreadStopped)
    }

    fn receive(&mut self) -> Result<Reply, StoreError> {
        let started = Instant::now();
        let reply = self
            .replies
            .get_mut()
            .expect("the reply channel lock is never poisoned")
            .recv()
            .map_err(|_| StoreError::IoThreadStopped)??;
        self.stats.wait_time += started.elapsed();
        let s = reply.stats;
        self.stats.reads += s.reads;
        self.stats.initialised += s.initialised;
        self.stats.writes += s.writes;
        self.stats.bytes_read += s.bytes_read;
        self.stats.bytes_written += s.bytes_written;
        self.stats.io_time += s.io_time;
        self.stats.hook_time += s.hook_time;
        Ok(reply)
    }

    /// Loads partitions until exactly `state` is resident, evicting others first-come.
    /// Used for the initial fill (nothing resident) and between epochs.
    pub fn fill(&mut self, state: &[u32]) -> Result<(), StoreError> {
        let mut evictable: Vec<u32> = self
            .resident()
            .into_iter()
            .filter(|p| !state.contains(p))
            .collect();
        for &p in state {
            if self.is_resident(p) {
                continue;
            }
            let evict = evictable
                .pop()
                .and_then(|e| self.resident[e as usize].take());
            self.send(Request::Swap {
                evict,
                load: p,
                hook: None,
            })?;
            self.in_flight = Some(p);
            self.finish_swap()?;
        }
        let leaving = evictable
            .into_iter()
            .map(|e| self.resident[e as usize].take().expect("resident"))
            .collect::<Vec<_>>();
        if !leaving.is_empty() {
            self.send(Request::Evict(leaving))?;
            self.receive()?;
        }
        Ok(())
    }

    /// Starts a swap: `evict` leaves the buffer now (compute must not touch it any more) and
    /// `load` becomes resident at [`PartitionBuffer::finish_swap`].
    pub fn begin_swap(&mut self, evict: u32, load: u32) -> Result<(), StoreError> {
        self.begin_swap_with(evict, load, None)
    }

    /// [`PartitionBuffer::begin_swap`] with a hook the I/O thread runs before it writes
    /// `evict` back and after it has read `load` (see [`SwapHook`]).
    pub fn begin_swap_with(
        &mut self,
        evict: u32,
        load: u32,
        hook: Option<Box<dyn SwapHook>>,
    ) -> Result<(), StoreError> {
        assert!(self.in_flight.is_none(), "one swap at a time");
        let part = self.resident[evict as usize]
            .take()
            .unwrap_or_else(|| panic!("evicting partition {evict}, which is not resident"));
        self.send(Request::Swap {
            evict: Some(part),
            load,
            hook,
        })?;
        self.in_flight = Some(load);
        self.stats.swaps += 1;
        Ok(())
    }

    /// Waits for the swap in flight and makes its partition resident.
    pub fn finish_swap(&mut self) -> Result<(), StoreError> {
        let p = self.in_flight.take().expect("a swap in flight");
        let reply = self.receive()?;
        let part = reply
            .loaded
            .expect("a swap reply carries the loaded partition");
        debug_assert_eq!(part.id, p);
        self.resident[p as usize] = Some(part);
        Ok(())
    }

    /// Writes every resident partition back to the store and syncs it; they stay resident.
    pub fn flush(&mut self) -> Result<(), StoreError> {
        let parts: Vec<Partition> = self.resident.iter_mut().filter_map(Option::take).collect();
        self.send(Request::Flush(parts))?;
        let reply = self.receive()?;
        for part in reply.flushed {
            let id = part.id as usize;
            self.resident[id] = Some(part);
        }
        Ok(())
    }

    /// Writes every resident partition back (unless the store is in memory too) and commits a
    /// checkpoint with `progress` and `aux` in the store. Returns whether the store keeps checkpoints itself (see
    /// [`PartitionStore::commit`]).
    pub fn checkpoint(&mut self, progress: Vec<u8>, aux: Vec<u8>) -> Result<bool, StoreError> {
        let parts: Vec<Partition> = self.resident.iter_mut().filter_map(Option::take).collect();
        self.send(Request::Checkpoint {
            parts,
            progress,
            aux,
        })?;
        let reply = self.receive()?;
        for part in reply.flushed {
            let id = part.id as usize;
            self.resident[id] = Some(part);
        }
        Ok(reply.committed)
    }

    /// A copy of partition `p`, resident or not.
    pub fn read_partition(&mut self, p: u32) -> Result<Partition, StoreError> {
        self.with_partition(p, Partition::clone)
    }

    /// Calls `f` with partition `p`: a resident one in place, another read from the store for
    /// the call (for checkpoints, exports and evaluation, which would otherwise copy every
    /// resident partition: the whole table when all are resident).
    pub fn with_partition<R>(
        &mut self,
        p: u32,
        f: impl FnOnce(&Partition) -> R,
    ) -> Result<R, StoreError> {
        if let Some(part) = self.partition(p) {
            return Ok(f(part));
        }
        self.send(Request::Read(p))?;
        let reply = self.receive()?;
        let part = reply.loaded.expect("a read reply carries the partition");
        let r = f(&part);
        if reply.lent {
            self.send(Request::Return(part))?;
            self.receive()?;
        }
        Ok(r)
    }

    /// Embedding and state rows of entity `id`, if its partition is resident.
    pub fn row(&self, id: u32) -> Option<(&[f32], &[f32])> {
        let p = self.scheme.partition_of(id);
        let part = self.resident[p as usize].as_ref()?;
        let local = (u64::from(id) - self.scheme.range(p).start) as usize;
        let RowShape { dim, state, .. } = self.shape;
        Some((
            &part.emb[local * dim..(local + 1) * dim],
            &part.state[local * state..(local + 1) * state],
        ))
    }

    /// Mutable embedding and state rows of entity `id`, if its partition is resident.
    pub fn rows_mut(&mut self, id: u32) -> Option<(&mut [f32], &mut [f32])> {
        let p = self.scheme.partition_of(id);
        let start = self.scheme.range(p).start;
        let part = self.resident[p as usize].as_mut()?;
        let local = (u64::from(id) - start) as usize;
        let RowShape { dim, state, .. } = self.shape;
        Some((
            &mut part.emb[local * dim..(local + 1) * dim],
            &mut part.state[local * state..(local + 1) * state],
        ))
    }

    /// Writable rows of `ids`, in their order, so that callers can update them in parallel.
    ///
    /// # Panics
    /// If an id repeats or its partition is not resident.
    pub fn disjoint_rows_mut(&mut self, ids: &[u32]) -> Vec<RowMut<'_>> {
        let RowShape {
            dim, state: width, ..
        } = self.shape;
        let scheme = self.scheme;
        // What is left of each resident partition past the last row handed out, and the id of
        // its first row: ids are visited in ascending order, each row split off the front.
        let mut rest: Vec<Option<(RowMut<'_>, u64)>> = self
            .resident
            .iter_mut()
            .enumerate()
            .map(|(p, part)| {
                part.as_mut().map(|part| {
                    let first = scheme.range(p as u32).start;
                    ((&mut part.emb[..], &mut part.state[..]), first)
                })
            })
            .collect();
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_unstable_by_key(|&i| ids[i]);
        let mut rows: Vec<Option<RowMut<'_>>> = ids.iter().map(|_| None).collect();
        for i in order {
            let id = u64::from(ids[i]);
            let p = scheme.partition_of(ids[i]) as usize;
            let ((emb, state), first) = rest[p]
                .take()
                .unwrap_or_else(|| panic!("row {id}: partition {p} is not resident"));
            let skip =
                id.checked_sub(first)
                    .unwrap_or_else(|| panic!("row {id} asked for twice")) as usize;
            let (row, emb) = emb[skip * dim..].split_at_mut(dim);
            let (row_state, state) = state[skip * width..].split_at_mut(width);
            rows[i] = Some((row, row_state));
            rest[p] = Some(((emb, state), id + 1));
        }
        rows.into_iter()
            .map(|r| r.expect("every id visited"))
            .collect()
    }

    /// A resident partition.
    pub fn partition(&self, p: u32) -> Option<&Partition> {
        self.resident[p as usize].as_ref()
    }

    /// A resident partition, writable (a compute engine that keeps the rows elsewhere
    /// copies them back here before the partition leaves or is read).
    pub fn partition_mut(&mut self, p: u32) -> Option<&mut Partition> {
        self.resident[p as usize].as_mut()
    }
}

impl Drop for PartitionBuffer {
    fn drop(&mut self) {
        // Closing the channel ends the I/O thread's loop.
        self.requests.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    store: &mut impl PartitionStore,
    scheme: PartitionScheme,
    shape: RowShape,
    init: &Init,
    defer_init: &AtomicBool,
    request: Request,
) -> Result<Reply, StoreError> {
    let started = Instant::now();
    let mut stats = IoStats::default();
    match request {
        Request::Swap {
            evict,
            load,
            mut hook,
        } => {
            let part = match evict {
                Some(mut old) => {
                    if let Some(h) = hook.as_deref_mut() {
                        let t = Instant::now();
                        h.before_write(&mut old)?;
                        stats.hook_time += t.elapsed();
                    }
                    match evict_into(store, old, shape, &mut stats)? {
                        // The file stores' memory is reused for the partition being loaded.
                        Some(old) => old,
                        None => Partition::empty(load),
                    }
                }
                None => Partition::empty(load),
            };
            let mut reply = loaded_reply(
                store,
                scheme,
                shape,
                init,
                Partition { id: load, ..part },
                Access::Take {
                    defer_init: defer_init.load(Ordering::Relaxed),
                },
                stats,
                started,
            )?;
            if let Some(h) = hook.as_deref_mut() {
                let t = Instant::now();
                h.after_read(reply.loaded.as_ref().expect("a swap loads a partition"))?;
                reply.stats.hook_time += t.elapsed();
                reply.stats.io_time = started.elapsed();
            }
            Ok(reply)
        }
        Request::Read(p) => {
            if let Some((emb, state)) = store.take(p) {
                // Lent, not copied: a checkpoint or an evaluation reads every partition, and
                // a copy of each would raise the run's peak by a partition.
                let part = Partition {
                    id: p,
                    emb,
                    state,
                    fresh: false,
                };
                return Ok(Reply {
                    loaded: Some(part),
                    lent: true,
                    ..Reply::stats(stats)
                });
            }
            loaded_reply(
                store,
                scheme,
                shape,
                init,
                Partition::empty(p),
                Access::Peek,
                stats,
                started,
            )
        }
        Request::Return(part) => {
            store.keep(part.id, part.emb, part.state)?;
            Ok(Reply::stats(stats))
        }
        Request::Flush(parts) => {
            write_back(store, &parts, shape, &mut stats)?;
            store.sync()?;
            stats.io_time = started.elapsed();
            Ok(Reply {
                flushed: parts,
                ..Reply::stats(stats)
            })
        }
        Request::Evict(parts) => {
            for part in parts {
                evict_into(store, part, shape, &mut stats)?;
            }
            store.sync()?;
            stats.io_time = started.elapsed();
            Ok(Reply::stats(stats))
        }
        Request::Checkpoint {
            parts,
            progress,
            aux,
        } => {
            if !store.in_memory() {
                write_back(store, &parts, shape, &mut stats)?;
            }
            let committed = store.commit(&progress, &aux)?;
            stats.io_time = started.elapsed();
            Ok(Reply {
                flushed: parts,
                committed,
                ..Reply::stats(stats)
            })
        }
    }
}

/// Whether a partition read becomes resident (the store may give up its copy; a never-written
/// one is left to the engine to draw when `defer_init`) or is only looked at.
#[derive(Clone, Copy)]
enum Access {
    Take { defer_init: bool },
    Peek,
}

/// Loads partition `part.id` into `part` (reusing its memory) and builds the reply that
/// carries it.
#[expect(clippy::too_many_arguments)]
fn loaded_reply(
    store: &mut impl PartitionStore,
    scheme: PartitionScheme,
    shape: RowShape,
    init: &Init,
    mut part: Partition,
    access: Access,
    mut stats: IoStats,
    started: Instant,
) -> Result<Reply, StoreError> {
    load_into(store, scheme, shape, init, &mut part, access, &mut stats)?;
    stats.io_time = started.elapsed();
    Ok(Reply {
        loaded: Some(part),
        ..Reply::stats(stats)
    })
}

/// Reads partition `part.id` into `part` (reusing its memory), or initialises it if never
/// written.
fn load_into(
    store: &mut impl PartitionStore,
    scheme: PartitionScheme,
    shape: RowShape,
    init: &Init,
    part: &mut Partition,
    access: Access,
    stats: &mut IoStats,
) -> Result<(), StoreError> {
    let p = part.id;
    let range = scheme.range(p);
    let rows = (range.end - range.start) as usize;
    let dim = shape.dim;
    if let Access::Take { .. } = access
        && let Some((emb, state)) = store.take(p)
    {
        (part.emb, part.state, part.fresh) = (emb, state, false);
        stats.reads += 1;
        stats.bytes_read += shape.bytes_of(part);
        return Ok(());
    }
    for (floats, width) in [(&mut part.emb, dim), (&mut part.state, shape.state)] {
        let len = rows * width;
        if floats.is_empty() {
            // Zeroed by the allocator (fresh pages, touched only when written): filling a
            // 17 GB partition explicitly would take seconds before it is even read.
            *floats = vec![0.0; len];
        } else {
            floats.resize(len, 0.0);
        }
    }
    let found = store.read(p, &mut part.emb, &mut part.state)?;
    part.fresh = !found && matches!(access, Access::Take { defer_init: true });
    if part.fresh {
        stats.initialised += 1;
    } else if found {
        stats.reads += 1;
        stats.bytes_read += shape.bytes_of(part);
    } else {
        // Rows are independent draws (a hash of the row id): on every core, since one thread
        // takes 25-30 s for a partition of 5.2 M rows at d = 100 (the Twitter-shaped run's
        // first epoch, which initialises each partition once).
        part.emb
            .par_chunks_exact_mut(dim)
            .enumerate()
            .for_each(|(i, emb)| init.node_row(range.start + i as u64, emb));
        part.state.fill(0.0);
        stats.initialised += 1;
    }
    Ok(())
}

/// Writes an evicted partition back: a store in memory keeps it (`None`), others are
/// written and the partition is handed back for its memory.
fn evict_into(
    store: &mut impl PartitionStore,
    part: Partition,
    shape: RowShape,
    stats: &mut IoStats,
) -> Result<Option<Partition>, StoreError> {
    if !store.in_memory() {
        write_back(store, std::slice::from_ref(&part), shape, stats)?;
        return Ok(Some(part));
    }
    stats.writes += 1;
    stats.bytes_written += shape.bytes_of(&part);
    store.keep(part.id, part.emb, part.state)?;
    Ok(None)
}

fn write_back(
    store: &mut impl PartitionStore,
    parts: &[Partition],
    shape: RowShape,
    stats: &mut IoStats,
) -> Result<(), StoreError> {
    for p in parts {
        store.write(p.id, &p.emb, &p.state)?;
        stats.writes += 1;
        stats.bytes_written += shape.bytes_of(p);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_written_partitions_hold_the_initial_rows() {
        let (entities, dim) = (10_007u64, 6usize);
        let scheme = PartitionScheme::new(entities, 3).unwrap();
        let init = Init {
            seed: 42,
            ..Init::default()
        };
        let mut buffer = PartitionBuffer::new(scheme, element(dim), init, MemoryStore::default());
        buffer.fill(&[2, 0]).unwrap();
        let mut want = vec![0.0f32; dim];
        for p in [0, 2] {
            let part = buffer.partition(p).expect("resident");
            let range = scheme.range(p);
            assert_eq!(part.emb.len(), (range.end - range.start) as usize * dim);
            for (row, got) in range.zip(part.emb.chunks_exact(dim)) {
                init.node_row(row, &mut want);
                assert_eq!(got, &want[..], "partition {p} row {row}");
            }
            assert!(part.state.iter().all(|&x| x == 0.0));
        }
        assert_eq!(buffer.stats().initialised, 2);
    }

    fn element(dim: usize) -> RowShape {
        RowShape::new(dim, StateLayout::Element)
    }

    #[test]
    fn row_wise_state_is_one_float_a_row_in_every_accessor() {
        let (entities, dim) = (100u64, 3usize);
        let shape = RowShape::new(dim, StateLayout::Row);
        let scheme = PartitionScheme::new(entities, 4).unwrap();
        let emb: Vec<f32> = (0..entities as usize * dim).map(|i| i as f32).collect();
        let state: Vec<f32> = (0..entities).map(|i| -(i as f32)).collect();
        let store = MemoryStore::from_tables(scheme, shape, emb, state);
        let mut buffer = PartitionBuffer::new(scheme, shape, Init::default(), store);
        buffer.fill(&[2, 0]).unwrap();
        for (id, (emb, state)) in [60u32, 3, 74]
            .iter()
            .zip(buffer.disjoint_rows_mut(&[60, 3, 74]))
        {
            let first = (*id as usize * dim) as f32;
            assert_eq!(*emb, [first, first + 1.0, first + 2.0], "row {id}");
            assert_eq!(*state, [-(*id as f32)], "row {id}");
            state[0] = 7.0;
        }
        assert_eq!(buffer.row(60).unwrap().1, [7.0]);
        assert_eq!(buffer.rows_mut(74).unwrap().1, [7.0]);
        // A never-written partition comes with one zero accumulator a row.
        let mut fresh =
            PartitionBuffer::new(scheme, shape, Init::default(), MemoryStore::default());
        fresh.fill(&[1]).unwrap();
        let part = fresh.partition(1).unwrap();
        assert_eq!((part.emb.len(), part.state.len()), (25 * dim, 25));
    }

    #[test]
    fn disjoint_rows_are_the_rows_asked_for_in_their_order() {
        let (entities, dim) = (100u64, 2usize);
        let scheme = PartitionScheme::new(entities, 4).unwrap();
        let emb: Vec<f32> = (0..entities as usize * dim).map(|i| i as f32).collect();
        let state: Vec<f32> = emb.iter().map(|x| -x).collect();
        let store = MemoryStore::from_tables(scheme, element(dim), emb, state);
        let mut buffer = PartitionBuffer::new(scheme, element(dim), Init::default(), store);
        buffer.fill(&[3, 1]).unwrap();
        // Unsorted, across both resident partitions, first and last rows of each included.
        let ids = [99u32, 25, 80, 49, 26, 75];
        let rows = buffer.disjoint_rows_mut(&ids);
        for (&id, (emb, state)) in ids.iter().zip(&rows) {
            let first = (id as usize * dim) as f32;
            assert_eq!(*emb, [first, first + 1.0], "row {id}");
            assert_eq!(*state, [-first, -first - 1.0], "row {id}");
        }
        for (emb, state) in rows {
            emb[0] = 0.5;
            state[1] = 0.25;
        }
        for id in ids {
            let (emb, state) = buffer.row(id).unwrap();
            assert!(
                emb[0] == 0.5 && state[1] == 0.25,
                "row {id} written through"
            );
        }
        let repeated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            buffer.disjoint_rows_mut(&[30, 26, 30]).len()
        }));
        assert!(
            repeated.is_err(),
            "a repeated row must not be handed out twice"
        );
        let absent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            buffer.disjoint_rows_mut(&[0]).len()
        }));
        assert!(absent.is_err(), "partition 0 is not resident");
    }

    #[test]
    fn tables_split_into_partitions_keep_their_rows_and_partition_zero_is_not_copied() {
        let (entities, dim) = (1_001u64, 3usize);
        let emb: Vec<f32> = (0..entities as usize * dim).map(|i| i as f32).collect();
        let state: Vec<f32> = emb.iter().map(|x| -x).collect();
        for n in [1, 4] {
            let scheme = PartitionScheme::new(entities, n).unwrap();
            let mut store =
                MemoryStore::from_tables(scheme, element(dim), emb.clone(), state.clone());
            for p in 0..n {
                let (e, s) = store.take(p).unwrap();
                let rows = scheme.range(p);
                let floats = rows.start as usize * dim..rows.end as usize * dim;
                assert!(
                    e == emb[floats.clone()] && s == state[floats],
                    "partition {p}"
                );
            }
        }
        // Moved, not copied: the caller's table is partition 0.
        let scheme = PartitionScheme::new(entities, 1).unwrap();
        let at = emb.as_ptr();
        let mut store = MemoryStore::from_tables(scheme, element(dim), emb, state);
        assert_eq!(store.take(0).unwrap().0.as_ptr(), at);
    }

    #[test]
    fn the_memory_store_moves_partitions_instead_of_copying_them() {
        let (entities, dim) = (9_000u64, 4usize);
        let scheme = PartitionScheme::new(entities, 3).unwrap();
        let mut buffer = PartitionBuffer::new(
            scheme,
            element(dim),
            Init::default(),
            MemoryStore::default(),
        );
        buffer.fill(&[0, 1]).unwrap();
        buffer.rows_mut(5).unwrap().0[0] = 42.0;
        let rows = |b: &PartitionBuffer, p| {
            let part = b.partition(p).unwrap();
            (part.emb.as_ptr(), part.state.as_ptr())
        };
        let before = rows(&buffer, 0);
        buffer.begin_swap(0, 2).unwrap();
        buffer.finish_swap().unwrap();
        // Read while in the store (a checkpoint, an evaluation): lent, not copied.
        let lent = buffer
            .with_partition(0, |p| (p.emb.as_ptr(), p.emb[20]))
            .unwrap();
        assert_eq!(lent, (before.0, 42.0));
        buffer.begin_swap(1, 0).unwrap();
        buffer.finish_swap().unwrap();
        // Partition 0 went into the store and came back: the same memory, its rows intact.
        assert_eq!(rows(&buffer, 0), before);
        assert_eq!(buffer.row(5).unwrap().0[0], 42.0);
        let s = buffer.stats();
        assert_eq!((s.writes, s.reads, s.initialised), (2, 1, 3));
    }
}
