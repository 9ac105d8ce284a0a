//! The `file`, `nvme` and `proxy` backends: partitions in a [`legend_storage::Store`] on a file
//! or block device (`O_DIRECT`, io_uring), or on an NVMe namespace through I/O queue pairs (an
//! SSD bound to `legend_nvme`, or the userspace proxy controller over a file), with checkpoints
//! committed by the store's superblock flip.

use std::path::{Path, PathBuf};

use legend_fs::{Access, Dir, Guard};
use legend_nvme_proxy::DeviceModel;
use legend_storage::{
    CreateOptions, DatasetId, Expect, IoBuffer, IoConfig, IoPiece, Layout, NvmeTarget, Region,
    Store, StoreSpec, Target,
};

use super::at_rest::{narrow, widen};
use super::controllers::{self, SharedController};
use super::{PartitionStore, PartitionStoreError, QueueBackend, QueueLocation, StoreMember};
use crate::rows::RowShape;

/// Bytes between two rows of a partition below which [`FileStore::read_rows`] reads both in one
/// transfer (the bytes between them come along): a few blocks cost less than another request.
pub const ROW_READ_GAP: u64 = 64 << 10;

/// Bytes reserved for the training-progress record in the superblock.
pub const PROGRESS_CAPACITY: u32 = 4096;

/// A member of a store, its directory opened ([`StoreFile`]).
#[derive(Debug)]
pub struct MemberFile {
    /// The file.
    pub file: StoreFile,
    /// How it is reached when behind NVMe queues.
    pub queue: Option<QueueLocation>,
}

impl MemberFile {
    /// Opens the directory of `member` of the run in `run` (canonically `run_dir`), as
    /// [`StoreFile::of_run`] does.
    pub fn of_run(
        run: &Dir,
        run_dir: &Path,
        member: &StoreMember,
        guard: &dyn Guard,
    ) -> Result<MemberFile, PartitionStoreError> {
        Ok(MemberFile {
            file: StoreFile::of_run(run, run_dir, &member.path, member.queue, guard)?,
            queue: member.queue,
        })
    }
}

/// A partition store over an on-disk [`Store`].
///
/// The store is created with shadow copies, so a crash rolls every partition back to exactly
/// the last committed checkpoint, and resuming reproduces an uninterrupted run.
pub struct FileStore {
    store: Store,
    staging: IoBuffer,
    /// The members of a queue-backed store, in stripe order (kept for their users, e.g. the
    /// GPU I/O kernels).
    queued: Vec<QueuedMember>,
}

/// A member of a store behind NVMe queues: its controller and the namespace it is on.
#[derive(Clone)]
pub struct QueuedMember {
    /// The controller.
    pub controller: SharedController,
    /// The namespace holding the member.
    pub namespace: u32,
}

/// A store's file, a proxy's backing file or a device node: the directory holding it, opened
/// once, and its name there. Files are then reached beneath the directory without following
/// links (legend-fs), so a path swapped after the directory was admitted changes nothing.
#[derive(Debug)]
pub struct StoreFile {
    /// The directory.
    pub dir: Dir,
    /// The file's name in it.
    pub name: PathBuf,
}

impl StoreFile {
    /// The file at `path`, its directory opened now and admitted by `guard`.
    pub fn open(path: &Path, guard: &dyn Guard) -> Result<StoreFile, PartitionStoreError> {
        let (dir, name) = Dir::open_parent(path).map_err(io_error(path))?;
        guard.admit(&dir).map_err(io_error(dir.path()))?;
        Ok(StoreFile {
            name: name.to_owned(),
            dir,
        })
    }

    /// The store of the run in `run` (canonically `run_dir`) at `path`: beneath the run when it
    /// is there; a device node (`nvme`) by its path, not the caller's to admit (namespace
    /// extents keep its users apart); elsewhere in a directory `guard` admits.
    pub fn of_run(
        run: &Dir,
        run_dir: &Path,
        path: &Path,
        queue: Option<QueueLocation>,
        guard: &dyn Guard,
    ) -> Result<StoreFile, PartitionStoreError> {
        match path.strip_prefix(run_dir) {
            Ok(name) => Self::in_dir(run, name),
            Err(_) if queue.is_some_and(|q| q.backend == QueueBackend::Nvme) => {
                Self::open(path, &legend_fs::Unguarded)
            }
            Err(_) => Self::open(path, guard),
        }
    }

