//! Hands what a job made to the user who submitted it, where it was made under another
//! identity: a job on a shared NVMe namespace runs under a uid of the daemon's (see
//! `process`), and when it ends the daemon makes the submitter the owner of what that uid made
//! in the job's output directory (the group stays). It needs `CAP_CHOWN` (the unit grants it).
//! A job that runs as its submitter makes its outputs theirs already: nothing is handed over.
//!
//! The walk starts from the job's output directory opened and admitted like every directory the
//! job writes (access::JobGuard), never follows a symbolic link, and changes only directories
//! and single-named regular files owned by the job's identity (a uid no account and no other
//! running job has) that were made after the job was submitted (their birth time). A file moved
//! or linked into the run from elsewhere keeps its owner, whoever that is: root's, the
//! daemon's, another user's, the submitter's own are never changed. Each entry is opened once
//! (`O_PATH`, no link followed) and checked and changed through that one descriptor, so a user
//! who rearranges the tree while it runs cannot swap what is changed for what was checked.

use std::os::fd::AsFd;

use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag, fstatat};
use nix::unistd::Uid;

/// How a directory is opened: never through a symbolic link.
fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Seconds since the epoch by the clock the kernel stamps files' times with (the coarse
/// real-time clock, which trails `SystemTime::now()` by up to a tick): a file made after this
/// call was born at or after the second it returns. A job's submission is timed with it; timed
/// with the precise clock, a file the job made within a tick of a second's start was born "in
/// the second before" and stayed the daemon's.
pub fn file_clock_secs() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to fill; CLOCK_REALTIME_COARSE exists on Linux.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    if r == 0 {
        u64::try_from(ts.tv_sec).unwrap_or(0)
    } else {
        0
    }
}

/// The output directory `path` of a job of `submitter`'s whose process ran as a uid `made_by`
/// accepts, opened (without following a link in its place) if it is the submitter's or that
/// identity's, and what that identity made in it handed to the submitter (see [`hand_over`]);
/// `Ok(0)` when there is no such directory (the job made none).
pub fn hand_over_outputs(
    path: &std::path::Path,
    submitter: u32,
    since: u64,
    made_by: &(dyn Fn(u32) -> bool + Sync),
) -> std::io::Result<usize> {
    /// Admits the submitter's directories and the job identity's.
    struct Theirs<'a> {
        submitter: u32,
        made_by: &'a (dyn Fn(u32) -> bool + Sync),
    }
    impl legend_fs::Guard for Theirs<'_> {
        fn admit(&self, dir: &legend_fs::Dir) -> std::io::Result<()> {
            let owner = std::os::unix::fs::MetadataExt::uid(&dir.metadata()?);
            if owner == self.submitter || (self.made_by)(owner) {
                Ok(())
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("owner uid {owner}: neither the submitter's nor the job's"),
                ))
            }
        }
    }
    let guard = Theirs { submitter, made_by };
    match legend_fs::Dir::open_guarded(path, &guard) {
        Ok(dir) => hand_over(&dir, submitter, since, made_by),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

/// Makes `owner` the owner of `dir` and of every file and directory under it owned by a uid
/// `made_by` accepts (the job's identity) and made at or after `since` (seconds since the
/// epoch: the job's submission); returns how many it changed.
pub fn hand_over(
    dir: &legend_fs::Dir,
    owner: u32,
    since: u64,
    made_by: &dyn Fn(u32) -> bool,
) -> std::io::Result<usize> {
    let top = Dir::from_fd(dir.as_fd().try_clone_to_owned()?)?;
    let rule = Rule {
        made_by,
        to: Uid::from_raw(owner),
        since,
    };
    Ok(chown_tree(top, &rule)?)
}

/// Which entries are handed over, and to whom.
struct Rule<'a> {
    made_by: &'a dyn Fn(u32) -> bool,
    to: Uid,
    since: u64,
}

