// SPDX-License-Identifier: GPL-2.0-only

//! Pinned host memory and kernel pages, and their streaming DMA mappings for one controller.
//!
//! The `unsafe` calls into the C shim are kept here: a [`PinnedPages`] owns page pins and their
//! charge to the pinning user's locked memory, a [`HostPages`] those and their DMA
//! mapping, and a [`DmaPage`] a kernel page and its mapping; each releases what it owns when
//! dropped.
//!
//! Unmapping happens before unpinning or freeing, always: probe admits only strict IOMMU
//! domains, where `dma_unmap_page` returns after the IOTLB no longer translates the address, so
//! nothing the controller is told (or a forged completion claims) decides when memory leaves
//! its reach.

use kernel::{
    bindings,
    device,
    dma::DataDirection,
    page::Page,
    prelude::*,
    sync::aref::ARef, //
};

use crate::uapi;

// The driver's page arithmetic and the ABI's host page are the same size.
const _: () = assert!(kernel::page::PAGE_SIZE == uapi::HOST_PAGE_SIZE as usize);

// The kernel structs are only passed by pointer, never by value.
#[expect(improper_ctypes)]
extern "C" {
    fn legend_shim_pin_user(
        uaddr: usize,
        npages: usize,
        pages: *mut *mut bindings::page,
        mm: *mut *mut bindings::mm_struct,
        user: *mut *mut RawUser,
    ) -> isize;
    fn legend_shim_unpin_user(
        pages: *mut *mut bindings::page,
        npages: usize,
        mm: *mut bindings::mm_struct,
        user: *mut RawUser,
    );
    fn legend_shim_page_phys(page: *mut bindings::page) -> u64;
    fn legend_shim_dma_map_page(
        dev: *mut bindings::device,
        page: *mut bindings::page,
        dir: c_int,
        bus: *mut u64,
    ) -> c_int;
    fn legend_shim_dma_unmap_page(dev: *mut bindings::device, bus: u64, dir: c_int);
    fn legend_shim_map_user(
        dev: *mut bindings::device,
        pages: *const *mut bindings::page,
        npages: usize,
        bus: *mut u64,
        sgt: *mut *mut RawSgTable,
    ) -> c_int;
    fn legend_shim_unmap_user(dev: *mut bindings::device, sgt: *mut RawSgTable);
}

/// `dir` as the C enum's value.
fn raw_dir(dir: DataDirection) -> c_int {
    // CAST: the enum's values are 0 to 3.
    dir as u32 as c_int
}

/// Maps `page` for `dev` in direction `dir`; the bus address.
///
/// # Safety
///
/// `page` is a valid page that stays allocated (or pinned) until the mapping is undone with
/// [`unmap_page`], and `dev` is bound until then.
unsafe fn map_page(
    dev: &device::Device,
    page: *mut bindings::page,
    dir: DataDirection,
) -> Result<u64> {
    let mut bus = 0u64;
    // SAFETY: by the function's contract.
    let ret = unsafe { legend_shim_dma_map_page(raw_device(dev), page, raw_dir(dir), &mut bus) };
    if ret == EOPNOTSUPP.to_errno() {
        dev_err!(
            dev,
            "DMA to the pages would need bounce buffers (SWIOTLB) or sync calls: refused\n"
        );
    }
    if ret != 0 {
        return Err(Error::from_errno(ret));
    }
    Ok(bus)
}

/// Undoes [`map_page`]; in the strict domain probe requires, the controller can no longer reach
/// the page when this returns.
///
/// # Safety
///
/// `bus` is a live mapping made by [`map_page`] for `dev` with `dir`; `dev` is bound.
unsafe fn unmap_page(dev: &device::Device, bus: u64, dir: DataDirection) {
    // SAFETY: by the function's contract.
    unsafe { legend_shim_dma_unmap_page(raw_device(dev), bus, raw_dir(dir)) };
}

/// A zeroed kernel page mapped for one device in one direction (`ToDevice`: the IOMMU lets the
/// device only read it).
///
/// # Invariants
///
/// `bus` is a live mapping of `page` for `dev` with `dir`, undone by `Drop` or [`DmaPage::unmap`].
pub(crate) struct DmaPage {
    dev: ARef<device::Device>,
    page: Page,
    bus: u64,
    dir: DataDirection,
}

