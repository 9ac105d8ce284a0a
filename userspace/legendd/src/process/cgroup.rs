//! A cgroup for each job, beneath the daemon's own: its memory and CPU bounds, its peak memory,
//! and whether the kernel killed it for memory.
//!
//! Both versions. Under cgroup v2 (systemd with `Delegate=yes`) the daemon's cgroup is the
//! delegated subtree: the daemon moves itself into a leaf `daemon/` (a cgroup with processes
//! cannot give its children controllers), enables `memory`, `cpu` and `pids` for the subtree
//! and makes `job-ID/` beside it (`memory.max`, `cpu.max`, `pids.max`; `memory.peak`,
//! `memory.events`). Under v1 (no systemd, the CI machines) it makes `legend-TAG-job-ID/` beneath
//! its own cgroup of each of the `memory`, `cpu` and `pids` hierarchies (`TAG` tells the
//! daemons of several state directories apart where they share a hierarchy's root)
//! (`memory.limit_in_bytes`, `cpu.cfs_quota_us`, `pids.max`; `memory.max_usage_in_bytes`,
//! `memory.oom_control`). Where neither can be written, jobs run without a cgroup and the
//! daemon says so once.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The processes (threads included) one job may have.
const PIDS_MAX: u64 = 16 << 10;

/// The CFS period a job's CPU quota is given in (µs).
const CPU_PERIOD_US: u64 = 100_000;

/// Where the daemon makes its jobs' cgroups.
#[derive(Debug)]
pub enum Hierarchy {
    /// cgroup v2: the delegated directory the jobs' cgroups go in.
    V2(PathBuf),
    /// cgroup v1: the daemon's own directory in the memory hierarchy, and in the cpu and pids
    /// hierarchies where they are mounted.
    V1 {
        /// The memory hierarchy's directory.
        memory: PathBuf,
        /// The cpu hierarchy's, if mounted.
        cpu: Option<PathBuf>,
        /// The pids hierarchy's, if mounted.
        pids: Option<PathBuf>,
    },
}

/// The jobs' hierarchy, found once (v2 first, where it has the memory controller); `None`
/// where the daemon cannot make cgroups.
pub fn hierarchy() -> Option<&'static Hierarchy> {
    static FOUND: OnceLock<Option<Hierarchy>> = OnceLock::new();
    FOUND
        .get_or_init(|| match find() {
            Ok(h) => {
                tracing::info!("job cgroups: {h:?}");
                Some(h)
            }
            Err(why) => {
                tracing::warn!(
                    "jobs run without a cgroup of their own (no memory or CPU bound, no peak \
                     memory): {why}"
                );
                None
            }
        })
        .as_ref()
}

/// The mount points of the cgroup file systems: v2's, and v1's by controller.
fn mounts() -> (Option<PathBuf>, Vec<(String, PathBuf)>) {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let (mut v2, mut v1) = (None, Vec::new());
    for line in text.lines() {
        // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS ... - FSTYPE SOURCE SUPEROPTIONS
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let point = left.split(' ').nth(4).map(PathBuf::from);
        let mut r = right.split(' ');
        let (fstype, _, superopts) = (r.next(), r.next(), r.next().unwrap_or(""));
        match (fstype, point) {
            (Some("cgroup2"), Some(p)) => v2 = v2.or(Some(p)),
            (Some("cgroup"), Some(p)) => {
                for opt in superopts.split(',') {
                    v1.push((opt.to_owned(), p.clone()));
                }
            }
            _ => {}
        }
    }
    (v2, v1)
}

/// This process's cgroup path in the hierarchy of `controller` (`""` for v2's).
fn own_path(controller: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, list, path) = (parts.next()?, parts.next()?, parts.next()?);
        list.split(',')
            .any(|c| c == controller)
            .then(|| path.to_owned())
    })
}

