//! The store: create/open, partition I/O through `io_uring`, commits.

use std::path::Path;

use legend_model::Dtype;

use crate::buffer::IoBuffer;
use crate::error::StoreError;
use crate::layout::{DatasetId, Extent, Layout, SUPERBLOCK_SLOT_BYTES, StoreSpec};
use crate::medium::{Medium, Target, Transfer};
use crate::signature;
use crate::superblock::{FORMAT_VERSION, RegionState, SlotError, Superblock};

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

/// Options of [`Store::create`].
#[derive(Clone, Debug, Default)]
pub struct CreateOptions {
    /// I/O tuning.
    pub io: IoConfig,
    /// Overwrite a target that carries a file-system, partition-table or
    /// store signature.
    pub force: bool,
    /// Refuse layouts larger than this many bytes (a cap on the file's size).
    pub max_bytes: Option<u64>,
}

/// What the caller expects of a store it opens; `None` accepts anything.
#[derive(Clone, Debug, Default)]
pub struct Expect {
    /// The dataset the store must belong to.
    pub dataset: Option<DatasetId>,
    /// The embedding dimension.
    pub dim: Option<u32>,
    /// Optimizer accumulators per row.
    pub state_width: Option<u32>,
    /// The embeddings' number format.
    pub dtype: Option<Dtype>,
    /// The number of partitions.
    pub num_partitions: Option<u32>,
}

/// A region of the store that can be read or written as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// Partition `p`: `[embeddings | AdaGrad state]`, `rows · d` elements of
    /// the store's dtype (padded to 4 bytes) and `rows · state_width` f32.
    Partition(u32),
    /// The auxiliary region (relation parameters and their optimizer state,
    /// in the caller's own encoding), `aux_bytes` long.
    Aux,
}

impl std::fmt::Display for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Region::Partition(p) => write!(f, "partition {p}"),
            Region::Aux => f.write_str("aux region"),
        }
    }
}

