//! `legendctl train`.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use legend_dataset::{Dataset, Split};
use legend_engine::file_store::{
    FileStore, FileStoreSpec, SharedFileStore, decode_progress, encode_progress, encode_relations,
};
use legend_engine::run::{self, RunMeta, TableChecksums};
use legend_engine::{Config, Device, MemoryStore, PartitionBuffer, Relations, Trainer};
use legend_eval::SampledNegatives;

use super::eval::{EvalRequest, describe, evaluate, open_run_dataset};

/// Arguments of `legendctl train`.
#[derive(clap::Args)]
pub struct Args {
    /// The dataset directory (from `legendctl import`); with --resume, defaults to the run's.
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// The run directory to create (or to continue with --resume).
    #[arg(long)]
    out: PathBuf,
    /// Configuration file (TOML); every key has a default.
    config: Option<PathBuf>,
    /// Override a configuration key, e.g. `--set model.dim=100` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long)]
    resume: bool,
    /// Print one JSON object per epoch, and the final evaluation, on stdout.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // Everything that can be wrong with the inputs is checked before the run directory exists.
    let (config, dataset, resumed) = if args.resume {
        let meta = run::read_meta(&args.out)
            .context("--resume needs a run directory with a checkpoint")?;
        let text = std::fs::read_to_string(args.out.join("config.toml"))
            .with_context(|| format!("{}/config.toml", args.out.display()))?;
        if args.config.is_some() {
            bail!("--resume continues with the run's own config.toml; change keys with --set");
        }
        let config = Config::parse(&text, &args.sets)?;
        let dataset = open_run_dataset(&meta, args.dataset.as_deref())?;
        (config, dataset, Some(meta))
    } else {
        let Some(dir) = &args.dataset else {
            bail!("--dataset DIR is required (or --resume an existing run)");
        };
        let text = match &args.config {
            Some(p) => {
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
            }
            None => String::new(),
        };
        let config = Config::parse(&text, &args.sets).with_context(|| match &args.config {
            Some(p) => format!("{}", p.display()),
            None => "configuration".into(),
        })?;
        if args.out.exists() && std::fs::read_dir(&args.out)?.next().is_some() {
            bail!(
                "{} already exists; choose another --out or continue it with --resume",
                args.out.display()
            );
        }
        (config, Dataset::open(dir)?, None)
    };
    // Opening the device is the last check: a GPU asked for and missing fails here.
    let device = Device::open(&config)?;
    tracing::info!("device: {}", device.describe());
    let created = resumed.is_none() && !args.out.exists();
    let result = train(&args, &config, &dataset, resumed, device);
    if result.is_err() && created && !meta_exists(&args.out) {
        // Nothing was committed: leave no half-made run directory behind.
        let _ = std::fs::remove_dir_all(&args.out);
    }
    result
}

fn meta_exists(run: &Path) -> bool {
    run::meta_path(run).exists()
}

