//! A run's memory footprint, on the host and on the GPU: what it will need, what the machine
//! has, what it used, and which settings would make it fit.
//!
//! A billion-edge run that the OOM killer ends while it saves has lost all its work, so a
//! session estimates its peak before it allocates anything and refuses, saying which setting
//! would make it fit, when the machine cannot hold it.

use std::path::Path;

use legend_dataset::{DatasetMeta, PartitionScheme, Split};

use crate::config::{Backend, Config, DeviceChoice, Protocol};

/// Bytes of one stored edge (source, relation, destination as `u32`).
const EDGE_BYTES: u64 = 12;
/// Bytes per edge of the filtered-negatives set (a hash set of edges at its load factor).
const KNOWN_EDGE_BYTES: u64 = 32;
/// The process itself, thread stacks, batch scratch and allocator slack.
const BASELINE_BYTES: u64 = 512 << 20;
/// The CUDA driver's host memory and the engine's pinned staging buffers (the Twitter-shaped
/// run on an H100 peaked 0.4 GiB above the rest of the estimate).
const CUDA_HOST_BYTES: u64 = 1 << 30;

/// A run's estimated peak host memory, by what holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostEstimate {
    /// Train edges in their buckets.
    pub edges: u64,
    /// Embedding and optimizer rows held in RAM (every partition with the memory backend; the
    /// buffer's partitions and the store's staging with the others), and the relation
    /// table with its state (RESCAL's: `dim²` floats a relation).
    pub tables: u64,
    /// The filtered-negatives set, when `training.negatives.filtered` is on.
    pub known_edges: u64,
    /// The evaluation at the end (its split, the filter or degrees, the gathered entity table
    /// when there is more than one partition).
    pub evaluation: u64,
    /// A training step's negatives: every chunk's ids, gathered rows and their gradients, and
    /// the batch's gathered relation rows and their gradients, one of each a positive (the
    /// CPU engine holds them at once: RESCAL's `dim²` floats a positive dominate; the GPU
    /// engine's are in its device workspace).
    pub step: u64,
    /// The process, threads and scratch (and the CUDA driver's share where a GPU may train).
    pub baseline: u64,
}

impl HostEstimate {
    /// What `config` on `dataset` will hold at its peak (the final evaluation runs while the
    /// trainer still holds its edges and tables), training on a CUDA device or not
    /// (`on_cuda`). When every partition stays on the GPU (memory backend, C = N), the host
    /// holds none of their rows, only the embeddings evaluation gathers from the device. A run
    /// resumed from a checkpoint holds the same: its rows go from the checkpoint straight to
    /// where a new run keeps them (`crate::Trainer::restore`), to the GPU a piece at a time.
    pub fn of(config: &Config, dataset: &DatasetMeta, on_cuda: bool) -> HostEstimate {
        let all_on_gpu =
            on_cuda && !config.uses_store() && config.capacity() == config.storage.num_partitions;
        let dim = config.model.dim as u64;
        let n = u64::from(config.storage.num_partitions.max(1));
        let row_bytes = config.entity_shape().memory_bytes(); // embedding + AdaGrad state
        let partition_bytes = dataset.entities.div_ceil(n) * row_bytes;
        let train = dataset.splits.get(Split::Train);
        let node_tables = match config.storage.backend {
            Backend::Memory if all_on_gpu => 0,
            Backend::Memory => dataset.entities * row_bytes,
            // The resident partitions, the one read ahead (or in flight), and the store's
            // staging buffer.
            _ => (u64::from(config.capacity()) + 2) * partition_bytes,
        };
        // Embeddings and AdaGrad state of every relation row.
        let relation_tables = config.relation_floats(dataset.relations).saturating_mul(8);
        let known_edges = if config.training.negatives.filtered {
            train * KNOWN_EDGE_BYTES
        } else {
            0
        };
        let split = dataset.splits.get(config.evaluation.split.split());
        let gathered = if n > 1 || all_on_gpu {
            dataset.entities * dim * 4
        } else {
            0
        };
        let ranking = match config.evaluation.protocol {
            // Every split's edges, twice: loaded, then indexed.
            Protocol::Filtered => {
                let all: u64 = Split::ALL.iter().map(|&s| dataset.splits.get(s)).sum();
                all * EDGE_BYTES * 2
            }
            Protocol::Sampled => split * EDGE_BYTES + dataset.entities * 4,
        };
        let n = &config.training.negatives;
        let chunks = n.num_chunks.min(config.training.batch_size) as u64;
        let step = if on_cuda {
            0
        } else {
            // A positive's relation rows (with reciprocal relations, its inverse's too),
            // gathered and their gradients.
            let rel_rows = if config.model.reciprocal_relations {
                2
            } else {
                1
            };
            let rw = config.model.decoder.relation_width(config.model.dim) as u64;
            let relations =
                (config.training.batch_size as u64).saturating_mul(rel_rows * rw * 4 * 2);
            // Saturating: at the settings' bounds the product passes 2^64, which must read
            // as "too much", never wrap to little.
            (chunks * 2)
                .saturating_mul(n.negatives_per_positive as u64)
                .saturating_mul(4 + dim * 4 * 2)
                .saturating_add(relations)
        };
        HostEstimate {
            edges: train * EDGE_BYTES,
            tables: node_tables.saturating_add(relation_tables),
            known_edges,
            evaluation: gathered + ranking,
            step,
            baseline: BASELINE_BYTES
                + match config.device() {
                    DeviceChoice::Cpu => 0,
                    DeviceChoice::Cuda(_) | DeviceChoice::Auto => CUDA_HOST_BYTES,
                },
        }
    }

