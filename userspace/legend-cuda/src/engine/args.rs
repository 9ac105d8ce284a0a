//! The kernels' argument structs, field for field as the CUDA sources declare them.

use cudarc::driver::DeviceRepr;

/// Operands of one batched product (`LegendGemm` in `kernels/gemm.cu`, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct GemmArgs {
    pub(super) a: u64,
    pub(super) a_batch: i64,
    pub(super) a_ld: i64,
    pub(super) b: u64,
    pub(super) b_batch: i64,
    pub(super) b_ld: i64,
    pub(super) c: u64,
    pub(super) c_batch: i64,
    pub(super) c_ld: i64,
    pub(super) m: i32,
    pub(super) n: i32,
    pub(super) k: i32,
    pub(super) m_rows: u64,
    pub(super) k_rows: u64,
    pub(super) k_split: i32,
    pub(super) atomic: i32,
    pub(super) a_vec: i32,
    pub(super) b_vec: i32,
    pub(super) c_vec: i32,
}

// SAFETY: plain #[repr(C)] data laid out as the kernel's struct (8-byte fields, then three
// ints padded to 8 before the next pointer, then five ints and tail padding to 8, exactly
// as C lays it out).
unsafe impl DeviceRepr for GemmArgs {}

/// A batch of row-major matrices of `rows × cols` floats, one after another from `ptr`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Matrices {
    pub(super) ptr: u64,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl GemmArgs {
    /// `c = a · b` for every batch entry (`b` as stored when the kernel transposes it): `m`,
    /// `n` and `k` the product's sizes; every row counts, nothing is split, `c` is written.
    pub(super) fn product(
        a: Matrices,
        b: Matrices,
        c: Matrices,
        (m, n, k): (usize, usize, usize),
    ) -> Self {
        // Floats between batch entries, and between rows.
        let strides = |x: Matrices| ((x.rows * x.cols) as i64, x.cols as i64);
        let ((a_batch, a_ld), (b_batch, b_ld), (c_batch, c_ld)) =
            (strides(a), strides(b), strides(c));
        GemmArgs {
            a: a.ptr,
            a_batch,
            a_ld,
            b: b.ptr,
            b_batch,
            b_ld,
            c: c.ptr,
            c_batch,
            c_ld,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            m_rows: 0,
            k_rows: 0,
            k_split: 0,
            atomic: 0,
            // Set per launch from the addresses (`launch_product`).
            a_vec: 0,
            b_vec: 0,
            c_vec: 0,
        }
    }

    /// Only the first `rows[batch entry]` of the `m` rows count (a device array of counts).
    pub(super) fn m_rows(self, rows: u64) -> Self {
        GemmArgs {
            m_rows: rows,
            ..self
        }
    }

    /// Only the first `rows[batch entry]` of the `k` dimension count, split into slices of
    /// `split` whose products add into `c` atomically (cleared first by the caller).
    pub(super) fn k_split(self, rows: u64, split: usize) -> Self {
        GemmArgs {
            k_rows: rows,
            k_split: split as i32,
            atomic: 1,
            ..self
        }
    }
}

/// The rows of a launch group (`LegendJobs` in `kernels/train_queries.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct JobArgs {
    pub(super) edges: u64,
    pub(super) row0: u64,
    pub(super) rows: u64,
    pub(super) absmax: u64,
    pub(super) query_norm: u64,
    pub(super) query_weight: u64,
    pub(super) first_job: u32,
    pub(super) max_rows: u32,
    pub(super) dim: u32,
    pub(super) decoder: i32,
    /// The first inverse relation row (reciprocal relations), 0 without them.
    pub(super) inverse: u32,
    /// The regulariser's number (`kernel_abi::PENALTY_CODES`) and weight (`LegendPenalty`).
    pub(super) penalty: i32,
    pub(super) penalty_weight: f32,
    pub(super) pad: u32,
}

// SAFETY: plain #[repr(C)] data laid out as the kernel's struct (six pointers, then eight
// 4-byte fields: no padding).
unsafe impl DeviceRepr for JobArgs {}

