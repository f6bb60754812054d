//! The families of the registry against what transformers computes on their tiny checkpoints
//! (`shared/families`: written by transformers 5.24, float32 eager references), and the
//! engine's guarantees on each of them.
//!
//! For every family fixture whose architecture is registered, with `--precision f32`: the
//! argmax of every position, 20 greedy tokens through the paged KV cache (prompts of 1, 6, 37
//! and 100 tokens, so the longer ones cross every sliding window), and the whole last row of
//! logits within 1e-3. Then batch invariance (each request alone against eight together, with
//! prompts chunked differently), and the fast paths (`bf16`, `q8_0`, `q4_k`) measured by KL
//! divergence against f32.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kylin_engine::Backend;
use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::model::{PrecisionChoice, QuantFormat};
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::sampler::argmax;
use kylin_engine::serving::{Event, EventKind, Request, Serving};
use serde_json::Value;

mod support;
use support::{greedy, ids, max_abs_diff, request};

/// Deterministic prompt ids in `1..1000`.
fn prompt(len: usize, seed: u64) -> Vec<u32> {
    support::prompt(len, seed, 1000)
}

const FAMILIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/families");
/// Further configurations of the same families, written by `scripts/make_family_fixtures.py`.
const MORE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/families");

/// The dense and Mixture-of-Experts families this engine runs; with [`HYBRID`], every family in
/// `shared/families`. A fixture in neither must be refused with a clear code.
const RUNNING: [&str; 14] = [
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-gemma4",
    "tiny-granite",
    "tiny-mistral-swa",
    "tiny-olmo2",
    "tiny-phi3",
    "tiny-smollm3",
    "tiny-qwen3-moe",
    "tiny-qwen2-moe",
    "tiny-mixtral",
    "tiny-olmoe",
    "tiny-gpt-oss",
    "tiny-gemma4-moe",
];

/// The hybrid families: recurrent mixers (Gated DeltaNet, short convolutions) beside attention,
/// each sequence's state in the engine's state pool.
const HYBRID: [&str; 4] = ["tiny-qwen3.5", "tiny-qwen3.5-vl", "tiny-lfm2", "tiny-qwen3.5-moe"];

fn fixture(name: &str) -> PathBuf {
    Path::new(FAMILIES).join("fixtures").join(name)
}

