//! Creating a store on its members and opening one: the checks of the targets, the members'
//! agreement on the commit to open at, and what the caller expects.

use std::path::Path;

use legend_model::Dtype;

use super::{Store, Tracked};
use crate::error::StoreError;
use crate::io::IoConfig;
use crate::layout::{DatasetId, Layout, SUPERBLOCK_SLOT_BYTES, StoreSpec};
use crate::medium::{Medium, Target};
use crate::signature;
use crate::stripe::Stripe;
use crate::superblock::{
    FORMAT_VERSION, MAX_MEMBERS, Membership, RegionState, SlotError, Superblock,
};

/// Default stripe unit of a store over several members: large enough that one NVMe command
/// (at most 1 MiB here) or one `io_uring` request never spans two members.
pub const DEFAULT_STRIPE_BYTES: u64 = 1 << 20;

/// Options of [`Store::create`].
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// I/O tuning.
    pub io: IoConfig,
    /// Overwrite a target that carries a file-system, partition-table or
    /// store signature.
    pub force: bool,
    /// Refuse layouts larger than this many bytes on a member (a cap on the file's size).
    pub max_bytes: Option<u64>,
    /// A store over several members ([`Store::create_striped`]): bytes of one stripe unit, a
    /// multiple of the store's alignment (64 KiB, or the block size when larger).
    pub stripe_bytes: u64,
    /// The new store's identity ([`new_store_id`] when `None`). A caller that records it
    /// before creating (an intent record) can create again after a crash: a target that
    /// already is a copy of this store (every superblock copy on it carries this identity) is
    /// its own creation interrupted (never committed), and is made again without `force`. Any
    /// other signature, another store's or a committed one's included, is still refused.
    pub store_id: Option<[u8; 16]>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            io: IoConfig::default(),
            force: false,
            max_bytes: None,
            stripe_bytes: DEFAULT_STRIPE_BYTES,
            store_id: None,
        }
    }
}

/// What the caller expects of a store it opens; `None` accepts anything.
#[derive(Clone, Debug, Default)]
pub struct Expect {
    /// The dataset the store must belong to.
    pub dataset: Option<DatasetId>,
    /// The embedding dimension.
    pub dim: Option<u32>,
    /// Optimizer accumulators per row.
    pub state_width: Option<u32>,
    /// The embeddings' number format.
    pub dtype: Option<Dtype>,
    /// The number of partitions.
    pub num_partitions: Option<u32>,
    /// The store's identity ([`Store::store_id`]): what its creator recorded, so that another
    /// store put in its place is refused.
    pub store_id: Option<[u8; 16]>,
}

impl Store {
    /// Creates a store for `spec` at `path` (a regular file, created if
    /// missing, or a block device). Refuses targets carrying a foreign
    /// signature unless `opts.force`, and targets too small for the layout.
    /// The new store is at generation 0 with every region uninitialised.
    pub fn create(path: &Path, spec: &StoreSpec, opts: &CreateOptions) -> Result<Self, StoreError> {
        Self::create_on(&Target::Path(path), spec, opts)
    }

