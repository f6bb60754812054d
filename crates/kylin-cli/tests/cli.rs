//! The `kylin` binary end to end: routing by format, the JSON shapes scripts rely on, errors as
//! `[CODE]` lines or `{"error": ...}` objects with a non-zero exit, on the fixtures and the real
//! models (HF directories and GGUF files).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

mod common;
use common::{kylin, kylin_with_env, s};

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

fn models_dir() -> PathBuf {
    match std::env::var_os("KYLIN_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/kylin-models"),
    }
}

fn model(name: &str) -> PathBuf {
    let path = models_dir().join(name);
    assert!(path.exists(), "{} is missing: run `bash testdata/models/fetch.sh --bench`", path.display());
    path
}

fn json_of(out: &Output) -> Value {
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {text}\nstderr: {}", String::from_utf8_lossy(&out.stderr)))
}

fn ok_json(args: &[&str]) -> Value {
    let out = kylin(args);
    assert!(out.status.success(), "kylin {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    json_of(&out)
}

#[test]
fn inspect_json_describes_the_published_qwen3_layout() {
    let dir = model("qwen3-0.6b-shaped");
    let r = ok_json(&["inspect", s(&dir), "--json"]);
    assert_eq!(r["format"], "hf-dir");
    assert_eq!(r["architecture"], "Qwen3ForCausalLM");
    assert_eq!(r["model_type"], "qwen3");
    assert_eq!(r["tensor_count"], 311);
    assert_eq!(r["dtypes"]["BF16"], 311);
    let c = &r["config"];
    for (key, want) in [
        ("hidden_size", 1024),
        ("num_layers", 28),
        ("num_heads", 16),
        ("num_kv_heads", 8),
        ("head_dim", 128),
        ("intermediate_size", 3072),
        ("vocab_size", 151936),
        ("max_position_embeddings", 40960),
    ] {
        assert_eq!(c[key], want, "config.{key}");
    }
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["rope"]["type"], "default");
    assert_eq!(c["rope"]["theta"], 1_000_000.0);
    assert_eq!(c["rms_norm_eps"], 1e-6);
    assert_eq!(r["binding"]["head"]["tied"], true);
    let reason = r["binding"]["head"]["reason"].as_str().unwrap();
    assert!(reason.contains("lm_head.weight is present but ignored"), "{reason}");
    assert_eq!(r["files"].as_array().unwrap().len(), 1);
    assert!(r["total_bytes"].as_u64().unwrap() > 1_400_000_000);
    let t = &r["tokenizer"];
    assert_eq!(t["vocab_size"], 151669);
    assert_eq!(t["has_chat_template"], true);
    let eos: Vec<u64> = t["eos_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(eos.contains(&151645) && eos.contains(&151643), "{eos:?}");
    assert!(r["generation_defaults"].is_object());
    assert!(r["warnings"].as_array().unwrap().is_empty(), "{}", r["warnings"]);
}

#[test]
fn inspect_succeeds_on_every_fixture_and_real_model_and_reads_gguf_metadata() {
    for entry in std::fs::read_dir(Path::new(SHARED).join("fixtures")).unwrap() {
        let path = entry.unwrap().path();
        let out = kylin(&["inspect", s(&path)]);
        assert!(out.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("format      hf-dir"));
    }
    for name in ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"] {
        let r = ok_json(&["inspect", s(&model(name)), "--json"]);
        assert_eq!(r["backend"], "kylin", "{name}");
    }
    let r = ok_json(&["inspect", s(&model("gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")), "--json"]);
    assert_eq!(r["format"], "gguf");
    assert_eq!(r["backend"], "llama.cpp");
    assert_eq!(r["architecture"], "qwen2");
    assert_eq!(r["tensor_count"], 291);
    let quant: Vec<&str> =
        r["gguf"]["quantization_types"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(quant.contains(&"Q4_K") && quant.contains(&"Q6_K"), "{quant:?}");
    assert_eq!(r["gguf"]["file_type"], "MOSTLY_Q4_K_M");
    assert_eq!(r["config"]["hidden_size"], 896);
    assert_eq!(r["tokenizer"]["vocab_size"], 151936);
    assert_eq!(r["tokenizer"]["has_chat_template"], true);
}

#[test]
fn errors_are_one_coded_line_or_one_json_object_and_exit_non_zero() {
    let out = kylin(&["inspect", "/nonexistent/model"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("[FILE_NOT_FOUND] ") && err.contains("/nonexistent/model"), "{err}");

    let out = kylin(&["inspect", "/nonexistent/model", "--json"]);
    assert!(!out.status.success());
    let r = json_of(&out);
    assert_eq!(r["error"]["code"], "FILE_NOT_FOUND");
    assert!(r["error"]["message"].as_str().unwrap().contains("/nonexistent/model"));

    // A truncated GGUF is caught before llama.cpp sees it.
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("cut.gguf");
    let bytes = std::fs::read(model("gguf/smollm2-135m-instruct-q4_1.gguf")).unwrap();
    std::fs::write(&gguf, &bytes[..bytes.len() / 2]).unwrap();
    for args in [vec!["inspect", s(&gguf), "--json"], vec!["run", s(&gguf), "-p", "x", "--json"]] {
        let out = kylin(&args);
        assert!(!out.status.success());
        assert_eq!(json_of(&out)["error"]["code"], "FILE_CORRUPTED", "{args:?}");
    }

    // Flags: an id outside the vocabulary, a prompt longer than the context, a bad messages file.
    let tiny = Path::new(SHARED).join("fixtures/tiny-qwen3");
    let out = kylin(&["run", s(&tiny), "--ids", "1,999999", "--json"]);
    assert_eq!(json_of(&out)["error"]["code"], "INPUT_INVALID");
    let out = kylin(&["run", s(&tiny), "--ids", "1,2,3,4,5", "--ctx-size", "3", "--json"]);
    assert_eq!(json_of(&out)["error"]["code"], "CONTEXT_OVERFLOW");
    let bad = dir.path().join("messages.json");
    std::fs::write(&bad, r#"[{"role": "user"}]"#).unwrap();
    let out = kylin(&["run", s(&tiny), "--messages", s(&bad), "--json"]);
    let r = json_of(&out);
    assert_eq!(r["error"]["code"], "INPUT_INVALID");
    assert!(r["error"]["message"].as_str().unwrap().contains("messages.json"));
    // The native engine refuses a GGUF file forced onto it, naming the fix.
    let out = kylin(&["run", s(&gguf), "--backend", "native", "-p", "x"]);
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("[OPERATOR_UNSUPPORTED] "));
}

#[test]
fn run_json_matches_the_reference_greedy_ids() {
    // The first raw-prompt case of the Qwen2.5 reference, through the CLI.
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(SHARED).join("reference/qwen2.5-coder-0.5b-instruct.json")).unwrap(),
    )
    .unwrap();
    let case = &reference["cases"][0];
    let prompt = case["prompt_text"].as_str().unwrap();
    let want: Vec<u64> = case["greedy_new_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let dir = model("qwen2.5-coder-0.5b-instruct");
    let r = ok_json(&[
        "run",
        s(&dir),
        "-p",
        prompt,
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
        "--precision",
        "f32",
    ]);
    assert_eq!(r["prompt_ids"], case["input_ids"]);
    let got: Vec<u64> = r["generated_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(got, want[..12]);
    assert_eq!(r["finish_reason"], "length");
    assert!(r["text"].as_str().unwrap().len() > 4);
    assert!(r["timings"]["decode_tok_s"].as_f64().unwrap() > 0.0);

    // A stop string ends generation and is not returned.
    let full = r["text"].as_str().unwrap();
    let stop: String = full.chars().skip(4).take(3).collect();
    let r =
        ok_json(&["run", s(&dir), "-p", prompt, "--temperature", "0", "--max-tokens", "12", "--stop", &stop, "--json"]);
    assert_eq!(r["finish_reason"], "stop");
    assert!(full.starts_with(r["text"].as_str().unwrap()) && !r["text"].as_str().unwrap().contains(&stop));
}

#[test]
fn logits_json_has_one_entry_per_position_best_first() {
    let tiny = Path::new(SHARED).join("fixtures/tiny-qwen2-f16");
    let r = ok_json(&["logits", s(&tiny), "--ids", "1,2,3", "--top", "5", "--json"]);
    let positions = r["positions"].as_array().unwrap();
    assert_eq!(positions.len(), 3);
    for p in positions {
        let top = p["top"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        let logits: Vec<f64> = top.iter().map(|pair| pair[1].as_f64().unwrap()).collect();
        assert!(logits.windows(2).all(|w| w[0] >= w[1]), "{logits:?}");
    }
}

#[test]
fn gguf_runs_through_llama_cpp_with_the_same_commands() {
    for name in ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-instruct-q4_k_m"] {
        let path = model(&format!("gguf/{name}.gguf"));
        let out =
            kylin(&["run", s(&path), "-p", "The capital of France is", "--temperature", "0", "--max-tokens", "8"]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.starts_with(" Paris"), "{name}: {text:?}");
        let summary = String::from_utf8_lossy(&out.stderr);
        assert!(summary.contains("prompt tokens") && summary.contains("decode"), "{summary}");
    }
}

#[test]
fn chat_keeps_the_history_and_reuses_the_cache() {
    let dir = model("smollm2-135m-instruct");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kylin"))
        .args(["chat", s(&dir), "--temperature", "0", "--max-tokens", "16"])
        .env("KYLIN_QUIET", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"What is the capital of France?\nAnd of Germany?\n/exit\n").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Paris"), "{text}");
    let log = String::from_utf8_lossy(&out.stderr);
    let summaries: Vec<&str> = log.lines().filter(|l| l.contains("prompt tokens")).collect();
    assert_eq!(summaries.len(), 2, "{log}");
    assert!(summaries[1].contains("from the cache"), "the second turn recomputed everything: {}", summaries[1]);
}

#[test]
fn bench_json_reports_both_engines_and_their_ratios() {
    let hf = model("smollm2-135m-instruct");
    let gguf = model("gguf/smollm2-135m-instruct-q4_1.gguf");
    let r = ok_json(&[
        "bench",
        s(&hf),
        "--vs",
        s(&gguf),
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--repetitions",
        "1",
        "--json",
    ]);
    for key in ["load_ms", "ttft_ms", "prefill_tok_s", "decode_tok_s", "peak_rss_mb", "decode_gb_s"] {
        assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {}", r[key]);
    }
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["backend"], "kylin");
    assert_eq!(results[1]["backend"], "llama.cpp");
    assert!(r["ratios"]["decode_tok_s"].as_f64().unwrap() > 0.0);
    assert!(r["machine_read_gb_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_no_warmup_measures_from_the_first_round() {
    let tiny = Path::new(SHARED).join("fixtures/tiny-qwen3");
    let args = ["bench", s(&tiny), "--prompt-tokens", "8", "--gen-tokens", "2", "--repetitions", "2"];
    let out = kylin(&[&args[..], &["--no-warmup"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!log.contains("warm-up"), "a warm-up round ran: {log}");
    assert!(log.contains("run 1") && log.contains("run 2"), "{log}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("median of 2 runs (no warm-up)"));
    // Without the flag, the warm-up round comes first.
    let out = kylin(&args);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("warm-up"));
}

#[test]
fn bench_concurrency_json_reports_the_batching_figures_for_both_engines() {
    let hf = model("smollm2-135m-instruct");
    let gguf = model("gguf/smollm2-135m-instruct-q4_1.gguf");
    let r = ok_json(&[
        "bench",
        s(&hf),
        "--vs",
        s(&gguf),
        "--concurrency",
        "3",
        "--prompt-tokens",
        "40",
        "--gen-tokens",
        "6",
        "--repetitions",
        "1",
        "--shared-prefix",
        "32",
        "--json",
    ]);
    for key in ["aggregate_decode_tok_s", "decode_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"] {
        assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {}", r[key]);
    }
    assert_eq!(r["concurrency"], 3);
    assert!(r["kv_blocks"].as_u64().unwrap() >= 2 && r["kv_tokens"].as_u64().unwrap() >= 31);
    assert_eq!(r["preemptions"].as_f64(), Some(0.0));
    // The shared 32 tokens are whole blocks (one of 32 where attention runs on AMX, two of 16
    // elsewhere), found by the two later requests: 2 x 32 of 120 prompt tokens.
    let rate = r["prefix_hit_rate"].as_f64().unwrap();
    assert!((rate - 64.0 / 120.0).abs() < 1e-9, "prefix hit rate {rate}");
    let results = r["results"].as_array().unwrap();
    assert_eq!((results[0]["backend"].as_str(), results[1]["backend"].as_str()), (Some("kylin"), Some("llama.cpp")));
    assert!(r["ratios"]["aggregate_decode_tok_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn perplexity_saves_a_base_and_compares_a_16_bit_kv_cache_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.kl");
    let hf = model("smollm2-135m-instruct");
    let text = Path::new(SHARED).join("data/gpl-3.0.txt");
    let args = |extra: &[&'static str]| {
        // f32 products, so the cache follows them in f32 unless a flag says otherwise.
        let mut a = vec!["perplexity", s(&hf), "--file", s(&text), "--ctx", "128", "--chunks", "2", "--json"];
        a.extend_from_slice(&["--precision", "f32", "--kl-divergence-base", s(&base)]);
        a.extend_from_slice(extra);
        a.into_iter().map(str::to_string).collect::<Vec<_>>()
    };
    let run = |a: Vec<String>| ok_json(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let saved = run(args(&[]));
    assert_eq!(saved["kl"]["mode"], "saved");
    assert_eq!(saved["scored_tokens"], 2 * 63);
    let ppl = saved["perplexity"].as_f64().unwrap();
    assert!(ppl > 1.0 && ppl < 1000.0, "{ppl}");
    // The same run again: nothing differs.
    let same = run(args(&[]));
    assert_eq!(same["kl"]["mean_kl_divergence"].as_f64(), Some(0.0));
    assert_eq!(same["kl"]["top1_agreement"].as_f64(), Some(1.0));
    // A bf16 cache differs a little, measurably.
    let bf16 = run(args(&["--kv-dtype", "bf16"]));
    let kl = bf16["kl"]["mean_kl_divergence"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 0.01, "{kl}");
    // A base from another window size is refused with the numbers.
    let out = kylin(&[
        "perplexity",
        s(&hf),
        "--file",
        s(&text),
        "--ctx",
        "64",
        "--chunks",
        "2",
        "--kl-divergence-base",
        s(&base),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ctx 128"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn flash_attn_configures_llama_cpp_and_is_refused_natively() {
    // A GGUF file runs with either llama.cpp attention; greedy decoding still says Paris.
    let gguf = model("gguf/smollm2-135m-instruct-q4_1.gguf");
    for flag in ["on", "off"] {
        let out =
            kylin(&["run", s(&gguf), "-p", "The capital of France is", "--max-tokens", "2", "--flash-attn", flag]);
        assert!(out.status.success(), "--flash-attn {flag}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("Paris"), "{}", String::from_utf8_lossy(&out.stdout));
    }
    // Kylin's own engine has one attention: on or off is CONFIG_INVALID naming the flag.
    let tiny = Path::new(SHARED).join("fixtures/tiny-qwen3");
    let out = kylin(&["run", s(&tiny), "--ids", "1,2", "--max-tokens", "1", "--flash-attn", "off"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("[CONFIG_INVALID] ") && err.contains("--flash-attn off"), "{err}");
}

#[test]
fn precision_is_reported_and_refused_where_it_cannot_apply() {
    // inspect names the kernel families and what `--precision auto` runs.
    let bf16_dir = model("smollm2-135m-instruct");
    let r = ok_json(&["inspect", s(&bf16_dir), "--json"]);
    let f32_kernels = r["kernels"]["f32"].as_str().unwrap();
    assert!(["avx512", "avx2", "scalar"].contains(&f32_kernels), "{f32_kernels}");
    let q8_kernels = r["kernels"]["q8_0"].as_str().unwrap();
    assert!(["avx512-vnni", "avx2", "scalar"].contains(&q8_kernels), "{q8_kernels}");
    let q4k_kernels = r["kernels"]["q4_k"].as_str().unwrap();
    assert!(
        q4k_kernels == q8_kernels || (q8_kernels == "avx512-vnni" && q4k_kernels == "avx512-vnni+amx-int8"),
        "Q4_K runs on the int8 family: {q4k_kernels} against {q8_kernels}"
    );
    let has_bf16 = r["kernels"]["bf16"].is_string();
    assert_eq!(r["kernels"]["auto_precision"], if has_bf16 { "bf16" } else { "f32" });
    let f32_fixture = Path::new(SHARED).join("fixtures/tiny-qwen3-sharded-f32");
    assert_eq!(ok_json(&["inspect", s(&f32_fixture), "--json"])["kernels"]["auto_precision"], "f32");

    // bf16 on F32 weights (or on a CPU without BF16 kernels) is CONFIG_INVALID, naming why.
    let out = kylin(&["run", s(&f32_fixture), "--ids", "1,2", "--precision", "bf16"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("[CONFIG_INVALID] ") && err.contains("--precision bf16"), "{err}");
    if has_bf16 {
        assert!(err.contains("stored as F32"), "{err}");
    }
    // int8 needs quantized weights.
    let out = kylin(&["run", s(&f32_fixture), "--ids", "1,2", "--precision", "int8"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("[CONFIG_INVALID] ") && err.contains("--precision int8") && err.contains("--quantize"),
        "{err}"
    );
    // On a published W4A16 checkpoint it runs the int8 products on every CPU.
    let w4a16 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quantized/tiny-qwen3-w4a16");
    let r = ok_json(&["run", s(&w4a16), "--ids", "1,2", "--max-tokens", "2", "--json", "--precision", "int8"]);
    assert_eq!(r["precision"], "int8");
    // GGUF runs through llama.cpp, which picks its own arithmetic.
    let gguf = model("gguf/smollm2-135m-instruct-q4_1.gguf");
    for flag in ["f32", "int8"] {
        let out = kylin(&["run", s(&gguf), "-p", "x", "--precision", flag]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("[CONFIG_INVALID] ") && err.contains("native engine"), "{err}");
    }

    // bench passes --precision to its workers and reports what ran.
    let tiny_bf16 = Path::new(SHARED).join("fixtures/tiny-qwen3");
    for (flag, want) in [("f32", "f32"), ("auto", if has_bf16 { "bf16" } else { "f32" })] {
        let r = ok_json(&[
            "bench",
            s(&tiny_bf16),
            "--prompt-tokens",
            "8",
            "--gen-tokens",
            "2",
            "--repetitions",
            "1",
            "--json",
            "--precision",
            flag,
        ]);
        assert_eq!(r["results"][0]["precision"], want, "bench --precision {flag}");
    }

    // run --json says which precision ran.
    let r = ok_json(&["run", s(&bf16_dir), "-p", "Hi", "--max-tokens", "2", "--json"]);
    assert_eq!(r["precision"], if has_bf16 { "bf16" } else { "f32" });
    let r = ok_json(&["run", s(&bf16_dir), "-p", "Hi", "--max-tokens", "2", "--json", "--precision", "f32"]);
    assert_eq!(r["precision"], "f32");
}

/// `kylin quantize` writes a directory that loads in place and computes exactly what
/// `--quantize q8_0` computes on the original: the same logits, bit for bit, on a fixture and a
/// real model (with a tied head, stored separately). It refuses what it cannot do, and a
/// broken quantized directory gets its error code.
#[test]
fn quantize_writes_q8_0_and_q4_k_directories_that_load_in_place_with_the_same_logits() {
    let out_root = std::env::temp_dir().join(format!("kylin-quantize-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_root);
    for (name, source, format) in [
        ("tiny-llama-rope3", Path::new(SHARED).join("fixtures/tiny-llama-rope3"), "q8_0"),
        ("smollm2", model("smollm2-135m-instruct"), "q8_0"),
        ("tiny-llama-rope3-q4_k", Path::new(SHARED).join("fixtures/tiny-llama-rope3"), "q4_k"),
        ("smollm2-q4_k", model("smollm2-135m-instruct"), "q4_k"),
    ] {
        let out = out_root.join(name);
        let q = kylin(&["quantize", s(&source), "--to", format, s(&out)]);
        assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
        let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["quantization_config"]["quant_method"], "kylin");
        assert_eq!(config["quantization_config"]["format"], format!("{format}-packed"));
        assert_eq!(config["tie_word_embeddings"], false);
        let ids = "1,5,9,200,17,3,44";
        let logits = |dir: &Path, extra: &[&str]| {
            let mut a = vec!["logits", s(dir), "--ids", ids, "--top", "8", "--json"];
            a.extend_from_slice(extra);
            ok_json(&a)["positions"].clone()
        };
        let stored = logits(&out, &[]);
        let at_load = logits(&source, &["--quantize", format]);
        assert_eq!(stored, at_load, "{name}: the stored model differs from --quantize {format}");
        let float = logits(&source, &["--precision", "f32"]);
        assert_ne!(stored, float, "{name}: the quantized logits equal the f32 ones: nothing was quantized");
        if format == "q8_0" {
            // BF16 activations over the same planes (`--precision bf16`, where the CPU has
            // AVX-512 BF16): the stored and the at-load model still agree bit for bit.
            let probe = kylin(&["logits", s(&out), "--ids", ids, "--precision", "bf16"]);
            if probe.status.success() {
                let stored_bf16 = logits(&out, &["--precision", "bf16"]);
                assert_eq!(stored_bf16, logits(&source, &["--quantize", format, "--precision", "bf16"]), "{name}");
                assert_ne!(stored_bf16, stored, "{name}: BF16 activations gave the int8 logits");
            } else {
                let err = String::from_utf8_lossy(&probe.stderr);
                assert!(err.starts_with("[CONFIG_INVALID] ") && err.contains("AVX-512 BF16"), "{err}");
            }
        }
        // inspect describes the stored quantization.
        let r = ok_json(&["inspect", s(&out), "--json"]);
        assert!(r.to_string().contains(&format!("{format}-packed")), "{r}");
        if name == "smollm2-q4_k" {
            // The recipe: Q4_K where a matrix has whole 256-column super-blocks (down_proj),
            // Q5_0 where it does not (the 576-column projections); where Q4_K_M wants more
            // bits, Q6_0 for whole super-blocks (down_proj in the `use_more_bits` layers) and
            // Q8_0 otherwise (the head, v_proj).
            let kinds = r["binding"]["quantization"]["kinds"].to_string();
            for kind in ["Q4_K", "Q5_0", "Q6_0", "Q8_0"] {
                assert!(kinds.contains(kind), "{kind} missing: {kinds}");
            }
        }
    }
    // A Q4_K plane of the wrong shape is named, with its format.
    let q4 = out_root.join("smollm2-q4_k");
    let shape_dir = out_root.join("broken-q4_k-shape");
    std::fs::create_dir_all(&shape_dir).unwrap();
    std::fs::copy(q4.join("model.safetensors"), shape_dir.join("model.safetensors")).unwrap();
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(q4.join("config.json")).unwrap()).unwrap();
    config["intermediate_size"] = 1024.into();
    std::fs::write(shape_dir.join("config.json"), config.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(q4.join(f), shape_dir.join(f)).unwrap();
    }
    let err = String::from_utf8_lossy(&kylin(&["run", s(&shape_dir), "--ids", "1,2"]).stderr).to_string();
    assert!(err.starts_with("[TENSOR_SHAPE_MISMATCH] ") && err.contains("Q4_K planes"), "{err}");
    // A `q4_k-packed` directory of version 1 (Q5_0's and Q6_0's high bits laid out as masks)
    // is refused with the command that writes it again, not read with the new layout.
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(q4.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["version"], 2);
    config["quantization_config"]["version"] = 1.into();
    std::fs::write(shape_dir.join("config.json"), config.to_string()).unwrap();
    let err = String::from_utf8_lossy(&kylin(&["run", s(&shape_dir), "--ids", "1,2"]).stderr).to_string();
    assert!(err.starts_with("[MODEL_VERSION_INCOMPATIBLE] ") && err.contains("kylin quantize"), "{err}");
    // A directory that already holds a model is not overwritten; GGUF files are refused.
    let again = kylin(&[
        "quantize",
        s(&Path::new(SHARED).join("fixtures/tiny-qwen3")),
        "--to",
        "q8_0",
        s(&out_root.join("smollm2")),
    ]);
    assert!(
        String::from_utf8_lossy(&again.stderr).starts_with("[INPUT_INVALID] "),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let gguf = model("gguf/smollm2-135m-instruct-q4_1.gguf");
    let out = kylin(&["quantize", s(&gguf), "--to", "q8_0", s(&out_root.join("gguf"))]);
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("[INPUT_INVALID] "),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = kylin(&["run", s(&gguf), "-p", "x", "--quantize", "q8_0"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("[CONFIG_INVALID] "),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Broken copies of the quantized fixture: each gets its code.
    let good = out_root.join("tiny-llama-rope3");
    let broken = |what: &str, edit: &dyn Fn(&mut Value)| {
        let dir = out_root.join(format!("broken-{what}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
            if good.join(f).exists() {
                std::fs::copy(good.join(f), dir.join(f)).unwrap();
            }
        }
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(good.join("config.json")).unwrap()).unwrap();
        edit(&mut config);
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let out = kylin(&["run", s(&dir), "--ids", "1,2"]);
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = broken("method", &|c| c["quantization_config"]["quant_method"] = "bitsandbytes".into());
    assert!(err.starts_with("[OPERATOR_UNSUPPORTED] ") && err.contains("bitsandbytes"), "{err}");
    // A published method's fields are required: GPTQ without `bits`.
    let err = broken("gptq", &|c| c["quantization_config"]["quant_method"] = "gptq".into());
    assert!(err.starts_with("[CONFIG_INVALID] ") && err.contains("'bits'"), "{err}");
    let err = broken("format", &|c| c["quantization_config"]["format"] = "q4_k".into());
    assert!(err.starts_with("[OPERATOR_UNSUPPORTED] ") && err.contains("q4_k"), "{err}");
    let err = broken("version", &|c| c["quantization_config"]["version"] = 2.into());
    assert!(err.starts_with("[MODEL_VERSION_INCOMPATIBLE] "), "{err}");
    // Without quantization_config, the U8 planes are not float matrices.
    let err = broken("plain", &|c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    assert!(err.starts_with("[TENSOR_SHAPE_MISMATCH] ") || err.starts_with("[TENSOR_DTYPE_UNSUPPORTED] "), "{err}");
    // A different intermediate size makes the planes the wrong shape, named.
    let err = broken("shape", &|c| c["intermediate_size"] = 256.into());
    assert!(err.starts_with("[TENSOR_SHAPE_MISMATCH] ") && err.contains("Q8_0 planes"), "{err}");
    // Weights files with a scale plane missing, or stored in another dtype.
    let rewrite = |what: &str, edit: &dyn Fn(&str, safetensors::Dtype) -> Option<safetensors::Dtype>| {
        let dir = out_root.join(format!("broken-{what}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(good.join("config.json"), dir.join("config.json")).unwrap();
        let bytes = std::fs::read(good.join("model.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = file
            .tensors()
            .into_iter()
            .filter_map(|(name, t)| {
                let dtype = edit(&name, t.dtype())?;
                Some((name, safetensors::tensor::TensorView::new(dtype, t.shape().to_vec(), t.data()).unwrap()))
            })
            .collect();
        safetensors::serialize_to_file(kept, None, &dir.join("model.safetensors")).unwrap();
        let out = kylin(&["run", s(&dir), "--ids", "1,2"]);
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let scale = "model.layers.1.mlp.down_proj.weight_scale";
    let err = rewrite("no-scale", &|name, dtype| (name != scale).then_some(dtype));
    assert!(err.starts_with("[TENSOR_MISSING] ") && err.contains(scale), "{err}");
    let err = rewrite("scale-dtype", &|name, dtype| Some(if name == scale { safetensors::Dtype::BF16 } else { dtype }));
    assert!(err.starts_with("[TENSOR_DTYPE_UNSUPPORTED] ") && err.contains(scale) && err.contains("F16"), "{err}");
    let _ = std::fs::remove_dir_all(&out_root);
}

/// Issue 13: every published quantized fixture runs through `run`, `logits` and `bench` as it
/// is, on both paths; `logits --precision f32` gives transformers' argmax at every position
/// (of a prompt the activation-quantized fixtures follow exactly, published.rs).
#[test]
fn published_quantized_checkpoints_run_through_run_logits_and_bench() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quantized");
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "reference" && n != "README.md" && !n.ends_with("-bf16"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 20, "{names:?}");
    for name in &names {
        let dir = root.join(name);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(root.join(format!("reference/{name}.json"))).unwrap())
                .unwrap();
        let case = &reference["cases"][1];
        let ids: Vec<String> = case["input_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
        let ids = ids.join(",");
        let want: Vec<u64> =
            case["argmax_per_position"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let r = ok_json(&["logits", s(&dir), "--ids", &ids, "--top", "1", "--precision", "f32", "--json"]);
        let got: Vec<u64> =
            r["positions"].as_array().unwrap().iter().map(|p| p["top"][0][0].as_u64().unwrap()).collect();
        assert_eq!(got, want, "{name}: logits --precision f32 argmax");
        for precision in ["f32", "auto"] {
            let out = kylin(&[
                "run",
                s(&dir),
                "--ids",
                &ids,
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--precision",
                precision,
            ]);
            assert!(out.status.success(), "{name} {precision}: {}", String::from_utf8_lossy(&out.stderr));
            assert!(!out.stdout.is_empty(), "{name} {precision}: no text");
        }
        let b =
            ok_json(&["bench", s(&dir), "--prompt-tokens", "8", "--gen-tokens", "4", "--repetitions", "1", "--json"]);
        assert!(b["decode_tok_s"].as_f64().unwrap() > 0.0, "{name}: {b}");
        // Decoding a published checkpoint is timed as a quantization.
        assert!(b["results"][0]["quantize_ms"].as_f64().is_some(), "{name}: {b}");
    }
    // `kylin quantize` refuses a checkpoint that is already quantized, naming it.
    let out = kylin(&["quantize", s(&root.join("tiny-qwen3-w4a16")), "--to", "q8_0", "/tmp/kylin-never-written"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("INPUT_INVALID") && err.contains("already quantized") && err.contains("compressed-tensors"),
        "{err}"
    );
    assert!(!Path::new("/tmp/kylin-never-written/model.safetensors").exists());
}

#[test]
fn serve_takes_one_model_or_a_set_of_models_and_says_which_is_missing() {
    let tiny = Path::new(SHARED).join("fixtures/tiny-qwen3");
    let dir = tempfile::tempdir().unwrap();
    let fixtures = Path::new(SHARED).join("fixtures");
    let cases: [(Vec<&str>, &str); 6] = [
        (vec!["serve", "--port", "0"], "kylin serve needs a model"),
        (vec!["serve", s(&tiny), "--models-dir", s(dir.path())], "not both"),
        (vec!["serve", "--models-dir", s(dir.path())], "no models there"),
        (vec!["serve", s(&tiny), "--models-memory", "1GiB"], "--models-memory applies only"),
        (vec!["serve", "--models-dir", s(&tiny)], "is itself a model directory"),
        (
            vec!["serve", "--models-dir", s(&fixtures), "--models-memory", "lots"],
            "--models-memory 'lots' is not a size",
        ),
    ];
    for (args, expected) in cases {
        let out = kylin(&args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("[INPUT_INVALID] ") && err.contains(expected), "{args:?}: {err}");
    }
}

#[test]
fn bench_concurrency_with_a_draft_model_accepts_a_self_draft_and_refuses_another_vocabulary() {
    // A model drafting for itself in greedy decoding: every proposal is accepted.
    let target = Path::new(SHARED).join("fixtures/tiny-qwen3");
    let bench = |draft: &Path| {
        kylin(&[
            "bench",
            s(&target),
            "--concurrency",
            "2",
            "--prompt-tokens",
            "16",
            "--gen-tokens",
            "12",
            "--repetitions",
            "1",
            "--draft-model",
            s(draft),
            "--json",
        ])
    };
    let out = bench(&target);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = json_of(&out);
    assert_eq!(r["spec_acceptance_rate"].as_f64(), Some(1.0), "{r}");
    // A draft with another vocabulary size is a typed error naming it.
    let other = Path::new(SHARED).join("fixtures/tiny-qwen2-f16");
    let out = bench(&other);
    assert!(!out.status.success());
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("VOCAB_MISMATCH") && text.contains("tiny-qwen2-f16"), "{text}");
}

#[test]
fn run_with_an_image_answers_as_transformers_and_refuses_what_is_no_image() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = repo.join("tests/fixtures/tiny-qwen3.5-vl-mrope");
    let png = repo.join("tests/fixtures/vision_model/chat.png");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(repo.join("tests/fixtures/vision_model/chat.json")).unwrap())
            .unwrap();
    let question = reference["question"].as_str().unwrap();
    let common = ["run", s(&dir), "--precision", "f32", "--image", s(&png), "-p", question];
    let r = ok_json(&[&common[..], &["--max-tokens", "10", "--ignore-eos", "--json"]].concat());
    assert_eq!(r["prompt_ids"], reference["prompt_ids"]);
    assert_eq!(r["generated_ids"], reference["greedy_new_ids"]);
    assert_eq!(r["text"], reference["greedy_text"]);
    assert_eq!(r["image_tokens"], 24);
    // A file that is no image: the code, the decoder's reason and the path.
    let config = dir.join("config.json");
    let out = kylin(&["run", s(&dir), "--image", s(&config), "-p", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("IMAGE_INVALID") && err.contains("IMAGE_FORMAT") && err.contains("config.json"), "{err}");
    // A model without a vision tower.
    let text_model = repo.join("testdata/fixtures/tiny-qwen3");
    let out = kylin(&["run", s(&text_model), "--image", s(&png), "-p", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("takes no images"), "{err}");
}

#[test]
fn run_with_an_image_on_gemma3_and_gemma4_answers_as_transformers() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let png = repo.join("tests/fixtures/vision_model/chat.png");
    for (fixture, reference, image_tokens) in
        [("tiny-gemma3-vl-pooled", "chat_gemma3.json", 9), ("tiny-gemma4-vl-bidir", "chat_gemma4.json", 63)]
    {
        let dir = repo.join("tests/fixtures").join(fixture);
        let reference: Value = serde_json::from_str(
            &std::fs::read_to_string(repo.join("tests/fixtures/vision_model").join(reference)).unwrap(),
        )
        .unwrap();
        let question = reference["question"].as_str().unwrap();
        let args = ["run", s(&dir), "--precision", "f32", "--image", s(&png), "-p", question];
        let r = ok_json(&[&args[..], &["--max-tokens", "10", "--ignore-eos", "--json"]].concat());
        assert_eq!(r["prompt_ids"], reference["prompt_ids"], "{fixture}");
        assert_eq!(r["generated_ids"], reference["greedy_new_ids"], "{fixture}");
        assert_eq!(r["image_tokens"], image_tokens, "{fixture}");
    }
    // Gemma 4 with a budget of 140 tokens per image (--mm-processor-kwargs), as transformers'
    // processor called with max_soft_tokens=140.
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(repo.join("tests/fixtures/vision_model/chat_gemma4.json")).unwrap(),
    )
    .unwrap();
    let dir = repo.join("tests/fixtures/tiny-gemma4-vl-bidir");
    let question = reference["question"].as_str().unwrap();
    let args = ["run", s(&dir), "--precision", "f32", "--image", s(&png), "-p", question, "--max-tokens", "10"];
    let kwargs = ["--mm-processor-kwargs", r#"{"max_soft_tokens": 140}"#, "--ignore-eos", "--json"];
    let r = ok_json(&[&args[..], &kwargs].concat());
    assert_eq!(r["prompt_ids"], reference["at_140_soft_tokens"]["prompt_ids"]);
    assert_eq!(r["generated_ids"], reference["at_140_soft_tokens"]["greedy_new_ids"]);
    let out = kylin(&[&args[..], &["--mm-processor-kwargs", r#"{"max_soft_tokens": 100}"#]].concat());
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("must be one of [70, 140, 280, 560, 1120]; got 100"), "{stderr}");
}

/// Under `--precision bf16` on AMX the BF16 matrices are copied into AMX tile order at load;
/// `KYLIN_BF16_TILES=0` keeps them in place in the map. Both must give the same bits: every
/// position's top logits for prompts of 1 token (decode's one-row tiles), 5 and 40 (a full and
/// a short token block), and 12 greedy tokens, on SmolLM2 (tied head: the embedding is looked
/// up in the map whose pages the head's copy released). Without AMX both runs take the same
/// path and the test says so.
#[test]
fn bf16_weights_copied_into_amx_tiles_give_the_bits_of_the_weights_in_place() {
    if kylin_kernels::bf16_kernels() != Some(kylin_kernels::Bf16Kernels::Amx) {
        eprintln!("no AMX on this machine: both runs would take the same path");
        return;
    }
    let dir = model("smollm2-135m-instruct");
    let with = |tiles: &str, args: &[&str]| -> Value {
        let out = kylin_with_env(args, &[("KYLIN_BF16_TILES", tiles)]);
        assert!(out.status.success(), "kylin {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        json_of(&out)
    };
    let ids_40: Vec<String> = (0..40).map(|i| (100 + 37 * i).to_string()).collect();
    let ids_40 = ids_40.join(",");
    for ids in ["504", "504,1281,28,339,2176", ids_40.as_str()] {
        let args = ["logits", s(&dir), "--ids", ids, "--top", "8", "--json", "--precision", "bf16"];
        let (tiled, in_place) = (with("1", &args), with("0", &args));
        assert_eq!(tiled["positions"].as_array().map(Vec::len), Some(ids.split(',').count()));
        assert_eq!(tiled, in_place, "logits of {} tokens", ids.split(',').count());
    }
    let args = [
        "run",
        s(&dir),
        "-p",
        "The capital of France is",
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
        "--precision",
        "bf16",
    ];
    let (tiled, in_place) = (with("1", &args), with("0", &args));
    assert_eq!(tiled["generated_ids"].as_array().map(Vec::len), Some(12));
    assert_eq!(tiled["generated_ids"], in_place["generated_ids"]);
}
