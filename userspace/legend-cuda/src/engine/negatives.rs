//! A batch's negatives: drawn on the GPU from the CPU sampler's counter-based streams, or
//! given by the caller.

use std::ops::Range;

use cudarc::driver::PushKernelArg;
use legend_model::BatchKey;

use crate::error::DriverContext;
use crate::gpu::grid_1d;
use crate::{Gpu, GpuError};

use super::GpuBatchEngine;

/// The keys of the negative lists of one batch as the CPU trainer forms them: list
/// `2c + side` uses `batch.negatives(c, side)` (side 0 replaces sources).
pub fn negative_keys(batch: BatchKey, chunks: usize) -> Vec<u64> {
    (0..2 * chunks as u64)
        .map(|l| batch.negatives(l / 2, l % 2))
        .collect()
}

impl GpuBatchEngine {
    /// Draws the negatives of the current batch on the GPU, as legend-engine's
    /// `NegativeSampler::sample` does on the CPU: list `l` (`2c + side`) from stream
    /// `keys[l]` (see [`negative_keys`]) over the entity-id ranges `partitions`, the first
    /// `round(degree_fraction · k)` draws by degree.
    pub fn sample_negatives(
        &mut self,
        gpu: &Gpu,
        partitions: &[Range<u64>],
        keys: &[u64],
        degree_fraction: f64,
    ) -> Result<(), GpuError> {
        let lists = 2 * self.chunks;
        if keys.len() != lists {
            return Err(GpuError::Shape(format!(
                "{} keys for {lists} negative lists",
                keys.len()
            )));
        }
        if partitions.is_empty() {
            return Err(GpuError::Shape("negatives from no partition".into()));
        }
        if let Some(why) = self.unusable_ranges(partitions) {
            return Err(GpuError::Shape(format!("negatives: {why}")));
        }
        let k = self.shape.negatives;
        let by_degree = (degree_fraction * k as f64).round() as u32;
        let starts: Vec<u64> = partitions.iter().map(|p| p.start).collect();
        let counts: Vec<u64> = partitions.iter().map(|p| p.end - p.start).collect();
        let total_rows: u64 = counts.iter().sum();
        let p = &self.degree_prefix_host;
        let weight: u64 = partitions
            .iter()
            .map(|r| p[r.end as usize] - p[r.start as usize])
            .sum();
        if self.part_start.len() < starts.len() {
            self.part_start = gpu.zeros(starts.len())?;
            self.part_rows = gpu.zeros(starts.len())?;
        }
        gpu.write(&starts, &mut self.part_start)?;
        gpu.write(&counts, &mut self.part_rows)?;
        gpu.write(keys, &mut self.keys)?;
        let (lists32, k32, nparts) = (lists as u32, k as u32, starts.len() as u32);
        let s = gpu.stream();
        let mut b = s.launch_builder(&gpu.kernels.sample);
        b.arg(&self.keys)
            .arg(&lists32)
            .arg(&k32)
            .arg(&by_degree)
            .arg(&self.part_start)
            .arg(&self.part_rows)
            .arg(&nparts)
            .arg(&total_rows)
            .arg(&self.degree_prefix)
            .arg(&weight)
            .arg(&mut self.negs);
        // SAFETY: keys has `lists` entries, the partition arrays `nparts`, the prefix
        // entities + 1 (ranges checked above), and negs lists × k: all the kernel touches.
        unsafe { b.launch(grid_1d((lists * k) as u64)?) }
            .during("launching legend_sample_negatives")?;
        if let Some(known) = &mut self.known {
            gpu.stream()
                .memcpy_dtod(
                    &self.negs.slice(..lists * k),
                    &mut known.negs.slice_mut(..lists * k),
                )
                .during("copying the negatives' global ids")?;
        }
        Self::remap(&self.slots, gpu, &mut self.negs, lists * k, 1, 1)?;
        self.mark(gpu, "sample")?;
        Ok(())
    }

    /// Uses the given negatives (`2 · chunks` lists of `k` entity ids, list `2c` replacing
    /// sources and `2c + 1` destinations) instead of sampling.
    pub fn set_negatives(&mut self, gpu: &Gpu, ids: &[u32]) -> Result<(), GpuError> {
        let want = 2 * self.chunks * self.shape.negatives;
        if ids.len() != want || ids.iter().any(|&i| !self.usable(u64::from(i))) {
            return Err(GpuError::Shape(format!(
                "{} negative ids (need {want} below {}, resident)",
                ids.len(),
                self.entities
            )));
        }
        gpu.write(ids, &mut self.negs)?;
        if let Some(known) = &mut self.known {
            gpu.write(ids, &mut known.negs)?;
        }
        Self::remap(&self.slots, gpu, &mut self.negs, want, 1, 1)
    }

    /// The negatives of the current batch as the kernels use them: global ids, or table
    /// rows when the table is slot-indexed (waits for the device).
    pub fn negatives(&self, gpu: &Gpu) -> Result<Vec<u32>, GpuError> {
        let mut all = gpu.download(&self.negs)?;
        all.truncate(2 * self.chunks * self.shape.negatives);
        Ok(all)
    }
}
