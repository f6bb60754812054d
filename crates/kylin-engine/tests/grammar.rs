//! Constrained decoding over a real tokenizer (Qwen3's, from the `tiny-qwen3` fixture) with
//! random logits: whatever the "model" prefers, every sampled output follows its grammar.
//! This is the engine half of "100% of outputs validate"; the end-to-end tests do the same
//! through the server with real models.

use std::path::Path;
use std::sync::Arc;

use kylin_engine::TextCodec;
use kylin_engine::grammar::{GrammarCompiler, GrammarSpec};
use kylin_engine::sampler::{Rng, SamplingParams};
use kylin_engine::sequence::Decoding;
use kylin_engine::serving::{EventKind, Request, StopReason};
use kylin_engine::tools::{ToolChoice, ToolSpec, ToolSyntax};
use kylin_loader::ErrorCode;
use serde_json::{Value, json};

const VOCAB: usize = 151_936;

fn codec() -> (TextCodec, Vec<u32>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/tiny-qwen3");
    let bundle = kylin_loader::tokenizer::load_tokenizer(&dir, &mut Vec::new()).unwrap().unwrap();
    let codec = TextCodec::new(&bundle, None).unwrap();
    let eos = codec.tokenize("<|im_end|>", false).unwrap();
    (codec, eos)
}

fn compiler() -> (TextCodec, Arc<GrammarCompiler>) {
    let (codec, eos) = codec();
    let compiler = codec.grammar_compiler(VOCAB, &eos).unwrap();
    (codec, compiler)
}

/// Samples one output under `spec` from random logits (seeded), at temperature 1.
fn sample(codec: &TextCodec, compiler: &GrammarCompiler, spec: &GrammarSpec, seed: u64) -> (String, StopReason, usize) {
    let grammar = compiler.compile(spec).unwrap();
    let mut request = Request::new(seed, vec![1], 160);
    request.sampling = SamplingParams { temperature: 1.0, seed, ..SamplingParams::greedy() };
    request.grammar = Some(grammar);
    let eos = codec.tokenize("<|im_end|>", false).unwrap();
    let mut d = Decoding::new(&request, 0, VOCAB, &eos);
    let mut rng = Rng::new(seed ^ 0xA5A5);
    let mut logits = vec![0f32; VOCAB];
    let mut text = String::new();
    let mut forced = 0;
    loop {
        for l in logits.iter_mut() {
            *l = (rng.next_f64() * 8.0) as f32;
        }
        let (_, event, mut reason) = d.accept(&logits, Some(codec), false).unwrap();
        let EventKind::Token { text: piece, .. } = event else { unreachable!() };
        text.push_str(&piece);
        while reason.is_none() {
            match d.next_forced(Some(codec), false).unwrap() {
                Some((_, EventKind::Token { text: piece, .. }, r)) => {
                    text.push_str(&piece);
                    reason = r;
                    forced += 1;
                }
                _ => break,
            }
        }
        if let Some(reason) = reason {
            if let EventKind::Finished { text: rest, .. } = d.finish(reason, Some(codec)).unwrap() {
                text.push_str(&rest);
            }
            return (text, reason, forced);
        }
    }
}

/// Checks `v` against the test schema below by hand.
fn valid_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let name_ok = o.get("name").and_then(Value::as_str).is_some_and(|s| (1..=12).contains(&s.chars().count()));
    let age_ok = o.get("age").and_then(Value::as_i64).is_some_and(|a| (0..=150).contains(&a));
    let tags_ok = o.get("tags").is_none_or(|t| {
        t.as_array().is_some_and(|a| a.len() <= 3 && a.iter().all(|x| x == "a" || x == "b" || x == "c"))
    });
    name_ok && age_ok && tags_ok && o.keys().all(|k| ["name", "age", "tags"].contains(&k.as_str()))
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

#[test]
fn every_sample_under_a_json_schema_validates() {
    let (codec, compiler) = compiler();
    let spec = GrammarSpec::JsonSchema(person_schema());
    let mut forced_total = 0;
    for seed in 0..40 {
        let (text, reason, forced) = sample(&codec, &compiler, &spec, seed);
        forced_total += forced;
        assert_eq!(reason, StopReason::Eos, "seed {seed}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        assert!(valid_person(&v), "seed {seed}: {text}");
    }
    // Keys and punctuation are forced: fast-forwarded, not sampled.
    assert!(forced_total > 40, "{forced_total} tokens forced");
}

#[test]
fn json_object_regex_and_lark_constrain_too() {
    let (codec, compiler) = compiler();
    let mut finished = 0;
    for seed in 0..10 {
        // Random logits write long strings: an object that ends must parse.
        let (text, reason, _) = sample(&codec, &compiler, &GrammarSpec::JsonObject, seed);
        if reason == StopReason::Eos {
            finished += 1;
            assert!(serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()), "{text}");
        } else {
            assert!(text.starts_with('{'), "{text}");
        }
        let (text, _, _) = sample(&codec, &compiler, &GrammarSpec::Regex("[0-9]{3}-[a-z]{2,4}".into()), seed);
        let (digits, letters) = text.split_once('-').unwrap();
        assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{text}");
        assert!((2..=4).contains(&letters.len()) && letters.bytes().all(|b| b.is_ascii_lowercase()), "{text}");
        let lark = "start: \"yes\" | \"no\" | \"maybe \" NUM\nNUM: /[1-9]/";
        let (text, _, _) = sample(&codec, &compiler, &GrammarSpec::Lark(lark.into()), seed);
        assert!(text == "yes" || text == "no" || (text.starts_with("maybe ") && text.len() == 7), "{text}");
    }
    assert!(finished > 0);
}

