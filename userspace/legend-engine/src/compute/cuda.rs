//! The GPU engine's side of training: node rows in a slot-indexed [`DeviceTable`] (one slot
//! per resident partition; with C = N, slot p holds partition p and the table is the whole node
//! table), relations resident on the device, and each batch stepped by legend-cuda's
//! [`GpuBatchEngine`], which draws the CPU engine's negatives exactly.
//!
//! Edges: checked once (every edge of bucket (i, j) has its source in partition i, its
//! destination in j and a known relation), then kept on the device across epochs when they
//! take at most `storage.gpu_edge_fraction` of its memory; otherwise each bucket is uploaded
//! when it is trained, into one of two device buffers in turn, on a copy stream of its own, so
//! that a bucket's upload overlaps the compute of the one before. Each batch is gathered on
//! the device in the bucket's permutation order: the host never shuffles or uploads a batch.
//!
//! Partitions move between the host buffer and their slots through pinned staging on an I/O
//! stream ([`Transfer`]), ordered against the compute stream by events. In a swap, the
//! buffer's I/O thread runs the copies (a [`SwapHook`]): once the compute queued before the
//! swap has run it downloads the evicted slot into the host partition, which it then writes
//! back, and right after reading the loaded partition it uploads it into the same slot; the
//! compute stream waits for that upload (an event) before the after-swap buckets. The overlap
//! buckets, which touch neither partition, run on the compute stream meanwhile.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use legend_cuda::nvme_io::{CudaDeviceMemory, GpuIo, GpuIoJob, GpuIoOptions, RingPlacement};
use legend_cuda::{
    BatchShape, CudaEvent, CudaSlice, DEFAULT_CHUNK_BYTES, DeviceTable, Gpu, GpuBatchEngine,
    GpuError, RowConverter, RowSpan, SlotMap, Transfer, negative_keys,
};
use legend_dataset::{Buckets, PartitionScheme};
use legend_model::{ChunkModel, Decoder, Init, StepRounding};
use rayon::prelude::*;

use super::{BucketRef, ComputeBackend, RowSink, Step};
use crate::buffer::{Partition, PartitionBuffer, StoreError, SwapHook};
use crate::config::Config;
use crate::controllers::SharedController;
use crate::file_store::SharedFileStore;
use crate::memory::{GpuEstimate, gib};
use crate::trainer::{IoDirection, IoKernelSpan, Relations, TrainError};

/// Score-matrix memory the engine may use for one launch group.
const SCORE_BYTES: usize = 1 << 30;
/// Floats of each of embeddings and state [`ComputeBackend::stream_partition`] stages at a
/// time (64 MiB each).
const STREAM_PIECE_FLOATS: usize = 16 << 20;

/// The GPU engine over a device partition buffer.
pub(crate) struct CudaCompute {
    gpu: Gpu,
    engine: GpuBatchEngine,
    nodes: DeviceTable,
    rels: Option<DeviceTable>,
    scheme: PartitionScheme,
    /// Whether the node table is slot-indexed (C < N); otherwise partition p sits in slot p.
    slotted: bool,
    /// The slot of each partition, [`SlotMap::ABSENT`] when it is not on the device.
    slot_of: Vec<u32>,
    /// Free slots (slot-indexed tables only).
    free: Vec<u32>,
    seed: u64,
    /// How never-written rows start (drawn here for [`Partition::fresh`] partitions).
    init: Init,
    degree_fraction: f64,
    edges: DeviceEdges,
    /// The I/O stream of the slot copies, shared with the swap hooks.
    copies: Arc<Mutex<SlotCopies>>,
    /// The slot the partition of the swap in flight will take.
    incoming: Option<u32>,
    /// Swaps through the GPU I/O kernels (`nvme` and `proxy` backends), once enabled.
    direct: Option<Arc<Mutex<DirectIo>>>,
}

/// The GPU I/O kernels' side of direct swaps: their queues and a staging region the
/// controller can reach, holding a partition as the store lays it out ([embeddings | state],
/// padded to the LBA size), and the store that says where partitions are.
struct DirectIo {
    io: GpuIo,
    staging: usize,
    store: SharedFileStore,
    /// 16-bit node rows: the conversion between a slot's f32 embeddings and the store's.
    converter: Option<RowConverter>,
    /// Launches not yet taken into a swap's report: when each began, and its span with
    /// `start_s` still unset.
    launches: Vec<(Instant, IoKernelSpan)>,
}

