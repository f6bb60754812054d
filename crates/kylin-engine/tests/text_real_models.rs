//! The tokenizer and chat template against what `transformers` produced for the real models
//! (`testdata/reference/*.json`) and the real Qwen3 tokenizer of the `tiny-qwen3` fixture.

use std::path::{Path, PathBuf};

use kylin_engine::{ChatMessage, TextCodec};
use kylin_loader::{ChatTemplate, SpecialToken, TokenizerBundle, TokenizerKind};

fn models_dir() -> PathBuf {
    match std::env::var_os("KYLIN_MODELS") {
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("HOME").expect("HOME is not set");
            PathBuf::from(home).join(".cache/kylin-models")
        }
    }
}

fn model_dir(name: &str) -> PathBuf {
    let dir = models_dir().join(name);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "real model '{name}' is missing at {}: run `bash testdata/models/fetch.sh` (or set KYLIN_MODELS)",
        dir.display()
    );
    dir
}

fn shared(rel: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata")).join(rel)
}

/// Builds the bundle straight from the files, the way the loader does.
fn bundle(dir: &Path) -> TokenizerBundle {
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer.json");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let special = |key: &str| -> Option<SpecialToken> {
        let content = match cfg.get(key)? {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_string(),
            _ => return None,
        };
        let id = tokenizer.token_to_id(&content)?;
        Some(SpecialToken { content, id })
    };
    let chat_templates = match cfg.get("chat_template") {
        Some(serde_json::Value::String(s)) => vec![ChatTemplate { name: "default".into(), source: s.clone() }],
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|t| ChatTemplate {
                name: t["name"].as_str().unwrap().into(),
                source: t["template"].as_str().unwrap().into(),
            })
            .collect(),
        _ => vec![],
    };
    TokenizerBundle {
        vocab_size: tokenizer.get_vocab_size(true),
        kind: TokenizerKind::TokenizerJson,
        bos_token: special("bos_token"),
        eos_token: special("eos_token"),
        pad_token: special("pad_token"),
        unk_token: special("unk_token"),
        add_bos_token: cfg.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false),
        add_eos_token: cfg.get("add_eos_token").and_then(|v| v.as_bool()).unwrap_or(false),
        special_tokens: vec![],
        chat_templates,
        tokenizer,
    }
}

