//! `kylin bench`: load time, time to first token, prefill and decode speed, peak memory.
//!
//! Every measured repetition runs in a fresh `kylin bench-worker` process, so that load time and
//! peak RSS belong to one model alone. With `--vs`, the two models alternate (warm-up A, warm-up
//! B, then A B A B ...), so a noisy machine slows both alike and the ratios hold. The parent
//! reports the median of each figure and the ratios A / B.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use kylin_engine::Backend;
use kylin_loader::KylinError;
use serde::{Deserialize, Serialize};

use crate::args::{BackendChoice, BenchArgs, BenchWorkerArgs, ModelArgs};
use crate::open::{open_with, threads};
use kylin_engine::sampler::argmax;

/// What one worker measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchSample {
    pub model: String,
    pub backend: String,
    pub architecture: String,
    pub threads: usize,
    /// Arithmetic of the matrix products (`f32`, `bf16`; llama.cpp: `ggml`).
    pub precision: String,
    /// Kernel family running them (`amx-bf16`, `avx512`, …; llama.cpp: its build's features).
    pub kernels: String,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// Path to ready backend (weights, tokenizer, buffers).
    pub load_ms: f64,
    /// Part of `load_ms` spent on the tokenizer, where known.
    pub tokenizer_ms: Option<f64>,
    /// Part of `load_ms` spent quantizing the weights (`--quantize`).
    pub quantize_ms: Option<f64>,
    /// Prefill of the prompt plus choosing the first token.
    pub ttft_ms: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// VmHWM of the worker process.
    pub peak_rss_mb: f64,
    pub weight_bytes_per_token: u64,
    /// Weight bytes read per generated token × decode tokens/s.
    pub decode_gb_s: f64,
    /// `decode_gb_s` plus the KV cache read by attention (at the mean decode position), where
    /// the backend reports its cache layout.
    pub decode_with_kv_gb_s: Option<f64>,
}

/// Medians over the measured repetitions of one model.
#[derive(Debug, Clone, Serialize)]
pub struct BenchSummary {
    pub model: String,
    pub backend: String,
    pub architecture: String,
    pub threads: usize,
    pub precision: String,
    pub kernels: String,
    pub load_ms: f64,
    pub tokenizer_ms: Option<f64>,
    pub quantize_ms: Option<f64>,
    pub ttft_ms: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub peak_rss_mb: f64,
    pub weight_bytes_per_token: u64,
    pub decode_gb_s: f64,
    /// `decode_gb_s` as a fraction of the machine's measured read bandwidth.
    pub decode_bandwidth_fraction: f64,
    /// Weights and KV cache read per second of decode, where the backend reports its cache.
    pub decode_with_kv_gb_s: Option<f64>,
    pub samples: Vec<BenchSample>,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.repetitions == 0 {
        return Err(
            KylinError::input_invalid("--prompt-tokens, --gen-tokens and --repetitions must be at least 1").into()
        );
    }
    if let Some(n) = args.concurrency {
        crate::bench_concurrent::check(n, args.prompt_tokens, args.shared_prefix)?;
    }
    let threads = threads(&args.model)?;
    let mut models = vec![args.model.clone()];
    if let Some(vs) = &args.vs {
        let mut b = args.model.clone();
        b.model = vs.clone();
        b.backend = args.vs_backend;
        // `--precision` chooses the native engine's arithmetic; the peer keeps its own.
        b.engine.precision = None;
        b.engine.quantize = None;
        models.push(b);
    }
    // `--flash-attn` configures llama.cpp: it goes to the GGUF side of a `--vs` run, and is an
    // error only when no model runs on llama.cpp.
    let on_llama: Vec<bool> = models.iter().map(crate::open::runs_on_llama_cpp).collect();
    if on_llama.contains(&true) {
        for (m, _) in models.iter_mut().zip(&on_llama).filter(|(_, on)| !**on) {
            m.flash_attn = crate::args::FlashAttnArg::Auto;
        }
    } else {
        crate::open::refuse_flash_attn(&args.model)?;
    }

    // The machine's read bandwidth with the same threads, the decode ceiling, is measured before
    // every round: on a shared machine it moves with the neighbours' load, so the median over the
    // rounds is set against the decode figures of the same rounds.
    let pool = kylin_kernels::ThreadPool::new(threads);
    let mut bandwidths = Vec::new();