impl DirectIo {
    /// Queues the copy of a slot's embeddings (`bytes` of f32 at `emb`) into the staging
    /// region at `base`, narrowed to the store's format; returns the bytes they take there
    /// (padded to 4, as the store lays a partition out: the state follows).
    ///
    /// # Safety
    /// As for [`GpuIo::copy`].
    unsafe fn embeddings_to_staging(
        &self,
        base: u64,
        emb: u64,
        bytes: usize,
    ) -> Result<usize, GpuError> {
        // SAFETY: the caller's contract.
        unsafe {
            match &self.converter {
                None => self.io.copy(base, emb, bytes).map(|()| bytes),
                Some(c) => c
                    .narrow(self.io.stream(), emb, base, bytes / 4)
                    .map(|()| c.bytes(bytes / 4).next_multiple_of(4)),
            }
        }
    }

    /// The inverse of [`DirectIo::embeddings_to_staging`]: the staging region's embeddings
    /// at `base`, widened into a slot's `bytes` of f32 at `emb`.
    ///
    /// # Safety
    /// As for [`GpuIo::copy`].
    unsafe fn embeddings_from_staging(
        &self,
        emb: u64,
        base: u64,
        bytes: usize,
    ) -> Result<usize, GpuError> {
        // SAFETY: the caller's contract.
        unsafe {
            match &self.converter {
                None => self.io.copy(emb, base, bytes).map(|()| bytes),
                Some(c) => c
                    .widen(self.io.stream(), base, emb, bytes / 4)
                    .map(|()| c.bytes(bytes / 4).next_multiple_of(4)),
            }
        }
    }

    /// Moves partition `p` between the staging region and its extent of the store (`at`,
    /// `len` bytes) with one launch of the I/O kernels, and logs the launch.
    fn move_staging(&mut self, p: u32, at: u64, len: u64, write: bool) -> Result<(), GpuError> {
        let job = GpuIoJob {
            region: self.staging,
            offset: 0,
            bytes: len,
            at,
            write,
        };
        let started = Instant::now();
        let run = self.io.run(&[job], false)?;
        self.launches.push((
            started,
            IoKernelSpan {
                op: if write {
                    IoDirection::Write
                } else {
                    IoDirection::Read
                },
                partition: p,
                start_s: 0.0,
                seconds: run.seconds,
                commands: run.commands,
                bytes: run.bytes,
            },
        ));
        Ok(())
    }
}

/// The train edges on the device.
enum DeviceEdges {
    /// All of them, bucket after bucket (three ids an edge), uploaded once; the first edge of
    /// each bucket.
    Resident {
        all: CudaSlice<u32>,
        offsets: Vec<u64>,
        /// Range (in ids) of the current bucket.
        current: Range<usize>,
    },
    /// Two buffers of the largest bucket, filled in turn, one bucket at a time.
    PerBucket {
        buffers: [CudaSlice<u32>; 2],
        /// Completes when the compute that reads each buffer has run.
        released: [Option<CudaEvent>; 2],
        /// The buffer of the current bucket and its length in ids.
        current: (usize, usize),
        transfer: Transfer,
    },
}

/// The copy stream of the partition slots. `closed` is set when the engine drops: a swap hook
/// that runs later must not touch the device table any more.
struct SlotCopies {
    transfer: Transfer,
    closed: bool,
    /// Completes when the upload of the swap in flight has run (set by the hook).
    uploaded: Option<CudaEvent>,
}

