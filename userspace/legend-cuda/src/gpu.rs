//! A CUDA device: context, stream and the loaded kernels.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::error::DriverContext;
use crate::kernel_abi::{GEMM_SMEM, SELECT_SMEM};
use crate::{GpuError, nvrtc};

/// The kernels, each from the module of its program (`nvrtc::PROGRAMS`).
pub(crate) struct Kernels {
    pub(crate) init_rows: CudaFunction,
    /// Node rows to and from their 16-bit format at rest (`kernels/init.cu`).
    pub(crate) narrow_rows: CudaFunction,
    pub(crate) widen_rows: CudaFunction,
    pub(crate) rng_vectors: CudaFunction,
    pub(crate) sample: CudaFunction,
    pub(crate) remap: CudaFunction,
    pub(crate) gather_batch: CudaFunction,
    pub(crate) gemm_nt: CudaFunction,
    pub(crate) gemm_nn: CudaFunction,
    pub(crate) gemm_tn: CudaFunction,
    pub(crate) dist_scores: CudaFunction,
    pub(crate) dist_grad_query: CudaFunction,
    pub(crate) dist_grad_negatives: CudaFunction,
    pub(crate) queries: CudaFunction,
    pub(crate) gather_negatives: CudaFunction,
    pub(crate) loss: CudaFunction,
    pub(crate) rows_backward: CudaFunction,
    /// The rows backward whose in-place steps round (16-bit node rows).
    pub(crate) rows_backward_rounded: CudaFunction,
    pub(crate) rows_backward_extra: CudaFunction,
    pub(crate) negatives_backward: CudaFunction,
    pub(crate) adagrad: CudaFunction,
    pub(crate) count_uses: CudaFunction,
    pub(crate) filter_known: CudaFunction,
    /// RotatE's queries and rows backward, and its modulus-distance products
    /// (`kernels/rotate.cu`).
    pub(crate) rotate_queries: CudaFunction,
    pub(crate) rotate_rows_backward: CudaFunction,
    pub(crate) modulus_scores: CudaFunction,
    pub(crate) modulus_grad_query: CudaFunction,
    pub(crate) modulus_grad_negatives: CudaFunction,
    /// RESCAL's queries and rows backward (`kernels/rescal.cu`).
    pub(crate) rescal_queries: CudaFunction,
    pub(crate) rescal_rows_backward: CudaFunction,
    /// The fused kernels' operand scales, FP16 copy of the negatives and (TransE L2) the
    /// operands' squared norms.
    pub(crate) fused_absmax: CudaFunction,
    pub(crate) gather_negatives_half: CudaFunction,
    pub(crate) fused_negative_norms: CudaFunction,
    /// The fused product kernels, the dot decoders' then TransE L2's, narrowest padded width
    /// first.
    pub(crate) fused: Vec<FusedKernels>,
    /// GPU-initiated NVMe I/O (`kernels/nvme_io.cu`) and its SQE test vectors.
    pub(crate) nvme_io: CudaFunction,
    pub(crate) sqe_vectors: CudaFunction,
    /// The row cache's lookups through the same queues.
    pub(crate) row_cache_lookup: CudaFunction,
    /// Exact top-K scans of an entity table for queries (`kernels/scan.cu`).
    pub(crate) scan_score: CudaFunction,
    pub(crate) scan_select: CudaFunction,
    pub(crate) scan_reset: CudaFunction,
    pub(crate) scan_norms: CudaFunction,
    pub(crate) scan_gather: CudaFunction,
}

/// The fused score/loss/gradient kernels of one padded width (`kernels/fused*.cu*`).
pub(crate) struct FusedKernels {
    /// Widest rows (d) the pair handles: its fragments span `width` columns.
    pub(crate) width: usize,
    /// Whether the pair is TransE L2's (`LEGEND_FUSED_TRANSE`), else the dot decoders'.
    pub(crate) transe: bool,
    /// How they are launched.
    pub(crate) launch: FusedLaunch,
    pub(crate) rows: CudaFunction,
    pub(crate) negatives: CudaFunction,
}

/// How a program's fused kernels are launched, as the program itself says
/// (`legend_fused_launch`, a `LegendFusedLaunch` in `kernels/fused_launch.cu`): the kernels' shapes
/// and shared memory differ by architecture and live with their code only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FusedLaunch {
    /// Threads a block of the rows kernel.
    pub(crate) rows_threads: u32,
    /// Dynamic shared memory of the rows kernel.
    pub(crate) rows_smem: u32,
    /// Non-zero: the rows kernel is persistent (a block a multiprocessor walks the group's
    /// blocks of rows); zero: a block a 128 rows of a job, the jobs along y.
    pub(crate) rows_persistent: u32,
    /// Threads a block of the negatives kernel.
    pub(crate) negatives_threads: u32,
    /// Dynamic shared memory of the negatives kernel.
    pub(crate) negatives_smem: u32,
}

