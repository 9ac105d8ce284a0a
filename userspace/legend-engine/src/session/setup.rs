//! Creating a run or resuming one: its directory, store, engine and trainer, each refusal
//! before anything is written.

use std::path::Path;
use std::time::Instant;

use legend_dataset::{Dataset, PartitionScheme};
use legend_fs::{Dir, Guard};

use crate::config::Config;
use crate::engine::Engine;
use crate::error::TrainError;
use crate::progress::BATCH_KEYS_VERSION;
use crate::relations::Relations;
use crate::restore::{CheckpointRows, TableReader};
use crate::run::RunMeta;
use crate::schedule::ValidHistory;
use crate::store::controllers::SharedController;
use crate::store::{FileStore, FileStoreSpec, MemberFile, MemoryStore, PartitionHome};
use crate::trainer::Trainer;
use crate::training::Training;
use crate::workers::Workers;
use crate::{evaluation, footprint, incremental, run};

use super::metrics::{keep_metrics_up_to, metrics_lines};
use super::{Position, Session, SessionError, io_error, write_meta};

impl Session {
    /// Creates the run `out` (which must not exist, or be an empty directory; its parent must
    /// exist) training `config` on the dataset in `dataset`. Everything that can be refused
    /// (configuration, plan, dataset, device, store target) is checked before the directory
    /// appears; after that the directory is always resumable. `guard` admits the directories
    /// opened by path (`out`'s parent, a store's outside the run) and adopts the new run
    /// directory; every file is then reached beneath them (legend-fs).
    pub fn create(
        out: &Path,
        dataset: &Path,
        config: Config,
        guard: &dyn Guard,
    ) -> Result<Session, SessionError> {
        Session::create_on(out, dataset, config, guard, None)
    }

    /// [`Session::create`] as host 0 of a job on several hosts (`hosts`, joined: the other
    /// hosts follow, `crate::workers::hosts::follow`); one host with `None`.
    pub fn create_on(
        out: &Path,
        dataset: &Path,
        config: Config,
        guard: &dyn Guard,
        hosts: Option<legend_cluster::Cluster>,
    ) -> Result<Session, SessionError> {
        Session::create_with(out, dataset, config, guard, hosts, None)
    }

    /// [`Session::create`] seeded from the run `init` (`legendctl train --init-from`): its
    /// rows and relations carried over, `dataset` an extension of the one it trained on
    /// (see [`crate::incremental`]). Refused, before anything is written, when the run's model
    /// differs, the dataset does not extend its, or a process trains it now.
    pub fn create_from(
        out: &Path,
        dataset: &Path,
        config: Config,
        guard: &dyn Guard,
        init: &Path,
    ) -> Result<Session, SessionError> {
        Session::create_with(out, dataset, config, guard, None, Some(init))
    }

    fn create_with(
        out: &Path,
        dataset: &Path,
        config: Config,
        guard: &dyn Guard,
        hosts: Option<legend_cluster::Cluster>,
        init: Option<&Path>,
    ) -> Result<Session, SessionError> {
        let joined = hosts.as_ref().map_or(1, legend_cluster::Cluster::hosts);
        if config.training.hosts != joined {
            return Err(SessionError::Refused(format!(
                "training.hosts = {} but the run starts on {joined} host(s): the launch sets it (legendctl train --hosts, torchrun or Slurm)",
                config.training.hosts
            )));
        }
        if out.exists()
            && std::fs::read_dir(out)
                .map_err(io_error(out))?
                .next()
                .is_some()
        {
            return Err(SessionError::Refused(format!(
                "{} already exists; choose another --out or continue it with --resume",
                out.display()
            )));
        }
        config.check_new_run()?;
        legend_planner::plan(
            config.storage.num_partitions,
            config.capacity(),
            config.order(),
        )
        .map_err(TrainError::from)?;
        let dataset = Dataset::open_checked(dataset, guard.read_check())?;
        let init = init
            .map(|init| incremental::check_init_run(init, &config, &dataset))
            .transpose()?;
        let device = Engine::open_all(&config)?;
        check_memory(&config, dataset.meta(), &device[0], false)?;
        let meta = RunMeta {
            init_from: init,
            ..new_meta(&config, &dataset)
        };
        let (parent, name) = Dir::open_parent(out).map_err(io_error(out))?;
        guard.admit(&parent).map_err(io_error(parent.path()))?;
        let run = assemble_run_dir(&parent, name, out, &config, &meta, guard)?;
        // Nothing is trained until the session starts: a refusal on the way (a store target
        // that holds a file system, say) takes the new directory away again.
        Session::start(run, config, dataset, meta, device, guard, hosts).inspect_err(|_| {
            let _ = parent.remove_all(name);
        })
    }

