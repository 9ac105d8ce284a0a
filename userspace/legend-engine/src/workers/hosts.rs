//! Workers on several hosts: one process a host, each running its GPUs as workers of one
//! schedule over all of them (legend-planner's `plan_hosts`: K = H·L GPUs host-major, N = 2K
//! partitions, hand-overs inside a host-round on the host's NVLink and between host-rounds
//! over the network), through the job's control connections (legend-cluster) and, between
//! GPUs, one NCCL communicator over every host's GPUs.
//!
//! Host 0 leads. Its session drives its [`Workers`] as on one host; the workers tell the
//! other hosts ([`follow`]) what to train: an epoch from a cut, with the learning rate, their
//! gates agreed with host 0's at every round (a host that does not reach a gate within
//! max(60 s, 4 × the round's planned time) of host 0 fails the job, named), their reports
//! gathered at its end. Checkpoints and evaluations stream the other hosts' partitions to host
//! 0 over the connections, a bounded piece at a time: host 0's run directory is the run's only
//! copy (one format, resumed on any number of hosts), committed once every piece is in.
//!
//! Edges: each host reads only the buckets its GPUs train (their runs of the dataset's saved
//! buckets, `legendctl partition`, or one pass over the train edges keeping them) and counts
//! entity degrees over the buckets it is first to train; host 0 sums the counts.
//!
//! Partitions at rest: a host keeps what its workers hold; a lay-out (the start, a resume, a
//! continuation after a checkpoint) sends what a host gives up to host 0's store and what it
//! lacks from there (a partition never trained is initialised where it is first read, by
//! global row, the same anywhere).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use legend_cluster::{Cluster, ClusterError};
use legend_dataset::Dataset;
use legend_planner::GpuSchedule;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::link::{ChannelLink, Message, PeerSender};
use super::{Agree, HostEpoch, Link, NcclLink, Workers, batch_counts, gpus_of};
use crate::compute::RowSink;
use crate::config::Config;
use crate::engine::Engine;
use crate::error::TrainError;
use crate::progress::EpochCut;
use crate::relations::{RelationGradients, Relations};
use crate::rows::Partition;
use crate::store::{MemoryStore, PartitionStore, SharedMemoryStore, StoredEmbeddings};

/// Host 0's commands, and the other hosts' replies.
const COMMANDS: u32 = 0;
/// Rows of partitions streamed to host 0.
const ROWS: u32 = 1;
/// Partitions moving through host 0's store in a lay-out.
const LAYOUT: u32 = 2;
/// Entity degree counts.
const DEGREES: u32 = 3;
/// Partitions handed to CPU worker `g` of another host: this plus `g`.
const PARTITIONS: u32 = 1 << 16;

/// A round's deadline: this many times its planned time ...
const ROUND_DEADLINE_FACTOR: f64 = 4.0;
/// ... and at least this.
pub const ROUND_DEADLINE_FLOOR: Duration = Duration::from_secs(60);
/// A round's deadline before any round has been measured here.
pub const UNMEASURED_ROUND_DEADLINE: Duration = Duration::from_secs(600);
/// How long the job's NCCL communicators may take to connect.
const NCCL_CONNECT: Duration = Duration::from_secs(600);

/// The other hosts of a run, as one host's workers see them.
pub struct Hosts {
    cluster: Cluster,
    gpus_per_host: u32,
    /// The slowest seconds per planned batch a round took here (nanoseconds): what round
    /// deadlines are planned from.
    batch_ns: Arc<AtomicU64>,
}

/// What host 0 sends the other hosts to start: what to train, and on what.
#[derive(Serialize, Deserialize)]
struct Job {
    /// The run's configuration (TOML), as host 0 resolved it.
    config: String,
    /// Host 0's dataset directory (a host given none uses the same path).
    dataset: PathBuf,
    /// The dataset's identity every host's must have.
    dataset_identity: String,
    /// NCCL's unique id, for GPU workers.
    nccl_id: Option<Vec<u8>>,
    /// Floats of the relation embeddings that follow the message (then their state): host
    /// 0's, a resumed run's included, so that every worker starts from the same rows.
    relation_floats: usize,
}

#[derive(Serialize, Deserialize)]
enum Command {
    /// Train your part of an epoch.
    Epoch {
        epoch: u32,
        from: Option<EpochCut>,
        learning_rate: f32,
    },
    /// Stream this partition's rows to host 0.
    Stream { partition: u32 },
    /// Settle your workers (a checkpoint).
    Settle,
}

