//! Kylin's native backend: one sequence over the batching engine's [`EngineCore`] behind the
//! [`Backend`] interface, for `run`, `chat` and `logits`.
//!
//! It is the same engine as [`crate::batch::BatchEngine`] with a batch of one: the same forward
//! pass, the same paged KV pool and the same prefix cache. A new prompt (after [`Backend::reset`]
//! or a rewind) takes the blocks the cache holds for its beginning, so a chat turn or a repeated
//! prompt computes only what is new.
//!
//! Guarantees: all memory (KV pool, RoPE tables, activations) is planned in
//! [`NativeBackend::new`]; `decode` allocates nothing. A prompt that does not fit is
//! `CONTEXT_OVERFLOW`, naming both sizes and `--ctx-size`.

use kylin_loader::{GenerationDefaults, KylinError, LoadedModel, ModelConfig, ModelWeights, Result, TokenizerBundle};

use crate::backend::{Backend, BackendSummary, ChatMessage};
use crate::batch::{EngineCore, EngineOptions, KvBudget, SeqKv};

pub use crate::batch::DEFAULT_CONTEXT;

/// How to run the native engine for one sequence.
#[derive(Debug, Clone, Default)]
pub struct NativeOptions {
    /// Worker threads for matmuls and attention (0 is treated as 1).
    pub threads: usize,
    /// Maximum tokens in the sequence; default `min(max_position_embeddings, 4096)`.
    pub ctx_size: Option<usize>,
    /// A chat template (its text) replacing the model's own.
    pub chat_template_override: Option<String>,
    /// The engine's sizing; `max_seqs` is 1 whatever is given. `None`: the defaults.
    pub engine: Option<EngineOptions>,
}

/// The parts of a loaded model the native engine uses.
pub struct ModelParts<'a> {
    pub config: &'a ModelConfig,
    pub weights: &'a ModelWeights,
    pub tokenizer: Option<&'a TokenizerBundle>,
    pub generation: GenerationDefaults,
    pub eos_ids: Vec<u32>,
}

/// The one sequence: its ids, how many of them are computed, its blocks, and its live slot in
/// the recurrent layers' state pool (`NO_SLOT` without recurrent layers).
#[derive(Debug)]
struct Direct {
    tokens: Vec<u32>,
    computed: usize,
    kv: SeqKv,
    state: u32,
}

/// A Hugging Face model run by Kylin's own kernels, one sequence at a time.
pub struct NativeBackend {
    core: EngineCore,
    seq: Direct,
}

impl std::fmt::Debug for NativeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeBackend").field("core", &self.core).field("position", &self.seq.tokens.len()).finish()
    }
}

impl NativeBackend {
    /// Builds the backend for a model from [`kylin_loader::load`]; see [`NativeBackend::from_parts`].
    pub fn new(model: LoadedModel, opts: NativeOptions) -> Result<Self> {
        let LoadedModel { config, weights, tokenizer, generation, eos_ids, task, .. } = model;
        if let kylin_loader::task::ModelTask::Embed(e) = task {
            return Err(KylinError::input_invalid(format!(
                "this is an embedding model (from {}): it generates no text; use `kylin embed` or `kylin serve` \
                 (/v1/embeddings), or --task generate to run its decoder as a language model",
                e.source
            )));
        }
        let parts =
            ModelParts { config: &config, weights: &weights, tokenizer: tokenizer.as_ref(), generation, eos_ids };
        NativeBackend::from_parts(parts, opts)
    }

    /// Binds the weights, builds the text codec and plans all run-time memory.
    ///
    /// `CONFIG_INVALID` for a zero or too-large `ctx_size` or a KV budget below one sequence,
    /// `TENSOR_SHAPE_MISMATCH` / `TENSOR_DTYPE_UNSUPPORTED` if a weight does not fit the
    /// configuration, `CONFIG_INVALID` if the chat template does not compile.
    pub fn from_parts(parts: ModelParts<'_>, opts: NativeOptions) -> Result<Self> {
        let mut engine =
            opts.engine.unwrap_or(EngineOptions { kv_budget: KvBudget::Default, ..EngineOptions::default() });
        engine.threads = opts.threads;
        engine.ctx_size = opts.ctx_size.or(engine.ctx_size);
        engine.chat_template_override = opts.chat_template_override.or(engine.chat_template_override);
        engine.max_seqs = 1;
        let mut core = EngineCore::new(parts, &engine)?;
        let max_blocks = core.context().div_ceil(core.block_size()) + 1;
        // The one sequence owns the one live state slot for the backend's lifetime.
        let state = core
            .take_state_slot()
            .ok_or_else(|| KylinError::config_invalid("internal: the state pool has no slot for the sequence"))?;
        let seq = Direct {
            tokens: Vec::with_capacity(core.context()),
            computed: 0,
            kv: SeqKv::with_capacity(max_blocks),
            state,
        };
        Ok(NativeBackend { core, seq })
    }

