//! The engine thread: the one place a [`Serving`] engine lives, and the channels to it.
//!
//! An engine need not be `Send` (llama.cpp's context is not), so it is built on its own thread
//! from a `Send` factory and never leaves it. Request handlers talk to it through an
//! [`EngineHandle`]: commands go in over one channel (submit a request, tokenize, detokenize,
//! cancel everything, stop), each reply comes back on its own one-shot channel, and each
//! request's [`Out`] events on its own unbounded channel, so the engine never waits for a
//! client.
//!
//! Guarantees:
//! * The loop steps the engine while it has work and blocks on the command channel when idle.
//! * A request whose event receiver is gone (the client disconnected) is cancelled at once, and
//!   the engine frees it at its next step.
//! * Statistics are published after every command and step, so `/metrics` never waits for the
//!   engine; time to first token, inter-token latency and request latency are measured here
//!   from the events' times.
//! * A failing step fails the requests it holds (each gets [`Out::Failed`]), never the thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kylin_engine::grammar::{Grammar, GrammarCompiler};
use kylin_engine::sampler::SamplingParams;
use kylin_engine::serving::{ImageInput, TokenLogprob};
use kylin_engine::tools::ToolSyntax;
use kylin_engine::vision::ImagePreparer;
use kylin_engine::{
    CancelHandle, EmbeddingInfo, EngineInfo, EngineStats, Event, EventKind, Request, Serving, StopReason, Usage,
};
use kylin_loader::{GenerationDefaults, KylinError};
use tokio::sync::{mpsc as tmpsc, oneshot, watch};

use crate::kv_events::KvEventSender;
use crate::metrics::Metrics;

/// Builds the engine on the engine thread.
pub type EngineFactory = Box<dyn FnOnce() -> Result<Box<dyn Serving>, KylinError> + Send>;

/// Where the server is in its life; `/health` answers 200 only in [`Status::Ready`].
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    Loading,
    Ready,
    ShuttingDown,
    /// The engine could not be built.
    Failed(KylinError),
}

/// What a request's prompt is before the engine thread turns it into ids.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text, tokenized with the tokenizer's special tokens (BOS) where it adds them.
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
    /// Chat messages (OpenAI's JSON, normalized) rendered through the model's chat template
    /// (which adds its own specials); tools, when shown to the model, are in `kwargs["tools"]`.
    Chat {
        messages: Vec<serde_json::Value>,
        kwargs: serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    },
}

/// One generation request as the server hands it to the engine thread.
#[derive(Debug)]
pub struct Submission {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// `None`: as many as fit in the context after the prompt.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// At most this many speculative proposals per step (`None`: the server's).
    pub speculative_tokens: Option<usize>,
    pub n: usize,
    /// `Some(k)`: log-probabilities with the `k` best alternatives.
    pub logprobs: Option<usize>,
    /// `Some(k)`: the prompt's log-probabilities too ([`Out::PromptLogprobs`]), and
    /// `max_tokens` may be 0.
    pub prompt_logprobs: Option<usize>,
    /// Return the prompt's text in [`Accepted::echo`] (the text as given, or the ids
    /// detokenized).
    pub echo: bool,
    /// Added to the logits of these ids before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// The compiled grammar every choice follows.
    pub grammar: Option<Grammar>,
    /// Drop special tokens from the text (false keeps them for a tool-call parser).
    pub skip_special_tokens: bool,
    pub cancel: CancelHandle,
    /// The prompt's images, prepared ([`crate::images`]); the prompt holds one placeholder
    /// token per image, expanded here to the image's tokens.
    pub images: Vec<kylin_engine::serving::ImageInput>,
    /// Added to the engine's choice index in the events (several prompts in one completion).
    pub index_offset: usize,
    pub events: tmpsc::UnboundedSender<Out>,
    /// When the HTTP request arrived (time to first token and latency start here).
    pub arrived: Instant,
}

/// A token's log-probability with its text, as the OpenAI responses show it.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobInfo {
    pub token: String,
    pub logprob: f32,
    /// The best alternatives, most likely first.
    pub top: Vec<(String, f32)>,
}

