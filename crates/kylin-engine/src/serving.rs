//! The request-level interface every serving engine implements: requests in, token events out.
//!
//! Two engines implement [`Serving`]: the continuous-batching [`crate::batch::BatchEngine`]
//! (Kylin's own kernels over a paged KV cache, many sequences per step) and
//! [`crate::serial::SerialEngine`] (any [`crate::Backend`], such as llama.cpp, one sequence at a
//! time). The HTTP server, `kylin run`/`chat` and `kylin bench --concurrency` are written once
//! against this trait and know nothing of how a step is computed.
//!
//! The protocol: [`Serving::add_request`] validates a [`Request`] (and refuses it with a typed
//! error, nothing queued), then every [`Serving::step`] appends [`Event`]s: for every choice of
//! every request, zero or more [`EventKind::Token`] and exactly one final
//! [`EventKind::Finished`]. A request whose [`CancelHandle`] is cancelled finishes with
//! [`StopReason::Cancelled`] at the next step, and its KV memory is free after that step.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kylin_loader::Result;
use serde::Serialize;

use crate::backend::ChatMessage;
use crate::sampler::SamplingParams;

/// A flag shared between whoever submitted a request and the engine; setting it cancels the
/// request at the engine's next step.
#[derive(Debug, Clone, Default)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    pub fn new() -> Self {
        CancelHandle::default()
    }

    /// Asks the engine to stop the request (idempotent).
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// One generation request as the engine sees it (already tokenized).
#[derive(Debug, Clone)]
pub struct Request {
    /// Chosen by the caller; unique among the requests the engine holds.
    pub id: u64,
    pub prompt_ids: Vec<u32>,
    /// Sampling for choice `i` uses `sampling` with `seed + i`, so choices differ and are
    /// reproducible.
    pub sampling: SamplingParams,
    /// Generated tokens per choice at most (an ending EOS included). 0 is allowed only with
    /// `prompt_logprobs`: the request then scores its prompt and generates nothing.
    pub max_new_tokens: usize,
    /// Generation of a choice ends when its text contains one of these; the stop string is
    /// never emitted.
    pub stop: Vec<String>,
    /// Keep going past EOS ids (up to `max_new_tokens`).
    pub ignore_eos: bool,
    /// Parallel samples from the same prompt (OpenAI `n`), at least 1. They share the prompt's
    /// KV blocks in the batching engine.
    pub n: usize,
    /// `Some(k)`: every token event carries the chosen token's log-probability and the `k`
    /// (at most [`MAX_TOP_LOGPROBS`]) most likely alternatives, from the model's raw logits.
    pub logprobs: Option<usize>,
    /// `Some(k)`: the log-probability of every prompt token after the first under the model
    /// (from the logits of the position before it) with the `k` (at most
    /// [`MAX_TOP_LOGPROBS`]) most likely alternatives, as [`EventKind::PromptLogprobs`] events
    /// of choice 0 (the prompt is every choice's). Every such position is computed: the prefix
    /// cache serves none of them.
    pub prompt_logprobs: Option<usize>,
    /// Stream text with the tokens (false: ids only, as `bench` wants).
    pub detokenize: bool,
    /// Drop special tokens from the text (true, as HF's `skip_special_tokens`); false keeps
    /// them, which tool-call syntaxes built on special tokens (`[TOOL_CALLS]`,
    /// `<|python_tag|>`) need.
    pub skip_special_tokens: bool,
    /// Added to the logits of these ids before sampling (OpenAI's `logit_bias`; -100 bans an
    /// id, 100 all but forces it). Log-probabilities stay those of the model.
    pub logit_bias: Vec<(u32, f32)>,
    /// A grammar every choice's output must follow (constrained decoding): the logits of the
    /// tokens it forbids are masked at every step, the tokens it forces are appended without
    /// sampling, and the choice ends (as EOS) when the grammar is complete.
    pub grammar: Option<crate::grammar::Grammar>,
    /// `Some`: the request returns values computed at its last prompt position (an
    /// [`EventKind::Pooled`] event before it finishes) and generates nothing (`max_new_tokens`
    /// 0, `n` 1): what decoder embedders and rerankers answer with.
    pub pooling: Option<Pooled>,
    /// The prompt's images, in prompt order: the prompt holds a run of the model's image
    /// placeholder token for each, one per token the image becomes.
    pub images: Vec<ImageInput>,
    /// At most this many speculative proposals per step for the request's choices (0: none),
    /// within the engine's own `speculative_tokens`; `None` takes the engine's. A client that
    /// knows its answer copies nothing turns speculation off for it.
    pub speculative_tokens: Option<usize>,
    pub cancel: CancelHandle,
}

