//! How partitions travel between workers: NCCL between GPUs ([`NcclLink`]), channels between
//! the CPU engine's workers ([`ChannelLink`]: the same coordinator, tested without GPUs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use legend_cuda::nccl::Communicator;

use crate::compute::PendingRelations;
use crate::error::TrainError;
use crate::relations::RelationGradients;
use crate::rows::Partition;
use crate::swap::Fence;
use crate::trainer::Trainer;

/// How often a worker waiting for a peer looks whether it should give up.
const POLL: Duration = Duration::from_millis(20);

/// One worker's end of the transport between workers.
pub(crate) trait Link: Send {
    /// Hands each `(partition, peer)` of `out` (resident on `trainer`) to that peer and takes
    /// each `(partition, peer)` of `into` from it, as one exchange with the peers, which post
    /// the matching halves; returns once the arrivals are resident. Fails, never waiting for
    /// ever, once `give_up` is set.
    fn hand_over(
        &mut self,
        trainer: &mut Trainer,
        out: &[(u32, usize)],
        into: &[(u32, usize)],
        give_up: &AtomicBool,
    ) -> Result<(), TrainError>;

    /// Replaces this worker's `pending` relation gradients by their sum over all workers,
    /// the same floats on every worker (every worker makes the call once a step); returns
    /// the point after which the sum is there.
    fn sum_relations(
        &mut self,
        pending: PendingRelations<'_>,
        give_up: &AtomicBool,
    ) -> Result<Fence, TrainError>;
}

/// What CPU workers send each other.
pub(crate) enum Message {
    /// A partition's host rows.
    Partition(Partition),
    /// A step's relation gradients.
    Relations(Arc<RelationGradients>),
}

/// Channels between CPU workers: a partition's host rows move from one worker to the other,
/// and each step's relation gradients go to every other worker (to a worker on another host
/// over the job's connections, see `hosts`).
pub(crate) struct ChannelLink {
    me: usize,
    to: Vec<PeerSender>,
    from: Vec<mpsc::Receiver<Message>>,
}

/// How a CPU worker's messages reach one peer.
pub(crate) enum PeerSender {
    /// A worker of this process.
    Local(mpsc::Sender<Message>),
    /// A worker on another host: the message goes over the job's connections, and a failure
    /// to send fails the job (every host's waits then end).
    Remote(Box<dyn Fn(&Message) + Send>),
}

impl PeerSender {
    fn send(&self, m: Message) {
        match self {
            // A peer that has gone (failed) no longer listens: the give-up flag says so.
            PeerSender::Local(to) => {
                let _ = to.send(m);
            }
            PeerSender::Remote(send) => send(&m),
        }
    }
}

impl ChannelLink {
    /// Worker `me`'s link, sending to each worker through `to` and receiving from each on
    /// `from` (indexed by worker).
    pub(crate) fn new(
        me: usize,
        to: Vec<PeerSender>,
        from: Vec<mpsc::Receiver<Message>>,
    ) -> ChannelLink {
        ChannelLink { me, to, from }
    }

    /// The next message from `peer`, unless the others gave up.
    fn receive(&self, peer: usize, give_up: &AtomicBool) -> Result<Message, TrainError> {
        loop {
            match self.from[peer].recv_timeout(POLL) {
                Ok(m) => return Ok(m),
                Err(mpsc::RecvTimeoutError::Timeout) if !give_up.load(Ordering::Acquire) => {}
                Err(_) => return Err(TrainError::WorkerStopped),
            }
        }
    }
}

/// The links of `k` CPU workers, each with a channel to and from every other.
pub(crate) fn channel_links(k: usize) -> Vec<ChannelLink> {
    let mut senders: Vec<Vec<Option<mpsc::Sender<Message>>>> = vec![vec![None; k]; k];
    let mut receivers: Vec<Vec<Option<mpsc::Receiver<Message>>>> =
        (0..k).map(|_| (0..k).map(|_| None).collect()).collect();
    for a in 0..k {
        for b in 0..k {
            let (tx, rx) = mpsc::channel();
            senders[a][b] = Some(tx);
            receivers[b][a] = Some(rx);
        }
    }
    senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(me, (to, from))| ChannelLink {
            me,
            to: to
                .into_iter()
                .map(|s| PeerSender::Local(s.expect("made above")))
                .collect(),
            from: from.into_iter().map(|r| r.expect("made above")).collect(),
        })
        .collect()
}

