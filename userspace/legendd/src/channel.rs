//! The channel between the daemon and a job's process: a socket pair, the process's
//! descriptor 3. The daemon sends the job ([`ToJob::Start`]), a stop, and a serve job's
//! queries; the process sends its events, log lines, a serve job's answers, and how it ended.
//!
//! A job's process may be its submitter's to control (it runs as them), so what it sends is
//! read like a request: control messages of at most [`CONTROL_MAX`] bytes parsed into typed
//! messages (the metrics lines they carry bounded by that), answers of at most a frame, which
//! the daemon hands to the asking client as they are, never parsed. A process that breaks the
//! framing is killed.
//!
//! A frame is a 4-byte big-endian length, a kind byte, and the payload: kind 0 is a JSON
//! message, kind 1 an answer (`u64` request id, `u32` queries answered, the reply's JSON).

use std::io::{Read, Write};

use legend_daemon_api::{JobSpec, MAX_FRAME, Queries};
use serde::{Deserialize, Serialize};

/// The largest control message a job's process may send.
pub const CONTROL_MAX: usize = 64 << 10;

/// The descriptor a job's process finds its channel on.
pub const CHANNEL_FD: i32 = 3;

/// The descriptor a job's process finds its kernel cache directory on.
pub const CACHE_FD: i32 = 4;

const KIND_MESSAGE: u8 = 0;
const KIND_ANSWER: u8 = 1;

/// What the daemon sends a job's process.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToJob {
    /// The job: the first message, sent once the process is in its cgroup.
    Start(Box<JobStart>),
    /// Stop at the next checkpointable point (a serve job: now).
    Stop,
    /// Queries for a serve job, as the client sent them.
    Query {
        /// The request's id on this channel.
        id: u64,
        /// The queries.
        queries: Queries,
    },
}

/// A job as its process gets it.
#[derive(Debug, Serialize, Deserialize)]
pub struct JobStart {
    /// The job's id.
    pub id: u64,
    /// What to run.
    pub spec: JobSpec,
    /// Who submitted it: whose directories it may write, as whom a process under another
    /// identity reads.
    pub submitter: Submitter,
    /// The process runs under an identity of the daemon's (a shared NVMe namespace), not as
    /// its submitter: reads are checked as the submitter would be, and the directories it makes
    /// stay its own until the daemon hands them over.
    pub device_identity: bool,
    /// A train job's run exists already: it is resumed.
    pub run_made: bool,
    /// What the run's `run.toml` must say of its store: the daemon recorded it at submission.
    pub expect: Option<crate::extents::RecordedStore>,
    /// A serve job's placement.
    pub serve: Option<ServeStart>,
}

/// The submitter as the daemon knows them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Submitter {
    /// Their uid.
    pub uid: u32,
    /// The gid they submitted with.
    pub gid: u32,
    /// Their groups.
    pub groups: Vec<u32>,
}

/// Where a serve job answers, as the daemon's policy places it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServeStart {
    /// `cpu`, `cuda:N` or `auto`.
    pub device: String,
    /// Bytes of the GPU the run may hold (the `serve_gpu_memory` share left), if on one.
    pub gpu_budget: Option<u64>,
    /// `serve_cache_fraction`.
    pub cache_fraction: f64,
    /// `serve_host_memory_mib`, in bytes.
    pub host_limit: Option<u64>,
    /// The group whose members may query (its members' queries come through the daemon).
    pub group: Option<u32>,
}

/// What a job's process sends the daemon.
#[derive(Debug, Serialize, Deserialize)]
pub enum FromJob {
    /// The engine it runs on, as the session describes it.
    Engine(String),
    /// A train job's run directory exists now: after a restart the job continues it.
    RunMade,
    /// An epoch begins (or continues from a checkpoint inside it).
    EpochStarted {
        /// The epoch.
        epoch: u32,
        /// Of how many.
        epochs: u32,
        /// Edges of an epoch.
        edges: u64,
        /// Edges done so far.
        edges_done: u64,
    },
    /// Edges of the epoch done so far (at most four times a second).
    Progress(u64),
    /// An epoch ended.
    Epoch(Box<EpochEnd>),
    /// A checkpoint was committed at this position.
    Checkpoint(String),
    /// An evaluation of this split began.
    Evaluating(String),
    /// An evaluation ended: its `metrics.jsonl` line, and its line for the job's log.
    Evaluated {
        /// The `metrics.jsonl` line.
        line: serde_json::Value,
        /// In words.
        text: String,
    },
    /// A line for the job's log.
    Log(String),
    /// A serve job holds its run and answers.
    Serving(Box<Serving>),
    /// How the job ended: the last message.
    Ended(Ended),
}

/// An epoch's end.
#[derive(Debug, Serialize, Deserialize)]
pub struct EpochEnd {
    /// Its `metrics.jsonl` line.
    pub line: serde_json::Value,
    /// Its number.
    pub epoch: u32,
    /// Mean loss.
    pub loss: f64,
    /// Positive edges per second.
    pub edges_per_sec: f64,
    /// Seconds it took.
    pub seconds: f64,
    /// Bytes its swaps moved.
    pub io_bytes: u64,
    /// Its line for the job's log (with the validation metrics when it was validated).
    pub text: String,
}

