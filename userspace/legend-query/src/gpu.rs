//! The GPU side of queries on a run (issue 32): a run's entity rows kept in GPU memory when
//! they fit, `predict` and `neighbors` answered by legend-cuda's exact scan (bit-identical to
//! the CPU's scores and order), and, for a table that stays out of GPU memory, rows looked up
//! through legend-cuda's row cache reading the run's own store.
//!
//! Which device: `cpu`, `cuda:N` (an error when it cannot be opened) or `auto` (device 0 when a
//! driver is present and it opens, else the CPU, saying why), as `training.device`. What the
//! GPU cannot do falls back to the CPU path, answer for answer the same: RotatE's modulus, a K
//! above [`SCAN_MAX_TOP`], more than [`SCAN_MAX_ROWS`] entities.

use std::sync::{Mutex, MutexGuard};

use legend_cuda::nvme_io::{
    CacheStats, CachedTable, GpuIo, GpuIoOptions, RingPlacement, RowCache, RowCacheOptions,
};
use legend_cuda::scan::{EntityRows, SCAN_MAX_ROWS, SCAN_MAX_TOP, SCAN_WORKING_BYTES};
use legend_cuda::{Gpu, GpuError};
use legend_engine::config::DeviceChoice;
use legend_engine::engine::Resolved;
use legend_engine::run::StoreLayout;
use legend_engine::store::MemberFile;
use legend_engine::store::QueueBackend;
use legend_engine::store::controllers::{self, DeviceModel};
use legend_eval::Kernel;
use legend_model::{Comparator, Dtype};

use crate::QueryError;

/// The row cache's share of the entity table unless told (the size AGILE's experiment and the
/// benchmarks use).
pub const DEFAULT_CACHE_FRACTION: f64 = 0.1;

/// GPU memory left free beside what queries take: the driver's own, and room for another
/// process's small allocations.
const GPU_RESERVE_BYTES: u64 = 1 << 30;

/// How queries on a run use a GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuOptions {
    /// `cpu`, `cuda:N` or `auto`.
    pub device: DeviceChoice,
    /// Bytes of the GPU's memory the run may take (entity rows, row cache, scan buffers);
    /// `None`: what is free, less a reserve of 1 GiB.
    pub budget: Option<u64>,
    /// The row cache's size as a fraction of the entity table (0: no cache), when the table
    /// stays out of GPU memory and the run has a store.
    pub cache_fraction: f64,
}

impl GpuOptions {
    /// Queries on the CPU only.
    pub fn cpu() -> GpuOptions {
        GpuOptions::on(DeviceChoice::Cpu)
    }

    /// Queries on `device`, the rest by default.
    pub fn on(device: DeviceChoice) -> GpuOptions {
        GpuOptions {
            device,
            budget: None,
            cache_fraction: DEFAULT_CACHE_FRACTION,
        }
    }
}

/// The device `choice` names, opened ([`DeviceChoice::resolve`]); `None` for the CPU, with why
/// when `auto` found no GPU.
pub(crate) fn open_device(choice: DeviceChoice) -> Result<(Option<OpenedGpu>, String), QueryError> {
    match choice.resolve() {
        Ok(Resolved::Gpu { ordinal, gpu }) => Ok((
            Some(OpenedGpu {
                name: format!("cuda:{ordinal} ({}, {})", gpu.name(), gpu.arch()),
                gpu: *gpu,
            }),
            String::new(),
        )),
        Ok(Resolved::Cpu { why: None }) => Ok((None, "cpu".into())),
        Ok(Resolved::Cpu { why: Some(why) }) => Ok((None, format!("cpu (auto: {why})"))),
        Err(source) => Err(QueryError::Gpu {
            device: choice.to_string(),
            source,
        }),
    }
}

/// A GPU opened for a run's queries, with its name for messages.
pub(crate) struct OpenedGpu {
    pub(crate) gpu: Gpu,
    pub(crate) name: String,
}

impl OpenedGpu {
    /// Bytes of its memory a run may take: `budget`, at most what is free less the reserve.
    pub(crate) fn budget(&self, budget: Option<u64>) -> Result<u64, QueryError> {
        let total = self.gpu.total_memory().map_err(|e| self.error(e))? as u64;
        let used = self.gpu.memory_in_use().map_err(|e| self.error(e))? as u64;
        let free = total.saturating_sub(used).saturating_sub(GPU_RESERVE_BYTES);
        Ok(budget.map_or(free, |b| b.min(free)))
    }