    /// The file `name` in `dir`.
    pub fn in_dir(dir: &Dir, name: &Path) -> Result<StoreFile, PartitionStoreError> {
        Ok(StoreFile {
            dir: dir.try_clone().map_err(io_error(dir.path()))?,
            name: name.to_owned(),
        })
    }

    /// Its path (for records and messages).
    pub fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    fn target(&self) -> Target<'_> {
        Target::In {
            dir: &self.dir,
            name: &self.name,
        }
    }
}

/// What a store-backed run needs to know to create or open its store.
pub struct FileStoreSpec<'a> {
    /// Where the store is (for `nvme`, the device node; for `proxy`, its backing file): one
    /// member, or the members it is striped over, in stripe order, all of one backend.
    pub members: &'a [MemberFile],
    /// Bytes of a stripe unit when there are several members.
    pub stripe_bytes: u64,
    /// Dataset identity and label.
    pub dataset: DatasetId,
    /// Entities.
    pub num_nodes: u64,
    /// Floats of an entity row.
    pub shape: RowShape,
    /// Partitions.
    pub num_partitions: u32,
    /// Bytes of the relation parameters and their state.
    pub aux_bytes: u64,
    /// The store's identity as the run records it. A new store gets it, and a target that is
    /// this store as an interrupted creation left it is made again (the run recorded the id
    /// before creating); an opened store must carry it. `None`: a new random one, or any when
    /// opening (runs recorded before store identities were).
    pub store_id: Option<[u8; 16]>,
    /// Overwrite a target carrying another signature.
    pub force: bool,
    /// `proxy`: the SSD it models, if any (a proxy already serving the file keeps its own).
    pub proxy_model: Option<DeviceModel>,
}

impl FileStore {
    /// Creates a new store. On files it is made under temporary names and renamed into place,
    /// so an interrupted creation never leaves a store that cannot be opened; a proxy's backing
    /// file is created (or extended) to its member's size first, and removed again if it was
    /// created and the creation fails.
    pub fn create(spec: &FileStoreSpec<'_>) -> Result<FileStore, PartitionStoreError> {
        let store_spec = store_spec(
            spec.dataset.clone(),
            spec.num_nodes,
            spec.shape,
            spec.num_partitions,
            spec.aux_bytes,
        );
        let opts = CreateOptions {
            force: spec.force,
            stripe_bytes: spec.stripe_bytes,
            store_id: spec.store_id,
            ..CreateOptions::default()
        };
        if spec.members.iter().any(|m| m.queue.is_some()) {
            let mut new_files = Vec::new();
            for m in spec.members {
                let f = &m.file;
                let proxy = m.queue.is_some_and(|q| q.backend == QueueBackend::Proxy);
                if proxy && !f.dir.exists(&f.name).map_err(io_error(&f.path()))? {
                    new_files.push(f);
                }
            }
            let created = Self::create_queued(spec, &store_spec, &opts);
            if created.is_err() {
                // Leave no backing file this creation made (its proxy has stopped with it).
                for f in new_files {
                    let _ = f.dir.remove_file(&f.name);
                }
            }
            return created;
        }
        // Members that do not exist yet are made under a temporary name.
        let mut tmps: Vec<Option<StoreFile>> = Vec::with_capacity(spec.members.len());
        for m in spec.members {
            let f = &m.file;
            tmps.push(if f.dir.exists(&f.name).map_err(io_error(&f.path()))? {
                None
            } else {
                let tmp = StoreFile {
                    dir: f.dir.try_clone().map_err(io_error(f.dir.path()))?,
                    name: f.name.with_extension("creating"),
                };
                let _ = tmp.dir.remove_file(&tmp.name);
                Some(tmp)
            });
        }
        let made: Vec<Target<'_>> = spec
            .members
            .iter()
            .zip(&tmps)
            .map(|(m, tmp)| tmp.as_ref().unwrap_or(&m.file).target())
            .collect();
        let store = Store::create_striped(&made, &store_spec, &opts)?;
        if tmps.iter().all(Option::is_none) {
            return Self::with_store(store, Vec::new());
        }
        drop(store);
        for (m, tmp) in spec.members.iter().zip(&tmps) {
            if let Some(tmp) = tmp {
                let f = &m.file;
                f.dir
                    .rename(&tmp.name, &f.name)
                    .map_err(io_error(&f.path()))?;
            }
        }
        let targets: Vec<Target<'_>> = spec.members.iter().map(|m| m.file.target()).collect();
        let expect = Expect {
            store_id: spec.store_id,
            ..Expect::default()
        };
        let store = Store::open_striped(&targets, &expect, &IoConfig::default())?;
        Self::with_store(store, Vec::new())
    }

