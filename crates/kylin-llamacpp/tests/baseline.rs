//! llama.cpp's baseline for the project benchmark: prefill of a 512-token prompt and 128 decode
//! steps on the Qwen3-0.6B-shaped BF16 GGUF with 2 threads, plus the process's peak memory.
//!
//! Ignored by default (it takes about a minute on 2 cores); run it with
//! `cargo test --release -p kylin-llamacpp --test baseline -- --ignored --nocapture`.

use std::path::PathBuf;
use std::time::Instant;

use kylin_engine::Backend;
use kylin_llamacpp::{LlamaCppBackend, LlamaCppOptions};

fn model_path() -> PathBuf {
    let dir = match std::env::var_os("KYLIN_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/kylin-models"),
    };
    let path = dir.join("qwen3-0.6b-shaped/gguf/qwen3-0.6b-shaped-bf16.gguf");
    assert!(path.is_file(), "{} is missing: run `bash ../shared/models/fetch.sh --bench`", path.display());
    path
}

/// `VmHWM` (peak resident memory) of this process, in MiB.
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    kib / 1024.0
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
#[ignore = "benchmark: about a minute on 2 cores"]
fn qwen3_shaped_bf16_baseline() {
    let opts = LlamaCppOptions { threads: 2, ctx_size: Some(1024), chat_template_override: None };
    let mut m = LlamaCppBackend::load(&model_path(), &opts).unwrap_or_else(|e| panic!("{e}"));
    let n_vocab = m.vocab_size() as u32;
    // A deterministic 512-token prompt of ordinary ids (the weights are random anyway).
    let prompt: Vec<u32> = (0..512u32).map(|i| 1000 + (i * 7919) % (n_vocab - 2000)).collect();

    // One warm-up pass so page faults of the memory map are not counted as compute.
    m.prefill(&prompt[..16]).unwrap();
    m.reset();

    let t = Instant::now();
    let mut next = argmax(m.prefill(&prompt).unwrap());
    let prefill_s = t.elapsed().as_secs_f64();

    let t = Instant::now();
    for _ in 0..128 {
        next = argmax(m.decode(next).unwrap());
    }
    let decode_s = t.elapsed().as_secs_f64();
    assert_eq!(m.position(), 512 + 128);

    let s = m.summary();
    println!(
        "llama.cpp {} threads={} load={:.0} ms prefill 512 tok: {:.1} tok/s ({:.2} s) | decode \
         128 tok: {:.2} tok/s ({:.2} s) | weights {:.0} MiB | VmHWM {:.0} MiB",
        s.architecture,
        s.threads,
        m.load_ms(),
        512.0 / prefill_s,
        prefill_s,
        128.0 / decode_s,
        decode_s,
        s.weight_bytes_per_token as f64 / 1048576.0,
        peak_rss_mib()
    );
}