/// An image of a prompt as the image processor leaves it: its patches, one row of
/// `channels · temporal_patch_size · patch_size²` values each in the processor's order, and
/// their grid.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub pixels: std::sync::Arc<[f32]>,
    pub grid: crate::vision::PatchGrid,
    /// How many of the images after this one in the request are its crops (Gemma 3's
    /// pan-and-scan: the whole image, then its crops, each an input of its own); 0 for an image
    /// without crops and for a crop.
    pub crops: usize,
}

impl ImageInput {
    /// An image without crops.
    pub fn new(pixels: std::sync::Arc<[f32]>, grid: crate::vision::PatchGrid) -> Self {
        ImageInput { pixels, grid, crops: 0 }
    }
}

/// What a prompt-only request returns at its last prompt position.
#[derive(Debug, Clone, PartialEq)]
pub enum Pooled {
    /// The final hidden state of the last prompt token, after the final norm, `(hidden)`:
    /// last-token pooling (Qwen3-Embedding).
    LastHidden,
    /// The model's logits for these ids at the last prompt position, in this order (a
    /// Qwen3-Reranker's `no` and `yes`).
    LastLogits(Vec<u32>),
}

/// The most ids a [`Pooled::LastLogits`] request may name.
pub const MAX_POOLED_IDS: usize = 64;

/// The largest `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Request {
    /// A greedy, text-streaming, single-choice request with no stop strings.
    pub fn new(id: u64, prompt_ids: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            id,
            prompt_ids,
            sampling: SamplingParams::greedy(),
            max_new_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            n: 1,
            logprobs: None,
            prompt_logprobs: None,
            detokenize: true,
            skip_special_tokens: true,
            logit_bias: Vec::new(),
            grammar: None,
            pooling: None,
            images: Vec::new(),
            speculative_tokens: None,
            cancel: CancelHandle::new(),
        }
    }
}

/// The log-probability of a generated token and its best alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// `(id, logprob)`, most likely first; as many as the request asked for.
    pub top: Vec<(u32, f32)>,
}

/// Why a choice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an EOS id.
    Eos,
    /// A stop string appeared in the text.
    StopString,
    /// `max_new_tokens` were generated.
    Length,
    /// The sequence reached the engine's context size.
    ContextFull,
    /// The request was cancelled.
    Cancelled,
    /// The request's grammar failed while generating (a step exceeded llguidance's limits);
    /// the text so far is kept.
    GrammarFailed,
}

impl StopReason {
    /// The OpenAI `finish_reason`: `stop` for EOS and stop strings, `length` for the limits.
    pub fn openai(self) -> &'static str {
        match self {
            StopReason::Eos | StopReason::StopString => "stop",
            StopReason::Length | StopReason::ContextFull => "length",
            StopReason::Cancelled => "cancelled",
            StopReason::GrammarFailed => "error",
        }
    }
}

/// Token counts of one choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache (not computed).
    pub cached_prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What happened to one choice of one request during a step.
#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// A token was generated. `text` is the text it completes (possibly empty: an incomplete
    /// UTF-8 character or the start of a possible stop string is held back), never part of a
    /// stop string; empty when the request does not detokenize.
    Token { id: u32, text: String, logprob: Option<TokenLogprob> },
    /// Log-probabilities of prompt tokens `start..start + logprobs.len()` (`start >= 1`),
    /// for a request with `prompt_logprobs`, in prompt order and before any token event of
    /// the request; together the events cover positions `1..prompt_len` once each. Sent for
    /// choice 0 only: every choice shares the prompt.
    PromptLogprobs { start: usize, logprobs: Vec<TokenLogprob> },
    /// The values a request with [`Request::pooling`] asked for, once, before it finishes.
    Pooled { values: Vec<f32> },
    /// The choice ended. `text` is whatever was held back and is now released (may be empty).
    Finished { reason: StopReason, text: String, usage: Usage },
}

/// One event for choice `index` of request `request`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub request: u64,
    pub index: usize,
    pub kind: EventKind,
}

/// Counters and gauges, for `/metrics` and `bench`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineStats {
    /// Sequences (choices) in the running batch.
    pub running: usize,
    /// Sequences waiting to be admitted (queued or preempted).
    pub waiting: usize,
    pub kv_blocks_total: usize,
    /// Blocks referenced by a live sequence (cached-but-unreferenced blocks count as free).
    pub kv_blocks_used: usize,
    /// Unreferenced blocks that still hold a cached prefix.
    pub kv_blocks_cached: usize,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Prompt tokens looked up in the prefix cache, and those found.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Tokens the speculative proposer proposed, and those the verification accepted (their
    /// keys and values kept; every emitted token is also in `generation_tokens_total`).
    pub speculative_proposed_tokens: u64,
    pub speculative_accepted_tokens: u64,
    /// The share of those two that a draft model (`--draft-model`) proposed: its proposals and
    /// the accepted ones (0 with the n-gram proposer).
    pub draft_model_proposed_tokens: u64,
    pub draft_model_accepted_tokens: u64,
    /// Tokens the draft model computed: catching up on the sequences' tokens and feeding its
    /// own proposals back (the cost of its proposals).
    pub draft_model_computed_tokens: u64,
    /// Images the vision tower encoded, the time it took (all of it, over however many
    /// steps), and images whose encoding was found among the latest ones instead.
    pub images_encoded: u64,
    pub image_encode_seconds: f64,
    pub image_cache_hits: u64,
}

