//! Many queue users at once, under load the test makes itself: every command must complete, and
//! every Read must return what the last Write to its blocks put there.
//!
//! Each worker thread owns a range of LBAs and, in turn, queue pairs of random depths (created,
//! used for a while, deleted, created again under another qid), and submits small Reads, Writes
//! and Flushes in bursts of random size, ringing the doorbell after each command or once per
//! burst. Spinning threads keep every core busy, so the controller threads and the submitters
//! are preempted at arbitrary points, and every second the proxy switches between posting
//! completions as their I/O finishes and newest first. A command unanswered for `STALL` fails
//! the test with the proxy's report of its queue.
//!
//! The backing file is in memory (`/dev/shm`) where the machine has it: what is tested is the
//! queues, not a disk's latency. `LEGEND_PROXY_STRESS_S` sets how long it runs (default 20 s).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Fixture, PAGE, Rng};
use legend_nvme::Controller;
use legend_nvme_protocol::{Opcode, Sqe};
use legend_nvme_proxy::{Faults, Proxy, ProxyOptions};

/// How long one command may go unanswered: far beyond any 512 B command's time on a loaded
/// machine, far below the store's 30 s timeout the original failure hit.
const STALL: Duration = Duration::from_secs(10);
/// Blocks of 512 B each worker owns.
const BLOCKS_PER_WORKER: u64 = 256;
const WORKERS: u32 = 12;
/// Queue pairs the proxy offers: more than the workers, so a recreated queue often gets a qid
/// another worker had.
const QUEUE_PAIRS: u16 = 24;

fn block_bytes(tag: u64, lba: u64) -> [u8; 512] {
    let mut b = [0u8; 512];
    for (i, chunk) in b.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&(tag ^ (lba << 20) ^ i as u64).to_le_bytes());
    }
    b
}

/// Claims a free qid from `free` (a bit per qid), or `None` while all are taken.
fn claim(free: &AtomicU64, rng: &mut Rng) -> Option<u32> {
    loop {
        let bits = free.load(Ordering::Acquire);
        if bits == 0 {
            return None;
        }
        // A random set bit, so qids move between workers.
        let set: Vec<u32> = (0..64).filter(|b| bits & (1 << b) != 0).collect();
        let bit = set[rng.below(set.len() as u64) as usize];
        if free
            .compare_exchange(
                bits,
                bits & !(1 << bit),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            return Some(bit + 1);
        }
    }
}