/// One transfer of a batch given to [`Store::submit`].
#[derive(Debug)]
pub enum IoRequest<'a> {
    /// Read the region's latest contents into the buffer.
    Read(Region, &'a mut IoBuffer),
    /// Write the buffer's first `bytes` of the region to the store.
    Write(Region, &'a IoBuffer),
}

/// Per-region bookkeeping in memory.
#[derive(Clone, Copy, Debug, Default)]
struct Tracked {
    /// As in the last committed superblock.
    committed: RegionState,
    /// Written since the last commit (to copy `1 - committed.copy` when
    /// shadowed).
    dirty: bool,
}

/// An open store. Single-owner: the I/O thread of the training engine owns
/// it (or wraps it in a mutex); every method completes its I/O before
/// returning, and [`Store::submit`] keeps several requests in flight.
#[derive(Debug)]
pub struct Store {
    medium: Medium,
    spec: StoreSpec,
    layout: Layout,
    generation: u64,
    progress: Vec<u8>,
    aux: Tracked,
    partitions: Vec<Tracked>,
}

impl Store {
    /// Creates a store for `spec` at `path` (a regular file, created if
    /// missing, or a block device). Refuses targets carrying a foreign
    /// signature unless `opts.force`, and targets too small for the layout.
    /// The new store is at generation 0 with every region uninitialised.
    pub fn create(path: &Path, spec: &StoreSpec, opts: &CreateOptions) -> Result<Self, StoreError> {
        Self::create_on(&Target::Path(path), spec, opts)
    }

    /// Creates a store for `spec` on `target`, as [`Store::create`] does for a path.
    pub fn create_on(
        target: &Target<'_>,
        spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<Self, StoreError> {
        let new_file = match target {
            Target::Path(path) => !path.exists(),
            Target::In { dir, name } => !dir.exists(name).unwrap_or(true),
            Target::Nvme(_) => false,
        };
        let res = Self::create_in(target, spec, opts);
        if res.is_err() && new_file {
            // Leave no half-made file behind; the error is what matters.
            let _ = match target {
                Target::Path(path) => std::fs::remove_file(path),
                Target::In { dir, name } => dir.remove_file(name),
                Target::Nvme(_) => Ok(()),
            };
        }
        res
    }

    fn create_in(
        target: &Target<'_>,
        spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<Self, StoreError> {
        let mut medium = Medium::open(target, true, &opts.io)?;
        let path = medium.path().to_owned();
        let layout = Layout::compute(spec, medium.block_size())?;
        let needed = layout.total_bytes;
        if let Some(cap) = opts.max_bytes.filter(|&cap| needed > cap) {
            return Err(StoreError::DeviceTooSmall {
                path,
                needed,
                available: cap,
                limit: "size cap",
            });
        }
        let size = medium.size()?;
        if size > 0 && !opts.force {
            let head = medium.read_at(0, signature::SCAN_BYTES)?;
            if let Some((signature, offset)) = signature::find(&head) {
                return Err(StoreError::ForeignSignature {
                    path,
                    signature,
                    offset,
                });
            }
        }
        medium.reserve(needed)?;
        // Wipe both slots before writing generation 0, so a stale copy from
        // an older store (overwritten with force) can never win at open.
        medium.write_at(0, &vec![0; 2 * SUPERBLOCK_SLOT_BYTES as usize])?;
        medium.sync()?;
        let n = spec.num_partitions as usize;
        let fresh = Superblock {
            generation: 0,
            spec: spec.clone(),
            layout,
            aux_state: RegionState::default(),
            partition_states: vec![RegionState::default(); n],
            progress: Vec::new(),
        };
        let mut store = Self::assemble(medium, fresh);
        store.write_superblock(0)?;
        tracing::info!(path = %path.display(), bytes = needed, direct = store.medium.is_direct(), "created store");
        Ok(store)
    }

    /// Opens an existing store, picking the valid superblock copy with the
    /// highest generation, and checks it against `expect`.
    pub fn open(path: &Path, expect: &Expect, io: &IoConfig) -> Result<Self, StoreError> {
        Self::open_on(&Target::Path(path), expect, io)
    }

    /// Opens an existing store on `target`, as [`Store::open`] does for a path.
    pub fn open_on(
        target: &Target<'_>,
        expect: &Expect,
        io: &IoConfig,
    ) -> Result<Self, StoreError> {
        let mut medium = Medium::open(target, false, io)?;
        let path = medium.path().to_owned();
        let path = path.as_path();
        let slot_len = SUPERBLOCK_SLOT_BYTES as usize;
        let head = medium.read_at(0, 2 * slot_len)?;
        let slot = |i: usize| {
            head.get(i * slot_len..((i + 1) * slot_len).min(head.len()))
                .unwrap_or(&[])
        };
        let decoded = [Superblock::decode(slot(0)), Superblock::decode(slot(1))];
        let sb = match decoded {
            [Ok(a), Ok(b)] => {
                if a.generation >= b.generation {
                    a
                } else {
                    b
                }
            }
            [Ok(a), Err(_)] | [Err(_), Ok(a)] => a,
            [Err(SlotError::NoMagic), Err(SlotError::NoMagic)] => {
                let found = signature::find(&head).map(|s| s.0);
                return Err(StoreError::WrongMagic {
                    path: path.to_owned(),
                    found,
                });
            }
            [Err(SlotError::Version(found)), _] | [_, Err(SlotError::Version(found))] => {
                return Err(StoreError::UnsupportedVersion {
                    path: path.to_owned(),
                    found,
                    supported: FORMAT_VERSION,
                });
            }
            [Err(a), Err(b)] => {
                let why = |e: SlotError| match e {
                    SlotError::Corrupt(m) => m,
                    other => format!("{other:?}"),
                };
                return Err(StoreError::BadChecksum {
                    path: path.to_owned(),
                    slot0: why(a),
                    slot1: why(b),
                });
            }
        };
        if let Some(want) = &expect.dataset
            && want.id != sb.spec.dataset.id
        {
            return Err(StoreError::DatasetMismatch {
                path: path.to_owned(),
                found: sb.spec.dataset.to_string(),
                expected: want.to_string(),
            });
        }
        if let Some(want) = expect.dim.filter(|&d| d != sb.spec.dim) {
            return Err(StoreError::DimMismatch {
                path: path.to_owned(),
                found: sb.spec.dim,
                expected: want,
            });
        }
        if let Some(want) = expect.state_width.filter(|&w| w != sb.spec.state_width) {
            return Err(StoreError::StateMismatch {
                path: path.to_owned(),
                found: sb.spec.state_width,
                expected: want,
            });
        }
        if let Some(want) = expect.dtype.filter(|&d| d != sb.spec.dtype) {
            return Err(StoreError::DtypeMismatch {
                path: path.to_owned(),
                found: sb.spec.dtype,
                expected: want,
            });
        }
        if let Some(want) = expect
            .num_partitions
            .filter(|&n| n != sb.spec.num_partitions)
        {
            return Err(StoreError::PartitionCountMismatch {
                path: path.to_owned(),
                found: sb.spec.num_partitions,
                expected: want,
            });
        }
        let actual = medium.size()?;
        if actual < sb.layout.total_bytes {
            return Err(StoreError::Truncated {
                path: path.to_owned(),
                needed: sb.layout.total_bytes,
                actual,
            });
        }
        if sb.layout.align % medium.block_size() != 0 {
            return Err(StoreError::InvalidSpec(format!(
                "{}: store aligned to {} bytes cannot be used on a device with {}-byte blocks",
                path.display(),
                sb.layout.align,
                medium.block_size()
            )));
        }
        tracing::info!(path = %path.display(), generation = sb.generation, direct = medium.is_direct(), "opened store");
        Ok(Self::assemble(medium, sb))
    }

    fn assemble(medium: Medium, sb: Superblock) -> Self {
        let track = |committed| Tracked {
            committed,
            dirty: false,
        };
        Self {
            medium,
            spec: sb.spec,
            layout: sb.layout,
            generation: sb.generation,
            progress: sb.progress,
            aux: track(sb.aux_state),
            partitions: sb.partition_states.into_iter().map(track).collect(),
        }
    }

    /// Path of the store (for an NVMe target: the controller, namespace and start LBA).
    pub fn path(&self) -> &Path {
        self.medium.path()
    }

    /// What the store holds.
    pub fn spec(&self) -> &StoreSpec {
        &self.spec
    }

    /// Placement of every region.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Extent of partition `p` (its node range is `first_node .. first_node + rows`).
    pub fn partition(&self, p: u32) -> Result<&Extent, StoreError> {
        self.layout
            .partitions
            .get(p as usize)
            .ok_or_else(|| self.no_such(p))
    }

    /// Generation of the last commit (0 right after creation).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The progress blob of the last commit.
    pub fn progress(&self) -> &[u8] {
        &self.progress
    }

    /// Whether I/O bypasses the page cache (`O_DIRECT`, or NVMe queues).
    pub fn is_direct(&self) -> bool {
        self.medium.is_direct()
    }

    /// Bytes of the file, device or namespace the store is on, from the store's start.
    pub fn medium_bytes(&self) -> Result<u64, StoreError> {
        self.medium.size()
    }

    /// Logical block size the store's I/O is aligned to.
    pub fn block_size(&self) -> u64 {
        self.medium.block_size()
    }

    /// Buffer capacity that fits any partition: allocate partition-buffer
    /// slots with `IoBuffer::new(store.max_partition_bytes())`.
    pub fn max_partition_bytes(&self) -> usize {
        self.io_len(self.layout.max_partition_bytes()) as usize
    }

    /// Whether the region holds data: committed in some generation, or
    /// written since the last commit. A region for which this is false must
    /// be initialised in memory; reading it is an error.
    pub fn is_initialized(&self, region: Region) -> Result<bool, StoreError> {
        let t = self.tracked(region)?;
        Ok(t.committed.initialized || t.dirty)
    }

    /// Reads a region into `buf` (see [`Store::submit`]).
    pub fn read(&mut self, region: Region, buf: &mut IoBuffer) -> Result<(), StoreError> {
        self.submit(&mut [IoRequest::Read(region, buf)])
    }

    /// Writes a region from `buf` (see [`Store::submit`]).
    pub fn write(&mut self, region: Region, buf: &IoBuffer) -> Result<(), StoreError> {
        self.submit(&mut [IoRequest::Write(region, buf)])
    }

    /// Runs a batch of transfers with up to `queue_depth` requests of
    /// `request_bytes` in flight, e.g. the write-back of an evicted
    /// partition together with the read of the next one. Returns when all
    /// completed.
    ///
    /// Each buffer needs a capacity of the region's bytes rounded up to the
    /// block size ([`Store::max_partition_bytes`] always suffices); its
    /// length may be shorter, the tail of the capacity is then transferred
    /// as padding. Writes go to the region's shadow copy when the store is
    /// shadowed and become the committed contents at the next
    /// [`Store::commit`]. A batch must not read and write the same region.
    pub fn submit(&mut self, requests: &mut [IoRequest<'_>]) -> Result<(), StoreError> {
        let mut transfers = Vec::with_capacity(requests.len());
        let mut written = Vec::new();
        for req in requests.iter_mut() {
            let (region, raw, write) = match req {
                IoRequest::Read(r, b) => (*r, b.raw(), false),
                IoRequest::Write(r, b) => (*r, b.raw(), true),
            };
            let (base, io_len) = self.target(region, write)?;
            if (raw.cap() as u64) < io_len {
                return Err(StoreError::BufferTooSmall {
                    path: self.path().to_owned(),
                    region: region.to_string(),
                    needed: io_len as usize,
                    got: raw.cap(),
                });
            }
            transfers.push(Transfer {
                raw,
                offset: base,
                len: io_len,
                write,
            });
            if write {
                written.push(region);
            }
        }
        self.medium.run(&transfers)?;
        for region in written {
            self.tracked_mut(region).dirty = true;
        }
        Ok(())
    }

    /// The store byte offset and length (rounded to the block size) of the copy of `region` a
    /// read (`write == false`) or a write goes to, checked as [`Store::submit`] checks.
    fn target(&self, region: Region, write: bool) -> Result<(u64, u64), StoreError> {
        let extent = self.extent(region)?;
        let (bytes, offsets) = (extent.bytes, extent.offsets);
        let t = *self.tracked(region)?;
        if !(write || t.committed.initialized || t.dirty) {
            return Err(StoreError::NotInitialized {
                path: self.path().to_owned(),
                region: region.to_string(),
            });
        }
        // Shadowed regions write the copy the last commit does not use;
        // unshadowed ones have both offsets equal.
        let copy = if write || t.dirty {
            1 - t.committed.copy
        } else {
            t.committed.copy
        };
        let copy = if offsets[0] == offsets[1] { 0 } else { copy };
        Ok((offsets[usize::from(copy)], self.io_len(bytes)))
    }

    /// Where a transfer of `region` that the caller runs itself (the GPU I/O kernels) must go:
    /// the byte offset on the medium (for an NVMe target, in the namespace: the start LBA
    /// counted in) and the length, rounded to the block size. After such a write, report it
    /// with [`Store::mark_written`] so the next [`Store::commit`] makes it current.
    ///
    /// # Errors
    ///
    /// [`StoreError::NotInitialized`] for a read of a region never written; as
    /// [`Store::partition`] for a bad partition.
    pub fn io_extent(&self, region: Region, write: bool) -> Result<(u64, u64), StoreError> {
        let (offset, len) = self.target(region, write)?;
        Ok((self.medium.base() + offset, len))
    }

    /// Records that the caller wrote `region` itself at [`Store::io_extent`]`(region, true)`.
    ///
    /// # Errors
    ///
    /// As [`Store::partition`] for a bad partition.
    pub fn mark_written(&mut self, region: Region) -> Result<(), StoreError> {
        self.tracked(region)?;
        self.tracked_mut(region).dirty = true;
        Ok(())
    }

    /// Makes everything written since the last commit durable, together
    /// with `progress` (the caller's training progress, at most
    /// `progress_capacity` bytes), as generation `generation() + 1`:
    /// `fdatasync`, write the superblock copy of slot `(g+1) % 2`,
    /// `fdatasync`. A crash at any point leaves generation `g` or `g+1`
    /// readable. Returns the new generation.
    pub fn commit(&mut self, progress: &[u8]) -> Result<u64, StoreError> {
        if progress.len() > self.spec.progress_capacity as usize {
            return Err(StoreError::ProgressTooLarge {
                path: self.path().to_owned(),
                len: progress.len(),
                capacity: self.spec.progress_capacity,
            });
        }
        self.medium.sync()?;
        let settle = |t: &Tracked| {
            if t.dirty {
                RegionState {
                    initialized: true,
                    copy: 1 - t.committed.copy,
                }
            } else {
                t.committed
            }
        };
        let next = self.generation + 1;
        let aux = settle(&self.aux);
        let parts: Vec<RegionState> = self.partitions.iter().map(settle).collect();
        let old_progress = std::mem::replace(&mut self.progress, progress.to_vec());
        let (old_aux, old_parts) = (self.aux, self.partitions.clone());
        self.aux = Tracked {
            committed: aux,
            dirty: false,
        };
        for (t, s) in self.partitions.iter_mut().zip(parts) {
            *t = Tracked {
                committed: s,
                dirty: false,
            };
        }
        if let Err(e) = self.write_superblock(next) {
            // Not committed: keep the old state so a retry redoes it all.
            self.progress = old_progress;
            self.aux = old_aux;
            self.partitions = old_parts;
            return Err(e);
        }
        self.generation = next;
        Ok(next)
    }

    /// Encodes the current committed state as `generation` and writes it to
    /// its slot, durably.
    fn write_superblock(&mut self, generation: u64) -> Result<(), StoreError> {
        let sb = Superblock {
            generation,
            spec: self.spec.clone(),
            layout: self.layout.clone(),
            aux_state: self.aux.committed,
            partition_states: self.partitions.iter().map(|t| t.committed).collect(),
            progress: self.progress.clone(),
        };
        self.medium
            .write_at((generation % 2) * SUPERBLOCK_SLOT_BYTES, &sb.encode())?;
        self.medium.sync()
    }

    fn io_len(&self, bytes: u64) -> u64 {
        bytes.next_multiple_of(self.medium.block_size())
    }

    fn no_such(&self, p: u32) -> StoreError {
        StoreError::NoSuchPartition {
            path: self.path().to_owned(),
            partition: p,
            count: self.spec.num_partitions,
        }
    }

    fn extent(&self, region: Region) -> Result<&Extent, StoreError> {
        match region {
            Region::Partition(p) => self.partition(p),
            Region::Aux => self.layout.aux.as_ref().ok_or_else(|| {
                StoreError::InvalidSpec(format!(
                    "{}: store has no aux region",
                    self.path().display()
                ))
            }),
        }
    }

    fn tracked(&self, region: Region) -> Result<&Tracked, StoreError> {
        match region {
            Region::Partition(p) => self
                .partitions
                .get(p as usize)
                .ok_or_else(|| self.no_such(p)),
            Region::Aux => Ok(&self.aux),
        }
    }

    fn tracked_mut(&mut self, region: Region) -> &mut Tracked {
        match region {
            Region::Partition(p) => &mut self.partitions[p as usize],
            Region::Aux => &mut self.aux,
        }
    }
}
