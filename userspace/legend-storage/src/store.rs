//! The store: create/open, partition I/O through `io_uring`, commits.

use std::path::Path;

use legend_model::Dtype;

use crate::buffer::IoBuffer;
use crate::error::StoreError;
use crate::layout::{DatasetId, Extent, Layout, SUPERBLOCK_SLOT_BYTES, StoreSpec};
use crate::medium::{Medium, MediumIo, Target};
use crate::signature;
use crate::stripe::Stripe;
use crate::superblock::{
    FORMAT_VERSION, MAX_MEMBERS, Membership, RegionState, SlotError, Superblock,
};

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

/// Default stripe unit of a store over several members: large enough that one NVMe command
/// (at most 1 MiB here) or one `io_uring` request never spans two members.
pub const DEFAULT_STRIPE_BYTES: u64 = 1 << 20;

/// Options of [`Store::create`].
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// I/O tuning.
    pub io: IoConfig,
    /// Overwrite a target that carries a file-system, partition-table or
    /// store signature.
    pub force: bool,
    /// Refuse layouts larger than this many bytes on a member (a cap on the file's size).
    pub max_bytes: Option<u64>,
    /// A store over several members ([`Store::create_striped`]): bytes of one stripe unit, a
    /// multiple of the store's alignment (64 KiB, or the block size when larger).
    pub stripe_bytes: u64,
    /// The new store's identity ([`new_store_id`] when `None`). A caller that records it
    /// before creating (an intent record) can create again after a crash: a target that
    /// already is a copy of this store (every superblock copy on it carries this identity) is
    /// its own creation interrupted (never committed), and is made again without `force`. Any
    /// other signature, another store's or a committed one's included, is still refused.
    pub store_id: Option<[u8; 16]>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            io: IoConfig::default(),
            force: false,
            max_bytes: None,
            stripe_bytes: DEFAULT_STRIPE_BYTES,
            store_id: None,
        }
    }
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
    /// The store's identity ([`Store::store_id`]): what its creator recorded, so that another
    /// store put in its place is refused.
    pub store_id: Option<[u8; 16]>,
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

/// One member's part of a transfer the caller runs itself ([`Store::io_pieces`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoPiece {
    /// The member, in stripe order.
    pub member: usize,
    /// Byte on the member's medium (in its namespace, the start LBA counted in).
    pub at: u64,
    /// Offset in the caller's buffer.
    pub buf_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// An open store. Single-owner: the I/O thread of the training engine owns