#[derive(Serialize, Deserialize)]
enum Reply {
    /// Set up, with these devices.
    Joined { devices: Vec<String> },
    /// Your part of the epoch.
    Epoch(HostEpoch),
    /// Settled.
    Settled,
}

#[derive(Serialize, Deserialize)]
enum LayOut {
    /// A partition at rest (its rows follow), or `None`: never written, initialised where read.
    Give { partition: u32, rows: Option<Rows> },
    /// What this host's workers lack (after every host gave up what it keeps no longer).
    Need { partitions: Vec<u32> },
    /// This host's workers hold their partitions.
    Done,
}

/// How a partition's rows at rest follow a message: embeddings (f32, or the bits of a 16-bit
/// format), then the f32 state.
#[derive(Serialize, Deserialize)]
struct Rows {
    bits16: bool,
    emb: usize,
    state: usize,
}

/// A piece of a streamed partition (its embeddings then its state follow), or its end.
#[derive(Serialize, Deserialize)]
struct Piece {
    emb: usize,
    state: usize,
    last: bool,
}

/// What a CPU worker sends a worker of another host; the raw bytes follow.
#[derive(Serialize, Deserialize)]
enum HandedOver {
    /// A partition's rows: `emb` embedding floats, then the state.
    Partition {
        from: usize,
        partition: u32,
        emb: usize,
    },
    /// A step's relation gradients: `grads` floats of rows `width` wide, then a count a row.
    Relations {
        from: usize,
        width: usize,
        grads: usize,
    },
}

/// Sends `head` (JSON) and `raw` as one message.
fn send<T: Serialize>(
    cluster: &Cluster,
    to: u32,
    channel: u32,
    head: &T,
    raw: &[&[u8]],
) -> Result<(), TrainError> {
    let json = serde_json::to_vec(head).expect("messages serialize");
    let len = (json.len() as u32).to_le_bytes();
    let mut parts: Vec<&[u8]> = vec![&len, &json];
    parts.extend_from_slice(raw);
    Ok(cluster.send(to, channel, &parts)?)
}

/// The next message from `from` on `channel`: its head, and the raw bytes after it.
fn recv<T: DeserializeOwned>(
    cluster: &Cluster,
    channel: u32,
    from: u32,
    what: &str,
) -> Result<(T, Vec<u8>), TrainError> {
    let mut payload = cluster.recv(channel, from, None, what)?;
    let bad = |why: String| {
        let reason = format!("{} sent a bad {what}: {why}", cluster.host(from));
        cluster.fail(reason.clone());
        TrainError::Hosts(ClusterError::Failed(reason))
    };
    let len = payload
        .get(..4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
        .ok_or_else(|| bad("no head".into()))?;
    let json = payload.get(4..4 + len).ok_or_else(|| bad("short".into()))?;
    let head: T = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
    let raw = payload.split_off(4 + len);
    Ok((head, raw))
}

/// `n` f32 values of `raw` from byte `at`.
fn floats(raw: &[u8], at: usize, n: usize) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(&raw[at..at + 4 * n])
}

impl Hosts {
    /// Hosts in the job.
    pub fn count(&self) -> u32 {
        self.cluster.hosts()
    }

    fn leader(&self) -> bool {
        self.cluster.is_leader()
    }

    /// The round timings' measurement, shared with the workers.
    pub(crate) fn batch_ns(&self) -> Arc<AtomicU64> {
        self.batch_ns.clone()
    }

    /// Other hosts' progress in the current epoch (host 0).
    pub(crate) fn others_progress(&self) -> u64 {
        self.cluster.others_progress()
    }

    pub(crate) fn set_progress(&self, edges: u64) {
        self.cluster.set_progress(edges);
    }

    pub(crate) fn failed(&self) -> bool {
        self.cluster.failed_flag().load(Ordering::Acquire)
    }

    pub(crate) fn failure(&self) -> Option<ClusterError> {
        self.cluster.failure()
    }

    /// This host failed with `e`: every host stops, told why.
    pub(crate) fn failed_here(&self, e: &TrainError) {
        if !self.failed() {
            self.cluster.fail(format!(
                "{} failed: {}",
                self.cluster.host(self.cluster.rank()),
                crate::error_chain::with_sources(e)
            ));
        }
    }

