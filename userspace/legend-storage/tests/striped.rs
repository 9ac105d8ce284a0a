//! A store striped over several files: where its bytes go, the commit rule across members
//! (a crash between two members' superblock writes) and every refusal of a member.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use legend_storage::{
    CreateOptions, DatasetId, Dtype, Expect, IoBuffer, IoConfig, IoRequest, Region,
    SUPERBLOCK_SLOT_BYTES, Store, StoreError, StoreSpec, Target,
};

const UNIT: u64 = 64 << 10;

fn spec() -> StoreSpec {
    StoreSpec {
        dataset: DatasetId {
            id: [4; 16],
            label: "striped".into(),
        },
        num_nodes: 2_001,
        dim: 50,
        dtype: Dtype::F32,
        state_width: 1,
        num_partitions: 3,
        aux_bytes: 5_000,
        progress_capacity: 64,
        shadow: true,
    }
}

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("legend-striped-test")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

fn paths(dir: &tempfile::TempDir, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| dir.path().join(format!("member{i}.bin")))
        .collect()
}

fn targets(paths: &[PathBuf]) -> Vec<Target<'_>> {
    paths.iter().map(|p| Target::Path(p)).collect()
}

fn create(paths: &[PathBuf]) -> Store {
    let opts = CreateOptions {
        stripe_bytes: UNIT,
        ..CreateOptions::default()
    };
    Store::create_striped(&targets(paths), &spec(), &opts).unwrap()
}

fn open(paths: &[PathBuf]) -> Result<Store, StoreError> {
    let expect = Expect {
        dataset: Some(spec().dataset),
        ..Expect::default()
    };
    Store::open_striped(&targets(paths), &expect, &IoConfig::default())
}

/// Partition `p` filled with bytes that depend on `seed` and the position.
fn filled(store: &Store, p: u32, seed: u8) -> IoBuffer {
    let mut b = IoBuffer::new(store.max_partition_bytes()).unwrap();
    let len = store.partition(p).unwrap().bytes as usize;
    for (i, v) in b.as_bytes_mut()[..len].iter_mut().enumerate() {
        *v = (i as u64 * 31 + u64::from(seed) * 7 + u64::from(p)) as u8;
    }
    b
}

fn read(store: &mut Store, p: u32) -> Vec<u8> {
    let mut b = IoBuffer::new(store.max_partition_bytes()).unwrap();
    store.read(Region::Partition(p), &mut b).unwrap();
    b.as_bytes()[..store.partition(p).unwrap().bytes as usize].to_vec()
}

fn write_all(store: &mut Store, seed: u8) -> Vec<Vec<u8>> {
    let bufs: Vec<IoBuffer> = (0..3).map(|p| filled(store, p, seed)).collect();
    let mut reqs: Vec<IoRequest<'_>> = bufs
        .iter()
        .enumerate()
        .map(|(p, b)| IoRequest::Write(Region::Partition(p as u32), b))
        .collect();
    store.submit(&mut reqs).unwrap();
    (0..3)
        .map(|p| payload(store, p, &bufs[p as usize]))
        .collect()
}

fn payload(store: &Store, p: u32, b: &IoBuffer) -> Vec<u8> {
    b.as_bytes()[..store.partition(p).unwrap().bytes as usize].to_vec()
}

fn peek(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = OpenOptions::new().read(true).open(path).unwrap();
    let mut b = vec![0; len];
    f.read_exact_at(&mut b, offset).unwrap();
    b
}

fn poke(path: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
    f.sync_all().unwrap();
}

/// Both superblock slots of a member.
fn slots(path: &Path) -> Vec<u8> {
    peek(path, 0, 2 * SUPERBLOCK_SLOT_BYTES as usize)
}

