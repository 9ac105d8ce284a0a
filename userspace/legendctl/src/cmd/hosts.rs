//! `legendctl train` on several hosts: where this process stands in the job (the command
//! line, torchrun's or Slurm's environment), the rendezvous, and the part of a host other than
//! host 0 (see legend-engine's `workers::hosts`).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use legend_cluster::{Cluster, Identity, Launch, Options, Token};
use legend_dataset::Dataset;
use legend_engine::Config;

/// The options of `legendctl train` for a job on several hosts.
#[derive(clap::Args, Debug, Default)]
pub struct HostArgs {
    /// Hosts H of a job on several machines: one process a host (this command on each),
    /// driving its own `--gpus`; host 0 writes the run. Without it, torchrun's and Slurm's
    /// variables are read (LEGEND_LAUNCH=none ignores them).
    #[arg(long, value_name = "H")]
    pub hosts: Option<u32>,
    /// This host's rank, 0 .. H-1 (with --hosts).
    #[arg(long, value_name = "R", requires = "hosts")]
    pub host_rank: Option<u32>,
    /// Where host 0 listens for the others, HOST:PORT (host 0 listens on that address only).
    #[arg(long, value_name = "HOST:PORT", requires = "hosts")]
    pub rendezvous: Option<String>,
    /// Seconds the hosts have to find each other before every one fails, naming the
    /// rendezvous and the hosts missing.
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    pub rendezvous_timeout: u64,
    /// Seconds a host may send nothing (stopped, dead, cut off) before every other stops,
    /// naming it.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub host_timeout: u64,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Where this process stands, when it is one host of several.
pub fn launch(args: &HostArgs) -> anyhow::Result<Option<Launch>> {
    Ok(Launch::resolve(
        args.hosts,
        args.host_rank,
        args.rendezvous.as_deref(),
        &env,
    )?)
}

/// What every host must agree on: this build, and either the new run's configuration (key
/// by key) and dataset, or a resume's `--set`s (host 0 then sends the run's configuration).
pub fn identity(
    config: Option<&Config>,
    dataset: Option<&Path>,
    sets: &[String],
) -> anyhow::Result<Identity> {
    let mut id = Identity::new();
    id.insert(
        "binary (SHA-256 of the legendctl executable)".into(),
        legend_cluster::binary_identity()?,
    );
    match config {
        Some(config) => {
            id.insert("mode".into(), "a new run".into());
            let value: toml::Value = toml::from_str(&config.to_toml())?;
            flatten("config ", &value, &mut id);
            if let Some(dir) = dataset {
                let ds =
                    Dataset::open(dir).with_context(|| format!("opening {}", dir.display()))?;
                id.insert(
                    "dataset (identity of dataset.toml's counts and checksums)".into(),
                    format!("{:032x}", ds.meta().identity()),
                );
            }
        }
        None => {
            id.insert("mode".into(), "a resume".into());
            for s in sets {
                let (key, value) = s.split_once('=').unwrap_or((s, ""));
                id.insert(format!("--set {}", key.trim()), value.trim().to_string());
            }
        }
    }
    Ok(id)
}

/// `value`'s leaves as `prefix` + dotted keys.
fn flatten(prefix: &str, value: &toml::Value, out: &mut Identity) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.ends_with(' ') {
                    format!("{prefix}{k}")
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

/// The job's token, from `LEGEND_JOB_TOKEN`.
pub fn token() -> anyhow::Result<Token> {
    Ok(Token::from_env(&env)?)
}

/// Joins the job: the rendezvous, proving `token`.
pub fn join(
    launch: &Launch,
    args: &HostArgs,
    token: Token,
    identity: &Identity,
) -> anyhow::Result<Cluster> {
    let mut options = Options::new(token);
    options.timeout = Duration::from_secs(args.rendezvous_timeout);
    options.host_timeout = Duration::from_secs(args.host_timeout.max(1));
    tracing::info!(
        "host {} of {} (from {}), rendezvous at {}",
        launch.rank,
        launch.hosts,
        launch.source,
        launch.rendezvous
    );
    Ok(legend_cluster::join(launch, identity, &options)?)
}

/// A host other than host 0: its part of the job, until host 0 ends it. Ends the process with
/// 130 when the job stopped as asked (as host 0 does).
pub fn follow(
    cluster: Cluster,
    dataset: Option<&Path>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let me = cluster.host(cluster.rank());
    let stopped = legend_engine::workers::hosts::follow(cluster, dataset, stop)?;
    if stopped {
        errln!(
            "{me}: host 0 stopped the job with a checkpoint; continue it with --resume on host 0's run, every host started again"
        );
        std::process::exit(130);
    }
    errln!("{me}: the job completed; host 0's run holds its results");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_name_each_config_key_and_a_resume_its_sets() {
        let config = Config::parse("", &["model.dim=64".into()]).unwrap();
        let id = identity(Some(&config), None, &[]).unwrap();
        assert_eq!(id["config model.dim"], "64");
        assert_eq!(id["config training.negatives.num_chunks"], "1");
        assert_eq!(id["mode"], "a new run");
        assert!(id.keys().any(|k| k.starts_with("binary")));
        let id = identity(None, None, &["training.num_epochs = 9".into()]).unwrap();
        assert_eq!(id["--set training.num_epochs"], "9");
        assert_eq!(id["mode"], "a resume");
    }
}
