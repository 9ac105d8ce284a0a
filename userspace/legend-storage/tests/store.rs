//! Store-level tests of the `file` backend: round trips, batching, commits,
//! crash behaviour and every refusal.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use legend_storage::{
    CreateOptions, DatasetId, Dtype, Expect, IoBuffer, IoConfig, IoRequest, Region,
    SUPERBLOCK_SLOT_BYTES, Store, StoreError, StoreSpec,
};
use rand_like::fill;

/// Deterministic pseudo-random fill without another dependency.
mod rand_like {
    pub fn fill(buf: &mut [f32], seed: u64) {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for v in buf {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        }
    }
}

fn dataset(tag: u8) -> DatasetId {
    DatasetId {
        id: [tag; 16],
        label: format!("graph-{tag}"),
    }
}

fn spec(shadow: bool) -> StoreSpec {
    StoreSpec {
        dataset: dataset(1),
        num_nodes: 1_003,
        dim: 37,
        dtype: Dtype::F32,
        state_width: 37,
        num_partitions: 5,
        aux_bytes: 3_000,
        progress_capacity: 256,
        shadow,
    }
}

/// Test files live under the crate's target dir: on the same file system
/// as /work, which supports O_DIRECT.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("legend-store-test")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

fn store_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("store.bin")
}

fn filled(store: &Store, p: u32, seed: u64) -> IoBuffer {
    let mut b = IoBuffer::new(store.max_partition_bytes()).unwrap();
    let rows = store.partition(p).unwrap().rows;
    let spec = store.spec();
    let (emb, state) = b.split_partition_mut(rows, spec);
    let mut values = vec![0.0; rows as usize * spec.dim as usize];
    fill(&mut values, seed);
    values
        .iter_mut()
        .for_each(|v| *v = spec.dtype.round_nearest(*v));
    spec.dtype.narrow(&values, emb);
    fill(state, seed + 1000);
    b
}

fn read(store: &mut Store, region: Region) -> Vec<u8> {
    let mut b = IoBuffer::new(store.max_partition_bytes()).unwrap();
    store.read(region, &mut b).unwrap();
    let len = match region {
        Region::Partition(p) => store.partition(p).unwrap().bytes,
        Region::Aux => store.layout().aux.as_ref().unwrap().bytes,
    };
    b.as_bytes()[..len as usize].to_vec()
}

fn payload(store: &Store, p: u32, buf: &IoBuffer) -> Vec<u8> {
    buf.as_bytes()[..store.partition(p).unwrap().bytes as usize].to_vec()
}

fn expect_all() -> Expect {
    Expect {
        dataset: Some(dataset(1)),
        dim: Some(37),
        dtype: Some(Dtype::F32),
        state_width: Some(37),
        num_partitions: Some(5),
        store_id: None,
    }
}

fn open(path: &Path) -> Result<Store, StoreError> {
    Store::open(path, &expect_all(), &IoConfig::default())
}

fn poke(path: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
    f.sync_all().unwrap();
}

fn peek(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = OpenOptions::new().read(true).open(path).unwrap();
    let mut b = vec![0; len];
    f.read_exact_at(&mut b, offset).unwrap();
    b
}

