//! What the three chat APIs (Chat Completions, Responses, Anthropic Messages) share: turning
//! messages, tools and an output format into a prompt and a grammar, and the model's text back
//! into content and tool calls.
//!
//! Guarantees:
//! * Tools reach the model through its own chat template when the template renders them, and
//!   otherwise through a system message in the Hermes syntax; either way the output is parsed
//!   with the syntax the model was shown.
//! * With `tool_choice` `required` or a named tool, or with a JSON schema / JSON object format,
//!   the output is grammar-constrained, so calls always parse and their arguments, like
//!   structured outputs, validate against their schemas. A grammar that cannot be compiled is
//!   a 400 naming the request field it came from.
//! * Grammars compile on a blocking thread, never on the engine's thread or an async worker.

use std::sync::Arc;

use kylin_engine::grammar::{Grammar, GrammarCompiler, GrammarSpec};
use kylin_engine::tools::{
    ParsedResponse, ToolCallParser, ToolChoice, ToolEvent, ToolParsing, ToolSpec, ToolSyntax, fallback_system_prompt,
};
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::engine::{Prompt, Published, TextJob, TextReply};
use crate::error::ApiError;

/// A chat request, whatever API it came through.
#[derive(Debug, Clone)]
pub struct ChatPlan {
    /// Normalized OpenAI-style messages (`api::message`).
    pub messages: Vec<Value>,
    pub tools: Vec<ToolSpec>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    /// A structured-output format and the request field it came from.
    pub format: Option<(GrammarSpec, String)>,
    pub kwargs: Map<String, Value>,
    pub add_generation_prompt: bool,
    /// The request field holding the tools (for errors).
    pub tools_param: &'static str,
}

/// What the engine runs for a chat request, and how to read its output.
pub struct Prepared {
    pub prompt: Prompt,
    /// The prompt's images, prepared, in the order of their placeholders.
    pub images: Vec<kylin_engine::serving::ImageInput>,
    pub grammar: Option<Grammar>,
    pub skip_special_tokens: bool,
    /// Parse the output for tool calls in this syntax, typed by the offered tools (`None`: no
    /// tools offered).
    pub syntax: Option<ToolParsing>,
}

/// The grammar compiler (built by the engine on first use, then kept).
pub async fn compiler(state: &AppState) -> Result<Arc<GrammarCompiler>, ApiError> {
    if let Some(c) = state.0.grammar.get() {
        return Ok(c.clone());
    }
    match state.engine().text(TextJob::GrammarCompiler).await {
        Ok(TextReply::Compiler(c)) => Ok(state.0.grammar.get_or_init(|| c).clone()),
        Ok(_) => Err(ApiError::internal("the engine answered a grammar job with something else")),
        Err(e) => Err(ApiError::invalid("response_format", e.message).code("grammar_unavailable")),
    }
}

/// Compiles `spec` off the async runtime; a bad grammar is a 400 naming `param`.
pub async fn compile(state: &AppState, spec: GrammarSpec, param: &str) -> Result<Grammar, ApiError> {
    let compiler = compiler(state).await.map_err(|e| ApiError { param: Some(param.to_string()), ..e })?;
    let compiled = tokio::task::spawn_blocking(move || compiler.compile(&spec)).await;
    match compiled {
        Ok(Ok(g)) => Ok(g),
        Ok(Err(e)) => Err(ApiError::invalid(param, e.message).code("invalid_grammar")),
        Err(_) => Err(ApiError::internal("the grammar compiler stopped")),
    }
}

/// Puts the tools' description at the start of the system message (or adds one), for a
/// template that does not render tools.
fn with_fallback_tools(messages: &mut Vec<Value>, tools: &[ToolSpec]) {
    let prompt = fallback_system_prompt(tools);
    match messages.first_mut() {
        Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => {
            let content = first.get("content").and_then(Value::as_str).unwrap_or("").to_string();
            first["content"] = json!(format!("{content}\n\n{prompt}").trim_start().to_string());
        }
        _ => messages.insert(0, json!({"role": "system", "content": prompt})),
    }
    // Tool calls and results written the Hermes way, which the prompt above describes.
    for m in messages.iter_mut() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("").to_string();
        if role == "assistant"
            && let Some(calls) = m.get("tool_calls").and_then(Value::as_array).cloned()
        {
            let mut text = m.get("content").and_then(Value::as_str).unwrap_or("").to_string();
            for c in calls {
                let call = json!({"name": c.pointer("/function/name"), "arguments": c.pointer("/function/arguments")});
                text.push_str(&format!("\n<tool_call>\n{call}\n</tool_call>"));
            }
            *m = json!({"role": "assistant", "content": text.trim_start()});
        } else if role == "tool" {
            let content = m.get("content").and_then(Value::as_str).unwrap_or("");
            *m = json!({"role": "user", "content": format!("<tool_response>\n{content}\n</tool_response>")});
        }
    }
}