#[test]
fn bad_and_unsatisfiable_grammars_are_input_errors() {
    let (_, compiler) = compiler();
    let cases = [
        GrammarSpec::JsonSchema(json!({"type": "string", "minLength": 5, "maxLength": 2})),
        GrammarSpec::JsonSchema(json!({"allOf": [{"type": "string"}, {"type": "integer"}]})),
        GrammarSpec::JsonSchema(json!({"type": "frobnicate"})),
        GrammarSpec::JsonSchema(json!([1, 2])),
        GrammarSpec::Lark("start: undefined_rule".into()),
        GrammarSpec::Regex("(unclosed".into()),
    ];
    for spec in cases {
        let err = compiler.compile(&spec).unwrap_err();
        assert_eq!(err.code, ErrorCode::InputInvalid, "{spec:?}");
        assert!(err.message.contains(spec.kind()), "{}", err.message);
    }
}

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            description: Some("The weather in a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}),
        },
        ToolSpec { name: "get_time".into(), description: None, parameters: json!({}) },
    ]
}

#[test]
fn forced_tool_calls_parse_and_validate_in_every_syntax() {
    let (codec, compiler) = compiler();
    let special = |s: &str| compiler.special_token(s);
    let syntaxes = [
        ToolSyntax::Hermes,
        ToolSyntax::Llama3,
        ToolSyntax::Mistral,
        ToolSyntax::Gemma,
        ToolSyntax::Harmony,
        ToolSyntax::QwenXml,
        ToolSyntax::Glm,
    ];
    for syntax in syntaxes {
        let mut completed = 0;
        for (choice, parallel) in [
            (ToolChoice::Required, false),
            (ToolChoice::Required, true),
            (ToolChoice::Named("get_weather".into()), false),
        ] {
            let lark = syntax.grammar(&tools(), &choice, parallel, &special).unwrap();
            for seed in 0..4 {
                let (text, reason, _) = sample(&codec, &compiler, &GrammarSpec::Lark(lark.clone()), seed);
                if reason == StopReason::Length {
                    // Random logits can write a string for ever; what ends must be right.
                    continue;
                }
                completed += 1;
                let parsed = syntax.parse_for(&text, &tools());
                assert!(!parsed.calls.is_empty(), "{syntax:?} {choice:?} seed {seed}: no call in {text:?}");
                assert!(parallel || parsed.calls.len() == 1, "{text}");
                for call in &parsed.calls {
                    let args: Value = serde_json::from_str(&call.arguments)
                        .unwrap_or_else(|e| panic!("{syntax:?} seed {seed}: {e}: {:?} in {text:?}", call.arguments));
                    match call.name.as_str() {
                        "get_weather" => {
                            assert!(args["city"].is_string(), "{text}");
                            assert!((1..=7).contains(&args["days"].as_i64().unwrap_or(0)), "{text}");
                        }
                        "get_time" => {
                            assert!(args.is_object());
                            assert!(choice != ToolChoice::Named("get_weather".into()));
                        }
                        other => panic!("{syntax:?}: unknown tool {other} in {text}"),
                    }
                }
            }
        }
        assert!(completed > 0, "{syntax:?}: every sample ran to the length limit");
        eprintln!("{syntax:?}: {completed} of 12 samples ended with their calls");
    }
}

#[test]
fn auto_lets_text_through_and_constrains_what_follows_the_marker() {
    let (codec, compiler) = compiler();
    let special = |s: &str| compiler.special_token(s);
    let lark = ToolSyntax::Hermes.grammar(&tools(), &ToolChoice::Auto, true, &special).unwrap();
    let grammar = GrammarSpec::Lark(lark);
    let compiled = compiler.compile(&grammar).unwrap();
    // Free text is allowed, and so is a call after it; a malformed call after the marker is not.
    let mut state = compiled.start();
    for id in codec.tokenize("Let me check.\n<tool_call>", false).unwrap() {
        assert!(state.forced().is_none_or(|f| f == id), "text before the marker is free, nothing is forced");
        state.commit(id).unwrap();
    }
    // After the marker the grammar takes over: the call's start is forced, not sampled.
    let mut forced = Vec::new();
    while let Some(f) = state.forced() {
        forced.push(f);
        state.commit(f).unwrap();
    }
    let forced = codec.detokenize(&forced, false).unwrap();
    assert!(forced.starts_with("\n{\"name\": \"get"), "{forced:?}");
    for seed in 0..6 {
        let (text, _, _) = sample(&codec, &compiler, &grammar, seed);
        let parsed = ToolSyntax::Hermes.parse(&text);
        for call in parsed.calls {
            serde_json::from_str::<Value>(&call.arguments).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        }
    }
}
