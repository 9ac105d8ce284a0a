//! `submit`: what a submission names is checked against what its submitter may touch, read as
//! they could (small records only, within a bound), and recorded as it stands now: its paths
//! normalised, its run by device and inode, the store its run names on a namespace (what the
//! job's process checks the run against when it starts), the device node it will hold.

use std::path::Path;

use legend_daemon_api::{ErrorCode, JobSpec, MAX_CONFIG_BYTES, Reply};
use legend_engine::Config;
use legend_engine::config::{Backend, DeviceChoice};

use super::{error, job_error};
use crate::access::{self, Peer};
use crate::extents::{self, RecordedStore};
use crate::jobs::estimate::{self, queue_of, train_config};
use crate::jobs::table::GPU_SET_QUEUE;
use crate::jobs::{Jobs, SERVE_QUEUE, Submission};
use crate::paths::{DirId, normalise_spec};

/// Queues `job` once it passed the checks; a new run on an NVMe namespace gets its extent.
pub fn submit(job: JobSpec, peer: &Peer, jobs: &Jobs) -> Reply {
    let mut s = match check(job, peer) {
        Ok(s) => s,
        Err(why) => return error(ErrorCode::Refused, why),
    };
    // A job that holds an NVMe controller runs under an identity of the daemon's.
    if let Some(node) = &s.device_node
        && let Err(why) =
            extents::check_device_node(Path::new(node)).and_then(|()| jobs.check_device_identity())
    {
        return error(ErrorCode::Refused, why);
    }
    let assigned = match assign_extent(&mut s, peer) {
        Ok(a) => a,
        Err(why) => return error(ErrorCode::Refused, why),
    };
    match jobs.submit(s) {
        Ok(info) => Reply::Job { job: info },
        Err(e) => {
            if let Some((place, run)) = assigned
                && let Err(why) = extents::release(&place, &run, peer.uid)
            {
                tracing::warn!(
                    "{}: freeing the extent of a refused job: {why}",
                    run.display()
                );
            }
            job_error(e)
        }
    }
}

/// For a new train run whose store is on an NVMe namespace: its extent, written into the job's
/// settings (`storage.start_lba`) and recorded (the store the run must keep naming).
fn assign_extent(
    s: &mut Submission,
    peer: &Peer,
) -> Result<Option<(extents::Placement, std::path::PathBuf)>, String> {
    let JobSpec::Train {
        dataset: Some(dataset),
        out,
        sets,
        resume: false,
        config,
    } = &mut s.spec
    else {
        return Ok(None);
    };
    let parsed = Config::parse(config, sets).map_err(|e| e.to_string())?;
    let Some(mut place) = extents::placement(&parsed, out) else {
        return Ok(None);
    };
    let lba = extents::assign(&place, &parsed, dataset, out, peer)?;
    sets.push(format!("storage.start_lba={lba}"));
    // The extent is this run's now: what a deleted run left in it may be overwritten.
    sets.push("storage.force=true".into());
    place.queue.start_lba = lba;
    s.expect = Some(place.recorded());
    Ok(Some((place, out.clone())))
}

/// An existing run of the submitter's, opened as they could: its identity, and the store it
/// names on a namespace (checked to be still the run's extent there).
fn run_to_read(peer: &Peer, run: &Path) -> Result<(Option<DirId>, Option<RecordedStore>), String> {
    let dir = access::open_own(peer, run)?;
    if !dir.is_file(legend_engine::run::META_FILE).unwrap_or(false) {
        return Err(format!(
            "{} is not a training run directory (no run.toml)",
            run.display()
        ));
    }
    let id = DirId::of(&dir).map_err(|e| format!("{}: {e}", run.display()))?;
    let store = extents::recorded_placement(&dir);
    if let Some(place) = &store {
        extents::check(place, run, peer)?;
    }
    Ok((Some(id), store.map(|p| p.recorded())))
}

/// The device node a job on `store` holds, when it is one of the module's.
fn device_node(store: Option<&RecordedStore>) -> Option<String> {
    let s = store?;
    (s.queue.backend == legend_engine::store::QueueBackend::Nvme)
        .then(|| s.path.to_string_lossy().into_owned())
}