#[test]
fn a_16_bit_store_keeps_its_rows_and_is_written_as_version_3() {
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let dir = scratch();
        let path = store_path(&dir);
        // 1003 rows of 37 over 5 partitions: odd element counts, so the state after the
        // 16-bit embeddings needs the padding.
        let spec = StoreSpec {
            dtype,
            state_width: 1,
            ..spec(true)
        };
        let mut store = Store::create(&path, &spec, &CreateOptions::default()).unwrap();
        let extent = store.partition(0).unwrap().clone();
        assert_eq!(
            extent.bytes,
            (201 * 37 * 2_u64).next_multiple_of(4) + 201 * 4
        );
        let b = filled(&store, 0, 5);
        store.write(Region::Partition(0), &b).unwrap();
        store.commit(b"one").unwrap();
        drop(store);
        assert_eq!(
            peek(&path, 8, 4),
            3u32.to_le_bytes(),
            "{dtype}: format version"
        );
        let expect = Expect {
            dtype: Some(dtype),
            state_width: Some(1),
            ..expect_all()
        };
        let mut store = Store::open(&path, &expect, &IoConfig::default()).unwrap();
        assert_eq!(store.spec().dtype, dtype);
        assert_eq!(
            read(&mut store, Region::Partition(0)),
            payload(&store, 0, &b)
        );
        let f32_expected = Expect {
            dtype: Some(Dtype::F32),
            ..Expect::default()
        };
        let err = Store::open(&path, &f32_expected, &IoConfig::default()).unwrap_err();
        assert!(
            err.to_string().contains(&format!(
                "the store keeps {dtype} embeddings, but the run asks for f32"
            )),
            "{err}"
        );
    }
    // An f32 store stays at version 2, readable by builds from before 16-bit rows.
    let dir = scratch();
    let path = store_path(&dir);
    drop(Store::create(&path, &spec(true), &CreateOptions::default()).unwrap());
    assert_eq!(peek(&path, 8, 4), 2u32.to_le_bytes());
}

#[test]
fn round_trip_of_random_partitions() {
    for shadow in [false, true] {
        let dir = scratch();
        let path = store_path(&dir);
        let mut store = Store::create(&path, &spec(shadow), &CreateOptions::default()).unwrap();
        assert!(
            store.is_direct(),
            "O_DIRECT expected on the target dir's file system"
        );
        let mut expected = Vec::new();
        for p in 0..5 {
            assert!(!store.is_initialized(Region::Partition(p)).unwrap());
            let b = filled(&store, p, u64::from(p) + 10);
            store.write(Region::Partition(p), &b).unwrap();
            // Visible before the commit, too.
            assert_eq!(
                read(&mut store, Region::Partition(p)),
                payload(&store, p, &b)
            );
            expected.push(payload(&store, p, &b));
        }
        let mut aux = IoBuffer::new(3_000).unwrap();
        aux.as_bytes_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i * 7) as u8);
        store.write(Region::Aux, &aux).unwrap();
        assert_eq!(store.commit(b"epoch 1").unwrap(), 1);
        // Rewrite two partitions once more and commit again: shadowed stores
        // flip copies, in-place ones overwrite.
        for p in [1, 3] {
            let b = filled(&store, p, u64::from(p) + 77);
            store.write(Region::Partition(p), &b).unwrap();
            expected[p as usize] = payload(&store, p, &b);
        }
        assert_eq!(store.commit(b"epoch 2").unwrap(), 2);
        drop(store);

        let mut store = open(&path).unwrap();
        assert_eq!((store.generation(), store.progress()), (2, &b"epoch 2"[..]));
        for p in 0..5 {
            assert!(store.is_initialized(Region::Partition(p)).unwrap());
            assert_eq!(
                read(&mut store, Region::Partition(p)),
                expected[p as usize],
                "partition {p}, shadow {shadow}"
            );
        }
        assert_eq!(read(&mut store, Region::Aux), aux.as_bytes());
    }
}

#[test]
fn batch_keeps_many_requests_in_flight() {
    let dir = scratch();
    let path = store_path(&dir);
    // 16 KiB requests and depth 8: each partition is several requests.
    let io = IoConfig {
        queue_depth: 8,
        request_bytes: 16 << 10,
        ..IoConfig::default()
    };
    let big = StoreSpec {
        num_nodes: 20_000,
        dim: 16,
        dtype: Dtype::F32,
        state_width: 16,
        num_partitions: 4,
        ..spec(true)
    };
    let mut store = Store::create(
        &path,
        &big,
        &CreateOptions {
            io: io.clone(),
            ..CreateOptions::default()
        },
    )
    .unwrap();
    let bufs: Vec<IoBuffer> = (0..4).map(|p| filled(&store, p, u64::from(p))).collect();
    let mut reqs: Vec<IoRequest> = bufs
        .iter()
        .enumerate()
        .map(|(p, b)| IoRequest::Write(Region::Partition(p as u32), b))
        .collect();
    store.submit(&mut reqs).unwrap();
    // A swap: write back 0 while reading 1..3.
    let mut outs: Vec<IoBuffer> = (0..3)
        .map(|_| IoBuffer::new(store.max_partition_bytes()).unwrap())
        .collect();
    let mut reqs = vec![IoRequest::Write(Region::Partition(0), &bufs[0])];
    for (i, o) in outs.iter_mut().enumerate() {
        reqs.push(IoRequest::Read(Region::Partition(i as u32 + 1), o));
    }
    store.submit(&mut reqs).unwrap();
    for (i, o) in outs.iter().enumerate() {
        let p = i as u32 + 1;
        assert_eq!(payload(&store, p, o), payload(&store, p, &bufs[p as usize]));
    }
}

