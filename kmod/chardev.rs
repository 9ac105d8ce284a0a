// SPDX-License-Identifier: GPL-2.0-only

//! `/dev/legend-nvme<N>`: the ioctl and `mmap` interface of one controller.
//!
//! One open file at a time may be the writer (opened for writing): it alone maps memory, creates
//! queue pairs and maps the doorbells. Any number of read-only files may read `INFO` and run the
//! `ADMIN` passthrough (Identify, SMART), so monitoring works beside the service that owns the
//! queues.

use core::ffi::c_void;

use kernel::{
    bindings,
    fs::{
        file,
        File, //
    },
    ioctl::_IOC_SIZE,
    miscdevice::{
        MiscDevice,
        MiscDeviceOptions,
        MiscDeviceRegistration, //
    },
    mm::virt::VmaNew,
    prelude::*,
    sync::Arc,
    transmute::{
        AsBytes,
        FromBytes, //
    },
    uaccess::{
        UserPtr,
        UserSlice, //
    },
};

use crate::{
    admin,
    controller::Controller,
    owner::Owner,
    uapi, //
};

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_doorbell_vma(vma: *mut bindings::vm_area_struct, ctx: *const c_void) -> c_int;
    fn legend_shim_insert_pfn(vmf: *mut bindings::vm_fault, phys: u64, ret: *mut c_uint);
    fn legend_shim_vma_pgoff(vma: *mut bindings::vm_area_struct) -> usize;
}

macro_rules! impl_bytes {
    ($($t:ty),*) => {$(
        // SAFETY: a `repr(C)` struct of integers and integer arrays whose padding is explicit
        // fields (pinned by legend-uapi's layout tests): no padding bytes, every bit pattern valid.
        unsafe impl FromBytes for $t {}
        // SAFETY: as above.
        unsafe impl AsBytes for $t {}
    )*};
}
impl_bytes!(
    uapi::Info,
    uapi::MapArgs,
    uapi::UnmapArgs,
    uapi::QueuePairArgs,
    uapi::DeleteQueuePairArgs,
    uapi::AdminArgs
);

/// The character device of one controller; deregistered when dropped, after which no `open`
/// reaches the controller through it.
#[pin_data]
pub(crate) struct CharDevice {
    #[pin]
    misc: MiscDeviceRegistration<OpenFile>,
    ctrl: Arc<Controller>,
}

impl CharDevice {
    /// Registers `/dev/<name>` for `ctrl`.
    pub(crate) fn register(
        ctrl: Arc<Controller>,
        name: &'static CStr,
    ) -> impl PinInit<Self, Error> {
        // `ctrl` first: an `open` may run as soon as the device is registered.
        try_pin_init!(Self {
            ctrl,
            misc <- MiscDeviceRegistration::register(MiscDeviceOptions { name }),
        })
    }

    /// The controller behind the character device `misc`.
    fn controller_of(misc: &MiscDeviceRegistration<OpenFile>) -> Arc<Controller> {
        let misc = core::ptr::from_ref(misc).cast_mut();
        // SAFETY: every `MiscDeviceRegistration<OpenFile>` is the `misc` field of a `CharDevice`
        // (only `register` makes one), and `open` (the only caller) runs under the misc core's
        // lock, which deregistration also takes, so the `CharDevice` is alive.
        let this = unsafe { &*kernel::container_of!(misc, CharDevice, misc) };
        this.ctrl.clone()
    }
}

/// State of one open file: the controller, and the number that owns what it creates.
struct OpenFile {
    ctrl: Arc<Controller>,
    owner: Owner,
    /// Opened for writing: the controller's one writer.
    writer: bool,
}

impl OpenFile {
    fn writer(&self) -> Result {
        if self.writer {
            Ok(())
        } else {
            Err(EBADF)
        }
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        // The last reference to the file is gone (no mmap remains): delete its queues first, then
        // release its mappings and the writer's place.
        self.ctrl.release(self.owner);
    }
}

#[vtable]
impl MiscDevice for OpenFile {
    type Ptr = Pin<KBox<Self>>;

    fn open(file: &File, misc: &MiscDeviceRegistration<Self>) -> Result<Pin<KBox<Self>>> {
        let ctrl = CharDevice::controller_of(misc);
        let owner = Owner::new_unique();
        let writer = file.flags() & file::flags::O_ACCMODE != file::flags::O_RDONLY;
        if writer {
            ctrl.claim_writer(owner)?;
        }
        // On failure the box drops the `OpenFile`, whose `release` gives the writer's place back.
        Ok(KBox::pin(
            OpenFile {
                ctrl,
                owner,
                writer,
            },
            GFP_KERNEL,
        )?)
    }