fn find() -> Result<Hierarchy, String> {
    let (v2, v1) = mounts();
    let v1_of = |c: &str| {
        let mount = v1.iter().find(|(o, _)| o == c).map(|(_, p)| p.clone())?;
        let own = own_path(c)?;
        Some(mount.join(own.trim_start_matches('/')))
    };
    if let Some(memory) = v1_of("memory") {
        probe(&memory)?;
        return Ok(Hierarchy::V1 {
            memory,
            cpu: v1_of("cpu").filter(|p| probe(p).is_ok()),
            pids: v1_of("pids").filter(|p| probe(p).is_ok()),
        });
    }
    let mount = v2.ok_or("no cgroup file system is mounted")?;
    let own = own_path("").ok_or("this process has no cgroup v2 path")?;
    let dir = mount.join(own.trim_start_matches('/'));
    let controllers = std::fs::read_to_string(dir.join("cgroup.controllers"))
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    if !controllers.split_whitespace().any(|c| c == "memory") {
        return Err(format!(
            "{}: the memory controller is not delegated (systemd: Delegate=yes)",
            dir.display()
        ));
    }
    // The daemon into a leaf of its own, so that the directory may give its children
    // controllers (v2 allows processes only in leaves of a subtree with controllers on).
    let leaf = dir.join("daemon");
    match std::fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("{}: {e} (systemd: Delegate=yes)", leaf.display())),
    }
    // This process only (all its threads): another process in the directory (a shell the
    // daemon was started from by hand) is not the daemon's to move, and then the directory
    // cannot give its children controllers: jobs run without cgroups, as said below.
    std::fs::write(leaf.join("cgroup.procs"), std::process::id().to_string())
        .map_err(|e| format!("moving the daemon into {}: {e}", leaf.display()))?;
    let wanted: Vec<&str> = ["memory", "cpu", "pids"]
        .into_iter()
        .filter(|c| controllers.split_whitespace().any(|have| have == *c))
        .collect();
    let enable: String = wanted.iter().map(|c| format!("+{c} ")).collect();
    std::fs::write(dir.join("cgroup.subtree_control"), enable.trim_end()).map_err(|e| {
        format!(
            "{}/cgroup.subtree_control: {e} (processes other than the daemon in it?)",
            dir.display()
        )
    })?;
    Ok(Hierarchy::V2(dir))
}

/// Makes and removes a test cgroup in `dir`: whether the daemon may make its jobs' there.
fn probe(dir: &Path) -> Result<(), String> {
    let test = dir.join(format!("legend-probe-{}", std::process::id()));
    std::fs::create_dir(&test).map_err(|e| format!("{}: {e}", dir.display()))?;
    let _ = std::fs::remove_dir(&test);
    Ok(())
}

/// Kills what is left in the cgroup `dir` (a killed daemon's job's processes, dying with it)
/// and removes it: whether it could within a few seconds.
fn empty_and_remove(dir: &Path) -> bool {
    for _ in 0..300 {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: signalling a process left in one of this daemon's job cgroups.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if std::fs::remove_dir(dir).is_ok() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// Makes again the cgroup `dir` a killed daemon left, or takes it over as it is when it does
/// not empty.
fn take_over(dir: &Path) {
    if !(empty_and_remove(dir) && std::fs::create_dir(dir).is_ok()) {
        tracing::warn!("{}: left by an earlier daemon, taken over", dir.display());
    }
}

/// Removes the job cgroups named `prefix…` a daemon of the same state directory left (killed
/// while its jobs ran): their processes died with it.
pub fn remove_left(h: &Hierarchy, prefix: &str) {
    let dirs: Vec<&PathBuf> = match h {
        Hierarchy::V2(dir) => vec![dir],
        Hierarchy::V1 { memory, cpu, pids } => {
            std::iter::once(memory).chain(cpu).chain(pids).collect()
        }
    };
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(prefix) && !empty_and_remove(&e.path()) {
                tracing::warn!(
                    "{}: left by an earlier daemon, not removed",
                    e.path().display()
                );
            }
        }
    }
}

/// What a job's cgroup bounds.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Bytes of memory.
    pub memory: u64,
    /// CPUs (in whole cores) it may use at once; `None`: all.
    pub cpus: Option<u32>,
}

