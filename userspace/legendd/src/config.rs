//! `/etc/legend/legendd.toml`: every key has a default (`Documentation/daemon-api.md`, "Service").

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The daemon's configuration.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonConfig {
    /// The Unix socket clients connect to.
    pub socket: PathBuf,
    /// Where jobs and their logs are kept across restarts.
    pub state_dir: PathBuf,
    /// Members of this group (and root) may bind and unbind devices and see everyone's jobs.
    pub admin_group: String,
    /// Jobs running at once on the CPU.
    pub cpu_jobs: usize,
    /// Jobs running at once on each GPU.
    pub gpu_jobs: usize,
    /// Serve jobs holding a run in memory at once (they take no CPU or GPU job slot).
    pub serve_jobs: usize,
    /// Serve jobs one user outside the admin group may have queued or running.
    pub serve_jobs_per_user: usize,
    /// Of `serve_jobs`, how many only the admin group's (and root's) jobs may take.
    pub reserved_serve_jobs: usize,
    /// Jobs one user outside the admin group may run at once on one CPU or GPU queue.
    pub running_jobs_per_user: usize,
    /// Of each CPU or GPU queue's slots (`cpu_jobs`, `gpu_jobs`), how many only the admin
    /// group's (and root's) jobs may take.
    pub reserved_job_slots: usize,
    /// Where a serve job answers unless it names a device: `cpu`, `cuda:N` or `auto` (device 0
    /// when a CUDA driver is present and it opens, else the CPU).
    pub serve_device: String,
    /// The share of each GPU's memory that serve jobs together may hold (entity rows, row
    /// caches, scan buffers); training jobs keep the rest. 0: serve jobs never use a GPU.
    pub serve_gpu_memory: f64,
    /// A served run whose entity rows do not fit its GPU share looks rows up through a row
    /// cache over its store of this share of its table (0: through host memory).
    pub serve_cache_fraction: f64,
    /// MiB of host memory a serve job may hold its run's entity rows in; a run whose rows take
    /// more (or more than the memory available, `MemAvailable` or the cgroup's limit) is
    /// served streamed from its store or checkpoint. None: only the memory available bounds it.
    pub serve_host_memory_mib: Option<u64>,
    /// Connections served at once; more are answered `unavailable` and closed.
    pub max_connections: usize,
    /// Of `max_connections`, how many only the admin group (and root) may take: they always
    /// get in.
    pub reserved_connections: usize,
    /// Connections one uid (outside the admin group) may hold at once.
    pub max_connections_per_uid: usize,
    /// Seconds a client may take to send a whole request (from connecting, or from its last
    /// reply) before it is disconnected.
    pub request_timeout_s: u64,
    /// MiB of memory the daemon holds for requests in flight (their frames, what they parse
    /// into, their answers): a user may hold a quarter, users together all but an eighth.
    pub request_memory_mib: u64,
    /// Jobs one user may have queued or running at once.
    pub max_jobs_per_user: usize,
    /// Ended jobs one user may keep (their records and logs stay until deleted); past it
    /// submissions are refused until some are deleted.
    pub max_ended_jobs_per_user: usize,
    /// Also serve the Prometheus metrics on `127.0.0.1:PORT` (`GET /metrics`).
    pub metrics_port: Option<u16>,
    /// The uids jobs on a shared NVMe namespace run under, `"FIRST-LAST"`: unused by any
    /// account, one per running job. None: such jobs are refused.
    pub device_job_uids: Option<String>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            socket: PathBuf::from(legend_daemon_api::DEFAULT_SOCKET),
            state_dir: PathBuf::from("/var/lib/legend"),
            admin_group: "legend-admin".into(),
            cpu_jobs: 1,
            gpu_jobs: 1,
            serve_jobs: 4,
            serve_jobs_per_user: 2,
            reserved_serve_jobs: 1,
            running_jobs_per_user: 1,
            reserved_job_slots: 0,
            serve_device: "auto".into(),
            serve_gpu_memory: 0.25,
            serve_cache_fraction: legend_query::DEFAULT_CACHE_FRACTION,
            serve_host_memory_mib: None,
            max_connections: 256,
            reserved_connections: 16,
            max_connections_per_uid: 32,
            request_timeout_s: 30,
            request_memory_mib: 64,
            max_jobs_per_user: 100,
            max_ended_jobs_per_user: 1000,
            metrics_port: None,
            device_job_uids: None,
        }
    }
}

