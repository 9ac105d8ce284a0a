//! The CPU engine's step: chunks split into blocks of rows trained in parallel on a snapshot of
//! the parameters, gradients summed in block order, one AdaGrad step per touched row (with the
//! regulariser's gradient, when there is one, added to the row's sum inside that step).

use legend_dataset::Edge;
use std::cell::RefCell;

use legend_model::{
    AdaGrad, Chunk, ChunkGrads, ChunkModel, ChunkWorkspace, Dtype, Regularizer, StepRounding,
};
use rayon::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Mutex;

use super::{BucketRef, ComputeBackend, PendingRelations, Step};

use crate::error::TrainError;
use crate::incremental::Frozen;
use crate::relations::{RelationGradients, Relations};
use crate::rows::RowMut;
use crate::sampler::NegativeSampler;
use crate::swap::{Fence, HostRows};

/// Most rows of a chunk handled by one parallel task. Every task packs the chunk's negatives
/// for its matrix products, a cost proportional to the negatives, so tasks should be large.
pub const BLOCK_ROWS: usize = 256;

/// Fewest edges a parallel task of the batch gather handles.
const GATHER_MIN: usize = 4096;

/// Fewest rows a parallel task of the optimizer step updates.
const APPLY_MIN: usize = 64;

/// Small chunks are still split into up to this many tasks (of at least [`MIN_BLOCK_ROWS`]
/// rows), so that small batches use several cores.
const MIN_BLOCKS: usize = 4;
/// See [`MIN_BLOCKS`].
const MIN_BLOCK_ROWS: usize = 16;

/// Rows per task for a chunk of `rows` rows. It depends on the chunk alone, never on the thread
/// count, so that results do not either.
fn block_len(rows: usize) -> usize {
    let blocks = rows
        .div_ceil(BLOCK_ROWS)
        .max(rows.div_ceil(MIN_BLOCK_ROWS).min(MIN_BLOCKS))
        .max(1);
    rows.div_ceil(blocks).max(1)
}

/// The CPU engine: rows are read and updated in the host partition buffer.
pub(crate) struct CpuCompute {
    pub(crate) model: ChunkModel,
    pub(crate) optimizer: AdaGrad,
    pub(crate) regularizer: Regularizer,
    /// `storage.dtype`: updated node rows are rounded to it.
    pub(crate) dtype: Dtype,
    /// Reciprocal relations: the relation table's second half holds the inverses.
    pub(crate) reciprocal: bool,
    pub(crate) dim: usize,
    pub(crate) num_chunks: usize,
    pub(crate) negatives: usize,
    pub(crate) sampler: NegativeSampler,
    pub(crate) known: Option<FxHashSet<Edge>>,
    pub(crate) pool: rayon::ThreadPool,
    /// Loss summed since the last `take_loss`.
    pub(crate) loss: f64,
    /// Each chunk side's gathered negative rows (source then destination), reused.
    pub(crate) neg_rows: Vec<Vec<f32>>,
    /// Each block's gradients, reused.
    pub(crate) block_grads: Vec<ChunkGrads>,
    /// Several workers: each step's relation gradients, held back for their sum.
    pub(crate) pending_relations: Option<RelationGradients>,
    /// The rows that are never stepped (`training.freeze = "existing"`).
    pub(crate) frozen: Option<Frozen>,
}

/// One block of a chunk: its rows and the chunk's negatives (ids and gathered rows).
struct Block<'a> {
    edges: &'a [Edge],
    neg_src: &'a [u32],
    neg_dst: &'a [u32],
    neg_src_rows: &'a [f32],
    neg_dst_rows: &'a [f32],
}

thread_local! {
    /// Each worker thread's chunk buffers, kept between batches so the step does not allocate.
    static WORKSPACE: RefCell<ChunkWorkspace> = RefCell::new(ChunkWorkspace::new());
}

/// Row `i` of a row-major matrix of `dim` columns.
fn row(rows: &[f32], i: usize, dim: usize) -> &[f32] {
    &rows[i * dim..(i + 1) * dim]
}

