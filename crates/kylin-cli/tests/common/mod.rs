//! Helpers shared by the binary's integration tests.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs the `kylin` binary with `args` (warnings off, no stdin) and returns what it did.
pub fn kylin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kylin"))
        .args(args)
        .env("KYLIN_QUIET", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run kylin")
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}
