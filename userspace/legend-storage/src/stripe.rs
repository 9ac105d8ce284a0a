//! Striping (RAID-0) of a store over several members: which member, and where on it, each byte
//! of the store's layout lives.
//!
//! The layout ([`crate::Layout`]) places every region in one address space as if the store
//! were on a single device. The superblock slots at its start are not striped: every member
//! has its own two slots there, at the same bytes. Past them, the address space is cut into
//! units of `unit` bytes dealt round-robin: unit `k` is on member `k mod M`, at that member's
//! `2 MiB + ⌊k / M⌋ · unit`. A partition of many units is thus spread evenly over the members,
//! and one transfer becomes a piece per unit, issued to the members at once.

use crate::layout::SUPERBLOCK_SLOT_BYTES;

/// The first striped byte of the layout: the superblock slots before it are each member's own.
const DATA_START: u64 = 2 * SUPERBLOCK_SLOT_BYTES;

/// Bytes each of `members` members needs for a layout of `total_bytes` ([`crate::Layout`])
/// striped in units of `stripe_bytes`: what a file or namespace must hold for its share.
pub fn member_bytes(total_bytes: u64, members: usize, stripe_bytes: u64) -> u64 {
    if members <= 1 {
        return total_bytes;
    }
    let members = u32::try_from(members).unwrap_or(u32::MAX);
    Stripe::new(members, stripe_bytes).member_bytes(total_bytes)
}

/// A store's striping: `members` devices, `unit` bytes a stripe unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stripe {
    unit: u64,
    members: u32,
}

/// The part of a transfer that lies on one member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The member.
    pub(crate) member: usize,
    /// Byte offset on the member.
    pub(crate) offset: u64,
    /// Offset of the piece in the transfer (and in its buffer).
    pub(crate) at: u64,
    /// Bytes.
    pub(crate) len: u64,
}

impl Stripe {
    /// A store on one device: every byte where the layout puts it.
    pub(crate) fn single() -> Self {
        Stripe {
            unit: 0,
            members: 1,
        }
    }

    /// `members` devices (at least 2) of `unit`-byte stripe units (positive).
    pub(crate) fn new(members: u32, unit: u64) -> Self {
        debug_assert!(members >= 2 && unit > 0);
        Stripe { unit, members }
    }

    /// Number of members.
    pub(crate) fn members(&self) -> usize {
        self.members as usize
    }

    /// Bytes of a stripe unit (0 for one member).
    pub(crate) fn unit(&self) -> u64 {
        self.unit
    }

    /// Bytes each member needs for a layout of `total_bytes`.
    pub(crate) fn member_bytes(&self, total_bytes: u64) -> u64 {
        if self.members == 1 {
            return total_bytes;
        }
        let units = total_bytes.saturating_sub(DATA_START).div_ceil(self.unit);
        DATA_START + units.div_ceil(u64::from(self.members)) * self.unit
    }

    /// The pieces of the transfer of `len` bytes at layout byte `offset` (past the superblock
    /// slots when striped), in transfer order.
    pub(crate) fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Piece> + use<> {
        let single = self.members == 1;
        debug_assert!(single || offset >= DATA_START);
        let (unit, members) = (self.unit, u64::from(self.members));
        let mut at = 0;
        std::iter::from_fn(move || {
            if at >= len {
                return None;
            }
            if single {
                at = len;
                return Some(Piece {
                    member: 0,
                    offset,
                    at: 0,
                    len,
                });
            }
            let data = offset + at - DATA_START;
            let (k, within) = (data / unit, data % unit);
            let n = (unit - within).min(len - at);
            let piece = Piece {
                member: (k % members) as usize,
                offset: DATA_START + (k / members) * unit + within,
                at,
                len: n,
            };
            at += n;
            Some(piece)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn units_go_round_robin_after_the_superblock_slots() {
        let s = Stripe::new(2, 1 << 20);
        let mib = 1u64 << 20;
        let got: Vec<Piece> = s.pieces(DATA_START + mib / 2, 2 * mib).collect();
        let want = [
            (0, DATA_START + mib / 2, 0, mib / 2),
            (1, DATA_START, mib / 2, mib),
            (0, DATA_START + mib, 3 * mib / 2, mib / 2),
        ];
        let want: Vec<Piece> = want
            .iter()
            .map(|&(member, offset, at, len)| Piece {
                member,
                offset,
                at,
                len,
            })
            .collect();
        assert_eq!(got, want);
        assert_eq!(
            s.member_bytes(DATA_START + 3 * mib + 1),
            DATA_START + 2 * mib
        );
        let one: Vec<Piece> = Stripe::single().pieces(4096, 100).collect();
        assert_eq!(
            one,
            [Piece {
                member: 0,
                offset: 4096,
                at: 0,
                len: 100
            }]
        );
    }

    proptest! {
        /// Every byte of a transfer lands on exactly one member byte, inside the member's
        /// size, and two layout bytes never share a member byte.
        #[test]
        fn the_mapping_is_one_to_one_and_fits(
            members in 2u32..6,
            unit_blocks in 1u64..8,
            start in 0u64..5_000,
            lens in proptest::collection::vec(1u64..6_000, 1..4),
        ) {
            let unit = unit_blocks * 512;
            let s = Stripe::new(members, unit);
            let mut seen = std::collections::HashSet::new();
            let mut offset = DATA_START + start;
            let end = offset + lens.iter().sum::<u64>();
            for len in lens {
                let mut covered = 0;
                for p in s.pieces(offset, len) {
                    prop_assert_eq!(p.at, covered);
                    prop_assert!(p.len > 0 && p.member < members as usize);
                    prop_assert!(p.offset >= DATA_START);
                    prop_assert!(p.offset + p.len <= s.member_bytes(end));
                    for b in p.offset..p.offset + p.len {
                        prop_assert!(seen.insert((p.member, b)), "member {} byte {} twice", p.member, b);
                    }
                    covered += p.len;
                }
                prop_assert_eq!(covered, len);
                offset += len;
            }
        }
    }
}
