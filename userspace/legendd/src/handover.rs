//! Where a job writes, and who owns what it wrote. Before a job runs, its output directory is
//! checked again: its parent must still be the submitter's, and nothing in it may be a symbolic
//! link (the daemon writes through plain paths, so a link planted by the submitter could send
//! its writes into someone else's directory). Checked at the job's start, not at every write:
//! a submitter racing a running job can still swap entries (path-safe writes in the engine would
//! close that).
//!
//! Hands a job's outputs to the user who submitted it: the daemon writes them as its own user,
//! then, when the job ends, makes the submitter their owner (the group, which lets the daemon
//! in again on a resume, stays). It needs `CAP_CHOWN` (the unit grants it); without it, or when
//! the submitter is the daemon's own user, the files stay as they are.
//!
//! The walk never follows a symbolic link and changes only regular files and directories the
//! daemon itself owns, each through a descriptor of its parent directory, so a user who
//! rearranges the tree while it runs cannot point it at anything else.

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag, fstat, fstatat};
use nix::unistd::{Uid, fchown, fchownat, geteuid};

/// Refuses to write into `out` for `owner` unless its parent belongs to them (or they are root)
/// and nothing at or under `out` is a symbolic link.
pub fn check_outputs(out: &Path, owner: u32) -> Result<(), String> {
    let parent = out
        .parent()
        .ok_or_else(|| format!("{}: not an output directory", out.display()))?;
    let parent_owner = std::fs::metadata(parent)
        .map_err(|e| format!("{}: {e}", parent.display()))?
        .uid();
    if owner != 0 && parent_owner != owner {
        return Err(format!(
            "{}: no longer the submitter's directory (owner uid {parent_owner})",
            parent.display()
        ));
    }
    let link = |path: &Path| {
        format!(
            "{}: a symbolic link in the output; the daemon does not write through links",
            path.display()
        )
    };
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", out.display())),
        Ok(m) if m.file_type().is_symlink() => return Err(link(out)),
        Ok(m) if !m.is_dir() => return Ok(()),
        Ok(_) => {}
    }
    let mut pending = vec![out.to_owned()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries {
            let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
            let kind = entry
                .file_type()
                .map_err(|e| format!("{}: {e}", entry.path().display()))?;
            if kind.is_symlink() {
                return Err(link(&entry.path()));
            }
            if kind.is_dir() {
                pending.push(entry.path());
            }
        }
    }
    Ok(())
}

/// How a directory is opened: never through a symbolic link.
fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Makes `owner` the owner of `dir` and of every file and directory under it that the daemon
/// owns; returns how many it changed.
pub fn hand_over(dir: &Path, owner: u32) -> nix::Result<usize> {
    let me = geteuid();
    if owner == me.as_raw() {
        return Ok(0);
    }
    let top = Dir::open(dir, dir_flags(), Mode::empty())?;
    chown_tree(top, me, Uid::from_raw(owner))
}

fn chown_tree(mut dir: Dir, me: Uid, to: Uid) -> nix::Result<usize> {
    let mut changed = 0;
    if fstat(dir.as_fd())?.st_uid == me.as_raw() {
        fchown(dir.as_fd(), Some(to), None)?;
        changed += 1;
    }
    let names: Vec<std::ffi::CString> = dir
        .iter()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    for name in names {
        let st = fstatat(dir.as_fd(), name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW)?;
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if kind == SFlag::S_IFDIR {
            let sub = Dir::openat(dir.as_fd(), name.as_c_str(), dir_flags(), Mode::empty())?;
            changed += chown_tree(sub, me, to)?;
        } else if kind == SFlag::S_IFREG && st.st_uid == me.as_raw() {
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