/// `(ids[j], row j of rows, false)` for every `j`: negatives' gradient rows.
fn rows_of<'a>(
    ids: &'a [u32],
    rows: &'a [f32],
    dim: usize,
) -> impl Iterator<Item = (u32, &'a [f32], bool)> + 'a {
    ids.iter()
        .enumerate()
        .map(move |(j, &id)| (id, row(rows, j, dim), false))
}

/// The gradient rows of a batch grouped by the parameter row they belong to, in the order they
/// were produced (block order), so that summing a group gives the same floats on any number of
/// threads.
struct RowSums<'a> {
    /// The distinct parameter rows, in order of first appearance.
    ids: Vec<u32>,
    /// Group `s` (for `ids[s]`) is `parts[starts[s]..starts[s + 1]]`.
    starts: Vec<usize>,
    parts: Vec<&'a [f32]>,
    /// How often each row occurs among the batch's positives (what the regulariser weighs).
    positives: Vec<u32>,
}

impl<'a> RowSums<'a> {
    /// Groups `(row id, gradient row, whether it comes from a positive)`.
    fn group(rows: impl Iterator<Item = (u32, &'a [f32], bool)>) -> Self {
        let mut slot_of: FxHashMap<u32, usize> = FxHashMap::default();
        let mut ids = Vec::new();
        let mut positives = Vec::new();
        let mut tagged = Vec::new();
        for (id, grad, positive) in rows {
            let slot = *slot_of.entry(id).or_insert_with(|| {
                ids.push(id);
                positives.push(0);
                ids.len() - 1
            });
            positives[slot] += u32::from(positive);
            tagged.push((slot, grad));
        }
        // A counting sort by slot keeps each group's rows in their original order.
        let mut starts = vec![0usize; ids.len() + 1];
        for &(slot, _) in &tagged {
            starts[slot + 1] += 1;
        }
        for s in 1..starts.len() {
            starts[s] += starts[s - 1];
        }
        let mut next = starts.clone();
        let mut parts: Vec<&[f32]> = vec![&[]; tagged.len()];
        for (slot, grad) in tagged {
            parts[next[slot]] = grad;
            next[slot] += 1;
        }
        Self {
            ids,
            starts,
            parts,
            positives,
        }
    }

    /// The groups whose row `frozen` does not hold: those rows are not stepped at all (no
    /// gradient, no regulariser, no AdaGrad state change).
    fn without(self, frozen: impl Fn(u32) -> bool) -> Self {
        let mut kept = RowSums {
            ids: Vec::with_capacity(self.ids.len()),
            starts: vec![0],
            parts: Vec::with_capacity(self.parts.len()),
            positives: Vec::with_capacity(self.ids.len()),
        };
        for (s, &id) in self.ids.iter().enumerate() {
            if frozen(id) {
                continue;
            }
            kept.ids.push(id);
            kept.positives.push(self.positives[s]);
            kept.parts
                .extend_from_slice(&self.parts[self.starts[s]..self.starts[s + 1]]);
            kept.starts.push(kept.parts.len());
        }
        kept
    }

    /// Adds each row's gradients, in their order, and its count of positives to `pending`.
    fn add_into(&self, pending: &mut RelationGradients) {
        let w = pending.width;
        for (s, &id) in self.ids.iter().enumerate() {
            let row = &mut pending.grads[id as usize * w..(id as usize + 1) * w];
            for grad in &self.parts[self.starts[s]..self.starts[s + 1]] {
                for (a, b) in row.iter_mut().zip(*grad) {
                    *a += b;
                }
            }
            pending.positives[id as usize] += self.positives[s];
        }
    }

    /// One AdaGrad step on each row of `params` (`params[s]` belongs to `ids[s]`) with its
    /// summed gradient plus `regularizer`'s, then `rounding` of the updated row (node rows
    /// stored in 16 bits); rows in parallel on the current pool. A row that leaves the
    /// format's range is an error naming it.
    fn apply(
        &self,
        params: Vec<RowMut<'_>>,
        optimizer: AdaGrad,
        regularizer: &Regularizer,
        rounding: Option<StepRounding>,
        dim: usize,
    ) -> Result<(), TrainError> {
        let regularized = regularizer.is_active();
        let out_of_range = Mutex::new(None);
        params
            .into_par_iter()
            .enumerate()
            .with_min_len(APPLY_MIN)
            .for_each_init(
                || vec![0.0f32; dim],
                |sum, (s, (emb, state))| {
                    let (first, rest) = self.parts[self.starts[s]..self.starts[s + 1]]
                        .split_first()
                        .expect("every group has a row");
                    if rest.is_empty() && !regularized {
                        // One gradient row (most positives): nothing to sum.
                        optimizer.apply_row(emb, state, first);
                    } else {
                        sum.copy_from_slice(first);
                        for grad in rest {
                            for (a, b) in sum.iter_mut().zip(*grad) {
                                *a += b;
                            }
                        }
                        regularizer.add_gradient(emb, self.positives[s], sum);
                        optimizer.apply_row(emb, state, sum);
                    }
                    if let Some(rounding) = rounding
                        && let Err(e) = rounding.round(u64::from(self.ids[s]), emb)
                    {
                        let mut first = out_of_range.lock().unwrap_or_else(|p| p.into_inner());
                        // The smallest row id, so the message is the same on any thread count.
                        if first.is_none_or(|(id, _)| id > self.ids[s]) {
                            *first = Some((self.ids[s], e));
                        }
                    }
                },
            );
        match out_of_range.into_inner().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(()),
            Some((row, e)) => Err(TrainError::OutOfRange {
                row: u64::from(row),
                element: e.element,
                dtype: rounding.map_or(Dtype::F32, |r| r.dtype),
            }),
        }
    }
}