    /// [`FileStore::create`] behind NVMe queues: each member's controller opened (a proxy's
    /// backing file sized first), then the store created through them.
    fn create_queued(
        spec: &FileStoreSpec<'_>,
        store_spec: &StoreSpec,
        opts: &CreateOptions,
    ) -> Result<FileStore, PartitionStoreError> {
        let controllers = open_controllers(spec, |m, q| {
            if q.backend == QueueBackend::Proxy {
                size_backing_file(spec, store_spec, m, q.start_lba)?;
            }
            Ok(())
        })?;
        let targets = nvme_targets(&controllers, spec.members);
        let nvme: Vec<Target<'_>> = targets.iter().map(Target::Nvme).collect();
        let store = Store::create_striped(&nvme, store_spec, opts)?;
        Self::with_store(store, queued(controllers, spec.members))
    }

    /// Opens an existing store, checking it belongs to this dataset, dimension and partitioning.
    pub fn open(spec: &FileStoreSpec<'_>) -> Result<FileStore, PartitionStoreError> {
        Self::open_expecting(spec, Some(spec.num_partitions))
    }

    /// Opens an existing store of this dataset and dimension, whatever its partitioning.
    pub fn open_any_partitioning(
        spec: &FileStoreSpec<'_>,
    ) -> Result<FileStore, PartitionStoreError> {
        Self::open_expecting(spec, None)
    }

    fn open_expecting(
        spec: &FileStoreSpec<'_>,
        num_partitions: Option<u32>,
    ) -> Result<FileStore, PartitionStoreError> {
        let expect = Expect {
            dataset: Some(spec.dataset.clone()),
            dim: Some(spec.shape.dim as u32),
            state_width: Some(spec.shape.state as u32),
            dtype: Some(spec.shape.dtype),
            num_partitions,
            store_id: spec.store_id,
        };
        let io = IoConfig::default();
        if spec.members.iter().any(|m| m.queue.is_some()) {
            let controllers = open_controllers(spec, |_, _| Ok(()))?;
            let targets = nvme_targets(&controllers, spec.members);
            let nvme: Vec<Target<'_>> = targets.iter().map(Target::Nvme).collect();
            let store = Store::open_striped(&nvme, &expect, &io)?;
            return Self::with_store(store, queued(controllers, spec.members));
        }
        let targets: Vec<Target<'_>> = spec.members.iter().map(|m| m.file.target()).collect();
        Self::with_store(Store::open_striped(&targets, &expect, &io)?, Vec::new())
    }

    fn with_store(
        store: Store,
        queued: Vec<QueuedMember>,
    ) -> Result<FileStore, PartitionStoreError> {
        let staging = IoBuffer::new(
            store
                .max_partition_bytes()
                .max(store.spec().aux_bytes as usize),
        )?;
        Ok(FileStore {
            store,
            staging,
            queued,
        })
    }

    /// Whether partition `p` holds data (committed or written since).
    pub fn is_initialized(&self, p: u32) -> Result<bool, PartitionStoreError> {
        Ok(self.store.is_initialized(Region::Partition(p))?)
    }

