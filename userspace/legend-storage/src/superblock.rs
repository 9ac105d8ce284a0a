//! Encoding and decoding of the superblock (see `Documentation/store-format.md`).

use legend_model::Dtype;

use crate::layout::{DatasetId, Extent, Layout, MAX_LABEL_BYTES, SUPERBLOCK_SLOT_BYTES, StoreSpec};

/// First 8 bytes of every superblock copy.
pub(crate) const MAGIC: [u8; 8] = *b"LGNDSTOR";
/// The newest format version this build writes. Version 3 added 16-bit embeddings (the dtype
/// at offset 124 may be bf16 or f16) and striping over several members (bytes 224..256); version 2 added the optimizer state's width (offset
/// 192); version 1, whose state always had the embedding's shape, is still read. A store is
/// written at the oldest version that can describe it ([`version_for`]), so an f32 store
/// stays readable by builds from before 16-bit rows, and a 16-bit one is refused by them as a
/// newer version rather than as damaged.
pub(crate) const FORMAT_VERSION: u32 = 3;
/// The oldest format version this build reads.
pub(crate) const OLDEST_VERSION: u32 = 1;
/// The embeddings' number format at offset 124: 1 = f32 (every store before 16-bit rows), 2 =
/// bf16, 3 = f16.
fn dtype_code(dtype: Dtype) -> u32 {
    match dtype {
        Dtype::F32 => 1,
        Dtype::Bf16 => 2,
        Dtype::F16 => 3,
    }
}

/// The oldest version that describes a store: 3 for 16-bit embeddings or several members
/// (a build that predates them would misread the rows, or take one member for the store).
fn version_for(spec: &StoreSpec, membership: &Membership) -> u32 {
    if spec.dtype.is_narrow() || membership.count > 1 {
        3
    } else {
        2
    }
}

fn dtype_of(code: u32) -> Option<Dtype> {
    Dtype::ALL.into_iter().find(|&d| dtype_code(d) == code)
}
const FLAG_SHADOW: u32 = 1;
const HEADER_BYTES: usize = 256;
const ENTRY_BYTES: usize = 48;
const CHECKSUM_AT: usize = 12;
/// Region state bits.
const STATE_INITIALIZED: u32 = 1;
const STATE_COPY1: u32 = 2;

/// Commit state of one region: whether it was ever committed, and which of
/// its two copies holds the committed bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RegionState {
    pub(crate) initialized: bool,
    pub(crate) copy: u8,
}

impl RegionState {
    fn bits(self) -> u32 {
        u32::from(self.initialized) * STATE_INITIALIZED + u32::from(self.copy) * STATE_COPY1
    }

    fn from_bits(bits: u32) -> Option<Self> {
        (bits & !(STATE_INITIALIZED | STATE_COPY1) == 0).then_some(Self {
            initialized: bits & STATE_INITIALIZED != 0,
            copy: u8::from(bits & STATE_COPY1 != 0),
        })
    }
}

// ---- Members of a striped store (bytes 224..256 of the header) ----
// Kept apart from the fields above (the row encoding, the state layout) so that each concern
// changes its own bytes. A store written before striping has zeros here: one member.

/// Where the member fields start.
const MEMBERS_AT: usize = 224;
/// Most members a store may be striped over.
pub(crate) const MAX_MEMBERS: u32 = 64;
/// Where the store id starts.
const STORE_ID_AT: usize = MEMBERS_AT + 16;

