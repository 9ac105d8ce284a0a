//! Import behaviour on real files: formats, splits, unseen edges and every kind of bad input.

use std::io::Write;
use std::path::{Path, PathBuf};

mod common;

use legend_dataset::{Columns, Dataset, DatasetError, ImportInput, ImportOptions, Split, import};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn files(train: PathBuf, valid: Option<PathBuf>, test: Option<PathBuf>) -> ImportOptions {
    ImportOptions::new(ImportInput::Files { train, valid, test })
}

/// Asserts that the import failed with a message containing every `needle` and left no file.
fn assert_fails(options: &ImportOptions, dir: &Path, needles: &[&str]) {
    let out = dir.join("out");
    let before: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let err = import(options, &out).unwrap_err().to_string();
    for n in needles {
        assert!(err.contains(n), "error {err:?} lacks {n:?}");
    }
    let after: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after, "a failed import left files behind");
}

/// Labels of the edges of `split` in `ds`, sorted (the import's order is its own).
fn labelled(ds: &Dataset, split: Split) -> Vec<(String, String, String)> {
    let mut v = common::labelled(ds, split);
    v.sort();
    v
}

#[test]
fn separate_files_round_trip_through_labels() {
    let dir = tempfile::tempdir().unwrap();
    let train = write(
        dir.path(),
        "train.tsv",
        "# comment\na\tlikes\tb\n\nb\tlikes\tc\r\nc\thates\ta\n",
    );
    let valid = write(dir.path(), "valid.tsv", "a\thates\tc\n");
    let test = write(dir.path(), "test.tsv", "b\thates\ta\n");
    let out = dir.path().join("ds");
    let s = import(&files(train, Some(valid), Some(test)), &out).unwrap();
    assert_eq!(
        (s.entities, s.relations, s.train, s.valid, s.test),
        (3, 2, 3, 1, 1)
    );
    let ds = Dataset::open(&out).unwrap();
    let t = |a: &str, r: &str, b: &str| (a.to_string(), r.to_string(), b.to_string());
    assert_eq!(
        labelled(&ds, Split::Train),
        vec![
            t("a", "likes", "b"),
            t("b", "likes", "c"),
            t("c", "hates", "a")
        ]
    );
    assert_eq!(labelled(&ds, Split::Valid), vec![t("a", "hates", "c")]);
    assert_eq!(labelled(&ds, Split::Test), vec![t("b", "hates", "a")]);
    // A text file that `cat` and editors show whole.
    let meta = std::fs::read_to_string(out.join(legend_dataset::META_FILE)).unwrap();
    assert!(meta.ends_with('\n'), "dataset.toml lacks a final newline");
}

#[test]
fn column_orders_gzip_and_delimiters() {
    let dir = tempfile::tempdir().unwrap();
    let gz = dir.path().join("edges.csv.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::fast(),
    );
    enc.write_all(b"a,b,r1\nb,c,r2\n").unwrap();
    enc.finish().unwrap();
    let mut opts = files(gz, None, None);
    opts.columns = Columns::Htr;
    let out = dir.path().join("ds");
    let s = import(&opts, &out).unwrap();
    assert_eq!((s.entities, s.relations, s.train), (3, 2, 2));
    let ds = Dataset::open(&out).unwrap();
    assert!(labelled(&ds, Split::Train).contains(&("a".into(), "r1".into(), "b".into())));

    let social = write(dir.path(), "social.txt", "1 2\n2   3\n3 1\n");
    let mut opts = files(social, None, None);
    opts.columns = Columns::Sd;
    let s = import(&opts, &dir.path().join("social")).unwrap();
    assert_eq!((s.entities, s.relations, s.train), (3, 1, 3));
    assert!(
        !Dataset::open(dir.path().join("social"))
            .unwrap()
            .meta()
            .has_relations
    );
}

