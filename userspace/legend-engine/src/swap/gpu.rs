//! The GPU engine's movers: partitions between slots of its node table and the store, through
//! pinned host memory ([`GpuCopyMover`]) or straight to the SSD with the GPU I/O kernels
//! ([`GpuDirectMover`]). Both run on the swap's I/O thread with CUDA streams of their own,
//! ordered against the compute stream by the jobs' fences.

use std::time::Instant;

use legend_cuda::nvme_io::{GpuIo, GpuIoJob, GpuIoOptions, IoMember, MemberJob, RingPlacement};
use legend_cuda::{
    CudaSlice, DEFAULT_CHUNK_BYTES, Gpu, GpuError, RowConverter, RowSpan, Transfer, addr,
};

use super::host::HostStore;
use super::{Fence, IoDirection, IoKernelSpan, Moved, Mover, WriteJob};
use crate::rows::Partition;
use crate::store::{
    FileStore, PartitionStore, PartitionStoreError, QueuedMember, StoredEmbeddings,
};

/// The slots of the GPU engine's node table as its movers reach them: raw device addresses.
///
/// The addresses stay valid while the engine lives: the trainer drops its swapper, whose I/O
/// thread runs every mover, before its engine, which owns the table.
pub(crate) struct DeviceSlots {
    /// Each slot's rows (a whole partition's worth; the last partition's may be fewer).
    pub(crate) spans: Vec<RowSpan>,
}

impl DeviceSlots {
    /// The rows partition `p`, of `rows` rows, takes in `slot`.
    fn span(&self, slot: u32, p: u32, rows: usize) -> Result<RowSpan, PartitionStoreError> {
        self.spans[slot as usize]
            .first_rows(rows)
            .map_err(|e| gpu_error("placing", p, ON_THE_GPU, e))
    }
}

const ON_THE_GPU: &str = "on the GPU";
const THROUGH_THE_KERNELS: &str = "through the GPU I/O kernels";

fn gpu_error(
    what: &'static str,
    partition: u32,
    path: &'static str,
    source: GpuError,
) -> PartitionStoreError {
    PartitionStoreError::Gpu {
        what,
        partition,
        path,
        source,
    }
}

/// Rows of partition `p` in `rest`'s partitioning.
fn rows_of<S>(rest: &HostStore<S>, p: u32) -> usize {
    let r = rest.scheme.range(p);
    (r.end - r.start) as usize
}

/// Draws never-written partition `p` in `span` on `transfer`'s stream; returns the fence compute
/// waits for.
fn draw_on_gpu<S>(
    transfer: &mut Transfer,
    rest: &HostStore<S>,
    p: u32,
    span: &RowSpan,
    moved: &mut Moved,
) -> Result<Fence, PartitionStoreError> {
    let fail = |e| gpu_error("drawing", p, ON_THE_GPU, e);
    // SAFETY: the slot's rows are this job's: compute released them (the write that freed the
    // slot waited for that) and uses them only after the fence returned here.
    unsafe { transfer.init_span(span, rest.scheme.range(p).start, &rest.init) }.map_err(fail)?;
    moved.stats.initialised += 1;
    Ok(Fence::at(transfer.record().map_err(fail)?))
}

/// Slots to and from the store through pinned host memory: the memory store, the `file`
/// backend, and stores striped over several queue-backed devices.
pub(crate) struct GpuCopyMover<S> {
    rest: HostStore<S>,
    slots: DeviceSlots,
    transfer: Transfer,
    /// 16-bit rows in a memory store: a slot's embeddings are narrowed here on the GPU before
    /// their download and widened from here after their upload, so that host RAM and the
    /// copies hold 2 bytes an element.
    narrow: Option<(RowConverter, CudaSlice<u16>)>,
    /// Host rows that a file store's partitions pass through, their memory reused.
    spare: Vec<Partition>,
    /// Every partition keeps its slot for the run: a host copy is dropped once uploaded.
    resident_for_good: bool,
}

