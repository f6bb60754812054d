//! The generation loop, written once for every [`Backend`]: prefill, then sample and decode
//! token by token, streaming complete text, until EOS, a stop string, the token limit or the end
//! of the context. [`ChatSession`] keeps a conversation and reuses the KV cache for the part of
//! the prompt a new turn shares with the previous one.

use std::time::Instant;

use kylin_loader::{KylinError, Result};
use serde::Serialize;

use crate::backend::{Backend, ChatMessage};
use crate::sampler::SamplingParams;
use crate::sequence::Decoding;
use crate::serving::{EventKind, Request, StopReason};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops when the text contains one of these; the stop string is not returned.
    pub stop: Vec<String>,
    /// Keep going past EOS ids (up to `max_new_tokens`).
    pub ignore_eos: bool,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an EOS id.
    Eos,
    /// A stop string appeared in the text.
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The KV cache is full.
    ContextFull,
}

impl From<StopReason> for FinishReason {
    fn from(reason: StopReason) -> Self {
        match reason {
            StopReason::Eos => FinishReason::Eos,
            // A cancelled generation ends like one stopped by a stop string.
            StopReason::StopString | StopReason::Cancelled | StopReason::GrammarFailed => FinishReason::Stop,
            StopReason::Length => FinishReason::Length,
            StopReason::ContextFull => FinishReason::ContextFull,
        }
    }
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ContextFull => "context_full",
        }
    }
}

/// Where the time went.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GenerationTimings {
    pub prompt_tokens: usize,
    /// Prompt tokens found in the KV cache from an earlier turn (not recomputed).
    pub cached_prompt_tokens: usize,
    pub generated_tokens: usize,
    /// From the call to the first generated token (prefill and one sampling step).
    pub ttft_ms: f64,
    /// Prompt tokens computed per second of prefill.
    pub prefill_tok_s: f64,
    /// Tokens per second after the first one (each is one decode step and one sampling step).
    pub decode_tok_s: f64,
    pub total_ms: f64,
}

/// The outcome of one generation.
#[derive(Debug, Clone, Serialize)]
pub struct GenerationResult {
    pub prompt_ids: Vec<u32>,
    /// Every generated id, an ending EOS included.
    pub generated_ids: Vec<u32>,
    /// The text of the generated ids (special tokens skipped, a stop string and what follows removed).
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: GenerationTimings,
}

