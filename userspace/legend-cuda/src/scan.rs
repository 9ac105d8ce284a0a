//! Exact top-K scans of an entity table on the GPU, for queries on a trained run (legend-query's
//! `predict` and `neighbors`): `kernels/scan.cu` says how a score is made bit-identical to the
//! CPU kernel's and how the K best are kept in the CPU's order.
//!
//! An [`EntityRows`] is a table of f32 rows in GPU memory (a served run's entities). A [`Scan`]
//! is one batch of query vectors: fed the resident table ([`Scan::resident`]) or rows from host
//! memory a piece at a time ([`Scan::host_rows`], a table larger than the GPU's memory), it
//! keeps each query's K best on the GPU and [`Scan::finish`] returns them, best first.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use legend_model::Comparator;

use crate::error::DriverContext;
use crate::gpu::grid_1d;
use crate::kernel_abi::{SELECT_SMEM, SELECT_SORT};
use crate::{Gpu, GpuError, Transfer};

/// The largest K a scan keeps on the GPU: the kept keys and a piece of candidates share the
/// selection's shared array (`kernel_abi::SELECT_SORT` entries).
pub const SCAN_MAX_TOP: usize = 2048;

/// The most query vectors one [`Scan`] takes (its candidate lists grow with them).
pub const SCAN_MAX_QUERIES: usize = 1024;

/// Ids a scan can rank: a key holds the id in 31 bits (`legend_scan_key`).
pub const SCAN_MAX_ROWS: u64 = 1 << 31;

/// Keys the candidate lists of a scan hold in all (128 MiB): a query's list holds a chunk's
/// rows, so fewer queries scan larger chunks (fewer launches).
const CANDIDATE_KEYS: usize = 1 << 24;

/// Bounds of the rows a chunk scores.
const MIN_CHUNK: usize = 4096;
const MAX_CHUNK: usize = 1 << 20;

/// Bytes of host rows staged on the GPU at a time by a streamed scan.
const STAGE_BYTES: usize = 256 << 20;

/// GPU memory a [`Scan`] may take beside the table: its candidate lists, its stage of host rows
/// and their norms, and the query vectors and kept keys of a full batch.
pub const SCAN_WORKING_BYTES: u64 = (CANDIDATE_KEYS * 8 + STAGE_BYTES + (64 << 20)) as u64;

/// `LegendScanScore` of `kernels/scan.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ScoreArgs {
    queries: u64,
    rows: u64,
    norms: u64,
    thresholds: u64,
    excl_start: u64,
    excl: u64,
    cand: u64,
    cand_count: u64,
    first_id: u64,
    n: u32,
    nq: u32,
    dim: u32,
    cap: u32,
    comparator: u32,
    fused: u32,
}

/// `LegendScanSelect`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SelectArgs {
    cand: u64,
    cand_count: u64,
    top: u64,
    top_count: u64,
    thresholds: u64,
    tops: u64,
    cap: u32,
    kmax: u32,
    sort: u32,
    pad: u32,
}

// SAFETY: plain `repr(C)` structs of integers, laid out as their CUDA twins.
unsafe impl DeviceRepr for ScoreArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for SelectArgs {}

/// How a scan scores a query vector against a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanScoring {
    /// The comparator (dot, L1, L2; RotatE's modulus is not scanned on the GPU).
    pub comparator: Comparator,
    /// Each element's step is a fused multiply-add, as the CPU kernel's AVX2 + FMA path does
    /// (else a rounded multiply, then a rounded add: its portable path).
    pub fused: bool,
    /// Rows are compared scaled to unit length (cosine neighbours; the queries are already).
    pub unit_rows: bool,
}

impl ScanScoring {
    fn comparator_code(&self) -> Result<u32, GpuError> {
        match self.comparator {
            Comparator::Dot => Ok(0),
            Comparator::NegL1 => Ok(1),
            Comparator::NegL2 => Ok(2),
            Comparator::NegModulus => Err(GpuError::Shape(
                "the GPU scan has no modulus comparator (RotatE scans on the CPU)".into(),
            )),
        }
    }
}

/// An entity table of f32 rows in GPU memory, with each row's norm once a cosine scan asked.
pub struct EntityRows {
    rows: CudaSlice<f32>,
    len: usize,
    dim: usize,
    norms: Option<CudaSlice<f32>>,
}

