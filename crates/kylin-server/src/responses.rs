//! OpenAI's Responses API (`POST /v1/responses`), stateless: text and function-call output
//! items, `instructions`, `tools`, `tool_choice`, `text.format` with a JSON schema, and the
//! streaming events (`response.created` ... `response.completed`).
//!
//! Left out, with a 400 naming the field: `previous_response_id` and `conversation` (nothing
//! is stored, `store` is accepted and ignored), built-in tools (web search, file search,
//! computer use, ...), `background`, `prompt` templates and non-text input. Reasoning items in
//! the input are skipped.

use std::convert::Infallible;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use kylin_engine::StopReason;
use kylin_engine::tools::{ParsedResponse, ToolChoice, ToolEvent};
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::api::{Common, Fields, arguments_object, response_format, tool_choice, tools};
use crate::chat::{self, ChatPlan, Ending, Generation, Limits, Progress};
use crate::error::ApiError;
use crate::routes::{check_model, read_body, ready, unix_now};

/// What this API calls the prompt and the generation limit, for its errors' `param`.
const FIELD_NAMES: chat::FieldNames = chat::FieldNames { prompt: "input", max_tokens: "max_output_tokens" };

/// A parsed `POST /v1/responses` body.
struct ResponsesRequest {
    common: Common,
    messages: Vec<Value>,
    plan_tools: Vec<kylin_engine::tools::ToolSpec>,
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    format: Option<kylin_engine::grammar::GrammarSpec>,
    /// Echoed back in the response object.
    echo: Map<String, Value>,
    /// The input's images (`input_image` parts), in order.
    images: Vec<crate::api::ImagePart>,
}

fn text_of(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(format!("{at}[{j}]"), "only text content is supported")
                            .code("unsupported_parameter"));
                    }
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::invalid(at, "content must be a string or a list of text parts")),
    }
}

/// `input` (a string or a list of items) as chat messages.
fn input_messages(input: Value, images: &mut Vec<crate::api::ImagePart>) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) => items,
        _ => return Err(ApiError::invalid("input", "`input` must be a string or a list of items")),
    };
    let mut messages: Vec<Value> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let at = |f: &str| format!("input[{i}].{f}");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                let role = match role {
                    "user" | "assistant" | "system" => role,
                    "developer" => "system",
                    other => return Err(ApiError::invalid(at("role"), format!("unknown role `{other}`"))),
                };
                let content = crate::api::content(item.get("content").cloned(), &at("content"), images)?;
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let name = item.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
                let name = name.ok_or_else(|| ApiError::invalid(at("name"), "a function_call needs its `name`"))?;
                let call_id = item.get("call_id").and_then(Value::as_str).unwrap_or("");
                let args = arguments_object(item.get("arguments").unwrap_or(&Value::Null), &at("arguments"))?;
                let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}});
                // Consecutive calls belong to one assistant turn.
                match messages.last_mut() {
                    Some(last)
                        if last.get("role").and_then(Value::as_str) == Some("assistant")
                            && last.get("tool_calls").is_some() =>
                    {
                        if let Some(list) = last["tool_calls"].as_array_mut() {
                            list.push(call);
                        }
                    }
                    _ => messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = item.get("call_id").and_then(Value::as_str).filter(|c| !c.is_empty());
                let call_id = call_id
                    .ok_or_else(|| ApiError::invalid(at("call_id"), "a function_call_output needs its `call_id`"))?;
                let output = text_of(item.get("output").unwrap_or(&Value::Null), &at("output"))?;
                messages.push(json!({"role": "tool", "content": output, "tool_call_id": call_id}));
            }
            "reasoning" => {}
            other => {
                return Err(ApiError::invalid(at("type"), format!("input items of type `{other}` are not supported"))
                    .code("unsupported_parameter"));
            }
        }
    }
    if messages.is_empty() {
        return Err(ApiError::invalid("input", "`input` has no messages"));
    }
    Ok(messages)
}

