//! The protocol of `legendd`, Legend's training service, on its Unix socket
//! (`/run/legend/legendd.sock`): shared by the daemon and its clients (`legendctl submit`,
//! `jobs`, `watch`, `cancel`, `logs`). `Documentation/daemon-api.md` is its reference.
//!
//! Every message is a frame: a 4-byte big-endian length, then that many bytes of JSON. A
//! client sends [`Envelope`]s (the protocol version and a [`Request`]); the daemon answers each
//! with one [`Reply`], except `watch`, which answers with a stream of [`Reply::Event`]s ended by
//! [`Reply::Ended`].

use std::io::{Read, Write};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The protocol version this crate speaks; the daemon refuses others.
pub const PROTOCOL_VERSION: u32 = 1;

/// Where the service listens (systemd's `RuntimeDirectory=legend`).
pub const DEFAULT_SOCKET: &str = "/run/legend/legendd.sock";

/// The largest frame either side accepts, in bytes.
pub const MAX_FRAME: usize = 1 << 20;

/// The most queries one [`Request::Query`] may carry (a batch: one pass over the run's
/// entities).
pub const MAX_QUERIES: usize = 1024;

/// The most entities one query to a served run may ask for (the answers must fit a frame).
pub const MAX_TOP: usize = 1000;

/// A request with the version it is written in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// [`PROTOCOL_VERSION`] of the client.
    pub v: u32,
    /// What is asked.
    pub request: Request,
}

/// What a client asks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case", deny_unknown_fields)]
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
    /// What the module reports for a controller ([`DeviceInfo`]): the device nodes are the
    /// daemon's alone, so users ask it.
    DeviceInfo {
        /// The node, `/dev/legend-nvmeN`.
        device: String,
    },
    /// A controller's SMART / health log ([`DeviceHealth`]).
    DeviceHealth {
        /// The node, `/dev/legend-nvmeN`.
        device: String,
    },
    /// Ask a running serve job's run: predict, score, neighbors or lookup queries (legend-query's
    /// `Query` in JSON, at most [`MAX_QUERIES`]), answered in order by [`Reply::Answers`].
    Query {
        /// The serve job.
        job: u64,
        /// The queries.
        queries: Vec<serde_json::Value>,
    },
}

/// A job to run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum JobSpec {
    /// `legendctl train`: a run directory created (or resumed) and trained.
    Train {
        /// The dataset directory (absolute); optional when resuming.
        dataset: Option<PathBuf>,
        /// The run directory (absolute); its parent must be writable by the submitter.
        out: PathBuf,
        /// The configuration file's text (TOML).
        #[serde(default)]
        config: String,
        /// `key=value` overrides.
        #[serde(default)]
        sets: Vec<String>,
        /// Continue `out` from its last checkpoint.
        #[serde(default)]
        resume: bool,
    },
    /// `legendctl eval`: rank a run's tables.
    Eval {
        /// The run directory (absolute).
        run: PathBuf,
        /// `filtered` or `sampled`.
        #[serde(default = "default_protocol")]
        protocol: String,
        /// `test` or `valid`.
        #[serde(default = "default_split")]
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
        #[serde(default)]
        group: Option<String>,
        /// Where to answer: `cpu`, `cuda:N` or `auto`; absent: the daemon's `serve_device`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
    },
}

fn default_protocol() -> String {
    "filtered".into()
}

fn default_split() -> String {
    "test".into()
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
}

/// The daemon's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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

/// A framing error.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The connection failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A frame longer than the limit.
    #[error("a frame of {len} bytes is over the {max}-byte limit")]
    TooLarge {
        /// Its announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The connection ended inside a frame.
    #[error("the connection ended inside a frame")]
    Truncated,
    /// The frame is not the JSON expected.
    #[error("malformed message")]
    Json(#[from] serde_json::Error),
}

/// Reads one frame's bytes; `None` when the peer closed the connection between frames.
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<Option<Vec<u8>>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            // A signal to the process (the proxy controller's threads take some) is no reason
            // to drop the client; `read_exact` below retries the same way.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
        _ => FrameError::Io(e),
    })?;
    Ok(Some(buf))
}

/// Reads one message; `None` when the peer closed the connection between frames.
pub fn read_message<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max: usize,
) -> Result<Option<T>, FrameError> {
    match read_frame(r, max)? {
        Some(bytes) => Ok(Some(serde_json::from_slice(&bytes)?)),
        None => Ok(None),
    }
}

