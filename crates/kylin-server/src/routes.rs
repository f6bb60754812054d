//! The HTTP handlers: OpenAI's chat and completions (whole or streamed as Server-Sent Events),
//! models, health, metrics, tokenize and detokenize.
//!
//! Guarantees:
//! * Every failure is an OpenAI-shaped [`ApiError`]; nothing a client sends reaches a panic.
//! * A generation request holds an admission slot from its acceptance until its response is
//!   complete or dropped; when the response is dropped early (the client disconnected), its
//!   engine requests are cancelled, so the engine frees them at its next step.
//! * Streamed text is the engine's text events as they come: never a broken UTF-8 character,
//!   never any part of a stop string.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use kylin_engine::{CancelHandle, StopReason};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use kylin_engine::grammar::Grammar;
use kylin_engine::tools::{ParsedResponse, ToolEvent, ToolParsing};

use crate::api::{ChatRequest, Common, CompletionRequest, DetokenizeRequest, PromptInput, TokenizeRequest};
use crate::chat::{self, ChatPlan, ChoiceOutput};
use crate::engine::{Echo, LogprobInfo, Out, Prompt, Published, Status, Submission, TextJob, TextReply};
use crate::error::ApiError;
use crate::{Admission, AppState};

/// `GET /health`: 200 when ready, 503 while loading or shutting down.
pub async fn health(State(state): State<AppState>) -> Response {
    match state.engine().status() {
        Status::Ready => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        Status::Loading => ApiError::unavailable("the model is loading").into_response(),
        Status::ShuttingDown => ApiError::unavailable("the server is shutting down").into_response(),
        Status::Failed(e) => ApiError::unavailable(format!("the model failed to load: {e}")).into_response(),
    }
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.metrics().render(&state.engine().stats());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// `GET /v1/models`: the one served model.
pub async fn models(State(state): State<AppState>) -> Result<Response, ApiError> {
    let published = ready(&state)?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.config().served_model_name,
            "object": "model",
            "created": state.started(),
            "owned_by": "kylin",
            "root": state.config().served_model_name,
            "max_model_len": published.info.context_size,
        }],
    }))
    .into_response())
}

/// Any other route: 404 in OpenAI's shape.
pub async fn not_found(request: Request) -> ApiError {
    ApiError::route_not_found(request.method().as_str(), request.uri().path())
}

/// The engine's description, or 503 while loading or shutting down.
pub(crate) fn ready(state: &AppState) -> Result<&Published, ApiError> {
    match state.engine().status() {
        Status::Ready => state.engine().published().ok_or_else(|| ApiError::unavailable("the model is loading")),
        Status::Loading => Err(ApiError::unavailable("the model is loading")),
        Status::ShuttingDown => Err(ApiError::unavailable("the server is shutting down")),
        Status::Failed(e) => Err(ApiError::unavailable(format!("the model failed to load: {e}"))),
    }
}

/// Reads the whole body within the size limit and the body timeout.
pub(crate) async fn read_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, ApiError> {
    read_body_within(state.config().max_body_bytes, state.config().body_timeout, headers, body).await
}

/// Reads the whole body within `limit` bytes and `timeout`.
pub(crate) async fn read_body_within(
    limit: usize,
    timeout: std::time::Duration,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, ApiError> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(ApiError::body_timeout(timeout.as_secs())),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let inner = e.into_inner();
            if inner.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                Err(ApiError::too_large(limit))
            } else {
                Err(ApiError::invalid_body(format!("could not read the request body: {inner}")))
            }
        }
    }
}

