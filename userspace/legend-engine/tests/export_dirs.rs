//! An export is assembled beside its output directory and takes its place in one step: an
//! export that fails, or that a crash interrupted, leaves the output as it was (never new
//! tables beside old ones), and what an interrupted one left is cleared by the next.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use legend_dataset::{GenerateOptions, generate};
use legend_engine::Config;
use legend_engine::export::{Format, export};
use legend_engine::session::Session;
use legend_fs::{Dir, Unguarded};

/// Every file under `dir` by name, with its bytes.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// Trains `run` (memory backend) up to `epochs`, from where it is.
fn train(ds: &Path, run: &Path, epochs: u32) {
    let sets = [format!("training.num_epochs={epochs}")];
    let mut session = if run.exists() {
        Session::resume(run, None, &sets, &Unguarded).unwrap()
    } else {
        let base = [
            "model.dim=4",
            "training.threads=1",
            "evaluation.protocol=sampled",
        ];
        let all: Vec<String> = base.iter().map(|s| s.to_string()).chain(sets).collect();
        Session::create(run, ds, Config::parse("", &all).unwrap(), &Unguarded).unwrap()
    };
    session.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
}

#[test]
fn a_failed_or_interrupted_export_leaves_the_output_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds");
    let mut o = GenerateOptions::new(200, 1000);
    o.relations = 2;
    generate(&o, &ds).unwrap();
    let run = tmp.path().join("run");
    train(&ds, &run, 1);
    let out = tmp.path().join("out");
    let staging = tmp.path().join(".out.exporting");
    for format in [Format::Npy, Format::Tsv] {
        let _ = std::fs::remove_dir_all(&out);
        export(&run, format, &out, None, &Unguarded).unwrap();
        let first = contents(&out);
        assert!(!staging.exists());
        // Trained further, its checkpoint then damaged: the export fails half-way through the
        // entities, and the first export stays whole.
        train(&ds, &run, 2);
        let meta = legend_engine::run::read_meta(&Dir::open(&run).unwrap()).unwrap();
        let table = run.join(&meta.checkpoint).join("entities.bin");
        let good = std::fs::read(&table).unwrap();
        let mut bad = good.clone();
        bad[good.len() / 2] ^= 0x40;
        std::fs::write(&table, &bad).unwrap();
        let err = export(&run, format, &out, None, &Unguarded).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
        assert!(
            contents(&out) == first,
            "{format:?}: a failed export changed the output"
        );
        assert!(
            !staging.exists(),
            "{format:?}: a failed export left its directory"
        );
        // What an interrupted export leaves (its directory beside the output, half written)
        // is cleared by the next, which replaces the first whole.
        std::fs::write(&table, &good).unwrap();
        std::fs::create_dir(&staging).unwrap();
        std::fs::write(staging.join("entities.npy"), b"half").unwrap();
        export(&run, format, &out, None, &Unguarded).unwrap();
        let second = contents(&out);
        assert_eq!(
            second.keys().collect::<Vec<_>>(),
            first.keys().collect::<Vec<_>>()
        );
        assert!(
            second != first,
            "{format:?}: the export of epoch 2 is not epoch 1's"
        );
        assert!(!staging.exists());
        let entries: Vec<PathBuf> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(entries.len(), 3, "{entries:?}");
        std::fs::remove_dir_all(&run).unwrap();
        train(&ds, &run, 1);
    }
}
