//! `kylin bench --concurrency N`: N sequences submitted at once to the batching engine (or, for
//! a GGUF file, to llama.cpp as one multi-sequence batch per step), each with its own prompt of
//! `--prompt-tokens` tokens (the first `--shared-prefix` of them shared by all) and
//! `--gen-tokens` greedy tokens.
//!
//! Figures, from the time every token arrived:
//! - `aggregate_decode_tok_s`: the tokens generated after the last sequence received its first
//!   token, divided by the time from then to the last token (steady batched decode, prefill
//!   excluded);
//! - `decode_tok_s`: the median over sequences of (tokens - 1) / (last - first token time);
//! - `ttft_ms_p50/p99` (from submission), `itl_ms_p50/p99` (gaps between a sequence's tokens);
//! - the KV pool (`kv_blocks`, `kv_tokens`), `preemptions`, and `prefix_hit_rate` (prompt
//!   tokens served by the prefix cache / prompt tokens looked up).
//!
//! With `--shared-prefix`, the first sequence is submitted alone and the others when it has
//! its first token (a shared system prompt that is already cached); each sequence's times count
//! from its own submission, and `ttft_first_ms` / `ttft_rest_ms_p50` set them side by side.
//! (For llama.cpp all sequences go at once: it has no prefix cache across sequences here.)
//!
//! Every repetition runs in a fresh worker process, the models alternating, as in `bench`.

use std::time::Instant;

use anyhow::Result;
use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::serving::{Event, EventKind, Request, Serving};
use kylin_loader::{Format, KylinError, LoadOptions};
use serde::{Deserialize, Serialize};

use crate::args::BenchWorkerArgs;
use crate::bench::{bench_prompt_seeded, median, peak_rss_mb};
use crate::open::{engine_options, threads};

/// What one worker measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConcurrentSample {
    pub model: String,
    pub backend: String,
    pub threads: usize,
    /// Arithmetic of the matrix products (`f32`, `bf16`; llama.cpp: `ggml`).
    #[serde(default)]
    pub precision: String,
    /// Kernel family running them.
    #[serde(default)]
    pub kernels: String,
    pub concurrency: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub shared_prefix: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub load_ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub aggregate_decode_tok_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub decode_tok_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub ttft_ms_p50: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub ttft_ms_p99: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub itl_ms_p50: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub itl_ms_p99: f64,
    /// The longest gap between two tokens of one of the `N` sequences.
    #[serde(deserialize_with = "nan_if_null")]
    pub itl_ms_max: f64,
    /// With `--late-prompt-tokens`: time to first token of the late request.
    pub late_ttft_ms: Option<f64>,
    /// From submission to the last token of the last sequence.
    #[serde(deserialize_with = "nan_if_null")]
    pub total_s: f64,
    pub kv_blocks: Option<usize>,
    pub kv_tokens: Option<usize>,
    pub kv_dtype: Option<String>,
    pub preemptions: Option<u64>,
    pub prefix_hit_rate: Option<f64>,
    /// With `--speculative-tokens`: the share of proposed tokens the verification accepted.
    pub spec_acceptance_rate: Option<f64>,
    /// Time to first token of the first sequence and the median of the others (shared prefix).
    #[serde(deserialize_with = "nan_if_null")]
    pub ttft_first_ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub ttft_rest_ms_p50: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub peak_rss_mb: f64,
    /// Weights + KV pool + planned activations, MiB (what peak RSS should stay near).
    pub planned_mb: Option<f64>,
}

impl ConcurrentSample {
    /// The figures every backend reports, from the token times (seconds from the start) and the
    /// submission times of the sequences; the engine-specific ones are left empty.
    fn measured(
        args: &BenchWorkerArgs,
        n: usize,
        threads: usize,
        backend: &str,
        load_ms: f64,
        times: &[Vec<f64>],
        submitted: &[f64],
    ) -> Self {
        let (aggregate, per_seq, [t50, t99, i50, i99, imax], total, first, rest) = summarize(times, submitted);
        ConcurrentSample {
            model: args.model.model.display().to_string(),
            backend: backend.to_string(),
            threads,
            precision: String::new(),
            kernels: String::new(),
            concurrency: n,
            prompt_tokens: args.prompt_tokens,
            gen_tokens: args.gen_tokens,
            shared_prefix: args.shared_prefix,
            load_ms,
            aggregate_decode_tok_s: aggregate,
            decode_tok_s: per_seq,
            ttft_ms_p50: t50,
            ttft_ms_p99: t99,
            itl_ms_p50: i50,
            itl_ms_p99: i99,
            itl_ms_max: imax,
            late_ttft_ms: None,
            total_s: total,
            kv_blocks: None,
            kv_tokens: None,
            kv_dtype: None,
            preemptions: None,
            prefix_hit_rate: None,
            spec_acceptance_rate: None,
            ttft_first_ms: first,
            ttft_rest_ms_p50: rest,
            peak_rss_mb: peak_rss_mb(),
            planned_mb: None,
        }
    }
}