/// What happened to one choice, as sent to the request's handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// New text of choice `index` (possibly empty: held back until a character or a possible
    /// stop string is complete).
    Token { index: usize, text: String, logprob: Option<LogprobInfo> },
    /// Log-probabilities of prompt tokens `start..` of choice `index` (every choice of a
    /// prompt gets the same), before any token of it.
    PromptLogprobs { index: usize, start: usize, logprobs: Vec<LogprobInfo> },
    /// Choice `index` ended; `text` is the last of its text.
    Finished { index: usize, reason: StopReason, text: String, usage: Usage },
    /// The engine failed while running this request.
    Failed { message: String },
}

/// The prompt as the engine will run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub prompt_tokens: usize,
    /// With [`Submission::echo`]: the prompt's text, and the text of its first token (whose
    /// log-probability is not defined).
    pub echo: Option<Echo>,
}

/// The prompt as an echoing completion shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Echo {
    pub text: String,
    pub first_token: String,
}

/// Text services the handlers ask of the engine.
#[derive(Debug)]
pub enum TextJob {
    /// Renders (for chat) and tokenizes a prompt; `add_special` applies to text prompts. With
    /// images, their tokens are in the ids as a generation would have them.
    Tokenize {
        prompt: Prompt,
        add_special: bool,
        images: Vec<ImageInput>,
    },
    Detokenize {
        ids: Vec<u32>,
    },
    /// The grammar compiler over the model's vocabulary (built on first use).
    GrammarCompiler,
}

/// A text job's answer.
#[derive(Clone)]
pub enum TextReply {
    Ids(Vec<u32>),
    Text(String),
    Compiler(Arc<GrammarCompiler>),
}

impl std::fmt::Debug for TextReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextReply::Ids(ids) => f.debug_tuple("Ids").field(ids).finish(),
            TextReply::Text(t) => f.debug_tuple("Text").field(t).finish(),
            TextReply::Compiler(_) => f.write_str("Compiler"),
        }
    }
}

/// Embeddings of prompts (texts tokenized with the tokenizer's specials, or ids), with the
/// tokens each took.
pub type EmbedReply = Result<(Vec<Vec<f32>>, usize), KylinError>;

/// A rerank request as the engine thread runs it.
struct RerankJob {
    query: String,
    documents: Vec<String>,
    instruction: Option<String>,
}

enum Command {
    Submit(Box<Submission>, oneshot::Sender<Result<Accepted, KylinError>>),
    Embed(Vec<Prompt>, oneshot::Sender<EmbedReply>),
    Rerank(Box<RerankJob>, oneshot::Sender<Result<(Vec<f32>, usize), KylinError>>),
    Text(TextJob, oneshot::Sender<Result<TextReply, KylinError>>),
    CancelAll,
    Stop,
}

/// What the engine thread publishes for the handlers, once it is built.
#[derive(Debug, Clone)]
pub struct Published {
    pub info: EngineInfo,
    pub defaults: GenerationDefaults,
    /// The tool-call syntax of the model's chat template (`None`: it renders no tools).
    pub tool_syntax: Option<ToolSyntax>,
    /// What the model's embeddings are, when it makes them.
    pub embedding: Option<EmbeddingInfo>,
    /// Whether the model reranks (`/v1/rerank`).
    pub rerank: bool,
    /// What turns image files into the model's image inputs, when it takes images.
    pub images: Option<Arc<kylin_engine::vision::ImagePreparer>>,
}

/// The handlers' side of the engine thread. Cheap to clone; `Send` and `Sync`.
#[derive(Clone)]
pub struct EngineHandle {
    commands: Sender<Command>,
    status: Arc<watch::Sender<Status>>,
    published: Arc<OnceLock<Published>>,
    stats: Arc<Mutex<EngineStats>>,
    next_id: Arc<AtomicU64>,
}

impl EngineHandle {
    /// Starts the engine thread, which builds the engine with `factory` and serves commands
    /// until [`EngineHandle::stop`] or until every handle is dropped.
    pub fn spawn(
        factory: EngineFactory,
        metrics: Arc<Metrics>,
        kv_events: Option<KvEventSender>,
    ) -> std::io::Result<(EngineHandle, JoinHandle<()>)> {
        let (commands, receiver) = mpsc::channel();
        let (status, _) = watch::channel(Status::Loading);
        let handle = EngineHandle {
            commands,
            status: Arc::new(status),
            published: Arc::new(OnceLock::new()),
            stats: Arc::new(Mutex::new(EngineStats::default())),
            next_id: Arc::new(AtomicU64::new(1)),
        };
        let thread_handle = handle.clone();
        let join = std::thread::Builder::new().name("kylin-engine".to_string()).spawn(move || {
            engine_thread(factory, receiver, thread_handle, metrics, kv_events);
        })?;
        Ok((handle, join))
    }

    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    /// Moves to `ShuttingDown` (from any state but `Failed`).
    pub fn begin_shutdown(&self) {
        self.status.send_if_modified(|s| {
            if matches!(s, Status::Failed(_) | Status::ShuttingDown) {
                false
            } else {
                *s = Status::ShuttingDown;
                true
            }
        });
    }

