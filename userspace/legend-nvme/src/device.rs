//! `/dev/legend-nvme<N>`: ioctls and the doorbell mapping.

use std::{
    fs::{File, OpenOptions},
    io,
    os::fd::AsRawFd,
    ptr::NonNull,
};

use legend_uapi as uapi;

use crate::{Error, Result};

/// An open `legend_nvme` character device.
///
/// Everything created through it (mappings, queue pairs) belongs to this open file and is
/// released by the kernel when it is closed.
#[derive(Debug)]
pub struct Device {
    file: File,
    path: String,
}

/// The SMART / health log fields `legendctl device health` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Health {
    /// Critical warning bits (0 is healthy).
    pub critical_warning: u8,
    /// Composite temperature in kelvin.
    pub temperature_kelvin: u16,
    /// Available spare, percent.
    pub available_spare: u8,
    /// Percentage of the rated endurance used.
    pub percentage_used: u8,
    /// Data units (1000 × 512 bytes) read, low 64 bits.
    pub data_units_read: u64,
    /// Data units written, low 64 bits.
    pub data_units_written: u64,
    /// Power-on hours, low 64 bits.
    pub power_on_hours: u64,
    /// Unsafe shutdowns, low 64 bits.
    pub unsafe_shutdowns: u64,
    /// Media and data integrity errors, low 64 bits.
    pub media_errors: u64,
}

/// Memory the controller may reach: one bus address per page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// Handle for [`Controller::unmap`] and [`Controller::create_queue_pair`].
    pub handle: u32,
    /// Bytes per entry of `bus_addrs` ([`uapi::HOST_PAGE_SIZE`] or [`uapi::GPU_PAGE_SIZE`]).
    pub page_size: u32,
    /// Bus address of each page, for this controller.
    pub bus_addrs: Vec<u64>,
}

impl Mapping {
    /// Bus address of byte `offset` of the mapping.
    ///
    /// # Panics
    ///
    /// If `offset` lies beyond the mapping.
    pub fn bus(&self, offset: usize) -> u64 {
        let page = self.page_size as usize;
        self.bus_addrs[offset / page] + (offset % page) as u64
    }
}

/// Doorbell offsets of a created queue pair, relative to [`Doorbells`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuePairDoorbells {
    /// Queue identifier.
    pub qid: u32,
    /// Byte offset of the SQ tail doorbell.
    pub sq_doorbell: u32,
    /// Byte offset of the CQ head doorbell.
    pub cq_doorbell: u32,
}

/// What keeps a [`Doorbells`] region valid.
enum Backing {
    /// A mapping of the device file, unmapped on drop.
    Mmap,
    /// Memory a userspace controller owns, kept alive by the value (only ever dropped).
    Shared(#[expect(dead_code, reason = "held for its drop")] Box<dyn Send + Sync>),
}

/// The controller's doorbell registers, mapped uncached into this process (the kernel module's
/// device, unmapped on drop), or a userspace controller's doorbell memory.
pub struct Doorbells {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

impl std::fmt::Debug for Doorbells {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Doorbells")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the mapping is device memory shared by all threads; writes to distinct doorbells are
// independent 32-bit stores.
unsafe impl Send for Doorbells {}
// SAFETY: as above.
unsafe impl Sync for Doorbells {}

impl Doorbells {
    /// Doorbells in memory a userspace controller polls: `len` bytes at `ptr`, kept valid by
    /// `keep` for as long as the result lives.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for 4-byte aligned volatile writes of `len` bytes while `keep` lives.
    pub unsafe fn shared(ptr: NonNull<u8>, len: usize, keep: Box<dyn Send + Sync>) -> Self {
        Self {
            ptr,
            len,
            backing: Backing::Shared(keep),
        }
    }

    /// Base address, e.g. to register with `cuMemHostRegister(..., IOMEMORY)`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never, for a created mapping).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The doorbell at byte `offset` (from [`QueuePairDoorbells`]).
    ///
    /// # Panics
    ///
    /// If `offset` is not a 4-byte aligned offset inside the region.
    pub fn register(&self, offset: u32) -> *mut u32 {
        let offset = offset as usize;
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "doorbell offset {offset} out of range"
        );
        // SAFETY: checked above to be an aligned dword of the live region.
        unsafe { self.ptr.as_ptr().add(offset).cast::<u32>() }
    }