impl DaemonConfig {
    /// Reads `path`; a missing file is the defaults, unknown keys and bad values are errors.
    pub fn load(path: &Path, must_exist: bool) -> anyhow::Result<DaemonConfig> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !must_exist => String::new(),
            Err(e) => return Err(anyhow::anyhow!("{}: {e}", path.display())),
        };
        let config: DaemonConfig =
            toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if config.cpu_jobs == 0
            || config.gpu_jobs == 0
            || config.serve_jobs == 0
            || config.serve_jobs_per_user == 0
            || config.running_jobs_per_user == 0
            || config.max_connections_per_uid == 0
            || config.max_jobs_per_user == 0
            || config.max_ended_jobs_per_user == 0
            || config.request_timeout_s == 0
        {
            anyhow::bail!(
                "{}: cpu_jobs, gpu_jobs, serve_jobs, serve_jobs_per_user, running_jobs_per_user, \
                 max_connections_per_uid, max_jobs_per_user, max_ended_jobs_per_user and \
                 request_timeout_s must be at least 1",
                path.display()
            );
        }
        for (key, reserved, of, total) in [
            (
                "reserved_serve_jobs",
                config.reserved_serve_jobs,
                "serve_jobs",
                config.serve_jobs,
            ),
            (
                "reserved_job_slots",
                config.reserved_job_slots,
                "cpu_jobs",
                config.cpu_jobs,
            ),
            (
                "reserved_job_slots",
                config.reserved_job_slots,
                "gpu_jobs",
                config.gpu_jobs,
            ),
        ] {
            if reserved >= total {
                anyhow::bail!(
                    "{}: {key} ({reserved}) must be less than {of} ({total}): users would get none",
                    path.display()
                );
            }
        }
        if config.request_memory_mib < 8 {
            anyhow::bail!(
                "{}: request_memory_mib = {} is under 8 (a request may take 2 MiB)",
                path.display(),
                config.request_memory_mib
            );
        }
        config
            .device_uid_range()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        config
            .serve_device
            .parse::<legend_engine::config::DeviceChoice>()
            .map_err(|e| anyhow::anyhow!("{}: serve_device: {e}", path.display()))?;
        for (key, share) in [
            ("serve_gpu_memory", config.serve_gpu_memory),
            ("serve_cache_fraction", config.serve_cache_fraction),
        ] {
            if !(0.0..=1.0).contains(&share) {
                anyhow::bail!("{}: {key} = {share} is not between 0 and 1", path.display());
            }
        }
        if config.reserved_connections >= config.max_connections {
            anyhow::bail!(
                "{}: reserved_connections ({}) must be less than max_connections ({})",
                path.display(),
                config.reserved_connections,
                config.max_connections
            );
        }
        Ok(config)
    }
}

impl DaemonConfig {
    /// `device_job_uids` as its first and last uid.
    pub fn device_uid_range(&self) -> Result<Option<(u32, u32)>, String> {
        let Some(text) = &self.device_job_uids else {
            return Ok(None);
        };
        let bad = || format!("device_job_uids = {text:?}: give \"FIRST-LAST\", uids above 0");
        let (a, b) = text.split_once('-').ok_or_else(bad)?;
        let (a, b): (u32, u32) = (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        );
        if a == 0 || b < a {
            return Err(bad());
        }
        Ok(Some((a, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_file_states_the_defaults() {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../systemd/legendd.toml");
        assert_eq!(
            DaemonConfig::load(&shipped, true).unwrap(),
            DaemonConfig::default()
        );
    }

    #[test]
    fn bad_files_are_refused_with_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("legendd.toml");
        for text in [
            "sockett = \"/x\"\n",
            "cpu_jobs = 0\n",
            "max_connections = 8\nreserved_connections = 8\n",
            "max_jobs_per_user = 0\n",
            "gpu_jobs = \"one\"\n",
            "serve_device = \"gpu\"\n",
            "serve_gpu_memory = 1.5\n",
            "serve_cache_fraction = -0.1\n",
            "serve_host_memory_mib = -1\n",
            "reserved_serve_jobs = 4\n",
            "gpu_jobs = 2\nreserved_job_slots = 1\n",
            "request_memory_mib = 1\n",
            "device_job_uids = \"9-3\"\n",
            "device_job_uids = \"0-10\"\n",
        ] {
            std::fs::write(&path, text).unwrap();
            let e = DaemonConfig::load(&path, true).unwrap_err().to_string();
            assert!(e.contains("legendd.toml"), "{text}: {e}");
        }
        assert!(DaemonConfig::load(&dir.path().join("none.toml"), true).is_err());
        assert_eq!(
            DaemonConfig::load(&dir.path().join("none.toml"), false).unwrap(),
            DaemonConfig::default()
        );
    }
}