    /// Whether a table of `rows` rows of `dim` floats fits `budget` with a scan's buffers.
    pub(crate) fn fits(rows: u64, dim: usize, budget: u64) -> bool {
        EntityRows::bytes(rows as usize, dim).saturating_add(SCAN_WORKING_BYTES) <= budget
    }

    pub(crate) fn error(&self, source: GpuError) -> QueryError {
        QueryError::Gpu {
            device: self.name.clone(),
            source,
        }
    }
}

/// The scans of a run on a GPU, and its entity rows when they are in GPU memory.
pub(crate) struct GpuScans {
    name: String,
    state: Mutex<GpuState>,
}

/// What a batch holds while it uses the GPU (one batch at a time: one stream).
pub(crate) struct GpuState {
    pub(crate) gpu: Gpu,
    /// The entity rows, when they are in GPU memory.
    pub(crate) rows: Option<EntityRows>,
}

impl GpuScans {
    pub(crate) fn new(opened: OpenedGpu, rows: Option<EntityRows>) -> GpuScans {
        GpuScans {
            name: opened.name,
            state: Mutex::new(GpuState {
                gpu: opened.gpu,
                rows,
            }),
        }
    }

    /// `cuda:N (name, arch)`.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The GPU, for one batch.
    pub(crate) fn lock(&self) -> MutexGuard<'_, GpuState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the scan can rank these queries on the GPU: a comparator it has, every K in
    /// 1..=[`SCAN_MAX_TOP`], ids below [`SCAN_MAX_ROWS`].
    pub(crate) fn can_rank(kernel: &Kernel, tops: &[usize], entities: usize) -> bool {
        kernel.comparator() != Comparator::NegModulus
            && tops.iter().all(|&k| (1..=SCAN_MAX_TOP).contains(&k))
            && (entities as u64) <= SCAN_MAX_ROWS
    }

    pub(crate) fn error(&self, source: GpuError) -> QueryError {
        QueryError::Gpu {
            device: self.name.clone(),
            source,
        }
    }
}

/// A GPU row cache of at most `bytes` over the committed partitions of a run's store, as its
/// reader found them ([`legend_engine::run::RunReader::store_layout`]), its rows as stored (the
/// store's dtype), read through the controller the reader's store opened (the proxy or
/// `legend_nvme` of a queue-backed store), or through a proxy over the store's file started
/// here at `proxy_model`'s rates (a `file` store); `queues` queue pairs, `opts` but for its
/// lines. A refusal says why the rows must be read on the CPU instead.
pub fn store_row_cache(
    gpu: &Gpu,
    layout: &StoreLayout,
    proxy_model: Option<DeviceModel>,
    bytes: u64,
    (queues, opts): (u32, &RowCacheOptions),
) -> Result<RowCache, RowCacheError> {
    let label = store_label(&layout.members);
    let [member] = &layout.members[..] else {
        return Err(RowCacheError::Unsupported(format!(
            "{label}: a store striped over {} devices (the row cache's lines address one \
             member's blocks; its rows are looked up through the store's reader instead)",
            layout.members.len()
        )));
    };
    let fail = |what: &'static str| {
        let label = label.clone();
        move |e: Box<dyn std::error::Error + Send + Sync>| RowCacheError::Failed {
            label,
            what,
            source: e,
        }
    };
    let ctrl = match &layout.queued[..] {
        [one] => one.controller.clone(),
        _ => controllers::open(QueueBackend::Proxy, &member.file, proxy_model)
            .map_err(|e| fail("starting a proxy controller over the store")(e.into()))?,
    };
    let placement = ctrl
        .gpu_placement(gpu)
        .map_err(|e| fail("reaching the controller from the GPU")(e.into()))?;
    let table = store_table(layout)?;
    let namespace = member.queue.map_or(1, |q| q.namespace);
    let info = ctrl
        .controller()
        .info()
        .map_err(|e| fail("reading the controller")(e.into()))?;
    let lba = legend_nvme::namespace(&info, namespace)
        .map(|n| 1u64 << n.lba_shift)
        .ok_or_else(|| {
            RowCacheError::Unsupported(format!(
                "{label}: the controller has no namespace {namespace}"
            ))
        })?;
    let line = RowCache::line_bytes_for(table.row_bytes, opts.line_bytes, lba);
    let io_opts = GpuIoOptions {
        queues,
        threads: 64,
        namespace,
        placement,
        // The proxy reaches pinned host memory with a memcpy: a line of at most 64 KiB is
        // staged there rather than copied into GPU memory by a CUDA copy a command.
        staging: if placement == RingPlacement::Host && line <= 64 << 10 {
            line as u32
        } else {
            0
        },
        ..GpuIoOptions::default()
    };
    let io = GpuIo::open(gpu, ctrl.controller(), &io_opts)
        .map_err(|e| fail("opening the GPU I/O queues")(e.into()))?;
    let lines = (bytes / line).min(u64::from(u32::MAX)) as u32;
    let lines = (lines / opts.ways * opts.ways).max(opts.ways);
    let opts = RowCacheOptions {
        lines,
        ..opts.clone()
    };
    RowCache::open(gpu, io, table, &opts).map_err(|e| fail("opening the row cache")(e.into()))
}

