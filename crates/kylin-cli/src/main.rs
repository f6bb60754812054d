//! The `kylin` command: a thin layer over the library crates.
//!
//! Arguments are parsed in two stages (as typed by clap, then resolved against the model's own
//! defaults in the command modules). Every failure is printed as `[CODE] message` (or
//! `{"error": {"code", "message"}}` with `--json`) and exits non-zero; nothing here panics on
//! user input.

mod args;
mod bench;
mod bench_concurrent;
mod chat;
mod convert;
mod embed;
mod inspect;
mod logits;
mod open;
mod perplexity;
mod quantize;
mod run;
mod run_images;
mod serve;
mod serve_many;
mod sigbus;

use std::process::ExitCode;

use clap::Parser;
use kylin_loader::KylinError;

use crate::args::{Cli, Command};

fn main() -> ExitCode {
    sigbus::install();
    let cli = Cli::parse();
    let json = cli.command.wants_json();
    let result = match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Run(a) => run::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::BenchWorker(a) => bench::worker(a),
        Command::Serve(a) => serve::run(a),
        Command::Embed(a) => embed::run(a),
        Command::Quantize(a) => quantize::run(&a),
        Command::Convert(a) => convert::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            report_error(&err, json);
            ExitCode::FAILURE
        }
    }
}

/// Prints an error once, in the stable `[CODE] message` form when it carries a code.
fn report_error(err: &anyhow::Error, json: bool) {
    let (code, message) = match err.downcast_ref::<KylinError>() {
        Some(e) => (e.code.as_str().to_string(), e.message.clone()),
        None => ("ERROR".to_string(), format!("{err:#}")),
    };
    if json {
        let obj = serde_json::json!({ "error": { "code": code, "message": message } });
        println!("{obj}");
    } else {
        eprintln!("[{code}] {message}");
    }
}
