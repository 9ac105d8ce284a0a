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
//! known edges of filtered negatives, `batch_setup` a batch onto the device, `negatives` its
//! negatives, `passes` the passes over job groups, `adagrad` the optimizer's step; this file
//! the engine itself and its settings. `Path` is the way an engine's products run, each way
//! owning the buffers only it uses (`FusedBuffers`, `UnfusedBuffers`).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice};
use legend_model::{AdaGrad, ChunkModel, Dtype, Loss, Regularizer, StepRounding};

use crate::error::DriverContext;
use crate::{Gpu, GpuError};

mod adagrad;
mod args;
mod batch_setup;
mod fused;
mod known;
mod negatives;
mod passes;
mod table;
mod unfused;

pub use known::known_edges_bytes;
pub use negatives::negative_keys;
pub(crate) use table::init_params;
pub use table::{DeviceTable, init_rows, rng_vectors};

use fused::FusedBuffers;
use known::KnownEdges;
use unfused::UnfusedBuffers;

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
            .map_err(|e| GpuError::Shape(e.to_string()))?;
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

    /// Rounds the node rows the next steps update to `rounding`'s format (`None`, or f32: no
    /// rounding), keyed by its epoch and batch: set before every step of a run whose rows are
    /// stored in 16 bits. The in-place steps of rows used once (`step`) and `legend_adagrad`
    /// round alike: the same stream for a row, the same bits.
    pub fn set_rounding(&mut self, rounding: Option<StepRounding>) {
        self.rounding = rounding.filter(|r| r.dtype.is_narrow());
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