fn reference_in(root: &str, name: &str) -> Value {
    let path = Path::new(root).join("reference").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn native(path: &Path, precision: PrecisionChoice, quantize: Option<QuantFormat>) -> NativeBackend {
    native_with_context(path, precision, quantize, None)
}

fn native_with_context(
    path: &Path,
    precision: PrecisionChoice,
    quantize: Option<QuantFormat>,
    ctx_size: Option<usize>,
) -> NativeBackend {
    let model = kylin_loader::load(path, &kylin_loader::LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let engine = EngineOptions { threads: 2, precision, quantize, ctx_size, ..EngineOptions::default() };
    NativeBackend::new(model, NativeOptions { threads: 2, ctx_size, engine: Some(engine), ..Default::default() })
        .unwrap_or_else(|e| panic!("building the backend for {}: {e}", path.display()))
}

/// f32 against transformers: argmax per position, the last row within 1e-3, greedy tokens.
fn check_against_transformers(name: &str) {
    check_in(FAMILIES, name);
}

fn check_in(root: &str, name: &str) {
    check_with_context(root, name, &|_| None);
}

/// [`check_in`] with the context planned per case (`context(prompt + 20 greedy tokens)`).
fn check_with_context(root: &str, name: &str, context: &dyn Fn(usize) -> Option<usize>) {
    let reference = reference_in(root, name);
    let cases = reference["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "{name}: no cases in the reference");
    let path = Path::new(root).join("fixtures").join(name);
    for (index, case) in cases.iter().enumerate() {
        let label = format!("{name} case {index}");
        let prompt = ids(&case["input_ids"]);
        let mut backend = native_with_context(&path, PrecisionChoice::F32, None, context(prompt.len() + 20));
        let vocab = backend.vocab_size();
        backend.reset();
        let all = backend.prefill_all_logits(&prompt).expect("prefill_all_logits");
        let argmaxes: Vec<u32> = all.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(argmaxes, ids(&case["argmax_per_position"]), "{label}: argmax per position");
        let last = &all[(prompt.len() - 1) * vocab..];
        let full = case["last_logits"].as_array().expect("last_logits");
        assert_eq!(full.len(), vocab, "{label}: reference row length");
        let max_diff = max_abs_diff(full, last);
        assert!(max_diff <= 1e-3, "{label}: max |logit difference| {max_diff} > 1e-3");
        let want = ids(&case["greedy_new_ids"]);
        assert_eq!(greedy(&mut backend, &prompt, want.len()), want, "{label}: greedy tokens");
    }
}

macro_rules! family_tests {
    ($($test:ident => $name:literal,)*) => {
        $(
            #[test]
            fn $test() {
                check_against_transformers($name);
            }
        )*
    };
}

family_tests! {
    gemma2_matches_transformers => "tiny-gemma2",
    gemma3_matches_transformers => "tiny-gemma3",
    gemma4_matches_transformers => "tiny-gemma4",
    granite_matches_transformers => "tiny-granite",
    mistral_sliding_window_matches_transformers => "tiny-mistral-swa",
    olmo2_matches_transformers => "tiny-olmo2",
    phi3_matches_transformers => "tiny-phi3",
    smollm3_matches_transformers => "tiny-smollm3",
    qwen3_moe_matches_transformers => "tiny-qwen3-moe",
    qwen2_moe_matches_transformers => "tiny-qwen2-moe",
    mixtral_matches_transformers => "tiny-mixtral",
    olmoe_matches_transformers => "tiny-olmoe",
    gemma4_moe_matches_transformers => "tiny-gemma4-moe",
    gpt_oss_matches_transformers => "tiny-gpt-oss",
    qwen3_5_matches_transformers => "tiny-qwen3.5",
    qwen3_5_conditional_generation_layout_matches_transformers => "tiny-qwen3.5-vl",
    lfm2_matches_transformers => "tiny-lfm2",
    qwen3_5_moe_matches_transformers => "tiny-qwen3.5-moe",
}

/// The last layer computes only the rows whose logits are wanted: a prompt's last logits are
/// the same bits as the last row of a pass that computes every row, for every family (dense,
/// windowed, Gemma 4's per-layer inputs and shared keys and values, experts, recurrent mixers)
/// and for prompts of one token, of one chunk and of several chunks (whose earlier chunks want
/// no logits), in f32, BF16 and Q8_0; and the pass really computed one row there.
#[test]
fn the_last_layer_computes_only_the_wanted_rows() {
    let dense = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/tiny-qwen3");
    let paths: Vec<PathBuf> = RUNNING.iter().chain(HYBRID.iter()).map(|name| fixture(name)).chain([dense]).collect();
    let mut modes = vec![(PrecisionChoice::F32, None), (PrecisionChoice::Auto, Some(QuantFormat::Q8_0))];
    if kylin_kernels::bf16_kernels().is_some() {
        modes.push((PrecisionChoice::Bf16, None));
    }
    for (path, &(precision, quantize)) in paths.iter().flat_map(|p| modes.iter().map(move |m| (p, m))) {
        for len in [1, 37, 100] {
            let ids = prompt(len, len as u64);
            let mut every = native_with_context(path, precision, quantize, Some(256));
            let vocab = every.vocab_size();
            let all = every.prefill_all_logits(&ids).expect("prefill_all_logits");
            let chunk = every.core().last_layer_rows();
            let mut wanted = native_with_context(path, precision, quantize, Some(256));
            let last = wanted.prefill(&ids).expect("prefill").to_vec();
            let label = format!("{} ({precision:?}, {quantize:?}) with {len} tokens", path.display());
            assert!(chunk > 1 || len == 1, "{label}: the all-logits pass computed {chunk} rows");
            assert_eq!(wanted.core().last_layer_rows(), 1, "{label}: rows of the last layer");
            let bits = |row: &[f32]| row.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&last), bits(&all[(len - 1) * vocab..]), "{label}: the last logits differ");
        }
    }
}

/// The further configurations (`tests/fixtures/families`): windows of 5 to 7, one KV head,
/// partial rotary, scaled global RoPE, NoPE every third layer, biases, other multipliers.
#[test]
fn further_configurations_match_transformers() {
    let mut names: Vec<String> = std::fs::read_dir(Path::new(MORE).join("fixtures"))
        .expect("tests/fixtures/families/fixtures")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() >= 7, "the further fixtures are missing: {names:?}");
    for name in names.iter().filter(|n| !n.contains("longrope")) {
        check_in(MORE, name);
    }
}