/// A serve job's run as loaded.
#[derive(Debug, Serialize, Deserialize)]
pub struct Serving {
    /// Where it answers, in words.
    pub placement: String,
    /// Why its entity rows are streamed, if they are.
    pub streamed: Option<String>,
    /// Bytes of tables in host memory.
    pub host_bytes: u64,
    /// Bytes a streamed run's reads hold at most besides.
    pub stream_bytes: u64,
    /// Bytes of GPU memory.
    pub gpu_bytes: u64,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// The row cache's hit rate and misses, when it has one (updated with each answer).
    pub cache: Option<(f64, u64)>,
}

/// How a job ended.
#[derive(Debug, Serialize, Deserialize)]
pub enum Ended {
    /// Done, with its result.
    Done(Option<serde_json::Value>),
    /// Stopped as asked, checkpointed at this position.
    Stopped(String),
    /// Failed, with the error and its causes.
    Failed(String),
}

/// A frame read from a job's process.
pub enum Frame {
    /// A control message.
    Message(FromJob),
    /// An answer to query request `id`: `queries` answered, the reply's bytes.
    Answer {
        /// The request.
        id: u64,
        /// Queries answered.
        queries: u32,
        /// The reply, serialised.
        reply: Vec<u8>,
    },
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The channel failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol.
    #[error("{0}")]
    Protocol(String),
}

fn write_frame(w: &mut impl Write, kind: u8, parts: &[&[u8]]) -> std::io::Result<()> {
    let len: usize = 1 + parts.iter().map(|p| p.len()).sum::<usize>();
    let len = u32::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let mut head = [0u8; 5];
    head[..4].copy_from_slice(&len.to_be_bytes());
    head[4] = kind;
    w.write_all(&head)?;
    for p in parts {
        w.write_all(p)?;
    }
    w.flush()
}

/// Writes a JSON message.
pub fn send(w: &mut impl Write, message: &impl Serialize) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(message).map_err(std::io::Error::other)?;
    write_frame(w, KIND_MESSAGE, &[&bytes])
}

/// Writes an answer to request `id`.
pub fn send_answer(w: &mut impl Write, id: u64, queries: u32, reply: &[u8]) -> std::io::Result<()> {
    write_frame(
        w,
        KIND_ANSWER,
        &[&id.to_be_bytes(), &queries.to_be_bytes(), reply],
    )
}

/// Reads a frame's kind and payload, of at most `max` bytes for a message and a frame (plus
/// its header) for an answer; `None` at the end of the stream.
fn read_raw(r: &mut impl Read, max: usize) -> Result<Option<(u8, Vec<u8>)>, ChannelError> {
    let mut head = [0u8; 5];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let kind = head[4];
    let bound = match kind {
        KIND_MESSAGE => max,
        KIND_ANSWER => MAX_FRAME + 12,
        other => return Err(ChannelError::Protocol(format!("a frame of kind {other}"))),
    };
    if len == 0 || len - 1 > bound {
        return Err(ChannelError::Protocol(format!(
            "a frame of {len} bytes (at most {bound})"
        )));
    }
    let mut payload = vec![0u8; len - 1];
    r.read_exact(&mut payload)?;
    Ok(Some((kind, payload)))
}

/// Reads what a job's process sent; `None` at the end of the stream.
pub fn read_from_job(r: &mut impl Read) -> Result<Option<Frame>, ChannelError> {
    let Some((kind, payload)) = read_raw(r, CONTROL_MAX)? else {
        return Ok(None);
    };
    if kind == KIND_ANSWER {
        if payload.len() < 12 {
            return Err(ChannelError::Protocol("a short answer".into()));
        }
        let id = u64::from_be_bytes(payload[..8].try_into().expect("8 bytes"));
        let queries = u32::from_be_bytes(payload[8..12].try_into().expect("4 bytes"));
        return Ok(Some(Frame::Answer {
            id,
            queries,
            reply: payload[12..].to_vec(),
        }));
    }
    serde_json::from_slice(&payload)
        .map(|m| Some(Frame::Message(m)))
        .map_err(|e| ChannelError::Protocol(format!("a malformed message: {e}")))
}

/// Reads what the daemon sent (a query's frame may hold a whole client frame); `None` at the
/// end of the stream.
pub fn read_to_job(r: &mut impl Read) -> Result<Option<ToJob>, ChannelError> {
    match read_raw(r, MAX_FRAME + 1024)? {
        Some((KIND_MESSAGE, payload)) => serde_json::from_slice(&payload)
            .map(Some)
            .map_err(|e| ChannelError::Protocol(format!("a malformed message: {e}"))),
        Some(_) => Err(ChannelError::Protocol("an answer sent to a job".into())),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_refused() {
        let mut wire = Vec::new();
        send(&mut wire, &FromJob::Log("hello".into())).unwrap();
        send_answer(&mut wire, 7, 2, b"{\"reply\":\"answers\"}").unwrap();
        let mut r = wire.as_slice();
        assert!(matches!(
            read_from_job(&mut r).unwrap(),
            Some(Frame::Message(FromJob::Log(l))) if l == "hello"
        ));
        assert!(matches!(
            read_from_job(&mut r).unwrap(),
            Some(Frame::Answer { id: 7, queries: 2, ref reply }) if reply.starts_with(b"{")
        ));
        assert!(read_from_job(&mut r).unwrap().is_none());
        // A control message over its bound, a kind there is not.
        let mut big = Vec::new();
        send(&mut big, &FromJob::Log("x".repeat(CONTROL_MAX))).unwrap();
        assert!(matches!(
            read_from_job(&mut big.as_slice()),
            Err(ChannelError::Protocol(_))
        ));
        let odd = [0, 0, 0, 2, 9, 0];
        assert!(read_from_job(&mut odd.as_slice()).is_err());
    }
}