#[test]
fn units_are_dealt_round_robin_over_the_members_and_read_back() {
    for members in [2, 3] {
        let dir = scratch();
        let paths = paths(&dir, members);
        let mut store = create(&paths);
        assert_eq!(store.members(), members);
        let written = write_all(&mut store, 1);
        store.commit(b"one").unwrap();
        drop(store);
        let mut store = open(&paths).unwrap();
        assert_eq!((store.generation(), store.progress()), (1, &b"one"[..]));
        for p in 0..3 {
            assert_eq!(read(&mut store, p), written[p as usize], "partition {p}");
        }
        // The format: layout byte b ≥ 2 MiB is in unit k = (b − 2 MiB) / UNIT, on member
        // k mod M at 2 MiB + ⌊k / M⌋ · UNIT + (b − 2 MiB) mod UNIT. Partitions were written
        // to their copy 1 (the copy generation 0 did not reference).
        let data_start = 2 * SUPERBLOCK_SLOT_BYTES;
        for p in 0..3u32 {
            let e = store.partition(p).unwrap().clone();
            let mut rebuilt = Vec::new();
            let mut at = e.offsets[1];
            while at < e.offsets[1] + e.bytes {
                let k = (at - data_start) / UNIT;
                let within = (at - data_start) % UNIT;
                let n = (UNIT - within).min(e.offsets[1] + e.bytes - at);
                let member = &paths[(k % members as u64) as usize];
                let offset = data_start + (k / members as u64) * UNIT + within;
                rebuilt.extend(peek(member, offset, n as usize));
                at += n;
            }
            assert_eq!(rebuilt, written[p as usize], "partition {p} on the members");
        }
        // Each member holds a share, not the whole store.
        let total = store.layout().total_bytes;
        for path in &paths {
            let len = std::fs::metadata(path).unwrap().len();
            assert!(
                len < data_start + (total - data_start) / members as u64 + 2 * UNIT,
                "{} is {len} bytes of a {total}-byte layout",
                path.display()
            );
        }
    }
}

#[test]
fn a_striped_transfer_run_by_the_caller_lands_where_io_pieces_say_and_commits() {
    for members in [1, 3] {
        let dir = scratch();
        let paths = paths(&dir, members);
        let mut store = create(&paths);
        // The caller (standing in for the GPU I/O kernels) writes partition 1 itself, a piece
        // at a time, to the members' media, and tells the store.
        let b = filled(&store, 1, 9);
        let pieces = store.io_pieces(Region::Partition(1), true).unwrap();
        let total: u64 = pieces.iter().map(|p| p.len).sum();
        assert_eq!(total % 4096, 0);
        assert!(total >= store.partition(1).unwrap().bytes);
        let mut expect_at = 0;
        for p in &pieces {
            assert_eq!(p.buf_offset, expect_at, "pieces in buffer order");
            expect_at += p.len;
            let bytes = &b.as_bytes()[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
            poke(&paths[p.member], p.at, bytes);
        }
        if members > 1 {
            assert!(
                (0..members).all(|m| pieces.iter().any(|p| p.member == m)),
                "every member holds a piece"
            );
        }
        assert!(matches!(
            store.io_pieces(Region::Partition(1), false),
            Err(StoreError::NotInitialized { .. })
        ));
        store.mark_written(Region::Partition(1)).unwrap();
        assert_eq!(
            store.io_pieces(Region::Partition(1), false).unwrap(),
            pieces
        );
        store.commit(b"caller").unwrap();
        drop(store);
        let mut store = open(&paths).unwrap();
        assert_eq!(
            read(&mut store, 1),
            payload(&store, 1, &b),
            "{members} members"
        );
    }
}

/// Simulates a crash between two members' superblock writes: `behind` keeps the slots it had
/// before the commit, the other members have the new generation.
fn crash_between_flips(behind: usize) {
    let dir = scratch();
    let paths = paths(&dir, 3);
    let mut store = create(&paths);
    let first = write_all(&mut store, 1);
    store.commit(b"g1").unwrap();
    write_all(&mut store, 2);
    let before = slots(&paths[behind]);
    store.commit(b"g2").unwrap();
    drop(store);
    poke(&paths[behind], 0, &before);

    // Generation 2 did not reach every member: the store is at 1, with generation 1's rows.
    let mut store = open(&paths).unwrap();
    assert_eq!((store.generation(), store.progress()), (1, &b"g1"[..]));
    for p in 0..3 {
        assert_eq!(read(&mut store, p), first[p as usize], "partition {p}");
    }
    // Writes after the roll-back and a second crash before the next commit reached anyone:
    // still generation 1 (the members ahead were rolled back at open, not left to win).
    write_all(&mut store, 3);
    drop(store);
    let mut store = open(&paths).unwrap();
    assert_eq!(store.generation(), 1);
    // The next commit is generation 2 again, on every member; a crash between its flips now
    // leaves generation 2 of this commit or generation 1, never a mix with the old one.
    let third = write_all(&mut store, 3);
    let before = slots(&paths[(behind + 1) % 3]);
    store.commit(b"g2 again").unwrap();
    drop(store);
    let mut store = open(&paths).unwrap();
    assert_eq!(
        (store.generation(), store.progress()),
        (2, &b"g2 again"[..])
    );
    for p in 0..3 {
        assert_eq!(read(&mut store, p), third[p as usize], "partition {p}");
    }
    drop(store);
    poke(&paths[(behind + 1) % 3], 0, &before);
    let mut store = open(&paths).unwrap();
    assert_eq!((store.generation(), store.progress()), (1, &b"g1"[..]));
    for p in 0..3 {
        assert_eq!(read(&mut store, p), first[p as usize], "partition {p}");
    }
}

#[test]
fn a_crash_between_two_members_flips_opens_at_the_generation_all_hold() {
    for behind in 0..3 {
        crash_between_flips(behind);
    }
}

fn member_error(paths: &[PathBuf]) -> String {
    match open(paths) {
        Err(e @ StoreError::Member { .. }) => e.to_string(),
        Err(e) => panic!("expected a member error, got {e}"),
        Ok(_) => panic!("opened"),
    }
}

#[test]
fn a_missing_extra_swapped_or_foreign_member_is_refused_by_name() {
    let dir = scratch();
    let paths = paths(&dir, 3);
    let mut store = create(&paths);
    write_all(&mut store, 1);
    store.commit(b"g1").unwrap();
    drop(store);

    let gone = dir.path().join("gone.bin");
    let missing = member_error(&[paths[0].clone(), paths[1].clone(), gone.clone()]);
    assert!(
        missing.contains(&gone.display().to_string()) && missing.contains("member 3 of"),
        "{missing}"
    );

    let two = member_error(&paths[..2]);
    assert!(
        two.contains(&paths[0].display().to_string()) && two.contains("striped over 3"),
        "{two}"
    );

    let swapped = member_error(&[paths[0].clone(), paths[2].clone(), paths[1].clone()]);
    assert!(
        swapped.contains(&paths[2].display().to_string())
            && swapped.contains("is member 3 of its store but is given as member 2"),
        "{swapped}"
    );

    let other_dir = scratch();
    let others = self::paths(&other_dir, 3);
    drop(create(&others));
    let foreign = member_error(&[paths[0].clone(), others[1].clone(), paths[2].clone()]);
    assert!(
        foreign.contains(&others[1].display().to_string()) && foreign.contains("another store"),
        "{foreign}"
    );

    // A member that lost its superblocks is no member.
    poke(&paths[1], 0, &vec![0; 2 * SUPERBLOCK_SLOT_BYTES as usize]);
    let blank = open(&paths).unwrap_err();
    assert!(
        matches!(&blank, StoreError::WrongMagic { path, .. } if path == &paths[1]),
        "{blank}"
    );

    // A member cut short is refused with its sizes.
    let dir = scratch();
    let paths = self::paths(&dir, 2);
    drop(create(&paths));
    let len = std::fs::metadata(&paths[1]).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&paths[1])
        .unwrap()
        .set_len(len - UNIT)
        .unwrap();
    let short = open(&paths).unwrap_err();
    assert!(
        matches!(&short, StoreError::Truncated { path, .. } if path == &paths[1]),
        "{short}"
    );
}