impl EntityRows {
    /// Bytes of GPU memory a table of `len` rows of `dim` takes, norms included.
    pub fn bytes(len: usize, dim: usize) -> u64 {
        len as u64 * (dim as u64 + 1) * 4
    }

    /// A table of `len` rows of `dim` zeros, filled with [`EntityRows::write`].
    ///
    /// # Errors
    ///
    /// Driver errors (out of memory).
    pub fn new(gpu: &Gpu, len: usize, dim: usize) -> Result<EntityRows, GpuError> {
        if dim == 0 {
            return Err(GpuError::Shape("entity rows of 0 floats".into()));
        }
        Ok(EntityRows {
            rows: gpu.zeros(len * dim)?,
            len,
            dim,
            norms: None,
        })
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Floats a row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Fills the whole table (`len × dim` floats, row-major, as bytes) through `transfer`'s
    /// pinned staging: `fill` writes each staging chunk's bytes in order (see
    /// [`Transfer::upload_filled`]), a run's table read from its checkpoint file straight into
    /// pinned memory on every core while the chunk before is on its way to the device; where
    /// [`EntityRows::write`]'s copy through the driver's staging runs on one thread, after the
    /// rows were read. Work queued on the compute stream later waits for it.
    ///
    /// # Errors
    ///
    /// `fill`'s first error; driver errors.
    pub fn fill<E: From<GpuError>>(
        &mut self,
        transfer: &mut Transfer,
        fill: crate::transfer::Fill<'_, E>,
    ) -> Result<(), E> {
        // Rows change (or some do, when `fill` fails): their norms are stale.
        self.norms = None;
        let bytes = self.len * self.dim * size_of::<f32>();
        transfer.upload_filled(&mut self.rows, bytes, fill)
    }

    /// Copies `rows` (whole rows) into the table from row `first`.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for rows past the table's end; driver errors.
    pub fn write(&mut self, gpu: &Gpu, first: usize, rows: &[f32]) -> Result<(), GpuError> {
        let n = rows.len() / self.dim;
        if !rows.len().is_multiple_of(self.dim) || first + n > self.len {
            return Err(GpuError::Shape(format!(
                "{} floats from row {first} into a table of {} rows of {}",
                rows.len(),
                self.len,
                self.dim
            )));
        }
        let mut view = self
            .rows
            .slice_mut(first * self.dim..(first + n) * self.dim);
        gpu.stream()
            .memcpy_htod(rows, &mut view)
            .during("copying entity rows to the device")?;
        // Rows changed: their norms are stale.
        self.norms = None;
        Ok(())
    }

    /// Rows `first..first + n`, to the host.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] past the table's end; driver errors.
    pub fn read(&self, gpu: &Gpu, first: usize, n: usize) -> Result<Vec<f32>, GpuError> {
        if first + n > self.len {
            return Err(GpuError::Shape(format!(
                "rows {first}..{} of a table of {}",
                first + n,
                self.len
            )));
        }
        let view = self.rows.slice(first * self.dim..(first + n) * self.dim);
        let mut out = vec![0.0; n * self.dim];
        gpu.stream()
            .memcpy_dtoh(&view, &mut out)
            .during("copying entity rows from the device")?;
        Ok(out)
    }

    /// The rows `ids` (each below [`EntityRows::len`]), in order, concatenated.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for an id past the table; driver errors.
    pub fn gather(&self, gpu: &Gpu, ids: &[u32]) -> Result<Vec<f32>, GpuError> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.len) {
            return Err(GpuError::Shape(format!(
                "row {bad} of a table of {}",
                self.len
            )));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let n = u32::try_from(ids.len())
            .map_err(|_| GpuError::Shape(format!("{} rows in one gather", ids.len())))?;
        let dim = self.dim as u32;
        let ids_dev = gpu.upload(ids)?;
        let mut out = gpu.zeros::<f32>(ids.len() * self.dim)?;
        let mut b = gpu.stream().launch_builder(&gpu.kernels.scan_gather);
        b.arg(&self.rows)
            .arg(&dim)
            .arg(&ids_dev)
            .arg(&n)
            .arg(&mut out);
        // SAFETY: the arguments match `legend_scan_gather(const float*, u32, const u32*, u32,
        // float*)`; every id is below `len` (checked), `rows` holds len x dim floats and `out`
        // n x dim.
        unsafe { b.launch(grid_1d(u64::from(n) * u64::from(dim))?) }
            .during("launching legend_scan_gather")?;
        gpu.download(&out)
    }

