//! Published quantized checkpoints (compressed-tensors, FP8, GPTQ, AWQ) against what transformers
//! computes from their dequantized weights, on the fixtures of `tests/fixtures/quantized`.
//!
//! - `--precision f32` dequantizes exactly: the argmax of every position, 20 greedy tokens and
//!   every logit of the last position within 2e-3 of the reference, for every fixture.
//! - The default (where the CPU has AVX-512 BF16: the weights as stored with BF16 activations,
//!   `q8_0_a16`, `q4_g_a16`, `f8_e4m3_a16`, and W8A8 on int8 activations, `q8_0`; elsewhere
//!   Q8_0 for 8-bit integers and FP8, Q4G for 4-bit groups) is measured against the reference
//!   and the f32 path: argmax agreement per fixture (printed; at least
//!   [`fast_agreement_floor`]), the last position's logits within [`A16_LOGIT_BOUND`] or
//!   [`FAST_LOGIT_BOUND`], and the packing the one documented.
//! - `--precision bf16` (the dequantized weights rounded to BF16, BF16 activations) agrees with
//!   the f32 path at 97% of positions or more on every fixture.
//! - GPTQ and AWQ hold the same integers in two packings: their logits are identical.
//! - Values no loader check can see (a `g_idx` naming a group that does not exist) are
//!   `FILE_CORRUPTED` when the engine is built, naming the tensor.

use std::path::{Path, PathBuf};

use kylin_engine::Backend;
use kylin_engine::batch::{EngineOptions, KvBudget};
use kylin_engine::model::{PrecisionChoice, QuantFormat};
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::sampler::argmax;
use kylin_kernels::quant::Packing;
use kylin_loader::{ErrorCode, LoadOptions};
use serde_json::Value;

mod support;
use support::{greedy, ids, max_abs_diff};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/quantized");

/// Every fixture but the unquantized sources, with the packing the fast path must choose where
/// the CPU has AVX-512 BF16 (16-bit activations for every scheme but W8A8) and elsewhere.
const QUANTIZED: [(&str, Packing, Packing); 9] = [
    ("w8a8", Packing::Q8_0, Packing::Q8_0),
    ("w8a16", Packing::Q8_0A16, Packing::Q8_0),
    ("w4a16", Packing::Q4GA16, Packing::Q4G),
    ("w4a16-asym", Packing::Q4GA16, Packing::Q4G),
    ("fp8-dynamic", Packing::F8A16, Packing::Q8_0),
    ("fp8-block", Packing::F8A16, Packing::Q8_0),
    ("fp8", Packing::F8A16, Packing::Q8_0),
    ("gptq", Packing::Q4GA16, Packing::Q4G),
    ("awq", Packing::Q4GA16, Packing::Q4G),
];

