//! What can be wrong with the inputs of an evaluation.

/// An input that cannot be evaluated; the message names what is wrong.
///
/// A message never repeats its cause: where there is one, it is returned by
/// [`std::error::Error::source`] only, so a report that walks the chain prints it once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvalError {
    /// The embedding dimension does not suit the decoder (zero, or odd for ComplEx).
    #[error("bad embedding dimension: {0}")]
    Dim(legend_model::DimError),
    /// A table's length is not a multiple of its row width, or it has no rows.
    #[error(
        "{table} table has {len} floats, which is not a positive multiple of its row width {dim}"
    )]
    TableSize {
        /// "entity" or "relation".
        table: &'static str,
        /// Its length in floats.
        len: usize,
        /// Floats of its rows: the embedding dimension, or the decoder's relation width
        /// (RESCAL's `dim²`).
        dim: usize,
    },
    /// An entity or relation id is not below the number of rows it indexes.
    #[error("{at}: {role} id {id} out of range (there are {limit})")]
    IdOutOfRange {
        /// Which triple, e.g. "triple 17".
        at: String,
        /// "source", "relation" or "destination".
        role: &'static str,
        /// The offending id.
        id: u32,
        /// The number of entities or relations.
        limit: usize,
    },
    /// The filter index was built for another number of entities than the table has.
    #[error("the filter index was built for {index} entities but the entity table has {table}")]
    FilterSize {
        /// Entities of the index.
        index: usize,
        /// Rows of the entity table.
        table: usize,
    },
    /// The degree list does not have one entry per entity.
    #[error("{len} entity degrees given for {table} entities")]
    DegreesLen {
        /// Entries given.
        len: usize,
        /// Rows of the entity table.
        table: usize,
    },
    /// Degree-proportional negatives were asked for, but every degree is zero.
    #[error("every entity degree is zero: cannot draw degree-proportional negatives")]
    ZeroDegrees,
    /// The sampled protocol was asked for with no negatives at all.
    #[error("the sampled protocol needs at least one negative (uniform + degree = 0)")]
    NoNegatives,
    /// So many negatives that their rows would not fit in memory.
    #[error("{uniform} uniform + {degree} degree negatives are too many to gather")]
    TooManyNegatives {
        /// Uniform negatives asked for.
        uniform: usize,
        /// Degree negatives asked for.
        degree: usize,
    },
    /// There is nothing to rank.
    #[error("no triples to rank")]
    NoTriples,
    /// The rayon pool could not be built.
    #[error("cannot build the evaluation thread pool")]
    ThreadPool(#[from] rayon::ThreadPoolBuildError),
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::EvalError;

    #[test]
    fn the_thread_pool_error_is_a_source_not_part_of_the_message() {
        // A second global pool is always refused, whatever the tests ran before.
        let _ = rayon::ThreadPoolBuilder::new().build_global();
        let cause = rayon::ThreadPoolBuilder::new()
            .build_global()
            .expect_err("the global pool exists");
        let cause_text = cause.to_string();
        let err = EvalError::from(cause);
        assert_eq!(err.to_string(), "cannot build the evaluation thread pool");
        let source = err.source().expect("the rayon error is the source");
        assert_eq!(source.to_string(), cause_text);
        assert!(!err.to_string().contains(&cause_text));
    }
}
