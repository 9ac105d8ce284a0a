//! The proxy's address space: what its "bus addresses" name, and its DMA engine.
//!
//! Host memory mapped through the proxy keeps its virtual address as bus address (the proxy
//! runs in the same process), GPU memory its device address: with CUDA's unified addressing
//! the two never overlap, so a bus address names one region or none. An address in no region
//! is what an IOMMU would fault on: the command fails with a Data Transfer Error.

use std::ptr;
use std::sync::Arc;

use legend_nvme::{DeviceMemory, uapi};

/// What a mapping covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Host memory of this process.
    Host,
    /// GPU memory (device addresses).
    Gpu,
}

/// One mapping.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub(crate) handle: u32,
    pub(crate) start: u64,
    pub(crate) len: u64,
    pub(crate) kind: Kind,
}

impl Region {
    fn contains(&self, bus: u64, len: u64) -> bool {
        bus >= self.start
            && bus
                .checked_add(len)
                .is_some_and(|e| e <= self.start + self.len)
    }

    /// Bytes per bus-address entry.
    pub(crate) fn page_size(&self) -> u32 {
        match self.kind {
            Kind::Host => uapi::HOST_PAGE_SIZE,
            Kind::Gpu => uapi::GPU_PAGE_SIZE,
        }
    }
}

/// The regions the controller may reach, and how to reach GPU ones.
#[derive(Clone, Default)]
pub(crate) struct AddressSpace {
    pub(crate) regions: Vec<Region>,
    pub(crate) device: Option<Arc<dyn DeviceMemory>>,
}

/// A bus address the proxy cannot reach: an IOMMU fault on real hardware.
#[derive(Debug)]
pub(crate) struct Fault;

impl AddressSpace {
    /// The region holding `bus`, and how many bytes of `len` it holds from there.
    fn find(&self, bus: u64, len: u64) -> Result<(&Region, u64), Fault> {
        let r = self
            .regions
            .iter()
            .find(|r| r.contains(bus, 1))
            .ok_or(Fault)?;
        Ok((r, len.min(r.start + r.len - bus)))
    }

    /// Writes `src` at bus address `bus` (DMA to memory). The range may span regions that lie
    /// back to back (separate allocations can); any byte outside them is a fault.
    pub(crate) fn write(&self, mut bus: u64, mut src: &[u8]) -> Result<(), Fault> {
        while !src.is_empty() {
            let (region, n) = self.find(bus, src.len() as u64)?;
            let (piece, rest) = src.split_at(n as usize);
            match region.kind {
                // SAFETY: the range lies in a host mapping, which its owner keeps valid while
                // mapped (the `map_host` contract); the controller may write it at any time.
                Kind::Host => unsafe {
                    ptr::copy_nonoverlapping(piece.as_ptr(), bus as *mut u8, piece.len());
                },
                Kind::Gpu => self.device()?.write(bus, piece).map_err(|_| Fault)?,
            }
            (bus, src) = (bus + n, rest);
        }
        Ok(())
    }

    /// Reads `dst.len()` bytes at bus address `bus` (DMA from memory), as `write` does.
    pub(crate) fn read(&self, mut bus: u64, mut dst: &mut [u8]) -> Result<(), Fault> {
        while !dst.is_empty() {
            let (region, n) = self.find(bus, dst.len() as u64)?;
            let (piece, rest) = dst.split_at_mut(n as usize);
            match region.kind {
                // SAFETY: as in `write`.
                Kind::Host => unsafe {
                    ptr::copy_nonoverlapping(bus as *const u8, piece.as_mut_ptr(), piece.len());
                },
                Kind::Gpu => self.device()?.read(bus, piece).map_err(|_| Fault)?,
            }
            (bus, dst) = (bus + n, rest);
        }
        Ok(())
    }

    /// Reads one little-endian 64-bit PRP list entry.
    pub(crate) fn read_u64(&self, bus: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(bus, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn device(&self) -> Result<&Arc<dyn DeviceMemory>, Fault> {
        self.device.as_ref().ok_or(Fault)
    }
}