    /// Writes `value` to the doorbell at byte `offset` (from [`QueuePairDoorbells`]).
    ///
    /// # Panics
    ///
    /// As [`Doorbells::register`].
    pub fn ring(&self, offset: u32, value: u32) {
        // SAFETY: an aligned dword of the live region.
        unsafe { self.register(offset).write_volatile(value) };
    }
}

impl Drop for Doorbells {
    fn drop(&mut self) {
        if matches!(self.backing, Backing::Mmap) {
            // SAFETY: unmapping the mapping this object owns.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

/// Copies to and from GPU memory on behalf of a controller that is not a PCIe device (the
/// userspace proxy): its DMA engine is the GPU's copy engine. `legend-cuda` implements it with
/// the CUDA driver.
pub trait DeviceMemory: Send + Sync {
    /// Copies `src` to device address `dst`.
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn write(&self, dst: u64, src: &[u8]) -> std::io::Result<()>;

    /// Copies from device address `src` into `dst`.
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn read(&self, src: u64, dst: &mut [u8]) -> std::io::Result<()>;

    /// Page-locks `len` bytes of host memory at `ptr` (the proxy's bounce buffers) so copies
    /// through it run at full speed, until [`DeviceMemory::unpin`].
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn pin(&self, ptr: *mut u8, len: usize) -> std::io::Result<()>;

    /// Releases what [`DeviceMemory::pin`] locked at `ptr`, before that memory is freed (the
    /// driver refuses to lock a range again while an old registration covers it).
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn unpin(&self, ptr: *mut u8) -> std::io::Result<()>;
}

/// An NVMe controller that hands this process I/O queue pairs in memory it supplies: the kernel
/// module's [`Device`], or a controller in userspace (`legend-nvme-proxy`). Everything that
/// drives queues (the stores' CPU submitter, the GPU I/O kernels) works through this.
pub trait Controller: Send + Sync {
    /// Where the controller is, for messages (`/dev/legend-nvme0`, `proxy of /data/x.img`).
    fn label(&self) -> &str;

    /// Identity and limits (`INFO`).
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`].
    fn info(&self) -> Result<uapi::Info>;

    /// Makes `len` bytes of host memory at `addr` reachable by the controller.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must stay mapped, and not be reused for other data, until the mapping
    /// is released ([`Controller::unmap`] or dropping the controller): the controller writes it.
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`] with the errno `Documentation/uapi.md` lists for `MAP`.
    unsafe fn map_host(&self, addr: *mut u8, len: usize) -> Result<Mapping>;

    /// Makes `len` bytes of GPU memory at device address `addr` reachable by the controller.
    ///
    /// # Safety
    ///
    /// As [`Controller::map_host`], for device memory (e.g. from `cuMemAlloc`).
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`] (`EOPNOTSUPP` without GPU support).
    unsafe fn map_gpu(&self, addr: u64, len: usize) -> Result<Mapping>;

    /// Releases a mapping.
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`] (`ENOENT`; `EBUSY` while any queue pair exists: delete the queues,
    /// which waits for their outstanding commands, before unmapping memory they may use).
    fn unmap(&self, handle: u32) -> Result<()>;

    /// Creates I/O queue pair `args.qid` with its SQ and CQ in earlier mappings.
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`] with the errno `Documentation/uapi.md` lists for `CREATE_QUEUE_PAIR`.
    fn create_queue_pair(&self, args: uapi::QueuePairArgs) -> Result<QueuePairDoorbells>;

    /// Deletes queue pair `qid`.
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`] (`ENOENT` if this user did not create it).
    fn delete_queue_pair(&self, qid: u32) -> Result<()>;

    /// The doorbells (`Info::doorbell_len` bytes).
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`].
    fn doorbells(&self) -> Result<Doorbells>;

    /// What the controller itself knows of queue pair `qid`, for a submitter that gave up on
    /// it: where it stopped fetching, and each command it holds with its age and stage. `None`
    /// where the controller cannot say (hardware answers only through its queues).
    fn queue_report(&self, qid: u32) -> Option<String> {
        let _ = qid;
        None
    }
}

impl Device {
    /// Opens a character device, e.g. `/dev/legend-nvme0`, as its one writer: the open file that
    /// may map memory, create queue pairs and map the doorbells.
    ///
    /// # Errors
    ///
    /// [`Error::Open`], e.g. for a missing node, missing `legend` group membership, or `EBUSY`
    /// while another open file is the writer.
    pub fn open(path: &str) -> Result<Self> {
        Self::open_with(path, true)
    }

    /// Opens a character device read-only, for [`Device::info`], [`Device::health`] and
    /// [`Device::identify_controller`]; any number of these may be open beside the writer.
    ///
    /// # Errors
    ///
    /// [`Error::Open`].
    pub fn open_read_only(path: &str) -> Result<Self> {
        Self::open_with(path, false)
    }

    fn open_with(path: &str, write: bool) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
            .map_err(|source| Error::Open {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self {
            file,
            path: path.to_owned(),
        })
    }

    /// The device file's path.
    pub fn path(&self) -> &str {
        &self.path
    }

    fn ioctl<T>(&self, op: &'static str, cmd: u32, arg: &mut T) -> Result<()> {
        // SAFETY: `cmd` encodes `size_of::<T>()` (uapi) and `arg` is a valid, exclusive `T`.
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                cmd as libc::c_ulong,
                std::ptr::from_mut(arg),
            )
        };
        if r < 0 {
            Err(Error::Ioctl {
                op,
                source: io::Error::last_os_error(),
            })
        } else {
            Ok(())
        }
    }

    fn admin(
        &self,
        op: &'static str,
        opcode: u8,
        nsid: u32,
        cdw10: u32,
        buf: &mut [u8],
    ) -> Result<()> {
        let mut a = uapi::AdminArgs {
            opcode,
            nsid,
            data: buf.as_mut_ptr() as u64,
            data_len: u32::try_from(buf.len()).unwrap_or(u32::MAX),
            ..Default::default()
        };
        a.cdw[0] = cdw10;
        self.ioctl(op, uapi::IOCTL_ADMIN, &mut a)?;
        if a.status != 0 {
            return Err(Error::Status {
                op,
                status: a.status,
            });
        }
        Ok(())
    }

    /// Identify Controller data (4096 bytes).
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`], [`Error::Status`].
    pub fn identify_controller(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 4096];
        self.admin("Identify", uapi::ADMIN_OPC_IDENTIFY, 0, 1, &mut buf)?;
        Ok(buf)
    }

