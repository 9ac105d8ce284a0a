//! The job token: a secret every host of a job gets from its environment
//! (`LEGEND_JOB_TOKEN`), proven with HMAC-SHA-256 over fresh nonces both ways, never sent.

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
}