fn worker(proxy: &Proxy, w: u32, free: &AtomicU64, deadline: Instant, commands: &AtomicU64) {
    let mut rng = Rng::new(0x5eed_0000 + u64::from(w));
    let first_lba = u64::from(w) * BLOCKS_PER_WORKER;
    // The tag last written to each of the worker's blocks (0: never written).
    let mut shadow = vec![0u64; BLOCKS_PER_WORKER as usize];
    let mut tag = u64::from(w) << 48;
    while Instant::now() < deadline {
        let Some(qid) = claim(free, &mut rng) else {
            std::thread::yield_now();
            continue;
        };
        let depth = 2 + rng.below(63) as u16;
        // One page of data per slot: commands of up to 8 blocks need no PRP list.
        let mut f = Fixture::new(proxy, qid, depth, usize::from(depth) * PAGE);
        for _ in 0..1 + rng.below(40) {
            // A burst of up to depth - 1 commands, to distinct blocks (no two in flight on one).
            let burst = 1 + rng.below(u64::from(depth) - 1) as usize;
            let mut busy = vec![false; BLOCKS_PER_WORKER as usize];
            let ring_each = rng.below(2) == 0;
            let mut sent = Vec::with_capacity(burst);
            for _ in 0..burst {
                let blocks = 1 + rng.below(8);
                let at = rng.below(BLOCKS_PER_WORKER - blocks + 1);
                let span = at as usize..(at + blocks) as usize;
                let op = match rng.below(10) {
                    0 => Opcode::Flush,
                    1..=4 => Opcode::Write,
                    _ => Opcode::Read,
                };
                if op != Opcode::Flush && busy[span.clone()].iter().any(|&b| b) {
                    continue;
                }
                let slot = f.qp.ring().sq_tail();
                let offset = usize::from(slot) * PAGE;
                let sqe = match op {
                    Opcode::Flush => Sqe::flush(1),
                    _ => {
                        if op == Opcode::Write {
                            tag += 1;
                            let data = f.data.bytes(usize::from(depth) * PAGE);
                            for b in 0..blocks {
                                let lba = first_lba + at + b;
                                data[offset + b as usize * 512..][..512]
                                    .copy_from_slice(&block_bytes(tag, lba));
                            }
                        }
                        busy[span.clone()].iter_mut().for_each(|b| *b = true);
                        let p = f.prps(offset, blocks * 512);
                        Sqe::read_write(op, 1, first_lba + at, blocks as u32, p)
                    }
                };
                let cid = f.qp.push(sqe).expect("a burst fits the queue");
                assert_eq!(cid, slot);
                if ring_each {
                    f.qp.ring_sq();
                }
                sent.push((cid, op, at, blocks, tag));
            }
            if !ring_each {
                f.qp.ring_sq();
            }
            let mut left = sent.len();
            let mut last = Instant::now();
            while left > 0 {
                let Some(done) = f.qp.poll() else {
                    assert!(
                        last.elapsed() < STALL,
                        "worker {w}: {left} of {} commands unanswered for {STALL:?} on qid {qid} \
                         depth {depth}: SQ tail {}, CQ head {} (phase {}), ring each: \
                         {ring_each}; {}",
                        sent.len(),
                        f.qp.ring().sq_tail(),
                        f.qp.ring().cq_head(),
                        f.qp.ring().phase(),
                        proxy.queue_report(qid).unwrap_or_default(),
                    );
                    std::hint::spin_loop();
                    continue;
                };
                last = Instant::now();
                left -= 1;
                let (cid, cqe) = done.expect("a completion for a command in flight");
                assert!(
                    cqe.status().is_success(),
                    "qid {qid} cid {cid}: {}",
                    cqe.status()
                );
                let &(_, op, at, blocks, t) = sent.iter().find(|s| s.0 == cid).unwrap();
                let offset = usize::from(cid) * PAGE;
                for b in 0..blocks {
                    let i = (at + b) as usize;
                    match op {
                        Opcode::Write => shadow[i] = t,
                        Opcode::Read if shadow[i] != 0 => {
                            let data = f.data.bytes(usize::from(depth) * PAGE);
                            assert_eq!(
                                data[offset + b as usize * 512..][..512],
                                block_bytes(shadow[i], first_lba + at + b),
                                "worker {w}: block {} read back wrong",
                                first_lba + at + b
                            );
                        }
                        _ => {}
                    }
                }
                // Ring the CQ head now and then, not after every completion.
                if rng.below(3) == 0 {
                    f.qp.ring_cq();
                }
            }
            f.qp.ring_cq();
            commands.fetch_add(sent.len() as u64, Ordering::Relaxed);
        }
        proxy.delete_queue_pair(qid).unwrap();
        f.unmap(proxy);
        free.fetch_or(1 << (qid - 1), Ordering::AcqRel);
    }
}

#[test]
fn every_command_completes_under_load_with_queues_coming_and_going() {
    let seconds = std::env::var("LEGEND_PROXY_STRESS_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .unwrap();
    let path = dir.path().join("ns.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(u64::from(WORKERS) * BLOCKS_PER_WORKER * 512)
        .unwrap();
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let proxy = Arc::new(
        Proxy::open(
            &path,
            &ProxyOptions {
                queue_pairs: QUEUE_PAIRS,
                // Two controller threads even on 2 cores: queues move between them as qids do.
                threads: 2,
                io_depth: 32,
                ..ProxyOptions::default()
            },
        )
        .unwrap(),
    );
    let free = Arc::new(AtomicU64::new((1 << QUEUE_PAIRS) - 1));
    let commands = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let spin = Arc::new(AtomicBool::new(true));
    let spinners: Vec<_> = (0..cores)
        .map(|_| {
            let spin = spin.clone();
            std::thread::spawn(move || {
                while spin.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (proxy, free, commands) = (proxy.clone(), free.clone(), commands.clone());
            std::thread::spawn(move || worker(&proxy, w, &free, deadline, &commands))
        })
        .collect();
    let mut reverse = false;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_secs(1));
        reverse = !reverse;
        proxy.set_faults(Faults {
            reverse_completions: reverse,
            ..Faults::default()
        });
    }
    let results: Vec<_> = workers.into_iter().map(|t| t.join()).collect();
    spin.store(false, Ordering::Relaxed);
    spinners.into_iter().for_each(|t| t.join().unwrap());
    let total = commands.load(Ordering::Relaxed);
    eprintln!("{total} commands in {seconds} s");
    for r in results {
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
    }
    assert!(total > 1000, "only {total} commands ran");
}
