//! The proxy controller driven as the queue users drive a real one: queue memory and data
//! buffers mapped through it, commands built with `legend-nvme-protocol`, doorbells rung.

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

use legend_nvme::Controller;
use legend_nvme_protocol::{Opcode, Sqe, Status, prp};
use legend_nvme_proxy::{Faults, Proxy, ProxyOptions};

use common::{Fixture, Mem, PAGE};

const BLOCKS: u64 = 4096;

fn pattern(lba: u64) -> Vec<u8> {
    (0..512)
        .map(|i| (lba as usize * 31 + i * 7) as u8)
        .collect()
}

fn backing() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    let mut f = std::fs::File::create(&path).unwrap();
    for lba in 0..BLOCKS {
        f.write_all(&pattern(lba)).unwrap();
    }
    (dir, path)
}

#[test]
fn reads_and_writes_move_every_byte_through_prp_lists() {
    let (_dir, path) = backing();
    let proxy = Proxy::open(&path, &ProxyOptions::default()).unwrap();
    let info = proxy.info().unwrap();
    assert_eq!(info.namespaces[0].blocks, BLOCKS);
    let mut f = Fixture::new(&proxy, 1, 16, 64 * PAGE);
    // 100 blocks (13 pages) from byte 512 of the buffer: a PRP list.
    let st = f.rw(Opcode::Read, 7, 100, 512);
    assert!(st.is_success(), "{st}");
    for i in 0..100u64 {
        assert_eq!(
            f.data.bytes(64 * PAGE)[512 + 512 * i as usize..][..512],
            pattern(7 + i)
        );
    }
    // Write them back 1000 blocks on, flush, and check the file itself.
    let st = f.rw(Opcode::Write, 1007, 100, 512);
    assert!(st.is_success(), "{st}");
    let st = f.run(Sqe::flush(1), Duration::from_secs(10)).unwrap();
    assert!(st.is_success(), "{st}");
    let mut file = std::fs::File::open(&path).unwrap();
    let mut block = vec![0u8; 512];
    for i in 0..100u64 {
        file.seek(SeekFrom::Start((1007 + i) * 512)).unwrap();
        file.read_exact(&mut block).unwrap();
        assert_eq!(block, pattern(7 + i), "lba {}", 1007 + i);
    }
}

#[test]
fn bad_commands_get_their_status() {
    let (_dir, path) = backing();
    let proxy = Proxy::open(&path, &ProxyOptions::default()).unwrap();
    let mut f = Fixture::new(&proxy, 1, 8, 4 * PAGE);
    let st = f.rw(Opcode::Read, BLOCKS - 1, 2, 0);
    assert_eq!((st.sct(), st.sc()), (0, 0x80), "{st}");
    // A PRP naming memory never mapped: what an IOMMU faults on.
    let sqe = Sqe::read_write(
        Opcode::Read,
        1,
        0,
        8,
        prp::Prp {
            prp1: 0x1000,
            prp2: 0,
        },
    );
    let st = f.run(sqe, Duration::from_secs(10)).unwrap();
    assert_eq!((st.sct(), st.sc()), (0, 0x04), "{st}");
    let mut other_ns = Sqe::flush(1);
    other_ns.nsid = 2;
    let st = f.run(other_ns, Duration::from_secs(10)).unwrap();
    assert_eq!((st.sct(), st.sc()), (0, 0x0b), "{st}");
}

#[test]
fn injected_faults_are_reported_not_hung() {
    let (_dir, path) = backing();
    let proxy = Proxy::open(&path, &ProxyOptions::default()).unwrap();
    let mut f = Fixture::new(&proxy, 1, 8, 4 * PAGE);
    let media = Status::new(2, 0x81);
    proxy.set_faults(Faults {
        fail_lbas: Some((100..108, media)),
        ..Faults::default()
    });
    assert_eq!(f.rw(Opcode::Read, 104, 1, 0), media);
    assert!(f.rw(Opcode::Read, 108, 1, 0).is_success());
    proxy.set_faults(Faults {
        delay: Duration::from_millis(50),
        ..Faults::default()
    });
    let start = Instant::now();
    assert!(f.rw(Opcode::Read, 0, 1, 0).is_success());
    assert!(start.elapsed() >= Duration::from_millis(50));
    // A lost doorbell: the command is never fetched and the submitter's timeout fires; the
    // next doorbell write (a later command's) covers it, and both complete.
    proxy.set_faults(Faults {
        lose_doorbells: 1,
        ..Faults::default()
    });
    let p = f.prps(0, 512);
    let err = f
        .run(
            Sqe::read_write(Opcode::Read, 1, 0, 1, p),
            Duration::from_millis(200),
        )
        .unwrap_err();
    assert!(err.contains("no completion"), "{err}");
    f.qp.push(Sqe::read_write(Opcode::Read, 1, 1, 1, p))
        .unwrap();
    f.qp.ring_sq();
    let (start, mut done) = (Instant::now(), 0);
    while done < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{done} of 2 completed"
        );
        if let Some(c) = f.qp.poll() {
            assert!(c.unwrap().1.status().is_success());
            done += 1;
        }
    }
    f.qp.ring_cq();
}

