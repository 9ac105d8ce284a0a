//! GPU-to-GPU traffic through NCCL, loaded at run time through cudarc's bindings: one
//! communicator for each GPU of this process, partitions sent and received on a stream of each
//! GPU's own, ordered after the compute that last used them by events.
//!
//! cudarc's loader panics when no library loads and its safe `Comm` panics when a teardown
//! fails: this module probes for the library first ([`nccl_version`]) and owns every
//! communicator's teardown, so a missing library or a failed call is an error, never an abort.
//! NVLink multicast (NVLS) can take a shared host's GPUs out of service: a communicator is only
//! made when `NCCL_NVLS_ENABLE` is set (Legend's binaries set it to 0 at start unless the user
//! chose).

use std::ffi::CStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result, sys};

use crate::error::DriverContext;
use crate::{Gpu, GpuError, RowSpan};

/// How long a communicator being dropped waits for its queued transfers before it aborts them.
const TEARDOWN_GRACE: Duration = Duration::from_secs(10);

/// Why NCCL could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// No NCCL library could be loaded.
    #[error(
        "NCCL is not installed: training on several GPUs needs libnccl.so (NCCL 2.28 or later): \
         install libnccl2 and libnccl-dev, or NVIDIA's nvidia-nccl-cu13 wheel and link its \
         lib/libnccl.so.2 as libnccl.so in a directory on LD_LIBRARY_PATH{found}"
    )]
    Missing {
        /// What else was found (a versioned library without the unversioned name).
        found: String,
    },
    /// `NCCL_NVLS_ENABLE` is unset in this process.
    #[error(
        "NCCL_NVLS_ENABLE is not set: NVLink multicast can take a shared host's GPUs out of \
         service, so Legend makes no communicator until it is set (NCCL_NVLS_ENABLE=0)"
    )]
    MulticastUnset,
    /// An NCCL call failed.
    #[error("NCCL {what} failed: {message}")]
    Call {
        /// The call.
        what: &'static str,
        /// NCCL's words for the error (and its last error message, when it has one).
        message: String,
    },
    /// The communicators were aborted (another GPU failed, or the job was stopped).
    #[error("NCCL communicator aborted: {0}")]
    Aborted(String),
    /// A CUDA call around the exchange failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// NCCL's words for `code`, with the communicator's last error message when it has one.
fn describe(code: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    // SAFETY: ncclGetErrorString returns a static string for any code; ncclGetLastError a
    // string owned by the library (or null), valid until the next NCCL call on this thread.
    unsafe {
        let mut text = CStr::from_ptr(sys::ncclGetErrorString(code))
            .to_string_lossy()
            .into_owned();
        let last = sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()));
        if !last.is_null() {
            let last = CStr::from_ptr(last).to_string_lossy();
            if !last.is_empty() {
                text = format!("{text} ({last})");
            }
        }
        text
    }
}

fn call(
    what: &'static str,
    comm: Option<sys::ncclComm_t>,
    r: Result<result::NcclStatus, result::NcclError>,
) -> Result<(), NcclError> {
    r.map(|_| ()).map_err(|e| NcclError::Call {
        what,
        message: describe(e.0, comm),
    })
}

/// NCCL's switch for NVLink multicast (NVLS).
const MULTICAST: &str = "NCCL_NVLS_ENABLE";

/// Turns NVLink multicast off for NCCL in this process (`NCCL_NVLS_ENABLE=0`) unless the user
/// set the variable: multicast can take a shared host's GPUs out of service. Every binary that
/// may start NCCL calls it first thing in `main`.
///
/// # Safety
/// Changes the environment: call before the process starts any thread.
pub unsafe fn keep_multicast_off() {
    if std::env::var_os(MULTICAST).is_none() {
        // SAFETY: the caller's contract: no other thread reads the environment yet.
        unsafe { std::env::set_var(MULTICAST, "0") };
    }
}

/// The NCCL version (e.g. 22809 for 2.28.9) when the library loads, else why not.
pub fn nccl_version() -> Result<i32, NcclError> {
    // SAFETY: only tries to dlopen the library by its candidate names.
    if !unsafe { sys::is_culib_present() } {
        // Versioned names cudarc does not try: say they are there, and how to expose them.
        let found = ["libnccl.so.2"]
            .iter()
            // SAFETY: as above, a dlopen by name.
            .filter(|name| unsafe { libloading_present(name) })
            .map(|name| format!(" ({name} loads, but not under the name libnccl.so)"))
            .collect();
        return Err(NcclError::Missing { found });
    }
    let mut version = 0;
    // SAFETY: the library is present (checked above); the call writes one int.
    let code = unsafe { sys::ncclGetVersion(&mut version) };
    call("ncclGetVersion", None, code.result())?;
    Ok(version)
}