    /// The SMART / health log.
    ///
    /// # Errors
    ///
    /// [`Error::Ioctl`], [`Error::Status`].
    pub fn health(&self) -> Result<Health> {
        let mut b = vec![0u8; 512];
        self.admin(
            "Get Log Page (SMART)",
            uapi::ADMIN_OPC_GET_LOG_PAGE,
            u32::MAX,
            u32::from(uapi::LOG_ID_SMART),
            &mut b,
        )?;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        Ok(Health {
            critical_warning: b[0],
            temperature_kelvin: u16::from_le_bytes([b[1], b[2]]),
            available_spare: b[3],
            percentage_used: b[5],
            data_units_read: u64_at(32),
            data_units_written: u64_at(48),
            power_on_hours: u64_at(128),
            unsafe_shutdowns: u64_at(144),
            media_errors: u64_at(160),
        })
    }

    /// `MAP` of `len` bytes at `addr` of memory `kind`.
    fn map(&self, kind: u32, addr: u64, len: usize, page: u32) -> Result<Mapping> {
        let mut bus_addrs = vec![0u64; len.div_ceil(page as usize)];
        let mut a = uapi::MapArgs {
            addr,
            len: len as u64,
            bus_addrs: bus_addrs.as_mut_ptr() as u64,
            bus_addrs_cap: u32::try_from(bus_addrs.len()).unwrap_or(u32::MAX),
            kind,
            ..Default::default()
        };
        self.ioctl("MAP", uapi::IOCTL_MAP, &mut a)?;
        bus_addrs.truncate(a.pages as usize);
        Ok(Mapping {
            handle: a.handle,
            page_size: a.page_size,
            bus_addrs,
        })
    }
}

impl Controller for Device {
    fn label(&self) -> &str {
        &self.path
    }

    fn info(&self) -> Result<uapi::Info> {
        // SAFETY: `Info` is integers and integer arrays; all-zero is a valid value.
        let mut info: uapi::Info = unsafe { std::mem::zeroed() };
        self.ioctl("INFO", uapi::IOCTL_INFO, &mut info)?;
        Ok(info)
    }

    unsafe fn map_host(&self, addr: *mut u8, len: usize) -> Result<Mapping> {
        self.map(uapi::MAP_KIND_HOST, addr as u64, len, uapi::HOST_PAGE_SIZE)
    }

    unsafe fn map_gpu(&self, addr: u64, len: usize) -> Result<Mapping> {
        self.map(uapi::MAP_KIND_GPU, addr, len, uapi::GPU_PAGE_SIZE)
    }

    fn unmap(&self, handle: u32) -> Result<()> {
        self.ioctl(
            "UNMAP",
            uapi::IOCTL_UNMAP,
            &mut uapi::UnmapArgs { handle, flags: 0 },
        )
    }

    fn create_queue_pair(&self, args: uapi::QueuePairArgs) -> Result<QueuePairDoorbells> {
        let mut a = args;
        self.ioctl("CREATE_QUEUE_PAIR", uapi::IOCTL_CREATE_QUEUE_PAIR, &mut a)?;
        Ok(QueuePairDoorbells {
            qid: a.qid,
            sq_doorbell: a.sq_doorbell,
            cq_doorbell: a.cq_doorbell,
        })
    }

    fn delete_queue_pair(&self, qid: u32) -> Result<()> {
        self.ioctl(
            "DELETE_QUEUE_PAIR",
            uapi::IOCTL_DELETE_QUEUE_PAIR,
            &mut uapi::DeleteQueuePairArgs { qid, flags: 0 },
        )
    }

    fn doorbells(&self) -> Result<Doorbells> {
        let len = self.info()?.doorbell_len as usize;
        // SAFETY: a new shared mapping of the device at offset 0; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Ioctl {
                op: "mmap",
                source: io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(p.cast()).ok_or(Error::Ioctl {
            op: "mmap",
            source: io::Error::from_raw_os_error(libc::EINVAL),
        })?;
        Ok(Doorbells {
            ptr,
            len,
            backing: Backing::Mmap,
        })
    }
}
