//! legendd's client protocol (legend-daemon-api) from Python: framing, the versioned envelope,
//! requests checked against the protocol's types before they are sent, replies as JSON. Waits
//! for a reply poll the socket and check for signals every tenth of a second, so Ctrl-C
//! interrupts a call or a watch; the interrupted connection is dropped (its reply would be out of
//! step) and the next call makes a new one.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Mutex;

use legend_daemon_api::{
    Envelope, FrameError, MAX_FRAME, PROTOCOL_VERSION, Reply, Request, read_message, write_message,
};
use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, recv};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::{Kind, raise, raise_message};
use crate::interrupt::TICK;

/// Why a call failed, met without the GIL.
enum CallError {
    /// The daemon could not be reached.
    Connect(std::io::Error),
    /// Sending or receiving failed.
    Frame(FrameError),
    /// The daemon closed the connection.
    Closed,
    /// The daemon answered with an error: its code (`bad_request`, `forbidden`, ...) and words.
    Refused { code: String, message: String },
    /// Ctrl-C (or another signal's exception) while waiting.
    Python(PyErr),
}

/// A connection to legendd.
struct Socket {
    stream: UnixStream,
}

fn connect(path: &std::path::Path) -> Result<Socket, CallError> {
    UnixStream::connect(path)
        .map(|stream| Socket { stream })
        .map_err(CallError::Connect)
}

impl Socket {
    fn send(&mut self, request: Request) -> Result<(), CallError> {
        let envelope = Envelope {
            v: PROTOCOL_VERSION,
            request,
        };
        write_message(&mut self.stream, &envelope).map_err(CallError::Frame)
    }

    /// Waits for the next reply, checking for signals while none has come.
    fn receive(&mut self) -> Result<Reply, CallError> {
        let io = |e: std::io::Error| CallError::Frame(FrameError::Io(e));
        self.stream.set_read_timeout(Some(TICK)).map_err(io)?;
        loop {
            // A byte waiting (or the end of the stream), without taking it.
            match recv(self.stream.as_raw_fd(), &mut [0u8], MsgFlags::MSG_PEEK) {
                Ok(_) => break,
                Err(Errno::EAGAIN | Errno::EINTR) => {
                    Python::attach(|py| py.check_signals()).map_err(CallError::Python)?;
                }
                Err(e) => return Err(io(e.into())),
            }
        }
        self.stream.set_read_timeout(None).map_err(io)?;
        match read_message::<Reply>(&mut self.stream, MAX_FRAME) {
            Ok(Some(Reply::Error { code, message })) => {
                let code = serde_json::to_value(code).expect("codes serialize");
                Err(CallError::Refused {
                    code: code.as_str().unwrap_or("error").to_owned(),
                    message,
                })
            }
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(CallError::Closed),
            Err(e) => Err(CallError::Frame(e)),
        }
    }
}

impl CallError {
    fn into_py(self, py: Python<'_>, socket: &std::path::Path) -> PyErr {
        let at = socket.display();
        match self {
            CallError::Connect(e) => raise_message(
                py,
                Kind::Daemon,
                format!(
                    "cannot reach legendd at {at} ({e}): is it running? (`systemctl start legendd`, \
                     or `legendd --foreground --socket {at}`)"
                ),
            ),
            CallError::Frame(e) => raise(py, Kind::Daemon, &e),
            CallError::Closed => raise_message(
                py,
                Kind::Daemon,
                format!("legendd at {at} closed the connection"),
            ),
            CallError::Refused { code, message } => {
                let err = raise_message(
                    py,
                    Kind::Daemon,
                    format!("legendd refused ({code}): {message}"),
                );
                let _ = err.value(py).setattr("code", code);
                err
            }
            CallError::Python(e) => e,
        }
    }
}

fn parse_request(json: &str) -> PyResult<Request> {
    serde_json::from_str(json).map_err(|e| {
        PyValueError::new_err(format!(
            "not a request of legendd's protocol (version {PROTOCOL_VERSION}): {e}"
        ))
    })
}

/// A client of legendd on the socket `path` (Python's `legend.Client` wraps it). Calls from
/// several threads take turns on the one connection.
#[pyclass(frozen, module = "legend._legend")]
pub struct Connection {
    path: PathBuf,
    /// The connection, made on first use and again after an interrupted call.
    socket: Mutex<Option<Socket>>,
}

#[pymethods]
impl Connection {
    /// Connects to legendd on `path`.
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Connection> {
        let line = py
            .detach(|| connect(&path))
            .map_err(|e| e.into_py(py, &path))?;
        Ok(Connection {
            path,
            socket: Mutex::new(Some(line)),
        })
    }

    /// The socket's path.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// Sends `request` (a request of the protocol, as JSON: `{"call": "list"}`) and returns
    /// the daemon's reply as JSON; an error reply raises `DaemonError` with its `code`.
    fn call(&self, py: Python<'_>, request: &str) -> PyResult<String> {
        let request = parse_request(request)?;
        let reply = py.detach(|| {
            let mut slot = self.socket.lock().unwrap_or_else(|e| e.into_inner());
            let mut line = match slot.take() {
                Some(line) => line,
                None => connect(&self.path)?,
            };
            let reply = line.send(request).and_then(|()| line.receive());
            // Kept only when the exchange completed: a reply left unread would answer the
            // next request.
            if matches!(reply, Ok(_) | Err(CallError::Refused { .. })) {
                *slot = Some(line);
            }
            reply
        });
        match reply {
            Ok(reply) => Ok(serde_json::to_string(&reply).expect("replies serialize")),
            Err(e) => Err(e.into_py(py, &self.path)),
        }
    }

    /// Follows job `job` on a connection of its own: an iterator of the daemon's replies (its
    /// events, then the `ended` reply), as JSON.
    fn watch(&self, py: Python<'_>, job: u64) -> PyResult<Watch> {
        let line = py
            .detach(|| {
                let mut line = connect(&self.path)?;
                line.send(Request::Watch { job })?;
                Ok(line)
            })
            .map_err(|e: CallError| e.into_py(py, &self.path))?;
        Ok(Watch {
            path: self.path.clone(),
            socket: Mutex::new(Some(line)),
        })
    }

    /// Closes the connection (a later call opens another).
    fn close(&self, py: Python<'_>) {
        py.detach(|| *self.socket.lock().unwrap_or_else(|e| e.into_inner()) = None);
    }
}

/// The replies of one watched job, until it ends.
#[pyclass(frozen, module = "legend._legend")]
pub struct Watch {
    path: PathBuf,
    /// `None` once the job has ended (or the watch was interrupted).
    socket: Mutex<Option<Socket>>,
}

#[pymethods]
impl Watch {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next reply as JSON; `None` (the end of the iteration) after the `ended` reply.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let next = py.detach(|| {
            let mut slot = self.socket.lock().unwrap_or_else(|e| e.into_inner());
            let Some(line) = slot.as_mut() else {
                return Ok(None);
            };
            let reply = line.receive();
            if !matches!(reply, Ok(Reply::Event { .. })) {
                *slot = None;
            }
            reply.map(Some)
        });
        match next {
            Ok(reply) => Ok(reply.map(|r| serde_json::to_string(&r).expect("replies serialize"))),
            Err(e) => Err(e.into_py(py, &self.path)),
        }
    }

    /// Stops following the job (the job goes on).
    fn close(&self, py: Python<'_>) {
        py.detach(|| *self.socket.lock().unwrap_or_else(|e| e.into_inner()) = None);
    }
}