    /// Reopens the run `out` where its last checkpoint left it; `sets` change configuration
    /// keys (e.g. `training.num_epochs`), `dataset` names the dataset if it moved.
    /// `guard` admits the run directory and a store's outside it, as for [`Session::create`].
    pub fn resume(
        out: &Path,
        dataset: Option<&Path>,
        sets: &[String],
        guard: &dyn Guard,
    ) -> Result<Session, SessionError> {
        Self::resume_expecting(out, dataset, sets, guard, &|_| Ok(()))
    }

    /// [`Session::resume`] as host 0 of a job on several hosts (see [`Session::create_on`]).
    pub fn resume_on(
        out: &Path,
        dataset: Option<&Path>,
        sets: &[String],
        guard: &dyn Guard,
        hosts: Option<legend_cluster::Cluster>,
    ) -> Result<Session, SessionError> {
        Self::resume_with(out, dataset, sets, guard, &|_| Ok(()), hosts)
    }

    /// [`Session::resume`], refusing the run when `expect` refuses its record `run.toml`, read
    /// once: the store it names is opened only after `expect` accepted it (a service checks
    /// it against what it recorded when the job was submitted, so that an edit of the record
    /// in between cannot point the job at another store or extent).
    pub fn resume_expecting(
        out: &Path,
        dataset: Option<&Path>,
        sets: &[String],
        guard: &dyn Guard,
        expect: &dyn Fn(&RunMeta) -> Result<(), String>,
    ) -> Result<Session, SessionError> {
        Self::resume_with(out, dataset, sets, guard, expect, None)
    }

    fn resume_with(
        out: &Path,
        dataset: Option<&Path>,
        sets: &[String],
        guard: &dyn Guard,
        expect: &dyn Fn(&RunMeta) -> Result<(), String>,
        hosts: Option<legend_cluster::Cluster>,
    ) -> Result<Session, SessionError> {
        let not_a_run = || {
            SessionError::Refused(format!(
                "{} is not a run directory (no run.toml): nothing to resume",
                out.display()
            ))
        };
        let run = match Dir::open(out) {
            Ok(run) => run,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(not_a_run()),
            Err(e) => return Err(io_error(out)(e)),
        };
        guard.admit(&run).map_err(io_error(out))?;
        // The directory is the submitter's; what is read in it must be theirs to read too.
        let run = run.reading_as(guard.read_check());
        if !run.is_file(run::META_FILE).map_err(io_error(out))? {
            return Err(not_a_run());
        }
        let meta = run::read_meta(&run)?;
        expect(&meta).map_err(|why| {
            SessionError::Refused(format!("{}: {why}", run.join(run::META_FILE).display()))
        })?;
        let config_path = run.join(run::CONFIG_FILE);
        let text = run
            .read_to_string(run::CONFIG_FILE)
            .map_err(io_error(&config_path))?;
        // The hosts it resumes on, whatever the run last trained on.
        let joined = hosts.as_ref().map_or(1, legend_cluster::Cluster::hosts);
        let mut sets = sets.to_vec();
        sets.push(format!("training.hosts={joined}"));
        let config = Config::parse_recorded(&text, &sets)?;
        let dataset = evaluation::open_run_dataset(&meta, dataset, guard)?;
        let device = Engine::open_all(&config)?;
        check_memory(&config, dataset.meta(), &device[0], true)?;
        let session = Session::start(run, config, dataset, meta, device, guard, hosts)?;
        // The keys changed with `sets` hold from now on.
        run::write_atomically(
            &session.run,
            run::CONFIG_FILE,
            session.config.to_toml().as_bytes(),
        )?;
        Ok(session)
    }