    if args.concurrency.is_some() {
        drop(pool);
        return run_concurrent(&args, &models, threads);
    }
    // One warm-up round (page cache, CPU frequency) unless `--no-warmup`, then alternating
    // measured rounds.
    let mut samples: Vec<Vec<BenchSample>> = vec![Vec::new(); models.len()];
    for round in usize::from(args.no_warmup)..=args.repetitions {
        let gb_s = kylin_kernels::measure_read_bandwidth(&pool, 1 << 30, 3);
        if !args.json {
            eprintln!("round {round}: machine read bandwidth {gb_s:.1} GB/s ({threads} threads)");
        }
        if round > 0 {
            bandwidths.push(gb_s);
        }
        for (i, model) in models.iter().enumerate() {
            let sample = spawn_worker(model, threads, &args)?;
            if !args.json {
                let label = if round == 0 { "warm-up".to_string() } else { format!("run {round}") };
                eprintln!(
                    "{label:>8} {:<10} prefill {:>7.1} tok/s  decode {:>6.2} tok/s  load {:>7.1} ms  rss {:>7.1} MB",
                    sample.backend, sample.prefill_tok_s, sample.decode_tok_s, sample.load_ms, sample.peak_rss_mb
                );
            }
            if round > 0 {
                samples[i].push(sample);
            }
        }
    }
    drop(pool);
    let read_gb_s = median(bandwidths);
    let summaries: Vec<BenchSummary> = samples.into_iter().map(|s| summarize(s, read_gb_s)).collect();
    let ratios = (summaries.len() == 2).then(|| ratios(&summaries[0], &summaries[1]));

