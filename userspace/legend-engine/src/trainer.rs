//! The CPU engine: walks the planner's bucket order over the partition buffer and trains with
//! synchronous sparse AdaGrad.
//!
//! A batch of positives from one bucket is split into chunks that share negatives; each chunk is
//! split further into fixed blocks of rows ([`BLOCK_ROWS`]), the unit of parallel work. Blocks
//! read a snapshot of the parameters; their gradients are summed in block order and applied
//! before the next batch, so updates are synchronous and the result depends only on the seed,
//! never on the thread count.

use std::time::Instant;

use legend_dataset::{Buckets, Edge};
use legend_model::{AdaGrad, Chunk, ChunkModel, ChunkWorkspace, Decoder, Init, Table};
use legend_planner::{Bucket, Plan};
use rayon::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

use crate::buffer::{IoStats, PartitionBuffer, StoreError};
use crate::config::Config;
use crate::sampler::{NegativeSampler, below, draw, key};

/// Rows of a chunk handled by one parallel task.
pub const BLOCK_ROWS: usize = 256;

/// Relation parameters and their AdaGrad state, always resident.
#[derive(Clone, Debug, PartialEq)]
pub struct Relations {
    /// `relations × dim` embeddings (empty for Dot).
    pub emb: Vec<f32>,
    /// AdaGrad state of the same shape.
    pub state: Vec<f32>,
}

impl Relations {
    /// Initial relation parameters.
    pub fn init(decoder: Decoder, count: usize, dim: usize, init: &Init) -> Relations {
        if !decoder.uses_relations() {
            return Relations {
                emb: Vec::new(),
                state: Vec::new(),
            };
        }
        let mut emb = vec![0.0; count * dim];
        for (r, row) in emb.chunks_exact_mut(dim).enumerate() {
            init.relation_row(decoder, Table::Relation, r as u64, row);
        }
        Relations {
            state: vec![0.0; emb.len()],
            emb,
        }
    }
}

/// Timing of one swap of an epoch (for the compute-vs-I/O timeline).
#[derive(Clone, Debug, Default, Serialize)]
pub struct SwapReport {
    /// Partition written back.
    pub evicted: u32,
    /// Partition read.
    pub loaded: u32,
    /// Seconds from the epoch start to the start of the swap.
    pub start_s: f64,
    /// Seconds of I/O the swap took on the I/O thread.
    pub io_s: f64,
    /// Seconds of compute overlapped with the swap.
    pub overlap_compute_s: f64,
    /// Seconds compute waited for the swap.
    pub wait_s: f64,
    /// Seconds of compute after the swap (needing the loaded partition).
    pub after_compute_s: f64,
    /// Bytes read plus written by the swap.
    pub bytes: u64,
}

/// What one epoch did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EpochReport {
    /// Epoch number, from 1.
    pub epoch: u32,
    /// Mean loss per positive edge.
    pub loss: f64,
    /// Positive edges trained on.
    pub edges: u64,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Positive edges per second.
    pub edges_per_sec: f64,
    /// Negatives per positive and side.
    pub negatives_per_positive: usize,
    /// Partitions read (initialised ones excluded).
    pub partitions_read: u64,
    /// Partitions written.
    pub partitions_written: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Seconds of I/O on the I/O thread.
    pub io_s: f64,
    /// Seconds compute waited for I/O.
    pub io_wait_s: f64,
    /// Buffer states this epoch went through (the fill counted once).
    pub buffer_states: u64,
    /// Per-swap timings.
    pub swaps: Vec<SwapReport>,
}

/// Training state: parameters, buffer, plan and data.
pub struct Trainer {
    model: ChunkModel,
    optimizer: AdaGrad,
    dim: usize,
    batch_size: usize,
    num_chunks: usize,
    negatives: usize,
    prefetch: bool,
    seed: u64,
    buckets: Buckets,
    plan: Plan,
    sampler: NegativeSampler,
    known: Option<FxHashSet<Edge>>,
    buffer: PartitionBuffer,
    relations: Relations,
    pool: rayon::ThreadPool,
}