    /// Host 0: tells every other host to train its part of `epoch` from `from`.
    pub(crate) fn start_epoch(
        &self,
        epoch: u32,
        from: Option<EpochCut>,
        learning_rate: f32,
    ) -> Result<(), TrainError> {
        if !self.leader() {
            return Ok(());
        }
        let command = Command::Epoch {
            epoch,
            from,
            learning_rate,
        };
        for r in 1..self.count() {
            send(&self.cluster, r, COMMANDS, &command, &[])?;
        }
        Ok(())
    }

    /// Host 0: its part of an epoch and every other host's, in host order.
    pub(crate) fn collect_epoch(&self, own: HostEpoch) -> Result<Vec<HostEpoch>, TrainError> {
        let mut parts = vec![own];
        for r in 1..self.count() {
            match recv::<Reply>(&self.cluster, COMMANDS, r, "epoch report")?.0 {
                Reply::Epoch(part) => parts.push(part),
                _ => return Err(self.unexpected(r, "its epoch report")),
            }
        }
        Ok(parts)
    }

    /// Host 0: settles every other host's workers.
    pub(crate) fn settle_others(&self) -> Result<(), TrainError> {
        for r in 1..self.count() {
            send(&self.cluster, r, COMMANDS, &Command::Settle, &[])?;
        }
        for r in 1..self.count() {
            match recv::<Reply>(&self.cluster, COMMANDS, r, "settle reply")?.0 {
                Reply::Settled => {}
                _ => return Err(self.unexpected(r, "its settle reply")),
            }
        }
        Ok(())
    }

    fn unexpected(&self, r: u32, wanted: &str) -> TrainError {
        let reason = format!("{} sent something else than {wanted}", self.cluster.host(r));
        self.cluster.fail(reason.clone());
        TrainError::Hosts(ClusterError::Failed(reason))
    }

    /// The agreement at this host's gates of `epoch` from round position `first` of `order`:
    /// gate `generation` is the one before round `order[first + generation]`, its deadline
    /// 4 × that round's planned time (its slowest GPU's batches at the slowest seconds a batch
    /// measured here), at least a minute.
    pub(crate) fn gate<'a>(
        &'a self,
        schedule: &'a GpuSchedule,
        epoch: u32,
        order: &'a [usize],
        first: usize,
    ) -> Agree<'a> {
        Box::new(move |generation: u64, stop: bool| {
            let position = first + generation as usize;
            let round = order.get(position).copied();
            let what = match round {
                Some(_) => format!("round {} of epoch {epoch}", position + 1),
                None => format!("the end of epoch {epoch}"),
            };
            let deadline = round_deadline(
                round.map_or(0, |r| schedule.round_batches[r]),
                self.batch_ns.load(Ordering::Relaxed),
            );
            let seq = (u64::from(epoch) << 32) | position as u64;
            Ok(self.cluster.agree(seq, stop, deadline, &what)?)
        })
    }

    /// After this host's workers made their partitions resident: the other hosts tell host
    /// 0, which waits for all.
    pub(crate) fn laid_out(&self) -> Result<(), TrainError> {
        if !self.leader() {
            return send(&self.cluster, 0, LAYOUT, &LayOut::Done, &[]);
        }
        for r in 1..self.count() {
            match recv::<LayOut>(&self.cluster, LAYOUT, r, "lay-out")?.0 {
                LayOut::Done => {}
                _ => return Err(self.unexpected(r, "the end of its lay-out")),
            }
        }
        Ok(())
    }
}

/// A round's deadline (see [`Hosts::gate`]): `batches` planned at `batch_ns` each.
fn round_deadline(batches: u64, batch_ns: u64) -> Duration {
    if batch_ns == 0 {
        return UNMEASURED_ROUND_DEADLINE;
    }
    let planned = batches as f64 * batch_ns as f64 / 1e9;
    ROUND_DEADLINE_FLOOR.max(Duration::from_secs_f64(ROUND_DEADLINE_FACTOR * planned))
}