/// Phi-3's LongRoPE: short factors while the context stays within the original 64 positions,
/// long ones past them. transformers picks by each forward's sequence length, Kylin by the
/// planned context (`--ctx-size`), so each case runs with the context transformers' choice
/// implies: 64 when the prompt and its 20 greedy tokens fit in 64, else 256.
#[test]
fn phi3_longrope_matches_transformers_on_both_sides_of_the_original_context() {
    check_with_context(MORE, "tiny-phi3-longrope", &|needed| Some(if needed <= 64 { 64 } else { 256 }));
}

/// Every family fixture either is one of [`RUNNING`] or [`HYBRID`] and loads, or is refused with
/// `MAPPING_MISSING` naming its architecture (not a panic, not a wrong answer).
#[test]
fn every_family_fixture_runs_or_is_refused_by_name() {
    let mut names: Vec<String> = std::fs::read_dir(Path::new(FAMILIES).join("fixtures"))
        .expect("families/fixtures")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in &names {
        let result = kylin_loader::load(&fixture(name), &kylin_loader::LoadOptions::default());
        if RUNNING.contains(&name.as_str()) || HYBRID.contains(&name.as_str()) {
            result.unwrap_or_else(|e| panic!("{name}: {e}"));
        } else {
            let err = result.err().unwrap_or_else(|| panic!("{name} loads but has no reference test here"));
            let config: Value =
                serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
            let arch = config["architectures"][0].as_str().unwrap();
            assert!(
                matches!(
                    err.code(),
                    kylin_loader::ErrorCode::MappingMissing | kylin_loader::ErrorCode::OperatorUnsupported
                ),
                "{name}: {err}"
            );
            assert!(
                err.message.contains(arch) || err.code() == kylin_loader::ErrorCode::OperatorUnsupported,
                "{name}: {err}"
            );
        }
    }
    for name in RUNNING {
        assert!(names.iter().any(|n| n == name), "{name}: fixture missing from shared/families");
    }
}

/// What one request produced: ids and the bits of their log-probabilities.
type Outputs = BTreeMap<u64, (Vec<u32>, Vec<u32>)>;

fn drain(engine: &mut BatchEngine) -> Outputs {
    let mut out: Outputs = BTreeMap::new();
    let mut events: Vec<Event> = Vec::new();
    let mut steps = 0;
    while engine.has_work() {
        events.clear();
        engine.step(&mut events).unwrap();
        for e in &events {
            if let EventKind::Token { id, logprob, .. } = &e.kind {
                let o = out.entry(e.request).or_default();
                o.0.push(*id);
                o.1.push(logprob.as_ref().map_or(0, |l| l.logprob.to_bits()));
            }
        }
        steps += 1;
        assert!(steps < 100_000, "the engine does not finish");
    }
    out
}

/// Nine requests (prompts of 3 to 90 tokens, crossing the windows) alone on fresh engines,
/// then together with 40-token steps (so each prompt is chunked differently): the same ids and
/// log-probabilities, bit for bit.
fn batch_invariance(name: &str, precision: PrecisionChoice, quantize: Option<QuantFormat>) {
    batch_invariance_at(&fixture(name), name, precision, quantize)
}