impl ComputeBackend for CpuCompute {
    fn arrive(&mut self, _p: u32, _slot: u32, _ready: &Fence) -> Result<(), TrainError> {
        Ok(())
    }

    fn release(&mut self, _p: u32) -> Result<Fence, TrainError> {
        Ok(Fence::passed())
    }

    fn settled(&mut self) -> Result<Fence, TrainError> {
        Ok(Fence::passed())
    }

    fn begin_bucket(&mut self, _bucket: &BucketRef<'_>) -> Result<(), TrainError> {
        Ok(())
    }

    fn train_batch(
        &mut self,
        step: &Step<'_>,
        host: &mut HostRows,
        rels: &mut Relations,
    ) -> Result<(), TrainError> {
        let dim = self.dim;
        // The batch in the bucket's order, gathered in parallel (each position is independent).
        let batch: Vec<Edge> = self.pool.install(|| {
            (0..step.len)
                .into_par_iter()
                .with_min_len(GATHER_MIN)
                .map(|j| step.edge(j))
                .collect()
        });
        let batch = batch.as_slice();
        let chunks = self.num_chunks.min(batch.len());
        let k = self.negatives;
        // Negatives of every chunk and side.
        let mut negs = vec![0u32; chunks * 2 * k];
        for (c, pair) in negs.chunks_exact_mut(2 * k).enumerate() {
            for (side, out) in pair.chunks_exact_mut(k).enumerate() {
                let stream = step.key.negatives(c as u64, side as u64);
                self.sampler.sample(step.resident, stream, out);
            }
        }
        // Each chunk's negative rows, gathered once and shared by its blocks.
        let width = self.optimizer.state.width(dim);
        let buffer = Resident {
            rows: &*host,
            dim,
            width,
        };
        let buffer = &buffer;
        self.neg_rows.resize_with(chunks * 2, Vec::new);
        self.pool.install(|| {
            self.neg_rows
                .par_iter_mut()
                .zip(negs.par_chunks_exact(k))
                .for_each(|(rows, ids)| gather(buffer, ids.iter().copied(), dim, rows));
        });
        let mut blocks = Vec::new();
        for c in 0..chunks {
            let rows = &batch[c * batch.len() / chunks..(c + 1) * batch.len() / chunks];
            let pair = &negs[c * 2 * k..(c + 1) * 2 * k];
            for edges in rows.chunks(block_len(rows.len())) {
                blocks.push(Block {
                    edges,
                    neg_src: &pair[..k],
                    neg_dst: &pair[k..],
                    neg_src_rows: &self.neg_rows[2 * c],
                    neg_dst_rows: &self.neg_rows[2 * c + 1],
                });
            }
        }
        self.block_grads
            .resize_with(blocks.len(), ChunkGrads::default);
        let relations = &*rels;
        let model = &self.model;
        let known = self.known.as_ref();
        // Reciprocal relations: r⁻¹ is row `inverse + r`.
        // Relation rows are `rw` floats (RESCAL: dim², a matrix).
        let rw = self.model.relation_width();
        let inverse = self.reciprocal.then(|| rels.emb.len() / rw / 2);
        let losses: Vec<f64> = self.pool.install(|| {
            blocks
                .par_iter()
                .zip(self.block_grads.par_iter_mut())
                .map(|(block, grads)| {
                    WORKSPACE.with_borrow_mut(|ws| {
                        let loss =
                            run_block(ws, model, buffer, relations, inverse, known, block, dim);
                        ws.swap_grads(grads);
                        loss
                    })
                })
                .collect()
        });
        let grads = &self.block_grads[..blocks.len()];
        // Sum the gradients of each row in block order (deterministic, whatever the thread
        // count), then take one AdaGrad step per touched row, rows in parallel.
        let nodes = RowSums::group(blocks.iter().zip(grads).flat_map(|(block, g)| {
            let positives = block.edges.iter().enumerate().flat_map(move |(i, e)| {
                [
                    (e[0], row(&g.src, i, dim), true),
                    (e[2], row(&g.dst, i, dim), true),
                ]
            });
            positives
                .chain(rows_of(block.neg_src, &g.neg_src, dim))
                .chain(rows_of(block.neg_dst, &g.neg_dst, dim))
        }));
        let relation_rows = RowSums::group(
            blocks
                .iter()
                .zip(grads)
                .filter(|(_, g)| !g.rel.is_empty())
                .flat_map(|(block, g)| {
                    let forward = block
                        .edges
                        .iter()
                        .enumerate()
                        .map(move |(i, e)| (e[1], row(&g.rel, i, rw), true));
                    let inverse =
                        inverse.into_iter().flat_map(move |offset| {
                            block.edges.iter().enumerate().map(move |(i, e)| {
                                (e[1] + offset as u32, row(&g.rel_src, i, rw), true)
                            })
                        });
                    forward.chain(inverse)
                }),
        );
        let (nodes, relation_rows) = match self.frozen {
            Some(f) => (
                nodes.without(|id| f.entity(id)),
                relation_rows.without(|row| f.relation_row(row)),
            ),
            None => (nodes, relation_rows),
        };
        let (optimizer, regularizer) = (self.optimizer, self.regularizer);
        let rounding = self.dtype.is_narrow().then_some(StepRounding {
            dtype: self.dtype,
            batch: step.key,
        });
        let node_rows = host.disjoint_rows_mut(&nodes.ids, dim, width);
        if let Some(pending) = &mut self.pending_relations {
            // Several workers: the relation rows step once every worker's sums are in.
            relation_rows.add_into(pending);
            self.pool
                .install(|| nodes.apply(node_rows, optimizer, &regularizer, rounding, dim))?;
        } else {
            let mut rel_rows: Vec<Option<RowMut<'_>>> = rels
                .emb
                .chunks_exact_mut(rw.max(1))
                .zip(rels.state.chunks_exact_mut(rw.max(1)))
                .map(Some)
                .collect();
            let rel_rows: Vec<RowMut<'_>> = relation_rows
                .ids
                .iter()
                .map(|&r| {
                    rel_rows[r as usize]
                        .take()
                        .expect("relation ids are distinct")
                })
                .collect();
            self.pool.install(|| {
                nodes.apply(node_rows, optimizer, &regularizer, rounding, dim)?;
                relation_rows.apply(rel_rows, optimizer.for_relations(), &regularizer, None, rw)
            })?;
        }
        self.loss += losses.iter().sum::<f64>();
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), TrainError> {
        Ok(())
    }

