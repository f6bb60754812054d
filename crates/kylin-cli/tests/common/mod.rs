//! Helpers shared by the binary's integration tests.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs the `kylin` binary with `args` (warnings off, no stdin) and returns what it did.
pub fn kylin(args: &[&str]) -> Output {
    kylin_with_env(args, &[])
}

/// Runs the `kylin` binary as [`kylin`] does, with the environment variables `vars` set too.
pub fn kylin_with_env(args: &[&str], vars: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kylin"))
        .args(args)
        .env("KYLIN_QUIET", "1")
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run kylin")
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}
