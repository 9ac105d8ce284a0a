//! A batch onto the device: its edges (from the host, or gathered from a resident bucket on
//! the device), remapped to slot rows when the node table is a partition buffer.

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use std::ops::Range;

use legend_model::Permutation;

use crate::error::DriverContext;
use crate::gpu::grid_1d;
use crate::{Gpu, GpuError};

use super::{GpuBatchEngine, SlotMap};

impl GpuBatchEngine {
    /// Makes the node table slot-indexed (`Some`: a partition buffer on the GPU, see
    /// [`SlotMap`]) or indexed by global id (`None`, the default). Batches and negatives
    /// keep using global ids; the engine rewrites them into table rows on the GPU. Call it
    /// again after every swap.
    pub fn set_slots(&mut self, gpu: &Gpu, slots: Option<SlotMap>) -> Result<(), GpuError> {
        self.slots = match slots {
            None => None,
            Some(map) => {
                if map.rows_per_partition == 0 || map.table_rows() > u64::from(u32::MAX) {
                    return Err(GpuError::Shape(format!(
                        "slot map of {} rows a partition and {} rows in all",
                        map.rows_per_partition,
                        map.table_rows()
                    )));
                }
                let dev = gpu.upload(&map.slot_of)?;
                let mut partition_of_slot = vec![0u32; map.slot_of.len()];
                for (p, &slot) in map.slot_of.iter().enumerate() {
                    if slot != SlotMap::ABSENT {
                        partition_of_slot[slot as usize] = p as u32;
                    }
                }
                self.partition_of_slot = Some(gpu.upload(&partition_of_slot)?);
                Some((map, dev))
            }
        };
        if self.slots.is_none() {
            self.partition_of_slot = None;
        }
        Ok(())
    }

    /// Rewrites the global ids of `ids` (every element whose index mod `step` has its bit
    /// set in `which`) into slot rows, when the table is slot-indexed (`slots`).
    pub(super) fn remap(
        slots: &Option<(SlotMap, CudaSlice<u32>)>,
        gpu: &Gpu,
        ids: &mut CudaSlice<u32>,
        n: usize,
        step: u32,
        which: u32,
    ) -> Result<(), GpuError> {
        let Some((map, slot_of)) = slots else {
            return Ok(());
        };
        let n64 = n as u64;
        let mut b = gpu.stream().launch_builder(&gpu.kernels.remap);
        b.arg(ids)
            .arg(&n64)
            .arg(&step)
            .arg(&which)
            .arg(slot_of)
            .arg(&map.rows_per_partition);
        // SAFETY: `ids` holds at least n ids, each checked by the caller to lie in a resident
        // partition, whose index is below slot_of's length.
        unsafe { b.launch(grid_1d(n64)?) }.during("launching legend_remap_ids")?;
        Ok(())
    }

    /// Whether global entity `id` can be used: below the entity count, and resident when
    /// the table is slot-indexed.
    pub(super) fn usable(&self, id: u64) -> bool {
        id < self.entities as u64 && self.slots.as_ref().is_none_or(|(m, _)| m.row(id).is_some())
    }

    /// Why rows of `ranges` (global entity ids) cannot be used, if they cannot: a range is
    /// empty or past the entities, or (slot-indexed table) meets a partition not resident.
    pub(super) fn unusable_ranges(&self, ranges: &[Range<u64>]) -> Option<String> {
        if ranges
            .iter()
            .any(|p| p.start >= p.end || !self.usable(p.start) || !self.usable(p.end - 1))
        {
            return Some(format!(
                "row ranges {ranges:?} for {} entities (and resident)",
                self.entities
            ));
        }
        let (map, _) = self.slots.as_ref()?;
        let rpp = map.rows_per_partition;
        ranges
            .iter()
            .flat_map(|r| r.start / rpp..=(r.end - 1) / rpp)
            .find(|&q| map.row(q * rpp).is_none())
            .map(|q| format!("partition {q} is not resident"))
    }