pub(crate) fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    let served = &state.config().served_model_name;
    match model {
        Some(m) if m != served => Err(ApiError::model_not_found(m, served)),
        _ => Ok(()),
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let req = ChatRequest::parse(&body)?;
    check_model(&state, req.common.model.as_deref())?;
    let sampling = req.common.sampling(&published.defaults, state.random_seed())?;
    check_logit_bias(&req.common, &published)?;
    let admission = state.admit()?;
    let mut common = req.common;
    let format = req
        .response_format
        .map(|spec| (spec, "response_format".to_string()))
        .or_else(|| common.guided.take().map(|(spec, param)| (spec, param.to_string())));
    let plan = ChatPlan {
        messages: req.messages,
        tools: req.tools,
        tool_choice: req.tool_choice,
        parallel_tool_calls: req.parallel_tool_calls,
        format,
        kwargs: req.chat_template_kwargs,
        add_generation_prompt: req.add_generation_prompt,
        tools_param: "tools",
    };
    let mut prepared = chat::prepare(&state, &published, plan).await?;
    prepared.images = crate::images::prepare(&state, &published, req.images, &req.image_options).await?;
    let job = Job {
        kind: Kind::Chat,
        common,
        logprobs: req.logprobs,
        prompt_logprobs: None,
        echo: false,
        prompts: vec![prepared.prompt],
        sampling,
        grammar: prepared.grammar,
        skip_special_tokens: prepared.skip_special_tokens,
        syntax: prepared.syntax,
        images: prepared.images,
    };
    run(state, job, admission, arrived, "messages").await
}

/// Every `logit_bias` id must be in the vocabulary.
pub(crate) fn check_logit_bias(common: &Common, published: &Published) -> Result<(), ApiError> {
    let vocab = published.info.vocab_size;
    match common.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        Some((id, _)) => Err(ApiError::invalid(
            "logit_bias",
            format!("`logit_bias` names token id {id}, outside the model's vocabulary of {vocab} ids"),
        )),
        None => Ok(()),
    }
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let req = CompletionRequest::parse(&body)?;
    check_model(&state, req.common.model.as_deref())?;
    let sampling = req.common.sampling(&published.defaults, state.random_seed())?;
    check_logit_bias(&req.common, &published)?;
    let admission = state.admit()?;
    let mut common = req.common;
    let grammar = match common.guided.take() {
        Some((spec, param)) => Some(chat::compile(&state, spec, param).await?),
        None => None,
    };
    let skip_special_tokens = common.skip_special_tokens;
    let prompts = req
        .prompts
        .into_iter()
        .map(|p| match p {
            PromptInput::Text(t) => Prompt::Text(t),
            PromptInput::Ids(ids) => Prompt::Ids(ids),
        })
        .collect();
    // Echoing with log-probabilities scores the prompt; so does an echo that generates
    // nothing (`max_tokens: 0`), whose engine request is the prompt's scoring.
    let prompt_logprobs = match (req.echo, req.logprobs, common.max_tokens) {
        (true, Some(k), _) => Some(k),
        (true, None, Some(0)) => Some(0),
        _ => None,
    };
    let job = Job {
        kind: Kind::Completion,
        common,
        logprobs: req.logprobs,
        prompt_logprobs,
        echo: req.echo,
        prompts,
        sampling,
        grammar,
        skip_special_tokens,
        syntax: None,
        images: Vec::new(),
    };
    run(state, job, admission, arrived, "prompt").await
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn object(self, stream: bool) -> &'static str {
        match (self, stream) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        }
    }
}

struct Job {
    kind: Kind,
    common: Common,
    logprobs: Option<usize>,
    /// Score the prompt (echo with log-probabilities).
    prompt_logprobs: Option<usize>,
    /// Completions' `echo`: each choice's text starts with its prompt.
    echo: bool,
    prompts: Vec<Prompt>,
    sampling: kylin_engine::sampler::SamplingParams,
    grammar: Option<Grammar>,
    skip_special_tokens: bool,
    /// Parse the choices' text for tool calls in this syntax.
    syntax: Option<ToolParsing>,
    /// The chat's images, prepared.
    images: Vec<kylin_engine::serving::ImageInput>,
}

/// The engine requests of one HTTP request; dropping it before the end cancels them.
struct Running {
    cancels: Vec<CancelHandle>,
    done: bool,
    _admission: Admission,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            self.cancels.iter().for_each(CancelHandle::cancel);
        }
    }
}

