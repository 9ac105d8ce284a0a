//! Requests, job specs and replies: the messages of the protocol.

use std::path::PathBuf;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::fields::Fields;
use crate::{MAX_CONFIG_BYTES, MAX_NAME_BYTES, MAX_SETS};

/// A request with the version it is written in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// [`crate::PROTOCOL_VERSION`] of the client.
    pub v: u32,
    /// What is asked.
    pub request: Request,
}

/// What a client asks. Parsed field by field into bounded types ([`crate::fields`]): names of
/// at most [`MAX_NAME_BYTES`], no generic JSON value.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum Request {
    /// The daemon's version and the caller's identity as the daemon sees it.
    Hello,
    /// Queue a job.
    Submit {
        /// The job.
        job: JobSpec,
    },
    /// Jobs: the caller's own, or everyone's (`all`, the admin group only).
    List {
        /// Everyone's jobs.
        #[serde(default)]
        all: bool,
    },
    /// One job.
    Status {
        /// Its id.
        job: u64,
    },
    /// A job's events as they happen, then its end.
    Watch {
        /// Its id.
        job: u64,
    },
    /// Stop a job: a queued one at once, a running one at its next checkpointable point.
    Cancel {
        /// Its id.
        job: u64,
    },
    /// A job's log.
    Logs {
        /// Its id.
        job: u64,
    },
    /// Forget an ended job (its record and log). Deleting the last train job of a run on an
    /// NVMe namespace frees the run's extent there: its store is gone, the run directory stays.
    Delete {
        /// Its id.
        job: u64,
    },
    /// The daemon's metrics in the Prometheus text format.
    Metrics,
    /// NVMe controllers and the module's devices (read-only).
    Devices,
    /// Hand a controller to `legend_nvme` (the admin group only).
    Bind {
        /// PCI address, e.g. `0000:01:00.0`.
        bdf: String,
        /// Bind even if a namespace is in use.
        #[serde(default)]
        force: bool,
    },
    /// Hand a controller back to `nvme` (the admin group only).
    Unbind {
        /// PCI address.
        bdf: String,
    },
    /// What the module reports for a controller ([`crate::DeviceInfo`]): the device nodes are
    /// the daemon's alone, so users ask it.
    DeviceInfo {
        /// The node, `/dev/legend-nvmeN`.
        device: String,
    },
    /// A controller's SMART / health log ([`crate::DeviceHealth`]).
    DeviceHealth {
        /// The node, `/dev/legend-nvmeN`.
        device: String,
    },
    /// Ask a running serve job's run: predict, score, neighbors or lookup queries (legend-query's
    /// `Query` in JSON, at most [`crate::MAX_QUERIES`]), answered in order by
    /// [`Reply::Answers`].
    Query {
        /// The serve job.
        job: u64,
        /// The queries, a JSON list: the daemon hands it to the serve job's process unparsed,
        /// which reads it element by element.
        queries: Queries,
    },
}

/// A JSON list of queries, kept as the client wrote it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Queries(pub Box<RawValue>);

impl Queries {
    /// The list of `queries`, serialised.
    pub fn of<T: Serialize>(queries: &[T]) -> serde_json::Result<Queries> {
        serde_json::value::to_raw_value(queries).map(Queries)
    }

    /// The JSON text.
    pub fn text(&self) -> &str {
        self.0.get()
    }
}

impl PartialEq for Queries {
    fn eq(&self, other: &Self) -> bool {
        self.text() == other.text()
    }
}

