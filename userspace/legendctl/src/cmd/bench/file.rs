//! `--backend file`: one io_uring per queue (thread), `--depth` requests in flight each.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use io_uring::{IoUring, opcode, types};

use super::{IoArgs, Op, PageMemory, Samples, Span, check_write};

pub fn run(args: &IoArgs, path: &Path, duration: Duration) -> anyhow::Result<Samples> {
    let open = |direct: bool| {
        OpenOptions::new()
            .read(true)
            .write(args.op == Op::Write)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(path)
    };
    let file = open(true)
        .or_else(|_| open(false))
        .with_context(|| format!("opening {}", path.display()))?;
    let meta = file.metadata()?;
    let is_block = meta.file_type().is_block_device();
    check_write(args, path, is_block)?;
    let size = if is_block {
        use std::io::Seek;
        file.try_clone()?.seek(std::io::SeekFrom::End(0))?
    } else {
        meta.len()
    };
    let span = Span::of(args, path, size, 512)?;
    let results: Vec<anyhow::Result<Samples>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.queues)
            .map(|q| {
                let (file, span) = (&file, &span);
                s.spawn(move || queue(args, file.as_raw_fd(), span, q, duration))
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
    fd: i32,
    span: &Span,
    q: u32,
    duration: Duration,
) -> anyhow::Result<Samples> {
    let depth = args.depth as usize;
    let size = args.size as usize;
    let bufs = PageMemory::new(depth * size, "request buffers")?;
    let mut ring = IoUring::new(args.depth.next_power_of_two())?;
    let mut started = vec![Instant::now(); depth];
    let mut rng = 0x9e37_79b9_7f4a_7c15 ^ u64::from(q + 1);
    let (mut n, mut in_flight) = (0u64, 0usize);
    let deadline = Instant::now() + duration;
    let mut samples = Samples::starting_now();
    let mut free: Vec<usize> = (0..depth).collect();
    loop {
        while Instant::now() < deadline
            && let Some(slot) = free.pop()
        {
            let offset = span.offset(args, q, n, &mut rng);
            n += 1;
            // SAFETY: slot `slot` of the buffers, `size` bytes.
            let buf = unsafe { bufs.ptr.add(slot * size) };
            let entry = match args.op {
                Op::Read => opcode::Read::new(types::Fd(fd), buf, size as u32),
                Op::Write => {
                    let w = opcode::Write::new(types::Fd(fd), buf, size as u32);
                    started[slot] = Instant::now();
                    // SAFETY: as below.
                    unsafe {
                        ring.submission()
                            .push(&w.offset(offset).build().user_data(slot as u64))?;
                    }
                    in_flight += 1;
                    continue;
                }
            };
            started[slot] = Instant::now();
            // SAFETY: the buffer outlives the request: this function waits for every
            // completion before freeing it.
            unsafe {
                ring.submission()
                    .push(&entry.offset(offset).build().user_data(slot as u64))?;
            }
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        ring.submit_and_wait(1)?;
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, res) in done {
            in_flight -= 1;
            if res < 0 || res as usize != size {
                // Drain what is left before failing: the buffers must outlive the requests.
                while in_flight > 0 {
                    ring.submit_and_wait(1)?;
                    in_flight -= ring.completion().count();
                }
                bail!(
                    "request of {size} bytes failed: {}; no figures are reported",
                    if res < 0 {
                        std::io::Error::from_raw_os_error(-res).to_string()
                    } else {
                        format!("short transfer of {res} bytes")
                    }
                );
            }
            samples.ops += 1;
            samples.bytes += size as u64;
            samples
                .latencies_ns
                .push(started[slot].elapsed().as_nanos() as u64);
            free.push(slot);
        }
    }
    Ok(samples)
}