impl CudaCompute {
    /// A GPU engine on `gpu` for `config`, with `capacity` slots, the relations uploaded and
    /// the edges of `buckets` checked (and uploaded when they stay resident).
    pub(crate) fn new(
        gpu: Gpu,
        config: &Config,
        buckets: &Buckets,
        degrees: &[u32],
        relations: &Relations,
    ) -> Result<CudaCompute, TrainError> {
        let scheme = buckets.scheme();
        let t = &config.training;
        let dim = config.model.dim;
        let model = ChunkModel {
            decoder: config.decoder(),
            loss: config.loss(),
            dim,
        };
        let optimizer = config.adagrad();
        let (chunks, k) = (t.negatives.num_chunks, t.negatives.negatives_per_positive);
        // Whole batches per launch where the score matrices fit, else fewer chunks. TransE L2
        // keeps its inverse distances next to the scores (legend-cuda's `BatchShape::group`).
        let rows = t.batch_size.div_ceil(chunks.max(1));
        let bytes = if model.decoder == Decoder::TransEL2 {
            8
        } else {
            4
        };
        let mut group = 2 * chunks;
        while group > 2 && group * rows * k * bytes > SCORE_BYTES {
            group -= 2;
        }
        let shape = BatchShape {
            max_batch: t.batch_size,
            num_chunks: chunks,
            negatives: k,
            group,
        };
        // Relation rows are the decoder's width (RESCAL: dim², a matrix).
        let rw = model.relation_width();
        let num_relations = relations.emb.len().checked_div(rw).unwrap_or(0);
        // With reciprocal relations the table's second half holds the inverses, which no
        // edge names.
        let reciprocal = config.model.reciprocal_relations;
        let edge_relations = if reciprocal {
            num_relations / 2
        } else {
            num_relations
        };
        check_edges(
            buckets,
            model.decoder.uses_relations().then_some(edge_relations),
        )?;
        // Refused before anything is allocated, with what to change, rather than failing on
        // whichever allocation runs out.
        let total = gpu.total_memory()? as u64;
        let free = total.saturating_sub(gpu.memory_in_use()? as u64);
        let relation_rows = if model.decoder.uses_relations() {
            num_relations as u64
        } else {
            0
        };
        let estimate = GpuEstimate::of(config, scheme, &buckets.counts(), relation_rows, total);
        tracing::info!(
            "GPU memory: about {:.1} GiB needed ({:.1} GiB of node rows, {:.1} GiB of edges{}), \
             {:.1} GiB free",
            gib(estimate.total()),
            gib(estimate.nodes),
            gib(estimate.edges),
            if estimate.edges_resident {
                ", resident"
            } else {
                ", a bucket at a time"
            },
            gib(free)
        );
        estimate
            .check(config, gpu.name(), free)
            .map_err(TrainError::GpuMemory)?;
        let mut engine =
            GpuBatchEngine::new(&gpu, model, optimizer, shape, degrees, num_relations)?;
        engine.set_loss_accumulation(true);
        engine.set_reciprocal_relations(reciprocal)?;
        engine.set_regularizer(Some(config.regularizer()));
        if t.negatives.filtered {
            engine.set_known_edges(&gpu, buckets.edges())?;
        }
        let capacity = config.capacity();
        let slotted = capacity < scheme.num_partitions;
        let table_rows = if slotted {
            capacity as usize * scheme.rows_per_partition as usize
        } else {
            scheme.entities as usize
        };
        let nodes = DeviceTable::zeros(&gpu, table_rows, dim, config.optimizer.state)?;
        let rels = if model.decoder.uses_relations() {
            Some(DeviceTable::from_host(
                &gpu,
                rw,
                &relations.emb,
                &relations.state,
            )?)
        } else {
            None
        };
        let edges = DeviceEdges::new(&gpu, buckets, config.storage.gpu_edge_fraction)?;
        let copies = SlotCopies {
            transfer: Transfer::new(&gpu, DEFAULT_CHUNK_BYTES)?,
            closed: false,
            uploaded: None,
        };
        let mut compute = CudaCompute {
            gpu,
            engine,
            nodes,
            rels,
            scheme,
            slotted,
            slot_of: vec![SlotMap::ABSENT; scheme.num_partitions as usize],
            free: if slotted {
                (0..capacity).rev().collect()
            } else {
                Vec::new()
            },
            seed: t.seed,
            init: config.init(),
            degree_fraction: t.negatives.degree_fraction,
            edges,
            copies: Arc::new(Mutex::new(copies)),
            incoming: None,
            direct: None,
        };
        compute.publish_slots()?;
        Ok(compute)
    }