/// Reads an f64 that JSON wrote as `null` (serde_json writes NaN so) back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// The `p`-th percentile (0..=100) by nearest rank.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// The figures from every sequence's token arrival times (seconds from the start) and the time
/// each sequence was submitted.
fn summarize(times: &[Vec<f64>], submitted: &[f64]) -> (f64, f64, [f64; 5], f64, f64, f64) {
    let firsts: Vec<f64> = times.iter().filter_map(|t| t.first().copied()).collect();
    let steady_from = firsts.iter().copied().fold(0.0, f64::max);
    let end = times.iter().filter_map(|t| t.last().copied()).fold(0.0, f64::max);
    let steady_tokens: usize = times.iter().map(|t| t.iter().filter(|&&x| x > steady_from).count()).sum();
    let aggregate = if end > steady_from { steady_tokens as f64 / (end - steady_from) } else { f64::NAN };
    let per_seq: Vec<f64> = times
        .iter()
        .filter(|t| t.len() > 1)
        .map(|t| (t.len() - 1) as f64 / (t[t.len() - 1] - t[0]).max(1e-9))
        .collect();
    let itl: Vec<f64> = times.iter().flat_map(|t| t.windows(2).map(|w| (w[1] - w[0]) * 1e3)).collect();
    let ttft: Vec<f64> = times.iter().zip(submitted).filter_map(|(t, s)| t.first().map(|f| (f - s) * 1e3)).collect();
    let rest: Vec<f64> = ttft.iter().skip(1).copied().collect();
    (
        aggregate,
        median(per_seq),
        [
            percentile(&ttft, 50.0),
            percentile(&ttft, 99.0),
            percentile(&itl, 50.0),
            percentile(&itl, 99.0),
            itl.iter().copied().fold(f64::NAN, f64::max),
        ],
        end,
        ttft.first().copied().unwrap_or(f64::NAN),
        if rest.is_empty() { f64::NAN } else { median(rest) },
    )
}

/// The prompts: distinct per sequence, the first `shared` tokens common to all.
fn prompts(n: usize, len: usize, shared: usize, vocab: usize) -> Vec<Vec<u32>> {
    let common = bench_prompt_seeded(shared.min(len), vocab, 0);
    (0..n)
        .map(|i| {
            let mut p = common.clone();
            p.extend(bench_prompt_seeded(len - common.len(), vocab, i as u64 + 1));
            p
        })
        .collect()
}

