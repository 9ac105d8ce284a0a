//! What every medium's I/O is described in: the store's I/O tuning and one transfer between a
//! buffer and a medium.

use std::sync::Arc;

use crate::buffer::RawAlloc;

/// I/O tuning; the defaults suit NVMe SSDs.
#[derive(Clone, Debug)]
pub struct IoConfig {
    /// Requests in flight at once (the ring depth).
    pub queue_depth: u32,
    /// Size of one request; a partition is split into requests of this size
    /// (rounded to the block size).
    pub request_bytes: u32,
    /// Registered-buffer entries of the ring (least recently used ones are
    /// replaced); a buffer takes one for each GiB (the kernel's limit for
    /// one entry).
    pub registered_buffers: u16,
    /// Fall back to buffered I/O (with a warning) where the file system
    /// refuses `O_DIRECT`; when false that is an error.
    pub allow_buffered: bool,
    /// NVMe targets: how long a command may go unanswered before the
    /// transfer fails (and the queue pair is deleted).
    pub command_timeout: std::time::Duration,
}

impl Default for IoConfig {
    fn default() -> Self {
        Self {
            queue_depth: 32,
            request_bytes: 1 << 20,
            registered_buffers: 64,
            allow_buffered: true,
            command_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// One transfer between a buffer, from its byte `buf_offset`, and the medium.
pub(crate) struct MediumIo<'a> {
    pub(crate) raw: &'a Arc<RawAlloc>,
    pub(crate) buf_offset: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) write: bool,
}
