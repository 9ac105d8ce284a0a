//! Frames on a control connection: a fixed header (kind, sender, addressee, channel, length)
//! and a payload, JSON for the control messages, raw bytes for data.

use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// "LGND": the first bytes of every frame.
const MAGIC: u32 = 0x4c47_4e44;
/// Bytes of a frame's header.
const HEADER_BYTES: usize = 32;
/// Payloads are read in pieces of this size, each one proof that the peer is alive.
const READ_PIECE: usize = 1 << 20;
/// The largest payload accepted before a peer has proven it holds the job's token.
pub(crate) const HANDSHAKE_MAX: u64 = 1 << 20;
/// The largest payload accepted from a peer of the job (a partition of a large table).
pub(crate) const DATA_MAX: u64 = 1 << 40;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Challenge = 1,
    Hello = 2,
    Welcome = 3,
    Refused = 4,
    Heartbeat = 5,
    Arrive = 6,
    Decide = 7,
    Abort = 8,
    Finish = 9,
    Data = 10,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Challenge,
            2 => Kind::Hello,
            3 => Kind::Welcome,
            4 => Kind::Refused,
            5 => Kind::Heartbeat,
            6 => Kind::Arrive,
            7 => Kind::Decide,
            8 => Kind::Abort,
            9 => Kind::Finish,
            10 => Kind::Data,
            _ => return None,
        })
    }
}

/// A frame's header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) from: u32,
    pub(crate) to: u32,
    pub(crate) channel: u32,
    pub(crate) len: u64,
}

/// Writes one frame: the header, then `parts` back to back as its payload.
pub(crate) fn write_frame(
    w: &mut impl Write,
    kind: Kind,
    from: u32,
    to: u32,
    channel: u32,
    parts: &[&[u8]],
) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut head = [0u8; HEADER_BYTES];
    head[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    head[4] = kind as u8;
    head[8..12].copy_from_slice(&from.to_le_bytes());
    head[12..16].copy_from_slice(&to.to_le_bytes());
    head[16..20].copy_from_slice(&channel.to_le_bytes());
    head[20..28].copy_from_slice(&(len as u64).to_le_bytes());
    w.write_all(&head)?;
    for p in parts {
        w.write_all(p)?;
    }
    w.flush()
}

/// Writes a control message as JSON.
pub(crate) fn write_json(
    w: &mut impl Write,
    kind: Kind,
    from: u32,
    to: u32,
    value: &impl Serialize,
) -> io::Result<()> {
    let bytes = serde_json::to_vec(value).expect("control messages serialize");
    write_frame(w, kind, from, to, 0, &[&bytes])
}

/// Reads a frame's header, refusing what is not one of ours.
pub(crate) fn read_header(r: &mut impl Read) -> io::Result<Header> {
    let mut head = [0u8; HEADER_BYTES];
    r.read_exact(&mut head)?;
    let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    if word(0) != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a Legend control connection (bad magic)",
        ));
    }
    let kind = Kind::from_u8(head[4]).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown frame kind {}", head[4]),
        )
    })?;
    Ok(Header {
        kind,
        from: word(8),
        to: word(12),
        channel: word(16),
        len: u64::from_le_bytes(head[20..28].try_into().expect("8 bytes")),
    })
}

/// Reads a payload of `len` bytes (at most `max`), calling `alive` after every piece.
pub(crate) fn read_payload(
    r: &mut impl Read,
    len: u64,
    max: u64,
    alive: &dyn Fn(),
) -> io::Result<Vec<u8>> {
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes, more than the {max} allowed here"),
        ));
    }
    let len = usize::try_from(len).map_err(|_| io::Error::other("frame larger than memory"))?;
    let mut buf = vec![0u8; len];
    for piece in buf.chunks_mut(READ_PIECE) {
        r.read_exact(piece)?;
        alive();
    }
    Ok(buf)
}

/// A control message's payload, decoded.
pub(crate) fn decode<T: DeserializeOwned>(payload: &[u8]) -> io::Result<T> {
    serde_json::from_slice(payload)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("bad message: {e}")))
}

/// The rendezvous protocol's version: hosts of another version are refused.
pub(crate) const VERSION: u32 = 1;

/// Host 0 to a connecting host: prove you hold the token.
#[derive(Serialize, Deserialize)]
pub(crate) struct Challenge {
    pub(crate) version: u32,
    pub(crate) nonce: String,
}

/// A host to host 0: who it is, its proof, and what must match.
#[derive(Serialize, Deserialize)]
pub(crate) struct Hello {
    pub(crate) version: u32,
    pub(crate) rank: u32,
    pub(crate) hosts: u32,
    pub(crate) name: String,
    pub(crate) nonce: String,
    pub(crate) mac: String,
    pub(crate) identity: std::collections::BTreeMap<String, String>,
}

/// Host 0 to every host once all arrived and match: the hosts' names, and host 0's proof.
#[derive(Serialize, Deserialize)]
pub(crate) struct Welcome {
    pub(crate) names: Vec<String>,
    pub(crate) mac: String,
}

/// Why a host was refused, or the job stopped before it began.
#[derive(Serialize, Deserialize)]
pub(crate) struct Refused {
    pub(crate) reason: String,
}

/// Liveness, every second each way: what the host has trained in the current epoch, and
/// whether it was asked to stop (SIGINT, SIGTERM).
#[derive(Serialize, Deserialize)]
pub(crate) struct Heartbeat {
    pub(crate) progress: u64,
    pub(crate) stop: bool,
}

/// A host at gate `seq`, and whether it wants to stop there.
#[derive(Serialize, Deserialize)]
pub(crate) struct Arrive {
    pub(crate) seq: u64,
    pub(crate) stop: bool,
}

/// Host 0's decision at gate `seq`.
#[derive(Serialize, Deserialize)]
pub(crate) struct Decide {
    pub(crate) seq: u64,
    pub(crate) go: bool,
}

/// Host 0 ended the job: `stopped` as asked (with a checkpoint), or completed.
#[derive(Serialize, Deserialize)]
pub(crate) struct Finish {
    pub(crate) stopped: bool,
}

/// The job failed: why, in words that name the host.
#[derive(Serialize, Deserialize)]
pub(crate) struct Abort {
    pub(crate) reason: String,
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of lower-case or upper-case hex `s`.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_foreign_bytes_are_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Data, 3, 1, 7, &[b"ab", b"cde"]).unwrap();
        let mut r = &buf[..];
        let h = read_header(&mut r).unwrap();
        assert_eq!(
            (h.kind, h.from, h.to, h.channel, h.len),
            (Kind::Data, 3, 1, 7, 5)
        );
        let seen = std::cell::Cell::new(0);
        let p = read_payload(&mut r, h.len, 10, &|| seen.set(seen.get() + 1)).unwrap();
        assert_eq!((&p[..], seen.get()), (&b"abcde"[..], 1));
        assert!(read_payload(&mut &buf[..], 11, 10, &|| {}).is_err());
        let mut http = &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n012345"[..];
        assert!(read_header(&mut http).is_err());
        assert_eq!(unhex(&hex(&[0, 15, 255])).unwrap(), [0, 15, 255]);
        assert!(unhex("abc").is_none() && unhex("zz").is_none());
    }
}
