//! LBA extents of jobs on NVMe namespaces (`storage.backend = "nvme"` or `"proxy"`): a job
//! writes raw blocks, so two users' stores on one namespace must never overlap, and nobody may
//! reach another's. The daemon assigns each new run an extent from the table it keeps at the
//! start of the namespace (legend-storage's [`Extents`]) and sets the run's `storage.start_lba`
//! to it; resuming, evaluating or exporting a run checks that the extent is still the run's; the
//! extent is freed when the run's last train job is deleted.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use legend_engine::Config;
use legend_engine::store::controllers::{self};
use legend_engine::store::{QueueBackend, QueueLocation};
use legend_engine::store::{StoreFile, file::run_store_bytes};
use legend_fs::Unguarded;
use legend_storage::{Extents, NvmeTarget, Target};

use crate::access::{JobGuard, Peer};

/// Serialises changes to the tables: each is read, changed and committed under this lock.
static TABLES: Mutex<()> = Mutex::new(());

/// A run's store on a namespace as the daemon recorded it when the job was submitted: what the
/// run's `run.toml` must still name when the job starts (an edit in between cannot point the
/// job at another store or extent).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedStore {
    /// The device node or the proxy's backing file.
    pub path: PathBuf,
    /// Controller kind, namespace, first LBA.
    pub queue: QueueLocation,
}

/// How a run's store is placed: the namespace behind `path` and the run's key in its table.
pub struct Placement {
    /// The device node or the proxy's backing file.
    pub path: PathBuf,
    /// Controller kind and namespace (`start_lba` is the run's).
    pub queue: QueueLocation,
}

/// The table's key for `run`: its absolute path with the parent's symlinks resolved, so that
/// two spellings of one directory are one run.
pub fn run_key(run: &Path) -> String {
    let resolved = match (run.parent(), run.file_name()) {
        (Some(parent), Some(name)) => std::fs::canonicalize(parent)
            .map(|p| p.join(name))
            .unwrap_or_else(|_| run.to_owned()),
        _ => run.to_owned(),
    };
    resolved.to_string_lossy().into_owned()
}

/// Refuses a path given as an NVMe store that is not one of the module's device nodes: the
/// daemon opens those with its own rights, never a path a submitter chose elsewhere (its open
/// would tell them what lies there).
pub fn check_device_node(path: &Path) -> Result<(), String> {
    if path.to_str().is_some_and(legend_daemon_api::is_device_node) {
        return Ok(());
    }
    Err(format!(
        "{}: storage.backend = \"nvme\" takes a device node of legend_nvme \
         (/dev/legend-nvmeN) as storage.path",
        crate::paths::shown(path)
    ))
}

/// The extent table of `place`'s namespace, for a job of `owner`: a device node is the
/// daemon's, a proxy's backing file must lie in a directory of the job's owner.
fn open_table(place: &Placement, owner: u32) -> Result<Extents, String> {
    if place.queue.backend == QueueBackend::Nvme {
        check_device_node(&place.path)?;
    }
    let file = match place.queue.backend {
        QueueBackend::Nvme => StoreFile::open(&place.path, &Unguarded),
        QueueBackend::Proxy => {
            StoreFile::open(&place.path, &JobGuard::new(Peer::of_uid(owner), false))
        }
    };
    let controller = file
        .and_then(|file| controllers::open(place.queue.backend, &file, None))
        .map_err(|e| e.to_string())?;
    let target = NvmeTarget {
        controller: controller.controller(),
        namespace: place.queue.namespace,
        start_lba: 0,
    };
    Extents::open_or_create(&Target::Nvme(&target)).map_err(|e| {
        format!(
            "{} namespace {}: its extent table: {e}",
            place.path.display(),
            place.queue.namespace
        )
    })
}

/// Where a new run of `config` would put its store, if on a namespace.
pub fn placement(config: &Config, run: &Path) -> Option<Placement> {
    let queue = config.queue_location()?;
    Some(Placement {
        path: config.store_path(run),
        queue,
    })
}

impl From<RecordedStore> for Placement {
    fn from(r: RecordedStore) -> Placement {
        Placement {
            path: r.path,
            queue: r.queue,
        }
    }
}

impl Placement {
    /// What the job's record keeps of it.
    pub fn recorded(&self) -> RecordedStore {
        RecordedStore {
            path: self.path.clone(),
            queue: self.queue,
        }
    }
}

/// Gives the new run `run` of `owner` an extent large enough for its store and returns its
/// first LBA, the `storage.start_lba` the job must use.
pub fn assign(
    place: &Placement,
    config: &Config,
    dataset: &Path,
    run: &Path,
    owner: &Peer,
) -> Result<u64, String> {
    if config.storage.start_lba != 0 {
        return Err(
            "storage.start_lba: legendd assigns the extents of jobs on NVMe namespaces; leave it \
             out"
            .into(),
        );
    }
    let meta = crate::jobs::estimate::dataset_meta(owner, dataset)?;
    let owner = owner.uid;
    let _guard = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    let mut table = open_table(place, owner)?;
    let bytes = run_store_bytes(config, &meta, table.block_size()).map_err(|e| e.to_string())?;
    let key = run_key(run);
    let lba = table
        .allocate(&key, owner, bytes)
        .map_err(|e| e.to_string())?;
    tracing::info!(
        "extent of {key} (uid {owner}): {} namespace {} from LBA {lba}, {bytes} bytes",
        place.path.display(),
        place.queue.namespace
    );
    Ok(lba)
}

/// Checks that `run`'s store, at `place`, is still in an extent of the run that `peer` may use.
pub fn check(place: &Placement, run: &Path, peer: &Peer) -> Result<(), String> {
    let _guard = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    let table = open_table(place, peer.uid)?;
    let key = run_key(run);
    match table.table().find(&key) {
        Some(e) if e.start_lba == place.queue.start_lba && peer.may_manage(e.owner) => Ok(()),
        Some(e) if e.start_lba == place.queue.start_lba => Err(format!(
            "{key}: its store's extent belongs to uid {}",
            e.owner
        )),
        _ => Err(format!(
            "{key}: its store's extent (LBA {} of {}) is no longer the run's: the run was \
             deleted",
            place.queue.start_lba,
            place.path.display()
        )),
    }
}

/// Frees `run`'s extent, if it has one at `place`.
pub fn release(place: &Placement, run: &Path, owner: u32) -> Result<bool, String> {
    let _guard = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    let mut table = open_table(place, owner)?;
    let key = run_key(run);
    let freed = table.free(&key).map_err(|e| e.to_string())?;
    if let Some(e) = &freed {
        tracing::info!(
            "extent of {key} freed: LBA {} + {} blocks",
            e.start_lba,
            e.blocks
        );
    }
    Ok(freed.is_some())
}

/// Where an existing run's store is, if on a namespace (from the `run.toml` of the run opened
/// as `run`, for its submitter).
pub fn recorded_placement(run: &legend_fs::Dir) -> Option<Placement> {
    let meta = legend_engine::run::read_meta(run).ok()?;
    Some(Placement {
        path: meta.store?,
        queue: meta.store_queue?,
    })
}