    fn ioctl(me: Pin<&Self>, _file: &File, cmd: u32, arg: usize) -> Result<isize> {
        let user = UserSlice::new(UserPtr::from_addr(arg), _IOC_SIZE(cmd));
        let owner = me.owner;
        let ctrl = &me.ctrl;
        match cmd {
            uapi::IOCTL_INFO => user.writer().write(ctrl.info())?,
            uapi::IOCTL_MAP => {
                me.writer()?;
                let (mut r, mut w) = user.reader_writer();
                let args: uapi::MapArgs = r.read()?;
                Controller::map(ctrl, owner, &args, |out, bus| {
                    UserSlice::new(UserPtr::from_addr(args.bus_addrs as usize), bus.len() * 8)
                        .writer()
                        .write_slice(<[u64] as AsBytes>::as_bytes(bus))?;
                    w.write(out)
                })?;
            }
            uapi::IOCTL_UNMAP => {
                me.writer()?;
                let args: uapi::UnmapArgs = user.reader().read()?;
                if args.flags != 0 {
                    return Err(EINVAL);
                }
                ctrl.unmap(owner, args.handle)?;
            }
            uapi::IOCTL_CREATE_QUEUE_PAIR => {
                me.writer()?;
                let (mut r, mut w) = user.reader_writer();
                let mut args: uapi::QueuePairArgs = r.read()?;
                let (sq, cq) = ctrl.create_queue_pair(owner, &args)?;
                args.sq_doorbell = sq;
                args.cq_doorbell = cq;
                // Copied without a lock held (it may fault); if it cannot be, the queue pair
                // goes again, on the controller and from the records.
                w.write(&args)
                    .inspect_err(|_| ctrl.undo_create_queue_pair(owner, args.qid))?;
            }
            uapi::IOCTL_DELETE_QUEUE_PAIR => {
                me.writer()?;
                let args: uapi::DeleteQueuePairArgs = user.reader().read()?;
                if args.flags != 0 {
                    return Err(EINVAL);
                }
                ctrl.delete_queue_pair(owner, args.qid)?;
            }
            uapi::IOCTL_ADMIN => {
                let (mut r, mut w) = user.reader_writer();
                let mut args: uapi::AdminArgs = r.read()?;
                if args._pad0 != [0; 3] || args._pad1 != 0 {
                    return Err(EINVAL);
                }
                let len = args.data_len as usize;
                if len == 0 || len > admin::DATA_LEN {
                    return Err(EINVAL);
                }
                let mut buf = KVec::from_elem(0u8, len, GFP_KERNEL)?;
                let c = ctrl.admin_passthrough(&args, &mut buf)?;
                UserSlice::new(UserPtr::from_addr(args.data as usize), len)
                    .writer()
                    .write_slice(&buf)?;
                args.result = c.result;
                args.status = u32::from(c.status);
                w.write(&args)?;
            }
            _ => return Err(ENOTTY),
        }
        Ok(0)
    }

    fn mmap(me: Pin<&Self>, file: &File, vma: &VmaNew) -> Result {
        me.writer()?;
        let (doorbell_len, _) = me.ctrl.doorbell_region();
        let len = vma.end() - vma.start();
        // SAFETY: `vma` is a valid VMA being set up.
        let pgoff = unsafe { legend_shim_vma_pgoff(vma.as_ptr()) };
        if pgoff != 0 || len > doorbell_len {
            return Err(EINVAL);
        }
        let ctx = core::ptr::from_ref::<OpenFile>(&me).cast::<c_void>();
        // SAFETY: `vma` is being set up; `ctx` stays valid while the VMA exists, since the VMA
        // holds a reference to the file that owns this `OpenFile`. Pages are inserted on fault
        // (`legend_nvme_doorbell_fault`); a private mapping is refused (`EINVAL`).
        let ret = unsafe { legend_shim_doorbell_vma(vma.as_ptr(), ctx) };
        if ret != 0 {
            return Err(Error::from_errno(ret));
        }
        // Recorded last, once nothing else can fail: a refused `mmap` leaves nothing behind.
        me.ctrl.add_mmap(file.as_ptr())
    }
}

/// Called by the shim's fault handler for page `pgoff` of a doorbell mapping; leaves `*ret` at
/// `VM_FAULT_SIGBUS` unless the page is inserted.
///
/// # Safety
///
/// `ctx` is the context `mmap` gave the VMA and `vmf` the fault being handled on it.
#[no_mangle]
unsafe extern "C" fn legend_nvme_doorbell_fault(
    ctx: *const c_void,
    vmf: *mut bindings::vm_fault,
    pgoff: usize,
    ret: *mut c_uint,
) {
    // SAFETY: by the function's contract `ctx` points to the `OpenFile` of the VMA's file, which
    // the VMA keeps open.
    let me = unsafe { &*ctx.cast::<OpenFile>() };
    me.ctrl.doorbell_fault(pgoff, |phys| {
        // SAFETY: `vmf` is the fault being handled, `ret` its result; called under the doorbell
        // lock, so unbind cannot revoke the mapping between the check and the insertion.
        unsafe { legend_shim_insert_pfn(vmf, phys, ret) }
    });
}
