//! The launches of the I/O kernels over every member's queue pairs, and their reports.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{LaunchConfig, PushKernelArg};
use legend_nvme_protocol::{CommandError, Sqe, Status};

use super::abi::{IoJob, IoResult};
use super::member::Member;
use super::{GpuIo, GpuIoJob, IoRun, MemberJob};
use crate::GpuError;
use crate::error::DriverContext;

/// Counts a launch's blocks in the GPU's I/O block count while it lives.
pub(super) struct BlocksRunning {
    count: Arc<AtomicUsize>,
    blocks: usize,
}

impl BlocksRunning {
    pub(super) fn new(count: &Arc<AtomicUsize>, blocks: usize) -> Self {
        count.fetch_add(blocks, Ordering::Relaxed);
        BlocksRunning {
            count: count.clone(),
            blocks,
        }
    }
}

impl Drop for BlocksRunning {
    fn drop(&mut self) {
        self.count.fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

impl GpuIo {
    /// Moves `jobs`, all on member 0's namespace (the controller of [`GpuIo::open`]), with one
    /// launch of the I/O kernels and waits for it; `latencies` also returns each command's
    /// submission-to-completion time. [`GpuIo::run_members`] with every job on member 0.
    ///
    /// # Errors
    ///
    /// As [`GpuIo::run_members`].
    pub fn run(&mut self, jobs: &[GpuIoJob], latencies: bool) -> Result<IoRun, GpuError> {
        let jobs: Vec<MemberJob> = jobs
            .iter()
            .map(|&job| MemberJob { member: 0, job })
            .collect();
        self.run_members(&jobs, latencies)
    }

    /// Moves `jobs`, each on its member's namespace, with one launch of the I/O kernels and
    /// waits for it: every member's queue pairs take part at once, each block serving its own
    /// controller's jobs (a member's commands split evenly over its queue pairs, its jobs in
    /// their order). `latencies` also returns each command's submission-to-completion time
    /// (the jobs taken member by member).
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for a job naming no member or region, outside its region or its
    /// member's namespace, or not aligned to that namespace's LBA size;
    /// [`GpuError::NvmeCommand`] for a command a controller failed (its LBA and decoded
    /// status); [`GpuError::NvmeTimeout`] when a queue stopped answering (every queue pair is
    /// then deleted, and every later call fails the same way); both name the controller.
    pub fn run_members(&mut self, jobs: &[MemberJob], latencies: bool) -> Result<IoRun, GpuError> {
        if let Some((label, state)) = &self.broken {
            return Err(GpuError::NvmeTimeout {
                label: label.clone(),
                state: state.clone(),
            });
        }
        // A member's commands must be consecutive: its queue pairs split them.
        let mut ordered: Vec<&MemberJob> = jobs.iter().collect();
        ordered.sort_by_key(|j| j.member);
        let mut kernel_jobs = Vec::with_capacity(jobs.len());
        // Each member's first command and command count, and its bytes.
        let mut spans = vec![(0u64, 0u64); self.members.len()];
        let mut member_bytes = vec![0u64; self.members.len()];
        let mut commands = 0u64;
        let mut bytes = 0u64;
        for MemberJob { member, job: j } in ordered {
            let m = self.members.get(*member).ok_or_else(|| {
                GpuError::Shape(format!(
                    "a transfer on member {member} of {}",
                    self.members.len()
                ))
            })?;
            let region = self
                .regions
                .get(j.region)
                .ok_or_else(|| GpuError::Shape(format!("no mapped region {}", j.region)))?;
            let block = 1u64 << m.lba_shift;
            if j.bytes == 0
                || j.bytes % block != 0
                || j.at % block != 0
                || j.offset % 4 != 0
                || j.offset + j.bytes > region.len
                || j.at + j.bytes > m.namespace_bytes()
            {
                return Err(GpuError::Shape(format!(
                    "transfer of {} bytes from byte {} of region {} to byte {} of the \
                     namespace of {}: outside either, or not aligned to the {block}-byte LBA",
                    j.bytes,
                    j.offset,
                    j.region,
                    j.at,
                    m.ctrl.label()
                )));
            }
            let map = &region.maps[*member];
            let n = j.bytes.div_ceil(m.max_command);
            if spans[*member].1 == 0 {
                spans[*member].0 = commands;
            }
            spans[*member].1 += n;
            member_bytes[*member] += j.bytes;
            kernel_jobs.push(IoJob {
                pages: self.addr(&map.pages),
                device: region.start,
                offset: j.offset,
                bytes: j.bytes,
                lba: j.at >> m.lba_shift,
                command_bytes: m.max_command,
                first_command: commands,
                page_shift: map.mapping.page_size.trailing_zeros(),
                opcode: if j.write { 1 } else { 2 },
                nsid: m.opts.namespace,
                lba_shift: m.lba_shift,
            });
            commands += n;
            bytes += j.bytes;
        }
        if commands == 0 {
            return Ok(IoRun::default());
        }
        let ranges: Vec<u64> = self
            .members
            .iter()
            .zip(&spans)
            .flat_map(|(m, &(first, n))| block_ranges(first, n, m.qids.len()))
            .collect();
        let jobs_dev = self
            .stream
            .clone_htod(&kernel_jobs)
            .during("uploading the I/O jobs")?;
        let ranges_dev = self
            .stream
            .clone_htod(&ranges)
            .during("uploading the blocks' commands")?;
        let lat = if latencies {
            Some(
                self.stream
                    .alloc_zeros::<u64>(commands as usize)
                    .during("allocating the latency record")?,
            )
        } else {
            None
        };
        let njobs = kernel_jobs.len() as u32;
        let timeout = self.timeout().as_nanos() as u64;
        let blocks = self.blocks();
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let start = Instant::now();
        let running = BlocksRunning::new(&self.io_blocks, blocks);
        let mut b = self.stream.launch_builder(&self.kernel);
        b.arg(&mut self.queues)
            .arg(&jobs_dev)
            .arg(&njobs)
            .arg(&ranges_dev)
            .arg(&mut self.results)
            .arg(&timeout);
        let null = 0u64;
        match &lat {
            Some(l) => b.arg(l),
            None => b.arg(&null),
        };
        // SAFETY: the queues (one a block), jobs, ranges (two a block, each block's commands
        // those of its own controller's jobs), page tables and regions are live device memory
        // of the sizes the kernel indexes (checked above), and the controllers' rings and
        // doorbells stay mapped while this object lives.
        unsafe { b.launch(cfg) }.during("launching legend_nvme_io")?;
        self.stream
            .synchronize()
            .during("waiting for the I/O kernels")?;
        drop(running);
        let seconds = start.elapsed().as_secs_f64();
        let reports = self
            .stream
            .clone_dtoh(&self.results)
            .during("reading the I/O reports")?;
        self.check(&reports)?;
        let latencies_ns = match lat {
            Some(l) => self.stream.clone_dtoh(&l).during("reading latencies")?,
            None => Vec::new(),
        };
        Ok(IoRun {
            commands,
            bytes,
            seconds,
            latencies_ns,
            member_commands: spans.iter().map(|&(_, n)| n).collect(),
            member_bytes,
        })
    }

    /// How long a block waits for a completion: the longest of the members' timeouts.
    fn timeout(&self) -> Duration {
        (self.members.iter().map(|m| m.opts.timeout))
            .max()
            .unwrap_or_default()
    }

    /// The member whose queue pair block `b` of a launch drives.
    fn member_of_block(&self, b: usize) -> &Member {
        let i = self
            .members
            .partition_point(|m| m.first_block + m.qids.len() <= b);
        &self.members[i.min(self.members.len() - 1)]
    }

    /// Turns the blocks' reports into the first failure, if any.
    pub(super) fn check(&mut self, reports: &[IoResult]) -> Result<(), GpuError> {
        if let Some((b, r)) = reports.iter().enumerate().find(|(_, r)| r.kind == 2) {
            let m = self.member_of_block(b);
            let label = m.ctrl.label().to_string();
            let state = format!(
                "block {b} (qid {}) saw no completion for {:.1} s: SQ tail {}, CQ head {} \
                 (phase {}), {} commands in flight, {} completed; last CQE {:08x?}",
                m.qids[b - m.first_block],
                m.opts.timeout.as_secs_f64(),
                r.sq_tail,
                r.cq_head,
                r.phase,
                r.in_flight,
                r.completed,
                r.last_cqe
            );
            // Nothing the queues still hold may reach memory after this returns.
            for m in &mut self.members {
                m.delete_queue_pairs();
            }
            self.broken = Some((label.clone(), state.clone()));
            return Err(GpuError::NvmeTimeout { label, state });
        }
        if let Some((b, r)) = reports.iter().enumerate().find(|(_, r)| r.kind == 1) {
            // The failed command as the block read it back from its SQ slot.
            let sqe = Sqe {
                cdw0: r.opcode,
                cdw: [
                    r.lba as u32,
                    (r.lba >> 32) as u32,
                    r.blocks.saturating_sub(1),
                    0,
                    0,
                    0,
                ],
                ..Sqe::default()
            };
            let status = Status::from_raw(r.status as u16);
            return Err(GpuError::NvmeCommand {
                label: self.member_of_block(b).ctrl.label().to_string(),
                error: CommandError::new(&sqe, status),
            });
        }
        if let Some((b, r)) = reports.iter().enumerate().find(|(_, r)| r.kind == 3) {
            return Err(GpuError::Nvme {
                label: self.member_of_block(b).ctrl.label().to_string(),
                what: format!("a completion for no command in flight: {:08x?}", r.last_cqe),
            });
        }
        Ok(())
    }
}

/// The commands `[first, first + n)` of one member split over its `blocks` queue pairs: each
/// block's `[start, end)`, as the kernel's `ranges` take them.
fn block_ranges(first: u64, n: u64, blocks: usize) -> Vec<u64> {
    let per = n.div_ceil(blocks.max(1) as u64);
    (0..blocks as u64)
        .flat_map(|i| [first + (i * per).min(n), first + ((i + 1) * per).min(n)])
        .collect()
}
