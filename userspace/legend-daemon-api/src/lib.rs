//! The protocol of `legendd`, Legend's training service, on its Unix socket
//! (`/run/legend/legendd.sock`): shared by the daemon and its clients (`legendctl submit`,
//! `jobs`, `watch`, `cancel`, `logs`). `Documentation/daemon-api.md` is its reference.
//!
//! Every message is a frame: a 4-byte big-endian length, then that many bytes of JSON. A
//! client sends [`Envelope`]s (the protocol version and a [`Request`]); the daemon answers each
//! with one [`Reply`], except `watch`, which answers with a stream of [`Reply::Event`]s ended by
//! [`Reply::Ended`].

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

mod devices;
pub mod fields;
mod protocol;

pub use devices::{DeviceHealth, DeviceInfo, NamespaceInfo, NvmeController, is_device_node};
pub use protocol::{
    Envelope, ErrorCode, JobInfo, JobProcess, JobSpec, JobState, Progress, Queries, Reply, Request,
};

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

/// The most entities all the queries of one request may ask for together (`top` summed): their
/// answers must fit a frame, and a serve job refuses a request whose answers could not, before
/// it computes any (with long labels, fewer fit: the refusal says how many).
pub const MAX_ANSWER_HITS: usize = 16 << 10;

/// The longest path a request may name, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;

/// Bytes a train job's configuration text and its `--set` values may take together.
pub const MAX_CONFIG_BYTES: usize = 64 << 10;

/// `--set` values one train job may carry.
pub const MAX_SETS: usize = 256;

/// Bytes of a name a request carries: a protocol, a split, a format, a group, a device.
pub const MAX_NAME_BYTES: usize = 64;

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
    match read_frame_len(r, max)? {
        Some(len) => read_frame_body(r, len).map(Some),
        None => Ok(None),
    }
}

/// Reads a frame's length (at most `max`); `None` when the peer closed the connection between
/// frames. The body follows ([`read_frame_body`]): a reader that accounts for memory reserves
/// the length first.
pub fn read_frame_len(r: &mut impl Read, max: usize) -> Result<Option<usize>, FrameError> {
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
    Ok(Some(len))
}

/// Reads a frame's body of `len` bytes.
pub fn read_frame_body(r: &mut impl Read, len: usize) -> Result<Vec<u8>, FrameError> {
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
        _ => FrameError::Io(e),
    })?;
    Ok(buf)
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
            Request::Submit {
                job: JobSpec::Serve {
                    run: "/r".into(),
                    group: None,
                    device: Some("cpu".into()),
                },
            },
            Request::Query {
                job: 3,
                queries: Queries::of(&[serde_json::json!({"query": "lookup", "entity": "e1"})])
                    .unwrap(),
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
        // Unknown calls and fields, fields over their bounds.
        let long_path = format!("/{}", "a".repeat(MAX_PATH_BYTES));
        let many_sets = format!("[{}\"\"]", "\"\",".repeat(MAX_SETS));
        for text in [
            r#"{"v":1,"request":{"call":"format_disk"}}"#.to_owned(),
            r#"{"v":1,"request":{"call":"status","job":1,"extra":2}}"#.to_owned(),
            r#"{"v":1,"request":{"call":"status","job":1,"job":2}}"#.to_owned(),
            r#"{"v":1}"#.to_owned(),
            "[1,2".to_owned(),
            format!(
                r#"{{"v":1,"request":{{"call":"submit","job":{{"kind":"eval","run":"{long_path}"}}}}}}"#
            ),
            format!(
                r#"{{"v":1,"request":{{"call":"submit","job":{{"kind":"train","out":"/o","sets":{many_sets}}}}}}}"#
            ),
            format!(r#"{{"v":1,"request":{{"call":"device_info","device":"{long_path}"}}}}"#),
            r#"{"v":1,"request":{"call":"submit","job":{"kind":"eval","run":"/a\u0000b"}}}"#
                .to_owned(),
        ] {
            let mut wire = (text.len() as u32).to_be_bytes().to_vec();
            wire.extend(text.as_bytes());
            assert!(
                read_message::<Envelope>(&mut wire.as_slice(), MAX_FRAME).is_err(),
                "{text:.200}"
            );
        }
    }

    /// The fields of a request in any order, defaults where left out; a reply with a job in
    /// it reads back (a job spec is read field by field there too).
    #[test]
    fn fields_come_in_any_order_and_replies_read_back() {
        let text = r#"{"request":{"job":{"run":"/r","kind":"eval"},"call":"submit"},"v":1}"#;
        let env: Envelope = serde_json::from_str(text).unwrap();
        assert_eq!(
            env.request,
            Request::Submit {
                job: JobSpec::Eval {
                    run: "/r".into(),
                    protocol: "filtered".into(),
                    split: "test".into(),
                }
            }
        );
        let info = JobInfo {
            id: 1,
            owner: 2,
            spec: JobSpec::Train {
                dataset: None,
                out: "/o".into(),
                config: String::new(),
                sets: Vec::new(),
                resume: true,
            },
            state: JobState::Running,
            device: None,
            submitted: 3,
            started: None,
            ended: None,
            progress: Progress::default(),
            error: None,
            result: Some(serde_json::json!({"mrr": 0.5})),
            process: Some(JobProcess {
                pid: 4,
                uid: 2,
                cgroup: Some("/legend/job-1".into()),
                memory_limit: Some(1 << 30),
                peak_memory: None,
            }),
        };
        for reply in [
            Reply::Job { job: info.clone() },
            Reply::Jobs { jobs: vec![info] },
            Reply::Error {
                code: ErrorCode::Refused,
                message: "no".into(),
            },
        ] {
            let text = serde_json::to_string(&reply).unwrap();
            assert_eq!(serde_json::from_str::<Reply>(&text).unwrap(), reply);
        }
    }

    /// A list of queries is read one element at a time, and not past its bound.
    #[test]
    fn raw_lists_stop_at_their_bound() {
        let text = format!("[{}{{}}]", "{},".repeat(2000));
        let e = fields::raw_list(&text, 1024).unwrap_err().to_string();
        assert!(e.contains("more than 1024"), "{e}");
        assert_eq!(fields::raw_list("[{}, [1], \"x\"]", 3).unwrap().len(), 3);
    }
}