    /// The whole estimate in bytes.
    pub fn total(&self) -> u64 {
        [
            self.tables,
            self.known_edges,
            self.evaluation,
            self.step,
            self.baseline,
        ]
        .iter()
        .fold(self.edges, |sum, &b| sum.saturating_add(b))
    }
}

/// Bytes this process may still allocate: the kernel's `MemAvailable`, lowered by a cgroup
/// limit (a systemd unit's `MemoryMax`, a container's) where one applies. `None` where neither
/// can be read.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = match declared_memory() {
        Some(declared) => Some(declared),
        None => meminfo
            .as_deref()
            .and_then(|m| kib_field(m, "MemAvailable:")),
    };
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let cgroup = cgroup_headroom(Path::new("/sys/fs/cgroup"), &own);
    match (available, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// The environment variable that states the host memory a run may use, in GiB, where the
/// kernel's `MemAvailable` under-reports it: virtual machines whose memory grows as it is
/// touched (the lent multi-GPU machines start at 31 GiB of 256 or 512).
pub const DECLARED_MEMORY_VAR: &str = "LEGEND_HOST_MEMORY_GIB";

/// [`DECLARED_MEMORY_VAR`] in bytes, when set to a positive number (anything else is ignored
/// with a warning: the check then reads the kernel's figure).
fn declared_memory() -> Option<u64> {
    let text = std::env::var(DECLARED_MEMORY_VAR).ok()?;
    match text.trim().parse::<f64>() {
        Ok(gib) if gib.is_finite() && gib > 0.0 => Some((gib * (1u64 << 30) as f64) as u64),
        _ => {
            tracing::warn!(
                "{DECLARED_MEMORY_VAR} = {text:?} is not a positive number of GiB; ignored"
            );
            None
        }
    }
}

/// This process's peak resident set (`VmHWM`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&status, "VmHWM:")
}

/// The value of a `Name:   1234 kB` line, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// What this process's memory cgroup (as `own`, the text of `/proc/self/cgroup`, places it
/// under `root`) and its ancestors leave it: the least of their limits less their usage, if
/// any has a limit. cgroup v1 (`memory/…/memory.limit_in_bytes − memory.usage_in_bytes`, where
/// the memory controller has a v1 hierarchy) or v2 (`memory.max − memory.current`).
fn cgroup_headroom(root: &Path, own: &str) -> Option<u64> {
    let v1 = own.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    });
    let (base, path, limit, usage) = match v1 {
        Some(path) => (
            root.join("memory"),
            path,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        ),
        None => (
            root.to_owned(),
            own.lines().find_map(|l| l.strip_prefix("0::"))?,
            "memory.max",
            "memory.current",
        ),
    };
    let read = |dir: &Path, f: &str| -> Option<u64> {
        // v2's "max" (no limit) fails to parse; v1 says no limit with a number near 2^63.
        let n: u64 = std::fs::read_to_string(dir.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        (n < 1 << 60).then_some(n)
    };
    let mut dir = base.join(path.trim_start_matches('/'));
    let mut least: Option<u64> = None;
    loop {
        if let (Some(max), Some(current)) = (read(&dir, limit), read(&dir, usage)) {
            let left = max.saturating_sub(current);
            least = Some(least.map_or(left, |l| l.min(left)));
        }
        if dir == base || !dir.pop() {
            return least;
        }
    }
}

/// A run that does not fit in memory: what it needs, what there is, and the settings that
/// would make it fit (or that none does), in words.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{0}")]
pub struct DoesNotFit(pub String);

