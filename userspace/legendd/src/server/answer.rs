//! The reply to every request but `watch`: each answer's size is known (or bounded) before it
//! is built, reserved from the daemon's budget, and refused when it could not fit a frame.

use std::os::unix::net::UnixStream;
use std::time::Duration;

use legend_nvme::Controller as _;

use legend_daemon_api::{
    DeviceHealth, DeviceInfo, ErrorCode, FrameError, JobSpec, JobState, MAX_FRAME,
    PROTOCOL_VERSION, Queries, Reply, Request, write_message,
};

use super::{Client, devices, error, job_error};
use crate::budget::Reserved;
use crate::channel::ToJob;
use crate::extents;

/// How long a client waits for a serve job's answer.
const ANSWER_WAIT: Duration = Duration::from_secs(600);

/// What goes back to a client.
pub enum Outgoing {
    /// A reply to serialise.
    Reply(Box<Reply>),
    /// A reply a serve job's process serialised (at most a frame), sent as it is.
    Raw(Vec<u8>),
}

impl From<Reply> for Outgoing {
    fn from(r: Reply) -> Outgoing {
        Outgoing::Reply(Box::new(r))
    }
}

impl Outgoing {
    /// Writes it; one too large for a frame becomes an error saying so.
    pub fn write(self, w: &mut UnixStream) -> Result<(), FrameError> {
        let reply = match self {
            Outgoing::Raw(bytes) => return super::write_frame(w, &bytes),
            Outgoing::Reply(reply) => reply,
        };
        match write_message(w, &*reply) {
            // Nothing was written: the client hears why instead of a closed socket.
            Err(FrameError::TooLarge { len, max }) => {
                let why = format!(
                    "the answer is {len} bytes, over the {max}-byte frame limit (ask fewer \
                     queries or entities at once; delete ended jobs to shorten a list)"
                );
                write_message(w, &error(ErrorCode::Unavailable, why))
            }
            written => written,
        }
    }
}

/// Refuses an answer of `bytes` before it is built when it cannot fit a frame.
fn too_large(bytes: usize, what: &str) -> Option<Reply> {
    (bytes > MAX_FRAME).then(|| {
        error(
            ErrorCode::Unavailable,
            format!(
                "the answer would be about {bytes} bytes, over the {MAX_FRAME}-byte frame limit \
                 ({what})"
            ),
        )
    })
}

impl Client {
    /// Reserves `bytes` more for the answer; why not when there is no room.
    fn room(&self, bytes: usize) -> Result<Reserved, String> {
        self.budget.reserve(&self.peer, bytes)
    }

    /// `answer()` for job `id` when the caller may manage it and `room` was had; the refusal
    /// otherwise.
    fn managed(
        &self,
        id: u64,
        room: Result<Reserved, String>,
        answer: impl FnOnce() -> Reply,
    ) -> Reply {
        if let Some(refused) = self.refusal(id) {
            return refused;
        }
        match room {
            Ok(_room) => answer(),
            Err(why) => error(ErrorCode::Unavailable, why),
        }
    }

    /// `answer()` when `room` was had; why not otherwise.
    fn within(room: Result<Reserved, String>, answer: impl FnOnce() -> Reply) -> Reply {
        match room {
            Ok(_room) => answer(),
            Err(why) => error(ErrorCode::Unavailable, why),
        }
    }

    /// Why the caller may not manage job `id`, as the reply to send; `None` when it may.
    fn refusal(&self, id: u64) -> Option<Reply> {
        match self.jobs.size_of(id) {
            None => Some(job_error(crate::jobs::JobError::NotFound(id))),
            Some((owner, _)) if self.peer.may_manage(owner) => None,
            Some(_) => Some(error(
                ErrorCode::Forbidden,
                format!("job {id} is not yours"),
            )),
        }
    }

