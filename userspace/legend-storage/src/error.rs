//! The store's error type.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong opening, creating or using a store.
///
/// Every variant that concerns a store names its path, and mismatches name
/// both what the store holds and what the caller expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A system call failed.
    #[error("{path}: {what}")]
    Io {
        /// Store path.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `io_uring` could not be set up or a request failed in it.
    #[error("{path}: io_uring: {what}")]
    Uring {
        /// Store path.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The filesystem refused `O_DIRECT` and the caller required it.
    #[error(
        "{path}: the filesystem refuses O_DIRECT ({source}); put the store on a filesystem \
         or block device that supports direct I/O, or allow buffered I/O"
    )]
    DirectIoUnsupported {
        /// Store path.
        path: PathBuf,
        /// The error of the O_DIRECT open.
        #[source]
        source: io::Error,
    },
    /// The path is neither a regular file nor a block device.
    #[error("{path}: not a regular file or block device")]
    NotFileOrBlockDevice {
        /// Store path.
        path: PathBuf,
    },
    /// The file or device is shorter than the layout in its superblock.
    #[error("{path}: truncated store: the layout needs {needed} bytes but the file has {actual}")]
    Truncated {
        /// Store path.
        path: PathBuf,
        /// Bytes the layout covers.
        needed: u64,
        /// Bytes present.
        actual: u64,
    },
    /// Neither superblock copy starts with the Legend magic.
    #[error("{path}: not a Legend store (wrong magic in both superblock copies{})",
        found.map(|s| format!("; it carries a {s} signature")).unwrap_or_default())]
    WrongMagic {
        /// Store path.
        path: PathBuf,
        /// A foreign signature found instead, if any.
        found: Option<&'static str>,
    },
    /// The store's optimizer state has another layout than the caller's.
    #[error(
        "{path}: the store keeps {found} optimizer accumulator(s) a row, but the run asks for {expected} (optimizer.state: {} here, {} in the store); start a new store or set optimizer.state to match",
        state_name(*expected, *found),
        state_name(*found, *expected)
    )]
    StateMismatch {
        /// Store path.
        path: PathBuf,
        /// Accumulators per row in the store.
        found: u32,
        /// Accumulators per row the caller asked for.
        expected: u32,
    },
    /// The store's embeddings have another number format than the caller's.
    #[error(
        "{path}: the store keeps {found} embeddings, but the run asks for {expected} (storage.dtype); a run keeps the dtype it started with: start a new run (and store) to change it"
    )]
    DtypeMismatch {
        /// Store path.
        path: PathBuf,
        /// The store's format.
        found: legend_model::Dtype,
        /// The caller's.
        expected: legend_model::Dtype,
    },
    /// The store was written by a format version this build cannot read.
    #[error(
        "{path}: unsupported store format version {found} (this build reads versions 1 to {supported})"
    )]
    UnsupportedVersion {
        /// Store path.
        path: PathBuf,
        /// Version in the superblock.
        found: u32,
        /// Version this build reads and writes.
        supported: u32,
    },
    /// Both superblock copies carry the magic but neither passes its checksum
    /// or consistency checks.
    #[error("{path}: bad checksum in both superblock copies (slot 0: {slot0}; slot 1: {slot1})")]
    BadChecksum {
        /// Store path.
        path: PathBuf,
        /// Why slot 0 was rejected.
        slot0: String,
        /// Why slot 1 was rejected.
        slot1: String,
    },
    /// The store belongs to another dataset.
    #[error("{path}: store was made for dataset {found}, but the caller's dataset is {expected}")]
    DatasetMismatch {
        /// Store path.
        path: PathBuf,
        /// Identity in the store.
        found: String,
        /// Identity the caller expected.
        expected: String,
    },
    /// The store holds embeddings of another dimension.
    #[error(
        "{path}: store holds embeddings of dimension {found}, but the caller asked for {expected}"
    )]
    DimMismatch {
        /// Store path.
        path: PathBuf,
        /// Dimension in the store.
        found: u32,
        /// Dimension the caller expected.
        expected: u32,
    },
    /// The store has another number of partitions.
    #[error("{path}: store has {found} partitions, but the caller asked for {expected}")]
    PartitionCountMismatch {
        /// Store path.
        path: PathBuf,
        /// Partitions in the store.
        found: u32,
        /// Partitions the caller expected.
        expected: u32,
    },
    /// The device, file system or size cap cannot hold the layout.
    #[error(
        "{path}: device too small: the store needs {needed} bytes but only {available} are available ({limit})"
    )]
    DeviceTooSmall {
        /// Store path.
        path: PathBuf,
        /// Bytes the layout needs.
        needed: u64,
        /// Bytes available.
        available: u64,
        /// What limited it (device size, free space, size cap).
        limit: &'static str,
    },
    /// The target carries a file system, partition table or other signature.
    #[error(
        "{path}: carries a {signature} signature at byte {offset}; refusing to overwrite it (use force to override)"
    )]
    ForeignSignature {
        /// Store path.
        path: PathBuf,
        /// What was recognised.
        signature: &'static str,
        /// Byte offset of the signature.
        offset: u64,
    },
    /// The store is another one than the caller's record names (another store was put in its
    /// place since).
    #[error(
        "{path}: is store {found}, not the store {expected} its creator recorded: another store was put in its place; refusing to use it"
    )]
    OtherStore {
        /// Store path.
        path: PathBuf,
        /// The store's identity (hex).
        found: String,
        /// The identity the caller expected (hex).
        expected: String,
    },
    /// A member of a striped store is missing, belongs elsewhere or disagrees with the others.
    #[error("{path}: store member: {why}")]
    Member {
        /// The member's path.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The store parameters are unusable.
    #[error("invalid store specification: {0}")]
    InvalidSpec(String),
    /// A partition index past the end.
    #[error("{path}: partition {partition} out of range (store has {count})")]
    NoSuchPartition {
        /// Store path.
        path: PathBuf,
        /// Requested index.
        partition: u32,
        /// Partitions in the store.
        count: u32,
    },
    /// A region read before anything was ever written to it.
    #[error("{path}: {region} was never written; initialise it in memory instead of reading it")]
    NotInitialized {
        /// Store path.
        path: PathBuf,
        /// The region ("partition 3", "aux region").
        region: String,
    },
    /// A caller buffer cannot hold the request.
    #[error(
        "{path}: {region} needs a buffer of {needed} bytes (capacity, rounded to the block size), got {got}"
    )]
    BufferTooSmall {
        /// Store path.
        path: PathBuf,
        /// The region.
        region: String,
        /// Capacity needed.
        needed: usize,
        /// Capacity given.
        got: usize,
    },
    /// The progress blob does not fit the capacity chosen at creation.
    #[error("{path}: progress blob of {len} bytes exceeds the store's capacity of {capacity}")]
    ProgressTooLarge {
        /// Store path.
        path: PathBuf,
        /// Blob size.
        len: usize,
        /// Capacity.
        capacity: u32,
    },
    /// The NVMe controller refused a request of the store (`MAP`, `CREATE_QUEUE_PAIR`, ...).
    #[error("{path}: {what}")]
    Controller {
        /// The target.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The controller's error.
        #[source]
        source: legend_nvme::Error,
    },
    /// An NVMe command of a transfer completed with an error status.
    #[error("{path}: {error} (store byte {region_offset})")]
    Command {
        /// The target.
        path: PathBuf,
        /// Byte offset in the store of the command's first block.
        region_offset: u64,
        /// The command and its decoded status.
        error: legend_nvme_protocol::CommandError,
    },
    /// The controller stopped answering; the queue pair was deleted.
    #[error(
        "{path}: the controller did not complete a command in time; the queue pair was deleted ({state})"
    )]
    ControllerTimeout {
        /// The target.
        path: PathBuf,
        /// The queue's state when the timeout fired.
        state: String,
    },
    /// The controller broke the protocol (a completion for no command in flight).
    #[error("{path}: {message}")]
    Protocol {
        /// The target.
        path: PathBuf,
        /// What happened.
        message: String,
    },
    /// An aligned buffer could not be allocated.
    #[error("cannot allocate an aligned I/O buffer of {bytes} bytes")]
    BufferAlloc {
        /// Requested size.
        bytes: usize,
    },
}

/// The `optimizer.state` name of `width` accumulators a row, knowing the other side's width
/// (of two different widths, 1 is `row` and the other `element`).
fn state_name(width: u32, other: u32) -> &'static str {
    if width == 1 && other != 1 {
        "row"
    } else {
        "element"
    }
}