#[test]
fn ids_are_a_seeded_permutation() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..200).map(|i| format!("n{i}\tr\tn{}\n", i + 1)).collect();
    let train = write(dir.path(), "train.tsv", &text);
    let ids = |seed: u64, name: &str| {
        let mut o = files(train.clone(), None, None);
        o.seed = seed;
        import(&o, &dir.path().join(name)).unwrap();
        Dataset::open(dir.path().join(name))
            .unwrap()
            .entity_labels()
            .unwrap()
    };
    let (a, b, c) = (ids(1, "a"), ids(1, "b"), ids(2, "c"));
    assert_eq!(a, b, "same seed, same ids");
    assert_ne!(a, c, "another seed permutes differently");
    let mut sorted = a.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 201);
    assert_ne!(
        a[..10],
        (0..10).map(|i| format!("n{i}")).collect::<Vec<_>>()[..],
        "ids are not in input order"
    );
}

#[test]
fn unseen_valid_test_edges_are_dropped_or_kept() {
    let dir = tempfile::tempdir().unwrap();
    let train = write(dir.path(), "train.tsv", "a\tr\tb\nb\tr\tc\n");
    let valid = write(dir.path(), "valid.tsv", "a\tr\tc\na\tr\tz\na\tq\tb\n");
    let s = import(
        &files(train.clone(), Some(valid.clone()), None),
        &dir.path().join("drop"),
    )
    .unwrap();
    assert_eq!(
        (s.valid, s.unseen_dropped, s.entities, s.relations),
        (1, 2, 3, 1)
    );
    let mut keep = files(train, Some(valid), None);
    keep.keep_unseen = true;
    let s = import(&keep, &dir.path().join("keep")).unwrap();
    assert_eq!(
        (s.valid, s.unseen_kept, s.entities, s.relations),
        (3, 2, 4, 2)
    );
}

#[test]
fn split_by_fraction_is_exact_and_seeded() {
    let dir = tempfile::tempdir().unwrap();
    // A ring so every entity is in train whatever the split.
    let text: String = (0..1000)
        .map(|i| format!("n{}\tr\tn{}\n", i % 50, (i * 7 + 1) % 50))
        .collect();
    let f = write(dir.path(), "all.tsv", &text);
    let opts = ImportOptions {
        keep_unseen: true,
        ..ImportOptions::new(ImportInput::Split {
            files: vec![f],
            fractions: [0.8, 0.1, 0.1],
        })
    };
    let s = import(&opts, &dir.path().join("a")).unwrap();
    assert_eq!((s.train, s.valid, s.test), (800, 100, 100));
    import(&opts, &dir.path().join("b")).unwrap();
    let read = |n: &str| std::fs::read(dir.path().join(n).join("edges/test.bin")).unwrap();
    assert_eq!(read("a"), read("b"));
    let bad = ImportOptions::new(ImportInput::Split {
        files: vec![dir.path().join("all.tsv")],
        fractions: [0.8, 0.3, 0.1],
    });
    assert!(
        import(&bad, &dir.path().join("c"))
            .unwrap_err()
            .to_string()
            .contains("summing to 1")
    );
}

#[test]
fn bad_inputs_name_file_and_line_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: Vec<(&str, &str, Vec<&str>)> = vec![
        (
            "missing.tsv",
            "a\tr\tb\nc\tr\n",
            vec!["missing.tsv:2:", "missing column"],
        ),
        (
            "extra.tsv",
            "a\tr\tb\n\na\tr\tb\tx\n",
            vec!["extra.tsv:3:", "wrong column count"],
        ),
        (
            "emptyfield.tsv",
            "a\t\tb\n",
            vec!["emptyfield.tsv:1:", "empty field in column 2"],
        ),
        ("empty.tsv", "", vec!["empty.tsv", "no edges"]),
        (
            "comments.tsv",
            "# only\n\n#x\n",
            vec!["comments.tsv", "no edges"],
        ),
    ];
    for (name, text, needles) in cases {
        let path = write(d, name, text);
        assert_fails(&files(path.clone(), None, None), d, &needles);
        std::fs::remove_file(path).unwrap();
    }
    // A file that claims to be gzip but is cut short.
    let gz = d.join("broken.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(&b"a\tr\tb\n".repeat(10_000)).unwrap();
    let bytes = enc.finish().unwrap();
    std::fs::write(&gz, &bytes[..bytes.len() / 2]).unwrap();
    assert_fails(&files(gz.clone(), None, None), d, &["broken.gz"]);
    std::fs::remove_file(gz).unwrap();
    // A missing file names itself.
    assert_fails(&files(d.join("nope.tsv"), None, None), d, &["nope.tsv"]);
    // An existing output directory is never overwritten.
    let train = write(d, "ok.tsv", "a\tr\tb\n");
    std::fs::create_dir(d.join("out")).unwrap();
    let err = import(&files(train, None, None), &d.join("out")).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
}

