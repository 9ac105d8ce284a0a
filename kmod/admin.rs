// SPDX-License-Identifier: GPL-2.0-only

//! The admin queue pair: a submission queue the controller can only read, a coherent completion
//! queue, a data page mapped per command, submission and polled completion.
//!
//! # What the queue writer can do to it
//!
//! The writer's I/O commands DMA wherever their PRPs point within the device's IOMMU domain, so
//! the admin queue is built for that:
//! - the SQ is a page of its own mapped `DMA_TO_DEVICE` (read-only in the IOMMU): a Read aimed at
//!   it faults, so the controller only ever fetches entries the driver wrote (or the zeroes it
//!   clears consumed slots with, which it rejects);
//! - the data page exists only while one command runs (allocated zeroed, mapped
//!   `DMA_FROM_DEVICE`, unmapped with a synchronous IOTLB flush before it is read and freed);
//! - the CQ must be device-writable, and a Read aimed at it can forge completions. The driver
//!   makes no safety decision on a completion: memory is unpinned only after its IOMMU mapping is
//!   gone (strict domain, see `Controller::probe`), whatever a Delete reported. A forged
//!   completion can make an admin call fail or return a wrong status (and cost a controller
//!   reset), nothing more.
//!
//! Stray completions (command identifier 0: the controller ran a cleared slot because someone
//! wrote the admin SQ tail doorbell, which shares a page with the writer's where the doorbell
//! stride is small) are consumed and the driver continues from the SQ head they report; a
//! command whose slot such a write made the controller fetch too early is submitted again if it
//! may run twice (`Command::idempotent`). So a doorbell poke costs the next admin caller (a
//! monitor's Identify or SMART read) nothing; the writer's own Create or Delete can still time
//! out on it, which only hurts the writer.

use core::sync::atomic::{
    fence,
    Ordering, //
};

use kernel::{
    device,
    dma::{
        Coherent,
        DataDirection, //
    },
    io::{
        poll::read_poll_timeout,
        Io, //
    },
    prelude::*,
    time::Delta, //
};

use crate::{
    mapping::DmaPage,
    regs::{
        self,
        Bar0, //
    },
};

/// Entries in each admin queue; small because the driver issues one command at a time.
pub(crate) const DEPTH: u16 = 16;

/// Size of an admin command's data: one controller memory page.
pub(crate) const DATA_LEN: usize = 4096;

/// An admin command, with the fields the driver's commands use.
#[derive(Clone, Copy, Default)]
pub(crate) struct Command {
    pub(crate) opcode: u8,
    pub(crate) nsid: u32,
    /// Ignored where the command gets a data page ([`AdminQueue::submit`]).
    pub(crate) prp1: u64,
    /// Command dwords 10 to 15.
    pub(crate) cdw: [u32; 6],
    /// Running it twice does no harm (Identify, Get Log Page, Set Features): it is submitted
    /// again if a doorbell write may have made the controller fetch its slot before it was there.
    pub(crate) idempotent: bool,
}

/// What a completion queue entry reports.
#[derive(Clone, Copy)]
pub(crate) struct Completion {
    /// Completion dword 0.
    pub(crate) result: u32,
    /// Status field (status code type << 8 | status code); zero is success.
    pub(crate) status: u16,
}

/// Why the admin queue stopped: either way the controller's state is unknown and it must be
/// disabled before any memory it may reach is released (see `Controller::quiesce`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// No completion within the timeout.
    Timeout,
    /// A completion the driver did not ask for, or one that does not match the command (another
    /// writer of the admin doorbells, or a controller bug).
    Unexpected,
    /// The doorbell write failed (the BAR is gone).
    Doorbell,
    /// No memory for the command's data page; nothing was submitted.
    NoMemory,
}

impl From<Fault> for Error {
    fn from(f: Fault) -> Self {
        match f {
            Fault::Timeout => ETIMEDOUT,
            Fault::Unexpected | Fault::Doorbell => EIO,
            Fault::NoMemory => ENOMEM,
        }
    }
}

