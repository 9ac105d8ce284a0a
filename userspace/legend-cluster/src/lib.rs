//! Legend on several hosts: one process a host, each driving its own GPUs, that find each other
//! and stay in step through this crate.
//!
//! - [`Launch`]: a host's place in the job, from `--hosts/--host-rank/--rendezvous`, torchrun's
//!   environment or Slurm's (compressed node lists like `node[01-04]` included).
//! - [`join`]: the rendezvous. Host 0 listens on the named address only; every other host
//!   connects, proves it holds the job token (`LEGEND_JOB_TOKEN`, HMAC over fresh nonces both
//!   ways) and sends its identity (configuration, dataset, binary...); host 0 admits the job
//!   only when all H hosts arrived within the timeout and every identity matches its own,
//!   else every host fails with the same message naming the host and the key (or the hosts
//!   that never came, and the rendezvous).
//! - [`Cluster`]: the connections that stay open for the job (a star around host 0): data
//!   between hosts (what the engine sends: commands, rows of partitions), the gates where every
//!   host agrees before a round whether to go on (with a deadline), and liveness. Every host
//!   sends a heartbeat each second; a host that sends nothing for the host timeout (stopped,
//!   dead, cut off) or closes its connection fails the job on every host with an error that
//!   names it. The engine's waits poll [`Cluster::failed_flag`], so no host waits for ever.
//!
//! Every frame after the handshake is authenticated under a key of its connection (HKDF-SHA-256
//! of the token and both handshake nonces; keyed BLAKE3 over the frame's direction, its
//! sequence number on the connection, its header and its payload): a frame tampered with,
//! injected, replayed, reordered, cut short or recorded on another connection fails the job,
//! naming the host, before anything in it is acted on. Nothing is encrypted.
//!
//! This is the control plane only: partitions travel between GPUs through NCCL.

mod auth;
mod cluster;
mod launch;
mod wire;

pub use auth::{TOKEN_MIN, TOKEN_VAR, Token, binary_identity};
pub use cluster::{Cluster, HOST_TIMEOUT, Identity, Options, RENDEZVOUS_TIMEOUT, join};
pub use launch::{
    LAUNCH_VAR, Launch, LaunchSource, PORT_VAR, SLURM_BASE_PORT, expand_nodelist, split_host_port,
};

/// What can go wrong between hosts; every message names the host (and the rendezvous).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// The launch settings are incomplete or inconsistent.
    #[error("{0}")]
    Launch(String),
    /// The job token is missing or too short.
    #[error("{0}")]
    Token(String),
    /// Host 0 could not listen at the rendezvous.
    #[error(
        "cannot listen at the rendezvous {rendezvous} (host 0 listens on that address only: is this host 0?)"
    )]
    Bind {
        /// The rendezvous.
        rendezvous: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The rendezvous did not complete (hosts missing, host 0 absent) in time.
    #[error("{0}")]
    Rendezvous(String),
    /// The hosts do not run the same job (configuration, dataset, binary).
    #[error("{0}")]
    Mismatch(String),
    /// Host 0 refused this host.
    #[error("{0}")]
    Refused(String),
    /// The job failed on some host, or lost one.
    #[error("{0}")]
    Failed(String),
    /// Host 0 ended the job (`stopped`: as asked, with a checkpoint) while this host waited.
    #[error("host 0 ended the job")]
    Finished {
        /// The job stopped as asked rather than completing.
        stopped: bool,
    },
    /// A local I/O failure.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}
