//! What the validation evaluations decide: the best epoch so far, early stopping
//! (`evaluation.patience`) and the learning-rate schedule (`[optimizer]` warm-up, decay and
//! reduce-on-plateau).
//!
//! Nothing here is stored: a [`ValidHistory`] is replayed from the `valid` MRRs in
//! metrics.jsonl, which a resume has already cut back to its checkpoint, so a resumed run takes
//! the decisions the uninterrupted run took.

use crate::config::Config;

/// The validation MRRs seen so far and what they imply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ValidHistory {
    /// The best epoch and its MRR.
    pub best: Option<(u32, f64)>,
    /// Evaluations since the best one (early stopping counts these).
    pub since_best: u32,
    /// Evaluations without improvement since the last learning-rate reduction or improvement.
    plateau: u32,
    /// How many times the plateau rule has cut the learning rate.
    pub reductions: u32,
}

impl ValidHistory {
    /// Replays the `valid` MRRs of the metrics.jsonl lines in `text` (epoch lines in order).
    pub fn replay(text: &str, config: &Config) -> ValidHistory {
        let mut history = ValidHistory::default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let epoch = v.get("epoch").and_then(serde_json::Value::as_u64);
            let mrr = v.pointer("/valid/mrr").and_then(serde_json::Value::as_f64);
            if let (Some(epoch), Some(mrr)) = (epoch, mrr) {
                history.record(epoch as u32, mrr, config);
            }
        }
        history
    }

    /// Records epoch `epoch`'s validation MRR; returns whether it is the best so far (a tie
    /// keeps the earlier epoch).
    pub fn record(&mut self, epoch: u32, mrr: f64, config: &Config) -> bool {
        let improved = self.best.is_none_or(|(_, best)| mrr > best);
        if improved {
            self.best = Some((epoch, mrr));
            self.since_best = 0;
            self.plateau = 0;
            return true;
        }
        self.since_best += 1;
        let o = &config.optimizer;
        if o.plateau_factor < 1.0 {
            self.plateau += 1;
            if self.plateau >= o.plateau_patience {
                self.reductions += 1;
                self.plateau = 0;
            }
        }
        false
    }

    /// Whether early stopping ends training here.
    pub fn exhausted(&self, config: &Config) -> bool {
        let patience = config.evaluation.patience;
        patience > 0 && self.since_best >= patience
    }

    /// The learning rate of epoch `epoch` (from 1): linear warm-up over
    /// `optimizer.warmup_epochs`, then `optimizer.decay` per epoch, times `plateau_factor` per
    /// reduction so far.
    pub fn learning_rate(&self, epoch: u32, config: &Config) -> f32 {
        let o = &config.optimizer;
        let schedule = if epoch <= o.warmup_epochs {
            epoch as f32 / (o.warmup_epochs + 1) as f32
        } else {
            o.decay.powi((epoch - o.warmup_epochs - 1) as i32)
        };
        o.learning_rate * schedule * o.plateau_factor.powi(self.reductions as i32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sets: &[&str]) -> Config {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::parse("", &sets).unwrap()
    }

    #[test]
    fn patience_counts_evaluations_since_the_best() {
        let c = config(&["evaluation.epochs_per_eval=2", "evaluation.patience=2"]);
        let mut h = ValidHistory::default();
        assert!(h.record(2, 0.5, &c));
        assert!(!h.record(4, 0.5, &c), "a tie is no improvement");
        assert!(!h.exhausted(&c));
        assert!(h.record(6, 0.6, &c));
        assert!(!h.record(8, 0.59, &c));
        assert!(!h.record(10, 0.58, &c));
        assert!(h.exhausted(&c));
        assert_eq!(h.best, Some((6, 0.6)));
    }

    #[test]
    fn replay_reads_the_valid_lines_and_skips_the_rest() {
        let c = config(&["evaluation.epochs_per_eval=1", "evaluation.patience=1"]);
        let text = concat!(
            "{\"epoch\":1,\"loss\":3.0,\"valid\":{\"mrr\":0.3}}\n",
            "{\"epoch\":2,\"loss\":2.0}\n",
            "{\"epoch\":3,\"loss\":1.0,\"valid\":{\"mrr\":0.2}}\n",
            "{\"final\":true,\"split\":\"test\",\"metrics\":{\"mrr\":0.9}}\n",
            "not json\n"
        );
        let h = ValidHistory::replay(text, &c);
        assert_eq!(h.best, Some((1, 0.3)));
        assert_eq!(h.since_best, 1);
        assert!(h.exhausted(&c));
    }

    #[test]
    fn learning_rate_warms_up_decays_and_drops_on_plateaus() {
        let c = config(&[
            "optimizer.learning_rate=0.4",
            "optimizer.warmup_epochs=3",
            "optimizer.decay=0.5",
            "optimizer.plateau_factor=0.1",
            "optimizer.plateau_patience=2",
            "evaluation.epochs_per_eval=1",
        ]);
        let mut h = ValidHistory::default();
        let lr: Vec<f32> = (1..=6).map(|e| h.learning_rate(e, &c)).collect();
        assert_eq!(lr, [0.1, 0.2, 0.3, 0.4, 0.2, 0.1]);
        h.record(1, 0.5, &c);
        h.record(2, 0.4, &c);
        assert_eq!(h.reductions, 0);
        h.record(3, 0.4, &c);
        assert_eq!(h.reductions, 1);
        assert!((h.learning_rate(4, &c) - 0.04).abs() < 1e-7);
        // The defaults leave the rate alone.
        let plain = config(&[]);
        assert_eq!(ValidHistory::default().learning_rate(7, &plain), 0.1);
    }
}
