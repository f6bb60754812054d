//! The native forward pass on real published models against transformers' float32 outputs.
//!
//! For `qwen2.5-coder-0.5b-instruct` and `smollm2-135m-instruct` (in `$KYLIN_MODELS`, default
//! `$HOME/.cache/kylin-models`, fetched by `shared/models/fetch.sh`): for every reference case,
//! starting from the reference `input_ids`, the argmax of every position and 32 greedy tokens
//! (prefill, then decode against the KV cache, EOS ignored) are exactly transformers'.
//! The tokenizer and chat-template side of these cases is tested with the text codec.

use std::path::{Path, PathBuf};

use kylin_engine::Backend;
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::sampler::argmax;
use serde_json::Value;

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

fn models_dir() -> PathBuf {
    match std::env::var_os("KYLIN_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").expect("HOME or KYLIN_MODELS must be set");
            Path::new(&home).join(".cache/kylin-models")
        }
    }
}

fn model_path(name: &str) -> PathBuf {
    let path = models_dir().join(name);
    assert!(
        path.join("config.json").is_file(),
        "real model '{name}' is missing at {}; run `bash testdata/models/fetch.sh` (or set KYLIN_MODELS)",
        path.display()
    );
    path
}

fn reference(name: &str) -> Value {
    let path = Path::new(SHARED).join("reference").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("an id list").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

fn check_model(name: &str) {
    let path = model_path(name);
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut backend = NativeBackend::new(model, NativeOptions { threads, ..Default::default() })
        .unwrap_or_else(|e| panic!("building the backend for {name}: {e}"));
    let vocab = backend.vocab_size();
    let reference = reference(name);
    let cases = reference["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "{name}: no cases in the reference");
    for (index, case) in cases.iter().enumerate() {
        let label = format!("{name} case {index} ({})", case["kind"].as_str().unwrap_or("?"));
        let prompt = ids(&case["input_ids"]);

        // Every position's argmax in one prefill.
        backend.reset();
        let all = backend.prefill_all_logits(&prompt).expect("prefill_all_logits");
        let argmaxes: Vec<u32> = all.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(argmaxes, ids(&case["argmax_per_position"]), "{label}: argmax per position");

        // The last position's best ids, where they are clearly separated, and their logits.
        let last = &all[(prompt.len() - 1) * vocab..];
        let top: Vec<(usize, f64)> = case["last_top10"]
            .as_array()
            .expect("last_top10")
            .iter()
            .map(|p| (p[0].as_u64().unwrap() as usize, p[1].as_f64().unwrap()))
            .collect();
        for pair in top.windows(2) {
            let ((a, la), (b, lb)) = (pair[0], pair[1]);
            if la - lb > 1e-2 {
                assert!(last[a] > last[b], "{label}: id {a} ({la}) should rank above id {b} ({lb})");
            }
        }

        // 32 greedy tokens through the KV cache.
        let want = ids(&case["greedy_new_ids"]);
        backend.reset();
        let mut got = Vec::with_capacity(want.len());
        let mut next = argmax(backend.prefill(&prompt).expect("prefill"));
        got.push(next);
        while got.len() < want.len() {
            next = argmax(backend.decode(next).expect("decode"));
            got.push(next);
        }
        assert_eq!(got, want, "{label}: greedy tokens");
    }
}

#[test]
fn qwen2_5_coder_0_5b_instruct_matches_transformers() {
    check_model("qwen2.5-coder-0.5b-instruct");
}

#[test]
fn smollm2_135m_instruct_matches_transformers() {
    check_model("smollm2-135m-instruct");
}

/// Splitting a pass's work over threads changes no bit: the products, and the row-wise work
/// that a long prompt splits too (norms, activations, residual adds, the q/k norm and RoPE).
/// A 200-token prompt's logits at every position with one thread and with two, in f32 and in
/// the default precision (BF16 where the CPU has it), and the last logits of passes that
/// compute only the last row, the same bits as the last row of the others.
#[test]
fn the_thread_count_changes_no_bit() {
    use kylin_engine::batch::EngineOptions;
    use kylin_engine::model::PrecisionChoice;
    for name in ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"] {
        let path = model_path(name);
        let prompt: Vec<u32> = (0..200u32).map(|i| (i * 7919 + 13) % 30_000).collect();
        for precision in [PrecisionChoice::F32, PrecisionChoice::Auto] {
            let backend = |threads: usize| {
                let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
                let engine = EngineOptions { threads, precision, ..EngineOptions::default() };
                NativeBackend::new(model, NativeOptions { threads, engine: Some(engine), ..Default::default() })
                    .unwrap()
            };
            let bits = |row: &[f32]| row.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let runs: Vec<(Vec<u32>, Vec<u32>)> = [1, 2]
                .into_iter()
                .map(|threads| {
                    let all = backend(threads).prefill_all_logits(&prompt).unwrap();
                    let last = backend(threads).prefill(&prompt).unwrap().to_vec();
                    (bits(&all), bits(&last))
                })
                .collect();
            let label = format!("{name} ({precision:?})");
            assert!(runs[0].0 == runs[1].0, "{label}: the logits with one thread and with two differ");
            assert!(runs[0].1 == runs[1].1, "{label}: the last logits with one thread and with two differ");
            let vocab = runs[0].1.len();
            assert!(runs[1].0[(prompt.len() - 1) * vocab..] == runs[1].1[..], "{label}: the last rows differ");
        }
    }
}
