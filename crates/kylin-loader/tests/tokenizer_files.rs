//! `tokenizer.json` read by Kylin's single-pass reader is the same tokenizer the `tokenizers`
//! library builds from the file: identical serialization and identical ids on varied text, for
//! the Qwen3 fixture and every real model present.

use std::path::{Path, PathBuf};

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

fn models_dir() -> PathBuf {
    match std::env::var_os("KYLIN_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/kylin-models"),
    }
}

const TEXTS: [&str; 6] = [
    "The capital of France is",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "<|im_start|>user\nHéllo, 世界! 🦀<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "   leading spaces,\ttabs\r\nand 12345 numbers 3.14159",
    "<|endoftext|><|fim_prefix|>x<|fim_suffix|>",
    "",
];

fn check(path: &Path) {
    let fast = kylin_loader::tokenizer::read_tokenizer_json(path).unwrap();
    let slow = tokenizers::Tokenizer::from_file(path).unwrap();
    assert_eq!(fast.to_string(false).unwrap(), slow.to_string(false).unwrap(), "{}", path.display());
    for text in TEXTS {
        for special in [false, true] {
            let a = fast.encode(text, special).unwrap();
            let b = slow.encode(text, special).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "{}: {text:?}", path.display());
        }
    }
}

#[test]
fn single_pass_reader_builds_the_same_tokenizer() {
    check(&Path::new(SHARED).join("fixtures/tiny-qwen3/tokenizer.json"));
    let mut real = 0;
    for name in ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "qwen3-0.6b-shaped"] {
        let path = models_dir().join(name).join("tokenizer.json");
        if path.is_file() {
            check(&path);
            real += 1;
        }
    }
    // CI fetches the real models; a developer machine without them still checks the fixture.
    if std::env::var_os("CI").is_some() {
        assert_eq!(real, 3, "the real models are missing from {}", models_dir().display());
    }
}

#[test]
fn a_file_the_fast_path_does_not_handle_still_loads() {
    // A WordLevel model is not BPE: the reader hands it to the library's own path.
    let json = r#"{
      "version": "1.0",
      "added_tokens": [{"id": 3, "content": "<s>", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}],
      "pre_tokenizer": {"type": "Whitespace"},
      "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<s>": 3},
                "unk_token": "[UNK]"}
    }"#;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    let tok = kylin_loader::tokenizer::read_tokenizer_json(&path).unwrap();
    assert_eq!(tok.encode("<s> hello world", false).unwrap().get_ids(), [3, 0, 1]);
    std::fs::write(&path, "{\"version\": \"1.0\", \"model\": ").unwrap();
    let err = kylin_loader::tokenizer::read_tokenizer_json(&path).unwrap_err();
    assert_eq!(err.code, kylin_loader::ErrorCode::ConfigInvalid);
    assert!(err.message.contains("tokenizer.json"), "{err}");
}
