//! The llama.cpp backend on the real GGUF models, checked against what Hugging Face computes.
//!
//! Models come from `$KYLIN_MODELS/gguf/` (default `~/.cache/kylin-models`); a missing model is
//! a failure with a message saying how to fetch it. Each model is loaded once per test binary
//! and shared behind a `Mutex` (the KV cache is state; every test resets it first).

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use kylin_engine::sampler::argmax;
use kylin_engine::{Backend, ChatMessage};
use kylin_llamacpp::{FlashAttention, LlamaCppBackend, LlamaCppOptions};
use kylin_loader::ErrorCode;
use serde_json::Value;

const SMOL: &str = "smollm2-135m-instruct";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct";

fn models_dir() -> PathBuf {
    match std::env::var_os("KYLIN_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").expect("HOME is set");
            PathBuf::from(home).join(".cache/kylin-models")
        }
    }
}

/// The GGUF file of a reference model; panics with instructions when it is absent.
fn gguf_path(name: &str) -> PathBuf {
    let file = match name {
        SMOL => "smollm2-135m-instruct-q4_1.gguf",
        QWEN => "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        other => panic!("no GGUF file known for {other}"),
    };
    let path = models_dir().join("gguf").join(file);
    assert!(path.is_file(), "{} is missing: run `bash testdata/models/fetch.sh` (or set KYLIN_MODELS)", path.display());
    path
}

fn reference(name: &str) -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/reference/");
    let text =
        std::fs::read_to_string(format!("{path}{name}.json")).unwrap_or_else(|e| panic!("reference {name}.json: {e}"));
    serde_json::from_str(&text).expect("reference JSON parses")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("an id list").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

fn opts() -> LlamaCppOptions {
    LlamaCppOptions { threads: 2, ctx_size: Some(1024), ..Default::default() }
}

/// The shared, reset backend for `name`.
fn model(name: &str) -> MutexGuard<'static, LlamaCppBackend> {
    static SMOL_M: OnceLock<Mutex<LlamaCppBackend>> = OnceLock::new();
    static QWEN_M: OnceLock<Mutex<LlamaCppBackend>> = OnceLock::new();
    let cell = if name == SMOL { &SMOL_M } else { &QWEN_M };
    let m = cell.get_or_init(|| {
        let path = gguf_path(name);
        Mutex::new(LlamaCppBackend::load(&path, &opts()).unwrap_or_else(|e| panic!("{e}")))
    });
    let mut guard = m.lock().unwrap_or_else(|p| p.into_inner());
    guard.reset();
    guard
}

fn check_tokenization(name: &str) {
    let r = reference(name);
    let m = model(name);
    let case = &r["cases"][0];
    let text = case["prompt_text"].as_str().unwrap();
    assert_eq!(text, "The capital of France is");
    assert_eq!(m.tokenize(text, true).unwrap(), ids(&case["input_ids"]), "{name}: {text:?}");
    for t in r["tokenization"].as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        let got = m.tokenize(text, true).unwrap();
        assert_eq!(got, ids(&t["ids"]), "{name}: tokenizing {text:?}");
        assert_eq!(m.detokenize(&got, false).unwrap(), text, "{name}: round trip of {text:?}");
    }
}

#[test]
fn smollm2_tokenizes_like_hf() {
    check_tokenization(SMOL);
}

#[test]
fn qwen25_tokenizes_like_hf() {
    check_tokenization(QWEN);
}

fn check_greedy_paris(name: &str) {
    let r = reference(name);
    let case = &r["cases"][0];
    let prompt = ids(&case["input_ids"]);
    let want = ids(&case["greedy_new_ids"]);
    let mut m = model(name);
    let n_vocab = m.vocab_size();
    let mut next = argmax(m.prefill(&prompt).unwrap());
    assert_eq!(m.position(), prompt.len());
    let mut out = vec![next];
    for _ in 1..8 {
        let logits = m.decode(next).unwrap();
        assert_eq!(logits.len(), n_vocab);
        next = argmax(logits);
        out.push(next);
    }
    assert_eq!(m.position(), prompt.len() + 7);
    let text = m.detokenize(&out, true).unwrap();
    assert!(text.starts_with(" Paris"), "{name}: greedy continuation {text:?}");
    // The first token is the reference's; later ones may drift with 4-bit weights.
    assert_eq!(out[0], want[0], "{name}: first greedy token");
}

#[test]
fn smollm2_greedy_says_paris() {
    check_greedy_paris(SMOL);
}

#[test]
fn qwen25_greedy_says_paris() {
    check_greedy_paris(QWEN);
}

#[test]
fn all_logits_agree_with_prefill_and_reset_restarts() {
    let r = reference(QWEN);
    let case = &r["cases"][0];
    let prompt = ids(&case["input_ids"]);
    let mut m = model(QWEN);
    let n = m.vocab_size();
    let all = m.prefill_all_logits(&prompt).unwrap();
    assert_eq!(all.len(), prompt.len() * n);
    // The last position of the reference's per-position argmax is the first greedy token.
    let want_argmax = ids(&case["argmax_per_position"]);
    assert_eq!(argmax(&all[(prompt.len() - 1) * n..]), *want_argmax.last().unwrap());
    m.reset();
    assert_eq!(m.position(), 0);
    let last = m.prefill(&prompt).unwrap().to_vec();
    let row = &all[(prompt.len() - 1) * n..];
    let max_diff = last.iter().zip(row).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_diff < 1e-3, "same prompt after reset differs by {max_diff}");
}

