//! The error of a name that is none of a configuration enum's: the one type every `FromStr` of
//! a decoder, loss, regulariser, format and the like returns, across the crates.

use std::fmt;

/// A name that is none of the known ones of its kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownName {
    /// The kind of name (`decoder`, `dtype`, `split`, ...).
    pub what: &'static str,
    /// The name given.
    pub given: String,
    /// What would have been understood (`expected dot, distmult or ...`).
    pub expected: &'static str,
}

impl UnknownName {
    /// `given`, which is no `what`; `expected` says what is.
    pub fn new(what: &'static str, given: &str, expected: &'static str) -> UnknownName {
        UnknownName {
            what,
            given: given.to_owned(),
            expected,
        }
    }
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?}: {}",
            self.what, self.given, self.expected
        )
    }
}

impl std::error::Error for UnknownName {}

/// For callers that still report errors as text (legendd's request checks).
impl From<UnknownName> for String {
    fn from(e: UnknownName) -> String {
        e.to_string()
    }
}