    /// The reply to `request`; `held` is what reading it reserved.
    pub(super) fn answer(&self, request: Request, held: Reserved) -> Outgoing {
        let (peer, jobs) = (&self.peer, &self.jobs);
        // One job's record at most, twice (the job and its answer), for the small answers.
        let one_job = || self.room(2 * crate::jobs::record::MAX_RECORD_BYTES as usize);
        let reply = match request {
            Request::Hello => Reply::Hello {
                version: PROTOCOL_VERSION,
                daemon: env!("CARGO_PKG_VERSION").into(),
                uid: peer.uid,
                admin: peer.admin,
            },
            Request::Submit { job } => {
                Self::within(one_job(), || super::submit::submit(job, peer, jobs))
            }
            Request::List { all } => {
                if all && !peer.admin {
                    return error(
                        ErrorCode::Forbidden,
                        "only the admin group sees everyone's jobs",
                    )
                    .into();
                }
                let owner = (!all).then_some(peer.uid);
                let bytes = jobs.list_size(owner) + 64;
                if let Some(refused) = too_large(bytes, "delete ended jobs to shorten the list") {
                    return refused.into();
                }
                Self::within(self.room(2 * bytes), || Reply::Jobs {
                    jobs: jobs.list(owner),
                })
            }
            Request::Status { job } => self.managed(job, one_job(), || {
                jobs.get(job)
                    .map_or_else(job_error, |job| Reply::Job { job })
            }),
            Request::Cancel { job } => self.managed(job, one_job(), || {
                jobs.cancel(job)
                    .map_or_else(job_error, |job| Reply::Job { job })
            }),
            Request::Logs { job } => self.managed(job, self.room(MAX_FRAME), || Reply::Text {
                text: crate::jobs::log::tail(&jobs.log_path(job), MAX_FRAME / 2),
            }),
            Request::Delete { job } => self.managed(job, one_job(), || delete(job, jobs)),
            Request::Metrics => {
                let shows = |owner| peer.may_manage(owner);
                let bytes = jobs.metrics_size(shows);
                if let Some(refused) = too_large(bytes, "too many jobs to show") {
                    return refused.into();
                }
                Self::within(self.room(2 * bytes), || Reply::Text {
                    text: jobs.metrics(shows),
                })
            }
            Request::Devices => devices::devices(),
            Request::Bind { bdf, force } if peer.admin => {
                devices::change(legend_nvme::Sysfs::default().bind(&bdf, force))
            }
            Request::Unbind { bdf } if peer.admin => {
                devices::change(legend_nvme::Sysfs::default().unbind(&bdf))
            }
            Request::Bind { .. } | Request::Unbind { .. } => error(
                ErrorCode::Forbidden,
                "only the admin group binds and unbinds devices",
            ),
            Request::DeviceInfo { device } => devices::report(&device, |d| {
                d.info()
                    .map(|info| serde_json::to_value(DeviceInfo::new(&device, &info)))
            }),
            Request::DeviceHealth { device } => devices::report(&device, |d| {
                d.health()
                    .map(|h| serde_json::to_value(DeviceHealth::new(&device, &h)))
            }),
            Request::Query { job, queries } => {
                // The request's text stays held while it is forwarded; its answer comes back
                // at most a frame long.
                return match self.room(MAX_FRAME) {
                    Ok(_room) => self.query(job, queries),
                    Err(why) => error(ErrorCode::Unavailable, why).into(),
                };
            }
            Request::Watch { .. } => unreachable!("answered by watch()"),
        };
        drop(held);
        reply.into()
    }

    /// Forwards queries to the serve job `id`'s process, for its submitter, a member of the
    /// group it names, or root; its answer goes back as the process wrote it.
    fn query(&self, id: u64, queries: Queries) -> Outgoing {
        let Some((owner, _)) = self.jobs.size_of(id) else {
            return job_error(crate::jobs::JobError::NotFound(id)).into();
        };
        let live = self.jobs.live(id);
        let serve = live.as_ref().and_then(|l| l.serve.as_ref());
        let allowed = match serve {
            Some(s) => s.may_query(&self.peer),
            None => self.peer.uid == 0 || self.peer.uid == owner,
        };
        if !allowed {
            return error(
                ErrorCode::Forbidden,
                format!("job {id} is not yours, nor served to a group of yours"),
            )
            .into();
        }
        let (Some(live), Some(serve)) = (live.as_ref(), serve) else {
            return self.not_serving(id).into();
        };
        if !serve.is_serving() {
            return self.not_serving(id).into();
        }
        let forwarded = serve.forward();
        if live
            .send(&ToJob::Query {
                id: forwarded.id,
                queries,
            })
            .is_err()
        {
            return self.not_serving(id).into();
        }
        match forwarded.answer(ANSWER_WAIT) {
            Some(bytes) => Outgoing::Raw(bytes),
            None => error(
                ErrorCode::Unavailable,
                format!("job {id} ended, or took too long, before it answered"),
            )
            .into(),
        }
    }

    /// Why job `id` does not answer queries now.
    fn not_serving(&self, id: u64) -> Reply {
        match self.jobs.get(id) {
            Err(e) => job_error(e),
            Ok(info) => match (&info.spec, info.state) {
                (JobSpec::Serve { .. }, JobState::Queued | JobState::Running) => error(
                    ErrorCode::Unavailable,
                    format!(
                        "job {id} is {} (loading its run): try again",
                        info.state.name()
                    ),
                ),
                (JobSpec::Serve { .. }, state) => error(
                    ErrorCode::Refused,
                    format!("job {id} has ended ({}): submit serve again", state.name()),
                ),
                (spec, _) => error(
                    ErrorCode::Refused,
                    format!("job {id} is a {} job, not a serve job", spec.kind()),
                ),
            },
        }
    }
}

/// Deletes an ended job; the last train job of a run on a namespace frees the run's extent
/// there (the one recorded at submission: the run's `run.toml` is not asked).
fn delete(id: u64, jobs: &crate::jobs::Jobs) -> Reply {
    let (info, store) = match jobs.delete(id) {
        Ok(deleted) => deleted,
        Err(e) => return job_error(e),
    };
    let run = info.spec.dir();
    let last_of_its_run = matches!(info.spec, JobSpec::Train { .. }) && !jobs.has_train_job_on(run);
    if last_of_its_run
        && let Some(store) = store
        && let Err(why) = extents::release(&extents::Placement::from(store), run, info.owner)
    {
        return error(
            ErrorCode::Unavailable,
            format!("job {id} deleted, but its run's extent was not freed: {why}"),
        );
    }
    Reply::Job { job: info }
}