#[test]
fn never_written_partition_is_reported_not_read() {
    let dir = scratch();
    let path = store_path(&dir);
    let mut store = Store::create(&path, &spec(false), &CreateOptions::default()).unwrap();
    let mut b = IoBuffer::new(store.max_partition_bytes()).unwrap();
    let err = store.read(Region::Partition(2), &mut b).unwrap_err();
    assert!(matches!(err, StoreError::NotInitialized { .. }), "{err}");
    assert!(
        err.to_string().contains("partition 2 was never written"),
        "{err}"
    );
    let w = filled(&store, 2, 5);
    store.write(Region::Partition(2), &w).unwrap();
    store.commit(&[]).unwrap();
    // Written after the commit, then a crash (drop without commit): the
    // partition is uninitialised again at reopen.
    let w = filled(&store, 4, 5);
    store.write(Region::Partition(4), &w).unwrap();
    drop(store);
    let store = open(&path).unwrap();
    assert!(store.is_initialized(Region::Partition(2)).unwrap());
    assert!(!store.is_initialized(Region::Partition(4)).unwrap());
}

#[test]
fn shadowed_store_rolls_back_to_the_last_commit() {
    let dir = scratch();
    let path = store_path(&dir);
    let mut store = Store::create(&path, &spec(true), &CreateOptions::default()).unwrap();
    let a = filled(&store, 0, 1);
    store.write(Region::Partition(0), &a).unwrap();
    store.commit(b"one").unwrap();
    let b = filled(&store, 0, 2);
    store.write(Region::Partition(0), &b).unwrap();
    // Crash before the commit.
    drop(store);
    let mut store = open(&path).unwrap();
    assert_eq!(store.progress(), b"one");
    assert_eq!(
        read(&mut store, Region::Partition(0)),
        payload(&store, 0, &a)
    );
}

#[test]
fn torn_superblock_write_falls_back_to_the_previous_generation() {
    let dir = scratch();
    let path = store_path(&dir);
    let mut store = Store::create(&path, &spec(true), &CreateOptions::default()).unwrap();
    let a = filled(&store, 1, 1);
    store.write(Region::Partition(1), &a).unwrap();
    store.commit(b"gen 1").unwrap(); // slot 1
    let before = peek(&path, 0, 64 << 10); // slot 0 still holds gen 0
    let b = filled(&store, 1, 2);
    store.write(Region::Partition(1), &b).unwrap();
    store.commit(b"gen 2").unwrap(); // slot 0
    drop(store);
    // Tear the gen-2 write: only its first 256 bytes (the header) reached
    // the disk, the rest of the slot still holds gen 0.
    poke(&path, 256, &before[256..]);
    let mut store = open(&path).unwrap();
    assert_eq!((store.generation(), store.progress()), (1, &b"gen 1"[..]));
    assert_eq!(
        read(&mut store, Region::Partition(1)),
        payload(&store, 1, &a)
    );
    // Committing from here overwrites the torn slot and is read back.
    store.commit(b"gen 2 again").unwrap();
    drop(store);
    assert_eq!(open(&path).unwrap().progress(), b"gen 2 again");
}

