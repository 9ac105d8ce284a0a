//! The job token: a secret every host of a job gets from its environment
//! (`LEGEND_JOB_TOKEN`), proven with HMAC-SHA-256 over fresh nonces both ways, never sent; and
//! the session key each control connection derives from it and both nonces, under which every
//! frame after the handshake is authenticated (see `wire`).

use std::io::Read;

use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::ClusterError;

/// The variable holding the job token.
pub const TOKEN_VAR: &str = "LEGEND_JOB_TOKEN";
/// The shortest token accepted (bytes).
pub const TOKEN_MIN: usize = 16;

type HmacSha256 = hmac::Hmac<Sha256>;

/// A job's shared secret.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// The token in `value` (at least [`TOKEN_MIN`] bytes).
    pub fn new(value: &str) -> Result<Token, ClusterError> {
        if value.len() < TOKEN_MIN {
            return Err(ClusterError::Token(format!(
                "{TOKEN_VAR} holds {} bytes; a job token needs at least {TOKEN_MIN} (e.g. export {TOKEN_VAR}=$(openssl rand -hex 16) before srun or torchrun, so that every host gets the same)",
                value.len()
            )));
        }
        Ok(Token(value.as_bytes().to_vec()))
    }

    /// The token of `LEGEND_JOB_TOKEN` in `env`.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Token, ClusterError> {
        let value = env(TOKEN_VAR).ok_or_else(|| {
            ClusterError::Token(format!(
                "a job of several hosts needs a secret they share in {TOKEN_VAR} (at least {TOKEN_MIN} bytes, e.g. export {TOKEN_VAR}=$(openssl rand -hex 16) before srun or torchrun): the rendezvous admits only hosts that prove they hold it"
            ))
        })?;
        Token::new(&value)
    }

    /// HMAC-SHA-256 of `parts` (each length-prefixed, so that no two lists collide).
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> Vec<u8> {
        self.keyed(parts).finalize().into_bytes().to_vec()
    }

    /// Whether `tag` is the HMAC of `parts` (compared in constant time).
    pub(crate) fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.keyed(parts).verify_slice(tag).is_ok()
    }

    fn keyed(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC takes keys of any length");
        for p in parts {
            mac.update(&(p.len() as u64).to_le_bytes());
            mac.update(p);
        }
        mac
    }
}

/// HKDF-SHA-256 (RFC 5869) of `ikm` with `salt` and `info`, its first 32 bytes (one block
/// of the expansion: all a session key needs).
fn hkdf_sha256(salt: &[u8], ikm: &[u8], info: &[u8]) -> [u8; 32] {
    let mut extract =
        <HmacSha256 as KeyInit>::new_from_slice(salt).expect("HMAC takes keys of any length");
    extract.update(ikm);
    let prk = extract.finalize().into_bytes();
    let mut expand =
        <HmacSha256 as KeyInit>::new_from_slice(&prk).expect("HMAC takes keys of any length");
    expand.update(info);
    expand.update(&[1]);
    expand.finalize().into_bytes().into()
}

/// The key that authenticates one control connection's frames once its handshake is over
/// (BLAKE3 in keyed mode: a MAC several times faster than HMAC-SHA-256 on the large frames
/// of partitions, see `examples/frame_cost.rs`). Derived from the token and both ends' fresh
/// nonces, it differs for every connection and every job, so that a frame recorded on one
/// connection is refused on any other.
#[derive(Clone)]
pub(crate) struct SessionKey([u8; 32]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// A MAC keyed with the session key, to feed a frame's bytes.
    pub(crate) fn mac(&self) -> blake3::Hasher {
        blake3::Hasher::new_keyed(&self.0)
    }
}

impl Token {
    /// The session key of host `rank`'s connection to host 0, whose handshake drew
    /// `challenge` (host 0's nonce) and `client_nonce` (the host's): HKDF-SHA-256 with the
    /// nonces as salt, the token as input key material and the connection's place as info.
    pub(crate) fn session_key(
        &self,
        challenge: &[u8],
        client_nonce: &[u8],
        rank: u32,
    ) -> SessionKey {
        let salt = [challenge, client_nonce].concat();
        let info = [
            &b"legend control connection, host 0 and host "[..],
            &rank.to_le_bytes(),
        ]
        .concat();
        SessionKey(hkdf_sha256(&salt, &self.0, &info))
    }
}

/// 32 bytes from the kernel's random source.
pub(crate) fn nonce() -> Result<[u8; 32], ClusterError> {
    let mut n = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|source| ClusterError::Io {
            what: "reading /dev/urandom for a nonce".into(),
            source,
        })?;
    Ok(n)
}

/// SHA-256 of this process's executable, hex: hosts running different binaries are refused.
pub fn binary_identity() -> Result<String, ClusterError> {
    let path = std::env::current_exe().map_err(|source| ClusterError::Io {
        what: "finding this program's executable".into(),
        source,
    })?;
    let mut file = std::fs::File::open(&path).map_err(|source| ClusterError::Io {
        what: format!("reading {}", path.display()),
        source,
    })?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|source| ClusterError::Io {
            what: format!("reading {}", path.display()),
            source,
        })?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
    }
    Ok(crate::wire::hex(&hash.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_proofs_bind_every_part() {
        assert!(Token::new("short").is_err());
        let e = Token::from_env(&|_| None).unwrap_err().to_string();
        assert!(e.contains(TOKEN_VAR), "{e}");
        let t = Token::new("0123456789abcdef").unwrap();
        let tag = t.mac(&[b"a", b"bc"]);
        assert!(t.verify(&[b"a", b"bc"], &tag));
        assert!(!t.verify(&[b"ab", b"c"], &tag), "parts are length-prefixed");
        let other = Token::new("0123456789abcdeX").unwrap();
        assert!(!other.verify(&[b"a", b"bc"], &tag));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
        assert_eq!(format!("{t:?}"), "Token(..)");
    }

    #[test]
    fn hkdf_is_rfc_5869_and_session_keys_differ_by_nonce_rank_and_token() {
        // RFC 5869, test case 1: the first 32 bytes of its OKM.
        let okm = hkdf_sha256(
            &(0u8..=0x0c).collect::<Vec<_>>(),
            &[0x0b; 22],
            &(0xf0u8..=0xf9).collect::<Vec<_>>(),
        );
        assert_eq!(
            crate::wire::hex(&okm),
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
        );
        let t = Token::new("0123456789abcdef").unwrap();
        let tag = |k: SessionKey| k.mac().finalize();
        let base = tag(t.session_key(&[1; 32], &[2; 32], 1));
        assert_eq!(base, tag(t.session_key(&[1; 32], &[2; 32], 1)));
        assert_ne!(base, tag(t.session_key(&[3; 32], &[2; 32], 1)));
        assert_ne!(base, tag(t.session_key(&[1; 32], &[3; 32], 1)));
        assert_ne!(base, tag(t.session_key(&[1; 32], &[2; 32], 2)));
        let other = Token::new("0123456789abcdeX").unwrap();
        assert_ne!(base, tag(other.session_key(&[1; 32], &[2; 32], 1)));
        assert_eq!(
            format!("{:?}", t.session_key(&[1; 32], &[2; 32], 1)),
            "SessionKey(..)"
        );
    }
}
