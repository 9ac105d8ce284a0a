//! Parameter tables on the device and their initialisation by the kernels' RNG.

use std::ops::Range;

use cudarc::driver::{CudaSlice, PushKernelArg};
use legend_model::{Distribution, StateLayout, Table};

use crate::error::DriverContext;
use crate::{Gpu, GpuError, RowSpan};

/// A parameter table on the device: embeddings, AdaGrad state, and the per-batch gradient
/// accumulator with its touched-row list and each row's use count (all left cleared between
/// steps).
pub struct DeviceTable {
    pub(super) rows: usize,
    pub(super) dim: usize,
    /// AdaGrad accumulators per row: `dim` or 1 (row-wise).
    pub(super) state_width: usize,
    pub(super) emb: CudaSlice<f32>,
    pub(super) state: CudaSlice<f32>,
    pub(super) grad: CudaSlice<f32>,
    pub(super) flags: CudaSlice<u32>,
    pub(super) list: CudaSlice<u32>,
    pub(super) count: CudaSlice<u32>,
    /// Uses of each row by the current batch (`legend_count_uses`, [`GpuBatchEngine::step`]).
    pub(super) uses: CudaSlice<u32>,
}

impl DeviceTable {
    /// The gradient accumulator's address and floats (rows × dim): what a step of several
    /// GPUs sums over them between the passes and AdaGrad.
    pub fn gradient_span(&self) -> (u64, usize) {
        (crate::addr(&self.grad), self.rows * self.dim)
    }

    /// A table holding copies of `emb` (`rows × dim`) and `state` (`rows × dim`, or `rows`
    /// for row-wise AdaGrad).
    pub fn from_host(gpu: &Gpu, dim: usize, emb: &[f32], state: &[f32]) -> Result<Self, GpuError> {
        let rows = emb.len().checked_div(dim).unwrap_or(0);
        let state_width = if state.len() == emb.len() { dim } else { 1 };
        if dim == 0 || rows * dim != emb.len() || state.len() != rows * state_width {
            return Err(GpuError::Shape(format!(
                "table of {} floats and state of {} for dim {dim}",
                emb.len(),
                state.len()
            )));
        }
        Ok(DeviceTable {
            rows,
            dim,
            state_width,
            emb: gpu.upload(emb)?,
            state: gpu.upload(state)?,
            grad: gpu.zeros(rows * dim)?,
            flags: gpu.zeros(rows)?,
            list: gpu.zeros(rows)?,
            count: gpu.zeros(1)?,
            uses: gpu.zeros(rows)?,
        })
    }

    /// A table of `rows` zero rows with AdaGrad state of `layout` (a partition buffer's
    /// slots, filled by [`DeviceTable::write_rows`]).
    pub fn zeros(
        gpu: &Gpu,
        rows: usize,
        dim: usize,
        layout: StateLayout,
    ) -> Result<Self, GpuError> {
        if dim == 0 {
            return Err(GpuError::Shape("a table of dim 0".into()));
        }
        let state_width = layout.width(dim);
        Ok(DeviceTable {
            rows,
            dim,
            state_width,
            emb: gpu.zeros(rows * dim)?,
            state: gpu.zeros(rows * state_width)?,
            grad: gpu.zeros(rows * dim)?,
            flags: gpu.zeros(rows)?,
            list: gpu.zeros(rows)?,
            count: gpu.zeros(1)?,
            uses: gpu.zeros(rows)?,
        })
    }

    /// A table of `rows` rows initialised on the device by the counter-based hash of
    /// legend-model's `fill_row` (row `i` is global row `first_row + i` of `table`), with a
    /// zero element-wise AdaGrad state.
    pub fn init(
        gpu: &Gpu,
        rows: usize,
        dim: usize,
        first_row: u64,
        seed: u64,
        table: Table,
        dist: Distribution,
    ) -> Result<Self, GpuError> {
        let mut t = Self::zeros(gpu, rows, dim, StateLayout::Element)?;
        fill(gpu, &mut t.emb, rows, dim, first_row, seed, table, dist)?;
        Ok(t)
    }

    /// Rows of the table.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Floats per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// AdaGrad accumulators per row: [`DeviceTable::dim`] or 1.
    pub fn state_width(&self) -> usize {
        self.state_width
    }

    /// The embeddings, `rows × dim` row-major.
    pub fn emb(&self) -> &CudaSlice<f32> {
        &self.emb
    }

