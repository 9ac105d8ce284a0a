//! A run records its store in run.toml before making it (the intent record: members and the
//! store's identity) and marks it made afterwards. Every state a crash can leave between the
//! two, on files and behind the proxy controller, one member or striped over two, outside the
//! run directory, is built here as the crash leaves it, and the resume must finish with exactly
//! the tables of an uninterrupted run; a store that is not the run's own, at the same paths, is
//! refused and left as it was.

mod common;

use std::path::{Path, PathBuf};

use legend_engine::Config;
use legend_engine::run::{self, RunMeta, Tables};
use legend_engine::session::Session;
use legend_fs::{Dir, Unguarded};

use common::{chain, small_graph, train_to_the_end};

/// A store backend and where its members go.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// `file`, at `storage.path`.
    File,
    /// `proxy`, its backing file at `storage.path`.
    Proxy,
    /// `file`, striped over two `[[storage.device]]` files.
    FileStriped,
    /// `proxy`, striped over two backing files.
    ProxyStriped,
}

impl Layout {
    const ALL: [Layout; 4] = [
        Layout::File,
        Layout::Proxy,
        Layout::FileStriped,
        Layout::ProxyStriped,
    ];

    fn striped(self) -> bool {
        matches!(self, Layout::FileStriped | Layout::ProxyStriped)
    }

    fn on_files(self) -> bool {
        matches!(self, Layout::File | Layout::FileStriped)
    }

    /// The members of a store named `name` in `dir`.
    fn members(self, dir: &Path, name: &str) -> Vec<PathBuf> {
        if self.striped() {
            vec![
                dir.join(format!("{name}-a.bin")),
                dir.join(format!("{name}-b.bin")),
            ]
        } else {
            vec![dir.join(format!("{name}.bin"))]
        }
    }

    /// The configuration of a run with its store on `members`.
    fn config(self, members: &[PathBuf], extra: &[&str]) -> Config {
        let backend = if self.on_files() { "file" } else { "proxy" };
        let mut sets: Vec<String> = [
            "model.dim=8",
            "storage.num_partitions=3",
            "storage.buffer_capacity=2",
            "training.threads=1",
            "training.batch_size=200",
            "training.num_epochs=2",
            "evaluation.protocol=sampled",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        sets.push(format!("storage.backend={backend}"));
        let quoted = |p: &PathBuf| format!("\"{}\"", p.display());
        if self.striped() {
            let devices: Vec<String> = members
                .iter()
                .map(|m| format!("{{path={}}}", quoted(m)))
                .collect();
            sets.push(format!("storage.device=[{}]", devices.join(", ")));
            sets.push("storage.stripe_bytes=65536".into());
        } else {
            sets.push(format!("storage.path={}", quoted(&members[0])));
        }
        sets.extend(extra.iter().map(|s| s.to_string()));
        Config::parse("", &sets).unwrap()
    }
}

fn meta(out: &Path) -> RunMeta {
    run::read_meta(&Dir::open(out).unwrap()).unwrap()
}

fn write_meta(out: &Path, meta: &RunMeta) {
    let text = toml::to_string_pretty(meta).unwrap();
    run::write_atomically(&Dir::open(out).unwrap(), run::META_FILE, text.as_bytes()).unwrap();
}

fn tables(out: &Path) -> Tables {
    let dir = Dir::open(out).unwrap();
    run::load_tables(&dir, &run::read_meta(&dir).unwrap(), &Unguarded).unwrap()
}

fn zero(path: &Path, range: std::ops::Range<u64>) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![0; (range.end - range.start) as usize], range.start)
        .unwrap();
    f.sync_all().unwrap();
}

/// What a crash between the intent record and the record of the made store can leave of the
/// members (run.toml then says `store_creating = true`).
#[derive(Clone, Copy, Debug)]
enum Crash {
    /// Before anything was made (the files were never created).
    NothingMade,
    /// After the proxy's backing files were sized, or the temporary files made, and both
    /// superblock slots wiped: no signature yet.
    SlotsWiped,
    /// While generation 0 was written to the first member: its magic and identity are there,
    /// its checksum fails; the other members' slots are wiped.
    GenerationZeroTorn,
    /// On files: every member made under its temporary name, all but the last renamed.
    NotAllRenamed,
    /// After the store was made whole (generation 0 on every member, in place).
    Made,
}

impl Crash {
    const ALL: [Crash; 5] = [
        Crash::NothingMade,
        Crash::SlotsWiped,
        Crash::GenerationZeroTorn,
        Crash::NotAllRenamed,
        Crash::Made,
    ];

