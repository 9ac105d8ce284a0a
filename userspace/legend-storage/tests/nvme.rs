//! The store on an NVMe namespace, driven through queue pairs of the userspace proxy
//! controller: the same bytes as on a file, commits, the start LBA, decoded command errors and
//! a controller that stops answering.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use legend_nvme_protocol::Status;
use legend_nvme_proxy::{Faults, Proxy, ProxyOptions};
use legend_storage::{
    CreateOptions, DatasetId, Dtype, Expect, Extents, IoBuffer, IoConfig, IoRequest, NvmeTarget,
    Region, Store, StoreError, StoreSpec, Target,
};

fn spec() -> StoreSpec {
    StoreSpec {
        dataset: DatasetId {
            id: [7; 16],
            label: "nvme-test".into(),
        },
        num_nodes: 2_003,
        dim: 29,
        dtype: Dtype::F32,
        state_width: 29,
        num_partitions: 4,
        aux_bytes: 5_000,
        progress_capacity: 256,
        shadow: true,
    }
}

/// Where the proxies' backing files go: memory (`/dev/shm`) where the machine has it. These
/// tests are about the queues; a disk shared with a build can hold one allocating write for
/// over the 30 s command timeout (seen in a full cold suite run: the proxy's report showed the
/// command fetched and its write to an ext4 file not done), which is the disk's latency, not
/// the protocol's.
fn scratch() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm
    } else {
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
    };
    tempfile::Builder::new()
        .prefix("legend-nvme-test")
        .tempdir_in(base)
        .unwrap()
}

/// A zero-filled backing file of `bytes` and a proxy over it.
fn proxy(path: &Path, bytes: u64, lba_shift: u32) -> Arc<Proxy> {
    std::fs::File::create(path).unwrap().set_len(bytes).unwrap();
    let opts = ProxyOptions {
        lba_shift,
        ..ProxyOptions::default()
    };
    Arc::new(Proxy::open(path, &opts).unwrap())
}

fn target(p: &Arc<Proxy>, start_lba: u64) -> NvmeTarget {
    NvmeTarget {
        controller: p.clone(),
        namespace: 1,
        start_lba,
    }
}

fn filled(store: &Store, seed: u32) -> IoBuffer {
    let mut b = IoBuffer::new(store.max_partition_bytes()).unwrap();
    for (i, v) in b.as_f32_mut().iter_mut().enumerate() {
        *v = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) as f32;
    }
    b
}

fn payload(store: &Store, p: u32, b: &IoBuffer) -> Vec<u8> {
    b.as_bytes()[..store.partition(p).unwrap().bytes as usize].to_vec()
}

#[test]
fn a_store_on_a_namespace_holds_what_a_file_store_holds() {
    let dir = scratch();
    for lba_shift in [9, 12] {
        let backing = dir.path().join(format!("ns-{lba_shift}.img"));
        let px = proxy(&backing, 64 << 20, lba_shift);
        // A start LBA: the store sits after a 1 MiB head the namespace keeps for others.
        let start = (1 << 20) >> lba_shift;
        let t = target(&px, start);
        let file = dir.path().join(format!("file-{lba_shift}.bin"));
        let mut on_nvme =
            Store::create_on(&Target::Nvme(&t), &spec(), &CreateOptions::default()).unwrap();
        let mut on_file = Store::create(&file, &spec(), &CreateOptions::default()).unwrap();
        assert_eq!(on_nvme.layout(), on_file.layout());
        for p in 0..4 {
            let b = filled(&on_nvme, p * 3 + 1);
            let mut batch = [IoRequest::Write(Region::Partition(p), &b)];
            on_nvme.submit(&mut batch).unwrap();
            on_file.submit(&mut batch).unwrap();
        }
        on_nvme.commit(b"epochs_completed=1").unwrap();
        on_file.commit(b"epochs_completed=1").unwrap();
        drop(on_nvme);
        // The head before the start LBA is untouched.
        let head = std::fs::read(&backing).unwrap();
        assert!(head[..1 << 20].iter().all(|&b| b == 0));
        let expect = Expect {
            dataset: Some(spec().dataset),
            dim: Some(29),
            dtype: Some(Dtype::F32),
            state_width: Some(29),
            num_partitions: Some(4),
            store_id: None,
        };
        let mut again = Store::open_on(&Target::Nvme(&t), &expect, &IoConfig::default()).unwrap();
        assert_eq!(again.generation(), 1);
        assert_eq!(again.progress(), b"epochs_completed=1");
        for p in 0..4 {
            let (mut a, mut b) = (
                IoBuffer::new(again.max_partition_bytes()).unwrap(),
                IoBuffer::new(again.max_partition_bytes()).unwrap(),
            );
            again.read(Region::Partition(p), &mut a).unwrap();
            on_file.read(Region::Partition(p), &mut b).unwrap();
            assert_eq!(
                payload(&again, p, &a),
                payload(&on_file, p, &b),
                "partition {p}"
            );
            assert_eq!(
                payload(&again, p, &a),
                payload(&again, p, &filled(&again, p * 3 + 1))
            );
            // A few bytes through the queues (a row a query looks up), unaligned at both ends.
            let whole = payload(&again, p, &a);
            let at = again
                .read_range(Region::Partition(p), 700..1_333, &mut b)
                .unwrap();
            assert_eq!(&b.as_bytes()[at..at + 633], &whole[700..1_333]);
        }
    }
}

