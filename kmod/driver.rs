// SPDX-License-Identifier: GPL-2.0-only

//! PCI glue: probe brings a controller up and registers its character device.

use core::sync::atomic::{
    AtomicU32,
    Ordering, //
};

use kernel::{
    device::Core,
    device_id::IdArray,
    pci,
    prelude::*,
    sync::Arc, //
};

use crate::{
    chardev::CharDevice,
    controller::Controller,
    sysfs::StatsFiles, //
};

/// Names of the character devices; `MiscDeviceOptions` needs `'static` names.
const NAMES: [&CStr; 8] = [
    c"legend-nvme0",
    c"legend-nvme1",
    c"legend-nvme2",
    c"legend-nvme3",
    c"legend-nvme4",
    c"legend-nvme5",
    c"legend-nvme6",
    c"legend-nvme7",
];

/// Bit `i` set: `NAMES[i]` is taken.
static NAMES_USED: AtomicU32 = AtomicU32::new(0);

/// A claimed index into [`NAMES`], released on drop.
struct NameSlot(usize);

impl NameSlot {
    fn claim() -> Result<Self> {
        let mut used = NAMES_USED.load(Ordering::Relaxed);
        loop {
            let i = (!used).trailing_zeros() as usize;
            if i >= NAMES.len() {
                return Err(ENOSPC);
            }
            match NAMES_USED.compare_exchange(
                used,
                used | (1 << i),
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(Self(i)),
                Err(now) => used = now,
            }
        }
    }
}

impl Drop for NameSlot {
    fn drop(&mut self) {
        NAMES_USED.fetch_and(!(1 << self.0), Ordering::AcqRel);
    }
}

/// The bound controller; shut down when dropped, which matters when probe fails after the
/// controller came up (unbind shuts it down before, and a second shutdown does nothing).
struct Quiesced(Arc<Controller>);

impl Drop for Quiesced {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

/// Driver data of a bound controller.
///
/// Fields drop in declaration order: the sysfs counters go first, then the character device is
/// deregistered (so no `open` can reach the controller any more), then the controller reference
/// and the name are released.
#[pin_data]
pub(crate) struct Registered {
    _stats: StatsFiles,
    #[pin]
    _chardev: CharDevice,
    ctrl: Quiesced,
    _name: NameSlot,
}

pub(crate) struct LegendNvme;

/// No IDs, and so no module alias: the driver binds a controller only when asked to through its
/// `driver_override` (as vfio-pci does), never on its own; `modprobe` or udev could otherwise
/// hand it every NVMe disk, the boot disk included. Probe checks the class.
static PCI_TABLE: IdArray<pci::DeviceId, (), 0> = IdArray::new([]);

impl pci::Driver for LegendNvme {
    type IdInfo = ();
    type Data<'bound> = Registered;

    const ID_TABLE: pci::IdTable<Self::IdInfo> = &PCI_TABLE;

    fn probe<'bound>(
        pdev: &'bound pci::Device<Core<'_>>,
        _info: Option<&'bound Self::IdInfo>,
    ) -> impl PinInit<Self::Data<'bound>, Error> + 'bound {
        pin_init::pin_init_scope(move || {
            let name = NameSlot::claim()?;
            let ctrl = Quiesced(Controller::probe(pdev)?);
            let stats = StatsFiles::new(ctrl.0.clone(), name.0)?;
            let chardev = CharDevice::register(ctrl.0.clone(), NAMES[name.0]);
            Ok(try_pin_init!(Registered {
                _stats: stats,
                ctrl,
                _name: name,
                _chardev <- chardev,
            }))
        })
    }

    fn unbind<'bound>(_pdev: &'bound pci::Device<Core<'_>>, this: Pin<&Self::Data<'bound>>) {
        this.ctrl.0.shutdown();
    }
}