    /// The embeddings, writable (for swaps in and out of a partition buffer).
    pub fn emb_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.emb
    }

    /// The AdaGrad state, `rows × state_width`.
    pub fn state(&self) -> &CudaSlice<f32> {
        &self.state
    }

    /// Host copies of the embeddings and the state (waits for the device).
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
        Ok((gpu.download(&self.emb)?, gpu.download(&self.state)?))
    }

    /// Copies `emb` and `state` (whole rows) into the table from row `row0` on,
    /// stream-ordered (for loading a partition into a slot).
    pub fn write_rows(
        &mut self,
        gpu: &Gpu,
        row0: usize,
        emb: &[f32],
        state: &[f32],
    ) -> Result<(), GpuError> {
        let (e, st) = self.spans(row0, emb.len(), state.len())?;
        let s = gpu.stream();
        s.memcpy_htod(emb, &mut self.emb.slice_mut(e))
            .during("copying rows to the device")?;
        s.memcpy_htod(state, &mut self.state.slice_mut(st))
            .during("copying rows to the device")
    }

    /// Copies rows from `row0` on into `emb` and `state` (whole rows), after the work queued
    /// so far (for writing a slot back to its partition).
    pub fn read_rows(
        &self,
        gpu: &Gpu,
        row0: usize,
        emb: &mut [f32],
        state: &mut [f32],
    ) -> Result<(), GpuError> {
        let (e, st) = self.spans(row0, emb.len(), state.len())?;
        let s = gpu.stream();
        s.memcpy_dtoh(&self.emb.slice(e), emb)
            .during("copying rows from the device")?;
        s.memcpy_dtoh(&self.state.slice(st), state)
            .during("copying rows from the device")?;
        s.synchronize().during("copying rows from the device")
    }

    /// The device addresses of `rows` rows of embeddings and state from row `row0`, for
    /// copies on a [`crate::Transfer`].
    pub fn row_span(&self, row0: usize, rows: usize) -> Result<RowSpan, GpuError> {
        let (emb, state) = self.spans(row0, rows * self.dim, rows * self.state_width)?;
        Ok(RowSpan::new(&self.emb, emb, &self.state, state, self.dim))
    }

    /// The float ranges of `len` floats of embeddings and `state_len` of state from row
    /// `row0`: whole rows, the same rows of both.
    fn spans(
        &self,
        row0: usize,
        len: usize,
        state_len: usize,
    ) -> Result<(Range<usize>, Range<usize>), GpuError> {
        let rows = len / self.dim;
        if rows * self.dim != len || rows * self.state_width != state_len || row0 + rows > self.rows
        {
            return Err(GpuError::Shape(format!(
                "{len} floats ({state_len} of state) from row {row0} of a {}×{} table ({} of state a row)",
                self.rows, self.dim, self.state_width
            )));
        }
        let at = |width: usize| row0 * width..(row0 + rows) * width;
        Ok((at(self.dim), at(self.state_width)))
    }

    /// The gradients summed by [`GpuBatchEngine::forward_backward`] and not yet applied
    /// (all zeros outside a step), for checks.
    pub fn pending_gradients(&self, gpu: &Gpu) -> Result<Vec<f32>, GpuError> {
        gpu.download(&self.grad)
    }

    /// Each row's use count (all zeros outside a step), for checks.
    pub fn pending_uses(&self, gpu: &Gpu) -> Result<Vec<u32>, GpuError> {
        gpu.download(&self.uses)
    }
}

/// `legend_init_rows`' table tag, normal flag and scale for rows of `table` drawn from `dist`.
pub(crate) fn init_params(table: Table, dist: Distribution) -> (u32, bool, f32) {
    let tag = match table {
        Table::Node => 0,
        Table::Relation => 1,
        Table::InverseRelation => 2,
    };
    match dist {
        Distribution::Normal { std } => (tag, true, std),
        Distribution::Uniform { bound } => (tag, false, bound),
    }
}

#[allow(clippy::too_many_arguments)]
fn fill(
    gpu: &Gpu,
    out: &mut CudaSlice<f32>,
    rows: usize,
    dim: usize,
    first_row: u64,
    seed: u64,
    table: Table,
    dist: Distribution,
) -> Result<(), GpuError> {
    let (tag, normal, scale) = init_params(table, dist);
    let rows32 =
        u32::try_from(rows).map_err(|_| GpuError::Shape(format!("{rows} rows in one launch")))?;
    if out.len() < rows * dim {
        return Err(GpuError::Shape("init output too short".into()));
    }
    gpu.launch_init(out, first_row, rows32, dim as u32, seed, tag, normal, scale)
}

/// Fills `out` (at least `rows × dim` floats) with rows `first_row..first_row + rows` of
/// `table` as legend-model's `fill_row` draws them.
#[allow(clippy::too_many_arguments)]
pub fn init_rows(
    gpu: &Gpu,
    out: &mut CudaSlice<f32>,
    dim: usize,
    first_row: u64,
    rows: usize,
    seed: u64,
    table: Table,
    dist: Distribution,
) -> Result<(), GpuError> {
    fill(gpu, out, rows, dim, first_row, seed, table, dist)
}

/// `(mix(a), draw(a, b), below(a, c), key(a, [b, c]))` of each input `(a, b, c)`, by the
/// kernels' own RNG functions (`legend_rng_vectors`): the GPU side of the shared test vectors.
pub fn rng_vectors(gpu: &Gpu, inputs: &[[u64; 3]]) -> Result<Vec<[u64; 4]>, GpuError> {
    let flat: Vec<u64> = inputs.iter().flatten().copied().collect();
    let n = inputs.len() as u32;
    let input = gpu.upload(&flat)?;
    let mut out = gpu.zeros::<u64>(4 * inputs.len())?;
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rng_vectors);
    b.arg(&input).arg(&n).arg(&mut out);
    // SAFETY: `input` holds 3 values per input and `out` 4; the kernel touches no more.
    unsafe { b.launch(crate::gpu::grid_1d(u64::from(n))?) }
        .during("launching legend_rng_vectors")?;
    let out = gpu.download(&out)?;
    Ok(out
        .chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect())
}
