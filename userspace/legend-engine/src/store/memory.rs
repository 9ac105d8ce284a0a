//! The `memory` backend's store: partitions kept in RAM outside the resident set, their
//! embeddings in `storage.dtype` (16-bit rows take half the RAM of f32 ones).

use std::sync::{Arc, Condvar, Mutex};

use legend_dataset::PartitionScheme;
use legend_model::Dtype;
use rustc_hash::FxHashMap;

use super::at_rest::{narrow, widen};
use super::{PartitionStore, PartitionStoreError};
use crate::rows::RowShape;

/// A partition's embeddings as a memory store keeps them.
#[derive(Debug)]
pub enum StoredEmbeddings {
    /// f32 values (`storage.dtype = "f32"`): moved in and out of the store, never copied.
    F32(Vec<f32>),
    /// The bits of 16-bit values (`bf16`, `f16`): converted on the way in and out.
    Bits16(Vec<u16>),
}

impl StoredEmbeddings {
    /// Values in the store.
    pub fn len(&self) -> usize {
        match self {
            StoredEmbeddings::F32(v) => v.len(),
            StoredEmbeddings::Bits16(v) => v.len(),
        }
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Partitions kept in RAM while they are not resident: the `memory` backend when C < N (and
/// the partitions a resumed run restores there).
#[derive(Default)]
pub struct MemoryStore {
    dtype: Dtype,
    parts: FxHashMap<u32, (StoredEmbeddings, Vec<f32>)>,
}

impl MemoryStore {
    /// An empty store keeping embeddings in `dtype`.
    pub fn new(dtype: Dtype) -> MemoryStore {
        MemoryStore {
            dtype,
            parts: FxHashMap::default(),
        }
    }

    /// A store holding whole tables already in memory (`entities` rows of `shape` each, f32
    /// values `shape.dtype` represents), split by `scheme`. The tables are cut from their ends,
    /// each partition copied out (narrowed, in a 16-bit format) and the rest shrunk, and what
    /// remains is partition 0 itself: the tables once and at most one partition twice. (A
    /// resumed run reads its checkpoint into the store a partition at a time instead:
    /// [`crate::Trainer::restore`].)
    pub fn from_tables(
        scheme: PartitionScheme,
        shape: RowShape,
        mut emb: Vec<f32>,
        mut state: Vec<f32>,
    ) -> MemoryStore {
        let mut store = MemoryStore::new(shape.dtype);
        for p in (1..scheme.num_partitions).rev() {
            let start = scheme.range(p).start as usize;
            let part = (
                store.at_rest(emb.split_off(start * shape.dim)),
                state.split_off(start * shape.state),
            );
            emb.shrink_to_fit();
            state.shrink_to_fit();
            store.parts.insert(p, part);
        }
        let first = (store.at_rest(emb), state);
        store.parts.insert(0, first);
        store
    }

    /// Takes every partition of `scheme` (rows of `shape`) from a checkpoint, read a partition
    /// at a time as the store keeps it (a resumed run whose partitions all wait here: K workers),
    /// and checks its checksums.
    pub fn restore(
        &mut self,
        scheme: PartitionScheme,
        shape: RowShape,
        mut rows: crate::restore::CheckpointRows,
    ) -> Result<(), crate::run::RunError> {
        rows.partitions_at_rest(scheme, shape, |p, emb, state| {
            self.parts.insert(p, (emb, state));
            Ok::<(), crate::run::RunError>(())
        })?;
        rows.finish()
    }

    /// The store's form of `values`.
    fn at_rest(&self, values: Vec<f32>) -> StoredEmbeddings {
        if !self.dtype.is_narrow() {
            return StoredEmbeddings::F32(values);
        }
        let mut bits = vec![0u16; values.len()];
        narrow(self.dtype, &values, bytemuck::cast_slice_mut(&mut bits));
        StoredEmbeddings::Bits16(bits)
    }

    /// The format it keeps embeddings in.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Bytes the store holds (embeddings at rest and AdaGrad state).
    pub fn bytes(&self) -> u64 {
        self.parts
            .values()
            .map(|(e, s)| (e.len() * self.dtype.bytes() + s.len() * 4) as u64)
            .sum()
    }
}

/// `emb` widened into `out` (resized).
pub(crate) fn widen_into(dtype: Dtype, emb: &StoredEmbeddings, out: &mut Vec<f32>) {
    match emb {
        StoredEmbeddings::F32(v) => {
            out.clear();
            out.extend_from_slice(v);
        }
        StoredEmbeddings::Bits16(bits) => {
            out.resize(bits.len(), 0.0);
            widen(dtype, bytemuck::cast_slice(bits), out);
        }
    }
}

impl PartitionStore for MemoryStore {
    fn read(
        &mut self,
        p: u32,
        emb: &mut [f32],
        state: &mut [f32],
    ) -> Result<bool, PartitionStoreError> {
        match self.parts.get(&p) {
            Some((StoredEmbeddings::F32(e), s)) => {
                emb.copy_from_slice(e);
                state.copy_from_slice(s);
                Ok(true)
            }
            Some((StoredEmbeddings::Bits16(bits), s)) => {
                widen(self.dtype, bytemuck::cast_slice(bits), emb);
                state.copy_from_slice(s);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn in_memory(&self) -> bool {
        true
    }

    fn take_stored(&mut self, p: u32) -> Option<(StoredEmbeddings, Vec<f32>)> {
        self.parts.remove(&p)
    }

    fn keep_stored(
        &mut self,
        p: u32,
        emb: StoredEmbeddings,
        state: Vec<f32>,
    ) -> Result<(), PartitionStoreError> {
        let emb = match emb {
            StoredEmbeddings::F32(v) if self.dtype.is_narrow() => self.at_rest(v),
            other => other,
        };
        self.parts.insert(p, (emb, state));
        Ok(())
    }

    fn write(&mut self, p: u32, emb: &[f32], state: &[f32]) -> Result<(), PartitionStoreError> {
        let dtype = self.dtype;
        let entry = self
            .parts
            .entry(p)
            .or_insert_with(|| (StoredEmbeddings::F32(Vec::new()), Vec::new()));
        match (&mut entry.0, dtype.is_narrow()) {
            (StoredEmbeddings::Bits16(bits), true) => {
                bits.resize(emb.len(), 0);
                narrow(dtype, emb, bytemuck::cast_slice_mut(bits));
            }
            (_, true) => {
                let mut bits = vec![0u16; emb.len()];
                narrow(dtype, emb, bytemuck::cast_slice_mut(&mut bits));
                entry.0 = StoredEmbeddings::Bits16(bits);
            }
            (StoredEmbeddings::F32(v), false) => {
                v.clear();
                v.extend_from_slice(emb);
            }
            (_, false) => entry.0 = StoredEmbeddings::F32(emb.to_vec()),
        }
        entry.1.clear();
        entry.1.extend_from_slice(state);
        Ok(())
    }
}

/// One memory store shared by the workers of a K-GPU run ([`crate::workers`]): each worker's
/// swap path reads the partitions it trains from it and writes back those it leaves; in
/// between, partitions travel from worker to worker or wait here (parked, N ≥ 3K).
///
/// A partition a worker took out is not home until that worker writes it back, and the write
/// runs on the worker's I/O thread while another worker may already be reading the same
/// partition ahead of its next round: the store orders the two, making the read wait
/// ([`PartitionStore::take_out`]). A read never sees stale rows nor draws a partition afresh
/// because its last holder had not written it yet.
#[derive(Clone)]
pub struct SharedMemoryStore(Arc<Shared>);

struct Shared {
    store: Mutex<Kept>,
    came_home: Condvar,
}

struct Kept {
    store: MemoryStore,
    /// Partitions some swap path took out and has not brought home.
    out: std::collections::HashSet<u32>,
    /// Set when the run fails: waits end with an error instead of waiting for a worker that
    /// will never write its partition back.
    abandoned: bool,
}

/// How often a wait for a partition looks whether the run was abandoned (belt and braces: an
/// abandon also wakes every wait).
const WAKE: std::time::Duration = std::time::Duration::from_millis(100);

impl SharedMemoryStore {
    /// `store`, shared; every partition home.
    pub fn new(store: MemoryStore) -> SharedMemoryStore {
        SharedMemoryStore(Arc::new(Shared {
            store: Mutex::new(Kept {
                store,
                out: std::collections::HashSet::new(),
                abandoned: false,
            }),
            came_home: Condvar::new(),
        }))
    }

    /// The embeddings' format at rest.
    pub fn dtype(&self) -> Dtype {
        self.lock().store.dtype()
    }

    /// The partitions it holds, ascending.
    pub(crate) fn stored(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.lock().store.parts.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The run failed: every wait for a partition ends in [`PartitionStoreError::Abandoned`],
    /// until [`SharedMemoryStore::resume`].
    pub(crate) fn abandon(&self) {
        self.lock().abandoned = true;
        self.0.came_home.notify_all();
    }

    /// Waits block again (a new part of the run starts).
    pub(crate) fn resume(&self) {
        self.lock().abandoned = false;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        // A worker that panicked holding the lock left whole partitions (each operation moves
        // one partition in or out at once): the store is still consistent.
        self.0
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lock, once partition `p` is home.
    fn lock_home(&self, p: u32) -> Result<std::sync::MutexGuard<'_, Kept>, PartitionStoreError> {
        let mut kept = self.lock();
        while kept.out.contains(&p) {
            if kept.abandoned {
                return Err(PartitionStoreError::Abandoned(p));
            }
            kept = self
                .0
                .came_home
                .wait_timeout(kept, WAKE)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        Ok(kept)
    }
}

impl PartitionStore for SharedMemoryStore {
    fn read(
        &mut self,
        p: u32,
        emb: &mut [f32],
        state: &mut [f32],
    ) -> Result<bool, PartitionStoreError> {
        self.lock().store.read(p, emb, state)
    }

    fn write(&mut self, p: u32, emb: &[f32], state: &[f32]) -> Result<(), PartitionStoreError> {
        self.lock().store.write(p, emb, state)
    }

    fn in_memory(&self) -> bool {
        true
    }

    fn take_stored(&mut self, p: u32) -> Option<(StoredEmbeddings, Vec<f32>)> {
        self.lock().store.take_stored(p)
    }

    fn keep_stored(
        &mut self,
        p: u32,
        emb: StoredEmbeddings,
        state: Vec<f32>,
    ) -> Result<(), PartitionStoreError> {
        self.lock().store.keep_stored(p, emb, state)
    }

    fn take_out(&mut self, p: u32) -> Result<(), PartitionStoreError> {
        self.lock_home(p)?.out.insert(p);
        Ok(())
    }

    fn bring_home(&mut self, p: u32) {
        self.lock().out.remove(&p);
        self.0.came_home.notify_all();
    }

    fn wait_home(&mut self, p: u32) -> Result<(), PartitionStoreError> {
        self.lock_home(p).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legend_model::StateLayout;

    #[test]
    fn tables_split_into_partitions_keep_their_rows_and_partition_zero_is_not_copied() {
        let (entities, dim) = (1_001u64, 3usize);
        let shape = RowShape::new(dim, StateLayout::Element);
        let emb: Vec<f32> = (0..entities as usize * dim).map(|i| i as f32).collect();
        let state: Vec<f32> = emb.iter().map(|x| -x).collect();
        for n in [1, 4] {
            let scheme = PartitionScheme::new(entities, n).unwrap();
            let mut store = MemoryStore::from_tables(scheme, shape, emb.clone(), state.clone());
            for p in 0..n {
                let Some((StoredEmbeddings::F32(e), s)) = store.take_stored(p) else {
                    panic!("partition {p} kept as f32");
                };
                let rows = scheme.range(p);
                let floats = rows.start as usize * dim..rows.end as usize * dim;
                assert!(
                    e == emb[floats.clone()] && s == state[floats],
                    "partition {p}"
                );
            }
        }
        // Moved, not copied: the caller's table is partition 0.
        let scheme = PartitionScheme::new(entities, 1).unwrap();
        let at = emb.as_ptr();
        let mut store = MemoryStore::from_tables(scheme, shape, emb, state);
        let Some((StoredEmbeddings::F32(e), _)) = store.take_stored(0) else {
            panic!("kept as f32")
        };
        assert_eq!(e.as_ptr(), at);
    }

    #[test]
    fn sixteen_bit_rows_take_half_the_embeddings_memory_and_read_back_exactly() {
        let (entities, dim) = (1_000u64, 8usize);
        let shape = RowShape::new(dim, StateLayout::Row).with_dtype(Dtype::Bf16);
        let scheme = PartitionScheme::new(entities, 4).unwrap();
        // Values bf16 represents (the engine rounds every row it writes).
        let emb: Vec<f32> = (0..entities as usize * dim)
            .map(|i| Dtype::Bf16.round_nearest(i as f32 * 0.37 - 900.0))
            .collect();
        let state: Vec<f32> = (0..entities).map(|i| i as f32).collect();
        let mut store = MemoryStore::from_tables(scheme, shape, emb.clone(), state.clone());
        assert_eq!(store.bytes(), entities * (dim as u64 * 2 + 4));
        let rows = scheme.range(2);
        let (mut got, mut got_state) = (vec![0.0; 250 * dim], vec![0.0; 250]);
        assert!(store.read(2, &mut got, &mut got_state).unwrap());
        assert_eq!(got, emb[rows.start as usize * dim..rows.end as usize * dim]);
        assert_eq!(got_state, state[rows.start as usize..rows.end as usize]);
        // Written back as f32 values, kept as 16 bits.
        store.write(2, &got, &got_state).unwrap();
        assert_eq!(store.bytes(), entities * (dim as u64 * 2 + 4));
        let Some((StoredEmbeddings::Bits16(bits), _)) = store.take_stored(2) else {
            panic!("kept as bits")
        };
        let mut back = Vec::new();
        widen_into(Dtype::Bf16, &StoredEmbeddings::Bits16(bits), &mut back);
        assert_eq!(back, got);
    }

    /// A worker reading a partition another worker still holds waits for its write-back, and
    /// sees the written rows; an abandoned run's wait ends in an error naming the partition.
    #[test]
    fn a_shared_read_waits_for_the_holders_write_and_an_abandon_ends_it() {
        let home = SharedMemoryStore::new(MemoryStore::new(Dtype::F32));
        let (mut holder, mut reader) = (home.clone(), home.clone());
        holder.take_out(3).unwrap();
        let waiting = std::thread::spawn(move || {
            reader.take_out(3).unwrap();
            let (mut emb, mut state) = ([0.0f32; 2], [0.0f32; 2]);
            assert!(reader.read(3, &mut emb, &mut state).unwrap());
            emb
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !waiting.is_finished(),
            "the read waits while partition 3 is out"
        );
        holder.write(3, &[1.0, 2.0], &[0.5, 0.5]).unwrap();
        holder.bring_home(3);
        assert_eq!(waiting.join().unwrap(), [1.0, 2.0]);
        // Out again, with the reader; nobody will bring it home.
        let mut stuck = home.clone();
        let waiting = std::thread::spawn(move || stuck.take_out(3));
        std::thread::sleep(std::time::Duration::from_millis(50));
        home.abandon();
        let err = waiting.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("partition 3 was not written back"), "{err}");
        // A new part of the run waits again; other partitions were never held up.
        home.resume();
        let mut other = home.clone();
        other.take_out(4).unwrap();
        other.wait_home(5).unwrap();
    }
}
