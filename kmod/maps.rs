// SPDX-License-Identifier: GPL-2.0-only

//! The writer's mappings (`MAP` / `UNMAP`): host memory pinned without any lock and mapped under
//! the state lock, GPU memory pinned through NVIDIA's API, and the rule that nothing is unpinned
//! while a queue of the owner may still point into it.

use core::sync::atomic::Ordering;

use kernel::{
    prelude::*,
    sync::Arc, //
};

use super::{
    Controller,
    State, //
};
use crate::{
    mapping::{
        HostPages,
        PinnedPages,
        MAX_HOST_PAGES, //
    },
    owner::Owner,
    p2p::{
        GpuPages,
        Revoker, //
    },
    uapi, //
};

/// Most 64 KiB pages one GPU mapping may pin (64 GiB).
pub(super) const MAX_GPU_PAGES: u64 = 1 << 20;

/// Memory behind a mapping.
pub(super) enum Memory {
    Host(HostPages),
    Gpu(GpuPages),
}

impl Memory {
    pub(super) fn bus_addrs(&self) -> &[u64] {
        match self {
            Self::Host(p) => p.bus_addrs(),
            Self::Gpu(p) => p.bus_addrs(),
        }
    }

    /// Bytes covered by one entry of [`Memory::bus_addrs`].
    pub(super) fn page_size(&self) -> u32 {
        match self {
            Self::Host(_) => uapi::HOST_PAGE_SIZE,
            Self::Gpu(_) => uapi::GPU_PAGE_SIZE,
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::Host(p) => p.len(),
            Self::Gpu(p) => p.len(),
        }
    }

    /// Physical address of the [`Memory::page_size`] page `i` (below the number of pages): the
    /// memory's identity, whatever bus address a mapping gives it.
    pub(super) fn frame(&self, i: usize) -> u64 {
        match self {
            Self::Host(p) => p.frame(i),
            Self::Gpu(p) => p.frame(i),
        }
    }
}

/// A [`uapi::MapArgs`] mapping.
///
/// Dropping one may call into the NVIDIA driver, which may wait for its free callback, which
/// takes the state lock: mappings are dropped only after the state lock is released.
pub(super) struct Mapping {
    pub(super) owner: Owner,
    pub(super) handle: u32,
    pub(super) memory: Memory,
    /// NVIDIA freed the GPU memory ([`Revoker::revoke`]); no longer counted or usable.
    pub(super) revoked: bool,
    /// Its bus addresses reached the caller: `MAP` returned its handle. Until then it is only
    /// recorded (so unbind drops it), not usable.
    pub(super) published: bool,
}

