//! Who is asking, and what they may touch: callers are identified by their socket credentials,
//! and a job reads and writes only where its submitter could.

use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use legend_fs::{Dir, Guard, ReadCheck};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::sys::stat::FileStat;
use nix::unistd::{Gid, Group, Uid, User};

/// A connected client.
#[derive(Clone, Debug)]
pub struct Peer {
    /// Its uid.
    pub uid: u32,
    /// Its gid (the connecting process's; for a job, what its process runs with).
    pub gid: u32,
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
        Ok(Peer {
            uid,
            gid: cred.gid(),
            groups,
            admin,
        })
    }

    /// A user known by uid alone: their primary group from the user database (their uid
    /// where it has none).
    pub fn of_uid(uid: u32) -> Peer {
        let gid = User::from_uid(Uid::from_raw(uid))
            .ok()
            .flatten()
            .map_or(uid, |u| u.gid.as_raw());
        Peer::of_ids(uid, gid)
    }

    /// A job's submitter known by uid and the gid they submitted with (a job outlives its
    /// connection, and the daemon): groups from the user database as they are now.
    pub fn of_ids(uid: u32, gid: u32) -> Peer {
        Peer {
            uid,
            gid,
            groups: groups_of(uid, gid),
            admin: false,
        }
    }

    /// How the daemon checks what it opens for this peer: as the kernel would check the
    /// peer's own open (search on each directory, read or write at the end).
    pub fn read_check(&self) -> ReadCheck {
        let peer = self.clone();
        Arc::new(move |st: &FileStat, want: u32| {
            if allows_bits(&peer, st.st_uid, st.st_gid, st.st_mode, want) {
                return Ok(());
            }
            let what = match want {
                1 => "search a directory on the way",
                4 | 5 => "read it",
                _ => "write it",
            };
            Err(std::io::Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "uid {} may not {what} (owner uid {}, mode {:o})",
                    peer.uid,
                    st.st_uid,
                    st.st_mode & 0o7777
                ),
            ))
        })
    }

    /// Opens the directory `path` as this peer could (legend-fs's `Dir::open_checked`): an
    /// error says only what the peer could have found out by looking.
    /// What the daemon reads through it is read only up to [`crate::paths::USER_TEXT_LIMIT`].
    pub fn open_dir(&self, path: &Path) -> Result<Dir, String> {
        Dir::open_checked(path, self.read_check())
            .map(|d| d.with_text_limit(crate::paths::USER_TEXT_LIMIT))
            .map_err(|e| format!("{}: {e}", crate::paths::shown(path)))
    }

    /// Whether this peer may see and cancel a job of `owner`.
    pub fn may_manage(&self, owner: u32) -> bool {
        self.admin || self.uid == owner
    }
}

