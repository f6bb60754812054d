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

/// The conversation the `chat_template` fuzz target renders (`fuzz/src/lib.rs`), so that an
/// input replays here exactly as it ran there.
fn fuzz_conversation() -> Vec<ChatMessage> {
    [("system", "be brief"), ("user", "hello"), ("assistant", "world"), ("user", "hello world")]
        .into_iter()
        .map(|(role, content)| ChatMessage { role: role.into(), content: content.into() })
        .collect()
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
        let start = Instant::now();
        let err = codec.apply_chat_template(&fuzz_conversation(), true, &serde_json::Map::new()).unwrap_err();
        let took = start.elapsed();
        eprintln!("{}: {took:?}", path.display());
        assert_eq!(err.code, ErrorCode::ConfigInvalid, "{}: {err}", path.display());
        assert!(took < Duration::from_secs(5), "{} took {took:?}", path.display());
        seen += 1;
    }
    assert!(seen > 0, "no regression inputs in {}", dir.display());
}

/// The fuzzer's SIGSEGVs in CI (findings 6 and 9 in docs/fuzzing.md): a list literal nested
/// deep in a loop nests a value many levels per iteration, and printing, comparing or dropping
/// it recurses once per level on the render thread's stack. A 60-deep literal reached 2.28
/// million levels, which overflowed 256 MiB; a 72-deep one (the deepest that compiles) reached
/// 4.7 million within the fuel, and printing 3.6 million overflowed 1 GiB, aborting the whole
/// process. Since the patched minijinja searches the value a namespace is assigned for the
/// namespace itself, paying for the search, each assignment pays for every level before it:
/// 36 000 levels (500 iterations) print, compare and drop; 600 iterations, and the 3.6 million
/// levels of the abort, run out of fuel (`CONFIG_INVALID`).
#[test]
fn values_nested_by_deep_literals_in_a_loop_render_or_fail_cleanly() {
    let messages = vec![ChatMessage { role: "user".into(), content: "hello".into() }];
    let nest = |depth: usize, iterations: usize, show: &str| {
        let literal = format!("{}ns.x{}", "[".repeat(depth), "]".repeat(depth));
        format!(
            "{{% set ns = namespace(x=1) %}}{{% for i in range({iterations}) %}}\
             {{% set ns.x = {literal} %}}{{% endfor %}}{show}"
        )
    };
    let render = |source: &str| {
        let codec = TextCodec::new(&bundle(source), None).unwrap();
        codec.apply_chat_template(&messages, true, &serde_json::Map::new())
    };
    for show in ["{{ ns.x|length }}", "{{ ns.x == [ns.x] }}", ""] {
        let rendered = render(&nest(72, 500, show)).unwrap();
        assert_eq!(rendered.is_empty(), show.is_empty(), "{show:?}");
    }
    let text = render(&nest(72, 500, "{{ ns.x }}")).unwrap();
    assert_eq!(text.len(), 2 * 500 * 72 + 1, "36 000 nested lists around the 1");
    for (depth, iterations) in [(72, 600), (72, 50_000), (60, 38_000)] {
        let err = render(&nest(depth, iterations, "{{ ns.x }}")).unwrap_err();
        assert_eq!(err.code, ErrorCode::ConfigInvalid, "{depth} deep, {iterations} times: {err}");
        assert!(err.message.contains("instructions without finishing"), "{err}");
    }
}

/// The fuzzer's SIGSEGV of finding 10 (docs/fuzzing.md): `{% set ns.n = ns %}` made a
/// namespace hold itself, and printing it recursed without end until the render thread's stack
/// overflowed, aborting the process. The patched minijinja refuses an assignment whose value
/// holds the namespace at any depth (`CONFIG_INVALID` naming the attribute), and still assigns
/// values that hold other namespaces, or one shared value many times.
#[test]
fn a_namespace_cannot_be_made_to_hold_itself() {
    let messages = vec![ChatMessage { role: "user".into(), content: "hello".into() }];
    let render = |source: &str| {
        TextCodec::new(&bundle(source), None).unwrap().apply_chat_template(&messages, true, &serde_json::Map::new())
    };
    for (assignment, attribute) in [
        ("{% set ns.n = ns %}", "n"),
        ("{% set ns.n = [1, {'a': [ns]}] %}", "n"),
        ("{% set other = namespace(a=[ns]) %}{% set ns.b = other %}", "b"),
    ] {
        let source = format!("{{% set ns = namespace(n=0) %}}{assignment}{{{{ ns }}}}");
        let err = render(&source).unwrap_err();
        assert_eq!(err.code, ErrorCode::ConfigInvalid, "{assignment}: {err}");
        assert!(
            err.message.contains(&format!("cannot assign to {attribute} a value that holds its own namespace")),
            "{err}"
        );
    }
    let other = render("{% set ns = namespace(n=0) %}{% set ns.m = namespace(k=[1, 2]) %}{{ ns.m.k }}").unwrap();
    assert_eq!(other, "[1, 2]");
    // A value that shares one list at every level (2^60 paths) is searched once per list.
    let shared = "{% set ns = namespace(x=1, y=0) %}{% for i in range(60) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}\
                  {% set ns.y = ns.x %}{{ ns.y|length }}";
    assert_eq!(render(shared).unwrap(), "2");
}

