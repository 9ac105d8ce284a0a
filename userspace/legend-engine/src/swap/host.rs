//! Partitions in host memory: the CPU engine's slots ([`HostRows`]), what every mover shares to
//! move rows between host memory and a [`PartitionStore`] ([`HostStore`]), and the CPU engine's
//! mover ([`HostMover`]).

use legend_dataset::PartitionScheme;
use legend_model::Init;
use rayon::prelude::*;

use super::{Fence, Moved, Mover, WriteJob};
use crate::rows::{Partition, RowMut, RowShape};
use crate::store::at_rest::narrow;
use crate::store::memory::widen_into;
use crate::store::{PartitionStore, PartitionStoreError, StoredEmbeddings};

/// The CPU engine's resident partitions, by partition: compute reads and updates their rows
/// in place; a partition's memory travels to the I/O thread with its write and comes back
/// with a read.
pub struct HostRows {
    scheme: PartitionScheme,
    parts: Vec<Option<Partition>>,
}

impl HostRows {
    /// No resident partitions of `scheme` (and none ever, unless `used`: the GPU engine's rows
    /// are elsewhere).
    pub(crate) fn new(scheme: PartitionScheme, used: bool) -> HostRows {
        let n = if used { scheme.num_partitions } else { 0 };
        HostRows {
            scheme,
            parts: (0..n).map(|_| None).collect(),
        }
    }

    pub(crate) fn insert(&mut self, part: Partition) {
        let p = part.id as usize;
        self.parts[p] = Some(part);
    }

    pub(crate) fn remove(&mut self, p: u32) -> Option<Partition> {
        self.parts.get_mut(p as usize).and_then(Option::take)
    }

    /// A resident partition's rows.
    pub fn partition(&self, p: u32) -> Option<&Partition> {
        self.parts.get(p as usize)?.as_ref()
    }

    fn local(&self, id: u32) -> (usize, usize) {
        let p = self.scheme.partition_of(id);
        (
            p as usize,
            (u64::from(id) - self.scheme.range(p).start) as usize,
        )
    }

    /// Embedding and state rows of entity `id` (`dim` and `width` floats), if its partition is
    /// resident.
    pub fn row(&self, id: u32, dim: usize, width: usize) -> Option<(&[f32], &[f32])> {
        let (p, local) = self.local(id);
        let part = self.parts.get(p)?.as_ref()?;
        Some((
            &part.emb[local * dim..(local + 1) * dim],
            &part.state[local * width..(local + 1) * width],
        ))
    }

    /// Writable rows of `ids` (`dim` and `width` floats each), in their order, so that callers
    /// can update them in parallel.
    ///
    /// # Panics
    /// If an id repeats or its partition is not resident.
    pub fn disjoint_rows_mut(&mut self, ids: &[u32], dim: usize, width: usize) -> Vec<RowMut<'_>> {
        let scheme = self.scheme;
        // What is left of each resident partition past the last row handed out, and the id of
        // its first row: ids are visited in ascending order, each row split off the front.
        let mut rest: Vec<Option<(RowMut<'_>, u64)>> = self
            .parts
            .iter_mut()
            .enumerate()
            .map(|(p, part)| {
                part.as_mut().map(|part| {
                    let first = scheme.range(p as u32).start;
                    ((&mut part.emb[..], &mut part.state[..]), first)
                })
            })
            .collect();
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_unstable_by_key(|&i| ids[i]);
        let mut rows: Vec<Option<RowMut<'_>>> = ids.iter().map(|_| None).collect();
        for i in order {
            let id = u64::from(ids[i]);
            let p = scheme.partition_of(ids[i]) as usize;
            let ((emb, state), first) = rest[p]
                .take()
                .unwrap_or_else(|| panic!("row {id}: partition {p} is not resident"));
            let skip =
                id.checked_sub(first)
                    .unwrap_or_else(|| panic!("row {id} asked for twice")) as usize;
            let (row, emb) = emb[skip * dim..].split_at_mut(dim);
            let (row_state, state) = state[skip * width..].split_at_mut(width);
            rows[i] = Some((row, row_state));
            rest[p] = Some(((emb, state), id + 1));
        }
        rows.into_iter()
            .map(|r| r.expect("every id visited"))
            .collect()
    }
}

/// A partition store with what moving rows between it and host memory needs: the partitioning,
/// the row shape, and how never-written rows are drawn. Every mover reads and lends through
/// one.
pub(crate) struct HostStore<S> {
    pub(crate) store: S,
    pub(crate) scheme: PartitionScheme,
    pub(crate) shape: RowShape,
    pub(crate) init: Init,
}

impl<S: PartitionStore> HostStore<S> {
    /// `part` (whose memory is reused) sized for partition `p`'s rows.
    pub(crate) fn sized(&self, p: u32, mut part: Partition) -> Partition {
        let range = self.scheme.range(p);
        let rows = (range.end - range.start) as usize;
        part.id = p;
        for (floats, width) in [
            (&mut part.emb, self.shape.dim),
            (&mut part.state, self.shape.state),
        ] {
            let len = rows * width;
            if floats.is_empty() {
                // Zeroed by the allocator (fresh pages, touched only when written): filling a
                // 17 GB partition explicitly would take seconds before it is even read.
                *floats = vec![0.0; len];
            } else {
                floats.resize(len, 0.0);
            }
        }
        part
    }

