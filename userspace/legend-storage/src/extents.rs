//! The extent table of a shared namespace: which LBA ranges belong to which run, so that jobs of
//! several users on one device get disjoint stores. `legendd` keeps it at the start of the
//! namespace as a small store of its own, the table being that store's progress record: it is
//! committed by the same two-copy superblock flip as a training checkpoint, so a crash leaves
//! the previous table or the new one, never a torn one.

use crate::error::StoreError;
use crate::io::IoConfig;
use crate::layout::{DatasetId, StoreSpec};
use crate::medium::Target;
use crate::store::{CreateOptions, Expect, Store};

/// The identity of the table's own store: a device whose first store has another identity
/// holds a training store there, and is refused.
const TABLE_DATASET: [u8; 16] = *b"legendd-extents1";
/// Where the table's encoding starts.
const MAGIC: [u8; 8] = *b"LGNDEXTS";
/// Bytes the table may take (its store's progress capacity).
const TABLE_CAPACITY: u32 = 64 << 10;
/// Every extent starts on a multiple of this many bytes.
pub const EXTENT_ALIGN: u64 = 1 << 20;
/// Longest run path an entry keeps, in bytes.
const MAX_RUN_BYTES: usize = 4096;

/// One allocated extent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtentEntry {
    /// What it belongs to (legendd: the run directory).
    pub run: String,
    /// The uid that owns it.
    pub owner: u32,
    /// Its first LBA.
    pub start_lba: u64,
    /// Its length in blocks.
    pub blocks: u64,
}

impl ExtentEntry {
    fn end(&self) -> u64 {
        self.start_lba + self.blocks
    }
}

/// The allocation table proper, with its limits: blocks `[first_lba, end_lba)` are for extents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtentTable {
    /// Allocated extents, by start LBA.
    entries: Vec<ExtentEntry>,
    /// First block after the table's own store.
    first_lba: u64,
    /// Blocks of the namespace.
    end_lba: u64,
    /// Bytes per block.
    block_size: u64,
}

impl ExtentTable {
    /// An empty table for blocks `[first_lba, end_lba)` of `block_size` bytes.
    pub fn new(first_lba: u64, end_lba: u64, block_size: u64) -> Self {
        ExtentTable {
            entries: Vec::new(),
            first_lba,
            end_lba,
            block_size,
        }
    }

    /// The allocated extents, by start LBA.
    pub fn entries(&self) -> &[ExtentEntry] {
        &self.entries
    }

    /// The extent of `run`.
    pub fn find(&self, run: &str) -> Option<&ExtentEntry> {
        self.entries.iter().find(|e| e.run == run)
    }

    /// Gives `run` (owned by `owner`) the first free range of at least `bytes` bytes, aligned
    /// to [`EXTENT_ALIGN`]; returns its first LBA.
    ///
    /// # Errors
    /// [`StoreError::InvalidSpec`] when `run` already has an extent or its name is unusable;
    /// [`StoreError::DeviceTooSmall`] when no free range is large enough.
    pub fn allocate(&mut self, run: &str, owner: u32, bytes: u64) -> Result<u64, StoreError> {
        if run.is_empty() || run.len() > MAX_RUN_BYTES {
            return Err(StoreError::InvalidSpec(format!(
                "an extent's owner name must have 1 to {MAX_RUN_BYTES} bytes, not {}",
                run.len()
            )));
        }
        if let Some(e) = self.find(run) {
            return Err(StoreError::InvalidSpec(format!(
                "{run} already has the extent at LBA {}",
                e.start_lba
            )));
        }
        let align = (EXTENT_ALIGN / self.block_size).max(1);
        let blocks = bytes.div_ceil(self.block_size).max(1);
        let mut cursor = self.first_lba.next_multiple_of(align);
        let mut largest = 0;
        let mut at = self.entries.len();
        for (i, e) in self.entries.iter().enumerate() {
            if e.start_lba >= cursor && e.start_lba - cursor >= blocks {
                at = i;
                break;
            }
            largest = largest.max(e.start_lba.saturating_sub(cursor));
            cursor = cursor.max(e.end().next_multiple_of(align));
        }
        if at == self.entries.len() {
            let tail = self.end_lba.saturating_sub(cursor);
            if tail < blocks {
                return Err(StoreError::DeviceTooSmall {
                    path: format!("extent table: the largest free range for {run}").into(),
                    needed: blocks * self.block_size,
                    available: largest.max(tail) * self.block_size,
                    limit: "free space",
                });
            }
        }
        self.entries.insert(
            at,
            ExtentEntry {
                run: run.to_owned(),
                owner,
                start_lba: cursor,
                blocks,
            },
        );
        Ok(cursor)
    }

