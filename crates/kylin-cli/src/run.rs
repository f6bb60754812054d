//! `kylin run`: one generation from a prompt, a messages file or token ids.

use std::io::Write;
use std::path::Path;

use anyhow::Result;
use kylin_engine::generate::{GenerateRequest, GenerationResult, generate};
use kylin_engine::sampler::SamplingParams;
use kylin_engine::{Backend, ChatMessage};
use kylin_loader::{GenerationDefaults, KylinError};
use serde_json::{Map, Value};

use crate::args::{RunArgs, SamplingArgs, TemplateArgs};
use crate::open::open;

/// Generated tokens when neither `--max-tokens` nor generation_config.json says.
pub const DEFAULT_MAX_TOKENS: usize = 256;

pub fn run(args: RunArgs) -> Result<()> {
    if !args.image.is_empty() {
        return crate::run_images::run(&args);
    }
    let needs_text = args.ids.is_none();
    let mut opened = open(&args.model, needs_text)?;
    let backend = opened.backend.as_mut();
    let defaults = backend.generation_defaults();

    // 1. The prompt, as ids.
    let prompt_ids = if let Some(ids) = &args.ids {
        parse_ids(ids, backend.vocab_size())?
    } else if let Some(path) = &args.messages {
        let messages = read_messages(path)?;
        let kwargs = template_kwargs(&args.template)?;
        let text = backend.apply_chat_template(&messages, true, &kwargs)?;
        backend.tokenize(&text, false)?
    } else if let Some(prompt) = &args.prompt {
        backend.tokenize(prompt, true)?
    } else {
        return Err(KylinError::input_invalid("give a prompt with -p TEXT, --messages FILE or --ids 1,2,3").into());
    };
    if prompt_ids.is_empty() {
        return Err(KylinError::input_invalid("the prompt has no tokens").into());
    }

    // 2. Sampling and limits: flags over generation_config.json over built-in defaults.
    let request = GenerateRequest {
        prompt_ids,
        max_new_tokens: max_tokens(args.max_tokens, &defaults),
        sampling: resolve_sampling(&args.sampling, &defaults),
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
    };

    // 3. Generate, streaming unless the caller wants one JSON object.
    let stdout = std::io::stdout();
    let result = if args.json {
        generate(backend, &request, &mut |_| {})?
    } else {
        let mut out = stdout.lock();
        let result = generate(backend, &request, &mut |piece| {
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        })?;
        let _ = writeln!(out);
        result
    };
    if args.json {
        println!("{}", result_json(&result, backend));
    } else {
        eprintln!("{}", summary_line(&result));
    }
    Ok(())
}

/// `--max-tokens`, else generation_config's `max_new_tokens`, else [`DEFAULT_MAX_TOKENS`].
pub fn max_tokens(flag: Option<usize>, defaults: &GenerationDefaults) -> usize {
    flag.or(defaults.max_new_tokens).unwrap_or(DEFAULT_MAX_TOKENS)
}

/// The sampler's parameters: generation_config.json defaults, each overridden by its flag.
pub fn resolve_sampling(flags: &SamplingArgs, defaults: &GenerationDefaults) -> SamplingParams {
    let mut params = SamplingParams::from_defaults(defaults);
    if let Some(t) = flags.temperature {
        params.temperature = t;
    }
    if let Some(k) = flags.top_k {
        params.top_k = k;
    }
    if let Some(p) = flags.top_p {
        params.top_p = p;
    }
    if let Some(p) = flags.min_p {
        params.min_p = p;
    }
    if let Some(r) = flags.repetition_penalty {
        params.repetition_penalty = r;
    }
    if let Some(s) = flags.seed {
        params.seed = s;
    }
    params
}

/// Template variables from `--chat-template-kwargs` and `--no-think`.
pub fn template_kwargs(args: &TemplateArgs) -> Result<Map<String, Value>> {
    let mut kwargs = match &args.chat_template_kwargs {
        None => Map::new(),
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => map,
            Ok(other) => {
                return Err(KylinError::input_invalid(format!(
                    "--chat-template-kwargs must be a JSON object, got {other}"
                ))
                .into());
            }
            Err(e) => {
                return Err(KylinError::input_invalid(format!("--chat-template-kwargs is not valid JSON: {e}")).into());
            }
        },
    };
    if args.no_think {
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
    }
    Ok(kwargs)
}