/// `pprint` still pretty-prints what real templates hold (minijinja's `{:#?}` layout), while
/// `chat_template-pprint-deep.jinja` (a list nested 5000 deep, which took 379 s) is refused at once.
#[test]
fn pprint_formats_shallow_values_and_refuses_deep_ones() {
    let messages = vec![ChatMessage { role: "user".into(), content: "hello".into() }];
    let render = |source: &str| {
        TextCodec::new(&bundle(source), None).unwrap().apply_chat_template(&messages, true, &serde_json::Map::new())
    };
    let text = render("{{ [1, [2, 3]]|pprint }}").unwrap();
    assert_eq!(text, "[\n    1,\n    [\n        2,\n        3,\n    ],\n]");
    let deep = "{% set ns = namespace(x=1) %}{% for i in range(65) %}{% set ns.x = [ns.x] %}{% endfor %}";
    let err = render(&format!("{deep}{{{{ ns.x|pprint }}}}")).unwrap_err();
    assert_eq!(err.code, ErrorCode::ConfigInvalid);
    assert!(err.message.contains("nested more than 64 levels"), "{err}");
    let shallow = deep.replace("range(65)", "range(64)");
    assert!(render(&format!("{shallow}{{{{ ns.x|pprint }}}}")).unwrap().contains("1,"));
}

/// The fuzzer's SIGSEGV (issue 15): a value nested in a loop, formatted, compared or dropped,
/// recursed deeper than the stack (30 000 levels overflowed an 8 MiB main thread). Rendering
/// now has its own thread with room for the deepest value the fuel allows: a value nested
/// 36 000 levels by a 72-deep literal renders (`tojson` refuses it with its own depth limit);
/// one nested until the fuel runs out is `CONFIG_INVALID`. Both run here on a 2 MiB thread,
/// the size of a tokio worker's stack in `kylin serve`.
#[test]
fn deeply_nested_values_render_or_fail_cleanly_on_a_small_stack() {
    let run = |source: String| {
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let messages = vec![ChatMessage { role: "user".into(), content: "hello".into() }];
                let codec = TextCodec::new(&bundle(&source), None).unwrap();
                codec.apply_chat_template(&messages, true, &serde_json::Map::new())
            })
            .unwrap()
            .join()
            .unwrap()
    };
    let nest = |iterations: usize, show: &str| {
        let literal = format!("{}ns.x{}", "[".repeat(72), "]".repeat(72));
        format!(
            "{{% set ns = namespace(x=[]) %}}{{% for i in range({iterations}) %}}\
             {{% set ns.x = {literal} %}}{{% endfor %}}{show}"
        )
    };
    for show in ["{{ ns.x }}", "{{ ns.x|tojson }}", "{{ ns.x == ns.x }}", ""] {
        match run(nest(500, show)) {
            Ok(text) if show == "{{ ns.x }}" => {
                assert_eq!(text.len(), 2 * 36_001, "36 000 nested lists print as brackets")
            }
            Ok(_) => {}
            // `tojson` refuses values nested deeper than serde_json's limit.
            Err(e) => assert!(show.contains("tojson") && e.code == ErrorCode::ConfigInvalid, "{show:?}: {e}"),
        }
        let start = Instant::now();
        let err = run(nest(100_000, show)).unwrap_err();
        assert_eq!(err.code, ErrorCode::ConfigInvalid, "{show:?}: {err}");
        assert!(err.message.contains("instructions"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10), "{show:?} took {:?}", start.elapsed());
    }
}

/// Finding 8 in docs/fuzzing.md: a long chain in one block (`{{ 1 + 1 + … }}`, `not not …`,
/// `- - …`, filters, attributes) or a long `elif` chain builds a syntax tree as deep as the
/// chain, which minijinja compiled and dropped recursively on the loading thread: 20 000 terms
/// overflowed an 8 MiB main thread and aborted the process (`kylin serve` included). The
/// patched parser refuses more than 1000 tokens in one block and guards `elif` nesting, so
/// each of these is `CONFIG_INVALID` at load, here on a test thread's small stack.
#[test]
fn long_chains_are_refused_at_load_not_by_a_stack_overflow() {
    let chains = [
        format!("{{{{ 1{} }}}}", " + 1".repeat(20_000)),
        format!("{{{{ 'a'{} }}}}", " ~ 'a'".repeat(20_000)),
        format!("{{{{ {}1 }}}}", "not ".repeat(20_000)),
        format!("{{{{ {}1 }}}}", "- ".repeat(20_000)),
        format!("{{{{ messages{} }}}}", ".x".repeat(20_000)),
        format!("{{{{ 'a'{} }}}}", "|trim".repeat(20_000)),
        format!("{{% if false %}}a{}{{% endif %}}", "{% elif false %}b".repeat(20_000)),
    ];
    for source in &chains {
        let err = TextCodec::new(&bundle(source), None).expect_err("a 20 000-long chain must not compile");
        assert_eq!(err.code, ErrorCode::ConfigInvalid, "{err}");
        assert!(err.message.contains("does not compile"), "{err}");
    }
    // The limit is far above what templates write: 400 terms (800 tokens) and 100 elifs run.
    let messages = vec![ChatMessage { role: "user".into(), content: "hello".into() }];
    let long = format!("{{{{ 1{} }}}}", " + 1".repeat(399));
    let codec = TextCodec::new(&bundle(&long), None).unwrap();
    assert_eq!(codec.apply_chat_template(&messages, true, &serde_json::Map::new()).unwrap(), "400");
    let elifs: String = (1..=100).map(|i| format!("{{% elif messages|length == {i} %}}{i}")).collect();
    let codec = TextCodec::new(&bundle(&format!("{{% if false %}}0{elifs}{{% endif %}}")), None).unwrap();
    assert_eq!(codec.apply_chat_template(&messages, true, &serde_json::Map::new()).unwrap(), "1");
}
