//! Completion status fields (NVMe Base 2.0, 4.2.3) decoded into readable errors.

use core::fmt;

use crate::{Opcode, Sqe};

/// A completion's status field without the phase tag: Do Not Retry (bit 14), More (13), Command
/// Retry Delay (12:11), Status Code Type (10:8), Status Code (7:0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Status(u16);

impl Status {
    /// Successful completion.
    pub const SUCCESS: Self = Self(0);

    /// A status of type `sct` (0 generic, 1 command specific, 2 media and data integrity, 3 path,
    /// 7 vendor specific) and code `sc`.
    pub const fn new(sct: u8, sc: u8) -> Self {
        Self((((sct & 7) as u16) << 8) | sc as u16)
    }

    /// From the 15 status bits of a completion (dword 3 bits 31:17).
    pub const fn from_raw(raw: u16) -> Self {
        Self(raw & 0x7fff)
    }

    /// The 15 status bits.
    pub const fn raw(self) -> u16 {
        self.0
    }

    /// Whether the command succeeded.
    pub const fn is_success(self) -> bool {
        self.sct() == 0 && self.sc() == 0
    }

    /// Status Code Type.
    pub const fn sct(self) -> u8 {
        // CAST: three bits.
        ((self.0 >> 8) & 7) as u8
    }

    /// Status Code.
    pub const fn sc(self) -> u8 {
        // CAST: the low byte.
        self.0 as u8
    }

    /// Do Not Retry: the controller says the same command will fail again.
    pub const fn do_not_retry(self) -> bool {
        self.0 & (1 << 14) != 0
    }

    fn type_name(self) -> &'static str {
        match self.sct() {
            0 => "generic",
            1 => "command specific",
            2 => "media error",
            3 => "path error",
            7 => "vendor specific",
            _ => "reserved type",
        }
    }

    /// The specification's name of the status code, where this crate knows it.
    pub fn code_name(self) -> Option<&'static str> {
        Some(match (self.sct(), self.sc()) {
            (0, 0x00) => "Successful Completion",
            (0, 0x01) => "Invalid Command Opcode",
            (0, 0x02) => "Invalid Field in Command",
            (0, 0x03) => "Command ID Conflict",
            (0, 0x04) => "Data Transfer Error",
            (0, 0x05) => "Commands Aborted due to Power Loss Notification",
            (0, 0x06) => "Internal Error",
            (0, 0x07) => "Command Abort Requested",
            (0, 0x08) => "Command Aborted due to SQ Deletion",
            (0, 0x0b) => "Invalid Namespace or Format",
            (0, 0x0f) => "Invalid SGL Segment Descriptor",
            (0, 0x13) => "PRP Offset Invalid",
            (0, 0x80) => "LBA Out of Range",
            (0, 0x81) => "Capacity Exceeded",
            (0, 0x82) => "Namespace Not Ready",
            (1, 0x00) => "Completion Queue Invalid",
            (1, 0x01) => "Invalid Queue Identifier",
            (1, 0x02) => "Invalid Queue Size",
            (1, 0x80) => "Conflicting Attributes",
            (1, 0x82) => "Attempted Write to Read Only Range",
            (2, 0x80) => "Write Fault",
            (2, 0x81) => "Unrecovered Read Error",
            (2, 0x82) => "End-to-end Guard Check Error",
            (2, 0x86) => "Access Denied",
            (2, 0x87) => "Deallocated or Unwritten Logical Block",
            (3, 0x00) => "Internal Path Error",
            _ => return None,
        })
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.code_name() {
            Some(name) => write!(f, "{name}")?,
            None => write!(f, "{} status code {:#04x}", self.type_name(), self.sc())?,
        }
        write!(f, " (sct {}, sc {:#04x}", self.sct(), self.sc())?;
        if self.do_not_retry() {
            f.write_str(", do not retry")?;
        }
        f.write_str(")")
    }
}

/// A command that completed with an error status: what it was and what the controller said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommandError {
    /// The command's opcode byte.
    pub opcode: u8,
    /// Starting LBA (Read/Write).
    pub lba: u64,
    /// Logical blocks (Read/Write).
    pub blocks: u32,
    /// The completion's status.
    pub status: Status,
}

impl CommandError {
    /// The error of `sqe` completing with `status`.
    pub fn new(sqe: &Sqe, status: Status) -> Self {
        Self {
            opcode: sqe.opcode(),
            lba: sqe.lba(),
            blocks: sqe.blocks(),
            status,
        }
    }
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match Opcode::from_u8(self.opcode) {
            Some(Opcode::Flush) => write!(f, "flush failed: {}", self.status),
            Some(op) => write!(
                f,
                "{} of {} blocks at LBA {} failed: {}",
                op.name(),
                self.blocks,
                self.lba,
                self.status
            ),
            None => write!(f, "command {:#04x} failed: {}", self.opcode, self.status),
        }
    }
}

impl core::error::Error for CommandError {}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::string::ToString;

    use super::*;
    use crate::prp::Prp;

    #[test]
    fn statuses_read_as_the_specification_names_them() {
        assert!(Status::SUCCESS.is_success());
        let s = Status::new(0, 0x80);
        assert_eq!(s.to_string(), "LBA Out of Range (sct 0, sc 0x80)");
        let s = Status::from_raw((1 << 14) | Status::new(2, 0x81).raw());
        assert!(s.do_not_retry());
        assert_eq!(
            s.to_string(),
            "Unrecovered Read Error (sct 2, sc 0x81, do not retry)"
        );
        assert_eq!(
            Status::new(7, 0xc3).to_string(),
            "vendor specific status code 0xc3 (sct 7, sc 0xc3)"
        );
    }

    #[test]
    fn errors_name_the_command_and_its_lbas() {
        let sqe = Sqe::read_write(crate::Opcode::Read, 1, 16384, 8, Prp::default());
        let e = CommandError::new(&sqe, Status::new(0, 0x80));
        assert_eq!(
            e.to_string(),
            "read of 8 blocks at LBA 16384 failed: LBA Out of Range (sct 0, sc 0x80)"
        );
        let e = CommandError::new(&Sqe::flush(1), Status::new(0, 0x06));
        assert_eq!(
            e.to_string(),
            "flush failed: Internal Error (sct 0, sc 0x06)"
        );
    }
}
