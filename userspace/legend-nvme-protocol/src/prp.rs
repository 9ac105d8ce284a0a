//! Physical Region Page entries (NVMe Base 2.0, 4.1.1), with the controller's memory page size
//! at 4 KiB (CC.MPS = 0, which `legend_nvme` sets).
//!
//! PRP1 names the first data byte (any dword-aligned offset in its page). A transfer within that
//! page needs nothing else; one that ends in the next page puts that page in PRP2; a longer one
//! puts in PRP2 the address of a PRP list, one entry per further page. Lists built here fit in
//! one page ([`MAX_PAGES`] pages per command, 2 MiB of data or more: above any controller's
//! MDTS seen so far); [`walk`] also follows chained lists, as a controller must.

/// The controller memory page size, in bytes.
pub const PAGE: u64 = 4096;

/// Most pages one command built here spans: PRP1's page and a one-page list of 512 entries.
pub const MAX_PAGES: usize = 1 + (PAGE / 8) as usize;

/// The two PRP entries of a command.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prp {
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2.
    pub prp2: u64,
}

/// Why PRP entries could not be built or followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrpError {
    /// The first byte is not dword aligned, a page address is not page aligned, or the list is
    /// not 8-byte aligned.
    Unaligned,
    /// The transfer spans more pages than one list page holds, or the list memory given is short
    /// or crosses a page boundary.
    TooLong,
    /// The transfer is empty.
    Empty,
    /// Reading a list entry failed (the walker's callback said so).
    ListUnreadable,
}

impl core::fmt::Display for PrpError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::Unaligned => "misaligned PRP entry",
            Self::TooLong => "transfer too long for one PRP list page",
            Self::Empty => "empty transfer",
            Self::ListUnreadable => "PRP list not readable",
        })
    }
}

/// Pages a transfer of `len` bytes starting at byte `offset` of its first page touches.
pub fn pages(offset: u64, len: u64) -> usize {
    // CAST: callers bound transfers far below usize::MAX pages.
    (offset % PAGE + len).div_ceil(PAGE) as usize
}

/// Builds the PRP entries of a transfer of `len` bytes that starts at byte `offset` of page 0,
/// where `page(i)` is the bus address of its page `i` (page aligned). Entries beyond PRP2 go into
/// `list`, whose first entry is at bus address `list_bus`.
///
/// # Errors
///
/// [`PrpError::Empty`], [`PrpError::Unaligned`] (offset not dword aligned, a page address not
/// page aligned, `list_bus` not 8-byte aligned), [`PrpError::TooLong`] (more than
/// [`MAX_PAGES`] pages, `list` too short, or the list would cross a page boundary).
pub fn build(
    offset: u64,
    len: u64,
    page: impl Fn(usize) -> u64,
    list: &mut [u64],
    list_bus: u64,
) -> Result<Prp, PrpError> {
    if len == 0 {
        return Err(PrpError::Empty);
    }
    if !offset.is_multiple_of(4) || offset >= PAGE {
        return Err(PrpError::Unaligned);
    }
    let n = pages(offset, len);
    if n > MAX_PAGES {
        return Err(PrpError::TooLong);
    }
    let first = page(0);
    if !first.is_multiple_of(PAGE) {
        return Err(PrpError::Unaligned);
    }
    let prp1 = first + offset;
    let prp2 = match n {
        1 => 0,
        2 => page(1),
        _ => {
            let entries = n - 1;
            if !list_bus.is_multiple_of(8) {
                return Err(PrpError::Unaligned);
            }
            if list.len() < entries || list_bus % PAGE + 8 * entries as u64 > PAGE {
                return Err(PrpError::TooLong);
            }
            for (i, e) in list[..entries].iter_mut().enumerate() {
                *e = page(i + 1);
            }
            list_bus
        }
    };
    if n >= 2 && prp2 % PAGE != 0 {
        return Err(PrpError::Unaligned);
    }
    if n > 2 && (1..n).any(|i| !page(i).is_multiple_of(PAGE)) {
        return Err(PrpError::Unaligned);
    }
    Ok(Prp { prp1, prp2 })
}