/// A training error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The plan could not be made.
    #[error("planning: {0}")]
    Plan(#[from] legend_planner::PlanError),
    /// The loss became NaN or infinite.
    #[error("the loss diverged (not finite) in epoch {epoch}; lower training.learning_rate")]
    Diverged {
        /// The epoch.
        epoch: u32,
    },
    /// The thread pool could not start.
    #[error("starting {threads} worker threads: {message}")]
    Threads {
        /// Requested threads.
        threads: usize,
        /// The error.
        message: String,
    },
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

impl Trainer {
    /// A trainer over `buckets` with `buffer` (nothing resident yet) and starting `relations`.
    pub fn new(
        config: &Config,
        buckets: Buckets,
        degrees: &[u32],
        buffer: PartitionBuffer,
        relations: Relations,
    ) -> Result<Trainer, TrainError> {
        let scheme = buckets.scheme();
        let plan = legend_planner::plan(scheme.num_partitions, config.capacity(), config.order())?;
        let t = &config.training;
        let threads = match t.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("legend-cpu-{i}"))
            .build()
            .map_err(|e| TrainError::Threads {
                threads,
                message: e.to_string(),
            })?;
        let known = t
            .negatives
            .filtered
            .then(|| buckets.edges().iter().copied().collect());
        Ok(Trainer {
            model: ChunkModel {
                decoder: config.decoder(),
                loss: config.loss(),
                dim: config.model.dim,
            },
            optimizer: AdaGrad {
                lr: t.learning_rate,
                eps: t.adagrad_eps,
            },
            dim: config.model.dim,
            batch_size: t.batch_size,
            num_chunks: t.negatives.num_chunks,
            negatives: t.negatives.negatives_per_positive,
            prefetch: config.storage.prefetch,
            seed: t.seed,
            sampler: NegativeSampler::new(scheme, degrees, t.negatives.degree_fraction),
            buckets,
            plan,
            known,
            buffer,
            relations,
            pool,
        })
    }

    /// The plan of epoch 1 (later epochs relabel partitions, see [`Trainer::epoch_relabeling`]).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The partition buffer.
    pub fn buffer(&mut self) -> &mut PartitionBuffer {
        &mut self.buffer
    }

    /// The relation parameters.
    pub fn relations(&self) -> &Relations {
        &self.relations
    }

    /// The partition relabeling used in epoch `epoch` (from 1): epoch e+1 starts in the buffer
    /// state epoch e ended in, so no I/O is spent between epochs, and it is a function of the
    /// epoch number alone, so a resumed run follows the same schedule.
    pub fn epoch_relabeling(&self, epoch: u32) -> Vec<u32> {
        let n = self.plan.num_partitions as usize;
        let first = &self.plan.states[0];
        let last = self.plan.states.last().expect("a plan has a state");
        let mut pi: Vec<u32> = (0..n as u32).collect();
        for _ in 1..epoch {
            // The next epoch's first state is this epoch's last state, relabeled by pi.
            let target: Vec<u32> = last.iter().map(|&p| pi[p as usize]).collect();
            let mut next = vec![u32::MAX; n];
            for (&f, &t) in first.iter().zip(&target) {
                next[f as usize] = t;
            }
            let mut free = (0..n as u32).filter(|p| !target.contains(p));
            for slot in next.iter_mut().filter(|s| **s == u32::MAX) {
                *slot = free.next().expect("a permutation");
            }
            pi = next;
        }
        pi
    }

    /// Trains one epoch (numbered from 1). `progress` is called with the positives done so far.
    pub fn run_epoch(
        &mut self,
        epoch: u32,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochReport, TrainError> {
        let started = Instant::now();
        let io_before = self.buffer.stats();
        let pi = self.epoch_relabeling(epoch);
        let relabel = |b: &Bucket| [pi[b[0] as usize], pi[b[1] as usize]];
        let first: Vec<u32> = self.plan.states[0]
            .iter()
            .map(|&p| pi[p as usize])
            .collect();
        let mut report = EpochReport {
            epoch,
            negatives_per_positive: self.negatives,
            buffer_states: 1,
            ..EpochReport::default()
        };
        let mut loss = 0.0f64;
        let mut batch_counter = 0u64;
        self.buffer.fill(&first)?;
        let mut resident = first.clone();
        let plan = self.plan.clone();
        let initial: Vec<Bucket> = plan.initial.iter().map(relabel).collect();
        let mut ctx = EpochCtx {
            epoch,
            loss: &mut loss,
            edges: &mut report.edges,
            batch: &mut batch_counter,
            progress,
        };
        self.run_buckets(&initial, &resident, &mut ctx)?;
        for swap in &plan.swaps {
            let (evicted, loaded) = (pi[swap.evicted as usize], pi[swap.loaded as usize]);
            let overlap: Vec<Bucket> = swap.overlap.iter().map(relabel).collect();
            let after: Vec<Bucket> = swap.after.iter().map(relabel).collect();
            let stats_before = self.buffer.stats();
            let mut sr = SwapReport {
                evicted,
                loaded,
                start_s: started.elapsed().as_secs_f64(),
                ..SwapReport::default()
            };
            resident.retain(|&p| p != evicted);
            self.buffer.begin_swap(evicted, loaded)?;
            let t = Instant::now();
            if self.prefetch {
                self.run_buckets(&overlap, &resident, &mut ctx)?;
            }
            sr.overlap_compute_s = t.elapsed().as_secs_f64();
            self.buffer.finish_swap()?;
            resident.push(loaded);
            let t = Instant::now();
            if !self.prefetch {
                self.run_buckets(&overlap, &resident, &mut ctx)?;
            }
            self.run_buckets(&after, &resident, &mut ctx)?;
            sr.after_compute_s = t.elapsed().as_secs_f64();
            let s = self.buffer.stats();
            sr.io_s = (s.io_time - stats_before.io_time).as_secs_f64();
            sr.wait_s = (s.wait_time - stats_before.wait_time).as_secs_f64();
            sr.bytes = (s.bytes_read + s.bytes_written)
                - (stats_before.bytes_read + stats_before.bytes_written);
            report.swaps.push(sr);
            report.buffer_states += 1;
        }
        if !loss.is_finite() {
            return Err(TrainError::Diverged { epoch });
        }
        let io = diff(self.buffer.stats(), io_before);
        report.loss = loss / report.edges.max(1) as f64;
        report.seconds = started.elapsed().as_secs_f64();
        report.edges_per_sec = report.edges as f64 / report.seconds.max(1e-9);
        report.partitions_read = io.reads;
        report.partitions_written = io.writes;
        report.bytes_read = io.bytes_read;
        report.bytes_written = io.bytes_written;
        report.io_s = io.io_time.as_secs_f64();
        report.io_wait_s = io.wait_time.as_secs_f64();
        Ok(report)
    }

    fn run_buckets(
        &mut self,
        buckets: &[Bucket],
        resident: &[u32],
        ctx: &mut EpochCtx<'_>,
    ) -> Result<(), TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        for b in buckets {
            let mut edges = self.buckets.bucket(b[0], b[1]).to_vec();
            let scheme = self.buckets.scheme();
            shuffle(
                &mut edges,
                key(
                    self.seed,
                    &[
                        1,
                        u64::from(ctx.epoch),
                        scheme.bucket_index(b[0], b[1]) as u64,
                    ],
                ),
            );
            for batch in edges.chunks(self.batch_size) {
                *ctx.loss += self.train_batch(batch, &sorted_resident, ctx.epoch, *ctx.batch);
                *ctx.batch += 1;
                *ctx.edges += batch.len() as u64;
                (ctx.progress)(*ctx.edges);
            }
        }
        Ok(())
    }

    /// One synchronous step on `batch`; returns its summed loss.
    fn train_batch(
        &mut self,
        batch: &[Edge],
        partitions: &[u32],
        epoch: u32,
        batch_no: u64,
    ) -> f64 {
        let dim = self.dim;
        let chunks = self.num_chunks.min(batch.len());
        let k = self.negatives;
        // Negatives of every chunk and side.
        let mut negs = vec![0u32; chunks * 2 * k];
        for (c, pair) in negs.chunks_exact_mut(2 * k).enumerate() {
            for (side, out) in pair.chunks_exact_mut(k).enumerate() {
                let stream = key(
                    self.seed,
                    &[2, u64::from(epoch), batch_no, c as u64, side as u64],
                );
                self.sampler.sample(partitions, stream, out);
            }
        }
        let mut blocks = Vec::new();
        for c in 0..chunks {
            let rows = &batch[c * batch.len() / chunks..(c + 1) * batch.len() / chunks];
            let pair = &negs[c * 2 * k..(c + 1) * 2 * k];
            for edges in rows.chunks(BLOCK_ROWS) {
                blocks.push(Block {
                    edges,
                    neg_src: &pair[..k],
                    neg_dst: &pair[k..],
                });
            }
        }
        let buffer = &self.buffer;
        let relations = &self.relations;
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
            let (emb, state) = self.buffer.rows_mut(id).expect("sampled rows are resident");
            self.optimizer
                .apply_row(emb, state, &grads[slot * dim..(slot + 1) * dim]);
        }
        for (&r, &slot) in &rel_index {
            let row = r as usize * dim..(r as usize + 1) * dim;
            self.optimizer.apply_row(
                &mut self.relations.emb[row.clone()],
                &mut self.relations.state[row],
                &rel_grads[slot * dim..(slot + 1) * dim],
            );
        }
        loss
    }
}

struct EpochCtx<'a> {
    epoch: u32,
    loss: &'a mut f64,
    edges: &'a mut u64,
    batch: &'a mut u64,
    progress: &'a mut dyn FnMut(u64),
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

/// Fisher–Yates with the counter-based stream `key`.
fn shuffle<T>(items: &mut [T], key: u64) {
    for i in (1..items.len()).rev() {
        let j = below(draw(key, i as u64), i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

fn diff(a: IoStats, b: IoStats) -> IoStats {
    IoStats {
        reads: a.reads - b.reads,
        initialised: a.initialised - b.initialised,
        writes: a.writes - b.writes,
        bytes_read: a.bytes_read - b.bytes_read,
        bytes_written: a.bytes_written - b.bytes_written,
        io_time: a.io_time.saturating_sub(b.io_time),
        wait_time: a.wait_time.saturating_sub(b.wait_time),
        swaps: a.swaps - b.swaps,
    }
}