impl ResponsesRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body)?;
        let mut echo = Map::new();
        let model: Option<String> = f.take("model", "a string")?;
        let input: Value = f
            .take("input", "a string or a list of items")?
            .ok_or_else(|| ApiError::invalid("input", "`input` is required"))?;
        let instructions: Option<String> = f.take("instructions", "a string")?;
        let max_output_tokens: Option<usize> = f.take("max_output_tokens", "a positive integer")?;
        if max_output_tokens == Some(0) {
            return Err(ApiError::invalid("max_output_tokens", "`max_output_tokens` must be at least 1"));
        }
        let temperature: Option<f32> = f.take("temperature", "a number")?;
        let top_p: Option<f32> = f.take("top_p", "a number")?;
        let stream = f.take::<bool>("stream", "a boolean")?.unwrap_or(false);
        let raw_tools: Option<Value> = f.take("tools", "a list of tools")?;
        let plan_tools = tools(raw_tools.clone(), "tools")?;
        let raw_choice: Option<Value> = f.take("tool_choice", "a string or an object")?;
        let tool_choice = tool_choice(raw_choice.clone(), &plan_tools)?;
        let parallel_tool_calls = f.take::<bool>("parallel_tool_calls", "a boolean")?.unwrap_or(true);
        let text: Option<Value> = f.take("text", "an object")?;
        let format = response_format(text.as_ref().and_then(|t| t.get("format")).cloned(), "text.format")?;
        if let Some(metadata) = f.take::<Value>("metadata", "an object")? {
            echo.insert("metadata".into(), metadata);
        }
        f.take::<Value>("store", "a boolean")?;
        f.take::<Value>("reasoning", "an object")?;
        f.take::<Value>("truncation", "a string")?;
        f.take::<Value>("include", "a list")?;
        for key in ["previous_response_id", "conversation"] {
            f.refuse_unless(
                key,
                |_| false,
                "this server is stateless (store: false); send the whole conversation in `input`",
            )?;
        }
        f.refuse_unless("background", |v| v == false, "background responses are not implemented")?;
        f.refuse_unless("prompt", |_| false, "stored prompt templates are not implemented")?;
        f.finish()?;
        let mut images = Vec::new();
        let mut messages = input_messages(input, &mut images)?;
        if let Some(instructions) = &instructions {
            messages.insert(0, json!({"role": "system", "content": instructions}));
        }
        echo.insert("instructions".into(), json!(instructions));
        echo.insert("tools".into(), raw_tools.unwrap_or(json!([])));
        echo.insert("tool_choice".into(), raw_choice.unwrap_or(json!("auto")));
        echo.insert("parallel_tool_calls".into(), json!(parallel_tool_calls));
        echo.insert("text".into(), text.unwrap_or(json!({"format": {"type": "text"}})));
        echo.insert("temperature".into(), json!(temperature));
        echo.insert("top_p".into(), json!(top_p));
        echo.insert("max_output_tokens".into(), json!(max_output_tokens));
        let common =
            Common { model, max_tokens: max_output_tokens, temperature, top_p, n: 1, stream, ..Common::default() };
        Ok(ResponsesRequest { common, messages, plan_tools, tool_choice, parallel_tool_calls, format, echo, images })
    }
}