    /// Turns a made store's `members` into what the crash left.
    fn leave(self, layout: Layout, members: &[PathBuf]) {
        let slots = 0..2 << 20;
        match self {
            Crash::NothingMade => members
                .iter()
                .for_each(|m| std::fs::remove_file(m).unwrap()),
            Crash::SlotsWiped => members.iter().for_each(|m| zero(m, slots.clone())),
            Crash::GenerationZeroTorn => {
                // The superblock's first 256 bytes (magic, identity) written, the rest not.
                zero(&members[0], 256..4096);
                members[1..].iter().for_each(|m| zero(m, slots.clone()));
            }
            Crash::NotAllRenamed => {
                assert!(layout.on_files());
                let last = members.last().expect("a member");
                std::fs::rename(last, last.with_extension("creating")).unwrap();
            }
            Crash::Made => {}
        }
    }
}

/// Makes the run `out` with its store, then sets its record back to the intent (as a crash
/// before the store was recorded as made leaves it) and the members to what `crash` leaves.
fn crashed_while_creating(
    ds: &Path,
    out: &Path,
    layout: Layout,
    members: &[PathBuf],
    crash: Crash,
) -> RunMeta {
    drop(Session::create(out, ds, layout.config(members, &[]), &Unguarded).unwrap());
    let mut m = meta(out);
    assert!(m.store_id.is_some() && !m.store_creating, "{m:?}");
    m.store_creating = true;
    write_meta(out, &m);
    crash.leave(layout, members);
    m
}

#[test]
fn a_run_stopped_while_it_created_its_store_resumes_from_the_start() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    // The proxy's backing files in memory where the machine has it (as the other proxy tests).
    let stores = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    for layout in Layout::ALL {
        let reference = tmp.path().join(format!("{layout:?}-reference"));
        let members = layout.members(stores.path(), &format!("{layout:?}-reference"));
        let mut session =
            Session::create(&reference, &ds, layout.config(&members, &[]), &Unguarded).unwrap();
        train_to_the_end(&mut session);
        drop(session);
        let want = tables(&reference);
        for crash in Crash::ALL {
            if matches!(crash, Crash::NotAllRenamed) && !layout.on_files() {
                continue;
            }
            let what = format!("{layout:?}, {crash:?}");
            let out = tmp.path().join(format!("{layout:?}-{crash:?}"));
            let members = layout.members(stores.path(), &format!("{layout:?}-{crash:?}"));
            let intent = crashed_while_creating(&ds, &out, layout, &members, crash);
            // Nothing to read yet: said as such.
            let dir = Dir::open(&out).unwrap();
            let err = run::load_tables(&dir, &intent, &Unguarded).unwrap_err();
            assert!(
                err.to_string()
                    .contains("stopped while it created its store"),
                "{what}: {err}"
            );
            let mut session = Session::resume(&out, None, &[], &Unguarded)
                .unwrap_or_else(|e| panic!("{what}: {}", chain(&e)));
            train_to_the_end(&mut session);
            drop(session);
            let done = meta(&out);
            assert!(!done.store_creating, "{what}: {done:?}");
            assert_eq!(
                (&done.store_id, &done.store, &done.store_members),
                (&intent.store_id, &intent.store, &intent.store_members),
                "{what}: the store the intent named"
            );
            assert!(
                tables(&out) == want,
                "{what}: differs from the uninterrupted run"
            );
            for m in &members {
                assert!(!m.with_extension("creating").exists(), "{what}");
            }
        }
    }
}

/// A run's creation stopped before its intent was recorded (right after the run directory
/// appeared): run.toml names no store, and none was made. The resume makes it.
#[test]
fn a_run_stopped_before_its_store_was_recorded_makes_it_on_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    let layout = Layout::Proxy;
    let members = layout.members(tmp.path(), "store");
    let out = tmp.path().join("run");
    drop(Session::create(&out, &ds, layout.config(&members, &[]), &Unguarded).unwrap());
    let mut m = meta(&out);
    (m.store, m.store_queue, m.store_id) = (None, None, None);
    write_meta(&out, &m);
    std::fs::remove_file(&members[0]).unwrap();
    let mut session = Session::resume(&out, None, &[], &Unguarded).unwrap();
    train_to_the_end(&mut session);
    let done = meta(&out);
    assert!(done.store.is_some() && done.store_id.is_some() && !done.store_creating);
}