    fn start(
        run: Dir,
        mut config: Config,
        dataset: Dataset,
        mut meta: RunMeta,
        mut device: Vec<Engine>,
        guard: &dyn Guard,
        hosts: Option<legend_cluster::Cluster>,
    ) -> Result<Session, SessionError> {
        let meta_ds = dataset.meta();
        let decoder = config.decoder();
        check_tables_match(&config, &meta)?;
        if !meta_ds.has_relations && decoder.uses_relations() {
            tracing::warn!(
                "the dataset has no relation types; {decoder} learns one relation for all edges"
            );
        }
        check_seeding(&config, &meta, &device, hosts.is_some())?;
        config.frozen = incremental::frozen(&config, meta.init_from.as_ref(), &dataset);
        let started = Instant::now();
        let scheme = dataset.scheme(config.storage.num_partitions)?;
        let selected = match &meta.init_from {
            Some(init) => incremental::selected_edges(&config, init, &dataset)?,
            None => None,
        };
        let epoch_edges = selected
            .as_ref()
            .map_or(meta_ds.splits.train, |e| e.len() as u64);
        // On several hosts each reads its own buckets (workers::hosts), not every edge here.
        let edges = match hosts {
            Some(_) => None,
            None => {
                let buckets = match selected {
                    Some(edges) => legend_dataset::Buckets::build(edges, scheme),
                    None => dataset.buckets(config.storage.num_partitions)?,
                };
                let degrees = legend_dataset::degrees(meta_ds.entities as usize, buckets.edges());
                tracing::info!(
                    "set-up: {} train edges loaded into {} buckets and entity degrees counted in {:.1} s",
                    buckets.edges().len(),
                    buckets.counts().len(),
                    started.elapsed().as_secs_f64()
                );
                Some((buckets, degrees))
            }
        };
        let engine = match device.as_slice() {
            [one] => one.describe(),
            all => format!("{} × {}", all.len(), all[0].describe()),
        };
        let Home {
            mut home,
            mut relations,
            position,
            device_health,
            checkpoint,
        } = if config.uses_store() {
            Home::in_store(&run, &config, &mut meta, scheme, guard)?
        } else {
            Home::in_memory(&run, &config, &meta, scheme, guard)?
        };
        // A seeded run that starts from its beginning (again, if it stopped before its first
        // checkpoint) carries the init run's rows over into its store.
        if let Some(init) = &meta.init_from
            && position == Position::default()
        {
            let store: &mut dyn crate::store::PartitionStore = match &mut home {
                PartitionHome::Memory(s) => s,
                PartitionHome::File(s) => s.as_mut(),
                PartitionHome::Shared(s) => s,
            };
            let carried;
            (relations, carried) =
                incremental::carry_over(run.path(), store, scheme, &config, &dataset, init, guard)?;
            tracing::info!(
                "set-up: carried over {} rows ({:.1} MB read) of {} (epoch {}) into {} partitions in {:.1} s ({:.0} MB/s); {} new rows, {} of them started from their neighbours' mean",
                carried.rows,
                carried.bytes_read as f64 / 1e6,
                init.tables.display(),
                init.epoch,
                carried.partitions,
                carried.seconds,
                carried.bytes_read as f64 / 1e6 / carried.seconds.max(1e-9),
                carried.new_rows,
                carried.from_neighbours
            );
        }
        let epochs = config.training.num_epochs;
        if position.epochs_completed > epochs
            || (position.epochs_completed == epochs && position.cut.is_some())
        {
            return Err(SessionError::Refused(format!(
                "the run has trained to {}; training.num_epochs = {epochs} would undo that (set at least {})",
                position.describe(),
                position.epochs_completed + u32::from(position.cut.is_some())
            )));
        }
        adopt_batch_keys(&mut meta, &position)?;
        let restored = checkpoint.is_some();
        let trainer = match (hosts, edges, home) {
            (Some(cluster), _, PartitionHome::Memory(mut store)) => {
                // Each host's store holds every partition, as on one host.
                if let Some(rows) = checkpoint {
                    store.restore(scheme, config.entity_shape(), rows)?;
                }
                Training::Workers(Box::new(Workers::on_hosts(
                    &config, &dataset, store, relations, device, cluster,
                )?))
            }
            (None, Some((buckets, degrees)), home) if device.len() == 1 => {
                let engine = device.pop().expect("one engine");
                let mut trainer =
                    Trainer::on_device(&config, buckets, &degrees, home, relations, engine)?;
                if let Some(rows) = checkpoint {
                    trainer.restore(rows)?;
                }
                Training::One(Box::new(trainer))
            }
            (None, Some((buckets, degrees)), PartitionHome::Memory(mut store)) => {
                // The workers take their partitions from the store: it holds them all.
                if let Some(rows) = checkpoint {
                    store.restore(scheme, config.entity_shape(), rows)?;
                }
                Training::Workers(Box::new(Workers::new(
                    &config, buckets, &degrees, store, relations, device,
                )?))
            }
            _ => unreachable!(
                "training.gpus or training.hosts > 1 keeps partitions in memory (its configuration says)"
            ),
        };
        tracing::info!(
            "set-up: the {engine} engine ready (edges and relations placed{}) in {:.1} s",
            if restored {
                ", the checkpoint's rows restored"
            } else {
                ""
            },
            started.elapsed().as_secs_f64()
        );
        keep_metrics_up_to(&run, position.epochs_completed)?;
        let history = ValidHistory::replay(&metrics_lines(&run)?, &config);
        Ok(Session {
            run,
            config,
            dataset,
            trainer,
            meta,
            position,
            engine,
            device_health,
            history,
            epoch_edges,
        })
    }
}

