//! The continuous-batching engine: batch invariance, preemption under a small KV budget,
//! cancellation, prefix reuse, parallel sampling, and block accounting, on the tiny fixtures and
//! a real model.
//!
//! The same checks run in `--precision bf16` where the CPU has BF16 kernels.
//!
//! Token ids and log-probabilities (computed from the raw logits, so equal bits mean equal
//! logits) are compared bit for bit between a request run alone and the same request among
//! others.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kylin_engine::batch::{BatchEngine, EngineOptions, KvBudget};
use kylin_engine::sampler::SamplingParams;
use kylin_engine::serving::{Event, EventKind, Request, Serving, StopReason, TokenLogprob};
use kylin_engine::{PrecisionChoice, QuantFormat};

mod support;
use support::{prompt, request};

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

fn fixture(name: &str) -> PathBuf {
    Path::new(SHARED).join("fixtures").join(name)
}

fn engine(path: &Path, opts: EngineOptions) -> BatchEngine {
    let model = kylin_loader::load(path, &kylin_loader::LoadOptions::default()).unwrap();
    BatchEngine::new(model, &opts).unwrap()
}

fn options(threads: usize) -> EngineOptions {
    EngineOptions { threads, ctx_size: Some(256), ..EngineOptions::default() }
}

/// What one choice produced.
#[derive(Debug, Clone, PartialEq)]
struct Output {
    ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    reason: Option<StopReason>,
    cached: usize,
}

/// Steps until idle; returns every choice's output, keyed by (request, index).
fn drain(engine: &mut dyn Serving) -> BTreeMap<(u64, usize), Output> {
    let mut out: BTreeMap<(u64, usize), Output> = BTreeMap::new();
    drain_into(engine, &mut out);
    out
}

/// Steps until idle, adding to `out`.
fn drain_into(engine: &mut dyn Serving, out: &mut BTreeMap<(u64, usize), Output>) {
    let mut events: Vec<Event> = Vec::new();
    let mut steps = 0;
    while engine.has_work() {
        events.clear();
        engine.step(&mut events).unwrap();
        collect(&events, out);
        steps += 1;
        assert!(steps < 100_000, "the engine does not finish");
    }
}

fn collect(events: &[Event], out: &mut BTreeMap<(u64, usize), Output>) {
    for e in events {
        let o = out.entry((e.request, e.index)).or_insert(Output {
            ids: vec![],
            logprobs: vec![],
            reason: None,
            cached: 0,
        });
        match &e.kind {
            EventKind::Token { id, logprob, .. } => {
                assert!(o.reason.is_none(), "token after the end");
                o.ids.push(*id);
                if let Some(lp) = logprob {
                    o.logprobs.push(lp.clone());
                }
            }
            EventKind::PromptLogprobs { .. } => panic!("prompt log-probabilities nobody asked for"),
            EventKind::Pooled { .. } => panic!("pooled values nobody asked for"),
            EventKind::Finished { reason, usage, .. } => {
                assert!(o.reason.is_none(), "finished twice");
                o.reason = Some(*reason);
                o.cached = usage.cached_prompt_tokens;
                assert_eq!(usage.completion_tokens, o.ids.len());
            }
        }
    }
}

/// `requests` run one at a time on fresh engines.
fn alone(path: &Path, opts: &EngineOptions, requests: &[Request]) -> BTreeMap<(u64, usize), Output> {
    let mut all = BTreeMap::new();
    for r in requests {
        let mut e = engine(path, opts.clone());
        e.add_request(r.clone()).unwrap();
        all.extend(drain(&mut e));
    }
    all
}

fn assert_same(alone: &BTreeMap<(u64, usize), Output>, together: &BTreeMap<(u64, usize), Output>, what: &str) {
    assert_eq!(alone.len(), together.len(), "{what}: choice count");
    for (key, a) in alone {
        let b = &together[key];
        assert_eq!(a.ids, b.ids, "{what}: ids of request {key:?}");
        assert_eq!(a.reason, b.reason, "{what}: finish of request {key:?}");
        for (i, (x, y)) in a.logprobs.iter().zip(&b.logprobs).enumerate() {
            assert_eq!(x.logprob.to_bits(), y.logprob.to_bits(), "{what}: logprob {i} of request {key:?}");
            assert_eq!(x.top.len(), y.top.len());
            for (p, q) in x.top.iter().zip(&y.top) {
                assert_eq!((p.0, p.1.to_bits()), (q.0, q.1.to_bits()), "{what}: top logprob {i} of request {key:?}");
            }
        }
    }
}