#[test]
fn bad_checksum_in_one_copy_uses_the_other_and_in_both_is_refused() {
    let dir = scratch();
    let path = store_path(&dir);
    let mut store = Store::create(&path, &spec(false), &CreateOptions::default()).unwrap();
    store.commit(b"g1").unwrap(); // slot 1
    store.commit(b"g2").unwrap(); // slot 0
    drop(store);
    // Flip a byte inside the progress area of slot 0 (gen 2).
    let mut hdr = peek(&path, 0, 4096);
    hdr[200] ^= 0xff;
    poke(&path, 0, &hdr);
    let store = open(&path).unwrap();
    assert_eq!((store.generation(), store.progress()), (1, &b"g1"[..]));
    drop(store);
    let mut hdr = peek(&path, SUPERBLOCK_SLOT_BYTES, 4096);
    hdr[120] ^= 0x01; // dim field of slot 1
    poke(&path, SUPERBLOCK_SLOT_BYTES, &hdr);
    let err = open(&path).unwrap_err();
    assert!(matches!(err, StoreError::BadChecksum { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("bad checksum in both"),
        "{msg}"
    );
}

#[test]
fn truncated_store_is_refused_naming_sizes() {
    let dir = scratch();
    let path = store_path(&dir);
    let store = Store::create(&path, &spec(true), &CreateOptions::default()).unwrap();
    let total = store.layout().total_bytes;
    drop(store);
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(total - 65536)
        .unwrap();
    let err = open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Truncated { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!(
            "needs {total} bytes but the file has {}",
            total - 65536
        )),
        "{err}"
    );
    // Cut inside the superblock slots: still a clear error, not a panic.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(3000)
        .unwrap();
    let err = open(&path).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Truncated { .. } | StoreError::BadChecksum { .. }
        ),
        "{err}"
    );
}