fn batch_invariance_at(path: &Path, name: &str, precision: PrecisionChoice, quantize: Option<QuantFormat>) {
    let path = path.to_path_buf();
    let opts = EngineOptions {
        threads: 2,
        ctx_size: Some(256),
        max_batch_tokens: 40,
        precision,
        quantize,
        ..EngineOptions::default()
    };
    let make = || {
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        BatchEngine::new(model, &opts).unwrap()
    };
    let requests: Vec<Request> =
        (0..9u64).map(|i| request(i, prompt(3 + (i as usize * 29) % 88, i + 7), 12 + i as usize % 4)).collect();
    let mut alone = Outputs::new();
    for r in &requests {
        let mut e = make();
        e.add_request(r.clone()).unwrap();
        alone.extend(drain(&mut e));
    }
    let mut e = make();
    for r in &requests {
        e.add_request(r.clone()).unwrap();
    }
    let together = drain(&mut e);
    assert_eq!(alone, together, "{name} ({precision:?}, {quantize:?}): together differs from alone");
    assert_eq!(e.stats().kv_blocks_used, 0, "{name}: blocks still referenced");
}

#[test]
fn every_family_batches_invariantly_in_f32() {
    for name in RUNNING {
        batch_invariance(name, PrecisionChoice::F32, None);
    }
}

/// The hybrid families: nine requests alone and together (prompts chunked at 40 tokens, so the
/// delta rule's chunks are split across steps differently), the same bits.
#[test]
fn every_hybrid_family_batches_invariantly() {
    for name in HYBRID {
        batch_invariance(name, PrecisionChoice::F32, None);
        batch_invariance(name, PrecisionChoice::Auto, Some(QuantFormat::Q8_0));
    }
}

/// The hybrid families whose fixtures are only in `tests/fixtures/families` (LFM2-MoE,
/// Qwen3-Next): nine requests alone and together, the same bits.
#[test]
fn further_hybrid_families_batch_invariantly() {
    for name in ["tiny-lfm2-moe-dense2-bias", "tiny-qwen3-next-gqa-sparse"] {
        let path = Path::new(MORE).join("fixtures").join(name);
        batch_invariance_at(&path, name, PrecisionChoice::F32, None);
        batch_invariance_at(&path, name, PrecisionChoice::Auto, Some(QuantFormat::Q8_0));
    }
}

#[test]
fn every_family_batches_invariantly_on_the_fast_paths() {
    let bf16 = kylin_kernels::bf16_kernels().is_some();
    for name in RUNNING {
        if bf16 {
            batch_invariance(name, PrecisionChoice::Bf16, None);
        }
        batch_invariance(name, PrecisionChoice::Auto, Some(QuantFormat::Q8_0));
    }
}

/// `KL(p_f32 || p_fast)` of the last position's distribution, averaged over the reference
/// prompts; and the share of positions whose argmax agrees with f32.
fn kl_against_f32(name: &str, precision: PrecisionChoice, quantize: Option<QuantFormat>) -> (f64, f64) {
    kl_in(FAMILIES, name, precision, quantize)
}

fn kl_in(root: &str, name: &str, precision: PrecisionChoice, quantize: Option<QuantFormat>) -> (f64, f64) {
    let reference = reference_in(root, name);
    let path = Path::new(root).join("fixtures").join(name);
    let mut base = native(&path, PrecisionChoice::F32, None);
    let mut fast = native(&path, precision, quantize);
    let vocab = base.vocab_size();
    let (mut kl, mut agree, mut count) = (0.0f64, 0usize, 0usize);
    for case in reference["cases"].as_array().unwrap() {
        let prompt = ids(&case["input_ids"]);
        base.reset();
        fast.reset();
        let a = base.prefill_all_logits(&prompt).unwrap();
        let b = fast.prefill_all_logits(&prompt).unwrap();
        for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
            let log_softmax = |r: &[f32]| {
                let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z = r.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
                r.iter().map(|&v| v as f64 - z).collect::<Vec<f64>>()
            };
            let (la, lb) = (log_softmax(ra), log_softmax(rb));
            kl += la.iter().zip(&lb).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
            agree += usize::from(argmax(ra) == argmax(rb));
            count += 1;
        }
    }
    (kl / count as f64, agree as f64 / count as f64)
}

