// SPDX-License-Identifier: GPL-2.0-only

//! NVMe controller registers (NVMe Base Specification 2.0, section 3.1.4).

use kernel::{
    io::register,
    pci, //
};

register! {
    // The 64-bit registers are accessed as two dwords: `Mmio` regions guarantee 4-byte
    // alignment only, and NVMe allows dword access to them.

    /// Controller Capabilities, low dword.
    pub(crate) CAP_LO(u32) @ 0x00 {
        /// Worst-case time for CSTS.RDY to change, in 500 ms units.
        31:24 to;
        /// Maximum Queue Entries Supported, zero based.
        15:0 mqes;
    }

    /// Controller Capabilities, high dword.
    pub(crate) CAP_HI(u32) @ 0x04 {
        /// Memory Page Size Minimum: `2 ^ (12 + mpsmin)` bytes.
        19:16 mpsmin;
        /// Doorbell stride: doorbells are `4 << dstrd` bytes apart.
        3:0 dstrd;
    }

    /// Version.
    pub(crate) VS(u32) @ 0x08 {
        31:0 value;
    }

    /// Controller Configuration.
    pub(crate) CC(u32) @ 0x14 {
        /// I/O Completion Queue Entry Size, log2.
        23:20 iocqes;
        /// I/O Submission Queue Entry Size, log2.
        19:16 iosqes;
        /// Shutdown Notification.
        15:14 shn;
        /// Memory Page Size: `2 ^ (12 + mps)`.
        10:7 mps;
        /// I/O Command Set Selected.
        6:4 css;
        /// Enable.
        0:0 en => bool;
    }

    /// Controller Status.
    pub(crate) CSTS(u32) @ 0x1c {
        /// Controller Fatal Status.
        1:1 cfs => bool;
        /// Ready.
        0:0 rdy => bool;
    }

    /// Admin Queue Attributes.
    pub(crate) AQA(u32) @ 0x24 {
        /// Admin Completion Queue Size, zero based.
        27:16 acqs;
        /// Admin Submission Queue Size, zero based.
        11:0 asqs;
    }

    /// Admin Submission Queue Base Address, low dword.
    pub(crate) ASQ_LO(u32) @ 0x28 {
        31:0 addr;
    }

    /// Admin Submission Queue Base Address, high dword.
    pub(crate) ASQ_HI(u32) @ 0x2c {
        31:0 addr;
    }

    /// Admin Completion Queue Base Address, low dword.
    pub(crate) ACQ_LO(u32) @ 0x30 {
        31:0 addr;
    }

    /// Admin Completion Queue Base Address, high dword.
    pub(crate) ACQ_HI(u32) @ 0x34 {
        31:0 addr;
    }
}

/// Offset of the first doorbell (admin SQ tail).
// CAST: 0x1000.
pub(crate) const DOORBELLS: usize = crate::rules::DOORBELL_OFFSET as usize;

/// Size of BAR0 the driver requires: the registers plus a page of doorbells. A power of two, so
/// the region is aligned for 64-bit register access; controllers implement at least 8 KiB.
pub(crate) const BAR0_MIN: usize = 0x2000;

/// BAR0 as the driver maps it: at least [`BAR0_MIN`] bytes.
pub(crate) type Bar0<'a> = pci::Bar<'a, BAR0_MIN>;

/// [`Bar0`] held for as long as the device is bound.
pub(crate) type DevresBar0 = pci::DevresBar<BAR0_MIN>;