#[test]
fn a_failed_command_names_its_lbas_and_status_and_commits_nothing() {
    let dir = scratch();
    let px = proxy(&dir.path().join("ns.img"), 64 << 20, 9);
    let t = target(&px, 0);
    let mut store =
        Store::create_on(&Target::Nvme(&t), &spec(), &CreateOptions::default()).unwrap();
    let b = filled(&store, 9);
    store.write(Region::Partition(2), &b).unwrap();
    store.commit(b"one").unwrap();
    // A media error under partition 1's region.
    let ext = store.partition(1).unwrap().clone();
    let lba = ext.offsets[1] / 512;
    px.set_faults(Faults {
        fail_lbas: Some((lba..lba + 1, Status::new(2, 0x80))),
        ..Faults::default()
    });
    let b1 = filled(&store, 4);
    let e = store.write(Region::Partition(1), &b1).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, StoreError::Command { .. })
            && msg.contains("Write Fault")
            && msg.contains("write of"),
        "{msg}"
    );
    px.set_faults(Faults::default());
    drop(store);
    // Nothing of the failed write was committed: generation 1, partition 1 never written.
    let mut again =
        Store::open_on(&Target::Nvme(&t), &Expect::default(), &IoConfig::default()).unwrap();
    assert_eq!(again.generation(), 1);
    assert!(!again.is_initialized(Region::Partition(1)).unwrap());
    let mut back = IoBuffer::new(again.max_partition_bytes()).unwrap();
    again.read(Region::Partition(2), &mut back).unwrap();
    assert_eq!(payload(&again, 2, &back), payload(&again, 2, &b));
}

#[test]
fn a_controller_that_stops_answering_fails_the_transfer_instead_of_hanging() {
    let dir = scratch();
    let px = proxy(&dir.path().join("ns.img"), 64 << 20, 9);
    let t = target(&px, 0);
    drop(Store::create_on(&Target::Nvme(&t), &spec(), &CreateOptions::default()).unwrap());
    // Long enough that a loaded machine (CI runs tests side by side) does not trip it.
    let io = IoConfig {
        command_timeout: Duration::from_secs(2),
        ..IoConfig::default()
    };
    let mut store = Store::open_on(&Target::Nvme(&t), &Expect::default(), &io).unwrap();
    px.set_faults(Faults {
        lose_doorbells: 1,
        ..Faults::default()
    });
    let b = filled(&store, 1);
    let start = std::time::Instant::now();
    let e = store.write(Region::Partition(0), &b).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    let msg = e.to_string();
    assert!(
        matches!(e, StoreError::ControllerTimeout { .. }) && msg.contains("SQ tail"),
        "{msg}"
    );
    // The controller's side names the cause: it never fetched what the lost doorbell covered.
    let seen = |key: &str| -> u32 {
        let rest = &msg[msg.find(key).unwrap_or_else(|| panic!("{key} in {msg}")) + key.len()..];
        rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap()]
            .parse()
            .unwrap()
    };
    assert_eq!(
        seen("SQ tail doorbell "),
        seen("fetched up to ") + 1,
        "{msg}"
    );
    assert!(msg.contains("held: []"), "{msg}");
    // The queue pair is gone; the store refuses further I/O with the same reason.
    assert!(matches!(
        store.write(Region::Partition(0), &b),
        Err(StoreError::ControllerTimeout { .. })
    ));
}