/// What one poll of the CQ found.
enum Poll {
    /// Nothing posted yet.
    Pending,
    /// A stray completion (of a cleared slot, or of a command submitted again), consumed.
    Stray,
    /// The completion of the command with this identifier.
    Done([u32; 4]),
    /// A completion of no command of the driver's, other than a stray one.
    Unexpected,
    /// A doorbell write failed.
    Doorbell,
}

/// Positions of the admin queue, for the debugfs files (see `Controller::stats`).
#[derive(Clone, Copy)]
pub(crate) struct View {
    pub(crate) sq_bus: u64,
    pub(crate) cq_bus: u64,
    /// The data page's bus address during the last command that had one (unmapped since).
    pub(crate) data_bus: u64,
    pub(crate) sq_tail: u16,
    pub(crate) cq_head: u16,
    pub(crate) phase: bool,
    pub(crate) next_cid: u16,
}

/// The admin SQ and CQ.
///
/// The driver owns the whole SQ (it waits for each command's completion before the next), and
/// the CQ entry at `cq_head` belongs to the controller until its phase tag equals `phase`.
pub(crate) struct AdminQueue {
    /// Read-only for the controller; the driver writes entries with the CPU.
    sq: DmaPage,
    cq: Coherent<[[u32; 4]]>,
    /// Data pages of commands that failed: the controller may still write them until it is
    /// disabled, which happens before this queue is dropped.
    stale: KVec<DmaPage>,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    cid: u16,
    /// The identifier of the next command, drawn in advance (debugfs shows it to root).
    next_cid: u16,
    /// The identifier a command had before it was submitted again: a late completion of it is
    /// stray.
    retired: Option<u16>,
    data_bus: u64,
    doorbell_stride: usize,
}

/// A command identifier other than `prev` and 0 (what a cleared slot carries), unpredictable: a
/// writer forging a completion while a command runs must first read the command back from the SQ
/// (a Write from it, then a Read of what it wrote) to learn it.
fn random_cid(prev: u16) -> u16 {
    loop {
        // SAFETY: plain C call.
        let c = unsafe { kernel::bindings::get_random_u16() };
        if c != 0 && c != prev {
            return c;
        }
    }
}

impl AdminQueue {
    /// Allocates zeroed rings (a zero phase tag means "not yet written" for the first pass).
    pub(crate) fn new(dev: &device::Device<device::Bound>, doorbell_stride: usize) -> Result<Self> {
        let depth = usize::from(DEPTH);
        Ok(Self {
            sq: DmaPage::new(dev, DataDirection::ToDevice)?,
            cq: Coherent::<[u32; 4]>::zeroed_slice(dev, depth, GFP_KERNEL)?,
            stale: KVec::new(),
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            cid: 0,
            next_cid: random_cid(0),
            retired: None,
            data_bus: 0,
            doorbell_stride,
        })
    }

    pub(crate) fn sq_dma(&self) -> u64 {
        self.sq.bus()
    }

    pub(crate) fn cq_dma(&self) -> u64 {
        self.cq.dma_address()
    }

    pub(crate) fn view(&self) -> View {
        View {
            sq_bus: self.sq.bus(),
            cq_bus: self.cq.dma_address(),
            data_bus: self.data_bus,
            sq_tail: self.sq_tail,
            cq_head: self.cq_head,
            phase: self.phase,
            next_cid: self.next_cid,
        }
    }

    /// The CQ entry at `cq_head`.
    fn cq_entry(&self) -> [u32; 4] {
        let slot = self.cq.as_ptr().cast::<[u32; 4]>();
        // SAFETY: `cq_head < DEPTH`, the number of entries of `cq`; a volatile read of memory the
        // device may write concurrently.
        unsafe { core::ptr::read_volatile(slot.add(usize::from(self.cq_head))) }
    }

    fn posted(&self, cqe: &[u32; 4]) -> bool {
        ((cqe[3] >> 16) & 1 == 1) == self.phase
    }

