//! Controller discovery and driver switching through sysfs.

use std::{
    fs,
    path::{Path, PathBuf},
};

use crate::{
    Error, Result,
    kmod_rules::{self, Overrides, Platform},
};

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
    /// unless `force`, and, before anything changes, where the platform lacks what the module
    /// requires (the module's own rules, applied to what sysfs shows), naming the fix. Should the
    /// module refuse it anyway, the
    /// controller goes back to the driver it had.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`], [`Error::InUse`], [`Error::Isolation`], [`Error::Sysfs`], or
    /// [`Error::NotBound`] if the module did not take it (not loaded, or probe failed: see dmesg).
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
        self.check_isolation(bdf)?;
        self.switch(&c, LEGEND_DRIVER)
    }

    /// What the platform provides controller `bdf`, as far as sysfs shows it, in the terms of
    /// the module's isolation rules (`kmod/rules.rs`). Read before the controller changes
    /// drivers: a lazy (`DMA-FQ`) group counts as strict, since [`Sysfs::bind`] makes it so;
    /// interrupt isolation is read from the names of the interrupt chips of its MSI vectors
    /// (`IR-` for Intel and AMD interrupt remapping, `ITS-` for an Arm ITS), or of the system's
    /// where it has none, and assumed where neither tells (the module checks it at probe).
    fn platform(&self, bdf: &str) -> Platform {
        let dir = self.device_dir(bdf);
        let group_type = read(&dir.join("iommu_group/type")).unwrap_or_default();
        Platform {
            translated: matches!(group_type.as_str(), "DMA" | "DMA-FQ"),
            // CAST: a handful of devices.
            group_devices: names(&dir.join("iommu_group/devices")).len() as u32,
            lazy: false,
            isolated_msi: self.interrupts_isolated(&dir).unwrap_or(true),
            ats: fs::read(dir.join("config")).is_ok_and(|c| ats_enabled(&c)),
            // CAST: a handful of regions.
            direct_regions: read(&dir.join("iommu_group/reserved_regions"))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.ends_with(" direct") || l.ends_with(" direct-relaxable"))
                .count() as u32,
        }
    }

    /// The `enable_unsafe_*` parameters the loaded module was given.
    fn overrides(&self) -> Overrides {
        let on = |name: &str| {
            read(&self.sys.join("module/legend_nvme/parameters").join(name))
                .is_ok_and(|v| v == "Y" || v == "1")
        };
        Overrides {
            noiommu: on("enable_unsafe_noiommu_mode"),
            lazy_iotlb: on("enable_unsafe_lazy_iotlb"),
            interrupts: on("enable_unsafe_interrupts"),
        }
    }

    /// Whether the interrupt chips of the device at `dir` (or, where it has no MSI vector, of
    /// the system) isolate interrupt messages; `None` where no chip tells.
    fn interrupts_isolated(&self, dir: &Path) -> Option<bool> {
        let irqs = self.sys.join("kernel/irq");
        let chip = |irq: &str| read(&irqs.join(irq).join("chip_name")).ok();
        let isolating = |name: &str| name.starts_with("IR-") || name.starts_with("ITS-");
        let own: Vec<String> = names(&dir.join("msi_irqs"))
            .iter()
            .filter_map(|irq| chip(irq))
            .collect();
        if !own.is_empty() {
            return Some(own.iter().all(|c| isolating(c)));
        }
        let all: Vec<String> = names(&irqs).iter().filter_map(|irq| chip(irq)).collect();
        if all.iter().any(|c| isolating(c)) {
            Some(true)
        } else if all.iter().any(|c| c.contains("PCI-MSI")) {
            Some(false)
        } else {
            None
        }
    }

    /// Refuses, naming each fix, where the module would refuse controller `bdf`.
    fn check_isolation(&self, bdf: &str) -> Result<()> {
        let gaps = kmod_rules::gaps(&self.platform(bdf), &self.overrides());
        if !gaps.refused() {
            return Ok(());
        }
        let reasons: Vec<String> = gaps
            .iter()
            .filter(|&(_, accepted)| !accepted)
            .map(|(gap, _)| match gap.parameter() {
                Some(p) => format!(
                    "{}; {} (or load legend_nvme with {p}=1 to accept that, tainting the kernel)",
                    gap.what(),
                    gap.fix()
                ),
                None => format!("{}; {}", gap.what(), gap.fix()),
            })
            .collect();
        Err(Error::Isolation {
            bdf: bdf.to_owned(),
            reasons: reasons.join("; and "),
        })
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

    /// Moves controller `c` to driver `to`. If any step after it left its driver fails, or
    /// `to` does not take it, the controller goes back to the driver it had (with its
    /// `driver_override`), rather than stay with none.
    fn switch(&self, c: &PciController, to: &str) -> Result<PciController> {
        let dir = self.device_dir(&c.bdf);
        // "(null)" where none is set; written back as an empty line, which clears it.
        let override_before = read(&dir.join("driver_override"))
            .ok()
            .filter(|o| o != "(null)")
            .unwrap_or_default();
        // The override makes the probe below pick `to` and keeps other drivers off the device.
        write(&dir.join("driver_override"), to)?;
        let moved = self.move_to(c, to);
        if let Ok(now) = &moved
            && now.driver.as_deref() == Some(to)
        {
            return moved;
        }
        let restored = self.hand_back(c, &override_before);
        moved.and(Err(Error::NotBound {
            bdf: c.bdf.clone(),
            driver: to.to_owned(),
            restored,
        }))
    }

    /// The steps of [`Sysfs::switch`] once `driver_override` names `to`: unbind, make a lazy
    /// IOMMU group strict (for `legend_nvme`), probe; where the controller is then.
    fn move_to(&self, c: &PciController, to: &str) -> Result<PciController> {
        let dir = self.device_dir(&c.bdf);
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
        self.describe(&c.bdf)
    }

    /// Gives controller `c` back to the driver it had, with `driver_override` as it was;
    /// says where it is now.
    fn hand_back(&self, c: &PciController, override_before: &str) -> String {
        let dir = self.device_dir(&c.bdf);
        let back = write(
            &dir.join("driver_override"),
            &format!("{override_before}\n"),
        )
        .and_then(|()| match &c.driver {
            Some(_) => write(&self.sys.join("bus/pci/drivers_probe"), &c.bdf),
            None => Ok(()),
        })
        .and_then(|()| self.describe(&c.bdf));
        match (back, &c.driver) {
            (Ok(now), Some(had)) if now.driver.as_ref() == Some(had) => {
                format!("it is back on {had}")
            }
            (Ok(now), None) if now.driver.is_none() => "it has no driver, as before".into(),
            (Ok(now), _) => format!(
                "it is now on {}",
                now.driver.as_deref().unwrap_or("no driver")
            ),
            (Err(e), _) => format!("giving it back failed: {e}"),
        }
    }
}