/// Bytes in GiB, for messages.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// Refuses `config` on `dataset` (on a CUDA device or not: see [`HostEstimate::of`]) when its
/// estimated peak exceeds `available` bytes, with a message that says how much it needs, what
/// there is, and the settings that would fit (found by [`settings_that_fit`]; a run `resuming`
/// keeps its backend and partitions) or that none does.
pub fn check_fits(
    config: &Config,
    dataset: &DatasetMeta,
    on_cuda: bool,
    resuming: bool,
    available: u64,
) -> Result<HostEstimate, DoesNotFit> {
    let e = HostEstimate::of(config, dataset, on_cuda);
    if e.total() <= available {
        return Ok(e);
    }
    let advice = match settings_that_fit(config, dataset, on_cuda, resuming, available) {
        Some((changes, fitted)) => format!(
            "set {} (about {:.1} GiB)",
            changes
                .iter()
                .map(Change::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            gib(fitted.total())
        ),
        None => {
            let least = least_estimate(config, dataset, on_cuda, resuming);
            let (settings, instead) = if resuming {
                (
                    "storage.buffer_capacity, evaluation.protocol or \
                     training.negatives.filtered (what a resumed run may change: it keeps the \
                     tables and partitions it started with)",
                    "resume it where that much is available, or with fewer negatives",
                )
            } else {
                (
                    "storage.backend, storage.num_partitions, storage.buffer_capacity, \
                     evaluation.protocol or training.negatives.filtered",
                    "use a machine with more memory, a smaller model.dim or fewer negatives",
                )
            };
            format!(
                "no setting of {settings} fits this machine (the least is about {:.1} GiB: \
                 {:.1} GiB of edges, {:.1} GiB for evaluation, whose protocols both rank \
                 against every embedding, {:.1} GiB for a step's negatives); {instead} \
                 (training.negatives.num_chunks × negatives_per_positive)",
                gib(least.total()),
                gib(least.edges),
                gib(least.evaluation),
                gib(least.step)
            )
        }
    };
    Err(DoesNotFit(format!(
        "this run needs about {:.1} GiB of host memory ({:.1} GiB of edges, {:.1} GiB of tables, \
         {:.1} GiB of filtered-negative index, {:.1} GiB for evaluation, {:.1} GiB for a step's \
         negatives, {:.1} GiB for the process and drivers) \
         but {:.1} GiB is available: {advice}",
        gib(e.total()),
        gib(e.edges),
        gib(e.tables),
        gib(e.known_edges),
        gib(e.evaluation),
        gib(e.step),
        gib(e.baseline),
        gib(available),
    )))
}

/// One configuration change the memory advice may propose; displayed as the `key = value`
/// that `--set` and a configuration file accept.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Change {
    /// `storage.backend`.
    Backend(Backend),
    /// `storage.num_partitions`.
    Partitions(u32),
    /// `storage.buffer_capacity`.
    Capacity(u32),
    /// `evaluation.protocol`.
    Protocol(Protocol),
    /// `training.negatives.filtered`.
    FilteredNegatives(bool),
}

impl Change {
    /// Applies the change to `config`.
    pub fn apply(self, config: &mut Config) {
        match self {
            Change::Backend(b) => config.storage.backend = b,
            Change::Partitions(n) => config.storage.num_partitions = n,
            Change::Capacity(c) => config.storage.buffer_capacity = c,
            Change::Protocol(p) => config.evaluation.protocol = p,
            Change::FilteredNegatives(f) => config.training.negatives.filtered = f,
        }
    }
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Backend(b) => write!(f, "storage.backend = \"{b}\""),
            Change::Partitions(n) => write!(f, "storage.num_partitions = {n}"),
            Change::Capacity(c) => write!(f, "storage.buffer_capacity = {c}"),
            Change::Protocol(p) => write!(f, "evaluation.protocol = \"{}\"", p.name()),
            Change::FilteredNegatives(v) => write!(f, "training.negatives.filtered = {v}"),
        }
    }
}

/// The most partitions the advice proposes (their plans stay quick to compute).
const MAX_ADVISED_PARTITIONS: u32 = 1024;

/// The changes to `config` that bring its estimate within `available` bytes, and the estimate
/// with them; `None` when no candidate fits. Candidates are tried in the order of what they
/// cost the run, and the first that the estimator, the configuration's checks and the planner
/// all accept is taken: first the storage layout alone (keeping the current one, else the
/// `file` backend with the fewest partitions and, for those, the largest buffer), then the same
/// with sampled evaluation, without filtered negatives, and with both. A resumed run keeps its
/// backend and partitions: only its buffer may shrink.
pub fn settings_that_fit(
    config: &Config,
    dataset: &DatasetMeta,
    on_cuda: bool,
    resuming: bool,
    available: u64,
) -> Option<(Vec<Change>, HostEstimate)> {
    candidates(config, dataset, on_cuda, resuming).find_map(|(changes, candidate, estimate)| {
        (estimate.total() <= available
            && candidate.validate().is_ok()
            && legend_planner::plan(
                candidate.storage.num_partitions,
                candidate.capacity(),
                candidate.order(),
            )
            .is_ok())
        .then_some((changes, estimate))
    })
}

/// The smallest estimate among the candidates of [`settings_that_fit`] (what a refusal that
/// finds none cites).
fn least_estimate(
    config: &Config,
    dataset: &DatasetMeta,
    on_cuda: bool,
    resuming: bool,
) -> HostEstimate {
    candidates(config, dataset, on_cuda, resuming)
        .map(|(_, _, estimate)| estimate)
        .min_by_key(HostEstimate::total)
        .expect("the current layout is always a candidate")
}