/// Follows the PRP entries of a `len`-byte transfer as a controller does, calling
/// `visit(bus address, bytes)` for each piece in order. `read(bus address)` reads one list entry.
///
/// # Errors
///
/// [`PrpError::Empty`], [`PrpError::Unaligned`] for a misaligned entry, or
/// [`PrpError::ListUnreadable`] if `read` fails.
pub fn walk(
    prp: Prp,
    len: u64,
    mut read: impl FnMut(u64) -> Option<u64>,
    mut visit: impl FnMut(u64, u64),
) -> Result<(), PrpError> {
    if len == 0 {
        return Err(PrpError::Empty);
    }
    if !prp.prp1.is_multiple_of(4) {
        return Err(PrpError::Unaligned);
    }
    let head = (PAGE - prp.prp1 % PAGE).min(len);
    visit(prp.prp1, head);
    let mut left = len - head;
    if left == 0 {
        return Ok(());
    }
    if left <= PAGE {
        if !prp.prp2.is_multiple_of(PAGE) {
            return Err(PrpError::Unaligned);
        }
        visit(prp.prp2, left);
        return Ok(());
    }
    if !prp.prp2.is_multiple_of(8) {
        return Err(PrpError::Unaligned);
    }
    let mut entry = prp.prp2;
    while left > 0 {
        let addr = read(entry).ok_or(PrpError::ListUnreadable)?;
        // The last entry of a list page points to the next list page when more than one page of
        // data is left.
        if (entry + 8).is_multiple_of(PAGE) && left > PAGE {
            if addr % PAGE != 0 {
                return Err(PrpError::Unaligned);
            }
            entry = addr;
            continue;
        }
        if addr % PAGE != 0 {
            return Err(PrpError::Unaligned);
        }
        let n = left.min(PAGE);
        visit(addr, n);
        left -= n;
        entry += 8;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use proptest::prelude::*;

    use super::*;

    fn page(i: usize) -> u64 {
        // Scattered, page-aligned bus addresses.
        0x10_0000 + (i as u64 * 7 % 13) * PAGE + (i as u64 / 13) * 13 * PAGE
    }

    #[test]
    fn one_and_two_pages_need_no_list() {
        let mut list = [0u64; 4];
        let p = build(512, 1024, page, &mut list, 0x9000).unwrap();
        assert_eq!(
            p,
            Prp {
                prp1: page(0) + 512,
                prp2: 0
            }
        );
        let p = build(0, 8192, page, &mut list, 0x9000).unwrap();
        assert_eq!(
            p,
            Prp {
                prp1: page(0),
                prp2: page(1)
            }
        );
        assert_eq!(list, [0; 4]);
    }

    #[test]
    fn longer_transfers_use_a_list() {
        let mut list = [0u64; 8];
        let p = build(0, 4 * PAGE, page, &mut list, 0x9000).unwrap();
        assert_eq!(p.prp2, 0x9000);
        assert_eq!(list[..3], [page(1), page(2), page(3)]);
    }

    #[test]
    fn bad_inputs_are_refused() {
        let mut list = [0u64; 1];
        assert_eq!(build(0, 0, page, &mut list, 0), Err(PrpError::Empty));
        assert_eq!(build(2, 8, page, &mut list, 0), Err(PrpError::Unaligned));
        assert_eq!(
            build(0, 3 * PAGE, page, &mut list, 0x9000),
            Err(PrpError::TooLong)
        );
        let mut big = [0u64; 600];
        assert_eq!(
            build(0, (MAX_PAGES as u64 + 1) * PAGE, page, &mut big, 0x9000),
            Err(PrpError::TooLong)
        );
        // A list crossing into the next page.
        assert_eq!(
            build(0, 4 * PAGE, page, &mut big, 0x9ff8),
            Err(PrpError::TooLong)
        );
        assert_eq!(
            build(0, 4 * PAGE, |_| 0x1234, &mut big, 0x9000),
            Err(PrpError::Unaligned)
        );
    }

    #[test]
    fn walk_follows_a_chained_list() {
        // 1 + 511 + 2 pages: the first list page's last entry chains to a second list page.
        let len = 514 * PAGE;
        let mut mem = std::collections::HashMap::new();
        for i in 0..511u64 {
            mem.insert(0x8000 + 8 * i, page(i as usize + 1));
        }
        mem.insert(0x8000 + 8 * 511, 0xa000);
        mem.insert(0xa000, page(512));
        mem.insert(0xa008, page(513));
        let mut seen = Vec::new();
        walk(
            Prp {
                prp1: page(0),
                prp2: 0x8000,
            },
            len,
            |a| mem.get(&a).copied(),
            |a, n| seen.push((a, n)),
        )
        .unwrap();
        let want: Vec<_> = (0..514).map(|i| (page(i), PAGE)).collect();
        assert_eq!(seen, want);
    }

    proptest! {
        #[test]
        fn walk_visits_what_build_described(offset in (0u64..1024).prop_map(|o| o * 4), len in 1u64..(MAX_PAGES as u64 - 1) * PAGE) {
            let mut list = std::vec![0u64; MAX_PAGES];
            let list_bus = 0x40_0000;
            let p = build(offset, len, page, &mut list, list_bus).unwrap();
            let mut pieces = Vec::new();
            walk(p, len, |a| list.get(((a - list_bus) / 8) as usize).copied(), |a, n| pieces.push((a, n))).unwrap();
            prop_assert_eq!(pieces.iter().map(|p| p.1).sum::<u64>(), len);
            prop_assert_eq!(pieces[0].0, page(0) + offset);
            for (i, &(a, _)) in pieces.iter().enumerate().skip(1) {
                prop_assert_eq!(a, page(i));
            }
            prop_assert_eq!(pieces.len(), pages(offset, len));
        }
    }
}
