//! The NVMe I/O queue protocol as Legend speaks it, in one `no_std` place.
//!
//! Everything that builds or reads queue entries uses this crate: the CPU submitter of the `nvme`
//! and `proxy` stores, the proxy controller, and the kernel module's QEMU selftests. The CUDA
//! side (`kernels/nvme_io.cuh`) mirrors [`Sqe`]'s builders, and the test vectors in
//! `kernels/testdata/sqe_vectors.txt` (checked against this crate in its tests, and against the
//! CUDA code on a GPU) pin both to the same bytes.
//!
//! - [`Sqe`] / [`Cqe`]: the 64-byte submission and 16-byte completion entries (NVMe Base 2.0,
//!   4.2 and 4.6), with builders for Read, Write and Flush.
//! - [`prp`]: PRP1/PRP2 and PRP lists for transfers of any size.
//! - [`Status`] and [`CommandError`]: status fields decoded into readable errors.
//! - [`Ring`]: the tail/head/phase bookkeeping of one queue pair, and [`doorbell`] offsets.
//! - [`QueuePair`]: a queue pair in memory both sides can reach, driven by volatile accesses.
//! - [`QueueLayout`] and [`max_command_bytes`]: where a queue pair's rings and PRP list pages
//!   lie in its memory, and how large one command may be.

#![no_std]

pub mod doorbell;
mod layout;
pub mod prp;
mod queue;
mod status;

use bytemuck::{Pod, Zeroable};

pub use layout::{QueueLayout, max_command_bytes};
pub use queue::{MAX_DEPTH, QueuePair, Ring, Unexpected};
pub use status::{CommandError, Status};

/// NVM command set opcodes this crate builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    /// Commit volatile write cache contents to media.
    Flush = 0x00,
    /// Write logical blocks.
    Write = 0x01,
    /// Read logical blocks.
    Read = 0x02,
}

impl Opcode {
    /// The opcode of a raw command byte, if this crate knows it.
    pub fn from_u8(b: u8) -> Option<Self> {
        match b {
            0x00 => Some(Self::Flush),
            0x01 => Some(Self::Write),
            0x02 => Some(Self::Read),
            _ => None,
        }
    }

    /// Lower-case name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Flush => "flush",
            Self::Write => "write",
            Self::Read => "read",
        }
    }
}

/// A submission queue entry (64 bytes, little endian).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Sqe {
    /// Command dword 0: opcode (bits 7:0), fused/PSDT (15:8, zero: PRPs), command id (31:16).
    pub cdw0: u32,
    /// Namespace identifier.
    pub nsid: u32,
    /// Command dwords 2 and 3 (unused by I/O commands here).
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// Metadata pointer (unused: namespaces without separate metadata).
    pub mptr: u64,
    /// PRP entry 1: the first data byte.
    pub prp1: u64,
    /// PRP entry 2: the second page, or the PRP list (see [`prp`]).
    pub prp2: u64,
    /// Command dwords 10 to 15; for Read/Write: starting LBA (10, 11), blocks - 1 (12).
    pub cdw: [u32; 6],
}

const _: () = assert!(core::mem::size_of::<Sqe>() == 64);

impl Sqe {
    /// A Read or Write of `blocks` (1 ..= 65536) logical blocks at `lba` of namespace `nsid`, with
    /// the data at the PRP entries from [`prp`]. The command id is left 0 ([`Sqe::set_cid`]).
    ///
    /// # Panics
    ///
    /// If `blocks` is 0 or above 65536 (the field holds blocks - 1 in 16 bits).
    pub fn read_write(op: Opcode, nsid: u32, lba: u64, blocks: u32, prp: prp::Prp) -> Self {
        assert!(
            (1..=65536).contains(&blocks),
            "{blocks} blocks: one command moves 1 to 65536"
        );
        Self {
            cdw0: u32::from(op as u8),
            nsid,
            prp1: prp.prp1,
            prp2: prp.prp2,
            // CAST: splitting the 64-bit LBA into dwords.
            cdw: [lba as u32, (lba >> 32) as u32, blocks - 1, 0, 0, 0],
            ..Self::default()
        }
    }