impl<S: PartitionStore> GpuCopyMover<S> {
    /// A mover for `gpu`'s `slots` over `rest`; `resident_for_good`: no partition ever leaves
    /// its slot (C = N).
    pub(crate) fn new(
        gpu: &Gpu,
        rest: HostStore<S>,
        slots: DeviceSlots,
        resident_for_good: bool,
    ) -> Result<GpuCopyMover<S>, GpuError> {
        let dtype = rest.shape.dtype;
        let narrow = match RowConverter::new(gpu, dtype) {
            Some(c) if rest.store.in_memory() => {
                let values = rest.scheme.rows_per_partition as usize * rest.shape.dim;
                Some((c, gpu.zeros::<u16>(values)?))
            }
            _ => None,
        };
        Ok(GpuCopyMover {
            rest,
            slots,
            transfer: Transfer::new(gpu, DEFAULT_CHUNK_BYTES)?,
            narrow,
            spare: Vec::new(),
            resident_for_good,
        })
    }

    /// Copies `span`'s rows into a memory store's form, reusing `stale`'s memory (the copy
    /// the store kept when the partition was uploaded).
    ///
    /// # Safety
    /// Nothing else may touch the slot's rows until the call returns.
    unsafe fn download_stored(
        &mut self,
        span: &RowSpan,
        stale: Option<(StoredEmbeddings, Vec<f32>)>,
    ) -> Result<(StoredEmbeddings, Vec<f32>), GpuError> {
        let (emb, mut state) = stale.unwrap_or((StoredEmbeddings::F32(Vec::new()), Vec::new()));
        let [(emb_at, emb_bytes), (state_at, state_bytes)] = span.addrs();
        state.resize(state_bytes / 4, 0.0);
        let values = emb_bytes / 4;
        let emb = match &self.narrow {
            None => {
                let mut v = match emb {
                    StoredEmbeddings::F32(v) => v,
                    StoredEmbeddings::Bits16(_) => Vec::new(),
                };
                v.resize(values, 0.0);
                // SAFETY: the caller's contract; the span is the slot's.
                unsafe { self.transfer.download_raw(emb_at, &mut v) }?;
                StoredEmbeddings::F32(v)
            }
            Some((converter, staging)) => {
                let mut bits = match emb {
                    StoredEmbeddings::Bits16(b) => b,
                    StoredEmbeddings::F32(_) => Vec::new(),
                };
                bits.resize(values, 0);
                // SAFETY: as above; the staging buffer is this mover's, and its stream runs one
                // job at a time (the narrowing runs before the download on it).
                unsafe {
                    converter.narrow(self.transfer.stream(), emb_at, addr(staging), values)?;
                    self.transfer.download_raw(addr(staging), &mut bits)?;
                }
                StoredEmbeddings::Bits16(bits)
            }
        };
        // SAFETY: as above.
        unsafe { self.transfer.download_raw(state_at, &mut state) }?;
        Ok((emb, state))
    }

    /// Queues the copy of a memory store's rows into `span`'s.
    ///
    /// # Safety
    /// Nothing else may touch the slot's rows until the transfer stream has run the copies.
    unsafe fn upload_stored(
        &mut self,
        span: &RowSpan,
        emb: &StoredEmbeddings,
        state: &[f32],
    ) -> Result<(), GpuError> {
        let [(emb_at, _), (state_at, _)] = span.addrs();
        // SAFETY: the caller's contract; the staging buffer is this mover's, and the widening
        // runs after the upload on its stream.
        unsafe {
            match (emb, &self.narrow) {
                (StoredEmbeddings::F32(v), _) => self.transfer.upload_raw(v, emb_at)?,
                (StoredEmbeddings::Bits16(bits), Some((converter, staging))) => {
                    self.transfer.upload_raw(bits, addr(staging))?;
                    converter.widen(self.transfer.stream(), addr(staging), emb_at, bits.len())?;
                }
                (StoredEmbeddings::Bits16(_), None) => {
                    return Err(GpuError::Shape(
                        "16-bit rows without their conversion kernels".into(),
                    ));
                }
            }
            self.transfer.upload_raw(state, state_at)
        }
    }
}