    if args.json {
        let a = &summaries[0];
        let out = serde_json::json!({
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "repetitions": args.repetitions,
            "threads": threads,
            "machine_read_gb_s": read_gb_s,
            "load_ms": a.load_ms,
            "tokenizer_ms": a.tokenizer_ms,
            "quantize_ms": a.quantize_ms,
            "ttft_ms": a.ttft_ms,
            "prefill_tok_s": a.prefill_tok_s,
            "decode_tok_s": a.decode_tok_s,
            "peak_rss_mb": a.peak_rss_mb,
            "decode_gb_s": a.decode_gb_s,
            "decode_bandwidth_fraction": a.decode_bandwidth_fraction,
            "decode_with_kv_gb_s": a.decode_with_kv_gb_s,
            "results": summaries,
            "ratios": ratios,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&summaries, ratios.as_ref(), &args, read_gb_s);
    }
    Ok(())
}

/// `--concurrency`: alternating rounds of concurrent workers, then medians, ratios and a table.
fn run_concurrent(args: &BenchArgs, models: &[ModelArgs], threads: usize) -> Result<()> {
    use crate::bench_concurrent::{ConcurrentSample, summarize_samples};
    let mut samples: Vec<Vec<ConcurrentSample>> = vec![Vec::new(); models.len()];
    for round in usize::from(args.no_warmup)..=args.repetitions {
        for (i, model) in models.iter().enumerate() {
            let value = spawn_worker_json(model, threads, args)?;
            let sample: ConcurrentSample = serde_json::from_value(value)?;
            if !args.json {
                let label = if round == 0 { "warm-up".to_string() } else { format!("run {round}") };
                eprintln!(
                    "{label:>8} {:<10} aggregate decode {:>7.1} tok/s  ttft p50 {:>8.1} ms  itl p99 {:>7.1} ms",
                    sample.backend, sample.aggregate_decode_tok_s, sample.ttft_ms_p50, sample.itl_ms_p99
                );
            }
            if round > 0 {
                samples[i].push(sample);
            }
        }
    }
    let summaries: Vec<serde_json::Value> = samples.iter().map(|s| summarize_samples(s)).collect();
    let figure = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_f64()).unwrap_or(f64::NAN);
    let ratio = (summaries.len() == 2).then(|| {
        serde_json::json!({
            "aggregate_decode_tok_s": figure(&summaries[0], "aggregate_decode_tok_s") / figure(&summaries[1], "aggregate_decode_tok_s"),
            "ttft_ms_p50": figure(&summaries[0], "ttft_ms_p50") / figure(&summaries[1], "ttft_ms_p50"),
            "itl_ms_p99": figure(&summaries[0], "itl_ms_p99") / figure(&summaries[1], "itl_ms_p99"),
        })
    });
    if args.json {
        let a = &summaries[0];
        let mut out = a.clone();
        if let Some(obj) = out.as_object_mut() {
            obj.insert("repetitions".into(), args.repetitions.into());
            obj.insert("results".into(), serde_json::Value::Array(summaries.clone()));
            obj.insert("ratios".into(), ratio.clone().unwrap_or(serde_json::Value::Null));
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "kylin bench: {} sequences at once, {} prompt tokens ({} shared), {} generated each, {} threads, median of {} runs",
        args.concurrency.unwrap_or(1),
        args.prompt_tokens,
        args.shared_prefix,
        args.gen_tokens,
        threads,
        args.repetitions
    );
    println!(
        "{:<10} {:>10} {:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>11} {:>8}",
        "backend",
        "agg tok/s",
        "seq tok/s",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99",
        "kv blocks",
        "preemptions",
        "rss MB"
    );
    for s in &summaries {
        let opt = |k: &str| s.get(k).and_then(|x| x.as_f64()).map_or("-".to_string(), |v| format!("{v:.0}"));
        println!(
            "{:<10} {:>10.1} {:>9.2} {:>8.1}ms {:>8.1}ms {:>7.1}ms {:>7.1}ms {:>9} {:>11} {:>8.1}",
            s["backend"].as_str().unwrap_or("?"),
            figure(s, "aggregate_decode_tok_s"),
            figure(s, "decode_tok_s"),
            figure(s, "ttft_ms_p50"),
            figure(s, "ttft_ms_p99"),
            figure(s, "itl_ms_p50"),
            figure(s, "itl_ms_p99"),
            opt("kv_blocks"),
            opt("preemptions"),
            figure(s, "peak_rss_mb"),
        );
        if let Some(late) = s.get("late_ttft_ms").and_then(|x| x.as_f64()) {
            println!(
                "{}: a late {}-token request got its first token after {:.1} ms; the decoding sequences' longest gap was {:.1} ms (p99 {:.1} ms)",
                s["backend"].as_str().unwrap_or("?"),
                args.late_prompt_tokens,
                late,
                figure(s, "itl_ms_max"),
                figure(s, "itl_ms_p99")
            );
        }
        if let Some(rate) = s.get("prefix_hit_rate").and_then(|x| x.as_f64()).filter(|_| args.shared_prefix > 0) {
            println!(
                "{}: prefix hit rate {:.1}%, ttft of the first request {:.1} ms, of the others (median) {:.1} ms",
                s["backend"].as_str().unwrap_or("?"),
                rate * 100.0,
                figure(s, "ttft_first_ms"),
                figure(s, "ttft_rest_ms_p50")
            );
        }
    }
    for s in &summaries {
        let text = |k: &str| s.get(k).and_then(|x| x.as_str()).filter(|t| !t.is_empty());
        if let (Some(precision), Some(kernels)) = (text("precision"), text("kernels")) {
            println!("{}: precision {precision}, kernels {kernels}", s["backend"].as_str().unwrap_or("?"));
        }
    }
    if let Some(r) = ratio {
        println!(
            "ratio A/B: aggregate decode {:.2}x, ttft p50 {:.2}x, itl p99 {:.2}x",
            figure(&r, "aggregate_decode_tok_s"),
            figure(&r, "ttft_ms_p50"),
            figure(&r, "itl_ms_p99")
        );
    }
    Ok(())
}

/// Ratios A / B of the figures where bigger is better, and of the costs.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRatios {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub ttft_ms: f64,
    pub load_ms: f64,
    pub peak_rss_mb: f64,
}

fn ratios(a: &BenchSummary, b: &BenchSummary) -> BenchRatios {
    let r = |x: f64, y: f64| if y > 0.0 { x / y } else { f64::NAN };
    BenchRatios {
        prefill_tok_s: r(a.prefill_tok_s, b.prefill_tok_s),
        decode_tok_s: r(a.decode_tok_s, b.decode_tok_s),
        ttft_ms: r(a.ttft_ms, b.ttft_ms),
        load_ms: r(a.load_ms, b.load_ms),
        peak_rss_mb: r(a.peak_rss_mb, b.peak_rss_mb),
    }
}

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2.0 }
}

