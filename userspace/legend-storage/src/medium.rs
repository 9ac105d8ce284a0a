//! What a store's bytes live on: a file or block device driven with `io_uring`, or an NVMe
//! namespace driven through I/O queue pairs. The store's layout, superblocks and commits are the
//! same on both; this is the one place that tells them apart.

use std::os::fd::AsRawFd;
use std::path::Path;

use legend_fs::Dir;

use crate::error::StoreError;
use crate::io::{IoConfig, MediumIo};
use crate::nvme::{NvmeQueues, NvmeTarget};
use crate::target_file::TargetFile;
use crate::uring::Ring;

/// Where to create or open a store.
#[derive(Clone, Debug)]
pub enum Target<'a> {
    /// A regular file (created if missing) or a block device, by path (links followed).
    Path(&'a Path),
    /// A regular file (created if missing) or a block device named `name` in `dir`, reached
    /// beneath it without following links (legend-fs).
    In {
        /// The directory.
        dir: &'a Dir,
        /// The name in it.
        name: &'a Path,
    },
    /// A namespace of an NVMe controller, through its queue pairs.
    Nvme(&'a NvmeTarget),
}

/// The opened target.
#[derive(Debug)]
pub(crate) enum Medium {
    File {
        // Field order matters on drop: the ring (and its pins on registered memory) goes
        // before the device it refers to.
        ring: Ring,
        dev: TargetFile,
        request_bytes: u64,
    },
    Nvme(NvmeQueues),
}

impl Medium {
    /// Opens `target` (a missing file is created when `create`).
    pub(crate) fn open(
        target: &Target<'_>,
        create: bool,
        io: &IoConfig,
    ) -> Result<Self, StoreError> {
        let dev = match target {
            Target::Path(path) => {
                let (dir, name) = Dir::open_parent(path).map_err(|source| StoreError::Io {
                    path: path.to_path_buf(),
                    what: "open",
                    source,
                })?;
                TargetFile::open(&dir, name, create, io.allow_buffered)?
            }
            Target::In { dir, name } => TargetFile::open(dir, name, create, io.allow_buffered)?,
            Target::Nvme(t) => {
                let queues = NvmeQueues::open(t, io.queue_depth, io.command_timeout)?;
                return Ok(Medium::Nvme(queues));
            }
        };
        let ring = Ring::new(
            dev.file.as_raw_fd(),
            io.queue_depth.max(1),
            io.registered_buffers,
        )
        .map_err(|(what, source)| StoreError::Uring {
            path: dev.path.clone(),
            what,
            source,
        })?;
        let request_bytes = u64::from(io.request_bytes)
            .max(dev.block_size)
            .next_multiple_of(dev.block_size);
        Ok(Medium::File {
            ring,
            dev,
            request_bytes,
        })
    }

    /// How messages name the target.
    pub(crate) fn path(&self) -> &Path {
        match self {
            Medium::File { dev, .. } => &dev.path,
            Medium::Nvme(q) => q.label(),
        }
    }

    /// Where store byte 0 is on the medium: the start LBA's byte in an NVMe namespace.
    pub(crate) fn base(&self) -> u64 {
        match self {
            Medium::File { .. } => 0,
            Medium::Nvme(q) => q.start_byte(),
        }
    }

    /// Every I/O offset and length is a multiple of this.
    pub(crate) fn block_size(&self) -> u64 {
        match self {
            Medium::File { dev, .. } => dev.block_size,
            Medium::Nvme(q) => q.block_size(),
        }
    }

    /// Whether I/O bypasses the page cache (always, on NVMe queues).
    pub(crate) fn is_direct(&self) -> bool {
        match self {
            Medium::File { dev, .. } => dev.direct,
            Medium::Nvme(_) => true,
        }
    }

    /// Bytes the target holds.
    pub(crate) fn size(&self) -> Result<u64, StoreError> {
        match self {
            Medium::File { dev, .. } => dev.size(),
            Medium::Nvme(q) => Ok(q.size()),
        }
    }

    /// Makes room for `needed` bytes: a regular file is preallocated, a block device or
    /// namespace must be large enough.
    pub(crate) fn reserve(&self, needed: u64) -> Result<(), StoreError> {
        let size = self.size()?;
        match self {
            Medium::File { dev, .. } if !dev.is_block => dev.preallocate(needed.max(size)),
            _ if size < needed => Err(StoreError::DeviceTooSmall {
                path: self.path().to_owned(),
                needed,
                available: size,
                limit: match self {
                    Medium::Nvme(_) => "namespace size after the start LBA",
                    Medium::File { .. } => "device size",
                },
            }),
            _ => Ok(()),
        }
    }

    /// Reads up to `len` bytes at `offset` (block aligned); fewer at the end.
    pub(crate) fn read_at(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, StoreError> {
        match self {
            Medium::File { dev, .. } => dev.read_at(offset, len),
            Medium::Nvme(q) => q.read_at(offset, len),
        }
    }

    /// Writes `bytes` at `offset`, padded with zeros to the block size.
    pub(crate) fn write_at(&mut self, offset: u64, bytes: &[u8]) -> Result<(), StoreError> {
        match self {
            Medium::File { dev, .. } => dev.write_at(offset, bytes),
            Medium::Nvme(q) => q.write_at(offset, bytes),
        }
    }

    /// Everything written so far is durable when this returns (`fdatasync`, NVMe Flush).
    pub(crate) fn sync(&mut self) -> Result<(), StoreError> {
        match self {
            Medium::File { dev, .. } => dev.sync(),
            Medium::Nvme(q) => q.sync(),
        }
    }

    /// Runs the transfers with several requests in flight; returns when all completed.
    pub(crate) fn run(&mut self, transfers: &[MediumIo<'_>]) -> Result<(), StoreError> {
        match self {
            Medium::File {
                ring,
                dev,
                request_bytes,
            } => {
                let mut chunks = Vec::new();
                ring.begin_plan();
                for t in transfers {
                    ring.plan(t, *request_bytes, &mut chunks);
                }
                ring.run(&mut chunks).map_err(|source| StoreError::Uring {
                    path: dev.path.clone(),
                    what: "transfer",
                    source,
                })
            }
            Medium::Nvme(q) => q.transfer(transfers),
        }
    }
}