/// Submits every prompt, then answers whole or as a stream.
async fn run(
    state: AppState,
    job: Job,
    admission: Admission,
    arrived: Instant,
    param: &str,
) -> Result<Response, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let n = job.common.n;
    let mut running = Running { cancels: Vec::new(), done: false, _admission: admission };
    let mut prompt_tokens = 0;
    let mut echoes = Vec::new();
    // A chat's images (it has one prompt).
    let mut images = job.images;
    for (i, prompt) in job.prompts.into_iter().enumerate() {
        let cancel = CancelHandle::new();
        running.cancels.push(cancel.clone());
        let submission = Submission {
            prompt,
            sampling: job.sampling,
            max_tokens: job.common.max_tokens,
            stop: job.common.stop.clone(),
            ignore_eos: job.common.ignore_eos,
            speculative_tokens: job.common.speculative_tokens,
            n,
            logprobs: job.logprobs,
            prompt_logprobs: job.prompt_logprobs,
            echo: job.echo,
            echo_text: None,
            logit_bias: job.common.logit_bias.clone(),
            grammar: job.grammar.clone(),
            skip_special_tokens: job.skip_special_tokens && job.common.skip_special_tokens,
            cancel,
            images: std::mem::take(&mut images),
            index_offset: i * n,
            events: tx.clone(),
            arrived,
        };
        // An error about a parameter (max_tokens, speculative_tokens, ...) names it; others
        // name the prompt.
        let accepted = state.engine().submit(submission).await.map_err(|e| ApiError::from_engine(&e, param))?;
        prompt_tokens += accepted.prompt_tokens;
        echoes.extend(std::iter::repeat_n(accepted.echo, n));
    }
    drop(tx);
    let choices = running.cancels.len() * n;
    let header = Header {
        id: format!("{}-{}", job.kind.id_prefix(), state.next_response_id()),
        created: unix_now(),
        model: state.config().served_model_name.clone(),
        kind: job.kind,
    };
    let mut collector = Collector::new(choices, n, prompt_tokens, job.syntax);
    collector.echo = echoes;
    if job.common.stream {
        let stream = StreamState {
            rx,
            running,
            header,
            collector,
            include_usage: job.common.include_usage,
            logprobs: job.logprobs.is_some(),
            pending: VecDeque::new(),
            started: false,
            ended: false,
        };
        let events = futures_util::stream::unfold(stream, |mut s| async move {
            s.next().await.map(|data| (Ok::<_, Infallible>(SseEvent::default().data(data)), s))
        });
        return Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response());
    }
    let mut rx = rx;
    let mut collector = collector;
    while !collector.all_finished() {
        match rx.recv().await {
            Some(Out::Failed { message }) => return Err(ApiError::internal(message)),
            Some(out) => {
                collector.absorb(&out);
            }
            None => return Err(ApiError::internal("the engine stopped before the request finished")),
        }
    }
    running.done = true;
    collector.finish_outputs();
    Ok(axum::Json(whole_response(&header, &collector, job.logprobs.is_some())).into_response())
}

struct Header {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

/// What the choices produced so far.
struct Collector {
    texts: Vec<String>,
    /// Each choice's text read for tool calls (plain text when no tools were offered).
    outputs: Vec<ChoiceOutput>,
    reasons: Vec<Option<StopReason>>,
    logprobs: Vec<Vec<LogprobInfo>>,
    /// Per choice, with `echo`: the prompt's text and first token (None without echo).
    echo: Vec<Option<Echo>>,
    /// The prompt's log-probabilities (positions 1..) of each choice, when it echoes them.
    prompt_logprobs: Vec<Vec<LogprobInfo>>,
    /// Streaming: whether the choice's echo chunk went out.
    echoed: Vec<bool>,
    /// Choices per prompt (`n`).
    n: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    open: usize,
}

impl Collector {
    fn new(choices: usize, n: usize, prompt_tokens: usize, syntax: Option<ToolParsing>) -> Self {
        Collector {
            texts: vec![String::new(); choices],
            outputs: (0..choices).map(|_| ChoiceOutput::new(syntax.as_ref())).collect(),
            reasons: vec![None; choices],
            logprobs: vec![Vec::new(); choices],
            echo: vec![None; choices],
            prompt_logprobs: vec![Vec::new(); choices],
            echoed: vec![false; choices],
            n: n.max(1),
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            open: choices,
        }
    }

