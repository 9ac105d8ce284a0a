//! A session writes its run directory beneath the directory it opened, never through a link:
//! a run moved away and replaced by a link mid-session, or links planted in it, redirect
//! nothing, and a guard that refuses a directory stops the run before anything is written there.

mod common;

use std::os::unix::fs::{MetadataExt, symlink};
use std::path::Path;

use legend_engine::Config;
use legend_engine::session::Session;
use legend_fs::{Dir, Guard, Unguarded};

use common::{chain, small_graph, train_to_the_end};

fn config(extra: &[&str]) -> Config {
    let mut sets: Vec<String> = [
        "model.dim=8",
        "storage.num_partitions=2",
        "training.threads=1",
        "training.batch_size=200",
        "training.checkpoint_every=1",
        "training.num_epochs=2",
        "evaluation.protocol=sampled",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    Config::parse("", &sets).unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_run_moved_away_and_replaced_by_a_link_is_still_written_where_it_went() {
    for backend in ["memory", "file"] {
        let tmp = tempfile::tempdir().unwrap();
        let ds = small_graph(tmp.path(), 500, 4000);
        let out = tmp.path().join("run");
        let decoy = tmp.path().join("decoy");
        std::fs::create_dir(&decoy).unwrap();
        let backend_key = format!("storage.backend={backend}");
        let mut session = Session::create(&out, &ds, config(&[&backend_key]), &Unguarded).unwrap();
        // The submitter's move: the run goes elsewhere, a link to a directory of its choice
        // takes its name.
        let moved = tmp.path().join("moved");
        std::fs::rename(&out, &moved).unwrap();
        symlink(&decoy, &out).unwrap();
        train_to_the_end(&mut session);
        drop(session);
        assert!(names(&decoy).is_empty(), "{backend}: {:?}", names(&decoy));
        let meta =
            legend_engine::run::read_meta(&legend_engine::run::open(&moved).unwrap()).unwrap();
        assert_eq!(meta.epochs_completed, 2, "{backend}");
        let metrics = std::fs::read_to_string(moved.join("metrics.jsonl")).unwrap();
        assert_eq!(
            metrics.lines().count(),
            3,
            "{backend}: two epochs and the final line"
        );
        assert!(names(&moved).contains(&"run.toml".to_string()));
    }
}

#[test]
fn links_planted_in_a_run_are_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 500, 4000);
    let out = tmp.path().join("run");
    let mut session =
        Session::create(&out, &ds, config(&["training.num_epochs=1"]), &Unguarded).unwrap();
    train_to_the_end(&mut session);
    drop(session);
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    std::fs::remove_file(out.join("metrics.jsonl")).unwrap();
    symlink(&victim, out.join("metrics.jsonl")).unwrap();
    let sets = ["training.num_epochs=2".to_string()];
    let e = Session::resume(&out, None, &sets, &Unguarded)
        .err()
        .expect("a link in place of metrics.jsonl is refused");
    assert!(chain(&e).contains("symbolic link"), "{e}");
    assert!(chain(&e).contains("metrics.jsonl"), "{e}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    // A link in place of config.toml is refused too: the run's configuration is not read from
    // wherever a link points.
    std::fs::remove_file(out.join("metrics.jsonl")).unwrap();
    std::fs::rename(out.join("config.toml"), tmp.path().join("config.toml")).unwrap();
    symlink(tmp.path().join("config.toml"), out.join("config.toml")).unwrap();
    let e = Session::resume(&out, None, &sets, &Unguarded)
        .err()
        .expect("a link in place of config.toml is refused");
    assert!(chain(&e).contains("symbolic link"), "{e}");
}

/// Refuses one directory (by inode), admits the rest.
struct Refuse(u64);

impl Guard for Refuse {
    fn admit(&self, dir: &Dir) -> std::io::Result<()> {
        if dir.metadata()?.ino() == self.0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "not the submitter's directory",
            ));
        }
        Ok(())
    }
}

#[test]
fn a_directory_the_guard_refuses_is_never_written() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 500, 4000);
    let other = tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let refuse = Refuse(std::fs::metadata(&other).unwrap().ino());
    // A store outside the run, in the refused directory: the run is refused and removed.
    let out = tmp.path().join("run");
    let store = format!("storage.path={}", other.join("store").display());
    let e = Session::create(
        &out,
        &ds,
        config(&["storage.backend=file", &store]),
        &refuse,
    )
    .err()
    .expect("the store's directory is refused");
    assert!(chain(&e).contains("not the submitter's directory"), "{e}");
    assert!(!out.exists(), "a refused run leaves no directory");
    assert!(names(&other).is_empty(), "{:?}", names(&other));
    // A run in the refused directory.
    let e = Session::create(&other.join("run"), &ds, config(&[]), &refuse)
        .err()
        .expect("the run's parent is refused");
    assert!(chain(&e).contains("not the submitter's directory"), "{e}");
    assert!(names(&other).is_empty());
    // An export into it, of a run trained elsewhere.
    let mut session =
        Session::create(&out, &ds, config(&["training.num_epochs=1"]), &Unguarded).unwrap();
    train_to_the_end(&mut session);
    drop(session);
    let e = legend_engine::export::export(
        &out,
        legend_engine::export::Format::Npy,
        &other.join("export"),
        None,
        &refuse,
    )
    .expect_err("the export's parent is refused");
    assert!(chain(&e).contains("not the submitter's directory"), "{e}");
    assert!(names(&other).is_empty());
    // A record its caller refuses exports nothing, naming the record.
    let e = legend_engine::export::export_expecting(
        &out,
        legend_engine::export::Format::Npy,
        &tmp.path().join("refused-export"),
        None,
        &refuse,
        &|meta| Err(format!("{} entities, not the run submitted", meta.entities)),
    )
    .expect_err("the record is refused");
    assert!(
        chain(&e).contains("run.toml: ") && chain(&e).contains("entities, not the run submitted"),
        "{e}"
    );
    assert!(!tmp.path().join("refused-export").exists());
    // The same export where the guard admits it lands there.
    legend_engine::export::export(
        &out,
        legend_engine::export::Format::Npy,
        &tmp.path().join("export"),
        None,
        &refuse,
    )
    .unwrap();
    assert_eq!(
        names(&tmp.path().join("export")),
        [
            "entities.labels.txt",
            "entities.npy",
            "relations.labels.txt",
            "relations.npy"
        ]
    );
}