/// Writes one message as a frame.
pub fn write_message(w: &mut impl Write, message: &impl Serialize) -> Result<(), FrameError> {
    let bytes = serde_json::to_vec(message)?;
    if bytes.len() > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len: bytes.len(),
            max: MAX_FRAME,
        });
    }
    w.write_all(&(bytes.len() as u32).to_be_bytes())?;
    w.write_all(&bytes)?;
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_modules_device_nodes_are_device_nodes() {
        for ok in ["/dev/legend-nvme0", "/dev/legend-nvme17"] {
            assert!(is_device_node(ok), "{ok}");
        }
        for bad in [
            "/dev/legend-nvme",
            "/dev/legend-nvme0/../../../etc/shadow",
            "/dev/legend-nvme-1",
            "/dev/legend-nvme99999",
            "dev/legend-nvme0",
            "/etc/passwd",
            "/dev/sda",
        ] {
            assert!(!is_device_node(bad), "{bad}");
        }
    }

    #[test]
    fn requests_round_trip_through_frames() {
        let requests = [
            Request::Hello,
            Request::Submit {
                job: JobSpec::Train {
                    dataset: Some("/d".into()),
                    out: "/o".into(),
                    config: "[model]\ndim = 8\n".into(),
                    sets: vec!["training.num_epochs=2".into()],
                    resume: false,
                },
            },
            Request::List { all: true },
            Request::Watch { job: 7 },
            Request::Bind {
                bdf: "0000:01:00.0".into(),
                force: false,
            },
        ];
        for request in requests {
            let mut wire = Vec::new();
            let env = Envelope {
                v: PROTOCOL_VERSION,
                request,
            };
            write_message(&mut wire, &env).unwrap();
            let back: Envelope = read_message(&mut wire.as_slice(), MAX_FRAME)
                .unwrap()
                .unwrap();
            assert_eq!(back, env);
        }
    }

    #[test]
    fn bad_frames_are_errors_not_panics() {
        // Over the limit, announced.
        let mut wire = (MAX_FRAME as u32 + 1).to_be_bytes().to_vec();
        wire.extend([0u8; 16]);
        assert!(matches!(
            read_frame(&mut wire.as_slice(), MAX_FRAME),
            Err(FrameError::TooLarge { .. })
        ));
        // Cut inside the length and inside the body.
        assert!(matches!(
            read_frame(&mut [0u8, 0].as_slice(), MAX_FRAME),
            Err(FrameError::Truncated)
        ));
        let mut short = 10u32.to_be_bytes().to_vec();
        short.extend(b"{}");
        assert!(matches!(
            read_frame(&mut short.as_slice(), MAX_FRAME),
            Err(FrameError::Truncated)
        ));
        // Closed between frames.
        assert!(read_frame(&mut [].as_slice(), MAX_FRAME).unwrap().is_none());
        // Unknown calls and fields.
        for text in [
            r#"{"v":1,"request":{"call":"format_disk"}}"#,
            r#"{"v":1,"request":{"call":"status","job":1,"extra":2}}"#,
            r#"{"v":1}"#,
            "[1,2",
        ] {
            let mut wire = (text.len() as u32).to_be_bytes().to_vec();
            wire.extend(text.as_bytes());
            assert!(
                read_message::<Envelope>(&mut wire.as_slice(), MAX_FRAME).is_err(),
                "{text}"
            );
        }
    }
}

/// A controller as the module reports it (`legendctl device info`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The device node.
    pub device: String,
    /// The module's ABI version.
    pub abi_version: u32,
    /// PCI address, `dddd:bb:dd.f`.
    pub pci_address: String,
    /// NVMe version, `major.minor.tertiary`.
    pub nvme_version: String,
    /// Model number.
    pub model: String,
    /// Serial number.
    pub serial: String,
    /// Firmware revision.
    pub firmware: String,
    /// Most entries an I/O queue may have.
    pub max_queue_entries: u32,
    /// Bytes between doorbells.
    pub doorbell_stride: u32,
    /// Largest transfer of one command in bytes (0: no limit).
    pub max_transfer: u32,
    /// I/O queue pairs granted.
    pub queue_pairs: u32,
    /// Active namespaces.
    pub namespaces: Vec<NamespaceInfo>,
}

