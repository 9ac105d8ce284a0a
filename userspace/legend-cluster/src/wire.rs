//! Frames on a control connection: a fixed header (kind, sender, addressee, channel, length,
//! sequence number) and a payload, JSON for the control messages, raw bytes for data.
//!
//! The handshake's frames go plain ([`write_json`], [`read_header`], [`read_payload`]): what
//! they say is vouched for by the token's MACs inside the messages. Every frame after it is
//! sealed ([`Sealer`], [`Opener`]) under the connection's session key: the header is followed
//! by its MAC, checked before the payload is read (a forged length never makes a reader wait
//! or allocate), and the payload by the MAC of header and payload. Both MACs cover the
//! frame's direction and its sequence number on the connection (0, 1, 2... each way), so that
//! a frame tampered with, injected, replayed, reordered, reflected to its sender, cut short
//! or recorded on another connection is refused.

use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::auth::SessionKey;

/// "LGND": the first bytes of every frame.
const MAGIC: u32 = 0x4c47_4e44;
/// Bytes of a sealed frame's header.
const HEADER_BYTES: usize = 40;
/// Bytes of a handshake frame's header: the sealed one without its sequence number, the
/// layout of every protocol version, so that a host of another version is told so.
const PLAIN_HEADER_BYTES: usize = 32;
/// Bytes of a frame's MACs (BLAKE3 keyed with the session key).
const TAG_BYTES: usize = 32;
/// Payloads are read in pieces of this size, each one proof that the peer is alive.
const READ_PIECE: usize = 1 << 20;
/// A sealed payload up to this size goes out in one write with its header and MACs; larger
/// ones are MAC'd and written a piece at a time (each piece still in cache for its write).
const WRITE_PIECE: usize = 1 << 16;
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
    /// The frame's place on its connection, one way (0 for the handshake's frames).
    pub(crate) seq: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut head = [0u8; HEADER_BYTES];
        head[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        head[4] = self.kind as u8;
        head[8..12].copy_from_slice(&self.from.to_le_bytes());
        head[12..16].copy_from_slice(&self.to.to_le_bytes());
        head[16..20].copy_from_slice(&self.channel.to_le_bytes());
        head[20..28].copy_from_slice(&self.len.to_le_bytes());
        head[28..36].copy_from_slice(&self.seq.to_le_bytes());
        head
    }

    /// The header `head` holds, refusing what is not one of ours.
    fn decode(head: &[u8; HEADER_BYTES]) -> io::Result<Header> {
        let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
        let long = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
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
            len: long(20),
            seq: long(28),
        })
    }
}

/// Writes one frame of the handshake (before the connection has a session key): a control
/// message as JSON.
pub(crate) fn write_json(
    w: &mut impl Write,
    kind: Kind,
    from: u32,
    to: u32,
    value: &impl Serialize,
) -> io::Result<()> {
    let bytes = serde_json::to_vec(value).expect("control messages serialize");
    let head = Header {
        kind,
        from,
        to,
        channel: 0,
        len: bytes.len() as u64,
        seq: 0,
    };
    w.write_all(&[&head.encode()[..PLAIN_HEADER_BYTES], &bytes].concat())?;
    w.flush()
}

/// Reads a handshake frame's header, refusing what is not one of ours.
pub(crate) fn read_header(r: &mut impl Read) -> io::Result<Header> {
    let mut head = [0u8; HEADER_BYTES];
    r.read_exact(&mut head[..PLAIN_HEADER_BYTES])?;
    Header::decode(&head)
}

/// Reads a handshake frame's payload of `len` bytes (at most `max`).
pub(crate) fn read_payload(r: &mut impl Read, len: u64, max: u64) -> io::Result<Vec<u8>> {
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes, more than the {max} allowed here"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Which way a frame goes on a connection between host 0 and another host: part of every
/// frame's MACs, so that a frame reflected back to its sender is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Direction {
    FromHostZero = 0,
    ToHostZero = 1,
}