#[test]
fn wrong_magic_is_refused_and_names_a_foreign_signature() {
    let dir = scratch();
    let path = store_path(&dir);
    std::fs::write(&path, vec![0x42u8; 3 << 20]).unwrap();
    let err = open(&path).unwrap_err();
    assert!(
        matches!(err, StoreError::WrongMagic { found: None, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("not a Legend store"), "{err}");
    let mut img = vec![0u8; 3 << 20];
    img[1080..1082].copy_from_slice(&[0x53, 0xef]);
    std::fs::write(&path, img).unwrap();
    let err = open(&path).unwrap_err();
    assert!(err.to_string().contains("ext2/3/4 signature"), "{err}");
}

#[test]
fn unsupported_version_is_refused() {
    let dir = scratch();
    let path = store_path(&dir);
    drop(Store::create(&path, &spec(false), &CreateOptions::default()).unwrap());
    poke(&path, 8, &99u32.to_le_bytes());
    let err = open(&path).unwrap_err();
    assert!(
        err.to_string()
            .contains("unsupported store format version 99"),
        "{err}"
    );
}

#[test]
fn other_dataset_dim_or_partition_count_is_refused_naming_both() {
    let dir = scratch();
    let path = store_path(&dir);
    drop(Store::create(&path, &spec(false), &CreateOptions::default()).unwrap());
    let io = IoConfig::default();
    let err = Store::open(
        &path,
        &Expect {
            dataset: Some(dataset(9)),
            ..Expect::default()
        },
        &io,
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("graph-1")
            && msg.contains("graph-9")
            && msg.contains(&"01".repeat(16))
            && msg.contains(&"09".repeat(16)),
        "{msg}"
    );
    let err = Store::open(
        &path,
        &Expect {
            dim: Some(64),
            ..Expect::default()
        },
        &io,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("dimension 37, but the caller asked for 64"),
        "{err}"
    );
    let err = Store::open(
        &path,
        &Expect {
            state_width: Some(1),
            ..Expect::default()
        },
        &io,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("optimizer.state: row here, element in the store"),
        "{err}"
    );
    let err = Store::open(
        &path,
        &Expect {
            dtype: Some(Dtype::Bf16),
            ..Expect::default()
        },
        &io,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("the store keeps f32 embeddings, but the run asks for bf16"),
        "{err}"
    );
    let err = Store::open(
        &path,
        &Expect {
            num_partitions: Some(8),
            ..Expect::default()
        },
        &io,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("5 partitions, but the caller asked for 8"),
        "{err}"
    );
    // No expectations: inspection of any store.
    assert_eq!(
        Store::open(&path, &Expect::default(), &io).unwrap().spec(),
        &spec(false)
    );
}

#[test]
fn device_too_small_is_refused_naming_both_sizes() {
    let dir = scratch();
    let path = store_path(&dir);
    let opts = CreateOptions {
        max_bytes: Some(2 << 20),
        ..CreateOptions::default()
    };
    let err = Store::create(&path, &spec(true), &opts).unwrap_err();
    assert!(matches!(err, StoreError::DeviceTooSmall { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("only {} are available", 2 << 20)) && msg.contains("the store needs"),
        "{msg}"
    );
    // A layout beyond the file system's free space fails at preallocation.
    let huge = StoreSpec {
        num_nodes: 1 << 40,
        dim: 512,
        dtype: Dtype::F32,
        state_width: 512,
        num_partitions: 16,
        ..spec(false)
    };
    let err = Store::create(&path, &huge, &CreateOptions::default()).unwrap_err();
    assert!(matches!(err, StoreError::DeviceTooSmall { .. }), "{err}");
    assert!(!path.exists(), "a failed create leaves no file behind");
}

#[test]
fn foreign_signature_is_refused_unless_forced() {
    let dir = scratch();
    let path = store_path(&dir);
    let mut img = vec![0u8; 1 << 20];
    img[512..520].copy_from_slice(b"EFI PART");
    std::fs::write(&path, &img).unwrap();
    let err = Store::create(&path, &spec(false), &CreateOptions::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("GPT partition table signature at byte 512"),
        "{err}"
    );
    let mut store = Store::create(
        &path,
        &spec(false),
        &CreateOptions {
            force: true,
            ..CreateOptions::default()
        },
    )
    .unwrap();
    store.commit(b"x").unwrap();
    store.commit(b"y").unwrap();
    store.commit(b"z").unwrap(); // gen 3 in slot 1
    drop(store);
    // An existing store is a signature too; forcing over it must not let
    // its higher-generation slot survive.
    let err = Store::create(&path, &spec(false), &CreateOptions::default()).unwrap_err();
    assert!(err.to_string().contains("Legend store signature"), "{err}");
    drop(
        Store::create(
            &path,
            &spec(false),
            &CreateOptions {
                force: true,
                ..CreateOptions::default()
            },
        )
        .unwrap(),
    );
    let store = open(&path).unwrap();
    assert_eq!((store.generation(), store.progress()), (0, &[][..]));
}

/// A creation whose creator recorded the store's id first is made again after a crash (its
/// generation 0 written, or torn while written), without force; another store, or the same
/// creator asking with another id, is refused; and an opener expecting the id refuses a store
/// put in its place.
#[test]
fn a_store_is_made_again_by_its_recorded_id_and_no_other_is() {
    let dir = scratch();
    let path = store_path(&dir);
    let id = legend_storage::new_store_id();
    let with_id = |id| CreateOptions {
        store_id: Some(id),
        ..CreateOptions::default()
    };
    drop(Store::create(&path, &spec(false), &with_id(id)).unwrap());
    let copy = peek(&path, 0, 4096);
    for torn in [false, true] {
        if torn {
            // Generation 0 cut short: the magic and the id are there, the checksum fails.
            let mut bytes = copy.clone();
            bytes[300..].fill(0);
            poke(&path, 0, &bytes);
            assert!(matches!(open(&path), Err(StoreError::BadChecksum { .. })));
        }
        let again = Store::create(&path, &spec(false), &with_id(id)).unwrap();
        assert_eq!((again.store_id(), again.generation()), (id, 0));
    }
    // Another creator (another id, or none) is refused by the signature.
    for opts in [
        with_id(legend_storage::new_store_id()),
        CreateOptions::default(),
    ] {
        let err = Store::create(&path, &spec(false), &opts).unwrap_err();
        assert!(
            err.to_string().contains("Legend store signature at byte 0"),
            "{err}"
        );
    }
    // A store that lived (committed) is no creation to redo, even for its creator; its id
    // still names it: opening expects it.
    let mut store = Store::open(&path, &expect_all(), &IoConfig::default()).unwrap();
    store.commit(b"x").unwrap();
    drop(store);
    let err = Store::create(&path, &spec(false), &with_id(id)).unwrap_err();
    assert!(matches!(err, StoreError::ForeignSignature { .. }), "{err}");
    let expecting = |id| Expect {
        store_id: Some(id),
        ..expect_all()
    };
    Store::open(&path, &expecting(id), &IoConfig::default()).unwrap();
    let other = legend_storage::new_store_id();
    let err = Store::open(&path, &expecting(other), &IoConfig::default()).unwrap_err();
    assert!(
        matches!(err, StoreError::OtherStore { .. })
            && err
                .to_string()
                .contains(&legend_storage::store_id_hex(other)),
        "{err}"
    );
    // Another signature is never taken for a copy, whatever the id.
    let mut img = vec![0u8; 1 << 20];
    img[512..520].copy_from_slice(b"EFI PART");
    std::fs::write(&path, &img).unwrap();
    let err = Store::create(&path, &spec(false), &with_id(id)).unwrap_err();
    assert!(matches!(err, StoreError::ForeignSignature { .. }), "{err}");
}

#[test]
fn misuse_is_reported() {
    let dir = scratch();
    let path = store_path(&dir);
    let mut store = Store::create(&path, &spec(false), &CreateOptions::default()).unwrap();
    let small = IoBuffer::new(100).unwrap();
    let err = store.write(Region::Partition(0), &small).unwrap_err();
    assert!(matches!(err, StoreError::BufferTooSmall { .. }), "{err}");
    let err = store.write(Region::Partition(5), &small).unwrap_err();
    assert!(
        err.to_string().contains("partition 5 out of range"),
        "{err}"
    );
    let err = store.commit(&[0; 257]).unwrap_err();
    assert!(matches!(err, StoreError::ProgressTooLarge { .. }), "{err}");
}

#[test]
fn works_on_tmp_and_shm_with_or_without_direct_io() {
    // tmpfs accepts O_DIRECT since Linux 6.6; older kernels (and some FUSE
    // file systems) refuse it, and the store then falls back to buffered
    // I/O with a warning, or refuses when buffered I/O is not allowed.
    for base in ["/tmp", "/dev/shm"] {
        let Ok(dir) = tempfile::Builder::new()
            .prefix("legend-store-test")
            .tempdir_in(base)
        else {
            continue;
        };
        let path = store_path(&dir);
        let strict = CreateOptions {
            io: IoConfig {
                allow_buffered: false,
                ..IoConfig::default()
            },
            ..CreateOptions::default()
        };
        match Store::create(&path, &spec(false), &strict) {
            Ok(store) => assert!(store.is_direct()),
            Err(e) => assert!(
                matches!(e, StoreError::DirectIoUnsupported { .. }),
                "{base}: {e}"
            ),
        }
        let mut store = Store::create(
            &path,
            &spec(false),
            &CreateOptions {
                force: true,
                ..CreateOptions::default()
            },
        )
        .unwrap();
        let b = filled(&store, 3, 3);
        store.write(Region::Partition(3), &b).unwrap();
        store.commit(&[]).unwrap();
        drop(store);
        let mut store = open(&path).unwrap();
        assert_eq!(
            read(&mut store, Region::Partition(3)),
            payload(&store, 3, &b),
            "{base}"
        );
    }
}

#[test]
fn store_and_buffers_can_move_to_an_io_thread() {
    fn is_send<T: Send>() {}
    fn is_sync<T: Sync>() {}
    is_send::<Store>();
    is_send::<IoBuffer>();
    is_sync::<IoBuffer>();
}
