//! GPU-to-GPU traffic through NCCL, loaded at run time through cudarc's bindings: one
//! communicator for each GPU of this process, partitions sent and received on a stream of each
//! GPU's own, ordered after the compute that last used them by events.
//!
//! One process's GPUs share a communicator made with `ncclCommInitAll` ([`communicators`]).
//! A job of several hosts makes one over all their GPUs ([`job_communicators`]) from the
//! unique id host 0 draws ([`unique_id`]) and its rendezvous hands out; those are
//! non-blocking, so that no call waits for a peer that is gone: initialisation and every
//! exchange are polled, and given up when the job fails anywhere.
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
    /// Made non-blocking (a job of several hosts): calls may return before their work is
    /// queued, and are polled.
    nonblocking: bool,
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
    wrap(&comms, gpus, 0, gpus.len(), false)
}

/// `comms` (made for `gpus`, ranks `first ..` of `size`) as [`Communicator`]s, each with a
/// transfer stream of its GPU's. Wrapped before any stream of the next is made, so that a
/// failure tears every one down: the wrapped as they drop, the others aborted here.
fn wrap(
    comms: &[sys::ncclComm_t],
    gpus: &[&Gpu],
    first: usize,
    size: usize,
    nonblocking: bool,
) -> Result<Vec<Communicator>, NcclError> {
    let mut made: Vec<Communicator> = Vec::with_capacity(gpus.len());
    for (i, (&comm, gpu)) in comms.iter().zip(gpus).enumerate() {
        let stream = match gpu
            .context()
            .new_stream()
            .during("creating the NCCL stream")
        {
            Ok(s) => s,
            Err(e) => {
                for &c in &comms[i..] {
                    // SAFETY: a live communicator nothing else holds.
                    let _ = unsafe { result::comm_abort(c) };
                }
                return Err(e.into());
            }
        };
        made.push(Communicator {
            comm,
            rank: first + i,
            size,
            stream,
            aborted: false,
            nonblocking,
        });
    }
    Ok(made)
}

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// A fresh NCCL unique id (host 0 of a job draws it; every host's communicators start from
/// it): NCCL's bootstrap listens on this host for the ranks to meet.
pub fn unique_id() -> Result<Vec<u8>, NcclError> {
    nccl_version()?;
    let id = result::get_uniqueid().map_err(|e| NcclError::Call {
        what: "ncclGetUniqueId",
        message: describe(e.0, None),
    })?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// NCCL's initializer of a communicator's configuration (NCCL_CONFIG_INITIALIZER of the
/// 2.28 headers cudarc's bindings follow), made non-blocking.
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: std::ffi::c_int = std::ffi::c_int::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22_800,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// The communicators of this host's `gpus` in a job of `ranks` GPUs over several hosts, from
/// host 0's unique `id`: rank `first + i` for `gpus[i]` (ranks host-major). Non-blocking:
/// initialisation is polled, and abandoned (every communicator aborted) once `give_up` is
/// raised (the job failed elsewhere) or after `deadline`, so that a peer that never comes
/// leaves no host waiting.
pub fn job_communicators(
    gpus: &[&Gpu],
    id: &[u8],
    ranks: usize,
    first: usize,
    give_up: &AtomicBool,
    deadline: Duration,
) -> Result<Vec<Communicator>, NcclError> {
    nccl_version()?;
    if std::env::var_os(MULTICAST).is_none() {
        return Err(NcclError::MulticastUnset);
    }
    let mut unique = sys::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    if id.len() != UNIQUE_ID_BYTES {
        return Err(NcclError::Call {
            what: "ncclCommInitRankConfig",
            message: format!("a unique id of {} bytes, not {UNIQUE_ID_BYTES}", id.len()),
        });
    }
    for (c, b) in unique.internal.iter_mut().zip(id) {
        *c = *b as std::ffi::c_char;
    }
    let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); gpus.len()];
    let abort_all = |comms: &[sys::ncclComm_t]| {
        for &c in comms.iter().filter(|c| !c.is_null()) {
            // SAFETY: a communicator this function made, used by nothing else.
            let _ = unsafe { result::comm_abort(c) };
        }
    };
    call("ncclGroupStart", None, result::group_start())?;
    let mut started = Ok(());
    for (i, gpu) in gpus.iter().enumerate() {
        let bound = gpu
            .context()
            .bind_to_thread()
            .during("binding a GPU for NCCL");
        if let Err(e) = bound {
            started = started.and(Err(e.into()));
            break;
        }
        let mut config = nonblocking_config();
        // SAFETY: `comms[i]` receives the communicator; the config outlives the call (NCCL
        // copies it).
        let r = unsafe {
            result::comm_init_rank_config(
                &mut comms[i],
                ranks as std::ffi::c_int,
                unique,
                (first + i) as std::ffi::c_int,
                &mut config,
            )
        };
        started = started.and(call("ncclCommInitRankConfig", None, r));
    }
    let ended = call("ncclGroupEnd", None, result::group_end());
    if let Err(e) = started.and(ended) {
        abort_all(&comms);
        return Err(e);
    }
    let since = std::time::Instant::now();
    loop {
        let mut pending = false;
        for &c in &comms {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a query of a communicator being initialised, writing one result code.
            let code = unsafe { sys::ncclCommGetAsyncError(c, &mut state) };
            let checked =
                call("ncclCommGetAsyncError", Some(c), code.result()).and_then(|()| match state {
                    sys::ncclResult_t::ncclSuccess => Ok(()),
                    sys::ncclResult_t::ncclInProgress => {
                        pending = true;
                        Ok(())
                    }
                    e => Err(NcclError::Call {
                        what: "ncclCommInitRankConfig (asynchronous)",
                        message: describe(e, Some(c)),
                    }),
                });
            if let Err(e) = checked {
                abort_all(&comms);
                return Err(e);
            }
        }
        if !pending {
            break;
        }
        if give_up.load(Ordering::Acquire) {
            abort_all(&comms);
            return Err(NcclError::Aborted(
                "the job failed while its communicators were being made".into(),
            ));
        }
        if since.elapsed() > deadline {
            abort_all(&comms);
            return Err(NcclError::Call {
                what: "ncclCommInitRankConfig",
                message: format!(
                    "the {ranks} ranks did not all connect within {} s",
                    deadline.as_secs()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    wrap(&comms, gpus, first, ranks, true)
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

    /// What every collective does first: refuses after an abort (saying `when`), binds the
    /// communicator's GPU to this thread and orders its stream after the events `after`.
    fn begin(&self, when: &str, after: &[&CudaEvent]) -> Result<(), NcclError> {
        if self.aborted {
            return Err(NcclError::Aborted(when.into()));
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
        Ok(())
    }
    /// Sends the rows of each `(peer, span)` of `sends` to that peer and receives those of each
    /// of `recvs` from it, as one NCCL group on this GPU's transfer stream, after `after` (the
    /// compute that last used the spans: every event of it). Returns the event after which the received spans
    /// hold their rows and the sent ones may be reused. A non-blocking communicator's group is
    /// polled until queued, given up (aborted) once `give_up` is raised.
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
        give_up: &AtomicBool,
    ) -> Result<CudaEvent, NcclError> {
        self.begin("before an exchange", after)?;
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
        if self.nonblocking {
            // Queued on the stream only once NCCL says so.
            self.settle(give_up)?;
        }
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
    /// after which the sum is there. A non-blocking communicator's call is polled until
    /// queued, given up (aborted) once `give_up` is raised.
    ///
    /// # Safety
    /// `at` must hold `floats` f32 of device memory of this communicator's GPU that nothing
    /// else touches until the event has passed; every rank must make the same call.
    pub unsafe fn all_reduce_sum(
        &mut self,
        at: u64,
        floats: usize,
        after: &[&CudaEvent],
        give_up: &AtomicBool,
    ) -> Result<CudaEvent, NcclError> {
        self.begin("before a sum", after)?;
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
        if self.nonblocking {
            // Queued on the stream only once NCCL says so.
            self.settle(give_up)?;
        }
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
        self.state().map(|_| ())
    }

    /// Whether NCCL still works on the calls made (a non-blocking communicator's), failing
    /// (aborted) on its asynchronous error.
    fn state(&mut self) -> Result<bool, NcclError> {
        if self.aborted {
            return Err(NcclError::Aborted("the communicator was aborted".into()));
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a query of a live communicator, writing one result code.
        let code = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        call("ncclCommGetAsyncError", Some(self.comm), code.result())?;
        match state {
            sys::ncclResult_t::ncclSuccess => Ok(false),
            sys::ncclResult_t::ncclInProgress => Ok(true),
            e => {
                self.abort();
                Err(NcclError::Call {
                    what: "an exchange (asynchronous error)",
                    message: describe(e, Some(self.comm)),
                })
            }
        }
    }

    /// Polls a non-blocking communicator until its calls are done (queued on the stream),
    /// aborting it once `give_up` is raised.
    fn settle(&mut self, give_up: &AtomicBool) -> Result<(), NcclError> {
        while self.state()? {
            if give_up.load(Ordering::Acquire) {
                self.abort();
                return Err(NcclError::Aborted("another GPU's worker stopped".into()));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
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
        if self.nonblocking {
            // A non-blocking communicator is finalised (polled) before it is destroyed.
            // SAFETY: the communicator is live and nothing else uses it now (we own it).
            let finalised = unsafe { result::comm_finalize(self.comm) };
            let started = std::time::Instant::now();
            let settled = finalised.is_ok()
                && loop {
                    match self.state() {
                        Ok(false) => break true,
                        Ok(true) if started.elapsed() < TEARDOWN_GRACE => {
                            std::thread::sleep(Duration::from_millis(1))
                        }
                        _ => break false,
                    }
                };
            if !settled {
                tracing::warn!(
                    "NCCL: GPU rank {}'s communicator did not finalise; aborting it",
                    self.rank
                );
                self.abort();
                return;
            }
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
