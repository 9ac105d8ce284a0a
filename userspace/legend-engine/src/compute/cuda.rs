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
//! Which partition sits in which slot is the swap path's ([`crate::swap`]): it tells the engine
//! where a partition arrived ([`ComputeBackend::arrive`], with an event the compute stream
//! waits on) and the engine says when it is done with one ([`ComputeBackend::release`], an event
//! the swap path's copies wait on). The engine keeps the map of partitions to slots that its
//! kernels index rows through.

use std::ops::Range;

use legend_cuda::{
    BatchShape, CudaEvent, CudaSlice, DEFAULT_CHUNK_BYTES, DeviceTable, Gpu, GpuBatchEngine,
    GpuError, RowSpan, SlotMap, Transfer, negative_keys,
};
use legend_dataset::{Buckets, PartitionScheme};
use legend_model::{ChunkModel, Decoder, StepRounding};
use rayon::prelude::*;

use super::{BucketRef, ComputeBackend, PendingRelations, RowSink, Step};
use crate::config::Config;
use crate::error::TrainError;
use crate::footprint::{GpuEstimate, gib};
use crate::relations::Relations;
use crate::swap::gpu::DeviceSlots;
use crate::swap::{Fence, HostRows};

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
    /// `storage.dtype`: the step rounds updated node rows to it.
    node_dtype: legend_model::Dtype,
    degree_fraction: f64,
    edges: DeviceEdges,
    /// Downloads of resident rows ([`ComputeBackend::stream_partition`]).
    downloads: Transfer,
    /// Several workers: steps leave the relation gradients for their sum over the GPUs.
    defer_relations: bool,
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

impl CudaCompute {
    /// A GPU engine on `gpu` for `config`, with [`Config::slots`] slots, the relations uploaded
    /// and the edges of `buckets` checked (and uploaded when they stay resident).
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
        let slots = config.slots();
        let slotted = slots < scheme.num_partitions;
        let table_rows = if slotted {
            slots as usize * scheme.rows_per_partition as usize
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
        let downloads = Transfer::new(&gpu, DEFAULT_CHUNK_BYTES)?;
        let mut compute = CudaCompute {
            gpu,
            engine,
            nodes,
            rels,
            scheme,
            slotted,
            slot_of: vec![SlotMap::ABSENT; scheme.num_partitions as usize],
            node_dtype: config.storage.dtype,
            degree_fraction: t.negatives.degree_fraction,
            edges,
            downloads,
            defer_relations: false,
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

    /// The engine's slots as the swap path's movers reach them: slot `s` holds rows
    /// `s · rows_per_partition ..` of the node table (with every partition resident, slot p is
    /// partition p's rows, the last one shorter).
    pub(crate) fn device_slots(&self) -> Result<DeviceSlots, TrainError> {
        let rpp = self.scheme.rows_per_partition as usize;
        let table = self.nodes.rows();
        let spans = (0..table.div_ceil(rpp))
            .map(|s| self.nodes.row_span(s * rpp, rpp.min(table - s * rpp)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceSlots { spans })
    }

    /// The device.
    pub(crate) fn gpu(&self) -> &Gpu {
        &self.gpu
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

impl ComputeBackend for CudaCompute {
    fn arrive(&mut self, p: u32, slot: u32, ready: &Fence) -> Result<(), TrainError> {
        if let Some(ev) = ready.event() {
            self.gpu.wait_for(ev)?;
        }
        debug_assert!(self.slotted || slot == p, "slot {slot} for partition {p}");
        self.slot_of[p as usize] = slot;
        self.publish_slots()
    }

    fn release(&mut self, p: u32) -> Result<Fence, TrainError> {
        assert_ne!(
            self.slot_of[p as usize],
            SlotMap::ABSENT,
            "releasing partition {p}, not on the GPU"
        );
        self.slot_of[p as usize] = SlotMap::ABSENT;
        self.publish_slots()?;
        Ok(Fence::at(self.gpu.record()?))
    }

    fn settled(&mut self) -> Result<Fence, TrainError> {
        Ok(Fence::at(self.gpu.record()?))
    }

    fn begin_bucket(&mut self, bucket: &BucketRef<'_>) -> Result<(), TrainError> {
        Ok(self.edges.begin(&self.gpu, bucket)?)
    }

    fn train_batch(
        &mut self,
        step: &Step<'_>,
        _host: &mut HostRows,
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
        let keys = negative_keys(step.key, self.engine.chunks());
        let ranges: Vec<_> = step
            .resident
            .iter()
            .map(|&p| self.scheme.range(p))
            .collect();
        self.engine
            .sample_negatives(gpu, &ranges, &keys, self.degree_fraction)?;
        self.engine.set_rounding(Some(StepRounding {
            dtype: self.node_dtype,
            batch: step.key,
        }));
        if self.defer_relations {
            self.engine
                .step_nodes(gpu, &mut self.nodes, self.rels.as_mut())?;
        } else {
            self.engine.step(gpu, &mut self.nodes, self.rels.as_mut())?;
        }
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
            self.downloads
                .download_rows(&self.nodes, row0 + done, emb, state)?;
            f(emb, state)?;
            done += n;
        }
        Ok(true)
    }

    fn device_memory_in_use(&self) -> Option<u64> {
        self.gpu.memory_in_use().ok().map(|b| b as u64)
    }

    fn defer_relations(&mut self, _rels: &Relations) -> Result<(), TrainError> {
        self.defer_relations = true;
        Ok(())
    }

    fn pending_relations(&mut self) -> Result<PendingRelations<'_>, TrainError> {
        let table = self
            .rels
            .as_ref()
            .expect("deferred relations belong to a decoder with relations");
        let (at, floats) = table.gradient_span();
        let after = Fence::at(self.gpu.record()?);
        Ok(PendingRelations::Device { at, floats, after })
    }

    fn apply_relations(&mut self, _rels: &mut Relations, ready: &Fence) -> Result<(), TrainError> {
        let table = self
            .rels
            .as_mut()
            .expect("deferred relations belong to a decoder with relations");
        if let Some(ev) = ready.event() {
            self.gpu.wait_for(ev)?;
        }
        self.engine.apply_relations_everywhere(&self.gpu, table)?;
        Ok(())
    }

    fn slot_span(&self, slot: u32, p: u32) -> Result<Option<RowSpan>, TrainError> {
        let range = self.scheme.range(p);
        let rows = (range.end - range.start) as usize;
        let span = self.nodes.row_span(self.row0(slot), rows)?;
        Ok(Some(span))
    }
}