#[test]
fn a_namespace_too_small_or_a_missing_one_is_refused() {
    let dir = scratch();
    let px = proxy(&dir.path().join("ns.img"), 1 << 20, 9);
    let e = Store::create_on(
        &Target::Nvme(&target(&px, 0)),
        &spec(),
        &CreateOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(e, StoreError::DeviceTooSmall { .. }) && e.to_string().contains("namespace"),
        "{e}"
    );
    let mut t = target(&px, 0);
    t.namespace = 3;
    let e = Store::create_on(&Target::Nvme(&t), &spec(), &CreateOptions::default()).unwrap_err();
    assert!(e.to_string().contains("no namespace 3"), "{e}");
    let e = Store::create_on(
        &Target::Nvme(&target(&px, 1 << 20)),
        &spec(),
        &CreateOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("past the namespace"), "{e}");
}

#[test]
fn transfers_run_by_the_caller_land_where_io_extent_says_and_commit() {
    use std::os::unix::fs::FileExt;
    let dir = scratch();
    let backing = dir.path().join("ns.img");
    let px = proxy(&backing, 64 << 20, 9);
    let t = target(&px, 4096);
    let mut store =
        Store::create_on(&Target::Nvme(&t), &spec(), &CreateOptions::default()).unwrap();
    // The caller (standing in for the GPU I/O kernels) writes partition 3 itself, straight into
    // the namespace, and tells the store.
    let (at, len) = store.io_extent(Region::Partition(3), true).unwrap();
    assert!(at >= 4096 * 512 && len % 512 == 0);
    let b = filled(&store, 77);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&backing)
        .unwrap();
    file.write_all_at(&b.as_bytes()[..len as usize], at)
        .unwrap();
    file.sync_all().unwrap();
    assert!(matches!(
        store.io_extent(Region::Partition(3), false),
        Err(StoreError::NotInitialized { .. })
    ));
    store.mark_written(Region::Partition(3)).unwrap();
    // Reads now go to the copy just written.
    assert_eq!(
        store.io_extent(Region::Partition(3), false).unwrap(),
        (at, len)
    );
    store.commit(b"epochs_completed=1").unwrap();
    drop(store);
    let mut again =
        Store::open_on(&Target::Nvme(&t), &Expect::default(), &IoConfig::default()).unwrap();
    let mut back = IoBuffer::new(again.max_partition_bytes()).unwrap();
    again.read(Region::Partition(3), &mut back).unwrap();
    assert_eq!(payload(&again, 3, &back), payload(&again, 3, &b));
    // The next write goes to the other (shadow) copy.
    assert_ne!(again.io_extent(Region::Partition(3), true).unwrap().0, at);
}

