//! The epochs of a session: training, timed and counted checkpoints, validation, early
//! stopping, and the final evaluation.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use legend_dataset::Split;
use legend_eval::{Metrics, SampledNegatives};
use legend_fs::Access;

use crate::config::Protocol;
use crate::evaluation::EvalRequest;
use crate::run::{RunMeta, TableWriter};
use crate::store::file::encode_relations;
use crate::trainer::{EpochEnd, EpochReport};
use crate::training::Training;
use crate::{evaluation, run};

use super::metrics::{METRICS_FILE, append_line, has_final_line};
use super::{BEST_DIR, Event, Outcome, Position, Session, SessionError, io_error, write_meta};

impl Session {
    /// Trains the remaining epochs, checkpointing as configured, then evaluates. When `stop`
    /// is set it ends before the next batch with a checkpoint of that point.
    pub fn run(
        &mut self,
        stop: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Outcome, SessionError> {
        let epochs = self.config.training.num_epochs;
        let mut metrics = self
            .run
            .open_file(METRICS_FILE, Access::Append)
            .map_err(io_error(&self.run.join(METRICS_FILE)))?;
        let mut clock = CheckpointClock::new(self.config.training.checkpoint_minutes);
        for epoch in self.position.epochs_completed + 1..=epochs {
            if self.history.exhausted(&self.config) {
                break;
            }
            let learning_rate = self.history.learning_rate(epoch, &self.config);
            self.trainer.set_learning_rate(learning_rate);
            let Some(report) = self.train_epoch(epoch, stop, &mut clock, on_event)? else {
                return Ok(Outcome::Stopped(self.position));
            };
            let mut line = serde_json::to_value(&report).expect("a report serializes");
            line["learning_rate"] = serde_json::json!(learning_rate);
            let (valid, improved) = self.validate_epoch(epoch, &mut line)?;
            // The best tables are written before the checkpoint that follows (a crash between
            // the two resumes before this epoch, which then writes them again).
            let kept = improved && self.config.evaluation.keep_best;
            if kept {
                self.save_best(epoch)?;
            }
            let early_stop = self.history.exhausted(&self.config);
            if early_stop {
                let (best, mrr) = self
                    .history
                    .best
                    .expect("patience counts from a best epoch");
                tracing::info!(
                    "early stopping after epoch {epoch}: no better validation MRR in {} evaluations since epoch {best} ({mrr:.4})",
                    self.history.since_best
                );
            }
            append_line(&mut metrics, &self.run, &line)?;
            on_event(Event::EpochFinished {
                report: &report,
                valid: valid.as_ref(),
                line: &line,
            });
            self.position = Position {
                epochs_completed: epoch,
                cut: None,
            };
            let every = self.config.training.checkpoint_every;
            let stopping = stop.load(Ordering::Relaxed);
            // A kept improvement is checkpointed, so that a resume never starts before the best
            // epoch (whose tables it could not rebuild from an older checkpoint).
            if epoch == epochs
                || stopping
                || early_stop
                || kept
                || (every > 0 && epoch % every == 0)
                || clock.due()
            {
                clock.cost = self.committed_checkpoint(on_event)?;
                clock.last = Instant::now();
            }
            if stopping && epoch < epochs {
                return Ok(Outcome::Stopped(self.position));
            }
        }
        self.final_evaluation(&mut metrics, on_event)
    }

    /// Trains `epoch` from where the position says, committing a checkpoint wherever the
    /// trainer paused (a stop, or a timed checkpoint due inside a long epoch) and going on from
    /// it as a resume would; `None` once a stop's checkpoint is committed.
    fn train_epoch(
        &mut self,
        epoch: u32,
        stop: &AtomicBool,
        clock: &mut CheckpointClock,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Option<EpochReport>, SessionError> {
        let mut cut = self.position.cut.take();
        on_event(Event::EpochStarted {
            epoch,
            epochs: self.config.training.num_epochs,
            edges: self.epoch_edges,
            edges_done: cut.map_or(0, |c| c.edges),
        });
        loop {
            // Raised on a stop, or when a timed checkpoint falls due inside a long epoch:
            // the trainer then ends this part of the epoch before its next batch.
            let pause = AtomicBool::new(stop.load(Ordering::Relaxed));
            let at = *clock;
            let end = self
                .trainer
                .run_epoch_from(epoch, cut, &pause, &mut |done| {
                    if stop.load(Ordering::Relaxed) || at.due() {
                        pause.store(true, Ordering::Relaxed);
                    }
                    on_event(Event::Progress {
                        epoch,
                        edges_done: done,
                    })
                })?;
            let part = match end {
                EpochEnd::Done(report) => return Ok(Some(report)),
                EpochEnd::Stopped(part) => part,
            };
            self.position = Position {
                epochs_completed: epoch - 1,
                cut: Some(part),
            };
            clock.cost = self.committed_checkpoint(on_event)?;
            clock.last = Instant::now();
            if stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            // Continued in this process exactly as a resume from the checkpoint would.
            cut = Some(part);
        }
    }

    /// The validation evaluation after `epoch`, when `[evaluation]` asks for one (its metrics
    /// go into the epoch's `line`), and whether it improved on the best so far.
    fn validate_epoch(
        &mut self,
        epoch: u32,
        line: &mut serde_json::Value,
    ) -> Result<(Option<Metrics>, bool), SessionError> {
        let e = &self.config.evaluation;
        if !(e.epochs_per_eval > 0
            && epoch.is_multiple_of(e.epochs_per_eval)
            && self.dataset.meta().splits.valid > 0)
        {
            return Ok((None, false));
        }
        let protocol = e.valid_protocol.unwrap_or(e.protocol);
        let m = self.evaluate_with(Split::Valid, protocol)?;
        line["valid"] = serde_json::to_value(&m).expect("metrics serialize");
        let improved = self.history.record(epoch, m.mrr, &self.config);
        Ok((Some(m), improved))
    }

    /// The final evaluation of `evaluation.split` (of the best epoch's tables, when kept),
    /// unless the run has one already or the split is empty.
    fn final_evaluation(
        &mut self,
        metrics: &mut File,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Outcome, SessionError> {
        if has_final_line(&self.run)? {
            return Ok(Outcome::Finished(None));
        }
        let split = self.config.evaluation.split.split();
        if self.dataset.meta().splits.get(split) == 0 {
            tracing::warn!("no {} edges: skipping the final evaluation", split.name());
            return Ok(Outcome::Finished(None));
        }
        on_event(Event::Evaluating { split });
        let (m, best_epoch) = match self.evaluate_best(split)? {
            Some((m, epoch)) => (m, Some(epoch)),
            None => (self.evaluate(split)?, None),
        };
        let mut line = serde_json::json!({ "final": true, "split": split.name(), "metrics": m });
        if let Some(epoch) = best_epoch {
            line["best_epoch"] = serde_json::json!(epoch);
        }
        append_line(metrics, &self.run, &line)?;
        on_event(Event::Evaluated {
            split,
            metrics: &m,
            line: &line,
        });
        Ok(Outcome::Finished(Some(m)))
    }

    /// How `[evaluation]` ranks `split`.
    fn eval_request(&self, split: Split, protocol: Protocol) -> EvalRequest {
        let e = &self.config.evaluation;
        EvalRequest {
            protocol,
            split,
            negatives: SampledNegatives {
                uniform: e.uniform_negatives,
                degree: e.degree_negatives,
                seed: e.seed,
            },
            threads: self.config.training.threads,
        }
    }

    /// Evaluates the current parameters on `split` as `[evaluation]` says.
    pub fn evaluate(&mut self, split: Split) -> Result<Metrics, SessionError> {
        self.evaluate_with(split, self.config.evaluation.protocol)
    }

    /// Evaluates the current parameters on `split` with `protocol`.
    fn evaluate_with(&mut self, split: Split, protocol: Protocol) -> Result<Metrics, SessionError> {
        let dim = self.config.model.dim;
        let request = self.eval_request(split, protocol);
        let decoder = self.config.decoder();
        self.trainer.sync_relations()?;
        let relations = self.trainer.relations().emb.clone();
        let scheme = self.trainer.scheme();
        let evaluate = |entities: &[f32]| {
            evaluation::evaluate(
                &self.dataset,
                decoder,
                dim,
                entities,
                &relations,
                self.meta.reciprocal_relations,
                &request,
            )
        };
        let in_place = if scheme.num_partitions == 1 {
            // One partition in host memory is the whole table: ranked in place, not copied.
            self.trainer
                .host_partition(0)
                .map(|part| evaluate(&part.emb))
        } else {
            None
        };
        let metrics = if let Some(metrics) = in_place {
            metrics?
        } else {
            // The embeddings alone, gathered from wherever each partition is (from the GPU
            // a piece at a time: its optimizer state never comes to the host).
            let mut emb = Vec::with_capacity(scheme.entities as usize * dim);
            for p in 0..scheme.num_partitions {
                self.trainer.stream_partition(p, &mut |rows, _| {
                    emb.extend_from_slice(rows);
                    Ok(())
                })?;
            }
            evaluate(&emb)?
        };
        Ok(metrics)
    }

    /// Writes the current tables into [`BEST_DIR`] as the checkpoint of `epoch`.
    fn save_best(&mut self, epoch: u32) -> Result<(), SessionError> {
        let path = self.run.join(BEST_DIR);
        let best = self.run.create_dir_all(BEST_DIR).map_err(io_error(&path))?;
        run::write_atomically(&best, run::CONFIG_FILE, self.config.to_toml().as_bytes())?;
        self.trainer.sync_relations()?;
        let relations = self.trainer.relations().clone();
        let meta = RunMeta {
            epochs_completed: epoch,
            cut: None,
            checkpoint: String::new(),
            store: None,
            store_queue: None,
            store_members: Vec::new(),
            store_id: None,
            store_creating: false,
            ..self.meta.clone()
        };
        let trainer = &mut self.trainer;
        run::commit_checkpoint(&best, meta, (&relations.emb, &relations.state), |e, s| {
            write_entity_tables(trainer, e, s)
        })?;
        tracing::info!(
            "epoch {epoch} is the best so far: its tables are in {}",
            path.display()
        );
        Ok(())
    }

    /// Ranks `split` with the best epoch's tables, when `evaluation.keep_best` kept them;
    /// `None` without them (no validation evaluations, or `best/` from an epoch the resumed run
    /// has not reached).
    fn evaluate_best(&mut self, split: Split) -> Result<Option<(Metrics, u32)>, SessionError> {
        let Some((epoch, _)) = self.history.best else {
            return Ok(None);
        };
        if !self.config.evaluation.keep_best {
            return Ok(None);
        }
        let path = self.run.join(BEST_DIR);
        if !self
            .run
            .is_file(Path::new(BEST_DIR).join(run::META_FILE))
            .map_err(io_error(&path))?
        {
            tracing::warn!(
                "{}: no best tables; ranking the last epoch's",
                path.display()
            );
            return Ok(None);
        }
        let best = self.run.dir(BEST_DIR).map_err(io_error(&path))?;
        let meta = run::read_meta(&best)?;
        if meta.epochs_completed != epoch {
            tracing::warn!(
                "{} holds epoch {}, not the best epoch {epoch}; ranking the last epoch's tables",
                path.display(),
                meta.epochs_completed
            );
            return Ok(None);
        }
        let (entities, relations) = run::load_embeddings(&best, &meta, &legend_fs::Unguarded)?;
        let m = evaluation::evaluate(
            &self.dataset,
            self.config.decoder(),
            meta.dim,
            &entities,
            &relations,
            meta.reciprocal_relations,
            &self.eval_request(split, self.config.evaluation.protocol),
        )?;
        Ok(Some((m, epoch)))
    }

    /// [`Session::checkpoint`], then tells `on_event`; returns what the commit took (the next
    /// timed checkpoint is spaced by it).
    fn committed_checkpoint(
        &mut self,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Duration, SessionError> {
        let started = Instant::now();
        self.checkpoint()?;
        let cost = started.elapsed();
        on_event(Event::Checkpoint {
            position: self.position,
        });
        Ok(cost)
    }

    /// Commits the parameters at `self.position`: in the store (its superblock is the commit
    /// record) or as a checkpoint directory named by run.toml (memory backend).
    fn checkpoint(&mut self) -> Result<(), SessionError> {
        self.trainer.sync_relations()?;
        let relations = self.trainer.relations().clone();
        let position = self.position;
        self.meta.epochs_completed = position.epochs_completed;
        self.meta.cut = position.cut;
        let aux = encode_relations(&relations.emb, &relations.state);
        if self.trainer.checkpoint(position.encode(), aux)? {
            // The store committed; run.toml only mirrors the position for people.
            return write_meta(&self.run, &self.meta);
        }
        // A blank stand-in while the real record is moved through `commit_checkpoint`.
        let meta = std::mem::replace(&mut self.meta, RunMeta::blank());
        self.meta = run::commit_checkpoint(
            &self.run,
            meta,
            (&relations.emb, &relations.state),
            |e, s| write_entity_tables(&mut self.trainer, e, s),
        )?;
        tracing::debug!("checkpoint {} committed", self.meta.checkpoint);
        Ok(())
    }
}

/// When the last checkpoint was committed and what it cost, against `training.checkpoint_minutes`.
#[derive(Clone, Copy)]
struct CheckpointClock {
    /// When the last checkpoint was committed; the session's start counts as one (a resumed
    /// run has just read one).
    last: Instant,
    /// How long it took.
    cost: Duration,
    /// `training.checkpoint_minutes`.
    interval: Duration,
}

impl CheckpointClock {
    fn new(minutes: f64) -> CheckpointClock {
        CheckpointClock {
            last: Instant::now(),
            cost: Duration::ZERO,
            // Finite and ≥ 0 (checked); beyond what a Duration holds means never.
            interval: Duration::try_from_secs_f64(minutes * 60.0).unwrap_or(Duration::MAX),
        }
    }

    /// Whether a timed checkpoint is due now ([`checkpoint_due`]).
    fn due(&self) -> bool {
        checkpoint_due(self.last.elapsed(), self.cost, self.interval)
    }
}

/// Training time per second of checkpoint writing, at the least: checkpoints take at most
/// 1/20 = 5 % of a run's wall time.
const CHECKPOINT_SPACING: u32 = 20;

/// Whether a timed checkpoint (`training.checkpoint_minutes`) is due `since_last` after the
/// last checkpoint (or the session's start): once `interval` has passed (zero: never), and once
/// 20 times the last checkpoint's `cost` has passed, so that slow checkpoints (a billion-edge
/// table written to a slow disk) are spaced out rather than eating the run. It is taken before
/// the next batch, so a crash loses at most about `interval`.
pub fn checkpoint_due(since_last: Duration, cost: Duration, interval: Duration) -> bool {
    !interval.is_zero() && since_last >= interval.max(cost * CHECKPOINT_SPACING)
}

/// Streams every partition's embedding and state rows from wherever `trainer` holds them into
/// a checkpoint's two entity tables.
fn write_entity_tables(
    trainer: &mut Training,
    e: &mut TableWriter,
    s: &mut TableWriter,
) -> Result<(), SessionError> {
    for p in 0..trainer.scheme().num_partitions {
        trainer.stream_partition(p, &mut |emb, state| {
            e.write(emb)?;
            Ok(s.write(state)?)
        })?;
    }
    Ok(())
}
