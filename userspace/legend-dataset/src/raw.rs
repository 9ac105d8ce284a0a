//! What every input format is read into before import writes a dataset: edges with
//! provisional ids and the labels behind those ids.

use crate::Edge;

/// Label of the single relation of graphs without relation types.
pub const UNTYPED_RELATION: &str = "(untyped)";

/// Edges with provisional ids and the labels behind those ids.
pub(crate) struct RawGraph {
    pub entity_labels: Vec<Box<[u8]>>,
    pub relation_labels: Vec<Box<[u8]>>,
    pub has_relations: bool,
    pub splits: [Vec<Edge>; 3],
}
