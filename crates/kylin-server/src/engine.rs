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
use kylin_engine::serving::{ImageInput, PromptText, TokenLogprob};
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
    /// The prompt's text as given, kept for [`Submission::echo`] when [`EngineHandle::submit`]
    /// tokenized it before the engine thread saw it (`None` when building a submission).
    pub echo_text: Option<String>,
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
    /// The engine's tokenizer and chat template, when it shares them: prompts are then
    /// rendered and tokenized on the blocking pool, not on the engine thread between steps.
    pub text: Option<SharedText>,
}

/// An engine's shared [`PromptText`].
#[derive(Clone)]
pub struct SharedText(pub Arc<dyn PromptText>);

impl std::fmt::Debug for SharedText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedText")
    }
}

/// The handlers' side of the engine thread. Cheap to clone; `Send` and `Sync`.
#[derive(Clone)]
pub struct EngineHandle {
    commands: Sender<Command>,
    status: Arc<watch::Sender<Status>>,
    published: Arc<OnceLock<Published>>,
    stats: Arc<Mutex<EngineStats>>,
    next_id: Arc<AtomicU64>,
    /// Prompts rendered and tokenized at once off the engine thread, at most
    /// [`PROMPTS_TOKENIZED_AT_ONCE`].
    tokenizing: Arc<tokio::sync::Semaphore>,
}

/// How many prompts are rendered and tokenized at once off the engine thread. Tokenizing takes
/// about 230 bytes of memory per byte of text (the `tokenizers` crate keeps every byte's
/// alignment and every token's string): 7 GB for a body at `--max-body-bytes`' default of
/// 32 MiB. The engine thread did one at a time; two keep a short prompt from waiting behind
/// one long one while the peak stays near what it was.
const PROMPTS_TOKENIZED_AT_ONCE: usize = 2;

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
            tokenizing: Arc::new(tokio::sync::Semaphore::new(PROMPTS_TOKENIZED_AT_ONCE)),
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
    /// refused it (nothing queued then). The prompt is rendered and tokenized here when the
    /// engine shares its text ([`Published::text`]), so the engine thread gets ids.
    pub async fn submit(&self, mut submission: Submission) -> Result<Accepted, KylinError> {
        if let (Prompt::Text(text), true) = (&submission.prompt, submission.echo) {
            submission.echo_text = Some(text.clone());
        }
        let prompt = std::mem::replace(&mut submission.prompt, Prompt::Ids(Vec::new()));
        submission.prompt = self.tokenize_off_engine(prompt, true, &submission.images).await?;
        let (reply, answer) = oneshot::channel();
        self.send(Command::Submit(Box::new(submission), reply))?;
        answer.await.map_err(|_| stopped())?
    }

    /// Embeds prompts on the engine thread, as one batch between its steps (tokenized before,
    /// here, when the engine shares its text).
    pub async fn embed(&self, prompts: Vec<Prompt>) -> EmbedReply {
        let mut tokenized = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            tokenized.push(self.tokenize_off_engine(prompt, true, &[]).await?);
        }
        let (reply, answer) = oneshot::channel();
        self.send(Command::Embed(tokenized, reply))?;
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

    /// Runs a text job on the engine thread; a tokenization runs here instead when the engine
    /// shares its text.
    pub async fn text(&self, job: TextJob) -> Result<TextReply, KylinError> {
        let job = match job {
            TextJob::Tokenize { prompt, add_special, images } => {
                match (self.tokenize_off_engine(prompt, add_special, &images).await?, images.is_empty()) {
                    (Prompt::Ids(ids), true) => return Ok(TextReply::Ids(ids)),
                    // Images still have their placeholders expanded on the engine thread.
                    (prompt, _) => TextJob::Tokenize { prompt, add_special, images },
                }
            }
            job => job,
        };
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

    /// A text or chat prompt's ids (its images' markers written in, their placeholders not yet
    /// expanded), rendered and tokenized on the blocking pool with the engine's shared text. The
    /// prompt as it is when the engine shares none (the engine thread turns it into ids), or
    /// when it is ids already.
    async fn tokenize_off_engine(
        &self,
        prompt: Prompt,
        add_special: bool,
        images: &[ImageInput],
    ) -> Result<Prompt, KylinError> {
        let Some(published) = self.published.get() else {
            return Ok(prompt);
        };
        let (Some(text), false) = (published.text.clone(), matches!(prompt, Prompt::Ids(_))) else {
            return Ok(prompt);
        };
        let preparer = match images.is_empty() {
            true => None,
            false => {
                Some(published.images.clone().ok_or_else(|| KylinError::input_invalid("this model takes no images"))?)
            }
        };
        let images = images.to_vec();
        // The permit goes with the work: a client that leaves does not free it before the
        // blocking thread is done.
        let permit = self.tokenizing.clone().acquire_owned().await.map_err(|_| stopped())?;
        let work = move || {
            let ids = prompt_ids(TextSide::Shared(&*text.0), prompt, add_special, preparer.as_deref(), &images);
            drop(permit);
            ids
        };
        let ids = tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| KylinError::backend_failed(format!("the thread tokenizing the prompt failed: {e}")))??;
        Ok(Prompt::Ids(ids))
    }
}

