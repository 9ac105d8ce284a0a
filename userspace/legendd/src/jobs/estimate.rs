//! What a job may use: its cgroup's memory limit (its estimated peak × 1.25 + 512 MiB), its
//! CPU quota, its `RLIMIT_MEMLOCK` (what its store pins), all from its spec and what the daemon
//! reads of its run and dataset as its submitter (small records, read within a bound).

use legend_daemon_api::JobSpec;
use legend_dataset::{DatasetMeta, Split};
use legend_engine::config::DeviceChoice;
use legend_engine::footprint::HostEstimate;
use legend_engine::run::{self, RunMeta};
use legend_engine::{Config, run::CONFIG_FILE};

use super::table::{GPU_SET_QUEUE, gpu_queue};
use crate::access::Peer;

/// What the margin adds to an estimate: the process itself, allocator slack.
pub const MARGIN_BYTES: u64 = 512 << 20;

/// The limit when a job's needs cannot be read (it then fails reading them itself).
const UNKNOWN_BYTES: u64 = 1 << 30;

/// Pinned memory every job may hold besides its store's (rings, small staging).
const BASE_PINS: u64 = 64 << 20;

/// Bytes of a label and its index entry, for a run's labels held in memory.
const LABEL_BYTES: u64 = 96;

/// A job's needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// Its estimated peak memory.
    pub estimate: u64,
    /// Cores it uses at once (`training.threads`); `None`: every core.
    pub cpus: Option<u32>,
    /// Memory its store pins (io_uring's registered buffers, the module's mappings).
    pub pins: u64,
}

impl Needs {
    /// The memory limit of its cgroup: the estimate × 1.25 + [`MARGIN_BYTES`].
    pub fn memory_limit(&self) -> u64 {
        self.estimate
            .saturating_add(self.estimate / 4)
            .saturating_add(MARGIN_BYTES)
    }

    /// Its `RLIMIT_MEMLOCK`: its store's pins and room for rings and small buffers, within
    /// `ceiling` (what the daemon may give; `None`: no bound).
    pub fn memlock(&self, ceiling: Option<u64>) -> u64 {
        let want = self.pins.saturating_add(BASE_PINS);
        ceiling.map_or(want, |c| want.min(c))
    }
}

/// The configuration a train job runs with: its own for a new run, the run's `config.toml`
/// with the job's overrides when it resumes, read as `reader` (its submitter) could read it:
/// the daemon never reads, and so never quotes back in a parse error, what they could not.
pub fn train_config(spec: &JobSpec, reader: &Peer, resuming: bool) -> Result<Config, String> {
    let JobSpec::Train {
        out, config, sets, ..
    } = spec
    else {
        return Err("not a train job".into());
    };
    if resuming {
        // Through the run's directory: not through a link, not a FIFO, not a large file.
        let dir = reader.open_dir(out)?;
        if !dir.is_file(run::META_FILE).unwrap_or(false) {
            return Err(format!(
                "{}: not a run directory (no run.toml)",
                out.display()
            ));
        }
        let text = dir
            .read_to_string(CONFIG_FILE)
            .map_err(|e| format!("{}: {e}", dir.join(CONFIG_FILE).display()))?;
        Config::parse(&text, sets)
    } else {
        Config::parse(config, sets)
    }
    .map_err(|e| e.to_string())
}

/// The device queue a train job of `config` runs in: `cpu`, `cuda:N`, or `cuda` (any
/// `training.gpus` GPUs, given when it starts) on several GPUs; eval and export jobs run on
/// the CPU.
pub fn queue_of(config: &Config) -> String {
    let ordinal = match config.device() {
        DeviceChoice::Cpu => return "cpu".into(),
        DeviceChoice::Cuda(n) => n,
        DeviceChoice::Auto if legend_cuda::driver_present() => 0,
        DeviceChoice::Auto => return "cpu".into(),
    };
    if config.training.gpus > 1 {
        GPU_SET_QUEUE.into()
    } else {
        gpu_queue(u32::try_from(ordinal).unwrap_or(u32::MAX))
    }
}

/// The run record `run.toml` of the run `path`, read as `reader`.
pub fn run_meta(reader: &Peer, path: &std::path::Path) -> Result<RunMeta, String> {
    let dir = reader.open_dir(path)?;
    run::read_meta(&dir).map_err(|e| legend_engine::error_chain::with_sources(&e))
}

/// The dataset description at `path`, read as `reader`.
pub fn dataset_meta(reader: &Peer, path: &std::path::Path) -> Result<DatasetMeta, String> {
    let dir = reader.open_dir(path)?;
    DatasetMeta::read_in(&dir).map_err(|e| legend_engine::error_chain::with_sources(&e))
}

/// What job `spec` (in `queue`; a train job resuming or not) needs; serve jobs hold at most
/// `serve_host` bytes of entity rows.
pub fn needs(
    spec: &JobSpec,
    reader: &Peer,
    queue: &str,
    resuming: bool,
    serve_host: Option<u64>,
) -> Needs {
    let unknown = Needs {
        estimate: UNKNOWN_BYTES,
        cpus: None,
        pins: 0,
    };
    match spec {
        JobSpec::Train { dataset, out, .. } => {
            let Ok(config) = train_config(spec, reader, resuming) else {
                return unknown;
            };
            let path = match dataset {
                Some(d) => d.clone(),
                None => match run_meta(reader, out) {
                    Ok(meta) => meta.dataset,
                    Err(_) => return unknown,
                },
            };
            let Ok(meta) = dataset_meta(reader, &path) else {
                return unknown;
            };
            let on_cuda = queue.starts_with("cuda");
            let e = HostEstimate::of(&config, &meta, on_cuda, resuming);
            Needs {
                estimate: e.total(),
                cpus: u32::try_from(config.training.threads)
                    .ok()
                    .filter(|&t| t > 0),
                pins: if config.uses_store() { e.tables } else { 0 },
            }
        }
        JobSpec::Eval { run, .. } | JobSpec::Export { run, .. } | JobSpec::Serve { run, .. } => {
            let Ok(meta) = run_meta(reader, run) else {
                return unknown;
            };
            let Ok(data) = dataset_meta(reader, &meta.dataset) else {
                return unknown;
            };
            let entity_floats = meta.entities.saturating_mul(meta.dim as u64);
            let tables = entity_floats
                .saturating_mul(4)
                .saturating_add(meta.relation_floats() as u64 * 8);
            let labels = (data.entities + data.relations).saturating_mul(LABEL_BYTES);
            let edges: u64 = Split::ALL.iter().map(|&s| data.splits.get(s)).sum();
            let estimate = match spec {
                // Both tables and their AdaGrad state, and every split's edges for the filter.
                JobSpec::Eval { .. } => tables
                    .saturating_mul(2)
                    .saturating_add(edges.saturating_mul(24)),
                // Streamed: a partition's rows at a time, the labels.
                JobSpec::Export { .. } => labels.saturating_add(tables / 4),
                _ => {
                    let rows = serve_host.map_or(tables, |h| tables.min(h));
                    // The filter of known triples, and the answers in flight.
                    rows.saturating_add(labels)
                        .saturating_add(edges.saturating_mul(24))
                        .saturating_add(16 << 20)
                }
            };
            Needs {
                estimate: estimate.saturating_add(MARGIN_BYTES),
                cpus: None,
                pins: 0,
            }
        }
    }
}