fn summarize(samples: Vec<BenchSample>, read_gb_s: f64) -> BenchSummary {
    let m = |f: fn(&BenchSample) -> f64| median(samples.iter().map(f).collect());
    let first = samples[0].clone();
    let decode_gb_s = m(|s| s.decode_gb_s);
    let tokenizer_ms = first.tokenizer_ms.map(|_| m(|s| s.tokenizer_ms.unwrap_or(f64::NAN)));
    let quantize_ms = first.quantize_ms.map(|_| m(|s| s.quantize_ms.unwrap_or(f64::NAN)));
    BenchSummary {
        model: first.model,
        backend: first.backend,
        architecture: first.architecture,
        threads: first.threads,
        precision: first.precision,
        kernels: first.kernels,
        load_ms: m(|s| s.load_ms),
        tokenizer_ms,
        quantize_ms,
        ttft_ms: m(|s| s.ttft_ms),
        prefill_tok_s: m(|s| s.prefill_tok_s),
        decode_tok_s: m(|s| s.decode_tok_s),
        peak_rss_mb: m(|s| s.peak_rss_mb),
        weight_bytes_per_token: first.weight_bytes_per_token,
        decode_gb_s,
        decode_bandwidth_fraction: decode_gb_s / read_gb_s,
        decode_with_kv_gb_s: first.decode_with_kv_gb_s.map(|_| m(|s| s.decode_with_kv_gb_s.unwrap_or(f64::NAN))),
        samples,
    }
}

fn print_table(summaries: &[BenchSummary], ratios: Option<&BenchRatios>, args: &BenchArgs, read_gb_s: f64) {
    println!(
        "kylin bench: {} prompt tokens, {} generated, {} threads, median of {} runs ({}); machine read bandwidth {:.1} GB/s",
        args.prompt_tokens,
        args.gen_tokens,
        summaries[0].threads,
        args.repetitions,
        if args.no_warmup { "no warm-up" } else { "after a warm-up" },
        read_gb_s
    );
    println!(
        "{:<10} {:>9} {:>9} {:>12} {:>11} {:>9} {:>10} {:>9}  model",
        "backend", "load ms", "ttft ms", "prefill t/s", "decode t/s", "decode GB/s", "of peak", "rss MB"
    );
    for s in summaries {
        println!(
            "{:<10} {:>9.1} {:>9.1} {:>12.1} {:>11.2} {:>9.1} {:>9.0}% {:>9.1}  {}",
            s.backend,
            s.load_ms,
            s.ttft_ms,
            s.prefill_tok_s,
            s.decode_tok_s,
            s.decode_gb_s,
            s.decode_bandwidth_fraction * 100.0,
            s.peak_rss_mb,
            s.model
        );
    }
    for s in summaries {
        println!("{}: precision {}, kernels {}", s.backend, s.precision, s.kernels);
        match (s.tokenizer_ms, s.quantize_ms) {
            (Some(tok), Some(q)) => println!(
                "{}: load {:.0} ms, of which the tokenizer {:.0} ms and quantization {:.0} ms",
                s.backend, s.load_ms, tok, q
            ),
            (Some(tok), None) => {
                println!("{}: load {:.0} ms, of which the tokenizer {:.0} ms", s.backend, s.load_ms, tok)
            }
            _ => {}
        }
        if let Some(total) = s.decode_with_kv_gb_s {
            println!(
                "{}: decode reads {:.1} GB/s of weights and KV cache together ({:.0}% of the machine's)",
                s.backend,
                total,
                total / read_gb_s * 100.0
            );
        }
    }
    if let Some(r) = ratios {
        println!(
            "ratio A/B: prefill {:.2}x, decode {:.2}x, ttft {:.2}x, load {:.2}x, peak rss {:.2}x",
            r.prefill_tok_s, r.decode_tok_s, r.ttft_ms, r.load_ms, r.peak_rss_mb
        );
    }
}

fn backend_flag(choice: BackendChoice) -> &'static str {
    match choice {
        BackendChoice::Auto => "auto",
        BackendChoice::Native => "native",
        BackendChoice::LlamaCpp => "llama.cpp",
    }
}

/// Runs one repetition in a fresh process and reads its JSON.
fn spawn_worker(model: &ModelArgs, threads: usize, args: &BenchArgs) -> Result<BenchSample> {
    Ok(serde_json::from_value(spawn_worker_json(model, threads, args)?)?)
}