    /// Waits until the engine is built (`Ok`) or failed to build (`Err`).
    pub async fn wait_ready(&self) -> Result<Published, KylinError> {
        let mut rx = self.status.subscribe();
        loop {
            match &*rx.borrow_and_update() {
                Status::Failed(e) => return Err(e.clone()),
                Status::Loading => {}
                Status::Ready | Status::ShuttingDown => {
                    if let Some(p) = self.published.get() {
                        return Ok(p.clone());
                    }
                }
            }
            if rx.changed().await.is_err() {
                return Err(KylinError::backend_failed("the engine thread stopped"));
            }
        }
    }

    /// Waits until the server starts shutting down (or the engine failed).
    pub async fn wait_shutdown(&self) {
        let mut rx = self.status.subscribe();
        let _ = rx.wait_for(|s| matches!(s, Status::ShuttingDown | Status::Failed(_))).await;
    }

    /// The engine's description and the model's defaults, once it is built.
    pub fn published(&self) -> Option<&Published> {
        self.published.get()
    }

    /// The statistics after the engine's last step.
    pub fn stats(&self) -> EngineStats {
        match self.stats.lock() {
            Ok(s) => *s,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// Queues a request; the answer says how many prompt tokens it has, or why the engine
    /// refused it (nothing queued then).
    pub async fn submit(&self, submission: Submission) -> Result<Accepted, KylinError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Submit(Box::new(submission), reply))?;
        answer.await.map_err(|_| stopped())?
    }

    /// Embeds prompts on the engine thread, as one batch between its steps.
    pub async fn embed(&self, prompts: Vec<Prompt>) -> EmbedReply {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Embed(prompts, reply))?;
        answer.await.map_err(|_| stopped())?
    }

    /// Scores documents against a query on the engine thread, as one batch.
    pub async fn rerank(
        &self,
        query: String,
        documents: Vec<String>,
        instruction: Option<String>,
    ) -> Result<(Vec<f32>, usize), KylinError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Rerank(Box::new(RerankJob { query, documents, instruction }), reply))?;
        answer.await.map_err(|_| stopped())?
    }

    /// Runs a text job on the engine thread.
    pub async fn text(&self, job: TextJob) -> Result<TextReply, KylinError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Text(job, reply))?;
        answer.await.map_err(|_| stopped())?
    }

    /// Cancels every request the engine holds (the end of the shutdown grace period).
    pub fn cancel_all(&self) {
        let _ = self.commands.send(Command::CancelAll);
    }

    /// Asks the engine thread to finish what it holds and exit.
    pub fn stop(&self) {
        let _ = self.commands.send(Command::Stop);
    }

    fn send(&self, command: Command) -> Result<(), KylinError> {
        self.commands.send(command).map_err(|_| stopped())
    }
}

fn stopped() -> KylinError {
    KylinError::backend_failed("the engine thread has stopped")
}

/// A request the engine holds, as the thread routes its events.
struct Live {
    events: tmpsc::UnboundedSender<Out>,
    cancel: CancelHandle,
    logprobs: bool,
    index_offset: usize,
    arrived: Instant,
    /// When each choice produced its last token (None: no token yet).
    last_token: Vec<Option<Instant>>,
    open_choices: usize,
}

struct EngineLoop {
    engine: Box<dyn Serving>,
    handle: EngineHandle,
    metrics: Arc<Metrics>,
    live: HashMap<u64, Live>,
    events: Vec<Event>,
    /// Where the prefix cache's changes go after each step, when they are published.
    kv_events: Option<(KvEventSender, usize)>,
}

