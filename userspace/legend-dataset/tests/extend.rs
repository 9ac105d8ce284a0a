//! `import --extend BASE --add DELTA`: append-only ids, the added edges recorded as such, and
//! the refusals of a base whose labels cannot be matched or a delta read otherwise.

use std::path::{Path, PathBuf};

mod common;

use legend_dataset::{Columns, Dataset, ImportInput, ImportOptions, Split, import};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The base: 5 entities, 2 relations, imported with a seed that permutes its ids.
fn base(dir: &Path) -> PathBuf {
    let train = write(
        dir,
        "train.tsv",
        "a\tr\tb\nb\tr\tc\nc\ts\td\nd\ts\te\ne\tr\ta\n",
    );
    let test = write(dir, "test.tsv", "a\ts\tc\n");
    let out = dir.join("base");
    let mut options = ImportOptions::new(ImportInput::Files {
        train,
        valid: None,
        test: Some(test),
    });
    options.seed = 7;
    import(&options, &out).unwrap();
    out
}

fn extend(base: &Path, train: PathBuf, test: Option<PathBuf>) -> ImportOptions {
    ImportOptions::new(ImportInput::Extend {
        base: base.to_owned(),
        train,
        valid: None,
        test,
    })
}

#[test]
fn extending_keeps_every_id_and_appends_new_labels_and_edges() {
    let dir = tempfile::tempdir().unwrap();
    let base_dir = base(dir.path());
    let old = Dataset::open(&base_dir).unwrap();
    // f and g are new, t a new relation; c—d an added edge between old entities; the test edge
    // names h, which no train edge has: dropped.
    let delta = write(
        dir.path(),
        "delta.tsv",
        "f\tr\ta\nc\tt\tg\nc\tr\td\ng\ts\tf\n",
    );
    let delta_test = write(dir.path(), "delta-test.tsv", "f\ts\tg\nh\tr\ta\n");
    let out = dir.path().join("grown");
    let summary = import(&extend(&base_dir, delta, Some(delta_test)), &out).unwrap();
    assert_eq!(summary.unseen_dropped, 1);
    let new = Dataset::open(&out).unwrap();
    let (om, nm) = (old.meta(), new.meta());
    assert_eq!((nm.entities, nm.relations), (7, 3));
    let ext = nm.extends.as_ref().expect("the extension is recorded");
    assert_eq!((ext.entities, ext.relations), (5, 2));
    assert_eq!(ext.splits, om.splits);
    assert_eq!(ext.base_identity, format!("{:032x}", om.identity()));
    // Every old id keeps its label; the new ones follow in order of first appearance.
    let (oe, ne) = (old.entity_labels().unwrap(), new.entity_labels().unwrap());
    assert_eq!(ne[..5], oe[..]);
    assert_eq!(ne[5..], ["f".to_string(), "g".into()]);
    assert_eq!(
        new.relation_labels().unwrap()[..2],
        old.relation_labels().unwrap()[..]
    );
    // The base's edges first, unchanged, then the added ones.
    for split in Split::ALL {
        let (o, n) = (old.edges(split).unwrap(), new.edges(split).unwrap());
        assert_eq!(n[..o.len()], o[..], "{split:?}");
    }
    let train = common::labelled(&new, Split::Train);
    let strs = |v: &[(&str, &str, &str)]| -> Vec<(String, String, String)> {
        v.iter()
            .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
            .collect()
    };
    assert_eq!(
        train[5..],
        strs(&[
            ("f", "r", "a"),
            ("c", "t", "g"),
            ("c", "r", "d"),
            ("g", "s", "f")
        ])[..]
    );
    assert_eq!(
        common::labelled(&new, Split::Test)[1..],
        strs(&[("f", "s", "g")])[..]
    );
    // An extension of the extension keeps both generations' ids.
    let more = write(dir.path(), "more.tsv", "i\tr\tf\n");
    let out2 = dir.path().join("grown2");
    import(&extend(&out, more, None), &out2).unwrap();
    let again = Dataset::open(&out2).unwrap();
    assert_eq!(again.entity_labels().unwrap()[..7], ne[..]);
    assert_eq!(again.meta().extends.as_ref().unwrap().entities, 7);
}

/// Asserts that extending failed naming every `needle`, leaving no output.
fn assert_refused(options: &ImportOptions, out: &Path, needles: &[&str]) {
    let err = import(options, out).unwrap_err().to_string();
    for n in needles {
        assert!(err.contains(n), "error {err:?} lacks {n:?}");
    }
    assert!(!out.exists());
    let parent = out.parent().unwrap();
    for e in std::fs::read_dir(parent).unwrap() {
        let name = e.unwrap().file_name();
        assert!(
            !name.to_string_lossy().starts_with('.'),
            "a staging directory {name:?} was left behind"
        );
    }
}

#[test]
fn a_base_whose_labels_cannot_be_matched_or_a_delta_read_otherwise_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let base_dir = base(dir.path());
    let delta = write(dir.path(), "delta.tsv", "f\tr\ta\n");
    let out = dir.path().join("grown");
    // A delta read without relation types, of a base that has them.
    let mut sd = extend(&base_dir, delta.clone(), None);
    sd.columns = Columns::Sd;
    assert_refused(&sd, &out, &["--columns sd", "has relation types"]);
    // The base's entities renumbered: a line's id is not its position.
    let labels = base_dir.join("entities.tsv");
    let good = std::fs::read_to_string(&labels).unwrap();
    std::fs::write(&labels, good.replacen("1\t", "9\t", 1)).unwrap();
    assert_refused(
        &extend(&base_dir, delta.clone(), None),
        &out,
        &[
            "entities.tsv",
            "line 2 holds id \"9\" where id 1 was expected",
        ],
    );
    // One label under two ids.
    let first = good.lines().next().unwrap().split('\t').nth(1).unwrap();
    let dup: String = good
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i == 1 {
                format!("1\t{first}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(&labels, dup).unwrap();
    assert_refused(
        &extend(&base_dir, delta.clone(), None),
        &out,
        &["entities.tsv", "has two ids, 0 and 1"],
    );
    std::fs::write(&labels, good).unwrap();
    // An edge file changed since the base was imported.
    let edges = base_dir.join("edges/train.bin");
    let mut bytes = std::fs::read(&edges).unwrap();
    bytes.swap(0, 12);
    bytes.swap(4, 16);
    bytes.swap(8, 20);
    std::fs::write(&edges, bytes).unwrap();
    assert_refused(
        &extend(&base_dir, delta, None),
        &out,
        &["train.bin", "the base changed since it was imported"],
    );
}