impl<S: PartitionStore> Mover for GpuCopyMover<S> {
    fn write(
        &mut self,
        job: WriteJob,
        moved: &mut Moved,
    ) -> Result<Option<Partition>, PartitionStoreError> {
        let p = job.p;
        let fail = |e| gpu_error("downloading", p, ON_THE_GPU, e);
        let span = self.slots.span(job.slot, p, rows_of(&self.rest, p))?;
        if let Some(ev) = job.after.event() {
            self.transfer.wait(ev).map_err(fail)?;
        }
        let t = Instant::now();
        if self.rest.store.in_memory() {
            let stale = self.rest.store.take_stored(p);
            // SAFETY: the table outlives the swapper (see `DeviceSlots`); after `job.after`
            // nothing on the compute stream touches the slot, and a read into it is queued
            // after this job.
            let (emb, state) = unsafe { self.download_stored(&span, stale) }.map_err(fail)?;
            moved.stats.copy_time += t.elapsed();
            self.rest.store.keep_stored(p, emb, state)?;
            moved.stats.writes += 1;
            moved.stats.bytes_written += rows_of(&self.rest, p) as u64 * self.rest.shape.bytes();
            return Ok(None);
        }
        let host = self.spare.pop().unwrap_or_else(|| Partition::empty(p));
        let mut host = self.rest.sized(p, host);
        // SAFETY: as above.
        unsafe {
            self.transfer
                .download_span(&span, &mut host.emb, &mut host.state)
        }
        .map_err(fail)?;
        moved.stats.copy_time += t.elapsed();
        self.spare.extend(self.rest.write(host, moved)?);
        Ok(None)
    }

    fn read(
        &mut self,
        p: u32,
        slot: u32,
        moved: &mut Moved,
    ) -> Result<(Option<Partition>, Fence), PartitionStoreError> {
        let fail = |e| gpu_error("uploading", p, ON_THE_GPU, e);
        let span = self.slots.span(slot, p, rows_of(&self.rest, p))?;
        let t = Instant::now();
        if self.rest.store.in_memory() {
            let Some((emb, state)) = self.rest.store.take_stored(p) else {
                let ready = draw_on_gpu(&mut self.transfer, &self.rest, p, &span, moved)?;
                return Ok((None, ready));
            };
            // SAFETY: as in `write`; the slot's previous partition was copied out first on this
            // stream, and compute waits for the fence before it uses the slot. The host rows are
            // staged when the call returns.
            unsafe { self.upload_stored(&span, &emb, &state) }.map_err(fail)?;
            moved.stats.copy_time += t.elapsed();
            moved.stats.reads += 1;
            moved.stats.bytes_read += rows_of(&self.rest, p) as u64 * self.rest.shape.bytes();
            if !self.resident_for_good {
                // Stale from the first step, but its memory takes the rows back at the write.
                self.rest.store.keep_stored(p, emb, state)?;
            }
            // Else the slot holds the rows for the whole run: the host copy's memory goes back
            // (a whole table, resuming a run in GPU memory).
            let ready = Fence::at(self.transfer.record().map_err(fail)?);
            return Ok((None, ready));
        }
        let spare = self.spare.pop().unwrap_or_else(|| Partition::empty(p));
        let (host, found) = self.rest.read(p, spare, moved)?;
        if !found {
            self.spare.push(host);
            let ready = draw_on_gpu(&mut self.transfer, &self.rest, p, &span, moved)?;
            return Ok((None, ready));
        }
        // SAFETY: as above.
        unsafe { self.transfer.upload_span(&host.emb, &host.state, &span) }.map_err(fail)?;
        moved.stats.copy_time += t.elapsed();
        self.spare.push(host);
        Ok((None, Fence::at(self.transfer.record().map_err(fail)?)))
    }

    fn lend(&mut self, p: u32) -> Result<(Partition, bool), PartitionStoreError> {
        self.rest.lend(p)
    }

    fn read_rows(&mut self, ids: &[u64], out: &mut [f32]) -> Result<(), PartitionStoreError> {
        self.rest.store.read_rows(&self.rest.init, ids, out)
    }

