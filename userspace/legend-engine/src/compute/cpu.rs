//! The CPU engine's step: chunks split into blocks of rows trained in parallel on a snapshot of
//! the parameters, gradients summed in block order, one AdaGrad step per touched row.

use legend_dataset::Edge;
use legend_model::{AdaGrad, Chunk, ChunkModel, ChunkWorkspace};
use rayon::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};

use super::{BucketRef, ComputeBackend, Step};
use crate::buffer::{PartitionBuffer, SwapHook};
use legend_model::rng::key;

use crate::sampler::NegativeSampler;
use crate::trainer::{Relations, TrainError};

/// Most rows of a chunk handled by one parallel task. Every task packs the chunk's negatives
/// for its matrix products, a cost proportional to the negatives, so tasks should be large.
pub const BLOCK_ROWS: usize = 256;

/// Fewest edges a parallel task of the batch gather handles.
const GATHER_MIN: usize = 4096;

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
    pub(crate) dim: usize,
    pub(crate) num_chunks: usize,
    pub(crate) negatives: usize,
    pub(crate) seed: u64,
    pub(crate) sampler: NegativeSampler,
    pub(crate) known: Option<FxHashSet<Edge>>,
    pub(crate) pool: rayon::ThreadPool,
    /// Loss summed since the last `take_loss`.
    pub(crate) loss: f64,
}

/// One block of a chunk: its rows and the chunk's negatives.
struct Block<'a> {
    edges: &'a [Edge],
    neg_src: &'a [u32],
    neg_dst: &'a [u32],
}

/// Gradients of one block, with the ids they belong to.
struct BlockGrads {
    loss: f64,
    src: Vec<f32>,
    rel: Vec<f32>,
    dst: Vec<f32>,
    neg_src: Vec<f32>,
    neg_dst: Vec<f32>,
}

impl ComputeBackend for CpuCompute {
    fn loaded(&mut self, _host: &mut PartitionBuffer, _p: u32) -> Result<(), TrainError> {
        Ok(())
    }

    fn evicting(&mut self, _host: &mut PartitionBuffer, _p: u32) -> Result<(), TrainError> {
        Ok(())
    }

    fn begin_swap(
        &mut self,
        _host: &mut PartitionBuffer,
        _evicted: u32,
        _loaded: u32,
    ) -> Result<Option<Box<dyn SwapHook>>, TrainError> {
        Ok(None)
    }

    fn finish_swap(&mut self, _host: &PartitionBuffer, _loaded: u32) -> Result<(), TrainError> {
        Ok(())
    }

    fn begin_bucket(&mut self, _bucket: &BucketRef<'_>) -> Result<(), TrainError> {
        Ok(())
    }