/// Sends partition `p` as `store` keeps it (taking it out), or that it was never written.
fn give(
    cluster: &Cluster,
    to: u32,
    store: &mut SharedMemoryStore,
    p: u32,
) -> Result<(), TrainError> {
    let Some((emb, state)) = store.take_stored(p) else {
        return send(
            cluster,
            to,
            LAYOUT,
            &LayOut::Give {
                partition: p,
                rows: None,
            },
            &[],
        );
    };
    let (bits16, len, bytes): (bool, usize, &[u8]) = match &emb {
        StoredEmbeddings::F32(v) => (false, v.len(), bytemuck::cast_slice(v)),
        StoredEmbeddings::Bits16(v) => (true, v.len(), bytemuck::cast_slice(v)),
    };
    let head = LayOut::Give {
        partition: p,
        rows: Some(Rows {
            bits16,
            emb: len,
            state: state.len(),
        }),
    };
    send(
        cluster,
        to,
        LAYOUT,
        &head,
        &[bytes, bytemuck::cast_slice(&state)],
    )
}

/// Keeps a partition [`give`] sent in `store`.
fn keep(
    store: &mut SharedMemoryStore,
    p: u32,
    rows: Option<Rows>,
    raw: &[u8],
) -> Result<(), TrainError> {
    let Some(rows) = rows else {
        return Ok(());
    };
    let (emb, at) = if rows.bits16 {
        let bits: Vec<u16> = bytemuck::pod_collect_to_vec(&raw[..2 * rows.emb]);
        (StoredEmbeddings::Bits16(bits), 2 * rows.emb)
    } else {
        (
            StoredEmbeddings::F32(floats(raw, 0, rows.emb)),
            4 * rows.emb,
        )
    };
    Ok(store.keep_stored(p, emb, floats(raw, at, rows.state))?)
}

impl Workers {
    /// Host 0's workers of a run on several hosts, starting the other hosts (see the module
    /// docs): the run's partitions start in `home` (a resumed run's tables; empty for a new
    /// run), on `engines` (this host's `training.gpus`).
    pub fn on_hosts(
        config: &Config,
        dataset: &Dataset,
        home: MemoryStore,
        relations: Relations,
        engines: Vec<Engine>,
        cluster: Cluster,
    ) -> Result<Workers, TrainError> {
        assert!(cluster.is_leader(), "host 0 starts the others");
        let gpus = gpus_of(&engines);
        let nccl_id = if gpus.is_empty() {
            None
        } else {
            Some(legend_cuda::nccl::unique_id()?)
        };
        let job = Job {
            config: config.to_toml(),
            dataset: std::fs::canonicalize(dataset.dir()).unwrap_or_else(|_| dataset.dir().into()),
            dataset_identity: format!("{:032x}", dataset.meta().identity()),
            nccl_id: nccl_id.clone(),
            relation_floats: relations.emb.len(),
        };
        let tables = [
            bytemuck::cast_slice(&relations.emb),
            bytemuck::cast_slice(&relations.state),
        ];
        for r in 1..cluster.hosts() {
            send(&cluster, r, COMMANDS, &job, &tables)?;
        }
        Workers::join_hosts(config, dataset, home, relations, engines, cluster, nccl_id)
    }