/// A job's cgroup, removed when dropped (once its processes are gone).
#[derive(Debug)]
pub struct JobCgroup {
    /// Its directories: the memory hierarchy's first (the one v2 has).
    dirs: Vec<PathBuf>,
    v2: bool,
    /// The path `status` shows: within the hierarchy.
    pub shown: String,
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), String> {
    std::fs::write(dir.join(file), value).map_err(|e| format!("{}/{file}: {e}", dir.display()))
}

impl JobCgroup {
    /// Makes the cgroup `name` (one job's, of one daemon) with `bounds`.
    pub fn create(h: &Hierarchy, name: &str, bounds: Bounds) -> Result<JobCgroup, String> {
        let (dirs, v2) = match h {
            Hierarchy::V2(dir) => (vec![dir.join(name)], true),
            Hierarchy::V1 { memory, cpu, pids } => {
                let mut dirs = vec![memory.join(name)];
                dirs.extend(cpu.iter().chain(pids).map(|d| d.join(name)));
                (dirs, false)
            }
        };
        for dir in &dirs {
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                // Left by a daemon killed while the job ran: its process dies with it (its
                // parent-death signal), and may still be going. Killed, then the cgroup is
                // made again once empty, or taken over as it is.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => take_over(dir),
                Err(e) => return Err(format!("{}: {e}", dir.display())),
            }
        }
        let cgroup = JobCgroup {
            shown: dirs[0].to_string_lossy().into_owned(),
            dirs,
            v2,
        };
        cgroup.limit(bounds)?;
        Ok(cgroup)
    }

    fn limit(&self, bounds: Bounds) -> Result<(), String> {
        let memory = &self.dirs[0];
        let quota = bounds.cpus.map(|n| u64::from(n.max(1)) * CPU_PERIOD_US);
        if self.v2 {
            write(memory, "memory.max", &bounds.memory.to_string())?;
            // No swap: a job past its memory is killed, not slowed to a crawl.
            let _ = write(memory, "memory.swap.max", "0");
            if let Some(q) = quota {
                let _ = write(memory, "cpu.max", &format!("{q} {CPU_PERIOD_US}"));
            }
            let _ = write(memory, "pids.max", &PIDS_MAX.to_string());
            return Ok(());
        }
        write(memory, "memory.limit_in_bytes", &bounds.memory.to_string())?;
        let _ = write(
            memory,
            "memory.memsw.limit_in_bytes",
            &bounds.memory.to_string(),
        );
        for dir in &self.dirs[1..] {
            if dir.join("cpu.cfs_quota_us").exists() {
                if let Some(q) = quota {
                    write(dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                    write(dir, "cpu.cfs_quota_us", &q.to_string())?;
                }
            } else if dir.join("pids.max").exists() {
                write(dir, "pids.max", &PIDS_MAX.to_string())?;
            }
        }
        Ok(())
    }

    /// Opens each `cgroup.procs` for a child to enter by writing `0` before it executes the
    /// job (so that everything it allocates counts).
    pub fn procs_files(&self) -> Result<Vec<OwnedFd>, String> {
        self.dirs
            .iter()
            .map(|d| {
                let path = d.join("cgroup.procs");
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map(OwnedFd::from)
                    .map_err(|e| format!("{}: {e}", path.display()))
            })
            .collect()
    }

    /// The most memory the cgroup has held, in bytes.
    pub fn peak_memory(&self) -> Option<u64> {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        std::fs::read_to_string(self.dirs[0].join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// How many times the kernel killed a process of the cgroup for memory.
    pub fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.dirs[0].join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Kills every process left in the cgroup (a job's process that forked).
    pub fn kill_all(&self) {
        if self.v2 && write(&self.dirs[0], "cgroup.kill", "1").is_ok() {
            return;
        }
        let procs = std::fs::read_to_string(self.dirs[0].join("cgroup.procs")).unwrap_or_default();
        for pid in procs
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: signalling a process of the job's cgroup, which only the job's make.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

impl Drop for JobCgroup {
    fn drop(&mut self) {
        self.kill_all();
        for dir in &self.dirs {
            // The kernel frees a cgroup once its last process is reaped: retried a moment.
            if !empty_and_remove(dir) {
                tracing::warn!("{}: could not be removed", dir.display());
            }
        }
    }
}
