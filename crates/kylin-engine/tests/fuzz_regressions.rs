//! Inputs found by the cargo-fuzz targets (fuzz/, docs/fuzzing.md) that once hung, panicked or
//! allocated without bound, replayed in the ordinary test suite. Each file in
//! `tests/data/fuzz/` is a chat template; every one must fail with a typed error, quickly.

use std::path::Path;
use std::time::{Duration, Instant};

use kylin_engine::{ChatMessage, TextCodec};
use kylin_loader::{ChatTemplate, ErrorCode, SpecialToken, TokenizerBundle, TokenizerKind};

/// A bundle around a four-token word-level tokenizer whose default template is `template`.
fn bundle(template: &str) -> TokenizerBundle {
    let json = r#"{
      "version": "1.0",
      "added_tokens": [{"id": 3, "content": "<s>", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}],
      "pre_tokenizer": {"type": "Whitespace"},
      "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<s>": 3},
                "unk_token": "[UNK]"}
    }"#;
    TokenizerBundle {
        tokenizer: tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap(),
        kind: TokenizerKind::TokenizerJson,
        vocab_size: 4,
        bos_token: Some(SpecialToken { content: "<s>".into(), id: 3 }),
        eos_token: None,
        pad_token: None,
        unk_token: None,
        add_bos_token: true,
        add_eos_token: false,
        special_tokens: vec![],
        chat_templates: vec![ChatTemplate { name: "default".into(), source: template.into() }],
    }
}

/// A template that would run for hours (two nested 100 000-item loops: 10^10 iterations) is
/// stopped by the render budget with `CONFIG_INVALID`, in well under the fuzzer's 5 s limit.
#[test]
fn runaway_templates_stop_with_config_invalid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
            continue;
        }
        let source = std::fs::read_to_string(&path).unwrap();
        let codec = TextCodec::new(&bundle(&source), None).unwrap();
        let messages = vec![ChatMessage { role: "user".into(), content: "hello".into() }];
        let start = Instant::now();
        let err = codec.apply_chat_template(&messages, true, &serde_json::Map::new()).unwrap_err();
        assert_eq!(err.code, ErrorCode::ConfigInvalid, "{}: {err}", path.display());
        assert!(start.elapsed() < Duration::from_secs(5), "{} took {:?}", path.display(), start.elapsed());
        seen += 1;
    }
    assert!(seen > 0, "no regression inputs in {}", dir.display());
}