impl Controller {
    /// Pins `args.len` bytes at `args.addr` for `owner` and records the mapping; `publish` hands
    /// the caller its result (`args` with `handle`, `page_size` and `pages` filled in) and the bus
    /// addresses.
    ///
    /// Nothing of the mapping is left if any step fails, `publish` included (the caller's output
    /// that cannot be written): until `publish` returned, the mapping is recorded (so unbind
    /// drops it) but no call can use its handle, and undoing it needs no other check. The caller
    /// may have learnt its bus addresses by then, and a command of one of its live queues may
    /// name them: in the strict domain bind requires, the unmap makes such a command fault in the
    /// IOMMU before the memory is unpinned.
    ///
    /// # Errors
    ///
    /// `EINVAL` for bad arguments, `E2BIG` above [`MAX_HOST_PAGES`] or [`MAX_GPU_PAGES`],
    /// `ENOSPC` for a short `bus_addrs` array, `ENODEV` after unbind, `ENXIO` if NVIDIA freed the
    /// GPU memory while it was being mapped (or unbind came between mapping host memory and
    /// publishing it), `publish`'s error, plus [`PinnedPages::pin`]'s, [`HostPages::map`]'s and
    /// [`GpuPages::pin`]'s.
    pub(crate) fn map(
        this: &Arc<Self>,
        owner: Owner,
        args: &uapi::MapArgs,
        publish: impl FnOnce(&uapi::MapArgs, &[u64]) -> Result,
    ) -> Result {
        if args.flags != 0 {
            return Err(EINVAL);
        }
        this.check_group_alone()?;
        let (page, max) = match args.kind {
            uapi::MAP_KIND_HOST => (uapi::HOST_PAGE_SIZE, MAX_HOST_PAGES as u64),
            uapi::MAP_KIND_GPU => (uapi::GPU_PAGE_SIZE, MAX_GPU_PAGES),
            _ => return Err(EINVAL),
        };
        let page_size = u64::from(page);
        if args.len == 0 || args.len % page_size != 0 || args.addr % page_size != 0 {
            return Err(EINVAL);
        }
        args.addr.checked_add(args.len).ok_or(EINVAL)?;
        let npages = args.len / page_size;
        if npages > max {
            return Err(E2BIG);
        }
        if u64::from(args.bus_addrs_cap) < npages {
            return Err(ENOSPC);
        }
        let out = |handle| uapi::MapArgs {
            handle,
            page_size: page,
            // CAST: at most `MAX_GPU_PAGES`.
            pages: npages as u32,
            ..*args
        };
        if args.kind == uapi::MAP_KIND_HOST {
            // Pinning may wait on page faults (a userfaultfd range) for as long as the process
            // likes: it holds no lock and nothing that unbind waits for.
            // CAST: `npages <= MAX_HOST_PAGES`.
            let pinned = PinnedPages::pin(args.addr, npages as usize)?;
            let (handle, bus) = this.record_host(owner, pinned)?;
            // Published outside the lock (the copies may fault too); a fault forgets the mapping.
            publish(&out(handle), &bus).inspect_err(|_| this.forget_unpublished(owner, handle))?;
            return this.mark_published(owner, handle);
        }
        let (_ticket, handle) = PinTicket::take(this)?;
        let revoker: Arc<dyn Revoker> = this.clone();
        // Without the state lock: NVIDIA may run a free callback meanwhile, which takes it. The
        // ticket keeps unbind from completing meanwhile (the pages need the bound device).
        let memory = Memory::Gpu(GpuPages::pin(
            &this.pdev, args.addr, args.len, revoker, owner, handle,
        )?);
        // Published before the mapping is recorded: a fault drops the memory.
        publish(&out(handle), memory.bus_addrs())?;
        this.insert(owner, handle, memory)
    }

    /// Maps `pinned` for the controller under the state lock (so the device is bound) and
    /// records it, not yet published; returns its handle and a copy of its bus addresses.
    ///
    /// # Errors
    ///
    /// `ENODEV` after unbind, `ENOSPC` without a free handle, [`HostPages::map`]'s errors.
    fn record_host(&self, owner: Owner, pinned: PinnedPages) -> Result<(u32, KVVec<u64>)> {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if !state.bound {
            drop(guard);
            drop(pinned);
            return Err(ENODEV);
        }
        let handle = free_handle(state)?;
        // SAFETY: `bound` is set under the state lock, so unbind has not dropped the device's
        // resources yet, and it drops every mapping (this one too) before it completes.
        let dev = unsafe { self.dev().as_bound() };
        let memory = HostPages::map(dev, pinned)?;
        let mut bus = KVVec::with_capacity(memory.bus_addrs().len(), GFP_KERNEL)?;
        bus.extend_from_slice(memory.bus_addrs(), GFP_KERNEL)?;
        state.maps.reserve(1, GFP_KERNEL)?;
        self.stats
            .bytes_pinned
            .fetch_add(memory.len() as u64, Ordering::Relaxed);
        // Capacity reserved above: cannot fail.
        state.maps.push(
            Mapping {
                owner,
                handle,
                memory: Memory::Host(memory),
                revoked: false,
                published: false,
            },
            GFP_KERNEL,
        )?;
        Ok((handle, bus))
    }

    /// Forgets the unpublished mapping `handle` of `owner`, if unbind did not take it already.
    fn forget_unpublished(&self, owner: Owner, handle: u32) {
        let mut guard = self.state.lock();
        let Some(i) = guard
            .maps
            .iter()
            .position(|m| m.owner == owner && m.handle == handle)
        else {
            return;
        };
        if let Ok(m) = guard.maps.remove(i) {
            self.stats
                .bytes_pinned
                .fetch_sub(m.memory.len() as u64, Ordering::Relaxed);
            // Dropped after the state lock is released (see `Mapping`).
            drop(guard);
            drop(m);
        }
    }

    /// Makes the recorded mapping `handle` of `owner` usable.
    ///
    /// # Errors
    ///
    /// `ENODEV` if unbind dropped it meanwhile.
    fn mark_published(&self, owner: Owner, handle: u32) -> Result {
        let mut state = self.state.lock();
        let m = state
            .maps
            .iter_mut()
            .find(|m| m.owner == owner && m.handle == handle)
            .ok_or(ENODEV)?;
        m.published = true;
        Ok(())
    }