/// it (or wraps it in a mutex); every method completes its I/O before
/// returning, and [`Store::submit`] keeps several requests in flight.
///
/// A store may be striped over several members (files, block devices, namespaces:
/// [`Store::create_striped`]); each has its own medium (its own ring or queue pair) and its
/// own superblock copies, and a batch is issued to all of them at once.
#[derive(Debug)]
pub struct Store {
    /// One medium per member, in stripe order.
    members: Vec<Medium>,
    stripe: Stripe,
    /// The members' common identity.
    store_id: [u8; 16],
    /// How messages name the store: its member's path, or every member's.
    label: std::path::PathBuf,
    /// The largest block size of the members.
    block_size: u64,
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
        Self::create_striped(std::slice::from_ref(target), spec, opts)
    }

    /// Creates a store for `spec` striped over `members` in units of `opts.stripe_bytes`
    /// (one member: a plain store, as [`Store::create_on`]). Every member is checked as
    /// [`Store::create`] checks its target and gets its own superblock copies; files created
    /// here are removed again when creation fails.
    pub fn create_striped(
        members: &[Target<'_>],
        spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<Self, StoreError> {
        let new_files: Vec<bool> = members
            .iter()
            .map(|target| match target {
                Target::Path(path) => !path.exists(),
                Target::In { dir, name } => !dir.exists(name).unwrap_or(true),
                Target::Nvme(_) => false,
            })
            .collect();
        let res = Self::create_in(members, spec, opts);
        if res.is_err() {
            // Leave no half-made file behind; the error is what matters.
            for (target, _) in members.iter().zip(new_files).filter(|(_, new)| *new) {
                let _ = match target {
                    Target::Path(path) => std::fs::remove_file(path),
                    Target::In { dir, name } => dir.remove_file(name),
                    Target::Nvme(_) => Ok(()),
                };
            }
        }
        res
    }

    fn create_in(
        targets: &[Target<'_>],
        spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<Self, StoreError> {
        let count = member_count(targets.len())?;
        let mut members = targets
            .iter()
            .map(|t| Medium::open(t, true, &opts.io))
            .collect::<Result<Vec<_>, _>>()?;
        let block_size = members.iter().map(Medium::block_size).max().unwrap_or(1);
        let layout = Layout::compute(spec, block_size)?;
        let stripe = if count == 1 {
            Stripe::single()
        } else if opts.stripe_bytes == 0 || !opts.stripe_bytes.is_multiple_of(layout.align) {
            return Err(StoreError::InvalidSpec(format!(
                "stripe unit of {} bytes: must be a positive multiple of {} (the store's alignment)",
                opts.stripe_bytes, layout.align
            )));
        } else {
            Stripe::new(count, opts.stripe_bytes)
        };
        let needed = stripe.member_bytes(layout.total_bytes);
        for medium in &mut members {
            let path = medium.path().to_owned();
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
                let head = medium.read_at(0, signature::HEAD_BYTES)?;
                if let Some((signature, offset)) =
                    signature::foreign_signature(&head, opts.store_id)
                {
                    return Err(StoreError::ForeignSignature {
                        path,
                        signature,
                        offset,
                    });
                }
            }
            medium.reserve(needed)?;
        }
        for medium in &mut members {
            // Wipe both slots before writing generation 0, so a stale copy from
            // an older store (overwritten with force) can never win at open.
            medium.write_at(0, &vec![0; 2 * SUPERBLOCK_SLOT_BYTES as usize])?;
            medium.sync()?;
        }
        let n = spec.num_partitions as usize;
        let fresh = Superblock {
            generation: 0,
            membership: Membership {
                store_id: opts.store_id.unwrap_or_else(new_store_id),
                index: 0,
                count,
                stripe_bytes: if count == 1 { 0 } else { opts.stripe_bytes },
            },
            spec: spec.clone(),
            layout,
            aux_state: RegionState::default(),
            partition_states: vec![RegionState::default(); n],
            progress: Vec::new(),
        };
        let mut store = Self::assemble(members, fresh);
        store.write_superblock(0)?;
        tracing::info!(store = %store.label.display(), bytes = needed, members = count, direct = store.is_direct(), "created store");
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
        Self::open_striped(std::slice::from_ref(target), expect, io)
    }

    /// Opens a store over `members`, given in the order they were created (one member: as
    /// [`Store::open_on`]). Every member must belong to the same store, in the place it is
    /// given; a missing, extra, foreign or misplaced member is refused by its path. The store
    /// opens at the highest generation every member holds: a commit that reached only some
    /// members (a crash between their superblock writes) is rolled back on them here, before
    /// anything else is written.
    pub fn open_striped(
        targets: &[Target<'_>],
        expect: &Expect,
        io: &IoConfig,
    ) -> Result<Self, StoreError> {
        let count = member_count(targets.len())?;
        let mut members = Vec::with_capacity(targets.len());
        let mut copies = Vec::with_capacity(targets.len());
        for (i, target) in targets.iter().enumerate() {
            let mut medium = Medium::open(target, false, io).map_err(|e| match e {
                StoreError::Io { path, source, .. }
                    if count > 1 && source.kind() == std::io::ErrorKind::NotFound =>
                {
                    StoreError::Member {
                        path,
                        why: format!("member {} of the store's {count} is missing", i + 1),
                    }
                }
                e => e,
            })?;
            copies.push(valid_copies(&mut medium)?);
            members.push(medium);
        }
        let sb = agree(&mut members, copies)?;
        let path = members[0].path().to_owned();
        let path = path.as_path();
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
        if let Some(want) = expect.store_id.filter(|&id| id != sb.membership.store_id) {
            return Err(StoreError::OtherStore {
                path: path.to_owned(),
                found: store_id_hex(sb.membership.store_id),
                expected: store_id_hex(want),
            });
        }
        let needed = stripe_of(&sb.membership).member_bytes(sb.layout.total_bytes);
        for medium in &members {
            let actual = medium.size()?;
            if actual < needed {
                return Err(StoreError::Truncated {
                    path: medium.path().to_owned(),
                    needed,
                    actual,
                });
            }
            if sb.layout.align % medium.block_size() != 0 {
                return Err(StoreError::InvalidSpec(format!(
                    "{}: store aligned to {} bytes cannot be used on a device with {}-byte blocks",
                    medium.path().display(),
                    sb.layout.align,
                    medium.block_size()
                )));
            }
        }
        let store = Self::assemble(members, sb);
        tracing::info!(store = %store.label.display(), generation = store.generation, direct = store.is_direct(), "opened store");
        Ok(store)
    }

    fn assemble(members: Vec<Medium>, sb: Superblock) -> Self {
        let track = |committed| Tracked {
            committed,
            dirty: false,
        };
        let label = members
            .iter()
            .map(|m| m.path().display().to_string())
            .collect::<Vec<_>>()
            .join(" + ");
        Self {
            block_size: members.iter().map(Medium::block_size).max().unwrap_or(1),
            members,
            stripe: stripe_of(&sb.membership),
            store_id: sb.membership.store_id,
            label: label.into(),
            spec: sb.spec,
            layout: sb.layout,
            generation: sb.generation,
            progress: sb.progress,
            aux: track(sb.aux_state),
            partitions: sb.partition_states.into_iter().map(track).collect(),
        }
    }

    /// Path of the store (for an NVMe target: the controller, namespace and start LBA); for a
    /// striped store, every member's, joined by ` + `.
    pub fn path(&self) -> &Path {
        &self.label
    }

    /// The store's identity, chosen at creation and the same on every member (zeros for a
    /// store written before striping).
    pub fn store_id(&self) -> [u8; 16] {
        self.store_id
    }

    /// Members the store is striped over (1 for a plain store).
    pub fn members(&self) -> usize {
        self.members.len()
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

    /// Whether I/O bypasses the page cache (`O_DIRECT`, or NVMe queues) on every member.
    pub fn is_direct(&self) -> bool {
        self.members.iter().all(Medium::is_direct)
    }

    /// Bytes of the file, device or namespace the store is on, from the store's start (of the
    /// smallest member, for a striped store).
    pub fn medium_bytes(&self) -> Result<u64, StoreError> {
        self.members
            .iter()
            .map(Medium::size)
            .try_fold(u64::MAX, |min, size| Ok(min.min(size?)))
    }

    /// Logical block size the store's I/O is aligned to (the largest of its members').
    pub fn block_size(&self) -> u64 {
        self.block_size
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
        let mut transfers: Vec<Vec<MediumIo<'_>>> =
            (0..self.members.len()).map(|_| Vec::new()).collect();
        let mut written = Vec::new();
        for req in requests.iter_mut() {
            let (region, raw, write) = match req {
                IoRequest::Read(r, b) => (*r, b.raw(), false),
                IoRequest::Write(r, b) => (*r, b.raw(), true),
            };
            let (base, io_len) = self.target(region, write)?;
            self.add_transfer(&mut transfers, region, raw, (base, io_len), write)?;
            if write {
                written.push(region);
            }
        }
        self.run_transfers(transfers)?;
        for region in written {
            self.tracked_mut(region).dirty = true;
        }
        Ok(())
    }

    /// Reads the blocks of `region` that hold its bytes `range` (of the copy [`Store::read`]
    /// reads) into `buf`, from the buffer's start; returns where in `buf` byte `range.start`
    /// is. A reader of a few rows of a partition (a query's lookups) reads them, not the
    /// partition: `buf` needs the range's bytes rounded out to whole blocks.
    ///
    /// # Errors
    ///
    /// As [`Store::submit`]; [`StoreError::InvalidSpec`] for a range past the region's end.
    pub fn read_range(
        &mut self,
        region: Region,
        range: std::ops::Range<u64>,
        buf: &mut IoBuffer,
    ) -> Result<usize, StoreError> {
        let (base, io_len) = self.target(region, false)?;
        let bytes = self.extent(region)?.bytes;
        if range.start > range.end || range.end > bytes {
            return Err(StoreError::InvalidSpec(format!(
                "{}: bytes {}..{} of {region}, which holds {bytes}",
                self.path().display(),
                range.start,
                range.end
            )));
        }
        let bs = self.block_size;
        let start = range.start / bs * bs;
        let len = range.end.next_multiple_of(bs).min(io_len) - start;
        let mut transfers: Vec<Vec<MediumIo<'_>>> =
            (0..self.members.len()).map(|_| Vec::new()).collect();
        self.add_transfer(
            &mut transfers,
            region,
            buf.raw(),
            (base + start, len),
            false,
        )?;
        self.run_transfers(transfers)?;
        Ok((range.start - start) as usize)
    }

    /// Adds the transfer of `len` store bytes at `at` to or from `raw` to each member's list
    /// (`transfers`, by member), its pieces as the stripe places them.
    fn add_transfer<'b>(
        &self,
        transfers: &mut [Vec<MediumIo<'b>>],
        region: Region,
        raw: &'b std::sync::Arc<crate::buffer::RawAlloc>,
        (at, len): (u64, u64),
        write: bool,
    ) -> Result<(), StoreError> {
        if (raw.cap() as u64) < len {
            return Err(StoreError::BufferTooSmall {
                path: self.path().to_owned(),
                region: region.to_string(),
                needed: len as usize,
                got: raw.cap(),
            });
        }
        for piece in self.stripe.pieces(at, len) {
            transfers[piece.member].push(MediumIo {
                raw,
                buf_offset: piece.at,
                offset: piece.offset,
                len: piece.len,
                write,
            });
        }
        Ok(())
    }

    /// Runs each member's transfers, the members at once.
    fn run_transfers(&mut self, transfers: Vec<Vec<MediumIo<'_>>>) -> Result<(), StoreError> {
        at_once(&mut self.members, transfers, |medium, t| {
            if t.is_empty() { Ok(()) } else { medium.run(&t) }
        })
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
        if self.members.len() > 1 {
            return Err(StoreError::InvalidSpec(format!(
                "{}: a striped store's transfers go through Store::submit or Store::io_pieces, \
                 not one extent",
                self.label.display()
            )));
        }
        let (offset, len) = self.target(region, write)?;
        Ok((self.members[0].base() + offset, len))
    }

    /// [`Store::io_extent`] for a store on any number of members: the pieces of the transfer of
    /// `region`, one a stripe unit (one in all on a single member), each with its member, its
    /// byte on that member's medium (for an NVMe target, in the namespace) and its offset in
    /// the caller's buffer, in buffer order. After a write, report it with
    /// [`Store::mark_written`].
    ///
    /// # Errors
    ///
    /// As [`Store::io_extent`].
    pub fn io_pieces(&self, region: Region, write: bool) -> Result<Vec<IoPiece>, StoreError> {
        let (offset, len) = self.target(region, write)?;
        Ok(self
            .stripe
            .pieces(offset, len)
            .map(|p| IoPiece {
                member: p.member,
                at: self.members[p.member].base() + p.offset,
                buf_offset: p.at,
                len: p.len,
            })
            .collect())
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
    /// `fdatasync` every member, then on each member write the superblock copy of slot
    /// `(g+1) % 2` and `fdatasync`. A crash at any point leaves generation `g` or `g+1`
    /// readable: `g`'s regions are untouched until every member holds `g+1`, and
    /// [`Store::open_striped`] opens at the generation all members hold. Returns the new
    /// generation.
    pub fn commit(&mut self, progress: &[u8]) -> Result<u64, StoreError> {
        if progress.len() > self.spec.progress_capacity as usize {
            return Err(StoreError::ProgressTooLarge {
                path: self.path().to_owned(),
                len: progress.len(),
                capacity: self.spec.progress_capacity,
            });
        }
        at_once(
            &mut self.members,
            vec![(); self.stripe.members()],
            |m, ()| m.sync(),
        )?;
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
    /// its slot on every member in turn, durably.
    fn write_superblock(&mut self, generation: u64) -> Result<(), StoreError> {
        let mut sb = Superblock {
            generation,
            membership: Membership {
                store_id: self.store_id,
                index: 0,
                count: self.members.len() as u32,
                stripe_bytes: self.stripe.unit(),
            },
            spec: self.spec.clone(),
            layout: self.layout.clone(),
            aux_state: self.aux.committed,
            partition_states: self.partitions.iter().map(|t| t.committed).collect(),
            progress: self.progress.clone(),
        };
        for (i, medium) in self.members.iter_mut().enumerate() {
            sb.membership.index = i as u32;
            medium.write_at((generation % 2) * SUPERBLOCK_SLOT_BYTES, &sb.encode())?;
            medium.sync()?;
        }
        Ok(())
    }

    fn io_len(&self, bytes: u64) -> u64 {
        bytes.next_multiple_of(self.block_size)
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

/// Checks the number of members a store is given.
fn member_count(given: usize) -> Result<u32, StoreError> {
    match u32::try_from(given) {
        Ok(n @ 1..=MAX_MEMBERS) => Ok(n),
        _ => Err(StoreError::InvalidSpec(format!(
            "a store has 1 to {MAX_MEMBERS} members, not {given}"
        ))),
    }
}

/// The striping a superblock records.
fn stripe_of(m: &Membership) -> Stripe {
    if m.count == 1 {
        Stripe::single()
    } else {
        Stripe::new(m.count, m.stripe_bytes)
    }
}

/// A store identity in messages: 32 hex digits, as records keep it.
pub fn store_id_hex(id: [u8; 16]) -> String {
    format!("{:032x}", u128::from_le_bytes(id))
}

/// A new store's identity: 16 random bytes from the kernel. A caller chooses it before
/// creating ([`CreateOptions::store_id`]) when it records it first.
pub fn new_store_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    // SAFETY: writes at most 16 bytes into `id`.
    let n = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if n != 16 {
        // Never seen on Linux ≥ 3.17; the identity then still differs between stores made at
        // different times or by different processes.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        id[..8].copy_from_slice(&(t.as_nanos() as u64).to_le_bytes());
        id[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    id
}

/// The valid superblock copies of a member, newest first; when it has none, the error that
/// says why (as for a plain store).
fn valid_copies(medium: &mut Medium) -> Result<Vec<Superblock>, StoreError> {
    let path = medium.path().to_owned();
    let slot_len = SUPERBLOCK_SLOT_BYTES as usize;
    let head = medium.read_at(0, 2 * slot_len)?;
    let slot = |i: usize| {
        head.get(i * slot_len..((i + 1) * slot_len).min(head.len()))
            .unwrap_or(&[])
    };
    match [Superblock::decode(slot(0)), Superblock::decode(slot(1))] {
        [Ok(a), Ok(b)] if a.generation >= b.generation => Ok(vec![a, b]),
        [Ok(a), Ok(b)] => Ok(vec![b, a]),
        [Ok(a), Err(_)] | [Err(_), Ok(a)] => Ok(vec![a]),
        [Err(SlotError::NoMagic), Err(SlotError::NoMagic)] => Err(StoreError::WrongMagic {
            path,
            found: signature::find(&head).map(|s| s.0),
        }),
        [Err(SlotError::Version(found)), _] | [_, Err(SlotError::Version(found))] => {
            Err(StoreError::UnsupportedVersion {
                path,
                found,
                supported: FORMAT_VERSION,
            })
        }
        [Err(a), Err(b)] => {
            let why = |e: SlotError| match e {
                SlotError::Corrupt(m) => m,
                other => format!("{other:?}"),
            };
            Err(StoreError::BadChecksum {
                path,
                slot0: why(a),
                slot1: why(b),
            })
        }
    }
}

/// The commit the members agree on: each member must be the store's member in the place it
/// was given, and the store opens at the highest generation every member holds. A member
/// ahead of it (its superblock written by a commit that did not reach every member) gets that
/// copy overwritten with the agreed one, so that a later commit of the same generation number
/// can never meet it.
fn agree(members: &mut [Medium], copies: Vec<Vec<Superblock>>) -> Result<Superblock, StoreError> {
    let count = members.len() as u32;
    let first = copies[0][0].membership;
    let names = |members: &[Medium]| {
        members
            .iter()
            .map(|m| m.path().display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (i, (medium, newest)) in members.iter().zip(&copies).enumerate() {
        let m = newest[0].membership;
        let why = if m.count != count {
            format!(
                "belongs to a store striped over {} member(s), but {count} are given ({}): give \
                 every member, in the order they were created",
                m.count,
                names(members)
            )
        } else if m.store_id != first.store_id {
            format!(
                "belongs to another store than {} (given as member 1)",
                members[0].path().display()
            )
        } else if m.index != i as u32 {
            format!(
                "is member {} of its store but is given as member {}: give the members in the \
                 order they were created",
                m.index + 1,
                i + 1
            )
        } else {
            continue;
        };
        return Err(StoreError::Member {
            path: medium.path().to_owned(),
            why,
        });
    }
    let agreed = copies.iter().map(|c| c[0].generation).min().unwrap_or(0);
    let mut chosen: Vec<Superblock> = Vec::with_capacity(copies.len());
    for (medium, member) in members.iter().zip(&copies) {
        let Some(sb) = member.iter().find(|sb| sb.generation == agreed) else {
            return Err(StoreError::Member {
                path: medium.path().to_owned(),
                why: format!(
                    "holds no valid superblock of generation {agreed}, the newest every member \
                     holds (it has {:?})",
                    member.iter().map(|sb| sb.generation).collect::<Vec<_>>()
                ),
            });
        };
        let mut same = sb.clone();
        same.membership.index = 0;
        if chosen.first().is_some_and(|member1| *member1 != same) {
            return Err(StoreError::Member {
                path: medium.path().to_owned(),
                why: format!(
                    "its superblock of generation {agreed} differs from the first member's"
                ),
            });
        }
        chosen.push(same);
    }
    for (i, (medium, member)) in members.iter_mut().zip(&copies).enumerate() {
        for ahead in member.iter().filter(|sb| sb.generation > agreed) {
            tracing::warn!(
                member = %medium.path().display(),
                "generation {} reached this member only: the commit did not complete; back to \
                 generation {agreed}",
                ahead.generation
            );
            let mut sb = chosen[0].clone();
            sb.membership.index = i as u32;
            medium.write_at((ahead.generation % 2) * SUPERBLOCK_SLOT_BYTES, &sb.encode())?;
            medium.sync()?;
        }
    }
    Ok(chosen.swap_remove(0))
}

/// Runs `f` on every member with its share of `work` (one item per member), on a thread per
/// member when there are several, so that their devices work at the same time; returns once
/// every member is done, with the first error.
fn at_once<T: Send>(
    members: &mut [Medium],
    work: Vec<T>,
    f: impl Fn(&mut Medium, T) -> Result<(), StoreError> + Sync,
) -> Result<(), StoreError> {
    if let [medium] = members {
        return f(
            medium,
            work.into_iter().next().expect("one item per member"),
        );
    }
    std::thread::scope(|scope| {
        let f = &f;
        let running: Vec<_> = members
            .iter_mut()
            .zip(work)
            .map(|(medium, w)| scope.spawn(move || f(medium, w)))
            .collect();
        let mut first = Ok(());
        for r in running {
            let r = r
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            if first.is_ok() {
                first = r;
            }
        }
        first
    })
}
