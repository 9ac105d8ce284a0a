//! `legendctl device`: NVMe controllers for the `legend_nvme` module.

use std::path::Path;

use anyhow::{Context, bail};
use legend_daemon_api::{DeviceHealth, DeviceInfo, NvmeController, Reply, Request};
use legend_nvme::{Controller, Device, Sysfs};

use super::client::Client;

/// The module's name, as `modprobe` and `/sys/module` know it.
const MODULE: &str = "legend_nvme";

/// Whether the `legend_nvme` module is loaded, under the sysfs root `sys` (normally `/sys`).
fn module_loaded(sys: &Path) -> bool {
    sys.join("module").join(MODULE).is_dir()
}

/// The next setup step (Documentation/admin-guide.md, "Install" and "Bind and unbind") when no
/// legend device can be used: load the module, then bind a controller.
fn setup_hint(module_loaded: bool) -> &'static str {
    if module_loaded {
        "no controller is bound to legend_nvme: `legendctl device bind BDF` hands one over (BDF from `legendctl device list`)"
    } else {
        "the legend_nvme module is not loaded: `modprobe legend_nvme`, then `legendctl device bind BDF` (BDF from `legendctl device list`; see Documentation/admin-guide.md)"
    }
}

/// Opens a device node read-only; `None` when this user may not (the service's nodes are its
/// own: ask legendd instead). When the node is missing, says which setup step is left.
fn open_read_only(path: &str) -> anyhow::Result<Option<Device>> {
    match Device::open_read_only(path) {
        Ok(d) => Ok(Some(d)),
        Err(legend_nvme::Error::Open { source, .. })
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            Ok(None)
        }
        Err(err) => {
            let missing = matches!(
                &err,
                legend_nvme::Error::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound
            );
            let err = anyhow::Error::new(err);
            Err(if missing {
                err.context(setup_hint(module_loaded(Path::new("/sys"))))
            } else {
                err
            })
        }
    }
}

/// Asks legendd for what `request` reports of a device this user may not open.
fn from_daemon<T: serde::de::DeserializeOwned>(
    socket: Option<&Path>,
    request: Request,
) -> anyhow::Result<T> {
    let mut client = Client::connect(socket)
        .context("only legendd may open the device nodes, and it cannot be reached")?;
    match client.call(request)? {
        Reply::Data { data } => Ok(serde_json::from_value(data)?),
        other => bail!("unexpected reply from legendd: {other:?}"),
    }
}

/// Arguments of `legendctl device`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: DeviceCommand,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(clap::Subcommand)]
enum DeviceCommand {
    /// NVMe controllers, their driver, block devices and legend device node.
    List,
    /// Move a controller from `nvme` to `legend_nvme`: refused while its namespaces are in use, and,
    /// before anything changes, where the platform cannot isolate it (no translating IOMMU, a
    /// shared IOMMU group, no interrupt remapping, ATS, firmware 1:1 regions), naming the fix.
    Bind {
        /// PCI address, e.g. 0000:01:00.0.
        bdf: String,
        /// Bind even if a namespace is mounted or open.
        #[arg(long)]
        force: bool,
    },
    /// Hand a controller back to `nvme`.
    Unbind {
        /// PCI address.
        bdf: String,
    },
    /// What the module reports for a controller: identity, limits, namespaces.
    Info {
        /// Device node (default /dev/legend-nvme0).
        #[arg(default_value = "/dev/legend-nvme0")]
        device: String,
    },
    /// SMART / health log of a controller.
    Health {
        /// Device node (default /dev/legend-nvme0).
        #[arg(default_value = "/dev/legend-nvme0")]
        device: String,
    },
}

