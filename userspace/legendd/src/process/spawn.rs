//! Starting a job's process: the daemon's own binary executed again (`/proc/self/exe`, never a
//! lookup in `PATH`) with a clean environment, as the job's identity, in the job's cgroup, with
//! no capabilities, only the descriptors it is handed, a raised `oom_score_adj`, a finite
//! `RLIMIT_MEMLOCK` and a parent-death signal.
//!
//! Everything between `fork` and `exec` is done in the child by plain system calls on values
//! prepared before (no allocation there): enter the cgroup (so that all it allocates counts),
//! a session of its own (a terminal's Ctrl-C goes to the daemon, which stops its jobs in
//! order), `oom_score_adj`, `RLIMIT_MEMLOCK`, the channel and cache directory moved to
//! descriptors 3 and 4 and every other descriptor marked close-on-exec, the capability
//! bounding set emptied (where the daemon may: `CAP_SETPCAP`), the identity's groups, gid and
//! uid, ambient capabilities cleared, `no_new_privs` set; `PR_SET_PDEATHSIG` is armed first and
//! again last (a change of identity clears it), checked against a parent that died first. The process then checks, as its first act, that it holds no
//! capability (see `worker`).

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStderr, Command, Stdio};

use crate::channel::{CACHE_FD, CHANNEL_FD};

/// The `oom_score_adj` of a job's process: when memory runs out on the machine (or in the
/// daemon's cgroup), the kernel takes a job before the daemon.
pub const OOM_SCORE_ADJ: &[u8] = b"500";

/// Who a job's process runs as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
}

/// What a job's process is started with.
pub struct Launch<'a> {
    /// The program: the daemon's own binary.
    pub program: &'a Path,
    /// Its arguments.
    pub args: &'a [&'a str],
    /// Who it runs as.
    pub identity: &'a Identity,
    /// The job cgroup's `cgroup.procs` files, open for writing.
    pub cgroup_procs: &'a [OwnedFd],
    /// `RLIMIT_MEMLOCK`, in bytes.
    pub memlock: u64,
    /// Its kernel cache directory (descriptor 4).
    pub cache_dir: &'a OwnedFd,
    /// Its environment, and nothing else.
    pub env: &'a [(&'a str, String)],
    /// Its umask.
    pub umask: libc::mode_t,
}

/// A started job process.
pub struct Launched {
    /// The process.
    pub child: Child,
    /// The daemon's end of its channel.
    pub channel: UnixStream,
    /// Its standard error (its log lines and a panic's message).
    pub stderr: ChildStderr,
}

/// The highest capability number the kernel knows.
fn last_cap() -> i32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(63)
}

/// `CAP_SETPCAP`: may change capability bounding sets.
pub const CAP_SETPCAP: u32 = 8;