    /// The rows' norms, computed on first use.
    fn norms(&mut self, gpu: &Gpu) -> Result<&CudaSlice<f32>, GpuError> {
        if self.norms.is_none() {
            let mut norms = gpu.zeros::<f32>(self.len)?;
            launch_norms(gpu, &self.rows, self.len, self.dim, &mut norms)?;
            self.norms = Some(norms);
        }
        Ok(self.norms.as_ref().expect("just set"))
    }
}

/// `legend_scan_norms` over `n` rows of `dim` in `rows` into `out`.
fn launch_norms(
    gpu: &Gpu,
    rows: &CudaSlice<f32>,
    n: usize,
    dim: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    if n == 0 {
        return Ok(());
    }
    let (n64, dim32) = (n as u64, dim as u32);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.scan_norms);
    b.arg(rows).arg(&n64).arg(&dim32).arg(out);
    // SAFETY: the arguments match `legend_scan_norms(const float*, u64, u32, float*)`; `rows`
    // holds at least n x dim floats and `out` n.
    unsafe { b.launch(grid_1d(n64)?) }.during("launching legend_scan_norms")?;
    Ok(())
}

/// One batch of query vectors scanned against a table on the GPU.
pub struct Scan<'g> {
    gpu: &'g Gpu,
    scoring: ScanScoring,
    comparator: u32,
    dim: usize,
    nq: usize,
    kmax: usize,
    /// Rows a chunk scores at most: what a query's candidate list holds.
    cap: usize,
    queries: CudaSlice<f32>,
    tops: CudaSlice<u32>,
    thresholds: CudaSlice<u64>,
    excl_start: CudaSlice<u32>,
    excl: CudaSlice<u32>,
    cand: CudaSlice<u64>,
    cand_count: CudaSlice<u32>,
    top: CudaSlice<u64>,
    top_count: CudaSlice<u32>,
    /// Host rows staged for a streamed scan, and their norms.
    stage: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Rows scanned so far (each id once, in order).
    scanned: u64,
}

