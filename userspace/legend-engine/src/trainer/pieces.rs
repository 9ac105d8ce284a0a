//! What the workers drive on a trainer: the pieces of a K-GPU schedule's rounds (with the
//! relation gradients summed across workers in lockstep) and the partitions handed between
//! them.

use std::sync::atomic::AtomicBool;

use legend_planner::{Bucket, Piece};

use crate::compute::PendingRelations;
use crate::error::TrainError;
use crate::rows::Partition;
use crate::swap::Fence;

use super::Trainer;
use super::epoch::{EpochCtx, batch_step, bucket_ref};

/// A partition on its way to another worker (see [`Trainer::hand_out`]).
pub(crate) struct Outgoing {
    /// Its host rows (the CPU engine's).
    pub(crate) rows: Option<Partition>,
    /// Its rows in the GPU slot it leaves.
    pub(crate) span: Option<legend_cuda::RowSpan>,
    /// The point after which compute no longer touches the slot.
    pub(crate) after: Fence,
}

impl Trainer {
    /// Trains `buckets` of epoch `epoch` in order, their partitions resident, drawing
    /// negatives from the partitions `resident`; returns the positive edges trained. What a
    /// bucket does depends on the parameters, `epoch` and `resident` alone, not on what was
    /// trained before it (the work of one worker of several, or a test's).
    pub fn train_buckets(
        &mut self,
        epoch: u32,
        buckets: &[Bucket],
        resident: &[u32],
    ) -> Result<u64, TrainError> {
        let mut edges = 0;
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut edges,
            progress: &mut |_| {},
            stop: &AtomicBool::new(false),
        };
        self.run_group(buckets, resident, None, &mut ctx)?;
        self.compute.synchronize()?;
        Ok(edges)
    }

    /// Trains `pieces` of epoch `epoch` in order (runs of batches of buckets whose partitions
    /// are resident), drawing negatives from the partitions `resident`; returns the positive
    /// edges trained. A K-GPU worker's share of a round ([`crate::workers`]).
    pub fn train_pieces(
        &mut self,
        epoch: u32,
        pieces: &[Piece],
        resident: &[u32],
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64, TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        let mut edges = 0;
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut edges,
            progress,
            stop: &AtomicBool::new(false),
        };
        for piece in pieces {
            self.run_bucket(
                piece.bucket,
                piece.batches.clone(),
                &sorted_resident,
                &mut ctx,
            )?;
        }
        self.compute.synchronize()?;
        Ok(edges)
    }

    /// Trains `pieces` like [`Trainer::train_pieces`] in lockstep with the other workers of a
    /// run with relations: after every batch the relation gradients are summed over the
    /// workers by `link` and every worker steps the relation rows alike; a worker whose
    /// pieces end first takes empty steps (its share of the sum is zero) until `steps`, the
    /// round's most batches on any worker, so every sum has every worker.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn train_pieces_synced(
        &mut self,
        epoch: u32,
        pieces: &[Piece],
        resident: &[u32],
        steps: u64,
        link: &mut dyn crate::workers::Link,
        give_up: &AtomicBool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64, TrainError> {
        let mut sorted_resident = resident.to_vec();
        sorted_resident.sort_unstable();
        // The edges are shared (a clone is a handle): the bucket borrows this copy, not self.
        let buckets = self.buckets.clone();
        let (mut edges, mut taken) = (0u64, 0u64);
        for piece in pieces {
            let bucket = bucket_ref(&buckets, piece.bucket, self.seed, epoch);
            self.compute.begin_bucket(&bucket)?;
            let end = piece.batches.end.min(self.batches_of(piece.bucket));
            for batch in piece.batches.start..end {
                let step = batch_step(
                    &bucket,
                    batch,
                    self.batch_size,
                    &sorted_resident,
                    self.seed,
                    epoch,
                );
                self.compute
                    .train_batch(&step, self.swapper.host(), &mut self.relations)?;
                edges += step.len as u64;
                progress(edges);
                self.sum_relations(link, give_up)?;
                taken += 1;
            }
        }
        for _ in taken..steps {
            self.sum_relations(link, give_up)?;
        }
        self.compute.synchronize()?;
        Ok(edges)
    }

    /// The K workers' rule for relations run on this one trainer, the CPU reference of
    /// [`Trainer::train_pieces_synced`]: worker `g`'s `shares[g]` (its pieces and the
    /// partitions it holds) step in lockstep, `steps` steps, each step's relation gradients
    /// kept per worker and summed in worker order before the relation rows take one step.
    /// Node rows of different workers never meet (their partitions differ), so this trains
    /// exactly what the workers train. CPU engine only.
    pub fn train_lockstep(
        &mut self,
        epoch: u32,
        shares: &[(&[Piece], [u32; 2])],
        steps: u64,
    ) -> Result<u64, TrainError> {
        self.defer_relations()?;
        let template = match self.compute.pending_relations()? {
            PendingRelations::Host(p) => p.clone(),
            PendingRelations::Device { .. } => {
                return Err(TrainError::Resume(
                    "the lockstep reference runs on the CPU engine".into(),
                ));
            }
        };
        let mut pending = vec![template.clone(); shares.len()];
        let mut batches: Vec<Vec<(Bucket, u64)>> = shares
            .iter()
            .map(|(pieces, _)| {
                pieces
                    .iter()
                    .flat_map(|p| {
                        let end = p.batches.end.min(self.batches_of(p.bucket));
                        (p.batches.start..end).map(move |b| (p.bucket, b))
                    })
                    .rev()
                    .collect()
            })
            .collect();
        let mut edges = 0;
        let mut ctx = EpochCtx {
            epoch,
            edges: &mut edges,
            progress: &mut |_| {},
            stop: &AtomicBool::new(false),
        };
        for _ in 0..steps {
            let mut total = template.clone();
            for (g, (_, held)) in shares.iter().enumerate() {
                let PendingRelations::Host(slot) = self.compute.pending_relations()? else {
                    unreachable!("checked above");
                };
                std::mem::swap(slot, &mut pending[g]);
                if let Some((bucket, batch)) = batches[g].pop() {
                    let mut held = held.to_vec();
                    held.sort_unstable();
                    self.run_bucket(bucket, batch..batch + 1, &held, &mut ctx)?;
                }
                let PendingRelations::Host(slot) = self.compute.pending_relations()? else {
                    unreachable!("checked above");
                };
                std::mem::swap(slot, &mut pending[g]);
                total.add(&pending[g]);
                pending[g].clear();
            }
            let PendingRelations::Host(slot) = self.compute.pending_relations()? else {
                unreachable!("checked above");
            };
            *slot = total;
            self.compute
                .apply_relations(&mut self.relations, &Fence::passed())?;
        }
        Ok(edges)
    }

    /// This step's relation gradients summed over the workers by `link`, then applied.
    fn sum_relations(
        &mut self,
        link: &mut dyn crate::workers::Link,
        give_up: &AtomicBool,
    ) -> Result<(), TrainError> {
        let pending = self.compute.pending_relations()?;
        let ready = link.sum_relations(pending, give_up)?;
        self.compute.apply_relations(&mut self.relations, &ready)
    }

    /// From now on the relation rows step only with the workers' summed gradients
    /// ([`Trainer::train_pieces_synced`]).
    pub(crate) fn defer_relations(&mut self) -> Result<(), TrainError> {
        self.compute.defer_relations(&self.relations)
    }

    /// Partition `p` (resident) leaves for another worker: compute lets it go and its slot is
    /// free, nothing written. Returns how its rows travel: the CPU engine's host rows, or the
    /// GPU slot's rows once the fence has passed (valid until the next partition arrives).
    pub(crate) fn hand_out(&mut self, p: u32) -> Result<Outgoing, TrainError> {
        let after = self.compute.release(p)?;
        let slot = self
            .swapper
            .slot(p)
            .expect("handing out a resident partition");
        let span = self.compute.slot_span(slot, p)?;
        let (_, rows) = self.swapper.give(p);
        Ok(Outgoing { rows, span, after })
    }

    /// A slot for partition `p`, which another worker sends: its device rows (GPU engines)
    /// for the transfer to fill.
    pub(crate) fn hand_in(&mut self, p: u32) -> Result<Option<legend_cuda::RowSpan>, TrainError> {
        let slot = self.swapper.reserve(p);
        self.compute.slot_span(slot, p)
    }

    /// Partition `p` arrived from another worker: its host rows (CPU engine), or its slot
    /// filled once `ready` has passed.
    pub(crate) fn handed_in(
        &mut self,
        p: u32,
        rows: Option<Partition>,
        ready: Fence,
    ) -> Result<(), TrainError> {
        self.swapper.received(p, rows);
        let slot = self.swapper.slot(p).expect("received");
        self.compute.arrive(p, slot, &ready)
    }

    /// Partition `p` (resident) goes home, parked until a worker takes it again: its write is
    /// queued to run once compute has let it go, and its slot is free for what is read next.
    pub(crate) fn park(&mut self, p: u32) -> Result<(), TrainError> {
        let released = self.compute.release(p)?;
        Ok(self.swapper.evict(p, released, None)?)
    }

    /// Queues the read of partition `p` from home into the free slot, to run while compute
    /// trains (a parked schedule's next partition).
    pub(crate) fn read_ahead(&mut self, p: u32) -> Result<(), TrainError> {
        Ok(self.swapper.load(p, None)?)
    }

    /// Waits for the read of `p` (the oldest queued) and lets compute use it.
    pub(crate) fn take_arrival(&mut self, p: u32) -> Result<(), TrainError> {
        let (slot, ready) = self.swapper.arrive(p)?;
        self.compute.arrive(p, slot, &ready)
    }

    /// Drops the swap path's record of finished moves: the workers count moves by their
    /// schedule (the record feeds a one-GPU epoch's timeline, and would only grow here).
    pub(crate) fn forget_moves(&mut self) {
        self.swapper.take_log();
    }

    /// Gives back, unmodified, every partition read ahead and not yet taken (a stop at a round
    /// gate: the next round will not run).
    pub(crate) fn cancel_read_ahead(&mut self) -> Result<(), TrainError> {
        Ok(self.swapper.cancel_loads()?)
    }

    /// Partitions resident, ascending.
    pub fn resident(&self) -> Vec<u32> {
        self.swapper.resident()
    }

    /// Writes back every resident partition outside `keep` (waiting for the writes).
    pub(crate) fn release_except(&mut self, keep: &[u32]) -> Result<(), TrainError> {
        for p in self.swapper.resident() {
            if !keep.contains(&p) {
                let released = self.compute.release(p)?;
                self.swapper.evict(p, released, None)?;
            }
        }
        Ok(self.swapper.drain()?)
    }

    /// Waits until the steps queued so far have run.
    pub(crate) fn synchronize(&mut self) -> Result<(), TrainError> {
        self.compute.synchronize()
    }

    /// The loss summed since the last call (waits for queued steps).
    pub(crate) fn take_loss(&mut self) -> Result<f64, TrainError> {
        self.compute.take_loss()
    }

    /// Device memory in use (GPU engines).
    pub(crate) fn device_memory_in_use(&self) -> Option<u64> {
        self.compute.device_memory_in_use()
    }
}