/// Where a run's partitions live between swaps, with the relations and the position it
/// starts from.
struct Home {
    home: PartitionHome,
    relations: Relations,
    position: Position,
    /// The SMART logs of the `nvme` backend's controllers.
    device_health: Vec<legend_nvme::Health>,
    /// A memory-backend checkpoint to restore once the trainer's slots exist.
    checkpoint: Option<CheckpointRows>,
}

impl Home {
    /// The run's store: opened where the run recorded it, else created where `config` says
    /// (and recorded in `meta` from then on).
    fn in_store(
        run: &Dir,
        config: &Config,
        meta: &mut RunMeta,
        scheme: PartitionScheme,
        guard: &dyn Guard,
    ) -> Result<Home, SessionError> {
        let relation_floats = meta.relation_floats();
        let record = meta.store_record(run.path())?;
        let run_dir = std::fs::canonicalize(run.path()).map_err(io_error(run.path()))?;
        let members = meta
            .recorded_members()
            .unwrap_or_else(|| config.store_members(&run_dir));
        let path = members[0].path.clone();
        let files = members
            .iter()
            .map(|m| MemberFile::of_run(run, &run_dir, m, guard))
            .collect::<Result<Vec<_>, _>>()?;
        let spec = FileStoreSpec {
            members: &files,
            stripe_bytes: config.storage.stripe_bytes,
            dataset: run::dataset_id(&meta.dataset_identity, &path)?,
            num_nodes: scheme.entities,
            shape: config.entity_shape(),
            num_partitions: scheme.num_partitions,
            aux_bytes: (relation_floats * 8) as u64,
            store_id: record.store_id(),
            force: config.storage.force,
            proxy_model: config.proxy_model(),
        };
        let mut store = match record {
            run::StoreRecord::Made(_) => FileStore::open(&spec)?,
            run::StoreRecord::ToCreate(id) => {
                // The intent first: after a crash from here on, the resume makes the store
                // again, knowing its half-made members by `id` and nothing else by it.
                meta.record_store_intent(&members, id)?;
                write_meta(run, meta)?;
                let store = FileStore::create(&spec)?;
                // From here on the run's commit record is the store's superblock.
                meta.store_creating = false;
                write_meta(run, meta)?;
                store
            }
        };
        let position = Position::decode(store.progress())?;
        let device_health = store
            .queued_members()
            .iter()
            .filter_map(|m| read_health(&m.controller))
            .collect();
        let relations = match store.aux(relation_floats * 8)? {
            Some(bytes) if position != Position::default() => {
                let all: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
                let (emb, state) = all.split_at(relation_floats);
                Relations {
                    emb: emb.to_vec(),
                    state: state.to_vec(),
                }
            }
            _ => fresh_relations(config, meta),
        };
        Ok(Home {
            home: PartitionHome::File(Box::new(store)),
            relations,
            position,
            device_health,
            checkpoint: None,
        })
    }

