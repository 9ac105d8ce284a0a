//! The index of known true triples used by the filtered protocol, and entity degrees.

use legend_model::Side;
use rayon::slice::ParallelSliceMut;

use crate::EvalError;

/// Known true triples, grouped for both corruption sides.
///
/// For [`Side::Dst`] the key is (source, relation) and the candidates are the known
/// destinations; for [`Side::Src`] the key is (destination, relation) and the candidates are
/// the known sources. Each side is a sorted list of keys with offsets into one sorted,
/// deduplicated candidate array (compressed rows): 12 bytes per distinct triple and side, and a
/// binary search per query.
#[derive(Clone, Debug)]
pub struct FilterIndex {
    num_entities: usize,
    dst: Grouped,
    src: Grouped,
}

#[derive(Clone, Debug, Default)]
struct Grouped {
    /// `(anchor << 32) | relation`, sorted and unique.
    keys: Vec<u64>,
    /// `candidates[offsets[k]..offsets[k + 1]]` belong to `keys[k]`.
    offsets: Vec<usize>,
    candidates: Vec<u32>,
}

impl FilterIndex {
    /// Builds the index from slices of `[src, rel, dst]` triples (typically train, valid and
    /// test). Entity ids must be below `num_entities`; relation ids are only used as keys.
    /// Sorting runs on the current rayon pool.
    pub fn build(num_entities: usize, parts: &[&[[u32; 3]]]) -> Result<FilterIndex, EvalError> {
        for (part, triples) in parts.iter().enumerate() {
            for (index, t) in triples.iter().enumerate() {
                check_entities(t, num_entities, || {
                    format!("filter part {part}, triple {index}")
                })?;
            }
        }
        let dst = Grouped::build(parts, |[s, r, d]| (key(s, r), d));
        let src = Grouped::build(parts, |[s, r, d]| (key(d, r), s));
        Ok(FilterIndex {
            num_entities,
            dst,
            src,
        })
    }

    /// The number of entities the index was built for.
    pub fn num_entities(&self) -> usize {
        self.num_entities
    }

    /// The known true entities for `side` of a query: known destinations of (`anchor`, `rel`)
    /// for [`Side::Dst`], known sources of (`rel`, `anchor`) for [`Side::Src`]. Sorted, unique.
    pub fn candidates(&self, side: Side, anchor: u32, rel: u32) -> &[u32] {
        let g = match side {
            Side::Dst => &self.dst,
            Side::Src => &self.src,
        };
        match g.keys.binary_search(&key(anchor, rel)) {
            Ok(k) => &g.candidates[g.offsets[k]..g.offsets[k + 1]],
            Err(_) => &[],
        }
    }
}

fn key(anchor: u32, rel: u32) -> u64 {
    (u64::from(anchor) << 32) | u64::from(rel)
}

impl Grouped {
    fn build(parts: &[&[[u32; 3]]], split: impl Fn([u32; 3]) -> (u64, u32)) -> Grouped {
        let mut pairs: Vec<(u64, u32)> = parts
            .iter()
            .flat_map(|p| p.iter().map(|&t| split(t)))
            .collect();
        pairs.par_sort_unstable();
        // Train, valid and test may repeat triples; duplicates would be subtracted twice.
        pairs.dedup();
        let mut g = Grouped {
            offsets: vec![0],
            candidates: Vec::with_capacity(pairs.len()),
            ..Grouped::default()
        };
        for (k, c) in pairs {
            if g.keys.last() != Some(&k) {
                if !g.keys.is_empty() {
                    g.offsets.push(g.candidates.len());
                }
                g.keys.push(k);
            }
            g.candidates.push(c);
        }
        if !g.keys.is_empty() {
            g.offsets.push(g.candidates.len());
        }
        g
    }
}

/// Checks the entity ids of one triple; `at` names the triple for the error.
pub(crate) fn check_entities(
    t: &[u32; 3],
    num_entities: usize,
    at: impl Fn() -> String,
) -> Result<(), EvalError> {
    for (role, id) in [("source", t[0]), ("destination", t[2])] {
        if id as usize >= num_entities {
            return Err(EvalError::IdOutOfRange {
                at: at(),
                role,
                id,
                limit: num_entities,
            });
        }
    }
    Ok(())
}

/// Entity degrees (in + out, a self-loop counting twice) over slices of triples, for
/// degree-proportional negatives. Counts saturate at `u32::MAX`.
pub fn entity_degrees(num_entities: usize, parts: &[&[[u32; 3]]]) -> Result<Vec<u32>, EvalError> {
    let mut degrees = vec![0u32; num_entities];
    for (part, triples) in parts.iter().enumerate() {
        for (index, t) in triples.iter().enumerate() {
            check_entities(t, num_entities, || {
                format!("degree part {part}, triple {index}")
            })?;
            for e in [t[0], t[2]] {
                let d = &mut degrees[e as usize];
                *d = d.saturating_add(1);
            }
        }
    }
    Ok(degrees)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_both_sides_and_deduplicates() {
        let train = [[0, 1, 2], [0, 1, 3], [4, 1, 2], [0, 0, 2]];
        let test = [[0, 1, 2], [0, 1, 5]];
        let f = FilterIndex::build(6, &[&train, &test]).unwrap();
        assert_eq!(f.candidates(Side::Dst, 0, 1), &[2, 3, 5]);
        assert_eq!(f.candidates(Side::Dst, 0, 0), &[2]);
        assert_eq!(f.candidates(Side::Src, 2, 1), &[0, 4]);
        assert_eq!(f.candidates(Side::Src, 5, 1), &[0]);
        assert!(f.candidates(Side::Dst, 1, 1).is_empty());
        assert!(f.candidates(Side::Src, 0, 7).is_empty());
    }

    #[test]
    fn rejects_out_of_range_entities() {
        let err = FilterIndex::build(3, &[&[[0, 9, 1]], &[[0, 0, 3]]]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("filter part 1, triple 0") && msg.contains("destination id 3"));
        assert!(entity_degrees(2, &[&[[2, 0, 0]]]).is_err());
    }

    #[test]
    fn degrees_count_both_ends() {
        let d = entity_degrees(4, &[&[[0, 0, 1], [1, 0, 1]], &[[3, 2, 0]]]).unwrap();
        assert_eq!(d, vec![2, 3, 0, 1]);
    }
}