/// Whether a PCI function's configuration space (`config` in sysfs: 4 KiB for root) has an
/// Address Translation Services capability with ATS enabled (PCI Express Base Specification,
/// section 10.5.1: extended capability 0x000f, Enable in bit 15 of the control word at 6).
fn ats_enabled(config: &[u8]) -> bool {
    const ATS: u16 = 0x000f;
    let dword = |at: usize| {
        config
            .get(at..at + 4)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut at = 0x100;
    // Each capability is at least a dword, so a well-formed list has fewer than 1024.
    for _ in 0..1024 {
        let header = dword(at);
        if header == 0 || header == u32::MAX {
            return false;
        }
        if header as u16 == ATS {
            return config
                .get(at + 6..at + 8)
                .is_some_and(|c| u16::from_le_bytes([c[0], c[1]]) & 0x8000 != 0);
        }
        let next = (header >> 20) as usize & !3;
        if next < 0x100 {
            return false;
        }
        at = next;
    }
    false
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

    /// An IOMMU group 7 of type `kind` holding `bdf` alone, and the device's `driver_override`
    /// unset; the group's directory.
    fn fake_group(root: &Path, bdf: &str, kind: &str) -> PathBuf {
        let group = root.join("sys/kernel/iommu_groups/7");
        let dev = root.join("sys/bus/pci/devices").join(bdf);
        fs::create_dir_all(group.join("devices")).unwrap();
        fs::write(group.join("type"), format!("{kind}\n")).unwrap();
        std::os::unix::fs::symlink(&dev, group.join("devices").join(bdf)).unwrap();
        std::os::unix::fs::symlink(&group, dev.join("iommu_group")).unwrap();
        fs::write(dev.join("driver_override"), "(null)\n").unwrap();
        group
    }

    /// Interrupt `irq` of the fake tree, on a chip named `chip`; listed as an MSI vector of
    /// `bdf` if given.
    fn fake_irq(root: &Path, irq: u32, chip: &str, bdf: Option<&str>) {
        let dir = root.join("sys/kernel/irq").join(irq.to_string());
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("chip_name"), format!("{chip}\n")).unwrap();
        if let Some(bdf) = bdf {
            let msi = root.join("sys/bus/pci/devices").join(bdf).join("msi_irqs");
            fs::create_dir_all(&msi).unwrap();
            fs::write(msi.join(irq.to_string()), "msix\n").unwrap();
        }
    }

    /// The error of binding the fake tree's `0000:00:04.0` (which never binds: the fake's driver
    /// link does not follow the probe).
    fn bind_error(root: &Path) -> Error {
        let s = Sysfs::with_roots(root.join("sys"), root.join("proc"));
        s.bind("0000:00:04.0", true).unwrap_err()
    }

    /// A refusal before anything changed: `driver_override` untouched.
    fn refused_untouched(root: &Path, want: &str) {
        let e = bind_error(root);
        assert!(matches!(e, Error::Isolation { .. }), "{e}");
        assert!(e.to_string().contains(want), "{e}");
        let dev = root.join("sys/bus/pci/devices/0000:00:04.0");
        assert_eq!(
            fs::read_to_string(dev.join("driver_override"))
                .unwrap()
                .trim(),
            "(null)"
        );
        assert!(!root.join("sys/bus/pci/drivers/nvme/unbind").exists());
    }

    #[test]
    fn bind_refuses_a_platform_without_isolation_before_touching_anything() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        let dev = t.path().join("sys/bus/pci/devices/0000:00:04.0");
        fs::write(dev.join("driver_override"), "(null)\n").unwrap();
        refused_untouched(t.path(), "intel_iommu=on");
        let group = fake_group(t.path(), "0000:00:04.0", "identity");
        refused_untouched(t.path(), "without iommu=pt");
        fs::write(group.join("type"), "DMA\n").unwrap();
        std::os::unix::fs::symlink(&dev, group.join("devices/0000:00:04.1")).unwrap();
        refused_untouched(t.path(), "IOMMU group of its own");
        fs::remove_file(group.join("devices/0000:00:04.1")).unwrap();
        fs::write(
            group.join("reserved_regions"),
            "0x00000000fee00000 0x00000000feefffff msi\n0x000000007b800000 0x000000007fffffff direct\n",
        )
        .unwrap();
        refused_untouched(t.path(), "firmware reserves no memory");
    }

    #[test]
    fn bind_refuses_interrupts_without_remapping_unless_the_module_accepts_them() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        fake_group(t.path(), "0000:00:04.0", "DMA-FQ");
        // The stock driver's vectors, on a chip without the remapping prefix.
        fake_irq(t.path(), 24, "PCI-MSIX-0000:00:04.0", Some("0000:00:04.0"));
        fake_irq(t.path(), 9, "IR-IO-APIC", None);
        refused_untouched(t.path(), "intremap=on");
        let params = t.path().join("sys/module/legend_nvme/parameters");
        fs::create_dir_all(&params).unwrap();
        fs::write(params.join("enable_unsafe_interrupts"), "Y\n").unwrap();
        // Accepted: the bind goes ahead (and the fake, which never binds, is handed back).
        assert!(matches!(bind_error(t.path()), Error::NotBound { .. }));
    }

    #[test]
    fn interrupt_isolation_is_read_from_the_chips() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        let s = Sysfs::with_roots(t.path().join("sys"), t.path().join("proc"));
        let dev = s.device_dir("0000:00:04.0");
        // No chip at all: unknown (the module decides).
        assert_eq!(s.interrupts_isolated(&dev), None);
        // No vector of its own: the system's chips tell.
        fake_irq(t.path(), 30, "PCI-MSI-0000:00:1f.0", None);
        assert_eq!(s.interrupts_isolated(&dev), Some(false));
        fake_irq(t.path(), 9, "IR-IO-APIC", None);
        assert_eq!(s.interrupts_isolated(&dev), Some(true));
        // Its own vectors decide: remapped (Intel, AMD) or behind an Arm ITS.
        fake_irq(
            t.path(),
            40,
            "IR-PCI-MSIX-0000:00:04.0",
            Some("0000:00:04.0"),
        );
        assert_eq!(s.interrupts_isolated(&dev), Some(true));
        fake_irq(
            t.path(),
            41,
            "ITS-PCI-MSIX-0000:00:04.0",
            Some("0000:00:04.0"),
        );
        assert_eq!(s.interrupts_isolated(&dev), Some(true));
        fake_irq(t.path(), 42, "PCI-MSIX-0000:00:04.0", Some("0000:00:04.0"));
        assert_eq!(s.interrupts_isolated(&dev), Some(false));
    }

    /// A configuration space with extended capabilities at 0x100 (AER, id 1) and 0x140 (`id`),
    /// whose control word is `ctrl`.
    fn config_with(id: u16, ctrl: u16) -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        c[0x100..0x104].copy_from_slice(&(1u32 | (1 << 16) | (0x140 << 20)).to_le_bytes());
        c[0x140..0x144].copy_from_slice(&(u32::from(id) | (1 << 16)).to_le_bytes());
        c[0x146..0x148].copy_from_slice(&ctrl.to_le_bytes());
        c
    }

    #[test]
    fn ats_enable_is_found_in_the_extended_capabilities() {
        assert!(ats_enabled(&config_with(0x000f, 0x8000)));
        assert!(!ats_enabled(&config_with(0x000f, 0x0000)));
        assert!(!ats_enabled(&config_with(0x0010, 0x8000)));
        // A list that loops back on itself ends; a short (non-root) read has no capabilities.
        let mut looped = config_with(0x0010, 0);
        looped[0x140..0x144].copy_from_slice(&(0x10u32 | (1 << 16) | (0x100 << 20)).to_le_bytes());
        assert!(!ats_enabled(&looped));
        assert!(!ats_enabled(&[0u8; 64]));
    }

    #[test]
    fn bind_refused_by_the_module_hands_the_controller_back() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        fake_group(t.path(), "0000:00:04.0", "DMA");
        let e = bind_error(t.path());
        assert!(e.to_string().contains("it is back on nvme"), "{e}");
        let dev = t.path().join("sys/bus/pci/devices/0000:00:04.0");
        assert_eq!(
            fs::read_to_string(dev.join("driver_override")).unwrap(),
            "\n"
        );
        assert_eq!(
            fs::read_to_string(t.path().join("sys/bus/pci/drivers_probe")).unwrap(),
            "0000:00:04.0"
        );
    }

    #[test]
    fn a_step_that_fails_midway_hands_the_controller_back() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        fake_group(t.path(), "0000:00:04.0", "DMA");
        // The unbind cannot be written.
        fs::create_dir_all(t.path().join("sys/bus/pci/drivers/nvme/unbind")).unwrap();
        let e = bind_error(t.path());
        assert!(
            matches!(e, Error::Sysfs { ref path, .. } if path.ends_with("unbind")),
            "{e}"
        );
        let dev = t.path().join("sys/bus/pci/devices/0000:00:04.0");
        assert_eq!(
            fs::read_to_string(dev.join("driver_override")).unwrap(),
            "\n"
        );
    }

    #[test]
    fn bind_makes_a_lazy_iommu_group_strict() {
        let t = tempfile::tempdir().unwrap();
        fake(t.path(), "0000:00:04.0", "nvme", "nvme0n1");
        let group = fake_group(t.path(), "0000:00:04.0", "DMA-FQ");
        // The fake's driver link does not follow the probe, so the bind itself reports NotBound.
        let e = bind_error(t.path());
        assert!(matches!(e, Error::NotBound { .. }), "{e}");
        assert_eq!(fs::read_to_string(group.join("type")).unwrap(), "DMA");
        assert!(t.path().join("sys/bus/pci/drivers/nvme/unbind").exists());
    }
}