    /// A Flush of namespace `nsid`.
    pub fn flush(nsid: u32) -> Self {
        Self {
            cdw0: u32::from(Opcode::Flush as u8),
            nsid,
            ..Self::default()
        }
    }

    /// The opcode byte.
    pub fn opcode(&self) -> u8 {
        // CAST: bits 7:0.
        self.cdw0 as u8
    }

    /// The command identifier.
    pub fn cid(&self) -> u16 {
        // CAST: bits 31:16.
        (self.cdw0 >> 16) as u16
    }

    /// Sets the command identifier.
    pub fn set_cid(&mut self, cid: u16) {
        self.cdw0 = (self.cdw0 & 0xffff) | (u32::from(cid) << 16);
    }

    /// Starting LBA of a Read or Write.
    pub fn lba(&self) -> u64 {
        u64::from(self.cdw[0]) | (u64::from(self.cdw[1]) << 32)
    }

    /// Logical blocks of a Read or Write.
    pub fn blocks(&self) -> u32 {
        (self.cdw[2] & 0xffff) + 1
    }
}

/// A completion queue entry (16 bytes, little endian).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Cqe {
    /// Command-specific result (dword 0).
    pub result: u32,
    /// Dword 1, reserved.
    pub rsvd: u32,
    /// The controller's SQ head after this command was fetched.
    pub sq_head: u16,
    /// The SQ the command came from.
    pub sq_id: u16,
    /// The command's identifier.
    pub cid: u16,
    /// Phase tag (bit 0) and status field (bits 15:1).
    pub status_phase: u16,
}

const _: () = assert!(core::mem::size_of::<Cqe>() == 16);

impl Cqe {
    /// A completion of command `cid` from SQ `sq_id` with `status`, posted with phase `phase`.
    pub fn new(sq_id: u16, sq_head: u16, cid: u16, status: Status, phase: bool) -> Self {
        Self {
            sq_head,
            sq_id,
            cid,
            status_phase: (status.raw() << 1) | u16::from(phase),
            ..Self::default()
        }
    }

    /// The phase tag: an entry is new when it equals the consumer's expected phase.
    pub fn phase(&self) -> bool {
        self.status_phase & 1 == 1
    }

    /// The status field.
    pub fn status(&self) -> Status {
        Status::from_raw(self.status_phase >> 1)
    }
}

#[cfg(test)]
mod tests {
    use core::mem::offset_of;

    use super::*;

    #[test]
    fn entry_layouts_follow_the_specification() {
        assert_eq!(offset_of!(Sqe, nsid), 4);
        assert_eq!(offset_of!(Sqe, mptr), 16);
        assert_eq!(offset_of!(Sqe, prp1), 24);
        assert_eq!(offset_of!(Sqe, prp2), 32);
        assert_eq!(offset_of!(Sqe, cdw), 40);
        assert_eq!(offset_of!(Cqe, sq_head), 8);
        assert_eq!(offset_of!(Cqe, cid), 12);
        assert_eq!(offset_of!(Cqe, status_phase), 14);
    }

    #[test]
    fn read_write_fields_round_trip() {
        let p = prp::Prp {
            prp1: 0x1000,
            prp2: 0x2000,
        };
        let mut s = Sqe::read_write(Opcode::Write, 1, 0x1_2345_6789, 65536, p);
        s.set_cid(0xbeef);
        assert_eq!(s.opcode(), 1);
        assert_eq!(s.cid(), 0xbeef);
        assert_eq!(s.lba(), 0x1_2345_6789);
        assert_eq!(s.blocks(), 65536);
        assert_eq!(s.nsid, 1);
        assert_eq!(Opcode::from_u8(s.opcode()), Some(Opcode::Write));
    }

    #[test]
    fn cqe_status_and_phase() {
        let c = Cqe::new(3, 7, 42, Status::new(0, 0x80), true);
        assert!(c.phase());
        assert_eq!(c.status(), Status::new(0, 0x80));
        assert_eq!(c.cid, 42);
        assert!(!Cqe::new(3, 7, 42, Status::SUCCESS, false).phase());
    }
}