    /// Tells the engine where the partitions are (slot-indexed tables only).
    fn publish_slots(&mut self) -> Result<(), TrainError> {
        if self.slotted {
            let map = SlotMap {
                rows_per_partition: self.scheme.rows_per_partition,
                slot_of: self.slot_of.clone(),
            };
            self.engine.set_slots(&self.gpu, Some(map))?;
        }
        Ok(())
    }

    /// First table row of a slot.
    fn row0(&self, slot: u32) -> usize {
        slot as usize * self.scheme.rows_per_partition as usize
    }

    /// The device rows partition `p` has (or will have) in `slot`.
    fn span(&self, slot: u32, p: u32) -> Result<RowSpan, TrainError> {
        let r = self.scheme.range(p);
        Ok(self
            .nodes
            .row_span(self.row0(slot), (r.end - r.start) as usize)?)
    }

    fn copies(&self) -> MutexGuard<'_, SlotCopies> {
        // A hook that panicked leaves nothing half-done that matters here: the swap failed.
        self.copies.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copies the device rows of resident partition `p` into its host copy.
    fn download(&self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError> {
        let row0 = self.row0(self.slot_of[p as usize]);
        let part = host
            .partition_mut(p)
            .expect("a partition on the device is resident in the host buffer");
        self.copies()
            .transfer
            .download_rows(&self.nodes, row0, &mut part.emb, &mut part.state)?;
        part.fresh = false;
        Ok(())
    }
}

impl Drop for CudaCompute {
    fn drop(&mut self) {
        // Waits for a hook that is copying, and stops those still queued on the I/O thread.
        self.copies().closed = true;
    }
}

/// Checks that every edge of bucket (i, j) has its source in partition i, its destination in
/// partition j and (when `relations` is given) a relation below it: the kernels index the
/// tables with the ids unchecked.
fn check_edges(buckets: &Buckets, relations: Option<usize>) -> Result<(), TrainError> {
    let scheme = buckets.scheme();
    let n = scheme.num_partitions;
    let rel_limit = relations.map_or(u64::MAX, |r| r as u64);
    for i in 0..n {
        for j in 0..n {
            let (src, dst) = (scheme.range(i), scheme.range(j));
            let bad = buckets.bucket(i, j).par_iter().find_any(|e| {
                !src.contains(&u64::from(e[0]))
                    || !dst.contains(&u64::from(e[2]))
                    || u64::from(e[1]) >= rel_limit
            });
            if let Some(e) = bad {
                return Err(GpuError::Shape(format!(
                    "train edge {e:?} of bucket ({i}, {j}): ids outside partitions {i} / {j} \
                     ({src:?} / {dst:?}) or relation not below {rel_limit}"
                ))
                .into());
            }
        }
    }
    Ok(())
}

impl DeviceEdges {
    /// All edges on the device when they take at most `fraction` of its memory, else two
    /// buffers for one bucket at a time.
    fn new(gpu: &Gpu, buckets: &Buckets, fraction: f64) -> Result<DeviceEdges, GpuError> {
        let edges = buckets.edges();
        let ids: &[u32] = bytemuck::cast_slice(edges);
        let bytes = std::mem::size_of_val(ids);
        let mut transfer = Transfer::new(gpu, DEFAULT_CHUNK_BYTES)?;
        if GpuEstimate::edges_resident(bytes as u64, fraction, gpu.total_memory()? as u64) {
            let mut all = gpu.zeros(ids.len())?;
            transfer.upload(ids, &mut all)?;
            let mut offsets = vec![0u64];
            offsets.extend(buckets.counts().iter().scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            }));
            return Ok(DeviceEdges::Resident {
                all,
                offsets,
                current: 0..0,
            });
        }
        let largest = buckets.counts().into_iter().max().unwrap_or(0) as usize;
        Ok(DeviceEdges::PerBucket {
            buffers: [gpu.zeros(3 * largest)?, gpu.zeros(3 * largest)?],
            released: [None, None],
            current: (1, 0),
            transfer,
        })
    }

    /// Makes `bucket` the current one (uploading it when the edges are not resident).
    fn begin(&mut self, gpu: &Gpu, bucket: &BucketRef<'_>) -> Result<(), GpuError> {
        match self {
            DeviceEdges::Resident {
                offsets, current, ..
            } => {
                let start = 3 * offsets[bucket.index] as usize;
                *current = start..start + 3 * bucket.edges.len();
            }
            DeviceEdges::PerBucket {
                buffers,
                released,
                current,
                transfer,
            } => {
                // The previous bucket's batches are all queued: its buffer is free once they ran.
                let previous = current.0;
                released[previous] = Some(gpu.record()?);
                let next = 1 - previous;
                if let Some(ev) = &released[next] {
                    transfer.wait(ev)?;
                }
                let ids: &[u32] = bytemuck::cast_slice(bucket.edges);
                transfer.upload_unordered(ids, &mut buffers[next])?;
                *current = (next, ids.len());
            }
        }
        Ok(())
    }
}

