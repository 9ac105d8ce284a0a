//! Filtered negatives (`training.negatives.filtered`): the training edges on the device sorted
//! twice, as (source, relation, destination) and as (relation, destination, source), so that a
//! row's known neighbours on either side are one contiguous range. `legend_filter_known` finds
//! each row's range and sets the score of every negative in it to −∞ before the loss (the CPU
//! engine's exclusion masks, without a mask). The keys are global ids, so the engine keeps
//! global-id copies of the batch and its negatives from before they become slot rows.

use cudarc::driver::CudaSlice;
use rayon::prelude::*;

use crate::{Gpu, GpuError};

/// The known edges on the device, and the current batch in global ids.
pub(super) struct KnownEdges {
    /// Distinct edges as (source, relation, destination), sorted.
    pub(super) by_source: CudaSlice<u32>,
    /// The same as (relation, destination, source), sorted.
    pub(super) by_destination: CudaSlice<u32>,
    /// How many distinct edges.
    pub(super) count: u32,
    /// The batch's edges, three ids each, in global ids.
    pub(super) edges: CudaSlice<u32>,
    /// The batch's negative lists in global ids.
    pub(super) negs: CudaSlice<u32>,
}

/// Device bytes the known edges take (for memory estimates): two sorted copies of 12 bytes an
/// edge.
pub fn known_edges_bytes(edges: u64) -> u64 {
    24 * edges
}

/// `edges` with their ids in the order `order` names, sorted and without repeats, flattened.
fn sorted_keys(edges: &[[u32; 3]], order: [usize; 3]) -> Vec<u32> {
    let mut keys: Vec<[u32; 3]> = edges
        .par_iter()
        .map(|e| [e[order[0]], e[order[1]], e[order[2]]])
        .collect();
    keys.par_sort_unstable();
    keys.dedup();
    keys.into_iter().flatten().collect()
}

impl KnownEdges {
    /// The known `edges` on `gpu`, with room for batches of `max_batch` edges and
    /// `negatives` negative ids.
    pub(super) fn new(
        gpu: &Gpu,
        edges: &[[u32; 3]],
        max_batch: usize,
        negatives: usize,
    ) -> Result<KnownEdges, GpuError> {
        let by_source = sorted_keys(edges, [0, 1, 2]);
        let by_destination = sorted_keys(edges, [1, 2, 0]);
        let count = u32::try_from(by_source.len() / 3).map_err(|_| {
            GpuError::Shape(format!(
                "{} known edges for filtered negatives (at most 2^32 − 1)",
                by_source.len() / 3
            ))
        })?;
        Ok(KnownEdges {
            by_source: gpu.upload(&by_source)?,
            by_destination: gpu.upload(&by_destination)?,
            count,
            edges: gpu.zeros(3 * max_batch)?,
            negs: gpu.zeros(negatives)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_are_sorted_distinct_and_in_the_asked_order() {
        let edges = [[5, 1, 2], [0, 9, 3], [5, 1, 2], [5, 0, 7]];
        assert_eq!(sorted_keys(&edges, [0, 1, 2]), [0, 9, 3, 5, 0, 7, 5, 1, 2]);
        // (relation, destination, source): a row's sources are the range of its (r, d).
        assert_eq!(sorted_keys(&edges, [1, 2, 0]), [0, 7, 5, 1, 2, 5, 9, 3, 0]);
        assert_eq!(known_edges_bytes(1000), 24_000);
    }
}