#[test]
fn the_extent_table_persists_gives_disjoint_stores_and_guards_the_namespace_start() {
    let dir = scratch();
    let backing = dir.path().join("shared.img");
    let px = proxy(&backing, 64 << 20, 9);
    let table_target = target(&px, 0);
    let (a, b) = {
        let mut ext = Extents::open_or_create(&Target::Nvme(&table_target)).unwrap();
        let bytes = legend_storage::Layout::compute(&spec(), ext.block_size())
            .unwrap()
            .total_bytes;
        let a = ext.allocate("/runs/a", 1000, bytes).unwrap();
        let b = ext.allocate("/runs/b", 1001, bytes).unwrap();
        assert!(a + bytes / 512 <= b, "disjoint: a at {a}, b at {b}");
        (a, b)
    };
    // Two stores in their extents: filling one leaves the other's bytes alone.
    let (ta, tb) = (target(&px, a), target(&px, b));
    let mut sa = Store::create_on(&Target::Nvme(&ta), &spec(), &CreateOptions::default()).unwrap();
    let mut sb = Store::create_on(&Target::Nvme(&tb), &spec(), &CreateOptions::default()).unwrap();
    let fill_a = filled(&sa, 1);
    let fill_b = filled(&sb, 2);
    for p in 0..4 {
        sa.write(Region::Partition(p), &fill_a).unwrap();
        sb.write(Region::Partition(p), &fill_b).unwrap();
    }
    sa.commit(b"a").unwrap();
    sb.commit(b"b").unwrap();
    let mut back = IoBuffer::new(sa.max_partition_bytes()).unwrap();
    for p in 0..4 {
        sa.read(Region::Partition(p), &mut back).unwrap();
        assert_eq!(payload(&sa, p, &back), payload(&sa, p, &fill_a));
    }
    drop((sa, sb));
    // Reopened (a restarted daemon): the same extents; a freed one is reused first.
    let mut ext = Extents::open_or_create(&Target::Nvme(&table_target)).unwrap();
    assert_eq!(ext.table().find("/runs/b").map(|e| e.start_lba), Some(b));
    assert_eq!(ext.free("/runs/a").unwrap().unwrap().owner, 1000);
    drop(ext);
    let mut ext = Extents::open_or_create(&Target::Nvme(&table_target)).unwrap();
    assert!(
        ext.table().find("/runs/a").is_none(),
        "the free was committed"
    );
    assert_eq!(ext.allocate("/runs/c", 1002, 4096).unwrap(), a);
    // A namespace whose start holds a training store is not taken for a table.
    let other = dir.path().join("trained.img");
    let px2 = proxy(&other, 16 << 20, 9);
    Store::create_on(
        &Target::Nvme(&target(&px2, 0)),
        &spec(),
        &CreateOptions::default(),
    )
    .unwrap();
    let refused = Extents::open_or_create(&Target::Nvme(&target(&px2, 0)))
        .err()
        .expect("a training store at LBA 0");
    assert!(
        matches!(refused, StoreError::DatasetMismatch { .. }),
        "{refused}"
    );
}

