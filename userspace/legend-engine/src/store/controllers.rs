//! The NVMe controllers of the `nvme` and `proxy` backends, one per device (or backing file) in
//! this process: `legend_nvme` has one writer per controller, and two proxies over one file
//! would race, so every store, the trainer's and an evaluation's, shares it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use legend_cuda::Gpu;
use legend_cuda::nvme_io::{CudaDeviceMemory, RingPlacement};
use legend_nvme::{Controller, Device};
pub use legend_nvme_proxy::DeviceModel;
use legend_nvme_proxy::{Proxy, ProxyOptions};

use super::{PartitionStoreError, QueueBackend, StoreFile};

/// An open controller of either kind.
#[derive(Clone)]
pub enum SharedController {
    /// The module's device.
    Device(Arc<Device>),
    /// A userspace proxy.
    Proxy(Arc<Proxy>),
}

impl SharedController {
    /// The controller, for the store.
    pub fn controller(&self) -> Arc<dyn Controller> {
        match self {
            SharedController::Device(d) => d.clone(),
            SharedController::Proxy(p) => p.clone(),
        }
    }

    /// How the GPU I/O kernels on `gpu` reach this controller, the one way every user of them
    /// sets it up: a proxy's queues live in pinned host memory, and it moves the kernels' data
    /// with `gpu`'s copy engine (attached here); a real controller's queues live in GPU memory,
    /// which it reads and writes peer to peer.
    ///
    /// # Errors
    ///
    /// The copy engine cannot be made, or the proxy refuses it.
    pub fn gpu_placement(&self, gpu: &Gpu) -> Result<RingPlacement, PartitionStoreError> {
        match self {
            SharedController::Proxy(p) => {
                let memory =
                    CudaDeviceMemory::new(gpu).map_err(|e| PartitionStoreError::Controller {
                        what: "setting up the proxy controller's copies".into(),
                        source: Box::new(e),
                    })?;
                p.attach_device(Arc::new(memory))
                    .map_err(|e| PartitionStoreError::Controller {
                        what: "attaching the GPU to the proxy controller".into(),
                        source: Box::new(e),
                    })?;
                Ok(RingPlacement::Host)
            }
            SharedController::Device(_) => Ok(RingPlacement::Device),
        }
    }
}

enum Held {
    Device(Weak<Device>),
    Proxy(Weak<Proxy>),
}

static OPEN: Mutex<Option<HashMap<(QueueBackend, PathBuf), Held>>> = Mutex::new(None);

/// The controller of `backend` at `file`, opening it unless this process already has it; a
/// proxy it opens serves at `proxy_model`'s rates (one already open keeps its own).
///
/// # Errors
///
/// A device that cannot be opened (module not loaded, controller not bound, another writer) or
/// a backing file the proxy cannot serve, with the path and what to do.
pub fn open(
    backend: QueueBackend,
    file: &StoreFile,
    proxy_model: Option<DeviceModel>,
) -> Result<SharedController, PartitionStoreError> {
    let path = file.path();
    let path = path.as_path();
    let key_path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    let map = open.get_or_insert_with(HashMap::new);
    let key = (backend, key_path);
    let held = match map.get(&key) {
        Some(Held::Device(w)) => w.upgrade().map(SharedController::Device),
        Some(Held::Proxy(w)) => w.upgrade().map(SharedController::Proxy),
        None => None,
    };
    if let Some(c) = held {
        return Ok(c);
    }
    let opened = match backend {
        QueueBackend::Nvme => {
            let d = Device::open(&path.to_string_lossy()).map_err(|e| PartitionStoreError::Controller {
                what: format!(
                    "opening {} (is the controller bound to legend_nvme: `modprobe legend_nvme`, \
                     `legendctl device bind BDF`; and is no other process, such as legendd, its \
                     writer?)",
                    path.display()
                ),
                source: Box::new(e),
            })?;
            let d = Arc::new(d);
            map.insert(key, Held::Device(Arc::downgrade(&d)));
            SharedController::Device(d)
        }
        QueueBackend::Proxy => {
            let opts = ProxyOptions {
                model: proxy_model,
                ..ProxyOptions::default()
            };
            let p = Proxy::open_in(&file.dir, &file.name, &opts).map_err(|e| {
                PartitionStoreError::Controller {
                    what: format!("starting the proxy controller over {}", path.display()),
                    source: Box::new(e),
                }
            })?;
            let p = Arc::new(p);
            map.insert(key, Held::Proxy(Arc::downgrade(&p)));
            SharedController::Proxy(p)
        }
    };
    Ok(opened)
}
