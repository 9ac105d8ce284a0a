//! Where everything lives on the device: superblock slots, the auxiliary
//! region and the partition extents.

use std::fmt;

use legend_model::Dtype;
use legend_model::partition::partition_range;

use crate::error::StoreError;

/// Bytes reserved for each of the two superblock copies (slot 0 at byte 0,
/// slot 1 right after). Fixed, so that either copy can be found without
/// trusting the other.
pub const SUPERBLOCK_SLOT_BYTES: u64 = 1 << 20;
/// Minimum alignment of every extent; raised to the logical block size when
/// that is larger.
pub const BASE_ALIGN: u64 = 64 << 10;
/// Most partitions a store may have (bounded by the superblock slot size).
pub const MAX_PARTITIONS: u32 = 16_384;
/// Largest progress blob a store may reserve.
pub const MAX_PROGRESS_BYTES: u32 = 128 << 10;
/// Longest dataset label, in bytes of UTF-8.
pub const MAX_LABEL_BYTES: usize = 64;

/// Bytes of one optimizer-state element (always `f32`).
const STATE_ELEM_BYTES: u64 = 4;

/// Identity of the dataset a store belongs to: an opaque 128-bit id chosen
/// by the caller (e.g. a hash of the dataset manifest) and a human label
/// used in messages. Only the id is compared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetId {
    /// The identity proper.
    pub id: [u8; 16],
    /// Human-readable name, at most [`MAX_LABEL_BYTES`] bytes.
    pub label: String,
}

impl fmt::Display for DatasetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\" (id ", self.label)?;
        for b in self.id {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// What a store holds; fixed at creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSpec {
    /// Dataset the embeddings belong to.
    pub dataset: DatasetId,
    /// Number of nodes |V| (rows over all partitions).
    pub num_nodes: u64,
    /// Embedding dimension d.
    pub dim: u32,
    /// The embeddings' number format (the optimizer state is always f32).
    pub dtype: Dtype,
    /// Optimizer accumulators per row: d (element-wise AdaGrad) or 1 (row-wise). Recorded
    /// from format version 2; a version-1 store has d.
    pub state_width: u32,
    /// Number of partitions N.
    pub num_partitions: u32,
    /// Size of the auxiliary region (relation parameters and their optimizer
    /// state, serialised by the caller); 0 for none. Kept in two copies and
    /// committed with the partitions.
    pub aux_bytes: u64,
    /// Bytes reserved in the superblock for the caller's progress blob.
    pub progress_capacity: u32,
    /// Keep two copies of every partition and write the one not referenced
    /// by the last commit, so that a crash rolls the partitions back to
    /// exactly the last checkpoint (doubles the space). Without it,
    /// partitions are written in place and a crash keeps any write-back done
    /// after the last checkpoint.
    pub shadow: bool,
}

impl StoreSpec {
    /// Bytes of one row at rest: its embedding and its optimizer state.
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.dim) * self.dtype.bytes() as u64
            + u64::from(self.state_width) * STATE_ELEM_BYTES
    }

    /// Bytes of the embeddings of a partition of `rows` rows, padded to 4 so that the f32
    /// state after them is aligned (16-bit embeddings of an odd count); `None` on overflow.
    pub fn embedding_bytes(&self, rows: u64) -> Option<u64> {
        rows.checked_mul(u64::from(self.dim) * self.dtype.bytes() as u64)?
            .checked_next_multiple_of(STATE_ELEM_BYTES)
    }

    /// Payload bytes of a partition of `rows` rows: embeddings (padded), then state.
    pub fn partition_bytes(&self, rows: u64) -> Option<u64> {
        self.embedding_bytes(rows)?
            .checked_add(rows.checked_mul(u64::from(self.state_width) * STATE_ELEM_BYTES)?)
    }
}

/// One region of the store: a partition or the auxiliary region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Byte offsets of the two copies (equal when the region is not
    /// shadowed).
    pub offsets: [u64; 2],
    /// First node id (0 for the auxiliary region).
    pub first_node: u64,
    /// Rows (nodes) it holds (0 for the auxiliary region).
    pub rows: u64,
    /// Bytes of payload: [`StoreSpec::partition_bytes`] for a partition
    /// (embeddings, then AdaGrad state), `aux_bytes` for the auxiliary region.
    pub bytes: u64,
}

/// The computed placement of every region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Alignment of every extent: max(64 KiB, logical block size).
    pub align: u64,
    /// Auxiliary region, when `aux_bytes > 0`; always two copies.
    pub aux: Option<Extent>,
    /// Partition extents, in partition order.
    pub partitions: Vec<Extent>,
    /// Bytes the whole store covers.
    pub total_bytes: u64,
}

fn invalid(msg: impl Into<String>) -> StoreError {
    StoreError::InvalidSpec(msg.into())
}

