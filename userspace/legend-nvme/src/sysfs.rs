//! Controller discovery and driver switching through sysfs.

use std::{
    fs,
    path::{Path, PathBuf},
};

use crate::{Error, Result};

/// PCI class of NVMe controllers (mass storage, non-volatile memory, NVM Express).
const NVME_CLASS: &str = "0x010802";
/// The module's PCI driver name.
pub const LEGEND_DRIVER: &str = "legend_nvme";
/// The stock Linux driver.
pub const STOCK_DRIVER: &str = "nvme";

/// An NVMe controller as sysfs describes its PCI function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciController {
    /// PCI address, `DDDD:BB:DD.F`.
    pub bdf: String,
    /// Bound driver, if any.
    pub driver: Option<String>,
    /// PCI vendor and device ID.
    pub id: (u16, u16),
    /// Block devices (namespaces and partitions) while bound to `nvme`, e.g. `nvme0n1`.
    pub block_devices: Vec<String>,
    /// `/dev/legend-nvme<N>` while bound to `legend_nvme`.
    pub char_device: Option<String>,
}

/// A view of sysfs and procfs; the roots are parameters so tests can use a fake tree.
#[derive(Clone, Debug)]
pub struct Sysfs {
    sys: PathBuf,
    proc: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Self::with_roots("/sys", "/proc")
    }
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| Error::Sysfs {
            path: path.display().to_string(),
            source,
        })
}

