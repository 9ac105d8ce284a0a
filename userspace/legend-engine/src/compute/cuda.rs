//! The GPU engine's side of training: node rows in a slot-indexed [`DeviceTable`] (one slot
//! per resident partition; with C = N, slot p holds partition p and the table is the whole node
//! table), relations resident on the device, and each batch stepped by legend-cuda's
//! [`GpuBatchEngine`], which draws the CPU engine's negatives exactly.
//!
//! Partitions move between the host buffer and their slots with synchronous copies on the
//! compute stream (pageable host memory): the evicted slot is copied out before the buffer's
//! I/O thread writes it back, and the loaded partition is copied in after the swap finished.
//! The disk I/O of a swap still overlaps with the GPU's compute of the overlap buckets.

use legend_cuda::{BatchShape, DeviceTable, Gpu, GpuBatchEngine, SlotMap, negative_keys};
use legend_dataset::PartitionScheme;
use legend_model::{AdaGrad, ChunkModel, Decoder};

use super::{ComputeBackend, Step};
use crate::buffer::PartitionBuffer;
use crate::config::Config;
use crate::trainer::{Relations, TrainError};

/// Score-matrix memory the engine may use for one launch group.
const SCORE_BYTES: usize = 1 << 30;

/// The GPU engine over a device partition buffer.
pub(crate) struct CudaCompute {
    gpu: Gpu,
    engine: GpuBatchEngine,
    nodes: DeviceTable,
    rels: Option<DeviceTable>,
    scheme: PartitionScheme,
    /// Whether the node table is slot-indexed (C < N); otherwise partition p sits in slot p.
    slotted: bool,
    /// The slot of each partition, [`SlotMap::ABSENT`] when it is not on the device.
    slot_of: Vec<u32>,
    /// Free slots (slot-indexed tables only).
    free: Vec<u32>,
    seed: u64,
    degree_fraction: f64,
}

impl CudaCompute {
    /// A GPU engine on `gpu` for `config`, with `capacity` slots and the relations uploaded.
    pub(crate) fn new(
        gpu: Gpu,
        config: &Config,
        scheme: PartitionScheme,
        degrees: &[u32],
        relations: &Relations,
    ) -> Result<CudaCompute, TrainError> {
        config.cuda_support()?;
        let t = &config.training;
        let dim = config.model.dim;
        let model = ChunkModel {
            decoder: config.decoder(),
            loss: config.loss(),
            dim,
        };
        let optimizer = AdaGrad {
            lr: t.learning_rate,
            eps: t.adagrad_eps,
        };
        let (chunks, k) = (t.negatives.num_chunks, t.negatives.negatives_per_positive);
        // Whole batches per launch where the score matrices fit, else fewer chunks. TransE L2
        // keeps its distances next to the scores (legend-cuda's `BatchShape::group`).
        let rows = t.batch_size.div_ceil(chunks.max(1));
        let bytes = if model.decoder == Decoder::TransEL2 {
            8
        } else {
            4
        };
        let mut group = 2 * chunks;
        while group > 2 && group * rows * k * bytes > SCORE_BYTES {
            group -= 2;
        }
        let shape = BatchShape {
            max_batch: t.batch_size,
            num_chunks: chunks,
            negatives: k,
            group,
        };
        let num_relations = relations.emb.len().checked_div(dim).unwrap_or(0);
        let mut engine =
            GpuBatchEngine::new(&gpu, model, optimizer, shape, degrees, num_relations)?;
        engine.set_loss_accumulation(true);
        let capacity = config.capacity();
        let slotted = capacity < scheme.num_partitions;
        let table_rows = if slotted {
            capacity as usize * scheme.rows_per_partition as usize
        } else {
            scheme.entities as usize
        };
        let nodes = DeviceTable::zeros(&gpu, table_rows, dim)?;
        let rels = if model.decoder.uses_relations() {
            Some(DeviceTable::from_host(
                &gpu,
                dim,
                &relations.emb,
                &relations.state,
            )?)
        } else {
            None
        };
        let mut compute = CudaCompute {
            gpu,
            engine,
            nodes,
            rels,
            scheme,
            slotted,
            slot_of: vec![SlotMap::ABSENT; scheme.num_partitions as usize],
            free: if slotted {
                (0..capacity).rev().collect()
            } else {
                Vec::new()
            },
            seed: t.seed,
            degree_fraction: t.negatives.degree_fraction,
        };
        compute.publish_slots()?;
        Ok(compute)
    }

