//! The daemon's memory for requests in flight: every request reserves what reading, parsing
//! and answering it may hold (twice its frame, and its answer's bound) before the daemon reads
//! its body, and gives it back when answered. One budget for the whole daemon
//! (`request_memory_mib`), of which one user outside the admin group may hold a quarter and
//! users together all but an eighth: a request past its share is answered `unavailable`,
//! naming the setting, and costs nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::access::Peer;

/// Bytes in flight, in all and by uid.
#[derive(Default)]
struct InFlight {
    total: usize,
    by_uid: HashMap<u32, usize>,
}

/// The budget.
pub struct Budget {
    limit: usize,
    in_flight: Mutex<InFlight>,
}

/// Bytes reserved, given back when dropped.
pub struct Reserved {
    budget: Arc<Budget>,
    uid: u32,
    bytes: usize,
}

impl Budget {
    /// A budget of `mib` MiB.
    pub fn new(mib: u64) -> Arc<Budget> {
        Arc::new(Budget {
            limit: usize::try_from(mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
            in_flight: Mutex::default(),
        })
    }

    /// Reserves `bytes` for `peer`, or says why not.
    pub fn reserve(self: &Arc<Self>, peer: &Peer, bytes: usize) -> Result<Reserved, String> {
        let mut f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let mine = f.by_uid.get(&peer.uid).copied().unwrap_or(0);
        let (cap, whose) = if peer.admin {
            (self.limit, "the daemon's")
        } else if mine + bytes > self.limit / 4 {
            return Err(format!(
                "uid {} has {} KiB of requests in flight, and this one needs {} KiB more (a \
                 user may hold a quarter of request_memory_mib = {} MiB); try again",
                peer.uid,
                mine >> 10,
                bytes.div_ceil(1 << 10),
                self.limit >> 20
            ));
        } else {
            (self.limit - self.limit / 8, "the users'")
        };
        if f.total + bytes > cap {
            return Err(format!(
                "{} KiB of requests are in flight, and this one needs {} KiB more ({whose} share \
                 of request_memory_mib = {} MiB); try again",
                f.total >> 10,
                bytes.div_ceil(1 << 10),
                self.limit >> 20
            ));
        }
        f.total += bytes;
        *f.by_uid.entry(peer.uid).or_default() += bytes;
        Ok(Reserved {
            budget: self.clone(),
            uid: peer.uid,
            bytes,
        })
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let mut f = self
            .budget
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        f.total -= self.bytes;
        if let Some(n) = f.by_uid.get_mut(&self.uid) {
            *n -= self.bytes;
            if *n == 0 {
                f.by_uid.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, admin: bool) -> Peer {
        Peer {
            uid,
            gid: uid,
            groups: Vec::new(),
            admin,
        }
    }

    #[test]
    fn a_user_holds_a_quarter_users_leave_an_eighth_to_the_admins() {
        let b = Budget::new(8);
        let mib = 1 << 20;
        let a = b.reserve(&peer(1, false), 2 * mib).unwrap();
        let e = b.reserve(&peer(1, false), 1).err().unwrap();
        assert!(e.contains("request_memory_mib = 8"), "{e}");
        let _others: Vec<_> = (2..4)
            .map(|u| b.reserve(&peer(u, false), 2 * mib).unwrap())
            .collect();
        // 6 MiB of 8 held; users may take 7.
        let _more = b.reserve(&peer(4, false), mib).unwrap();
        assert!(b.reserve(&peer(5, false), 1).is_err());
        let _admin = b.reserve(&peer(0, true), mib).unwrap();
        assert!(b.reserve(&peer(0, true), 1).is_err());
        drop(a);
        // 6 MiB held, admins' included: a user may take one more.
        b.reserve(&peer(1, false), mib).unwrap();
    }
}
