//! Hands a job's outputs to the user who submitted it: the daemon writes them as its own user,
//! then, when the job ends, makes the submitter their owner (the group, which lets the daemon
//! in again on a resume, stays). It needs `CAP_CHOWN` (the unit grants it); without it, or when
//! the submitter is the daemon's own user, the files stay as they are.
//!
//! The walk starts from the job's output directory opened and admitted like every directory the
//! job writes (access::JobGuard), never follows a symbolic link, and changes only directories
//! and single-named regular files the daemon itself owns, each through a descriptor of its
//! parent directory, so a user who rearranges the tree while it runs cannot point it at
//! anything else, nor have a hard link to a daemon file handed over.

use std::os::fd::AsFd;

use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag, fstat, fstatat};
use nix::unistd::{Uid, fchown, fchownat, geteuid};

/// How a directory is opened: never through a symbolic link.
fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Makes `owner` the owner of `dir` and of every file and directory under it that the daemon
/// owns; returns how many it changed.
pub fn hand_over(dir: &legend_fs::Dir, owner: u32) -> std::io::Result<usize> {
    let me = geteuid();
    if owner == me.as_raw() {
        return Ok(0);
    }
    let top = Dir::from_fd(dir.as_fd().try_clone_to_owned()?)?;
    Ok(chown_tree(top, me, Uid::from_raw(owner))?)
}

/// Depth first with a stack of its own rather than recursion: a tree nested deeper than a
/// thread's stack (which the submitter can make in their run) ends in an error, not in a crash
/// of the daemon.
fn chown_tree(top: Dir, me: Uid, to: Uid) -> nix::Result<usize> {
    let mut changed = 0;
    let mut stack = vec![enter(top, me, to, &mut changed)?];
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
            stack.push(enter(sub, me, to, &mut changed)?);
        } else if kind == SFlag::S_IFREG && st.st_uid == me.as_raw() && st.st_nlink == 1 {
            fchownat(
                dir.as_fd(),
                name.as_c_str(),
                Some(to),
                None,
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )?;
            changed += 1;
        }
    }
    Ok(changed)
}

/// Hands `dir` itself over (when it is the daemon's) and lists the names in it.
fn enter(
    mut dir: Dir,
    me: Uid,
    to: Uid,
    changed: &mut usize,
) -> nix::Result<(Dir, Vec<std::ffi::CString>)> {
    if fstat(dir.as_fd())?.st_uid == me.as_raw() {
        fchown(dir.as_fd(), Some(to), None)?;
        *changed += 1;
    }
    let names = dir
        .iter()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    Ok((dir, names))
}