fn assert_all_blocks_free(e: &BatchEngine) {
    let stats = e.stats();
    assert_eq!(stats.kv_blocks_used, 0, "blocks still referenced after all requests ended");
    assert_eq!(e.core().free_blocks(), e.core().total_blocks());
    assert_eq!((stats.running, stats.waiting), (0, 0));
}

#[test]
fn sixteen_requests_together_equal_each_alone_on_every_fixture() {
    for name in ["tiny-qwen3", "tiny-qwen2-f16", "tiny-llama-rope3", "tiny-qwen3-sharded-f32"] {
        let path = fixture(name);
        // Small steps so that prompts are chunked differently from when they run alone.
        let opts = EngineOptions { max_batch_tokens: 48, ..options(2) };
        let requests: Vec<Request> =
            (0..16).map(|i| request(i, prompt(3 + 11 * i as usize % 70, i + 1, 1000), 6 + i as usize % 5)).collect();
        let single = alone(&path, &opts, &requests);
        let mut e = engine(&path, opts.clone());
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        let together = drain(&mut e);
        assert_same(&single, &together, name);
        assert_all_blocks_free(&e);
        // Chunked into 48-token steps, every prompt took at least one step of its own.
        assert!(e.stats().steps > 16);
    }
}

/// A model quantized at load, over a BF16 KV cache (`--kv-dtype bf16`), attends on the BF16
/// path where the CPU has BF16 kernels (f32 elsewhere): sixteen requests together equal each
/// alone, bit for bit, and the first tokens (from the prompts' last logits) are the ones the
/// same model picks over its default F16 cache with f32 attention, their log-probabilities
/// 0.1 apart on average. (This random fixture is sensitive: f32 attention over a BF16 cache
/// is 0.037 from the F16 cache on average, up to 0.16; the BF16 path 0.044, up to 0.094.)
#[test]
fn quantized_models_attend_in_bf16_over_a_bf16_cache() {
    use kylin_kernels::WeightDType;
    // Head size 32: a shape the BF16 attention paths take.
    let path = fixture("tiny-qwen3-sharded-f32");
    let requests: Vec<Request> =
        (0..16).map(|i| request(i, prompt(3 + 11 * i as usize % 70, i + 1, 1000), 6 + i as usize % 5)).collect();
    for quantize in [QuantFormat::Q8_0, QuantFormat::Q4K] {
        let f16_cache = EngineOptions {
            max_batch_tokens: 48,
            quantize: Some(quantize),
            precision: PrecisionChoice::Auto,
            ..options(2)
        };
        let bf16_cache = EngineOptions { kv_dtype: Some(WeightDType::BF16), ..f16_cache.clone() };
        let mut e = engine(&path, bf16_cache.clone());
        let core = e.core();
        let report = core.model().kernels_report(core.kv_dtype(), core.block_size());
        let attention = match kylin_kernels::bf16_kernels() {
            Some(kylin_kernels::Bf16Kernels::Amx) => "attention amx-bf16",
            Some(kylin_kernels::Bf16Kernels::Avx512Bf16) => "attention avx512-bf16",
            None => "attention f32",
        };
        assert!(report.ends_with(attention), "{quantize:?} over a BF16 cache: kernels {report}");
        let what = format!("{quantize:?} over a BF16 cache");
        let single = alone(&path, &bf16_cache, &requests);
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        let together = drain(&mut e);
        assert_same(&single, &together, &what);
        assert_all_blocks_free(&e);
        let f32_attention = alone(&path, &f16_cache, &requests);
        let (mut same, mut distance) = (0, 0.0f32);
        for (key, a) in &together {
            let b = &f32_attention[key];
            same += usize::from(a.ids[0] == b.ids[0]);
            distance += (a.logprobs[0].logprob - b.logprobs[0].logprob).abs() / requests.len() as f32;
        }
        assert!(same >= 14 && distance < 0.1, "{what}: {same} of 16 first tokens the same, mean distance {distance}");
    }
}

