// SPDX-License-Identifier: GPL-2.0-only

//! The admin queue pair: coherent DMA rings, submission and polled completion.

use core::{
    ptr,
    sync::atomic::{
        fence,
        Ordering, //
    }, //
};

use kernel::{
    device,
    dma::Coherent,
    io::{
        poll::read_poll_timeout,
        Io, //
    },
    prelude::*,
    time::Delta, //
};

use crate::{
    controller::Bar0,
    regs, //
};

/// Entries in each admin queue; small because the driver issues one command at a time.
pub(crate) const DEPTH: u16 = 16;

/// Size of the admin data buffer: one controller memory page.
pub(crate) const DATA_LEN: usize = 4096;

/// An admin command, with the fields the driver's commands use.
#[derive(Clone, Copy, Default)]
pub(crate) struct Command {
    pub(crate) opcode: u8,
    pub(crate) nsid: u32,
    pub(crate) prp1: u64,
    /// Command dwords 10 to 15.
    pub(crate) cdw: [u32; 6],
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
}

impl From<Fault> for Error {
    fn from(f: Fault) -> Self {
        match f {
            Fault::Timeout => ETIMEDOUT,
            Fault::Unexpected | Fault::Doorbell => EIO,
        }
    }
}

/// The admin SQ/CQ and a one-page data buffer, all in coherent DMA memory.
///
/// The driver owns the whole SQ (it waits for each command's completion before the next), and
/// the CQ entry at `cq_head` belongs to the controller until its phase tag equals `phase`.
///
/// The admin doorbells share a page with the I/O queues' where the doorbell stride is small, so
/// the process that maps the doorbells can ring them. That cannot make the controller run a
/// command the driver did not write: every slot is cleared once its command completed (a zeroed
/// entry is Delete I/O SQ of queue 0, which the controller rejects), and command identifier 0,
/// which a cleared slot carries, is never used, so any completion the driver did not ask for is
/// recognised and reported as [`Fault::Unexpected`].
pub(crate) struct AdminQueue {
    sq: Coherent<[[u32; 16]]>,
    cq: Coherent<[[u32; 4]]>,
    data: Coherent<[u8]>,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    cid: u16,
    doorbell_stride: usize,
}

impl AdminQueue {
    /// Allocates zeroed rings (a zero phase tag means "not yet written" for the first pass).
    pub(crate) fn new(dev: &device::Device<device::Bound>, doorbell_stride: usize) -> Result<Self> {
        let depth = usize::from(DEPTH);
        Ok(Self {
            sq: Coherent::<[u32; 16]>::zeroed_slice(dev, depth, GFP_KERNEL)?,
            cq: Coherent::<[u32; 4]>::zeroed_slice(dev, depth, GFP_KERNEL)?,
            data: Coherent::<u8>::zeroed_slice(dev, DATA_LEN, GFP_KERNEL)?,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            cid: 0,
            doorbell_stride,
        })
    }

    pub(crate) fn sq_dma(&self) -> u64 {
        self.sq.dma_address()
    }

    pub(crate) fn cq_dma(&self) -> u64 {
        self.cq.dma_address()
    }

    pub(crate) fn data_dma(&self) -> u64 {
        self.data.dma_address()
    }

    /// Copies the data buffer out after a command completed.
    pub(crate) fn data(&self, out: &mut [u8]) {
        let n = out.len().min(DATA_LEN);
        // SAFETY: `data` holds `DATA_LEN` bytes and `n <= DATA_LEN`; no command is outstanding
        // (submission waits for completion), so the device is not writing the buffer.
        unsafe { ptr::copy_nonoverlapping(self.data.as_ptr().cast::<u8>(), out.as_mut_ptr(), n) };
    }

    /// The CQ entry at `cq_head`.
    fn cq_entry(&self) -> [u32; 4] {
        let slot = self.cq.as_ptr().cast::<[u32; 4]>();
        // SAFETY: `cq_head < DEPTH`, the number of entries of `cq`; a volatile read of memory the
        // device may write concurrently.
        unsafe { ptr::read_volatile(slot.add(usize::from(self.cq_head))) }
    }

