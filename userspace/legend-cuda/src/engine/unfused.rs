//! The unfused path: the step's three products as separate kernels, TF32 products on the
//! tensor cores for the dot comparator, distances on the CUDA cores for TransE.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use legend_model::{ChunkModel, Comparator, Decoder};

use super::args::{GemmArgs, Matrices};
use super::{GpuBatchEngine, Path, blocks};
use crate::error::DriverContext;
use crate::kernel_abi::{GEMM_SMEM, loss_code};
use crate::{Gpu, GpuError};

/// Output tile edge of the product kernels.
pub(super) const TILE: usize = 128;
/// K-slice of the product kernels; split-K ranges are multiples of it.
pub(super) const SLICE: usize = 16;
/// Rows per block of the loss kernel (`LEGEND_LOSS_ROWS`).
pub(super) const LOSS_ROWS: usize = 32;
/// Output tiles of the distance kernels (`kernels/distance.cu`): 128 rows by 128 columns
/// for the scores, by 64 for the gradients.
const DIST_ROWS: usize = 128;
const DIST_SCORE_COLS: usize = 128;
const DIST_GRAD_COLS: usize = 64;
/// Output tiles of RotatE's modulus kernels (`kernels/rotate.cu`): 32 rows by 32 negatives
/// for the scores, by 16 complex pairs for the gradients.
const MOD_ROWS: usize = 32;
const MOD_COLS: usize = 32;
const MOD_PAIRS: usize = 16;

/// What only the unfused path holds.
pub(super) struct UnfusedBuffers {
    /// The group's dense negatives (FP32, d a row).
    pub(super) neg_rows: CudaSlice<f32>,
    /// The group's score matrices, which the loss turns into ∂L/∂S in place.
    pub(super) scores: CudaSlice<f32>,
    /// TransE L2's inverse distances (0 at distance 0), the shape of `scores` (one float
    /// otherwise): the loss overwrites the scores, and the gradients scale G by them.
    pub(super) dist: CudaSlice<f32>,
}

impl UnfusedBuffers {
    /// The buffers of `group` jobs of up to `max_rows` rows and `k` negatives.
    pub(super) fn new(
        gpu: &Gpu,
        model: &ChunkModel,
        group: usize,
        max_rows: usize,
        k: usize,
    ) -> Result<UnfusedBuffers, GpuError> {
        let scores = group * max_rows * k;
        Ok(UnfusedBuffers {
            neg_rows: gpu.zeros(group * k * model.dim)?,
            scores: gpu.zeros(scores)?,
            dist: gpu.zeros(if model.decoder == Decoder::TransEL2 {
                scores
            } else {
                1
            })?,
        })
    }
}

/// The three products of an unfused step, on the tensor cores (dot comparator) or as
/// distances on the CUDA cores (TransE).
#[derive(Clone, Copy, Debug)]
pub(super) enum Product {
    /// `S = Q·Nᵀ`, or `S = −‖Q_i − N_j‖`.
    Scores,
    /// `dQ = G·N`, or through the distances.
    GradQuery,
    /// `dN = Gᵀ·Q`, or through the distances.
    GradNegatives,
}