/// The NVRTC target for a device of compute capability `major.minor`: Hopper (9.0) gets
/// the arch-specific `sm_90a`, whose warpgroup products (wgmma) the fused kernels use;
/// other devices their own `sm_XY`, and the fused kernels' mma.sync path. A non-empty
/// `LEGEND_CUDA_ARCH` overrides it (e.g. `sm_90` on an H100, to run and time the mma.sync
/// path there).
fn kernel_arch(major: i32, minor: i32) -> String {
    match std::env::var("LEGEND_CUDA_ARCH") {
        Ok(arch) if !arch.is_empty() => arch,
        _ if (major, minor) == (9, 0) => "sm_90a".to_string(),
        _ => format!("sm_{major}{minor}"),
    }
}

/// One CUDA device with a stream and the Legend kernels loaded on it.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    arch: String,
    multiprocessors: usize,
    /// Blocks of the GPU I/O kernels running now (each holds a multiprocessor's worth of
    /// room that a persistent kernel's block cannot share).
    io_blocks: Arc<AtomicUsize>,
    pub(crate) kernels: Kernels,
}

/// Whether the CUDA driver library can be loaded (cudarc panics on its first call otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Bytes of memory of CUDA device `ordinal`, read without loading the kernels (what a service
/// shares between its jobs).
///
/// # Errors
///
/// No driver, no such device, driver errors.
pub fn device_memory(ordinal: usize) -> Result<usize, GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    context(ordinal)?
        .total_mem()
        .during("reading the device memory size")
}

/// CUDA devices this process sees (0 without a driver).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// The context of device `ordinal`, once the driver reports that it exists (the driver must be
/// present: cudarc panics otherwise).
fn context(ordinal: usize) -> Result<Arc<CudaContext>, GpuError> {
    let count = CudaContext::device_count()
        .during("counting devices")?
        .max(0) as usize;
    if ordinal >= count {
        return Err(GpuError::NoDevice { ordinal, count });
    }
    CudaContext::new(ordinal).during("creating the context")
}

