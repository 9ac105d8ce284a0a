//! The orderings the planner knows.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// Which partition-swap ordering to plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Legend's order where it applies (capacity 3), BETA at any other capacity: the default,
    /// so that every capacity ≥ 2 plans. A plan records the order it resolved to.
    Auto,
    /// Legend's Algorithm 1 (buffer states) and Algorithm 2 (bucket order); capacity 3 only.
    Legend,
    /// Marius's BETA ordering, with an exhaustively searched tail; any capacity ≥ 2.
    Beta,
    /// Naive row-by-row baseline for ablations; any capacity ≥ 2.
    Sequential,
}

impl Order {
    /// Every ordering, in the order the documentation lists them.
    pub const ALL: [Order; 4] = [Order::Auto, Order::Legend, Order::Beta, Order::Sequential];

    /// The name used by `FromStr`, `Display` and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Order::Auto => "auto",
            Order::Legend => "legend",
            Order::Beta => "beta",
            Order::Sequential => "sequential",
        }
    }
}

impl Order {
    /// The order [`Order::Auto`] stands for at `capacity`; any other order itself.
    pub fn resolve(self, capacity: u32) -> Order {
        match self {
            Order::Auto if capacity == crate::LEGEND_CAPACITY => Order::Legend,
            Order::Auto => Order::Beta,
            other => other,
        }
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is none of [`Order::ALL`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown order `{0}` (expected auto, legend, beta or sequential)")]
pub struct UnknownOrder(pub String);

impl FromStr for Order {
    type Err = UnknownOrder;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Order::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| UnknownOrder(s.to_owned()))
    }
}
