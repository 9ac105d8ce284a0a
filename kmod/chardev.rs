// SPDX-License-Identifier: GPL-2.0-only

//! `/dev/legend-nvme<N>`: the ioctl and `mmap` interface of one controller.

use kernel::{
    fs::File,
    ioctl::_IOC_SIZE,
    miscdevice::{
        MiscDevice,
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
    controller::{
        Controller,
        Owner, //
    },
    driver::Registered,
    uapi, //
};

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_mmap_uncached(vma: *mut kernel::bindings::vm_area_struct, phys: u64) -> c_int;
    fn legend_shim_vma_pgoff(vma: *mut kernel::bindings::vm_area_struct) -> usize;
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

/// State of one open file: the controller, and (by its address) the owner of what it creates.
pub(crate) struct OpenFile {
    ctrl: Arc<Controller>,
}

impl OpenFile {
    fn owner(&self) -> Owner {
        core::ptr::from_ref(self) as Owner
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        // The last reference to the file is gone (no mmap remains): delete its queues first, then
        // release its mappings.
        self.ctrl.release(self.owner());
    }
}

#[vtable]
impl MiscDevice for OpenFile {
    type Ptr = Pin<KBox<Self>>;

    fn open(_file: &File, misc: &MiscDeviceRegistration<Self>) -> Result<Pin<KBox<Self>>> {
        let ctrl = Registered::controller_of(misc);
        Ok(KBox::pin(OpenFile { ctrl }, GFP_KERNEL)?)
    }

    fn ioctl(me: Pin<&Self>, _file: &File, cmd: u32, arg: usize) -> Result<isize> {
        let user = UserSlice::new(UserPtr::from_addr(arg), _IOC_SIZE(cmd));
        let owner = me.owner();
        let ctrl = &me.ctrl;
        match cmd {
            uapi::IOCTL_INFO => user.writer().write(ctrl.info())?,
            uapi::IOCTL_MAP => {
                let (mut r, mut w) = user.reader_writer();
                let mut args: uapi::MapArgs = r.read()?;
                let (handle, page_size, bus) = Controller::map(ctrl, owner, &args)?;
                let out =
                    UserSlice::new(UserPtr::from_addr(args.bus_addrs as usize), bus.len() * 8);
                let written = out.writer().write_slice(<[u64] as AsBytes>::as_bytes(&bus));
                if let Err(e) = written {
                    // Undone like an UNMAP: refused (`EBUSY`) while the file has a queue pair,
                    // since part of the addresses may have reached the caller before the fault.
                    // The mapping then stays with the file and is released when it is closed.
                    let _ = ctrl.unmap(owner, handle);
                    return Err(e);
                }
                args.handle = handle;
                args.page_size = page_size;
                // CAST: at most `MAX_GPU_PAGES` entries.
                args.pages = bus.len() as u32;
                w.write(&args)?;
            }
            uapi::IOCTL_UNMAP => {
                let args: uapi::UnmapArgs = user.reader().read()?;
                if args.flags != 0 {
                    return Err(EINVAL);
                }
                ctrl.unmap(owner, args.handle)?;
            }
            uapi::IOCTL_CREATE_QUEUE_PAIR => {
                let (mut r, mut w) = user.reader_writer();
                let mut args: uapi::QueuePairArgs = r.read()?;
                let (sq, cq) = ctrl.create_queue_pair(owner, &args)?;
                args.sq_doorbell = sq;
                args.cq_doorbell = cq;
                if let Err(e) = w.write(&args) {
                    let _ = ctrl.delete_queue_pair(owner, args.qid);
                    return Err(e);
                }
            }
            uapi::IOCTL_DELETE_QUEUE_PAIR => {
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
        let len = vma.end() - vma.start();
        // SAFETY: `vma` is a valid VMA being set up.
        let pgoff = unsafe { legend_shim_vma_pgoff(vma.as_ptr()) };
        if pgoff != 0 || len > me.ctrl.info().doorbell_len as usize {
            return Err(EINVAL);
        }
        me.ctrl.add_mmap(me.owner(), file.as_ptr())?;
        vma.set_io();
        vma.set_dontexpand();
        vma.set_dontcopy();
        vma.set_dontdump();
        // SAFETY: `vma` is being set up; the range is the doorbell page(s) of BAR0, which stay
        // mapped by the driver until unbind, which zaps this mapping first (`add_mmap`).
        let ret = unsafe { legend_shim_mmap_uncached(vma.as_ptr(), me.ctrl.doorbell_phys()) };
        if ret != 0 {
            return Err(Error::from_errno(ret));
        }
        Ok(())
    }
}
