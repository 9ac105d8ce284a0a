//! The GPU I/O kernels (`kernels/nvme_io.cu`) against the userspace proxy controller over a
//! file: the SQE bytes equal legend-nvme-protocol's test vectors, whole partitions move in both
//! directions byte for byte (small commands also through staging slots in host memory),
//! injected error statuses come back with their LBA, and a lost
//! doorbell ends in a timeout report instead of a hang; the row cache's lookups equal the store
//! byte for byte, and finish with fewer SQ entries and cache slots than requesting threads.
//! Needs a GPU: the tests are `#[ignore]`d, so a plain `cargo test` reports them skipped;
//! `--include-ignored` runs them (scripts/gpu/run-all.sh).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use legend_cuda::nvme_io::{
    CachedTable, CudaDeviceMemory, GpuIo, GpuIoJob, GpuIoOptions, IoMember, MemberJob,
    RingPlacement, RowCache, RowCacheOptions, SqeVector, sqe_vectors,
};
use legend_cuda::{Gpu, GpuError};
use legend_nvme_protocol::Status;
use legend_nvme_proxy::{Faults, Proxy, ProxyOptions};

mod common;

use common::gpu;

const VECTORS: &str = include_str!("../../../kernels/testdata/sqe_vectors.txt");

/// Page `k` of vector `i`'s buffer, as the vector file's header says.
fn page(i: usize, k: u64, page_shift: u32) -> u64 {
    0x7f00_0000_0000 + (((k * 7919 + i as u64) % 509) << page_shift)
}

fn hex(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn the_kernels_build_the_shared_sqe_vectors() {
    let gpu = gpu();
    let lines: Vec<&str> = VECTORS.lines().filter(|l| !l.starts_with('#')).collect();
    let mut vectors = Vec::new();
    let mut want = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let parts: Vec<&str> = line.split('|').collect();
        let f: Vec<&str> = parts[0].split_whitespace().collect();
        let (lba_shift, page_shift) = (f[4].parse::<u32>().unwrap(), f[5].parse::<u32>().unwrap());
        let offset = hex(f[6]);
        let blocks: u32 = f[3].parse().unwrap();
        let last = (offset + (u64::from(blocks) << lba_shift)) >> page_shift;
        let table: Vec<u64> = (0..=last).map(|k| page(i, k, page_shift)).collect();
        let dev = gpu.upload(&table).unwrap();
        vectors.push((dev, f.clone(), lba_shift, page_shift, offset, blocks));
        let dwords: Vec<u32> = parts[1]
            .split_whitespace()
            .map(|w| u32::from_str_radix(w, 16).unwrap())
            .collect();
        let list: Vec<u64> = parts[2].split_whitespace().map(hex).collect();
        want.push((dwords, list));
    }
    let inputs: Vec<SqeVector> = vectors
        .iter()
        .map(
            |(dev, f, lba_shift, page_shift, offset, blocks)| SqeVector {
                pages: gpu_ptr(&gpu, dev),
                offset: *offset,
                lba: hex(f[2]),
                list_bus: hex(f[8]),
                page_shift: *page_shift,
                opcode: f[0].parse().unwrap(),
                nsid: f[1].parse().unwrap(),
                blocks: *blocks,
                lba_shift: *lba_shift,
                cid: f[7].parse().unwrap(),
            },
        )
        .collect();
    let (sqes, lists) = sqe_vectors(&gpu, &inputs).unwrap();
    for (i, (dwords, list)) in want.iter().enumerate() {
        assert_eq!(
            &sqes[16 * i..16 * i + 16],
            dwords.as_slice(),
            "vector {i}: SQE"
        );
        assert_eq!(
            &lists[512 * i..512 * i + list.len()],
            list.as_slice(),
            "vector {i}: PRP list"
        );
    }
    println!("{} SQE vectors equal on CPU and GPU", want.len());
}

fn gpu_ptr(gpu: &Gpu, s: &legend_cuda::CudaSlice<u64>) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _g) = s.device_ptr(gpu.stream());
    p
}

/// A backing file of `bytes` with a known pattern, and a proxy over it that reaches `gpu`.
fn proxy(dir: &tempfile::TempDir, bytes: usize, gpu: &Gpu) -> (std::path::PathBuf, Arc<Proxy>) {
    proxy_with(dir, bytes, gpu, 0)
}