/// Runs one repetition in a fresh process and returns its JSON object.
fn spawn_worker_json(model: &ModelArgs, threads: usize, args: &BenchArgs) -> Result<serde_json::Value> {
    let exe = std::env::current_exe().context("cannot find the kylin executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("bench-worker")
        .arg(&model.model)
        .args(["--backend", backend_flag(model.backend)])
        .args(["--threads", &threads.to_string()])
        .args(["--prompt-tokens", &args.prompt_tokens.to_string()])
        .args(["--gen-tokens", &args.gen_tokens.to_string()]);
    if let Some(ctx) = model.ctx_size {
        cmd.args(["--ctx-size", &ctx.to_string()]);
    }
    cmd.args(["--flash-attn", &crate::args::flag_value(&model.flash_attn)]);
    if let Some(map) = &model.tensor_map {
        cmd.arg("--tensor-map").arg(map);
    }
    if let Some(n) = args.concurrency {
        cmd.args(["--concurrency", &n.to_string()])
            .args(["--shared-prefix", &args.shared_prefix.to_string()])
            .args(["--late-prompt-tokens", &args.late_prompt_tokens.to_string()]);
    }
    let e = &model.engine;
    for (flag, value) in [
        ("--kv-memory", e.kv_memory.clone()),
        ("--memory-fraction", e.memory_fraction.map(|f| f.to_string())),
        ("--max-seqs", e.max_seqs.map(|v| v.to_string())),
        ("--max-batch-tokens", e.max_batch_tokens.map(|v| v.to_string())),
        ("--kv-block-size", e.kv_block_size.map(|v| v.to_string())),
        ("--kv-dtype", e.kv_dtype.map(|d| crate::args::flag_value(&d))),
        ("--precision", e.precision.map(|p| crate::args::flag_value(&p))),
        ("--quantize", e.quantize.map(|q| crate::args::flag_value(&q))),
        ("--speculative-tokens", e.speculative_tokens.map(|v| v.to_string())),
        ("--speculative-step-tokens", e.speculative_step_tokens.map(|v| v.to_string())),
    ] {
        if let Some(v) = value {
            cmd.args([flag, &v]);
        }
    }
    if let Some(draft) = &e.draft_model {
        cmd.arg("--draft-model").arg(draft);
    }
    if e.mtp {
        cmd.arg("--mtp");
    }
    let output = cmd.env("KYLIN_QUIET", "1").output().context("cannot start a bench worker")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let value: serde_json::Value = serde_json::from_str(stdout.trim()).map_err(|_| {
        KylinError::backend_failed(format!(
            "bench worker for {} failed (exit {:?}): {}{}",
            model.model.display(),
            output.status.code(),
            stdout.trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    })?;
    if let Some(err) = value.get("error") {
        let code = err.get("code").and_then(|c| c.as_str()).unwrap_or("ERROR");
        let message = err.get("message").and_then(|c| c.as_str()).unwrap_or("");
        return Err(anyhow::anyhow!("[{code}] bench of {}: {message}", model.model.display()));
    }
    Ok(value)
}

/// Deterministic prompt ids spread over the ordinary part of the vocabulary, identical for both
/// models of a `--vs` run when they share a vocabulary.
fn bench_prompt(len: usize, vocab: usize) -> Vec<u32> {
    bench_prompt_seeded(len, vocab, 0)
}

/// The prompt of the single-sequence warm-up: as long as `prompt` up to 16 tokens (so that it
/// and its one decoded token fit the context the measured run needs), from another seed than
/// `prompt`, and with another first token (for any vocabulary of three tokens or more), so that
/// `prompt` shares no prefix with it. The warm-up once was `prompt`'s first 16 tokens: the
/// native engine's prefix cache then served them to the measured prefill, which computed 496 of
/// 512 tokens and was reported 3% faster than it was (BENCHMARKS.md).
fn warm_up_prompt(prompt: &[u32], vocab: usize) -> Vec<u32> {
    let mut warm = bench_prompt_seeded(prompt.len().min(16), vocab, u64::MAX);
    if let (Some(w), Some(&p)) = (warm.first_mut(), prompt.first())
        && *w == p
    {
        // Another id of the same range.
        *w = p % prompt_id_span(vocab) + 1;
    }
    warm
}

/// How many token ids benchmark prompts draw from: `1..=span`, the first 30,000 ids after 0 at
/// most (never 0, which is often a special token).
fn prompt_id_span(vocab: usize) -> u32 {
    vocab.clamp(2, 30_000) as u32 - 1
}

/// [`bench_prompt`] from another seed (seed 0 is `bench_prompt` itself).
pub(crate) fn bench_prompt_seeded(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let span = u64::from(prompt_id_span(vocab));
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (0..len)
        .map(|_| {
            // SplitMix64: deterministic and well spread.
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (1 + z % span) as u32
        })
        .collect()
}

/// Peak resident set size of this process in MB (VmHWM), 0 where /proc is unavailable.
pub fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// One repetition: load, (warm up), prefill, decode greedily; prints one JSON object.
pub fn worker(args: BenchWorkerArgs) -> Result<()> {
    if let Some(n) = args.concurrency {
        return crate::bench_concurrent::worker(&args, n);
    }
    let mut model = args.model.clone();
    if model.ctx_size.is_none() {
        model.ctx_size = Some(args.prompt_tokens + args.gen_tokens + 1);
    }
    let mut opened = open_with(&model, false, true)?;
    let backend: &mut dyn Backend = opened.backend.as_mut();
    let summary = backend.summary();
    let prompt = bench_prompt(args.prompt_tokens, backend.vocab_size());

    if !args.no_warmup {
        // Touch every weight page and every code path once, on a prompt the measured one shares
        // no prefix with, so that the prefix cache serves none of the measured prefill.
        let warm = warm_up_prompt(&prompt, backend.vocab_size());
        let first = argmax(backend.prefill(&warm)?);
        backend.decode(first)?;
        backend.reset();
    }

    let started = Instant::now();
    let mut next = argmax(backend.prefill(&prompt)?);
    let ttft = started.elapsed().as_secs_f64();
    let prefill_s = ttft;
    let decode_started = Instant::now();
    for _ in 0..args.gen_tokens {
        next = argmax(backend.decode(next)?);
    }
    let decode_s = decode_started.elapsed().as_secs_f64();
    let decode_tok_s = args.gen_tokens as f64 / decode_s;

    let sample = BenchSample {
        model: display_name(&args.model.model),
        backend: summary.backend,
        architecture: summary.architecture,
        threads: summary.threads,
        precision: summary.precision,
        kernels: summary.kernels,
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        load_ms: opened.load_ms,
        tokenizer_ms: opened.tokenizer_ms,
        quantize_ms: summary.quantize_ms,
        ttft_ms: ttft * 1e3,
        prefill_tok_s: args.prompt_tokens as f64 / prefill_s,
        decode_tok_s,
        peak_rss_mb: peak_rss_mb(),
        weight_bytes_per_token: summary.weight_bytes_per_token,
        decode_gb_s: summary.weight_bytes_per_token as f64 * decode_tok_s / 1e9,
        decode_with_kv_gb_s: summary.kv_bytes_per_position.map(|kv| {
            let mean_position = args.prompt_tokens as f64 + args.gen_tokens as f64 / 2.0;
            (summary.weight_bytes_per_token as f64 + kv as f64 * mean_position) * decode_tok_s / 1e9
        }),
    };
    println!("{}", serde_json::to_string(&sample)?);
    Ok(())
}

fn display_name(path: &Path) -> String {
    path.display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn bench_prompt_is_deterministic_and_in_range() {
        let a = bench_prompt(512, 151936);
        assert_eq!(a, bench_prompt(512, 151936));
        assert!(a.iter().all(|id| (1..30_000).contains(id)));
        assert!(bench_prompt(8, 5).iter().all(|&id| id < 5));
    }

    #[test]
    fn the_warm_up_shares_no_prefix_with_the_measured_prompt() {
        for vocab in [3, 4, 5, 100, 151936] {
            for len in [1, 16, 512] {
                let prompt = bench_prompt(len, vocab);
                let warm = warm_up_prompt(&prompt, vocab);
                assert_eq!(warm.len(), len.min(16));
                assert_ne!(warm[0], prompt[0], "vocab {vocab}, {len} tokens");
                assert!(warm.iter().all(|&id| (1..vocab as u32).contains(&id)), "vocab {vocab}: {warm:?}");
            }
        }
    }
}