/// The id of the group `name` (a group name of at most 64 bytes, from the group database).
pub fn group_id(name: &str) -> Result<u32, String> {
    if name.is_empty() || name.len() > 64 {
        return Err(format!("{} bytes is not a group name", name.len()));
    }
    match Group::from_name(name) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(format!("no group {name:?}")),
        Err(e) => Err(format!("looking up group {name:?}: {e}")),
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

/// Whether `peer` has the permission bits `want` on the file of `m`.
fn allows(peer: &Peer, m: &std::fs::Metadata, want: u32) -> bool {
    allows_bits(peer, m.uid(), m.gid(), m.mode(), want)
}

/// Whether `peer` has the permission bits `want` on a file of owner `uid`, group `gid` and
/// `mode`.
fn allows_bits(peer: &Peer, uid: u32, gid: u32, mode: u32, want: u32) -> bool {
    if peer.uid == 0 {
        return true;
    }
    let bits = if uid == peer.uid {
        mode >> 6
    } else if peer.groups.contains(&gid) {
        mode >> 3
    } else {
        mode
    };
    bits & want == want
}

/// What a job's process may write: directories it opens by path (its run's parent, its run, a
/// store's or an export's directory) must be its submitter's (or, for a job under a device
/// identity, made by that job's process), who may create files in them, checked on the opened
/// directory (legend-fs reaches everything beneath it without following links).
///
/// A job running as its submitter reads with the kernel's checks, which are theirs. A job under
/// a device identity reads as its submitter could (every directory on the way searchable by
/// them, every file readable), checked on what it opens: its own rights (the daemon's group)
/// are not its submitter's.
#[derive(Clone)]
pub struct JobGuard {
    submitter: Peer,
    /// Reads are checked as the submitter's (the process is not them).
    check_reads: bool,
}

impl JobGuard {
    /// The guard of a job `submitter` sent, whose process runs as them (`as_submitter`) or
    /// under a device identity.
    pub fn new(submitter: Peer, as_submitter: bool) -> JobGuard {
        JobGuard {
            submitter,
            check_reads: !as_submitter,
        }
    }
}

impl Guard for JobGuard {
    fn admit(&self, dir: &Dir) -> std::io::Result<()> {
        let m = dir.metadata()?;
        let peer = &self.submitter;
        let refuse = |why: String| Err(std::io::Error::new(ErrorKind::PermissionDenied, why));
        let own = m.uid() == Uid::effective().as_raw();
        if peer.uid != 0 && m.uid() != peer.uid && !own {
            return refuse(format!(
                "not the submitter's directory (owner uid {}, submitter uid {}); a job writes \
                 only into directories its submitter owns",
                m.uid(),
                peer.uid
            ));
        }
        if !own && !allows(peer, &m, 3) {
            return refuse("the submitter may not create files there".into());
        }
        Ok(())
    }

    fn read_check(&self) -> Option<ReadCheck> {
        self.check_reads.then(|| self.submitter.read_check())
    }
}

/// Opens the directory `path` for `peer` to create entries in: it must belong to `peer` (or
/// `peer` is root) and let `peer` write: a job writes its run directory only into a directory
/// of its submitter's own, never into a shared one (`/tmp`) or another user's that happens to
/// be open to the daemon.
pub fn open_to_create_in(peer: &Peer, path: &Path) -> Result<Dir, String> {
    let dir = peer.open_dir(path)?;
    may_create_in(peer, &dir)?;
    Ok(dir)
}

fn may_create_in(peer: &Peer, dir: &Dir) -> Result<(), String> {
    let m = dir
        .metadata()
        .map_err(|e| format!("{}: {e}", dir.path().display()))?;
    if peer.uid != 0 && m.uid() != peer.uid {
        return Err(format!(
            "{}: not your directory (owner uid {}); put the run in a directory you own",
            dir.path().display(),
            m.uid()
        ));
    }
    if !allows(peer, &m, 3) {
        return Err(format!(
            "{}: you may not create files there",
            dir.path().display()
        ));
    }
    Ok(())
}

/// Opens the directory `path` if it belongs to `peer` (or `peer` is root): the daemon reads
/// runs for their owners only.
pub fn open_own(peer: &Peer, path: &Path) -> Result<Dir, String> {
    let dir = peer.open_dir(path)?;
    let owner = dir
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .uid();
    if peer.uid != 0 && owner != peer.uid {
        return Err(format!(
            "{}: not your run (owner uid {owner}); the daemon evaluates and exports its submitters' own runs",
            path.display()
        ));
    }
    Ok(dir)
}

/// Refuses unless `peer` could read and write the file `path`, or create it.
pub fn check_may_write_or_create(peer: &Peer, path: &Path) -> Result<(), String> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(format!("{}: not a file path", path.display()));
    };
    let dir = peer.open_dir(parent)?;
    match dir.entry(name) {
        Ok(Some(st)) => (peer.read_check())(&st, 6).map_err(|e| format!("{}: {e}", path.display())),
        Ok(None) => may_create_in(peer, &dir),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}