impl Direction {
    /// The way the frames host `rank` writes go (every connection has host 0 at one end).
    pub(crate) fn outgoing(rank: u32) -> Direction {
        if rank == 0 {
            Direction::FromHostZero
        } else {
            Direction::ToHostZero
        }
    }

    /// The other way.
    pub(crate) fn reverse(self) -> Direction {
        match self {
            Direction::FromHostZero => Direction::ToHostZero,
            Direction::ToHostZero => Direction::FromHostZero,
        }
    }
}

/// The MACs of a frame with header `head` going `direction` under `key`: the header's, and
/// the whole frame's with its payload still to be fed.
fn frame_macs(
    key: &SessionKey,
    direction: Direction,
    head: &[u8; HEADER_BYTES],
) -> (blake3::Hasher, blake3::Hasher) {
    let start = |domain: &[u8]| {
        let mut mac = key.mac();
        mac.update(domain);
        mac.update(&[direction as u8]);
        mac.update(head);
        mac
    };
    (start(b"head"), start(b"body"))
}

/// Whether `tag` is what `mac` finalizes to (compared in constant time).
fn matches(mac: &blake3::Hasher, tag: &[u8; TAG_BYTES]) -> bool {
    mac.finalize() == blake3::Hash::from_bytes(*tag)
}

/// A connection's writing end after the handshake: every frame sealed (see the module).
pub(crate) struct Sealer<W> {
    w: W,
    key: SessionKey,
    direction: Direction,
    next: u64,
}

impl<W: Write> Sealer<W> {
    /// Seals what goes `direction` on `w` under `key`, from frame 0.
    pub(crate) fn new(w: W, key: SessionKey, direction: Direction) -> Sealer<W> {
        Sealer {
            w,
            key,
            direction,
            next: 0,
        }
    }

    /// The connection.
    pub(crate) fn get_ref(&self) -> &W {
        &self.w
    }

    /// Writes one frame: the header and its MAC, then `parts` back to back as its payload,
    /// then the frame's MAC.
    pub(crate) fn send(
        &mut self,
        kind: Kind,
        from: u32,
        to: u32,
        channel: u32,
        parts: &[&[u8]],
    ) -> io::Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let head = Header {
            kind,
            from,
            to,
            channel,
            len: len as u64,
            seq: self.next,
        }
        .encode();
        let (head_mac, mut mac) = frame_macs(&self.key, self.direction, &head);
        let head_tag = *head_mac.finalize().as_bytes();
        if len <= WRITE_PIECE {
            let mut out = Vec::with_capacity(HEADER_BYTES + 2 * TAG_BYTES + len);
            out.extend_from_slice(&head);
            out.extend_from_slice(&head_tag);
            for p in parts {
                mac.update(p);
                out.extend_from_slice(p);
            }
            out.extend_from_slice(mac.finalize().as_bytes());
            self.w.write_all(&out)?;
        } else {
            self.w.write_all(&[&head[..], &head_tag].concat())?;
            for piece in parts.iter().flat_map(|p| p.chunks(WRITE_PIECE)) {
                mac.update(piece);
                self.w.write_all(piece)?;
            }
            self.w.write_all(mac.finalize().as_bytes())?;
        }
        // A frame half written leaves the connection unusable: nothing is sent after it.
        self.next += 1;
        self.w.flush()
    }
}

/// Why a sealed frame could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The connection ended between two frames, or failed (reset, timed out).
    #[error("{0}")]
    Closed(io::Error),
    /// The connection ended inside a frame.
    #[error(
        "its connection ended inside a frame, after {got} of its {of} bytes: the frame is cut short (its process ended, its network failed, or the stream was cut)"
    )]
    Truncated { got: u64, of: u64 },
    /// A frame whose MAC does not match.
    #[error(
        "frame {seq} on its connection fails authentication ({what}): tampered with, injected, or sealed under another connection's session key"
    )]
    Forged { seq: u64, what: &'static str },
    /// An authentic frame out of its place on the connection.
    #[error(
        "frame {got} of its connection arrived where frame {expected} was due: replayed or reordered"
    )]
    OutOfSequence { got: u64, expected: u64 },
    /// An authentic frame larger than this end accepts.
    #[error("a frame of {len} bytes, more than the {max} allowed")]
    TooLarge { len: u64, max: u64 },
}