/// Whether `head` (a target's first bytes, both superblock slots) is the store `store_id`
/// as its creation left it: a slot carries the magic, every slot that does carries that id,
/// and none holds a valid commit after generation 0 (a creation interrupted after it wrote
/// generation 0, or while it wrote it, leaves exactly that). Its creator, which keeps the id in
/// its own record, may make it again; a store that was ever committed is nobody's to remake.
/// An id of zeros (stores written before striping) is nobody's.
pub(crate) fn is_creation_of(head: &[u8], store_id: [u8; 16]) -> bool {
    let slot_len = SUPERBLOCK_SLOT_BYTES as usize;
    let slots: Vec<&[u8]> = [0, slot_len]
        .iter()
        .filter_map(|&at| head.get(at..(at + slot_len).min(head.len())))
        .filter(|slot| slot.len() >= HEADER_BYTES && slot[..MAGIC.len()] == MAGIC)
        .collect();
    store_id != [0; 16]
        && !slots.is_empty()
        && slots.iter().all(|slot| {
            slot[STORE_ID_AT..STORE_ID_AT + 16] == store_id
                && Superblock::decode(slot).map_or(true, |sb| sb.generation == 0)
        })
}

/// Which member of which store a superblock copy belongs to (`Documentation/store-format.md`,
/// "Striping over several devices").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Membership {
    /// Random identity chosen when the store was created; the same on every member.
    pub(crate) store_id: [u8; 16],
    /// This member's place in the stripe, from 0.
    pub(crate) index: u32,
    /// Members the store is striped over.
    pub(crate) count: u32,
    /// Bytes of one stripe unit (0 for a store of one member).
    pub(crate) stripe_bytes: u64,
}

impl Membership {
    fn encode(&self, w: &mut Writer) {
        w.u32(MEMBERS_AT, self.index);
        w.u32(MEMBERS_AT + 4, self.count);
        w.u64(MEMBERS_AT + 8, self.stripe_bytes);
        w.put(STORE_ID_AT, &self.store_id);
    }

    fn decode(r: &Reader<'_>, align: u64) -> Result<Self, SlotError> {
        let m = Membership {
            index: r.u32(MEMBERS_AT),
            // Zero: written before striping existed, a store of one member.
            count: r.u32(MEMBERS_AT + 4).max(1),
            stripe_bytes: r.u64(MEMBERS_AT + 8),
            store_id: r.0[STORE_ID_AT..STORE_ID_AT + 16]
                .try_into()
                .expect("16 bytes"),
        };
        let unit_ok = if m.count == 1 {
            m.stripe_bytes == 0
        } else {
            m.stripe_bytes > 0 && m.stripe_bytes.is_multiple_of(align)
        };
        if m.index >= m.count || m.count > MAX_MEMBERS || !unit_ok {
            return Err(SlotError::Corrupt(format!(
                "member {} of {} with stripe unit {} bytes",
                m.index, m.count, m.stripe_bytes
            )));
        }
        Ok(m)
    }
}
// ---- end of the member fields ----

/// Decoded contents of one superblock copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Superblock {
    pub(crate) generation: u64,
    pub(crate) membership: Membership,
    pub(crate) spec: StoreSpec,
    pub(crate) layout: Layout,
    pub(crate) aux_state: RegionState,
    pub(crate) partition_states: Vec<RegionState>,
    pub(crate) progress: Vec<u8>,
}

/// Why a superblock copy was rejected.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SlotError {
    NoMagic,
    Version(u32),
    Corrupt(String),
}

struct Writer(Vec<u8>);

impl Writer {
    fn put(&mut self, at: usize, bytes: &[u8]) {
        self.0[at..at + bytes.len()].copy_from_slice(bytes);
    }
    fn u32(&mut self, at: usize, v: u32) {
        self.put(at, &v.to_le_bytes());
    }
    fn u64(&mut self, at: usize, v: u64) {
        self.put(at, &v.to_le_bytes());
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.0[at..at + 4].try_into().expect("4 bytes"))
    }
    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().expect("8 bytes"))
    }
}

/// Encoded length of a superblock with `partitions` entries and a progress
/// blob of `progress` bytes.
fn encoded_len(partitions: usize, progress: usize) -> usize {
    HEADER_BYTES + ENTRY_BYTES * partitions + progress
}