    /// Frees the extent of `run`, returning it.
    pub fn free(&mut self, run: &str) -> Option<ExtentEntry> {
        let i = self.entries.iter().position(|e| e.run == run)?;
        Some(self.entries.remove(i))
    }

    /// The table as its store keeps it.
    fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.start_lba.to_le_bytes());
            out.extend_from_slice(&e.blocks.to_le_bytes());
            out.extend_from_slice(&e.owner.to_le_bytes());
            out.extend_from_slice(&(e.run.len() as u32).to_le_bytes());
            out.extend_from_slice(e.run.as_bytes());
        }
        out
    }

    /// Reads `bytes` back into a table over `[first_lba, end_lba)`, checking that its extents
    /// lie there, in order, without overlap.
    fn decode(
        bytes: &[u8],
        first_lba: u64,
        end_lba: u64,
        block_size: u64,
    ) -> Result<Self, BadTable> {
        let mut table = ExtentTable::new(first_lba, end_lba, block_size);
        if bytes.is_empty() {
            return Ok(table);
        }
        let mut rest = bytes.strip_prefix(&MAGIC[..]).ok_or(BadTable::Magic)?;
        let mut take = |n: usize| -> Result<&[u8], BadTable> {
            if rest.len() < n {
                return Err(BadTable::Truncated);
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let count = u32_at(take(4)?);
        let mut previous_end = first_lba;
        for i in 0..count {
            let start_lba = u64_at(take(8)?);
            let blocks = u64_at(take(8)?);
            let owner = u32_at(take(4)?);
            let len = u32_at(take(4)?) as usize;
            if len == 0 || len > MAX_RUN_BYTES {
                return Err(BadTable::NameLength { entry: i, len });
            }
            let run = String::from_utf8(take(len)?.to_vec())
                .map_err(|_| BadTable::NameNotUtf8 { entry: i })?;
            let end = start_lba
                .checked_add(blocks)
                .filter(|&end| blocks > 0 && start_lba >= previous_end && end <= end_lba)
                .ok_or_else(|| BadTable::Outside {
                    entry: i,
                    run: run.clone(),
                    start_lba,
                    blocks,
                    first_lba,
                    end_lba,
                })?;
            previous_end = end;
            table.entries.push(ExtentEntry {
                run,
                owner,
                start_lba,
                blocks,
            });
        }
        if !rest.is_empty() {
            return Err(BadTable::Trailing(rest.len()));
        }
        Ok(table)
    }
}

/// Why bytes are not an extent table.
#[derive(Debug, thiserror::Error)]
enum BadTable {
    #[error("not an extent table (wrong magic)")]
    Magic,
    #[error("truncated")]
    Truncated,
    #[error("entry {entry}: name of {len} bytes")]
    NameLength { entry: u32, len: usize },
    #[error("entry {entry}: name is not UTF-8")]
    NameNotUtf8 { entry: u32 },
    #[error(
        "entry {entry} ({run}): blocks {start_lba}+{blocks} overlap another or leave \
         [{first_lba}, {end_lba})"
    )]
    Outside {
        entry: u32,
        run: String,
        start_lba: u64,
        blocks: u64,
        first_lba: u64,
        end_lba: u64,
    },
    #[error("{0} bytes after the last entry")]
    Trailing(usize),
}

/// The table on its namespace: read at open, written back (committed) by every change.
pub struct Extents {
    store: Store,
    table: ExtentTable,
}

impl Extents {
    /// Opens the table at the start of `target` (whose start LBA must be 0), creating an empty
    /// one on a blank namespace.
    ///
    /// # Errors
    /// The namespace's start holds a training store or another signature
    /// ([`StoreError::DatasetMismatch`], [`StoreError::ForeignSignature`]); a corrupt table
    /// ([`StoreError::InvalidSpec`]); I/O errors.
    pub fn open_or_create(target: &Target<'_>) -> Result<Self, StoreError> {
        let id = DatasetId {
            id: TABLE_DATASET,
            label: "legendd extent table".into(),
        };
        let expect = Expect {
            dataset: Some(id.clone()),
            ..Expect::default()
        };
        let io = IoConfig::default();
        let store = match Store::open_on(target, &expect, &io) {
            Ok(store) => store,
            Err(StoreError::WrongMagic { found: None, .. }) => {
                let spec = StoreSpec {
                    dataset: id,
                    num_nodes: 1,
                    dim: 1,
                    dtype: crate::Dtype::F32,
                    state_width: 1,
                    num_partitions: 1,
                    aux_bytes: 0,
                    progress_capacity: TABLE_CAPACITY,
                    shadow: true,
                };
                let mut store = Store::create_on(target, &spec, &CreateOptions::default())?;
                store.commit(&[])?;
                store
            }
            Err(e) => return Err(e),
        };
        let block_size = store.block_size();
        let first_lba = store.layout().total_bytes.div_ceil(block_size);
        let end_lba = store.medium_bytes()? / block_size;
        let table = ExtentTable::decode(store.progress(), first_lba, end_lba, block_size).map_err(
            |why| {
                StoreError::InvalidSpec(format!("{}: extent table: {why}", store.path().display()))
            },
        )?;
        Ok(Extents { store, table })
    }