/// The copies of one swap, run by the buffer's I/O thread.
struct SwapCopy {
    copies: Arc<Mutex<SlotCopies>>,
    /// Completes when the compute queued before the swap (the last to use the evicted slot)
    /// has run.
    released: CudaEvent,
    /// The evicted partition's rows on the device, and the loaded partition's (the same slot).
    out: RowSpan,
    into: RowSpan,
    /// How a never-written loaded partition is drawn, and its first row's id.
    init: Init,
    first_id: u64,
}

/// The slot copies of a swap's partition `p`, unless the engine has stopped (then nothing may
/// touch its device memory any more).
fn lock_open(copies: &Mutex<SlotCopies>, p: u32) -> Result<MutexGuard<'_, SlotCopies>, StoreError> {
    let c = copies.lock().unwrap_or_else(|e| e.into_inner());
    if c.closed {
        return Err(StoreError::Invalid(format!(
            "partition {p}: the GPU engine stopped before the swap's copies ran"
        )));
    }
    Ok(c)
}

impl SwapCopy {
    fn lock(&self, p: u32) -> Result<MutexGuard<'_, SlotCopies>, StoreError> {
        lock_open(&self.copies, p)
    }
}

fn copy_error(what: &'static str, partition: u32, source: GpuError) -> StoreError {
    StoreError::Gpu {
        what,
        partition,
        path: "on the GPU",
        source,
    }
}

impl SwapHook for SwapCopy {
    fn before_write(&mut self, part: &mut Partition) -> Result<(), StoreError> {
        let mut c = self.lock(part.id)?;
        c.transfer
            .wait(&self.released)
            .map_err(|e| copy_error("downloading", part.id, e))?;
        // SAFETY: the node table lives until the engine drops, which marks the copies closed
        // (checked under this lock) before freeing it; after `released`, nothing on the compute
        // stream touches the evicted slot (its partition is unmapped and the overlap buckets do
        // not use it), and the slot's next upload is queued behind this copy.
        unsafe {
            c.transfer
                .download_span(&self.out, &mut part.emb, &mut part.state)
        }
        .map_err(|e| copy_error("downloading", part.id, e))?;
        part.fresh = false;
        Ok(())
    }

    fn after_read(&mut self, part: &Partition) -> Result<(), StoreError> {
        let mut c = self.lock(part.id)?;
        // SAFETY: as in `before_write`; the slot is free once the download above (earlier on
        // the same stream) has run, and compute waits for `uploaded` before using it.
        unsafe {
            if part.fresh {
                // Never written: drawn in the slot (the host's rows stay untouched until the
                // partition is evicted and downloaded into them).
                c.transfer.init_span(&self.into, self.first_id, &self.init)
            } else {
                c.transfer.upload_span(&part.emb, &part.state, &self.into)
            }
        }
        .map_err(|e| copy_error("uploading", part.id, e))?;
        let ev = c
            .transfer
            .record()
            .map_err(|e| copy_error("uploading", part.id, e))?;
        c.uploaded = Some(ev);
        Ok(())
    }
}

/// A swap through the GPU I/O kernels: the evicted slot's rows go to the store straight from
/// GPU memory, and the loaded partition's rows come straight from the store into the slot; a
/// partition never written is initialised on the host as before and uploaded.
struct DirectSwap {
    direct: Arc<Mutex<DirectIo>>,
    copies: Arc<Mutex<SlotCopies>>,
    released: CudaEvent,
    out: RowSpan,
    into: RowSpan,
}

