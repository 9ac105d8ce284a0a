//! The opened file or block device: open flags, geometry, synchronous
//! aligned I/O for superblocks, preallocation and flushes.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use legend_fs::{Access, Dir};

use crate::buffer::IoBuffer;
use crate::error::StoreError;

/// `BLKSSZGET` (linux/fs.h): logical sector size of a block device, as int.
const BLKSSZGET: libc::c_ulong = 0x1268;
/// `BLKGETSIZE64` (linux/fs.h): size of a block device in bytes, as u64.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// An open store target: a file or a block device.
#[derive(Debug)]
pub(crate) struct TargetFile {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
    pub(crate) is_block: bool,
    /// Whether the file was opened with `O_DIRECT`.
    pub(crate) direct: bool,
    /// Logical block size: every I/O offset and length is a multiple of it.
    pub(crate) block_size: u64,
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        path: path.to_owned(),
        what,
        source,
    }
}

impl TargetFile {
    /// Opens the file or block device `name` beneath `dir` read-write, with `O_DIRECT` when
    /// the file system allows it. `create` creates a missing regular file.
    pub(crate) fn open(
        dir: &Dir,
        name: &Path,
        create: bool,
        allow_buffered: bool,
    ) -> Result<Self, StoreError> {
        let path = dir.join(name);
        let path = path.as_path();
        let access = if create {
            Access::ReadWriteCreate
        } else {
            Access::ReadWrite
        };
        let open = |direct: bool| {
            if direct {
                dir.open_file_direct(name, access)
            } else {
                dir.open_file(name, access)
            }
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            // tmpfs and some FUSE file systems reject O_DIRECT with EINVAL.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                if !allow_buffered {
                    return Err(StoreError::DirectIoUnsupported {
                        path: path.to_owned(),
                        source: e,
                    });
                }
                tracing::warn!(
                    path = %path.display(),
                    "file system refuses O_DIRECT ({e}); falling back to buffered I/O through the page cache"
                );
                (open(false).map_err(io_err(path, "open"))?, false)
            }
            Err(e) => return Err(io_err(path, "open")(e)),
        };
        let meta = file.metadata().map_err(io_err(path, "stat"))?;
        let is_block = meta.file_type().is_block_device();
        if !is_block && !meta.file_type().is_file() {
            return Err(StoreError::NotFileOrBlockDevice {
                path: path.to_owned(),
            });
        }
        let block_size = if is_block {
            let mut sz: libc::c_int = 0;
            // SAFETY: BLKSSZGET writes one c_int through the pointer, which
            // points to a live local.
            let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut sz) };
            if rc < 0 {
                return Err(io_err(path, "BLKSSZGET")(io::Error::last_os_error()));
            }
            u64::try_from(sz).unwrap_or(0)
        } else {
            // st_blksize is the file system's preferred I/O size, a safe
            // (if sometimes generous) bound on its direct-I/O granularity.
            use std::os::unix::fs::MetadataExt;
            let b = meta.blksize();
            if b.is_power_of_two() && (512..=1 << 20).contains(&b) {
                b.max(4096)
            } else {
                4096
            }
        };
        Ok(Self {
            file,
            path: path.to_owned(),
            is_block,
            direct,
            block_size,
        })
    }

    /// Size of the file or device in bytes.
    pub(crate) fn size(&self) -> Result<u64, StoreError> {
        if self.is_block {
            let mut sz: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which
            // points to a live local.
            let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), BLKGETSIZE64, &mut sz) };
            if rc < 0 {
                return Err(io_err(&self.path, "BLKGETSIZE64")(
                    io::Error::last_os_error(),
                ));
            }
            Ok(sz)
        } else {
            Ok(self
                .file
                .metadata()
                .map_err(io_err(&self.path, "stat"))?
                .len())
        }
    }

    /// Reads up to `len` bytes at `offset` (block aligned); returns fewer at
    /// the end of the file.
    pub(crate) fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, StoreError> {
        use std::os::unix::fs::FileExt;
        let io_len = (len as u64).next_multiple_of(self.block_size) as usize;
        let mut buf = IoBuffer::new(io_len)?;
        let mut done = 0;
        while done < io_len {
            match self
                .file
                .read_at(&mut buf.as_bytes_mut()[done..], offset + done as u64)
            {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Past the end of a file O_DIRECT may answer EINVAL for a
                // partial block; treat it as the end.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && done > 0 => break,
                Err(e) => return Err(io_err(&self.path, "read")(e)),
            }
        }
        Ok(buf.as_bytes()[..done.min(len)].to_vec())
    }

    /// Writes `bytes` at `offset`, padded with zeros to the block size.
    pub(crate) fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), StoreError> {
        use std::os::unix::fs::FileExt;
        let len = (bytes.len() as u64).next_multiple_of(self.block_size) as usize;
        let mut buf = IoBuffer::new(len)?;
        buf.as_bytes_mut()[..bytes.len()].copy_from_slice(bytes);
        self.file
            .write_all_at(buf.as_bytes(), offset)
            .map_err(io_err(&self.path, "write"))
    }

    /// `fdatasync`: everything written so far is durable when this returns.
    pub(crate) fn sync(&self) -> Result<(), StoreError> {
        self.file
            .sync_data()
            .map_err(io_err(&self.path, "fdatasync"))
    }

    /// Makes a regular file `len` bytes long with its blocks allocated, so
    /// later writes cannot fail for lack of space.
    pub(crate) fn preallocate(&self, len: u64) -> Result<(), StoreError> {
        let off_len = libc::off_t::try_from(len)
            .map_err(|_| StoreError::InvalidSpec(format!("store of {len} bytes exceeds off_t")))?;
        // SAFETY: plain syscall on an open descriptor.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, off_len) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EFBIG) => Err(StoreError::DeviceTooSmall {
                path: self.path.clone(),
                needed: len,
                available: self.size()? + self.free_bytes()?,
                limit: "file size plus free space in the file system",
            }),
            Some(libc::EOPNOTSUPP) => {
                tracing::warn!(path = %self.path.display(), "file system cannot preallocate; extending the file sparsely");
                self.file
                    .set_len(len)
                    .map_err(io_err(&self.path, "ftruncate"))
            }
            _ => Err(io_err(&self.path, "fallocate")(e)),
        }
    }

    /// Bytes an unprivileged writer may still allocate in the file system.
    fn free_bytes(&self) -> Result<u64, StoreError> {
        // SAFETY: statvfs is plain old data; all-zero is a valid value.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a live local the call fills in.
        let rc = unsafe { libc::fstatvfs(self.file.as_raw_fd(), &mut st) };
        if rc < 0 {
            return Err(io_err(&self.path, "statvfs")(io::Error::last_os_error()));
        }
        Ok(st.f_bavail.saturating_mul(st.f_frsize))
    }
}