/// Parses `1,2,3`, checking every id against the vocabulary.
pub fn parse_ids(text: &str, vocab_size: usize) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (i, part) in text.split(',').map(str::trim).filter(|p| !p.is_empty()).enumerate() {
        let id: u32 = part
            .parse()
            .map_err(|_| KylinError::input_invalid(format!("--ids: item {} ({part:?}) is not a token id", i + 1)))?;
        if id as usize >= vocab_size {
            return Err(KylinError::input_invalid(format!(
                "--ids: token id {id} is outside the vocabulary (vocab_size {vocab_size})"
            ))
            .into());
        }
        ids.push(id);
    }
    Ok(ids)
}

/// Reads an OpenAI-style messages file: `[{"role", "content"}, ...]` or `{"messages": [...]}`.
pub fn read_messages(path: &Path) -> Result<Vec<ChatMessage>> {
    let text = std::fs::read_to_string(path).map_err(|e| KylinError::io(path, "cannot read the messages file", &e))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| {
        KylinError::input_invalid(format!("messages file {} is not valid JSON: {e}", path.display())).at(path)
    })?;
    let list = match value {
        Value::Object(mut obj) => obj.remove("messages").unwrap_or(Value::Null),
        other => other,
    };
    let messages: Vec<ChatMessage> = serde_json::from_value(list).map_err(|e| {
        KylinError::input_invalid(format!(
            "messages file {}: expected a list of {{\"role\": ..., \"content\": ...}} objects ({e})",
            path.display()
        ))
        .at(path)
    })?;
    if messages.is_empty() {
        return Err(KylinError::input_invalid(format!("messages file {} has no messages", path.display())).into());
    }
    Ok(messages)
}

/// The one-line summary on stderr.
pub fn summary_line(result: &GenerationResult) -> String {
    let t = &result.timings;
    let cached = if t.cached_prompt_tokens > 0 {
        format!(" ({} from the cache)", t.cached_prompt_tokens)
    } else {
        String::new()
    };
    format!(
        "[{} prompt tokens{cached}, {} generated, finish: {}] time to first token {:.0} ms, prefill {:.1} tok/s, decode {:.1} tok/s",
        t.prompt_tokens,
        t.generated_tokens,
        result.finish_reason.as_str(),
        t.ttft_ms,
        t.prefill_tok_s,
        t.decode_tok_s
    )
}

fn result_json(result: &GenerationResult, backend: &dyn Backend) -> Value {
    let summary = backend.summary();
    serde_json::json!({
        "backend": summary.backend,
        "precision": summary.precision,
        "kernels": summary.kernels,
        "prompt_ids": result.prompt_ids,
        "generated_ids": result.generated_ids,
        "text": result.text,
        "finish_reason": result.finish_reason.as_str(),
        "timings": result.timings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_parsed_and_checked() {
        assert_eq!(parse_ids("9707, 11,1879", 151936).unwrap(), vec![9707, 11, 1879]);
        let err = parse_ids("1,x", 10).unwrap_err();
        assert!(err.to_string().contains("item 2"), "{err}");
        let err = parse_ids("10", 10).unwrap_err();
        assert_eq!(err.downcast_ref::<KylinError>().unwrap().code, kylin_loader::ErrorCode::InputInvalid);
    }

    #[test]
    fn no_think_sets_enable_thinking_false() {
        let args = TemplateArgs { chat_template_kwargs: Some(r#"{"x": 1}"#.into()), no_think: true };
        let kw = template_kwargs(&args).unwrap();
        assert_eq!(kw["enable_thinking"], Value::Bool(false));
        assert_eq!(kw["x"], Value::from(1));
        let bad = TemplateArgs { chat_template_kwargs: Some("[1]".into()), no_think: false };
        assert!(template_kwargs(&bad).is_err());
    }
}
