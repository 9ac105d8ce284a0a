//! Device requests: the NVMe controllers, and what the module reports of its device nodes
//! (opened read-only, as monitors beside a running job).

use std::path::Path;

use legend_daemon_api::{ErrorCode, NvmeController, Reply};
use legend_engine::error_chain::with_sources;
use legend_engine::store::QueueBackend;
use legend_engine::store::StoreFile;
use legend_engine::store::controllers::{self, SharedController};
use legend_fs::Unguarded;

use super::error;

fn controller_json(c: legend_nvme::PciController) -> serde_json::Value {
    serde_json::to_value(NvmeController::from(c)).expect("plain fields serialise")
}

/// The NVMe controllers, their driver and nodes.
pub fn devices() -> Reply {
    match legend_nvme::Sysfs::default().list() {
        Ok(list) => Reply::Data {
            data: serde_json::Value::Array(list.into_iter().map(controller_json).collect()),
        },
        Err(e) => error(ErrorCode::Refused, with_sources(&e)),
    }
}

/// What `read` reports of the module's device `node`, opened as the jobs open it (one writer
/// per controller: a running job's handle is shared, not fought over).
pub fn report(
    node: &str,
    read: impl FnOnce(
        &legend_nvme::Device,
    ) -> legend_nvme::Result<serde_json::Result<serde_json::Value>>,
) -> Reply {
    if !legend_daemon_api::is_device_node(node) {
        return error(
            ErrorCode::BadRequest,
            format!("{node}: not a device node of legend_nvme (/dev/legend-nvmeN)"),
        );
    }
    let file = StoreFile::open(Path::new(node), &Unguarded);
    let controller = match file.and_then(|file| controllers::open(QueueBackend::Nvme, &file, None))
    {
        Ok(c) => c,
        Err(e) => return error(ErrorCode::Refused, with_sources(&e)),
    };
    let SharedController::Device(device) = controller else {
        unreachable!("an nvme controller is a device");
    };
    match read(&device) {
        Ok(Ok(data)) => Reply::Data { data },
        Ok(Err(e)) => error(ErrorCode::Unavailable, with_sources(&e)),
        Err(e) => error(
            ErrorCode::Unavailable,
            format!("{node}: {}", with_sources(&e)),
        ),
    }
}

/// The controller after a bind or unbind, or why it failed.
pub fn change(result: legend_nvme::Result<legend_nvme::PciController>) -> Reply {
    match result {
        Ok(c) => Reply::Data {
            data: controller_json(c),
        },
        Err(e) => error(ErrorCode::Refused, with_sources(&e)),
    }
}
