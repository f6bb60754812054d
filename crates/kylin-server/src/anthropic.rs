//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): `system`,
//! messages of text, `tool_use` and `tool_result` blocks, `tools`, `tool_choice` (`auto`,
//! `any`, `tool`, `none`, `disable_parallel_tool_use`), `stop_sequences`, `max_tokens`,
//! sampling, and streaming with Anthropic's events (`message_start`, `content_block_start`,
//! `content_block_delta` with `text_delta` / `input_json_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`). Errors are Anthropic-shaped:
//! `{"type": "error", "error": {"type", "message"}}`.
//!
//! The request is turned into the same chat plan as OpenAI's APIs (`tool_use` blocks become
//! assistant tool calls, `tool_result` blocks tool messages), so tools, grammars and parsing
//! are shared. Left out: images and documents, extended thinking, prompt caching controls
//! (`cache_control` is accepted and ignored; the prefix cache works anyway and its hits are
//! reported as `cache_read_input_tokens`).

use std::convert::Infallible;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use kylin_engine::StopReason;
use kylin_engine::tools::{ParsedResponse, ToolChoice, ToolEvent, ToolSpec};
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::api::{Common, Fields};
use crate::chat::{self, ChatPlan, Ending, Generation, Limits, Progress};
use crate::engine::{TextJob, TextReply};
use crate::error::ApiError;
use crate::routes::{check_model, read_body, ready};

/// What this API calls the prompt and the generation limit, for its errors' `param`.
const FIELD_NAMES: chat::FieldNames = chat::FieldNames { prompt: "messages", max_tokens: "max_tokens" };

/// An [`ApiError`] answered in Anthropic's shape.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

/// Anthropic's error `type` for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 408 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

impl AnthropicError {
    pub fn body(&self) -> Value {
        let e = &self.0;
        let message = match &e.param {
            Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
            _ => e.message.clone(),
        };
        json!({"type": "error", "error": {"type": error_type(e.status), "message": message}})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let mut response = (self.0.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.0.retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

/// Text of a `system` value or a `tool_result`'s content: a string or text blocks.
fn blocks_text(value: &Value, at: &str) -> Result<String, ApiError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(t)
                    }
                    _ => {
                        return Err(ApiError::invalid(format!("{at}[{j}]"), "only text blocks are supported here"));
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(at, "must be a string or a list of text blocks")),
    }
}

/// An `image` block's image: `source` of type `base64` (its `data`); a `url` source is refused,
/// as Kylin fetches nothing from the network.
fn image_block(block: &Value, at: &str) -> Result<crate::api::ImagePart, ApiError> {
    let source = block.get("source").unwrap_or(&Value::Null);
    match (source.get("type").and_then(Value::as_str), source.get("data").and_then(Value::as_str)) {
        (Some("base64"), Some(data)) => {
            let media = source.get("media_type").and_then(Value::as_str).unwrap_or("image/png");
            let url = format!("data:{media};base64,{data}");
            Ok(crate::api::ImagePart { source: crate::api::image_ref(&url, at)?, at: at.to_string() })
        }
        (Some("base64"), None) => Err(ApiError::invalid(at, "a base64 image source needs its `data`")),
        (Some("url"), _) => {
            Err(ApiError::invalid(at, "Kylin fetches nothing from the network: send the image as a base64 source")
                .code("unsupported_parameter"))
        }
        _ => Err(ApiError::invalid(at, "an image block needs a `source` of type `base64`")),
    }
}