    fn defer_relations(&mut self, rels: &Relations) -> Result<(), TrainError> {
        let width = self.model.relation_width();
        let rows = rels.emb.len().checked_div(width).unwrap_or(0);
        self.pending_relations = Some(RelationGradients::zeros(rows, width));
        Ok(())
    }

    fn pending_relations(&mut self) -> Result<PendingRelations<'_>, TrainError> {
        let pending = self
            .pending_relations
            .as_mut()
            .expect("relations are deferred before their gradients are asked for");
        Ok(PendingRelations::Host(pending))
    }

    fn apply_relations(&mut self, rels: &mut Relations, _ready: &Fence) -> Result<(), TrainError> {
        if let Some(pending) = &mut self.pending_relations {
            pending.apply(rels, self.optimizer.for_relations(), &self.regularizer);
        }
        Ok(())
    }

    fn take_loss(&mut self) -> Result<f64, TrainError> {
        Ok(std::mem::take(&mut self.loss))
    }

    fn set_learning_rate(&mut self, lr: f32) {
        self.optimizer.lr = lr;
    }
}

/// The resident rows a step reads, with their shape.
struct Resident<'a> {
    rows: &'a HostRows,
    dim: usize,
    width: usize,
}

fn gather(buffer: &Resident<'_>, ids: impl Iterator<Item = u32>, dim: usize, out: &mut Vec<f32>) {
    out.clear();
    for id in ids {
        let (emb, _) = buffer
            .rows
            .row(id, buffer.dim, buffer.width)
            .expect("rows of a running bucket are resident");
        debug_assert_eq!(emb.len(), dim);
        out.extend_from_slice(emb);
    }
}