/// The fast paths work for every family and stay close to f32 (the figures are printed:
/// `cargo test -- --nocapture`, and recorded in BENCHMARKS.md). These random-weight fixtures
/// are far more sensitive than trained models, Gemma's most (four `1 + w` norms per layer and
/// a √hidden embedding amplify every rounding: its BF16 KL is 25 times Mistral's, and Q8_0
/// keeps the same ratio to BF16 as every other family), so the bounds are loose: mean KL per
/// position below 0.2 nats (0.3 for Qwen3.5-MoE, below) and the same argmax at 70% of positions or more (50% for the
/// Mixture-of-Experts families, whose top-k routing is discrete: a rounding that swaps two
/// nearly tied experts changes a token's output wholesale, and random routers make near-ties
/// common). The fixtures' 64- and 128-column matrices are below one Q4_K super-block, so
/// `q4_k` runs them as Q5_0, as llama.cpp's Q4_K_M does (their experts of width 48 stay as
/// stored): its step is eight times Q8_0's (`amax / 16` against `amax / 127`), and on these
/// fixtures its KL is 3 to 31 times Q8_0's (trained models: `BENCHMARKS.md`), so its bounds are
/// those of a path that works, not of a close one: KL below 1.5 nats (noise is `ln(vocab)`,
/// about 7) and the same argmax at 30% of positions (15% for the Mixture-of-Experts families).
/// The Q5_0 products themselves are checked bit for bit in `kylin-kernels/tests/q56.rs`.
#[test]
fn fast_paths_stay_close_to_f32_on_every_family() {
    let mut paths: Vec<(&str, PrecisionChoice, Option<QuantFormat>)> = vec![
        ("q8_0", PrecisionChoice::Auto, Some(QuantFormat::Q8_0)),
        ("q4_k", PrecisionChoice::Auto, Some(QuantFormat::Q4K)),
    ];
    if kylin_kernels::bf16_kernels().is_some() {
        paths.insert(0, ("bf16", PrecisionChoice::Bf16, None));
    }
    let mut failures = Vec::new();
    for name in RUNNING.iter().chain(&HYBRID) {
        for &(label, precision, quantize) in &paths {
            let (kl, agree) = kl_against_f32(name, precision, quantize);
            println!("{name:<18} {label:<5} KL {kl:.6}  argmax agreement {:.1}%", agree * 100.0);
            let moe = name.contains("moe") || name.contains("mixtral") || name.contains("gpt-oss");
            let floor = match (label, moe) {
                ("q4_k", true) => 0.15,
                ("q4_k", false) => 0.3,
                (_, true) => 0.5,
                (_, false) => 0.7,
            };
            // Qwen3.5-MoE compounds both sensitivities: the recurrent layers' rounding (tiny-qwen3.5
            // alone: KL 0.08) moves the random routers' near-ties (0.14 to 0.25 over its four
            // fixtures, argmax agreement 70 to 77%).
            let ceiling = match label {
                "q4_k" => 1.5,
                _ if name.contains("qwen3.5-moe") => 0.3,
                _ => 0.2,
            };
            if kl >= ceiling || agree < floor {
                failures.push(format!("{name} {label}: KL {kl:.4}, argmax agreement {:.1}%", agree * 100.0));
            }
        }
    }
    assert!(failures.is_empty(), "fast paths too far from f32: {failures:?}");
}

