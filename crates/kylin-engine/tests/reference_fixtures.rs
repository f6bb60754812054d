//! The native forward pass against what transformers computes on the tiny fixtures.
//!
//! For every fixture in `shared/fixtures` and every case of `shared/reference/<name>.json`:
//! the argmax of every position, 20 greedy tokens (prefill, then decode against the KV cache,
//! EOS ignored), the order of the last position's top 20 (where the reference logits are more
//! than 1e-4 apart), and, where the reference has the whole last row, every logit within 2e-3.

use std::path::{Path, PathBuf};

use kylin_engine::Backend;
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::sampler::argmax;
use serde_json::Value;

mod support;
use support::{greedy, ids};

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

fn fixtures_dir() -> PathBuf {
    Path::new(SHARED).join("fixtures")
}

fn reference(name: &str) -> Value {
    let path = Path::new(SHARED).join("reference").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn backend(name: &str) -> NativeBackend {
    let path = fixtures_dir().join(name);
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    NativeBackend::new(model, NativeOptions { threads: 2, ..Default::default() })
        .unwrap_or_else(|e| panic!("building the backend for {name}: {e}"))
}

/// Our top `k` ids must follow the reference order wherever consecutive reference logits differ
/// by more than `tie`; within a run of near-equal logits any order is accepted.
fn assert_top_order(label: &str, logits: &[f32], reference: &[Value], tie: f64) {
    let k = reference.len();
    let want: Vec<(u32, f64)> =
        reference.iter().map(|p| (p[0].as_u64().expect("id") as u32, p[1].as_f64().expect("logit"))).collect();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    let got = &order[..k];
    // Split the reference into runs of near-ties and compare each run as a set.
    let mut start = 0;
    while start < k {
        let mut end = start + 1;
        while end < k && (want[end - 1].1 - want[end].1).abs() <= tie {
            end += 1;
        }
        // A run touching the cut at k may continue past it: only complete runs are compared.
        if end < k || start == 0 || end - start == 1 {
            let mut a: Vec<u32> = want[start..end].iter().map(|p| p.0).collect();
            let mut b: Vec<u32> = got[start..end].to_vec();
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "{label}: top-{k} ranks {start}..{end} differ; ours {got:?}, reference {want:?}");
        }
        start = end;
    }
}

fn check_fixture(name: &str) {
    let reference = reference(name);
    let cases = reference["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "{name}: no cases in the reference");
    let mut backend = backend(name);
    let vocab = backend.vocab_size();
    for (index, case) in cases.iter().enumerate() {
        let label = format!("{name} case {index}");
        let prompt = ids(&case["input_ids"]);

        // Every position's logits in one prefill.
        backend.reset();
        let all = backend.prefill_all_logits(&prompt).expect("prefill_all_logits");
        assert_eq!(all.len(), prompt.len() * vocab);
        let argmaxes: Vec<u32> = all.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(argmaxes, ids(&case["argmax_per_position"]), "{label}: argmax per position");
        assert_eq!(backend.position(), prompt.len());

        let last = &all[(prompt.len() - 1) * vocab..];
        let top = case["last_top20"].as_array().expect("last_top20");
        assert_top_order(&label, last, top, 1e-4);
        for pair in top {
            let (id, want) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap());
            let diff = (last[id] as f64 - want).abs();
            assert!(diff <= 2e-3, "{label}: logit of id {id} is {}, reference {want}", last[id]);
        }
        if let Some(full) = case.get("last_logits").and_then(Value::as_array) {
            assert_eq!(full.len(), vocab, "{label}: reference row length");
            let max_diff =
                full.iter().zip(last).map(|(w, g)| (w.as_f64().unwrap() - *g as f64).abs()).fold(0.0f64, f64::max);
            assert!(max_diff <= 2e-3, "{label}: max |logit difference| {max_diff} > 2e-3");
        }

        // The last-position logits of a plain prefill equal the last row of the full one, up to
        // summation order (the head runs as a GEMV for one row and as a GEMM for all of them).
        backend.reset();
        let plain = backend.prefill(&prompt).expect("prefill").to_vec();
        let max_diff = plain.iter().zip(last).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(max_diff <= 1e-4, "{label}: prefill and prefill_all_logits differ by {max_diff} on the last row");

        // Greedy generation through the KV cache.
        let want = ids(&case["greedy_new_ids"]);
        let got = greedy(&mut backend, &prompt, want.len());
        assert_eq!(got, want, "{label}: greedy tokens");
        assert_eq!(backend.position(), prompt.len() + want.len() - 1);
    }
}

