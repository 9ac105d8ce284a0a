//! Errors of planning, validation and prediction.

use thiserror::Error;

use crate::bucket::Bucket;
use crate::order::Order;

/// Why no plan was produced.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// `num_partitions` was 0.
    #[error("num_partitions must be at least 1, got 0")]
    ZeroPartitions,
    /// The buffer cannot hold two partitions while there are more partitions than slots.
    #[error(
        "capacity must be at least 2 when num_partitions ({num_partitions}) > capacity, got {capacity}"
    )]
    CapacityTooSmall {
        /// Requested buffer capacity.
        capacity: u32,
        /// Requested number of partitions.
        num_partitions: u32,
    },
    /// The ordering is only defined for some capacities.
    #[error(
        "order `{order}` supports capacity {supported} only, got {capacity} (order `auto` plans any capacity)"
    )]
    UnsupportedCapacity {
        /// Requested ordering.
        order: Order,
        /// Requested buffer capacity.
        capacity: u32,
        /// The capacity the ordering supports.
        supported: u32,
    },
    /// The planner produced a plan that fails validation: a planner bug.
    #[error(
        "internal planner bug, {order} plan for N={num_partitions}, C={capacity} is invalid: {source}"
    )]
    Invalid {
        /// Ordering that produced the plan.
        order: Order,
        /// Number of partitions.
        num_partitions: u32,
        /// Buffer capacity.
        capacity: u32,
        /// What the validator found.
        #[source]
        source: ValidationError,
    },
}

/// The first rule a plan breaks; see [`crate::validate`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// The plan has no buffer state at all.
    #[error("plan has no buffer states")]
    NoStates,
    /// A state lists a partition id ≥ N.
    #[error("state {state} holds partition {partition}, but N = {num_partitions}")]
    PartitionOutOfRange {
        /// Index into `states`.
        state: usize,
        /// The offending partition.
        partition: u32,
        /// Number of partitions.
        num_partitions: u32,
    },
    /// A state is not strictly increasing (unsorted or a repeated partition).
    #[error("state {state} is not a sorted list of distinct partitions")]
    StateNotSorted {
        /// Index into `states`.
        state: usize,
    },
    /// More partitions resident than the buffer holds.
    #[error("state {state} holds {len} partitions, capacity is {capacity}")]
    OverCapacity {
        /// Index into `states`.
        state: usize,
        /// Partitions in the state.
        len: usize,
        /// Buffer capacity.
        capacity: u32,
    },
    /// Consecutive states differ by other than exactly one evicted and one loaded partition.
    #[error("states {state} -> {} do not differ by exactly one swap", state + 1)]
    NotOneSwap {
        /// Index of the earlier state.
        state: usize,
    },
    /// `swaps.len()` is not `states.len() - 1`.
    #[error("{swaps} swaps for {states} states")]
    SwapCount {
        /// Length of `swaps`.
        swaps: usize,
        /// Length of `states`.
        states: usize,
    },
    /// A swap's `evicted`/`loaded` disagree with the states around it.
    #[error("swap {swap} says evict {evicted} load {loaded}, which is not what the states do")]
    SwapMismatch {
        /// Index into `swaps`.
        swap: usize,
        /// The swap's `evicted`.
        evicted: u32,
        /// The swap's `loaded`.
        loaded: u32,
    },
    /// Property (1) of Theorem 1: the partition loaded by a swap is evicted by the next one.
    #[error("swap {swap} evicts partition {partition}, loaded by the previous swap (property 1)")]
    Property1 {
        /// Index into `swaps` of the offending eviction.
        swap: usize,
        /// The partition.
        partition: u32,
    },
    /// A bucket names a partition ≥ N.
    #[error("bucket {bucket:?} is out of range for N = {num_partitions}")]
    BucketOutOfRange {
        /// The bucket.
        bucket: Bucket,
        /// Number of partitions.
        num_partitions: u32,
    },
    /// A bucket is scheduled twice.
    #[error("bucket {bucket:?} is scheduled more than once")]
    DuplicateBucket {
        /// The bucket.
        bucket: Bucket,
    },
    /// A bucket is never scheduled.
    #[error("bucket {bucket:?} is never scheduled")]
    MissingBucket {
        /// The first missing bucket in row-major order.
        bucket: Bucket,
    },
    /// A bucket runs while one of its partitions is not resident.
    #[error("bucket {bucket:?} runs in {group} without both partitions resident")]
    NotResident {
        /// The bucket.
        bucket: Bucket,
        /// Where it was scheduled, e.g. `initial` or `swap 3 overlap`.
        group: String,
    },
    /// `order` is not `initial` followed by each swap's `overlap` and `after`.
    #[error("`order` is not the concatenation of the initial, overlap and after groups")]
    OrderMismatch,
    /// `io_count`, `volume` or `swaps_without_overlap` disagree with the states and swaps.
    #[error("summary field `{field}` is inconsistent with the states and swaps")]
    Summary {
        /// The field's JSON name.
        field: &'static str,
    },
}

/// Why a prediction could not be made.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum PredictError {
    /// Per-bucket edge counts were given, but not N² of them.
    #[error("expected {expected} per-bucket edge counts (N²), got {got}")]
    BucketCountLength {
        /// N².
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// An input that must be positive and finite was not.
    #[error("`{name}` must be positive and finite, got {value}")]
    NonPositive {
        /// The input's name.
        name: &'static str,
        /// Its value.
        value: f64,
    },
}