/// gpt-oss as published: the experts run as stored, 4-bit FP4 codes with E8M0 scales in the
/// MXFP4 kernel (int8 activations), the attention and head in BF16 as stored (on the BF16
/// kernels where the CPU has them); close to the
/// f32 path (which matches transformers' dequantized forward exactly, above), and batch
/// invariant.
#[test]
fn mxfp4_experts_run_as_stored() {
    let path = Path::new(MORE).join("fixtures/tiny-gpt-oss-mxfp4");
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
    let options = EngineOptions { threads: 2, precision: PrecisionChoice::Auto, ..EngineOptions::default() };
    let engine = BatchEngine::new(model, &options).unwrap();
    assert_eq!(
        engine.core().model().quantization(),
        Some(QuantFormat::Published(kylin_kernels::quant::Packing::Mxfp4)),
        "the experts are packed as MXFP4"
    );
    // The float half (attention, router, head: all BF16 as stored) runs on the BF16 kernels and
    // keeps a BF16 KV cache where the CPU has them, as a BF16 model's would.
    let bf16 = kylin_kernels::bf16_kernels().is_some();
    let model = engine.core().model();
    let (precision, kv) = if bf16 {
        ("int8 experts, bf16 elsewhere", kylin_kernels::WeightDType::BF16)
    } else {
        ("int8 experts, f32 elsewhere", kylin_kernels::WeightDType::F16)
    };
    assert_eq!((model.precision_name(), engine.core().kv_dtype()), (precision, kv));
    let (kl, agree) = kl_in(MORE, "tiny-gpt-oss-mxfp4", PrecisionChoice::Auto, None);
    println!("tiny-gpt-oss-mxfp4 mxfp4 kernels: KL {kl:.6}, argmax agreement {:.1}%", agree * 100.0);
    assert!(kl < 0.05 && agree >= 0.85, "MXFP4 kernels too far from f32: KL {kl}, agreement {agree}");
    batch_invariance_at(&path, "tiny-gpt-oss-mxfp4", PrecisionChoice::Auto, None);
}

/// A model whose sliding layers share a window keeps their keys and values for the window
/// only: a pool of its own, sized for the window plus one step per sequence, of which a long
/// sequence holds a bounded share; the full layers keep every position. Outputs are those of
/// the plain engine (the reference tests above run through the same pools).
#[test]
fn sliding_layers_hold_only_their_window() {
    // tiny-gemma3: 6 layers, 5 sliding with a window of 8, 1 full; head_dim 16, 2 KV heads.
    let path = fixture("tiny-gemma3");
    let opts = EngineOptions {
        threads: 2,
        ctx_size: Some(1024),
        max_seqs: 2,
        max_batch_tokens: 32,
        precision: PrecisionChoice::F32,
        ..EngineOptions::default()
    };
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
    let mut e = BatchEngine::new(model, &opts).unwrap();
    let bs = e.core().block_size();
    let per_position_layer = 2 * 2 * 16 * 4; // keys and values, 2 KV heads of 16, f32
    // The sliding pool: per sequence the window's blocks plus two, and one step's blocks; 5
    // layers.
    let sliding_blocks = 2 * ((8 - 1usize).div_ceil(bs) + 2) + 32usize.div_ceil(bs);
    assert_eq!(e.core().sliding_kv_bytes(), (sliding_blocks * bs * 5 * per_position_layer) as u64);
    // The full pool holds the one full layer, for two sequences of the whole context.
    let full = e.core().kv_bytes() - e.core().sliding_kv_bytes();
    assert_eq!(full, (e.core().total_blocks() * bs * per_position_layer) as u64);
    assert_eq!(e.core().total_blocks(), 2 * 1024 / bs);

    // A 300-token prompt and 60 new tokens: the sliding blocks held never exceed the window
    // and one step's positions.
    e.add_request(request(1, prompt(300, 3), 60)).unwrap();
    let mut events = Vec::new();
    let mut most = 0;
    while e.has_work() {
        events.clear();
        e.step(&mut events).unwrap();
        most = most.max(e.core().sliding_blocks_in_use());
    }
    assert!(most <= (8 - 1 + 32usize).div_ceil(bs) + 1, "a sequence held {most} sliding blocks");
    assert_eq!(e.core().sliding_blocks_in_use(), 0, "sliding blocks still held after the request ended");
}