    /// Host memory: the run's checkpoint when it has one (restored into where its rows go once
    /// the trainer exists, so that the tables are never in host memory twice), else fresh rows.
    fn in_memory(
        run: &Dir,
        config: &Config,
        meta: &RunMeta,
        scheme: PartitionScheme,
        guard: &dyn Guard,
    ) -> Result<Home, SessionError> {
        if meta.checkpoint.is_empty() {
            return Ok(Home {
                home: PartitionHome::Memory(MemoryStore::new(config.storage.dtype)),
                relations: fresh_relations(config, meta),
                position: Position::default(),
                device_health: Vec::new(),
                checkpoint: None,
            });
        }
        let position = Position {
            epochs_completed: meta.epochs_completed,
            cut: meta.cut,
        };
        if meta.store.is_none() {
            return Ok(Home {
                home: PartitionHome::Memory(MemoryStore::new(config.storage.dtype)),
                relations: Relations {
                    emb: TableReader::open(run, meta, 2)?.read_all()?,
                    state: TableReader::open(run, meta, 3)?.read_all()?,
                },
                position,
                device_health: Vec::new(),
                checkpoint: Some(CheckpointRows::open(run, meta)?),
            });
        }
        // The record names a store: the tables are read from it (through the guard, as its
        // owner would), whole, as a file-backend run's.
        let t = run::load_tables(run, meta, guard)?;
        let shape = config.entity_shape();
        Ok(Home {
            home: PartitionHome::Memory(MemoryStore::from_tables(
                scheme,
                shape,
                t.entities,
                t.entities_state,
            )),
            relations: Relations {
                emb: t.relations,
                state: t.relations_state,
            },
            position,
            device_health: Vec::new(),
            checkpoint: None,
        })
    }
}

/// A new run's relation rows, drawn by `config`'s initialisation.
fn fresh_relations(config: &Config, meta: &RunMeta) -> Relations {
    Relations::init(
        config.decoder(),
        meta.relations as usize,
        config.model.dim,
        &config.init(),
    )
}

/// The SMART log of an `nvme` store's controller (a warning, and nothing, if it cannot be
/// read: the run does not depend on it).
fn read_health(controller: &SharedController) -> Option<legend_nvme::Health> {
    match controller {
        SharedController::Device(d) => d
            .health()
            .inspect_err(|e| tracing::warn!("reading the controller's SMART log: {e}"))
            .ok(),
        SharedController::Proxy(_) => None,
    }
}

/// Refuses a run whose estimated peak host memory exceeds what the machine has (see
/// [`footprint::check_fits`]), before anything is allocated or written.
fn check_memory(
    config: &Config,
    dataset: &legend_dataset::DatasetMeta,
    device: &Engine,
    resuming: bool,
) -> Result<(), SessionError> {
    let Some(available) = footprint::available_bytes() else {
        tracing::warn!("cannot read the available memory; the run's memory is not checked");
        return Ok(());
    };
    let on_cuda = matches!(device, Engine::Cuda { .. });
    let estimate = footprint::check_fits(config, dataset, on_cuda, resuming, available)
        .map_err(|e| SessionError::Refused(e.0))?;
    tracing::info!(
        "host memory: about {:.1} GiB at the peak, {:.1} GiB available",
        footprint::gib(estimate.total()),
        footprint::gib(available)
    );
    Ok(())
}

/// Refuses what a seeded run (`--init-from`) cannot do, and its keys in a run that is not one.
fn check_seeding(
    config: &Config,
    meta: &RunMeta,
    device: &[Engine],
    on_hosts: bool,
) -> Result<(), SessionError> {
    let t = &config.training;
    let refuse = |why: &str| Err(SessionError::Refused(why.to_string()));
    let Some(_) = &meta.init_from else {
        if t.freeze != crate::config::Freeze::None || t.replay != 1.0 {
            return refuse(
                "training.freeze and training.replay choose what a run seeded with --init-from trains; this run starts from drawn rows (every row trains)",
            );
        }
        return Ok(());
    };
    if on_hosts {
        return refuse(
            "a run seeded with --init-from trains on one host (each host's store would need the carry-over)",
        );
    }
    if t.freeze != crate::config::Freeze::None
        && device.iter().any(|d| matches!(d, Engine::Cuda { .. }))
    {
        return refuse(
            "training.freeze = \"existing\" is honoured by the CPU engine only in this build (the GPU kernels step every row they touch): train it with training.device = \"cpu\", or without freezing",
        );
    }
    Ok(())
}