    /// This host's workers of the job (either role): the schedule, this host's buckets, the
    /// degrees summed over hosts, the links between GPUs, and every host's devices at host 0.
    fn join_hosts(
        config: &Config,
        dataset: &Dataset,
        home: MemoryStore,
        relations: Relations,
        engines: Vec<Engine>,
        cluster: Cluster,
        nccl_id: Option<Vec<u8>>,
    ) -> Result<Workers, TrainError> {
        let (h, l, rank) = (cluster.hosts(), config.training.gpus, cluster.rank());
        if config.training.hosts != h {
            return Err(TrainError::Config(crate::config::ConfigError(format!(
                "training.hosts = {} but {h} hosts joined the job",
                config.training.hosts
            ))));
        }
        assert_eq!(engines.len(), l as usize, "training.gpus engines a host");
        let k = (h * l) as usize;
        let first = (rank * l) as usize;
        let n = config.storage.num_partitions;
        let counts = dataset.bucket_counts(n)?;
        let schedule = legend_planner::plan_hosts(n, h, l, &batch_counts(config, &counts))
            .map_err(|e| TrainError::Resume(e.to_string()))?;
        let traffic = schedule.host_traffic(l);
        tracing::info!(
            "{h} hosts of {l} GPU(s): {} rounds an epoch, {} hand-overs inside hosts and {} between them",
            schedule.rounds.len(),
            traffic.within,
            traffic.across
        );
        let per_host: Vec<Vec<[u32; 2]>> = (0..h).map(|x| schedule.host_buckets(x, l)).collect();
        let scheme = dataset.scheme(n)?;
        let index = |b: [u32; 2]| scheme.bucket_index(b[0], b[1]);
        let mine: HashSet<usize> = per_host[rank as usize].iter().map(|&b| index(b)).collect();
        let buckets = dataset.buckets_selected(n, &|b| mine.contains(&b))?;
        let total: u64 = counts.iter().sum();
        tracing::info!(
            "host {rank} holds the {} buckets its GPUs train of the {}: {} of the {total} train edges ({:.2} GiB)",
            mine.len(),
            counts.len(),
            buckets.edges().len(),
            (std::mem::size_of_val(buckets.edges()) as f64) / f64::from(1u32 << 30)
        );
        // Degrees over every edge once: each bucket counted by the first host that trains it
        // (a diagonal bucket may be trained in pieces on two).
        let mut owner = vec![u32::MAX; counts.len()];
        for (x, list) in per_host.iter().enumerate() {
            for &b in list {
                let o = &mut owner[index(b)];
                *o = (*o).min(x as u32);
            }
        }
        let mut degrees = vec![0u32; scheme.entities as usize];
        for i in 0..n {
            for j in 0..n {
                if owner[scheme.bucket_index(i, j)] == rank {
                    for e in buckets.bucket(i, j) {
                        degrees[e[0] as usize] += 1;
                        degrees[e[2] as usize] += 1;
                    }
                }
            }
        }
        let degrees = sum_degrees(&cluster, degrees)?;
        let gpus = gpus_of(&engines);
        let links: Vec<Box<dyn Link>> = if gpus.is_empty() {
            cpu_links(&cluster, k, first, l as usize)
        } else {
            let id = nccl_id.expect("host 0 draws an NCCL id for GPU workers");
            legend_cuda::nccl::job_communicators(
                &gpus,
                &id,
                k,
                first,
                cluster.failed_flag(),
                NCCL_CONNECT,
            )?
            .into_iter()
            .map(|c| Box::new(NcclLink::new(c)) as Box<dyn Link>)
            .collect()
        };
        let hosts = Hosts {
            cluster: cluster.clone(),
            gpus_per_host: l,
            batch_ns: Arc::default(),
        };
        let mut workers = Workers::assemble(
            config,
            buckets,
            &degrees,
            SharedMemoryStore::new(home),
            relations,
            engines,
            schedule,
            links,
            first,
            Some(hosts),
        )?;
        if rank == 0 {
            for r in 1..h {
                match recv::<Reply>(&cluster, COMMANDS, r, "set-up reply")?.0 {
                    Reply::Joined { devices } => workers.devices.extend(devices),
                    _ => {
                        let hosts = workers.hosts.as_ref().expect("on hosts");
                        return Err(hosts.unexpected(r, "its set-up reply"));
                    }
                }
            }
            tracing::info!("all {h} hosts are set up");
        } else {
            let devices = workers.devices.clone();
            send(&cluster, 0, COMMANDS, &Reply::Joined { devices }, &[])?;
        }
        Ok(workers)
    }

    /// The lay-out's moves between hosts, between every host's releases and its workers
    /// reading what they lack (see the module docs).
    pub(super) fn gather_and_scatter(&mut self, held: &[[u32; 2]]) -> Result<(), TrainError> {
        let hosts = self.hosts.as_ref().expect("on hosts");
        let cluster = &hosts.cluster;
        let home = &mut self.home;
        if hosts.leader() {
            let mut needs = Vec::new();
            for r in 1..hosts.count() {
                loop {
                    match recv::<LayOut>(cluster, LAYOUT, r, "lay-out")? {
                        (LayOut::Give { partition, rows }, raw) => {
                            keep(home, partition, rows, &raw)?
                        }
                        (LayOut::Need { partitions }, _) => {
                            needs.push((r, partitions));
                            break;
                        }
                        (LayOut::Done, _) => return Err(hosts.unexpected(r, "its lay-out")),
                    }
                }
            }
            for (r, partitions) in needs {
                for p in partitions {
                    give(cluster, r, home, p)?;
                }
            }
            return Ok(());
        }
        let l = hosts.gpus_per_host as usize;
        let mine: Vec<u32> = held[self.first..self.first + l]
            .iter()
            .flatten()
            .copied()
            .collect();
        for p in home.stored() {
            if !mine.contains(&p) {
                give(cluster, 0, home, p)?;
            }
        }
        let resident: Vec<u32> = self
            .workers
            .iter()
            .flat_map(|w| w.trainer.resident())
            .collect();
        let stored = home.stored();
        let need: Vec<u32> = mine
            .into_iter()
            .filter(|p| !resident.contains(p) && !stored.contains(p))
            .collect();
        send(
            cluster,
            0,
            LAYOUT,
            &LayOut::Need {
                partitions: need.clone(),
            },
            &[],
        )?;
        for _ in &need {
            match recv::<LayOut>(cluster, LAYOUT, 0, "lay-out")? {
                (LayOut::Give { partition, rows }, raw) => keep(home, partition, rows, &raw)?,
                _ => return Err(hosts.unexpected(0, "a partition")),
            }
        }
        Ok(())
    }

