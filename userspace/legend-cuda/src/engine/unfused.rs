//! The unfused path: the step's three products as separate kernels, TF32 products on the
//! tensor cores for the dot comparator, distances on the CUDA cores for TransE.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use legend_model::Comparator;

use super::GpuBatchEngine;
use super::args::GemmArgs;
use crate::error::DriverContext;
use crate::gpu::GEMM_SMEM;
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
            Comparator::NegL1 => 0i32,
            Comparator::NegL2 => 1i32,
        };
        let (f, cols, other) = match which {
            Product::Scores => (&kern.dist_scores, DIST_SCORE_COLS, None),
            Product::GradQuery => (&kern.dist_grad_query, DIST_GRAD_COLS, Some(&self.query)),
            Product::GradNegatives => (
                &kern.dist_grad_negatives,
                DIST_GRAD_COLS,
                Some(&self.neg_rows),
            ),
        };
        let tiles = (g.m as usize).div_ceil(DIST_ROWS) * (g.n as usize).div_ceil(cols);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, splits, batch),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dist = gpu.ptr(&self.dist);
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
