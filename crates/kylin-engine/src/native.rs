//! Kylin's native backend: the [`Model`] forward pass, its planned [`State`] and the model's
//! [`TextCodec`] behind the [`Backend`] interface.
//!
//! Guarantees: all memory for a sequence (KV cache, RoPE tables, activations) is planned in
//! [`NativeBackend::new`] from the configuration and the context size; `decode` allocates
//! nothing. A prompt that does not fit is `CONTEXT_OVERFLOW`, naming both sizes and `--ctx-size`.

use kylin_kernels::ThreadPool;
use kylin_loader::{GenerationDefaults, KylinError, LoadedModel, ModelConfig, ModelWeights, Result, TokenizerBundle};

use crate::backend::{Backend, BackendSummary, ChatMessage};
use crate::model::{DEFAULT_MAX_CHUNK, Model, State};
use crate::text::TextCodec;

/// The context size used when none is given, capped by the model's `max_position_embeddings`.
pub const DEFAULT_CONTEXT: usize = 4096;

/// How to run the native engine.
#[derive(Debug, Clone, Default)]
pub struct NativeOptions {
    /// Worker threads for matmuls and attention (0 is treated as 1).
    pub threads: usize,
    /// Maximum tokens in the KV cache; default `min(max_position_embeddings, 4096)`.
    pub ctx_size: Option<usize>,
    /// A chat template (its text) replacing the model's own.
    pub chat_template_override: Option<String>,
}

/// The parts of a loaded model the native backend uses.
pub struct ModelParts<'a> {
    pub config: &'a ModelConfig,
    pub weights: &'a ModelWeights,
    pub tokenizer: Option<&'a TokenizerBundle>,
    pub generation: GenerationDefaults,
    pub eos_ids: Vec<u32>,
}

/// A Hugging Face model run by Kylin's own kernels.
pub struct NativeBackend {
    model: Model,
    state: State,
    pool: ThreadPool,
    text: Option<TextCodec>,
    generation: GenerationDefaults,
    eos_ids: Vec<u32>,
    architecture: String,
}

impl std::fmt::Debug for NativeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeBackend")
            .field("architecture", &self.architecture)
            .field("dims", self.model.dims())
            .field("context", &self.state.capacity())
            .field("position", &self.state.position())
            .finish()
    }
}

impl NativeBackend {
    /// Builds the backend for a model from [`kylin_loader::load`]; see [`NativeBackend::from_parts`].
    pub fn new(model: LoadedModel, opts: NativeOptions) -> Result<Self> {
        let LoadedModel { config, weights, tokenizer, generation, eos_ids, .. } = model;
        let parts =
            ModelParts { config: &config, weights: &weights, tokenizer: tokenizer.as_ref(), generation, eos_ids };
        NativeBackend::from_parts(parts, opts)
    }

    /// Binds the weights, builds the text codec and plans all run-time memory.
    ///
    /// `CONFIG_INVALID` for a zero or too-large `ctx_size`, `TENSOR_SHAPE_MISMATCH` /
    /// `TENSOR_DTYPE_UNSUPPORTED` if a weight does not fit the configuration, `CONFIG_INVALID`
    /// if the chat template does not compile.
    pub fn from_parts(parts: ModelParts<'_>, opts: NativeOptions) -> Result<Self> {
        let config = parts.config;
        let model = Model::new(config, parts.weights)?;
        let max_pos = config.max_position_embeddings;
        let context = match opts.ctx_size {
            None => max_pos.min(DEFAULT_CONTEXT),
            Some(0) => {
                return Err(KylinError::config_invalid("--ctx-size must be at least 1; got 0"));
            }
            Some(n) if n > max_pos => {
                return Err(KylinError::config_invalid(format!(
                    "--ctx-size {n} exceeds the model's max_position_embeddings of {max_pos}; pass at most {max_pos}"
                )));
            }
            Some(n) => n,
        };
        let state = model.plan(context, DEFAULT_MAX_CHUNK)?;
        let text =
            parts.tokenizer.map(|bundle| TextCodec::new(bundle, opts.chat_template_override.clone())).transpose()?;
        Ok(NativeBackend {
            model,
            state,
            pool: ThreadPool::new(opts.threads.max(1)),
            text,
            generation: parts.generation,
            eos_ids: parts.eos_ids,
            architecture: config.architecture.hf_name().to_string(),
        })
    }

    /// The text codec, or `CONFIG_MISSING` when the model directory has no tokenizer.
    fn text(&self) -> Result<&TextCodec> {
        self.text.as_ref().ok_or_else(|| {
            KylinError::config_missing(
                "model has no tokenizer (tokenizer.json or vocab.json + merges.txt); \
                 pass token ids instead of text, or add the tokenizer files to the model directory",
            )
        })
    }

    /// Bytes of the planned KV cache.
    pub fn kv_cache_bytes(&self) -> usize {
        self.state.kv_cache_bytes()
    }
}

impl Backend for NativeBackend {
    fn summary(&self) -> BackendSummary {
        BackendSummary {
            backend: "kylin".to_string(),
            architecture: self.architecture.clone(),
            parameters: self.model.parameter_count(),
            weight_bytes_per_token: self.model.weight_bytes_per_token(),
            kv_bytes_per_position: Some(self.state.kv_cache_bytes() as u64 / self.state.capacity().max(1) as u64),
            vocab_size: self.model.dims().vocab,
            context_size: self.state.capacity(),
            threads: self.pool.threads(),
        }
    }

    fn generation_defaults(&self) -> GenerationDefaults {
        self.generation.clone()
    }

    fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    fn vocab_size(&self) -> usize {
        self.model.dims().vocab
    }

    fn context_size(&self) -> usize {
        self.state.capacity()
    }

    fn position(&self) -> usize {
        self.state.position()
    }

    fn has_tokenizer(&self) -> bool {
        self.text.is_some()
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.text()?.tokenize(text, add_special)
    }

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.text()?.detokenize(ids, skip_special)
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.text()?.apply_chat_template(messages, add_generation_prompt, kwargs)
    }

    fn reset(&mut self) {
        self.state.reset();
    }

    fn rewind(&mut self, len: usize) {
        self.state.truncate(len);
    }

    fn prefill(&mut self, ids: &[u32]) -> Result<&[f32]> {
        self.model.prefill(&self.pool, &mut self.state, ids)
    }

    fn decode(&mut self, id: u32) -> Result<&[f32]> {
        self.model.decode(&self.pool, &mut self.state, id)
    }

    fn prefill_all_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let vocab = self.model.dims().vocab;
        let len = ids
            .len()
            .checked_mul(vocab)
            .ok_or_else(|| KylinError::input_invalid(format!("{} tokens x {vocab} logits overflows", ids.len())))?;
        // Checked before allocating: the buffer is only sized once the ids are known to fit.
        self.model.check_input(&self.state, ids)?;
        let mut out = vec![0.0f32; len];
        self.model.prefill_all_logits(&self.pool, &mut self.state, ids, &mut out)?;
        Ok(out)
    }
}