impl<'g> Scan<'g> {
    /// A scan of the `queries` (row-major, `dim` floats each) keeping `tops[q]` rows for query
    /// q (1 to [`SCAN_MAX_TOP`]), leaving out the ascending ids `excluded[q]`.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for inconsistent arguments (named), more than
    /// [`SCAN_MAX_QUERIES`] queries or a K out of range; driver errors.
    pub fn new(
        gpu: &'g Gpu,
        scoring: ScanScoring,
        queries: &[f32],
        dim: usize,
        tops: &[usize],
        excluded: &[&[u32]],
    ) -> Result<Scan<'g>, GpuError> {
        let comparator = scoring.comparator_code()?;
        let nq = tops.len();
        if dim == 0 || queries.len() != nq * dim || excluded.len() != nq {
            return Err(GpuError::Shape(format!(
                "{} query floats, {nq} tops and {} exclusion lists for rows of {dim}",
                queries.len(),
                excluded.len()
            )));
        }
        if nq == 0 || nq > SCAN_MAX_QUERIES {
            return Err(GpuError::Shape(format!(
                "{nq} queries in one scan (1 to {SCAN_MAX_QUERIES})"
            )));
        }
        if let Some(k) = tops.iter().find(|&&k| k == 0 || k > SCAN_MAX_TOP) {
            return Err(GpuError::Shape(format!(
                "a scan keeps 1 to {SCAN_MAX_TOP} rows a query, not {k}"
            )));
        }
        let kmax = tops.iter().copied().max().expect("at least one query");
        let cap = (CANDIDATE_KEYS / nq).clamp(MIN_CHUNK, MAX_CHUNK);
        let mut starts = Vec::with_capacity(nq + 1);
        let mut ids: Vec<u32> = Vec::new();
        starts.push(0u32);
        for list in excluded {
            ids.extend_from_slice(list);
            starts.push(
                u32::try_from(ids.len()).map_err(|_| {
                    GpuError::Shape(format!("{} ids left out of one scan", ids.len()))
                })?,
            );
        }
        let tops32: Vec<u32> = tops.iter().map(|&k| k as u32).collect();
        let mut scan = Scan {
            gpu,
            scoring,
            comparator,
            dim,
            nq,
            kmax,
            cap,
            queries: gpu.upload(queries)?,
            tops: gpu.upload(&tops32)?,
            thresholds: gpu.zeros(nq)?,
            excl_start: gpu.upload(&starts)?,
            excl: gpu.upload(&ids)?,
            cand: gpu.zeros(nq * cap)?,
            cand_count: gpu.zeros(nq)?,
            top: gpu.zeros(nq * kmax)?,
            top_count: gpu.zeros(nq)?,
            stage: None,
            scanned: 0,
        };
        let nq32 = nq as u32;
        let mut b = gpu.stream().launch_builder(&gpu.kernels.scan_reset);
        b.arg(&mut scan.thresholds)
            .arg(&mut scan.top_count)
            .arg(&mut scan.cand_count)
            .arg(&nq32);
        // SAFETY: the arguments match `legend_scan_reset(u64*, u32*, u32*, u32)`; each buffer
        // holds nq entries.
        unsafe { b.launch(grid_1d(nq as u64)?) }.during("launching legend_scan_reset")?;
        Ok(scan)
    }

    /// Scans every row of `table` (its ids from the scan's next id, normally 0).
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for a table of another width, or ids past [`SCAN_MAX_ROWS`];
    /// driver errors.
    pub fn resident(&mut self, table: &mut EntityRows) -> Result<(), GpuError> {
        if table.dim != self.dim {
            return Err(GpuError::Shape(format!(
                "a table of rows of {} scanned with queries of {}",
                table.dim, self.dim
            )));
        }
        let gpu = self.gpu;
        let rows = gpu.ptr(&table.rows);
        let norms = if self.scoring.unit_rows {
            gpu.ptr(table.norms(gpu)?)
        } else {
            0
        };
        let mut first = 0;
        while first < table.len {
            let n = self.cap.min(table.len - first);
            let (at, norms_at) = (
                rows + (first * self.dim * 4) as u64,
                norms_offset(norms, first),
            );
            self.chunk(at, norms_at, n)?;
            first += n;
        }
        Ok(())
    }

    /// Scans `rows` (whole rows, host memory), the next ids of the table.
    ///
    /// # Errors
    ///
    /// As [`Scan::resident`].
    pub fn host_rows(&mut self, rows: &[f32]) -> Result<(), GpuError> {
        if !rows.len().is_multiple_of(self.dim) {
            return Err(GpuError::Shape(format!(
                "{} floats are not whole rows of {}",
                rows.len(),
                self.dim
            )));
        }
        let gpu = self.gpu;
        let per = self.cap.min((STAGE_BYTES / (self.dim * 4)).max(1));
        if self.stage.is_none() {
            self.stage = Some((gpu.zeros(per * self.dim)?, gpu.zeros(per)?));
        }
        for piece in rows.chunks(per * self.dim) {
            let n = piece.len() / self.dim;
            let (stage, norms) = self.stage.as_mut().expect("made above");
            gpu.write(piece, stage)?;
            let norms_at = if self.scoring.unit_rows {
                launch_norms(gpu, stage, n, self.dim, norms)?;
                gpu.ptr(norms)
            } else {
                0
            };
            let at = gpu.ptr(stage);
            // The next piece's copy into the stage is queued behind this one's kernels.
            self.chunk(at, norms_at, n)?;
        }
        Ok(())
    }

    /// Scores `n` rows at device address `rows` (norms at `norms`, or 0), the next ids, then
    /// merges what passed into each query's best.
    fn chunk(&mut self, rows: u64, norms: u64, n: usize) -> Result<(), GpuError> {
        debug_assert!(n <= self.cap);
        if self.scanned + n as u64 > SCAN_MAX_ROWS {
            return Err(GpuError::Shape(format!(
                "a scan ranks at most {SCAN_MAX_ROWS} rows"
            )));
        }
        let gpu = self.gpu;
        let score = ScoreArgs {
            queries: gpu.ptr(&self.queries),
            rows,
            norms,
            thresholds: gpu.ptr(&self.thresholds),
            excl_start: gpu.ptr(&self.excl_start),
            excl: gpu.ptr(&self.excl),
            cand: gpu.ptr(&self.cand),
            cand_count: gpu.ptr(&self.cand_count),
            first_id: self.scanned,
            n: n as u32,
            nq: self.nq as u32,
            dim: self.dim as u32,
            cap: self.cap as u32,
            comparator: self.comparator,
            fused: u32::from(self.scoring.fused),
        };
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, self.nq.div_ceil(32) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(&gpu.kernels.scan_score);
        b.arg(&score);
        // SAFETY: the argument is `LegendScanScore` by value, laid out as its twin: the queries
        // (nq x dim), thresholds, counts and starts (nq, nq + 1), the candidate lists (nq x cap,
        // n <= cap) and the rows (n x dim, and n norms when given) are live device memory the
        // caller keeps until the stream has run the launch.
        unsafe { b.launch(cfg) }.during("launching legend_scan_score")?;
        let select = SelectArgs {
            cand: score.cand,
            cand_count: score.cand_count,
            top: gpu.ptr(&self.top),
            top_count: gpu.ptr(&self.top_count),
            thresholds: score.thresholds,
            tops: gpu.ptr(&self.tops),
            cap: self.cap as u32,
            kmax: self.kmax as u32,
            sort: SELECT_SORT,
            pad: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: (self.nq as u32, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: SELECT_SMEM,
        };
        let mut b = gpu.stream().launch_builder(&gpu.kernels.scan_select);
        b.arg(&select);
        // SAFETY: `LegendScanSelect` by value; the lists as above, the kept keys nq x kmax, the
        // K of each query at most kmax <= SCAN_MAX_TOP, so kept keys plus a piece fit the
        // SELECT_SORT entries of shared memory the launch gives.
        unsafe { b.launch(cfg) }.during("launching legend_scan_select")?;
        self.scanned += n as u64;
        Ok(())
    }

    /// Each query's kept rows, best first: (id, score).
    ///
    /// # Errors
    ///
    /// Driver errors (of this or an earlier launch).
    pub fn finish(self) -> Result<Vec<Vec<(u32, f32)>>, GpuError> {
        let keys = self.gpu.download(&self.top)?;
        let counts = self.gpu.download(&self.top_count)?;
        Ok(counts
            .iter()
            .zip(keys.chunks_exact(self.kmax))
            .map(|(&kept, keys)| keys[..kept as usize].iter().map(|&k| decode(k)).collect())
            .collect())
    }
}

