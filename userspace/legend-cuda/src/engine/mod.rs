//! One synchronous training step on device-resident tables.
//!
//! The step follows legend-model's CPU math exactly (`ChunkWorkspace::forward_backward` per
//! chunk, gradients of repeated rows summed, one `AdaGrad::apply_row` per touched row), with
//! the products on the tensor cores (TransE L1, and L2 past d = 126: distances in FP32 on the
//! CUDA cores):
//!
//! 1. negatives: `2 · chunks` lists of `k` ids drawn on the GPU from counter-based streams
//!    (draw for draw the CPU sampler's), or given by the caller;
//! 2. per group of jobs (a job is one side of one chunk): queries and positive scores,
//!    gathered negatives, `S = Q·Nᵀ`, the loss turning `S` into `∂L/∂S` in place,
//!    `dQ = G·N`, `dN = Gᵀ·Q`, and the backward through the query operator, all added into
//!    a gradient table with atomics while each touched row is listed once (TransE:
//!    `S = −‖Q_i − N_j‖` and the gradients through the distances, `kernels/distance.cu`);
//! 3. AdaGrad over the listed rows, in place, which also clears their gradients and marks.
//!
//! All work is queued on the [`Gpu`]'s stream; nothing waits for the device until
//! [`GpuBatchEngine::loss`] reads the loss back.
//!
//! Laid out by concern: `args` holds the kernels' argument structs, `table` the device tables
//! and their initialisation, `unfused` the three products as separate kernels (TF32 or
//! distances), `fused` the kernels that keep the score matrices on chip, `known` the table of
//! known edges of filtered negatives; this file the engine itself: batch set-up, negatives, the
//! passes over job groups, and AdaGrad. `Path` is the way an engine's products run, each
//! way owning the buffers only it uses (`FusedBuffers`, `UnfusedBuffers`).

use std::ops::Range;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use legend_model::{
    AdaGrad, BatchKey, ChunkModel, Decoder, Dtype, Loss, Penalty, Permutation, Regularizer,
    StepRounding,
};

use crate::error::DriverContext;
use crate::gpu::grid_1d;
use crate::{Gpu, GpuError};

mod args;
mod fused;
mod known;
mod table;
mod unfused;

pub use known::known_edges_bytes;
pub(crate) use table::init_params;
pub use table::{DeviceTable, init_rows, rng_vectors};

use args::{DirectArgs, JobArgs, RoundingArgs};
use fused::FusedBuffers;
use known::KnownEdges;
use unfused::UnfusedBuffers;

/// The keys of the negative lists of one batch as the CPU trainer forms them: list
/// `2c + side` uses `batch.negatives(c, side)` (side 0 replaces sources).
pub fn negative_keys(batch: BatchKey, chunks: usize) -> Vec<u64> {
    (0..2 * chunks as u64)
        .map(|l| batch.negatives(l / 2, l % 2))
        .collect()
}

/// Where the node rows live when the node table is a partition buffer on the GPU: partition
/// `p` (ids `p · rows_per_partition ..`, the scheme of legend-dataset's `PartitionScheme`)
/// sits in slot `slot_of[p]` ([`SlotMap::ABSENT`] when not resident), and entity `id` is
/// row `slot · rows_per_partition + id mod rows_per_partition` of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMap {
    /// Rows of every partition (the last may use fewer).
    pub rows_per_partition: u64,
    /// The slot of each partition.
    pub slot_of: Vec<u32>,
}

impl SlotMap {
    /// The slot of a partition that is not resident.
    pub const ABSENT: u32 = u32::MAX;

    /// The table row of global entity `id`, if its partition is resident.
    pub fn row(&self, id: u64) -> Option<u64> {
        let p = usize::try_from(id / self.rows_per_partition).ok()?;
        match self.slot_of.get(p) {
            Some(&s) if s != Self::ABSENT => {
                Some(u64::from(s) * self.rows_per_partition + id % self.rows_per_partition)
            }
            _ => None,
        }
    }

    /// Rows a table needs to hold every slot.
    pub fn table_rows(&self) -> u64 {
        let slots = self
            .slot_of
            .iter()
            .filter(|&&s| s != Self::ABSENT)
            .map(|&s| u64::from(s) + 1)
            .max();
        slots.unwrap_or(0) * self.rows_per_partition
    }
}

/// The shapes an engine is sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchShape {
    /// The most positives in one batch.
    pub max_batch: usize,
    /// Chunks per batch (a smaller batch uses `min(num_chunks, len)`).
    pub num_chunks: usize,
    /// Negatives per positive and side, shared by a chunk.
    pub negatives: usize,
    /// Jobs (chunk sides) per launch, rounded up to whole chunks (an even number): more
    /// fills the GPU better, fewer needs less memory (the score buffer holds
    /// `group × ⌈max_batch / num_chunks⌉ × negatives` floats, and TransE L2 as many
    /// inverse distances; the fused kernels' G as many FP16 values instead). On an H100, a whole batch (`2 · num_chunks`) was fastest for 10
    /// chunks of 10⁴ rows.
    pub group: usize,
}

