//! `--backend proxy | nvme` with CPU submitters: one I/O queue pair per thread, `--depth`
//! commands in flight, built and completed with `legend-nvme-protocol`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use legend_nvme::{Controller, uapi};
use legend_nvme_protocol::{CommandError, MAX_DEPTH, Opcode, QueueLayout, QueuePair, Sqe, prp};

use super::{BenchBackend, IoArgs, Op, PageMemory, Samples, Span, check_write};

/// How long one command may take before the run is declared failed.
const TIMEOUT: Duration = Duration::from_secs(10);

pub fn run(
    args: &IoArgs,
    path: &Path,
    ctrl: Arc<dyn Controller>,
    duration: Duration,
) -> anyhow::Result<Samples> {
    let info = ctrl.info()?;
    let ns = legend_nvme::namespace(&info, args.namespace)
        .with_context(|| format!("{}: no namespace {}", ctrl.label(), args.namespace))?;
    check_write(args, path, args.backend == BenchBackend::Nvme)?;
    let block = 1u64 << ns.lba_shift;
    let span = Span::of(args, path, ns.blocks << ns.lba_shift, block)?;
    if info.max_transfer != 0 && args.size > u64::from(info.max_transfer) {
        bail!(
            "--size {} exceeds the controller's transfer limit of {} bytes",
            args.size,
            info.max_transfer
        );
    }
    if args.size > (prp::MAX_PAGES as u64 - 1) * prp::PAGE || args.size / block > 65536 {
        bail!("--size {} exceeds what one command moves here", args.size);
    }
    let depth = (args.depth + 1)
        .min(u32::from(MAX_DEPTH))
        .min(info.max_queue_entries);
    if args.queues > info.queue_pairs {
        bail!(
            "--queues {}: the controller offers {}",
            args.queues,
            info.queue_pairs
        );
    }
    let results: Vec<anyhow::Result<Samples>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.queues)
            .map(|q| {
                let (ctrl, span) = (&ctrl, &span);
                s.spawn(move || {
                    queue(
                        args,
                        ctrl.as_ref(),
                        span,
                        q,
                        depth as u16,
                        ns.lba_shift,
                        duration,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a queue thread panicked"))
            })
            .collect()
    });
    let mut all = Samples::default();
    for r in results {
        all.merge(r?);
    }
    Ok(all)
}

fn queue(
    args: &IoArgs,
    ctrl: &dyn Controller,
    span: &Span,
    q: u32,
    depth: u16,
    lba_shift: u32,
    duration: Duration,
) -> anyhow::Result<Samples> {
    // The rings and PRP list pages, then each slot's data buffer.
    let layout = QueueLayout::new(depth);
    let total = layout.bytes() + usize::from(depth) * slot_bytes(args);
    let mem = PageMemory::new(total, "queue memory")?;
    // SAFETY: `mem` outlives the mapping: it is unmapped below after the queue pair is gone
    // (or leaked with it on failure).
    let map = unsafe { ctrl.map_host(mem.ptr, total) }?;
    let qp = ctrl
        .create_queue_pair(uapi::QueuePairArgs {
            qid: q + 1,
            depth: u32::from(depth),
            sq_handle: map.handle,
            cq_handle: map.handle,
            sq_offset: layout.sq_offset() as u64,
            cq_offset: layout.cq_offset() as u64,
            ..Default::default()
        })
        .with_context(|| format!("creating queue pair {}", q + 1))?;
    let doorbells = ctrl.doorbells()?;
    // SAFETY: the rings lie in `mem`, the doorbells in `doorbells`; the queue pair is deleted
    // before either goes.
    let mut pair = unsafe {
        QueuePair::new(
            depth,
            mem.ptr.add(layout.sq_offset()).cast(),
            mem.ptr.add(layout.cq_offset()).cast(),
            doorbells.register(qp.sq_doorbell),
            doorbells.register(qp.cq_doorbell),
        )
    };
    let result = drive(
        args, &mut pair, &mem, &map, span, q, layout, lba_shift, duration,
    );
    // The queue pair goes first (Delete I/O SQ waits for its commands), then the memory.
    ctrl.delete_queue_pair(q + 1)?;
    ctrl.unmap(map.handle)?;
    drop(doorbells);
    result
}