/// Published quantized checkpoints on the default path (`q8_0_a16`, `q4_g_a16`, `f8_e4m3_a16`
/// where the CPU has AVX-512 BF16, and W8A8's `q8_0`): sixteen requests together equal each
/// alone, bit for bit, with prompts chunked differently.
#[test]
fn published_quantized_checkpoints_batch_invariantly() {
    let quantized = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/quantized");
    for name in
        ["tiny-qwen3-w4a16", "tiny-llama-fp8-block", "tiny-qwen3-w8a16", "tiny-llama-w8a8", "tiny-qwen3-moe-fp8"]
    {
        let path = Path::new(quantized).join(name);
        let opts = EngineOptions { max_batch_tokens: 48, precision: PrecisionChoice::Auto, ..options(2) };
        let requests: Vec<Request> =
            (0..16).map(|i| request(i, prompt(3 + 11 * i as usize % 70, i + 1, 500), 6 + i as usize % 5)).collect();
        let single = alone(&path, &opts, &requests);
        let mut e = engine(&path, opts.clone());
        let packing = e.core().model().quantization().map(|q| q.name());
        let a16 = kylin_kernels::w16::available() && !name.ends_with("w8a8");
        assert_eq!(packing.is_some_and(|p| p.ends_with("_a16")), a16, "{name}: packing {packing:?}");
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        let together = drain(&mut e);
        assert_same(&single, &together, name);
        assert_all_blocks_free(&e);
    }
}

#[test]
fn a_budget_for_three_sequences_finishes_eight_with_preemption() {
    let path = fixture("tiny-qwen2-f16");
    let per_block = support::f32_block_bytes(&path);
    // Context 64 = 4 blocks per sequence; 12 blocks hold three sequences.
    let opts =
        EngineOptions { ctx_size: Some(64), kv_budget: KvBudget::Bytes(12 * per_block), max_seqs: 8, ..options(2) };
    let requests: Vec<Request> = (0..8).map(|i| request(i, prompt(20 + i as usize, 50 + i, 500), 40)).collect();
    let single = alone(&path, &opts, &requests);
    let mut e =
        BatchEngine::new(kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap(), &opts).unwrap();
    assert_eq!(e.info().kv_blocks, 12);
    for r in &requests {
        e.add_request(r.clone()).unwrap();
    }
    let together = drain(&mut e);
    assert_same(&single, &together, "preemption");
    assert!(e.stats().preemptions > 0, "8 sequences of 4 blocks in 12 blocks must preempt");
    assert_all_blocks_free(&e);
}

#[test]
fn a_budget_below_one_sequence_is_config_invalid_with_the_numbers() {
    let path = fixture("tiny-qwen3");
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
    let opts = EngineOptions { ctx_size: Some(256), kv_budget: KvBudget::Bytes(1000), ..options(1) };
    let err = BatchEngine::new(model, &opts).unwrap_err();
    assert_eq!(err.code(), kylin_loader::ErrorCode::ConfigInvalid);
    assert!(err.message.contains("needs 16 blocks"), "{}", err.message);
    assert!(err.message.contains("256 tokens"), "{}", err.message);
}

#[test]
fn cancellation_ends_the_request_and_frees_its_blocks_at_the_next_step() {
    let path = fixture("tiny-qwen3");
    let mut e = engine(&path, options(2));
    let requests: Vec<Request> = (0..4).map(|i| request(i, prompt(40, i + 9, 1000), 200)).collect();
    let cancel = requests[2].cancel.clone();
    for r in &requests {
        e.add_request(r.clone()).unwrap();
    }
    let mut out = BTreeMap::new();
    let mut events = Vec::new();
    for _ in 0..5 {
        events.clear();
        e.step(&mut events).unwrap();
        collect(&events, &mut out);
    }
    let used_before = e.stats().kv_blocks_used;
    cancel.cancel();
    events.clear();
    e.step(&mut events).unwrap();
    collect(&events, &mut out);
    assert_eq!(out[&(2, 0)].reason, Some(StopReason::Cancelled));
    assert_eq!(e.stats().running, 3);
    // 40 prompt tokens + 5 generated = 3 blocks freed; the others grew by at most one block each.
    assert!(e.stats().kv_blocks_used < used_before, "{} -> {}", used_before, e.stats().kv_blocks_used);
    drain_into(&mut e, &mut out);
    assert_eq!(out[&(0, 0)].ids.len(), 200);
    assert_all_blocks_free(&e);
}