impl Link for ChannelLink {
    fn hand_over(
        &mut self,
        trainer: &mut Trainer,
        out: &[(u32, usize)],
        into: &[(u32, usize)],
        give_up: &AtomicBool,
    ) -> Result<(), TrainError> {
        for &(p, _) in into {
            trainer.hand_in(p)?;
        }
        for &(p, peer) in out {
            let rows = trainer
                .hand_out(p)?
                .rows
                .expect("a CPU worker's partitions are host rows");
            self.to[peer].send(Message::Partition(rows));
        }
        for &(p, peer) in into {
            let Message::Partition(rows) = self.receive(peer, give_up)? else {
                unreachable!("worker {peer} sent relation gradients during a hand-over");
            };
            assert_eq!(rows.id, p, "worker {peer} sent another partition");
            trainer.handed_in(p, Some(rows), Fence::passed())?;
        }
        Ok(())
    }

    fn sum_relations(
        &mut self,
        pending: PendingRelations<'_>,
        give_up: &AtomicBool,
    ) -> Result<Fence, TrainError> {
        let PendingRelations::Host(mine) = pending else {
            unreachable!("CPU workers' relation gradients are host rows");
        };
        let shared = Arc::new(mine.clone());
        for (peer, to) in self.to.iter().enumerate() {
            if peer != self.me {
                to.send(Message::Relations(Arc::clone(&shared)));
            }
        }
        // Summed in worker order on every worker: the same floats everywhere.
        mine.clear();
        for peer in 0..self.to.len() {
            if peer == self.me {
                mine.add(&shared);
                continue;
            }
            let Message::Relations(theirs) = self.receive(peer, give_up)? else {
                unreachable!("worker {peer} sent a partition during a step");
            };
            mine.add(&theirs);
        }
        Ok(Fence::passed())
    }
}

/// NCCL between GPUs: a partition's device rows (embeddings and state) are sent from the slot
/// it leaves into a free slot of the GPU it goes to.
pub(crate) struct NcclLink {
    comm: Communicator,
}

impl NcclLink {
    /// The link over `comm` (this worker's GPU's communicator).
    pub(crate) fn new(comm: Communicator) -> NcclLink {
        NcclLink { comm }
    }
}

impl Link for NcclLink {
    fn hand_over(
        &mut self,
        trainer: &mut Trainer,
        out: &[(u32, usize)],
        into: &[(u32, usize)],
        give_up: &AtomicBool,
    ) -> Result<(), TrainError> {
        let mut recvs = Vec::with_capacity(into.len());
        for &(p, peer) in into {
            let span = trainer
                .hand_in(p)?
                .expect("a GPU worker's slots are device rows");
            recvs.push((peer, span));
        }
        let mut sends = Vec::with_capacity(out.len());
        let mut leaving = Vec::with_capacity(out.len());
        for &(p, peer) in out {
            let o = trainer.hand_out(p)?;
            sends.push((peer, o.span.expect("a GPU worker's slots are device rows")));
            leaving.push(o.after);
        }
        let released: Vec<_> = leaving.iter().filter_map(Fence::event).collect();
        // SAFETY: the received spans are free slots this worker reserved, which compute uses
        // only once `handed_in` below; the sent ones are slots compute released (the transfer
        // waits for those events) and that no partition takes before this exchange is waited
        // for (a slot freed here is reserved again only at the next hand-over). The peers post
        // the matching halves: the schedule's moves, the same on every worker.
        unsafe { self.comm.exchange(&sends, &recvs, &released, give_up) }?;
        // Waited for here: the next round starts with its partitions in place (the time is
        // the round's hand-over time).
        self.comm.wait(give_up)?;
        for &(p, _) in into {
            trainer.handed_in(p, None, Fence::passed())?;
        }
        Ok(())
    }

    fn sum_relations(
        &mut self,
        pending: PendingRelations<'_>,
        give_up: &AtomicBool,
    ) -> Result<Fence, TrainError> {
        let PendingRelations::Device { at, floats, after } = pending else {
            unreachable!("GPU workers' relation gradients are device rows");
        };
        let after: Vec<_> = after.event().into_iter().collect();
        // SAFETY: the relation gradient table is this GPU's; compute writes it only in the
        // next step, which waits for the returned fence (the apply waits for it first), and
        // every worker makes this call once a step (the rounds' step counts are aligned).
        let ev = unsafe { self.comm.all_reduce_sum(at, floats, &after, give_up) }?;
        Ok(Fence::at(ev))
    }
}