/// Where a prompt is rendered and tokenized: by the engine, on its thread between steps, or by
/// the text it shares, on any thread. Both give the same ids.
enum TextSide<'a> {
    Engine(&'a dyn Serving),
    Shared(&'a dyn PromptText),
}

impl TextSide<'_> {
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, KylinError> {
        match self {
            TextSide::Engine(engine) => engine.tokenize(text, add_special),
            TextSide::Shared(shared) => shared.tokenize(text, add_special),
        }
    }

    fn render_chat(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, KylinError> {
        match self {
            TextSide::Engine(engine) => engine.render_chat(messages, add_generation_prompt, kwargs),
            TextSide::Shared(shared) => shared.render_chat(messages, add_generation_prompt, kwargs),
        }
    }
}

/// A prompt's ids before its image placeholders are expanded; a chat's rendered text takes the
/// image markers the model's processor writes in text (Gemma 3's, with its crops) first.
fn prompt_ids(
    text: TextSide<'_>,
    prompt: Prompt,
    add_special: bool,
    preparer: Option<&ImagePreparer>,
    images: &[ImageInput],
) -> Result<Vec<u32>, KylinError> {
    match prompt {
        Prompt::Ids(ids) => Ok(ids),
        Prompt::Text(given) => text.tokenize(&given, add_special),
        Prompt::Chat { messages, kwargs, add_generation_prompt } => {
            let rendered = text.render_chat(&messages, add_generation_prompt, &kwargs)?;
            match preparer {
                Some(preparer) => text.tokenize(&preparer.expand_text(&rendered, images), false),
                None => text.tokenize(&rendered, false),
            }
        }
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
        text: engine.prompt_text().map(SharedText),
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

    /// [`prompt_ids`] on the engine thread.
    fn prompt_ids_with(
        &self,
        prompt: Prompt,
        add_special: bool,
        preparer: Option<&ImagePreparer>,
        images: &[ImageInput],
    ) -> Result<Vec<u32>, KylinError> {
        if !matches!(prompt, Prompt::Ids(_)) {
            self.require_tokenizer()?;
        }
        prompt_ids(TextSide::Engine(&*self.engine), prompt, add_special, preparer, images)
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
            (_, true) => s.echo_text.clone(),
            (_, false) => None,
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

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::mpsc as smpsc;

    use kylin_engine::ChatMessage;
    use kylin_engine::batch::{BatchEngine, EngineOptions};

    use super::*;

    /// A batching engine whose first step waits, with the engine thread inside it, until the
    /// test releases it; everything else is the engine's own.
    struct HeldStep {
        inner: BatchEngine,
        hold: Option<(oneshot::Sender<()>, smpsc::Receiver<()>)>,
        share_text: bool,
        /// Shares this text instead, over the engine's.
        counted: Option<Arc<CountedText>>,
    }

    /// The engine's shared text, whose tokenizations wait until the test opens the gate and
    /// count how many run at once.
    #[derive(Default)]
    struct CountedText {
        inner: OnceLock<Arc<dyn PromptText>>,
        running: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
        open: (Mutex<bool>, std::sync::Condvar),
    }

    impl CountedText {
        fn open_gate(&self) {
            *self.open.0.lock().unwrap() = true;
            self.open.1.notify_all();
        }
    }

    impl PromptText for CountedText {
        fn tokenize(&self, text: &str, add_special: bool) -> kylin_loader::Result<Vec<u32>> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            let mut open = self.open.0.lock().unwrap();
            while !*open {
                open = self.open.1.wait(open).unwrap();
            }
            drop(open);
            self.running.fetch_sub(1, Ordering::SeqCst);
            self.inner.get().unwrap().tokenize(text, add_special)
        }

        fn render_chat(
            &self,
            messages: &[serde_json::Value],
            add_generation_prompt: bool,
            kwargs: &serde_json::Map<String, serde_json::Value>,
        ) -> kylin_loader::Result<String> {
            self.inner.get().unwrap().render_chat(messages, add_generation_prompt, kwargs)
        }
    }

    impl Serving for HeldStep {
        fn info(&self) -> EngineInfo {
            self.inner.info()
        }

        fn generation_defaults(&self) -> GenerationDefaults {
            self.inner.generation_defaults()
        }

        fn add_request(&mut self, request: Request) -> kylin_loader::Result<()> {
            self.inner.add_request(request)
        }

        fn step(&mut self, events: &mut Vec<Event>) -> kylin_loader::Result<()> {
            if let Some((entered, release)) = self.hold.take() {
                let _ = entered.send(());
                let _ = release.recv();
            }
            self.inner.step(events)
        }

        fn has_work(&self) -> bool {
            self.inner.has_work()
        }

        fn stats(&self) -> EngineStats {
            self.inner.stats()
        }

        fn tokenize(&self, text: &str, add_special: bool) -> kylin_loader::Result<Vec<u32>> {
            self.inner.tokenize(text, add_special)
        }

        fn detokenize(&self, ids: &[u32], skip_special: bool) -> kylin_loader::Result<String> {
            self.inner.detokenize(ids, skip_special)
        }

        fn apply_chat_template(
            &self,
            messages: &[ChatMessage],
            add_generation_prompt: bool,
            kwargs: &serde_json::Map<String, serde_json::Value>,
        ) -> kylin_loader::Result<String> {
            self.inner.apply_chat_template(messages, add_generation_prompt, kwargs)
        }

        fn render_chat(
            &self,
            messages: &[serde_json::Value],
            add_generation_prompt: bool,
            kwargs: &serde_json::Map<String, serde_json::Value>,
        ) -> kylin_loader::Result<String> {
            self.inner.render_chat(messages, add_generation_prompt, kwargs)
        }

        fn prompt_text(&self) -> Option<Arc<dyn PromptText>> {
            let shared = self.inner.prompt_text().filter(|_| self.share_text)?;
            match &self.counted {
                Some(counted) => {
                    let _ = counted.inner.set(shared);
                    Some(counted.clone() as Arc<dyn PromptText>)
                }
                None => Some(shared),
            }
        }
    }

    fn submission(prompt: Prompt, echo: bool) -> (Submission, tmpsc::UnboundedReceiver<Out>) {
        let (events, received) = tmpsc::unbounded_channel();
        let submission = Submission {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: Some(3),
            stop: Vec::new(),
            ignore_eos: true,
            speculative_tokens: None,
            n: 1,
            logprobs: None,
            prompt_logprobs: None,
            echo,
            echo_text: None,
            logit_bias: Vec::new(),
            grammar: None,
            skip_special_tokens: true,
            cancel: CancelHandle::new(),
            images: Vec::new(),
            index_offset: 0,
            events,
            arrived: Instant::now(),
        };
        (submission, received)
    }

    fn chat() -> Prompt {
        let messages = vec![serde_json::json!({"role": "user", "content": "Hello world"})];
        Prompt::Chat { messages, kwargs: serde_json::Map::new(), add_generation_prompt: true }
    }

    /// Starts the engine thread over tiny-qwen3 (`HeldStep`'s `hold`, `share_text` and
    /// `counted`) and waits until it is ready.
    async fn start_engine(
        hold: Option<(oneshot::Sender<()>, smpsc::Receiver<()>)>,
        share_text: bool,
        counted: Option<Arc<CountedText>>,
    ) -> EngineHandle {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/tiny-qwen3");
        let factory: EngineFactory = Box::new(move || {
            let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default())?;
            let opts = EngineOptions { ctx_size: Some(256), ..EngineOptions::default() };
            let inner = BatchEngine::new(model, &opts)?;
            Ok(Box::new(HeldStep { inner, hold, share_text, counted }) as Box<dyn Serving>)
        });
        let (handle, _thread) = EngineHandle::spawn(factory, Arc::new(Metrics::new("tiny")), None).unwrap();
        handle.wait_ready().await.unwrap();
        handle
    }

    /// Starts the engine thread over tiny-qwen3, a generation running, and returns once the
    /// thread is inside its first step, held there until `release` is sent to.
    async fn engine_inside_a_step(
        share_text: bool,
    ) -> (EngineHandle, smpsc::Sender<()>, tmpsc::UnboundedReceiver<Out>) {
        let (entered, inside) = oneshot::channel();
        let (release, held) = smpsc::channel();
        let handle = start_engine(Some((entered, held)), share_text, None).await;
        let (running, events) = submission(Prompt::Ids(vec![9707, 1879]), false);
        handle.submit(running).await.unwrap();
        inside.await.unwrap();
        (handle, release, events)
    }

    /// A prompt is rendered and tokenized while the engine thread is busy in a step: the
    /// tokenization of `/tokenize`, a completion's text and a chat's messages all finish with
    /// the thread held inside the step, and the requests run after it with those ids.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn prompts_are_tokenized_while_the_engine_thread_is_inside_a_step() {
        let (handle, release, mut running) = engine_inside_a_step(true).await;
        let within = Duration::from_secs(60);
        let job =
            TextJob::Tokenize { prompt: Prompt::Text("Hello world".into()), add_special: true, images: Vec::new() };
        let ids = match tokio::time::timeout(within, handle.text(job)).await {
            Ok(Ok(TextReply::Ids(ids))) => ids,
            Ok(other) => panic!("tokenize answered {other:?}"),
            Err(_) => panic!("tokenize waited for the engine thread's step"),
        };
        // Qwen's byte-level BPE: "Hello" and " world".
        assert_eq!(ids, [9707, 1879]);
        let job = TextJob::Tokenize { prompt: chat(), add_special: false, images: Vec::new() };
        let chat_ids = match tokio::time::timeout(within, handle.text(job)).await {
            Ok(Ok(TextReply::Ids(ids))) => ids,
            Ok(other) => panic!("tokenize answered {other:?}"),
            Err(_) => panic!("tokenizing a chat waited for the engine thread's step"),
        };
        // "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n".
        assert_eq!(chat_ids.first(), Some(&151644));
        assert!(chat_ids.windows(2).any(|w| w == [9707, 1879]), "{chat_ids:?}");
        // A submission is tokenized before it reaches the thread, so its ids are there to run
        // when the step ends; an echo still shows the text as given.
        let (by_chat, mut chat_events) = submission(chat(), false);
        // Qwen's tokenizer composes characters (NFC), so the text the ids spell differs from
        // the text given: "cafe" with a combining acute accent.
        let given = "Hello world, cafe\u{301}";
        let job = TextJob::Tokenize { prompt: Prompt::Text(given.into()), add_special: true, images: Vec::new() };
        let Ok(Ok(TextReply::Ids(given_ids))) = tokio::time::timeout(within, handle.text(job)).await else {
            panic!("tokenizing a text waited for the engine thread's step");
        };
        let (by_text, mut text_events) = submission(Prompt::Text(given.into()), true);
        let answers = {
            let (a, b) = (handle.clone(), handle.clone());
            tokio::spawn(async move { tokio::join!(a.submit(by_chat), b.submit(by_text)) })
        };
        release.send(()).unwrap();
        let (chat_accepted, text_accepted) = answers.await.unwrap();
        assert_eq!(chat_accepted.unwrap().prompt_tokens, chat_ids.len());
        let text_accepted = text_accepted.unwrap();
        assert_eq!(text_accepted.prompt_tokens, given_ids.len());
        assert_eq!(text_accepted.echo.map(|e| e.text).as_deref(), Some(given));
        for events in [&mut running, &mut chat_events, &mut text_events] {
            let mut tokens = 0;
            loop {
                match events.recv().await {
                    Some(Out::Token { .. }) => tokens += 1,
                    Some(Out::Finished { usage, .. }) => {
                        assert_eq!(usage.completion_tokens, 3);
                        break;
                    }
                    other => panic!("the request ended with {other:?} after {tokens} tokens"),
                }
            }
        }
        handle.stop();
    }

    /// Without shared text (llama.cpp's engines), the engine thread tokenizes, after its step.
    #[tokio::test]
    async fn an_engine_without_shared_text_tokenizes_on_its_thread() {
        let (handle, release, _running) = engine_inside_a_step(false).await;
        let job =
            TextJob::Tokenize { prompt: Prompt::Text("Hello world".into()), add_special: true, images: Vec::new() };
        let answer = tokio::spawn({
            let handle = handle.clone();
            async move { handle.text(job).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!answer.is_finished(), "the engine thread answered from inside its step");
        release.send(()).unwrap();
        match answer.await.unwrap() {
            Ok(TextReply::Ids(ids)) => assert_eq!(ids, [9707, 1879]),
            other => panic!("tokenize answered {other:?}"),
        }
        handle.stop();
    }

    /// Prompts are tokenized two at a time off the engine thread, whatever the number of
    /// requests waiting (tokenizing a long prompt takes much memory).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_most_two_prompts_are_tokenized_at_once() {
        let counted = Arc::new(CountedText::default());
        let handle = start_engine(None, true, Some(counted.clone())).await;
        let jobs: Vec<_> = (0..4)
            .map(|_| {
                let handle = handle.clone();
                tokio::spawn(async move {
                    let prompt = Prompt::Text("Hello world".into());
                    handle.text(TextJob::Tokenize { prompt, add_special: true, images: Vec::new() }).await
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while counted.running.load(Ordering::SeqCst) < PROMPTS_TOKENIZED_AT_ONCE {
            if Instant::now() > deadline {
                counted.open_gate();
                panic!("{} tokenizations started", counted.running.load(Ordering::SeqCst));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The other two are waiting for a permit; given time, they do not start. (The gate
        // opens before the assertion, so that a failure does not leave threads waiting.)
        tokio::time::sleep(Duration::from_millis(200)).await;
        let most_while_closed = counted.most.load(Ordering::SeqCst);
        counted.open_gate();
        assert_eq!(most_while_closed, PROMPTS_TOKENIZED_AT_ONCE);
        for job in jobs {
            match job.await.unwrap() {
                Ok(TextReply::Ids(ids)) => assert_eq!(ids, [9707, 1879]),
                other => panic!("tokenize answered {other:?}"),
            }
        }
        assert_eq!(counted.most.load(Ordering::SeqCst), PROMPTS_TOKENIZED_AT_ONCE);
        handle.stop();
    }
}