    fn all_finished(&self) -> bool {
        self.open == 0
    }

    /// Records an event; returns what the choice's output completed with it (for streaming).
    fn absorb(&mut self, out: &Out) -> Vec<ToolEvent> {
        match out {
            Out::Token { index, text, logprob } => {
                if let Some(t) = self.texts.get_mut(*index) {
                    t.push_str(text);
                }
                if let (Some(lp), Some(list)) = (logprob, self.logprobs.get_mut(*index)) {
                    list.push(lp.clone());
                }
                self.outputs.get_mut(*index).map(|o| o.push(text)).unwrap_or_default()
            }
            Out::Finished { index, reason, text, usage } => {
                if let Some(t) = self.texts.get_mut(*index) {
                    t.push_str(text);
                }
                let mut events = self.outputs.get_mut(*index).map(|o| o.push(text)).unwrap_or_default();
                if let Some(r) = self.reasons.get_mut(*index)
                    && r.is_none()
                {
                    *r = Some(*reason);
                    self.open = self.open.saturating_sub(1);
                    self.completion_tokens += usage.completion_tokens;
                    if index % self.n == 0 {
                        self.cached_tokens += usage.cached_prompt_tokens;
                    }
                    if let Some(o) = self.outputs.get_mut(*index) {
                        events.extend(o.finish());
                    }
                }
                events
            }
            Out::PromptLogprobs { index, logprobs, .. } => {
                if let Some(list) = self.prompt_logprobs.get_mut(*index) {
                    list.extend(logprobs.iter().cloned());
                }
                Vec::new()
            }
            Out::Failed { .. } => Vec::new(),
        }
    }

    /// The echoed prompt's text of choice `i` ("" without echo).
    fn echo_text(&self, i: usize) -> &str {
        self.echo.get(i).and_then(Option::as_ref).map_or("", |e| e.text.as_str())
    }

    /// The completions API's log-probabilities of choice `i`: with echo, the prompt's tokens
    /// (the first with null log-probabilities) then the generated ones. Offsets count
    /// characters of the token texts from 0 over the prompt's tokens, and from the echoed
    /// text's length over the generated ones.
    fn completion_logprobs(&self, i: usize) -> Value {
        let generated = self.logprobs.get(i).map_or(&[][..], Vec::as_slice);
        match self.echo.get(i).and_then(Option::as_ref) {
            None => completion_logprobs(generated, 0),
            Some(echo) => {
                let prompt = self.prompt_logprobs.get(i).map_or(&[][..], Vec::as_slice);
                let mut whole = echo_logprobs(&echo.first_token, prompt);
                let rest = completion_logprobs(generated, echo.text.chars().count());
                append_logprobs(&mut whole, rest);
                whole
            }
        }
    }