/// Anthropic messages as chat messages.
fn chat_messages(
    system: Option<Value>,
    raw: Vec<Value>,
    images: &mut Vec<crate::api::ImagePart>,
) -> Result<Vec<Value>, ApiError> {
    let mut messages = Vec::with_capacity(raw.len() + 1);
    if let Some(system) = system {
        let text = blocks_text(&system, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    for (i, m) in raw.into_iter().enumerate() {
        let at = |f: &str| format!("messages.{i}.{f}");
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "user" && role != "assistant" {
            return Err(ApiError::invalid(at("role"), format!("role must be `user` or `assistant`; got `{role}`")));
        }
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            _ => return Err(ApiError::invalid(at("content"), "content must be a string or a list of blocks")),
        };
        let mut text = String::new();
        // With images, the content is parts in order, as chat templates read them.
        let mut parts = Vec::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let at = |f: &str| format!("messages.{i}.content.{j}.{f}");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => {
                    let t = b.get("text").and_then(Value::as_str).unwrap_or("");
                    text.push_str(t);
                    parts.push(json!({"type": "text", "text": t}));
                }
                Some("image") if role == "user" => {
                    images.push(image_block(b, &at("source"))?);
                    parts.push(json!({"type": "image"}));
                }
                Some("tool_use") if role == "assistant" => {
                    let id = b.get("id").and_then(Value::as_str).unwrap_or("");
                    let name = b.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
                    let name =
                        name.ok_or_else(|| ApiError::invalid(at("name"), "a tool_use block needs its `name`"))?;
                    let input = match b.get("input") {
                        Some(v @ Value::Object(_)) => v.clone(),
                        None | Some(Value::Null) => json!({}),
                        Some(_) => return Err(ApiError::invalid(at("input"), "`input` must be an object")),
                    };
                    calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
                }
                Some("tool_result") if role == "user" => {
                    let id = b.get("tool_use_id").and_then(Value::as_str).filter(|n| !n.is_empty());
                    let id = id.ok_or_else(|| {
                        ApiError::invalid(at("tool_use_id"), "a tool_result block needs its `tool_use_id`")
                    })?;
                    let mut content = blocks_text(b.get("content").unwrap_or(&Value::Null), &at("content"))?;
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        content = format!("Error: {content}");
                    }
                    messages.push(json!({"role": "tool", "content": content, "tool_call_id": id}));
                }
                Some("thinking" | "redacted_thinking") => {}
                Some(kind @ ("tool_use" | "tool_result")) => {
                    return Err(ApiError::invalid(
                        at("type"),
                        format!("a `{kind}` block cannot be in a {role} message"),
                    ));
                }
                Some(other) => {
                    return Err(ApiError::invalid(
                        at("type"),
                        format!("content blocks of type `{other}` are not supported"),
                    ));
                }
                None => return Err(ApiError::invalid(at("type"), "a content block needs a `type`")),
            }
        }
        if !text.is_empty()
            || (calls.is_empty() && !blocks.iter().any(|b| b.get("type") == Some(&json!("tool_result"))))
        {
            let content = if parts.iter().any(|p| p["type"] == "image") { Value::Array(parts) } else { json!(text) };
            let mut msg = json!({"role": role, "content": content});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            messages.push(msg);
        } else if !calls.is_empty() {
            messages.push(json!({"role": "assistant", "content": "", "tool_calls": calls}));
        }
    }
    if messages.iter().all(|m| m["role"] == "system") {
        return Err(ApiError::invalid("messages", "`messages` must not be empty"));
    }
    Ok(messages)
}

fn anthropic_tools(raw: Option<Value>) -> Result<Vec<ToolSpec>, ApiError> {
    let Some(Value::Array(list)) = raw.filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
    let as_openai: Vec<Value> = list
        .iter()
        .map(|t| {
            json!({"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema"),
            }})
        })
        .collect();
    crate::api::tools(Some(Value::Array(as_openai)), "tools").map_err(|e| {
        let param = e.param.clone().map(|p| p.replace(".function", "").replace(".parameters", ".input_schema"));
        ApiError { param, ..e }
    })
}

fn anthropic_choice(raw: Option<Value>, tools: &[ToolSpec]) -> Result<(ToolChoice, bool), ApiError> {
    let Some(v) = raw.filter(|v| !v.is_null()) else {
        return Ok((if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto }, true));
    };
    let parallel = v.get("disable_parallel_tool_use").and_then(Value::as_bool) != Some(true);
    let choice = match v.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => json!({"type": "function", "function": {"name": v.get("name")}}),
        other => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                format!("must be auto, any, tool or none; got {other:?}"),
            ));
        }
    };
    Ok((crate::api::tool_choice(Some(choice), tools)?, parallel))
}

struct MessagesRequest {
    common: Common,
    plan: ChatPlan,
    /// The messages' `image` blocks, in order.
    images: Vec<crate::api::ImagePart>,
}