#[test]
fn prefix_reuse_gives_the_same_outputs_as_no_reuse() {
    let path = fixture("tiny-llama-rope3");
    let shared = prompt(40, 77, 1000);
    let mut second = shared.clone();
    second.extend(prompt(9, 78, 1000));
    let first = request(1, shared, 8);
    let follow = request(2, second, 8);

    let cold = alone(&path, &options(2), std::slice::from_ref(&follow));
    let mut e = engine(&path, options(2));
    e.add_request(first).unwrap();
    drain(&mut e);
    let stats_before = e.stats();
    assert!(stats_before.kv_blocks_cached >= 2, "full prompt blocks stay cached");
    e.add_request(follow).unwrap();
    let warm = drain(&mut e);
    assert_same(&cold, &warm, "prefix reuse");
    // Two full blocks (32 tokens) of the 40 shared ones came from the cache.
    assert_eq!(warm[&(2, 0)].cached, 32);
    assert_eq!(cold[&(2, 0)].cached, 0);
    assert!(e.stats().prefix_cache_hits - stats_before.prefix_cache_hits >= 32);
    assert_all_blocks_free(&e);
}

#[test]
fn parallel_choices_share_the_prompt_and_equal_separate_seeds() {
    let path = fixture("tiny-qwen3");
    let mut r = request(5, prompt(37, 3, 1000), 12);
    r.sampling = SamplingParams { temperature: 0.9, top_k: 40, seed: 11, ..SamplingParams::greedy() };
    r.n = 3;
    let mut e = engine(&path, options(2));
    e.add_request(r.clone()).unwrap();
    let mut out = BTreeMap::new();
    let mut events = Vec::new();
    let mut peak_used = 0;
    while e.has_work() {
        events.clear();
        e.step(&mut events).unwrap();
        collect(&events, &mut out);
        peak_used = peak_used.max(e.stats().kv_blocks_used);
    }
    assert_eq!(out.len(), 3);
    // Three separate sequences of 37 + 12 tokens would hold 3 x 4 blocks; the two full prompt
    // blocks are shared, so at most 2 + 3 x 2 are held.
    assert!(peak_used <= 8, "peak {peak_used} blocks: the prompt blocks are not shared");
    for i in 0..3 {
        let mut single = r.clone();
        single.n = 1;
        single.sampling.seed = 11 + i as u64;
        let alone = alone(&path, &options(2), &[single]);
        assert_eq!(alone[&(5, 0)].ids, out[&(5, i)].ids, "choice {i} equals seed {}", 11 + i);
    }
    assert!(out[&(5, 0)].ids != out[&(5, 1)].ids || out[&(5, 1)].ids != out[&(5, 2)].ids, "choices differ");
    assert_all_blocks_free(&e);
}

#[test]
fn invalid_requests_are_refused_and_nothing_is_queued() {
    let path = fixture("tiny-qwen3");
    let mut e = engine(&path, options(1));
    let vocab = e.info().vocab_size as u32;
    let cases = [
        (request(1, vec![], 4), "no tokens"),
        (request(2, vec![vocab], 4), "outside the model's vocabulary"),
        (request(3, vec![1; 256], 4), "leaves no room"),
        (Request { n: 0, ..request(4, vec![1], 4) }, "n must be"),
        (Request { logprobs: Some(21), ..request(5, vec![1], 4) }, "top_logprobs"),
    ];
    for (r, message) in cases {
        let err = e.add_request(r).unwrap_err();
        assert!(err.message.contains(message), "{}", err.message);
    }
    assert!(!e.has_work());
}

fn smollm2() -> PathBuf {
    let models = std::env::var("KYLIN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/kylin-models"));
    let path = models.join("smollm2-135m-instruct");
    assert!(path.is_dir(), "run testdata/models/fetch.sh first: {} is missing", path.display());
    path
}