/// Mistral's templates want tool call ids of 9 letters or digits: longer ids keep their last 9.
fn mistral_ids(messages: &mut [Value]) {
    let short = |id: &str| -> String {
        let alnum: String = id.chars().filter(char::is_ascii_alphanumeric).collect();
        let tail = &alnum[alnum.len().saturating_sub(9)..];
        format!("{tail:0>9}")
    };
    for m in messages.iter_mut() {
        if let Some(id) = m.get("tool_call_id").and_then(Value::as_str).map(short) {
            m["tool_call_id"] = json!(id);
        }
        if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for c in calls {
                if let Some(id) = c.get("id").and_then(Value::as_str).map(short) {
                    c["id"] = json!(id);
                }
            }
        }
    }
}

/// Decides the prompt and the grammar of a chat request.
pub async fn prepare(state: &AppState, published: &Published, plan: ChatPlan) -> Result<Prepared, ApiError> {
    let ChatPlan {
        mut messages,
        tools,
        tool_choice,
        parallel_tool_calls,
        format,
        mut kwargs,
        add_generation_prompt,
        tools_param,
    } = plan;
    let tools_on = !tools.is_empty() && tool_choice != ToolChoice::None;
    let syntax = published.tool_syntax.unwrap_or(ToolSyntax::Hermes);
    if tools_on {
        match published.tool_syntax {
            Some(_) if !kwargs.contains_key("tools") => {
                kwargs.insert("tools".into(), Value::Array(tools.iter().map(ToolSpec::to_openai).collect()));
            }
            Some(_) => {}
            None => with_fallback_tools(&mut messages, &tools),
        }
    }
    if published.tool_syntax == Some(ToolSyntax::Mistral) {
        mistral_ids(&mut messages);
    }
    let mut skip_special_tokens = true;
    let mut grammar = None;
    if tools_on {
        let compiler = compiler(state).await.map_err(|e| ApiError { param: Some(tools_param.to_string()), ..e });
        // Without a compiler (a backend that cannot mask logits), `auto` still works unconstrained.
        let special = |m: &str| compiler.as_ref().ok().and_then(|c| c.special_token(m));
        skip_special_tokens = !syntax.markers().iter().any(|m| special(m).is_some());
        if let Some(lark) = syntax.grammar(&tools, &tool_choice, parallel_tool_calls, &special) {
            match compiler {
                Ok(_) => grammar = Some(compile(state, GrammarSpec::Lark(lark), tools_param).await?),
                Err(e) if tool_choice != ToolChoice::Auto => return Err(e),
                Err(_) => {}
            }
        }
    }
    if grammar.is_none()
        && let Some((spec, param)) = format
        && !(tools_on && tool_choice != ToolChoice::Auto)
    {
        grammar = Some(compile(state, spec, &param).await?);
    }
    Ok(Prepared {
        images: Vec::new(),
        prompt: Prompt::Chat { messages, kwargs, add_generation_prompt },
        grammar,
        skip_special_tokens,
        syntax: tools_on.then(|| ToolParsing { syntax, tools: tools.into() }),
    })
}

/// One choice's output as it streams: text, or text and tool calls when tools were offered.
#[derive(Debug, Default)]
pub struct ChoiceOutput {
    parser: Option<Box<dyn ToolCallParser>>,
    pub parsed: ParsedResponse,
}

impl ChoiceOutput {
    pub fn new(syntax: Option<&ToolParsing>) -> Self {
        ChoiceOutput { parser: syntax.map(ToolParsing::parser), parsed: ParsedResponse::default() }
    }

    /// Feeds generated text; returns what it completed.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        match &mut self.parser {
            Some(p) => p.push(text, &mut events),
            None if !text.is_empty() => events.push(ToolEvent::Text(text.to_string())),
            None => {}
        }
        self.parsed.absorb(&events);
        events
    }

    /// The text ended.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        if let Some(p) = &mut self.parser {
            p.finish(&mut events);
        }
        self.parsed.absorb(&events);
        events
    }

    /// True when the choice called a tool.
    pub fn has_calls(&self) -> bool {
        !self.parsed.calls.is_empty()
    }
}

/// A tool call's id: unique per response and call.
pub fn call_id(response_id: &str, choice: usize, index: usize) -> String {
    let tail: String = response_id.chars().filter(char::is_ascii_alphanumeric).collect();
    let tail = &tail[tail.len().saturating_sub(16)..];
    format!("call_{tail}{choice:x}{index:02x}")
}

/// How one chat generation ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub reason: kylin_engine::StopReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// The choice called at least one tool.
    pub called: bool,
}

