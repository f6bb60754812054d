//! Prompt log-probabilities (`Request::prompt_logprobs`, the engine side of `echo` with
//! `logprobs` on `/v1/completions`) against transformers' own `log_softmax`.
//!
//! `tests/fixtures/prompt_logprobs/*.json` (written by
//! `scripts/make_prompt_logprobs_reference.py`) hold, for one prompt, every position's
//! log-probability of the next prompt token and its five best ids, computed by transformers in
//! float32. The batching engine must report them within 1e-3, whether the request runs alone
//! or among others, in chunks cut by the token budget and by the step's logits rows, after a
//! prefix-cache hit on the same prompt (the scored positions are never served by the cache),
//! and with `max_new_tokens` 0 (score only) or more; the serial engine over the native backend
//! must agree with it.

use std::path::{Path, PathBuf};

use kylin_engine::SerialEngine;
use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::serving::{Event, EventKind, Request, Serving, StopReason, TokenLogprob};
use serde_json::Value;

mod support;

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared");
const REFERENCES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/prompt_logprobs");

fn models_dir() -> PathBuf {
    std::env::var_os("KYLIN_MODELS").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(&std::env::var_os("HOME").expect("HOME or KYLIN_MODELS")).join(".cache/kylin-models")
    })
}

fn reference(name: &str) -> Value {
    let path = Path::new(REFERENCES).join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Every prompt log-probability of one request, by position, and how it ended.
#[derive(Debug, Default)]
struct Scored {
    by_position: Vec<Option<TokenLogprob>>,
    generated: usize,
    reason: Option<StopReason>,
    cached: usize,
}

fn run(engine: &mut dyn Serving, requests: Vec<Request>) -> Vec<Scored> {
    let ids: Vec<u64> = requests.iter().map(|r| r.id).collect();
    let mut out: Vec<Scored> =
        requests.iter().map(|r| Scored { by_position: vec![None; r.prompt_ids.len()], ..Scored::default() }).collect();
    for r in requests {
        engine.add_request(r).unwrap();
    }
    let mut events: Vec<Event> = Vec::new();
    while engine.has_work() {
        events.clear();
        engine.step(&mut events).unwrap();
        for e in &events {
            let o = &mut out[ids.iter().position(|&i| i == e.request).unwrap()];
            match &e.kind {
                EventKind::PromptLogprobs { start, logprobs } => {
                    assert_eq!(e.index, 0);
                    assert_eq!(o.generated, 0, "prompt log-probabilities after a token");
                    for (k, lp) in logprobs.iter().enumerate() {
                        let slot = &mut o.by_position[start + k];
                        assert!(slot.is_none(), "position {} reported twice", start + k);
                        *slot = Some(lp.clone());
                    }
                }
                EventKind::Token { .. } => o.generated += 1,
                EventKind::Pooled { .. } => panic!("pooled values nobody asked for"),
                EventKind::Finished { reason, usage, .. } => {
                    o.reason = Some(*reason);
                    o.cached = usage.cached_prompt_tokens;
                }
            }
        }
    }
    out
}

fn scoring(id: u64, prompt: &[u32], max_new: usize) -> Request {
    let mut r = Request::new(id, prompt.to_vec(), max_new);
    r.detokenize = false;
    r.ignore_eos = true;
    r.prompt_logprobs = Some(5);
    r
}

/// Every position against the reference; returns the largest log-probability difference.
fn check(name: &str, reference: &Value, got: &Scored) -> f64 {
    let positions = reference["positions"].as_array().unwrap();
    assert_eq!(got.by_position.len(), positions.len() + 1);
    assert!(got.by_position[0].is_none(), "{name}: the first prompt token has no log-probability");
    let mut worst = 0.0f64;
    for (p, want) in positions.iter().enumerate() {
        let lp = got.by_position[p + 1].as_ref().unwrap_or_else(|| panic!("{name}: position {} missing", p + 1));
        assert_eq!(u64::from(lp.id), want["token"].as_u64().unwrap());
        worst = worst.max((f64::from(lp.logprob) - want["logprob"].as_f64().unwrap()).abs());
        let top = want["top"].as_array().unwrap();
        assert_eq!(lp.top.len(), 5);
        for (k, (id, logprob)) in lp.top.iter().enumerate() {
            let (want_id, want_lp) = (top[k][0].as_u64().unwrap(), top[k][1].as_f64().unwrap());
            worst = worst.max((f64::from(*logprob) - want_lp).abs());
            // Near-ties may swap places; a swapped id must then tie within the tolerance.
            if u64::from(*id) != want_id {
                assert!((f64::from(*logprob) - want_lp).abs() < 1e-3, "{name}: position {} top {k}", p + 1);
            }
        }
    }
    assert!(worst < 1e-3, "{name}: prompt log-probabilities differ from transformers by {worst}");
    worst
}

fn check_model(name: &str, path: &Path) {
    let reference = reference(name);
    let prompt = support::ids(&reference["input_ids"]);
    let load = || kylin_loader::load(path, &kylin_loader::LoadOptions::default()).unwrap();
    // A small token budget cuts the prompt into chunks; the logits rows cut it further where
    // the vocabulary is large.
    let opts = EngineOptions { threads: 2, ctx_size: Some(256), max_batch_tokens: 20, ..EngineOptions::default() };
    let mut engine = BatchEngine::new(load(), &opts).unwrap();

    // Alone, scoring only.
    let alone = run(&mut engine, vec![scoring(1, &prompt, 0)]);
    check(name, &reference, &alone[0]);
    assert_eq!((alone[0].reason, alone[0].generated), (Some(StopReason::Length), 0));

    // Again, now that the prompt's blocks are cached, among other requests (one generating
    // from the same prompt without scoring it, which the cache serves), and generating too.
    let mut plain = Request::new(3, prompt.clone(), 4);
    plain.detokenize = false;
    let others = vec![
        scoring(2, &prompt, 3),
        plain,
        support::request(4, support::prompt(30, 7, 200), 5),
        scoring(5, &prompt[..17], 0),
    ];
    let together = run(&mut engine, others);
    assert_eq!(together[0].cached, 0, "the scored prompt must be computed, not taken from the cache");
    assert!(together[1].cached > 0, "the unscored prompt is served by the cache");
    assert_eq!(together[0].generated, 3);
    for (p, (a, b)) in alone[0].by_position.iter().zip(&together[0].by_position).enumerate() {
        assert_eq!(a, b, "{name}: position {p} differs between alone and batched (batch invariance)");
    }
    for (p, (a, b)) in alone[0].by_position.iter().zip(&together[3].by_position).enumerate() {
        assert_eq!(a, b, "{name}: position {p} of the shorter prompt");
    }

    // The serial engine over the native backend reports the same values.
    let native = NativeBackend::new(load(), NativeOptions { threads: 2, ..Default::default() }).unwrap();
    let mut serial = SerialEngine::new(Box::new(native));
    let serial_out = run(&mut serial, vec![scoring(1, &prompt, 2)]);
    check(name, &reference, &serial_out[0]);
    assert_eq!(serial_out[0].generated, 2);
}

#[test]
fn prompt_logprobs_match_transformers_on_a_tiny_fixture() {
    check_model("tiny-qwen3", &Path::new(SHARED).join("fixtures/tiny-qwen3"));
}

#[test]
fn prompt_logprobs_match_transformers_on_smollm2() {
    check_model("smollm2-135m-instruct", &models_dir().join("smollm2-135m-instruct"));
}

#[test]
fn scoring_only_needs_prompt_logprobs() {
    let path = Path::new(SHARED).join("fixtures/tiny-qwen3");
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
    let mut engine =
        BatchEngine::new(model, &EngineOptions { ctx_size: Some(64), ..EngineOptions::default() }).unwrap();
    let e = engine.add_request(Request::new(1, vec![1, 2, 3], 0)).unwrap_err();
    assert!(e.to_string().contains("max_tokens"), "{e}");
    // A prompt filling the whole context can be scored (nothing is generated after it).
    engine.add_request(scoring(2, &support::prompt(64, 3, 500), 0)).unwrap();
    let e = engine.add_request(scoring(3, &support::prompt(65, 3, 500), 0)).unwrap_err();
    assert_eq!(e.code(), kylin_loader::ErrorCode::ContextOverflow);
}