    /// Host 0: partition `p`'s rows from worker `g` on another host, a piece at a time.
    pub(super) fn stream_remote(
        &mut self,
        p: u32,
        g: usize,
        f: &mut RowSink<'_>,
    ) -> Result<(), TrainError> {
        let hosts = self.hosts.as_ref().expect("on hosts");
        let host = (g / hosts.gpus_per_host as usize) as u32;
        send(
            &hosts.cluster,
            host,
            COMMANDS,
            &Command::Stream { partition: p },
            &[],
        )?;
        // Every piece is read, even after `f` failed, so that the next stream starts clean.
        let mut result = Ok(());
        loop {
            let (piece, raw) = recv::<Piece>(&hosts.cluster, ROWS, host, "partition's rows")?;
            if piece.last {
                return result;
            }
            if result.is_ok() {
                result = f(
                    &floats(&raw, 0, piece.emb),
                    &floats(&raw, 4 * piece.emb, piece.state),
                )
                .map_err(TrainError::Sink);
            }
        }
    }

    /// Another host: streams partition `p` (one of its workers holds it) to host 0.
    fn serve_stream(&mut self, p: u32) -> Result<(), TrainError> {
        let cluster = self.hosts.as_ref().expect("on hosts").cluster.clone();
        let holder = self
            .workers
            .iter_mut()
            .find(|w| w.trainer.resident().contains(&p))
            .ok_or_else(|| {
                TrainError::Resume(format!(
                    "host 0 asked {} for partition {p}, which none of its workers holds",
                    cluster.host(cluster.rank())
                ))
            })?;
        holder.trainer.stream_partition(p, &mut |emb, state| {
            let piece = Piece {
                emb: emb.len(),
                state: state.len(),
                last: false,
            };
            send(
                &cluster,
                0,
                ROWS,
                &piece,
                &[bytemuck::cast_slice(emb), bytemuck::cast_slice(state)],
            )
            .map_err(Into::into)
        })?;
        let end = Piece {
            emb: 0,
            state: 0,
            last: true,
        };
        send(&cluster, 0, ROWS, &end, &[])
    }
}

/// Every host's degree counts summed (through host 0).
fn sum_degrees(cluster: &Cluster, mut degrees: Vec<u32>) -> Result<Vec<u32>, TrainError> {
    if cluster.is_leader() {
        for r in 1..cluster.hosts() {
            let counts = cluster.recv(DEGREES, r, None, "degree counts")?;
            if counts.len() != 4 * degrees.len() {
                let reason = format!(
                    "{} counted degrees of {} entities, host 0 of {}",
                    cluster.host(r),
                    counts.len() / 4,
                    degrees.len()
                );
                cluster.fail(reason.clone());
                return Err(ClusterError::Failed(reason).into());
            }
            let theirs: Vec<u32> = bytemuck::pod_collect_to_vec(&counts);
            for (d, t) in degrees.iter_mut().zip(theirs) {
                *d += t;
            }
        }
        for r in 1..cluster.hosts() {
            cluster.send(r, DEGREES, &[bytemuck::cast_slice(&degrees)])?;
        }
        Ok(degrees)
    } else {
        cluster.send(0, DEGREES, &[bytemuck::cast_slice(&degrees)])?;
        let all = cluster.recv(DEGREES, 0, None, "degree counts")?;
        Ok(bytemuck::pod_collect_to_vec(&all))
    }
}