/// Sixteen greedy requests of different lengths on SmolLM2-135M (BF16 weights), each equal to
/// itself run alone, in `precision`.
fn real_model_batch_invariance(precision: PrecisionChoice) {
    real_model_batch_invariance_with(EngineOptions { precision, ..EngineOptions::default() });
}

/// As [`real_model_batch_invariance`], with `base`'s precision and quantization.
fn real_model_batch_invariance_with(base: EngineOptions) {
    let path = smollm2();
    let precision = base.precision;
    let what = format!("smollm2 {precision:?} {:?}", base.quantize);
    let opts = EngineOptions { ctx_size: Some(512), max_batch_tokens: 128, ..base };
    let opts = EngineOptions { threads: 2, ..opts };
    let requests: Vec<Request> =
        (0..16).map(|i| request(i, prompt(5 + 23 * i as usize % 150, 100 + i, 40_000), 16)).collect();
    let single = alone(&path, &opts, &requests);
    let mut e = engine(&path, opts);
    for r in &requests {
        e.add_request(r.clone()).unwrap();
    }
    let together = drain(&mut e);
    assert_same(&single, &together, &what);
    assert_all_blocks_free(&e);
}

#[test]
fn a_real_model_batches_sixteen_greedy_requests_invariantly() {
    real_model_batch_invariance(PrecisionChoice::F32);
}

#[test]
fn bf16_precision_batches_invariantly_on_fixtures_and_a_real_model() {
    if kylin_kernels::bf16_kernels().is_none() {
        eprintln!("no BF16 matrix kernels on this CPU: --precision bf16 is refused, nothing to check");
        return;
    }
    for name in ["tiny-qwen3", "tiny-llama-rope3"] {
        let path = fixture(name);
        let opts = EngineOptions { max_batch_tokens: 48, precision: PrecisionChoice::Bf16, ..options(2) };
        let requests: Vec<Request> =
            (0..16).map(|i| request(i, prompt(3 + 11 * i as usize % 70, i + 1, 1000), 6 + i as usize % 5)).collect();
        let single = alone(&path, &opts, &requests);
        let mut e = engine(&path, opts.clone());
        assert_eq!(e.info().precision, "bf16");
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        assert_same(&single, &drain(&mut e), name);
        assert_all_blocks_free(&e);
    }
    real_model_batch_invariance(PrecisionChoice::Bf16);
}

/// Split-K decode attention: a sequence decoding alone past one partition (1024 positions) on
/// SmolLM2 (three KV heads, two threads: fewer attention tasks than twice the threads) has its
/// attention split by partition across the threads and folded afterwards; among two others
/// (nine tasks) it is not split. Tokens and log-probabilities are the same bits either way, in
/// f32 and (where the CPU has it) on the AMX path over the pair-layout BF16 cache.
#[test]
fn split_decode_attention_over_long_contexts_keeps_the_bits() {
    let path = smollm2();
    let mut precisions = vec![PrecisionChoice::F32];
    if kylin_kernels::bf16_kernels().is_some() {
        precisions.push(PrecisionChoice::Bf16);
    }
    for precision in precisions {
        let opts = EngineOptions {
            ctx_size: Some(2304),
            max_batch_tokens: 512,
            threads: 2,
            precision,
            ..EngineOptions::default()
        };
        let requests: Vec<Request> = [1030usize, 1500, 2200]
            .iter()
            .enumerate()
            .map(|(i, &n)| request(i as u64, prompt(n, 900 + i as u64, 40_000), 6))
            .collect();
        let single = alone(&path, &opts, &requests);
        let mut e = engine(&path, opts);
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        assert_same(&single, &drain(&mut e), &format!("split-K {precision:?}"));
        assert_all_blocks_free(&e);
    }
}