    /// Creates a store for `spec` on `target`, as [`Store::create`] does for a path.
    pub fn create_on(
        target: &Target<'_>,
        spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<Self, StoreError> {
        Self::create_striped(std::slice::from_ref(target), spec, opts)
    }

    /// Creates a store for `spec` striped over `members` in units of `opts.stripe_bytes`
    /// (one member: a plain store, as [`Store::create_on`]). Every member is checked as
    /// [`Store::create`] checks its target and gets its own superblock copies; files created
    /// here are removed again when creation fails.
    pub fn create_striped(
        members: &[Target<'_>],
        spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<Self, StoreError> {
        let new_files: Vec<bool> = members
            .iter()
            .map(|target| match target {
                Target::Path(path) => !path.exists(),
                Target::In { dir, name } => !dir.exists(name).unwrap_or(true),
                Target::Nvme(_) => false,
            })
            .collect();
        let res = Self::create_in(members, spec, opts);
        if res.is_err() {
            // Leave no half-made file behind; the error is what matters.
            for (target, _) in members.iter().zip(new_files).filter(|(_, new)| *new) {
                let _ = match target {
                    Target::Path(path) => std::fs::remove_file(path),
                    Target::In { dir, name } => dir.remove_file(name),
                    Target::Nvme(_) => Ok(()),
                };
            }
        }
        res
    }

    fn create_in(
        targets: &[Target<'_>],
        spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<Self, StoreError> {
        let count = member_count(targets.len())?;
        let mut members = targets
            .iter()
            .map(|t| Medium::open(t, true, &opts.io))
            .collect::<Result<Vec<_>, _>>()?;
        let block_size = members.iter().map(Medium::block_size).max().unwrap_or(1);
        let layout = Layout::compute(spec, block_size)?;
        let stripe = if count == 1 {
            Stripe::single()
        } else if opts.stripe_bytes == 0 || !opts.stripe_bytes.is_multiple_of(layout.align) {
            return Err(StoreError::InvalidSpec(format!(
                "stripe unit of {} bytes: must be a positive multiple of {} (the store's alignment)",
                opts.stripe_bytes, layout.align
            )));
        } else {
            Stripe::new(count, opts.stripe_bytes)
        };
        let needed = stripe.member_bytes(layout.total_bytes);
        for medium in &mut members {
            let path = medium.path().to_owned();
            if let Some(cap) = opts.max_bytes.filter(|&cap| needed > cap) {
                return Err(StoreError::DeviceTooSmall {
                    path,
                    needed,
                    available: cap,
                    limit: "size cap",
                });
            }
            let size = medium.size()?;
            if size > 0 && !opts.force {
                let head = medium.read_at(0, signature::HEAD_BYTES)?;
                if let Some((signature, offset)) =
                    signature::foreign_signature(&head, opts.store_id)
                {
                    return Err(StoreError::ForeignSignature {
                        path,
                        signature,
                        offset,
                    });
                }
            }
            medium.reserve(needed)?;
        }
        for medium in &mut members {
            // Wipe both slots before writing generation 0, so a stale copy from
            // an older store (overwritten with force) can never win at open.
            medium.write_at(0, &vec![0; 2 * SUPERBLOCK_SLOT_BYTES as usize])?;
            medium.sync()?;
        }
        let n = spec.num_partitions as usize;
        let fresh = Superblock {
            generation: 0,
            membership: Membership {
                store_id: opts.store_id.unwrap_or_else(new_store_id),
                index: 0,
                count,
                stripe_bytes: if count == 1 { 0 } else { opts.stripe_bytes },
            },
            spec: spec.clone(),
            layout,
            aux_state: RegionState::default(),
            partition_states: vec![RegionState::default(); n],
            progress: Vec::new(),
        };
        let mut store = Self::assemble(members, fresh);
        store.write_superblock(0)?;
        tracing::info!(store = %store.label.display(), bytes = needed, members = count, direct = store.is_direct(), "created store");
        Ok(store)
    }

    /// Opens an existing store, picking the valid superblock copy with the
    /// highest generation, and checks it against `expect`.
    pub fn open(path: &Path, expect: &Expect, io: &IoConfig) -> Result<Self, StoreError> {
        Self::open_on(&Target::Path(path), expect, io)
    }

    /// Opens an existing store on `target`, as [`Store::open`] does for a path.
    pub fn open_on(
        target: &Target<'_>,
        expect: &Expect,
        io: &IoConfig,
    ) -> Result<Self, StoreError> {
        Self::open_striped(std::slice::from_ref(target), expect, io)
    }

    /// Opens a store over `members`, given in the order they were created (one member: as
    /// [`Store::open_on`]). Every member must belong to the same store, in the place it is
    /// given; a missing, extra, foreign or misplaced member is refused by its path. The store
    /// opens at the highest generation every member holds: a commit that reached only some
    /// members (a crash between their superblock writes) is rolled back on them here, before
    /// anything else is written.
    pub fn open_striped(
        targets: &[Target<'_>],
        expect: &Expect,
        io: &IoConfig,
    ) -> Result<Self, StoreError> {
        let count = member_count(targets.len())?;
        let mut members = Vec::with_capacity(targets.len());
        let mut copies = Vec::with_capacity(targets.len());
        for (i, target) in targets.iter().enumerate() {
            let mut medium = Medium::open(target, false, io).map_err(|e| match e {
                StoreError::Io { path, source, .. }
                    if count > 1 && source.kind() == std::io::ErrorKind::NotFound =>
                {
                    StoreError::Member {
                        path,
                        why: format!("member {} of the store's {count} is missing", i + 1),
                    }
                }
                e => e,
            })?;
            copies.push(valid_copies(&mut medium)?);
            members.push(medium);
        }
        let sb = agree(&mut members, copies)?;
        let path = members[0].path().to_owned();
        let path = path.as_path();
        if let Some(want) = &expect.dataset
            && want.id != sb.spec.dataset.id
        {
            return Err(StoreError::DatasetMismatch {
                path: path.to_owned(),
                found: sb.spec.dataset.to_string(),
                expected: want.to_string(),
            });
        }
        if let Some(want) = expect.dim.filter(|&d| d != sb.spec.dim) {
            return Err(StoreError::DimMismatch {
                path: path.to_owned(),
                found: sb.spec.dim,
                expected: want,
            });
        }
        if let Some(want) = expect.state_width.filter(|&w| w != sb.spec.state_width) {
            return Err(StoreError::StateMismatch {
                path: path.to_owned(),
                found: sb.spec.state_width,
                expected: want,
            });
        }
        if let Some(want) = expect.dtype.filter(|&d| d != sb.spec.dtype) {
            return Err(StoreError::DtypeMismatch {
                path: path.to_owned(),
                found: sb.spec.dtype,
                expected: want,
            });
        }
        if let Some(want) = expect
            .num_partitions
            .filter(|&n| n != sb.spec.num_partitions)
        {
            return Err(StoreError::PartitionCountMismatch {
                path: path.to_owned(),
                found: sb.spec.num_partitions,
                expected: want,
            });
        }
        if let Some(want) = expect.store_id.filter(|&id| id != sb.membership.store_id) {
            return Err(StoreError::OtherStore {
                path: path.to_owned(),
                found: store_id_hex(sb.membership.store_id),
                expected: store_id_hex(want),
            });
        }
        let needed = stripe_of(&sb.membership).member_bytes(sb.layout.total_bytes);
        for medium in &members {
            let actual = medium.size()?;
            if actual < needed {
                return Err(StoreError::Truncated {
                    path: medium.path().to_owned(),
                    needed,
                    actual,
                });
            }
            if sb.layout.align % medium.block_size() != 0 {
                return Err(StoreError::InvalidSpec(format!(
                    "{}: store aligned to {} bytes cannot be used on a device with {}-byte blocks",
                    medium.path().display(),
                    sb.layout.align,
                    medium.block_size()
                )));
            }
        }
        let store = Self::assemble(members, sb);
        tracing::info!(store = %store.label.display(), generation = store.generation, direct = store.is_direct(), "opened store");
        Ok(store)
    }

    fn assemble(members: Vec<Medium>, sb: Superblock) -> Self {
        let track = |committed| Tracked {
            committed,
            dirty: false,
        };
        let label = members
            .iter()
            .map(|m| m.path().display().to_string())
            .collect::<Vec<_>>()
            .join(" + ");
        Self {
            block_size: members.iter().map(Medium::block_size).max().unwrap_or(1),
            members,
            stripe: stripe_of(&sb.membership),
            store_id: sb.membership.store_id,
            label: label.into(),
            spec: sb.spec,
            layout: sb.layout,
            generation: sb.generation,
            progress: sb.progress,
            aux: track(sb.aux_state),
            partitions: sb.partition_states.into_iter().map(track).collect(),
        }
    }
}

/// Checks the number of members a store is given.
fn member_count(given: usize) -> Result<u32, StoreError> {
    match u32::try_from(given) {
        Ok(n @ 1..=MAX_MEMBERS) => Ok(n),
        _ => Err(StoreError::InvalidSpec(format!(
            "a store has 1 to {MAX_MEMBERS} members, not {given}"
        ))),
    }
}

/// The striping a superblock records.
fn stripe_of(m: &Membership) -> Stripe {
    if m.count == 1 {
        Stripe::single()
    } else {
        Stripe::new(m.count, m.stripe_bytes)
    }
}

/// A store identity in messages: 32 hex digits, as records keep it.
pub fn store_id_hex(id: [u8; 16]) -> String {
    format!("{:032x}", u128::from_le_bytes(id))
}

/// A new store's identity: 16 random bytes from the kernel. A caller chooses it before
/// creating ([`CreateOptions::store_id`]) when it records it first.
pub fn new_store_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    // SAFETY: writes at most 16 bytes into `id`.
    let n = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if n != 16 {
        // Never seen on Linux ≥ 3.17; the identity then still differs between stores made at
        // different times or by different processes.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        id[..8].copy_from_slice(&(t.as_nanos() as u64).to_le_bytes());
        id[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    id
}

/// The valid superblock copies of a member, newest first; when it has none, the error that
/// says why (as for a plain store).
fn valid_copies(medium: &mut Medium) -> Result<Vec<Superblock>, StoreError> {
    let path = medium.path().to_owned();
    let slot_len = SUPERBLOCK_SLOT_BYTES as usize;
    let head = medium.read_at(0, 2 * slot_len)?;
    let slot = |i: usize| {
        head.get(i * slot_len..((i + 1) * slot_len).min(head.len()))
            .unwrap_or(&[])
    };
    match [Superblock::decode(slot(0)), Superblock::decode(slot(1))] {
        [Ok(a), Ok(b)] if a.generation >= b.generation => Ok(vec![a, b]),
        [Ok(a), Ok(b)] => Ok(vec![b, a]),
        [Ok(a), Err(_)] | [Err(_), Ok(a)] => Ok(vec![a]),
        [Err(SlotError::NoMagic), Err(SlotError::NoMagic)] => Err(StoreError::WrongMagic {
            path,
            found: signature::find(&head).map(|s| s.0),
        }),
        [Err(SlotError::Version(found)), _] | [_, Err(SlotError::Version(found))] => {
            Err(StoreError::UnsupportedVersion {
                path,
                found,
                supported: FORMAT_VERSION,
            })
        }
        [Err(a), Err(b)] => {
            let why = |e: SlotError| match e {
                SlotError::Corrupt(m) => m,
                other => format!("{other:?}"),
            };
            Err(StoreError::BadChecksum {
                path,
                slot0: why(a),
                slot1: why(b),
            })
        }
    }
}

/// The commit the members agree on: each member must be the store's member in the place it
/// was given, and the store opens at the highest generation every member holds. A member
/// ahead of it (its superblock written by a commit that did not reach every member) gets that
/// copy overwritten with the agreed one, so that a later commit of the same generation number
/// can never meet it.
fn agree(members: &mut [Medium], copies: Vec<Vec<Superblock>>) -> Result<Superblock, StoreError> {
    let count = members.len() as u32;
    let first = copies[0][0].membership;
    let names = |members: &[Medium]| {
        members
            .iter()
            .map(|m| m.path().display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (i, (medium, newest)) in members.iter().zip(&copies).enumerate() {
        let m = newest[0].membership;
        let why = if m.count != count {
            format!(
                "belongs to a store striped over {} member(s), but {count} are given ({}): give \
                 every member, in the order they were created",
                m.count,
                names(members)
            )
        } else if m.store_id != first.store_id {
            format!(
                "belongs to another store than {} (given as member 1)",
                members[0].path().display()
            )
        } else if m.index != i as u32 {
            format!(
                "is member {} of its store but is given as member {}: give the members in the \
                 order they were created",
                m.index + 1,
                i + 1
            )
        } else {
            continue;
        };
        return Err(StoreError::Member {
            path: medium.path().to_owned(),
            why,
        });
    }
    let agreed = copies.iter().map(|c| c[0].generation).min().unwrap_or(0);
    let mut chosen: Vec<Superblock> = Vec::with_capacity(copies.len());
    for (medium, member) in members.iter().zip(&copies) {
        let Some(sb) = member.iter().find(|sb| sb.generation == agreed) else {
            return Err(StoreError::Member {
                path: medium.path().to_owned(),
                why: format!(
                    "holds no valid superblock of generation {agreed}, the newest every member \
                     holds (it has {:?})",
                    member.iter().map(|sb| sb.generation).collect::<Vec<_>>()
                ),
            });
        };
        let mut same = sb.clone();
        same.membership.index = 0;
        if chosen.first().is_some_and(|member1| *member1 != same) {
            return Err(StoreError::Member {
                path: medium.path().to_owned(),
                why: format!(
                    "its superblock of generation {agreed} differs from the first member's"
                ),
            });
        }
        chosen.push(same);
    }
    for (i, (medium, member)) in members.iter_mut().zip(&copies).enumerate() {
        for ahead in member.iter().filter(|sb| sb.generation > agreed) {
            tracing::warn!(
                member = %medium.path().display(),
                "generation {} reached this member only: the commit did not complete; back to \
                 generation {agreed}",
                ahead.generation
            );
            let mut sb = chosen[0].clone();
            sb.membership.index = i as u32;
            medium.write_at((ahead.generation % 2) * SUPERBLOCK_SLOT_BYTES, &sb.encode())?;
            medium.sync()?;
        }
    }
    Ok(chosen.swap_remove(0))
}