/// In-place AdaGrad for node rows used once (`LegendDirect` in `kernels/train_backward.cu`): the
/// node table's state and use counts (a null `uses` sends every row through the gradient
/// table), the optimizer's settings, and the rounding of the rows it updates.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct DirectArgs {
    pub(super) state: u64,
    pub(super) uses: u64,
    pub(super) lr: f32,
    pub(super) eps: f32,
    /// 1: the node table keeps one AdaGrad float a row.
    pub(super) row_wise: u32,
    pub(super) pad: u32,
    /// What `legend_adagrad` would round the rows to (all zeros: nothing).
    pub(super) rounding: RoundingArgs,
}

// SAFETY: plain #[repr(C)] data laid out as the kernel's struct (two pointers, two floats,
// two u32s, then the 8-byte aligned rounding struct: no padding).
unsafe impl DeviceRepr for DirectArgs {}

/// The rounding of updated node rows to their format at rest (`LegendRounding` in
/// `kernels/common.cuh`): legend-model's `StepRounding`, with the slot → partition map of a
/// slot-indexed table (0: rows are global ids) and the out-of-range report word.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RoundingArgs {
    /// legend-model's `BatchKey` of the step.
    pub(super) batch_key: u64,
    pub(super) partition_of_slot: u64,
    pub(super) out_of_range: u64,
    /// The format's index in `Dtype::ALL` (0, f32: nothing is rounded).
    pub(super) dtype: u32,
    pub(super) rows_per_slot: u32,
}

// SAFETY: plain #[repr(C)] data laid out as the kernel's struct (three 8-byte fields, then two
// u32s: no padding).
unsafe impl DeviceRepr for RoundingArgs {}

/// Buffers and sizes of the fused kernels (`LegendFused` in `kernels/fused.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct FusedArgs {
    pub(super) query: u64,
    pub(super) query_half: u64,
    pub(super) negs: u64,
    pub(super) pos: u64,
    pub(super) grad_pos: u64,
    pub(super) grad_query: u64,
    pub(super) grad_negs: u64,
    pub(super) g: u64,
    pub(super) corr: u64,
    pub(super) rows: u64,
    pub(super) absmax: u64,
    pub(super) loss_sum: u64,
    pub(super) query_norm: u64,
    pub(super) neg_norm: u64,
    pub(super) nearest: u64,
    pub(super) query_weight: u64,
    pub(super) neg_weight: u64,
    pub(super) jobs: u32,
    pub(super) max_rows: u32,
    pub(super) k: u32,
    pub(super) dim: u32,
    pub(super) dim_pad: u32,
    pub(super) loss: i32,
    pub(super) margin: f32,
    pub(super) row_split: u32,
    pub(super) atomic: i32,
}

// SAFETY: plain #[repr(C)] data laid out as the kernel's struct (seventeen pointers, then nine
// 4-byte fields: no padding inside; the kernel's struct ends padded to 8 bytes as this one).
unsafe impl DeviceRepr for FusedArgs {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn product_arguments_describe_their_row_major_batches() {
        let m = |ptr, rows, cols| Matrices { ptr, rows, cols };
        // S = Q · Nᵀ for 7 query rows, 5 negatives, d = 3.
        let s = GemmArgs::product(m(0x100, 7, 3), m(0x200, 5, 3), m(0x300, 7, 5), (7, 5, 3))
            .m_rows(0x400);
        let got = (s.a_batch, s.a_ld, s.b_batch, s.b_ld, s.c_batch, s.c_ld);
        assert_eq!(got, (21, 3, 15, 3, 35, 5));
        assert_eq!(
            (s.a, s.b, s.c, s.m, s.n, s.k),
            (0x100, 0x200, 0x300, 7, 5, 3)
        );
        assert_eq!((s.m_rows, s.k_rows, s.k_split, s.atomic), (0x400, 0, 0, 0));
        // dN = Gᵀ · Q, split over the query rows into atomic slices.
        let n = GemmArgs::product(m(0x300, 7, 5), m(0x100, 7, 3), m(0x500, 5, 3), (5, 3, 7))
            .k_split(0x400, 4);
        assert_eq!((n.m_rows, n.k_rows, n.k_split, n.atomic), (0, 0x400, 4, 1));
        assert_eq!((n.c_batch, n.c_ld, n.m, n.n, n.k), (15, 3, 5, 3, 7));
    }
}