/// The packing this CPU's fast path chooses for a fixture of [`QUANTIZED`].
fn expected_packing(with_bf16: Packing, without: Packing) -> Packing {
    if kylin_kernels::w16::available() { with_bf16 } else { without }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

fn reference(name: &str) -> Value {
    let path = fixture("reference").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn options(precision: PrecisionChoice) -> NativeOptions {
    let engine = EngineOptions { kv_budget: KvBudget::Default, precision, ..EngineOptions::default() };
    NativeOptions { threads: 2, engine: Some(engine), ..Default::default() }
}

fn try_backend(dir: &Path, precision: PrecisionChoice) -> kylin_loader::Result<NativeBackend> {
    let model = kylin_loader::load(dir, &LoadOptions::default())?;
    assert!(model.unused_tensors.is_empty(), "{}: unused tensors {:?}", dir.display(), model.unused_tensors);
    NativeBackend::new(model, options(precision))
}

fn backend(name: &str, precision: PrecisionChoice) -> NativeBackend {
    try_backend(&fixture(name), precision).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// `--precision f32`: the dequantized weights, computed as transformers computes them.
fn check_exact(name: &str) {
    let reference = reference(name);
    let mut backend = backend(name, PrecisionChoice::F32);
    assert_eq!(backend.core().model().quantization(), None, "{name}: f32 must not pack");
    let vocab = backend.vocab_size();
    for (index, case) in reference["cases"].as_array().expect("cases").iter().enumerate() {
        let label = format!("{name} case {index}");
        let prompt = ids(&case["input_ids"]);
        backend.reset();
        let all = backend.prefill_all_logits(&prompt).expect("prefill_all_logits");
        let argmaxes: Vec<u32> = all.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(argmaxes, ids(&case["argmax_per_position"]), "{label}: argmax per position");
        let last = &all[(prompt.len() - 1) * vocab..];
        let full = case["last_logits"].as_array().expect("last_logits");
        assert_eq!(full.len(), vocab);
        let diff = max_abs_diff(full, last);
        assert!(diff <= 2e-3, "{label}: max |logit difference| {diff} > 2e-3");
        let want = ids(&case["greedy_new_ids"]);
        assert_eq!(greedy(&mut backend, &prompt, want.len()), want, "{label}: greedy tokens");
    }
}

/// The largest last-position logit difference allowed on the fast path. With int8 activations
/// (W8A8 everywhere; every scheme on a CPU without AVX-512 BF16) measured 0.05 to 0.12 over the
/// fixtures; with BF16 activations (the `_a16` packings) 0.025 to 0.035.
const FAST_LOGIT_BOUND: f64 = 0.15;
const A16_LOGIT_BOUND: f64 = 0.05;

/// The argmax agreement below which the fast path fails: the 95%, measured at 95.7% to
/// 99.3% over the fixtures where the CPU has AVX-512 BF16 (W8A8 on int8 activations the
/// lowest). Without it every scheme runs on int8 activations, which on these random fixtures
/// (their top two logits often within a few hundredths) measured 93.5% to 96.3%: the floor
/// there is 92%.
fn fast_agreement_floor() -> f64 {
    if kylin_kernels::w16::available() { 0.95 } else { 0.92 }
}

/// Deterministic token ids in `3..503` for `len` positions.
fn pseudo_random_prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % 500 + 3) as u32
        })
        .collect()
}

/// The default (integer kernels) against transformers' reference (its cases) and against the
/// f32 path (which matches transformers, tested above) on four prompts of 128 tokens: returns
/// (positions, positions whose argmax agrees, the largest last-position logit difference from
/// the reference).
fn measure_fast(name: &str, packing: Packing) -> (usize, usize, f64) {
    let reference = reference(name);
    let mut fast = backend(name, PrecisionChoice::Auto);
    assert_eq!(fast.core().model().quantization(), Some(QuantFormat::Published(packing)), "{name}: the packing");
    let vocab = fast.vocab_size();
    let (mut positions, mut agree, mut worst) = (0, 0, 0.0f64);
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = ids(&case["input_ids"]);
        fast.reset();
        let all = fast.prefill_all_logits(&prompt).expect("prefill_all_logits");
        let want = ids(&case["argmax_per_position"]);
        positions += want.len();
        agree += all.chunks_exact(vocab).map(argmax).zip(&want).filter(|(a, b)| a == *b).count();
        let last = &all[(prompt.len() - 1) * vocab..];
        worst = worst.max(max_abs_diff(case["last_logits"].as_array().expect("last_logits"), last));
    }
    let mut exact = backend(name, PrecisionChoice::F32);
    for seed in 1..=4 {
        let prompt = pseudo_random_prompt(seed, 128);
        exact.reset();
        fast.reset();
        let want: Vec<u32> = exact.prefill_all_logits(&prompt).expect("f32").chunks_exact(vocab).map(argmax).collect();
        let got = fast.prefill_all_logits(&prompt).expect("fast");
        positions += want.len();
        agree += got.chunks_exact(vocab).map(argmax).zip(&want).filter(|(a, b)| a == *b).count();
    }
    (positions, agree, worst)
}