/// `CAP_SYS_RESOURCE`: may raise resource limits.
pub const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process holds capability `cap` (effective).
pub fn holds(cap: u32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

/// Starts the process.
pub fn launch(l: &Launch<'_>) -> std::io::Result<Launched> {
    // CAP_SETPCAP: the daemon may empty the child's capability bounding set.
    let drop_bounding = holds(CAP_SETPCAP);
    if l.identity.uid == 0 && !drop_bounding {
        // Executed as root with a bounding set it keeps, the job would hold the daemon's
        // capabilities.
        return Err(std::io::Error::other(
            "a job as root needs the daemon to hold CAP_SETPCAP (to take every capability \
             from it): see the shipped unit",
        ));
    }
    let (ours, theirs) = UnixStream::pair()?;
    let parent = std::process::id() as libc::pid_t;
    let last = last_cap();
    let oom = CString::new("/proc/self/oom_score_adj").expect("no NUL");
    let procs: Vec<RawFd> = l.cgroup_procs.iter().map(AsRawFd::as_raw_fd).collect();
    let (channel, cache) = (theirs.as_raw_fd(), l.cache_dir.as_raw_fd());
    let identity = l.identity.clone();
    let (memlock, umask) = (l.memlock, l.umask);
    let mut command = Command::new(l.program);
    command
        .args(l.args)
        .env_clear()
        .envs(l.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: the closure makes only async-signal-safe system calls on values prepared above.
    unsafe {
        command.pre_exec(move || {
            child_setup(&ChildSetup {
                parent,
                procs: &procs,
                oom: &oom,
                memlock,
                channel,
                cache,
                drop_bounding,
                last_cap: last,
                identity: &identity,
                umask,
            })
        });
    }
    let mut child = command.spawn()?;
    drop(theirs);
    let stderr = child.stderr.take().expect("piped");
    Ok(Launched {
        child,
        channel: ours,
        stderr,
    })
}

/// What the child does between fork and exec.
struct ChildSetup<'a> {
    parent: libc::pid_t,
    procs: &'a [RawFd],
    oom: &'a CString,
    memlock: u64,
    channel: RawFd,
    cache: RawFd,
    drop_bounding: bool,
    last_cap: i32,
    identity: &'a Identity,
    umask: libc::mode_t,
}

fn check(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn child_setup(s: &ChildSetup<'_>) -> std::io::Result<()> {
    // SAFETY: plain system calls on descriptors and values the parent prepared; no allocation,
    // no lock (this runs between fork and exec).
    unsafe {
        for &fd in s.procs {
            if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
        }
        // Armed at once (a daemon killed now takes this child with it), and again below once
        // the identity is set (a change of uid or gid clears it).
        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0))?;
        check(libc::setsid())?;
        let fd = libc::open(s.oom.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        check(fd)?;
        let wrote = libc::write(fd, OOM_SCORE_ADJ.as_ptr().cast(), OOM_SCORE_ADJ.len());
        libc::close(fd);
        if wrote < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let limit = libc::rlimit {
            rlim_cur: s.memlock,
            rlim_max: s.memlock,
        };
        check(libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit))?;
        // Out of the way of 3 and 4 first, then onto them (dup2 clears close-on-exec).
        let channel = libc::fcntl(s.channel, libc::F_DUPFD_CLOEXEC, 10);
        check(channel)?;
        let cache = libc::fcntl(s.cache, libc::F_DUPFD_CLOEXEC, 10);
        check(cache)?;
        check(libc::dup2(channel, CHANNEL_FD))?;
        check(libc::dup2(cache, CACHE_FD))?;
        // Everything else closes at exec (std's own pipe for exec errors must live till then).
        let marked = libc::syscall(
            libc::SYS_close_range,
            CACHE_FD as libc::c_uint + 1,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
        if marked < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if s.drop_bounding {
            for cap in 0..=s.last_cap {
                check(libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0))?;
            }
        }
        let id = s.identity;
        check(libc::setgroups(id.groups.len(), id.groups.as_ptr()))?;
        check(libc::setresgid(id.gid, id.gid, id.gid))?;
        check(libc::setresuid(id.uid, id.uid, id.uid))?;
        check(libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ))?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        libc::umask(s.umask);
        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0))?;
        if libc::getppid() != s.parent {
            // The daemon died before the signal was armed.
            libc::_exit(1);
        }
    }
    Ok(())
}

/// The environment of every job: the kernel cache in the directory it is handed,
/// `NCCL_NVLS_ENABLE=0` (NVLink multicast off, as the machines need), and the administrator's
/// GPU selection and library path from the daemon's own environment; a job given `devices`
/// (several GPUs, by the daemon's ordinals) sees those alone, as its `cuda:0` onwards.
pub fn job_env(devices: &[u32]) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("NCCL_NVLS_ENABLE", "0".to_owned()),
        // legend-cuda caches compiled kernels in $XDG_CACHE_HOME/legend/kernels.
        ("XDG_CACHE_HOME", format!("/proc/self/fd/{CACHE_FD}")),
        ("LEGEND_LOG", "info".to_owned()),
    ];
    for key in [
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "LEGEND_CUDA_ARCH",
        "LD_LIBRARY_PATH",
    ] {
        if let Ok(v) = std::env::var(key) {
            env.push((key, v));
        }
    }
    if !devices.is_empty() {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let selection = visible_subset(visible.as_deref(), devices);
        env.retain(|(key, _)| *key != "CUDA_VISIBLE_DEVICES");
        env.push(("CUDA_VISIBLE_DEVICES", selection));
    }
    env
}