    fn posted(&self, cqe: &[u32; 4]) -> bool {
        ((cqe[3] >> 16) & 1 == 1) == self.phase
    }

    /// Submits `cmd` and polls for its completion. The caller must stop using the queue (and
    /// quiesce the controller) after any error.
    ///
    /// # Errors
    ///
    /// - [`Fault::Unexpected`] if a completion was posted that no command of the driver asked for,
    ///   or the completion does not match the command;
    /// - [`Fault::Timeout`] if the controller did not complete the command in time;
    /// - [`Fault::Doorbell`] if a doorbell could not be written.
    pub(crate) fn submit(&mut self, bar: &Bar0<'_>, cmd: &Command) -> Result<Completion, Fault> {
        // An entry already posted at the head was not asked for by this driver.
        if self.posted(&self.cq_entry()) {
            return Err(Fault::Unexpected);
        }
        // Identifier 0 is what a cleared slot carries; never use it.
        self.cid = match self.cid.wrapping_add(1) {
            0 => 1,
            c => c,
        };
        let mut sqe = [0u32; 16];
        sqe[0] = u32::from(cmd.opcode) | (u32::from(self.cid) << 16);
        sqe[1] = cmd.nsid;
        // CAST: splitting the PRP entry into its two dwords.
        sqe[6] = cmd.prp1 as u32;
        sqe[7] = (cmd.prp1 >> 32) as u32;
        sqe[10..16].copy_from_slice(&cmd.cdw);
        // A command that returns no data leaves none of an earlier one's behind.
        // SAFETY: `data` holds `DATA_LEN` bytes and no command is outstanding.
        unsafe { ptr::write_bytes(self.data.as_mut_ptr().cast::<u8>(), 0, DATA_LEN) };

        let tail = usize::from(self.sq_tail);
        let sq = self.sq.as_mut_ptr().cast::<[u32; 16]>();
        // SAFETY: `tail < DEPTH`, the number of entries of `sq`; the controller does not read the
        // slot because every earlier command in it has completed.
        unsafe { ptr::write_volatile(sq.add(tail), sqe) };
        // Ensure all command data is visible before ringing the doorbell.
        fence(Ordering::SeqCst);
        self.sq_tail = (self.sq_tail + 1) % DEPTH;
        bar.try_write32(u32::from(self.sq_tail), regs::DOORBELLS)
            .map_err(|_| Fault::Doorbell)?;

        // TIMEOUT: admin commands complete in microseconds on hardware; emulated controllers
        // (QEMU TCG in the selftests) can take far longer, so allow a generous 10 s.
        let cqe = read_poll_timeout(
            || Ok(self.cq_entry()),
            |c: &[u32; 4]| self.posted(c),
            Delta::from_micros(20),
            Delta::from_secs(10),
        )
        .map_err(|_| Fault::Timeout)?;
        // Read the rest of the entry only after its phase tag said it is complete.
        fence(Ordering::SeqCst);
        // The slot is consumed (the completion says the controller fetched it): clear it so a
        // stray doorbell write cannot make the controller run it again.
        // SAFETY: as above; the command completed, so the controller no longer reads the slot.
        unsafe { ptr::write_volatile(sq.add(tail), [0u32; 16]) };

        self.cq_head = (self.cq_head + 1) % DEPTH;
        if self.cq_head == 0 {
            self.phase = !self.phase;
        }
        bar.try_write32(
            u32::from(self.cq_head),
            regs::DOORBELLS + self.doorbell_stride,
        )
        .map_err(|_| Fault::Doorbell)?;

        // CAST: the command identifier is the low half of dword 3, the SQ head the low half of
        // dword 2.
        let (cid, sq_head) = ((cqe[3] & 0xffff) as u16, (cqe[2] & 0xffff) as u16);
        if cid != self.cid || sq_head != self.sq_tail {
            return Err(Fault::Unexpected);
        }
        Ok(Completion {
            result: cqe[0],
            // CAST: status code type and status code, dword 3 bits 27:17 (11 bits).
            status: ((cqe[3] >> 17) & 0x7ff) as u16,
        })
    }
}