impl Gpu {
    /// Opens device `ordinal`: checks that the driver and NVRTC load and that the device
    /// exists, then compiles (or takes from the kernel cache) and loads the kernels.
    pub fn new(ordinal: usize) -> Result<Gpu, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        if !nvrtc::nvrtc_present() {
            return Err(GpuError::NoNvrtc);
        }
        let ctx = context(ordinal)?;
        // SAFETY: the engine runs all its work on one stream, in order, and frees nothing
        // while work that uses it is queued (buffers live in the engine until it drops,
        // and dropping a CudaSlice frees it stream-ordered), so cudarc's per-buffer events
        // are not needed; they would cost an event record per kernel argument.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().during("creating a stream")?;
        let (major, minor) = ctx
            .compute_capability()
            .during("reading the compute capability")?;
        let arch = kernel_arch(major, minor);
        let name = ctx.name().during("reading the device name")?;
        let multiprocessors = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during("reading the multiprocessor count")?
            .max(1) as usize;
        let modules = nvrtc::cached_programs(&arch)?
            .into_iter()
            .zip(&nvrtc::PROGRAMS)
            .map(|(code, program)| {
                let module = ctx
                    .load_module(Ptx::from_binary(code))
                    .during("loading the kernels")?;
                Ok((program, module))
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        // Each kernel from the module of the program that defines it.
        let module_of = |name: &str| {
            let (_, module) = modules
                .iter()
                .find(|(p, _)| p.kernels.contains(&name))
                .unwrap_or(&modules[0]);
            module
        };
        let f = |name: &str| load(module_of(name), name);
        let kernels = Kernels {
            init_rows: f("legend_init_rows")?,
            narrow_rows: f("legend_narrow_rows")?,
            widen_rows: f("legend_widen_rows")?,
            rng_vectors: f("legend_rng_vectors")?,
            sample: f("legend_sample_negatives")?,
            remap: f("legend_remap_ids")?,
            gather_batch: f("legend_gather_batch")?,
            gemm_nt: f("legend_gemm_nt")?,
            gemm_nn: f("legend_gemm_nn")?,
            gemm_tn: f("legend_gemm_tn")?,
            dist_scores: f("legend_dist_scores")?,
            dist_grad_query: f("legend_dist_grad_query")?,
            dist_grad_negatives: f("legend_dist_grad_negatives")?,
            queries: f("legend_queries")?,
            gather_negatives: f("legend_gather_negatives")?,
            loss: f("legend_loss")?,
            rows_backward: f("legend_rows_backward")?,
            rows_backward_rounded: f("legend_rows_backward_rounded")?,
            rows_backward_extra: f("legend_rows_backward_extra")?,
            negatives_backward: f("legend_negatives_backward")?,
            adagrad: f("legend_adagrad")?,
            count_uses: f("legend_count_uses")?,
            filter_known: f("legend_filter_known")?,
            rotate_queries: f("legend_rotate_queries")?,
            rotate_rows_backward: f("legend_rotate_rows_backward")?,
            modulus_scores: f("legend_modulus_scores")?,
            modulus_grad_query: f("legend_modulus_grad_query")?,
            modulus_grad_negatives: f("legend_modulus_grad_negatives")?,
            rescal_queries: f("legend_rescal_queries")?,
            rescal_rows_backward: f("legend_rescal_rows_backward")?,
            fused_absmax: f("legend_fused_absmax")?,
            gather_negatives_half: f("legend_gather_negatives_half")?,
            fused_negative_norms: f("legend_fused_negative_norms")?,
            // The fused programs in order, narrowest first (`nvrtc::PROGRAMS`).
            fused: nvrtc::PROGRAMS
                .iter()
                .filter(|p| p.fused_width > 0)
                .map(|p| {
                    let width = p.fused_width as usize;
                    let kind = if p.transe {
                        "legend_fused_transe"
                    } else {
                        "legend_fused"
                    };
                    let rows = format!("{kind}_rows_d{width}");
                    Ok(FusedKernels {
                        width,
                        transe: p.transe,
                        launch: read_launch(module_of(&rows), &stream)?,
                        rows: f(&rows)?,
                        negatives: f(&format!("{kind}_negatives_d{width}"))?,
                    })
                })
                .collect::<Result<_, GpuError>>()?,
            nvme_io: f("legend_nvme_io")?,
            sqe_vectors: f("legend_nvme_sqe_vectors")?,
            row_cache_lookup: f("legend_row_cache_lookup")?,
            scan_score: f("legend_scan_score")?,
            scan_select: f("legend_scan_select")?,
            scan_reset: f("legend_scan_reset")?,
            scan_norms: f("legend_scan_norms")?,
            scan_gather: f("legend_scan_gather")?,
        };
        for f in [&kernels.gemm_nt, &kernels.gemm_nn, &kernels.gemm_tn] {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                GEMM_SMEM as i32,
            )
            .during("raising the shared-memory limit of the product kernels")?;
        }
        kernels
            .scan_select
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                SELECT_SMEM as i32,
            )
            .during("raising the shared-memory limit of the scan's selection")?;
        for k in &kernels.fused {
            for (f, smem) in [
                (&k.rows, k.launch.rows_smem),
                (&k.negatives, k.launch.negatives_smem),
            ] {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .during("raising the shared-memory limit of the fused kernels")?;
            }
        }
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch,
            multiprocessors,
            io_blocks: Arc::default(),
            kernels,
        })
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture the kernels were compiled for (`sm_90a` on an H100).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The multiprocessors the persistent kernels run one block on each: the device's, less
    /// one for each block of the GPU I/O kernels running now. A persistent kernel's block fills
    /// a multiprocessor and walks a fixed share of the work: one that had to wait for a
    /// multiprocessor an I/O block holds would double the kernel's time, while a block fewer
    /// costs only its share.
    pub(crate) fn multiprocessors(&self) -> usize {
        self.multiprocessors
            .saturating_sub(self.io_blocks.load(Ordering::Relaxed))
            .max(1)
    }

    /// The count of I/O kernel blocks running, which `nvme_io::GpuIo` keeps.
    pub(crate) fn io_blocks(&self) -> &Arc<AtomicUsize> {
        &self.io_blocks
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all the engine's work is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all queued work and reports any error it raised.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .during("synchronizing the stream")?;
        self.ctx.check_err().during("a queued operation")
    }

    /// An event recorded on the stream now: it completes when the work queued so far has run.
    pub fn record(&self) -> Result<CudaEvent, GpuError> {
        let ev = self
            .ctx
            .new_event(None)
            .during("creating an ordering event")?;
        ev.record(&self.stream)
            .during("recording an ordering event")?;
        Ok(ev)
    }

    /// Work queued after this call waits for `event` (recorded on another stream: a copy).
    pub fn wait_for(&self, event: &CudaEvent) -> Result<(), GpuError> {
        self.stream
            .wait(event)
            .during("ordering the stream after an event")
    }

    /// Bytes of device memory in all.
    pub fn total_memory(&self) -> Result<usize, GpuError> {
        self.ctx
            .total_mem()
            .during("reading the device memory size")
    }

    /// Bytes of device memory in use, by every process on the device.
    pub fn memory_in_use(&self) -> Result<usize, GpuError> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .during("reading the device memory in use")?;
        Ok(total - free)
    }

    /// A device buffer of `len` zeros.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, GpuError> {
        self.stream
            .alloc_zeros(len.max(1))
            .during("allocating device memory")
    }

    /// A device copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, GpuError> {
        if data.is_empty() {
            // SAFETY: a one-element allocation that nothing reads (an empty table's stand-in).
            return unsafe { self.stream.alloc(1) }.during("allocating device memory");
        }
        self.stream.clone_htod(data).during("copying to the device")
    }

    /// Copies `data` into the start of `dst` (which must be at least as long).
    pub fn write<T: DeviceRepr>(&self, data: &[T], dst: &mut CudaSlice<T>) -> Result<(), GpuError> {
        if data.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(..data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .during("copying to the device")
    }

    /// A host copy of `src` (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, GpuError> {
        self.stream
            .clone_dtoh(src)
            .during("copying from the device")
    }

    /// Fills `dst` with zero bytes, stream-ordered.
    pub fn clear<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        dst: &mut CudaSlice<T>,
    ) -> Result<(), GpuError> {
        self.stream
            .memset_zeros(dst)
            .during("clearing device memory")
    }

    /// The raw address of a buffer, for the argument structures of the kernels.
    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        // Event tracking is off (see `new`), so the returned guard records nothing.
        let (p, _guard) = s.device_ptr(&self.stream);
        p
    }

    /// Runs `init_rows` for `rows` rows starting at `first_row` (see `kernels/init.cu`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_init(
        &self,
        out: &mut CudaSlice<f32>,
        first_row: u64,
        rows: u32,
        dim: u32,
        seed: u64,
        tag: u32,
        normal: bool,
        scale: f32,
    ) -> Result<(), GpuError> {
        let n = u64::from(rows) * u64::from(dim);
        let normal = i32::from(normal);
        let mut b = self.stream.launch_builder(&self.kernels.init_rows);
        b.arg(out)
            .arg(&first_row)
            .arg(&rows)
            .arg(&dim)
            .arg(&seed)
            .arg(&tag)
            .arg(&normal)
            .arg(&scale)
            .arg(&F32_ROWS);
        // SAFETY: `out` holds at least rows × dim floats (checked by the caller); the
        // kernel writes only below that and reads nothing.
        unsafe { b.launch(grid_1d(n)?) }.during("launching legend_init_rows")?;
        Ok(())
    }
}