impl MessagesRequest {
    fn parse(body: &[u8], counting: bool) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body)?;
        let model: Option<String> = f.take("model", "a string")?;
        let max_tokens: Option<usize> = f.take("max_tokens", "a positive integer")?;
        if !counting && max_tokens.is_none() {
            return Err(ApiError::invalid("max_tokens", "`max_tokens` is required"));
        }
        if max_tokens == Some(0) {
            return Err(ApiError::invalid("max_tokens", "`max_tokens` must be at least 1"));
        }
        let system: Option<Value> = f.take("system", "a string or a list of text blocks")?;
        let raw: Vec<Value> = f
            .take("messages", "a list of messages")?
            .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        let tools = anthropic_tools(f.take("tools", "a list of tools")?)?;
        let (tool_choice, parallel_tool_calls) = anthropic_choice(f.take("tool_choice", "an object")?, &tools)?;
        let stop: Vec<String> = f.take("stop_sequences", "a list of strings")?.unwrap_or_default();
        if stop.len() > crate::api::MAX_STOP || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop_sequences",
                format!("at most {} non-empty strings", crate::api::MAX_STOP),
            ));
        }
        let temperature: Option<f32> = f.take("temperature", "a number")?;
        let top_p: Option<f32> = f.take("top_p", "a number")?;
        let top_k: Option<i64> = f.take("top_k", "an integer")?;
        let stream = f.take::<bool>("stream", "a boolean")?.unwrap_or(false);
        f.take::<Value>("metadata", "an object")?;
        f.take::<Value>("service_tier", "a string")?;
        f.refuse_unless(
            "thinking",
            |v| v.get("type") == Some(&json!("disabled")),
            "extended thinking is not implemented",
        )?;
        f.finish()?;
        let mut images = Vec::new();
        let messages = chat_messages(system, raw, &mut images)?;
        let common = Common { model, max_tokens, temperature, top_p, top_k, stop, n: 1, stream, ..Common::default() };
        let plan = ChatPlan {
            messages,
            tools,
            tool_choice,
            parallel_tool_calls,
            format: None,
            kwargs: Map::new(),
            add_generation_prompt: true,
            tools_param: "tools",
        };
        Ok(MessagesRequest { common, plan, images })
    }
}

fn stop_reason(ending: &Ending) -> &'static str {
    match ending.reason {
        _ if ending.called => "tool_use",
        StopReason::Length | StopReason::ContextFull => "max_tokens",
        StopReason::StopString => "stop_sequence",
        _ => "end_turn",
    }
}

/// The stop sequence that ended the message, when it can be told (one was given).
fn stop_sequence(ending: &Ending, stops: &[String]) -> Value {
    match (ending.reason, stops) {
        (StopReason::StopString, [one]) => json!(one),
        _ => Value::Null,
    }
}

fn usage(ending: &Ending) -> Value {
    json!({
        "input_tokens": ending.prompt_tokens.saturating_sub(ending.cached_tokens),
        "cache_read_input_tokens": ending.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": ending.completion_tokens,
    })
}

fn tool_use_id(id: &str, index: usize) -> String {
    chat::call_id(id, 0, index).replacen("call_", "toolu_", 1)
}

