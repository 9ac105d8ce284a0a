//! The fused path: scores, loss and gradients of a group of jobs in kernels that keep the
//! score matrices on chip (`kernels/fused*.cu*`), on sm_80 and newer.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use legend_model::{Comparator, Decoder};

use super::args::FusedArgs;
use super::{GpuBatchEngine, Path, blocks};
use crate::error::DriverContext;
use crate::gpu::FusedKernels;
use crate::kernel_abi::{
    FUSED_BLOCK_ROWS, FUSED_NEG_BLOCK, FUSED_TILE, fused_dim_pad, fused_k_pad, fused_rows_pad,
    loss_code,
};
use crate::{Gpu, GpuError};

/// Blocks the fused negatives kernel aims at (about eight per multiprocessor of an H100, so
/// that the last wave is short): the rows of a job are split into ranges to get there.
const FUSED_BLOCKS: usize = 1024;

/// Blocks a job of `legend_fused_absmax` (eight warps each, a warp a negative): 16 blocks
/// of each of a group's 20 jobs give the benchmark batch between two and three per
/// multiprocessor, about eight negatives a warp.
const FUSED_ABSMAX_BLOCKS: u32 = 16;

/// What only the fused path holds: the FP16 operands, G, the softmax factors and the
/// operands' scales (`LegendFused` in `kernels/fused.cuh` has the layouts).
pub(super) struct FusedBuffers {
    /// The fused kernels' index in `Kernels::fused` (the narrowest that fit the rows).
    which: usize,
    /// The negatives and the queries in FP16 (pairs of values, `dim_pad` values a row, in
    /// tiles of 64 rows; negatives padded to `fused_k_pad(k)`, rows to `fused_rows_pad`).
    pub(super) neg_half: CudaSlice<u32>,
    pub(super) query_half: CudaSlice<u32>,
    /// G of each row and negative (FP16 pairs in blocks of 16 × 16).
    pub(super) g: CudaSlice<u32>,
    /// The softmax factors of each row and 64-negative tile.
    pub(super) corr: CudaSlice<f32>,
    /// Each job's largest query and negative magnitudes (float bits), which give the FP16
    /// operands their power-of-two scales.
    pub(super) absmax: CudaSlice<u32>,
    /// TransE L2's norms and weight sums (`TransENorms`); none for the other decoders.
    transe: Option<TransENorms>,
}

/// What the fused kernels need for TransE L2's distances, `|q|² + |n|² − 2 q·n` with the
/// product on the tensor cores (`legend_fused_transe_tile` in `kernels/fused_loss.cuh`).
pub(super) struct TransENorms {
    /// The squared norms of the FP16 queries (`max_rows` a job) and negatives
    /// (`fused_k_pad(k)` a job).
    query_norm: CudaSlice<f32>,
    neg_norm: CudaSlice<f32>,
    /// Each job's smallest nearest distance (complemented float bits, cleared before a group).
    nearest: CudaSlice<u32>,
    /// The weight sums that the per-row kernels subtract times the FP32 rows from dQ and dN
    /// (`max_rows` and `k` a job; `legend_fused_transe_weights`).
    query_weight: CudaSlice<f32>,
    neg_weight: CudaSlice<f32>,
}

/// Whether fused kernels `kernels` take rows of `d` values for `decoder`: the dot decoders'
/// need `d ≤ width`; TransE L2's two padding columns more (the operands' columns of ones that
/// sum G / dist per row and per negative, `legend_fused_transe_weights`); TransE L1 has no
/// product form.
pub(super) fn fused_fits(decoder: Decoder, d: usize, kernels: &FusedKernels) -> bool {
    // RESCAL's queries kernel does not report the FP16 operand scale (absmax) the fused
    // products need (Documentation/gpu.md).
    if decoder == Decoder::Rescal {
        return false;
    }
    match decoder.comparator() {
        Comparator::Dot => !kernels.transe && d <= kernels.width,
        Comparator::NegL2 => kernels.transe && d + 2 <= kernels.width,
        Comparator::NegL1 | Comparator::NegModulus => false,
    }
}

