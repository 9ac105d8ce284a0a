//! The forward and backward passes of a batch, a group of jobs a launch: queries, the three
//! products (`fused` or `unfused`), the rows' and the negatives' backward.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use legend_model::Decoder;

use crate::error::DriverContext;
use crate::gpu::grid_1d;
use crate::kernel_abi::{decoder_code, penalty_code};
use crate::{Gpu, GpuError};

use super::args::{DirectArgs, JobArgs, RoundingArgs};
use super::{DeviceTable, GpuBatchEngine, Path, blocks};

impl GpuBatchEngine {
    fn check_tables(
        &self,
        nodes: &DeviceTable,
        rels: Option<&DeviceTable>,
    ) -> Result<(), GpuError> {
        let d = self.model.dim;
        let need = match &self.slots {
            Some((map, _)) => map.table_rows() as usize,
            None => self.entities,
        };
        let state = self.optimizer.state.width(d);
        if nodes.dim != d || nodes.rows < need || nodes.state_width != state {
            return Err(GpuError::Shape(format!(
                "node table {}×{} ({} of state a row) for {need} rows of dim {d} ({state} of state)",
                nodes.rows, nodes.dim, nodes.state_width
            )));
        }
        // Relation rows of the decoder's width (RESCAL: d², a matrix), element-wise state.
        let rw = self.model.relation_width();
        match (self.model.decoder.uses_relations(), rels) {
            (true, Some(r)) if r.dim == rw && r.rows >= self.relations && r.state_width == rw => {
                Ok(())
            }
            (true, _) => Err(GpuError::Shape(format!(
                "{} needs a relation table of {} rows of {rw} floats",
                self.model.decoder, self.relations
            ))),
            (false, _) => Ok(()),
        }
    }

    /// Queues the forward and backward passes of the current batch: afterwards the tables'
    /// gradient accumulators hold the summed gradients and every touched row is listed.
    pub fn forward_backward(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
    ) -> Result<(), GpuError> {
        self.passes(gpu, nodes, rels, false)
    }

    /// Counts the current batch's uses of each node row into `nodes.uses`.
    fn count_uses(&mut self, gpu: &Gpu, nodes: &mut DeviceTable) -> Result<(), GpuError> {
        let negs = 2 * self.chunks * self.shape.negatives;
        let (len32, negs32) = (self.batch_len as u32, negs as u32);
        let cfg = grid_1d((2 * self.batch_len + negs) as u64)?;
        let mut b = gpu.stream().launch_builder(&gpu.kernels.count_uses);
        b.arg(&self.edges)
            .arg(&len32)
            .arg(&self.negs)
            .arg(&negs32)
            .arg(&mut nodes.uses);
        // SAFETY: edges holds batch_len edges and negs 2·chunks·k ids, all rows of the node
        // table (checked by check_tables and when set), which uses has one counter each.
        unsafe { b.launch(cfg) }.during("launching legend_count_uses")?;
        self.mark(gpu, "count_uses")
    }

    /// The forward and backward passes; with `direct`, the node rows the batch uses once
    /// (counted first by `count_uses`) take their AdaGrad step in the backward kernels and
    /// stay out of the gradient table and lists.
    pub(super) fn passes(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        rels: Option<&mut DeviceTable>,
        direct: bool,
    ) -> Result<(), GpuError> {
        if self.chunks == 0 {
            return Err(GpuError::Shape("no batch set".into()));
        }
        self.check_tables(nodes, rels.as_deref())?;
        self.mark(gpu, "(between steps)")?;
        // RESCAL's row gradients need every element of the other rows of the edge, which an
        // in-place step would change under the warp: its rows take the gradient table.
        let direct = direct && self.model.decoder != Decoder::Rescal;
        if direct {
            self.count_uses(gpu, nodes)?;
        }
        if !self.accumulate_loss {
            gpu.clear(&mut self.loss_sum)?;
        }
        let (penalty, penalty_weight) = penalty_code(self.regularizer);
        let pass = Pass {
            decoder: decoder_code(self.model.decoder),
            penalty,
            penalty_weight,
            direct,
            // The in-place steps round as legend_adagrad does.
            rounding: self.node_rounding(gpu, nodes),
            rels: match rels.as_deref() {
                Some(r) => RelationRows {
                    emb: gpu.ptr(&r.emb),
                    grad: gpu.ptr(&r.grad),
                    flags: gpu.ptr(&r.flags),
                    list: gpu.ptr(&r.list),
                    count: gpu.ptr(&r.count),
                },
                None => {
                    let (f, u) = (gpu.ptr(&self.no_rel), gpu.ptr(&self.no_rel_u32));
                    RelationRows {
                        emb: f,
                        grad: f,
                        flags: u,
                        list: u,
                        count: u,
                    }
                }
            },
        };
        // Every kernel of the step goes on the GPU's one stream: the in-place AdaGrad of rows
        // used once (direct) relies on every earlier reader of those rows having finished.
        let jobs = 2 * self.chunks;
        for g0 in (0..jobs).step_by(self.shape.group) {
            self.group_pass(gpu, nodes, &pass, g0)?;
        }
        Ok(())
    }

