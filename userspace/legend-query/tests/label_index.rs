//! The label index a query command keeps in the run (`RUN/index/`): reused while the dataset's
//! label file is the one it was built from (its length and CRC-32), rebuilt when that file
//! changed or the index is damaged, never trusted then; answers the same whether the index was built, reused, mapped
//! or read, and whether the rows were mapped from the checkpoint or read.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use legend_dataset::{Dataset, GenerateOptions, generate};
use legend_engine::run;
use legend_fs::Unguarded;
use legend_query::{Answer, GpuOptions, Query, QueryRun, Residency};

/// Entities: enough for the index to be kept (tables of 2^16 labels or more).
const ENTITIES: u64 = 70_000;
const DIM: usize = 4;

/// A generated dataset of [`ENTITIES`] (labels `e<id>`) and a DistMult run on it, its rows on
/// a grid (ties abound) in a committed checkpoint; returns the run and the dataset.
fn run_and_dataset(dir: &Path) -> (PathBuf, PathBuf) {
    let ds = dir.join("ds");
    let mut o = GenerateOptions::new(ENTITIES, 200_000);
    o.relations = 3;
    generate(&o, &ds).unwrap();
    let dataset = Dataset::open(&ds).unwrap();
    let out = dir.join("run");
    std::fs::create_dir(&out).unwrap();
    let identity = format!("{:032x}", dataset.meta().identity());
    let meta = common::run_meta(
        (ds.clone(), identity),
        "distmult",
        (ENTITIES, DIM),
        (3, false),
    );
    let rows = common::grid(ENTITIES as usize * DIM, 7);
    run::commit_checkpoint(
        &legend_fs::Dir::open(&out).unwrap(),
        meta,
        (&common::grid(3 * DIM, 8), &[0.0; 3 * DIM]),
        |e, es| {
            e.write(&rows)?;
            es.write(&rows)
        },
    )
    .unwrap();
    (out, ds)
}

/// Queries by label over the whole table: the first, a middle and the last entity.
fn queries() -> Vec<Query> {
    let mut q = Vec::new();
    for e in ["e0", "e34567", "e69999"] {
        q.push(Query::Predict {
            head: Some(e.into()),
            relation: "r1".into(),
            tail: None,
            top: 5,
            filtered: true,
        });
        q.push(Query::Neighbors {
            entity: e.into(),
            top: 5,
            metric: legend_query::Metric::Cosine,
        });
        q.push(Query::Lookup { entity: e.into() });
    }
    q
}

fn answer(q: &QueryRun) -> Vec<Answer> {
    q.answer(&queries(), 100, &|i| format!("query {}", i + 1))
        .unwrap()
}

/// The kept index's inode (a rebuilt index is a new file) and size.
fn index_file(run: &Path) -> (u64, u64) {
    let m = std::fs::metadata(run.join("index/entities.tsv.index")).unwrap();
    (m.ino(), m.len())
}

/// Opens `run` as a query command does (files mapped, the index kept).
fn command(run: &Path) -> QueryRun {
    QueryRun::open(run, None, &Unguarded, Residency::Fitting).unwrap()
}

/// Opens `run` as a daemon's serve job does (files mapped where only this user may write
/// them, else read; the run not written).
fn served(run: &Path) -> QueryRun {
    QueryRun::open_served(
        run,
        None,
        Arc::new(Unguarded),
        &GpuOptions::cpu(),
        None,
        &|_| Ok(()),
    )
    .unwrap()
}

#[test]
fn a_kept_index_is_reused_and_rebuilt_when_damaged_never_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let (run, _) = run_and_dataset(dir.path());
    // Read whole, from the checkpoint, built in memory: what every later open must answer.
    let want = answer(&served(&run));
    assert!(!run.join("index").exists(), "a served run is not written");
    let first = command(&run);
    assert!(first.model().is_mapped());
    assert_eq!(answer(&first), want, "built, rows mapped");
    drop(first);
    let kept = index_file(&run);
    assert_eq!(answer(&command(&run)), want, "reused");
    assert_eq!(index_file(&run), kept, "reused, not rebuilt");
    assert_eq!(answer(&served(&run)), want, "reused by a served run");
    // Damaged: one bit of a hash, of an id, of a line start, the header; cut short; emptied.
    let path = run.join("index/entities.tsv.index");
    let whole = std::fs::read(&path).unwrap();
    let n = whole.len();
    let flips = [n / 2, n - 3, 6 * 8 + 5, 4 * 8, 5 * 8];
    for at in flips {
        let mut bytes = whole.clone();
        bytes[at] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        // A served run neither trusts it nor writes the run.
        let before = index_file(&run);
        assert_eq!(answer(&served(&run)), want, "byte {at} flipped, served");
        assert_eq!(index_file(&run), before, "a served run left it");
        assert_eq!(answer(&command(&run)), want, "byte {at} flipped");
        assert_ne!(index_file(&run).0, before.0, "byte {at} flipped: rebuilt");
        assert_eq!(std::fs::read(&path).unwrap(), whole, "rebuilt as it was");
    }
    for len in [n - 8, 40, 0] {
        std::fs::write(&path, &whole[..len]).unwrap();
        assert_eq!(answer(&command(&run)), want, "cut to {len} bytes");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            whole,
            "cut to {len} bytes: rebuilt"
        );
    }
}