/// Refuses a configuration whose tables differ from the run's (a resume's `--set` of
/// `model.dim`, `model.decoder`, `storage.dtype` or `optimizer.state`): its checkpoint cannot
/// be read as them.
fn check_tables_match(config: &Config, meta: &RunMeta) -> Result<(), SessionError> {
    let recorded = meta.entity_shape();
    let mismatch = if config.model.dim != meta.dim {
        Some(format!(
            "model.dim = {} but the run's tables have {}",
            config.model.dim, meta.dim
        ))
    } else if config.decoder().name() != meta.decoder {
        Some(format!(
            "model.decoder = {} but the run trained {}",
            config.decoder(),
            meta.decoder
        ))
    } else if config.storage.dtype != recorded.dtype {
        Some(format!(
            "storage.dtype = {} but the run's rows are {}",
            config.storage.dtype, recorded.dtype
        ))
    } else if config.entity_shape() != recorded {
        let name = |width: usize| if width == meta.dim { "element" } else { "row" };
        Some(format!(
            "optimizer.state = {} but the run's state is {}-wise",
            config.optimizer.state,
            name(recorded.state)
        ))
    } else {
        None
    };
    match mismatch {
        Some(why) => Err(SessionError::Refused(format!(
            "{why}: a run keeps the tables it started with (start a new run to change them)"
        ))),
        None => Ok(()),
    }
}

/// Moves a run recorded with older batch keys to [`BATCH_KEYS_VERSION`] (a run from a newer
/// version is refused): it continues from `position` exactly where it stopped, cuts inside an
/// epoch included (they were all taken between buffer states), drawing with today's keys.
fn adopt_batch_keys(meta: &mut RunMeta, position: &Position) -> Result<(), SessionError> {
    if meta.batch_keys > BATCH_KEYS_VERSION {
        return Err(SessionError::Refused(format!(
            "the run was written with batch keys version {} and this build knows {BATCH_KEYS_VERSION}: resume it with the Legend that wrote it",
            meta.batch_keys
        )));
    }
    if meta.batch_keys < BATCH_KEYS_VERSION && *position != Position::default() {
        tracing::warn!(
            "the run was written before training keyed its random draws by bucket (run.toml has no batch_keys): it continues from {} with the new keys, so what it trains from here differs from what the version that started it would have trained (its checkpoints, evaluations and exports are unaffected)",
            position.describe()
        );
    }
    meta.batch_keys = BATCH_KEYS_VERSION;
    Ok(())
}

/// The commit record of a new run of `config` on `dataset`.
fn new_meta(config: &Config, dataset: &Dataset) -> RunMeta {
    let m = dataset.meta();
    let decoder = config.decoder();
    RunMeta {
        dataset: std::fs::canonicalize(dataset.dir()).unwrap_or_else(|_| dataset.dir().to_owned()),
        dataset_identity: format!("{:032x}", m.identity()),
        decoder: decoder.name().into(),
        dim: config.model.dim,
        entity_state_width: Some(config.entity_shape().state),
        entity_dtype: config.storage.dtype,
        entities: m.entities,
        relations: config.relation_rows(m.relations),
        reciprocal_relations: config.model.reciprocal_relations && decoder.uses_relations(),
        ..RunMeta::blank()
    }
}

/// Makes `name` in `parent` (the run `out`) with config.toml and run.toml in one rename, so
/// that it never exists without them; returns it, opened.
fn assemble_run_dir(
    parent: &Dir,
    name: &Path,
    out: &Path,
    config: &Config,
    meta: &RunMeta,
    guard: &dyn Guard,
) -> Result<Dir, SessionError> {
    let tmp_name = format!(
        ".{}.creating-{}",
        name.to_string_lossy(),
        std::process::id()
    );
    let tmp_path = parent.join(&tmp_name);
    parent.clear(&tmp_name).map_err(io_error(&tmp_path))?;
    let tmp = parent.create_dir(&tmp_name).map_err(io_error(&tmp_path))?;
    let assembled = guard
        .adopt(&tmp)
        .map_err(io_error(&tmp_path))
        .and_then(|()| {
            Ok(run::write_atomically(
                &tmp,
                run::CONFIG_FILE,
                config.to_toml().as_bytes(),
            )?)
        })
        .and_then(|()| write_meta(&tmp, meta))
        // An empty `out` is replaced; a non-empty one was refused before.
        .and_then(|()| parent.rename(&tmp_name, name).map_err(io_error(out)));
    match assembled {
        Ok(()) => Ok(tmp.with_path(out.to_owned())),
        Err(e) => {
            let _ = parent.remove_all(&tmp_name);
            Err(e)
        }
    }
}