/// Every candidate of [`settings_that_fit`] in its order: the changes, the configuration they
/// make and its estimate.
fn candidates<'a>(
    config: &'a Config,
    dataset: &'a DatasetMeta,
    on_cuda: bool,
    resuming: bool,
) -> impl Iterator<Item = (Vec<Change>, Config, HostEstimate)> + 'a {
    let layouts = layouts(config, dataset, resuming);
    tweaks(config).into_iter().flat_map(move |tweaks| {
        layouts
            .iter()
            .map(|layout| {
                let changes: Vec<Change> = layout.iter().chain(&tweaks).copied().collect();
                let mut candidate = config.clone();
                for change in &changes {
                    change.apply(&mut candidate);
                }
                let estimate = HostEstimate::of(&candidate, dataset, on_cuda);
                (changes, candidate, estimate)
            })
            .collect::<Vec<_>>()
    })
}

/// Storage layouts to try, cheapest in I/O first: the current one; then (for a new run) a
/// store (the `file` backend unless one is configured) with 2, 4, 8, … partitions, and for
/// each every buffer from all of them down to 2; or (resuming) smaller buffers only.
fn layouts(config: &Config, dataset: &DatasetMeta, resuming: bool) -> Vec<Vec<Change>> {
    let mut layouts = vec![Vec::new()];
    if resuming {
        if config.storage.num_partitions > 2 {
            layouts.extend(
                (2..config.capacity())
                    .rev()
                    .map(|c| vec![Change::Capacity(c)]),
            );
        }
        return layouts;
    }
    let backend = (!config.uses_store()).then_some(Change::Backend(Backend::File));
    let most = MAX_ADVISED_PARTITIONS.min(u32::try_from(dataset.entities).unwrap_or(u32::MAX));
    for n in std::iter::successors(Some(2u32), |n| n.checked_mul(2)).take_while(|&n| n <= most) {
        for c in (2..=n).rev() {
            layouts.push(
                backend
                    .into_iter()
                    .chain([Change::Partitions(n), Change::Capacity(c)])
                    .collect(),
            );
        }
    }
    layouts
}

/// Changes beyond the layout, least intrusive first: none, sampled evaluation, no filtered
/// negatives, both (those already in effect left out).
fn tweaks(config: &Config) -> Vec<Vec<Change>> {
    let sampled = (config.evaluation.protocol != Protocol::Sampled)
        .then_some(Change::Protocol(Protocol::Sampled));
    let unfiltered = config
        .training
        .negatives
        .filtered
        .then_some(Change::FilteredNegatives(false));
    let mut tweaks = vec![Vec::new()];
    tweaks.extend(sampled.map(|s| vec![s]));
    tweaks.extend(unfiltered.map(|u| vec![u]));
    if let (Some(s), Some(u)) = (sampled, unfiltered) {
        tweaks.push(vec![s, u]);
    }
    tweaks
}

/// Bytes per row of a device table beyond its `dim` floats of embedding, AdaGrad state and
/// gradient: the touched flag, the touched list and the use count (`u32` each).
const DEVICE_ROW_EXTRA_BYTES: u64 = 12;
/// The CUDA context, the loaded kernels and the batch workspace (score matrices of up to
/// 1 GiB, operands): 1.14 GiB on an H100 both with one partition and with C = 3 of 8, the
/// Twitter-shaped runs of `scripts/gpu/billion-edge.sh`.
const DEVICE_WORKSPACE_BYTES: u64 = 3 << 29;

/// A GPU run's estimated device memory, by what holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuEstimate {
    /// Node rows: every entity (C = N) or C partition slots, each row its embedding, AdaGrad
    /// state and gradient, and three counters.
    pub nodes: u64,
    /// One partition slot's share of `nodes` (C < N), or 0.
    pub slot: u64,
    /// Relation rows, as node rows with element-wise state.
    pub relations: u64,
    /// Train edges: all of them when resident, else two buffers of the largest bucket.
    pub edges: u64,
    /// Whether the edges stay on the device (they take at most `storage.gpu_edge_fraction`
    /// of its memory).
    pub edges_resident: bool,
    /// What the edges would take if resident (to say what lowering the fraction saves).
    pub all_edges: u64,
    /// Degree prefix sums (degree-based negatives), context, kernels and batch workspace.
    pub workspace: u64,
    /// The table of known edges of filtered negatives (`training.negatives.filtered`), or 0.
    pub known_edges: u64,
    /// Entities of the graph (to size the partitions of other layouts).
    pub entities: u64,
    /// Bytes of one node row on the device.
    pub row: u64,
}