/// Reads into `buf` until it is full or the stream ends: the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// A connection's reading end after the handshake: every frame opened and checked (see the
/// module).
pub(crate) struct Opener<R> {
    r: R,
    key: SessionKey,
    direction: Direction,
    next: u64,
}

impl<R: Read> Opener<R> {
    /// Opens what comes `direction` on `r` under `key`, from frame 0.
    pub(crate) fn new(r: R, key: SessionKey, direction: Direction) -> Opener<R> {
        Opener {
            r,
            key,
            direction,
            next: 0,
        }
    }

    /// The next frame, its payload at most `max` bytes; `alive` is called after its header
    /// and after every piece of its payload, each one proof that the peer is alive (the
    /// header's once it is found authentic).
    pub(crate) fn next_frame(
        &mut self,
        max: u64,
        alive: &dyn Fn(),
    ) -> Result<(Header, Vec<u8>), FrameError> {
        let mut sealed_head = [0u8; HEADER_BYTES + TAG_BYTES];
        let got = read_full(&mut self.r, &mut sealed_head).map_err(FrameError::Closed)?;
        if got == 0 {
            return Err(FrameError::Closed(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "end of stream",
            )));
        }
        let whole = (HEADER_BYTES + TAG_BYTES) as u64;
        if got < sealed_head.len() {
            return Err(FrameError::Truncated {
                got: got as u64,
                of: whole,
            });
        }
        let (raw, tag) = sealed_head.split_at(HEADER_BYTES);
        let raw: &[u8; HEADER_BYTES] = raw.try_into().expect("the header's bytes");
        let seq = self.next;
        let forged = |what| FrameError::Forged { seq, what };
        let (head_mac, mut mac) = frame_macs(&self.key, self.direction, raw);
        if !matches(&head_mac, tag.try_into().expect("a MAC's bytes")) {
            return Err(forged("its header's MAC does not match"));
        }
        let head = Header::decode(raw).map_err(|_| forged("an authentic header it cannot read"))?;
        if head.seq != self.next {
            return Err(FrameError::OutOfSequence {
                got: head.seq,
                expected: self.next,
            });
        }
        if head.len > max {
            return Err(FrameError::TooLarge { len: head.len, max });
        }
        alive();
        let of = whole + head.len + TAG_BYTES as u64;
        let len = usize::try_from(head.len).map_err(|_| FrameError::TooLarge {
            len: head.len,
            max: usize::MAX as u64,
        })?;
        let mut payload = vec![0u8; len];
        let mut at = whole;
        for piece in payload.chunks_mut(READ_PIECE) {
            let got = read_full(&mut self.r, piece).map_err(FrameError::Closed)?;
            at += got as u64;
            if got < piece.len() {
                return Err(FrameError::Truncated { got: at, of });
            }
            mac.update(piece);
            alive();
        }
        let mut tag = [0u8; TAG_BYTES];
        let got = read_full(&mut self.r, &mut tag).map_err(FrameError::Closed)?;
        if got < TAG_BYTES {
            return Err(FrameError::Truncated {
                got: at + got as u64,
                of,
            });
        }
        if !matches(&mac, &tag) {
            return Err(forged("its payload's MAC does not match"));
        }
        self.next += 1;
        Ok((head, payload))
    }
}

/// A control message's payload, decoded.
pub(crate) fn decode<T: DeserializeOwned>(payload: &[u8]) -> io::Result<T> {
    serde_json::from_slice(payload)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("bad message: {e}")))
}