fn train(
    args: &Args,
    config: &Config,
    dataset: &Dataset,
    resumed: Option<RunMeta>,
    device: Device,
) -> anyhow::Result<()> {
    let meta_ds = dataset.meta();
    let decoder = config.decoder();
    let dim = config.model.dim;
    if !meta_ds.has_relations && decoder.uses_relations() {
        tracing::warn!(
            "the dataset has no relation types; {decoder} learns one relation for all edges"
        );
    }
    let buckets = dataset.buckets(config.storage.num_partitions)?;
    let scheme = buckets.scheme();
    let degrees = legend_dataset::degrees(meta_ds.entities as usize, buckets.edges());
    let init = config.init();
    let relation_floats = if decoder.uses_relations() {
        meta_ds.relations as usize * dim
    } else {
        0
    };
    let fresh_relations = || Relations::init(decoder, meta_ds.relations as usize, dim, &init);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    run::write_atomically(&args.out.join("config.toml"), config.to_toml().as_bytes())?;
    let mut meta = resumed.unwrap_or_else(|| RunMeta {
        format_version: run::RUN_FORMAT_VERSION,
        dataset: std::fs::canonicalize(dataset.dir()).unwrap_or_else(|_| dataset.dir().to_owned()),
        dataset_identity: format!("{:032x}", meta_ds.identity()),
        decoder: decoder.name().into(),
        dim,
        entities: meta_ds.entities,
        relations: if decoder.uses_relations() {
            meta_ds.relations
        } else {
            0
        },
        epochs_completed: 0,
        checkpoint: String::new(),
        store: None,
        store_queue: None,
        checksums: TableChecksums::default(),
    });
    // A store behind NVMe queues, trained on a GPU: the GPU I/O kernels move the swaps.
    let mut direct = None;
    let gpu_engine = matches!(device, Device::Cuda { .. });
    let (buffer, relations, start_epoch) = if config.uses_store() {
        let queue = meta.store_queue.or(config.queue_location());
        let path = match &meta.store {
            Some(p) => p.clone(),
            None => config.store_path(&std::fs::canonicalize(&args.out)?),
        };
        let spec = FileStoreSpec {
            path: &path,
            dataset: run::dataset_id(&meta.dataset_identity, &path)?,
            num_nodes: meta_ds.entities,
            dim,
            num_partitions: scheme.num_partitions,
            aux_bytes: (relation_floats * 8) as u64,
            force: config.storage.force,
            queue,
        };
        let mut store = if meta.store.is_some() {
            FileStore::open(&spec)?
        } else {
            let store = FileStore::create(&spec)?;
            // From here on the run's commit record is the store's superblock.
            meta.store = Some(std::fs::canonicalize(&path)?);
            meta.store_queue = queue;
            run::write_atomically(
                &run::meta_path(&args.out),
                toml::to_string_pretty(&meta)?.as_bytes(),
            )?;
            store
        };
        let epochs_done = decode_progress(store.progress())?;
        let relations = match store.aux(relation_floats * 8)? {
            Some(bytes) if epochs_done > 0 => {
                let all: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
                let (emb, state) = all.split_at(relation_floats);
                Relations {
                    emb: emb.to_vec(),
                    state: state.to_vec(),
                }
            }
            _ => fresh_relations(),
        };
        let buffer = match store.controller().cloned() {
            Some(controller) if gpu_engine => {
                let shared = SharedFileStore::new(store);
                direct = Some((shared.clone(), controller));
                PartitionBuffer::new(scheme, dim, init, shared)
            }
            _ => PartitionBuffer::new(scheme, dim, init, store),
        };
        (buffer, relations, epochs_done)
    } else if !meta.checkpoint.is_empty() {
        let t = run::load_tables(&args.out, &meta)?;
        let store = MemoryStore::from_tables(scheme, dim, &t.entities, &t.entities_state);
        let relations = Relations {
            emb: t.relations,
            state: t.relations_state,
        };
        let buffer = PartitionBuffer::new(scheme, dim, init, store);
        (buffer, relations, meta.epochs_completed)
    } else {
        let buffer = PartitionBuffer::new(scheme, dim, init, MemoryStore::default());
        (buffer, fresh_relations(), 0)
    };
    let engine = device.describe();
    let mut trainer = Trainer::on_device(config, buckets, &degrees, buffer, relations, device)?;
    if let Some((store, controller)) = &direct {
        trainer.use_direct_io(store, controller)?;
    }
    let epochs = config.training.num_epochs;
    if start_epoch >= epochs {
        bail!(
            "the run already has {start_epoch} epochs; raise training.num_epochs with --set to continue"
        );
    }
    let plan = trainer.plan();
    tracing::info!(
        "training {decoder} d={dim} on {} ({} entities, {} relations, {} train edges); engine {engine}, {} backend, {} partitions, buffer {}, order {} ({} buffer states per epoch)",
        dataset.dir().display(),
        meta_ds.entities,
        meta_ds.relations,
        meta_ds.splits.train,
        config.storage.backend,
        scheme.num_partitions,
        config.capacity(),
        config.storage.order,
        plan.io_count
    );
    let mut metrics = OpenOptions::new()
        .create(true)
        .append(true)
        .open(args.out.join("metrics.jsonl"))
        .context("opening metrics.jsonl")?;
    for epoch in start_epoch + 1..=epochs {
        let bar = ProgressBar::new(meta_ds.splits.train);
        bar.set_style(
            ProgressStyle::with_template(
                "epoch {prefix:>4} [{bar:30}] {pos}/{len} edges {per_sec} eta {eta}",
            )
            .expect("static template")
            .progress_chars("=> "),
        );
        bar.set_prefix(format!("{epoch}/{epochs}"));
        let report = trainer.run_epoch(epoch, &mut |done| bar.set_position(done))?;
        bar.finish_and_clear();
        let mut line = serde_json::to_value(&report)?;
        if config.evaluation.epochs_per_eval > 0
            && epoch % config.evaluation.epochs_per_eval == 0
            && meta_ds.splits.valid > 0
        {
            let m = evaluate_now(&mut trainer, dataset, config, Split::Valid)?;
            tracing::info!("epoch {epoch} valid: {}", describe(&m));
            line["valid"] = serde_json::to_value(&m)?;
        }
        tracing::info!(
            "epoch {epoch}/{epochs}: loss {:.4}, {:.0} edges/s ({} negatives per positive and side), {:.2} s",
            report.loss,
            report.edges_per_sec,
            report.negatives_per_positive,
            report.seconds
        );
        writeln!(metrics, "{line}")?;
        if args.json {
            super::print_json(&line)?;
        }
        let every = config.training.checkpoint_every;
        if epoch == epochs || (every > 0 && epoch % every == 0) {
            meta.epochs_completed = epoch;
            meta = checkpoint(&args.out, meta, &mut trainer)?;
        }
    }
    let split = config.evaluation.split.split();
    if dataset.meta().splits.get(split) == 0 {
        tracing::warn!("no {} edges: skipping the final evaluation", split.name());
        return Ok(());
    }
    let m = evaluate_now(&mut trainer, dataset, config, split)?;
    let final_line = serde_json::json!({ "final": true, "split": split.name(), "metrics": m });
    writeln!(metrics, "{final_line}")?;
    if args.json {
        super::print_json(&final_line)?;
    } else {
        println!("{} {}: {}", args.out.display(), split.name(), describe(&m));
    }
    Ok(())
}