    /// Partition `p`'s rows from the store in host memory (a memory store's own, moved out of
    /// it; else read into `spare`'s memory), counted in `moved`, and whether it was ever
    /// written (if not, the rows are `spare`'s memory, sized, for the caller to draw).
    pub(crate) fn read(
        &mut self,
        p: u32,
        spare: Partition,
        moved: &mut Moved,
    ) -> Result<(Partition, bool), PartitionStoreError> {
        let part = match self.store.take_stored(p) {
            Some((StoredEmbeddings::F32(emb), state)) => Partition { id: p, emb, state },
            Some((bits, state)) => {
                // 16-bit rows widened into `spare`'s memory; the bits go (the partition is
                // resident now, and its next write narrows it again).
                let mut part = spare;
                part.id = p;
                widen_into(self.shape.dtype, &bits, &mut part.emb);
                part.state = state;
                part
            }
            None => {
                let mut part = self.sized(p, spare);
                if !self.store.read(p, &mut part.emb, &mut part.state)? {
                    return Ok((part, false));
                }
                part
            }
        };
        moved.stats.reads += 1;
        moved.stats.bytes_read += self.shape.bytes_of(&part);
        Ok((part, true))
    }

    /// Writes `part` to the store, counted in `moved`: a memory store takes f32 rows over
    /// (`None` back), a 16-bit one their narrowed bits; others copy them. The memory not taken
    /// over comes back.
    pub(crate) fn write(
        &mut self,
        part: Partition,
        moved: &mut Moved,
    ) -> Result<Option<Partition>, PartitionStoreError> {
        moved.stats.writes += 1;
        moved.stats.bytes_written += self.shape.bytes_of(&part);
        if self.store.in_memory() {
            let Partition { id, emb, state } = part;
            if !self.shape.dtype.is_narrow() {
                self.store
                    .keep_stored(id, StoredEmbeddings::F32(emb), state)?;
                return Ok(None);
            }
            let mut bits = vec![0u16; emb.len()];
            narrow(self.shape.dtype, &emb, bytemuck::cast_slice_mut(&mut bits));
            self.store
                .keep_stored(id, StoredEmbeddings::Bits16(bits), state)?;
            return Ok(Some(Partition {
                id,
                emb,
                state: Vec::new(),
            }));
        }
        self.store.write(part.id, &part.emb, &part.state)?;
        Ok(Some(part))
    }

    /// Draws `part`'s rows from the initial distribution, row by global id, with zero state.
    pub(crate) fn draw(&self, part: &mut Partition) {
        let first = self.scheme.range(part.id).start;
        let init = &self.init;
        // Rows are independent draws (a hash of the row id): on every core, since one thread
        // takes 25-30 s for a partition of 5.2 M rows at d = 100 (the Twitter-shaped run's
        // first epoch, which draws each partition once).
        part.emb
            .par_chunks_exact_mut(self.shape.dim)
            .enumerate()
            .for_each(|(i, emb)| init.node_row(first + i as u64, emb));
        part.state.fill(0.0);
    }

    /// [`Mover::lend`] for a mover over this store.
    pub(crate) fn lend(&mut self, p: u32) -> Result<(Partition, bool), PartitionStoreError> {
        match self.store.take_stored(p) {
            // Lent, not copied: a checkpoint or an evaluation reads every partition, and a copy
            // of each would raise the run's peak by a partition.
            Some((StoredEmbeddings::F32(emb), state)) => {
                return Ok((Partition { id: p, emb, state }, true));
            }
            // 16-bit rows: a widened copy; the store keeps its bits.
            Some((bits, state)) => {
                let mut part = Partition::empty(p);
                widen_into(self.shape.dtype, &bits, &mut part.emb);
                part.state.clone_from(&state);
                self.store.keep_stored(p, bits, state)?;
                return Ok((part, false));
            }
            None => {}
        }
        let (mut part, found) = self.read(p, Partition::empty(p), &mut Moved::default())?;
        if !found {
            self.draw(&mut part);
        }
        Ok((part, false))
    }
}

/// The CPU engine's mover: host rows to and from the store.
pub(crate) struct HostMover<S> {
    rest: HostStore<S>,
    /// Host memory of free slots, reused by the next read.
    pool: Vec<Partition>,
}

impl<S: PartitionStore> HostMover<S> {
    /// A mover over `rest`.
    pub(crate) fn new(rest: HostStore<S>) -> HostMover<S> {
        HostMover {
            rest,
            pool: Vec::new(),
        }
    }
}

impl<S: PartitionStore> Mover for HostMover<S> {
    fn write(
        &mut self,
        job: WriteJob,
        moved: &mut Moved,
    ) -> Result<Option<Partition>, PartitionStoreError> {
        let part = job
            .rows
            .expect("the CPU engine's slots travel with their writes");
        let back = self.rest.write(part, moved)?;
        if job.keep {
            // A checkpoint's write: a memory store never gets one (the swapper skips it).
            return Ok(back);
        }
        self.pool.extend(back);
        Ok(None)
    }

    fn read(
        &mut self,
        p: u32,
        _slot: u32,
        moved: &mut Moved,
    ) -> Result<(Option<Partition>, Fence), PartitionStoreError> {
        let spare = self.pool.pop().unwrap_or_else(|| Partition::empty(p));
        let (mut part, found) = self.rest.read(p, spare, moved)?;
        if !found {
            self.rest.draw(&mut part);
            moved.stats.initialised += 1;
        }
        Ok((Some(part), Fence::passed()))
    }

    fn lend(&mut self, p: u32) -> Result<(Partition, bool), PartitionStoreError> {
        self.rest.lend(p)
    }

    fn read_rows(&mut self, ids: &[u64], out: &mut [f32]) -> Result<(), PartitionStoreError> {
        self.rest.store.read_rows(&self.rest.init, ids, out)
    }

    fn store(&mut self) -> &mut dyn PartitionStore {
        &mut self.rest.store
    }
}
