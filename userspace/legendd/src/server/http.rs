//! The metrics over HTTP (`metrics_port`): `GET /metrics` on `127.0.0.1`, the daemon's totals
//! only.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::Deadline;
use crate::jobs::Jobs;

/// HTTP connections to the metrics served at once; more are answered 503.
const HTTP_CONNECTIONS: usize = 8;

/// Serves `GET /metrics` on `127.0.0.1:port`, for the life of the process. Anyone on the machine
/// may connect and no credentials come with TCP: it shows the daemon's totals only, no job nor
/// owner (see `Jobs::metrics`). Each request must arrive whole within `timeout`, and at most
/// [`HTTP_CONNECTIONS`] are served at once, each on its own thread.
pub fn serve_metrics_http(port: u16, jobs: Arc<Jobs>, timeout: Duration) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("serving metrics on 127.0.0.1:{port}"))?;
    let open = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else {
                    continue;
                };
                let _ = s.set_write_timeout(Some(timeout));
                if open.fetch_add(1, Ordering::Relaxed) >= HTTP_CONNECTIONS {
                    open.fetch_sub(1, Ordering::Relaxed);
                    let _ = s.write_all(
                        b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
                    );
                    continue;
                }
                let (jobs, open) = (jobs.clone(), open.clone());
                let spawned = std::thread::Builder::new()
                    .name("metrics-client".into())
                    .spawn(move || {
                        answer_http(s, &jobs, timeout);
                        open.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    tracing::warn!("no thread for a metrics client");
                }
            }
        })?;
    Ok(())
}

/// Reads one HTTP request head (at most 1 KiB, whole within `timeout`) and answers it.
fn answer_http(s: TcpStream, jobs: &Jobs, timeout: Duration) {
    let mut head = Vec::new();
    let mut reader = Deadline {
        stream: &s,
        at: Instant::now() + timeout,
    };
    let mut buf = [0u8; 1024];
    while head.len() < buf.len() && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match reader.read(&mut buf[..1024 - head.len()]) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let response = if head.starts_with(b"GET /metrics ") {
        let body = jobs.metrics(|_| false);
        format!(
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    } else {
        "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_string()
    };
    let mut s = s;
    let _ = s.write_all(response.as_bytes());
}