#[test]
fn a_changed_label_file_is_indexed_again_never_answered_from_the_old_index() {
    let dir = tempfile::tempdir().unwrap();
    let (run, ds) = run_and_dataset(dir.path());
    let want = answer(&command(&run));
    let kept = index_file(&run);
    // The same labels with two swapped (as long as before, in place): e0 is now entity 1, e1
    // entity 0.
    let labels = ds.join("entities.tsv");
    let text = std::fs::read_to_string(&labels).unwrap();
    let swapped = text.replacen("0\te0\n1\te1\n", "0\te1\n1\te0\n", 1);
    assert_ne!(swapped, text);
    std::fs::write(&labels, &swapped).unwrap();
    let q = command(&run);
    let id = |label: &str| common::id_of(&q, label);
    assert_eq!((id("e0"), id("e1"), id("e2")), (1, 0, 2));
    assert_ne!(index_file(&run).0, kept.0, "indexed again");
    // The other answers name the same entities as before, e0's now those of row 1.
    let now = answer(&q);
    assert_eq!(now[3..], want[3..]);
    assert_ne!(now[..3], want[..3]);
    drop(q);
    // Back as it was: answered as at first (and indexed again: the file is another one now).
    std::fs::write(&labels, &text).unwrap();
    assert_eq!(answer(&command(&run)), want);
    // A label file of another length (a label more) is refused as before, whatever is kept.
    std::fs::write(&labels, format!("{text}70000\te70000\n")).unwrap();
    let Err(e) = QueryRun::open(&run, None, &Unguarded, Residency::Fitting) else {
        panic!("opened with a label too many");
    };
    assert!(
        e.to_string()
            .contains("holds 70001 labels, dataset.toml says 70000"),
        "{e}"
    );
}

#[test]
fn a_checkpoint_damaged_since_it_was_written_is_refused_mapped_or_read() {
    let dir = tempfile::tempdir().unwrap();
    let (run, _) = run_and_dataset(dir.path());
    let meta = run::read_meta(&run::open(&run).unwrap()).unwrap();
    let file = run.join(&meta.checkpoint).join("entities.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[12345] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let mapped = QueryRun::open(&run, None, &Unguarded, Residency::Fitting).err();
    // Writable by its group: a served run reads it into memory rather than mapping it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o664)).unwrap();
    let read = QueryRun::open_served(
        &run,
        None,
        Arc::new(Unguarded),
        &GpuOptions::cpu(),
        None,
        &|_| Ok(()),
    )
    .err();
    for (how, e) in [("mapped", mapped), ("read", read)] {
        let msg = e.unwrap_or_else(|| panic!("{how}: answered")).to_string();
        assert!(
            msg.contains("entities.bin") && msg.contains("checksum mismatch"),
            "{how}: {msg}"
        );
    }
}

#[test]
fn a_served_run_is_opened_by_the_record_its_caller_checked() {
    let dir = tempfile::tempdir().unwrap();
    let (run, _) = run_and_dataset(dir.path());
    // The check sees the record the run is opened by; a refusal names the record and why.
    let seen = std::cell::Cell::new(0u64);
    let expect = |meta: &run::RunMeta| {
        seen.set(meta.entities);
        Err("names another store than at submission".to_owned())
    };
    let Err(e) = QueryRun::open_served(
        &run,
        None,
        Arc::new(Unguarded),
        &GpuOptions::cpu(),
        None,
        &expect,
    ) else {
        panic!("opened though its record was refused");
    };
    assert!(
        e.to_string()
            .contains("run.toml: names another store than at submission"),
        "{e}"
    );
    assert_eq!(seen.get(), ENTITIES);
}

#[test]
fn a_served_run_maps_the_files_only_its_user_can_change_and_reads_the_others() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (run, ds) = run_and_dataset(dir.path());
    let want = answer(&command(&run));
    let meta = run::read_meta(&run::open(&run).unwrap()).unwrap();
    let rows = run.join(&meta.checkpoint).join("entities.bin");
    let index = run.join("index/entities.tsv.index");
    let labels = ds.join("entities.tsv");
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    // Its user's own files (the checkpoint, the labels, the index the command kept), no one
    // else may write (whatever this process's umask made them): mapped as the command maps
    // them, nothing copied, nothing written.
    for file in [&rows, &index, &labels, &ds.join("relations.tsv")] {
        mode(file, 0o644);
    }
    let kept = index_file(&run);
    let first = served(&run);
    assert!(first.model().is_mapped());
    assert_eq!(first.copied(), Vec::<String>::new());
    assert_eq!(answer(&first), want);
    drop(first);
    assert_eq!(index_file(&run), kept, "a served run writes nothing");
    // A file its group or others may write could change under a mapping after it was checked:
    // read into memory, checked there, the answers the same; the others still mapped.
    for (file, m, who) in [
        (&rows, 0o664, "writable by its group (mode 664)"),
        (&index, 0o646, "writable by others (mode 646)"),
        (
            &labels,
            0o666,
            "writable by its group and others (mode 666)",
        ),
    ] {
        mode(file, m);
        let q = served(&run);
        assert_eq!(
            q.copied(),
            vec![format!("{}: {who}", file.display())],
            "{}",
            file.display()
        );
        assert_eq!(q.model().is_mapped(), file != &rows);
        assert_eq!(answer(&q), want, "{} read", file.display());
        mode(file, 0o644);
    }
    // Another user's file, however its mode (only root can give one away here; the run this
    // process made is its user's).
    if std::fs::metadata(&run).unwrap().uid() == 0 {
        std::os::unix::fs::chown(&labels, Some(4321), None).unwrap();
        let q = served(&run);
        assert_eq!(
            q.copied(),
            vec![format!(
                "{}: owned by uid 4321 (this process runs as uid 0)",
                labels.display()
            )]
        );
        assert_eq!(answer(&q), want);
        // A query command is its user's own: it maps what it may read.
        assert_eq!(command(&run).copied(), Vec::<String>::new());
    }
}
