//! An epoch: the plan's buffer states, each swap overlapped with the buckets that do not need
//! it, every bucket's batches in their keyed order, a stop taken before any batch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use legend_dataset::Buckets;
use legend_model::rng::bucket_order_key;
use legend_model::{BatchKey, Permutation};
use legend_planner::Bucket;

use crate::compute::{BucketRef, Step};
use crate::error::TrainError;
use crate::progress::{BatchCursor, EpochCut};

use super::Trainer;
use super::report::{EpochEnd, EpochReport, SwapReport};

impl Trainer {
    /// Trains one epoch (numbered from 1). `progress` is called with the positives done so far.
    pub fn run_epoch(
        &mut self,
        epoch: u32,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochReport, TrainError> {
        match self.run_epoch_from(epoch, None, &AtomicBool::new(false), progress)? {
            EpochEnd::Done(report) => Ok(report),
            EpochEnd::Stopped(_) => unreachable!("nothing asked the epoch to stop"),
        }
    }

    /// Trains epoch `epoch` from where `from` stopped (or from its start), until it ends or
    /// `stop` is seen set before a batch. Stopping leaves every parameter consistent (nothing
    /// is half-trained: the swap under way, if any, is completed or cancelled), and an epoch
    /// resumed from the returned cut after a checkpoint trains exactly what the uninterrupted
    /// epoch would have.
    pub fn run_epoch_from(
        &mut self,
        epoch: u32,
        from: Option<EpochCut>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EpochEnd, TrainError> {
        let started = Instant::now();
        let io_before = self.swapper.stats();
        let pi = self.epoch_relabeling(epoch);
        let relabel = |buckets: &[Bucket]| -> Vec<Bucket> {
            buckets
                .iter()
                .map(|b| [pi[b[0] as usize], pi[b[1] as usize]])
                .collect()
        };
        let from = from.filter(|c| c.epoch == epoch);
        if let Some(cut) = from
            && let Some(k) = cut.workers
        {
            return Err(TrainError::Resume(format!(
                "epoch {epoch} stopped {} on {k} GPUs: resume with training.gpus = {k} to finish that epoch (a new number of GPUs takes over at an epoch boundary)",
                cut.describe()
            )));
        }
        let done_swaps = from.map_or(0, |c| c.swaps as usize);
        let plan = self.plan.clone();
        if done_swaps > plan.swaps.len() {
            return Err(TrainError::Resume(format!(
                "epoch {epoch} stopped after {done_swaps} swaps, but its plan has {}",
                plan.swaps.len()
            )));
        }
        // The state the epoch is in: its first, or the one the last finished swap made.
        let first: Vec<u32> = plan.states[done_swaps]
            .iter()
            .map(|&p| pi[p as usize])
            .collect();
        let loaded_by = |i: usize| pi[plan.swaps[i].loaded as usize];
        let mut report = EpochReport {
            epoch,
            negatives_per_positive: self.negatives,
            buffer_states: 1,
            edges: from.map_or(0, |c| c.edges),
            ..EpochReport::default()
        };
        let loss_before = from.map_or(0.0, |c| c.loss);
        self.fill(&first)?;
        let mut resident = first.clone();
        // With read-ahead, each swap's partition is read into the spare slot while the state
        // before it trains: the first swap's now, the next one's as soon as a swap is done.
        if self.read_ahead && done_swaps < plan.swaps.len() {
            self.swapper.load(loaded_by(done_swaps), Some(done_swaps))?;
        }
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut report.edges,
            progress,
            stop,
        };
        // The rest of the bucket group of the state the epoch (re)starts in, unless the cut
        // says it is complete: a fresh epoch's initial buckets, or a resumed swap's overlap and
        // after buckets, the overlap ones with the partitions they drew negatives from then.
        let start = match from {
            None => Some(None),
            Some(cut) => cut.next.map(Some),
        };
        if let Some(start) = start {
            let stopped = if done_swaps == 0 {
                self.run_group(&relabel(&plan.initial), &resident, start, &mut ctx)?
            } else {
                let swap = &plan.swaps[done_swaps - 1];
                let (overlap, after) = (relabel(&swap.overlap), relabel(&swap.after));
                let loaded = loaded_by(done_swaps - 1);
                self.finish_swap_groups([&overlap, &after], loaded, &resident, start, &mut ctx)?
            };
            if let Some(cursor) = stopped {
                return self.stopped(epoch, done_swaps, Some(cursor), &mut report, loss_before);
            }
        }
        for (i, swap) in plan.swaps.iter().enumerate().skip(done_swaps) {
            if stop.load(Ordering::Relaxed) {
                return self.stopped(epoch, i, None, &mut report, loss_before);
            }
            let (evicted, loaded) = (pi[swap.evicted as usize], loaded_by(i));
            let overlap = relabel(&swap.overlap);
            let after = relabel(&swap.after);
            let mut sr = SwapReport {
                evicted,
                loaded,
                start_s: started.elapsed().as_secs_f64(),
                ..SwapReport::default()
            };
            resident.retain(|&p| p != evicted);
            let released = self.compute.release(evicted)?;
            self.swapper.evict(evicted, released, Some(i))?;
            if !self.read_ahead {
                self.swapper.load(loaded, Some(i))?;
            }
            let t = Instant::now();
            let mut stopped = None;
            if self.prefetch {
                stopped = self.run_group(&overlap, &resident, None, &mut ctx)?;
                self.compute.synchronize()?;
            }
            sr.overlap_compute_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let (slot, ready) = self.swapper.arrive(loaded)?;
            sr.wait_s = t.elapsed().as_secs_f64();
            self.compute.arrive(loaded, slot, &ready)?;
            resident.push(loaded);
            report.buffer_states += 1;
            if let Some(cursor) = stopped {
                // Stopped in the overlap buckets: the swap is complete, the rest follows it.
                report.swaps.push(sr);
                return self.stopped(epoch, i + 1, Some(cursor), &mut report, loss_before);
            }
            if self.read_ahead && i + 1 < plan.swaps.len() {
                self.swapper.load(loaded_by(i + 1), Some(i + 1))?;
            }
            let t = Instant::now();
            if !self.prefetch {
                stopped = self.run_group(&overlap, &resident, None, &mut ctx)?;
            }
            if stopped.is_none() {
                stopped = self.run_group(&after, &resident, None, &mut ctx)?;
            }
            self.compute.synchronize()?;
            sr.after_compute_s = t.elapsed().as_secs_f64();
            report.swaps.push(sr);
            if let Some(cursor) = stopped {
                return self.stopped(epoch, i + 1, Some(cursor), &mut report, loss_before);
            }
        }
        // The last swap's write may still run: the epoch's I/O ends with it.
        self.swapper.drain()?;
        self.take_swap_io(&mut report, done_swaps, started);
        let loss = loss_before + self.compute.take_loss()?;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { epoch });
        }
        report.loss = loss / report.edges.max(1) as f64;
        self.close_report(&mut report, from, started, &io_before);
        Ok(EpochEnd::Done(report))
    }

    /// The rest of a resumed swap's bucket groups (`[overlap, after]`) from `start`: the
    /// overlap buckets with the partitions they drew negatives from before `loaded` arrived.
    fn finish_swap_groups(
        &mut self,
        [overlap, after]: [&[Bucket]; 2],
        loaded: u32,
        resident: &[u32],
        start: Option<BatchCursor>,
        ctx: &mut EpochCtx<'_>,
    ) -> Result<Option<BatchCursor>, TrainError> {
        let before_arrival: Vec<u32> = if self.prefetch {
            resident.iter().copied().filter(|&p| p != loaded).collect()
        } else {
            resident.to_vec()
        };
        let in_overlap = start.is_none_or(|c| overlap.contains(&c.bucket));
        if in_overlap && let Some(cursor) = self.run_group(overlap, &before_arrival, start, ctx)? {
            return Ok(Some(cursor));
        }
        let start = start.filter(|_| !in_overlap);
        self.run_group(after, resident, start, ctx)
    }

    /// An epoch's closing figures: its time and rate (of what it trained now, `from` a cut or
    /// its start), its I/O since `io_before`, the memory it peaked at.
    fn close_report(
        &self,
        report: &mut EpochReport,
        from: Option<EpochCut>,
        started: Instant,
        io_before: &crate::swap::IoStats,
    ) {
        let io = self.swapper.stats().since(io_before);
        report.seconds = started.elapsed().as_secs_f64();
        let trained_now = report.edges - from.map_or(0, |c| c.edges);
        report.edges_per_sec = trained_now as f64 / report.seconds.max(1e-9);
        report.partitions_read = io.reads;
        report.partitions_written = io.writes;
        report.bytes_read = io.bytes_read;
        report.bytes_written = io.bytes_written;
        report.io_s = io.io_time.as_secs_f64();
        report.io_wait_s = io.wait_time.as_secs_f64();
        report.resumed = from.is_some();
        report.peak_rss_bytes = crate::footprint::peak_rss_bytes().unwrap_or(0);
        report.gpu_memory_bytes = self.compute.device_memory_in_use();
    }

    /// Makes exactly `state` resident: the partitions outside it are written back, the
    /// missing ones read (the epoch's first state; between epochs nothing moves, see
    /// [`Trainer::epoch_relabeling`]).
    pub(super) fn fill(&mut self, state: &[u32]) -> Result<(), TrainError> {
        for p in self.swapper.resident() {
            if !state.contains(&p) {
                let released = self.compute.release(p)?;
                self.swapper.evict(p, released, None)?;
            }
        }
        let missing: Vec<u32> = state
            .iter()
            .copied()
            .filter(|&p| self.swapper.slot(p).is_none())
            .collect();
        for &p in &missing {
            self.swapper.load(p, None)?;
        }
        for &p in &missing {
            let (slot, ready) = self.swapper.arrive(p)?;
            self.compute.arrive(p, slot, &ready)?;
        }
        Ok(())
    }

    /// Adds each swap's I/O, from the swap path's log of the epoch's moves (swap `i` of the
    /// plan is `report.swaps[i - first_swap]`), to `report`.
    fn take_swap_io(&mut self, report: &mut EpochReport, first_swap: usize, started: Instant) {
        let since = |t: Instant| t.saturating_duration_since(started).as_secs_f64();
        for record in self.swapper.take_log() {
            let Some(sr) = record
                .tag
                .and_then(|i| i.checked_sub(first_swap))
                .and_then(|i| report.swaps.get_mut(i))
            else {
                continue;
            };
            let s = record.stats;
            sr.io_s += s.io_time.as_secs_f64();
            sr.copy_s += s.copy_time.as_secs_f64();
            sr.bytes += s.bytes_read + s.bytes_written;
            let start = since(record.started);
            sr.io_start_s = Some(sr.io_start_s.map_or(start, |t: f64| t.min(start)));
            sr.io_kernels
                .extend(record.kernels.into_iter().map(|(at, mut span)| {
                    span.start_s = since(at);
                    span
                }));
        }
    }

    /// Ends the epoch early in buffer state `swaps`, `next` naming where its group continues:
    /// the partition read ahead (unmodified) is dropped, queued steps finish and the swap
    /// path's writes drain, so the resident partitions are what a checkpoint must write.
    fn stopped(
        &mut self,
        epoch: u32,
        swaps: usize,
        next: Option<BatchCursor>,
        report: &mut EpochReport,
        loss_before: f64,
    ) -> Result<EpochEnd, TrainError> {
        self.swapper.cancel_loads()?;
        self.compute.synchronize()?;
        self.swapper.drain()?;
        self.swapper.take_log();
        Ok(EpochEnd::Stopped(EpochCut {
            epoch,
            swaps: swaps as u32,
            next,
            edges: report.edges,
            loss: loss_before + self.compute.take_loss()?,
            workers: None,
            hosts: None,
        }))
    }

    /// Trains `group`'s buckets in order, from `start` (`None`: its first bucket's first
    /// batch), each batch keyed by its bucket and its place in it (legend-model's
    /// [`BatchKey`]) and drawing negatives from `resident`. Returns where it stopped when
    /// `ctx.stop` was seen set before a batch, `None` once every bucket is trained.
    pub(super) fn run_group(
        &mut self,
        group: &[Bucket],
        resident: &[u32],
        start: Option<BatchCursor>,
        ctx: &mut EpochCtx<'_>,
    ) -> Result<Option<BatchCursor>, TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        let skip = match start {
            None => 0,
            Some(c) => group.iter().position(|b| *b == c.bucket).ok_or_else(|| {
                TrainError::Resume(format!(
                    "epoch {} stopped in bucket ({}, {}), which its buffer state's group of {} buckets does not hold",
                    ctx.epoch,
                    c.bucket[0],
                    c.bucket[1],
                    group.len()
                ))
            })?,
        };
        for (i, b) in group.iter().enumerate().skip(skip) {
            let first_batch = match start {
                Some(c) if i == skip => c.batch,
                _ => 0,
            };
            let batches = self.batches_of(*b);
            if first_batch > batches {
                return Err(TrainError::Resume(format!(
                    "epoch {} stopped at batch {first_batch} of bucket ({}, {}), which has {batches}",
                    ctx.epoch, b[0], b[1]
                )));
            }
            if let Some(cursor) =
                self.run_bucket(*b, first_batch..batches, &sorted_resident, ctx)?
            {
                return Ok(Some(cursor));
            }
        }
        Ok(None)
    }

    /// Batches of bucket `b` (the last may be short).
    pub(super) fn batches_of(&self, b: Bucket) -> u64 {
        self.buckets
            .bucket(b[0], b[1])
            .len()
            .div_ceil(self.batch_size) as u64
    }

    /// Trains batches `batches` of bucket `b` (as many as it has), negatives drawn from
    /// `resident` (ascending), checking `ctx.stop` before each; returns where it stopped.
    pub(super) fn run_bucket(
        &mut self,
        b: Bucket,
        batches: std::ops::Range<u64>,
        resident: &[u32],
        ctx: &mut EpochCtx<'_>,
    ) -> Result<Option<BatchCursor>, TrainError> {
        let batches = batches.start..batches.end.min(self.batches_of(b));
        if batches.is_empty() {
            return Ok(None);
        }
        let bucket = bucket_ref(&self.buckets, b, self.seed, ctx.epoch);
        self.compute.begin_bucket(&bucket)?;
        for batch in batches {
            if ctx.stop.load(Ordering::Relaxed) {
                return Ok(Some(BatchCursor { bucket: b, batch }));
            }
            let step = batch_step(
                &bucket,
                batch,
                self.batch_size,
                resident,
                self.seed,
                ctx.epoch,
            );
            self.compute
                .train_batch(&step, self.swapper.host(), &mut self.relations)?;
            *ctx.edges += step.len as u64;
            (ctx.progress)(*ctx.edges);
        }
        Ok(None)
    }
}