/// Trains one block; `inverse` is the offset of the inverse relations' rows when relations are
/// reciprocal.
#[allow(clippy::too_many_arguments)]
fn run_block(
    ws: &mut ChunkWorkspace,
    model: &ChunkModel,
    buffer: &Resident<'_>,
    relations: &Relations,
    inverse: Option<usize>,
    known: Option<&FxHashSet<Edge>>,
    block: &Block<'_>,
    dim: usize,
) -> f64 {
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    gather(buffer, block.edges.iter().map(|e| e[0]), dim, &mut src);
    gather(buffer, block.edges.iter().map(|e| e[2]), dim, &mut dst);
    let rw = model.relation_width();
    let relation_rows = |offset: usize| -> Vec<f32> {
        block
            .edges
            .iter()
            .flat_map(|e| row(&relations.emb, offset + e[1] as usize, rw))
            .copied()
            .collect()
    };
    let rel = if relations.emb.is_empty() {
        Vec::new()
    } else {
        relation_rows(0)
    };
    let rel_src = inverse.map(relation_rows);
    let masks = known.map(|known| {
        let src_mask: Vec<bool> = block
            .edges
            .iter()
            .flat_map(|e| {
                block
                    .neg_src
                    .iter()
                    .map(move |&n| known.contains(&[n, e[1], e[2]]))
            })
            .collect();
        let dst_mask: Vec<bool> = block
            .edges
            .iter()
            .flat_map(|e| {
                block
                    .neg_dst
                    .iter()
                    .map(move |&n| known.contains(&[e[0], e[1], n]))
            })
            .collect();
        (src_mask, dst_mask)
    });
    let chunk = Chunk {
        src: &src,
        rel: &rel,
        dst: &dst,
        neg_src: block.neg_src_rows,
        neg_dst: block.neg_dst_rows,
        exclude_src: masks.as_ref().map(|m| m.0.as_slice()),
        exclude_dst: masks.as_ref().map(|m| m.1.as_slice()),
        rel_src: rel_src.as_deref(),
    };
    ws.forward_backward(model, &chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_chunks_still_split_and_large_ones_keep_big_blocks() {
        assert_eq!(block_len(5), 5, "too small to split");
        assert_eq!(block_len(100), 25, "four tasks for a batch of 100");
        assert_eq!(block_len(1000), 250);
        assert_eq!(
            block_len(10_000),
            250,
            "never more than BLOCK_ROWS rows a task"
        );
        assert_eq!(block_len(0), 1);
    }
}