/// BF16 activations move the logits a little and the greedy choice rarely: on SmolLM2, the
/// first generated token of each prompt is the same as in f32 and its log-probability within
/// 0.15 (the measured KL divergence over real text is in BENCHMARKS.md).
#[test]
fn bf16_precision_stays_close_to_f32_on_a_real_model() {
    if kylin_kernels::bf16_kernels().is_none() {
        eprintln!("no BF16 matrix kernels on this CPU: nothing to compare");
        return;
    }
    let path = smollm2();
    let requests: Vec<Request> = (0..6).map(|i| request(i, prompt(40 + 17 * i as usize, 500 + i, 40_000), 1)).collect();
    let run = |precision| {
        let mut e =
            engine(&path, EngineOptions { ctx_size: Some(256), precision, threads: 2, ..EngineOptions::default() });
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        drain(&mut e)
    };
    let (f32_out, bf16_out) = (run(PrecisionChoice::F32), run(PrecisionChoice::Bf16));
    assert_ne!(
        f32_out.values().map(|o| o.logprobs[0].logprob.to_bits()).collect::<Vec<_>>(),
        bf16_out.values().map(|o| o.logprobs[0].logprob.to_bits()).collect::<Vec<_>>(),
        "bf16 gave the f32 bits: the BF16 kernels did not run"
    );
    for (key, a) in &f32_out {
        let b = &bf16_out[key];
        // The greedy choice must agree unless f32's top two were within rounding of each other.
        let top = &a.logprobs[0].top;
        if top[0].1 - top[1].1 > 0.2 {
            assert_eq!(a.ids, b.ids, "request {key:?}: greedy token differs between f32 and bf16");
        }
        let (x, y) = (a.logprobs[0].logprob, b.logprobs[0].logprob);
        assert!((x - y).abs() < 0.15, "request {key:?}: logprob {x} in f32, {y} in bf16");
    }
}

/// Q8_0 weights (`--quantize q8_0`): every sequence's tokens and log-probabilities equal its
/// own run alone, on the fixtures and on SmolLM2.
#[test]
fn q8_0_batches_invariantly_on_fixtures_and_a_real_model() {
    quantized_batches_invariantly(QuantFormat::Q8_0);
}

/// Q4_K weights (`--quantize q4_k`): the same. The fixtures' matrices are narrower than a
/// 256-column super-block, so they run the recipe's Q8_0 fallback; SmolLM2 mixes Q4_K
/// (down_proj) and Q8_0 as the recipe does.
#[test]
fn q4_k_batches_invariantly_on_fixtures_and_a_real_model() {
    quantized_batches_invariantly(QuantFormat::Q4K);
}

/// Q8_0 weights with BF16 activations (`--quantize q8_0 --precision bf16`, where the CPU has
/// AVX-512 BF16): the same.
#[test]
fn q8_0_with_bf16_activations_batches_invariantly() {
    if !kylin_kernels::w16::available() {
        eprintln!("skipped: no AVX-512 BF16");
        return;
    }
    quantized_batches_invariantly_in(QuantFormat::Q8_0, PrecisionChoice::Bf16);
}

fn quantized_batches_invariantly(format: QuantFormat) {
    quantized_batches_invariantly_in(format, PrecisionChoice::Auto);
}

fn quantized_batches_invariantly_in(format: QuantFormat, precision: PrecisionChoice) {
    let q8 = |opts: EngineOptions| EngineOptions { quantize: Some(format), precision, ..opts };
    for name in ["tiny-qwen3", "tiny-llama-rope3"] {
        let path = fixture(name);
        let opts = q8(EngineOptions { max_batch_tokens: 48, ..options(2) });
        let requests: Vec<Request> =
            (0..16).map(|i| request(i, prompt(3 + 11 * i as usize % 70, i + 1, 1000), 6 + i as usize % 5)).collect();
        let single = alone(&path, &opts, &requests);
        let mut e = engine(&path, opts.clone());
        let (want_precision, want_kernels) = match precision {
            PrecisionChoice::Bf16 => ("bf16 activations", format!("{}_a16", format.name())),
            _ => ("int8", format.name().to_string()),
        };
        assert_eq!(e.info().precision, want_precision);
        assert!(e.info().kernels.contains(&want_kernels), "{}", e.info().kernels);
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        assert_same(&single, &drain(&mut e), name);
        assert_all_blocks_free(&e);
    }
    real_model_batch_invariance_with(q8(EngineOptions::default()));
}