    /// Uploads a batch of `(source, relation, destination)` positives and splits it into
    /// chunks as the CPU trainer does (chunk `c` holds rows `c·B/C .. (c+1)·B/C`).
    pub fn set_batch(&mut self, gpu: &Gpu, edges: &[[u32; 3]]) -> Result<(), GpuError> {
        let b = edges.len();
        if b == 0 || b > self.shape.max_batch {
            return Err(GpuError::Shape(format!(
                "batch of {b} edges (at most {})",
                self.shape.max_batch
            )));
        }
        let rel_limit = if self.model.decoder.uses_relations() {
            self.edge_relations()
        } else {
            usize::MAX
        };
        if let Some(e) = edges.iter().find(|e| {
            !self.usable(u64::from(e[0]))
                || !self.usable(u64::from(e[2]))
                || e[1] as usize >= rel_limit
        }) {
            return Err(GpuError::Shape(format!(
                "edge {e:?} outside {} entities / {} relations, or in a partition not resident",
                self.entities,
                self.edge_relations()
            )));
        }
        let flat: Vec<u32> = edges.iter().flatten().copied().collect();
        gpu.write(&flat, &mut self.edges)?;
        self.finish_batch(gpu, b)
    }

    /// Builds the batch on the device: edges `order(first) .. order(first + len − 1)` of
    /// `bucket` (`order.len()` edges in device memory, three ids an edge, legend-model's
    /// [`Permutation`] order), then split into chunks as [`GpuBatchEngine::set_batch`] does.
    /// The host checks the row ranges (known, resident when slot-indexed), not the edges.
    ///
    /// # Safety
    /// Every edge of `bucket` must have its source in `src_rows`, its destination in
    /// `dst_rows` and (for decoders with relations) a relation below the relation count
    /// (half the relation rows with reciprocal relations): the kernels index the tables with
    /// them unchecked.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn set_batch_from_device(
        &mut self,
        gpu: &Gpu,
        bucket: &CudaView<'_, u32>,
        order: &Permutation,
        first: u64,
        len: usize,
        src_rows: Range<u64>,
        dst_rows: Range<u64>,
    ) -> Result<(), GpuError> {
        if len == 0 || len > self.shape.max_batch {
            return Err(GpuError::Shape(format!(
                "batch of {len} edges (at most {})",
                self.shape.max_batch
            )));
        }
        if let Some(why) = self.unusable_ranges(&[src_rows, dst_rows]) {
            return Err(GpuError::Shape(format!("bucket rows: {why}")));
        }
        crate::batch::gather_batch(gpu, bucket, order, first, len as u32, &mut self.edges)?;
        self.finish_batch(gpu, len)
    }

    /// After the `b` edges of a batch are in `edges` (global ids): rewrites them into slot rows
    /// and splits the batch into chunks.
    fn finish_batch(&mut self, gpu: &Gpu, b: usize) -> Result<(), GpuError> {
        if let Some(known) = &mut self.known {
            gpu.stream()
                .memcpy_dtod(
                    &self.edges.slice(..3 * b),
                    &mut known.edges.slice_mut(..3 * b),
                )
                .during("copying the batch's global ids")?;
        }
        Self::remap(&self.slots, gpu, &mut self.edges, 3 * b, 3, 0b101)?;
        let chunks = self.shape.num_chunks.min(b);
        if (b, chunks) != (self.batch_len, self.chunks) {
            let mut row0 = Vec::with_capacity(2 * chunks);
            let mut rows = Vec::with_capacity(2 * chunks);
            for c in 0..chunks {
                let (lo, hi) = (c * b / chunks, (c + 1) * b / chunks);
                for _side in 0..2 {
                    row0.push(lo as u32);
                    rows.push((hi - lo) as u32);
                }
            }
            gpu.write(&row0, &mut self.row0)?;
            gpu.write(&rows, &mut self.rows)?;
            self.batch_len = b;
            self.chunks = chunks;
        }
        Ok(())
    }
}