/// `FlashAttention::On` and `Off` reach llama.cpp: the same prompt's logits come out of two
/// different arithmetics (f16 value sums against f32 ones), so they are not bit-identical; both
/// pick the reference's greedy token and land near transformers' top ten logits (measured:
/// within 0.16 with flash attention, 0.10 without).
#[test]
fn flash_attention_choice_reaches_llama_cpp() {
    let r = reference(QWEN);
    let case = &r["cases"][0];
    let prompt = ids(&case["input_ids"]);
    let want = *ids(&case["argmax_per_position"]).last().unwrap();
    let top10: Vec<(usize, f32)> = case["last_top10"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pair| (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32))
        .collect();
    let path = gguf_path(QWEN);
    let mut logits = Vec::new();
    for flash_attention in [FlashAttention::On, FlashAttention::Off] {
        let mut m = LlamaCppBackend::load(&path, &LlamaCppOptions { flash_attention, ..opts() }).unwrap();
        let last = m.prefill(&prompt).unwrap().to_vec();
        assert_eq!(argmax(&last), want, "{flash_attention:?}");
        let off_reference = top10.iter().map(|&(id, v)| (last[id] - v).abs()).fold(0.0f32, f32::max);
        assert!(off_reference < 0.25, "{flash_attention:?}: top-10 logits {off_reference} from the reference");
        logits.push(last);
    }
    assert!(
        logits[0] != logits[1],
        "flash attention on and off gave bit-identical logits: the choice did not reach llama.cpp"
    );
}

/// The summary names the attention kernel llama.cpp runs, and `Auto` reports what llama.cpp
/// resolved it to: on a CPU it turns flash attention on, so `Auto` gives `On`'s logits bit for
/// bit and `Off` different ones.
#[test]
fn summary_names_the_attention_kernel_llama_cpp_resolved() {
    let r = reference(SMOL);
    let prompt = ids(&r["cases"][0]["input_ids"]);
    let path = gguf_path(SMOL);
    let mut runs = Vec::new();
    for flash_attention in [FlashAttention::Auto, FlashAttention::On, FlashAttention::Off] {
        let mut m = LlamaCppBackend::load(&path, &LlamaCppOptions { flash_attention, ..opts() }).unwrap();
        let kernels = m.summary().kernels;
        runs.push((kernels, m.prefill(&prompt).unwrap().to_vec()));
    }
    let attention = |i: usize| runs[i].0.rsplit_once(", attention ").map(|(_, a)| a.to_string());
    assert_eq!(attention(0).as_deref(), Some("flash (--flash-attn auto)"), "{}", runs[0].0);
    assert_eq!(attention(1).as_deref(), Some("flash (--flash-attn on)"), "{}", runs[1].0);
    assert_eq!(attention(2).as_deref(), Some("standard (--flash-attn off)"), "{}", runs[2].0);
    assert!(runs[0].1 == runs[1].1, "auto reported flash attention but its logits differ from --flash-attn on");
    assert!(runs[0].1 != runs[2].1, "auto and off gave bit-identical logits");
}

fn user(content: &str) -> ChatMessage {
    ChatMessage { role: "user".into(), content: content.into() }
}

fn check_chat(name: &str) {
    let r = reference(name);
    let m = model(name);
    let kwargs = serde_json::Map::new();
    let text = m.apply_chat_template(&[user("hello")], true, &kwargs).unwrap();
    assert!(text.contains("<|im_start|>user\nhello<|im_end|>"), "{name}: {text:?}");
    assert!(text.ends_with("<|im_start|>assistant\n"), "{name}: {text:?}");
    // Every chat case renders exactly as transformers renders it, default system prompt included.
    for case in &r["cases"].as_array().unwrap()[3..] {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["prompt"].clone()).unwrap();
        let text = m.apply_chat_template(&messages, true, &kwargs).unwrap();
        assert_eq!(text, case["prompt_text"].as_str().unwrap(), "{name}");
        assert_eq!(m.tokenize(&text, false).unwrap(), ids(&case["input_ids"]), "{name}");
    }
}

#[test]
fn smollm2_chat_template() {
    check_chat(SMOL);
}

#[test]
fn qwen25_chat_template() {
    check_chat(QWEN);
}

#[test]
fn eos_ids_are_the_models_end_tokens() {
    // <|im_end|> is SmolLM2's eos (2); Qwen2.5-instruct ends on <|im_end|> (151645) and
    // <|endoftext|> (151643).
    assert!(model(SMOL).eos_ids().contains(&2), "{:?}", model(SMOL).eos_ids());
    let q = model(QWEN);
    assert!(q.eos_ids().contains(&151645) && q.eos_ids().contains(&151643), "{:?}", q.eos_ids());
}

