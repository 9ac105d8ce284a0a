//! What the daemon reports of NVMe controllers and the module's devices (`legendctl device`).

use serde::{Deserialize, Serialize};

/// A controller as the module reports it (`legendctl device info`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The device node.
    pub device: String,
    /// The module's ABI version.
    pub abi_version: u32,
    /// PCI address, `dddd:bb:dd.f`.
    pub pci_address: String,
    /// NVMe version, `major.minor.tertiary`.
    pub nvme_version: String,
    /// Model number.
    pub model: String,
    /// Serial number.
    pub serial: String,
    /// Firmware revision.
    pub firmware: String,
    /// Most entries an I/O queue may have.
    pub max_queue_entries: u32,
    /// Bytes between doorbells.
    pub doorbell_stride: u32,
    /// Largest transfer of one command in bytes (0: no limit).
    pub max_transfer: u32,
    /// I/O queue pairs granted.
    pub queue_pairs: u32,
    /// Active namespaces.
    pub namespaces: Vec<NamespaceInfo>,
}

/// One namespace of a [`DeviceInfo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceInfo {
    /// Namespace id.
    pub nsid: u32,
    /// Bytes per logical block.
    pub lba_bytes: u64,
    /// Logical blocks.
    pub lbas: u64,
}

/// ASCII identity fields: space or NUL padded.
fn identity_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .trim_end_matches([' ', '\0'])
        .to_owned()
}

impl DeviceInfo {
    /// The view of `info`, read from `device`.
    pub fn new(device: &str, info: &legend_nvme::uapi::Info) -> Self {
        let v = info.nvme_version;
        DeviceInfo {
            device: device.to_owned(),
            abi_version: info.abi_version,
            pci_address: format!(
                "{:04x}:{:02x}:{:02x}.{}",
                info.pci_domain, info.pci_bus, info.pci_device, info.pci_function
            ),
            nvme_version: format!("{}.{}.{}", v >> 16, (v >> 8) & 0xff, v & 0xff),
            model: identity_text(&info.model),
            serial: identity_text(&info.serial),
            firmware: identity_text(&info.firmware),
            max_queue_entries: info.max_queue_entries,
            doorbell_stride: info.doorbell_stride,
            max_transfer: info.max_transfer,
            queue_pairs: info.queue_pairs,
            namespaces: legend_nvme::namespaces(info)
                .iter()
                .map(|n| NamespaceInfo {
                    nsid: n.nsid,
                    lba_bytes: 1u64 << n.lba_shift.min(63),
                    lbas: n.blocks,
                })
                .collect(),
        }
    }
}

/// A controller's SMART / health log (`legendctl device health`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceHealth {
    /// The device node.
    pub device: String,
    /// Critical warning bits (0 is healthy).
    pub critical_warning: u8,
    /// Composite temperature.
    pub temperature_celsius: i32,
    /// Available spare, percent.
    pub available_spare_percent: u8,
    /// Share of the rated endurance used, percent.
    pub percentage_used: u8,
    /// Data units (1000 × 512 bytes) read.
    pub data_units_read: u64,
    /// Data units written.
    pub data_units_written: u64,
    /// Power-on hours.
    pub power_on_hours: u64,
    /// Unsafe shutdowns.
    pub unsafe_shutdowns: u64,
    /// Media and data integrity errors.
    pub media_errors: u64,
}

impl DeviceHealth {
    /// The view of `h`, read from `device`.
    pub fn new(device: &str, h: &legend_nvme::Health) -> Self {
        DeviceHealth {
            device: device.to_owned(),
            critical_warning: h.critical_warning,
            temperature_celsius: i32::from(h.temperature_kelvin) - 273,
            available_spare_percent: h.available_spare,
            percentage_used: h.percentage_used,
            data_units_read: h.data_units_read,
            data_units_written: h.data_units_written,
            power_on_hours: h.power_on_hours,
            unsafe_shutdowns: h.unsafe_shutdowns,
            media_errors: h.media_errors,
        }
    }
}

/// Whether `path` names a device node of the module (`/dev/legend-nvmeN`), the only files the
/// daemon opens for a device request.
pub fn is_device_node(path: &str) -> bool {
    path.strip_prefix("/dev/legend-nvme")
        .is_some_and(|n| !n.is_empty() && n.len() <= 4 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// An NVMe controller on the PCI bus and who drives it (`legendctl device list`, `bind`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeController {
    /// PCI address.
    pub bdf: String,
    /// The bound driver (`nvme`, `legend_nvme`), if any.
    pub driver: Option<String>,
    /// PCI vendor id, hex.
    pub vendor: String,
    /// PCI device id, hex.
    pub device: String,
    /// Its block devices while `nvme` drives it.
    pub block_devices: Vec<String>,
    /// Its `/dev/legend-nvmeN` while `legend_nvme` drives it.
    pub legend_device: Option<String>,
}

impl From<legend_nvme::PciController> for NvmeController {
    fn from(c: legend_nvme::PciController) -> Self {
        NvmeController {
            bdf: c.bdf,
            driver: c.driver,
            vendor: format!("{:04x}", c.id.0),
            device: format!("{:04x}", c.id.1),
            block_devices: c.block_devices,
            legend_device: c.char_device,
        }
    }
}