/// One namespace of a [`DeviceInfo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceInfo {
    /// Namespace id.
    pub nsid: u32,
    /// Bytes per logical block.
    pub lba_bytes: u64,
    /// Logical blocks.
    pub lbas: u64,
}

/// ASCII identity fields: space or NUL padded.
fn identity_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .trim_end_matches([' ', '\0'])
        .to_owned()
}

impl DeviceInfo {
    /// The view of `info`, read from `device`.
    pub fn new(device: &str, info: &legend_nvme::uapi::Info) -> Self {
        let v = info.nvme_version;
        DeviceInfo {
            device: device.to_owned(),
            abi_version: info.abi_version,
            pci_address: format!(
                "{:04x}:{:02x}:{:02x}.{}",
                info.pci_domain, info.pci_bus, info.pci_device, info.pci_function
            ),
            nvme_version: format!("{}.{}.{}", v >> 16, (v >> 8) & 0xff, v & 0xff),
            model: identity_text(&info.model),
            serial: identity_text(&info.serial),
            firmware: identity_text(&info.firmware),
            max_queue_entries: info.max_queue_entries,
            doorbell_stride: info.doorbell_stride,
            max_transfer: info.max_transfer,
            queue_pairs: info.queue_pairs,
            namespaces: legend_nvme::namespaces(info)
                .iter()
                .map(|n| NamespaceInfo {
                    nsid: n.nsid,
                    lba_bytes: 1u64 << n.lba_shift.min(63),
                    lbas: n.blocks,
                })
                .collect(),
        }
    }
}

/// A controller's SMART / health log (`legendctl device health`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceHealth {
    /// The device node.
    pub device: String,
    /// Critical warning bits (0 is healthy).
    pub critical_warning: u8,
    /// Composite temperature.
    pub temperature_celsius: i32,
    /// Available spare, percent.
    pub available_spare_percent: u8,
    /// Share of the rated endurance used, percent.
    pub percentage_used: u8,
    /// Data units (1000 × 512 bytes) read.
    pub data_units_read: u64,
    /// Data units written.
    pub data_units_written: u64,
    /// Power-on hours.
    pub power_on_hours: u64,
    /// Unsafe shutdowns.
    pub unsafe_shutdowns: u64,
    /// Media and data integrity errors.
    pub media_errors: u64,
}

impl DeviceHealth {
    /// The view of `h`, read from `device`.
    pub fn new(device: &str, h: &legend_nvme::Health) -> Self {
        DeviceHealth {
            device: device.to_owned(),
            critical_warning: h.critical_warning,
            temperature_celsius: i32::from(h.temperature_kelvin) - 273,
            available_spare_percent: h.available_spare,
            percentage_used: h.percentage_used,
            data_units_read: h.data_units_read,
            data_units_written: h.data_units_written,
            power_on_hours: h.power_on_hours,
            unsafe_shutdowns: h.unsafe_shutdowns,
            media_errors: h.media_errors,
        }
    }
}

/// Whether `path` names a device node of the module (`/dev/legend-nvmeN`), the only files the
/// daemon opens for a device request.
pub fn is_device_node(path: &str) -> bool {
    path.strip_prefix("/dev/legend-nvme")
        .is_some_and(|n| !n.is_empty() && n.len() <= 4 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// An NVMe controller on the PCI bus and who drives it (`legendctl device list`, `bind`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeController {
    /// PCI address.
    pub bdf: String,
    /// The bound driver (`nvme`, `legend_nvme`), if any.
    pub driver: Option<String>,
    /// PCI vendor id, hex.
    pub vendor: String,
    /// PCI device id, hex.
    pub device: String,
    /// Its block devices while `nvme` drives it.
    pub block_devices: Vec<String>,
    /// Its `/dev/legend-nvmeN` while `legend_nvme` drives it.
    pub legend_device: Option<String>,
}

impl From<legend_nvme::PciController> for NvmeController {
    fn from(c: legend_nvme::PciController) -> Self {
        NvmeController {
            bdf: c.bdf,
            driver: c.driver,
            vendor: format!("{:04x}", c.id.0),
            device: format!("{:04x}", c.id.1),
            block_devices: c.block_devices,
            legend_device: c.char_device,
        }
    }
}