impl Rule<'_> {
    /// Hands over what `fd` (an `O_PATH` descriptor, or a directory's) names if the job's
    /// identity owns it, it has one name (directories aside) and it was born for the job;
    /// `true` if it did.
    fn apply(&self, fd: std::os::fd::BorrowedFd<'_>, directory: bool) -> nix::Result<bool> {
        use std::os::fd::AsRawFd;
        // SAFETY: an all-zero statx is a valid value to be filled in.
        let mut st: libc::statx = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open; the empty path with AT_EMPTY_PATH names it; `st` is writable.
        let r = unsafe {
            libc::statx(
                fd.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
                libc::STATX_BASIC_STATS | libc::STATX_BTIME,
                &mut st,
            )
        };
        nix::errno::Errno::result(r)?;
        let kind = u32::from(st.stx_mode) & libc::S_IFMT;
        let eligible = if directory {
            kind == libc::S_IFDIR
        } else {
            kind == libc::S_IFREG && st.stx_nlink == 1
        };
        // A file system that does not record birth times gets nothing handed over: the
        // outputs stay the daemon's rather than risk giving away what it did not make.
        let born_for_the_job = st.stx_mask & libc::STATX_BTIME != 0
            && u64::try_from(st.stx_btime.tv_sec).is_ok_and(|t| t >= self.since);
        if !(eligible && (self.made_by)(st.stx_uid) && born_for_the_job) {
            return Ok(false);
        }
        // SAFETY: as above; the same descriptor that was checked is changed.
        let r = unsafe {
            libc::fchownat(
                fd.as_raw_fd(),
                c"".as_ptr(),
                self.to.as_raw(),
                u32::MAX,
                libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        nix::errno::Errno::result(r)?;
        Ok(true)
    }
}

/// Depth first with a stack of its own rather than recursion: a tree nested deeper than a
/// thread's stack (which the submitter can make in their run) ends in an error, not in a crash
/// of the daemon.
fn chown_tree(top: Dir, rule: &Rule) -> nix::Result<usize> {
    let mut changed = 0;
    let mut stack = vec![enter(top, rule, &mut changed)?];
    while let Some((dir, left)) = stack.last_mut() {
        let Some(name) = left.pop() else {
            stack.pop();
            continue;
        };
        let st = match fstatat(dir.as_fd(), name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(nix::errno::Errno::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if kind == SFlag::S_IFDIR {
            let sub = Dir::openat(dir.as_fd(), name.as_c_str(), dir_flags(), Mode::empty())?;
            stack.push(enter(sub, rule, &mut changed)?);
        } else if kind == SFlag::S_IFREG {
            let file = match nix::fcntl::openat(
                dir.as_fd(),
                name.as_c_str(),
                OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(nix::errno::Errno::ENOENT) => continue,
                Err(e) => return Err(e),
            };
            changed += usize::from(rule.apply(file.as_fd(), false)?);
        }
    }
    Ok(changed)
}

/// Hands `dir` itself over (when it is the daemon's) and lists the names in it.
fn enter(
    mut dir: Dir,
    rule: &Rule,
    changed: &mut usize,
) -> nix::Result<(Dir, Vec<std::ffi::CString>)> {
    *changed += usize::from(rule.apply(dir.as_fd(), true)?);
    let names = dir
        .iter()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    Ok((dir, names))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// Run as root (CI is), the test plays the job's identity (root here): what it made for
    /// the job goes to the submitter; a file it owns that was born before the job was
    /// submitted, a file of another owner's, and a second name of one of its files stay as
    /// they are.
    #[test]
    fn only_what_was_made_for_the_job_is_handed_over() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: hand-over needs root (CAP_CHOWN)");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let old = run.join("moved-in");
        std::fs::write(&old, b"secret").unwrap();
        let born = std::fs::metadata(&old).unwrap().created().unwrap();
        let since = born
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 1;
        // Files made for the job: after `since` (wait for the file clock's next second; the
        // precise clock can be past it a tick before files are stamped with it).
        while file_clock_secs() < since {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let sub = run.join("checkpoints");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("table.bin"), b"x").unwrap();
        std::fs::write(run.join("linked"), b"y").unwrap();
        std::fs::hard_link(run.join("linked"), tmp.path().join("elsewhere")).unwrap();
        // Made now, but by another owner: moved in by someone, it stays theirs.
        let others = run.join("others");
        std::fs::write(&others, b"z").unwrap();
        std::os::unix::fs::chown(&others, Some(4242), None).unwrap();
        let dir = legend_fs::Dir::open(&run).unwrap();
        // The run directory itself was born before `since` too: only its new contents move.
        let n = hand_over(&dir, 65534, since, &|uid| uid == 0).unwrap();
        let uid = |p: &std::path::Path| std::fs::symlink_metadata(p).unwrap().uid();
        assert_eq!(n, 2, "the new directory and its file");
        assert_eq!(uid(&sub), 65534);
        assert_eq!(uid(&sub.join("table.bin")), 65534);
        assert_eq!(uid(&old), 0, "a file older than the job is not handed over");
        assert_eq!(
            uid(&run.join("linked")),
            0,
            "a file with a second name is not"
        );
        assert_eq!(uid(&run), 0);
        assert_eq!(
            uid(&others),
            4242,
            "another owner's file is not handed over"
        );
    }
}
