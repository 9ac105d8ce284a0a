//! Recognition of foreign signatures: file systems, partition tables, swap,
//! encrypted volumes, and existing Legend stores.

use crate::superblock::MAGIC;

/// (name, byte offset, magic bytes). The offsets are the documented
/// on-disk locations of each format's primary magic.
const SIGNATURES: &[(&str, u64, &[u8])] = &[
    ("Legend store", 0, &MAGIC),
    ("Legend store", crate::layout::SUPERBLOCK_SLOT_BYTES, &MAGIC),
    ("LUKS", 0, b"LUKS\xba\xbe"),
    ("LUKS2 (secondary header)", 0x4000, b"SKUL\xba\xbe"),
    ("xfs", 0, b"XFSB"),
    ("NTFS", 3, b"NTFS    "),
    ("GPT partition table", 512, b"EFI PART"),
    ("GPT partition table (4 KiB sectors)", 4096, b"EFI PART"),
    ("LVM2 physical volume", 512 + 24, b"LVM2 001"),
    ("ext2/3/4", 1024 + 56, &[0x53, 0xef]),
    ("f2fs", 1024, &[0x10, 0x20, 0xf5, 0xf2]),
    ("swap", 4096 - 10, b"SWAPSPACE2"),
    ("swap (old)", 4096 - 10, b"SWAP-SPACE"),
    ("ISO 9660", 32769, b"CD001"),
    ("btrfs", 65536 + 64, b"_BHRfS_M"),
    ("MBR partition table or boot sector", 510, &[0x55, 0xaa]),
];

/// Bytes from the start of a target that [`foreign_signature`] inspects: both Legend superblock
/// slots (which cover every other signature's offset, the btrfs superblock at 64 KiB the
/// farthest).
pub const HEAD_BYTES: usize = 2 * crate::layout::SUPERBLOCK_SLOT_BYTES as usize;

/// What keeps a store from being created on a target whose first bytes are `head` (at least
/// [`HEAD_BYTES`] of them, or the whole target when shorter) without `force`: the first
/// signature found in it, with its offset; `None` when there is none, or when `head` is the
/// store `store_id` as its interrupted creation left it (the creator recorded the id first).
/// That creation wiped both slots before it wrote, so nothing of an older content is left.
pub fn foreign_signature(head: &[u8], store_id: Option<[u8; 16]>) -> Option<(&'static str, u64)> {
    if store_id.is_some_and(|id| crate::superblock::is_creation_of(head, id)) {
        return None;
    }
    find(head)
}

/// Returns the first signature found in `head` (the first bytes of the
/// target) with its offset. Legend's own magic comes first in the table so
/// an old store is named as such.
pub(crate) fn find(head: &[u8]) -> Option<(&'static str, u64)> {
    SIGNATURES.iter().find_map(|&(name, at, magic)| {
        let at_us = usize::try_from(at).ok()?;
        (head.get(at_us..at_us + magic.len()) == Some(magic)).then_some((name, at))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_each_signature() {
        for &(name, at, magic) in SIGNATURES {
            let mut head = vec![0u8; 2 << 20];
            head[at as usize..at as usize + magic.len()].copy_from_slice(magic);
            assert_eq!(find(&head).map(|f| f.0), Some(name));
        }
        assert_eq!(find(&vec![0u8; HEAD_BYTES]), None);
    }
}