impl Superblock {
    /// Serialises the superblock, checksum included. The result is at most
    /// [`SUPERBLOCK_SLOT_BYTES`] long (guaranteed by the spec limits).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let s = &self.spec;
        let l = &self.layout;
        let len = encoded_len(l.partitions.len(), self.progress.len());
        debug_assert!(len as u64 <= SUPERBLOCK_SLOT_BYTES);
        let mut w = Writer(vec![0; len]);
        w.put(0, &MAGIC);
        w.u32(8, version_for(s, &self.membership));
        w.u32(16, len as u32);
        w.u32(20, if s.shadow { FLAG_SHADOW } else { 0 });
        w.u64(24, self.generation);
        w.put(32, &s.dataset.id);
        w.put(48, s.dataset.label.as_bytes());
        w.u64(112, s.num_nodes);
        w.u32(120, s.dim);
        w.u32(124, dtype_code(s.dtype));
        w.u32(128, s.num_partitions);
        w.u32(132, s.progress_capacity);
        w.u32(136, self.progress.len() as u32);
        w.u32(140, self.aux_state.bits());
        w.u64(
            144,
            legend_model::partition::rows_per_partition(s.num_nodes, s.num_partitions),
        );
        w.u64(152, l.align);
        w.u64(160, l.total_bytes);
        w.u64(168, s.aux_bytes);
        let aux = l.aux.as_ref().map_or([0, 0], |e| e.offsets);
        w.u64(176, aux[0]);
        w.u64(184, aux[1]);
        w.u32(192, s.state_width);
        self.membership.encode(&mut w);
        for (i, (e, st)) in l.partitions.iter().zip(&self.partition_states).enumerate() {
            let at = HEADER_BYTES + i * ENTRY_BYTES;
            w.u64(at, e.offsets[0]);
            w.u64(at + 8, e.offsets[1]);
            w.u64(at + 16, e.first_node);
            w.u64(at + 24, e.rows);
            w.u64(at + 32, e.bytes);
            w.u32(at + 40, st.bits());
        }
        w.put(len - self.progress.len(), &self.progress);
        let crc = crc32c::crc32c(&w.0);
        w.u32(CHECKSUM_AT, crc);
        w.0
    }

    /// Parses and verifies one superblock copy (`slot` holds the whole slot
    /// or as much of it as the file has).
    pub(crate) fn decode(slot: &[u8]) -> Result<Self, SlotError> {
        if slot.len() < HEADER_BYTES || slot[..8] != MAGIC {
            return Err(SlotError::NoMagic);
        }
        let r = Reader(slot);
        let version = r.u32(8);
        if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(SlotError::Version(version));
        }
        let bad = |m: String| Err(SlotError::Corrupt(m));
        let len = r.u32(16) as usize;
        if len < HEADER_BYTES || len > slot.len() {
            return bad(format!("recorded length {len} out of range"));
        }
        let mut copy = slot[..len].to_vec();
        copy[CHECKSUM_AT..CHECKSUM_AT + 4].fill(0);
        let (stored, computed) = (r.u32(CHECKSUM_AT), crc32c::crc32c(&copy));
        if stored != computed {
            return bad(format!("checksum {stored:08x} != computed {computed:08x}"));
        }
        // From here on the bytes are what a writer produced; inconsistencies
        // mean a bug or a deliberate edit, still reported rather than trusted.
        let flags = r.u32(20);
        let label_bytes = &slot[48..48 + MAX_LABEL_BYTES];
        let label_end = label_bytes
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(MAX_LABEL_BYTES);
        let Ok(label) = std::str::from_utf8(&label_bytes[..label_end]) else {
            return bad("dataset label is not UTF-8".into());
        };
        let Some(dtype) = dtype_of(r.u32(124)) else {
            return bad(format!("unknown dtype {}", r.u32(124)));
        };
        let num_partitions = r.u32(128);
        let progress_len = r.u32(136) as usize;
        if flags & !FLAG_SHADOW != 0 || encoded_len(num_partitions as usize, progress_len) != len {
            return bad("header fields disagree with the recorded length".into());
        }
        let spec = StoreSpec {
            dataset: DatasetId {
                id: slot[32..48].try_into().expect("16 bytes"),
                label: label.into(),
            },
            num_nodes: r.u64(112),
            dim: r.u32(120),
            dtype,
            state_width: if version == 1 { r.u32(120) } else { r.u32(192) },
            num_partitions,
            aux_bytes: r.u64(168),
            progress_capacity: r.u32(132),
            shadow: flags & FLAG_SHADOW != 0,
        };
        if progress_len > spec.progress_capacity as usize {
            return bad("progress blob larger than its capacity".into());
        }
        let layout = Layout::compute(&spec, r.u64(152))
            .map_err(|e| SlotError::Corrupt(format!("unusable parameters: {e}")))?;
        let state = |bits| {
            RegionState::from_bits(bits)
                .ok_or(SlotError::Corrupt(format!("bad region state {bits:#x}")))
        };
        let aux_state = state(r.u32(140))?;
        let aux = layout.aux.as_ref().map_or([0, 0], |e| e.offsets);
        if layout.align != r.u64(152)
            || layout.total_bytes != r.u64(160)
            || aux != [r.u64(176), r.u64(184)]
        {
            return bad("recorded layout differs from the one its parameters give".into());
        }
        let membership = Membership::decode(&r, layout.align)?;
        let mut partition_states = Vec::with_capacity(num_partitions as usize);
        for (i, e) in layout.partitions.iter().enumerate() {
            let at = HEADER_BYTES + i * ENTRY_BYTES;
            let stored = Extent {
                offsets: [r.u64(at), r.u64(at + 8)],
                first_node: r.u64(at + 16),
                rows: r.u64(at + 24),
                bytes: r.u64(at + 32),
            };
            if &stored != e {
                return bad(format!(
                    "extent of partition {i} differs from the computed layout"
                ));
            }
            partition_states.push(state(r.u32(at + 40))?);
        }
        Ok(Self {
            generation: r.u64(24),
            membership,
            spec,
            layout,
            aux_state,
            partition_states,
            progress: slot[len - progress_len..len].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        let spec = StoreSpec {
            dataset: DatasetId {
                id: [3; 16],
                label: "fb15k".into(),
            },
            num_nodes: 14_951,
            dim: 100,
            dtype: Dtype::F32,
            state_width: 1,
            num_partitions: 5,
            aux_bytes: 10_000,
            progress_capacity: 64,
            shadow: true,
        };
        let layout = Layout::compute(&spec, 4096).unwrap();
        Superblock {
            generation: 9,
            membership: Membership {
                store_id: [5; 16],
                index: 1,
                count: 2,
                stripe_bytes: 1 << 20,
            },
            spec,
            layout,
            aux_state: RegionState {
                initialized: true,
                copy: 1,
            },
            partition_states: vec![
                RegionState::default(),
                RegionState {
                    initialized: true,
                    copy: 1,
                },
                RegionState::default(),
                RegionState::default(),
                RegionState {
                    initialized: true,
                    copy: 0,
                },
            ],
            progress: b"epoch=3".to_vec(),
        }
    }

    #[test]
    fn round_trip() {
        let sb = sample();
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        let bytes = sample().encode();
        for i in (0..bytes.len()).step_by(7) {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(Superblock::decode(&b).is_err(), "flip at byte {i} accepted");
        }
    }

    #[test]
    fn a_version_1_superblock_reads_with_element_wise_state() {
        let mut sb = sample();
        sb.spec.state_width = sb.spec.dim;
        sb.layout = Layout::compute(&sb.spec, sb.layout.align).unwrap();
        let mut bytes = sb.encode();
        // What version 1 wrote: no state width (zeros at 192).
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        bytes[192..196].fill(0);
        bytes[CHECKSUM_AT..CHECKSUM_AT + 4].fill(0);
        let crc = crc32c::crc32c(&bytes);
        bytes[CHECKSUM_AT..CHECKSUM_AT + 4].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
        // Version 2 with the same bytes is a store with no state: refused.
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        bytes[CHECKSUM_AT..CHECKSUM_AT + 4].fill(0);
        let crc = crc32c::crc32c(&bytes);
        bytes[CHECKSUM_AT..CHECKSUM_AT + 4].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            Superblock::decode(&bytes),
            Err(SlotError::Corrupt(_))
        ));
    }

    /// Recomputes the checksum of hand-edited bytes.
    fn reseal(bytes: &mut [u8]) {
        bytes[CHECKSUM_AT..CHECKSUM_AT + 4].fill(0);
        let crc = crc32c::crc32c(bytes);
        bytes[CHECKSUM_AT..CHECKSUM_AT + 4].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn a_superblock_from_before_striping_is_a_store_of_one_member() {
        let mut sb = sample();
        let mut bytes = sb.encode();
        bytes[MEMBERS_AT..MEMBERS_AT + 32].fill(0);
        reseal(&mut bytes);
        sb.membership = Membership {
            store_id: [0; 16],
            index: 0,
            count: 1,
            stripe_bytes: 0,
        };
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
    }

    #[test]
    fn a_creation_is_known_by_its_id_in_every_slot_with_the_magic_and_no_commit() {
        let slot = SUPERBLOCK_SLOT_BYTES as usize;
        let mut head = vec![0u8; 2 * slot];
        assert!(!is_creation_of(&head, [5; 16]), "nothing there");
        let mut sb = sample();
        sb.generation = 0;
        let copy = sb.encode();
        head[..copy.len()].copy_from_slice(&copy);
        assert!(is_creation_of(&head, [5; 16]));
        assert!(!is_creation_of(&head, [6; 16]), "another store's id");
        // A torn copy (no valid checksum) still carries its id.
        head[100] ^= 1;
        assert!(is_creation_of(&head, [5; 16]));
        // A commit after generation 0: a store that lived.
        let mut committed = sb.clone();
        committed.generation = 1;
        let committed = committed.encode();
        head[slot..slot + committed.len()].copy_from_slice(&committed);
        assert!(!is_creation_of(&head, [5; 16]));
        // Slot 1 of another store: not ours either.
        let mut other = sb.clone();
        other.membership.store_id = [6; 16];
        let other = other.encode();
        head[slot..slot + other.len()].copy_from_slice(&other);
        assert!(!is_creation_of(&head, [5; 16]));
        // Ids of zeros (written before striping) are nobody's.
        sb.membership.store_id = [0; 16];
        let old = sb.encode();
        let mut head = vec![0u8; 2 * slot];
        head[..old.len()].copy_from_slice(&old);
        assert!(!is_creation_of(&head, [0; 16]));
    }

    #[test]
    fn a_member_index_past_the_count_or_an_unaligned_stripe_is_refused() {
        for (index, count, stripe_bytes) in
            [(2, 2, 1 << 20), (0, 2, 0), (0, 2, 1000), (0, 65, 1 << 20)]
        {
            let mut sb = sample();
            sb.membership.index = index;
            sb.membership.count = count;
            sb.membership.stripe_bytes = stripe_bytes;
            let mut bytes = sb.encode();
            reseal(&mut bytes);
            assert!(
                matches!(Superblock::decode(&bytes), Err(SlotError::Corrupt(_))),
                "member {index} of {count}, unit {stripe_bytes}"
            );
        }
    }

    #[test]
    fn row_wise_state_takes_4_bytes_a_row() {
        let sb = sample();
        let rows = sb.layout.partitions[0].rows;
        assert_eq!(sb.layout.partitions[0].bytes, rows * (100 + 1) * 4);
    }
}
