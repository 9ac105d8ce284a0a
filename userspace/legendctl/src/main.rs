//! `legendctl`: the Legend command-line tool.
fn main() {}