/// Checks what a submission names against what its submitter may touch, and finds its queue.
fn check(mut spec: JobSpec, peer: &Peer) -> Result<Submission, String> {
    normalise_spec(&mut spec)?;
    let mut queue = "cpu".to_owned();
    let mut gpus = 1;
    let (mut run_id, mut expect, mut node) = (None, None, None);
    match &spec {
        JobSpec::Train {
            dataset,
            out,
            resume,
            config,
            sets,
        } => {
            // A job's record keeps its spec until deleted: its size is bounded like its count.
            let bytes = config.len() + sets.iter().map(String::len).sum::<usize>();
            if bytes > MAX_CONFIG_BYTES {
                return Err(format!(
                    "the job's configuration and --set values take {bytes} bytes (at most \
                     {MAX_CONFIG_BYTES})"
                ));
            }
            let parent = out
                .parent()
                .ok_or_else(|| format!("{}: not a run directory path", out.display()))?;
            let parent = access::open_to_create_in(peer, parent)?;
            if !*resume && !is_free_for_a_run(&parent, out) {
                // As `legendctl train` says it, up front rather than when the job starts.
                return Err(format!(
                    "{} already exists; choose another --out or continue it with --resume",
                    out.display()
                ));
            }
            if let Some(d) = dataset {
                peer.open_dir(d)?;
            }
            let config = train_config(&spec, peer, *resume)?;
            check_store_path(peer, &config)?;
            if *resume {
                let dir = peer.open_dir(out)?;
                run_id = Some(DirId::of(&dir).map_err(|e| format!("{}: {e}", out.display()))?);
                let recorded = extents::recorded_placement(&dir);
                if let Some(place) = &recorded {
                    extents::check(place, out, peer)?;
                }
                expect = recorded.map(|p| p.recorded());
            }
            queue = queue_of(&config);
            if queue == GPU_SET_QUEUE {
                gpus = config.training.gpus;
            }
            node = device_node(expect.as_ref()).or_else(|| {
                (config.storage.backend == Backend::Nvme)
                    .then(|| config.storage.path.clone())
                    .flatten()
                    .map(|p| p.to_string_lossy().into_owned())
            });
            let needs = estimate::needs(&spec, peer, &queue, *resume, None);
            crate::jobs::check_memlock(&needs)?;
        }
        JobSpec::Eval {
            run,
            protocol,
            split,
        } => {
            // Checked here, not when the job runs: a bad value is refused, never kept in a
            // record nor quoted back at length.
            protocol.parse::<legend_engine::config::Protocol>()?;
            split.parse::<legend_dataset::Split>()?;
            (run_id, expect) = run_to_read(peer, run)?;
        }
        JobSpec::Serve { run, group, device } => {
            (run_id, expect) = run_to_read(peer, run)?;
            if let Some(d) = device {
                d.parse::<DeviceChoice>()?;
            }
            if let Some(name) = group {
                let gid = access::group_id(name)?;
                // Like chgrp: a run is shared only with a group its owner is in.
                if peer.uid != 0 && !peer.groups.contains(&gid) {
                    return Err(format!(
                        "uid {} is not in group {name}: a run is served only to a group of \
                         its submitter's",
                        peer.uid
                    ));
                }
            }
            queue = SERVE_QUEUE.into();
        }
        JobSpec::Export { run, out, format } => {
            (run_id, expect) = run_to_read(peer, run)?;
            format.parse::<legend_engine::export::Format>()?;
            let parent = out
                .parent()
                .ok_or_else(|| format!("{}: not a directory path", out.display()))?;
            access::open_to_create_in(peer, parent)?;
        }
    }
    if !matches!(spec, JobSpec::Train { .. }) {
        node = device_node(expect.as_ref());
    }
    Ok(Submission {
        spec,
        queue,
        peer: peer.clone(),
        run_id,
        expect,
        device_node: node,
        gpus,
    })
}

/// Checks the store paths a train job names (`storage.path`, `[[storage.device]]`): the
/// submitter must be able to write each file, or create it. Device nodes (`nvme`) are the
/// daemon's; their extents keep users apart, on one namespace a job.
fn check_store_path(peer: &Peer, config: &Config) -> Result<(), String> {
    let s = &config.storage;
    if s.backend == Backend::Nvme {
        if !s.device.is_empty() {
            return Err(
                "storage.device: legendd gives a job an extent of one namespace; a store \
                 striped over several devices ([[storage.device]]) runs with legendctl train"
                    .into(),
            );
        }
        return Ok(());
    }
    s.path
        .iter()
        .chain(s.device.iter().map(|d| &d.path))
        .try_for_each(|path| access::check_may_write_or_create(peer, path))
}

/// Whether a new run may be made at `out` in its opened `parent`: nothing there, or an empty
/// directory.
fn is_free_for_a_run(parent: &legend_fs::Dir, out: &Path) -> bool {
    let Some(name) = out.file_name() else {
        return false;
    };
    match parent.entry(name) {
        Ok(None) => true,
        Ok(Some(_)) => parent.entries(name).is_ok_and(|e| e.is_empty()),
        Err(_) => false,
    }
}
