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

/// The admin SQ/CQ and a one-page data buffer, all in coherent DMA memory.
///
/// The driver owns the whole SQ (it waits for each command's completion before the next), and
/// the CQ entry at `cq_head` belongs to the controller until its phase tag equals `phase`.
pub(crate) struct AdminQueue {
    sq: Coherent<[[u32; 16]]>,
    cq: Coherent<[[u32; 4]]>,
    data: Coherent<[u8]>,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    cid: u16,
    doorbell_stride: usize,
    /// Set when a command timed out: a late completion would desynchronise the rings.
    broken: bool,
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
            broken: false,
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

    /// Submits `cmd` and polls for its completion.
    ///
    /// # Errors
    ///
    /// - `EIO` if an earlier command timed out or the completion does not match the command.
    /// - `ETIMEDOUT` if the controller did not complete the command in time.
    pub(crate) fn submit(&mut self, bar: &Bar0<'_>, cmd: &Command) -> Result<Completion> {
        if self.broken {
            return Err(EIO);
        }
        self.cid = self.cid.wrapping_add(1);
        let mut sqe = [0u32; 16];
        sqe[0] = u32::from(cmd.opcode) | (u32::from(self.cid) << 16);
        sqe[1] = cmd.nsid;
        // CAST: splitting the PRP entry into its two dwords.
        sqe[6] = cmd.prp1 as u32;
        sqe[7] = (cmd.prp1 >> 32) as u32;
        sqe[10..16].copy_from_slice(&cmd.cdw);

        let tail = usize::from(self.sq_tail);
        // SAFETY: `tail < DEPTH`, the number of entries of `sq`; the controller does not read the
        // slot because every earlier command in it has completed.
        unsafe { ptr::write_volatile(self.sq.as_mut_ptr().cast::<[u32; 16]>().add(tail), sqe) };
        // Ensure all command data is visible before ringing the doorbell.
        fence(Ordering::SeqCst);
        self.sq_tail = (self.sq_tail + 1) % DEPTH;
        bar.try_write32(u32::from(self.sq_tail), regs::DOORBELLS)?;

        let head = usize::from(self.cq_head);
        let slot = self.cq.as_ptr().cast::<[u32; 4]>();
        let phase = self.phase;
        // TIMEOUT: admin commands complete in microseconds on hardware; emulated controllers
        // (QEMU TCG in the selftests) can take far longer, so allow a generous 10 s.
        let cqe = read_poll_timeout(
            // SAFETY: `head < DEPTH`, the number of entries of `cq`; a volatile read of memory the
            // device may write concurrently.
            || Ok(unsafe { ptr::read_volatile(slot.add(head)) }),
            |c: &[u32; 4]| ((c[3] >> 16) & 1 == 1) == phase,
            Delta::from_micros(20),
            Delta::from_secs(10),
        )
        .inspect_err(|_| self.broken = true)?;
        // Read the rest of the entry only after its phase tag said it is complete.
        fence(Ordering::SeqCst);

        self.cq_head = (self.cq_head + 1) % DEPTH;
        if self.cq_head == 0 {
            self.phase = !self.phase;
        }
        bar.try_write32(
            u32::from(self.cq_head),
            regs::DOORBELLS + self.doorbell_stride,
        )?;

        // CAST: the command identifier is the low half of dword 3.
        if (cqe[3] & 0xffff) as u16 != self.cid {
            self.broken = true;
            return Err(EIO);
        }
        Ok(Completion {
            result: cqe[0],
            // CAST: status code type and status code, dword 3 bits 27:17 (11 bits).
            status: ((cqe[3] >> 17) & 0x7ff) as u16,
        })
    }
}