/// Whether the dynamic loader finds a library named `name`.
///
/// # Safety
/// Loading a library runs its initialisers.
unsafe fn libloading_present(name: &str) -> bool {
    let Ok(name) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: the caller's contract; the handle is closed at once.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            return false;
        }
        libc::dlclose(h);
    }
    true
}

/// One GPU's end of the communicators of a process's GPUs, with the stream its transfers run
/// on. Every call on it is made from the thread that owns it, the abort included (NCCL's
/// calls on one communicator are not thread-safe): a rank told to give up by others aborts
/// itself ([`Communicator::wait`]).
pub struct Communicator {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
    stream: Arc<CudaStream>,
    aborted: bool,
}

// SAFETY: an NCCL communicator may move between threads; it is used by one at a time (the
// owner of this value: every method takes `self` by reference from that thread).
unsafe impl Send for Communicator {}

/// Communicators for `gpus` (one process, one rank a GPU, in order).
pub fn communicators(gpus: &[&Gpu]) -> Result<Vec<Communicator>, NcclError> {
    nccl_version()?;
    if std::env::var_os(MULTICAST).is_none() {
        return Err(NcclError::MulticastUnset);
    }
    let ordinals: Vec<i32> = gpus.iter().map(|g| g.context().ordinal() as i32).collect();
    let mut comms = vec![std::ptr::null_mut(); gpus.len()];
    // SAFETY: `comms` has room for one communicator a device of `ordinals`.
    call("ncclCommInitAll", None, unsafe {
        result::comm_init_all(comms.as_mut_ptr(), gpus.len() as i32, ordinals.as_ptr())
    })?;
    // Made before any stream, so that a failure below tears the communicators down too.
    let mut made: Vec<Communicator> = Vec::with_capacity(gpus.len());
    for (rank, (comm, gpu)) in comms.into_iter().zip(gpus).enumerate() {
        let stream = match gpu
            .context()
            .new_stream()
            .during("creating the NCCL stream")
        {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: `comm` is a live communicator nothing else holds.
                let _ = unsafe { result::comm_abort(comm) };
                return Err(e.into());
            }
        };
        made.push(Communicator {
            comm,
            rank,
            size: gpus.len(),
            stream,
            aborted: false,
        });
    }
    Ok(made)
}

impl Communicator {
    /// This GPU's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in all.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Sends the rows of each `(peer, span)` of `sends` to that peer and receives those of each
    /// of `recvs` from it, as one NCCL group on this GPU's transfer stream, after `after` (the
    /// compute that last used the spans: every event of it). Returns the event after which the received spans
    /// hold their rows and the sent ones may be reused.
    ///
    /// # Safety
    /// The spans must be device memory of this communicator's GPU that nothing else writes
    /// (or, for the sent ones, reads and writes) until the event has passed; every peer must
    /// post the matching receives and sends of the same sizes.
    pub unsafe fn exchange(
        &mut self,
        sends: &[(usize, RowSpan)],
        recvs: &[(usize, RowSpan)],
        after: &[&CudaEvent],
    ) -> Result<CudaEvent, NcclError> {
        if self.aborted {
            return Err(NcclError::Aborted("before an exchange".into()));
        }
        self.stream
            .context()
            .bind_to_thread()
            .during("binding the NCCL GPU")?;
        for ev in after {
            self.stream
                .wait(ev)
                .during("ordering the NCCL stream after compute")?;
        }
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let comm = self.comm;
        call("ncclGroupStart", Some(comm), result::group_start())?;
        let mut queued = Ok(());
        for (peer, span) in sends {
            for (at, bytes) in span.addrs() {
                // SAFETY: the caller's contract on the span; the count is its bytes.
                let r = unsafe {
                    result::send(
                        at as *const std::ffi::c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        *peer as i32,
                        comm,
                        stream,
                    )
                };
                queued = queued.and(call("ncclSend", Some(comm), r));
            }
        }
        for (peer, span) in recvs {
            for (at, bytes) in span.addrs() {
                // SAFETY: as above.
                let r = unsafe {
                    result::recv(
                        at as *mut std::ffi::c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        *peer as i32,
                        comm,
                        stream,
                    )
                };
                queued = queued.and(call("ncclRecv", Some(comm), r));
            }
        }
        // The group is closed whatever happened inside it.
        let ended = call("ncclGroupEnd", Some(comm), result::group_end());
        queued.and(ended)?;
        let ev = self
            .stream
            .context()
            .new_event(None)
            .during("creating the exchange's event")?;
        ev.record(&self.stream)
            .during("recording the exchange's event")?;
        Ok(ev)
    }