/// Evaluates the current parameters on `split` as `[evaluation]` says. Ranking needs the whole
/// entity table in memory.
fn evaluate_now(
    trainer: &mut Trainer,
    dataset: &Dataset,
    config: &Config,
    split: Split,
) -> anyhow::Result<legend_eval::Metrics> {
    let dim = config.model.dim;
    let (entities, _) = gather_entities(trainer, dim)?;
    let request = EvalRequest {
        protocol: config.evaluation.protocol.name(),
        split,
        negatives: SampledNegatives {
            uniform: config.evaluation.uniform_negatives,
            degree: config.evaluation.degree_negatives,
            seed: config.evaluation.seed,
        },
        threads: config.training.threads,
    };
    evaluate(
        dataset,
        config.decoder(),
        dim,
        &entities,
        &trainer.relations().emb,
        &request,
    )
}

/// The whole entity table and its state, partition by partition.
fn gather_entities(trainer: &mut Trainer, dim: usize) -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
    trainer.sync_host()?;
    let buffer = trainer.buffer();
    let scheme = buffer.scheme();
    let mut emb = Vec::with_capacity(scheme.entities as usize * dim);
    let mut state = Vec::with_capacity(scheme.entities as usize * dim);
    for p in 0..scheme.num_partitions {
        let part = buffer.read_partition(p)?;
        emb.extend_from_slice(&part.emb);
        state.extend_from_slice(&part.state);
    }
    Ok((emb, state))
}

fn checkpoint(out: &Path, meta: RunMeta, trainer: &mut Trainer) -> anyhow::Result<RunMeta> {
    trainer.sync_host()?;
    let relations = trainer.relations().clone();
    let buffer = trainer.buffer();
    let aux = encode_relations(&relations.emb, &relations.state);
    if buffer.checkpoint(encode_progress(meta.epochs_completed), aux)? {
        // The store committed; run.toml only mirrors the epoch count for people.
        run::write_atomically(
            &run::meta_path(out),
            toml::to_string_pretty(&meta)?.as_bytes(),
        )?;
        return Ok(meta);
    }
    let meta = run::commit_checkpoint(out, meta, (&relations.emb, &relations.state), |e, s| {
        for p in 0..buffer.scheme().num_partitions {
            let part = buffer
                .read_partition(p)
                .map_err(|err| run::RunError::Invalid {
                    path: out.to_owned(),
                    message: err.to_string(),
                })?;
            e.write(&part.emb)?;
            s.write(&part.state)?;
        }
        Ok(())
    })?;
    tracing::debug!("checkpoint {} committed", meta.checkpoint);
    Ok(meta)
}
