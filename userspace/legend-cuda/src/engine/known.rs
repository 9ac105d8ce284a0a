//! Filtered negatives (`training.negatives.filtered`): the training edges in a hash table on the
//! device, which `legend_filter_known` probes for every (row, negative) of a job and sets the
//! score of a known edge to −∞ before the loss (the CPU engine's exclusion masks, without a
//! mask). The table is keyed by global ids, so the engine keeps global-id copies of the batch
//! and its negatives from before they are rewritten into slot rows.

use cudarc::driver::CudaSlice;
use legend_model::rng::{GOLDEN, mix};

use crate::{Gpu, GpuError};

/// The known edges on the device, and the current batch in global ids.
pub(super) struct KnownEdges {
    /// Slots of four ids: source, relation, destination, 1 (all 0: empty).
    pub(super) table: CudaSlice<u32>,
    /// Slots − 1 (a power of two).
    pub(super) capacity_mask: u64,
    /// The batch's edges, three ids each, in global ids.
    pub(super) edges: CudaSlice<u32>,
    /// The batch's negative lists in global ids.
    pub(super) negs: CudaSlice<u32>,
}

/// The slot an edge's probe starts at, before the mask (the kernels' `legend_edge_hash`).
fn edge_hash(e: [u32; 3]) -> u64 {
    mix(((u64::from(e[0])) << 32 | u64::from(e[2])) ^ mix(u64::from(e[1]).wrapping_add(GOLDEN)))
}

/// Device bytes of the table of `edges` distinct edges (for memory estimates).
pub fn known_edges_bytes(edges: u64) -> u64 {
    16 * capacity(edges as usize) as u64
}

/// Slots for `n` edges: a power of two, at most half full.
fn capacity(n: usize) -> usize {
    (2 * n).next_power_of_two().max(2)
}

/// The table of `edges` (a repeated edge is stored once) and its capacity mask.
fn build_table(edges: &[[u32; 3]]) -> (Vec<u32>, u64) {
    let mask = capacity(edges.len()) as u64 - 1;
    let mut slots = vec![0u32; 4 * (mask as usize + 1)];
    for &e in edges {
        let mut i = edge_hash(e) & mask;
        loop {
            let slot = &mut slots[4 * i as usize..4 * i as usize + 4];
            if slot[3] == 0 {
                slot.copy_from_slice(&[e[0], e[1], e[2], 1]);
                break;
            }
            if slot[..3] == e {
                break;
            }
            i = (i + 1) & mask;
        }
    }
    (slots, mask)
}

impl KnownEdges {
    /// The table of `edges` on `gpu`, with room for batches of `max_batch` edges and
    /// `negatives` negative ids.
    pub(super) fn new(
        gpu: &Gpu,
        edges: &[[u32; 3]],
        max_batch: usize,
        negatives: usize,
    ) -> Result<KnownEdges, GpuError> {
        let (slots, capacity_mask) = build_table(edges);
        Ok(KnownEdges {
            table: gpu.upload(&slots)?,
            capacity_mask,
            edges: gpu.zeros(3 * max_batch)?,
            negs: gpu.zeros(negatives)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's probe of the table, as `legend_known` walks it.
    fn contains(slots: &[u32], mask: u64, e: [u32; 3]) -> bool {
        let mut i = edge_hash(e) & mask;
        loop {
            let slot = &slots[4 * i as usize..4 * i as usize + 4];
            if slot[3] == 0 {
                return false;
            }
            if slot[..3] == e {
                return true;
            }
            i = (i + 1) & mask;
        }
    }

    #[test]
    fn every_edge_is_found_and_others_are_not() {
        let edges: Vec<[u32; 3]> = (0..5000u32).map(|i| [i % 97, i % 5, i / 3]).collect();
        let (slots, mask) = build_table(&edges);
        assert_eq!(slots.len(), 4 * 16384, "at most half full");
        let stored = slots.chunks_exact(4).filter(|s| s[3] == 1).count();
        let mut distinct = edges.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(stored, distinct.len(), "repeats are stored once");
        assert!(edges.iter().all(|&e| contains(&slots, mask, e)));
        // Zero ids are ids like any other: the empty mark is the fourth word.
        assert!(!contains(&slots, mask, [0, 0, 1]) || edges.contains(&[0, 0, 1]));
        assert!(!contains(&slots, mask, [98, 0, 0]));
        assert!(!contains(&slots, mask, [1, 1, 100_000]));
        assert_eq!(known_edges_bytes(5000), 16 * 16384);
    }
}
