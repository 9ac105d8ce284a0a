// SPDX-License-Identifier: GPL-2.0-only

//! I/O queue pairs (`CREATE_QUEUE_PAIR` / `DELETE_QUEUE_PAIR`): rings in the writer's mappings,
//! created and deleted through the admin queue; a Delete the controller refuses quiesces it.

use core::sync::atomic::Ordering;

use kernel::prelude::*;

use super::{
    Controller,
    Live,
    Owner,
    State, //
};
use crate::{
    admin::Command,
    regs,
    uapi, //
};

pub(super) const OPC_DELETE_SQ: u8 = 0x00;

pub(super) const OPC_CREATE_SQ: u8 = 0x01;

pub(super) const OPC_DELETE_CQ: u8 = 0x04;

pub(super) const OPC_CREATE_CQ: u8 = 0x05;

/// An I/O queue pair created through [`uapi::IOCTL_CREATE_QUEUE_PAIR`].
pub(super) struct QueuePair {
    pub(super) owner: Owner,
    pub(super) qid: u32,
    /// [`Live::epoch`] when it was created.
    pub(super) epoch: u64,
    /// Bytes `[start, end)` of each ring within its mapping: `(handle, start, end)`.
    pub(super) rings: [(u32, u64, u64); 2],
}

impl Controller {
    /// Whether queue pair `q` exists on the controller, by `live` (the admin lock held).
    pub(super) fn on_device(live: &Live, q: &QueuePair) -> bool {
        !live.failed && live.epoch == q.epoch
    }

    /// Whether queue pair `q` may still exist on the controller, for holders of the state lock
    /// alone: what the last quiesce published ([`Controller::seen`]), which may lag the admin
    /// queue's view but never leads it.
    pub(super) fn maybe_on_device(&self, q: &QueuePair) -> bool {
        !self.seen.failed.load(Ordering::Acquire)
            && self.seen.epoch.load(Ordering::Acquire) == q.epoch
    }

    /// Bus address of `bytes` at `offset` of mapping `handle`, which must be contiguous.
    ///
    /// # Errors
    ///
    /// `ENOENT` for an unknown handle, `ENXIO` if NVIDIA freed its memory, `EINVAL` otherwise.
    fn queue_memory(
        state: &State,
        owner: Owner,
        handle: u32,
        offset: u64,
        bytes: u64,
    ) -> Result<u64> {
        let m = state
            .maps
            .iter()
            .find(|m| m.owner == owner && m.handle == handle && m.published)
            .ok_or(ENOENT)?;
        if m.revoked {
            return Err(ENXIO);
        }
        let len = m.memory.len() as u64;
        if offset % u64::from(uapi::HOST_PAGE_SIZE) != 0
            || offset.checked_add(bytes).ok_or(EINVAL)? > len
        {
            return Err(EINVAL);
        }
        let page = u64::from(m.memory.page_size());
        let bus = m.memory.bus_addrs();
        // CAST: both indices are below the number of pages, which fits in a `usize`.
        let first = (offset / page) as usize;
        let last = ((offset + bytes - 1) / page) as usize;
        // NVMe queues in this driver are physically contiguous (PC = 1).
        for i in first..last {
            if bus[i + 1] != bus[i] + page {
                return Err(EINVAL);
            }
        }
        Ok(bus[first] + offset % page)
    }

    /// Creates I/O queue pair `args.qid` in memory of `owner`'s mappings; returns the byte offsets
    /// of its SQ tail and CQ head doorbells in the doorbell mapping.
    ///
    /// # Errors
    ///
    /// `EINVAL` for a bad qid, depth, offset, overlapping rings or non-contiguous queue memory,
    /// `EBUSY` if the qid is in use, `ENOENT` for unknown handles, `EIO` if the controller
    /// refuses the command or failed and cannot be enabled again.
    pub(crate) fn create_queue_pair(
        &self,
        owner: Owner,
        args: &uapi::QueuePairArgs,
    ) -> Result<(u32, u32)> {
        if args.qid == 0
            || args.qid > self.info.queue_pairs
            || args.depth < 2
            || args.depth > self.info.max_queue_entries
        {
            return Err(EINVAL);
        }
        self.check_group_alone()?;
        let depth = u64::from(args.depth);
        let rings = [
            (args.sq_handle, args.sq_offset, depth * 64),
            (args.cq_handle, args.cq_offset, depth * 16),
        ]
        .map(|(h, off, len)| (h, off, off.saturating_add(len)));
        let [(sh, ss, se), (ch, cs, ce)] = rings;
        // The controller would overwrite commands with completions.
        if sh == ch && ss < ce && cs < se {
            return Err(EINVAL);
        }
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let mut live_guard = self.live.lock();
        let live = Self::bound_live(&mut live_guard)?;
        self.recover(live)?;
        // Commands of a new queue could still name the freed GPU memory's bus addresses: the
        // owner first acknowledges the revocation by unmapping it.
        if state.maps.iter().any(|m| m.owner == owner && m.revoked) {
            return Err(ENXIO);
        }
        if state.queues.iter().any(|q| q.qid == args.qid) {
            return Err(EBUSY);
        }
        // Another queue's rings would be overwritten by this one's.
        if state.queues.iter().any(|q| {
            q.rings.iter().any(|&(h, s, e)| {
                rings
                    .iter()
                    .any(|&(h2, s2, e2)| h == h2 && s < e2 && s2 < e)
            })
        }) {
            return Err(EINVAL);
        }
        let sq = Self::queue_memory(state, owner, args.sq_handle, args.sq_offset, depth * 64)?;
        let cq = Self::queue_memory(state, owner, args.cq_handle, args.cq_offset, depth * 16)?;
        state.queues.reserve(1, GFP_KERNEL)?;
        let size_qid = ((args.depth - 1) << 16) | args.qid;
        // Polled queue: physically contiguous, interrupts disabled.
        let cq_cdw = [size_qid, 1, 0, 0, 0, 0];
        if !self.create_on_device(live, "CQ", OPC_CREATE_CQ, cq, cq_cdw, args.qid)? {
            return Err(EIO);
        }
        let sq_cdw = [size_qid, (args.qid << 16) | 1, 0, 0, 0, 0];
        if !self.create_on_device(live, "SQ", OPC_CREATE_SQ, sq, sq_cdw, args.qid)? {
            // The CQ must go too; if it cannot, the controller is stopped instead.
            self.delete_on_device(live, args.qid, &[OPC_DELETE_CQ])?;
            return Err(EIO);
        }
        let epoch = live.epoch;
        // Capacity reserved above: cannot fail.
        state.queues.push(
            QueuePair {
                owner,
                qid: args.qid,
                epoch,
                rings: [(sh, ss, se), (ch, cs, ce)],
            },
            GFP_KERNEL,
        )?;
        self.stats.queue_pairs.fetch_add(1, Ordering::Relaxed);
        let stride = self.info.doorbell_stride as usize;
        let offset = |i: usize| -> u32 {
            // CAST: inside the doorbell mapping (`doorbell_len` covers every granted qid).
            (regs::DOORBELLS + i * stride - self.doorbell_base) as u32
        };
        // CAST: `qid <= queue_pairs`.
        let qid = args.qid as usize;
        Ok((offset(2 * qid), offset(2 * qid + 1)))
    }