/// The device address of norm `first` of the norms at `norms` (0: none).
fn norms_offset(norms: u64, first: usize) -> u64 {
    if norms == 0 {
        0
    } else {
        norms + (first * 4) as u64
    }
}

/// The id and score of a key (`legend_scan_key`): NaN for a NaN score, -0 kept.
fn decode(key: u64) -> (u32, f32) {
    let b = (key >> 32) as u32;
    let id = ((key >> 1) & 0x7fff_ffff) as u32;
    let score = if b == u32::MAX {
        f32::NAN
    } else if key & 1 == 1 {
        -0.0
    } else {
        let ascending = !b;
        f32::from_bits(if ascending & 0x8000_0000 != 0 {
            ascending & 0x7fff_ffff
        } else {
            !ascending
        })
    };
    (id, score)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `legend_scan_key`, written again for the test.
    fn key(score: f32, id: u32) -> u64 {
        let (b, negative_zero) = if score.is_nan() {
            (u32::MAX, 0)
        } else {
            let (u, nz) = match score.to_bits() {
                0x8000_0000 => (0, 1),
                u => (u, 0),
            };
            let ascending = if u & 0x8000_0000 != 0 {
                !u
            } else {
                u | 0x8000_0000
            };
            (!ascending, nz)
        };
        (u64::from(b) << 32) | (u64::from(id) << 1) | negative_zero
    }

    #[test]
    fn keys_order_as_the_cpu_ranks_and_decode_to_their_scores() {
        let scores = [
            1.5,
            -2.0,
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1.5,
            f32::MAX,
            f32::MIN,
        ];
        let mut pairs: Vec<(u32, f32)> = scores
            .iter()
            .enumerate()
            .map(|(id, &s)| (id as u32, s))
            .collect();
        for &(id, s) in &pairs {
            let (got_id, got) = decode(key(s, id));
            assert_eq!(got_id, id);
            assert!(
                got.to_bits() == s.to_bits() || (got.is_nan() && s.is_nan()),
                "{s}"
            );
        }
        // Smaller key first: higher score, equal scores (-0 == 0) by id, NaN last.
        pairs.sort_by_key(|&(id, s)| key(s, id));
        let ids: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        assert_eq!(ids, [4, 10, 0, 9, 7, 2, 3, 8, 1, 11, 5, 6]);
    }
}