impl EngineStats {
    /// Fraction of the KV blocks held by live sequences.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks_total == 0 { 0.0 } else { self.kv_blocks_used as f64 / self.kv_blocks_total as f64 }
    }
}

/// What a serving engine is and holds, fixed once built.
#[derive(Debug, Clone, Serialize)]
pub struct EngineInfo {
    /// `kylin` or `llama.cpp`.
    pub backend: String,
    pub architecture: String,
    pub vocab_size: usize,
    /// Longest sequence (prompt and generated tokens) one request may reach.
    pub context_size: usize,
    /// Sequences that can run in one batch.
    pub max_seqs: usize,
    /// Tokens in one step's batch.
    pub max_batch_tokens: usize,
    pub kv_block_size: usize,
    pub kv_blocks: usize,
    /// `kv_blocks * kv_block_size`: positions the KV cache holds in all.
    pub kv_tokens: usize,
    pub kv_bytes: u64,
    /// `f32`, `f16` or `bf16`.
    pub kv_dtype: String,
    pub threads: usize,
    /// Arithmetic of the matrix products: `f32`, `bf16` or `int8` (a quantized model; the
    /// llama.cpp backend: `ggml`).
    pub precision: String,
    /// Kernel family running them: `amx-bf16`, `avx512`, `avx2`, `scalar` (llama.cpp: `ggml`).
    pub kernels: String,
    pub has_tokenizer: bool,
    pub eos_ids: Vec<u32>,
    /// The recurrent layers' state pool of a hybrid model (`None` without recurrent layers).
    pub state_pool: Option<StatePoolInfo>,
}

/// The state pool of a model with recurrent layers (Gated DeltaNet, short convolutions),
/// counted in the memory budget beside the KV cache (`kylin_engine::state_pool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StatePoolInfo {
    /// Live states: one per running sequence (`max_seqs`).
    pub live_slots: usize,
    /// Snapshots of states at chunk boundaries, for the prefix cache (`--state-snapshots`).
    pub snapshots: usize,
    /// Bytes of one live state and of one snapshot.
    pub live_bytes: u64,
    pub snapshot_bytes: u64,
    /// Bytes of the whole pool.
    pub bytes: u64,
    /// Positions between two state updates; snapshots sit at its multiples.
    pub chunk: usize,
}

/// What an embedding model produces (for `/v1/embeddings`, `kylin embed` and `/v1/models`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmbeddingInfo {
    /// Width of an embedding.
    pub dimension: usize,
    /// `cls`, `mean`, `max`, `mean_sqrt_len` or `last_token`.
    pub pooling: String,
    /// Embeddings have unit length (the directory's `Normalize` module).
    pub normalized: bool,
    /// Longest input, in tokens.
    pub max_tokens: usize,
    /// Named prompts prefixed to a text (`config_sentence_transformers.json`), e.g. `query`.
    pub prompts: std::collections::BTreeMap<String, String>,
}

/// A request-level engine: the batching engine or one backend run one sequence at a time.
///
/// Text methods run on the thread that owns the engine. Engines need not be `Send` (llama.cpp's
/// context is not): build one on the thread that will drive it.
pub trait Serving {
    fn info(&self) -> EngineInfo;

    /// What turns image files into this engine's image inputs, when it takes images.
    fn image_preparer(&self) -> Option<std::sync::Arc<crate::vision::ImagePreparer>> {
        None
    }

    /// The model's published sampling defaults (`generation_config.json`).
    fn generation_defaults(&self) -> kylin_loader::GenerationDefaults;

    /// Validates and queues a request: `INPUT_INVALID` for no prompt ids, an id outside the
    /// vocabulary, `n` of 0 or above `max_seqs`, too many top log-probabilities or bad sampling
    /// parameters; `CONTEXT_OVERFLOW` if the prompt leaves no room for one generated token.
    /// Nothing is queued on error.
    fn add_request(&mut self, request: Request) -> Result<()>;