/// Reads that complete out of order (a controller's later commands may overtake earlier ones;
/// the proxy posts them newest first) must still land where their own PRPs said: with a
/// shallow queue the slot at the SQ tail then often still holds a command in flight, and
/// nothing of a new command may be written into that slot (its PRP list page) until it is free.
/// Reads of whole partitions in one batch, under load the test makes itself, checked byte for
/// byte.
#[test]
fn reads_completing_out_of_order_land_in_their_own_buffers() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = scratch();
    let px = Arc::new(
        Proxy::open(
            &{
                let path = dir.path().join("ns.img");
                std::fs::File::create(&path)
                    .unwrap()
                    .set_len(256 << 20)
                    .unwrap();
                path
            },
            &ProxyOptions {
                lba_shift: 9,
                // 64 KiB commands: 16-page PRP lists, many commands per partition.
                max_transfer: 64 << 10,
                ..ProxyOptions::default()
            },
        )
        .unwrap(),
    );
    let spec = StoreSpec {
        num_nodes: 60_000,
        dim: 64,
        dtype: Dtype::F32,
        state_width: 64,
        ..spec()
    };
    let t = target(&px, 0);
    let mut store = Store::create_on(&Target::Nvme(&t), &spec, &CreateOptions::default()).unwrap();
    px.set_faults(Faults {
        reverse_completions: true,
        ..Faults::default()
    });
    let written: Vec<IoBuffer> = (0..4).map(|p| filled(&store, 1000 + p)).collect();
    for (p, b) in written.iter().enumerate() {
        store.write(Region::Partition(p as u32), b).unwrap();
    }
    store.commit(b"written").unwrap();
    drop(store);
    let spin = Arc::new(AtomicBool::new(true));
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let spin = spin.clone();
            std::thread::spawn(move || {
                while spin.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let mut checked = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    for depth in [3, 4, 5, 8].into_iter().cycle() {
        if std::time::Instant::now() > deadline {
            break;
        }
        let io = IoConfig {
            queue_depth: depth,
            ..IoConfig::default()
        };
        let mut store = Store::open_on(&Target::Nvme(&t), &Expect::default(), &io).unwrap();
        let mut back: Vec<IoBuffer> = (0..4)
            .map(|_| IoBuffer::new(store.max_partition_bytes()).unwrap())
            .collect();
        for _ in 0..5 {
            for b in &mut back {
                b.as_bytes_mut().fill(0xee);
            }
            let mut batch: Vec<IoRequest<'_>> = back
                .iter_mut()
                .enumerate()
                .map(|(p, b)| IoRequest::Read(Region::Partition(p as u32), b))
                .collect();
            store.submit(&mut batch).unwrap();
            for p in 0..4 {
                let (got, want) = (
                    payload(&store, p, &back[p as usize]),
                    payload(&store, p, &written[p as usize]),
                );
                let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert!(
                    wrong == 0,
                    "partition {p}: {wrong} of {} bytes read back wrong (queue depth {depth})",
                    want.len()
                );
            }
            checked += 1;
        }
    }
    spin.store(false, Ordering::Relaxed);
    spinners.into_iter().for_each(|s| s.join().unwrap());
    assert!(checked > 0);
}

#[test]
fn a_store_striped_over_two_controllers_holds_what_a_file_store_holds() {
    let dir = scratch();
    // Two controllers of different LBA sizes, each with its own queue pair; one starts after a
    // head of its namespace.
    let (a, b) = (
        proxy(&dir.path().join("a.img"), 32 << 20, 9),
        proxy(&dir.path().join("b.img"), 32 << 20, 12),
    );
    let (ta, tb) = (target(&a, 0), target(&b, 256));
    let members = [Target::Nvme(&ta), Target::Nvme(&tb)];
    let opts = CreateOptions {
        stripe_bytes: 64 << 10,
        ..CreateOptions::default()
    };
    let mut striped = Store::create_striped(&members, &spec(), &opts).unwrap();
    let file = dir.path().join("file.bin");
    let mut on_file = Store::create(&file, &spec(), &CreateOptions::default()).unwrap();
    let bufs: Vec<IoBuffer> = (0..4).map(|p| filled(&striped, p * 5 + 2)).collect();
    let mut batch: Vec<IoRequest<'_>> = bufs
        .iter()
        .enumerate()
        .map(|(p, b)| IoRequest::Write(Region::Partition(p as u32), b))
        .collect();
    striped.submit(&mut batch).unwrap();
    on_file.submit(&mut batch).unwrap();
    striped.commit(b"one").unwrap();
    on_file.commit(b"one").unwrap();
    drop(striped);
    let mut again =
        Store::open_striped(&members, &Expect::default(), &IoConfig::default()).unwrap();
    assert_eq!((again.generation(), again.progress()), (1, &b"one"[..]));
    for p in 0..4 {
        let (mut x, mut y) = (
            IoBuffer::new(again.max_partition_bytes()).unwrap(),
            IoBuffer::new(again.max_partition_bytes()).unwrap(),
        );
        again.read(Region::Partition(p), &mut x).unwrap();
        on_file.read(Region::Partition(p), &mut y).unwrap();
        assert_eq!(
            payload(&again, p, &x),
            payload(&on_file, p, &y),
            "partition {p}"
        );
    }
    // Both namespaces carry a share: neither holds the partitions alone.
    // Blocks written past the superblock slots (and b's head before its start LBA).
    let used = |path: &Path, head: usize| {
        std::fs::read(path)
            .unwrap()
            .chunks(4096)
            .skip(head + 512)
            .filter(|c| c.iter().any(|&v| v != 0))
            .count()
    };
    let (ua, ub) = (
        used(&dir.path().join("a.img"), 0),
        used(&dir.path().join("b.img"), 256),
    );
    let bytes: u64 = (0..4).map(|p| again.partition(p).unwrap().bytes).sum();
    assert!(
        ua > 0 && ub > 0 && (ua + ub) as u64 * 4096 >= bytes && ua.abs_diff(ub) <= 64,
        "{ua} and {ub} blocks used"
    );
}
