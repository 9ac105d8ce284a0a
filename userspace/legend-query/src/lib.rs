//! Queries on a trained Legend run, shared by `legendctl predict | score | neighbors` and
//! legendd's serve jobs:
//!
//! * **predict**: the K entities that best complete `(head, relation, ?)` or
//!   `(?, relation, tail)`, scored by the run's own decoder exactly as the evaluator scores
//!   them; with `filtered`, entities forming a known triple (train, valid or test) are left
//!   out, through legend-eval's [`legend_eval::FilterIndex`];
//! * **score**: the score of given triples;
//! * **neighbors**: the K nearest entities of an entity (cosine, dot or L2);
//! * **lookup**: an entity's row.
//!
//! Top-K is exact: every entity is scored, on every core, and ties are broken by the lower id
//! (NaN scores last), so an answer never depends on the thread count or the partitioning.
//! Entities and relations are named by their dataset labels (or by id); an unknown name is an
//! error naming it. A run is answered either from memory ([`Residency::Resident`]) or straight
//! from its checkpoint or store, for runs larger than memory ([`Residency::Streamed`]: the rows
//! of the entities a batch names read alone, and the table read once, a piece at a time
//! through the training swap path, to score every entity); [`Residency::Fitting`] picks by the
//! memory available, and a served run ([`QueryRun::open_served`]) by the memory it may take.
//!
//! On a GPU ([`GpuOptions`], [`QueryRun::open_on`]) the entity rows go into GPU memory when they
//! fit, and legend-cuda's scan answers `predict` and `neighbors` with the CPU's answers, bit for
//! bit; a larger table is streamed to the GPU's scans, and its rows are looked up through
//! legend-cuda's row cache over the run's own store ([`store_row_cache`]).

mod error;
mod gpu;
mod model;
mod names;
mod query;
mod topk;

pub use error::QueryError;
pub use gpu::{DEFAULT_CACHE_FRACTION, GpuOptions, RowCacheError, store_row_cache, store_table};
pub use model::{Completion, Metric, Model, Nearest};
pub use query::{
    Answer, DEFAULT_TOP, Hit, LineKind, Named, Query, QueryRun, Residency, parse_line,
};
pub use topk::{Ranked, TopK};