#[test]
fn every_quantized_fixture_matches_transformers_in_f32() {
    for family in ["tiny-qwen3", "tiny-llama"] {
        check_exact(&format!("{family}-bf16"));
        for (suffix, _, _) in QUANTIZED {
            check_exact(&format!("{family}-{suffix}"));
        }
    }
}

#[test]
fn the_integer_kernels_agree_with_transformers() {
    let mut report = Vec::new();
    for family in ["tiny-qwen3", "tiny-llama"] {
        for (suffix, with_bf16, without) in QUANTIZED {
            let name = format!("{family}-{suffix}");
            let packing = expected_packing(with_bf16, without);
            let (positions, agree, worst) = measure_fast(&name, packing);
            report.push((name, positions, agree, worst, packing));
        }
    }
    for (name, positions, agree, worst, _) in &report {
        let share = 100.0 * *agree as f64 / *positions as f64;
        println!(
            "{name}: argmax agrees at {agree} of {positions} positions ({share:.1}%), last-position logits within {worst:.4}"
        );
    }
    for (name, positions, agree, worst, packing) in report {
        assert!(
            agree as f64 >= fast_agreement_floor() * positions as f64,
            "{name}: argmax agrees at {agree} of {positions} positions"
        );
        let bound = if packing.name().ends_with("_a16") { A16_LOGIT_BOUND } else { FAST_LOGIT_BOUND };
        assert!(worst < bound, "{name}: last-position logits differ by up to {worst}");
    }
}

#[test]
fn gptq_and_awq_packings_of_the_same_integers_give_identical_logits() {
    let reference = reference("tiny-llama-gptq");
    for precision in [PrecisionChoice::F32, PrecisionChoice::Auto] {
        let mut gptq = backend("tiny-llama-gptq", precision);
        let mut awq = backend("tiny-llama-awq", precision);
        for case in reference["cases"].as_array().expect("cases") {
            let prompt = ids(&case["input_ids"]);
            gptq.reset();
            awq.reset();
            let a = gptq.prefill_all_logits(&prompt).expect("gptq").to_vec();
            let b = awq.prefill_all_logits(&prompt).expect("awq").to_vec();
            assert!(a == b, "{precision:?}: GPTQ and AWQ logits differ");
        }
    }
}

/// `--precision bf16`: the dequantized weights rounded to BF16 with BF16 activations (16-bit
/// activations, as the A16 schemes intend), where the CPU has BF16 kernels; a clear
/// `CONFIG_INVALID` naming the alternatives elsewhere.
#[test]
fn bf16_precision_runs_the_dequantized_weights_on_the_bf16_kernels() {
    if kylin_kernels::bf16_kernels().is_none() {
        let err = try_backend(&fixture("tiny-qwen3-w4a16"), PrecisionChoice::Bf16).unwrap_err();
        assert_eq!(err.code, ErrorCode::ConfigInvalid, "{err}");
        assert!(err.message.contains("--precision auto") && err.message.contains("f32"), "{err}");
        return;
    }
    let mut report = Vec::new();
    for family in ["tiny-qwen3", "tiny-llama"] {
        for (suffix, _, _) in QUANTIZED {
            let name = format!("{family}-{suffix}");
            let mut exact = backend(&name, PrecisionChoice::F32);
            let mut bf16 = backend(&name, PrecisionChoice::Bf16);
            assert_eq!(bf16.core().model().quantization(), None, "{name}");
            assert_eq!(bf16.core().model().precision_name(), "bf16", "{name}");
            let vocab = exact.vocab_size();
            let (mut positions, mut agree) = (0, 0);
            for seed in 1..=4 {
                let prompt = pseudo_random_prompt(seed, 128);
                exact.reset();
                bf16.reset();
                let want: Vec<u32> =
                    exact.prefill_all_logits(&prompt).expect("f32").chunks_exact(vocab).map(argmax).collect();
                let got = bf16.prefill_all_logits(&prompt).expect("bf16");
                positions += want.len();
                agree += got.chunks_exact(vocab).map(argmax).zip(&want).filter(|(a, b)| a == *b).count();
            }
            report.push((name, positions, agree));
        }
    }
    for (name, positions, agree) in &report {
        println!("{name}: bf16 argmax agrees at {agree} of {positions} positions");
    }
    for (name, positions, agree) in report {
        assert!(agree * 100 >= positions * 97, "{name}: bf16 argmax agrees at {agree} of {positions} positions");
    }
}