fn content_blocks(id: &str, parsed: &ParsedResponse) -> Vec<Value> {
    let mut blocks = Vec::new();
    let text = if parsed.calls.is_empty() { parsed.content.as_str() } else { parsed.content.trim() };
    if !text.is_empty() {
        blocks.push(json!({"type": "text", "text": text}));
    }
    for (k, call) in parsed.calls.iter().enumerate() {
        let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
        blocks.push(json!({"type": "tool_use", "id": tool_use_id(id, k), "name": call.name, "input": input}));
    }
    if blocks.is_empty() {
        blocks.push(json!({"type": "text", "text": ""}));
    }
    blocks
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<AppState>, request: Request) -> Result<Response, AnthropicError> {
    let arrived = Instant::now();
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let req = MessagesRequest::parse(&body, false)?;
    check_model(&state, req.common.model.as_deref())?;
    let sampling = req.common.sampling(&published.defaults, state.random_seed())?;
    let admission = state.admit()?;
    let stops = req.common.stop.clone();
    let mut prepared = chat::prepare(&state, &published, req.plan).await?;
    prepared.images = crate::images::prepare(&state, &published, req.images, &Default::default()).await?;
    let limits = Limits { sampling, max_tokens: req.common.max_tokens, stop: req.common.stop };
    let generation = chat::start(&state, prepared, limits, admission, arrived, FIELD_NAMES).await?;
    let id = format!("msg_{}", state.next_response_id());
    let model = state.config().served_model_name.clone();
    if !req.common.stream {
        let (parsed, ending) = generation.collect().await?;
        return Ok(axum::Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content_blocks(&id, &parsed),
            "stop_reason": stop_reason(&ending),
            "stop_sequence": stop_sequence(&ending, &stops),
            "usage": usage(&ending),
        }))
        .into_response());
    }
    let stream = MessageStream {
        generation,
        id,
        model,
        stops,
        pending: Default::default(),
        started: false,
        ended: false,
        open: None,
        blocks: 0,
        input_tokens: 0,
    };
    let events = futures_util::stream::unfold(stream, |mut s| async move {
        s.next().await.map(|(name, data)| (Ok::<_, Infallible>(SseEvent::default().event(name).data(data)), s))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, `{"input_tokens"}`.
pub async fn count_tokens(State(state): State<AppState>, request: Request) -> Result<Response, AnthropicError> {
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let req = MessagesRequest::parse(&body, true)?;
    check_model(&state, req.common.model.as_deref())?;
    let prepared = chat::prepare(&state, &published, ChatPlan { tool_choice: ToolChoice::Auto, ..req.plan }).await?;
    // The images' tokens are counted as the model's processor puts them into the prompt.
    let images = crate::images::prepare(&state, &published, req.images, &Default::default()).await?;
    let job = TextJob::Tokenize { prompt: prepared.prompt, add_special: false, images };
    match state.engine().text(job).await.map_err(|e| ApiError::from_engine(&e, "messages"))? {
        TextReply::Ids(ids) => Ok(axum::Json(json!({"input_tokens": ids.len()})).into_response()),
        _ => Err(ApiError::internal("the engine answered a tokenize job with something else").into()),
    }
}

/// What kind of block is open in a stream.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Open {
    Text(usize),
    /// A tool_use block: (block index, call index).
    Tool(usize, usize),
}

struct MessageStream {
    generation: Generation,
    id: String,
    model: String,
    stops: Vec<String>,
    pending: std::collections::VecDeque<(String, String)>,
    started: bool,
    ended: bool,
    open: Option<Open>,
    blocks: usize,
    input_tokens: usize,
}

impl MessageStream {
    fn push(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        self.pending.push_back((kind.to_string(), data.to_string()));
    }

    fn close(&mut self) {
        if let Some(Open::Text(i) | Open::Tool(i, _)) = self.open.take() {
            self.push("content_block_stop", json!({"index": i}));
        }
    }

    fn absorb(&mut self, events: Vec<ToolEvent>) {
        for e in events {
            match e {
                ToolEvent::Text(t) => {
                    if t.is_empty()
                        || (t.trim().is_empty() && matches!(self.open, Some(Open::Tool(..)) | None) && self.blocks > 0)
                    {
                        continue;
                    }
                    let index = match self.open {
                        Some(Open::Text(i)) => i,
                        _ => {
                            self.close();
                            let i = self.blocks;
                            self.blocks += 1;
                            self.push(
                                "content_block_start",
                                json!({"index": i, "content_block": {"type": "text", "text": ""}}),
                            );
                            self.open = Some(Open::Text(i));
                            i
                        }
                    };
                    self.push(
                        "content_block_delta",
                        json!({"index": index, "delta": {"type": "text_delta", "text": t}}),
                    );
                }
                ToolEvent::Reasoning(_) => {}
                ToolEvent::Start { index, name } => {
                    self.close();
                    let i = self.blocks;
                    self.blocks += 1;
                    let block =
                        json!({"type": "tool_use", "id": tool_use_id(&self.id, index), "name": name, "input": {}});
                    self.push("content_block_start", json!({"index": i, "content_block": block}));
                    self.open = Some(Open::Tool(i, index));
                }
                ToolEvent::Arguments { index, delta } => {
                    if let Some(Open::Tool(i, call)) = self.open
                        && call == index
                    {
                        self.push(
                            "content_block_delta",
                            json!({"index": i, "delta": {"type": "input_json_delta", "partial_json": delta}}),
                        );
                    }
                }
                ToolEvent::End { .. } => self.close(),
            }
        }
    }

    async fn next(&mut self) -> Option<(String, String)> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.ended {
                return None;
            }
            if !self.started {
                self.started = true;
                self.input_tokens = self.generation.prompt_tokens;
                let message = json!({
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                    "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
                });
                self.push("message_start", json!({"message": message}));
                self.push("ping", json!({}));
                continue;
            }
            match self.generation.next().await {
                Some(Progress::Events(events)) => self.absorb(events),
                Some(Progress::Done(ending)) => {
                    self.close();
                    if self.blocks == 0 {
                        self.push(
                            "content_block_start",
                            json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
                        );
                        self.push("content_block_stop", json!({"index": 0}));
                    }
                    let delta = json!({"stop_reason": stop_reason(&ending), "stop_sequence": stop_sequence(&ending, &self.stops)});
                    self.push("message_delta", json!({"delta": delta, "usage": usage(&ending)}));
                    self.push("message_stop", json!({}));
                    self.ended = true;
                }
                Some(Progress::Failed(message)) => {
                    let error = AnthropicError(ApiError::internal(message)).body();
                    self.pending.push_back(("error".into(), error.to_string()));
                    self.ended = true;
                }
                None => self.ended = true,
            }
        }
    }
}