    /// Nothing to do: each choice's output is finished with its last event.
    fn finish_outputs(&mut self) {}

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    /// OpenAI's `finish_reason` of choice `i`: `tool_calls` when it called a tool.
    fn finish_reason(&self, i: usize) -> Value {
        let reason = self.reasons.get(i).copied().flatten();
        match reason {
            Some(StopReason::Eos | StopReason::StopString)
                if self.outputs.get(i).is_some_and(ChoiceOutput::has_calls) =>
            {
                json!("tool_calls")
            }
            other => finish_reason(other),
        }
    }
}

fn finish_reason(reason: Option<StopReason>) -> Value {
    match reason {
        Some(StopReason::Cancelled) => json!("abort"),
        Some(r) => json!(r.openai()),
        None => Value::Null,
    }
}

/// A log-probability as JSON can hold it (`-inf` becomes a very small number, as vLLM does).
fn finite(lp: f32) -> f32 {
    if lp.is_finite() { lp } else { -9999.0 }
}

fn chat_logprob(lp: &LogprobInfo) -> Value {
    json!({
        "token": lp.token,
        "logprob": finite(lp.logprob),
        "bytes": lp.token.as_bytes(),
        "top_logprobs": lp.top.iter().map(|(t, p)| json!({"token": t, "logprob": finite(*p), "bytes": t.as_bytes()})).collect::<Vec<_>>(),
    })
}

/// The completions API's log-probabilities of a run of tokens; offsets count characters from
/// `offset`. As in OpenAI's legacy API, each position's `top_logprobs` holds the `k` best
/// tokens and the chosen one (so up to `k + 1` entries).
fn completion_logprobs(list: &[LogprobInfo], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(list.len());
    for lp in list {
        text_offset.push(offset);
        offset += lp.token.chars().count();
    }
    json!({
        "tokens": list.iter().map(|lp| lp.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": list.iter().map(|lp| finite(lp.logprob)).collect::<Vec<_>>(),
        "top_logprobs": list.iter().map(completion_top).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// One position's `top_logprobs`: the best alternatives, then the chosen token if it is not
/// among them.
fn completion_top(lp: &LogprobInfo) -> Value {
    let mut top: serde_json::Map<String, Value> = lp.top.iter().map(|(t, p)| (t.clone(), json!(finite(*p)))).collect();
    if !top.contains_key(&lp.token) {
        top.insert(lp.token.clone(), json!(finite(lp.logprob)));
    }
    Value::Object(top)
}

/// The echoed prompt's log-probabilities: its first token (no log-probability: nothing
/// precedes it) then `rest`, positions 1 onward.
fn echo_logprobs(first_token: &str, rest: &[LogprobInfo]) -> Value {
    let mut whole = json!({
        "tokens": [first_token],
        "token_logprobs": [null],
        "top_logprobs": [null],
        "text_offset": [0],
    });
    append_logprobs(&mut whole, completion_logprobs(rest, first_token.chars().count()));
    whole
}

/// Appends the lists of `rest` to those of `whole` (both in the completions shape).
fn append_logprobs(whole: &mut Value, rest: Value) {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(Value::Array(into)), Value::Array(from)) =
            (whole.get_mut(key), rest.get(key).cloned().unwrap_or_default())
        {
            into.extend(from);
        }
    }
}

/// A chat choice's message: its text (`null` when it only called tools) and its tool calls.
fn chat_message(header: &Header, choice: usize, parsed: &ParsedResponse) -> Value {
    let mut message = json!({"role": "assistant"});
    if parsed.calls.is_empty() {
        message["content"] = json!(parsed.content);
    } else {
        let content = parsed.content.trim();
        message["content"] = if content.is_empty() { Value::Null } else { json!(content) };
        message["tool_calls"] = parsed
            .calls
            .iter()
            .enumerate()
            .map(|(k, call)| {
                json!({
                    "id": chat::call_id(&header.id, choice, k),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                })
            })
            .collect();
    }
    if !parsed.reasoning.is_empty() {
        message["reasoning_content"] = json!(parsed.reasoning);
    }
    message
}

fn whole_response(header: &Header, c: &Collector, logprobs: bool) -> Value {
    let choices: Vec<Value> = (0..c.texts.len())
        .map(|i| match header.kind {
            Kind::Chat => json!({
                "index": i,
                "message": chat_message(header, i, &c.outputs[i].parsed),
                "logprobs": if logprobs { json!({"content": c.logprobs[i].iter().map(chat_logprob).collect::<Vec<_>>()}) } else { Value::Null },
                "finish_reason": c.finish_reason(i),
            }),
            Kind::Completion => json!({
                "index": i,
                "text": format!("{}{}", c.echo_text(i), c.texts[i]),
                "logprobs": if logprobs { c.completion_logprobs(i) } else { Value::Null },
                "finish_reason": c.finish_reason(i),
            }),
        })
        .collect();
    json!({
        "id": header.id,
        "object": header.kind.object(false),
        "created": header.created,
        "model": header.model,
        "choices": choices,
        "usage": c.usage(),
    })
}

/// A streamed response being produced, chunk by chunk.
struct StreamState {
    rx: mpsc::UnboundedReceiver<Out>,
    running: Running,
    header: Header,
    collector: Collector,
    include_usage: bool,
    logprobs: bool,
    pending: VecDeque<String>,
    started: bool,
    ended: bool,
}

impl StreamState {
    /// The next `data:` payload, or `None` after `[DONE]`.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(data) = self.pending.pop_front() {
                return Some(data);
            }
            if self.ended {
                return None;
            }
            if !self.started {
                self.started = true;
                if self.header.kind == Kind::Chat {
                    for i in 0..self.collector.texts.len() {
                        let delta = json!({"role": "assistant", "content": ""});
                        self.push_choice(json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": null}));
                    }
                }
                continue;
            }
            if self.collector.all_finished() {
                self.running.done = true;
                if self.include_usage {
                    let mut chunk = self.chunk(Vec::new());
                    chunk["usage"] = self.collector.usage();
                    self.pending.push_back(chunk.to_string());
                }
                self.pending.push_back("[DONE]".to_string());
                self.ended = true;
                continue;
            }
            match self.rx.recv().await {
                Some(Out::Failed { message }) => self.fail(&message),
                None => self.fail("the engine stopped before the request finished"),
                Some(out) => {
                    let offset = match &out {
                        Out::Token { index, .. } | Out::Finished { index, .. } => {
                            self.echo_chunk(*index);
                            self.collector.echo_text(*index).chars().count()
                                + self.collector.texts.get(*index).map_or(0, |t| t.chars().count())
                        }
                        Out::PromptLogprobs { .. } | Out::Failed { .. } => 0,
                    };
                    let events = self.collector.absorb(&out);
                    self.emit(&out, offset, events);
                }
            }
        }
    }

    /// An echoing choice's first chunk, before its first generated text: the prompt's text and,
    /// with log-probabilities, the prompt's.
    fn echo_chunk(&mut self, index: usize) {
        let Some(Some(echo)) = self.collector.echo.get(index) else { return };
        if self.collector.echoed.get(index).copied().unwrap_or(true) {
            return;
        }
        let prompt = self.collector.prompt_logprobs.get(index).map_or(&[][..], Vec::as_slice);
        let lp = if self.logprobs { echo_logprobs(&echo.first_token, prompt) } else { Value::Null };
        let text = echo.text.clone();
        self.collector.echoed[index] = true;
        self.push_choice(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}));
    }

    fn fail(&mut self, message: &str) {
        self.pending.push_back(ApiError::internal(message).body().to_string());
        self.pending.push_back("[DONE]".to_string());
        self.ended = true;
    }

    fn chunk(&self, choices: Vec<Value>) -> Value {
        let mut chunk = json!({
            "id": self.header.id,
            "object": self.header.kind.object(true),
            "created": self.header.created,
            "model": self.header.model,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    fn push_choice(&mut self, choice: Value) {
        let chunk = self.chunk(vec![choice]);
        self.pending.push_back(chunk.to_string());
    }

    fn emit(&mut self, out: &Out, offset: usize, events: Vec<ToolEvent>) {
        let chat = self.header.kind == Kind::Chat;
        match out {
            Out::Token { index, text, logprob } => {
                if chat {
                    let lp = match (self.logprobs, logprob) {
                        (true, Some(lp)) => json!({"content": [chat_logprob(lp)]}),
                        _ => Value::Null,
                    };
                    let mut deltas = self.chat_deltas(*index, events);
                    if deltas.is_empty() && !lp.is_null() {
                        deltas.push(json!({"content": ""}));
                    }
                    let n = deltas.len();
                    for (k, delta) in deltas.into_iter().enumerate() {
                        let lp = if k + 1 == n { lp.clone() } else { Value::Null };
                        self.push_choice(
                            json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": null}),
                        );
                    }
                    return;
                }
                if text.is_empty() && !(self.logprobs && logprob.is_some()) {
                    return;
                }
                let lp = match (self.logprobs, logprob) {
                    (true, Some(lp)) => completion_logprobs(std::slice::from_ref(lp), offset),
                    _ => Value::Null,
                };
                self.push_choice(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}));
            }
            Out::Finished { index, text, .. } => {
                let reason = self.collector.finish_reason(*index);
                if chat {
                    for delta in self.chat_deltas(*index, events) {
                        self.push_choice(
                            json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null}),
                        );
                    }
                    self.push_choice(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}));
                } else {
                    self.push_choice(json!({"index": index, "text": text, "logprobs": null, "finish_reason": reason}));
                }
            }
            Out::PromptLogprobs { .. } | Out::Failed { .. } => {}
        }
    }

    /// The chat deltas for what a choice's output completed: text as `content`, tool calls as
    /// `tool_calls` (the first delta of a call carries its id, type and name; the next ones
    /// pieces of its arguments).
    fn chat_deltas(&mut self, choice: usize, events: Vec<ToolEvent>) -> Vec<Value> {
        let mut deltas = Vec::new();
        let mut text = String::new();
        let mut reasoning = String::new();
        for e in events {
            match e {
                ToolEvent::Text(t) => text.push_str(&t),
                ToolEvent::Reasoning(t) => reasoning.push_str(&t),
                ToolEvent::Start { index, name } => {
                    flush_text(&mut deltas, &mut text, &mut reasoning);
                    let id = chat::call_id(&self.header.id, choice, index);
                    deltas.push(json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}));
                }
                ToolEvent::Arguments { index, delta } => {
                    flush_text(&mut deltas, &mut text, &mut reasoning);
                    deltas.push(json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}));
                }
                ToolEvent::End { .. } => {}
            }
        }
        flush_text(&mut deltas, &mut text, &mut reasoning);
        deltas
    }
}

