//! AdaGrad over the rows a step touched, in place, and the step that runs the passes and it.

use crate::error::DriverContext;
use crate::kernel_abi::dtype_code;
use crate::{Gpu, GpuError};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::args::RoundingArgs;
use super::{DeviceTable, GpuBatchEngine, blocks};

impl GpuBatchEngine {
    /// Queues AdaGrad on every row touched since the last call, in place, and clears the
    /// gradients and row lists for the next batch.
    pub fn apply(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        let touched_nodes = nodes
            .rows
            .min(2 * self.batch_len + 2 * self.chunks * self.shape.negatives);
        let rounding = self.node_rounding(gpu, nodes);
        self.adagrad(gpu, nodes, touched_nodes, rounding)?;
        if let Some(r) = rels
            && self.model.decoder.uses_relations()
        {
            // With reciprocal relations an edge touches its relation's row and its inverse's.
            let per_edge = if self.inverse.is_some() { 2 } else { 1 };
            let touched = r.rows.min(per_edge * self.batch_len);
            self.adagrad(gpu, r, touched, RoundingArgs::default())?;
        }
        Ok(())
    }

    /// The kernels' arguments of the node rows' rounding this step (all zeros: none).
    pub(super) fn node_rounding(&self, gpu: &Gpu, nodes: &DeviceTable) -> RoundingArgs {
        let Some(r) = self.rounding else {
            return RoundingArgs::default();
        };
        let (partition_of_slot, rows_per_slot) = match (&self.slots, &self.partition_of_slot) {
            (Some((map, _)), Some(dev)) => (gpu.ptr(dev), map.rows_per_partition as u32),
            _ => (0, nodes.rows as u32),
        };
        RoundingArgs {
            batch_key: r.batch.0,
            partition_of_slot,
            out_of_range: gpu.ptr(&self.out_of_range),
            dtype: dtype_code(r.dtype),
            rows_per_slot,
        }
    }

    fn adagrad(
        &mut self,
        gpu: &Gpu,
        t: &mut DeviceTable,
        capacity: usize,
        rounding: RoundingArgs,
    ) -> Result<(), GpuError> {
        let (d, lr, eps) = (t.dim as u32, self.optimizer.lr, self.optimizer.eps);
        let row_state = u32::from(t.state_width != t.dim);
        let mut b = gpu.stream().launch_builder(&gpu.kernels.adagrad);
        b.arg(&mut t.emb)
            .arg(&mut t.state)
            .arg(&mut t.grad)
            .arg(&mut t.flags)
            .arg(&mut t.uses)
            .arg(&t.list)
            .arg(&t.count)
            .arg(&d)
            .arg(&row_state)
            .arg(&lr)
            .arg(&eps)
            .arg(&rounding);
        let cfg = LaunchConfig {
            grid_dim: (blocks(capacity, 8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads the count, then only list entries below it (each a row
        // id of this table) and those rows of the table's buffers (state of the width
        // row_state says) and of uses; with rounding, partition_of_slot's entry of each
        // row's slot (rows_per_slot divides the slot-indexed table) and out_of_range.
        unsafe { b.launch(cfg) }.during("launching legend_adagrad")?;
        self.mark(gpu, "adagrad")?;
        gpu.clear(&mut t.count)
    }

    /// Queues one full step on the current batch and negatives: the result of
    /// [`forward_backward`](Self::forward_backward) then [`apply`](Self::apply), but the node
    /// rows the batch uses once (most of them) take their AdaGrad step in the backward
    /// kernels, without the gradient table's atomics, clearing and second pass (with
    /// row-wise state, after the warp has stored the row's whole gradient), rounded as
    /// `legend_adagrad` rounds where [`GpuBatchEngine::set_rounding`] asks for it.
    pub fn step(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        mut rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        self.passes(gpu, nodes, rels.as_deref_mut(), true)?;
        self.apply(gpu, nodes, rels)
    }

    /// Like [`GpuBatchEngine::step`], but only the node rows step: the relation table keeps
    /// the batch's summed gradients, for a caller that adds them up over several GPUs (the
    /// table's [`DeviceTable::gradient_span`]) and then steps them with
    /// [`GpuBatchEngine::apply_relations_everywhere`].
    pub fn step_nodes(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        self.passes(gpu, nodes, rels, true)?;
        let touched_nodes = nodes
            .rows
            .min(2 * self.batch_len + 2 * self.chunks * self.shape.negatives);
        let rounding = self.node_rounding(gpu, nodes);
        self.adagrad(gpu, nodes, touched_nodes, rounding)
    }

    /// AdaGrad on every row of the relation table with the gradients it holds (summed over
    /// the GPUs by the caller), then cleared. A row no GPU touched has a zero gradient and
    /// keeps its values and state (a step of zero), so the rows every GPU steps are the union
    /// of the rows each touched, and the tables stay equal on all of them.
    pub fn apply_relations_everywhere(
        &mut self,
        gpu: &Gpu,
        rels: &mut DeviceTable,
    ) -> Result<(), GpuError> {
        let rows = rels.rows;
        if self
            .all_relation_rows
            .as_ref()
            .is_none_or(|(ids, _)| ids.len() != rows)
        {
            let ids: Vec<u32> = (0..rows as u32).collect();
            self.all_relation_rows = Some((gpu.upload(&ids)?, gpu.upload(&[rows as u32])?));
        }
        let (ids, count) = self.all_relation_rows.as_ref().expect("made above");
        gpu.stream()
            .memcpy_dtod(ids, &mut rels.list.slice_mut(..rows))
            .during("listing every relation row")?;
        gpu.stream()
            .memcpy_dtod(count, &mut rels.count)
            .during("counting every relation row")?;
        self.adagrad(gpu, rels, rows, RoundingArgs::default())
    }
}