impl GpuEstimate {
    /// What training `config` over `scheme` (entities and partitions), with `bucket_edges`
    /// train edges per bucket and `relation_rows` relation rows, holds on a device of
    /// `device_total` bytes.
    pub fn of(
        config: &Config,
        scheme: PartitionScheme,
        bucket_edges: &[u64],
        relation_rows: u64,
        device_total: u64,
    ) -> GpuEstimate {
        // Embedding and gradient, and the state of `optimizer.state` (relations: element-wise,
        // rows of the decoder's relation width).
        let dim = config.model.dim as u64;
        let row = config.entity_shape().memory_bytes() + dim * 4 + DEVICE_ROW_EXTRA_BYTES;
        let rw = config.model.decoder.relation_width(config.model.dim) as u64;
        let relation_row = rw * 4 * 3 + DEVICE_ROW_EXTRA_BYTES;
        let slots = u64::from(config.slots());
        let (table_rows, slot) = if slots < u64::from(scheme.num_partitions) {
            let slot = scheme.rows_per_partition * row;
            (slots * scheme.rows_per_partition, slot)
        } else {
            (scheme.entities, 0)
        };
        let all_edges = bucket_edges.iter().sum::<u64>() * EDGE_BYTES;
        let edges_resident =
            Self::edges_resident(all_edges, config.storage.gpu_edge_fraction, device_total);
        let edges = if edges_resident {
            all_edges
        } else {
            2 * bucket_edges.iter().copied().max().unwrap_or(0) * EDGE_BYTES
        };
        GpuEstimate {
            nodes: table_rows * row,
            slot,
            relations: relation_rows * relation_row,
            edges,
            edges_resident,
            all_edges,
            workspace: (scheme.entities + 1) * 8 + DEVICE_WORKSPACE_BYTES,
            known_edges: if config.training.negatives.filtered {
                legend_cuda::known_edges_bytes(bucket_edges.iter().sum())
            } else {
                0
            },
            entities: scheme.entities,
            row,
        }
    }

    /// Whether `edge_bytes` of edges stay on a device of `device_total` bytes, given
    /// `storage.gpu_edge_fraction`: the GPU engine's rule.
    pub fn edges_resident(edge_bytes: u64, fraction: f64, device_total: u64) -> bool {
        edge_bytes as f64 <= fraction * device_total as f64
    }

    /// The whole estimate in bytes.
    pub fn total(&self) -> u64 {
        self.nodes + self.relations + self.edges + self.workspace + self.known_edges
    }

    /// The first layout with fewer partition slots than partitions whose node rows fit in
    /// `free` beside the rest of the estimate, as (N, C): the current N first, then 2, 4, 8, …
    /// (up to 1024) beyond it, and for each the largest C that fits (with the spare slot of
    /// `storage.read_ahead`) and the planner accepts.
    /// The rest is kept as it is: streamed edges are then sized by the current largest bucket,
    /// which finer partitions only make smaller.
    fn fitting_layout(&self, config: &Config, free: u64) -> Option<(u32, u32)> {
        let rest = self.total() - self.nodes;
        let current = config.storage.num_partitions;
        let most = MAX_ADVISED_PARTITIONS.min(u32::try_from(self.entities).unwrap_or(u32::MAX));
        let finer = std::iter::successors(Some(2u32), |n| n.checked_mul(2))
            .skip_while(|&n| n <= current)
            .take_while(|&n| n <= most);
        let spare = u64::from(config.read_ahead());
        std::iter::once(current).chain(finer).find_map(|n| {
            let slot = self.entities.div_ceil(u64::from(n)) * self.row;
            (2..n)
                .rev()
                .find(|&c| {
                    rest + (u64::from(c) + spare) * slot <= free
                        && legend_planner::plan(n, c, config.order()).is_ok()
                })
                .map(|c| (n, c))
        })
    }

    /// What makes a worker of a K-GPU run (`workers` of them; each holds three partition
    /// slots) fit in `free`: the fewest partitions, at least 3K, whose slots fit beside the
    /// rest, the others parked in host memory between rounds (one host only).
    fn parked_advice(&self, config: &Config, workers: u32, free: u64) -> String {
        let rest = self.total() - self.nodes;
        if config.training.hosts > 1 {
            return format!(
                "a run over several hosts holds the table in its GPUs' memory together (N = 2K): add GPUs or hosts, or train on one host with storage.num_partitions ≥ {} (partitions parked in its memory)",
                3 * workers
            );
        }
        let most = MAX_ADVISED_PARTITIONS.min(u32::try_from(self.entities).unwrap_or(u32::MAX));
        let slot = |n: u32| self.entities.div_ceil(u64::from(n)) * self.row;
        let start = (3 * workers).max(config.storage.num_partitions + 1);
        match (start..=most).find(|&n| rest + 3 * slot(n) <= free) {
            Some(n) => format!(
                "park partitions in host memory between rounds, each GPU holding 3 of {n} ({:.1} GiB each): {}",
                gib(slot(n)),
                Change::Partitions(n)
            ),
            None => format!(
                "no partitioning fits a GPU's three partition slots beside the {:.1} GiB that the edges, relation rows and workspace take",
                gib(rest)
            ),
        }
    }