fn write(path: &Path, value: &str) -> Result<()> {
    fs::write(path, value).map_err(|source| Error::Sysfs {
        path: path.display().to_string(),
        source,
    })
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn hex16(s: &str) -> u16 {
    u16::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or(0)
}

impl Sysfs {
    /// A view rooted at `sys` and `proc` (normally `/sys` and `/proc`).
    pub fn with_roots(sys: impl Into<PathBuf>, proc: impl Into<PathBuf>) -> Self {
        Self {
            sys: sys.into(),
            proc: proc.into(),
        }
    }

    fn device_dir(&self, bdf: &str) -> PathBuf {
        self.sys.join("bus/pci/devices").join(bdf)
    }

    /// All NVMe controllers, sorted by PCI address.
    ///
    /// # Errors
    ///
    /// [`Error::Sysfs`] if a device's attributes cannot be read.
    pub fn list(&self) -> Result<Vec<PciController>> {
        let mut out = Vec::new();
        for bdf in names(&self.sys.join("bus/pci/devices")) {
            let dir = self.device_dir(&bdf);
            if read(&dir.join("class")).is_ok_and(|c| c == NVME_CLASS) {
                out.push(self.describe(&bdf)?);
            }
        }
        Ok(out)
    }

    /// The controller at `bdf`.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] if there is no NVMe controller at `bdf`.
    pub fn controller(&self, bdf: &str) -> Result<PciController> {
        let dir = self.device_dir(bdf);
        if !read(&dir.join("class")).is_ok_and(|c| c == NVME_CLASS) {
            return Err(Error::NotFound(bdf.to_owned()));
        }
        self.describe(bdf)
    }

    fn describe(&self, bdf: &str) -> Result<PciController> {
        let dir = self.device_dir(bdf);
        let driver = fs::read_link(dir.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
        let mut block_devices = Vec::new();
        let mut paths = Vec::new();
        for ctrl in names(&dir.join("nvme")) {
            let cdir = dir.join("nvme").join(&ctrl);
            // Namespaces are the children with a device number; partitions nest below them. With
            // native multipath the controller's children are hidden paths (`nvme0c0n1`, no device
            // number) of a head block device elsewhere (`nvme0n1`).
            for ns in names(&cdir).into_iter().filter(|n| n.starts_with("nvme")) {
                if cdir.join(&ns).join("dev").exists() {
                    Self::push_with_partitions(&cdir.join(&ns), &mut block_devices);
                } else {
                    paths.push(ns);
                }
            }
        }
        if !paths.is_empty() {
            // A head lists its paths in `multipath/`.
            let class = self.sys.join("class/block");
            for head in names(&class) {
                let mp = class.join(&head).join("multipath");
                if names(&mp).iter().any(|p| paths.contains(p)) {
                    Self::push_with_partitions(&class.join(&head), &mut block_devices);
                }
            }
        }
        // The misc device has no parent, so the driver names it in its own attribute group.
        let char_device = read(&dir.join("legend_nvme/index"))
            .ok()
            .map(|n| format!("/dev/legend-nvme{n}"));
        Ok(PciController {
            bdf: bdf.to_owned(),
            driver,
            id: (
                hex16(&read(&dir.join("vendor"))?),
                hex16(&read(&dir.join("device"))?),
            ),
            block_devices,
            char_device,
        })
    }

    /// Appends the block device at `dir` (a namespace) and its partitions to `out`.
    fn push_with_partitions(dir: &Path, out: &mut Vec<String>) {
        let Some(ns) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            return;
        };
        let parts: Vec<String> = names(dir)
            .into_iter()
            .filter(|p| p.starts_with(&ns) && dir.join(p).join("partition").exists())
            .collect();
        out.push(ns);
        out.extend(parts);
    }

    /// Why the controller's block devices are busy: mounted, held by another block device
    /// (LVM, md), or open by a process; `None` if they are free.
    pub fn in_use(&self, c: &PciController) -> Option<String> {
        let mounts = fs::read_to_string(self.proc.join("mounts")).unwrap_or_default();
        for b in &c.block_devices {
            let dev = format!("/dev/{b}");
            if mounts
                .lines()
                .any(|l| l.split_whitespace().next() == Some(dev.as_str()))
            {
                return Some(format!("{dev} is mounted"));
            }
            if !names(&self.sys.join("class/block").join(b).join("holders")).is_empty() {
                return Some(format!("{dev} is held by another block device"));
            }
        }
        for pid in names(&self.proc)
            .into_iter()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        {
            for fd in names(&self.proc.join(&pid).join("fd")) {
                let Ok(target) = fs::read_link(self.proc.join(&pid).join("fd").join(fd)) else {
                    continue;
                };
                if let Some(b) = c
                    .block_devices
                    .iter()
                    .find(|b| target == Path::new("/dev").join(b))
                {
                    return Some(format!("/dev/{b} is open by process {pid}"));
                }
            }
        }
        None
    }

    /// Moves controller `bdf` to `legend_nvme` (driver_override, unbind, the IOMMU group's type
    /// from lazy `DMA-FQ` to strict `DMA`, probe). Refuses while its block devices are in use
    /// unless `force`.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`], [`Error::InUse`], [`Error::Sysfs`], or [`Error::NotBound`] if the
    /// module did not take it (not loaded, or probe failed: see dmesg).
    pub fn bind(&self, bdf: &str, force: bool) -> Result<PciController> {
        let c = self.controller(bdf)?;
        if c.driver.as_deref() == Some(LEGEND_DRIVER) {
            return Ok(c);
        }
        if !force && let Some(reason) = self.in_use(&c) {
            return Err(Error::InUse {
                bdf: bdf.to_owned(),
                reason,
            });
        }
        self.switch(&c, LEGEND_DRIVER)
    }

    /// Hands controller `bdf` back to the stock `nvme` driver.
    ///
    /// # Errors
    ///
    /// As [`Sysfs::bind`], without the in-use check (`legend_nvme` revokes its users itself).
    pub fn unbind(&self, bdf: &str) -> Result<PciController> {
        let c = self.controller(bdf)?;
        if c.driver.as_deref() == Some(STOCK_DRIVER) {
            return Ok(c);
        }
        self.switch(&c, STOCK_DRIVER)
    }

    fn switch(&self, c: &PciController, to: &str) -> Result<PciController> {
        let dir = self.device_dir(&c.bdf);
        // The override makes the probe below pick `to` and keeps other drivers off the device.
        write(&dir.join("driver_override"), to)?;
        if let Some(from) = &c.driver {
            write(
                &self.sys.join("bus/pci/drivers").join(from).join("unbind"),
                &c.bdf,
            )?;
        }
        if to == LEGEND_DRIVER {
            // `legend_nvme` refuses a lazily invalidating domain (DMA-FQ); the group's type can
            // change only now, with no driver bound.
            let group_type = dir.join("iommu_group/type");
            if read(&group_type).is_ok_and(|t| t == "DMA-FQ") {
                write(&group_type, "DMA")?;
            }
        }
        write(&self.sys.join("bus/pci/drivers_probe"), &c.bdf)?;
        let now = self.describe(&c.bdf)?;
        if now.driver.as_deref() != Some(to) {
            return Err(Error::NotBound {
                bdf: c.bdf.clone(),
                driver: to.to_owned(),
            });
        }
        Ok(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(root: &Path, bdf: &str, driver: &str, ns: &str) {
        let dev = root.join("sys/bus/pci/devices").join(bdf);
        fs::create_dir_all(dev.join("nvme/nvme0").join(ns)).unwrap();
        fs::write(dev.join("nvme/nvme0").join(ns).join("dev"), "259:0").unwrap();
        fs::write(dev.join("class"), "0x010802\n").unwrap();
        fs::write(dev.join("vendor"), "0x1b36\n").unwrap();
        fs::write(dev.join("device"), "0x0010\n").unwrap();
        let drv = root.join("sys/bus/pci/drivers").join(driver);
        fs::create_dir_all(&drv).unwrap();
        std::os::unix::fs::symlink(&drv, dev.join("driver")).unwrap();
        fs::create_dir_all(root.join("proc")).unwrap();
    }

    #[test]
    fn lists_controllers_with_block_devices() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        let s = Sysfs::with_roots(t.path().join("sys"), t.path().join("proc"));
        let l = s.list().unwrap();
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].driver.as_deref(), Some("nvme"));
        assert_eq!(l[0].id, (0x1b36, 0x0010));
        assert_eq!(l[0].block_devices, ["nvme0n1"]);
        assert!(matches!(
            s.controller("0000:00:05.0"),
            Err(Error::NotFound(_))
        ));
    }

    #[test]
    fn lists_the_multipath_head_of_a_hidden_path() {
        let t = tempfile::tempdir().unwrap();
        // Native multipath: the controller holds the hidden path `nvme0c0n1` (no `dev`), the
        // head `nvme0n1` lives under the subsystem and lists the path; `nvme1n1` is another
        // controller's.
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0c0n1");
        let ctrl = t.path().join("sys/bus/pci/devices/0000:00:04.0/nvme/nvme0");
        fs::remove_file(ctrl.join("nvme0c0n1/dev")).unwrap();
        let class = t.path().join("sys/class/block");
        for (head, path) in [("nvme0n1", "nvme0c0n1"), ("nvme1n1", "nvme1c1n1")] {
            fs::create_dir_all(class.join(head).join("multipath").join(path)).unwrap();
            fs::write(class.join(head).join("dev"), "259:0").unwrap();
        }
        fs::create_dir_all(class.join("nvme0n1/nvme0n1p1")).unwrap();
        fs::write(class.join("nvme0n1/nvme0n1p1/partition"), "1").unwrap();
        let s = Sysfs::with_roots(t.path().join("sys"), t.path().join("proc"));
        let c = s.controller("0000:00:04.0").unwrap();
        assert_eq!(c.block_devices, ["nvme0n1", "nvme0n1p1"]);
    }

    #[test]
    fn names_the_char_device_of_a_legend_controller() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "legend_nvme", "nvme0n1");
        let dir = t
            .path()
            .join("sys/bus/pci/devices/0000:00:04.0/legend_nvme");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("index"), "3\n").unwrap();
        let s = Sysfs::with_roots(t.path().join("sys"), t.path().join("proc"));
        let c = s.controller("0000:00:04.0").unwrap();
        assert_eq!(c.char_device.as_deref(), Some("/dev/legend-nvme3"));
    }

    #[test]
    fn bind_refuses_mounted_controller_without_force() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        fs::write(
            t.path().join("proc/mounts"),
            "/dev/nvme0n1 /data ext4 rw 0 0\n",
        )
        .unwrap();
        let s = Sysfs::with_roots(t.path().join("sys"), t.path().join("proc"));
        let e = s.bind("0000:00:04.0", false).unwrap_err();
        assert!(
            matches!(e, Error::InUse { ref reason, .. } if reason.contains("mounted")),
            "{e}"
        );
    }

    #[test]
    fn bind_makes_a_lazy_iommu_group_strict() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        let group = t.path().join("sys/kernel/iommu_groups/7");
        fs::create_dir_all(&group).unwrap();
        fs::write(group.join("type"), "DMA-FQ\n").unwrap();
        let dev = t.path().join("sys/bus/pci/devices/0000:00:04.0");
        std::os::unix::fs::symlink(&group, dev.join("iommu_group")).unwrap();
        let s = Sysfs::with_roots(t.path().join("sys"), t.path().join("proc"));
        // The fake's driver link does not follow the probe, so the bind itself reports NotBound.
        let e = s.bind("0000:00:04.0", true).unwrap_err();
        assert!(matches!(e, Error::NotBound { .. }), "{e}");
        assert_eq!(fs::read_to_string(group.join("type")).unwrap(), "DMA");
        assert_eq!(
            fs::read_to_string(dev.join("driver_override")).unwrap(),
            "legend_nvme"
        );
    }
}