    /// Tells the engine where the partitions are (slot-indexed tables only).
    fn publish_slots(&mut self) -> Result<(), TrainError> {
        if self.slotted {
            let map = SlotMap {
                rows_per_partition: self.scheme.rows_per_partition,
                slot_of: self.slot_of.clone(),
            };
            self.engine.set_slots(&self.gpu, Some(map))?;
        }
        Ok(())
    }

    /// First table row of a slot.
    fn row0(&self, slot: u32) -> usize {
        slot as usize * self.scheme.rows_per_partition as usize
    }

    /// Copies the device rows of resident partition `p` into its host copy.
    fn download(&self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError> {
        let row0 = self.row0(self.slot_of[p as usize]);
        let part = host
            .partition_mut(p)
            .expect("a partition on the device is resident in the host buffer");
        self.nodes
            .read_rows(&self.gpu, row0, &mut part.emb, &mut part.state)?;
        Ok(())
    }
}

impl ComputeBackend for CudaCompute {
    fn loaded(&mut self, host: &PartitionBuffer, p: u32) -> Result<(), TrainError> {
        if self.slot_of[p as usize] != SlotMap::ABSENT {
            return Ok(());
        }
        let slot = if self.slotted {
            self.free
                .pop()
                .expect("a free slot for every resident partition")
        } else {
            p
        };
        let part = host.partition(p).expect("a loaded partition is resident");
        let row0 = self.row0(slot);
        self.nodes
            .write_rows(&self.gpu, row0, &part.emb, &part.state)?;
        // The host partition may be handed to the I/O thread at the next swap.
        self.gpu.synchronize()?;
        self.slot_of[p as usize] = slot;
        self.publish_slots()
    }

    fn evicting(&mut self, host: &mut PartitionBuffer, p: u32) -> Result<(), TrainError> {
        let slot = self.slot_of[p as usize];
        if slot == SlotMap::ABSENT {
            return Ok(());
        }
        self.download(host, p)?;
        self.slot_of[p as usize] = SlotMap::ABSENT;
        if self.slotted {
            self.free.push(slot);
        }
        self.publish_slots()
    }

    fn train_batch(
        &mut self,
        step: &Step<'_>,
        _host: &mut PartitionBuffer,
        _rels: &mut Relations,
    ) -> Result<(), TrainError> {
        let gpu = &self.gpu;
        self.engine.set_batch(gpu, step.batch)?;
        let keys = negative_keys(self.seed, step.epoch, step.batch_no, self.engine.chunks());
        let ranges: Vec<_> = step
            .resident
            .iter()
            .map(|&p| self.scheme.range(p))
            .collect();
        self.engine
            .sample_negatives(gpu, &ranges, &keys, self.degree_fraction)?;
        self.engine.step(gpu, &mut self.nodes, self.rels.as_mut())?;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), TrainError> {
        Ok(self.gpu.synchronize()?)
    }

    fn take_loss(&mut self) -> Result<f64, TrainError> {
        Ok(self.engine.take_loss(&self.gpu)?)
    }

    fn sync_host(
        &mut self,
        host: &mut PartitionBuffer,
        rels: &mut Relations,
    ) -> Result<(), TrainError> {
        for p in 0..self.scheme.num_partitions {
            if self.slot_of[p as usize] != SlotMap::ABSENT {
                self.download(host, p)?;
            }
        }
        if let Some(table) = &self.rels {
            table.read_rows(&self.gpu, 0, &mut rels.emb, &mut rels.state)?;
        }
        Ok(())
    }
}
