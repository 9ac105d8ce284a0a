//! The store: partition I/O through `io_uring` or NVMe queues, commits; its creation and
//! opening are in `store/open.rs`.

use std::path::Path;

use crate::buffer::IoBuffer;
use crate::error::StoreError;
use crate::io::MediumIo;
use crate::layout::{Extent, Layout, SUPERBLOCK_SLOT_BYTES, StoreSpec};
use crate::medium::Medium;
use crate::stripe::Stripe;
use crate::superblock::{Membership, RegionState, Superblock};

mod open;

pub use open::{CreateOptions, DEFAULT_STRIPE_BYTES, Expect, new_store_id, store_id_hex};

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