    fn train_batch(
        &mut self,
        step: &Step<'_>,
        host: &mut PartitionBuffer,
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
                let stream = key(
                    self.seed,
                    &[
                        2,
                        u64::from(step.epoch),
                        step.batch_no,
                        c as u64,
                        side as u64,
                    ],
                );
                self.sampler.sample(step.resident, stream, out);
            }
        }
        let mut blocks = Vec::new();
        for c in 0..chunks {
            let rows = &batch[c * batch.len() / chunks..(c + 1) * batch.len() / chunks];
            let pair = &negs[c * 2 * k..(c + 1) * 2 * k];
            for edges in rows.chunks(block_len(rows.len())) {
                blocks.push(Block {
                    edges,
                    neg_src: &pair[..k],
                    neg_dst: &pair[k..],
                });
            }
        }
        let buffer = &*host;
        let relations = &*rels;
        let model = &self.model;
        let known = self.known.as_ref();
        let results: Vec<BlockGrads> = self.pool.install(|| {
            blocks
                .par_iter()
                .map_init(ChunkWorkspace::new, |ws, block| {
                    run_block(ws, model, buffer, relations, known, block, dim)
                })
                .collect()
        });
        // Sum gradients per row in block order (deterministic), then take one AdaGrad step per
        // touched row.
        let mut index: FxHashMap<u32, usize> = FxHashMap::default();
        let mut grads: Vec<f32> = Vec::new();
        let mut rel_index: FxHashMap<u32, usize> = FxHashMap::default();
        let mut rel_grads: Vec<f32> = Vec::new();
        let add = |index: &mut FxHashMap<u32, usize>, grads: &mut Vec<f32>, id: u32, g: &[f32]| {
            let next = index.len();
            let slot = *index.entry(id).or_insert(next);
            if slot == next {
                grads.extend_from_slice(g);
            } else {
                for (a, b) in grads[slot * dim..(slot + 1) * dim].iter_mut().zip(g) {
                    *a += b;
                }
            }
        };
        let mut loss = 0.0;
        for (block, r) in blocks.iter().zip(&results) {
            loss += r.loss;
            for (i, e) in block.edges.iter().enumerate() {
                let row = i * dim..(i + 1) * dim;
                add(&mut index, &mut grads, e[0], &r.src[row.clone()]);
                add(&mut index, &mut grads, e[2], &r.dst[row.clone()]);
                if !r.rel.is_empty() {
                    add(&mut rel_index, &mut rel_grads, e[1], &r.rel[row]);
                }
            }
            for (j, &id) in block.neg_src.iter().enumerate() {
                add(
                    &mut index,
                    &mut grads,
                    id,
                    &r.neg_src[j * dim..(j + 1) * dim],
                );
            }
            for (j, &id) in block.neg_dst.iter().enumerate() {
                add(
                    &mut index,
                    &mut grads,
                    id,
                    &r.neg_dst[j * dim..(j + 1) * dim],
                );
            }
        }
        for (&id, &slot) in &index {
            let (emb, state) = host.rows_mut(id).expect("sampled rows are resident");
            self.optimizer
                .apply_row(emb, state, &grads[slot * dim..(slot + 1) * dim]);
        }
        for (&r, &slot) in &rel_index {
            let row = r as usize * dim..(r as usize + 1) * dim;
            self.optimizer.apply_row(
                &mut rels.emb[row.clone()],
                &mut rels.state[row],
                &rel_grads[slot * dim..(slot + 1) * dim],
            );
        }
        self.loss += loss;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), TrainError> {
        Ok(())
    }

    fn take_loss(&mut self) -> Result<f64, TrainError> {
        Ok(std::mem::take(&mut self.loss))
    }

    fn sync_host(
        &mut self,
        _host: &mut PartitionBuffer,
        _rels: &mut Relations,
    ) -> Result<(), TrainError> {
        Ok(())
    }
}

fn gather(
    buffer: &PartitionBuffer,
    ids: impl Iterator<Item = u32>,
    dim: usize,
    out: &mut Vec<f32>,
) {
    out.clear();
    for id in ids {
        let (emb, _) = buffer
            .row(id)
            .expect("rows of a running bucket are resident");
        debug_assert_eq!(emb.len(), dim);
        out.extend_from_slice(emb);
    }
}

fn run_block(
    ws: &mut ChunkWorkspace,
    model: &ChunkModel,
    buffer: &PartitionBuffer,
    relations: &Relations,
    known: Option<&FxHashSet<Edge>>,
    block: &Block<'_>,
    dim: usize,
) -> BlockGrads {
    let (mut src, mut dst, mut ns, mut nd) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    gather(buffer, block.edges.iter().map(|e| e[0]), dim, &mut src);
    gather(buffer, block.edges.iter().map(|e| e[2]), dim, &mut dst);
    gather(buffer, block.neg_src.iter().copied(), dim, &mut ns);
    gather(buffer, block.neg_dst.iter().copied(), dim, &mut nd);
    let mut rel = Vec::new();
    if !relations.emb.is_empty() {
        for e in block.edges {
            let r = e[1] as usize;
            rel.extend_from_slice(&relations.emb[r * dim..(r + 1) * dim]);
        }
    }
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
        neg_src: &ns,
        neg_dst: &nd,
        exclude_src: masks.as_ref().map(|m| m.0.as_slice()),
        exclude_dst: masks.as_ref().map(|m| m.1.as_slice()),
    };
    let loss = ws.forward_backward(model, &chunk);
    let g = ws.grads();
    BlockGrads {
        loss,
        src: g.src.clone(),
        rel: g.rel.clone(),
        dst: g.dst.clone(),
        neg_src: g.neg_src.clone(),
        neg_dst: g.neg_dst.clone(),
    }
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