/// The links of this host's `local` CPU workers (schedule indices `first ..`) among `k`:
/// channels to this host's, the job's connections to the others' (a thread a worker and
/// remote host puts what arrives on the channel the link reads).
fn cpu_links(cluster: &Cluster, k: usize, first: usize, local: usize) -> Vec<Box<dyn Link>> {
    let per_host = local;
    let mut senders: Vec<Vec<mpsc::Sender<Message>>> = Vec::with_capacity(local);
    let mut receivers: Vec<Vec<mpsc::Receiver<Message>>> = Vec::with_capacity(local);
    for _ in 0..local {
        let (tx, rx): (Vec<_>, Vec<_>) = (0..k).map(|_| mpsc::channel()).unzip();
        senders.push(tx);
        receivers.push(rx);
    }
    for (i, to_me) in senders.iter().enumerate() {
        let g = first + i;
        for host in (0..cluster.hosts()).filter(|&x| x != cluster.rank()) {
            let (cluster, to_me) = (cluster.clone(), to_me.clone());
            std::thread::Builder::new()
                .name(format!("legend-recv-{g}-{host}"))
                .spawn(move || receive_handed(&cluster, g, host, per_host, &to_me))
                .expect("spawning a receiving thread");
        }
    }
    (0..local)
        .zip(receivers)
        .map(|(i, from)| {
            let me = first + i;
            let to = (0..k)
                .map(|peer| {
                    if (first..first + local).contains(&peer) {
                        PeerSender::Local(senders[peer - first][me].clone())
                    } else {
                        let cluster = cluster.clone();
                        let host = (peer / per_host) as u32;
                        PeerSender::Remote(Box::new(move |m: &Message| {
                            // A failure fails the job: every host's waits end.
                            let _ = send_handed(&cluster, host, me, peer, m);
                        }))
                    }
                })
                .collect();
            Box::new(ChannelLink::new(me, to, from)) as Box<dyn Link>
        })
        .collect()
}

/// Sends CPU worker `me`'s message `m` to worker `peer` on `host`.
fn send_handed(
    cluster: &Cluster,
    host: u32,
    me: usize,
    peer: usize,
    m: &Message,
) -> Result<(), TrainError> {
    let (head, raw): (HandedOver, [&[u8]; 2]) = match m {
        Message::Partition(rows) => (
            HandedOver::Partition {
                from: me,
                partition: rows.id,
                emb: rows.emb.len(),
            },
            [
                bytemuck::cast_slice(&rows.emb),
                bytemuck::cast_slice(&rows.state),
            ],
        ),
        Message::Relations(sums) => (
            HandedOver::Relations {
                from: me,
                width: sums.width,
                grads: sums.grads.len(),
            },
            [
                bytemuck::cast_slice(&sums.grads),
                bytemuck::cast_slice(&sums.positives),
            ],
        ),
    };
    send(cluster, host, PARTITIONS + peer as u32, &head, &raw)
}

/// Puts what CPU workers of `host` send local worker `g` on its channels (`to_me`, by
/// sending worker), until the job ends; a message that does not fit fails the job.
fn receive_handed(
    cluster: &Cluster,
    g: usize,
    host: u32,
    per_host: usize,
    to_me: &[mpsc::Sender<Message>],
) {
    // Ends with the job (finished or failed).
    while let Ok((head, raw)) =
        recv::<HandedOver>(cluster, PARTITIONS + g as u32, host, "hand-over")
    {
        let (from, message) = match head {
            HandedOver::Partition {
                from,
                partition,
                emb,
            } if 4 * emb <= raw.len() && raw.len() % 4 == 0 => {
                let state = (raw.len() - 4 * emb) / 4;
                let rows = Partition {
                    id: partition,
                    emb: floats(&raw, 0, emb),
                    state: floats(&raw, 4 * emb, state),
                };
                (from, Message::Partition(rows))
            }
            HandedOver::Relations { from, width, grads }
                if width > 0 && grads % width == 0 && raw.len() == 4 * (grads + grads / width) =>
            {
                let sums = RelationGradients {
                    width,
                    grads: floats(&raw, 0, grads),
                    positives: bytemuck::pod_collect_to_vec(&raw[4 * grads..]),
                };
                (from, Message::Relations(Arc::new(sums)))
            }
            _ => {
                cluster.fail(format!(
                    "{} sent worker {g} a hand-over of the wrong size",
                    cluster.host(host)
                ));
                return;
            }
        };
        if from / per_host != host as usize || from >= to_me.len() {
            cluster.fail(format!(
                "{} sent worker {g} a hand-over from worker {from}, not one of its own",
                cluster.host(host)
            ));
            return;
        }
        if to_me[from].send(message).is_err() {
            // The worker is gone (its epoch failed): the job fails with its error.
            return;
        }
    }
}