/// Generates from an empty KV cache; `on_text` receives the text as it is produced.
pub fn generate(
    backend: &mut dyn Backend,
    request: &GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerationResult> {
    // Reusing no prompt tokens rewinds the cache to empty.
    generate_from(backend, request, 0, on_text)
}

/// Generates with the first `reuse` prompt tokens already in the KV cache.
fn generate_from(
    backend: &mut dyn Backend,
    request: &GenerateRequest,
    reuse: usize,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerationResult> {
    request.sampling.validate()?;
    let prompt = &request.prompt_ids;
    if prompt.is_empty() {
        return Err(KylinError::input_invalid("the prompt has no tokens"));
    }
    let reuse = reuse.min(prompt.len() - 1);
    backend.rewind(reuse);
    if prompt.len() > backend.context_size() {
        return Err(KylinError::context_overflow(format!(
            "the prompt has {} tokens but the context holds {}; pass a larger --ctx-size or shorten the prompt",
            prompt.len(),
            backend.context_size()
        )));
    }
    // The per-token logic (sampling, EOS, stop strings, streaming text, limits) is the one the
    // serving engines use; without a tokenizer (a model run from ids) there is no text.
    let has_text = backend.has_tokenizer();
    let mut as_request = Request::new(0, Vec::new(), request.max_new_tokens);
    as_request.sampling = request.sampling;
    as_request.stop = request.stop.clone();
    as_request.ignore_eos = request.ignore_eos;
    as_request.detokenize = has_text;
    as_request.prompt_ids = prompt.clone();
    let mut decoding = Decoding::new(&as_request, 0, backend.vocab_size(), backend.eos_ids());
    // The logits are copied out so the backend can detokenize while they are sampled.
    let mut logits = vec![0.0f32; backend.vocab_size()];
    let mut text = String::new();
    let mut generated = Vec::new();

    let started = Instant::now();
    logits.copy_from_slice(backend.prefill(&prompt[reuse..])?);
    let mut ttft = None;
    let mut decode_started = started;
    let finish = loop {
        let at_end = backend.position() >= backend.context_size();
        let reader = has_text.then_some(&*backend);
        let (id, token, reason) = decoding.accept(&logits, reader, at_end)?;
        if ttft.is_none() {
            // Time to first token covers prefill and the first sampling step; decode starts after.
            ttft = Some(started.elapsed().as_secs_f64());
            decode_started = Instant::now();
        }
        generated.push(id);
        if let EventKind::Token { text: piece, .. } = &token
            && !piece.is_empty()
        {
            on_text(piece);
            text.push_str(piece);
        }
        if let Some(reason) = reason {
            if let EventKind::Finished { text: rest, .. } = decoding.finish(reason, reader)?
                && !rest.is_empty()
            {
                on_text(&rest);
                text.push_str(&rest);
            }
            break FinishReason::from(reason);
        }
        logits.copy_from_slice(backend.decode(id)?);
    };
    let ttft = ttft.unwrap_or(0.0);
    let decode_s = decode_started.elapsed().as_secs_f64();
    let decoded = generated.len().saturating_sub(1);
    let computed = prompt.len() - reuse;
    Ok(GenerationResult {
        prompt_ids: prompt.clone(),
        timings: GenerationTimings {
            prompt_tokens: prompt.len(),
            cached_prompt_tokens: reuse,
            generated_tokens: generated.len(),
            ttft_ms: ttft * 1e3,
            prefill_tok_s: computed as f64 / ttft.max(1e-9),
            decode_tok_s: if decoded > 0 { decoded as f64 / decode_s.max(1e-9) } else { 0.0 },
            total_ms: started.elapsed().as_secs_f64() * 1e3,
        },
        generated_ids: generated,
        text,
        finish_reason: finish,
    })
}

/// A multi-turn conversation over one backend, its history kept and the shared prefix of the
/// KV cache reused from turn to turn.
#[derive(Debug, Clone, Default)]
pub struct ChatSession {
    pub messages: Vec<ChatMessage>,
    /// Template variables (e.g. `enable_thinking`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The ids whose keys and values are in the backend's cache, in order.
    cached: Vec<u32>,
}

impl ChatSession {
    /// A conversation that starts with an optional system message.
    pub fn new(system: Option<String>, template_kwargs: serde_json::Map<String, serde_json::Value>) -> Self {
        let messages = system.map(|content| vec![ChatMessage { role: "system".into(), content }]).unwrap_or_default();
        ChatSession { messages, template_kwargs, cached: Vec::new() }
    }

    /// Forgets the conversation (the system message stays).
    pub fn clear(&mut self) {
        self.messages.retain(|m| m.role == "system");
        self.cached.clear();
    }

    /// Adds a user message, generates the reply (streamed to `on_text`) and records it.
    ///
    /// `request.prompt_ids` is ignored: the prompt is the whole conversation rendered through
    /// the chat template. On an error the user message is taken back, so the session stays usable.
    pub fn send(
        &mut self,
        backend: &mut dyn Backend,
        user: &str,
        request: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerationResult> {
        self.messages.push(ChatMessage { role: "user".into(), content: user.to_string() });
        let result = self.reply(backend, request, on_text);
        match &result {
            Ok(r) => {
                self.messages.push(ChatMessage { role: "assistant".into(), content: r.text.clone() });
                // The last generated id was sampled but never run through the model.
                self.cached = r.prompt_ids.clone();
                self.cached.extend_from_slice(&r.generated_ids[..r.generated_ids.len().saturating_sub(1)]);
            }
            Err(_) => {
                self.messages.pop();
                self.cached.clear();
            }
        }
        result
    }

    fn reply(
        &mut self,
        backend: &mut dyn Backend,
        request: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerationResult> {
        let text = backend.apply_chat_template(&self.messages, true, &self.template_kwargs)?;
        let prompt_ids = backend.tokenize(&text, false)?;
        let shared = self.cached.iter().zip(&prompt_ids).take_while(|(a, b)| a == b).count();
        let shared = shared.min(backend.position());
        let request = GenerateRequest { prompt_ids, ..request.clone() };
        generate_from(backend, &request, shared, on_text)
    }
}
