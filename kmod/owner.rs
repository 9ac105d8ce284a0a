// SPDX-License-Identifier: GPL-2.0-only

//! [`Owner`]: which open file of a controller's character device created a mapping or a queue
//! pair, so that closing it releases exactly what it made.

use core::sync::atomic::{
    AtomicU64,
    Ordering, //
};

/// Identifies an open file: a number no other open file of this module gets.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner(u64);

impl Owner {
    /// A number no earlier call returned.
    pub(crate) fn new_unique() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}