    /// Runs one step (one forward pass over the batch, or nothing when idle) and appends what
    /// happened to `events`. Returns an error only for an internal failure of the backend;
    /// requests never make a step fail.
    fn step(&mut self, events: &mut Vec<Event>) -> Result<()>;

    /// True while some request is queued or running.
    fn has_work(&self) -> bool;

    fn stats(&self) -> EngineStats;

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>>;

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String>;

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String>;

    /// Renders messages as OpenAI's JSON holds them (tool calls, tool results) through the
    /// chat template; tools go in `kwargs["tools"]`. The default takes plain `role`/`content`
    /// messages only (`INPUT_INVALID` otherwise), for engines whose renderer cannot do more.
    fn render_chat(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut plain = Vec::with_capacity(messages.len());
        for m in messages {
            let role = m.get("role").and_then(serde_json::Value::as_str);
            let content = m.get("content").and_then(serde_json::Value::as_str);
            let extra = m.as_object().is_some_and(|o| o.keys().any(|k| k != "role" && k != "content"));
            match (role, content, extra) {
                (Some(role), Some(content), false) => {
                    plain.push(ChatMessage { role: role.to_string(), content: content.to_string() })
                }
                _ => {
                    return Err(kylin_loader::KylinError::input_invalid(
                        "this engine renders plain text messages only (no tool calls or tool results)",
                    ));
                }
            }
        }
        self.apply_chat_template(&plain, add_generation_prompt, kwargs)
    }

    /// What [`Serving::embed`] produces, when the model makes embeddings.
    fn embedding_info(&self) -> Option<EmbeddingInfo> {
        None
    }

    /// One embedding per input (token ids), pooled and normalised as the model's files say;
    /// `INPUT_INVALID` when the model makes none, `CONTEXT_OVERFLOW` for a too-long input.
    /// Runs on the engine's thread between steps: the inputs form one batch.
    fn embed(&mut self, _inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        Err(kylin_loader::KylinError::input_invalid(
            "this model does not make embeddings; serve an embedding model (a sentence-transformers directory)",
        ))
    }

    /// Whether [`Serving::rerank`] works (a cross-encoder).
    fn can_rerank(&self) -> bool {
        false
    }

    /// One relevance score per document for `query`, as the model's own scoring gives it (a
    /// cross-encoder's sigmoid of its logit, a yes/no reranker's `P(yes)`), and the tokens the
    /// pairs took. Runs as one batch. `instruction` replaces a yes/no reranker's default task
    /// instruction; a cross-encoder has none and refuses it.
    fn rerank(&mut self, _query: &str, _documents: &[String], _instruction: Option<&str>) -> Result<(Vec<f32>, usize)> {
        Err(kylin_loader::KylinError::input_invalid(
            "this model does not rerank; serve a reranker (a cross-encoder such as bge-reranker)",
        ))
    }

    /// Starts recording the prefix cache's changes (blocks registered and evicted) for
    /// [`Serving::drain_kv_events`], which must then be called after every step; `false` when
    /// the engine has no prefix cache to follow.
    fn record_kv_events(&mut self) -> bool {
        false
    }

    /// Hands the prefix cache's changes since the last call to `f`, in order.
    fn drain_kv_events(&mut self, _f: &mut dyn FnMut(crate::kv_pool::KvEvent<'_>)) {}

    /// The tool-call syntax of the model's chat template (`None`: the template renders no
    /// tools, or the engine cannot tell).
    fn tool_syntax(&self) -> Option<crate::tools::ToolSyntax> {
        None
    }

    /// The grammar compiler over the model's vocabulary, for constrained decoding; engines
    /// that cannot mask logits say so (`INPUT_INVALID`).
    fn grammar_compiler(&self) -> Result<std::sync::Arc<crate::grammar::GrammarCompiler>> {
        Err(kylin_loader::KylinError::input_invalid(
            "constrained decoding (response_format, tool_choice, grammars) is not available on this backend",
        ))
    }

    /// The engine's tokenizer and chat template, shared, for other threads to render and
    /// tokenize prompts on while the engine steps (`None`: the engine has none it can share,
    /// and its own [`Serving::tokenize`] and [`Serving::render_chat`] do that work between
    /// steps). The ids and text are the same as those methods give.
    fn prompt_text(&self) -> Option<Arc<dyn PromptText>> {
        None
    }
}

/// The text half of an engine that is safe to use from any thread: what turns a prompt into
/// ids. A long prompt (megabytes of text, a chat template near its fuel budget) takes seconds
/// to render and tokenize; done here, on the caller's thread, it does not stall the engine's
/// steps for every other request.
pub trait PromptText: Send + Sync {
    /// Text to ids, as [`Serving::tokenize`].
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>>;

    /// OpenAI-shaped messages through the chat template, as [`Serving::render_chat`].
    fn render_chat(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String>;
}