    /// The passes of the group of jobs from `g0`: queries, the three products, the rows'
    /// and the negatives' backward.
    fn group_pass(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        pass: &Pass,
        g0: usize,
    ) -> Result<(), GpuError> {
        let gz = self.shape.group.min(2 * self.chunks - g0) as u32;
        // The fused path's operand scales start from zero maxima; legend_queries fills
        // the queries' (null elsewhere: the kernel then skips it), and for TransE L2
        // the queries' squared norms.
        let (absmax, (query_norm, query_weight)) = match &mut self.path {
            Path::Fused(f) => {
                gpu.clear(&mut f.absmax)?;
                (gpu.ptr(&f.absmax), f.query_norms_and_weights(gpu))
            }
            Path::Unfused(_) => (0, (0, 0)),
        };
        let job_args = JobArgs {
            edges: gpu.ptr(&self.edges),
            row0: gpu.ptr(&self.row0) + 4 * g0 as u64,
            rows: gpu.ptr(&self.rows) + 4 * g0 as u64,
            absmax,
            query_norm,
            query_weight,
            first_job: g0 as u32,
            max_rows: self.max_rows as u32,
            dim: self.model.dim as u32,
            decoder: pass.decoder,
            inverse: self.inverse.unwrap_or(0) as u32,
            penalty: pass.penalty,
            penalty_weight: pass.penalty_weight,
            pad: 0,
        };
        // Both sides of an edge at once (gz is even: whole chunks).
        let per_edge = LaunchConfig {
            grid_dim: (blocks(self.max_rows, 8), gz / 2, 1),
            ..warps(0)
        };
        let (queries, rows_backward) = self.row_kernels(gpu, &job_args, pass);
        let mut b = gpu.stream().launch_builder(queries);
        b.arg(&job_args)
            .arg(&nodes.emb)
            .arg(&pass.rels.emb)
            .arg(&mut self.query)
            .arg(&mut self.pos);
        // SAFETY: edges hold the batch, row0/rows the jobs from g0 on; ids were checked
        // against the tables in set_batch/check_tables; query and pos hold group ×
        // max_rows rows, as does query_norm where it is given (TransE L2, fused).
        unsafe { b.launch(per_edge) }.during("launching legend_queries")?;
        self.mark(gpu, "queries")?;
        match self.path {
            Path::Fused(_) => self.fused_products(gpu, &nodes.emb, g0, gz)?,
            Path::Unfused(_) => {
                self.unfused_products(gpu, &nodes.emb, g0, gz, job_args.row0, job_args.rows)?
            }
        }
        let direct_args = DirectArgs {
            state: gpu.ptr(&nodes.state),
            uses: if pass.direct { gpu.ptr(&nodes.uses) } else { 0 },
            lr: self.optimizer.lr,
            eps: self.optimizer.eps,
            row_wise: u32::from(nodes.state_width != nodes.dim),
            pad: 0,
            rounding: pass.rounding,
        };
        let mut b = gpu.stream().launch_builder(rows_backward);
        b.arg(&job_args)
            .arg(&mut nodes.emb)
            .arg(&pass.rels.emb)
            .arg(&self.pos)
            .arg(&self.grad_query)
            .arg(&self.grad_pos)
            .arg(&mut nodes.grad)
            .arg(&mut nodes.flags)
            .arg(&mut nodes.list)
            .arg(&mut nodes.count)
            .arg(&direct_args)
            .arg(&pass.rels.grad)
            .arg(&pass.rels.flags)
            .arg(&pass.rels.list)
            .arg(&pass.rels.count);
        // SAFETY: as for legend_queries; the gradient tables and the node state have the
        // shape of the parameter tables, uses one counter a node row, and the lists one
        // slot per row (a row is listed once).
        unsafe { b.launch(per_edge) }.during("launching legend_rows_backward")?;
        self.mark(gpu, "rows_backward")?;
        self.negatives_backward(gpu, nodes, g0, gz, &direct_args)
    }