    /// Writes SQ slot `slot`.
    fn write_slot(&self, slot: u16, sqe: &[u32; 16]) {
        // SAFETY: `sqe` is 64 bytes and slot `slot < DEPTH` lies inside the SQ page; the
        // controller does not read the slot (its earlier command completed, or it is past the
        // tail).
        let _ = unsafe {
            self.sq
                .page()
                .write_raw(sqe.as_ptr().cast(), usize::from(slot) * 64, 64)
        };
    }

    /// Consumes the entry at the CQ head if one is posted: ours (`Done`), a stray one (`Stray`),
    /// or anything else (`Unexpected`).
    fn poll(&mut self, bar: &Bar0<'_>, want: Option<u16>) -> Poll {
        let cqe = self.cq_entry();
        if !self.posted(&cqe) {
            return Poll::Pending;
        }
        // Read the rest of the entry only after its phase tag said it is complete.
        fence(Ordering::SeqCst);
        self.cq_head = (self.cq_head + 1) % DEPTH;
        if self.cq_head == 0 {
            self.phase = !self.phase;
        }
        if bar
            .try_write32(
                u32::from(self.cq_head),
                regs::DOORBELLS + self.doorbell_stride,
            )
            .is_err()
        {
            return Poll::Doorbell;
        }
        // CAST: the command identifier is the low half of dword 3, the SQ head the low half of
        // dword 2.
        let (cid, sq_head) = ((cqe[3] & 0xffff) as u16, (cqe[2] & 0xffff) as u16);
        match cid {
            // The controller ran a cleared slot: it fetched up to `sq_head`, so the next command
            // goes there.
            0 if sq_head < DEPTH => {
                self.sq_tail = sq_head;
                Poll::Stray
            }
            c if Some(c) == want => Poll::Done(cqe),
            c if Some(c) == self.retired => {
                self.retired = None;
                Poll::Stray
            }
            _ => Poll::Unexpected,
        }
    }

    /// Submits `cmd` and polls for its completion. With `data`, the command gets a fresh data page
    /// as PRP 1 (replacing `cmd.prp1`), whose first `data.len()` bytes are copied to `data`
    /// after it completed. The caller must stop using the queue (and quiesce the controller)
    /// after any error.
    ///
    /// # Errors
    ///
    /// - [`Fault::Unexpected`] if a completion was posted that no command of the driver asked for;
    /// - [`Fault::Timeout`] if the controller did not complete the command in time;
    /// - [`Fault::Doorbell`] if a doorbell could not be written;
    /// - [`Fault::NoMemory`] if the data page could not be had (nothing was submitted).
    pub(crate) fn submit(
        &mut self,
        dev: &device::Device<device::Bound>,
        bar: &Bar0<'_>,
        cmd: &Command,
        data: Option<&mut [u8]>,
    ) -> Result<Completion, Fault> {
        // Completions posted before this command: stray ones are skipped (and say where the
        // controller's SQ head is), anything else is a fault.
        for _ in 0..DEPTH {
            match self.poll(bar, None) {
                Poll::Pending => break,
                Poll::Stray => {}
                Poll::Done(_) | Poll::Unexpected => return Err(Fault::Unexpected),
                Poll::Doorbell => return Err(Fault::Doorbell),
            }
        }
        // Room to keep the data page if the command fails, reserved before it exists.
        self.stale
            .reserve(1, GFP_KERNEL)
            .map_err(|_| Fault::NoMemory)?;
        let page = match data {
            Some(_) => {
                Some(DmaPage::new(dev, DataDirection::FromDevice).map_err(|_| Fault::NoMemory)?)
            }
            None => None,
        };
        self.cid = self.next_cid;
        self.next_cid = random_cid(self.cid);
        let mut sqe = [0u32; 16];
        sqe[0] = u32::from(cmd.opcode) | (u32::from(self.cid) << 16);
        sqe[1] = cmd.nsid;
        let prp1 = page.as_ref().map_or(cmd.prp1, |p| p.bus());
        if let Some(p) = &page {
            self.data_bus = p.bus();
        }
        // CAST: splitting the PRP entry into its two dwords.
        sqe[6] = prp1 as u32;
        sqe[7] = (prp1 >> 32) as u32;
        sqe[10..16].copy_from_slice(&cmd.cdw);
        let mut slot = self.sq_tail;
        let result = self
            .ring(bar, slot, &sqe)
            .and_then(|()| self.wait(bar, &mut sqe, &mut slot, cmd.idempotent));
        // The slot is consumed (or the controller is about to be disabled): clear it so a stray
        // doorbell write cannot make the controller run it again.
        self.write_slot(slot, &[0u32; 16]);
        let cqe = match result {
            Ok(cqe) => cqe,
            Err(fault) => {
                // The controller may still write the data page until it is disabled.
                if let Some(p) = page {
                    // Capacity reserved above: cannot fail.
                    let _ = self.stale.push(p, GFP_KERNEL);
                }
                return Err(fault);
            }
        };
        if let (Some(p), Some(out)) = (page, data) {
            // Unmapped first (a synchronous IOTLB flush in a strict domain): what is read here can
            // no longer change.
            let page = p.unmap();
            let n = out.len().min(DATA_LEN);
            // SAFETY: `out` has room for `n <= PAGE_SIZE` bytes.
            let _ = unsafe { page.read_raw(out.as_mut_ptr(), 0, n) };
        }
        Ok(Completion {
            result: cqe[0],
            // CAST: status code type and status code, dword 3 bits 27:17 (11 bits).
            status: ((cqe[3] >> 17) & 0x7ff) as u16,
        })
    }