/// One repetition in this process: load, warm up, submit every sequence, print one JSON object.
pub fn worker(args: &BenchWorkerArgs, n: usize) -> Result<()> {
    let mut model_args = args.model.clone();
    if model_args.ctx_size.is_none() {
        model_args.ctx_size = Some(args.prompt_tokens.max(args.late_prompt_tokens) + args.gen_tokens + 1);
    }
    let threads = threads(&model_args)?;
    crate::sigbus::watch(&model_args.model);
    let format = kylin_loader::detect(&model_args.model)?;
    let started = Instant::now();
    let sample = if matches!(format, Format::Gguf { .. }) {
        gguf_worker(args, n, threads, started)?
    } else {
        let load = LoadOptions { prefetch: true, mtp: model_args.engine.mtp, ..LoadOptions::default() };
        let model = kylin_loader::load(&model_args.model, &load)?;
        // Room for every sequence, and for the late request too.
        // Memory resident from the start, as in the server.
        let opts = EngineOptions {
            prefault: true,
            ..engine_options(&model_args, threads, n + usize::from(args.late_prompt_tokens > 0))?
        };
        let mut engine = BatchEngine::new(model, &opts)?;
        let load_ms = started.elapsed().as_secs_f64() * 1e3;
        let info = engine.info();
        let vocab = info.vocab_size;
        let core = engine.core();
        let draft = engine.draft().map_or(0, |d| d.model().weight_bytes_resident() + d.kv_bytes())
            + engine.mtp().map_or(0, |m| m.kv_bytes());
        let planned = core.model().weight_bytes_resident()
            + core.kv_bytes()
            + core.state_bytes()
            + core.activation_bytes()
            + draft;

        // Warm-up: every code path once, with a prompt no measured one begins with.
        let warm: Vec<u32> = bench_prompt_seeded(16, vocab, u64::MAX);
        let mut events: Vec<Event> = Vec::with_capacity(4 * n);
        engine.add_request(ids_request(u64::MAX, warm, 2))?;
        while engine.has_work() {
            events.clear();
            engine.step(&mut events)?;
        }

        let before = engine.stats();
        let t0 = Instant::now();
        // With a shared prefix, the first request goes alone and the others follow once it has
        // its first token (a system prompt already in the cache); otherwise all go at once.
        // Times are measured from each request's own submission.
        let mut pending: Vec<(usize, Vec<u32>)> =
            prompts(n, args.prompt_tokens, args.shared_prefix, vocab).into_iter().enumerate().collect();
        let mut submitted = vec![0.0f64; n];
        let later = if args.shared_prefix > 0 { pending.split_off(1) } else { Vec::new() };
        for (i, p) in pending {
            engine.add_request(ids_request(i as u64, p, args.gen_tokens))?;
        }
        let mut later = Some(later).filter(|l| !l.is_empty());
        let late_id = n as u64;
        let mut late: Option<(f64, Option<f64>)> = None;
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(args.gen_tokens); n];
        while engine.has_work() {
            events.clear();
            engine.step(&mut events)?;
            let now = t0.elapsed().as_secs_f64();
            for e in &events {
                if let EventKind::Token { .. } = e.kind {
                    if e.request == late_id {
                        if let Some((at, first @ None)) = late.as_mut() {
                            *first = Some(now - *at);
                        }
                        continue;
                    }
                    times[e.request as usize].push(now);
                }
            }
            // Every sequence decodes: the late request arrives.
            if args.late_prompt_tokens > 0 && late.is_none() && later.is_none() && times.iter().all(|t| t.len() >= 2) {
                let prompt = bench_prompt_seeded(args.late_prompt_tokens, vocab, u64::MAX - 1);
                late = Some((now, None));
                engine.add_request(ids_request(late_id, prompt, 1))?;
            }
            if !times[0].is_empty()
                && let Some(rest) = later.take()
            {
                let at = t0.elapsed().as_secs_f64();
                for (i, p) in rest {
                    submitted[i] = at;
                    engine.add_request(ids_request(i as u64, p, args.gen_tokens))?;
                }
            }
        }
        let after = engine.stats();
        let late_ttft_ms = late.and_then(|(_, first)| first).map(|s| s * 1e3);
        let queries = after.prefix_cache_queries - before.prefix_cache_queries;
        let hits = after.prefix_cache_hits - before.prefix_cache_hits;
        let proposed = after.speculative_proposed_tokens - before.speculative_proposed_tokens;
        let accepted = after.speculative_accepted_tokens - before.speculative_accepted_tokens;
        ConcurrentSample {
            late_ttft_ms,
            kv_blocks: Some(info.kv_blocks),
            kv_tokens: Some(info.kv_tokens),
            kv_dtype: Some(info.kv_dtype),
            preemptions: Some(after.preemptions - before.preemptions),
            prefix_hit_rate: (queries > 0).then(|| hits as f64 / queries as f64),
            spec_acceptance_rate: (proposed > 0).then(|| accepted as f64 / proposed as f64),
            planned_mb: Some(planned as f64 / (1u64 << 20) as f64),
            precision: info.precision.clone(),
            kernels: info.kernels.clone(),
            ..ConcurrentSample::measured(args, n, threads, "kylin", load_ms, &times, &submitted)
        }
    };
    println!("{}", serde_json::to_string(&sample)?);
    Ok(())
}

/// A greedy request that streams ids only and ignores EOS.
fn ids_request(id: u64, prompt: Vec<u32>, gen_tokens: usize) -> Request {
    let mut r = Request::new(id, prompt, gen_tokens);
    r.detokenize = false;
    r.ignore_eos = true;
    r
}

#[cfg(feature = "llamacpp")]
fn gguf_worker(args: &BenchWorkerArgs, n: usize, threads: usize, _started: Instant) -> Result<ConcurrentSample> {
    let info = kylin_loader::read_gguf_info(&args.model.model)?;
    let vocab = info.vocab_size.and_then(|v| usize::try_from(v).ok()).unwrap_or(32_000);
    let prompts = prompts(n, args.prompt_tokens, args.shared_prefix, vocab);
    let run = kylin_llamacpp::concurrent::run_concurrent(
        &args.model.model,
        threads,
        &prompts,
        args.gen_tokens,
        crate::open::flash_attention(args.model.flash_attn),
    )?;
    let times: Vec<Vec<f64>> = run.sequences.into_iter().map(|s| s.token_times).collect();
    Ok(ConcurrentSample {
        precision: "ggml".to_string(),
        kernels: run.kernels,
        ..ConcurrentSample::measured(args, n, threads, "llama.cpp", run.load_ms, &times, &vec![0.0; n])
    })
}