    /// The group's queries and rows-backward kernels: RotatE's and RESCAL's own (with the same
    /// arguments as the shared ones), else the shared ones in the variant the step needs.
    fn row_kernels<'g>(
        &self,
        gpu: &'g Gpu,
        job_args: &JobArgs,
        pass: &Pass,
    ) -> (&'g CudaFunction, &'g CudaFunction) {
        let kern = &gpu.kernels;
        match self.model.decoder {
            Decoder::RotatE => (&kern.rotate_queries, &kern.rotate_rows_backward),
            Decoder::Rescal => (&kern.rescal_queries, &kern.rescal_rows_backward),
            // Reciprocal relations and regularisers, and rounded in-place steps, have
            // kernels of their own, so that the plain step keeps its registers.
            _ if job_args.inverse != 0 || pass.penalty != 0 => {
                (&kern.queries, &kern.rows_backward_extra)
            }
            _ if pass.direct && pass.rounding.dtype != 0 => {
                (&kern.queries, &kern.rows_backward_rounded)
            }
            _ => (&kern.queries, &kern.rows_backward),
        }
    }

    /// The negatives' backward of the `gz` jobs from `g0`.
    fn negatives_backward(
        &mut self,
        gpu: &Gpu,
        nodes: &mut DeviceTable,
        g0: usize,
        gz: u32,
        direct_args: &DirectArgs,
    ) -> Result<(), GpuError> {
        let k = self.shape.negatives;
        let (g032, k32, d32) = (g0 as u32, k as u32, self.model.dim as u32);
        let neg_weight = match &self.path {
            Path::Fused(f) => f.negative_weights(gpu),
            Path::Unfused(_) => 0,
        };
        let mut b = gpu.stream().launch_builder(&gpu.kernels.negatives_backward);
        b.arg(&self.negs)
            .arg(&g032)
            .arg(&k32)
            .arg(&d32)
            .arg(&self.grad_negs)
            .arg(&neg_weight)
            .arg(&mut nodes.emb)
            .arg(&mut nodes.grad)
            .arg(&mut nodes.flags)
            .arg(&mut nodes.list)
            .arg(&mut nodes.count)
            .arg(direct_args);
        let cfg = LaunchConfig {
            grid_dim: (blocks(k, 8), gz, 1),
            ..warps(0)
        };
        // SAFETY: negs ids are below the node rows; grad_negs holds group·k·d floats, and
        // neg_weight (where given) group·k; the node state and uses as for
        // legend_rows_backward.
        unsafe { b.launch(cfg) }.during("launching legend_negatives_backward")?;
        self.mark(gpu, "negatives_backward")
    }
}

/// Blocks of eight warps for `n` items, a warp each.
fn warps(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(n, 8), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What every launch of one step's passes shares: the kernels' numbers of the decoder and
/// regulariser, whether rows used once step in place, their rounding, the relation table.
struct Pass {
    decoder: i32,
    penalty: i32,
    penalty_weight: f32,
    direct: bool,
    rounding: RoundingArgs,
    rels: RelationRows,
}

/// Device addresses of the relation table's parts (stand-ins for Dot, which has none).
struct RelationRows {
    emb: u64,
    grad: u64,
    flags: u64,
    list: u64,
    count: u64,
}
