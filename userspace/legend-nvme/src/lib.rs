//! Safe userspace access to the `legend_nvme` kernel module.
//!
//! - [`Sysfs`] lists NVMe controllers and moves them between the stock `nvme` driver and
//!   `legend_nvme` (what `legendctl device list|bind|unbind` does).
//! - [`Device`] opens `/dev/legend-nvme<N>` and wraps its ioctls and the doorbell `mmap`
//!   (what `legendctl device info|health` and the daemon use).
//! - [`Controller`] is what drives queues needs of a controller: the kernel module's [`Device`]
//!   implements it, and so does the userspace proxy controller (`legend-nvme-proxy`).

mod device;
mod sysfs;

/// The kernel module's isolation rules (`kmod/rules.rs`, which the module compiles too):
/// [`Sysfs::bind`] applies the module's decision before it moves a controller. Its range
/// arithmetic serves the module alone; its unit tests run here, on the host.
#[allow(dead_code)]
#[path = "../../../kmod/rules.rs"]
mod kmod_rules;

pub use device::{
    Controller, Device, DeviceMemory, Doorbells, Health, Mapping, QueuePairDoorbells,
};
pub use legend_uapi as uapi;
pub use sysfs::{PciController, Sysfs};

/// The namespaces a controller's `info` lists: its count, never beyond the array the ABI
/// defines.
pub fn namespaces(info: &uapi::Info) -> &[uapi::NamespaceInfo] {
    &info.namespaces[..(info.num_namespaces as usize).min(info.namespaces.len())]
}

/// Namespace `nsid` of the controller whose `info` this is, if it has one.
pub fn namespace(info: &uapi::Info, nsid: u32) -> Option<&uapi::NamespaceInfo> {
    namespaces(info).iter().find(|n| n.nsid == nsid)
}

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No PCI device with this address, or it is not an NVMe controller.
    #[error("No NVMe controller at {0}")]
    NotFound(String),
    /// Binding would take a controller whose block devices are in use.
    #[error("{bdf} is in use ({reason}); unmount/close it or pass --force")]
    InUse {
        /// PCI address.
        bdf: String,
        /// What uses it.
        reason: String,
    },
    /// The controller did not appear under the expected driver.
    #[error(
        "{bdf} did not bind to {driver} (the kernel log says why: dmesg | grep {bdf}); {restored}"
    )]
    NotBound {
        /// PCI address.
        bdf: String,
        /// Driver expected.
        driver: String,
        /// Where the controller is now: back with the driver it had, or without one.
        restored: String,
    },
    /// The platform lacks what `legend_nvme` requires to isolate the controller's DMA and
    /// interrupts; nothing was changed.
    #[error("{bdf} cannot be given to legend_nvme: {reasons}")]
    Isolation {
        /// PCI address.
        bdf: String,
        /// Each missing requirement, with its fix (and the module parameter that accepts it).
        reasons: String,
    },
    /// A sysfs or procfs access failed.
    #[error("Cannot access {path}")]
    Sysfs {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening the character device failed.
    #[error("Cannot open {path}")]
    Open {
        /// The device file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// An ioctl or mmap of the device failed.
    #[error("{op} failed")]
    Ioctl {
        /// The operation.
        op: &'static str,
        /// The errno, as the uapi documentation describes it.
        #[source]
        source: std::io::Error,
    },
    /// An admin command completed with an NVMe error status.
    #[error("{op} completed with NVMe status {status:#x}")]
    Status {
        /// The operation.
        op: &'static str,
        /// Status code type << 8 | status code.
        status: u32,
    },
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    /// `e` and its sources, each after a `: `, as the CLI and the daemon print errors.
    fn chain(e: &dyn std::error::Error) -> String {
        let sources = std::iter::successors(Some(e), |e| e.source());
        sources
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(": ")
    }

    #[test]
    fn a_failed_call_ends_at_the_os_words() {
        let e = Error::Ioctl {
            op: "CREATE_QUEUE_PAIR",
            source: std::io::Error::from_raw_os_error(libc::EBUSY),
        };
        let text = chain(&e);
        assert!(text.starts_with("CREATE_QUEUE_PAIR"), "{text}");
        assert!(text.contains("Device or resource busy"), "{text}");
    }
}