    /// Records a new mapping; on failure it is dropped after the state lock is released.
    fn insert(&self, owner: Owner, handle: u32, memory: Memory) -> Result {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let refused = if !state.bound {
            Some(ENODEV)
        } else if matches!(&memory, Memory::Gpu(g) if g.revoked()) {
            // Under the state lock, a free callback that has not revoked the memory yet will
            // find the mapping once it is recorded.
            Some(ENXIO)
        } else {
            state.maps.reserve(1, GFP_KERNEL).err().map(Error::from)
        };
        if let Some(e) = refused {
            drop(guard);
            drop(memory);
            return Err(e);
        }
        self.stats
            .bytes_pinned
            .fetch_add(memory.len() as u64, Ordering::Relaxed);
        // Capacity reserved above: cannot fail.
        state.maps.push(
            Mapping {
                owner,
                handle,
                memory,
                revoked: false,
                published: true,
            },
            GFP_KERNEL,
        )?;
        Ok(())
    }

    /// Releases mapping `handle` of `owner`.
    ///
    /// Refused while `owner` has any queue pair on the controller, not only one whose SQ or CQ
    /// lies in the mapping: commands already submitted may carry PRPs (data buffers, PRP lists)
    /// that point into any of the owner's mappings, and the driver never sees them, so it cannot
    /// tell which memory the controller may still write. Deleting the queue pairs is what stops
    /// that: Delete I/O SQ completes only after the controller has completed or aborted the SQ's
    /// commands. A mapping NVIDIA already freed ([`Revoker::revoke`], which deleted the owner's
    /// queues at that time) holds nothing the device could reach, and may always be forgotten.
    ///
    /// # Errors
    ///
    /// `ENOENT` if `owner` has no such mapping, `EBUSY` while `owner` has a queue pair.
    pub(crate) fn unmap(&self, owner: Owner, handle: u32) -> Result {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let i = state
            .maps
            .iter()
            .position(|m| m.owner == owner && m.handle == handle && m.published)
            .ok_or(ENOENT)?;
        if !state.maps[i].revoked
            && state
                .queues
                .iter()
                .any(|q| q.owner == owner && self.maybe_on_device(q))
        {
            return Err(EBUSY);
        }
        let m = state.maps.remove(i)?;
        if !m.revoked {
            self.stats
                .bytes_pinned
                .fetch_sub(m.memory.len() as u64, Ordering::Relaxed);
        }
        drop(guard);
        // Dropped here, after the state lock is released (see `Mapping`).
        drop(m);
        Ok(())
    }
}

/// A `MAP` of GPU memory in progress: while it lives, unbind waits (the memory being pinned needs
/// the bound device until it is recorded or dropped). NVIDIA's pinning does not fault on user
/// memory, so the wait is bounded; host memory is pinned without a ticket.
struct PinTicket<'a>(&'a Controller);

impl<'a> PinTicket<'a> {
    /// Takes a ticket and a fresh mapping handle.
    ///
    /// # Errors
    ///
    /// `ENODEV` after unbind, `ENOSPC` if every handle is in use.
    fn take(ctrl: &'a Controller) -> Result<(Self, u32)> {
        let mut state = ctrl.state.lock();
        if !state.bound {
            return Err(ENODEV);
        }
        let handle = free_handle(&mut state)?;
        state.pins_in_flight += 1;
        Ok((Self(ctrl), handle))
    }
}

/// A fresh mapping handle: handles wrap around, skipping 0 and those still in use.
///
/// # Errors
///
/// `ENOSPC` if every handle is in use.
fn free_handle(state: &mut State) -> Result<u32> {
    let mut handle = state.next_handle;
    // At most `maps.len()` handles are taken, plus 0: one of this many candidates is free.
    for _ in 0..state.maps.len() + 2 {
        if handle != 0 && !state.maps.iter().any(|m| m.handle == handle) {
            state.next_handle = handle.wrapping_add(1);
            return Ok(handle);
        }
        handle = handle.wrapping_add(1);
    }
    Err(ENOSPC)
}

impl Drop for PinTicket<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state.lock();
        state.pins_in_flight -= 1;
        if state.pins_in_flight == 0 {
            self.0.pins_done.notify_all();
        }
    }
}