/// A host other than host 0 for the whole job: receives the job from host 0, sets its workers
/// up on `engines` (which `Engine::open_all` opens for the job's configuration) and the
/// dataset at `dataset` (host 0's path when `None`), then trains, streams and settles as host 0
/// says until it ends the job. Returns whether the job stopped as asked (`true`) or completed.
/// `stop` (raised by a signal here) asks host 0 to stop the job at its next round. Any failure
/// here fails the job on every host, named.
pub fn follow(
    cluster: Cluster,
    dataset: Option<&Path>,
    stop: Arc<AtomicBool>,
) -> Result<bool, TrainError> {
    cluster.watch_stop(stop.clone());
    let result = serve(&cluster, dataset, &stop);
    match &result {
        Ok(stopped) => cluster.finish(*stopped),
        Err(e) if cluster.failure().is_none() => cluster.fail(format!(
            "{} failed: {}",
            cluster.host(cluster.rank()),
            crate::error_chain::with_sources(e)
        )),
        Err(_) => {}
    }
    result
}

fn serve(cluster: &Cluster, dataset: Option<&Path>, stop: &AtomicBool) -> Result<bool, TrainError> {
    let (job, raw) = recv::<Job>(cluster, COMMANDS, 0, "job")?;
    let config = Config::parse(&job.config, &[])?;
    let path = dataset.unwrap_or(&job.dataset);
    let mismatch = |why: String| TrainError::Hosts(ClusterError::Mismatch(why));
    let dataset = Dataset::open(path)
        .map_err(|e| mismatch(format!("cannot open the dataset {}: {e}", path.display())))?;
    let identity = format!("{:032x}", dataset.meta().identity());
    if identity != job.dataset_identity {
        return Err(mismatch(format!(
            "its dataset {} is not host 0's (dataset identity {identity} here, {} on host 0): every host needs the same dataset",
            path.display(),
            job.dataset_identity
        )));
    }
    tracing::info!(
        "{}: training with host 0 on {}",
        cluster.host(cluster.rank()),
        path.display()
    );
    let engines = Engine::open_all(&config)?;
    let n = job.relation_floats;
    if raw.len() != 8 * n {
        return Err(TrainError::Hosts(ClusterError::Failed(format!(
            "host 0 sent {} bytes of relation tables, not the {} of {n} floats and their state",
            raw.len(),
            8 * n
        ))));
    }
    let relations = Relations {
        emb: floats(&raw, 0, n),
        state: floats(&raw, 4 * n, n),
    };
    let home = MemoryStore::new(config.storage.dtype);
    let mut workers = Workers::join_hosts(
        &config,
        &dataset,
        home,
        relations,
        engines,
        cluster.clone(),
        job.nccl_id,
    )?;
    loop {
        let command = match recv::<Command>(cluster, COMMANDS, 0, "command") {
            Ok((c, _)) => c,
            Err(TrainError::Hosts(ClusterError::Finished { stopped })) => return Ok(stopped),
            Err(e) => return Err(e),
        };
        match command {
            Command::Epoch {
                epoch,
                from,
                learning_rate,
            } => {
                workers.set_learning_rate(learning_rate);
                let part = workers.run_part(epoch, from, stop, &mut |_| {})?;
                send(cluster, 0, COMMANDS, &Reply::Epoch(part), &[])?;
            }
            Command::Stream { partition } => workers.serve_stream(partition)?,
            Command::Settle => {
                workers.settle_here()?;
                send(cluster, 0, COMMANDS, &Reply::Settled, &[])?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_deadlines_are_four_planned_rounds_and_at_least_a_minute() {
        assert_eq!(round_deadline(100, 0), UNMEASURED_ROUND_DEADLINE);
        // 100 batches of 1 ms: 0.1 s planned, the floor.
        assert_eq!(round_deadline(100, 1_000_000), ROUND_DEADLINE_FLOOR);
        // 10,000 batches of 10 ms: 100 s planned, 400 s.
        assert_eq!(round_deadline(10_000, 10_000_000), Duration::from_secs(400));
    }
}
