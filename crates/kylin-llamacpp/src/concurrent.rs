//! Many sequences at once through llama.cpp, for `kylin bench --concurrency N --vs MODEL.gguf`:
//! the way `llama-batched-bench` and llama.cpp's server batch slots, one llama.cpp batch carries
//! a token of every sequence per decode step.
//!
//! Prompts are prefilled first, packed into batches of up to 512 tokens across sequences (each
//! sequence's first token is sampled when its prompt's last chunk is done); then every step
//! decodes one token of every unfinished sequence in one batch. Greedy (argmax) sampling, EOS
//! ignored, as the bench wants.

use std::path::Path;
use std::time::Instant;

use kylin_engine::sampler::argmax;
use kylin_loader::{KylinError, Result};
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::token::LlamaToken;

use crate::{FlashAttention, MAX_BATCH, llama_backend, resolve_threads, validate_gguf};

/// When each token of one sequence arrived, in seconds from the submission of all sequences.
#[derive(Debug, Clone, Default)]
pub struct SequenceTimes {
    pub token_times: Vec<f64>,
}

/// What [`run_concurrent`] measured.
#[derive(Debug, Clone)]
pub struct ConcurrentRun {
    /// Every sequence's token times, in the order of the prompts.
    pub sequences: Vec<SequenceTimes>,
    /// Milliseconds to validate and load the file and create the context.
    pub load_ms: f64,
    /// ggml's CPU features and the attention kernel llama.cpp ran, as the single-sequence
    /// backend's summary names them.
    pub kernels: String,
}

/// Runs `prompts` concurrently, `gen_tokens` greedy tokens each.
pub fn run_concurrent(
    path: &Path,
    threads: usize,
    prompts: &[Vec<u32>],
    gen_tokens: usize,
    flash_attention: FlashAttention,
) -> Result<ConcurrentRun> {
    let started = Instant::now();
    validate_gguf(path)?;
    let backend = llama_backend()?;
    let threads = resolve_threads(threads)?;
    let n = prompts.len();
    if n == 0 || n > 256 || gen_tokens == 0 {
        return Err(KylinError::input_invalid("between 1 and 256 sequences and at least one token each"));
    }
    let model_params = LlamaModelParams::default().with_n_gpu_layers(0).with_use_mmap(true);
    let model = LlamaModel::load_from_file(backend, path, &model_params)
        .map_err(|e| KylinError::backend_failed(format!("llama.cpp could not load {}: {e}", path.display())))?;
    let n_vocab = usize::try_from(model.n_vocab()).unwrap_or(0);
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + gen_tokens + 1;
    let total_ctx = longest
        .checked_mul(n)
        .filter(|&t| t <= i32::MAX as usize)
        .ok_or_else(|| KylinError::input_invalid("the sequences do not fit in one llama.cpp context"))?;
    if let Some(bad) = prompts.iter().flatten().find(|&&id| id as usize >= n_vocab) {
        return Err(KylinError::input_invalid(format!("token id {bad} is outside the vocabulary of {n_vocab}")));
    }
    let ctx_params = LlamaContextParams::default()
        .with_n_ctx(std::num::NonZeroU32::new(total_ctx as u32))
        .with_n_batch(MAX_BATCH as u32)
        .with_n_ubatch(MAX_BATCH as u32)
        .with_n_seq_max(n as u32)
        .with_kv_unified(true)
        .with_n_threads(threads as i32)
        .with_n_threads_batch(threads as i32)
        .with_flash_attention_policy(flash_attention.policy());
    let (mut ctx, attention) = crate::with_attention_kernel(flash_attention, || {
        model.new_context(backend, ctx_params).map_err(|e| {
            KylinError::backend_failed(format!("llama.cpp could not create a context of {total_ctx}: {e}"))
        })
    })?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    let failed = |e: &dyn std::fmt::Display| KylinError::backend_failed(format!("llama.cpp decode failed: {e}"));

    // Warm-up: one short sequence, then an empty cache.
    let mut batch = LlamaBatch::new(MAX_BATCH, n as i32);
    for (i, &id) in prompts[0].iter().take(8).enumerate() {
        batch.add(LlamaToken(id as i32), i as i32, &[0], i + 1 == prompts[0].len().min(8)).map_err(|e| failed(&e))?;
    }
    ctx.decode(&mut batch).map_err(|e| failed(&e))?;
    ctx.clear_kv_cache();

    let t0 = Instant::now();
    let mut times = vec![SequenceTimes::default(); n];
    let mut next = vec![0u32; n];
    // Prefill: (sequence, position) pairs packed into batches of MAX_BATCH tokens.
    let mut pending: Vec<(usize, usize)> = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        pending.extend((0..p.len()).map(|i| (s, i)));
    }
    for chunk in pending.chunks(MAX_BATCH) {
        batch.clear();
        for &(s, i) in chunk {
            let last = i + 1 == prompts[s].len();
            batch.add(LlamaToken(prompts[s][i] as i32), i as i32, &[s as i32], last).map_err(|e| failed(&e))?;
        }
        ctx.decode(&mut batch).map_err(|e| failed(&e))?;
        for (row, &(s, i)) in chunk.iter().enumerate() {
            if i + 1 == prompts[s].len() {
                next[s] = argmax(ctx.get_logits_ith(row as i32));
                times[s].token_times.push(t0.elapsed().as_secs_f64());
            }
        }
    }
    // Decode: one token of every sequence per step.
    for step in 1..gen_tokens {
        batch.clear();
        for s in 0..n {
            let pos = (prompts[s].len() + step - 1) as i32;
            batch.add(LlamaToken(next[s] as i32), pos, &[s as i32], true).map_err(|e| failed(&e))?;
        }
        ctx.decode(&mut batch).map_err(|e| failed(&e))?;
        let now = t0.elapsed().as_secs_f64();
        for (s, slot) in next.iter_mut().enumerate() {
            *slot = argmax(ctx.get_logits_ith(s as i32));
            times[s].token_times.push(now);
        }
    }
    Ok(ConcurrentRun { sequences: times, load_ms, kernels: crate::kernels_report(&attention) })
}