#[test]
fn summary_describes_the_model() {
    let m = model(QWEN);
    let s = m.summary();
    assert_eq!(s.backend, "llama.cpp");
    assert_eq!(s.architecture, "qwen2");
    assert_eq!(s.vocab_size, 151936);
    assert_eq!(s.context_size, 1024);
    assert_eq!(s.threads, 2);
    // Qwen2.5-0.5B has 494,032,768 parameters with a tied head; this GGUF also stores the head
    // as `output.weight` (151936 x 896), and llama.cpp counts every stored tensor.
    assert_eq!(s.parameters, 494_032_768 + 151_936 * 896);
    let file_len = std::fs::metadata(gguf_path(QWEN)).unwrap().len();
    assert!(s.weight_bytes_per_token > 0 && s.weight_bytes_per_token <= file_len);
    // A decoded token reads one row of the token embedding (the head is `output.weight`): the
    // per-token bytes are the tensors' less all but one embedding row.
    let info = kylin_loader::read_gguf_info(&gguf_path(QWEN)).unwrap();
    assert!(!info.tied_output && info.embedding_bytes > 0);
    assert_eq!(s.weight_bytes_per_token, info.tensor_bytes - info.embedding_bytes + info.embedding_bytes / 151936);
}

#[test]
fn bad_inputs_are_errors_not_crashes() {
    let mut m = model(SMOL);
    let n = m.vocab_size() as u32;
    assert_eq!(m.decode(n).unwrap_err().code(), ErrorCode::InputInvalid);
    assert_eq!(m.detokenize(&[u32::MAX], false).unwrap_err().code(), ErrorCode::InputInvalid);
    assert_eq!(m.prefill(&[]).unwrap_err().code(), ErrorCode::InputInvalid);
    assert_eq!(m.position(), 0);
    let too_long = vec![1u32; m.context_size() + 1];
    assert_eq!(m.prefill(&too_long).unwrap_err().code(), ErrorCode::ContextOverflow);
    assert_eq!(m.prefill_all_logits(&too_long).unwrap_err().code(), ErrorCode::ContextOverflow);
    assert_eq!(m.position(), 0);
    // A NUL byte is ordinary text for the Jinja renderer and for llama.cpp's byte-based
    // tokenizer (no C string is involved): rendered, tokenized, and the round trip holds.
    let nul = [user("a\0b")];
    let text = m.apply_chat_template(&nul, true, &serde_json::Map::new()).unwrap();
    assert!(text.contains("a\0b"));
    let ids = m.tokenize(&text, false).unwrap();
    assert_eq!(m.detokenize(&ids, false).unwrap(), text);
}

#[test]
fn second_load_in_one_process_works_and_long_prompts_are_chunked() {
    // The shared SmolLM2 instance may or may not exist yet; this load is another one anyway.
    let _shared = model(SMOL);
    let path = gguf_path(SMOL);
    // A template name (not Jinja) selects llama.cpp's built-in engine, which has no default
    // system prompt.
    let small =
        LlamaCppOptions { threads: 2, ctx_size: Some(700), chat_template_override: Some("chatml".into()), ..opts() };
    let mut m = LlamaCppBackend::load(&path, &small).unwrap();
    assert_eq!(m.context_size(), 700);
    assert!(m.load_ms() > 0.0);
    let text = m.apply_chat_template(&[user("hi")], true, &serde_json::Map::new()).unwrap();
    assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    // 600 tokens exceed one 512-token batch: the prompt goes in two chunks.
    let prompt: Vec<u32> = (0..600u32).map(|i| 1000 + (i * 37) % 20000).collect();
    let last = m.prefill(&prompt).unwrap().to_vec();
    assert_eq!(m.position(), 600);
    m.reset();
    let all = m.prefill_all_logits(&prompt).unwrap();
    let n = m.vocab_size();
    assert_eq!(all.len(), 600 * n);
    let max_diff = last.iter().zip(&all[599 * n..]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_diff < 1e-3, "chunked prefill vs all-logits differ by {max_diff}");
    let overflow = vec![5u32; 101];
    assert_eq!(m.prefill(&overflow).unwrap_err().code(), ErrorCode::ContextOverflow);
}

#[test]
fn truncated_gguf_is_file_corrupted() {
    let src = std::fs::read(gguf_path(SMOL)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("truncated.gguf");
    std::fs::write(&path, &src[..src.len() / 2]).unwrap();
    let e = LlamaCppBackend::load(&path, &opts()).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FileCorrupted, "{e}");
    assert!(e.message.contains("truncated.gguf"), "{e}");
}

#[test]
fn non_gguf_file_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-a-model.gguf");
    std::fs::write(&path, b"{\"this\": \"is json, not GGUF\"}\n".repeat(100)).unwrap();
    let e = LlamaCppBackend::load(&path, &opts()).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FileCorrupted, "{e}");
    assert!(e.message.contains("not-a-model.gguf"), "{e}");
    let missing = dir.path().join("missing.gguf");
    let e = LlamaCppBackend::load(&missing, &opts()).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FileNotFound, "{e}");
}