    /// Where the caller's own transfer of partition `p` goes, on a store of any number of
    /// members: the transfer's pieces (see [`Store::io_pieces`]).
    pub fn io_pieces(&self, p: u32, write: bool) -> Result<Vec<IoPiece>, PartitionStoreError> {
        Ok(self.store.io_pieces(Region::Partition(p), write)?)
    }

    /// Records that the caller wrote partition `p` itself, at [`FileStore::io_pieces`] (the
    /// GPU I/O kernels): the next commit includes it.
    pub fn mark_written(&mut self, p: u32) -> Result<(), PartitionStoreError> {
        Ok(self.store.mark_written(Region::Partition(p))?)
    }

    /// How messages name the store: its member's path, or every member's.
    pub fn path(&self) -> &Path {
        self.store.path()
    }

    /// The store's layout parameters (nodes, dimension, dtype, partitions), read-only (a run's
    /// reader keeps them for the users of its [`crate::run::StoreLayout`]).
    pub fn spec(&self) -> &StoreSpec {
        self.store.spec()
    }

    /// Bytes the largest partition takes on the medium (a staging buffer for it).
    pub fn max_partition_bytes(&self) -> usize {
        self.store.max_partition_bytes()
    }

    /// The members of a queue-backed store, in stripe order (none for a store on files).
    pub fn queued_members(&self) -> &[QueuedMember] {
        &self.queued
    }

    /// The progress record of the last commit (empty for a new store).
    pub fn progress(&self) -> &[u8] {
        self.store.progress()
    }

    /// The relation parameters of the last commit, if any was made.
    pub fn aux(&mut self, len: usize) -> Result<Option<Vec<u8>>, PartitionStoreError> {
        if !self.store.is_initialized(Region::Aux)? {
            return Ok(None);
        }
        self.store.read(Region::Aux, &mut self.staging)?;
        Ok(Some(self.staging.as_bytes()[..len].to_vec()))
    }
}

impl PartitionStore for FileStore {
    fn read(
        &mut self,
        p: u32,
        emb: &mut [f32],
        state: &mut [f32],
    ) -> Result<bool, PartitionStoreError> {
        if !self.store.is_initialized(Region::Partition(p))? {
            return Ok(false);
        }
        self.store.read(Region::Partition(p), &mut self.staging)?;
        let rows = self.store.partition(p)?.rows;
        let spec = self.store.spec();
        let (stored_emb, stored_state) = self.staging.split_partition_mut(rows, spec);
        widen(spec.dtype, stored_emb, emb);
        state.copy_from_slice(stored_state);
        Ok(true)
    }

    fn write(&mut self, p: u32, emb: &[f32], state: &[f32]) -> Result<(), PartitionStoreError> {
        let rows = self.store.partition(p)?.rows;
        let spec = self.store.spec();
        let (stored_emb, stored_state) = self.staging.split_partition_mut(rows, spec);
        narrow(spec.dtype, emb, stored_emb);
        stored_state.copy_from_slice(state);
        Ok(self.store.write(Region::Partition(p), &self.staging)?)
    }