/// Where the committed entity rows of a run's store lie on its member, as its reader found
/// them: each partition's embeddings at the first byte of its committed copy, rows as stored.
/// A store striped over several members has no such single table.
pub fn store_table(layout: &StoreLayout) -> Result<CachedTable, RowCacheError> {
    let spec = &layout.spec;
    let label = store_label(&layout.members);
    let row_bytes = u32::try_from(spec.dim as usize * spec.dtype.bytes())
        .map_err(|_| RowCacheError::Unsupported(format!("{label}: rows of {} values", spec.dim)))?;
    let per_part = legend_model::partition::rows_per_partition(spec.num_nodes, spec.num_partitions);
    let partitions = layout
        .committed
        .iter()
        .map(|pieces| match &pieces[..] {
            [one] => Ok(one.at),
            _ => Err(RowCacheError::Unsupported(format!(
                "{label}: a partition in {} pieces (a striped store)",
                pieces.len()
            ))),
        })
        .collect::<Result<Vec<u64>, _>>()?;
    Ok(CachedTable {
        partitions,
        rows_per_partition: per_part,
        rows: spec.num_nodes,
        row_bytes,
    })
}

/// Why a run's rows cannot be looked up through the GPU row cache over its store (a caller
/// then reads them on the CPU).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RowCacheError {
    /// The store cannot be cached as one table of rows.
    #[error("{0}")]
    Unsupported(String),
    /// A step of setting the cache up failed.
    #[error("{label}: {what}")]
    Failed {
        /// The store.
        label: String,
        /// The step.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The store's first member's path, for messages.
fn store_label(members: &[MemberFile]) -> String {
    members
        .first()
        .map_or_else(String::new, |m| m.file.path().display().to_string())
}

/// A run's entity rows looked up through the GPU row cache over its store.
pub(crate) struct StoreRows {
    cache: Mutex<RowCache>,
    dtype: Dtype,
    dim: usize,
    /// The GPU and the store, for messages.
    label: String,
}

impl StoreRows {
    /// [`store_row_cache`] on the opened GPU, its rows widened to f32 by [`StoreRows::rows`].
    pub(crate) fn open(
        opened: &OpenedGpu,
        layout: &StoreLayout,
        proxy_model: Option<DeviceModel>,
        bytes: u64,
    ) -> Result<StoreRows, RowCacheError> {
        let spec = &layout.spec;
        let defaults = (GpuIoOptions::default().queues, &RowCacheOptions::default());
        let cache = store_row_cache(&opened.gpu, layout, proxy_model, bytes, defaults)?;
        Ok(StoreRows {
            label: format!(
                "{}, row cache over {}",
                opened.name,
                store_label(&layout.members)
            ),
            cache: Mutex::new(cache),
            dtype: spec.dtype,
            dim: spec.dim as usize,
        })
    }

    /// The rows `ids` (checked below the row count by the caller), widened to f32.
    pub(crate) fn rows(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>, QueryError> {
        let wide: Vec<u64> = ids.iter().map(|&id| u64::from(id)).collect();
        let (bytes, _) = self
            .lock()
            .lookup(&wide)
            .map_err(|e| QueryError::Tables(format!("{}: {e}", self.label)))?;
        let row_bytes = self.dim * self.dtype.bytes();
        Ok(bytes
            .chunks_exact(row_bytes)
            .map(|stored| {
                let mut row = vec![0.0; self.dim];
                self.dtype.widen(stored, &mut row);
                row
            })
            .collect())
    }

    /// The cache's counters so far.
    pub(crate) fn stats(&self) -> Option<CacheStats> {
        self.lock().stats().ok()
    }

    /// Bytes of GPU memory its lines take.
    pub(crate) fn capacity_bytes(&self) -> u64 {
        self.lock().capacity_bytes()
    }

    fn lock(&self) -> MutexGuard<'_, RowCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}