pub fn run(args: Args, socket: Option<&Path>) -> anyhow::Result<()> {
    let sysfs = Sysfs::default();
    match args.command {
        DeviceCommand::List => {
            let list: Vec<NvmeController> = sysfs.list()?.into_iter().map(Into::into).collect();
            let loaded = module_loaded(Path::new("/sys"));
            if !loaded || !list.iter().any(|c| c.driver.as_deref() == Some(MODULE)) {
                tracing::warn!("{}", setup_hint(loaded));
            }
            if args.json {
                return super::print_json(&list);
            }
            if list.is_empty() {
                outln!("no NVMe controllers found")?;
            }
            for c in list {
                outln!(
                    "{}  {}:{}  driver {}  block {}  legend {}",
                    c.bdf,
                    c.vendor,
                    c.device,
                    c.driver.as_deref().unwrap_or("(none)"),
                    if c.block_devices.is_empty() {
                        "-".into()
                    } else {
                        c.block_devices.join(",")
                    },
                    c.legend_device.as_deref().unwrap_or("-"),
                )?;
            }
        }
        // Only root writes sysfs; everyone else asks legendd, which binds for its admin group.
        DeviceCommand::Bind { bdf, force } if !nix::unistd::geteuid().is_root() => report(
            args.json,
            "bound",
            from_daemon(socket, Request::Bind { bdf, force })?,
        )?,
        DeviceCommand::Unbind { bdf } if !nix::unistd::geteuid().is_root() => report(
            args.json,
            "handed back to nvme",
            from_daemon(socket, Request::Unbind { bdf })?,
        )?,
        DeviceCommand::Bind { bdf, force } => {
            // Binding without the module would leave the controller with no driver at all.
            if !module_loaded(Path::new("/sys")) {
                bail!(
                    "the legend_nvme module is not loaded: `modprobe legend_nvme` first (see Documentation/admin-guide.md)"
                );
            }
            report(args.json, "bound", sysfs.bind(&bdf, force)?.into())?
        }
        DeviceCommand::Unbind { bdf } => {
            report(args.json, "handed back to nvme", sysfs.unbind(&bdf)?.into())?
        }
        DeviceCommand::Info { device } => {
            let view: DeviceInfo = match open_read_only(&device)? {
                Some(d) => DeviceInfo::new(&device, &d.info()?),
                None => from_daemon(socket, Request::DeviceInfo { device })?,
            };
            if args.json {
                return super::print_json(&view);
            }
            outln!(
                "{} ({}): {} serial {} firmware {}, NVMe {}, {} queue pairs of up to {} entries, max transfer {} B",
                view.device,
                view.pci_address,
                view.model,
                view.serial,
                view.firmware,
                view.nvme_version,
                view.queue_pairs,
                view.max_queue_entries,
                view.max_transfer
            )?;
            for n in &view.namespaces {
                outln!(
                    "  namespace {}: {} blocks of {} B",
                    n.nsid,
                    n.lbas,
                    n.lba_bytes
                )?;
            }
        }
        DeviceCommand::Health { device } => {
            let view: DeviceHealth = match open_read_only(&device)? {
                Some(d) => DeviceHealth::new(&device, &d.health()?),
                None => from_daemon(socket, Request::DeviceHealth { device })?,
            };
            if args.json {
                return super::print_json(&view);
            }
            outln!(
                "{}: critical warning {:#04x}, {} °C, spare {}%, used {}%, {} power-on hours, {} unsafe shutdowns, {} media errors",
                view.device,
                view.critical_warning,
                view.temperature_celsius,
                view.available_spare_percent,
                view.percentage_used,
                view.power_on_hours,
                view.unsafe_shutdowns,
                view.media_errors
            )?;
        }
    }
    Ok(())
}

fn report(json: bool, what: &str, c: NvmeController) -> anyhow::Result<()> {
    if json {
        return super::print_json(&c);
    }
    outln!(
        "{} {what} (driver {})",
        c.bdf,
        c.driver.as_deref().unwrap_or("(none)")
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hint_follows_the_setup_step_left() {
        let sys = tempfile::tempdir().unwrap();
        assert!(!module_loaded(sys.path()));
        let hint = setup_hint(module_loaded(sys.path()));
        assert!(hint.contains("`modprobe legend_nvme`, then `legendctl device bind BDF`"));
        std::fs::create_dir_all(sys.path().join("module/legend_nvme")).unwrap();
        assert!(module_loaded(sys.path()));
        let hint = setup_hint(true);
        assert!(hint.contains("`legendctl device bind BDF`") && !hint.contains("modprobe"));
    }

    #[test]
    fn a_missing_device_node_gets_the_hint_once() {
        let err = open_read_only("/nonexistent/legend-nvme9").expect_err("a missing node");
        let text = format!("{err:#}");
        assert_eq!(
            text.matches("legendctl device bind BDF").count(),
            1,
            "{text}"
        );
        assert_eq!(
            text.matches("No such file or directory").count(),
            1,
            "{text}"
        );
        assert!(
            text.ends_with(
                "Cannot open /nonexistent/legend-nvme9: No such file or directory (os error 2)"
            ),
            "{text}"
        );
    }
}