impl FusedBuffers {
    /// TransE L2's buffers per query (`max_rows` a job): where `legend_queries` leaves the
    /// squared norms of the FP16 queries, and where `legend_rows_backward` finds the weight
    /// sums it subtracts times the queries from dQ; (0, 0) (none) for the other decoders.
    pub(super) fn query_norms_and_weights(&self, gpu: &Gpu) -> (u64, u64) {
        self.transe.as_ref().map_or((0, 0), |t| {
            (gpu.ptr(&t.query_norm), gpu.ptr(&t.query_weight))
        })
    }

    /// TransE L2: where `legend_negatives_backward` finds the weight sums it subtracts times
    /// the negatives from dN (`k` a job); 0 (none) for the other decoders.
    pub(super) fn negative_weights(&self, gpu: &Gpu) -> u64 {
        self.transe.as_ref().map_or(0, |t| gpu.ptr(&t.neg_weight))
    }

    /// The buffers of the fused kernels `which` for `group` jobs of up to `max_rows` rows
    /// and `k` negatives.
    pub(super) fn new(
        gpu: &Gpu,
        which: usize,
        decoder: Decoder,
        group: usize,
        max_rows: usize,
        k: usize,
    ) -> Result<FusedBuffers, GpuError> {
        let half_len = fused_dim_pad(gpu.kernels.fused[which].width) / 2;
        let (k_pad, rows_pad) = (fused_k_pad(k), fused_rows_pad(max_rows));
        let transe = match decoder.comparator() {
            Comparator::NegL2 => Some(TransENorms {
                query_norm: gpu.zeros(group * max_rows)?,
                neg_norm: gpu.zeros(group * k_pad)?,
                nearest: gpu.zeros(group)?,
                query_weight: gpu.zeros(group * max_rows)?,
                neg_weight: gpu.zeros(group * k)?,
            }),
            _ => None,
        };
        Ok(FusedBuffers {
            transe,
            which,
            neg_half: gpu.zeros(group * k_pad * half_len)?,
            query_half: gpu.zeros(group * rows_pad * half_len)?,
            g: gpu.zeros(group * rows_pad * k_pad / 2)?,
            corr: gpu.zeros(group * rows_pad * k_pad / FUSED_TILE)?,
            absmax: gpu.zeros(2 * group)?,
        })
    }
}

