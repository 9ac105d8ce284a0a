//! Long work (training, an import) on a thread of its own, without the GIL, while the calling
//! thread stays Python's: it hands the work's messages to Python code (a progress bar) and
//! checks for signals every [`TICK`], so that Ctrl-C is seen within a tenth of a second even
//! while the work is setting up, checkpointing or evaluating. The work is never killed: a
//! signal, or an exception raised by the Python code, sets the work's stop flag, and the work
//! ends where it can end cleanly (a training run at its next batch, with a checkpoint there; an
//! import before it writes anything). The CLI's signal handlers are never installed: Python's
//! own (KeyboardInterrupt) stays in charge.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::time::Duration;

use pyo3::prelude::*;

/// How often the calling thread looks for signals while it waits.
pub const TICK: Duration = Duration::from_millis(100);

/// How [`run`] ended: the work's result (`Err` if it panicked), and the first Python error
/// (a `KeyboardInterrupt`, or an exception from `deliver`), which set `stop`.
pub struct Ended<T> {
    /// What the work returned, or its panic.
    pub result: std::thread::Result<T>,
    /// The first Python error met while waiting.
    pub error: Option<PyErr>,
}

/// Runs `work` on a new thread and waits for it, detached from Python between ticks. Each
/// message `work` sends goes to `deliver` on this thread, attached; after the first Python error
/// `deliver` is not called again (the messages are dropped) and `stop` is set.
pub fn run<T: Send, M: Send>(
    py: Python<'_>,
    stop: &AtomicBool,
    work: impl FnOnce(Sender<M>) -> T + Send,
    mut deliver: impl FnMut(Python<'_>, M) -> PyResult<()>,
) -> Ended<T> {
    let (tx, mut rx) = mpsc::channel::<M>();
    std::thread::scope(|scope| {
        let worker = scope.spawn(move || work(tx));
        let mut error: Option<PyErr> = None;
        let fail = |e: PyErr, error: &mut Option<PyErr>| {
            stop.store(true, Ordering::Relaxed);
            error.get_or_insert(e);
        };
        loop {
            // The receiver goes into the detached closure and comes back (it is not Sync).
            let (got, back) = py.detach(move || (rx.recv_timeout(TICK), rx));
            rx = back;
            match got {
                Ok(message) if error.is_none() => {
                    if let Err(e) = deliver(py, message) {
                        fail(e, &mut error);
                    }
                }
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if let Err(e) = py.check_signals() {
                fail(e, &mut error);
            }
        }
        // Joined detached: the worker's log lines take the GIL (see `logs`).
        let result = py.detach(move || worker.join());
        Ended { result, error }
    })
}

/// A panic's message, for the error that reports it.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