/// The response object, `status` and `output` as given.
fn response_object(
    id: &str,
    created: u64,
    model: &str,
    echo: &Map<String, Value>,
    status: &str,
    output: Vec<Value>,
    ending: Option<&Ending>,
) -> Value {
    let mut r = json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": null,
        "incomplete_details": null,
        "usage": null,
        "metadata": {},
    });
    for (k, v) in echo {
        r[k] = v.clone();
    }
    if let Some(e) = ending {
        r["usage"] = json!({
            "input_tokens": e.prompt_tokens,
            "input_tokens_details": {"cached_tokens": e.cached_tokens},
            "output_tokens": e.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": e.prompt_tokens + e.completion_tokens,
        });
        if matches!(e.reason, StopReason::Length | StopReason::ContextFull) {
            r["status"] = json!("incomplete");
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
    }
    r
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// The output items of a whole response.
fn output_items(id: &str, parsed: &ParsedResponse) -> Vec<Value> {
    let mut items = Vec::new();
    let text = if parsed.calls.is_empty() { parsed.content.as_str() } else { parsed.content.trim() };
    if !text.is_empty() || parsed.calls.is_empty() {
        items.push(message_item(&format!("msg_{id}"), text, "completed"));
    }
    for (k, call) in parsed.calls.iter().enumerate() {
        items.push(call_item(
            &format!("fc_{id}_{k}"),
            &chat::call_id(id, 0, k),
            &call.name,
            &call.arguments,
            "completed",
        ));
    }
    items
}

/// `POST /v1/responses`.
pub async fn responses(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let req = ResponsesRequest::parse(&body)?;
    check_model(&state, req.common.model.as_deref())?;
    let sampling = req.common.sampling(&published.defaults, state.random_seed())?;
    let admission = state.admit()?;
    let plan = ChatPlan {
        messages: req.messages,
        tools: req.plan_tools,
        tool_choice: req.tool_choice,
        parallel_tool_calls: req.parallel_tool_calls,
        format: req.format.map(|f| (f, "text.format".to_string())),
        kwargs: Map::new(),
        add_generation_prompt: true,
        tools_param: "tools",
    };
    let mut prepared = chat::prepare(&state, &published, plan).await?;
    prepared.images = crate::images::prepare(&state, &published, req.images, &Default::default()).await?;
    let limits = Limits { sampling, max_tokens: req.common.max_tokens, stop: Vec::new() };
    let generation = chat::start(&state, prepared, limits, admission, arrived, FIELD_NAMES).await?;
    let id = format!("resp_{}", state.next_response_id());
    let model = state.config().served_model_name.clone();
    let created = unix_now();
    if !req.common.stream {
        let (parsed, ending) = generation.collect().await?;
        let output = output_items(&id, &parsed);
        return Ok(axum::Json(response_object(&id, created, &model, &req.echo, "completed", output, Some(&ending)))
            .into_response());
    }
    let stream = ResponseStream {
        generation,
        id,
        model,
        created,
        echo: req.echo,
        seq: 0,
        pending: Default::default(),
        started: false,
        ended: false,
        text_item: None,
        text: String::new(),
        items: Vec::new(),
        calls: Vec::new(),
    };
    let events = futures_util::stream::unfold(stream, |mut s| async move {
        s.next().await.map(|(name, data)| (Ok::<_, Infallible>(SseEvent::default().event(name).data(data)), s))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

/// A streamed response: the Responses API's events.
struct ResponseStream {
    generation: Generation,
    id: String,
    model: String,
    created: u64,
    echo: Map<String, Value>,
    seq: u64,
    pending: std::collections::VecDeque<(String, String)>,
    started: bool,
    ended: bool,
    /// The open message item: (output index, item id).
    text_item: Option<(usize, String)>,
    text: String,
    /// Finished items, in output order.
    items: Vec<Value>,
    /// Open calls: (call index, output index, item id, call id, name, arguments).
    calls: Vec<(usize, usize, String, String, String, String)>,
}

impl ResponseStream {
    fn push(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.pending.push_back((kind.to_string(), data.to_string()));
    }

    fn object(&self, status: &str, ending: Option<&Ending>) -> Value {
        response_object(&self.id, self.created, &self.model, &self.echo, status, self.items.clone(), ending)
    }

    fn close_text(&mut self) {
        if let Some((output_index, item_id)) = self.text_item.take() {
            let text = std::mem::take(&mut self.text);
            self.push(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "text": text}),
            );
            self.push("response.content_part.done", json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}}));
            let item = message_item(&item_id, &text, "completed");
            self.push("response.output_item.done", json!({"output_index": output_index, "item": item}));
            self.items.push(item);
        }
    }

    fn close_calls(&mut self) {
        for (_, output_index, item_id, call_id, name, arguments) in std::mem::take(&mut self.calls) {
            self.push(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": output_index, "arguments": arguments}),
            );
            let item = call_item(&item_id, &call_id, &name, &arguments, "completed");
            self.push("response.output_item.done", json!({"output_index": output_index, "item": item}));
            self.items.push(item);
        }
    }

    fn next_index(&self) -> usize {
        self.items.len() + usize::from(self.text_item.is_some()) + self.calls.len()
    }

    fn absorb(&mut self, events: Vec<ToolEvent>) {
        for e in events {
            match e {
                ToolEvent::Text(t) => {
                    // Whitespace between or after calls is not worth a message.
                    if t.trim().is_empty()
                        && (self.text_item.is_none()
                            && (!self.calls.is_empty() || self.items.iter().any(|i| i["type"] == "function_call")))
                    {
                        continue;
                    }
                    if self.text_item.is_none() {
                        self.close_calls();
                        let output_index = self.next_index();
                        let item_id = format!("msg_{}_{output_index}", self.id);
                        self.push("response.output_item.added", json!({"output_index": output_index, "item": {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}}));
                        self.push("response.content_part.added", json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}));
                        self.text_item = Some((output_index, item_id));
                    }
                    if let Some((output_index, item_id)) = self.text_item.clone() {
                        self.text.push_str(&t);
                        self.push(
                            "response.output_text.delta",
                            json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "delta": t}),
                        );
                    }
                }
                ToolEvent::Reasoning(_) => {}
                ToolEvent::Start { index, name } => {
                    self.close_text();
                    let output_index = self.next_index();
                    let item_id = format!("fc_{}_{index}", self.id);
                    let call_id = chat::call_id(&self.id, 0, index);
                    let item = call_item(&item_id, &call_id, &name, "", "in_progress");
                    self.push("response.output_item.added", json!({"output_index": output_index, "item": item}));
                    self.calls.push((index, output_index, item_id, call_id, name, String::new()));
                }
                ToolEvent::Arguments { index, delta } => {
                    let found = self.calls.iter_mut().find(|c| c.0 == index).map(|c| {
                        c.5.push_str(&delta);
                        (c.1, c.2.clone())
                    });
                    if let Some((output_index, item_id)) = found {
                        self.push(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item_id, "output_index": output_index, "delta": delta}),
                        );
                    }
                }
                ToolEvent::End { .. } => {}
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
                let r = self.object("in_progress", None);
                self.push("response.created", json!({"response": r}));
                self.push("response.in_progress", json!({"response": r}));
                continue;
            }
            match self.generation.next().await {
                Some(Progress::Events(events)) => self.absorb(events),
                Some(Progress::Done(ending)) => {
                    self.close_text();
                    self.close_calls();
                    if self.items.is_empty() {
                        // An empty answer is still one (empty) message.
                        self.absorb(vec![ToolEvent::Text(String::new())]);
                        self.close_text();
                    }
                    let r = self.object("completed", Some(&ending));
                    let kind = if r["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
                    self.push(kind, json!({"response": r}));
                    self.ended = true;
                }
                Some(Progress::Failed(message)) => {
                    let mut r = self.object("failed", None);
                    r["error"] = json!({"code": "server_error", "message": message});
                    self.push("response.failed", json!({"response": r}));
                    self.ended = true;
                }
                None => self.ended = true,
            }
        }
    }
}