#[allow(clippy::too_many_arguments)]
fn drive(
    args: &IoArgs,
    pair: &mut QueuePair,
    mem: &PageMemory,
    map: &legend_nvme::Mapping,
    span: &Span,
    q: u32,
    layout: QueueLayout,
    lba_shift: u32,
    duration: Duration,
) -> anyhow::Result<Samples> {
    const PAGE: usize = prp::PAGE as usize;
    let size = args.size as usize;
    let d = usize::from(layout.depth());
    let op = if args.op == Op::Read {
        Opcode::Read
    } else {
        Opcode::Write
    };
    let slot_bytes = slot_bytes(args);
    let mut started = vec![Instant::now(); d];
    let mut rng = 0x9e37_79b9_7f4a_7c15 ^ u64::from(q + 1);
    let (mut n, mut in_flight) = (0u64, 0usize);
    let deadline = Instant::now() + duration;
    let mut samples = Samples::starting_now();
    let mut last = Instant::now();
    let mut failure: Option<String> = None;
    loop {
        let mut pushed = false;
        while failure.is_none() && Instant::now() < deadline {
            let offset = span.offset(args, q, n, &mut rng);
            // The PRP list goes into the slot's page only once `push` found the slot free.
            let Some(cid) = pair.push_with(|slot| {
                let list_at = layout.list_offset(slot);
                let data = layout.bytes() + usize::from(slot) * slot_bytes;
                // SAFETY: slot `slot`'s PRP list page in the queue memory.
                let list = unsafe {
                    std::slice::from_raw_parts_mut(mem.ptr.add(list_at).cast(), PAGE / 8)
                };
                let p = prp::build(
                    0,
                    args.size,
                    |i| map.bus(data + i * PAGE),
                    list,
                    map.bus(list_at),
                )
                .expect("a page-aligned buffer of a size checked in `run`");
                Sqe::read_write(
                    op,
                    args.namespace,
                    offset >> lba_shift,
                    (args.size >> lba_shift) as u32,
                    p,
                )
            }) else {
                break;
            };
            started[usize::from(cid)] = Instant::now();
            n += 1;
            in_flight += 1;
            pushed = true;
        }
        if pushed {
            pair.ring_sq();
        }
        if in_flight == 0 {
            break;
        }
        let mut reaped = false;
        while let Some(done) = pair.poll() {
            reaped = true;
            in_flight -= 1;
            match done {
                Ok((slot, cqe)) if cqe.status().is_success() => {
                    samples.ops += 1;
                    samples.bytes += size as u64;
                    samples
                        .latencies_ns
                        .push(started[usize::from(slot)].elapsed().as_nanos() as u64);
                }
                Ok((slot, cqe)) => {
                    failure.get_or_insert_with(|| {
                        CommandError::new(&pair.sqe(slot), cqe.status()).to_string()
                    });
                }
                Err(e) => {
                    failure.get_or_insert(e.to_string());
                }
            }
        }
        if reaped {
            pair.ring_cq();
            last = Instant::now();
        } else if last.elapsed() > TIMEOUT {
            let r = pair.ring();
            bail!(
                "queue {}: no completion for {} s with {in_flight} commands in flight (SQ tail {}, \
                 CQ head {}, phase {}); no figures are reported",
                q + 1,
                TIMEOUT.as_secs(),
                r.sq_tail(),
                r.cq_head(),
                u8::from(r.phase())
            );
        }
    }
    if let Some(f) = failure {
        bail!("queue {}: {f}; no figures are reported", q + 1);
    }
    Ok(samples)
}

/// Bytes of one slot's data buffer: the request, rounded up to a page so each buffer starts on
/// one and its PRP entries are whole pages from offset 0.
fn slot_bytes(args: &IoArgs) -> usize {
    (args.size as usize).next_multiple_of(prp::PAGE as usize)
}