#[test]
fn every_fixture_has_a_reference_and_a_test() {
    let mut names: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("fixtures directory")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let tested = [
        "tiny-llama-rope3",
        "tiny-qwen2-f16",
        "tiny-qwen3",
        "tiny-qwen3-sharded-f32",
        "tiny-qwen3-yarn",
        "tiny-qwen3-yarn-legacy-config",
    ];
    assert_eq!(names, tested, "a fixture was added or removed: add a test for it");
    for name in &names {
        assert!(Path::new(SHARED).join("reference").join(format!("{name}.json")).is_file(), "{name}: no reference");
    }
}

#[test]
fn tiny_qwen3_matches_transformers() {
    check_fixture("tiny-qwen3");
}

#[test]
fn tiny_qwen3_sharded_f32_untied_matches_transformers() {
    check_fixture("tiny-qwen3-sharded-f32");
}

#[test]
fn tiny_qwen3_yarn_matches_transformers() {
    check_fixture("tiny-qwen3-yarn");
}

#[test]
fn tiny_qwen3_yarn_legacy_config_matches_transformers() {
    check_fixture("tiny-qwen3-yarn-legacy-config");
}

#[test]
fn tiny_qwen2_f16_with_biases_matches_transformers() {
    check_fixture("tiny-qwen2-f16");
}

#[test]
fn tiny_llama_rope3_matches_transformers() {
    check_fixture("tiny-llama-rope3");
}

#[test]
fn both_yarn_config_layouts_give_identical_logits() {
    let reference = reference("tiny-qwen3-yarn");
    let mut new_layout = backend("tiny-qwen3-yarn");
    let mut legacy = backend("tiny-qwen3-yarn-legacy-config");
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = ids(&case["input_ids"]);
        new_layout.reset();
        legacy.reset();
        let a = new_layout.prefill_all_logits(&prompt).expect("prefill");
        let b = legacy.prefill_all_logits(&prompt).expect("prefill");
        assert!(a == b, "the two config layouts give different logits");
        assert_eq!(greedy(&mut new_layout, &prompt, 20), greedy(&mut legacy, &prompt, 20));
    }
}

#[test]
fn chunked_prefill_equals_one_pass() {
    // Prefill in pieces (as a chat continues) must give what one pass gives: the KV cache
    // holds exactly what a single forward would have computed.
    let reference = reference("tiny-qwen3-sharded-f32");
    let case = &reference["cases"][2];
    let prompt = ids(&case["input_ids"]);
    let mut backend = backend("tiny-qwen3-sharded-f32");
    let whole = backend.prefill(&prompt).expect("prefill").to_vec();
    backend.reset();
    let (head, tail) = prompt.split_at(prompt.len() / 2);
    backend.prefill(head).expect("first half");
    let pieces = backend.prefill(tail).expect("second half").to_vec();
    let max_diff = whole.iter().zip(&pieces).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_diff <= 1e-5, "split prefill differs by {max_diff}");
    assert_eq!(argmax(&whole), ids(&case["argmax_per_position"])[prompt.len() - 1]);
}

#[test]
fn context_overflow_names_both_sizes_and_the_flag() {
    let path = fixtures_dir().join("tiny-qwen3");
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).expect("load");
    let mut backend = NativeBackend::new(model, NativeOptions { threads: 1, ctx_size: Some(8), ..Default::default() })
        .expect("backend");
    assert_eq!(backend.context_size(), 8);
    let err = backend.prefill(&[1; 9]).unwrap_err();
    assert_eq!(err.code(), kylin_loader::ErrorCode::ContextOverflow);
    assert!(err.message.contains('9') && err.message.contains('8') && err.message.contains("--ctx-size"), "{err}");
    backend.prefill(&[1; 8]).expect("a prompt that exactly fills the context");
    let err = backend.decode(1).unwrap_err();
    assert_eq!(err.code(), kylin_loader::ErrorCode::ContextOverflow);
    // An id outside the vocabulary is refused, not a panic.
    backend.reset();
    let err = backend.prefill(&[u32::MAX]).unwrap_err();
    assert_eq!(err.code(), kylin_loader::ErrorCode::InputInvalid);
}

#[test]
fn summary_counts_parameters_and_bytes() {
    // tiny-qwen3-sharded-f32: untied F32 head; hidden 64, 3 layers, 4 heads x 32, 1 KV head,
    // intermediate 160, vocab 1024 (see its config.json).
    let backend = backend("tiny-qwen3-sharded-f32");
    let s = backend.summary();
    let (h, l, q, kv, i, v, hd) = (64u64, 3u64, 128u64, 32u64, 160u64, 1024u64, 32u64);
    let per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * hd;
    let params = v * h + l * per_layer + h + v * h;
    assert_eq!(s.parameters, params);
    assert_eq!(s.weight_bytes_per_token, 4 * (l * per_layer + h + v * h + h));
    assert_eq!(s.architecture, "Qwen3ForCausalLM");
    assert_eq!(s.backend, "kylin");
    assert_eq!(s.vocab_size, 1024);
    assert_eq!(s.context_size, 2048);
}
