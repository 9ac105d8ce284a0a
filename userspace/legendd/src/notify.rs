//! The systemd notification protocol (`Type=notify`): one datagram to `$NOTIFY_SOCKET`.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

fn send(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    // A leading '@' names an abstract socket.
    let addr = match path.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None => SocketAddr::from_pathname(&path),
    };
    let sent = addr.and_then(|addr| UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &addr));
    if let Err(e) = sent {
        tracing::warn!("notifying systemd ({path}): {e}");
    }
}

/// The service is ready: its socket accepts connections.
pub fn ready() {
    send("READY=1");
}

/// The service is stopping.
pub fn stopping() {
    send("STOPPING=1");
}