#[test]
fn controller_rules_match_the_kernel_module() {
    let (_dir, path) = backing();
    let proxy = Proxy::open(&path, &ProxyOptions::default()).unwrap();
    let f = Fixture::new(&proxy, 3, 8, PAGE);
    let busy = |r: legend_nvme::Result<()>| match r {
        Err(legend_nvme::Error::Ioctl { source, .. }) => source.raw_os_error(),
        Ok(()) => None,
        Err(_) => Some(-1),
    };
    // No unmap of a live queue's rings; no second queue with the same qid. A data buffer may
    // go: a command naming it afterwards fails as under an IOMMU.
    assert_eq!(busy(proxy.unmap(1)), Some(libc::EBUSY));
    assert_eq!(busy(proxy.unmap(2)), None);
    let again = proxy.create_queue_pair(legend_nvme::uapi::QueuePairArgs {
        qid: 3,
        depth: 8,
        sq_handle: 1,
        cq_handle: 1,
        cq_offset: PAGE as u64,
        ..Default::default()
    });
    assert!(again.is_err());
    drop(f);
    proxy.delete_queue_pair(3).unwrap();
    assert_eq!(busy(proxy.unmap(1)), None);
    // GPU memory needs a device to copy with.
    // SAFETY: refused before any use of the address.
    let gpu = unsafe { proxy.map_gpu(0x7f00_0000_0000, 65536) };
    assert!(gpu.is_err());
}

#[test]
fn transfers_cross_back_to_back_mappings_and_fault_on_a_hole() {
    let (_dir, path) = backing();
    let opts = ProxyOptions {
        threads: 3,
        ..ProxyOptions::default()
    };
    let proxy = Proxy::open(&path, &opts).unwrap();
    // Queues 1 to 4 land on all three controller threads.
    let mut queues: Vec<Fixture> = (1..=4)
        .map(|qid| Fixture::new(&proxy, qid, 8, 8 * PAGE))
        .collect();
    for (i, f) in queues.iter_mut().enumerate() {
        let lba = 64 * i as u64;
        assert!(f.rw(Opcode::Read, lba, 64, 0).is_success());
        assert_eq!(f.data.bytes(PAGE)[..512], pattern(lba));
    }
    // One buffer mapped as two regions side by side: a command over both moves every byte
    // (the proxy copies contiguous pages at once, across the regions' boundary).
    let mut buf = Mem::new(8 * PAGE);
    // SAFETY: `buf` outlives the proxy's use of it (the commands below complete first).
    let (low, high) = unsafe {
        (
            proxy.map_host(buf.ptr(), 4 * PAGE).unwrap(),
            proxy.map_host(buf.ptr().add(4 * PAGE), 4 * PAGE).unwrap(),
        )
    };
    let f = &mut queues[0];
    f.data_bus = low
        .bus_addrs
        .iter()
        .chain(&high.bus_addrs)
        .copied()
        .collect();
    assert!(f.rw(Opcode::Read, 300, 64, 0).is_success());
    for i in 0..64u64 {
        assert_eq!(
            buf.bytes(8 * PAGE)[512 * i as usize..][..512],
            pattern(300 + i)
        );
    }
    // With the upper half unmapped the same command faults, as under an IOMMU.
    proxy.unmap(high.handle).unwrap();
    let st = f.rw(Opcode::Read, 300, 64, 0);
    assert_eq!((st.sct(), st.sc()), (0, 0x04), "{st}");
}
