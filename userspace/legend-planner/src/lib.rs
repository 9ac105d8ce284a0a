//! Legend partition planner.
//!
//! Out-of-core training splits node embeddings into N partitions by id range and edges into
//! N×N buckets; a GPU buffer holds C partitions. [`plan`] decides which partitions are
//! resident when (the buffer states), which partition each swap exchanges, and in what order
//! the buckets run so that swaps overlap with compute. [`predict`] applies Legend's
//! Theorem 3 to a plan. See `Documentation/planner.md`.

mod beta;
mod bucket;
mod cover;
mod error;
mod gpus;
mod hosts;
mod legend;
mod order;
mod parked;
mod plan;
mod predict;
mod search;
mod sequential;

pub use bucket::Bucket;
pub use error::{PlanError, PredictError, ValidationError};
pub use gpus::{GpuPlanError, GpuRound, GpuSchedule, HandOver, Piece, plan_gpus, validate_gpus};
pub use hosts::{HostTraffic, plan_hosts, validate_hosts};
pub use order::{Order, UnknownOrder};
pub use parked::MAX_PARKED_PARTITIONS;
pub use plan::{Plan, Swap, validate};
pub use predict::{Prediction, PredictionInput, predict};

/// The only capacity Legend's Algorithm 1 is defined for.
pub const LEGEND_CAPACITY: u32 = 3;

/// Plans one epoch over `num_partitions` partitions with a buffer of `capacity` partitions.
///
/// With `num_partitions ≤ capacity` every ordering yields one state holding all partitions and
/// every bucket in [`Plan::initial`]. The returned plan has passed [`validate`].
///
/// # Errors
///
/// [`PlanError::ZeroPartitions`] for N = 0; [`PlanError::CapacityTooSmall`] for C < 2 when
/// N > C; [`PlanError::UnsupportedCapacity`] for [`Order::Legend`] with C ≠ 3 (and N > C);
/// [`PlanError::Invalid`] if the produced plan fails validation, which is a planner bug.
pub fn plan(num_partitions: u32, capacity: u32, order: Order) -> Result<Plan, PlanError> {
    let n = num_partitions;
    let order = order.resolve(capacity);
    if n == 0 {
        return Err(PlanError::ZeroPartitions);
    }
    let states = if n <= capacity {
        vec![(0..n).collect()]
    } else if capacity < 2 {
        return Err(PlanError::CapacityTooSmall {
            capacity,
            num_partitions: n,
        });
    } else {
        match order {
            Order::Legend if capacity != LEGEND_CAPACITY => {
                return Err(PlanError::UnsupportedCapacity {
                    order,
                    capacity,
                    supported: LEGEND_CAPACITY,
                });
            }
            Order::Legend => legend::states(n),
            // `Auto` was resolved above; it never reaches here.
            Order::Beta | Order::Auto => beta::states(n, capacity),
            Order::Sequential => sequential::states(n, capacity),
        }
    };
    let plan = plan::build(order, n, capacity, states);
    validate(&plan).map_err(|source| PlanError::Invalid {
        order,
        num_partitions: n,
        capacity,
        source,
    })?;
    Ok(plan)
}