    /// Writes `sqe` to SQ slot `slot` (the tail) and rings the SQ tail doorbell past it.
    fn ring(&mut self, bar: &Bar0<'_>, slot: u16, sqe: &[u32; 16]) -> Result<(), Fault> {
        self.write_slot(slot, sqe);
        // Ensure all command data is visible before ringing the doorbell.
        fence(Ordering::SeqCst);
        self.sq_tail = (slot + 1) % DEPTH;
        bar.try_write32(u32::from(self.sq_tail), regs::DOORBELLS)
            .map_err(|_| Fault::Doorbell)
    }

    /// Polls for the completion of `sqe` (identifier `self.cid`, in SQ slot `*slot`).
    ///
    /// A stray completion before it may mean that the controller fetched the slot before the
    /// command was in it (a doorbell write raced with the submission, and the controller ran the
    /// cleared slot). With `resubmit`, the command is then submitted once more, under a new
    /// identifier, at the SQ head the stray reported; should the first one still complete, its
    /// completion is stray.
    fn wait(
        &mut self,
        bar: &Bar0<'_>,
        sqe: &mut [u32; 16],
        slot: &mut u16,
        resubmit: bool,
    ) -> Result<[u32; 4], Fault> {
        let mut resubmit = resubmit;
        // TIMEOUT: admin commands complete in microseconds on hardware; emulated controllers
        // (QEMU TCG in the selftests) can take far longer, so allow a generous 10 s.
        let found = read_poll_timeout(
            || {
                Ok(match self.poll(bar, Some(self.cid)) {
                    Poll::Stray if resubmit => {
                        resubmit = false;
                        self.write_slot(*slot, &[0u32; 16]);
                        self.retired = Some(self.cid);
                        self.cid = self.next_cid;
                        self.next_cid = random_cid(self.cid);
                        sqe[0] = (sqe[0] & 0xffff) | (u32::from(self.cid) << 16);
                        *slot = self.sq_tail;
                        match self.ring(bar, *slot, sqe) {
                            Ok(()) => Poll::Pending,
                            Err(_) => Poll::Doorbell,
                        }
                    }
                    Poll::Stray => Poll::Pending,
                    p => p,
                })
            },
            |p: &Poll| !matches!(p, Poll::Pending),
            Delta::from_micros(20),
            Delta::from_secs(10),
        )
        .map_err(|_| Fault::Timeout)?;
        match found {
            Poll::Done(cqe) => Ok(cqe),
            Poll::Doorbell => Err(Fault::Doorbell),
            Poll::Pending | Poll::Stray | Poll::Unexpected => Err(Fault::Unexpected),
        }
    }
}