impl<'de> Deserialize<'de> for Request {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut f = Fields::deserialize(d)?;
        let call = f.tag::<D::Error>("call")?;
        let job = |f: &mut Fields| f.required::<u64, D::Error>("job");
        let name = |f: &mut Fields, n: &'static str| {
            f.text::<D::Error>(n, MAX_NAME_BYTES)?
                .ok_or_else(|| de::Error::custom(format!("missing field `{n}`")))
        };
        let request = match call.as_str() {
            "hello" => Request::Hello,
            "submit" => Request::Submit {
                job: f.required("job")?,
            },
            "list" => Request::List {
                all: f.optional("all")?.unwrap_or(false),
            },
            "status" => Request::Status { job: job(&mut f)? },
            "watch" => Request::Watch { job: job(&mut f)? },
            "cancel" => Request::Cancel { job: job(&mut f)? },
            "logs" => Request::Logs { job: job(&mut f)? },
            "delete" => Request::Delete { job: job(&mut f)? },
            "metrics" => Request::Metrics,
            "devices" => Request::Devices,
            "bind" => Request::Bind {
                bdf: name(&mut f, "bdf")?,
                force: f.optional("force")?.unwrap_or(false),
            },
            "unbind" => Request::Unbind {
                bdf: name(&mut f, "bdf")?,
            },
            "device_info" => Request::DeviceInfo {
                device: name(&mut f, "device")?,
            },
            "device_health" => Request::DeviceHealth {
                device: name(&mut f, "device")?,
            },
            "query" => Request::Query {
                job: job(&mut f)?,
                queries: f.required("queries")?,
            },
            other => return Err(de::Error::unknown_variant(other, REQUESTS)),
        };
        f.finish(&call)?;
        Ok(request)
    }
}

/// The calls there are.
const REQUESTS: &[&str] = &[
    "hello",
    "submit",
    "list",
    "status",
    "watch",
    "cancel",
    "logs",
    "delete",
    "metrics",
    "devices",
    "bind",
    "unbind",
    "device_info",
    "device_health",
    "query",
];

/// A job to run. Paths of at most [`crate::MAX_PATH_BYTES`], a configuration of at most
/// [`MAX_CONFIG_BYTES`], at most [`MAX_SETS`] `--set` values, names of at most
/// [`MAX_NAME_BYTES`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobSpec {
    /// `legendctl train`: a run directory created (or resumed) and trained.
    Train {
        /// The dataset directory (absolute); optional when resuming.
        dataset: Option<PathBuf>,
        /// The run directory (absolute); its parent must be writable by the submitter.
        out: PathBuf,
        /// The configuration file's text (TOML).
        config: String,
        /// `key=value` overrides.
        sets: Vec<String>,
        /// Continue `out` from its last checkpoint.
        resume: bool,
    },
    /// `legendctl eval`: rank a run's tables.
    Eval {
        /// The run directory (absolute).
        run: PathBuf,
        /// `filtered` or `sampled` (default `filtered`).
        protocol: String,
        /// `test` or `valid` (default `test`).
        split: String,
    },
    /// `legendctl export`: write a run's embeddings with their labels.
    Export {
        /// The run directory (absolute).
        run: PathBuf,
        /// The output directory (absolute): new, or empty, or holding an export of the same
        /// format; its parent must be the submitter's.
        out: PathBuf,
        /// `npy`, `tsv` or `bin`.
        format: String,
    },
    /// Keep a run's tables in memory and answer queries on it ([`Request::Query`]) until
    /// cancelled.
    Serve {
        /// The run directory (absolute).
        run: PathBuf,
        /// Members of this group may query it too (the submitter must be one).
        group: Option<String>,
        /// Where to answer: `cpu`, `cuda:N` or `auto`; absent: the daemon's `serve_device`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
    },
}