    /// Only the blocks holding the rows are read ([`Store::read_range`]; rows of one partition
    /// less than [`ROW_READ_GAP`] apart in one read), never the AdaGrad state. A store without
    /// a checkpoint yet refuses.
    fn read_rows(
        &mut self,
        init: &legend_model::Init,
        ids: &[u64],
        out: &mut [f32],
    ) -> Result<(), PartitionStoreError> {
        self.require_checkpoint()?;
        let spec = self.store.spec();
        let (dim, dtype, nodes) = (spec.dim as usize, spec.dtype, spec.num_nodes);
        let row_bytes = (dim * dtype.bytes()) as u64;
        let per_part = legend_model::partition::rows_per_partition(nodes, spec.num_partitions);
        assert_eq!(out.len(), ids.len() * dim, "one row of out per id");
        if let Some(&bad) = ids.iter().find(|&&id| id >= nodes) {
            return Err(PartitionStoreError::Invalid(format!(
                "{}: row {bad} asked of a store of {nodes} rows",
                self.store.path().display()
            )));
        }
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_unstable_by_key(|&i| ids[i]);
        let mut rest = &order[..];
        while let Some(&first) = rest.first() {
            let p = (ids[first] / per_part) as u32;
            let base = u64::from(p) * per_part;
            let byte = |i: usize| (ids[i] - base) * row_bytes;
            // The rows of one read: this partition's, each less than the gap after the last.
            let n = rest
                .windows(2)
                .take_while(|w| {
                    ids[w[1]] / per_part == u64::from(p)
                        && byte(w[1]) < byte(w[0]) + row_bytes + ROW_READ_GAP
                })
                .count()
                + 1;
            let (group, after) = rest.split_at(n);
            rest = after;
            if !self.store.is_initialized(Region::Partition(p))? {
                for &i in group {
                    init.node_row(ids[i], &mut out[i * dim..][..dim]);
                }
                continue;
            }
            let start = byte(group[0]);
            let end = byte(group[n - 1]) + row_bytes;
            let at = self
                .store
                .read_range(Region::Partition(p), start..end, &mut self.staging)?;
            let bytes = &self.staging.as_bytes()[at..];
            for &i in group {
                let from = (byte(i) - start) as usize;
                dtype.widen(
                    &bytes[from..][..row_bytes as usize],
                    &mut out[i * dim..][..dim],
                );
            }
        }
        Ok(())
    }

    fn commit(&mut self, progress: &[u8], aux: &[u8]) -> Result<bool, PartitionStoreError> {
        let bytes = self.staging.as_bytes_mut();
        bytes[..aux.len()].copy_from_slice(aux);
        bytes[aux.len()..self.store.spec().aux_bytes as usize].fill(0);
        self.store.write(Region::Aux, &self.staging)?;
        self.store.commit(progress)?;
        Ok(true)
    }
}

/// Opens the controller of every member (all behind NVMe queues), after `prepare` (which makes
/// a proxy's backing file big enough) ran for it.
fn open_controllers(
    spec: &FileStoreSpec<'_>,
    prepare: impl Fn(&MemberFile, QueueLocation) -> Result<(), PartitionStoreError>,
) -> Result<Vec<SharedController>, PartitionStoreError> {
    spec.members
        .iter()
        .map(|m| {
            let q = m.queue.ok_or_else(|| {
                PartitionStoreError::Invalid(format!(
                    "{}: every member of a store behind NVMe queues must be behind them too",
                    m.file.path().display()
                ))
            })?;
            prepare(m, q)?;
            controllers::open(q.backend, &m.file, spec.proxy_model)
        })
        .collect()
}

/// The members behind `controllers`, with their namespaces.
fn queued(controllers: Vec<SharedController>, members: &[MemberFile]) -> Vec<QueuedMember> {
    controllers
        .into_iter()
        .zip(members)
        .map(|(controller, m)| QueuedMember {
            controller,
            namespace: m
                .queue
                .expect("checked when the controllers were opened")
                .namespace,
        })
        .collect()
}

fn nvme_targets(controllers: &[SharedController], members: &[MemberFile]) -> Vec<NvmeTarget> {
    controllers
        .iter()
        .zip(members)
        .map(|(c, m)| {
            let q = m.queue.expect("checked when the controllers were opened");
            NvmeTarget {
                controller: c.controller(),
                namespace: q.namespace,
                start_lba: q.start_lba,
            }
        })
        .collect()
}

/// The store of a run: shadowed partitions, the relation tables in its auxiliary region.
fn store_spec(
    dataset: DatasetId,
    num_nodes: u64,
    shape: RowShape,
    num_partitions: u32,
    aux_bytes: u64,
) -> StoreSpec {
    StoreSpec {
        dataset,
        num_nodes,
        dim: shape.dim as u32,
        dtype: shape.dtype,
        state_width: shape.state as u32,
        num_partitions,
        aux_bytes: aux_bytes.max(1),
        progress_capacity: PROGRESS_CAPACITY,
        shadow: true,
    }
}

