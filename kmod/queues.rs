// SPDX-License-Identifier: GPL-2.0-only

//! I/O queue pairs (`CREATE_QUEUE_PAIR` / `DELETE_QUEUE_PAIR`): rings in the writer's mappings,
//! created and deleted through the admin queue; a Delete the controller refuses quiesces it.

use core::sync::atomic::Ordering;

use kernel::prelude::*;

use super::{
    Controller,
    Live,
    State, //
};
use crate::{
    admin::Command,
    owner::Owner,
    regs,
    rules::{
        self,
        Span, //
    },
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
    /// The physical memory of its SQ and CQ, sorted and merged ([`rules::normalize`]): no other
    /// ring may share a byte of it, whatever mapping (or handle) that ring came through.
    footprint: KVec<Span>,
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

    /// Bus address and physical footprint (sorted and merged) of `bytes` at `offset` of mapping
    /// `handle`, which must be contiguous in bus address space.
    ///
    /// # Errors
    ///
    /// `ENOENT` for an unknown handle, `ENXIO` if NVIDIA freed its memory, `ENOMEM`, `EINVAL`
    /// otherwise.
    fn ring_memory(
        state: &State,
        owner: Owner,
        handle: u32,
        offset: u64,
        bytes: u64,
    ) -> Result<(u64, KVec<Span>)> {
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
        let mut footprint = KVec::with_capacity(last - first + 1, GFP_KERNEL)?;
        for span in rules::ring_spans(offset, bytes, page, |i| m.memory.frame(i)) {
            footprint.push(span, GFP_KERNEL)?;
        }
        let n = rules::normalize(&mut footprint);
        footprint.truncate(n);
        Ok((bus[first] + offset % page, footprint))
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
        let (sq, mut footprint) =
            Self::ring_memory(state, owner, args.sq_handle, args.sq_offset, depth * 64)?;
        let (cq, cq_footprint) =
            Self::ring_memory(state, owner, args.cq_handle, args.cq_offset, depth * 16)?;
        // Compared by memory, not by handle: the same pages mapped twice have two handles. The
        // controller would overwrite commands with completions, or another queue's entries.
        if rules::overlap(&footprint, &cq_footprint)
            || state.queues.iter().any(|q| {
                rules::overlap(&q.footprint, &footprint)
                    || rules::overlap(&q.footprint, &cq_footprint)
            })
        {
            return Err(EINVAL);
        }
        footprint.extend_from_slice(&cq_footprint, GFP_KERNEL)?;
        let n = rules::normalize(&mut footprint);
        footprint.truncate(n);
        state.queues.reserve(1, GFP_KERNEL)?;
        let size_qid = ((args.depth - 1) << 16) | args.qid;
        // Polled queue: physically contiguous, interrupts disabled.
        let cq_cdw = [size_qid, 1, 0, 0, 0, 0];
        if !self.create_on_device(live, "CQ", OPC_CREATE_CQ, cq, cq_cdw, args.qid)? {
            return Err(EIO);
        }
        let sq_cdw = [size_qid, (args.qid << 16) | 1, 0, 0, 0, 0];
        let sq_created = self.create_on_device(live, "SQ", OPC_CREATE_SQ, sq, sq_cdw, args.qid);
        if !matches!(sq_created, Ok(true)) {
            // The CQ must go too, however the SQ failed (a refusal, no memory for the command);
            // if it cannot, the controller is stopped instead. A failed controller has no queue.
            if !live.failed {
                self.delete_on_device(live, args.qid, &[OPC_DELETE_CQ])?;
            }
            return Err(sq_created.err().unwrap_or(EIO));
        }
        let epoch = live.epoch;
        // Capacity reserved above: cannot fail.
        state.queues.push(
            QueuePair {
                owner,
                qid: args.qid,
                epoch,
                footprint,
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

    /// Deletes queue `qid` on the controller with `opcodes` (SQ before CQ, as the specification
    /// requires). Any failure (a refusal, a timeout, no memory for the command) quiesces the
    /// controller: either way the queue is gone from it when this returns.
    ///
    /// # Errors
    ///
    /// `EIO`, whatever failed; the controller is then disabled and holds no queue.
    pub(super) fn delete_on_device(&self, live: &mut Live, qid: u32, opcodes: &[u8]) -> Result {
        for &opcode in opcodes {
            let status = self
                .admin(
                    live,
                    &Command {
                        opcode,
                        cdw: [qid, 0, 0, 0, 0, 0],
                        ..Default::default()
                    },
                    None,
                )
                .map(|c| c.status);
            if status != Ok(0) {
                if let Ok(status) = status {
                    dev_err!(
                        self.dev(),
                        "deleting queue {} failed with status {:#x}\n",
                        qid,
                        status
                    );
                }
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

    /// Deletes queue pair `i` of `state` and forgets it, whatever the deletion reports: a
    /// failure quiesced the controller, so it is not on the device either.
    fn delete_and_forget(&self, state: &mut State, i: usize) {
        if self.delete_queue(state, i).is_err() {
            let _ = state.queues.remove(i);
        }
    }

    /// Undoes [`Controller::create_queue_pair`] of `qid` for `owner`, whose result could not be
    /// handed to the caller: the queue pair leaves the controller and the records.
    pub(crate) fn undo_create_queue_pair(&self, owner: Owner, qid: u32) {
        let mut guard = self.state.lock();
        if let Some(i) = guard
            .queues
            .iter()
            .position(|q| q.owner == owner && q.qid == qid)
        {
            self.delete_and_forget(&mut guard, i);
        }
    }

    /// Deletes every queue pair of `owner`; a failure quiesces the controller, after which none
    /// is left on it either.
    pub(super) fn delete_queues_of(&self, state: &mut State, owner: Owner) {
        while let Some(i) = state.queues.iter().position(|q| q.owner == owner) {
            self.delete_and_forget(state, i);
        }
    }
}