/// Bucket `b` of epoch `epoch` as the engines train it: its edges and their order.
pub(super) fn bucket_ref(buckets: &Buckets, b: Bucket, seed: u64, epoch: u32) -> BucketRef<'_> {
    let edges = buckets.bucket(b[0], b[1]);
    let index = buckets.scheme().bucket_index(b[0], b[1]);
    BucketRef {
        parts: b,
        index,
        edges,
        order: Permutation::new(
            edges.len() as u64,
            bucket_order_key(seed, epoch, index as u64),
        ),
    }
}

/// Batch `batch` of `bucket` (batches of `batch_size` edges), negatives from `resident`.
pub(super) fn batch_step<'a>(
    bucket: &'a BucketRef<'a>,
    batch: u64,
    batch_size: usize,
    resident: &'a [u32],
    seed: u64,
    epoch: u32,
) -> Step<'a> {
    let first = batch * batch_size as u64;
    Step {
        bucket,
        first,
        len: batch_size.min(bucket.edges.len() - first as usize),
        resident,
        key: BatchKey::new(seed, epoch, bucket.index as u64, batch),
    }
}

pub(super) struct EpochCtx<'a> {
    pub(super) epoch: u32,
    pub(super) edges: &'a mut u64,
    pub(super) progress: &'a mut dyn FnMut(u64),
    /// Raised to stop before the next batch.
    pub(super) stop: &'a AtomicBool,
}
