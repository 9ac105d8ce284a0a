//! Jobs' processes: how they are started ([`spawn`]), the cgroups that bound them
//! ([`cgroup`]), and the identities of jobs on shared NVMe namespaces ([`DeviceUids`]).
//!
//! A job on the memory, file or proxy backend runs as its submitter: its data is theirs, and
//! the kernel checks every file it opens as it would theirs. A job on a shared NVMe namespace
//! holds a controller that can write any LBA of it, so it must not be its submitter's to
//! control: it runs under a uid of the daemon's (`device_job_uids`, like systemd's
//! `DynamicUser`), one per running job, with the daemon's group, which its submitter can
//! neither signal nor trace.

pub mod cgroup;
pub mod spawn;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// The uids device jobs run under, each held by one running job.
pub struct DeviceUids {
    range: Option<(u32, u32)>,
    taken: Mutex<BTreeSet<u32>>,
}

/// A uid taken for a job; given back when dropped.
pub struct DeviceUid {
    pool: Arc<DeviceUids>,
    /// The uid.
    pub uid: u32,
}

impl DeviceUids {
    /// The pool of `range` (inclusive; none: device jobs are refused).
    pub fn new(range: Option<(u32, u32)>) -> Arc<DeviceUids> {
        Arc::new(DeviceUids {
            range,
            taken: Mutex::default(),
        })
    }

    /// Whether device jobs can run here (`device_job_uids` is set).
    pub fn configured(&self) -> bool {
        self.range.is_some()
    }

    /// Whether `uid` is one of the pool's.
    pub fn contains(&self, uid: u32) -> bool {
        self.range.is_some_and(|(a, b)| (a..=b).contains(&uid))
    }

    /// A free uid: in the range, held by no running job, and unknown to the user database.
    pub fn take(self: &Arc<Self>) -> Result<DeviceUid, String> {
        let Some((first, last)) = self.range else {
            return Err(
                "jobs on an NVMe namespace need device_job_uids in legendd.toml (a range of \
                 unused uids they run under: Documentation/admin-guide.md, \"The service\")"
                    .into(),
            );
        };
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let free = (first..=last).find(|&uid| {
            !taken.contains(&uid)
                && nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
                    .is_ok_and(|u| u.is_none())
        });
        let Some(uid) = free else {
            return Err(format!(
                "every uid of device_job_uids ({first}-{last}) is held by a running job or \
                 named in the user database"
            ));
        };
        taken.insert(uid);
        Ok(DeviceUid {
            pool: self.clone(),
            uid,
        })
    }
}

impl Drop for DeviceUid {
    fn drop(&mut self) {
        self.pool
            .taken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_uids_are_held_one_a_job() {
        let none = DeviceUids::new(None);
        assert!(none.take().err().unwrap().contains("device_job_uids"));
        // Far above any user database's entries.
        let pool = DeviceUids::new(Some((3_999_999_000, 3_999_999_001)));
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        assert_ne!(a.uid, b.uid);
        assert!(pool.take().err().unwrap().contains("held by a running job"));
        drop(a);
        assert!(pool.contains(pool.take().unwrap().uid));
    }
}