fn direct_error(what: &'static str, partition: u32, source: GpuError) -> StoreError {
    StoreError::Gpu {
        what,
        partition,
        path: "through the GPU I/O kernels",
        source,
    }
}

impl DirectSwap {
    fn lock(&self) -> MutexGuard<'_, DirectIo> {
        self.direct.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl SwapHook for DirectSwap {
    fn before_write(&mut self, part: &mut Partition) -> Result<(), StoreError> {
        let p = part.id;
        // Held throughout: the engine cannot drop (and free the slots) under the copies.
        let _copies = lock_open(&self.copies, p)?;
        let mut d = self.lock();
        let fail = |e: GpuError| direct_error("writing", p, e);
        let (at, len) = d.store.lock().io_extent(p, true)?;
        let [(emb, emb_bytes), (state, state_bytes)] = self.out.addrs();
        let base = d.io.region_addr(d.staging).map_err(fail)?;
        d.io.wait(&self.released).map_err(fail)?;
        // SAFETY: after `released` nothing on the compute stream touches the evicted slot; the
        // staging region is this engine's and its I/O stream runs one swap at a time.
        unsafe {
            let stored_emb = d
                .embeddings_to_staging(base, emb, emb_bytes)
                .map_err(fail)?;
            d.io.copy(base + stored_emb as u64, state, state_bytes)
                .map_err(fail)?;
        }
        d.move_staging(p, at, len, true).map_err(fail)?;
        d.store.lock().mark_written(p)
    }

    fn after_read(&mut self, part: &Partition) -> Result<(), StoreError> {
        let p = part.id;
        let mut c = lock_open(&self.copies, p)?;
        let mut d = self.lock();
        let fail = |e: GpuError| direct_error("reading", p, e);
        if !d.store.lock().is_initialized(p)? {
            // Initialised on the host by the buffer: uploaded as the host path does.
            // SAFETY: the evicted rows left the slot (the I/O stream's copies ran before its
            // kernels, which `run` waited for), and compute waits for `uploaded`.
            unsafe { c.transfer.upload_span(&part.emb, &part.state, &self.into) }
                .map_err(|e| copy_error("uploading", p, e))?;
            c.uploaded = Some(
                c.transfer
                    .record()
                    .map_err(|e| copy_error("uploading", p, e))?,
            );
            return Ok(());
        }
        let (at, len) = d.store.lock().io_extent(p, false)?;
        d.move_staging(p, at, len, false).map_err(fail)?;
        let [(emb, emb_bytes), (state, state_bytes)] = self.into.addrs();
        let base = d.io.region_addr(d.staging).map_err(fail)?;
        // SAFETY: the slot is free (its evicted rows were copied out first on this stream) and
        // compute waits for `uploaded` before it reads the slot.
        unsafe {
            let stored_emb = d
                .embeddings_from_staging(emb, base, emb_bytes)
                .map_err(fail)?;
            d.io.copy(state, base + stored_emb as u64, state_bytes)
                .map_err(fail)?;
        }
        c.uploaded = Some(d.io.record().map_err(fail)?);
        Ok(())
    }
}

impl ComputeBackend for CudaCompute {
    fn loaded(&mut self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError> {
        if self.slot_of[p as usize] != SlotMap::ABSENT {
            return Ok(());
        }
        let slot = if self.slotted {
            self.free
                .pop()
                .expect("a free slot for every resident partition")
        } else {
            p
        };
        let part = host.partition(p).expect("a loaded partition is resident");
        let row0 = self.row0(slot);
        let mut copies = self.copies.lock().unwrap_or_else(|e| e.into_inner());
        if part.fresh {
            let rows = self.scheme.range(p);
            copies.transfer.init_rows(
                &mut self.nodes,
                row0,
                rows.start,
                (rows.end - rows.start) as usize,
                &self.init,
            )?;
        } else {
            copies
                .transfer
                .upload_rows(&mut self.nodes, row0, &part.emb, &part.state)?;
        }
        drop(copies);
        if !self.slotted {
            // Every partition stays here for the whole run, so the host copy is stale from the
            // first step: its memory goes back (a whole table, resuming a run in GPU memory);
            // a download refills it where one is needed.
            let part = host
                .partition_mut(p)
                .expect("a loaded partition is resident");
            part.emb = vec![0.0; part.emb.len()];
            part.state = vec![0.0; part.state.len()];
        }
        self.slot_of[p as usize] = slot;
        self.publish_slots()
    }

    fn evicting(&mut self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError> {
        let slot = self.slot_of[p as usize];
        if slot == SlotMap::ABSENT {
            return Ok(());
        }
        self.download(host, p)?;
        self.slot_of[p as usize] = SlotMap::ABSENT;
        if self.slotted {
            self.free.push(slot);
        }
        self.publish_slots()
    }

    fn begin_swap(
        &mut self,
        _host: &mut PartitionBuffer,
        evicted: u32,
        loaded: u32,
    ) -> Result<Option<Box<dyn SwapHook>>, TrainError> {
        let slot = self.slot_of[evicted as usize];
        assert_ne!(
            slot,
            SlotMap::ABSENT,
            "swapping out partition {evicted}, not on the GPU"
        );
        self.slot_of[evicted as usize] = SlotMap::ABSENT;
        self.publish_slots()?;
        let released = self.gpu.record()?;
        let (out, into) = (self.span(slot, evicted)?, self.span(slot, loaded)?);
        self.incoming = Some(slot);
        if let Some(direct) = &self.direct {
            // The buffer's read of `loaded` moves nothing: the hook reads it into the slot.
            direct
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .store
                .lock()
                .claim_read(loaded);
            return Ok(Some(Box::new(DirectSwap {
                direct: direct.clone(),
                copies: self.copies.clone(),
                released,
                out,
                into,
            })));
        }
        Ok(Some(Box::new(SwapCopy {
            copies: self.copies.clone(),
            released,
            out,
            into,
            init: self.init,
            first_id: self.scheme.range(loaded).start,
        })))
    }

    fn finish_swap(&mut self, _host: &PartitionBuffer, loaded: u32) -> Result<(), TrainError> {
        let slot = self.incoming.take().expect("a swap in flight");
        let uploaded = self
            .copies()
            .uploaded
            .take()
            .expect("the swap's hook uploaded the loaded partition");
        self.gpu.wait_for(&uploaded)?;
        self.slot_of[loaded as usize] = slot;
        self.publish_slots()
    }

    fn begin_bucket(&mut self, bucket: &BucketRef<'_>) -> Result<(), TrainError> {
        Ok(self.edges.begin(&self.gpu, bucket)?)
    }

    fn train_batch(
        &mut self,
        step: &Step<'_>,
        _host: &mut PartitionBuffer,
        _rels: &mut Relations,
    ) -> Result<(), TrainError> {
        let gpu = &self.gpu;
        let view = match &self.edges {
            DeviceEdges::Resident { all, current, .. } => all.slice(current.clone()),
            DeviceEdges::PerBucket {
                buffers, current, ..
            } => buffers[current.0].slice(..current.1),
        };
        let [src, dst] = step.bucket.parts;
        // SAFETY: `check_edges` checked every edge of the bucket at construction: sources in
        // partition `src`, destinations in `dst`, relations known.
        unsafe {
            self.engine.set_batch_from_device(
                gpu,
                &view,
                &step.bucket.order,
                step.first,
                step.len,
                self.scheme.range(src),
                self.scheme.range(dst),
            )
        }?;
        let keys = negative_keys(self.seed, step.epoch, step.batch_no, self.engine.chunks());
        let ranges: Vec<_> = step
            .resident
            .iter()
            .map(|&p| self.scheme.range(p))
            .collect();
        self.engine
            .sample_negatives(gpu, &ranges, &keys, self.degree_fraction)?;
        self.engine.set_rounding(Some(StepRounding {
            dtype: self.init.node_dtype,
            seed: self.seed,
            epoch: step.epoch,
            batch: step.batch_no,
        }));
        self.engine.step(gpu, &mut self.nodes, self.rels.as_mut())?;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), TrainError> {
        Ok(self.gpu.synchronize()?)
    }

    fn take_loss(&mut self) -> Result<f64, TrainError> {
        Ok(self.engine.take_loss(&self.gpu)?)
    }

    fn set_learning_rate(&mut self, lr: f32) {
        self.engine.set_learning_rate(lr);
    }

    fn sync_host(
        &mut self,
        host: &mut PartitionBuffer,
        rels: &mut Relations,
    ) -> Result<(), TrainError> {
        for p in 0..self.scheme.num_partitions {
            if self.holds(p) {
                self.download(host, p)?;
            }
        }
        self.sync_relations(rels)
    }

    fn use_direct_io(
        &mut self,
        store: &SharedFileStore,
        controller: &SharedController,
    ) -> Result<bool, TrainError> {
        let placement = match controller {
            SharedController::Proxy(p) => {
                // The proxy moves the kernels' data with this GPU's copy engine.
                p.attach_device(Arc::new(CudaDeviceMemory::new(&self.gpu)?))
                    .map_err(|e| StoreError::Controller {
                        what: "attaching the GPU to the proxy controller".into(),
                        source: Box::new(e),
                    })?;
                RingPlacement::Host
            }
            SharedController::Device(_) => RingPlacement::Device,
        };
        let opts = GpuIoOptions {
            placement,
            ..GpuIoOptions::default()
        };
        let mut io = GpuIo::open(&self.gpu, controller.controller(), &opts)?;
        let staging = io.alloc(&self.gpu, store.lock().max_partition_bytes())?;
        tracing::info!(
            "partition swaps through the GPU I/O kernels: {} queue pairs of depth {} on {}",
            opts.queues,
            io.depth(),
            match placement {
                RingPlacement::Host => "pinned host memory (the proxy controller)",
                RingPlacement::Device => "GPU memory",
            }
        );
        self.direct = Some(Arc::new(Mutex::new(DirectIo {
            io,
            staging,
            store: store.clone(),
            converter: RowConverter::new(&self.gpu, self.init.node_dtype),
            launches: Vec::new(),
        })));
        Ok(true)
    }

    fn holds(&self, p: u32) -> bool {
        self.slot_of[p as usize] != SlotMap::ABSENT
    }

    fn sync_relations(&mut self, rels: &mut Relations) -> Result<(), TrainError> {
        if let Some(table) = &self.rels {
            table.read_rows(&self.gpu, 0, &mut rels.emb, &mut rels.state)?;
        }
        Ok(())
    }

    fn stream_partition(&mut self, p: u32, f: &mut RowSink<'_>) -> Result<bool, TrainError> {
        let slot = self.slot_of[p as usize];
        if slot == SlotMap::ABSENT {
            return Ok(false);
        }
        let (dim, width) = (self.nodes.dim(), self.nodes.state_width());
        let row0 = self.row0(slot);
        let range = self.scheme.range(p);
        let rows = (range.end - range.start) as usize;
        let piece_rows = (STREAM_PIECE_FLOATS / dim).max(1);
        let mut emb = vec![0.0; piece_rows.min(rows) * dim];
        let mut state = vec![0.0; piece_rows.min(rows) * width];
        let mut done = 0;
        while done < rows {
            let n = piece_rows.min(rows - done);
            let (emb, state) = (&mut emb[..n * dim], &mut state[..n * width]);
            self.copies()
                .transfer
                .download_rows(&self.nodes, row0 + done, emb, state)?;
            f(emb, state)?;
            done += n;
        }
        Ok(true)
    }

    fn device_memory_in_use(&self) -> Option<u64> {
        self.gpu.memory_in_use().ok().map(|b| b as u64)
    }

    fn take_io_kernels(&mut self, epoch_start: Instant) -> Vec<IoKernelSpan> {
        let Some(direct) = &self.direct else {
            return Vec::new();
        };
        let mut d = direct.lock().unwrap_or_else(|e| e.into_inner());
        d.launches
            .drain(..)
            .map(|(started, mut span)| {
                span.start_s = started.saturating_duration_since(epoch_start).as_secs_f64();
                span
            })
            .collect()
    }
}