/// `legend_init_rows`' format code of rows kept as drawn (f32).
const F32_ROWS: u32 = 0;

/// A fused program's launch shapes (`legend_fused_launch` in its module).
fn read_launch(
    module: &Arc<CudaModule>,
    stream: &Arc<CudaStream>,
) -> Result<FusedLaunch, GpuError> {
    let global = module
        .get_global("legend_fused_launch", stream)
        .during("finding legend_fused_launch")?;
    let bytes = stream
        .clone_dtoh(&global)
        .during("reading legend_fused_launch")?;
    if bytes.len() != std::mem::size_of::<FusedLaunch>() {
        return Err(GpuError::Shape(format!(
            "legend_fused_launch has {} bytes, expected {}",
            bytes.len(),
            std::mem::size_of::<FusedLaunch>()
        )));
    }
    let word = |i: usize| u32::from_ne_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    Ok(FusedLaunch {
        rows_threads: word(0),
        rows_smem: word(1),
        rows_persistent: word(2),
        negatives_threads: word(3),
        negatives_smem: word(4),
    })
}

fn load(module: &Arc<CudaModule>, name: &str) -> Result<CudaFunction, GpuError> {
    module
        .load_function(name)
        .map_err(|source| GpuError::Driver {
            what: "finding a kernel in the module",
            source,
        })
}

/// 256 threads a block, one thread per item.
pub(crate) fn grid_1d(n: u64) -> Result<LaunchConfig, GpuError> {
    let blocks = n.div_ceil(256).max(1);
    let blocks = u32::try_from(blocks)
        .map_err(|_| GpuError::Shape(format!("{n} items is too many for one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}