/// Another run's store at the paths a stopped creation recorded is refused (not overwritten:
/// its bytes are unchanged), whether the run's record is the intent or names the made store;
/// and another run cannot take a store whose creation was stopped without `force`.
#[test]
fn another_runs_store_at_the_same_paths_is_refused_and_left_as_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    let stores = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    for layout in [Layout::File, Layout::Proxy, Layout::ProxyStriped] {
        let members = layout.members(stores.path(), &format!("{layout:?}"));
        let a = tmp.path().join(format!("{layout:?}-a"));
        crashed_while_creating(&ds, &a, layout, &members, Crash::Made);
        // Run b at the same paths: refused, a's half-made store is not b's to take.
        let b = tmp.path().join(format!("{layout:?}-b"));
        let err = Session::create(&b, &ds, layout.config(&members, &[]), &Unguarded)
            .err()
            .expect("a's store is refused to b");
        assert!(
            chain(&err).contains("Legend store signature"),
            "{layout:?}: {}",
            chain(&err)
        );
        assert!(!b.exists(), "{layout:?}: a refused run leaves no directory");
        // Unless b forces it (a's store was abandoned, says its user): then a must not take
        // b's store back.
        let forced = layout.config(&members, &["storage.force=true"]);
        let mut session = Session::create(&b, &ds, forced, &Unguarded).unwrap();
        train_to_the_end(&mut session);
        drop(session);
        let bytes = |ms: &[PathBuf]| {
            ms.iter()
                .map(|m| std::fs::read(m).unwrap())
                .collect::<Vec<_>>()
        };
        let b_store = bytes(&members);
        let err = Session::resume(&a, None, &[], &Unguarded)
            .err()
            .expect("b's store is refused to a");
        let err = chain(&err);
        assert!(
            err.contains("Legend store signature")
                && err.contains(&members[0].display().to_string()),
            "{layout:?}: {err}"
        );
        assert!(
            bytes(&members) == b_store,
            "{layout:?}: b's store was written"
        );
        // a's record naming its store as made: b's store is refused by its identity, though
        // it is of the same dataset and shape.
        let mut made = meta(&a);
        made.store_creating = false;
        write_meta(&a, &made);
        let err = chain(
            &Session::resume(&a, None, &[], &Unguarded)
                .err()
                .expect("b's store is refused to a"),
        );
        assert!(
            err.contains("another store was put in its place")
                && err.contains(made.store_id.as_deref().unwrap()),
            "{layout:?}: {err}"
        );
        // The run's error names the store; the store's own words follow as its source.
        let err = chain(&run::load_tables(&Dir::open(&a).unwrap(), &made, &Unguarded).unwrap_err());
        assert!(
            err.contains("another store was put in its place"),
            "{layout:?}: {err}"
        );
        assert!(
            bytes(&members) == b_store,
            "{layout:?}: b's store was written"
        );
        // b itself still reads its tables.
        tables(&b);
    }
}

/// A store inside the run directory that the run's record does not name (a store a build from
/// before intent records left half-made, or anybody's) is not the run's to overwrite.
#[test]
fn a_store_the_record_does_not_name_is_refused_even_in_the_run_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    let out = tmp.path().join("run");
    let config = Config::parse(
        "",
        &[
            "model.dim=8".into(),
            "training.num_epochs=1".into(),
            "storage.backend=file".into(),
        ],
    )
    .unwrap();
    drop(Session::create(&out, &ds, config, &Unguarded).unwrap());
    let mut m = meta(&out);
    (m.store, m.store_id) = (None, None);
    write_meta(&out, &m);
    let store = out.join("store.bin");
    let before = std::fs::read(&store).unwrap();
    let err = chain(
        &Session::resume(&out, None, &[], &Unguarded)
            .err()
            .expect("refused"),
    );
    assert!(err.contains("Legend store signature"), "{err}");
    assert!(std::fs::read(&store).unwrap() == before);
}

/// A proxy's backing file that holds something else (here a small file with an ext4 superblock)
/// is refused as it is: not grown to the store's size first; and a backing file the refused
/// creation made for another member is removed again.
#[test]
fn a_proxy_backing_file_of_something_else_is_not_grown() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = small_graph(tmp.path(), 400, 3000);
    let mut image = vec![0u8; 8192];
    image[1080..1082].copy_from_slice(&[0x53, 0xef]);
    for layout in [Layout::Proxy, Layout::ProxyStriped] {
        let members = layout.members(tmp.path(), &format!("{layout:?}"));
        let fs = members.last().unwrap();
        std::fs::write(fs, &image).unwrap();
        let out = tmp.path().join(format!("{layout:?}-run"));
        let err = Session::create(&out, &ds, layout.config(&members, &[]), &Unguarded)
            .err()
            .expect("refused");
        assert!(
            chain(&err).contains("ext2/3/4 signature"),
            "{layout:?}: {}",
            chain(&err)
        );
        assert!(std::fs::read(fs).unwrap() == image, "{layout:?}");
        for m in &members[..members.len() - 1] {
            assert!(!m.exists(), "{layout:?}: {} left", m.display());
        }
        assert!(!out.exists(), "{layout:?}");
    }
}