impl GpuBatchEngine {
    /// The score, loss and gradient products of the group of `gz` jobs from `g0` through
    /// the fused kernels (`kernels/fused*.cu*`): the score matrices stay on chip.
    pub(super) fn fused_products(
        &mut self,
        gpu: &Gpu,
        emb: &CudaSlice<f32>,
        g0: usize,
        gz: u32,
    ) -> Result<(), GpuError> {
        if let Path::Fused(f) = &mut self.path
            && let Some(t) = &mut f.transe
        {
            gpu.clear(&mut t.nearest)?;
        }
        let Path::Fused(f) = &self.path else {
            unreachable!("the fused path's products");
        };
        let (neg_half, query_half, g, corr, absmax) = (
            gpu.ptr(&f.neg_half),
            gpu.ptr(&f.query_half),
            gpu.ptr(&f.g),
            gpu.ptr(&f.corr),
            gpu.ptr(&f.absmax),
        );
        let kernels = &gpu.kernels.fused[f.which];
        // The temperature is the self-adversarial loss's, which never runs fused.
        let (loss, margin, _) = loss_code(self.model.loss);
        let (d, k, max_rows) = (self.model.dim, self.shape.negatives, self.max_rows);
        let dim_pad = fused_dim_pad(kernels.width);
        let (k32, d32, pad32) = (k as u32, d as u32, dim_pad as u32);
        let (rows, mr32) = (gpu.ptr(&self.rows) + 4 * g0 as u64, max_rows as u32);
        self.half_negatives(gpu, emb, f, g0, gz)?;
        let (query_norm, neg_norm, nearest, query_weight, neg_weight) = match &f.transe {
            Some(t) => {
                self.negative_norms(gpu, emb, t, g0, gz)?;
                (
                    gpu.ptr(&t.query_norm),
                    gpu.ptr(&t.neg_norm),
                    gpu.ptr(&t.nearest),
                    gpu.ptr(&t.query_weight),
                    gpu.ptr(&t.neg_weight),
                )
            }
            None => (0, 0, 0, 0, 0),
        };
        self.mark(gpu, "gather_negatives")?;
        // Row ranges per job for the negatives kernel, so that enough blocks run; ranges
        // are whole tiles and add up atomically into a cleared buffer.
        let negative_blocks = k.div_ceil(FUSED_NEG_BLOCK) * gz as usize;
        let ranges = FUSED_BLOCKS
            .div_ceil(negative_blocks)
            .clamp(1, max_rows.div_ceil(FUSED_TILE));
        let row_split = max_rows.div_ceil(ranges).div_ceil(FUSED_TILE) * FUSED_TILE;
        let ranges = max_rows.div_ceil(row_split);
        let args = FusedArgs {
            query: gpu.ptr(&self.query),
            query_half,
            negs: neg_half,
            pos: gpu.ptr(&self.pos),
            grad_pos: gpu.ptr(&self.grad_pos),
            grad_query: gpu.ptr(&self.grad_query),
            grad_negs: gpu.ptr(&self.grad_negs),
            g,
            corr,
            rows,
            absmax,
            loss_sum: gpu.ptr(&self.loss_sum),
            query_norm,
            neg_norm,
            nearest,
            query_weight,
            neg_weight,
            jobs: gz,
            max_rows: mr32,
            k: k32,
            dim: d32,
            dim_pad: pad32,
            loss,
            margin,
            row_split: row_split as u32,
            atomic: i32::from(ranges > 1),
        };
        let mut b = gpu.stream().launch_builder(&kernels.rows);
        b.arg(&args);
        let row_blocks = blocks(max_rows, FUSED_BLOCK_ROWS);
        let launch = kernels.launch;
        let grid_dim = if launch.rows_persistent != 0 {
            // A block a multiprocessor walks the group's blocks of rows.
            ((row_blocks * gz).min(gpu.multiprocessors() as u32), 1, 1)
        } else {
            (row_blocks, gz, 1)
        };
        let cfg = LaunchConfig {
            grid_dim,
            block_dim: (launch.rows_threads, 1, 1),
            shared_mem_bytes: launch.rows_smem,
        };
        // SAFETY: query/pos hold the group's rows (written by legend_queries; query with 16
        // bytes to spare for the warp-specialised kernel's whole-piece copies), neg_half its
        // fused_k_pad(k) negatives; query_half, g and corr hold group × fused_rows_pad rows
        // (of dim_pad halves, fused_k_pad(k) values, and fused_k_pad(k) / 64 factors), the
        // kernel writes them for whole blocks of rows and reads and writes the other
        // buffers at rows below rows[z] only. The FP16 buffers are allocations of their own
        // (16-byte aligned), with rows of dim_pad values (32-byte multiples).
        unsafe { b.launch(cfg) }.during("launching the fused rows kernel")?;
        self.mark(gpu, "fused_rows")?;
        if ranges > 1 {
            gpu.clear(&mut self.grad_negs)?;
            if let Path::Fused(f) = &mut self.path
                && let Some(t) = &mut f.transe
            {
                gpu.clear(&mut t.neg_weight)?;
            }
        }
        let mut b = gpu.stream().launch_builder(&kernels.negatives);
        b.arg(&args);
        let cfg = LaunchConfig {
            grid_dim: (k.div_ceil(FUSED_NEG_BLOCK) as u32, ranges as u32, gz),
            block_dim: (launch.negatives_threads, 1, 1),
            shared_mem_bytes: launch.negatives_smem,
        };
        // SAFETY: as above; grad_negs holds group × k × d floats, and the rows kernel
        // queued before has written the G, factors and FP16 queries this one reads (whole
        // 64-row tiles, all inside the blocks of rows the rows kernel ran).
        unsafe { b.launch(cfg) }.during("launching the fused negatives kernel")?;
        self.mark(gpu, "fused_negatives")?;
        Ok(())
    }