    /// Refuses the run when the estimate exceeds `free` bytes of `device`'s memory, saying
    /// what would make it fit.
    pub fn check(&self, config: &Config, device: &str, free: u64) -> Result<(), DoesNotFit> {
        if self.total() <= free {
            return Ok(());
        }
        let short = self.total() - free;
        let mut advice = Vec::new();
        if self.known_edges >= short {
            advice.push(format!(
                "turn training.negatives.filtered off (its table of the known edges takes {:.1} GiB)",
                gib(self.known_edges)
            ));
        }
        if self.edges_resident && self.all_edges >= short {
            advice.push(format!(
                "keep the edges ({:.1} GiB) in host memory, streamed a bucket at a time, with a lower storage.gpu_edge_fraction (now {})",
                gib(self.all_edges),
                config.storage.gpu_edge_fraction
            ));
        }
        let workers = config.training.gpus * config.training.hosts;
        if workers == 1 && config.read_ahead() && self.slot >= short {
            advice.push(format!(
                "turn storage.read_ahead off (its spare partition slot takes {:.1} GiB; each swap then reads after its write)",
                gib(self.slot)
            ));
        }
        // What stays whatever the partition slots (edges, relations, workspace).
        let rest = self.total() - self.nodes;
        advice.push(if workers > 1 {
            self.parked_advice(config, workers, free)
        } else {
            match self.fitting_layout(config, free) {
            Some((n, c)) => {
                let mut changes = Vec::new();
                if n != config.storage.num_partitions {
                    changes.push(Change::Partitions(n));
                }
                changes.push(Change::Capacity(c));
                let changes: Vec<String> = changes.iter().map(Change::to_string).collect();
                format!(
                    "hold {c} of {n} partitions on the GPU ({:.1} GiB each) and the others in host memory: {}",
                    gib(self.entities.div_ceil(u64::from(n)) * self.row),
                    changes.join(", ")
                )
            }
            None => format!(
                "no partitioning fits the node rows beside the {:.1} GiB that the edges, relation rows and workspace take",
                gib(rest)
            ),
            }
        });
        Err(DoesNotFit(format!(
            "training on {device} needs about {:.1} GiB of its memory ({:.1} GiB of node rows with their AdaGrad state and gradients, {:.1} GiB of relation rows, {:.1} GiB of edges, {:.1} GiB of workspace, {:.1} GiB of known edges) but {:.1} GiB is free: {}",
            gib(self.total()),
            gib(self.nodes),
            gib(self.relations),
            gib(self.edges),
            gib(self.workspace),
            gib(self.known_edges),
            gib(free),
            advice.join("; or ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn twitter(partitions: u32, capacity: u32, read_ahead: bool) -> (Config, GpuEstimate) {
        let config = Config::parse(
            "",
            &[
                "model.decoder=dot".into(),
                "model.dim=100".into(),
                format!("storage.num_partitions={partitions}"),
                format!("storage.buffer_capacity={capacity}"),
                format!("storage.read_ahead={read_ahead}"),
            ],
        )
        .unwrap();
        let scheme = PartitionScheme::new(41_652_230, partitions).unwrap();
        let n2 = u64::from(partitions * partitions);
        let buckets = vec![1_468_218_346 / n2; n2 as usize];
        let h100 = 81_559 << 20;
        let e = GpuEstimate::of(&config, scheme, &buckets, 0, h100);
        (config, e)
    }

    #[test]
    fn the_gpu_estimate_matches_the_h100_runs_and_refuses_with_advice() {
        // In use on the H100 (total minus free, after set-up): 64.86 GiB for N = 1, 35.49 GiB
        // for N = 8, C = 3 (scripts/gpu/billion-edge.sh, before read-ahead's spare slot).
        for ((n, c), used) in [((1, 1), 64.86), ((8, 3), 35.49)] {
            let (config, e) = twitter(n, c, false);
            assert!(e.edges_resident);
            let got = gib(e.total());
            assert!(
                (got - used).abs() < 0.5,
                "N={n} C={c}: {got:.2} GiB, used {used}"
            );
            assert!(e.check(&config, "cuda:0", 70 << 30).is_ok());
        }
        let (config, e) = twitter(1, 1, false);
        let err = e.check(&config, "cuda:0", 40 << 30).unwrap_err().0;
        assert!(
            err.contains("needs about 65.")
                && err.contains("40.0 GiB is free")
                && err.contains("storage.num_partitions = 8, storage.buffer_capacity = 3"),
            "{err}"
        );
        // The advised layout fits by the estimate of that layout.
        let (config, e) = twitter(8, 3, false);
        assert!(e.check(&config, "cuda:0", 40 << 30).is_ok());
        // Read-ahead's spare slot is one partition more: 5.9 GiB at d = 100, element-wise.
        let (ahead_config, ahead) = twitter(8, 3, true);
        assert_eq!(ahead.total() - e.total(), e.slot);
        assert!((gib(e.slot) - 5.88).abs() < 0.01, "{:.2} GiB", gib(e.slot));
        let err = ahead
            .check(&ahead_config, "cuda:0", 40 << 30)
            .unwrap_err()
            .0;
        assert!(
            err.contains("turn storage.read_ahead off")
                && err.contains("storage.buffer_capacity = 2"),
            "{err}"
        );
        let err = e.check(&config, "cuda:0", 30 << 30).unwrap_err().0;
        assert!(
            err.contains("storage.gpu_edge_fraction")
                && err.contains("storage.buffer_capacity = 2"),
            "{err}"
        );
        let err = e.check(&config, "cuda:0", 10 << 30).unwrap_err().0;
        assert!(err.contains("no partitioning fits the node rows"), "{err}");
    }

    /// A worker of a K-GPU run holds three slots (two training, one arriving); when they do
    /// not fit, the advice is to park partitions in host memory: N ≥ 3K.
    #[test]
    fn a_k_gpu_worker_that_does_not_fit_is_advised_to_park_partitions() {
        let worker = |n: u32| {
            let mut config = Config::parse(
                "",
                &[
                    "model.decoder=dot".into(),
                    "model.dim=100".into(),
                    "training.gpus=2".into(),
                    format!("storage.num_partitions={n}"),
                ],
            )
            .unwrap();
            // What `Workers` gives each worker's trainer.
            config.storage.buffer_capacity = 2;
            config.storage.read_ahead = true;
            let scheme = PartitionScheme::new(41_652_230, n).unwrap();
            let n2 = u64::from(n * n);
            let buckets = vec![1_468_218_346 / n2; n2 as usize];
            let e = GpuEstimate::of(&config, scheme, &buckets, 0, 143_771 << 20);
            (config, e)
        };
        let (config, e) = worker(4);
        assert_eq!(config.storage.num_partitions, 4);
        // Three slots of a quarter of the table: 3 × 11.8 GiB, and the edges.
        let err = e.check(&config, "cuda:0", 40 << 30).unwrap_err().0;
        assert!(
            err.contains("park partitions in host memory")
                && err.contains("storage.num_partitions = ")
                && !err.contains("buffer_capacity"),
            "{err}"
        );
        let advised: u32 = err
            .split("storage.num_partitions = ")
            .nth(1)
            .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|d| d.parse().ok())
            .expect("a partition count");
        assert!(advised >= 6, "{err}");
        let (config, e) = worker(advised);
        assert_eq!(config.storage.num_partitions, advised, "N ≥ 3K is kept");
        assert!(e.check(&config, "cuda:0", 40 << 30).is_ok());
    }

    fn meta(entities: u64, train: u64) -> DatasetMeta {
        DatasetMeta {
            format_version: legend_dataset::FORMAT_VERSION,
            entities,
            relations: 1,
            has_relations: true,
            id_width: 4,
            splits: legend_dataset::SplitCounts {
                train,
                valid: train / 20,
                test: train / 20,
            },
            checksums: Default::default(),
            seed: 0,
            sources: Vec::new(),
            unseen_dropped: 0,
            unseen_kept: 0,
            extends: None,
        }
    }

    /// The `key=value` overrides a refusal advises, or `None` where it says none fits.
    fn advised_sets(message: &str) -> Option<Vec<String>> {
        let (_, rest) = message.split_once("is available: set ")?;
        let (list, _) = rest
            .split_once(" (about ")
            .expect("the advice ends with its estimate");
        Some(
            list.split(", ")
                .map(|kv| kv.replacen(" = ", "=", 1))
                .collect(),
        )
    }

    #[test]
    fn a_resumed_run_in_gpu_memory_is_estimated_as_the_run_it_continues() {
        // The Twitter-shaped run of scripts/gpu/billion-edge.sh: Dot, d = 100, memory backend,
        // N = 1, on a GPU. Its host holds the edges and the embeddings its evaluation gathers
        // (training peaked at 33.4 GiB on the H200); the resume read the checkpoint whole
        // before the GPU had it, and peaked at 48.2 GiB.
        let config = Config::parse(
            "",
            &[
                "model.decoder=dot".into(),
                "model.dim=100".into(),
                "evaluation.protocol=sampled".into(),
                "training.device=\"cuda:0\"".into(),
            ],
        )
        .unwrap();
        let mut twitter = meta(41_652_230, 1_468_218_346);
        twitter.splits.valid = 0;
        twitter.splits.test = 146_836;
        let e = HostEstimate::of(&config, &twitter, true);
        assert!(
            (gib(e.total()) - 33.6).abs() < 0.1,
            "{:.2} GiB",
            gib(e.total())
        );
        assert_eq!(e.tables, 0, "no node rows on the host");
        let available = 40 << 30;
        for resuming in [false, true] {
            assert_eq!(
                check_fits(&config, &twitter, true, resuming, available).ok(),
                Some(e),
                "resuming: {resuming}"
            );
        }
        // Where it does not fit, a resume is told what it may change: not its partitions.
        let err = check_fits(&config, &twitter, true, true, 30 << 30)
            .unwrap_err()
            .0;
        assert!(
            err.contains("what a resumed run may change") && err.contains("resume it where"),
            "{err}"
        );
        assert!(!err.contains("storage.num_partitions"), "{err}");
        // A new run may change its layout too (here no layout fits either: the edges and the
        // gathered embeddings stay).
        let err = check_fits(&config, &twitter, true, false, 30 << 30)
            .unwrap_err()
            .0;
        assert!(err.contains("storage.num_partitions"), "{err}");
    }

    #[test]
    fn the_issue_27_case_is_refused_plainly_and_fits_where_memory_allows() {
        // 100k entities at d = 100000: 74.5 GiB of tables; every evaluation gathers 37.3 GiB.
        let config = Config::parse("", &["model.dim=100000".into()]).unwrap();
        let meta = meta(100_000, 1_000_000);
        let err = check_fits(&config, &meta, false, false, 24 << 30)
            .unwrap_err()
            .0;
        assert!(
            err.contains("no setting of") && err.contains("37.3 GiB for evaluation"),
            "{err}"
        );
        let err = check_fits(&config, &meta, false, false, 64 << 30)
            .unwrap_err()
            .0;
        let sets = advised_sets(&err).unwrap_or_else(|| panic!("{err}"));
        assert_eq!(
            sets,
            [
                "storage.backend=\"file\"",
                "storage.num_partitions=16",
                "storage.buffer_capacity=3"
            ],
            "{err}"
        );
    }

    proptest::proptest! {
        /// Following the advice of a refusal fits (the estimator accepts the `key = value`
        /// settings as printed, through the configuration parser); a refusal that finds none
        /// is right that even the most frugal candidate does not fit.
        #[test]
        fn the_advice_fits_or_none_can(
            entities in 1u64..5_000_000,
            edges_per_entity in 0u64..60,
            dim_tenths in 1usize..4000,
            available_mib in 512u64..(256 << 10),
            filtered: bool,
            sampled: bool,
            file_partitions in proptest::option::of(1u32..64),
            resuming: bool,
        ) {
            let dim = dim_tenths * 10;
            let mut sets = vec![
                "model.decoder=dot".to_string(),
                format!("model.dim={dim}"),
                format!("training.negatives.filtered={filtered}"),
                format!("evaluation.protocol={}", if sampled { "sampled" } else { "filtered" }),
            ];
            if let Some(n) = file_partitions {
                let n = n.min(entities as u32);
                sets.extend(["storage.backend=file".into(), format!("storage.num_partitions={n}")]);
            }
            let config = Config::parse("", &sets).unwrap();
            let meta = meta(entities, entities * edges_per_entity);
            let available = available_mib << 20;
            match check_fits(&config, &meta, false, resuming, available) {
                Ok(e) => proptest::prop_assert!(e.total() <= available),
                Err(DoesNotFit(err)) => match advised_sets(&err) {
                    Some(advice) => {
                        let all: Vec<String> = sets.iter().cloned().chain(advice).collect();
                        let advised = Config::parse("", &all).map_err(|e| {
                            proptest::test_runner::TestCaseError::fail(format!("{err}: {e}"))
                        })?;
                        let e = check_fits(&advised, &meta, false, resuming, available);
                        proptest::prop_assert!(e.is_ok(), "{err}\nthen: {e:?}");
                    }
                    None => {
                        proptest::prop_assert!(err.contains("no setting of"), "{err}");
                        let mut frugal = config.clone();
                        frugal.evaluation.protocol = Protocol::Sampled;
                        frugal.training.negatives.filtered = false;
                        if resuming {
                            frugal.storage.buffer_capacity = 2;
                        } else {
                            let most = MAX_ADVISED_PARTITIONS.min(entities as u32);
                            frugal.storage.backend = Backend::File;
                            frugal.storage.num_partitions = 1 << most.ilog2();
                            frugal.storage.buffer_capacity = 2;
                        }
                        let least = HostEstimate::of(&frugal, &meta, false).total();
                        proptest::prop_assert!(least > available, "{err}: {least} fits");
                    }
                },
            }
        }
    }

    #[test]
    fn kib_fields_parse_as_bytes() {
        let status = "Name:\tlegendctl\nVmHWM:\t  123456 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(kib_field(status, "VmHWM:"), Some(123456 * 1024));
        assert_eq!(kib_field(status, "VmPeak:"), None);
        assert!(peak_rss_bytes().is_some_and(|b| b > 0));
        assert!(available_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn a_cgroup_limit_is_headroom_and_no_limit_is_none() {
        let root = tempfile::tempdir().unwrap();
        // v2: the process's cgroup, then an ancestor's tighter limit.
        let own = "0::/a/b\n";
        let dir = root.path().join("a/b");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1000\n").unwrap();
        std::fs::write(dir.join("memory.current"), "400\n").unwrap();
        assert_eq!(cgroup_headroom(root.path(), own), Some(600));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_headroom(root.path(), own), None);
        std::fs::write(root.path().join("a/memory.max"), "500\n").unwrap();
        std::fs::write(root.path().join("a/memory.current"), "450\n").unwrap();
        assert_eq!(cgroup_headroom(root.path(), own), Some(50));
        // v1: the memory hierarchy's line wins, "no limit" is a number near 2^63.
        let own = "4:memory:/x/y\n0::/\n";
        let dir = root.path().join("memory/x/y");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        std::fs::write(dir.join("memory.usage_in_bytes"), "100\n").unwrap();
        assert_eq!(cgroup_headroom(root.path(), own), None);
        let parent = root.path().join("memory/x");
        std::fs::write(parent.join("memory.limit_in_bytes"), "2000\n").unwrap();
        std::fs::write(parent.join("memory.usage_in_bytes"), "1500\n").unwrap();
        assert_eq!(cgroup_headroom(root.path(), own), Some(500));
    }
}
