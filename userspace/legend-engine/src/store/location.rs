//! How a run's store is reached, as its record and its configuration name it: plain data that
//! the configuration, the run record and the stores share.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Which kind of controller drives a store's queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueBackend {
    /// `/dev/legend-nvmeN`: an SSD bound to the `legend_nvme` module.
    Nvme,
    /// The userspace proxy controller over a file or block device.
    Proxy,
}

/// Where a store lives behind NVMe queues: with the path (the device node, or the proxy's
/// backing file), enough to open it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueLocation {
    /// The controller kind.
    pub backend: QueueBackend,
    /// Namespace identifier.
    pub namespace: u32,
    /// The store's first LBA.
    pub start_lba: u64,
}

/// One member of a run's store, as its record keeps it: the file, block device, device node
/// or proxy backing file, and how it is reached when behind NVMe queues.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreMember {
    /// The path.
    pub path: PathBuf,
    /// `nvme`, `proxy`: the controller kind, namespace and start LBA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueLocation>,
}
