//! What the dataset tests share.

use legend_dataset::{Dataset, Split};

/// The labels of each edge of `split` in `ds`, in the dataset's order, for comparing against
/// the input text.
pub fn labelled(ds: &Dataset, split: Split) -> Vec<(String, String, String)> {
    let ents = ds.entity_labels().unwrap();
    let rels = ds.relation_labels().unwrap();
    ds.edges(split)
        .unwrap()
        .iter()
        .map(|e| {
            (
                ents[e[0] as usize].clone(),
                rels[e[1] as usize].clone(),
                ents[e[2] as usize].clone(),
            )
        })
        .collect()
}