/// Q8_0 moves the logits a little more than BF16 activations: on SmolLM2, the first generated
/// token of each prompt is f32's unless f32's top two were close, and its log-probability stays
/// within 0.3 (the perplexity and KL divergence over real text are in BENCHMARKS.md). Asking
/// for f32 or bf16 arithmetic with it is refused.
#[test]
fn q8_0_stays_close_to_f32_on_a_real_model() {
    quantized_stays_close_to_f32(QuantFormat::Q8_0, 0.3);
}

/// Q4_K, 4-bit weights, moves them more: within 1.0.
#[test]
fn q4_k_stays_close_to_f32_on_a_real_model() {
    quantized_stays_close_to_f32(QuantFormat::Q4K, 1.0);
}

fn quantized_stays_close_to_f32(format: QuantFormat, tolerance: f32) {
    let path = smollm2();
    let requests: Vec<Request> = (0..6).map(|i| request(i, prompt(40 + 17 * i as usize, 500 + i, 40_000), 1)).collect();
    let run = |precision, quantize| {
        let opts = EngineOptions { ctx_size: Some(256), precision, quantize, threads: 2, ..EngineOptions::default() };
        let mut e = engine(&path, opts);
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        drain(&mut e)
    };
    let f32_out = run(PrecisionChoice::F32, None);
    let q_out = run(PrecisionChoice::Auto, Some(format));
    let name = format.name();
    for (key, a) in &f32_out {
        let b = &q_out[key];
        let top = &a.logprobs[0].top;
        if top[0].1 - top[1].1 > tolerance {
            assert_eq!(a.ids, b.ids, "request {key:?}: greedy token differs between f32 and {name}");
        }
        let (x, y) = (a.logprobs[0].logprob, b.logprobs[0].logprob);
        assert_ne!(x.to_bits(), y.to_bits(), "request {key:?}: {name} gave f32's bits: it did not run");
        assert!((x - y).abs() < tolerance, "request {key:?}: logprob {x} in f32, {y} in {name}");
        eprintln!("{name} request {key:?}: logprob {x} in f32, {y} quantized");
    }
    // BF16 activations over Q8_0 weights: closer to f32 than int8 activations, on every
    // request's first log-probability.
    let a16 = format == QuantFormat::Q8_0 && kylin_kernels::w16::available();
    if a16 {
        let a16_out = run(PrecisionChoice::Bf16, Some(format));
        let error = |out: &BTreeMap<(u64, usize), Output>| -> f32 {
            f32_out.iter().map(|(key, a)| (a.logprobs[0].logprob - out[key].logprobs[0].logprob).abs()).sum()
        };
        let (int8, bf16) = (error(&q_out), error(&a16_out));
        eprintln!("{name}: summed |logprob − f32's| {int8} with int8 activations, {bf16} with BF16 ones");
        assert!(bf16 < int8, "BF16 activations ({bf16}) are not closer to f32 than int8 ones ({int8})");
    }
    for precision in [PrecisionChoice::F32, PrecisionChoice::Bf16] {
        if precision == PrecisionChoice::Bf16 && a16 {
            continue;
        }
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        let opts = EngineOptions { precision, quantize: Some(format), ..EngineOptions::default() };
        let err = BatchEngine::new(model, &opts).unwrap_err();
        assert_eq!(err.code(), kylin_loader::ErrorCode::ConfigInvalid, "{}", err.message);
        assert!(err.message.contains(&format!("--quantize {name}")), "{}", err.message);
    }
}

#[test]
fn an_unbounded_token_limit_ends_at_the_context() {
    let path = fixture("tiny-qwen2-f16");
    let mut e = engine(&path, EngineOptions { ctx_size: Some(40), ..options(1) });
    e.add_request(request(1, prompt(10, 5, 1000), usize::MAX)).unwrap();
    let out = drain(&mut e);
    // 10 prompt tokens and 30 computed generated ones fill the 40 positions; the 31st sampled
    // token is emitted but has no room to be computed.
    assert_eq!(out[&(1, 0)].reason, Some(StopReason::ContextFull));
    assert_eq!(out[&(1, 0)].ids.len(), 31);
    assert_all_blocks_free(&e);
}