fn reference(name: &str) -> serde_json::Value {
    let path = shared(&format!("reference/{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn check_model(name: &str) {
    let codec = TextCodec::new(&bundle(&model_dir(name)), None).unwrap();
    assert!(codec.has_chat_template());
    let reference = reference(name);

    let tokenization = reference["tokenization"].as_array().unwrap();
    assert!(!tokenization.is_empty());
    for entry in tokenization {
        let text = entry["text"].as_str().unwrap();
        let expected = ids(&entry["ids"]);
        assert_eq!(codec.tokenize(text, true).unwrap(), expected, "{name}: tokenize({text:?})");
        assert_eq!(codec.detokenize(&expected, false).unwrap(), text, "{name}: detokenize of {text:?}");
    }

    let cases = reference["cases"].as_array().unwrap();
    let mut chats = 0;
    for case in cases {
        let expected_text = case["prompt_text"].as_str().unwrap();
        let expected_ids = ids(&case["input_ids"]);
        let rendered = match case["kind"].as_str().unwrap() {
            "raw" => {
                let prompt = case["prompt"].as_str().unwrap();
                assert_eq!(codec.tokenize(prompt, true).unwrap(), expected_ids, "{name}: raw {prompt:?}");
                prompt.to_string()
            }
            "chat" => {
                chats += 1;
                let messages: Vec<ChatMessage> = serde_json::from_value(case["prompt"].clone()).unwrap();
                let text = codec.apply_chat_template(&messages, true, &Default::default()).unwrap();
                // HF tokenizes a rendered chat without adding special tokens again.
                assert_eq!(codec.tokenize(&text, false).unwrap(), expected_ids, "{name}: chat ids");
                text
            }
            other => panic!("unknown case kind {other}"),
        };
        assert_eq!(rendered, expected_text, "{name}: prompt_text");
        // The reference's generated text decodes back from its ids (special tokens kept).
        let generated = ids(&case["greedy_new_ids"]);
        assert_eq!(
            codec.detokenize(&generated, false).unwrap(),
            case["greedy_new_text"].as_str().unwrap(),
            "{name}: greedy_new_text"
        );
    }
    assert!(chats >= 2, "{name}: expected chat cases in the reference");
}

#[test]
fn qwen25_coder_tokenizer_and_template_match_transformers() {
    check_model("qwen2.5-coder-0.5b-instruct");
}

#[test]
fn smollm2_tokenizer_and_template_match_transformers() {
    check_model("smollm2-135m-instruct");
}

fn qwen3_codec() -> TextCodec {
    TextCodec::new(&bundle(&shared("fixtures/tiny-qwen3")), None).unwrap()
}

#[test]
fn qwen3_template_renders_empty_think_block_without_thinking() {
    let codec = qwen3_codec();
    let messages = vec![
        ChatMessage { role: "system".into(), content: "Be brief.".into() },
        ChatMessage { role: "user".into(), content: "Hi!".into() },
    ];
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
    let text = codec.apply_chat_template(&messages, true, &kwargs).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // Without the flag, Qwen3 lets the model think: no think block is added.
    let text = codec.apply_chat_template(&messages, true, &Default::default()).unwrap();
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");
}

#[test]
fn qwen3_template_strips_reasoning_from_history() {
    let codec = qwen3_codec();
    let messages = vec![
        ChatMessage { role: "user".into(), content: "1+1?".into() },
        ChatMessage { role: "assistant".into(), content: "<think>\nadd\n</think>\n\n2".into() },
        ChatMessage { role: "user".into(), content: "2+2?".into() },
    ];
    let text = codec.apply_chat_template(&messages, true, &Default::default()).unwrap();
    // As transformers renders it: earlier turns keep only the answer after </think>.
    assert_eq!(
        text,
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n\
         <|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = codec.tokenize(&text, false).unwrap();
    assert_eq!(ids[0], 151644, "<|im_start|> is one special id");
    assert_eq!(codec.detokenize(&ids, false).unwrap(), text);
}

/// The render budget (`TEMPLATE_FUEL`) is sized for real conversations, not only against
/// runaway templates: each real template renders a conversation of 1000 messages and 1 MB of
/// text (about 250 000 tokens, past every context these models have) without running out, and
/// the rendering holds every message.
#[test]
fn real_templates_render_a_megabyte_conversation_within_the_budget() {
    let codecs = [
        ("tiny-qwen3 (Qwen3's template)", qwen3_codec()),
        (
            "qwen2.5-coder-0.5b-instruct",
            TextCodec::new(&bundle(&model_dir("qwen2.5-coder-0.5b-instruct")), None).unwrap(),
        ),
        ("smollm2-135m-instruct", TextCodec::new(&bundle(&model_dir("smollm2-135m-instruct")), None).unwrap()),
    ];
    let word = "lorem ipsum dolor sit amet, ";
    let messages: Vec<ChatMessage> = (0..1000)
        .map(|i| ChatMessage {
            role: if i == 0 {
                "system"
            } else if i % 2 == 1 {
                "user"
            } else {
                "assistant"
            }
            .into(),
            content: format!("message {i}: {}", word.repeat(1000 / word.len())),
        })
        .collect();
    let total: usize = messages.iter().map(|m| m.content.len()).sum();
    assert!(total >= 990_000, "{total} bytes of content");
    for (name, codec) in &codecs {
        let start = std::time::Instant::now();
        let text = codec
            .apply_chat_template(&messages, true, &Default::default())
            .unwrap_or_else(|e| panic!("{name}: a 1 MB conversation does not render: {e}"));
        eprintln!("{name}: {} bytes rendered in {:?}", text.len(), start.elapsed());
        assert!(text.len() >= total, "{name}: {} bytes rendered from {total}", text.len());
        assert!(text.contains("message 999: "), "{name}: the last message is missing");
    }
}