/// The `CUDA_VISIBLE_DEVICES` that shows a process the daemon's GPUs `devices` (its ordinals),
/// given the daemon's own `visible` list (indices or UUIDs; all GPUs when unset). CUDA stops
/// a list at its first invalid entry, so the daemon's ordinal `d` is the `d`-th entry.
fn visible_subset(visible: Option<&str>, devices: &[u32]) -> String {
    let entries: Option<Vec<&str>> = visible.map(|v| v.split(',').map(str::trim).collect());
    let names: Vec<String> = devices
        .iter()
        .map(|&d| match &entries {
            Some(list) => list
                .get(d as usize)
                .map_or_else(|| d.to_string(), |e| (*e).to_owned()),
            None => d.to_string(),
        })
        .collect();
    names.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_on_several_gpus_sees_only_its_own() {
        assert_eq!(visible_subset(None, &[1, 3]), "1,3");
        assert_eq!(
            visible_subset(Some("GPU-aa, GPU-bb,2,5"), &[1, 3]),
            "GPU-bb,5"
        );
    }

    /// What a process running as `uid` gets from `kill(pid, 0)` and `ptrace(PTRACE_ATTACH)`:
    /// their errno values (0 for success).
    fn probe_as(uid: u32, pid: i32) -> (i32, i32) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        // SAFETY: the child switches uid, makes two system calls, writes and exits.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            // SAFETY: plain system calls in the forked child.
            unsafe {
                let mut out = [-1i32; 2];
                if libc::setgroups(0, std::ptr::null()) == 0
                    && libc::setgid(uid) == 0
                    && libc::setuid(uid) == 0
                {
                    let errno = |r: libc::c_long| {
                        if r == 0 { 0 } else { *libc::__errno_location() }
                    };
                    out[0] = errno(libc::kill(pid, 0).into());
                    out[1] = errno(libc::ptrace(libc::PTRACE_ATTACH, pid, 0, 0));
                }
                libc::write(theirs.as_raw_fd(), out.as_ptr().cast(), 8);
                libc::_exit(0);
            }
        }
        drop(theirs);
        let mut buf = [0u8; 8];
        std::io::Read::read_exact(&mut &ours, &mut buf).unwrap();
        // SAFETY: reaping our child.
        unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
        (
            i32::from_ne_bytes(buf[..4].try_into().unwrap()),
            i32::from_ne_bytes(buf[4..].try_into().unwrap()),
        )
    }

    /// A process started as a device job's identity (a uid of `device_job_uids`, not the
    /// submitter's) cannot be signalled nor traced by the submitter; started as the submitter,
    /// it can be signalled by them (the probe sees the difference).
    #[test]
    fn a_device_identity_is_out_of_its_submitters_reach() {
        if !nix::unistd::geteuid().is_root() {
            println!("skip: starting processes as other uids needs root");
            return;
        }
        let submitter = 65534;
        let cache = tempfile::tempdir().unwrap();
        let cache_fd = OwnedFd::from(std::fs::File::open(cache.path()).unwrap());
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit fills the struct.
        let read = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
        assert_eq!(read, 0);
        let start = |uid: u32| {
            let identity = Identity {
                uid,
                gid: uid,
                groups: Vec::new(),
            };
            launch(&Launch {
                program: Path::new("/bin/sleep"),
                args: &["30"],
                identity: &identity,
                cgroup_procs: &[],
                memlock: limit.rlim_max,
                cache_dir: &cache_fd,
                env: &job_env(&[]),
                umask: 0o022,
            })
            .unwrap()
        };
        let mut device = start(3_999_999_000);
        let (kill, trace) = probe_as(submitter, device.child.id() as i32);
        assert_eq!((kill, trace), (libc::EPERM, libc::EPERM));
        let mut own = start(submitter);
        let (kill, _) = probe_as(submitter, own.child.id() as i32);
        assert_eq!(kill, 0, "the submitter could not signal their own process");
        for launched in [&mut device, &mut own] {
            let _ = launched.child.kill();
            let _ = launched.child.wait();
        }
    }
}