impl GpuBatchEngine {
    /// The products of the group of `gz` jobs from `g0` as separate kernels: gathered
    /// negatives, `S = Q·Nᵀ`, the known edges filtered out (filtered negatives), the loss
    /// turning `S` into G in place, `dQ = G·N` and `dN = Gᵀ·Q`. `row0` and `rows` point at
    /// the group's first job's entries of the engine's tables.
    pub(super) fn unfused_products(
        &mut self,
        gpu: &Gpu,
        emb: &CudaSlice<f32>,
        g0: usize,
        gz: u32,
        row0: u64,
        rows: u64,
    ) -> Result<(), GpuError> {
        let Path::Unfused(u) = &self.path else {
            unreachable!("the unfused path's products");
        };
        let (nr, sc) = (gpu.ptr(&u.neg_rows), gpu.ptr(&u.scores));
        let (d, k, max_rows) = (self.model.dim, self.shape.negatives, self.max_rows);
        let (g032, k32, d32, mr32) = (g0 as u32, k as u32, d as u32, max_rows as u32);
        let (loss, margin, temperature) = loss_code(self.model.loss);
        let s = gpu.stream().clone();
        let kern = &gpu.kernels;
        let launch = |grid_dim| LaunchConfig {
            grid_dim,
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&kern.gather_negatives);
        b.arg(&self.negs)
            .arg(&g032)
            .arg(&k32)
            .arg(&d32)
            .arg(emb)
            .arg(&nr);
        // SAFETY: negs holds 2·chunks·k ids below the table's rows; neg_rows group·k·d
        // floats.
        unsafe { b.launch(launch((blocks(k * d, 256), gz, 1))) }
            .during("launching legend_gather_negatives")?;
        self.mark(gpu, "gather_negatives")?;
        let q = gpu.ptr(&self.query);
        let m = |ptr, rows, cols| Matrices { ptr, rows, cols };
        // S = Q · Nᵀ.
        let scores = GemmArgs::product(
            m(q, max_rows, d),
            m(nr, k, d),
            m(sc, max_rows, k),
            (max_rows, k, d),
        )
        .m_rows(rows);
        self.product(gpu, Product::Scores, &scores, gz, 1)?;
        self.mark(gpu, "scores_product")?;
        if let Some(known) = &self.known {
            let mut b = s.launch_builder(&kern.filter_known);
            b.arg(&known.edges)
                .arg(&row0)
                .arg(&rows)
                .arg(&g032)
                .arg(&mr32)
                .arg(&known.negs)
                .arg(&k32)
                .arg(&known.by_source)
                .arg(&known.by_destination)
                .arg(&known.count)
                .arg(&sc);
            // SAFETY: known.edges holds the batch in global ids (3 a row, rows from row0),
            // known.negs its lists × k negatives, the two key arrays `count` sorted triples
            // each, scores group × max_rows × k floats.
            unsafe { b.launch(launch((blocks(max_rows, 8), gz, 1))) }
                .during("launching legend_filter_known")?;
            self.mark(gpu, "filter_known")?;
        }

        let mut b = s.launch_builder(&kern.loss);
        b.arg(&sc)
            .arg(&self.pos)
            .arg(&mut self.grad_pos)
            .arg(&rows)
            .arg(&mr32)
            .arg(&k32)
            .arg(&loss)
            .arg(&margin)
            .arg(&temperature)
            .arg(&mut self.loss_sum);
        // SAFETY: scores hold group × max_rows × k floats written by the product above;
        // pos/grad_pos group × max_rows; loss_sum one double.
        unsafe { b.launch(launch((blocks(max_rows, LOSS_ROWS), gz, 1))) }
            .during("launching legend_loss")?;
        self.mark(gpu, "loss")?;

        // dQ = G · N.
        let grad_query = GemmArgs::product(
            m(sc, max_rows, k),
            m(nr, k, d),
            m(gpu.ptr(&self.grad_query), max_rows, d),
            (max_rows, d, k),
        )
        .m_rows(rows);
        self.product(gpu, Product::GradQuery, &grad_query, gz, 1)?;
        self.mark(gpu, "grad_query_product")?;

        // dN = Gᵀ · Q, split over the rows so that two blocks run per multiprocessor (the
        // device's count); the splits add up atomically into a cleared buffer.
        gpu.clear(&mut self.grad_negs)?;
        let tiles = k.div_ceil(TILE) * d.div_ceil(TILE) * gz as usize;
        let splits = (2 * gpu.multiprocessors())
            .div_ceil(tiles)
            .clamp(1, max_rows.div_ceil(SLICE));
        let k_split = max_rows.div_ceil(splits).div_ceil(SLICE) * SLICE;
        let grad_negs = GemmArgs::product(
            m(sc, max_rows, k),
            m(q, max_rows, d),
            m(gpu.ptr(&self.grad_negs), k, d),
            (k, d, max_rows),
        )
        .k_split(rows, k_split);
        self.product(
            gpu,
            Product::GradNegatives,
            &grad_negs,
            gz,
            max_rows.div_ceil(k_split) as u32,
        )?;
        self.mark(gpu, "grad_negatives_product")
    }