    /// The table.
    pub fn table(&self) -> &ExtentTable {
        &self.table
    }

    /// Bytes per block of the namespace.
    pub fn block_size(&self) -> u64 {
        self.table.block_size
    }

    /// [`ExtentTable::allocate`], committed before it returns.
    ///
    /// # Errors
    /// As [`ExtentTable::allocate`], and I/O errors (the table is then unchanged).
    pub fn allocate(&mut self, run: &str, owner: u32, bytes: u64) -> Result<u64, StoreError> {
        let mut next = self.table.clone();
        let lba = next.allocate(run, owner, bytes)?;
        self.commit(next)?;
        Ok(lba)
    }

    /// [`ExtentTable::free`], committed before it returns.
    ///
    /// # Errors
    /// I/O errors (the table is then unchanged).
    pub fn free(&mut self, run: &str) -> Result<Option<ExtentEntry>, StoreError> {
        let mut next = self.table.clone();
        let freed = next.free(run);
        if freed.is_some() {
            self.commit(next)?;
        }
        Ok(freed)
    }

    fn commit(&mut self, next: ExtentTable) -> Result<(), StoreError> {
        let bytes = next.encode();
        if bytes.len() > TABLE_CAPACITY as usize {
            return Err(StoreError::InvalidSpec(format!(
                "{}: the extent table is full ({} entries)",
                self.store.path().display(),
                self.table.entries.len()
            )));
        }
        self.store.commit(&bytes)?;
        self.table = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn extents_are_aligned_disjoint_first_fit_and_freed() {
        // 512-byte blocks; the table's store takes the first 3 MiB; 64 MiB in all.
        let mut t = ExtentTable::new(3 * 2048 - 7, 64 * 2048, 512);
        let a = t.allocate("/runs/a", 1000, 10 * MIB).unwrap();
        let b = t.allocate("/runs/b", 1001, MIB + 1).unwrap();
        let c = t.allocate("/runs/c", 1000, 5 * MIB).unwrap();
        assert_eq!(a, 3 * 2048, "the first aligned block after the table");
        assert_eq!(b, a + 10 * 2048);
        assert_eq!(
            c,
            b + 2 * 2048,
            "b's 1 MiB + 1 byte rounds up to 2 MiB of alignment"
        );
        assert!(
            t.allocate("/runs/a", 1000, MIB).is_err(),
            "one extent per run"
        );
        assert_eq!(t.free("/runs/b").unwrap().start_lba, b);
        // First fit: a small extent takes b's hole, a large one goes after c.
        assert_eq!(t.allocate("/runs/d", 7, MIB).unwrap(), b);
        assert_eq!(t.allocate("/runs/e", 7, 20 * MIB).unwrap(), c + 5 * 2048);
        let too_big = t.allocate("/runs/f", 7, 64 * MIB).unwrap_err();
        assert!(
            matches!(too_big, StoreError::DeviceTooSmall { .. }),
            "{too_big}"
        );
        let ends: Vec<(u64, u64)> = t.entries().iter().map(|e| (e.start_lba, e.end())).collect();
        assert!(ends.windows(2).all(|w| w[0].1 <= w[1].0), "{ends:?}");
        assert!(ends.iter().all(|&(s, e)| s >= 3 * 2048 && e <= 64 * 2048));
    }

    #[test]
    fn the_encoding_round_trips_and_corruption_is_refused() {
        let mut t = ExtentTable::new(2048, 1 << 20, 4096);
        t.allocate("/home/ann/runs/r1", 1000, 100 * MIB).unwrap();
        t.allocate("/home/bob/runs/ünïcode", 1001, 3).unwrap();
        let bytes = t.encode();
        assert_eq!(ExtentTable::decode(&bytes, 2048, 1 << 20, 4096).unwrap(), t);
        assert_eq!(
            ExtentTable::decode(&[], 2048, 1 << 20, 4096)
                .unwrap()
                .entries(),
            &[]
        );
        for cut in [1, 9, 20, bytes.len() - 1] {
            assert!(ExtentTable::decode(&bytes[..cut], 2048, 1 << 20, 4096).is_err());
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ExtentTable::decode(&longer, 2048, 1 << 20, 4096).is_err());
        // An extent past the namespace's end (a smaller device) is refused, not trusted.
        let small = ExtentTable::decode(&bytes, 2048, 4096, 4096)
            .unwrap_err()
            .to_string();
        assert!(small.contains("/home/ann/runs/r1"), "{small}");
    }
}