#[test]
fn cancelled_import_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let train = write(dir.path(), "t.tsv", "a\tr\tb\n");
    let mut opts = files(train, None, None);
    opts.cancel = Some(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
        true,
    )));
    let out = dir.path().join("out");
    assert!(matches!(
        import(&opts, &out),
        Err(DatasetError::Interrupted)
    ));
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "only the input remains");
}

fn write_marius(dir: &Path, rows: &[[i32; 3]], yaml_extra: &str) {
    std::fs::create_dir_all(dir.join("edges")).unwrap();
    let bytes: Vec<u8> = rows
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(dir.join("edges/train_edges.bin"), bytes).unwrap();
    std::fs::write(
        dir.join("dataset.yaml"),
        format!(
            "dataset_dir: x\nnum_nodes: 4\nnum_relations: 2\nnum_train: {}\n{yaml_extra}",
            rows.len()
        ),
    )
    .unwrap();
}

#[test]
fn marius_directories_import_and_bad_ids_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("marius");
    write_marius(&m, &[[0, 0, 1], [1, 1, 2], [2, 0, 3]], "");
    let s = import(
        &ImportOptions::new(ImportInput::Marius { dir: m.clone() }),
        &dir.path().join("ds"),
    )
    .unwrap();
    assert_eq!((s.entities, s.relations, s.train), (4, 2, 3));
    let ds = Dataset::open(dir.path().join("ds")).unwrap();
    assert!(labelled(&ds, Split::Train).contains(&("1".into(), "1".into(), "2".into())));

    let bad = dir.path().join("bad");
    write_marius(&bad, &[[0, 0, 1], [1, 5, 9]], "");
    let err = import(
        &ImportOptions::new(ImportInput::Marius { dir: bad }),
        &dir.path().join("ds2"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("row 1"), "{err}");
    assert!(!dir.path().join("ds2").exists());
}

#[test]
fn partitioning_saves_and_reloads_and_changes_with_n() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..500)
        .map(|i| format!("n{}\tr{}\tn{}\n", i % 37, i % 3, (i * 11 + 5) % 37))
        .collect();
    let train = write(dir.path(), "t.tsv", &text);
    import(&files(train, None, None), &dir.path().join("ds")).unwrap();
    let ds = Dataset::open(dir.path().join("ds")).unwrap();
    for n in [1, 4, 7] {
        let made = ds.partition(n).unwrap();
        let loaded = ds.buckets(n).unwrap();
        assert_eq!(made.edges(), loaded.edges());
        assert_eq!(made.counts().iter().sum::<u64>(), 500);
        assert_eq!(made.counts().len(), (n * n) as usize);
    }
    // Damaged bucket files are refused, not trusted.
    let off = dir.path().join("ds/edges/train.buckets-4.offsets");
    let mut bytes = std::fs::read(&off).unwrap();
    bytes[8] ^= 0xff;
    std::fs::write(&off, bytes).unwrap();
    assert!(
        ds.buckets(4)
            .unwrap_err()
            .to_string()
            .contains("train.buckets-4.offsets")
    );
    assert!(
        ds.partition(38)
            .unwrap_err()
            .to_string()
            .contains("38 partitions for 37 entities")
    );
}