fn flush_text(deltas: &mut Vec<Value>, text: &mut String, reasoning: &mut String) {
    if !reasoning.is_empty() {
        deltas.push(json!({"reasoning_content": std::mem::take(reasoning)}));
    }
    if !text.is_empty() {
        deltas.push(json!({"content": std::mem::take(text)}));
    }
}

/// `POST /tokenize`: `{"prompt"}` or `{"messages"}` (with images, as chat completions take
/// them) to `{"tokens", "count", "max_model_len"}`; an image's tokens are the placeholder ids
/// the model's processor puts in its place.
pub async fn tokenize(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let (model, job, param) = match TokenizeRequest::parse(&body)? {
        TokenizeRequest::Text { model, text, add_special_tokens } => (
            model,
            TextJob::Tokenize { prompt: Prompt::Text(text), add_special: add_special_tokens, images: Vec::new() },
            "prompt",
        ),
        TokenizeRequest::Chat { model, messages, kwargs, add_generation_prompt, images, image_options } => {
            check_model(&state, model.as_deref())?;
            // An image counts the tokens the model's processor puts in its place.
            let images = crate::images::prepare(&state, &published, images, &image_options).await?;
            (
                model,
                TextJob::Tokenize {
                    prompt: Prompt::Chat { messages, kwargs, add_generation_prompt },
                    add_special: false,
                    images,
                },
                "messages",
            )
        }
    };
    check_model(&state, model.as_deref())?;
    match state.engine().text(job).await.map_err(|e| ApiError::from_engine(&e, param))? {
        TextReply::Ids(ids) => Ok(axum::Json(json!({
            "count": ids.len(),
            "max_model_len": published.info.context_size,
            "tokens": ids,
        }))
        .into_response()),
        _ => Err(ApiError::internal("the engine answered a tokenize job with something else")),
    }
}

/// `POST /detokenize`: `{"tokens"}` to `{"prompt"}`.
pub async fn detokenize(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    ready(&state)?;
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let req = DetokenizeRequest::parse(&body)?;
    check_model(&state, req.model.as_deref())?;
    match state
        .engine()
        .text(TextJob::Detokenize { ids: req.tokens })
        .await
        .map_err(|e| ApiError::from_engine(&e, "tokens"))?
    {
        TextReply::Text(text) => Ok(axum::Json(json!({"prompt": text})).into_response()),
        _ => Err(ApiError::internal("the engine answered a detokenize job with something else")),
    }
}