    fn store(&mut self) -> &mut dyn PartitionStore {
        &mut self.rest.store
    }
}

/// Slots straight to and from SSDs (or proxy controllers) with the GPU I/O kernels: the evicted
/// slot is copied (narrowed, for 16-bit rows) into a staging region every member's controller
/// can reach, one launch of the kernels writes it to the partition's extent (its stripe units
/// to every member of a striped store at once, each on its own controller's queues), and a read
/// runs the other way.
pub(crate) struct GpuDirectMover {
    rest: HostStore<FileStore>,
    slots: DeviceSlots,
    io: GpuIo,
    /// The staging region: a partition as the store lays it out ([embeddings | state], padded
    /// to the LBA size).
    staging: usize,
    /// 16-bit node rows: the conversion between a slot's f32 embeddings and the store's.
    converter: Option<RowConverter>,
    /// Draws never-written partitions in their slots.
    transfer: Transfer,
}

impl GpuDirectMover {
    /// A mover for `gpu`'s `slots` over `rest`, whose store is behind NVMe queues: queue pairs
    /// of every member's controller, on the member's namespace.
    pub(crate) fn new(
        gpu: &Gpu,
        rest: HostStore<FileStore>,
        slots: DeviceSlots,
    ) -> Result<GpuDirectMover, PartitionStoreError> {
        let setup = |e| PartitionStoreError::Controller {
            what: "setting up the GPU I/O kernels' queues".into(),
            source: Box::new(e),
        };
        let members = rest
            .store
            .queued_members()
            .iter()
            .map(|m| io_member(gpu, m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut io = GpuIo::open_members(gpu, &members).map_err(setup)?;
        let staging = io
            .alloc(gpu, rest.store.max_partition_bytes())
            .map_err(setup)?;
        let opts = &members[0].options;
        tracing::info!(
            "partition swaps through the GPU I/O kernels: {} controller(s), {} queue pairs of \
             depth {} each, on {}",
            members.len(),
            opts.queues,
            io.depth(),
            match opts.placement {
                RingPlacement::Host => "pinned host memory (the proxy controller)",
                RingPlacement::Device => "GPU memory",
            }
        );
        Ok(GpuDirectMover {
            converter: RowConverter::new(gpu, rest.init.node_dtype),
            transfer: Transfer::new(gpu, DEFAULT_CHUNK_BYTES).map_err(setup)?,
            rest,
            slots,
            io,
            staging,
        })
    }

    /// Moves partition `p` between the staging region and its extent of the store (one piece
    /// a stripe unit, each on its member's queues) with one launch of the I/O kernels,
    /// recorded in `moved`.
    fn move_staging(
        &mut self,
        p: u32,
        write: bool,
        moved: &mut Moved,
    ) -> Result<(), PartitionStoreError> {
        let jobs: Vec<MemberJob> = self
            .rest
            .store
            .io_pieces(p, write)?
            .into_iter()
            .map(|piece| MemberJob {
                member: piece.member,
                job: GpuIoJob {
                    region: self.staging,
                    offset: piece.buf_offset,
                    bytes: piece.len,
                    at: piece.at,
                    write,
                },
            })
            .collect();
        let started = Instant::now();
        let (what, op) = if write {
            ("writing", IoDirection::Write)
        } else {
            ("reading", IoDirection::Read)
        };
        let run = self
            .io
            .run_members(&jobs, false)
            .map_err(|e| gpu_error(what, p, THROUGH_THE_KERNELS, e))?;
        moved.kernels.push((
            started,
            IoKernelSpan {
                op,
                partition: p,
                start_s: 0.0,
                seconds: run.seconds,
                commands: run.commands,
                bytes: run.bytes,
            },
        ));
        Ok(())
    }

    /// Bytes partition `p` takes at rest.
    fn bytes(&self, p: u32) -> u64 {
        rows_of(&self.rest, p) as u64 * self.rest.shape.bytes()
    }
}

/// The GPU I/O kernels' queues on store member `m`: a proxy's in pinned host memory (it moves
/// the kernels' data with this GPU's copy engine), a real controller's in GPU memory.
fn io_member(gpu: &Gpu, m: &QueuedMember) -> Result<IoMember, PartitionStoreError> {
    let placement = m.controller.gpu_placement(gpu)?;
    Ok(IoMember {
        controller: m.controller.controller(),
        options: GpuIoOptions {
            placement,
            namespace: m.namespace,
            ..GpuIoOptions::default()
        },
    })
}

impl Mover for GpuDirectMover {
    fn write(
        &mut self,
        job: WriteJob,
        moved: &mut Moved,
    ) -> Result<Option<Partition>, PartitionStoreError> {
        let p = job.p;
        let fail = |e| gpu_error("writing", p, THROUGH_THE_KERNELS, e);
        let span = self.slots.span(job.slot, p, rows_of(&self.rest, p))?;
        let [(emb, emb_bytes), (state, state_bytes)] = span.addrs();
        let base = self.io.region_addr(self.staging).map_err(fail)?;
        if let Some(ev) = job.after.event() {
            self.io.wait(ev).map_err(fail)?;
        }
        // SAFETY: the table outlives the swapper (see `DeviceSlots`); after `job.after` nothing
        // on the compute stream touches the slot; the staging region is this mover's, and its
        // stream runs one job at a time.
        unsafe {
            let stored = match &self.converter {
                None => self.io.copy(base, emb, emb_bytes).map(|()| emb_bytes),
                Some(c) => c
                    .narrow(self.io.stream(), emb, base, emb_bytes / 4)
                    .map(|()| c.bytes(emb_bytes / 4).next_multiple_of(4)),
            }
            .map_err(fail)?;
            self.io
                .copy(base + stored as u64, state, state_bytes)
                .map_err(fail)?;
        }
        self.move_staging(p, true, moved)?;
        self.rest.store.mark_written(p)?;
        moved.stats.writes += 1;
        moved.stats.bytes_written += self.bytes(p);
        Ok(None)
    }

    fn read(
        &mut self,
        p: u32,
        slot: u32,
        moved: &mut Moved,
    ) -> Result<(Option<Partition>, Fence), PartitionStoreError> {
        let fail = |e| gpu_error("reading", p, THROUGH_THE_KERNELS, e);
        let span = self.slots.span(slot, p, rows_of(&self.rest, p))?;
        if !self.rest.store.is_initialized(p)? {
            let ready = draw_on_gpu(&mut self.transfer, &self.rest, p, &span, moved)?;
            return Ok((None, ready));
        }
        self.move_staging(p, false, moved)?;
        let [(emb, emb_bytes), (state, state_bytes)] = span.addrs();
        let base = self.io.region_addr(self.staging).map_err(fail)?;
        // SAFETY: as in `write`: the slot's previous partition was copied out first on this
        // stream (or drawn by a launch `run` waited behind), and compute waits for the fence
        // before it uses the slot.
        unsafe {
            let stored = match &self.converter {
                None => self.io.copy(emb, base, emb_bytes).map(|()| emb_bytes),
                Some(c) => c
                    .widen(self.io.stream(), base, emb, emb_bytes / 4)
                    .map(|()| c.bytes(emb_bytes / 4).next_multiple_of(4)),
            }
            .map_err(fail)?;
            self.io
                .copy(state, base + stored as u64, state_bytes)
                .map_err(fail)?;
        }
        moved.stats.reads += 1;
        moved.stats.bytes_read += self.bytes(p);
        Ok((None, Fence::at(self.io.record().map_err(fail)?)))
    }

    fn lend(&mut self, p: u32) -> Result<(Partition, bool), PartitionStoreError> {
        self.rest.lend(p)
    }

    fn read_rows(&mut self, ids: &[u64], out: &mut [f32]) -> Result<(), PartitionStoreError> {
        self.rest.store.read_rows(&self.rest.init, ids, out)
    }

    fn store(&mut self) -> &mut dyn PartitionStore {
        &mut self.rest.store
    }
}