/// What a running generation produced next.
#[derive(Debug)]
pub enum Progress {
    /// Text and tool-call pieces, in order.
    Events(Vec<ToolEvent>),
    Done(Ending),
    Failed(String),
}

/// One choice of a chat request running in the engine, read as text and tool calls (the
/// Responses and Anthropic APIs, which have no `n`). Dropping it before the end cancels the
/// request, so the engine frees it at its next step.
pub struct Generation {
    rx: tokio::sync::mpsc::UnboundedReceiver<crate::engine::Out>,
    cancel: kylin_engine::CancelHandle,
    done: bool,
    /// The ending, once the events that came with it were handed out.
    pending_end: Option<Ending>,
    pub prompt_tokens: usize,
    pub output: ChoiceOutput,
    _admission: crate::Admission,
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.done {
            self.cancel.cancel();
        }
    }
}

/// The sampling and limits of a generation.
pub struct Limits {
    pub sampling: kylin_engine::SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
}

/// The request fields an API calls the prompt and the generation limit, which its errors
/// name: the Responses API says `input` and `max_output_tokens` where Anthropic's says
/// `messages` and `max_tokens`.
#[derive(Clone, Copy)]
pub(crate) struct FieldNames {
    pub prompt: &'static str,
    pub max_tokens: &'static str,
}

/// Submits a prepared chat request (one choice); an error is blamed on the field the engine
/// names (`KylinError::field`, in the API's own words from `names`), else on the prompt.
pub(crate) async fn start(
    state: &AppState,
    prepared: Prepared,
    limits: Limits,
    admission: crate::Admission,
    arrived: std::time::Instant,
    names: FieldNames,
) -> Result<Generation, ApiError> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = kylin_engine::CancelHandle::new();
    let submission = crate::engine::Submission {
        prompt: prepared.prompt,
        sampling: limits.sampling,
        max_tokens: limits.max_tokens,
        stop: limits.stop,
        ignore_eos: false,
        speculative_tokens: None,
        n: 1,
        logprobs: None,
        prompt_logprobs: None,
        echo: false,
        echo_text: None,
        logit_bias: Vec::new(),
        grammar: prepared.grammar,
        skip_special_tokens: prepared.skip_special_tokens,
        cancel: cancel.clone(),
        images: prepared.images,
        index_offset: 0,
        events: tx,
        arrived,
    };
    let accepted = state.engine().submit(submission).await.map_err(|mut e| {
        if e.field == Some("max_tokens") {
            e.field = Some(names.max_tokens);
        }
        ApiError::from_engine(&e, names.prompt)
    })?;
    Ok(Generation {
        rx,
        cancel,
        done: false,
        pending_end: None,
        prompt_tokens: accepted.prompt_tokens,
        output: ChoiceOutput::new(prepared.syntax.as_ref()),
        _admission: admission,
    })
}

impl Generation {
    /// The next progress; `None` after [`Progress::Done`] or [`Progress::Failed`].
    pub async fn next(&mut self) -> Option<Progress> {
        if let Some(ending) = self.pending_end.take() {
            return Some(Progress::Done(ending));
        }
        if self.done {
            return None;
        }
        loop {
            match self.rx.recv().await {
                Some(crate::engine::Out::Token { text, .. }) => {
                    let events = self.output.push(&text);
                    if !events.is_empty() {
                        return Some(Progress::Events(events));
                    }
                }
                Some(crate::engine::Out::Finished { reason, text, usage, .. }) => {
                    self.done = true;
                    let mut events = self.output.push(&text);
                    events.extend(self.output.finish());
                    let ending = Ending {
                        reason,
                        prompt_tokens: self.prompt_tokens,
                        cached_tokens: usage.cached_prompt_tokens,
                        completion_tokens: usage.completion_tokens,
                        called: self.output.has_calls(),
                    };
                    if events.is_empty() {
                        return Some(Progress::Done(ending));
                    }
                    // The events first; the ending on the next call.
                    self.pending_end = Some(ending);
                    return Some(Progress::Events(events));
                }
                Some(crate::engine::Out::PromptLogprobs { .. }) => {}
                Some(crate::engine::Out::Failed { message }) => {
                    self.done = true;
                    return Some(Progress::Failed(message));
                }
                None => {
                    self.done = true;
                    return Some(Progress::Failed("the engine stopped before the request finished".into()));
                }
            }
        }
    }

    /// Runs to the end; the whole output and how it ended.
    pub async fn collect(mut self) -> Result<(ParsedResponse, Ending), ApiError> {
        loop {
            match self.next().await {
                Some(Progress::Events(_)) => {}
                Some(Progress::Done(ending)) => return Ok((std::mem::take(&mut self.output.parsed), ending)),
                Some(Progress::Failed(m)) => return Err(ApiError::internal(m)),
                None => return Err(ApiError::internal("the generation ended without an ending")),
            }
        }
    }
}