/// The prefix cache with sliding layers: the same prompt again reuses the cached blocks of
/// both pools (the window's sliding blocks are cached under the full blocks' hashes) and gives
/// the same tokens and log-probabilities, bit for bit, as the first time.
#[test]
fn prefix_reuse_with_sliding_layers_gives_the_same_outputs() {
    for name in ["tiny-gemma3", "tiny-mistral-swa"] {
        let path = fixture(name);
        let opts = EngineOptions {
            threads: 2,
            ctx_size: Some(256),
            precision: PrecisionChoice::F32,
            ..EngineOptions::default()
        };
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        let mut e = BatchEngine::new(model, &opts).unwrap();
        let p = prompt(150, 11);
        e.add_request(request(1, p.clone(), 20)).unwrap();
        let first = drain(&mut e);
        e.add_request(request(2, p.clone(), 20)).unwrap();
        let hits_before = e.stats().prefix_cache_hits;
        let second = drain(&mut e);
        assert!(e.stats().prefix_cache_hits > hits_before, "{name}: the second prompt hit no cached block");
        assert_eq!(first[&1], second[&2], "{name}: a cached prefix changed the outputs");
        // A prompt sharing only its first 100 tokens.
        let mut q = p[..100].to_vec();
        q.extend(prompt(40, 99));
        let mut fresh = {
            let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
            BatchEngine::new(model, &opts).unwrap()
        };
        fresh.add_request(request(3, q.clone(), 20)).unwrap();
        let alone = drain(&mut fresh);
        e.add_request(request(3, q, 20)).unwrap();
        assert_eq!(drain(&mut e)[&3], alone[&3], "{name}: a partly shared prefix changed the outputs");
    }
}

/// `kylin chat`'s path: a turn, then the next turn rewinds to the shared prefix and goes on;
/// the logits equal a fresh prefill of the whole conversation (windows crossed in both).
#[test]
fn rewinding_a_windowed_sequence_recomputes_what_its_window_lost() {
    for name in ["tiny-gemma2", "tiny-mistral-swa"] {
        let mut b = native(&fixture(name), PrecisionChoice::F32, None);
        let turn1 = prompt(90, 5);
        b.prefill(&turn1).unwrap();
        for _ in 0..10 {
            let next = argmax(b.decode(7).unwrap());
            let _ = next;
        }
        // The next turn keeps the first 70 tokens and adds 30 new ones.
        b.rewind(70);
        let mut whole = turn1[..70].to_vec();
        whole.extend(prompt(30, 8));
        let got = b.prefill(&whole[70..]).unwrap().to_vec();
        let mut fresh = native(&fixture(name), PrecisionChoice::F32, None);
        let want = fresh.prefill(&whole).unwrap().to_vec();
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-5, "{name}: rewound and fresh logits differ by {diff}");
        assert_eq!(argmax(&got), argmax(&want));
    }
}