    /// Sums `floats` f32 at `at` over every rank, in place, on this GPU's transfer stream after
    /// `after` (the step that wrote them): every rank ends with the same sum. Returns the event
    /// after which the sum is there.
    ///
    /// # Safety
    /// `at` must hold `floats` f32 of device memory of this communicator's GPU that nothing
    /// else touches until the event has passed; every rank must make the same call.
    pub unsafe fn all_reduce_sum(
        &mut self,
        at: u64,
        floats: usize,
        after: &[&CudaEvent],
    ) -> Result<CudaEvent, NcclError> {
        if self.aborted {
            return Err(NcclError::Aborted("before a sum".into()));
        }
        self.stream
            .context()
            .bind_to_thread()
            .during("binding the NCCL GPU")?;
        for ev in after {
            self.stream
                .wait(ev)
                .during("ordering the NCCL stream after compute")?;
        }
        let buffer = at as *mut std::ffi::c_void;
        // SAFETY: the caller's contract; in place (send and receive buffers the same) is
        // NCCL's documented in-place all-reduce.
        let r = unsafe {
            result::all_reduce(
                buffer,
                buffer,
                floats,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        };
        call("ncclAllReduce", Some(self.comm), r)?;
        let ev = self
            .stream
            .context()
            .new_event(None)
            .during("creating the sum's event")?;
        ev.record(&self.stream)
            .during("recording the sum's event")?;
        Ok(ev)
    }

    /// Waits for the exchanges queued so far. Fails, aborting the communicator so that its
    /// peers' transfers end too, on an asynchronous NCCL error or once `give_up` is set (another
    /// rank failed, or the job ends): no rank waits for ever for a peer that is gone.
    pub fn wait(&mut self, give_up: &AtomicBool) -> Result<(), NcclError> {
        self.stream
            .context()
            .bind_to_thread()
            .during("binding the NCCL GPU")?;
        loop {
            self.check()?;
            if give_up.load(Ordering::Acquire) {
                self.abort();
                return Err(NcclError::Aborted("another GPU's worker stopped".into()));
            }
            // SAFETY: a query of a live stream.
            let done = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match done {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                e => {
                    return Err(GpuError::Driver {
                        what: "waiting for an NCCL exchange",
                        source: cudarc::driver::DriverError(e),
                    }
                    .into());
                }
            }
        }
    }

    /// NCCL's asynchronous error of this communicator, if any (a peer gone, a failed
    /// transfer), or the abort that ended it.
    pub fn check(&mut self) -> Result<(), NcclError> {
        if self.aborted {
            return Err(NcclError::Aborted("the communicator was aborted".into()));
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a query of a live communicator, writing one result code.
        let code = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        call("ncclCommGetAsyncError", Some(self.comm), code.result())?;
        match state {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            e => {
                self.abort();
                Err(NcclError::Call {
                    what: "an exchange (asynchronous error)",
                    message: describe(e, Some(self.comm)),
                })
            }
        }
    }

    /// Aborts the communicator: operations queued or blocked on it end with an error, so no
    /// rank waits for a peer that will never come. Further exchanges fail.
    pub fn abort(&mut self) {
        if !std::mem::replace(&mut self.aborted, true) {
            // SAFETY: a live communicator, used by no other call now (we own it); the abort
            // frees it.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.aborted {
            // ncclCommAbort freed the communicator already.
            return;
        }
        // A transfer still queued (a peer that never posted its side, after a panic) would
        // hold a destroy for ever: past the grace time it is aborted instead.
        let started = std::time::Instant::now();
        loop {
            // SAFETY: a query of a live stream.
            let state = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            if state != cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY {
                break;
            }
            if started.elapsed() > TEARDOWN_GRACE {
                tracing::warn!(
                    "NCCL: GPU rank {}'s transfers did not finish in {:?}; aborting its communicator",
                    self.rank,
                    TEARDOWN_GRACE
                );
                self.abort();
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: the communicator is live and nothing else uses it now (we own it).
        let destroyed = unsafe { result::comm_destroy(self.comm) };
        if let Err(e) = destroyed {
            tracing::warn!(
                "NCCL: tearing down GPU rank {}'s communicator failed ({}); aborting it",
                self.rank,
                describe(e.0, None)
            );
            // SAFETY: as above; abort frees what destroy could not.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }
}