impl DmaPage {
    /// Allocates a zeroed page and maps it. `dev` must stay bound until the result is dropped.
    pub(crate) fn new(dev: &device::Device<device::Bound>, dir: DataDirection) -> Result<Self> {
        let page = Page::alloc_page(GFP_KERNEL | __GFP_ZERO)?;
        // SAFETY: `page` is kept in the result until the mapping is undone; `dev` is bound.
        let bus = unsafe { map_page(dev, page.as_ptr(), dir)? };
        // INVARIANT: just mapped.
        Ok(Self {
            dev: dev.into(),
            page,
            bus,
            dir,
        })
    }

    pub(crate) fn bus(&self) -> u64 {
        self.bus
    }

    /// The page, for the CPU's reads and writes.
    pub(crate) fn page(&self) -> &Page {
        &self.page
    }

    /// Undoes the mapping and hands the page back.
    pub(crate) fn unmap(self) -> Page {
        let this = core::mem::ManuallyDrop::new(self);
        // SAFETY: by the invariants; the caller's contract of `new` keeps `dev` bound.
        unsafe { unmap_page(&this.dev, this.bus, this.dir) };
        // SAFETY: each field is moved out once, and `this` is never dropped.
        let (page, dev) = unsafe { (core::ptr::read(&this.page), core::ptr::read(&this.dev)) };
        drop(dev);
        page
    }
}

impl Drop for DmaPage {
    fn drop(&mut self) {
        // SAFETY: by the invariants; the caller's contract of `new` keeps `dev` bound.
        unsafe { unmap_page(&self.dev, self.bus, self.dir) };
    }
}

/// The C `struct device` of `dev`.
pub(crate) fn raw_device(dev: &device::Device) -> *mut bindings::device {
    // CAST: `device::Device` is a `repr(transparent)` wrapper of `struct device`.
    core::ptr::from_ref(dev)
        .cast::<bindings::device>()
        .cast_mut()
}

/// Most pages one mapping may pin (1 GiB of host memory).
pub(crate) const MAX_HOST_PAGES: usize = 1 << 18;

/// The kernel's `struct user_struct` (a user's resource counters); only handled by pointer.
#[repr(C)]
struct RawUser {
    _opaque: [u8; 0],
}

/// User pages pinned with `FOLL_LONGTERM`; no device involved, so pinning (which may wait on a
/// page fault for as long as a userfaultfd handler likes) needs neither a bound device nor any
/// lock of the controller.
///
/// The pages are charged to the pinning user's locked memory (`user->locked_vm`, the counter
/// io_uring's registered buffers and iommufd use too), against the pinning process's
/// `RLIMIT_MEMLOCK` unless it has `CAP_IPC_LOCK`, and counted in its `VmPin`: one limit bounds
/// what a user pins in all its processes, whoever releases the pages later.
///
/// # Invariants
///
/// `pages` holds pinned pages, each pinned once by this object, counted in `mm`'s `pinned_vm`
/// and charged to `user` (unless null), of which this object holds references (`mmgrab`,
/// `get_uid`).
pub(crate) struct PinnedPages {
    pages: KVVec<*mut bindings::page>,
    mm: *mut bindings::mm_struct,
    user: *mut RawUser,
}

// SAFETY: the page, mm and user pointers are references owned through pins, `mmgrab` and
// `get_uid`; unpinning and uncharging may happen on any thread.
unsafe impl Send for PinnedPages {}

impl PinnedPages {
    /// Pins `npages` pages of the calling process from `uaddr`.
    ///
    /// # Errors
    ///
    /// - `EFAULT` if the range is not fully mapped writable memory of the caller.
    /// - `ENOMEM` if the caller's user would have more locked memory than the caller's
    ///   `RLIMIT_MEMLOCK` (without `CAP_IPC_LOCK`), or without memory.
    pub(crate) fn pin(uaddr: u64, npages: usize) -> Result<Self> {
        let uaddr = usize::try_from(uaddr).map_err(|_| EINVAL)?;
        // Before pinning: no allocation can fail with pages pinned and not owned.
        let mut pages = KVVec::with_capacity(npages, GFP_KERNEL)?;
        let (mut mm, mut user) = (core::ptr::null_mut(), core::ptr::null_mut());
        // SAFETY: `pages` has room for `npages` entries; the shim pins all of them or none.
        let got =
            unsafe { legend_shim_pin_user(uaddr, npages, pages.as_mut_ptr(), &mut mm, &mut user) };
        if got < 0 {
            // CAST: a negative errno fits in an i32.
            return Err(Error::from_errno(got as i32));
        }
        // SAFETY: the shim pinned and initialised all `npages` entries.
        unsafe { pages.inc_len(npages) };
        // INVARIANT: the pages are pinned, counted in `mm` and charged to `user`, both of which
        // the shim took references to.
        Ok(Self { pages, mm, user })
    }
}

