//! llama.cpp's embedding mode over a GGUF file: the same ids in, pooled embeddings out, for
//! `kylin embed --bench --vs MODEL.gguf` to compare throughput on the same weights.
//!
//! The context is created with embeddings on and the pooling the GGUF file declares (what
//! `llama-embedding` and `llama-server --embedding` do), or last-token pooling when asked (a
//! decoder embedder's GGUF, which declares none: `--pooling last`); a batch holds up to `max_seqs`
//! sequences and `max_batch_tokens` tokens in one ubatch (encoders need a sequence whole in one
//! ubatch), the KV memory is cleared before each batch, and every embedding is normalised to
//! unit length (llama.cpp's default `--embd-normalize 2`).

use std::path::Path;

use kylin_loader::{KylinError, Result};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::{LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::token::LlamaToken;

use crate::{llama_backend, resolve_threads, validate_gguf};

/// A GGUF embedding model in llama.cpp.
pub struct LlamaCppEmbedder {
    // Drop order: the context before the model it points into (as in `LlamaCppBackend`).
    ctx: LlamaContext<'static>,
    model: Box<LlamaModel>,
    max_seqs: usize,
    max_batch_tokens: usize,
    n_embd: usize,
}

impl std::fmt::Debug for LlamaCppEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaCppEmbedder").field("n_embd", &self.n_embd).finish()
    }
}

impl LlamaCppEmbedder {
    /// Loads `path` with a context for batches of `max_seqs` sequences and `max_batch_tokens`
    /// tokens; `last_token` pools by the last token whatever the file declares.
    pub fn load(
        path: &Path,
        threads: usize,
        max_seqs: usize,
        max_batch_tokens: usize,
        last_token: bool,
    ) -> Result<Self> {
        validate_gguf(path)?;
        let backend = llama_backend()?;
        let threads = resolve_threads(threads)? as i32;
        if max_seqs == 0 || max_seqs > 256 || max_batch_tokens == 0 || max_batch_tokens > 1 << 16 {
            return Err(KylinError::input_invalid(
                "llama.cpp embeddings: 1-256 sequences and 1-65536 tokens per batch",
            ));
        }
        let params = LlamaModelParams::default().with_n_gpu_layers(0).with_use_mmap(true);
        let model = LlamaModel::load_from_file(backend, path, &params).map_err(|e| {
            KylinError::backend_failed(format!("llama.cpp could not load {}: {e}", path.display())).at(path)
        })?;
        let model = Box::new(model);
        let n_embd = usize::try_from(model.n_embd()).unwrap_or(0);
        // llama.cpp pads its context to a multiple of 256; a ubatch of another size fails its
        // graph reservation (mean pooling's product) at context creation.
        let max_batch_tokens = max_batch_tokens.div_ceil(256) * 256;
        let tokens = max_batch_tokens as u32;
        let mut ctx_params = LlamaContextParams::default()
            .with_n_ctx(std::num::NonZeroU32::new(tokens))
            .with_n_batch(tokens)
            .with_n_ubatch(tokens)
            .with_n_seq_max(max_seqs as u32)
            .with_n_threads(threads)
            .with_n_threads_batch(threads)
            .with_embeddings(true);
        if last_token {
            ctx_params = ctx_params.with_pooling_type(LlamaPoolingType::Last);
        }
        let ctx = model.new_context(backend, ctx_params).map_err(|e| {
            KylinError::backend_failed(format!("llama.cpp could not create an embedding context: {e}")).at(path)
        })?;
        // SAFETY: the context points into the model behind `model`'s box, stored in the same
        // struct and declared after `ctx`, so dropped after it; the box is never replaced.
        let ctx: LlamaContext<'static> = unsafe { std::mem::transmute::<LlamaContext<'_>, LlamaContext<'static>>(ctx) };
        Ok(LlamaCppEmbedder { ctx, model, max_seqs, max_batch_tokens, n_embd })
    }

    pub fn dimension(&self) -> usize {
        self.n_embd
    }

    /// One unit-length embedding per input, in batches that fit the context.
    pub fn embed(&mut self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < inputs.len()
                && end - start < self.max_seqs
                && tokens + inputs[end].len() <= self.max_batch_tokens
            {
                tokens += inputs[end].len();
                end += 1;
            }
            if end == start {
                return Err(KylinError::context_overflow(format!(
                    "an input of {} tokens does not fit llama.cpp's batch of {}",
                    inputs[start].len(),
                    self.max_batch_tokens
                )));
            }
            let mut batch = LlamaBatch::new(tokens, (end - start) as i32);
            for (seq, ids) in inputs[start..end].iter().enumerate() {
                for (pos, &id) in ids.iter().enumerate() {
                    batch
                        .add(LlamaToken(id as i32), pos as i32, &[seq as i32], true)
                        .map_err(|e| KylinError::backend_failed(format!("llama.cpp batch: {e}")))?;
                }
            }
            self.ctx.clear_kv_cache();
            self.ctx.decode(&mut batch).map_err(|e| KylinError::backend_failed(format!("llama.cpp decode: {e}")))?;
            for seq in 0..end - start {
                let e = self
                    .ctx
                    .embeddings_seq_ith(seq as i32)
                    .map_err(|e| KylinError::backend_failed(format!("llama.cpp embeddings: {e}")))?;
                let norm = e.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt().max(1e-12);
                out.push(e.iter().map(|&x| (f64::from(x) / norm) as f32).collect());
            }
            start = end;
        }
        let _ = &self.model;
        Ok(out)
    }
}
