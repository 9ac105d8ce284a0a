//! A text file's first line that names its columns instead of holding an edge
//! (`head<TAB>relation<TAB>tail`, `subject,predicate,object`): imported as an edge it would add
//! a relation called "relation" and two entities to the graph.
//!
//! With [`Header::Auto`] (the default) the first data line of each file is a header when every
//! field is a usual column name ([`is_column_name`]): it is skipped, with a warning naming the
//! line. A first line that is not, but whose labels occur nowhere else in the inputs (a header
//! of other names looks like that), is imported, with a warning naming the line.
//! [`Header::Yes`] skips the first data line of every file; [`Header::No`] imports every line.

use std::str::FromStr;

use rayon::prelude::*;

use crate::Edge;

/// Whether text files start with a header line (`legendctl import --header`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Header {
    /// A first line of column names is a header; others are edges (see the module).
    #[default]
    Auto,
    /// The first data line of every file is a header.
    Yes,
    /// No file has a header.
    No,
}

impl FromStr for Header {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Header::Auto),
            "yes" => Ok(Header::Yes),
            "no" => Ok(Header::No),
            _ => Err(format!(
                "unknown header choice {s:?}: expected auto, yes or no"
            )),
        }
    }
}

/// Names that header lines of edge lists give their columns (compared in lower case, without
/// spaces, `_`, `-` or `:`, so that `Head_Entity` and Neo4j's `:START_ID` match).
const COLUMN_NAMES: &[&str] = &[
    "head",
    "headentity",
    "relation",
    "rel",
    "relationship",
    "relationtype",
    "edgetype",
    "type",
    "predicate",
    "pred",
    "tail",
    "tailentity",
    "subject",
    "sub",
    "object",
    "obj",
    "source",
    "src",
    "sourceid",
    "target",
    "dst",
    "destination",
    "targetid",
    "from",
    "to",
    "startid",
    "endid",
    "node1",
    "node2",
    "entity1",
    "entity2",
    "h",
    "r",
    "t",
    "s",
    "p",
    "o",
];

/// Whether `field` is a usual column name.
fn is_column_name(field: &[u8]) -> bool {
    let name: String = String::from_utf8_lossy(field)
        .chars()
        .filter(|c| !matches!(c, ' ' | '_' | '-' | ':'))
        .flat_map(char::to_lowercase)
        .collect();
    COLUMN_NAMES.contains(&name.as_str())
}

/// Whether a line's `fields` (head, relation if any, tail) are all column names, and different
/// ones: a header, not an edge.
pub(crate) fn names_columns(fields: &[&[u8]]) -> bool {
    fields.iter().all(|f| is_column_name(f))
        && fields
            .iter()
            .enumerate()
            .all(|(i, f)| !fields[..i].contains(f))
}

/// Whether none of the labels of the edge at `splits[split][index]` occurs in another edge
/// (`typed`: its relation counts too): a first line unlike the rest. Stops at the first other
/// occurrence, which a real edge's entities soon have.
pub(crate) fn is_isolated(
    splits: &[Vec<Edge>; 3],
    split: usize,
    index: usize,
    typed: bool,
) -> bool {
    let [h, r, t] = splits[split][index];
    let shares =
        |e: &Edge| e[0] == h || e[2] == h || e[0] == t || e[2] == t || (typed && e[1] == r);
    !splits.iter().enumerate().any(|(s, edges)| {
        edges
            .par_iter()
            .enumerate()
            .any(|(i, e)| (s, i) != (split, index) && shares(e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_names_make_a_header() {
        let header = |line: &str| {
            let fields: Vec<&[u8]> = line.split('\t').map(str::as_bytes).collect();
            names_columns(&fields)
        };
        assert!(header("head\trelation\ttail"));
        assert!(header("Subject\tPredicate\tObject"));
        assert!(header(":START_ID\t:TYPE\t:END_ID"));
        assert!(header("source\ttarget"));
        assert!(!header("aspirin\ttreats\theadache"));
        assert!(
            !header("head\thead\ttail"),
            "the same name twice is an edge"
        );
        assert_eq!("yes".parse::<Header>(), Ok(Header::Yes));
        assert!("maybe".parse::<Header>().is_err());
    }

    #[test]
    fn an_edge_is_isolated_when_no_other_shares_a_label() {
        let splits = [
            vec![[0, 0, 1], [2, 1, 3], [3, 1, 2]],
            vec![[4, 2, 2]],
            vec![],
        ];
        assert!(is_isolated(&splits, 0, 0, true));
        assert!(!is_isolated(&splits, 0, 1, true));
        // Shares only its relation with another edge: isolated when relations do not count.
        let splits = [vec![[0, 0, 1], [2, 0, 3]], vec![], vec![]];
        assert!(!is_isolated(&splits, 0, 0, true));
        assert!(is_isolated(&splits, 0, 0, false));
    }
}