#[test]
fn a_stripe_unit_off_the_alignment_is_refused() {
    let dir = scratch();
    let paths = paths(&dir, 2);
    let opts = CreateOptions {
        stripe_bytes: 100_000,
        ..CreateOptions::default()
    };
    let err = Store::create_striped(&targets(&paths), &spec(), &opts).unwrap_err();
    assert!(
        err.to_string().contains("stripe unit of 100000 bytes"),
        "{err}"
    );
    assert!(
        paths.iter().all(|p| !p.exists()),
        "files made for the store are removed"
    );
}

/// `read_range` reads a few bytes of a partition (a query's rows) as `read` reads the whole:
/// the committed copy, or the one written since, across stripe units; a range past the
/// partition's end is refused, naming it.
#[test]
fn a_range_of_a_partition_reads_what_the_whole_read_holds() {
    let dir = scratch();
    let paths = paths(&dir, 2);
    let mut store = create(&paths);
    write_all(&mut store, 1);
    store.commit(b"one").unwrap();
    // Partition 1 written again, not committed: both reads take the new copy.
    let again = filled(&store, 1, 9);
    store.write(Region::Partition(1), &again).unwrap();
    let mut buf = IoBuffer::new(store.max_partition_bytes()).unwrap();
    for p in 0..3 {
        let whole = read(&mut store, p);
        let len = whole.len() as u64;
        // Within a block, across the 64 KiB stripe unit, unaligned at both ends, the end.
        for range in [0..7, 100..300, UNIT - 10..UNIT + 900, 5..len, len - 1..len] {
            let at = store
                .read_range(Region::Partition(p), range.clone(), &mut buf)
                .unwrap();
            let got = &buf.as_bytes()[at..at + (range.end - range.start) as usize];
            assert_eq!(
                got,
                &whole[range.start as usize..range.end as usize],
                "partition {p}, bytes {range:?}"
            );
        }
        let past = store
            .read_range(Region::Partition(p), len - 1..len + 1, &mut buf)
            .unwrap_err()
            .to_string();
        assert!(past.contains(&format!("partition {p}")), "{past}");
    }
}