impl Layout {
    /// Computes the layout of `spec` on a device of the given logical block
    /// size (a power of two).
    pub fn compute(spec: &StoreSpec, block_size: u64) -> Result<Self, StoreError> {
        validate(spec)?;
        if !block_size.is_power_of_two() || block_size > SUPERBLOCK_SLOT_BYTES {
            return Err(invalid(format!("unusable logical block size {block_size}")));
        }
        // Both are powers of two, so the larger is their lcm.
        let align = BASE_ALIGN.max(block_size);
        let overflow = || invalid("store size overflows 64 bits");
        let mut cursor = (2 * SUPERBLOCK_SLOT_BYTES).next_multiple_of(align);
        // Reserves `bytes` at the cursor, rounded to the alignment.
        let mut take = |bytes: u64| -> Result<u64, StoreError> {
            let at = cursor;
            let span = bytes.checked_next_multiple_of(align).ok_or_else(overflow)?;
            cursor = cursor.checked_add(span).ok_or_else(overflow)?;
            Ok(at)
        };
        let aux = match spec.aux_bytes {
            0 => None,
            bytes => Some(Extent {
                offsets: [take(bytes)?, take(bytes)?],
                first_node: 0,
                rows: 0,
                bytes,
            }),
        };
        let mut partitions = Vec::with_capacity(spec.num_partitions as usize);
        for p in 0..spec.num_partitions {
            let nodes = partition_range(spec.num_nodes, spec.num_partitions, p);
            let rows = nodes.end - nodes.start;
            let bytes = spec.partition_bytes(rows).ok_or_else(overflow)?;
            let first = take(bytes)?;
            let second = if spec.shadow { take(bytes)? } else { first };
            partitions.push(Extent {
                offsets: [first, second],
                first_node: nodes.start,
                rows,
                bytes,
            });
        }
        Ok(Self {
            align,
            aux,
            partitions,
            total_bytes: cursor,
        })
    }

    /// Payload bytes of the largest partition.
    pub fn max_partition_bytes(&self) -> u64 {
        self.partitions.iter().map(|e| e.bytes).max().unwrap_or(0)
    }
}

fn validate(spec: &StoreSpec) -> Result<(), StoreError> {
    if spec.num_nodes == 0 {
        return Err(invalid("a store needs at least one node"));
    }
    if spec.dim == 0 {
        return Err(invalid("embedding dimension must be positive"));
    }
    if spec.state_width != 1 && spec.state_width != spec.dim {
        return Err(invalid(format!(
            "{} optimizer accumulators a row: must be 1 (row-wise) or the dimension {}",
            spec.state_width, spec.dim
        )));
    }
    if spec.num_partitions == 0 || spec.num_partitions > MAX_PARTITIONS {
        return Err(invalid(format!(
            "{} partitions: must be between 1 and {MAX_PARTITIONS}",
            spec.num_partitions
        )));
    }
    if spec.progress_capacity > MAX_PROGRESS_BYTES {
        return Err(invalid(format!(
            "progress capacity {} exceeds the maximum of {MAX_PROGRESS_BYTES} bytes",
            spec.progress_capacity
        )));
    }
    if spec.dataset.label.len() > MAX_LABEL_BYTES || spec.dataset.label.contains('\0') {
        return Err(invalid(format!(
            "dataset label {:?} must be at most {MAX_LABEL_BYTES} bytes without NUL",
            spec.dataset.label
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(
        num_nodes: u64,
        dim: u32,
        num_partitions: u32,
        aux_bytes: u64,
        shadow: bool,
    ) -> StoreSpec {
        StoreSpec {
            dataset: DatasetId {
                id: [7; 16],
                label: "t".into(),
            },
            num_nodes,
            dim,
            dtype: Dtype::F32,
            state_width: dim,
            num_partitions,
            aux_bytes,
            progress_capacity: 0,
            shadow,
        }
    }

    proptest! {
        #[test]
        fn layout_is_aligned_disjoint_and_fits(
            num_nodes in 1u64..5_000_000,
            dim in 1u32..600,
            num_partitions in 1u32..200,
            aux_bytes in prop_oneof![Just(0u64), 1u64..10_000_000],
            shadow in any::<bool>(),
            block_shift in 9u32..17,
        ) {
            let s = spec(num_nodes, dim, num_partitions, aux_bytes, shadow);
            let l = Layout::compute(&s, 1 << block_shift).unwrap();
            prop_assert_eq!(l.align % BASE_ALIGN, 0);
            prop_assert_eq!(l.align % (1 << block_shift), 0);
            // Every copy as (start, reserved end), superblock slots first.
            let mut spans = vec![(0, 2 * SUPERBLOCK_SLOT_BYTES)];
            let mut rows = 0;
            for (p, e) in l.partitions.iter().enumerate() {
                prop_assert_eq!(e.first_node, rows, "partition {} starts where the previous ended", p);
                rows += e.rows;
                prop_assert_eq!(e.bytes, e.rows * u64::from(dim) * 8);
                if e.bytes > 0 {
                    prop_assert_eq!(shadow, e.offsets[0] != e.offsets[1]);
                }
            }
            prop_assert_eq!(rows, num_nodes);
            for e in l.aux.iter().chain(&l.partitions) {
                let copies = if e.offsets[0] == e.offsets[1] { 1 } else { 2 };
                for &off in &e.offsets[..copies] {
                    prop_assert_eq!(off % l.align, 0);
                    if e.bytes > 0 {
                        spans.push((off, off + e.bytes.next_multiple_of(l.align)));
                    }
                }
            }
            spans.sort_unstable();
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
            }
            prop_assert!(spans.last().unwrap().1 <= l.total_bytes);
            prop_assert_eq!(l.total_bytes % l.align, 0);
        }
    }
}
