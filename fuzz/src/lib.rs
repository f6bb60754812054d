//! Helpers shared by the fuzz targets: a tiny tokenizer to hang chat templates on, and a
//! conversation to render them with.

use std::path::Path;

use kylin_engine::ChatMessage;
use kylin_loader::{ChatTemplate, SpecialToken, TokenizerBundle, TokenizerKind};

/// A word-level tokenizer with four tokens (`<s>` special), enough for a chat template to be
/// compiled and rendered; building it from JSON is cheap next to a fuzz iteration.
pub fn tiny_tokenizer() -> tokenizers::Tokenizer {
    let json = r#"{
      "version": "1.0",
      "added_tokens": [{"id": 3, "content": "<s>", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}],
      "pre_tokenizer": {"type": "Whitespace"},
      "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<s>": 3},
                "unk_token": "[UNK]"}
    }"#;
    tokenizers::Tokenizer::from_bytes(json.as_bytes()).expect("the fixed test tokenizer parses")
}

/// A bundle around [`tiny_tokenizer`] whose default chat template is `template`.
pub fn bundle_with_template(template: &str) -> TokenizerBundle {
    TokenizerBundle {
        tokenizer: tiny_tokenizer(),
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

/// A short conversation with every role a template usually branches on.
pub fn conversation() -> Vec<ChatMessage> {
    [("system", "be brief"), ("user", "hello"), ("assistant", "world"), ("user", "hello world")]
        .into_iter()
        .map(|(role, content)| ChatMessage { role: role.into(), content: content.into() })
        .collect()
}

/// Compiles the bundle's default template and renders [`conversation`] with it; every failure
/// must be a typed error (the result is discarded, only panics, hangs and huge allocations
/// matter to the fuzzer).
pub fn render(bundle: &TokenizerBundle) {
    if let Ok(codec) = kylin_engine::TextCodec::new(bundle, None) {
        let _ = codec.apply_chat_template(&conversation(), true, &serde_json::Map::new());
    }
}

/// The path named in error messages (never opened).
pub fn fake_path(name: &str) -> &Path {
    Path::new(name)
}
