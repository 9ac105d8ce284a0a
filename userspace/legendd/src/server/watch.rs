//! `watch`: a job's events as they happen, then its end. The watcher is taken off its job as
//! soon as the watch ends, whether the job ended or the client went away.

use std::os::unix::net::UnixStream;
use std::time::Duration;

use legend_daemon_api::{ErrorCode, FrameError, Reply, write_message};

use super::{error, job_error};
use crate::access::Peer;
use crate::jobs::Jobs;
use crate::jobs::watch::Next;

/// How often a quiet watch asks whether its client went away.
const HANGUP_EVERY: Duration = Duration::from_millis(250);

/// Takes a watcher off its job when the watch ends, however it ends.
struct Registered<'a> {
    jobs: &'a Jobs,
    job: u64,
    watcher: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.jobs.unwatch(self.job, self.watcher);
    }
}

/// Streams job `id`'s events to the client until the job ends (or the client goes away).
pub fn watch(writer: &mut UnixStream, peer: &Peer, jobs: &Jobs, id: u64) -> Result<(), FrameError> {
    let owner = match jobs.size_of(id) {
        Some((owner, _)) => owner,
        None => return write_message(writer, &job_error(crate::jobs::JobError::NotFound(id))),
    };
    if !peer.may_manage(owner) {
        return write_message(
            writer,
            &error(ErrorCode::Forbidden, format!("job {id} is not yours")),
        );
    }
    if let Ok(Some((watcher, queue))) = jobs.watch(id) {
        let _registered = Registered {
            jobs,
            job: id,
            watcher,
        };
        loop {
            match queue.next(HANGUP_EVERY) {
                Next::Event(bytes) => super::write_frame(writer, &bytes)?,
                // The job ended, or went back to the queue with a stopping daemon.
                Next::Closed => break,
                // A quiet job writes nothing that would find the client gone: ask the socket,
                // so a closed watch frees its queue and its connection slot.
                Next::Quiet if hung_up(writer) => return Ok(()),
                Next::Quiet => {}
            }
        }
    }
    let job = jobs.get(id).map_err(|_| FrameError::Truncated)?;
    write_message(writer, &Reply::Ended { job })
}

/// Whether the peer of `stream` closed its end (or the connection failed).
fn hung_up(stream: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd of an open socket, no wait.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}
