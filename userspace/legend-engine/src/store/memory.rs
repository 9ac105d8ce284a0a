//! The `memory` backend's store: partitions kept in RAM outside the resident set.

use legend_dataset::PartitionScheme;
use rustc_hash::FxHashMap;

use super::{PartitionStore, PartitionStoreError};
use crate::rows::RowShape;

/// Partitions kept in RAM while they are not resident: the `memory` backend when C < N.
#[derive(Default)]
pub struct MemoryStore {
    parts: FxHashMap<u32, (Vec<f32>, Vec<f32>)>,
}

impl MemoryStore {
    /// A store holding whole tables (`entities` rows of `shape` each), split by `scheme`:
    /// resuming a run.
    /// The tables are cut from their ends, each partition copied out and the rest shrunk, and
    /// what remains is partition 0 itself, so that resuming holds the tables once and at most
    /// one partition twice (none with one partition).
    pub fn from_tables(
        scheme: PartitionScheme,
        shape: RowShape,
        mut emb: Vec<f32>,
        mut state: Vec<f32>,
    ) -> MemoryStore {
        let mut parts = FxHashMap::default();
        for p in (1..scheme.num_partitions).rev() {
            let start = scheme.range(p).start as usize;
            let part = (
                emb.split_off(start * shape.dim),
                state.split_off(start * shape.state),
            );
            emb.shrink_to_fit();
            state.shrink_to_fit();
            parts.insert(p, part);
        }
        parts.insert(0, (emb, state));
        MemoryStore { parts }
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
            Some((e, s)) => {
                emb.copy_from_slice(e);
                state.copy_from_slice(s);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn in_memory(&self) -> bool {
        true
    }

    fn take(&mut self, p: u32) -> Option<(Vec<f32>, Vec<f32>)> {
        self.parts.remove(&p)
    }

    fn keep(&mut self, p: u32, emb: Vec<f32>, state: Vec<f32>) -> Result<(), PartitionStoreError> {
        self.parts.insert(p, (emb, state));
        Ok(())
    }

    fn write(&mut self, p: u32, emb: &[f32], state: &[f32]) -> Result<(), PartitionStoreError> {
        let entry = self.parts.entry(p).or_default();
        entry.0.clear();
        entry.0.extend_from_slice(emb);
        entry.1.clear();
        entry.1.extend_from_slice(state);
        Ok(())
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
                let (e, s) = store.take(p).unwrap();
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
        assert_eq!(store.take(0).unwrap().0.as_ptr(), at);
    }
}
