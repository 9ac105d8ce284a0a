//! Who is asking, and what they may touch: callers are identified by their socket credentials,
//! and a job reads and writes only where its submitter could.

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::unistd::{Gid, Group, Uid, User};

/// A connected client.
#[derive(Clone, Debug)]
pub struct Peer {
    /// Its uid.
    pub uid: u32,
    /// Its groups (primary and supplementary, from the user database).
    pub groups: Vec<u32>,
    /// Whether it may administer the daemon.
    pub admin: bool,
}

impl Peer {
    /// The credentials of the process at the other end of `stream`.
    pub fn of(stream: &UnixStream, admin_group: &str) -> std::io::Result<Peer> {
        let cred = getsockopt(stream, PeerCredentials).map_err(std::io::Error::from)?;
        let uid = cred.uid();
        let groups = groups_of(uid, cred.gid());
        let admin_gid = Group::from_name(admin_group)
            .ok()
            .flatten()
            .map(|g| g.gid.as_raw());
        // Root, the daemon's own user (single-user use), and the admin group.
        let admin = uid == 0
            || uid == Uid::effective().as_raw()
            || admin_gid.is_some_and(|g| groups.contains(&g));
        Ok(Peer { uid, groups, admin })
    }

    /// Whether this peer may see and cancel a job of `owner`.
    pub fn may_manage(&self, owner: u32) -> bool {
        self.admin || self.uid == owner
    }
}

/// `uid`'s groups from the user database, with `gid` (the process's own) always in.
fn groups_of(uid: u32, gid: u32) -> Vec<u32> {
    let mut groups = vec![gid];
    if let Ok(Some(user)) = User::from_uid(Uid::from_raw(uid))
        && let Ok(name) = std::ffi::CString::new(user.name)
        && let Ok(list) = nix::unistd::getgrouplist(&name, Gid::from_raw(gid))
    {
        groups.extend(list.into_iter().map(Gid::as_raw));
    }
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// Whether `peer` has the permission bits `want` (4 read, 2 write, 1 search) on `path`.
fn allowed(peer: &Peer, path: &Path, want: u32) -> std::io::Result<bool> {
    let m = std::fs::metadata(path)?;
    if peer.uid == 0 {
        return Ok(true);
    }
    let mode = m.mode();
    let bits = if m.uid() == peer.uid {
        mode >> 6
    } else if peer.groups.contains(&m.gid()) {
        mode >> 3
    } else {
        mode
    };
    Ok(bits & want == want)
}

/// Refuses unless `dir` belongs to `peer` (or `peer` is root) and `peer` may create entries in
/// it: a job writes its run directory only into a directory of its submitter's own, never into
/// a shared one (`/tmp`) or another user's that happens to be open to the daemon.
pub fn check_may_create_in(peer: &Peer, dir: &Path) -> Result<(), String> {
    let owner = std::fs::metadata(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .uid();
    if peer.uid != 0 && owner != peer.uid {
        return Err(format!(
            "{}: not your directory (owner uid {owner}); put the run in a directory you own",
            dir.display()
        ));
    }
    match allowed(peer, dir, 3) {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!("{}: you may not create files there", dir.display())),
        Err(e) => Err(format!("{}: {e}", dir.display())),
    }
}

/// Refuses unless `peer` could read and write the file `path`.
pub fn check_may_write(peer: &Peer, path: &Path) -> Result<(), String> {
    match allowed(peer, path, 6) {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!("{}: you may not read and write it", path.display())),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Refuses unless `peer` could read the directory `dir` (list and open its files).
pub fn check_may_read(peer: &Peer, dir: &Path) -> Result<(), String> {
    match allowed(peer, dir, 5) {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!("{}: you may not read it", dir.display())),
        Err(e) => Err(format!("{}: {e}", dir.display())),
    }
}