/// [`proxy`] with the pattern shifted by `salt`: files that differ everywhere.
fn proxy_with(
    dir: &tempfile::TempDir,
    bytes: usize,
    gpu: &Gpu,
    salt: u64,
) -> (std::path::PathBuf, Arc<Proxy>) {
    let path = dir.path().join("ns.img");
    let mut f = std::fs::File::create(&path).unwrap();
    let data: Vec<u8> = (0..bytes)
        .map(|i| (((i as u64 + salt) * 2_654_435_761) >> 13) as u8)
        .collect();
    f.write_all(&data).unwrap();
    drop(f);
    let p = Arc::new(Proxy::open(&path, &ProxyOptions::default()).unwrap());
    p.attach_device(Arc::new(CudaDeviceMemory::new(gpu).unwrap()))
        .unwrap();
    (path, p)
}

fn scratch() -> tempfile::TempDir {
    // tmpfs where the machine has one: the I/O then measures the queues, not a disk.
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix("legend-nvme-io")
        .tempdir_in(base)
        .unwrap()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn whole_partitions_move_through_the_gpu_queues_byte_for_byte() {
    let gpu = gpu();
    let dir = scratch();
    let bytes = 256 << 20;
    let (path, proxy) = proxy(&dir, bytes, &gpu);
    let opts = GpuIoOptions {
        queues: 8,
        threads: 256,
        ..GpuIoOptions::default()
    };
    let mut io = GpuIo::open(&gpu, proxy.clone(), &opts).unwrap();
    let half = bytes / 2;
    let buf = Aligned::new(&gpu, half);
    // SAFETY: `buf` outlives `io` (dropped first below).
    let region = unsafe { io.map(buf.ptr, half) }.unwrap();
    // Read the first half of the namespace into GPU memory.
    let run = io
        .run(
            &[GpuIoJob {
                region,
                offset: 0,
                bytes: half as u64,
                at: 0,
                write: false,
            }],
            true,
        )
        .unwrap();
    let got = buf.download(&gpu);
    let file = std::fs::read(&path).unwrap();
    assert!(got == file[..half], "the read half differs from the file");
    println!(
        "read {} MiB in {} commands: {:.2} GB/s",
        half >> 20,
        run.commands,
        run.bytes as f64 / run.seconds / 1e9
    );
    assert_eq!(run.latencies_ns.len() as u64, run.commands);
    assert!(run.latencies_ns.iter().all(|&l| l > 0));
    // Write it to the second half, then a swap in one launch: write a quarter back over the
    // start while reading another quarter.
    io.run(
        &[GpuIoJob {
            region,
            offset: 0,
            bytes: half as u64,
            at: half as u64,
            write: true,
        }],
        false,
    )
    .unwrap();
    let file = std::fs::read(&path).unwrap();
    assert!(file[half..] == file[..half], "the written half differs");
    let q = half / 2;
    io.run(
        &[
            GpuIoJob {
                region,
                offset: 0,
                bytes: q as u64,
                at: 4096,
                write: true,
            },
            GpuIoJob {
                region,
                offset: q as u64,
                bytes: q as u64,
                at: (half + 12 * 4096) as u64,
                write: false,
            },
        ],
        false,
    )
    .unwrap();
    let after = std::fs::read(&path).unwrap();
    assert!(
        after[4096..4096 + q] == got[..q],
        "swap: the written quarter differs"
    );
    let got2 = buf.download(&gpu);
    assert!(
        got2[q..] == after[half + 12 * 4096..half + 12 * 4096 + q],
        "swap: the read quarter differs"
    );
    drop(io);
    drop(buf);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn staged_small_commands_move_byte_for_byte_beside_direct_ones() {
    let gpu = gpu();
    let dir = scratch();
    let bytes = 64 << 20;
    let (path, proxy) = proxy(&dir, bytes, &gpu);
    let opts = GpuIoOptions {
        queues: 4,
        threads: 64,
        staging: 8192,
        ..GpuIoOptions::default()
    };
    let mut io = GpuIo::open(&gpu, proxy.clone(), &opts).unwrap();
    let len = 16 << 20;
    let buf = Aligned::new(&gpu, len);
    // SAFETY: `buf` outlives `io` (dropped first below).
    let region = unsafe { io.map(buf.ptr, len) }.unwrap();
    // Many more reads than staging slots, in sizes around the slot (4 KiB and 8 KiB staged,
    // 12 KiB and 1 MiB direct), to destinations only 4-byte aligned as well as aligned ones.
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut jobs = Vec::new();
    let mut at_buf = 0u64;
    while at_buf + (1 << 20) + 4 < len as u64 {
        let size = match next() % 40 {
            0 => 1 << 20,
            1..4 => 12288,
            4..12 => 8192,
            _ => 4096,
        };
        let at = next() % (bytes as u64 / 4096 - 256) * 4096;
        let offset = at_buf + if next() % 2 == 0 { 4 } else { 0 };
        jobs.push(GpuIoJob {
            region,
            offset,
            bytes: size,
            at,
            write: false,
        });
        at_buf = (offset + size).next_multiple_of(16);
    }
    let run = io.run(&jobs, true).unwrap();
    let got = buf.download(&gpu);
    let file = std::fs::read(&path).unwrap();
    for (i, j) in jobs.iter().enumerate() {
        let (o, a, n) = (j.offset as usize, j.at as usize, j.bytes as usize);
        assert!(
            got[o..o + n] == file[a..a + n],
            "read {i}: {n} bytes from byte {a} into byte {o} differ"
        );
    }
    println!(
        "{} staged and direct reads byte for byte: {:.2} GB/s",
        run.commands,
        run.bytes as f64 / run.seconds / 1e9
    );
    // Staged writes: 4 KiB pieces of the buffer to scattered places, read back from the file.
    let writes: Vec<GpuIoJob> = (0..2000u64)
        .map(|k| GpuIoJob {
            region,
            offset: k * 4100,
            bytes: 4096,
            at: (k * 7 + 3) * 4096,
            write: true,
        })
        .collect();
    io.run(&writes, false).unwrap();
    let file = std::fs::read(&path).unwrap();
    for (k, j) in writes.iter().enumerate() {
        let (o, a) = (j.offset as usize, j.at as usize);
        assert!(
            file[a..a + 4096] == got[o..o + 4096],
            "write {k}: 4096 bytes from byte {o} to byte {a} differ"
        );
    }
    // A staged read that fails copies nothing and reports its LBA.
    proxy.set_faults(Faults {
        fail_lbas: Some((800..801, Status::new(2, 0x81))),
        ..Faults::default()
    });
    let before = buf.download(&gpu);
    let e = io
        .run(
            &[GpuIoJob {
                region,
                offset: 0,
                bytes: 4096,
                at: 800 << 9,
                write: false,
            }],
            false,
        )
        .unwrap_err();
    assert!(
        matches!(e, GpuError::NvmeCommand { ref error, .. } if error.lba == 800),
        "{e}"
    );
    assert!(
        buf.download(&gpu) == before,
        "a failed staged read changed GPU memory"
    );
    drop(io);
    drop(buf);
}

/// `len` bytes of GPU memory starting at a 64 KiB boundary (what P2P mappings need) inside a
/// larger allocation.
struct Aligned {
    buf: legend_cuda::CudaSlice<u8>,
    ptr: u64,
    skip: usize,
    len: usize,
}

impl Aligned {
    fn new(gpu: &Gpu, len: usize) -> Aligned {
        use cudarc::driver::DevicePtr;
        let buf = gpu.zeros::<u8>(len + (1 << 16)).unwrap();
        let base = {
            let (base, _g) = buf.device_ptr(gpu.stream());
            base
        };
        let ptr = base.next_multiple_of(1 << 16);
        let skip = (ptr - base) as usize;
        Aligned {
            buf,
            ptr,
            skip,
            len,
        }
    }

    fn download(&self, gpu: &Gpu) -> Vec<u8> {
        let all = gpu.download(&self.buf).unwrap();
        all[self.skip..self.skip + self.len].to_vec()
    }
}

/// Where stripe unit `k` of a striped transfer lies: its member and its byte there (units dealt
/// round-robin from `first` on, as legend-storage's striping does).
fn unit_place(k: u64, members: u64, unit: u64, first: u64) -> (usize, u64) {
    ((k % members) as usize, first + k / members * unit)
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn one_launch_stripes_a_transfer_over_two_controllers() {
    // Two proxies over two files, each its own queue pairs (4 and 3): a transfer striped in
    // 256 KiB units moves in one launch each way, byte for byte against both files.
    let gpu = gpu();
    let (dir_a, dir_b) = (scratch(), scratch());
    let bytes = 32 << 20;
    let (path_a, a) = proxy_with(&dir_a, bytes, &gpu, 0);
    let (path_b, b) = proxy_with(&dir_b, bytes, &gpu, 7);
    let opts = |queues| GpuIoOptions {
        queues,
        threads: 64,
        ..GpuIoOptions::default()
    };
    let members = [
        IoMember {
            controller: a.clone(),
            options: opts(4),
        },
        IoMember {
            controller: b.clone(),
            options: opts(3),
        },
    ];
    let mut io = GpuIo::open_members(&gpu, &members).unwrap();
    assert_eq!(io.members(), 2);
    let info = io.member(1).unwrap();
    assert_eq!((info.queues, info.namespace_bytes), (3, bytes as u64));
    let (unit, units) = (256u64 << 10, 40u64);
    let len = (unit * units) as usize;
    let region = io.alloc(&gpu, len).unwrap();
    let jobs = |first: u64, write: bool| -> Vec<MemberJob> {
        (0..units)
            .map(|k| {
                let (member, at) = unit_place(k, 2, unit, first);
                MemberJob {
                    member,
                    job: GpuIoJob {
                        region,
                        offset: k * unit,
                        bytes: unit,
                        at,
                        write,
                    },
                }
            })
            .collect()
    };
    let mut files = [
        std::fs::read(&path_a).unwrap(),
        std::fs::read(&path_b).unwrap(),
    ];
    // Read: the region holds the units in order, each from its member.
    let run = io.run_members(&jobs(1 << 20, false), true).unwrap();
    let got = io.download(region).unwrap();
    for k in 0..units {
        let (m, at) = unit_place(k, 2, unit, 1 << 20);
        let (at, u) = (at as usize, unit as usize);
        let k = k as usize;
        assert!(
            got[k * u..(k + 1) * u] == files[m][at..at + u],
            "unit {k} read from member {m} differs"
        );
    }
    assert_eq!(run.member_bytes, vec![unit * units / 2; 2]);
    assert_eq!(run.latencies_ns.len() as u64, run.commands);
    println!(
        "striped read of {} MiB over two proxies in {} commands ({:?} a member): {:.2} GB/s",
        len >> 20,
        run.commands,
        run.member_commands,
        run.bytes as f64 / run.seconds / 1e9
    );
    // Write other bytes back, striped from another first byte, and compare whole files: every
    // unit where it belongs, nothing else touched.
    let pattern: Vec<u8> = (0..len).map(|i| ((i as u64 * 40_503) >> 7) as u8).collect();
    let staged = gpu.upload(&pattern).unwrap();
    let src = {
        use cudarc::driver::DevicePtr;
        let (p, _g) = staged.device_ptr(gpu.stream());
        p
    };
    gpu.synchronize().unwrap();
    // SAFETY: both ranges are live device memory of `len` bytes that nothing else writes.
    unsafe { io.copy(io.region_addr(region).unwrap(), src, len) }.unwrap();
    let first = 3 << 20;
    io.run_members(&jobs(first, true), false).unwrap();
    for k in 0..units {
        let (m, at) = unit_place(k, 2, unit, first);
        let (at, u, k) = (at as usize, unit as usize, k as usize);
        files[m][at..at + u].copy_from_slice(&pattern[k * u..(k + 1) * u]);
    }
    for (m, path) in [&path_a, &path_b].into_iter().enumerate() {
        let now = std::fs::read(path).unwrap();
        assert!(now == files[m], "member {m}'s file after the striped write");
    }
    // A member that does not exist is refused by its index.
    let bad = MemberJob {
        member: 2,
        ..jobs(0, false)[0]
    };
    match io.run_members(&[bad], false) {
        Err(GpuError::Shape(what)) => assert!(what.contains("member 2 of 2"), "{what}"),
        other => panic!("a job on member 2 of 2: {other:?}"),
    }
    drop(io);
    drop(staged);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn injected_errors_come_back_with_their_lba_and_status() {
    let gpu = gpu();
    let dir = scratch();
    let (_path, proxy) = proxy(&dir, 16 << 20, &gpu);
    let mut io = GpuIo::open(&gpu, proxy.clone(), &GpuIoOptions::default()).unwrap();
    let buf = Aligned::new(&gpu, 8 << 20);
    // SAFETY: `buf` outlives `io`.
    let region = unsafe { io.map(buf.ptr, 8 << 20) }.unwrap();
    let media = Status::new(2, 0x81);
    proxy.set_faults(Faults {
        fail_lbas: Some((5000..5001, media)),
        ..Faults::default()
    });
    let e = io
        .run(
            &[GpuIoJob {
                region,
                offset: 0,
                bytes: 8 << 20,
                at: 0,
                write: false,
            }],
            false,
        )
        .unwrap_err();
    match &e {
        GpuError::NvmeCommand { error, .. } => {
            assert_eq!(error.status.sct(), 2);
            assert_eq!(error.status.sc(), 0x81);
            assert!(
                error.lba <= 5000 && 5000 < error.lba + u64::from(error.blocks),
                "{e}"
            );
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("Unrecovered Read Error"), "{e}");
    // The queues stay usable after a failed command.
    proxy.set_faults(Faults::default());
    io.run(
        &[GpuIoJob {
            region,
            offset: 0,
            bytes: 1 << 20,
            at: 0,
            write: false,
        }],
        false,
    )
    .unwrap();
    drop(io);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn a_lost_doorbell_times_out_with_a_report_not_a_hang() {
    let gpu = gpu();
    let dir = scratch();
    let (_path, proxy) = proxy(&dir, 16 << 20, &gpu);
    let opts = GpuIoOptions {
        queues: 1,
        threads: 32,
        timeout: Duration::from_millis(500),
        placement: RingPlacement::Host,
        ..GpuIoOptions::default()
    };
    let mut io = GpuIo::open(&gpu, proxy.clone(), &opts).unwrap();
    let buf = Aligned::new(&gpu, 1 << 20);
    // SAFETY: `buf` outlives `io`.
    let region = unsafe { io.map(buf.ptr, 1 << 20) }.unwrap();
    // Every doorbell of the run is lost: one batch, one doorbell.
    proxy.set_faults(Faults {
        lose_doorbells: 1,
        ..Faults::default()
    });
    let start = Instant::now();
    let e = io
        .run(
            &[GpuIoJob {
                region,
                offset: 0,
                bytes: 64 << 10,
                at: 0,
                write: false,
            }],
            false,
        )
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(20));
    let msg = e.to_string();
    assert!(
        matches!(e, GpuError::NvmeTimeout { .. })
            && msg.contains("SQ tail")
            && msg.contains("in flight"),
        "{msg}"
    );
    drop(io);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn proxies_come_and_go_in_one_process() {
    let gpu = gpu();
    // Each proxy page-locks its bounce buffers with the GPU; a later one reusing the address
    // range must not find them still registered.
    for round in 0..3 {
        let dir = scratch();
        let (_path, proxy) = proxy(&dir, 8 << 20, &gpu);
        let mut io = GpuIo::open(&gpu, proxy.clone(), &GpuIoOptions::default()).unwrap();
        let region = io.alloc(&gpu, 4 << 20).unwrap();
        let job = GpuIoJob {
            region,
            offset: 0,
            bytes: 4 << 20,
            at: 0,
            write: false,
        };
        assert_eq!(
            io.run(&[job], false).unwrap().bytes,
            4 << 20,
            "round {round}"
        );
        let again = proxy.attach_device(Arc::new(CudaDeviceMemory::new(&gpu).unwrap()));
        assert!(again.is_err(), "a second GPU attached to one proxy");
    }
}

/// Ids over `rows`, most of them from a few hot rows (a power law by construction: id
/// `rows * u^4` for uniform u), the rest uniform.
fn skewed_ids(rows: u64, n: usize, seed: u64) -> Vec<u64> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            if s.is_multiple_of(4) {
                s % rows
            } else {
                ((rows as f64 * u.powi(4)) as u64).min(rows - 1)
            }
        })
        .collect()
}

/// Checks each looked-up row against the backing file.
fn assert_rows(got: &[u8], ids: &[u64], file: &[u8], table: &CachedTable) {
    let rb = table.row_bytes as usize;
    for (i, &id) in ids.iter().enumerate() {
        let at = table.byte_of(id) as usize;
        assert!(
            got[i * rb..(i + 1) * rb] == file[at..at + rb],
            "lookup {i}: row {id} differs from the store"
        );
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn cached_lookups_equal_the_store_byte_for_byte() {
    let gpu = gpu();
    let dir = scratch();
    let (path, proxy) = proxy(&dir, 16 << 20, &gpu);
    let file = std::fs::read(&path).unwrap();
    // 20 000 rows of 400 bytes (d = 100 floats): lines of 32 rows (12 800 bytes, whole
    // 512-byte LBAs), 625 lines; the cache holds 128 of them, a fifth (and fewer than the
    // 4 x 64 x 2 requests the blocks keep in flight, so sets fill and requests retry).
    let table = CachedTable::contiguous(3 * 4096, 20_000, 400);
    for staging in [0, 16384] {
        let io_opts = GpuIoOptions {
            queues: 4,
            threads: 64,
            staging,
            ..GpuIoOptions::default()
        };
        let io = GpuIo::open(&gpu, proxy.clone(), &io_opts).unwrap();
        let opts = RowCacheOptions {
            line_bytes: 4096,
            lines: 128,
            ways: 8,
            requesters: 64,
            ahead: 2,
            ..RowCacheOptions::default()
        };
        let mut cache = RowCache::open(&gpu, io, table.clone(), &opts).unwrap();
        assert_eq!(cache.line_bytes(), 12_800);
        let mut asked = 0u64;
        for round in 0..3u64 {
            let ids = skewed_ids(table.rows, 40_000, 7 + round);
            let (got, secs) = cache.lookup(&ids).unwrap();
            asked += ids.len() as u64;
            assert_rows(&got, &ids, &file, &table);
            let s = cache.stats().unwrap();
            println!(
                "staging {staging}, round {round}: {} lookups in {:.2} ms; {s:?}, hit rate {:.3}",
                ids.len(),
                secs * 1e3,
                s.hit_rate()
            );
            assert_eq!(s.hits + s.misses + s.coalesced, asked, "{s:?}");
            // Some lookups hit, and more lines were read than the cache holds (it evicts). (The
            // first GPU run, with a cache of 64 lines: hit rate 0.48.)
            assert!(s.hits > 0 && s.misses > 128 && s.misses < asked, "{s:?}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn lookups_finish_with_fewer_sq_entries_and_slots_than_requesters() {
    let gpu = gpu();
    let dir = scratch();
    let (path, proxy) = proxy(&dir, 8 << 20, &gpu);
    let file = std::fs::read(&path).unwrap();
    let table = CachedTable::contiguous(0, 16_384, 512);
    // Queues of 5 entries (2 threads' batches and a free slot) under 2 x 512 requesters with
    // 4 requests each in flight, and a cache of 16 one-row lines: sets fill with pinned lines
    // and requesters must give theirs up to go on.
    let io_opts = GpuIoOptions {
        queues: 2,
        threads: 2,
        timeout: Duration::from_secs(5),
        ..GpuIoOptions::default()
    };
    let io = GpuIo::open(&gpu, proxy.clone(), &io_opts).unwrap();
    let opts = RowCacheOptions {
        line_bytes: 512,
        lines: 16,
        ways: 4,
        requesters: 512,
        ahead: 4,
        ..RowCacheOptions::default()
    };
    let mut cache = RowCache::open(&gpu, io, table.clone(), &opts).unwrap();
    assert!(u32::from(cache.queue_depth()) < opts.requesters);
    let ids: Vec<u64> = (0..4_000u64).map(|i| (i * 7919) % table.rows).collect();
    let start = Instant::now();
    let (got, _) = cache.lookup(&ids).unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    assert_rows(&got, &ids, &file, &table);
    let s = cache.stats().unwrap();
    println!("depth {}: {s:?}", cache.queue_depth());
    assert!(s.retries > 0, "no set ever filled: {s:?}");
    // A line the controller fails: the lookup names it; the cache goes on afterwards. Rows
    // 100..132 first push every line out (8 new lines a 4-way set), so row 9000 is read.
    let flush: Vec<u64> = (100..132).collect();
    cache.lookup(&flush).unwrap();
    proxy.set_faults(Faults {
        fail_lbas: Some((9000..9001, Status::new(2, 0x81))),
        ..Faults::default()
    });
    let e = cache.lookup(&[9000, 1, 2]).unwrap_err();
    assert!(
        matches!(e, GpuError::NvmeCommand { ref error, .. } if error.lba == 9000),
        "{e}"
    );
    proxy.set_faults(Faults::default());
    let (got, _) = cache.lookup(&[9000, 1, 2]).unwrap();
    assert_rows(&got, &[9000, 1, 2], &file, &table);
}
