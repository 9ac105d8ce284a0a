//! Eval and export jobs: they read a run of their submitter's.

use std::path::Path;

use legend_daemon_api::JobSpec;
use legend_engine::config::Protocol;
use legend_engine::evaluation::{self, EvalRequest};
use legend_engine::{export, run};
use legend_fs::{Dir, Guard};

use super::{Outbox, chain, check_store};
use crate::access::JobGuard;
use crate::channel::{Ended, JobStart};

/// Opens the run `path` for reading as the job's guard says, and checks that its record still
/// names the store the daemon recorded at submission: the directory and that record, which is
/// the one the job must then use (reading it again would leave a window for a rewrite).
pub fn open_run(
    path: &Path,
    start: &JobStart,
    guard: &JobGuard,
) -> Result<(Dir, run::RunMeta), String> {
    let dir = run::open(path).map_err(|e| chain(&e))?;
    guard
        .admit(&dir)
        .map_err(|e| format!("{}: {e}", dir.path().display()))?;
    // The run is the submitter's; what is read in it must be theirs to read too.
    let dir = dir.reading_as(guard.read_check());
    let meta = run::read_meta(&dir).map_err(|e| chain(&e))?;
    check_store(&meta, start.expect.as_ref())
        .map_err(|why| format!("{}: {why}", dir.join(run::META_FILE).display()))?;
    Ok((dir, meta))
}

/// Ranks a run's tables.
pub fn eval(start: &JobStart, guard: &JobGuard) -> Result<Ended, String> {
    let JobSpec::Eval {
        run: path,
        protocol,
        split,
    } = &start.spec
    else {
        unreachable!("an eval job");
    };
    let protocol: Protocol = protocol.parse()?;
    let split: legend_dataset::Split = split.parse()?;
    let (dir, meta) = open_run(path, start, guard)?;
    let dataset = evaluation::open_run_dataset(&meta, None, guard).map_err(|e| chain(&e))?;
    let (entities, relations) = run::load_embeddings(&dir, &meta, guard).map_err(|e| chain(&e))?;
    let decoder = meta.decoder.parse()?;
    let request = EvalRequest {
        protocol,
        split,
        negatives: run::evaluation_negatives(&dir).map_err(|e| chain(&e))?,
        threads: 0,
    };
    let m = evaluation::evaluate(
        &dataset,
        decoder,
        meta.dim,
        &entities,
        &relations,
        meta.reciprocal_relations,
        &request,
    )
    .map_err(|e| chain(&e))?;
    Ok(Ended::Done(Some(
        serde_json::to_value(m).expect("metrics serialize"),
    )))
}

/// Writes a run's embeddings with their labels.
pub fn export(start: &JobStart, guard: &JobGuard, out: &Outbox) -> Result<Ended, String> {
    let JobSpec::Export {
        run: path,
        out: to,
        format,
    } = &start.spec
    else {
        unreachable!("an export job");
    };
    let format = format.parse()?;
    open_run(path, start, guard)?;
    // The export reads the record again: it checks that one, the one it uses.
    let expect = |meta: &run::RunMeta| check_store(meta, start.expect.as_ref());
    let done =
        export::export_expecting(path, format, to, None, guard, &expect).map_err(|e| chain(&e))?;
    out.log(format!(
        "exported {} entities and {} relations (d = {}) to {}",
        done.entities,
        done.relations,
        done.dim,
        to.display()
    ));
    Ok(Ended::Done(None))
}