#[cfg(not(feature = "llamacpp"))]
fn gguf_worker(args: &BenchWorkerArgs, _n: usize, _threads: usize, _started: Instant) -> Result<ConcurrentSample> {
    Err(KylinError::operator_unsupported(format!(
        "{} is a GGUF file, which runs through llama.cpp, but this kylin was built without the `llamacpp` feature",
        args.model.model.display()
    ))
    .into())
}

/// Medians over repetitions of one model.
pub fn summarize_samples(samples: &[ConcurrentSample]) -> serde_json::Value {
    let m = |f: fn(&ConcurrentSample) -> f64| median(samples.iter().map(f).collect());
    let first = &samples[0];
    serde_json::json!({
        "model": first.model,
        "backend": first.backend,
        "threads": first.threads,
        "precision": first.precision,
        "kernels": first.kernels,
        "concurrency": first.concurrency,
        "prompt_tokens": first.prompt_tokens,
        "gen_tokens": first.gen_tokens,
        "shared_prefix": first.shared_prefix,
        "load_ms": m(|s| s.load_ms),
        "aggregate_decode_tok_s": m(|s| s.aggregate_decode_tok_s),
        "decode_tok_s": m(|s| s.decode_tok_s),
        "ttft_ms_p50": m(|s| s.ttft_ms_p50),
        "ttft_ms_p99": m(|s| s.ttft_ms_p99),
        "itl_ms_p50": m(|s| s.itl_ms_p50),
        "itl_ms_p99": m(|s| s.itl_ms_p99),
        "itl_ms_max": m(|s| s.itl_ms_max),
        "late_ttft_ms": first.late_ttft_ms.map(|_| m(|s| s.late_ttft_ms.unwrap_or(f64::NAN))),
        "ttft_first_ms": m(|s| s.ttft_first_ms),
        "ttft_rest_ms_p50": m(|s| s.ttft_rest_ms_p50),
        "total_s": m(|s| s.total_s),
        "kv_blocks": first.kv_blocks,
        "kv_tokens": first.kv_tokens,
        "kv_dtype": first.kv_dtype,
        "preemptions": first.preemptions.map(|_| m(|s| s.preemptions.unwrap_or(0) as f64)),
        "prefix_hit_rate": first.prefix_hit_rate.map(|_| m(|s| s.prefix_hit_rate.unwrap_or(f64::NAN))),
        "spec_acceptance_rate": first.spec_acceptance_rate.map(|_| m(|s| s.spec_acceptance_rate.unwrap_or(f64::NAN))),
        "peak_rss_mb": m(|s| s.peak_rss_mb),
        "planned_mb": first.planned_mb,
        "samples": samples,
    })
}

/// `--concurrency` input checks.
pub fn check(n: usize, prompt_tokens: usize, shared: usize) -> Result<()> {
    if n == 0 || n > 256 {
        return Err(KylinError::input_invalid(format!("--concurrency must be between 1 and 256; got {n}")).into());
    }
    if shared > prompt_tokens {
        return Err(KylinError::input_invalid(format!(
            "--shared-prefix {shared} is longer than --prompt-tokens {prompt_tokens}"
        ))
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_decode_starts_when_the_last_sequence_has_its_first_token() {
        // Two sequences: first tokens at 1 s and 2 s, then one token every 0.5 s.
        let times = vec![vec![1.0, 1.5, 2.0, 2.5, 3.0], vec![2.0, 2.5, 3.0]];
        let (aggregate, per_seq, [t50, _, i50, _, _], total, first, rest) = summarize(&times, &[0.0, 0.0]);
        // After 2 s: 2.5, 3.0 (first) and 2.5, 3.0 (second) = 4 tokens in 1 s.
        assert!((aggregate - 4.0).abs() < 1e-9);
        assert!((per_seq - 2.0).abs() < 1e-9);
        assert_eq!((t50, i50, total, first, rest), (1000.0, 500.0, 3.0, 1000.0, 2000.0));
    }

    #[test]
    fn prompts_share_exactly_the_prefix() {
        let p = prompts(3, 20, 8, 1000);
        assert!(p.iter().all(|x| x.len() == 20 && x[..8] == p[0][..8]));
        assert_ne!(p[0][8..], p[1][8..]);
    }

    #[test]
    fn percentile_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((percentile(&v, 50.0), percentile(&v, 99.0)), (50.0, 99.0));
    }
}
