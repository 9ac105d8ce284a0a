//! Aligned host buffers for `O_DIRECT` I/O.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::StoreError;

/// Address and length granularity of [`IoBuffer`]s.
///
/// 4 KiB satisfies the logical block size of every device this crate has
/// met (512 B or 4 KiB); the store checks the real block size against the
/// buffer before each request anyway.
pub const IO_ALIGN: usize = 4096;

/// The allocation behind an [`IoBuffer`], shared with the store's table of
/// registered buffers so the memory stays valid until the kernel lets go.
#[derive(Debug)]
pub(crate) struct RawAlloc {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: `RawAlloc` is a plain heap allocation with no thread affinity; all
// reads and writes of its bytes go through an `IoBuffer` borrow (or an I/O
// request issued while such a borrow is held), so sharing the handle across
// threads cannot create unsynchronised access.
unsafe impl Send for RawAlloc {}
// SAFETY: see the `Send` impl; `&RawAlloc` exposes only the address and size.
unsafe impl Sync for RawAlloc {}

impl RawAlloc {
    fn layout(cap: usize) -> Layout {
        // `cap` is a non-zero multiple of IO_ALIGN, checked by the caller,
        // so this cannot fail except on absurd sizes caught earlier.
        Layout::from_size_align(cap, IO_ALIGN).expect("checked buffer layout")
    }

    /// Start address of the allocation.
    pub(crate) fn addr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Size of the allocation in bytes (a multiple of [`IO_ALIGN`]).
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and
        // is freed once, here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

/// A zero-initialised host buffer whose address and capacity are multiples
/// of [`IO_ALIGN`], as `O_DIRECT` requires.
///
/// Allocate one per partition-buffer slot (size it with
/// [`Store::max_partition_bytes`](crate::Store::max_partition_bytes)) and
/// reuse it: the store registers a buffer with its `io_uring` the first time
/// it is used, so later requests on it skip the page pinning.
#[derive(Debug)]
pub struct IoBuffer {
    raw: Arc<RawAlloc>,
    len: usize,
}

impl IoBuffer {
    /// Allocates `len` zeroed bytes; the capacity is `len` rounded up to
    /// [`IO_ALIGN`] (at least one block).
    pub fn new(len: usize) -> Result<Self, StoreError> {
        let cap = len
            .max(1)
            .checked_next_multiple_of(IO_ALIGN)
            .filter(|&c| c <= isize::MAX as usize - IO_ALIGN)
            .ok_or(StoreError::BufferAlloc { bytes: len })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(RawAlloc::layout(cap)) };
        let ptr = NonNull::new(ptr).ok_or(StoreError::BufferAlloc { bytes: len })?;
        Ok(Self {
            raw: Arc::new(RawAlloc { ptr, cap }),
            len,
        })
    }

    /// Logical length in bytes (what the slices show).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the logical length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocated bytes: the length rounded up to [`IO_ALIGN`].
    pub fn capacity(&self) -> usize {
        self.raw.cap
    }

    /// The bytes of the buffer.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds `cap >= len` initialised (zeroed)
        // bytes, and `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.raw.addr(), self.len) }
    }

    /// The bytes of the buffer, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.raw.addr(), self.len) }
    }

    /// The buffer as `f32`s (`len / 4` of them; the address is 4 KiB
    /// aligned, so the cast is always valid).
    pub fn as_f32(&self) -> &[f32] {
        // SAFETY: the address is IO_ALIGN-aligned (>= align_of::<f32>()), the
        // bytes are initialised, and every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts(self.raw.addr().cast::<f32>(), self.len / 4) }
    }

    /// The buffer as `f32`s, mutably.
    pub fn as_f32_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_f32`; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.raw.addr().cast::<f32>(), self.len / 4) }
    }

    /// Splits a partition image of `rows` rows of `spec`'s store into its
    /// embeddings (`rows · dim` elements of `spec.dtype`, as bytes) and its
    /// AdaGrad state (`rows · state_width` f32), the on-disk order.
    ///
    /// # Panics
    /// If the buffer is shorter than the partition.
    pub fn split_partition_mut(
        &mut self,
        rows: u64,
        spec: &crate::StoreSpec,
    ) -> (&mut [u8], &mut [f32]) {
        let too_big = "partition fits in memory";
        let emb = usize::try_from(spec.embedding_bytes(rows).expect(too_big)).expect(too_big);
        let state = usize::try_from(rows * u64::from(spec.state_width)).expect(too_big);
        let all = self.as_bytes_mut();
        assert!(
            all.len() >= emb + 4 * state,
            "buffer of {} bytes holds no partition of {emb} + {} bytes",
            all.len(),
            4 * state
        );
        let (e, rest) = all.split_at_mut(emb);
        let used = (rows * u64::from(spec.dim)) as usize * spec.dtype.bytes();
        (
            &mut e[..used],
            bytemuck::cast_slice_mut(&mut rest[..4 * state]),
        )
    }

    pub(crate) fn raw(&self) -> &Arc<RawAlloc> {
        &self.raw
    }
}
