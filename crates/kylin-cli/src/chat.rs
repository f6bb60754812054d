//! `kylin chat`: an interactive conversation through the model's chat template.
//!
//! Each line read from standard input is a user message; the reply streams to standard output.
//! The history is kept (and the KV cache reused for the part of the prompt that did not change);
//! `/reset` forgets it, `/exit` or end of input ends the session. Prompts and summaries go to
//! standard error, so standard output holds only the model's text.

use std::io::{BufRead, Write};

use anyhow::Result;
use kylin_engine::{ChatSession, GenerateRequest};
use kylin_loader::KylinError;

use crate::args::ChatArgs;
use crate::open::open;
use crate::run::{max_tokens, resolve_sampling, summary_line, template_kwargs};

pub fn run(args: ChatArgs) -> Result<()> {
    let mut opened = open(&args.model, true)?;
    let backend = opened.backend.as_mut();
    let defaults = backend.generation_defaults();
    let kwargs = template_kwargs(&args.template)?;
    // Fail now, not after the first message, when the model has no usable template.
    backend.apply_chat_template(
        &[kylin_engine::ChatMessage { role: "user".into(), content: "hi".into() }],
        true,
        &kwargs,
    )?;
    let request = GenerateRequest {
        prompt_ids: Vec::new(),
        max_new_tokens: max_tokens(args.max_tokens, &defaults),
        sampling: resolve_sampling(&args.sampling, &defaults),
        stop: Vec::new(),
        ignore_eos: false,
    };
    request.sampling.validate()?;
    let mut session = ChatSession::new(args.system.clone(), kwargs);
    eprintln!(
        "kylin chat ({}, {} context tokens): type a message; /reset clears the history, /exit or Ctrl-D ends",
        backend.summary().architecture,
        backend.context_size()
    );

    let stdin = std::io::stdin();
    let mut lines = stdin.lock();
    let mut line = String::new();
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        line.clear();
        let read = lines
            .read_line(&mut line)
            .map_err(|e| KylinError::input_invalid(format!("cannot read standard input: {e}")))?;
        if read == 0 {
            eprintln!();
            break;
        }
        let message = line.trim_end_matches(['\n', '\r']);
        match message.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                session.clear();
                eprintln!("(history cleared)");
                continue;
            }
            _ => {}
        }
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let result = session.send(backend, message, &request, &mut |piece| {
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        });
        let _ = writeln!(out);
        drop(out);
        match result {
            Ok(r) => eprintln!("{}", summary_line(&r)),
            // A turn that fails (e.g. the context is full) is reported; the session goes on.
            Err(e) => eprintln!("{e}"),
        }
    }
    Ok(())
}