    /// The group's negatives in FP16 for the fused kernels: their scales (the largest
    /// magnitudes, beside the queries' that legend_queries added), then the scaled rows.
    fn half_negatives(
        &self,
        gpu: &Gpu,
        emb: &CudaSlice<f32>,
        f: &FusedBuffers,
        g0: usize,
        gz: u32,
    ) -> Result<(), GpuError> {
        let (neg_half, absmax) = (gpu.ptr(&f.neg_half), gpu.ptr(&f.absmax));
        let (d, k) = (self.model.dim, self.shape.negatives);
        let dim_pad = fused_dim_pad(gpu.kernels.fused[f.which].width);
        let (g032, k32, d32, pad32) = (g0 as u32, k as u32, d as u32, dim_pad as u32);
        let mut b = gpu.stream().launch_builder(&gpu.kernels.fused_absmax);
        b.arg(&self.negs)
            .arg(&g032)
            .arg(&k32)
            .arg(&d32)
            .arg(emb)
            .arg(&absmax);
        let cfg = LaunchConfig {
            grid_dim: (FUSED_ABSMAX_BLOCKS, gz, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: negs holds 2·chunks·k ids below the table's rows, absmax two words a job
        // of the group (the queries' maxima already added by legend_queries).
        unsafe { b.launch(cfg) }.during("launching legend_fused_absmax")?;
        // TransE L2's column of ones in the negatives (none: past every row).
        let ones = if f.transe.is_some() {
            d32 + 1
        } else {
            u32::MAX
        };
        let mut b = gpu
            .stream()
            .launch_builder(&gpu.kernels.gather_negatives_half);
        b.arg(&self.negs)
            .arg(&g032)
            .arg(&k32)
            .arg(&d32)
            .arg(&pad32)
            .arg(&ones)
            .arg(emb)
            .arg(&absmax)
            .arg(&neg_half);
        let cfg = LaunchConfig {
            grid_dim: (blocks(fused_k_pad(k) * dim_pad / 2, 256), gz, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: negs holds 2·chunks·k ids below the table's rows; neg_half holds group ×
        // fused_k_pad(k) rows of dim_pad / 2 pairs.
        unsafe { b.launch(cfg) }.during("launching legend_gather_negatives_half")?;
        Ok(())
    }

    /// TransE L2: the squared norms of the group's negatives as the fused kernels round
    /// them (`legend_fused_negative_norms`), after their scales are known; the queries' come
    /// from `legend_queries` (`FusedBuffers::query_norms`).
    fn negative_norms(
        &self,
        gpu: &Gpu,
        emb: &CudaSlice<f32>,
        t: &TransENorms,
        g0: usize,
        gz: u32,
    ) -> Result<(), GpuError> {
        let k = self.shape.negatives;
        let Path::Fused(f) = &self.path else {
            unreachable!("the fused path's norms");
        };
        let (g032, k32, d32) = (g0 as u32, k as u32, self.model.dim as u32);
        let mut b = gpu
            .stream()
            .launch_builder(&gpu.kernels.fused_negative_norms);
        b.arg(&self.negs)
            .arg(&g032)
            .arg(&k32)
            .arg(&d32)
            .arg(emb)
            .arg(&f.absmax)
            .arg(&t.neg_norm);
        let cfg = LaunchConfig {
            grid_dim: (blocks(fused_k_pad(k), 8), gz, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: negs holds 2·chunks·k ids below the table's rows (k a job from g0), absmax
        // two words a job, and neg_norm group × fused_k_pad(k) floats.
        unsafe { b.launch(cfg) }.during("launching legend_fused_negative_norms")?;
        Ok(())
    }
}