/// One training step at a time over device tables (see the module docs).
pub struct GpuBatchEngine {
    model: ChunkModel,
    optimizer: AdaGrad,
    shape: BatchShape,
    max_rows: usize,
    entities: usize,
    relations: usize,
    /// Reciprocal relations: the first inverse row (relation `r`'s inverse is row
    /// `inverse + r`; the edges' relations are below it). `None` without them.
    inverse: Option<usize>,
    /// The regulariser of the rows of the positives (`None`: none).
    regularizer: Option<Regularizer>,
    degree_prefix_host: Vec<u64>,
    degree_prefix: CudaSlice<u64>,
    keys: CudaSlice<u64>,
    part_start: CudaSlice<u64>,
    part_rows: CudaSlice<u64>,
    edges: CudaSlice<u32>,
    row0: CudaSlice<u32>,
    rows: CudaSlice<u32>,
    batch_len: usize,
    chunks: usize,
    negs: CudaSlice<u32>,
    query: CudaSlice<f32>,
    pos: CudaSlice<f32>,
    grad_pos: CudaSlice<f32>,
    grad_query: CudaSlice<f32>,
    grad_negs: CudaSlice<f32>,
    /// How the products run, with the buffers that way alone uses.
    path: Path,
    loss_sum: CudaSlice<f64>,
    /// Whether the loss sum runs on over steps (see `set_loss_accumulation`).
    accumulate_loss: bool,
    /// Stand-ins for the relation table of Dot, which the kernels never dereference.
    no_rel: CudaSlice<f32>,
    no_rel_u32: CudaSlice<u32>,
    /// Where node rows live, when the node table is slot-indexed, with its device copy.
    slots: Option<(SlotMap, CudaSlice<u32>)>,
    /// The partition in each slot (for the rounding's global row ids), with `slots`.
    partition_of_slot: Option<CudaSlice<u32>>,
    /// Node rows stored in 16 bits: the rounding of the next step's updates (see
    /// [`GpuBatchEngine::set_rounding`]).
    rounding: Option<StepRounding>,
    /// The smallest `row << 32 | element` that left the format's range (u64::MAX: none).
    out_of_range: CudaSlice<u64>,
    /// Filtered negatives: the known edges (see [`GpuBatchEngine::set_known_edges`]).
    known: Option<KnownEdges>,
    /// When profiling: events recorded after each phase, with the phase's name.
    marks: Option<Vec<(&'static str, CudaEvent)>>,
    /// Every relation row's id (`0 .. rows`) and the row count, copied into the relation
    /// table's row list when its gradients, summed over several GPUs, step every row.
    all_relation_rows: Option<(CudaSlice<u32>, CudaSlice<u32>)>,
}

/// The way a step's three products (scores, dQ, dN) run.
enum Path {
    /// The fused kernels (dot comparator, d ≤ 128; TransE L2, d ≤ 126): the score matrices
    /// stay on chip.
    Fused(Box<FusedBuffers>),
    /// Separate product kernels (wider rows, TransE L1, filtered negatives): the score matrices
    /// go through device memory.
    Unfused(UnfusedBuffers),
}

/// The kernels' names of the decoders; a decoder's number is its index. The one definition:
/// every program is compiled with `-D<name>=<index>` ([`code_defines`]). RotatE and RESCAL
/// have queries and rows-backward kernels of their own (`kernels/rotate.cu`,
/// `kernels/rescal.cu`); the shared ones never see their numbers.
const DECODER_CODES: [(Decoder, &str); 7] = [
    (Decoder::Dot, "LEGEND_DOT"),
    (Decoder::DistMult, "LEGEND_DISTMULT"),
    (Decoder::ComplEx, "LEGEND_COMPLEX"),
    (Decoder::TransEL1, "LEGEND_TRANSE_L1"),
    (Decoder::TransEL2, "LEGEND_TRANSE_L2"),
    (Decoder::RotatE, "LEGEND_ROTATE"),
    (Decoder::Rescal, "LEGEND_RESCAL"),
];

/// The kernels' names of the losses, numbered by index as [`DECODER_CODES`].
const LOSS_CODES: [&str; 4] = [
    "LEGEND_LOSS_SOFTMAX",
    "LEGEND_LOSS_LOGISTIC",
    "LEGEND_LOSS_RANKING",
    "LEGEND_LOSS_SELF_ADVERSARIAL",
];

/// The kernels' names of the regularisers, numbered by index as [`DECODER_CODES`].
const PENALTY_CODES: [(Penalty, &str); 3] = [
    (Penalty::None, "LEGEND_PENALTY_NONE"),
    (Penalty::N3, "LEGEND_PENALTY_N3"),
    (Penalty::L2, "LEGEND_PENALTY_L2"),
];

/// The `-D` options that define the decoder, loss and regulariser numbers in the kernels.
pub(crate) fn code_defines() -> Vec<String> {
    let decoders = DECODER_CODES.iter().map(|(_, name)| *name).enumerate();
    let losses = LOSS_CODES.iter().copied().enumerate();
    let penalties = PENALTY_CODES.iter().map(|(_, name)| *name).enumerate();
    decoders
        .chain(losses)
        .chain(penalties)
        .map(|(code, name)| format!("-D{name}={code}"))
        .collect()
}

/// A node-row format's number in the kernels (`LEGEND_DTYPE_*` in `kernels/common.cuh`).
pub(crate) fn dtype_code(d: Dtype) -> u32 {
    Dtype::ALL
        .iter()
        .position(|&x| x == d)
        .expect("every dtype is listed") as u32
}

/// The regulariser's number in the kernels and its weight (none when inactive).
fn penalty_code(r: Option<Regularizer>) -> (i32, f32) {
    match r {
        Some(r) if r.is_active() => (
            PENALTY_CODES
                .iter()
                .position(|(p, _)| *p == r.penalty)
                .expect("every penalty has a code") as i32,
            r.weight,
        ),
        _ => (0, 0.0),
    }
}

/// The decoder's number in the kernels.
fn decoder_code(d: Decoder) -> i32 {
    DECODER_CODES
        .iter()
        .position(|(x, _)| *x == d)
        .expect("every decoder has a code") as i32
}

/// The loss's number in the kernels (an index of [`LOSS_CODES`]), its margin (the ranking
/// loss's, the self-adversarial loss's γ) and its temperature (the self-adversarial α).
fn loss_code(l: Loss) -> (i32, f32, f32) {
    match l {
        Loss::SoftmaxCe => (0, 0.0, 0.0),
        Loss::Logistic => (1, 0.0, 0.0),
        Loss::Ranking { margin } => (2, margin, 0.0),
        Loss::SelfAdversarial {
            margin,
            temperature,
        } => (3, margin, temperature),
    }
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

impl GpuBatchEngine {
    /// An engine for `model` trained with `optimizer` over `degrees.len()` entities and
    /// `relations` relations; `degrees` drive the degree-based negatives.
    pub fn new(
        gpu: &Gpu,
        model: ChunkModel,
        optimizer: AdaGrad,
        shape: BatchShape,
        degrees: &[u32],
        relations: usize,
    ) -> Result<Self, GpuError> {
        model
            .decoder
            .check_dim(model.dim)
            .map_err(GpuError::Shape)?;
        if shape.max_batch == 0 || shape.num_chunks == 0 || shape.negatives == 0 || shape.group == 0
        {
            return Err(GpuError::Shape(format!(
                "every size of {shape:?} must be at least 1"
            )));
        }
        // Whole chunks per launch: the row backward handles both sides of an edge at once.
        let group = (shape.group + shape.group % 2).min(2 * shape.num_chunks);
        let shape = BatchShape { group, ..shape };
        let max_rows = shape.max_batch.div_ceil(shape.num_chunks);
        let (d, k) = (model.dim, shape.negatives);
        let lists = 2 * shape.num_chunks;
        // The narrowest fused kernels that take the rows (see fused_fits), else unfused. The
        // self-adversarial loss runs on the unfused path alone (legend_loss; the fused
        // kernels' losses do not weigh negatives by their scores).
        let self_adversarial = matches!(model.loss, Loss::SelfAdversarial { .. });
        let fused = (gpu.kernels.fused.iter())
            .position(|f| !self_adversarial && fused::fused_fits(model.decoder, d, f));
        let path = match fused {
            Some(which) => Path::Fused(Box::new(FusedBuffers::new(
                gpu,
                which,
                model.decoder,
                group,
                max_rows,
                k,
            )?)),
            None => Path::Unfused(UnfusedBuffers::new(gpu, &model, group, max_rows, k)?),
        };
        let mut prefix = Vec::with_capacity(degrees.len() + 1);
        prefix.push(0u64);
        let mut acc = 0u64;
        for &deg in degrees {
            acc += u64::from(deg);
            prefix.push(acc);
        }
        Ok(GpuBatchEngine {
            model,
            optimizer,
            shape,
            max_rows,
            entities: degrees.len(),
            relations,
            inverse: None,
            regularizer: None,
            degree_prefix: gpu.upload(&prefix)?,
            degree_prefix_host: prefix,
            keys: gpu.zeros(lists)?,
            part_start: gpu.zeros(1)?,
            part_rows: gpu.zeros(1)?,
            edges: gpu.zeros(3 * shape.max_batch)?,
            row0: gpu.zeros(lists)?,
            rows: gpu.zeros(lists)?,
            batch_len: 0,
            chunks: 0,
            negs: gpu.zeros(lists * k)?,
            // Four floats more: the warp-specialised rows kernel copies whole 16-byte pieces.
            query: gpu.zeros(group * max_rows * d + 4)?,
            pos: gpu.zeros(group * max_rows)?,
            grad_pos: gpu.zeros(group * max_rows)?,
            grad_query: gpu.zeros(group * max_rows * d)?,
            grad_negs: gpu.zeros(group * k * d)?,
            path,
            loss_sum: gpu.zeros(1)?,
            accumulate_loss: false,
            no_rel: gpu.zeros(d)?,
            no_rel_u32: gpu.zeros(1)?,
            slots: None,
            partition_of_slot: None,
            rounding: None,
            out_of_range: gpu.upload(&[u64::MAX])?,
            known: None,
            marks: None,
            all_relation_rows: None,
        })
    }

    /// Trains reciprocal relations (or stops): the relation table's second half holds the
    /// inverses (relation `r`'s is row `R/2 + r` of the engine's `R` relation rows, and the
    /// edges' relations lie below `R/2`), and side 0 of every edge (sources replaced) is
    /// scored as `(destination, r⁻¹, ?)` with the destination-side operator, as the CPU
    /// engine's `Chunk::rel_src` does. Both product paths, fused or not, only see the queries.
    pub fn set_reciprocal_relations(&mut self, on: bool) -> Result<(), GpuError> {
        if !on {
            self.inverse = None;
            return Ok(());
        }
        if !self.model.decoder.uses_relations()
            || self.relations == 0
            || !self.relations.is_multiple_of(2)
        {
            return Err(GpuError::Shape(format!(
                "reciprocal relations need a decoder with relations and an even, non-zero \
                 relation count ({}: {} rows)",
                self.model.decoder, self.relations
            )));
        }
        self.inverse = Some(self.relations / 2);
        Ok(())
    }

    /// Regularises the rows of every positive (source, destination, relation and, with
    /// reciprocal relations, the inverse relation's row): the penalty's gradient at the row,
    /// once per occurrence, joins the row's gradient in the rows backward, and so its AdaGrad
    /// step (in place for rows used once, `legend_adagrad` for the others), as the CPU engine
    /// adds it to a row's sum before its step. `None` (or an inactive one) turns it off.
    pub fn set_regularizer(&mut self, regularizer: Option<Regularizer>) {
        self.regularizer = regularizer.filter(Regularizer::is_active);
    }

    /// How many relations the edges may name: the relation rows, or the first half of them
    /// with reciprocal relations.
    fn edge_relations(&self) -> usize {
        self.inverse.unwrap_or(self.relations)
    }

    /// Filters the negatives against `edges` (the training edges, global ids): a negative
    /// that, put in place of its positive's source (or destination), makes one of them drops
    /// out of that positive's loss, as `training.negatives.filtered` does on the CPU. The
    /// step then runs the unfused products, whose score matrices the filter can reach (the
    /// fused kernels keep theirs on chip).
    pub fn set_known_edges(&mut self, gpu: &Gpu, edges: &[[u32; 3]]) -> Result<(), GpuError> {
        let (group, rows, k) = (self.shape.group, self.max_rows, self.shape.negatives);
        let lists = 2 * self.shape.num_chunks;
        self.known = Some(KnownEdges::new(
            gpu,
            edges,
            self.shape.max_batch,
            lists * k,
        )?);
        if let Path::Fused(_) = self.path {
            self.path = Path::Unfused(UnfusedBuffers::new(gpu, &self.model, group, rows, k)?);
        }
        Ok(())
    }

    /// The shapes the engine was made for (its group clamped to the jobs of a batch).
    pub fn shape(&self) -> BatchShape {
        self.shape
    }

    /// Chunks of the current batch: `min(num_chunks, batch length)`.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Makes the node table slot-indexed (`Some`: a partition buffer on the GPU, see
    /// [`SlotMap`]) or indexed by global id (`None`, the default). Batches and negatives
    /// keep using global ids; the engine rewrites them into table rows on the GPU. Call it
    /// again after every swap.
    pub fn set_slots(&mut self, gpu: &Gpu, slots: Option<SlotMap>) -> Result<(), GpuError> {
        self.slots = match slots {
            None => None,
            Some(map) => {
                if map.rows_per_partition == 0 || map.table_rows() > u64::from(u32::MAX) {
                    return Err(GpuError::Shape(format!(
                        "slot map of {} rows a partition and {} rows in all",
                        map.rows_per_partition,
                        map.table_rows()
                    )));
                }
                let dev = gpu.upload(&map.slot_of)?;
                let mut partition_of_slot = vec![0u32; map.slot_of.len()];
                for (p, &slot) in map.slot_of.iter().enumerate() {
                    if slot != SlotMap::ABSENT {
                        partition_of_slot[slot as usize] = p as u32;
                    }
                }
                self.partition_of_slot = Some(gpu.upload(&partition_of_slot)?);
                Some((map, dev))
            }
        };
        if self.slots.is_none() {
            self.partition_of_slot = None;
        }
        Ok(())
    }

    /// Rounds the node rows the next steps update to `rounding`'s format (`None`, or f32: no
    /// rounding), keyed by its epoch and batch: set before every step of a run whose rows are
    /// stored in 16 bits. The in-place steps of rows used once (`step`) and `legend_adagrad`
    /// round alike: the same stream for a row, the same bits.
    pub fn set_rounding(&mut self, rounding: Option<StepRounding>) {
        self.rounding = rounding.filter(|r| r.dtype.is_narrow());
    }

    /// Rewrites the global ids of `ids` (every element whose index mod `step` has its bit
    /// set in `which`) into slot rows, when the table is slot-indexed (`slots`).
    fn remap(
        slots: &Option<(SlotMap, CudaSlice<u32>)>,
        gpu: &Gpu,
        ids: &mut CudaSlice<u32>,
        n: usize,
        step: u32,
        which: u32,
    ) -> Result<(), GpuError> {
        let Some((map, slot_of)) = slots else {
            return Ok(());
        };
        let n64 = n as u64;
        let mut b = gpu.stream().launch_builder(&gpu.kernels.remap);
        b.arg(ids)
            .arg(&n64)
            .arg(&step)
            .arg(&which)
            .arg(slot_of)
            .arg(&map.rows_per_partition);
        // SAFETY: `ids` holds at least n ids, each checked by the caller to lie in a resident
        // partition, whose index is below slot_of's length.
        unsafe { b.launch(grid_1d(n64)?) }.during("launching legend_remap_ids")?;
        Ok(())
    }

    /// Whether global entity `id` can be used: below the entity count, and resident when
    /// the table is slot-indexed.
    fn usable(&self, id: u64) -> bool {
        id < self.entities as u64 && self.slots.as_ref().is_none_or(|(m, _)| m.row(id).is_some())
    }

    /// Why rows of `ranges` (global entity ids) cannot be used, if they cannot: a range is
    /// empty or past the entities, or (slot-indexed table) meets a partition not resident.
    fn unusable_ranges(&self, ranges: &[Range<u64>]) -> Option<String> {
        if ranges
            .iter()
            .any(|p| p.start >= p.end || !self.usable(p.start) || !self.usable(p.end - 1))
        {
            return Some(format!(
                "row ranges {ranges:?} for {} entities (and resident)",
                self.entities
            ));
        }
        let (map, _) = self.slots.as_ref()?;
        let rpp = map.rows_per_partition;
        ranges
            .iter()
            .flat_map(|r| r.start / rpp..=(r.end - 1) / rpp)
            .find(|&q| map.row(q * rpp).is_none())
            .map(|q| format!("partition {q} is not resident"))
    }

    /// Uploads a batch of `(source, relation, destination)` positives and splits it into
    /// chunks as the CPU trainer does (chunk `c` holds rows `c·B/C .. (c+1)·B/C`).
    pub fn set_batch(&mut self, gpu: &Gpu, edges: &[[u32; 3]]) -> Result<(), GpuError> {
        let b = edges.len();
        if b == 0 || b > self.shape.max_batch {
            return Err(GpuError::Shape(format!(
                "batch of {b} edges (at most {})",
                self.shape.max_batch
            )));
        }
        let rel_limit = if self.model.decoder.uses_relations() {
            self.edge_relations()
        } else {
            usize::MAX
        };
        if let Some(e) = edges.iter().find(|e| {
            !self.usable(u64::from(e[0]))
                || !self.usable(u64::from(e[2]))
                || e[1] as usize >= rel_limit
        }) {
            return Err(GpuError::Shape(format!(
                "edge {e:?} outside {} entities / {} relations, or in a partition not resident",
                self.entities,
                self.edge_relations()
            )));
        }
        let flat: Vec<u32> = edges.iter().flatten().copied().collect();
        gpu.write(&flat, &mut self.edges)?;
        self.finish_batch(gpu, b)
    }

    /// Builds the batch on the device: edges `order(first) .. order(first + len − 1)` of
    /// `bucket` (`order.len()` edges in device memory, three ids an edge, legend-model's
    /// [`Permutation`] order), then split into chunks as [`GpuBatchEngine::set_batch`] does.
    /// The host checks the row ranges (known, resident when slot-indexed), not the edges.
    ///
    /// # Safety
    /// Every edge of `bucket` must have its source in `src_rows`, its destination in
    /// `dst_rows` and (for decoders with relations) a relation below the relation count
    /// (half the relation rows with reciprocal relations): the kernels index the tables with
    /// them unchecked.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn set_batch_from_device(
        &mut self,
        gpu: &Gpu,
        bucket: &CudaView<'_, u32>,
        order: &Permutation,
        first: u64,
        len: usize,
        src_rows: Range<u64>,
        dst_rows: Range<u64>,
    ) -> Result<(), GpuError> {
        if len == 0 || len > self.shape.max_batch {
            return Err(GpuError::Shape(format!(
                "batch of {len} edges (at most {})",
                self.shape.max_batch
            )));
        }
        if let Some(why) = self.unusable_ranges(&[src_rows, dst_rows]) {
            return Err(GpuError::Shape(format!("bucket rows: {why}")));
        }
        crate::batch::gather_batch(gpu, bucket, order, first, len as u32, &mut self.edges)?;
        self.finish_batch(gpu, len)
    }

    /// After the `b` edges of a batch are in `edges` (global ids): rewrites them into slot rows
    /// and splits the batch into chunks.
    fn finish_batch(&mut self, gpu: &Gpu, b: usize) -> Result<(), GpuError> {
        if let Some(known) = &mut self.known {
            gpu.stream()
                .memcpy_dtod(
                    &self.edges.slice(..3 * b),
                    &mut known.edges.slice_mut(..3 * b),
                )
                .during("copying the batch's global ids")?;
        }
        Self::remap(&self.slots, gpu, &mut self.edges, 3 * b, 3, 0b101)?;
        let chunks = self.shape.num_chunks.min(b);
        if (b, chunks) != (self.batch_len, self.chunks) {
            let mut row0 = Vec::with_capacity(2 * chunks);
            let mut rows = Vec::with_capacity(2 * chunks);
            for c in 0..chunks {
                let (lo, hi) = (c * b / chunks, (c + 1) * b / chunks);
                for _side in 0..2 {
                    row0.push(lo as u32);
                    rows.push((hi - lo) as u32);
                }
            }
            gpu.write(&row0, &mut self.row0)?;
            gpu.write(&rows, &mut self.rows)?;
            self.batch_len = b;
            self.chunks = chunks;
        }
        Ok(())
    }

    /// Draws the negatives of the current batch on the GPU, as legend-engine's
    /// `NegativeSampler::sample` does on the CPU: list `l` (`2c + side`) from stream
    /// `keys[l]` (see [`negative_keys`]) over the entity-id ranges `partitions`, the first
    /// `round(degree_fraction · k)` draws by degree.
    pub fn sample_negatives(
        &mut self,
        gpu: &Gpu,
        partitions: &[Range<u64>],
        keys: &[u64],
        degree_fraction: f64,
    ) -> Result<(), GpuError> {
        let lists = 2 * self.chunks;
        if keys.len() != lists {
            return Err(GpuError::Shape(format!(
                "{} keys for {lists} negative lists",
                keys.len()
            )));
        }
        if partitions.is_empty() {
            return Err(GpuError::Shape("negatives from no partition".into()));
        }
        if let Some(why) = self.unusable_ranges(partitions) {
            return Err(GpuError::Shape(format!("negatives: {why}")));
        }
        let k = self.shape.negatives;
        let by_degree = (degree_fraction * k as f64).round() as u32;
        let starts: Vec<u64> = partitions.iter().map(|p| p.start).collect();
        let counts: Vec<u64> = partitions.iter().map(|p| p.end - p.start).collect();
        let total_rows: u64 = counts.iter().sum();
        let p = &self.degree_prefix_host;
        let weight: u64 = partitions
            .iter()
            .map(|r| p[r.end as usize] - p[r.start as usize])
            .sum();
        if self.part_start.len() < starts.len() {
            self.part_start = gpu.zeros(starts.len())?;
            self.part_rows = gpu.zeros(starts.len())?;
        }
        gpu.write(&starts, &mut self.part_start)?;
        gpu.write(&counts, &mut self.part_rows)?;
        gpu.write(keys, &mut self.keys)?;
        let (lists32, k32, nparts) = (lists as u32, k as u32, starts.len() as u32);
        let s = gpu.stream();
        let mut b = s.launch_builder(&gpu.kernels.sample);
        b.arg(&self.keys)
            .arg(&lists32)
            .arg(&k32)
            .arg(&by_degree)
            .arg(&self.part_start)
            .arg(&self.part_rows)
            .arg(&nparts)
            .arg(&total_rows)
            .arg(&self.degree_prefix)
            .arg(&weight)
            .arg(&mut self.negs);
        // SAFETY: keys has `lists` entries, the partition arrays `nparts`, the prefix
        // entities + 1 (ranges checked above), and negs lists × k: all the kernel touches.
        unsafe { b.launch(grid_1d((lists * k) as u64)?) }
            .during("launching legend_sample_negatives")?;
        if let Some(known) = &mut self.known {
            gpu.stream()
                .memcpy_dtod(
                    &self.negs.slice(..lists * k),
                    &mut known.negs.slice_mut(..lists * k),
                )
                .during("copying the negatives' global ids")?;
        }
        Self::remap(&self.slots, gpu, &mut self.negs, lists * k, 1, 1)?;
        self.mark(gpu, "sample")?;
        Ok(())
    }

    /// Uses the given negatives (`2 · chunks` lists of `k` entity ids, list `2c` replacing
    /// sources and `2c + 1` destinations) instead of sampling.
    pub fn set_negatives(&mut self, gpu: &Gpu, ids: &[u32]) -> Result<(), GpuError> {
        let want = 2 * self.chunks * self.shape.negatives;
        if ids.len() != want || ids.iter().any(|&i| !self.usable(u64::from(i))) {
            return Err(GpuError::Shape(format!(
                "{} negative ids (need {want} below {}, resident)",
                ids.len(),
                self.entities
            )));
        }
        gpu.write(ids, &mut self.negs)?;
        if let Some(known) = &mut self.known {
            gpu.write(ids, &mut known.negs)?;
        }
        Self::remap(&self.slots, gpu, &mut self.negs, want, 1, 1)
    }

    /// The negatives of the current batch as the kernels use them: global ids, or table
    /// rows when the table is slot-indexed (waits for the device).
    pub fn negatives(&self, gpu: &Gpu) -> Result<Vec<u32>, GpuError> {
        let mut all = gpu.download(&self.negs)?;
        all.truncate(2 * self.chunks * self.shape.negatives);
        Ok(all)
    }

    fn check_tables(
        &self,
        nodes: &DeviceTable,
        rels: Option<&DeviceTable>,
    ) -> Result<(), GpuError> {
        let d = self.model.dim;
        let need = match &self.slots {
            Some((map, _)) => map.table_rows() as usize,
            None => self.entities,
        };
        let state = self.optimizer.state.width(d);
        if nodes.dim != d || nodes.rows < need || nodes.state_width != state {
            return Err(GpuError::Shape(format!(
                "node table {}×{} ({} of state a row) for {need} rows of dim {d} ({state} of state)",
                nodes.rows, nodes.dim, nodes.state_width
            )));
        }
        // Relation rows of the decoder's width (RESCAL: d², a matrix), element-wise state.
        let rw = self.model.relation_width();
        match (self.model.decoder.uses_relations(), rels) {
            (true, Some(r)) if r.dim == rw && r.rows >= self.relations && r.state_width == rw => {
                Ok(())
            }
            (true, _) => Err(GpuError::Shape(format!(
                "{} needs a relation table of {} rows of {rw} floats",
                self.model.decoder, self.relations
            ))),
            (false, _) => Ok(()),
        }
    }

    /// Queues the forward and backward passes of the current batch: afterwards the tables'
    /// gradient accumulators hold the summed gradients and every touched row is listed.
    pub fn forward_backward(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        self.passes(gpu, nodes, rels, false)
    }

    /// Counts the current batch's uses of each node row into `nodes.uses`.
    fn count_uses(&mut self, gpu: &Gpu, nodes: &mut DeviceTable) -> Result<(), GpuError> {
        let negs = 2 * self.chunks * self.shape.negatives;
        let (len32, negs32) = (self.batch_len as u32, negs as u32);
        let cfg = grid_1d((2 * self.batch_len + negs) as u64)?;
        let mut b = gpu.stream().launch_builder(&gpu.kernels.count_uses);
        b.arg(&self.edges)
            .arg(&len32)
            .arg(&self.negs)
            .arg(&negs32)
            .arg(&mut nodes.uses);
        // SAFETY: edges holds batch_len edges and negs 2·chunks·k ids, all rows of the node
        // table (checked by check_tables and when set), which uses has one counter each.
        unsafe { b.launch(cfg) }.during("launching legend_count_uses")?;
        self.mark(gpu, "count_uses")
    }

    /// The forward and backward passes; with `direct`, the node rows the batch uses once
    /// (counted first by `count_uses`) take their AdaGrad step in the backward kernels and
    /// stay out of the gradient table and lists.
    fn passes(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
        direct: bool,
    ) -> Result<(), GpuError> {
        if self.chunks == 0 {
            return Err(GpuError::Shape("no batch set".into()));
        }
        self.check_tables(nodes, rels.as_deref())?;
        self.mark(gpu, "(between steps)")?;
        // RESCAL's row gradients need every element of the other rows of the edge, which an
        // in-place step would change under the warp: its rows take the gradient table.
        let direct = direct && self.model.decoder != Decoder::Rescal;
        if direct {
            self.count_uses(gpu, nodes)?;
        }
        if !self.accumulate_loss {
            gpu.clear(&mut self.loss_sum)?;
        }
        let (d, k, max_rows) = (self.model.dim, self.shape.negatives, self.max_rows);
        let decoder = decoder_code(self.model.decoder);
        let (penalty, penalty_weight) = penalty_code(self.regularizer);
        let jobs = 2 * self.chunks;
        // The in-place steps round as legend_adagrad does.
        let rounding = self.node_rounding(gpu, nodes);
        // Every kernel of the step goes on this one stream: the in-place AdaGrad of rows used
        // once (direct) relies on every earlier reader of those rows having finished.
        let s = gpu.stream().clone();
        let kern = &gpu.kernels;
        let (rel_emb, rel_grad, rel_flags, rel_list, rel_count) = match rels.as_deref() {
            Some(r) => (
                gpu.ptr(&r.emb),
                gpu.ptr(&r.grad),
                gpu.ptr(&r.flags),
                gpu.ptr(&r.list),
                gpu.ptr(&r.count),
            ),
            None => {
                let (f, u) = (gpu.ptr(&self.no_rel), gpu.ptr(&self.no_rel_u32));
                (f, f, u, u, u)
            }
        };
        let warps = |n: usize| LaunchConfig {
            grid_dim: (blocks(n, 8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        for g0 in (0..jobs).step_by(self.shape.group) {
            let gz = self.shape.group.min(jobs - g0) as u32;
            // The fused path's operand scales start from zero maxima; legend_queries fills
            // the queries' (null elsewhere: the kernel then skips it), and for TransE L2
            // the queries' squared norms.
            let (absmax, (query_norm, query_weight)) = match &mut self.path {
                Path::Fused(f) => {
                    gpu.clear(&mut f.absmax)?;
                    (gpu.ptr(&f.absmax), f.query_norms_and_weights(gpu))
                }
                Path::Unfused(_) => (0, (0, 0)),
            };
            let job_args = JobArgs {
                edges: gpu.ptr(&self.edges),
                row0: gpu.ptr(&self.row0) + 4 * g0 as u64,
                rows: gpu.ptr(&self.rows) + 4 * g0 as u64,
                absmax,
                query_norm,
                query_weight,
                first_job: g0 as u32,
                max_rows: max_rows as u32,
                dim: d as u32,
                decoder,
                inverse: self.inverse.unwrap_or(0) as u32,
                penalty,
                penalty_weight,
                pad: 0,
            };
            let rows_ptr = job_args.rows;
            // Both sides of an edge at once (gz is even: whole chunks).
            let per_edge = LaunchConfig {
                grid_dim: (blocks(max_rows, 8), gz / 2, 1),
                ..warps(0)
            };

            // RotatE and RESCAL have their own queries and rows backward, with the same
            // arguments as the shared ones.
            let (queries, rows_backward) = match self.model.decoder {
                Decoder::RotatE => (&kern.rotate_queries, &kern.rotate_rows_backward),
                Decoder::Rescal => (&kern.rescal_queries, &kern.rescal_rows_backward),
                // Reciprocal relations and regularisers, and rounded in-place steps, have
                // kernels of their own, so that the plain step keeps its registers.
                _ if job_args.inverse != 0 || penalty != 0 => {
                    (&kern.queries, &kern.rows_backward_extra)
                }
                _ if direct && rounding.dtype != 0 => (&kern.queries, &kern.rows_backward_rounded),
                _ => (&kern.queries, &kern.rows_backward),
            };
            let mut b = s.launch_builder(queries);
            b.arg(&job_args)
                .arg(&nodes.emb)
                .arg(&rel_emb)
                .arg(&mut self.query)
                .arg(&mut self.pos);
            // SAFETY: edges hold the batch, row0/rows the jobs from g0 on; ids were checked
            // against the tables in set_batch/check_tables; query and pos hold group ×
            // max_rows rows, as does query_norm where it is given (TransE L2, fused).
            unsafe { b.launch(per_edge) }.during("launching legend_queries")?;
            self.mark(gpu, "queries")?;

            let (g032, k32, d32) = (g0 as u32, k as u32, d as u32);
            match self.path {
                Path::Fused(_) => self.fused_products(gpu, &nodes.emb, g0, gz)?,
                Path::Unfused(_) => {
                    self.unfused_products(gpu, &nodes.emb, g0, gz, job_args.row0, rows_ptr)?
                }
            }

            let direct_args = DirectArgs {
                state: gpu.ptr(&nodes.state),
                uses: if direct { gpu.ptr(&nodes.uses) } else { 0 },
                lr: self.optimizer.lr,
                eps: self.optimizer.eps,
                row_wise: u32::from(nodes.state_width != nodes.dim),
                pad: 0,
                rounding,
            };
            let mut b = s.launch_builder(rows_backward);
            b.arg(&job_args)
                .arg(&mut nodes.emb)
                .arg(&rel_emb)
                .arg(&self.pos)
                .arg(&self.grad_query)
                .arg(&self.grad_pos)
                .arg(&mut nodes.grad)
                .arg(&mut nodes.flags)
                .arg(&mut nodes.list)
                .arg(&mut nodes.count)
                .arg(&direct_args)
                .arg(&rel_grad)
                .arg(&rel_flags)
                .arg(&rel_list)
                .arg(&rel_count);
            // SAFETY: as for legend_queries; the gradient tables and the node state have the
            // shape of the parameter tables, uses one counter a node row, and the lists one
            // slot per row (a row is listed once).
            unsafe { b.launch(per_edge) }.during("launching legend_rows_backward")?;
            self.mark(gpu, "rows_backward")?;

            let neg_weight = match &self.path {
                Path::Fused(f) => f.negative_weights(gpu),
                Path::Unfused(_) => 0,
            };
            let mut b = s.launch_builder(&kern.negatives_backward);
            b.arg(&self.negs)
                .arg(&g032)
                .arg(&k32)
                .arg(&d32)
                .arg(&self.grad_negs)
                .arg(&neg_weight)
                .arg(&mut nodes.emb)
                .arg(&mut nodes.grad)
                .arg(&mut nodes.flags)
                .arg(&mut nodes.list)
                .arg(&mut nodes.count)
                .arg(&direct_args);
            let cfg = LaunchConfig {
                grid_dim: (blocks(k, 8), gz, 1),
                ..warps(0)
            };
            // SAFETY: negs ids are below the node rows; grad_negs holds group·k·d floats, and
            // neg_weight (where given) group·k; the node state and uses as for
            // legend_rows_backward.
            unsafe { b.launch(cfg) }.during("launching legend_negatives_backward")?;
            self.mark(gpu, "negatives_backward")?;
        }
        Ok(())
    }

    /// Queues AdaGrad on every row touched since the last call, in place, and clears the
    /// gradients and row lists for the next batch.
    pub fn apply(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        let touched_nodes = nodes
            .rows
            .min(2 * self.batch_len + 2 * self.chunks * self.shape.negatives);
        let rounding = self.node_rounding(gpu, nodes);
        self.adagrad(gpu, nodes, touched_nodes, rounding)?;
        if let Some(r) = rels
            && self.model.decoder.uses_relations()
        {
            // With reciprocal relations an edge touches its relation's row and its inverse's.
            let per_edge = if self.inverse.is_some() { 2 } else { 1 };
            let touched = r.rows.min(per_edge * self.batch_len);
            self.adagrad(gpu, r, touched, RoundingArgs::default())?;
        }
        Ok(())
    }

    /// The kernels' arguments of the node rows' rounding this step (all zeros: none).
    fn node_rounding(&self, gpu: &Gpu, nodes: &DeviceTable) -> RoundingArgs {
        let Some(r) = self.rounding else {
            return RoundingArgs::default();
        };
        let (partition_of_slot, rows_per_slot) = match (&self.slots, &self.partition_of_slot) {
            (Some((map, _)), Some(dev)) => (gpu.ptr(dev), map.rows_per_partition as u32),
            _ => (0, nodes.rows as u32),
        };
        RoundingArgs {
            batch_key: r.batch.0,
            partition_of_slot,
            out_of_range: gpu.ptr(&self.out_of_range),
            dtype: dtype_code(r.dtype),
            rows_per_slot,
        }
    }

    fn adagrad(
        &mut self,
        gpu: &Gpu,
        t: &mut DeviceTable,
        capacity: usize,
        rounding: RoundingArgs,
    ) -> Result<(), GpuError> {
        let (d, lr, eps) = (t.dim as u32, self.optimizer.lr, self.optimizer.eps);
        let row_state = u32::from(t.state_width != t.dim);
        let mut b = gpu.stream().launch_builder(&gpu.kernels.adagrad);
        b.arg(&mut t.emb)
            .arg(&mut t.state)
            .arg(&mut t.grad)
            .arg(&mut t.flags)
            .arg(&mut t.uses)
            .arg(&t.list)
            .arg(&t.count)
            .arg(&d)
            .arg(&row_state)
            .arg(&lr)
            .arg(&eps)
            .arg(&rounding);
        let cfg = LaunchConfig {
            grid_dim: (blocks(capacity, 8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads the count, then only list entries below it (each a row
        // id of this table) and those rows of the table's buffers (state of the width
        // row_state says) and of uses; with rounding, partition_of_slot's entry of each
        // row's slot (rows_per_slot divides the slot-indexed table) and out_of_range.
        unsafe { b.launch(cfg) }.during("launching legend_adagrad")?;
        self.mark(gpu, "adagrad")?;
        gpu.clear(&mut t.count)
    }

    /// Queues one full step on the current batch and negatives: the result of
    /// [`forward_backward`](Self::forward_backward) then [`apply`](Self::apply), but the node
    /// rows the batch uses once (most of them) take their AdaGrad step in the backward
    /// kernels, without the gradient table's atomics, clearing and second pass (with
    /// row-wise state, after the warp has stored the row's whole gradient), rounded as
    /// `legend_adagrad` rounds where [`GpuBatchEngine::set_rounding`] asks for it.
    pub fn step(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        mut rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        self.passes(gpu, nodes, rels.as_deref_mut(), true)?;
        self.apply(gpu, nodes, rels)
    }

    /// Like [`GpuBatchEngine::step`], but only the node rows step: the relation table keeps
    /// the batch's summed gradients, for a caller that adds them up over several GPUs (the
    /// table's [`DeviceTable::gradient_span`]) and then steps them with
    /// [`GpuBatchEngine::apply_relations_everywhere`].
    pub fn step_nodes(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        self.passes(gpu, nodes, rels, true)?;
        let touched_nodes = nodes
            .rows
            .min(2 * self.batch_len + 2 * self.chunks * self.shape.negatives);
        let rounding = self.node_rounding(gpu, nodes);
        self.adagrad(gpu, nodes, touched_nodes, rounding)
    }

    /// AdaGrad on every row of the relation table with the gradients it holds (summed over
    /// the GPUs by the caller), then cleared. A row no GPU touched has a zero gradient and
    /// keeps its values and state (a step of zero), so the rows every GPU steps are the union
    /// of the rows each touched, and the tables stay equal on all of them.
    pub fn apply_relations_everywhere(
        &mut self,
        gpu: &Gpu,
        rels: &mut DeviceTable,
    ) -> Result<(), GpuError> {
        let rows = rels.rows;
        if self
            .all_relation_rows
            .as_ref()
            .is_none_or(|(ids, _)| ids.len() != rows)
        {
            let ids: Vec<u32> = (0..rows as u32).collect();
            self.all_relation_rows = Some((gpu.upload(&ids)?, gpu.upload(&[rows as u32])?));
        }
        let (ids, count) = self.all_relation_rows.as_ref().expect("made above");
        gpu.stream()
            .memcpy_dtod(ids, &mut rels.list.slice_mut(..rows))
            .during("listing every relation row")?;
        gpu.stream()
            .memcpy_dtod(count, &mut rels.count)
            .during("counting every relation row")?;
        self.adagrad(gpu, rels, rows, RoundingArgs::default())
    }

    /// The summed loss of the last forward pass (both sides, all positives); waits for it.
    pub fn loss(&self, gpu: &Gpu) -> Result<f64, GpuError> {
        Ok(gpu.download(&self.loss_sum)?[0])
    }

    /// Keeps summing the loss over steps (`true`) until [`GpuBatchEngine::take_loss`], instead
    /// of restarting the sum at every forward pass (`false`, the default): a trainer then reads
    /// it once an epoch and never waits for a step.
    pub fn set_loss_accumulation(&mut self, on: bool) {
        self.accumulate_loss = on;
    }

    /// The learning rate of the steps launched from now on (a schedule changes it between
    /// epochs; the kernels take it as an argument at every launch).
    pub fn set_learning_rate(&mut self, lr: f32) {
        self.optimizer.lr = lr;
    }

    /// The loss summed since the last call (or since accumulation was turned on); waits for
    /// it and restarts the sum.
    pub fn take_loss(&mut self, gpu: &Gpu) -> Result<f64, GpuError> {
        let sum = gpu.download(&self.loss_sum)?[0];
        gpu.clear(&mut self.loss_sum)?;
        self.check_range(gpu)?;
        Ok(sum)
    }

    /// Fails naming the first node row a step took out of its format's range, if any (read
    /// with the loss, so no step waits for it).
    pub fn check_range(&self, gpu: &Gpu) -> Result<(), GpuError> {
        match gpu.download(&self.out_of_range)?[0] {
            u64::MAX => Ok(()),
            found => Err(GpuError::OutOfRange {
                row: found >> 32,
                element: found as u32,
                dtype: self.rounding.map_or(Dtype::F32, |r| r.dtype),
            }),
        }
    }

    /// Score FLOPs of one step on a full batch: three products (scores, dQ, dN) of
    /// 2·B·k·d each, on both sides (for TransE, two operations per element pair likewise).
    pub fn step_flops(&self) -> f64 {
        let (b, k, d) = (
            self.shape.max_batch as f64,
            self.shape.negatives as f64,
            self.model.dim as f64,
        );
        2.0 * 3.0 * 2.0 * b * k * d
    }

    /// Turns per-phase timing on (an event after every kernel of
    /// [`GpuBatchEngine::forward_backward`] and [`GpuBatchEngine::apply`]) or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.marks = on.then(Vec::new);
    }

    /// Milliseconds per phase since profiling was turned on or last read, summed over
    /// launches (waits for the device); empty when profiling is off.
    pub fn take_profile(&mut self, gpu: &Gpu) -> Result<Vec<(&'static str, f64)>, GpuError> {
        let Some(marks) = self.marks.as_mut() else {
            return Ok(Vec::new());
        };
        gpu.synchronize()?;
        let mut out: Vec<(&'static str, f64)> = Vec::new();
        for pair in marks.windows(2) {
            let ms = f64::from(
                pair[0]
                    .1
                    .elapsed_ms(&pair[1].1)
                    .during("reading a phase time")?,
            );
            match out.iter_mut().find(|(n, _)| *n == pair[1].0) {
                Some((_, t)) => *t += ms,
                None => out.push((pair[1].0, ms)),
            }
        }
        marks.clear();
        Ok(out)
    }

    /// Records the end of phase `name` when profiling.
    fn mark(&mut self, gpu: &Gpu, name: &'static str) -> Result<(), GpuError> {
        if let Some(marks) = self.marks.as_mut() {
            let ev = gpu
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .during("creating a timing event")?;
            ev.record(gpu.stream()).during("recording a timing event")?;
            marks.push((name, ev));
        }
        Ok(())
    }

    /// Scratch buffers for checks: the score (then gradient) matrices and the queries,
    /// which tests poison before a step so that an unwritten element shows as NaN.
    pub fn poison_scratch(&mut self, gpu: &Gpu) -> Result<(), GpuError> {
        let (floats, halves): (Vec<&mut CudaSlice<f32>>, Vec<&mut CudaSlice<u32>>) =
            match &mut self.path {
                Path::Fused(f) => (
                    vec![&mut f.corr],
                    vec![&mut f.neg_half, &mut f.query_half, &mut f.g],
                ),
                Path::Unfused(u) => (vec![&mut u.neg_rows, &mut u.scores, &mut u.dist], vec![]),
            };
        let common = [
            &mut self.query,
            &mut self.pos,
            &mut self.grad_pos,
            &mut self.grad_query,
        ];
        for buf in common.into_iter().chain(floats) {
            let nan = vec![f32::NAN; buf.len()];
            gpu.write(&nan, buf)?;
        }
        // Two FP16 NaNs a word.
        for buf in halves {
            let nan = vec![0x7e00_7e00u32; buf.len()];
            gpu.write(&nan, buf)?;
        }
        Ok(())
    }
}