/// A Mixture-of-Experts model's bytes: one token reads k of the E experts of each MoE layer
/// (what `bench` divides its decode speed by), the memory budget counts all of them, and
/// `kylin inspect` reports the same per-token figure as the engine.
#[test]
fn moe_bytes_per_token_count_the_active_experts() {
    let cases = [
        (Path::new(FAMILIES).join("fixtures/tiny-qwen3-moe"), "tiny-qwen3-moe"),
        (Path::new(FAMILIES).join("fixtures/tiny-gpt-oss"), "tiny-gpt-oss"),
        (Path::new(FAMILIES).join("fixtures/tiny-qwen2-moe"), "tiny-qwen2-moe"),
        (Path::new(MORE).join("fixtures/tiny-gpt-oss-mxfp4"), "tiny-gpt-oss-mxfp4"),
    ];
    for (path, name) in cases {
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        let report = kylin_loader::inspect::quantization_report(&model.config, &model.weights);
        let moe = model.config.decoder.moe.expect("a MoE fixture");
        // Every expert's bytes as stored (MXFP4: codes and scales), summed over the layers.
        let expert_bytes: u64 = model
            .weights
            .layers
            .iter()
            .flat_map(|l| l.experts.iter().flat_map(|e| e.values()))
            .map(|t| t.byte_len() as u64 + model.weights.published_matrix(t).map_or(0, |m| m.scale.byte_len() as u64))
            .sum();
        let active = expert_bytes / moe.num_experts as u64 * moe.top_k as u64;
        let options = EngineOptions { threads: 2, precision: PrecisionChoice::Auto, ..EngineOptions::default() };
        let engine = BatchEngine::new(model, &options).unwrap();
        let m = engine.core().model();
        let (per_token, resident) = (m.weight_bytes_per_token(), m.weight_bytes_resident());
        assert_eq!(report.bytes_per_token, per_token, "{name}: inspect and the engine count a token's bytes alike");
        assert_eq!(resident - per_token, expert_bytes - active, "{name}: the other experts are resident only");
        assert!(per_token < resident, "{name}");
    }
}

/// GLM-4.5 (`tests/fixtures/families/fixtures/tiny-glm4-moe-mtp`, which matches transformers in
/// `further_configurations_match_transformers`): nine requests alone and together give the same
/// bits in f32, BF16 and Q8_0, and the fast paths stay within the MoE families' bounds above.
#[test]
fn glm4_moe_batches_invariantly_and_its_fast_paths_stay_close_to_f32() {
    let name = "tiny-glm4-moe-mtp";
    let path = Path::new(MORE).join("fixtures").join(name);
    batch_invariance_at(&path, name, PrecisionChoice::F32, None);
    batch_invariance_at(&path, name, PrecisionChoice::Auto, Some(QuantFormat::Q8_0));
    let mut paths = vec![("q8_0", PrecisionChoice::Auto, Some(QuantFormat::Q8_0))];
    if kylin_kernels::bf16_kernels().is_some() {
        batch_invariance_at(&path, name, PrecisionChoice::Bf16, None);
        paths.push(("bf16", PrecisionChoice::Bf16, None));
    }
    for (label, precision, quantize) in paths {
        let (kl, agree) = kl_in(MORE, name, precision, quantize);
        println!("{name} {label}: KL {kl:.6}, argmax agreement {:.1}%", agree * 100.0);
        assert!(kl < 0.2 && agree >= 0.5, "{name} {label}: KL {kl}, argmax agreement {agree}");
    }
}

/// transformers' `Qwen3_5MoeTextConfig` has no `intermediate_size` (every layer is sparse), and
/// the configs Qwen3.5-MoE is published with leave it out: such a directory loads (the field
/// recorded as defaulted) and computes the same bits as the fixture, which has it.
#[test]
fn a_qwen3_5_moe_config_without_intermediate_size_runs_as_published() {
    let source = fixture("tiny-qwen3.5-moe");
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
    }
    let config_path = copy.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    assert!(config.as_object_mut().unwrap().remove("intermediate_size").is_some());
    std::fs::write(&config_path, serde_json::to_string(&config).unwrap()).unwrap();
    let loaded = kylin_loader::load(copy.path(), &kylin_loader::LoadOptions::default()).unwrap();
    assert!(loaded.config.defaulted.iter().any(|f| f == "intermediate_size"), "{:?}", loaded.config.defaulted);
    let prompt = ids(&reference_in(FAMILIES, "tiny-qwen3.5-moe")["cases"][2]["input_ids"]);
    let mut with = native(&source, PrecisionChoice::F32, None);
    let mut without = native(copy.path(), PrecisionChoice::F32, None);
    let a = with.prefill_all_logits(&prompt).unwrap().to_vec();
    let b = without.prefill_all_logits(&prompt).unwrap().to_vec();
    assert!(a == b, "the logits differ without intermediate_size");
}
