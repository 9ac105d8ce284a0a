//! An error with its sources on one line, as the CLI and the daemon print errors.

/// `e` and its sources, each after a `: ` (what the errors' own messages leave to their
/// sources: the OS's words for a failed `open`).
pub fn with_sources(e: &dyn std::error::Error) -> String {
    use std::fmt::Write as _;
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(c) = source {
        let _ = write!(s, ": {c}");
        source = c.source();
    }
    s
}