    /// Runs one of the unfused step's products on the operands `g` describes: the TF32
    /// product kernels for the dot comparator, the distance kernels for TransE (which take
    /// the same operands, plus the queries or negatives the gradients compare against).
    pub(super) fn product(
        &self,
        gpu: &Gpu,
        which: Product,
        g: &GemmArgs,
        batch: u32,
        splits: u32,
    ) -> Result<(), GpuError> {
        let kern = &gpu.kernels;
        let l2 = match self.model.decoder.comparator() {
            Comparator::Dot => {
                let f = match which {
                    Product::Scores => &kern.gemm_nt,
                    Product::GradQuery => &kern.gemm_nn,
                    Product::GradNegatives => &kern.gemm_tn,
                };
                return self.gemm(gpu, f, g, batch, splits);
            }
            Comparator::NegModulus => return self.modulus(gpu, which, g, batch, splits),
            Comparator::NegL1 => 0i32,
            Comparator::NegL2 => 1i32,
        };
        let Path::Unfused(u) = &self.path else {
            unreachable!("the unfused path's products");
        };
        let (f, cols, other) = match which {
            Product::Scores => (&kern.dist_scores, DIST_SCORE_COLS, None),
            Product::GradQuery => (&kern.dist_grad_query, DIST_GRAD_COLS, Some(&self.query)),
            Product::GradNegatives => {
                (&kern.dist_grad_negatives, DIST_GRAD_COLS, Some(&u.neg_rows))
            }
        };
        let tiles = (g.m as usize).div_ceil(DIST_ROWS) * (g.n as usize).div_ceil(cols);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, splits, batch),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dist = gpu.ptr(&u.dist);
        let mut b = gpu.stream().launch_builder(f);
        b.arg(g).arg(&l2);
        if let Some(x) = other {
            b.arg(x);
        }
        b.arg(&dist);
        // SAFETY: as for `gemm`; the queries and negatives have C's shape in the gradient
        // products, and for L2 `dist` holds group × max_rows × k floats, the scores' shape
        // (the scores kernel writes it, the gradient kernels read it); L1 never touches it.
        unsafe { b.launch(cfg) }.during("launching a distance kernel")?;
        Ok(())
    }

    /// RotatE's products on the operands `g` describes (`kernels/rotate.cu`): the modulus
    /// distances and their gradients, which also take the queries or negatives they compare
    /// against.
    fn modulus(
        &self,
        gpu: &Gpu,
        which: Product,
        g: &GemmArgs,
        batch: u32,
        splits: u32,
    ) -> Result<(), GpuError> {
        let Path::Unfused(u) = &self.path else {
            unreachable!("the unfused path's products");
        };
        let kern = &gpu.kernels;
        // Tiles of 32 rows by 32 negatives (scores) or by 16 complex pairs (gradients).
        let (f, cols, other) = match which {
            Product::Scores => (&kern.modulus_scores, g.n as usize, None),
            Product::GradQuery => (
                &kern.modulus_grad_query,
                g.n as usize / 2,
                Some(&self.query),
            ),
            Product::GradNegatives => (
                &kern.modulus_grad_negatives,
                g.n as usize / 2,
                Some(&u.neg_rows),
            ),
        };
        let col_tile = if other.is_some() { MOD_PAIRS } else { MOD_COLS };
        let tiles = (g.m as usize).div_ceil(MOD_ROWS) * cols.div_ceil(col_tile);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, splits, batch),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(f);
        b.arg(g);
        if let Some(x) = other {
            b.arg(x);
        }
        // SAFETY: as for `gemm`; in the gradient products the queries (dQ) or the gathered
        // negatives (dN) have C's shape, group × max_rows × d or group × k × d floats.
        unsafe { b.launch(cfg) }.during("launching a modulus kernel")?;
        Ok(())
    }

    pub(super) fn gemm(
        &self,
        gpu: &Gpu,
        f: &cudarc::driver::CudaFunction,
        g: &GemmArgs,
        batch: u32,
        splits: u32,
    ) -> Result<(), GpuError> {
        // 16-byte copies need 16-byte aligned rows in every batch entry.
        let aligned = |p: u64, ld: i64, batch: i64| {
            i32::from(p.is_multiple_of(16) && ld % 4 == 0 && batch % 4 == 0)
        };
        let g = &GemmArgs {
            a_vec: aligned(g.a, g.a_ld, g.a_batch),
            b_vec: aligned(g.b, g.b_ld, g.b_batch),
            c_vec: aligned(g.c, g.c_ld, g.c_batch),
            ..*g
        };
        let tiles = (g.m as usize).div_ceil(TILE) * (g.n as usize).div_ceil(TILE);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, splits, batch),
            block_dim: (256, 1, 1),
            shared_mem_bytes: GEMM_SMEM,
        };
        let mut b = gpu.stream().launch_builder(f);
        b.arg(g);
        // SAFETY: every operand address and stride above describes a live engine buffer of
        // at least batch × its per-entry size; the kernel bounds rows by m_rows/k_rows.
        unsafe { b.launch(cfg) }.during("launching a product kernel")?;
        Ok(())
    }
}