    /// The engine underneath (for its KV pool figures).
    pub fn core(&self) -> &EngineCore {
        &self.core
    }

    /// Bytes of the KV pool.
    pub fn kv_cache_bytes(&self) -> usize {
        self.core.kv_bytes() as usize
    }

    /// Checks ids before they join the sequence: `INPUT_INVALID` for none or one outside the
    /// vocabulary, `CONTEXT_OVERFLOW` when they do not fit.
    fn check_input(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(KylinError::input_invalid("prefill needs at least one token id; got none"));
        }
        let capacity = self.core.context();
        let cached = self.seq.tokens.len();
        let needed = cached.saturating_add(ids.len());
        if needed > capacity {
            return Err(KylinError::context_overflow(format!(
                "{} tokens after {cached} cached need a context of {needed} positions, but the context size is {capacity}; \
                 pass a larger --ctx-size (the model supports up to {})",
                ids.len(),
                self.core.model().max_position_embeddings()
            )));
        }
        let vocab = self.core.model().dims().vocab;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(KylinError::input_invalid(format!(
                "token id {bad} is outside the model's vocabulary of {vocab} ids"
            )));
        }
        Ok(())
    }

    /// Computes every token of the sequence not computed yet, in chunks of the planned batch
    /// size; the last chunk's logits go to logits row 0, or all of the new rows to `all_logits`
    /// (whose length is then `(tokens - computed) * vocab`). Takes cached prefix blocks first
    /// when the sequence has none (not with `all_logits`: every row must be computed).
    fn compute(&mut self, mut all_logits: Option<&mut [f32]>) -> Result<()> {
        let bs = self.core.block_size();
        let vocab = self.core.model().dims().vocab;
        let seq = &mut self.seq;
        if seq.kv.blocks.is_empty() {
            if all_logits.is_none() {
                let limit = seq.tokens.len().saturating_sub(1);
                seq.kv.match_prefix(&mut self.core.allocs(), &seq.tokens, limit, bs);
            }
            // With recurrent layers the hit is cut back to the last snapshot of their state (or
            // the state starts from zero).
            seq.computed = self.core.resume_state(&mut seq.kv, seq.state, &seq.tokens);
        }
        let first = seq.computed;
        while seq.computed < seq.tokens.len() {
            let len = (seq.tokens.len() - seq.computed).min(self.core.max_batch_tokens);
            let end = seq.computed + len;
            if !seq.kv.grow(&mut self.core.allocs(), end, bs) {
                return Err(KylinError::config_invalid(format!(
                    "the KV pool of {} blocks cannot hold {end} positions; raise --kv-memory",
                    self.core.total_blocks()
                )));
            }
            self.core.plan.clear();
            let last = end == seq.tokens.len();
            self.core.plan.push(
                &seq.tokens[seq.computed..end],
                seq.computed,
                &seq.kv.blocks,
                &seq.kv.sliding,
                seq.state,
                last && all_logits.is_none(),
            );
            let rows =
                all_logits.as_deref_mut().map(|out| &mut out[(seq.computed - first) * vocab..(end - first) * vocab]);
            self.core.forward(rows);
            seq.computed = end;
            seq.kv.advance(&mut self.core.allocs(), &seq.tokens, seq.computed, bs);
        }
        if seq.computed - first > 1 {
            // A prompt: its recurrent state at its last chunk boundary is what a repeated prompt
            // or the next turn reuses.
            self.core.snapshot_state(&seq.kv, seq.state, seq.computed);
        }
        Ok(())
    }
}