    /// Deletes queue `qid` on the controller with `opcodes` (SQ before CQ, as the specification
    /// requires). A refusal or an admin failure quiesces the controller.
    ///
    /// # Errors
    ///
    /// `EIO`, whatever failed (a refusal, a timeout); the controller is then disabled and holds
    /// no queue.
    /// Runs one Create I/O CQ or SQ command (`what`) for `qid`: `false` (logged) when the
    /// controller refused it.
    fn create_on_device(
        &self,
        live: &mut Live,
        what: &str,
        opcode: u8,
        prp1: u64,
        cdw: [u32; 6],
        qid: u32,
    ) -> Result<bool> {
        let c = self.admin(
            live,
            &Command {
                opcode,
                prp1,
                cdw,
                ..Default::default()
            },
            None,
        )?;
        if c.status != 0 {
            dev_err!(
                self.dev(),
                "Create I/O {} {} failed with status {:#x}\n",
                what,
                qid,
                c.status
            );
        }
        Ok(c.status == 0)
    }

    pub(super) fn delete_on_device(&self, live: &mut Live, qid: u32, opcodes: &[u8]) -> Result {
        for &opcode in opcodes {
            let c = self
                .admin(
                    live,
                    &Command {
                        opcode,
                        cdw: [qid, 0, 0, 0, 0, 0],
                        ..Default::default()
                    },
                    None,
                )
                .map_err(|_| EIO)?;
            if c.status != 0 {
                dev_err!(
                    self.dev(),
                    "deleting queue {} failed with status {:#x}\n",
                    qid,
                    c.status
                );
                self.quiesce(live, "a queue could not be deleted");
                return Err(EIO);
            }
        }
        Ok(())
    }

    /// Deletes queue pair `i` of `state` on the controller (if it is there) and forgets it.
    ///
    /// # Errors
    ///
    /// As [`Controller::delete_on_device`]; the record then stays, no longer on the device, and
    /// the next call forgets it.
    fn delete_queue(&self, state: &mut State, i: usize) -> Result {
        let qid = state.queues[i].qid;
        let mut live_guard = self.live.lock();
        if let Some(live) = (*live_guard).as_mut() {
            if Self::on_device(live, &state.queues[i]) {
                self.delete_on_device(live, qid, &[OPC_DELETE_SQ, OPC_DELETE_CQ])?;
                self.stats.queue_pairs.fetch_sub(1, Ordering::Relaxed);
            }
        }
        drop(live_guard);
        state.queues.remove(i)?;
        Ok(())
    }

    /// Deletes queue pair `qid` of `owner`.
    ///
    /// # Errors
    ///
    /// `ENOENT` if `owner` has no such queue pair, else as [`Controller::delete_queue`].
    pub(crate) fn delete_queue_pair(&self, owner: Owner, qid: u32) -> Result {
        let mut guard = self.state.lock();
        let i = guard
            .queues
            .iter()
            .position(|q| q.owner == owner && q.qid == qid)
            .ok_or(ENOENT)?;
        self.delete_queue(&mut guard, i)
    }

    /// Deletes every queue pair of `owner`; a failure quiesces the controller, after which none
    /// is left on it either.
    pub(super) fn delete_queues_of(&self, state: &mut State, owner: Owner) {
        while let Some(i) = state.queues.iter().position(|q| q.owner == owner) {
            if self.delete_queue(state, i).is_err() {
                // Quiesced: nothing is on the device any more.
                let _ = state.queues.remove(i);
            }
        }
    }
}