/// Bytes the store of a run of `config` on `dataset` takes on a medium of `block_size`-byte
/// blocks (what a shared namespace must set aside for it; a store of one member).
pub fn run_store_bytes(
    config: &crate::Config,
    dataset: &legend_dataset::DatasetMeta,
    block_size: u64,
) -> Result<u64, PartitionStoreError> {
    let shape = config.entity_shape();
    let spec = store_spec(
        DatasetId {
            id: [0; 16],
            label: String::new(),
        },
        dataset.entities,
        shape,
        config.storage.num_partitions,
        // The relation rows (reciprocal ones included) and their AdaGrad state.
        config.relation_floats(dataset.relations) * 8,
    );
    Ok(Layout::compute(&spec, block_size)?.total_bytes)
}

/// Creates the proxy's backing file of `member`, or extends it, to hold its share of the store
/// after `start_lba` (512-byte blocks, the proxy's LBA size).
fn size_backing_file(
    spec: &FileStoreSpec<'_>,
    store_spec: &StoreSpec,
    member: &MemberFile,
    start_lba: u64,
) -> Result<(), PartitionStoreError> {
    let total = Layout::compute(store_spec, 512)?.total_bytes;
    let needed = legend_storage::member_bytes(total, spec.members.len(), spec.stripe_bytes)
        + (start_lba << 9);
    let path = member.file.path();
    let file = member
        .file
        .dir
        .open_file(&member.file.name, Access::ReadWriteCreate)
        .map_err(io_error(&path))?;
    let meta = file.metadata().map_err(io_error(&path))?;
    if meta.is_file()
        && meta.len() < needed
        && (spec.force || !foreign(&file, &path, start_lba, spec.store_id)?)
    {
        file.set_len(needed).map_err(io_error(&path))?;
    }
    Ok(())
}

/// Whether the head of the proxy's backing file `file` (from `start_lba`) carries what the
/// store's creation refuses (another store, a file system): such a file is not grown first,
/// and the creation refuses it as it is.
fn foreign(
    mut file: &std::fs::File,
    path: &Path,
    start_lba: u64,
    store_id: Option<[u8; 16]>,
) -> Result<bool, PartitionStoreError> {
    use std::io::{Read, Seek, SeekFrom};
    let mut head = Vec::with_capacity(legend_storage::HEAD_BYTES);
    file.seek(SeekFrom::Start(start_lba << 9))
        .and_then(|_| {
            file.take(legend_storage::HEAD_BYTES as u64)
                .read_to_end(&mut head)
        })
        .map_err(io_error(path))?;
    Ok(legend_storage::foreign_signature(&head, store_id).is_some())
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> PartitionStoreError + '_ {
    move |source| PartitionStoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Relation tables as the aux region holds them: embeddings then state, little-endian f32.
pub fn encode_relations(emb: &[f32], state: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity((emb.len() + state.len()) * 4);
    out.extend_from_slice(bytemuck::cast_slice(emb));
    out.extend_from_slice(bytemuck::cast_slice(state));
    out
}

impl FileStore {
    /// The checkpoint's relation embeddings and their AdaGrad state (`relation_floats` each;
    /// empty when the store holds none).
    pub fn relations(
        &mut self,
        relation_floats: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), PartitionStoreError> {
        self.require_checkpoint()?;
        Ok(match self.aux(relation_floats * 8)? {
            Some(bytes) => {
                let all: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
                let (e, s) = all.split_at(relation_floats);
                (e.to_vec(), s.to_vec())
            }
            None => (Vec::new(), Vec::new()),
        })
    }

    fn require_checkpoint(&self) -> Result<(), PartitionStoreError> {
        if self.store.progress().is_empty() {
            return Err(PartitionStoreError::Invalid(format!(
                "{}: the run has no checkpoint yet",
                self.store.path().display()
            )));
        }
        Ok(())
    }
}