fn engine_thread(
    factory: EngineFactory,
    commands: Receiver<Command>,
    handle: EngineHandle,
    metrics: Arc<Metrics>,
    kv_events: Option<KvEventSender>,
) {
    let mut engine = match factory() {
        Ok(engine) => engine,
        Err(e) => {
            handle.status.send_replace(Status::Failed(e));
            // Answer every command with the failure until the server lets go of the channel.
            while let Ok(command) = commands.recv() {
                match command {
                    Command::Submit(_, reply) => drop(reply.send(Err(stopped()))),
                    Command::Embed(_, reply) => drop(reply.send(Err(stopped()))),
                    Command::Rerank(_, reply) => drop(reply.send(Err(stopped()))),
                    Command::Text(_, reply) => drop(reply.send(Err(stopped()))),
                    Command::CancelAll => {}
                    Command::Stop => return,
                }
            }
            return;
        }
    };
    let published = Published {
        info: engine.info(),
        defaults: engine.generation_defaults(),
        tool_syntax: engine.tool_syntax(),
        embedding: engine.embedding_info(),
        rerank: engine.can_rerank(),
        images: engine.image_preparer(),
    };
    let kv_events = match kv_events {
        Some(sender) if engine.record_kv_events() => {
            let block_size = published.info.kv_block_size;
            // A clean start for followers that saw an earlier process on this endpoint.
            sender.publish(block_size, |f| f(kylin_engine::kv_pool::KvEvent::Cleared));
            Some((sender, block_size))
        }
        Some(_) => {
            eprintln!(
                "warning: --kv-events-endpoint: the {} backend has no prefix cache to publish; no events will be sent",
                published.info.backend
            );
            None
        }
        None => None,
    };
    let _ = handle.published.set(published);
    let mut state = EngineLoop { engine, handle, metrics, live: HashMap::new(), events: Vec::new(), kv_events };
    state.publish_stats();
    state.handle.status.send_if_modified(|s| {
        if *s == Status::Loading {
            *s = Status::Ready;
            true
        } else {
            false
        }
    });
    let mut stopping = false;
    loop {
        // 1. Commands: all that are waiting, or block for one when there is nothing to run.
        loop {
            let command = if state.engine.has_work() || stopping {
                match commands.try_recv() {
                    Ok(c) => c,
                    Err(_) => break,
                }
            } else {
                // Idle: wait, waking now and then so a lost sender cannot hang the thread.
                match commands.recv_timeout(Duration::from_secs(1)) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            match command {
                Command::Submit(submission, reply) => {
                    let answer = state.submit(*submission);
                    let _ = reply.send(answer);
                }
                Command::Text(job, reply) => {
                    let _ = reply.send(state.text(job));
                }
                Command::Embed(prompts, reply) => {
                    let _ = reply.send(state.embed(prompts));
                }
                Command::Rerank(job, reply) => {
                    let _ = reply.send(state.engine.rerank(&job.query, &job.documents, job.instruction.as_deref()));
                }
                Command::CancelAll => state.live.values().for_each(|l| l.cancel.cancel()),
                Command::Stop => stopping = true,
            }
            state.publish_stats();
        }
        if stopping && !state.engine.has_work() {
            return;
        }
        // 2. One step.
        if state.engine.has_work() {
            state.step();
        }
    }
}

impl EngineLoop {
    fn publish_stats(&self) {
        let stats = self.engine.stats();
        match self.handle.stats.lock() {
            Ok(mut s) => *s = stats,
            Err(poisoned) => *poisoned.into_inner() = stats,
        }
    }

    fn prompt_ids(&self, prompt: Prompt, add_special: bool) -> Result<Vec<u32>, KylinError> {
        self.prompt_ids_with(prompt, add_special, None, &[])
    }

    /// The prompt's ids; a chat's rendered text gets the image markers `images` puts in text
    /// (Gemma 3's) before it is tokenized.
    /// A prompt's ids before its image placeholders are expanded; a chat's rendered text takes
    /// the image markers the model's processor writes in text (Gemma 3's, with its crops) first.
    fn prompt_ids_with(
        &self,
        prompt: Prompt,
        add_special: bool,
        preparer: Option<&ImagePreparer>,
        images: &[ImageInput],
    ) -> Result<Vec<u32>, KylinError> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => {
                self.require_tokenizer()?;
                self.engine.tokenize(&text, add_special)
            }
            Prompt::Chat { messages, kwargs, add_generation_prompt } => {
                self.require_tokenizer()?;
                let text = self.engine.render_chat(&messages, add_generation_prompt, &kwargs)?;
                match preparer {
                    Some(preparer) => self.engine.tokenize(&preparer.expand_text(&text, images), false),
                    None => self.engine.tokenize(&text, false),
                }
            }
        }
    }

    fn require_tokenizer(&self) -> Result<(), KylinError> {
        if self.handle.published.get().is_some_and(|p| p.info.has_tokenizer) {
            Ok(())
        } else {
            Err(KylinError::input_invalid("this model has no tokenizer; send the prompt as token ids"))
        }
    }

    fn submit(&mut self, s: Submission) -> Result<Accepted, KylinError> {
        let given_text = match (&s.prompt, s.echo) {
            (Prompt::Text(t), true) => Some(t.clone()),
            _ => None,
        };
        let preparer = match s.images.is_empty() {
            true => None,
            false => Some(
                self.engine.image_preparer().ok_or_else(|| KylinError::input_invalid("this model takes no images"))?,
            ),
        };
        let mut prompt_ids = self.prompt_ids_with(s.prompt, true, preparer.as_deref(), &s.images)?;
        if let Some(preparer) = &preparer {
            prompt_ids = preparer.expand(&prompt_ids, &s.images)?;
        }
        let echo = match s.echo {
            false => None,
            true => {
                let has_text = self.handle.published.get().is_some_and(|p| p.info.has_tokenizer);
                let text = match given_text {
                    Some(t) => t,
                    None if has_text => self.engine.detokenize(&prompt_ids, false)?,
                    None => String::new(),
                };
                let first_token = prompt_ids.first().map(|&id| token_text(&*self.engine, id)).unwrap_or_default();
                Some(Echo { text, first_token })
            }
        };
        let context = self.handle.published.get().map_or(0, |p| p.info.context_size);
        let prompt_tokens = prompt_ids.len();
        let max_new_tokens = match s.max_tokens {
            None => context.saturating_sub(prompt_tokens).max(1),
            Some(m) if prompt_tokens < context && prompt_tokens + m > context => {
                return Err(KylinError::context_overflow(format!(
                    "this model's context holds {context} tokens, but the request asks for {} \
                     ({prompt_tokens} in the prompt and {m} in max_tokens); shorten the prompt or lower max_tokens",
                    prompt_tokens + m
                ))
                .for_field("max_tokens"));
            }
            Some(m) => m,
        };
        let id = self.handle.next_id.fetch_add(1, Ordering::Relaxed);
        let request = Request {
            id,
            prompt_ids,
            sampling: s.sampling,
            max_new_tokens,
            stop: s.stop,
            ignore_eos: s.ignore_eos,
            n: s.n,
            logprobs: s.logprobs,
            prompt_logprobs: s.prompt_logprobs,
            detokenize: self.handle.published.get().is_some_and(|p| p.info.has_tokenizer),
            skip_special_tokens: s.skip_special_tokens,
            logit_bias: s.logit_bias,
            grammar: s.grammar,
            pooling: None,
            images: s.images,
            speculative_tokens: s.speculative_tokens,
            cancel: s.cancel.clone(),
        };
        self.engine.add_request(request)?;
        self.live.insert(
            id,
            Live {
                events: s.events,
                cancel: s.cancel,
                logprobs: s.logprobs.is_some(),
                index_offset: s.index_offset,
                arrived: s.arrived,
                last_token: vec![None; s.n],
                open_choices: s.n,
            },
        );
        Ok(Accepted { prompt_tokens, echo })
    }

    fn embed(&mut self, prompts: Vec<Prompt>) -> EmbedReply {
        let mut inputs = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            inputs.push(self.prompt_ids(prompt, true)?);
        }
        let tokens = inputs.iter().map(Vec::len).sum();
        Ok((self.engine.embed(&inputs)?, tokens))
    }

    fn text(&self, job: TextJob) -> Result<TextReply, KylinError> {
        match job {
            TextJob::Tokenize { prompt, add_special, images } if images.is_empty() => {
                self.prompt_ids(prompt, add_special).map(TextReply::Ids)
            }
            TextJob::Tokenize { prompt, add_special, images } => {
                let preparer = self
                    .engine
                    .image_preparer()
                    .ok_or_else(|| KylinError::input_invalid("this model takes no images"))?;
                let ids = self.prompt_ids_with(prompt, add_special, Some(&preparer), &images)?;
                preparer.expand(&ids, &images).map(TextReply::Ids)
            }
            TextJob::Detokenize { ids } => {
                self.require_tokenizer()?;
                let vocab = self.handle.published.get().map_or(0, |p| p.info.vocab_size);
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(KylinError::input_invalid(format!(
                        "token id {bad} is outside the model's vocabulary of {vocab} ids"
                    )));
                }
                self.engine.detokenize(&ids, false).map(TextReply::Text)
            }
            TextJob::GrammarCompiler => {
                self.require_tokenizer()?;
                self.engine.grammar_compiler().map(TextReply::Compiler)
            }
        }
    }

    fn step(&mut self) {
        self.events.clear();
        let result = self.engine.step(&mut self.events);
        if let Some((sender, block_size)) = &self.kv_events {
            let engine = &mut self.engine;
            sender.publish(*block_size, |f| engine.drain_kv_events(f));
        }
        let now = Instant::now();
        // Statistics first, so a client that sees its request end sees its tokens counted.
        self.publish_stats();
        let events = std::mem::take(&mut self.events);
        for event in &events {
            self.route(event, now);
        }
        self.events = events;
        if let Err(e) = result {
            // The engine failed: every request it holds fails (and is cancelled, so the engine
            // lets go of it at its next step).
            for (_, live) in self.live.drain() {
                live.cancel.cancel();
                let _ = live.events.send(Out::Failed { message: e.to_string() });
            }
        }
        self.publish_stats();
    }

    fn route(&mut self, event: &Event, now: Instant) {
        let Some(live) = self.live.get_mut(&event.request) else { return };
        let index = live.index_offset + event.index;
        let out = match &event.kind {
            EventKind::Token { id, text, logprob } => {
                if let Some(slot) = live.last_token.get_mut(event.index) {
                    match slot.replace(now) {
                        None => self.metrics.observe_ttft(now - live.arrived),
                        Some(before) => self.metrics.observe_itl(now - before),
                    }
                }
                let logprob = match (live.logprobs, logprob) {
                    (true, Some(lp)) => Some(logprob_info(&*self.engine, &TokenLogprob { id: *id, ..lp.clone() })),
                    _ => None,
                };
                Out::Token { index, text: text.clone(), logprob }
            }
            EventKind::PromptLogprobs { start, logprobs } => {
                let logprobs: Vec<LogprobInfo> = logprobs.iter().map(|lp| logprob_info(&*self.engine, lp)).collect();
                // Every choice of the prompt shows the prompt's log-probabilities.
                for choice in 0..live.last_token.len() {
                    let out = Out::PromptLogprobs {
                        index: live.index_offset + choice,
                        start: *start,
                        logprobs: logprobs.clone(),
                    };
                    if live.events.send(out).is_err() {
                        live.cancel.cancel();
                    }
                }
                return;
            }
            // The server's requests never pool (embeddings and reranking run through
            // `Serving::embed` and `Serving::rerank`).
            EventKind::Pooled { .. } => return,
            EventKind::Finished { reason, text, usage } => {
                live.open_choices = live.open_choices.saturating_sub(1);
                Out::Finished { index, reason: *reason, text: text.clone(), usage: *usage }
            }
        };
        // Metrics are recorded before the client can see the end of its request.
        if live.open_choices == 0 {
            self.metrics.observe_latency(now - live.arrived);
            if let EventKind::Finished { reason, .. } = &event.kind {
                self.metrics.count_finished(*reason);
            }
        }
        if live.events.send(out).is_err() {
            // The client is gone: the engine frees the request at its next step.
            live.cancel.cancel();
        }
        if live.open_choices == 0 {
            self.live.remove(&event.request);
        }
    }
}

/// A token's log-probability with the texts of it and its alternatives.
fn logprob_info(engine: &dyn Serving, lp: &TokenLogprob) -> LogprobInfo {
    LogprobInfo {
        token: token_text(engine, lp.id),
        logprob: lp.logprob,
        top: lp.top.iter().map(|&(t, p)| (token_text(engine, t), p)).collect(),
    }
}

/// The text of one token for log-probabilities (lossy where the token is part of a character).
fn token_text(engine: &dyn Serving, id: u32) -> String {
    engine.detokenize(&[id], false).unwrap_or_default()
}
