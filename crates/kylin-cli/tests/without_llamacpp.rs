//! A `kylin` built without the default `llamacpp` feature still runs Hugging Face models and
//! refuses GGUF files with a clear `[OPERATOR_UNSUPPORTED]` error naming the feature.
//!
//! Only compiled in that configuration: `cargo test --release -p kylin-cli --no-default-features
//! --test without_llamacpp` (the test script runs it after the workspace tests).
#![cfg(not(feature = "llamacpp"))]

use std::path::{Path, PathBuf};
use std::process::Command;

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

fn models_dir() -> PathBuf {
    match std::env::var_os("KYLIN_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/kylin-models"),
    }
}

#[test]
fn gguf_is_refused_with_the_feature_named_and_hf_still_runs() {
    let gguf = models_dir().join("gguf/smollm2-135m-instruct-q4_1.gguf");
    assert!(gguf.is_file(), "{} is missing: run `bash testdata/models/fetch.sh`", gguf.display());
    let out = Command::new(env!("CARGO_BIN_EXE_kylin")).args(["run"]).arg(&gguf).args(["-p", "x"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("[OPERATOR_UNSUPPORTED] ") && err.contains("llamacpp"), "{err}");

    let tiny = Path::new(SHARED).join("fixtures/tiny-qwen2-f16");
    let out = Command::new(env!("CARGO_BIN_EXE_kylin"))
        .args(["run"])
        .arg(&tiny)
        .args(["--ids", "1,2,3", "--max-tokens", "3", "--json"])
        .env("KYLIN_QUIET", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["generated_ids"].as_array().unwrap().len(), 3);
}