impl Drop for PinnedPages {
    fn drop(&mut self) {
        // SAFETY: by the invariants each page is pinned once by this object, counted in `mm` and
        // charged to `user`, whose references this releases.
        unsafe {
            legend_shim_unpin_user(
                self.pages.as_mut_ptr(),
                self.pages.len(),
                self.mm,
                self.user,
            )
        };
    }
}

/// The C shim's scatter-gather table of a [`HostPages`]; only handled by pointer.
#[repr(C)]
struct RawSgTable {
    _opaque: [u8; 0],
}

/// Pinned user pages mapped for DMA by one device, as one scatter-gather mapping: under an
/// IOMMU, the DMA API puts the pages at consecutive bus addresses, so rings of any size fit in
/// one mapping.
///
/// # Invariants
///
/// `sgt` is a live DMA mapping of `pinned`'s pages for `dev` (by `legend_shim_map_user`), and
/// `bus[i]` the bus address of page `i` in it.
pub(crate) struct HostPages {
    dev: ARef<device::Device>,
    sgt: *mut RawSgTable,
    bus: KVVec<u64>,
    pinned: PinnedPages,
}

// SAFETY: as for `PinnedPages`; the scatter-gather table is owned by this object, and DMA
// unmapping may happen on any thread.
unsafe impl Send for HostPages {}

impl HostPages {
    /// Maps `pinned` for `dev`, which must stay bound until the result is dropped; the controller
    /// ensures it by mapping under its state lock while bound and dropping every mapping before
    /// its unbind completes.
    ///
    /// # Errors
    ///
    /// - `ENOMEM` if memory or a DMA mapping could not be had.
    /// - `EOPNOTSUPP` if DMA to the pages would need sync calls (SWIOTLB bounce buffering).
    pub(crate) fn map(dev: &device::Device<device::Bound>, pinned: PinnedPages) -> Result<Self> {
        let npages = pinned.pages.len();
        let mut bus = KVVec::with_capacity(npages, GFP_KERNEL)?;
        let mut sgt = core::ptr::null_mut();
        // SAFETY: `pinned` holds `npages` pinned pages, kept (in the result) until `Drop` unmaps
        // them; `bus` has room for `npages` addresses; `dev` is bound (the caller's contract).
        let ret = unsafe {
            legend_shim_map_user(
                raw_device(dev),
                pinned.pages.as_ptr(),
                npages,
                bus.as_mut_ptr(),
                &mut sgt,
            )
        };
        if ret == EOPNOTSUPP.to_errno() {
            dev_err!(
                dev,
                "DMA to user pages would need bounce buffers (SWIOTLB) or sync calls: refused\n"
            );
        }
        if ret != 0 {
            return Err(Error::from_errno(ret));
        }
        // SAFETY: the shim wrote `npages` bus addresses.
        unsafe { bus.inc_len(npages) };
        // INVARIANT: the shim mapped the pages into `sgt`.
        Ok(Self {
            dev: dev.into(),
            sgt,
            bus,
            pinned,
        })
    }

    /// Bus addresses of the pages, one per [`uapi::HOST_PAGE_SIZE`] bytes.
    pub(crate) fn bus_addrs(&self) -> &[u64] {
        &self.bus
    }

    /// Bytes pinned.
    pub(crate) fn len(&self) -> usize {
        self.pinned.pages.len() * uapi::HOST_PAGE_SIZE as usize
    }

    /// Physical address of page `i` (`i` below the number of pages).
    pub(crate) fn frame(&self, i: usize) -> u64 {
        // SAFETY: the page is pinned by `self.pinned` (its invariants).
        unsafe { legend_shim_page_phys(self.pinned.pages[i]) }
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        // SAFETY: by the invariants `sgt` is a live mapping for `dev`, which the caller of `map`
        // keeps bound; the pages are unpinned only afterwards, when `pinned` is dropped.
        unsafe { legend_shim_unmap_user(raw_device(&self.dev), self.sgt) };
    }
}
