//! How far an epoch has trained: what a checkpoint taken inside an epoch records.
//!
//! An epoch walks the plan's buffer states in order; state `s` (from 0) has a group of buckets —
//! the plan's initial buckets for state 0, the overlap and after buckets of swap `s - 1`
//! otherwise — each trained batch by batch in its own edge order. A cut names the state and,
//! inside its group, the bucket and batch to continue from: since every random draw of a batch
//! is keyed by (epoch, bucket, batch within the bucket) (legend-model's `BatchKey`), training
//! from a cut repeats exactly what the uninterrupted epoch would have done.

use serde::{Deserialize, Serialize};

/// The version of the keys training draws its random streams from, recorded in run.toml
/// (`batch_keys`): 1 keys by (epoch, bucket, batch within the bucket); runs written before it
/// (no `batch_keys`, read as 0) keyed by a batch counter over the epoch.
pub const BATCH_KEYS_VERSION: u32 = 1;

/// Where an interrupted epoch stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochCut {
    /// The epoch (from 1).
    pub epoch: u32,
    /// Swaps finished: the epoch stopped in the plan's buffer state `swaps`.
    pub swaps: u32,
    /// Where that state's bucket group continues; `None` when it is complete (the next step
    /// is swap `swaps`). Cuts written before batch keys have none: they were all taken there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<BatchCursor>,
    /// Positive edges trained.
    pub edges: u64,
    /// Loss summed over them.
    pub loss: f64,
    /// The epoch ran on K workers (`training.gpus`): `swaps` counts the rounds of their
    /// schedule trained (`next` is none: they stop between rounds). None: one trainer's plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<u32>,
    /// The workers were spread over this many hosts (`training.hosts` > 1; their schedule is
    /// not one host's): only the same layout finishes the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosts: Option<u32>,
}

/// A batch of a bucket: the group's buckets before it are trained, and so are
/// its own batches before `batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchCursor {
    /// The bucket, `[source partition, destination partition]` (the data's, as keyed).
    pub bucket: [u32; 2],
    /// Batches of it already trained.
    pub batch: u64,
}

impl EpochCut {
    /// In words, for logs: `after 5 of its swaps`, `in bucket (2, 3) at batch 7 after 5 swaps`,
    /// `after 3 of its rounds` (K workers).
    pub fn describe(&self) -> String {
        if let Some(hosts) = self.hosts {
            return format!("after {} of its rounds on {hosts} hosts", self.swaps);
        }
        if self.workers.is_some() {
            return format!("after {} of its rounds", self.swaps);
        }
        match self.next {
            None => format!("after {} of its swaps", self.swaps),
            Some(c) => format!(
                "in bucket ({}, {}) at batch {} after {} of its swaps",
                c.bucket[0], c.bucket[1], c.batch, self.swaps
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_written_before_batch_keys_read_as_complete_groups() {
        // A cut as stores and run.toml recorded it before this version (a batch counter).
        let old = "epoch = 3\nswaps = 5\nbatches = 812\nedges = 81200\nloss = 12.5\n";
        let cut: EpochCut = toml::from_str(old).unwrap();
        assert_eq!(
            cut,
            EpochCut {
                epoch: 3,
                swaps: 5,
                next: None,
                edges: 81200,
                loss: 12.5,
                workers: None,
                hosts: None,
            }
        );
        let new = EpochCut {
            next: Some(BatchCursor {
                bucket: [2, 3],
                batch: 7,
            }),
            ..cut
        };
        let text = toml::to_string(&new).unwrap();
        assert_eq!(toml::from_str::<EpochCut>(&text).unwrap(), new);
        assert_eq!(
            new.describe(),
            "in bucket (2, 3) at batch 7 after 5 of its swaps"
        );
    }
}
