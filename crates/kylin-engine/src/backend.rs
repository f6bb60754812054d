//! The interface every backend implements: Kylin's native engine and llama.cpp.
//!
//! The generation loop, the sampler, the streaming detokenizer, the CLI and the benchmark are
//! written once against [`Backend`]; a backend only computes logits and converts text.

use kylin_loader::Result;
use serde::Serialize;

/// One chat message, OpenAI style.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// What a backend says about the model it runs (for `inspect`, the summary line and `bench`).
#[derive(Debug, Clone, Serialize)]
pub struct BackendSummary {
    /// `kylin` or `llama.cpp`.
    pub backend: String,
    /// e.g. `Qwen3ForCausalLM` or the GGUF `general.architecture`.
    pub architecture: String,
    pub parameters: u64,
    /// Bytes of weights read to produce one token (all matrices once): the decode bandwidth numerator.
    pub weight_bytes_per_token: u64,
    /// Bytes of keys and values one cached position holds across all layers (what attention
    /// reads per position per token), where the backend knows its cache layout.
    pub kv_bytes_per_position: Option<u64>,
    pub vocab_size: usize,
    pub context_size: usize,
    pub threads: usize,
    /// Arithmetic of the matrix products: `f32` or `bf16` (llama.cpp: `ggml`, its own choice
    /// per weight type).
    pub precision: String,
    /// Kernel family running them: `amx-bf16`, `avx512`, `avx2`, `scalar`; for llama.cpp, the
    /// CPU features its build uses (`ggml: AVX512_BF16, AMX_INT8, …`).
    pub kernels: String,
    /// Milliseconds spent quantizing the weights at load (`--quantize`), part of the load time.
    pub quantize_ms: Option<f64>,
}

/// A loaded model that turns token ids into next-token logits.
///
/// The sequence is stateful: `prefill` and `decode` append to the tokens already in the KV
/// cache; `reset` empties it. Logits slices are borrowed from the backend's own buffers and
/// are valid until the next call.
pub trait Backend {
    fn summary(&self) -> BackendSummary;

    /// Sampling defaults published with the model (`generation_config.json`); empty when the
    /// format has none (GGUF), so the sampler's own defaults apply.
    fn generation_defaults(&self) -> kylin_loader::GenerationDefaults {
        kylin_loader::GenerationDefaults::default()
    }

    /// Ids that end generation (union of generation_config, config and tokenizer EOS).
    fn eos_ids(&self) -> &[u32];

    /// Number of logits per position.
    fn vocab_size(&self) -> usize;

    /// Maximum number of tokens the KV cache holds.
    fn context_size(&self) -> usize;

    /// Tokens currently in the KV cache.
    fn position(&self) -> usize;

    /// Whether the backend has a tokenizer (`tokenize` and `detokenize` work). A model without
    /// one still runs from token ids.
    fn has_tokenizer(&self) -> bool {
        true
    }

    /// Text to ids, adding BOS where the tokenizer's configuration says so (`add_special`).
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>>;

    /// Ids to text. Special tokens are kept unless `skip_special`.
    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String>;

    /// Renders messages through the model's chat template.
    /// `kwargs` are extra template variables (e.g. `{"enable_thinking": false}`).
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String>;

    /// Empties the KV cache.
    fn reset(&mut self);

    /// Keeps the first `len` tokens of the KV cache and forgets the rest, so a conversation can
    /// reuse the prefix it shares with the previous turn. No-op when fewer are cached.
    fn rewind(&mut self, len: usize);

    /// Appends `ids` to the sequence in one forward pass; returns the logits of the last one.
    /// `CONTEXT_OVERFLOW` if they do not fit.
    fn prefill(&mut self, ids: &[u32]) -> Result<&[f32]>;

    /// Appends one token; returns its logits.
    fn decode(&mut self, id: u32) -> Result<&[f32]>;

    /// Appends `ids` and returns the logits of every position, `(ids.len(), vocab)` row-major.
    fn prefill_all_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>>;
}