impl NativeBackend {
    /// [`Backend::rewind`] for a model with recurrent layers, whose state cannot be cut back
    /// like blocks: the sequence resumes from its own anchor (its last chunk boundary) when
    /// that is within the kept tokens, else from the latest snapshot of a kept prefix, else
    /// from the start; what lies between is recomputed with the next call. The state at the
    /// anchor is snapshotted first, since it ends a turn the next prompt may share.
    fn rewind_recurrent(&mut self, len: usize) {
        let bs = self.core.block_size();
        let seq = &mut self.seq;
        self.core.snapshot_state(&seq.kv, seq.state, seq.computed);
        let chunk = self.core.state_pool().map_or(bs, |s| s.chunk());
        let anchor = seq.computed / chunk * chunk;
        let keep_blocks = (len / bs).min(seq.kv.blocks.len());
        let computed = if anchor <= len && anchor / bs <= seq.kv.hashes.len() {
            if let Some(states) = &mut self.core.states {
                states.rewind_to_anchor(seq.state);
            }
            let kept = seq.kv.truncate(&mut self.core.allocs(), &seq.tokens, anchor / bs, bs);
            kept * bs
        } else {
            seq.kv.truncate(&mut self.core.allocs(), &seq.tokens, keep_blocks, bs);
            self.core.resume_state(&mut seq.kv, seq.state, &seq.tokens)
        };
        seq.tokens.truncate(len);
        seq.computed = computed;
    }
}

impl Backend for NativeBackend {
    fn summary(&self) -> BackendSummary {
        let bs = self.core.block_size() as u64;
        BackendSummary {
            backend: "kylin".to_string(),
            architecture: self.core.architecture.clone(),
            parameters: self.core.model().parameter_count(),
            weight_bytes_per_token: self.core.model().weight_bytes_per_token(),
            kv_bytes_per_position: Some(self.core.kv_bytes() / (self.core.total_blocks() as u64 * bs).max(1)),
            vocab_size: self.core.model().dims().vocab,
            context_size: self.core.context(),
            threads: self.core.pool.threads(),
            precision: self.core.model().precision_name().to_string(),
            kernels: self.core.model().kernels_report(self.core.kv_dtype(), self.core.block_size()),
            quantize_ms: self.core.quantize_ms,
        }
    }

    fn generation_defaults(&self) -> GenerationDefaults {
        self.core.generation.clone()
    }

    fn eos_ids(&self) -> &[u32] {
        &self.core.eos_ids
    }

    fn vocab_size(&self) -> usize {
        self.core.model().dims().vocab
    }

    fn context_size(&self) -> usize {
        self.core.context()
    }

    fn position(&self) -> usize {
        self.seq.tokens.len()
    }

    fn has_tokenizer(&self) -> bool {
        self.core.text.is_some()
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.core.text()?.tokenize(text, add_special)
    }

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.core.text()?.detokenize(ids, skip_special)
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.core.text()?.apply_chat_template(messages, add_generation_prompt, kwargs)
    }

    /// Releases the sequence's blocks; its full blocks stay in the prefix cache (and, with
    /// recurrent layers, a snapshot of their state at its last chunk boundary).
    fn reset(&mut self) {
        self.core.snapshot_state(&self.seq.kv, self.seq.state, self.seq.computed);
        self.seq.kv.release_all(&mut self.core.allocs());
        self.seq.tokens.clear();
        self.seq.computed = 0;
    }

    /// Keeps the first `len` tokens. Blocks past the last full block of them are released; the
    /// few tokens of a partial last block are recomputed with the next call (a block shared
    /// with the prefix cache is never written).
    fn rewind(&mut self, len: usize) {
        if len >= self.seq.tokens.len() {
            return;
        }
        let bs = self.core.block_size();
        if self.core.state_pool().is_some() {
            self.rewind_recurrent(len);
            return;
        }
        let keep = (len / bs).min(self.seq.kv.blocks.len());
        let keep = self.seq.kv.truncate(&mut self.core.allocs(), &self.seq.tokens, keep, bs);
        self.seq.tokens.truncate(len);
        self.seq.computed = self.seq.computed.min(keep * bs);
    }

    fn prefill(&mut self, ids: &[u32]) -> Result<&[f32]> {
        self.check_input(ids)?;
        self.seq.tokens.extend_from_slice(ids);
        self.compute(None)?;
        Ok(self.core.logits(0))
    }

    fn decode(&mut self, id: u32) -> Result<&[f32]> {
        self.prefill(std::slice::from_ref(&id))
    }

    fn prefill_all_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        self.check_input(ids)?;
        let vocab = self.core.model().dims().vocab;
        let len = ids
            .len()
            .checked_mul(vocab)
            .ok_or_else(|| KylinError::input_invalid(format!("{} tokens x {vocab} logits overflows", ids.len())))?;
        // Tokens already in the sequence but not computed (after a rewind) go first, without logits.
        if self.seq.computed < self.seq.tokens.len() {
            self.compute(None)?;
        }
        let mut out = vec![0.0f32; len];
        self.seq.tokens.extend_from_slice(ids);
        self.compute(Some(&mut out))?;
        Ok(out)
    }
}