/// The rendezvous protocol's version: hosts of another version are refused.
pub(crate) const VERSION: u32 = 2;

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
    use crate::auth::Token;

    #[test]
    fn handshake_frames_round_trip_and_foreign_bytes_are_refused() {
        let mut buf = Vec::new();
        write_json(&mut buf, Kind::Hello, 3, 1, &Refused { reason: "x".into() }).unwrap();
        let mut r = &buf[..];
        let h = read_header(&mut r).unwrap();
        assert_eq!((h.kind, h.from, h.to, h.channel), (Kind::Hello, 3, 1, 0));
        let p = read_payload(&mut r, h.len, 100).unwrap();
        assert_eq!(decode::<Refused>(&p).unwrap().reason, "x");
        assert!(read_payload(&mut &buf[..], 101, 100).is_err());
        let mut http = &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n012345678901234"[..];
        assert!(read_header(&mut http).is_err());
        assert_eq!(unhex(&hex(&[0, 15, 255])).unwrap(), [0, 15, 255]);
        assert!(unhex("abc").is_none() && unhex("zz").is_none());
    }

    fn key(nonce: u8) -> SessionKey {
        Token::new("0123456789abcdef")
            .unwrap()
            .session_key(&[nonce; 32], &[9; 32], 1)
    }

    /// Frames 0, 1, 2 sealed under `key(1)` going to host 0: a heartbeat, a large data frame
    /// in two parts, an empty one; and where each ends.
    fn sealed() -> (Vec<u8>, Vec<usize>) {
        let mut s = Sealer::new(Vec::new(), key(1), Direction::ToHostZero);
        let big: Vec<u8> = (0..3 * READ_PIECE + 5).map(|i| i as u8).collect();
        let mut ends = Vec::new();
        s.send(Kind::Heartbeat, 1, 0, 0, &[b"{}"]).unwrap();
        ends.push(s.get_ref().len());
        s.send(Kind::Data, 1, 2, 7, &[&big[..10], &big[10..]])
            .unwrap();
        ends.push(s.get_ref().len());
        s.send(Kind::Data, 1, 0, 3, &[]).unwrap();
        ends.push(s.get_ref().len());
        (s.get_ref().clone(), ends)
    }

    fn opener(bytes: &[u8]) -> Opener<&[u8]> {
        Opener::new(bytes, key(1), Direction::ToHostZero)
    }

    #[test]
    fn sealed_frames_round_trip_in_order() {
        let (bytes, _) = sealed();
        let mut o = opener(&bytes);
        let seen = std::cell::Cell::new(0);
        let alive = || seen.set(seen.get() + 1);
        let (h, p) = o.next_frame(DATA_MAX, &alive).unwrap();
        assert_eq!((h.kind, h.seq, &p[..]), (Kind::Heartbeat, 0, &b"{}"[..]));
        let (h, p) = o.next_frame(DATA_MAX, &alive).unwrap();
        assert_eq!(
            (h.kind, h.from, h.to, h.channel, h.seq),
            (Kind::Data, 1, 2, 7, 1)
        );
        assert!(p.len() == 3 * READ_PIECE + 5 && p.iter().enumerate().all(|(i, &b)| b == i as u8));
        let (h, p) = o.next_frame(DATA_MAX, &alive).unwrap();
        assert_eq!((h.seq, p.len()), (2, 0));
        // After each header and each piece of a payload.
        assert_eq!(seen.get(), (1 + 1) + (1 + 4) + 1);
        assert!(matches!(
            o.next_frame(DATA_MAX, &|| {}),
            Err(FrameError::Closed(_))
        ));
    }

    /// The frames' errors, one reader for each of `streams`.
    fn errors(streams: impl IntoIterator<Item = Vec<u8>>) -> Vec<FrameError> {
        streams
            .into_iter()
            .map(|bytes| {
                let mut o = opener(&bytes);
                loop {
                    if let Err(e) = o.next_frame(DATA_MAX, &|| {}) {
                        break e;
                    }
                }
            })
            .collect()
    }

    #[test]
    fn a_tampered_byte_anywhere_in_a_frame_is_refused() {
        let (bytes, ends) = sealed();
        // Every byte of the first frame, and a sample of the large one's (header, MACs, the
        // payload's pieces, its last byte).
        let large = ends[0]..ends[1];
        let mut at: Vec<usize> = (0..ends[0]).collect();
        at.extend(large.clone().step_by(READ_PIECE / 3));
        at.extend([
            large.start + 20,
            large.start + 30,
            large.end - 33,
            large.end - 1,
        ]);
        for e in errors(at.iter().map(|&i| {
            let mut b = bytes.clone();
            b[i] ^= 0x20;
            b
        })) {
            // A flipped length may instead cut the stream short: refused either way.
            assert!(
                matches!(e, FrameError::Forged { .. } | FrameError::Truncated { .. }),
                "{e}"
            );
        }
        let mut b = bytes.clone();
        b[ends[0] + 100] ^= 1;
        let e = errors([b]).remove(0).to_string();
        assert!(
            e.starts_with("frame 1 on its connection fails authentication (its payload's MAC")
                && e.contains(
                    "tampered with, injected, or sealed under another connection's session key"
                ),
            "{e}"
        );
    }

    #[test]
    fn replayed_reordered_reflected_or_foreign_frames_are_refused() {
        let (bytes, ends) = sealed();
        let first = &bytes[..ends[0]];
        let second = &bytes[ends[0]..ends[1]];
        let replayed = [first, first].concat();
        let reordered = [second, first].concat();
        let e = errors([replayed, reordered]);
        assert_eq!(
            e[0].to_string(),
            "frame 0 of its connection arrived where frame 1 was due: replayed or reordered"
        );
        assert!(matches!(
            e[1],
            FrameError::OutOfSequence {
                got: 1,
                expected: 0
            }
        ));
        // Reflected: what host 1 sent, played back to host 1 as if from host 0.
        let mut back = Opener::new(first, key(1), Direction::FromHostZero);
        assert!(matches!(
            back.next_frame(DATA_MAX, &|| {}),
            Err(FrameError::Forged { seq: 0, .. })
        ));
        // Sealed under another connection's session key (the same token, other nonces).
        let mut other = Sealer::new(Vec::new(), key(2), Direction::ToHostZero);
        other.send(Kind::Heartbeat, 1, 0, 0, &[b"{}"]).unwrap();
        let e = errors([[first, other.get_ref()].concat()])
            .remove(0)
            .to_string();
        assert!(
            e.starts_with("frame 1 on its connection fails authentication (its header's MAC"),
            "{e}"
        );
    }

    #[test]
    fn a_frame_cut_short_anywhere_is_refused_as_truncated_and_a_large_one_by_size() {
        let (bytes, ends) = sealed();
        let cuts = (1..ends[0]).chain([ends[0] + 1, ends[0] + 80, ends[1] - 1]);
        for (cut, e) in cuts.clone().zip(errors(cuts.map(|c| bytes[..c].to_vec()))) {
            assert!(
                matches!(e, FrameError::Truncated { .. }),
                "cut at {cut}: {e}"
            );
        }
        let e = errors([bytes[..ends[1] - 1].to_vec()])
            .remove(0)
            .to_string();
        assert!(
            e.contains(&format!(
                "after {} of its {} bytes",
                ends[1] - ends[0] - 1,
                ends[1] - ends[0]
            )),
            "{e}"
        );
        let mut o = opener(&bytes[ends[0]..]);
        o.next = 1;
        assert!(matches!(
            o.next_frame(1000, &|| {}),
            Err(FrameError::TooLarge { max: 1000, .. })
        ));
    }
}