impl<'de> Deserialize<'de> for JobSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut f = Fields::deserialize(d)?;
        let kind = f.tag::<D::Error>("kind")?;
        let path = |f: &mut Fields, n: &'static str| {
            f.path::<D::Error>(n)?
                .ok_or_else(|| de::Error::custom(format!("missing field `{n}`")))
        };
        let name = |f: &mut Fields, n: &'static str| f.text::<D::Error>(n, MAX_NAME_BYTES);
        let spec = match kind.as_str() {
            "train" => JobSpec::Train {
                dataset: f.path("dataset")?,
                out: path(&mut f, "out")?,
                config: f.text("config", MAX_CONFIG_BYTES)?.unwrap_or_default(),
                sets: f
                    .texts("sets", MAX_SETS, MAX_CONFIG_BYTES)?
                    .unwrap_or_default(),
                resume: f.optional("resume")?.unwrap_or(false),
            },
            "eval" => JobSpec::Eval {
                run: path(&mut f, "run")?,
                protocol: name(&mut f, "protocol")?.unwrap_or_else(|| "filtered".into()),
                split: name(&mut f, "split")?.unwrap_or_else(|| "test".into()),
            },
            "export" => JobSpec::Export {
                run: path(&mut f, "run")?,
                out: path(&mut f, "out")?,
                format: name(&mut f, "format")?
                    .ok_or_else(|| de::Error::custom("missing field `format`"))?,
            },
            "serve" => JobSpec::Serve {
                run: path(&mut f, "run")?,
                group: name(&mut f, "group")?,
                device: name(&mut f, "device")?,
            },
            other => {
                return Err(de::Error::unknown_variant(
                    other,
                    &["train", "eval", "export", "serve"],
                ));
            }
        };
        f.finish(&kind)?;
        Ok(spec)
    }
}

impl JobSpec {
    /// The run directory the job trains (train) or reads (eval, export, serve).
    pub fn dir(&self) -> &PathBuf {
        match self {
            JobSpec::Train { out, .. } => out,
            JobSpec::Eval { run, .. }
            | JobSpec::Export { run, .. }
            | JobSpec::Serve { run, .. } => run,
        }
    }

    /// `train`, `eval`, `export` or `serve`.
    pub fn kind(&self) -> &'static str {
        match self {
            JobSpec::Train { .. } => "train",
            JobSpec::Eval { .. } => "eval",
            JobSpec::Export { .. } => "export",
            JobSpec::Serve { .. } => "serve",
        }
    }
}

/// Where a job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for its device.
    Queued,
    /// Running.
    Running,
    /// Ended as asked.
    Succeeded,
    /// Ended with an error (`JobInfo::error`).
    Failed,
    /// Stopped by a cancel (a train job keeps its last checkpoint: resumable).
    Cancelled,
}

impl JobState {
    /// Whether the job has ended.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }

    /// The name used on the wire and by `legendctl jobs`.
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// How far a running job is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// The epoch being trained (from 1; 0 before the first).
    pub epoch: u32,
    /// Epochs of the run.
    pub epochs: u32,
    /// Edges of the epoch trained so far.
    pub edges_done: u64,
    /// Edges of an epoch.
    pub edges: u64,
    /// Positive edges per second of the last finished epoch.
    pub edges_per_sec: f64,
}

/// A job as the daemon reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobInfo {
    /// Its id (never reused by a daemon's state directory).
    pub id: u64,
    /// The submitter's uid.
    pub owner: u32,
    /// What it runs.
    pub spec: JobSpec,
    /// Where it is.
    pub state: JobState,
    /// The engine it runs on (`cpu`, `cuda:0`), once known.
    #[serde(default)]
    pub device: Option<String>,
    /// Seconds since the epoch: submitted, started, ended.
    pub submitted: u64,
    /// When it started last (a resumed job starts again).
    #[serde(default)]
    pub started: Option<u64>,
    /// When it ended.
    #[serde(default)]
    pub ended: Option<u64>,
    /// How far it is.
    #[serde(default)]
    pub progress: Progress,
    /// Why it failed.
    #[serde(default)]
    pub error: Option<String>,
    /// The result: the final metrics line of a train job, the metrics of an eval job.
    #[serde(default)]
    pub result: Option<serde_json::Value>,
    /// The process the job runs (ran) in, once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<JobProcess>,
}