/// A writable copy of a fixture directory.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("temp dir");
    for entry in std::fs::read_dir(fixture(name)).expect("fixture dir") {
        let entry = entry.expect("dir entry");
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).expect("copy");
    }
    tmp
}

/// Overwrites the first element of an I32 tensor of `file` with `value`.
fn poke_i32(file: &Path, tensor: &str, value: i32) {
    let mut bytes = std::fs::read(file).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap_or_else(|| panic!("no tensor {tensor}")) as usize;
    let at = 8 + n + start;
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(file, bytes).expect("write");
}

#[test]
fn a_g_idx_beyond_the_groups_is_file_corrupted_on_both_paths() {
    let tensor = "model.layers.1.mlp.down_proj.g_idx";
    let dir = copy_fixture("tiny-llama-gptq");
    poke_i32(&dir.path().join("model.safetensors"), tensor, 7);
    for precision in [PrecisionChoice::F32, PrecisionChoice::Auto] {
        let err = try_backend(dir.path(), precision).unwrap_err();
        assert_eq!(err.code, ErrorCode::FileCorrupted, "{err}");
        assert!(err.message.contains("model.layers.1.mlp.down_proj") && err.message.contains('7'), "{err}");
    }
    poke_i32(&dir.path().join("model.safetensors"), tensor, -1);
    let err = try_backend(dir.path(), PrecisionChoice::Auto).unwrap_err();
    assert_eq!(err.code, ErrorCode::FileCorrupted, "{err}");
}

#[test]
fn activation_order_runs_through_the_dequantized_path() {
    // GPTQ with `desc_act`: column c belongs to group g_idx[c], in any order. The fixture's
    // down_proj (384 inputs, groups of 128) gets its groups reversed; f32 and the fast path
    // (dequantized, then Q8_0) must then agree with each other, and differ from the original.
    let dir = copy_fixture("tiny-llama-gptq");
    let config = dir.path().join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&config).expect("config")).expect("json");
    c["quantization_config"]["desc_act"] = Value::Bool(true);
    std::fs::write(&config, serde_json::to_vec_pretty(&c).expect("json")).expect("write");
    let file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let start = header["model.layers.0.mlp.down_proj.g_idx"]["data_offsets"][0].as_u64().expect("g_idx") as usize;
    for column in 0..384usize {
        let at = 8 + n + start + 4 * column;
        bytes[at..at + 4].copy_from_slice(&(2 - (column / 128) as i32).to_le_bytes());
    }
    std::fs::write(&file, bytes).expect("write");

    let reference = reference("tiny-llama-gptq");
    let prompt = ids(&reference["cases"][0]["input_ids"]);
    let mut exact = try_backend(dir.path(), PrecisionChoice::F32).expect("f32");
    let mut fast = try_backend(dir.path(), PrecisionChoice::Auto).expect("auto");
    let packing = expected_packing(Packing::Q4GA16, Packing::Q4G);
    assert_eq!(fast.core().model().quantization(), Some(QuantFormat::Published(packing)));
    let a = exact.prefill(&prompt).expect("f32").to_vec();
    let b = fast.prefill(&prompt).expect("auto").to_vec();
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(diff < FAST_LOGIT_BOUND as f32, "activation order: f32 and the fast path differ by {diff}");
    let original = reference["cases"][0]["last_logits"].as_array().expect("last_logits");
    assert!(max_abs_diff(original, &a) > 1e-3, "reversing the groups changed nothing: g_idx is not read");
}