/// The process of a job: each job runs in a process of its own, as its submitter (or, on a
/// shared NVMe namespace, under an identity of the daemon's), in a cgroup of its own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobProcess {
    /// Its process id (of its last start).
    pub pid: u32,
    /// The uid it runs as.
    pub uid: u32,
    /// Its cgroup (the memory controller's path), when the daemon could make one.
    #[serde(default)]
    pub cgroup: Option<String>,
    /// Its cgroup's memory limit in bytes.
    #[serde(default)]
    pub memory_limit: Option<u64>,
    /// The most memory its cgroup held, in bytes (while it runs: so far).
    #[serde(default)]
    pub peak_memory: Option<u64>,
}

/// The daemon's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// To [`Request::Hello`].
    Hello {
        /// The daemon's protocol version.
        version: u32,
        /// The daemon's build.
        daemon: String,
        /// The caller's uid.
        uid: u32,
        /// Whether the caller is in the admin group.
        admin: bool,
    },
    /// One job (to submit, status and cancel).
    Job {
        /// The job.
        job: JobInfo,
    },
    /// Jobs (to list).
    Jobs {
        /// The jobs, by id.
        jobs: Vec<JobInfo>,
    },
    /// An event of a watched job: `epoch` (an epoch report line of metrics.jsonl), `progress`,
    /// `checkpoint`, `evaluated`, `state`.
    Event {
        /// The job.
        job: u64,
        /// What happened (JSON with a `type` field).
        event: serde_json::Value,
    },
    /// A watched job ended (the last reply of a watch).
    Ended {
        /// The job as it ended.
        job: JobInfo,
    },
    /// Text: a log, or metrics.
    Text {
        /// The text.
        text: String,
    },
    /// Answers to [`Request::Query`], in the order asked (legend-query's `Answer` in JSON).
    Answers {
        /// The answers.
        answers: Vec<serde_json::Value>,
        /// Seconds the daemon took to answer them.
        seconds: f64,
    },
    /// Structured data (devices).
    Data {
        /// The data.
        data: serde_json::Value,
    },
    /// The request failed.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// What went wrong, in words.
        message: String,
    },
}

impl<'de> Deserialize<'de> for Reply {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Field by field like a request (see `fields`): a job spec inside a reply is read the
        // same way, which serde's buffered tagged enums could not.
        let mut f = Fields::deserialize(d)?;
        let reply = f.tag::<D::Error>("reply")?;
        let answer = match reply.as_str() {
            "hello" => Reply::Hello {
                version: f.required("version")?,
                daemon: f.required("daemon")?,
                uid: f.required("uid")?,
                admin: f.required("admin")?,
            },
            "job" => Reply::Job {
                job: f.required("job")?,
            },
            "jobs" => Reply::Jobs {
                jobs: f.required("jobs")?,
            },
            "event" => Reply::Event {
                job: f.required("job")?,
                event: f.required("event")?,
            },
            "ended" => Reply::Ended {
                job: f.required("job")?,
            },
            "text" => Reply::Text {
                text: f.required("text")?,
            },
            "answers" => Reply::Answers {
                answers: f.required("answers")?,
                seconds: f.required("seconds")?,
            },
            "data" => Reply::Data {
                data: f.required("data")?,
            },
            "error" => Reply::Error {
                code: f.required("code")?,
                message: f.required("message")?,
            },
            other => {
                return Err(de::Error::unknown_variant(
                    other,
                    &[
                        "hello", "job", "jobs", "event", "ended", "text", "answers", "data",
                        "error",
                    ],
                ));
            }
        };
        f.finish(&reply)?;
        Ok(answer)
    }
}

/// Classes of [`Reply::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed, too large, or of another protocol version.
    BadRequest,
    /// The caller may not do this.
    Forbidden,
    /// No such job.
    NotFound,
    /// The request is well formed but cannot be carried out (the message says why).
    Refused,
    /// The daemon is shutting down or overloaded.
    Unavailable,
}
