//! Helpers the engine's test files share: reference ids, greedy generation, deterministic
//! prompts and plain requests. Each test file includes it (`mod support;`) and uses a part.
#![allow(dead_code)]

use kylin_engine::Backend;
use kylin_engine::native::NativeBackend;
use kylin_engine::sampler::argmax;
use kylin_engine::serving::Request;
use serde_json::Value;

/// Steps `engine` until it has no work, handing each step's events to `on_events`; fails the
/// test if it has not finished after 100 000 steps.
pub fn step_until_idle(engine: &mut dyn kylin_engine::Serving, mut on_events: impl FnMut(&[kylin_engine::Event])) {
    let mut events = Vec::new();
    let mut steps = 0;
    while engine.has_work() {
        events.clear();
        engine.step(&mut events).unwrap();
        on_events(&events);
        steps += 1;
        assert!(steps < 100_000, "the engine does not finish");
    }
}

/// A reference's list of floats.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// The cosine of two vectors, in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
    let na: f64 = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// A reference's id list.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("an id list").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// The largest `|reference - got|` over a reference row of logits.
pub fn max_abs_diff(reference: &[Value], got: &[f32]) -> f64 {
    reference.iter().zip(got).map(|(w, g)| (w.as_f64().expect("a logit") - *g as f64).abs()).fold(0.0, f64::max)
}

/// Greedy generation of `n` tokens: prefill, then decode each new token (EOS ignored).
pub fn greedy(backend: &mut NativeBackend, prompt: &[u32], n: usize) -> Vec<u32> {
    backend.reset();
    let mut out = Vec::with_capacity(n);
    let mut next = argmax(backend.prefill(prompt).expect("prefill"));
    out.push(next);
    while out.len() < n {
        next = argmax(backend.decode(next).expect("decode"));
        out.push(next);
    }
    out
}

/// Deterministic prompt ids in `1..span`.
pub fn prompt(len: usize, seed: u64, span: u32) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            1 + (s % u64::from(span - 1)) as u32
        })
        .collect()
}

/// A request of `max_new` tokens, EOS ignored, no text, with the top-5 log-probabilities.
pub fn request(id: u64, prompt: Vec<u32>, max_new: usize) -> Request {
    let mut r = Request::new(id, prompt, max_new);
    r.detokenize = false;
    r.ignore_eos = true;
    r.logprobs = Some(5);
    r
}

/// Bytes of one f32 KV block of 16 positions of the model at `path` (every layer), for tests
/// that size a KV budget in blocks.
pub fn f32_block_bytes(path: &std::path::Path) -> u64 {
    let model = kylin_loader::load(path, &kylin_loader::LoadOptions::default()).unwrap();
    let c = &model.config;
    let shape = kylin_engine::kv_pool::KvShape { n_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
    kylin_engine::kv_pool::KvPool::block_bytes(kylin_kernels::WeightDType::F32, &vec![shape; c.num_layers], 16).unwrap()
}

/// What a request produced, as the vision tests read it: per prompt position `p` (from 1),
/// the top-20 of the logits of position `p - 1`; the generated ids and each one's top-20; the
/// prompt tokens the prefix cache supplied.
#[derive(Debug, Default, PartialEq)]
pub struct Output {
    pub prompt_top: Vec<Vec<(u32, f32)>>,
    pub ids: Vec<u32>,
    pub top: Vec<Vec<(u32, f32)>>,
    pub cached: usize,
}

/// Adds `requests` (ids counting up from the first's) and steps until idle, collecting each
/// one's [`Output`].
pub fn run_requests(e: &mut dyn kylin_engine::Serving, requests: Vec<Request>) -> Vec<Output> {
    use kylin_engine::EventKind;
    let n = requests.len();
    let first = requests[0].id;
    for r in requests {
        e.add_request(r).expect("the request is accepted");
    }
    let mut out: Vec<Output> = (0..n).map(|_| Output::default()).collect();
    step_until_idle(e, |events: &[kylin_engine::Event]| {
        for ev in events {
            let o = &mut out[(ev.request - first) as usize];
            match &ev.kind {
                EventKind::PromptLogprobs { start, logprobs } => {
                    assert_eq!(*start, o.prompt_top.len() + 1, "prompt positions in order");
                    o.prompt_top.extend(logprobs.iter().map(|l| l.top.clone()));
                }
                EventKind::Token { id, logprob, .. } => {
                    o.ids.push(*id);
                    o.top.push(logprob.as_ref().expect("log-probabilities were asked for").top.clone());
                }
                EventKind::Finished { usage, .. } => o.cached = usage.cached_prompt_tokens,
                EventKind::Pooled { .. } => unreachable!(),
            }
        }
    });
    out
}

/// `log_softmax(logits)`, in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

/// The repository's root (the fixtures are under `tests/fixtures`).
pub fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A fixture directory's batching engine.
pub fn engine(dir: &std::path::Path, opts: &kylin_engine::batch::EngineOptions) -> kylin_engine::batch::BatchEngine {
    let model = kylin_loader::load(dir, &Default::default()).expect("the fixture loads");
    kylin_engine::batch::BatchEngine::new(model, opts).expect("the engine builds")
}

/// Two threads, 256 positions of context, float32 compute: what the transformers references
/// are compared with.
pub fn f32_options() -> kylin_engine::batch::EngineOptions {
    kylin_engine::batch::EngineOptions {
        threads: 2,
        ctx_size: Some(256),
        precision: kylin_engine::PrecisionChoice::F32,
        ..Default::default()
    }
}

/// Checks a run against a transformers case (`argmax_per_position`, `logits`,
/// `greedy_new_ids`): the argmax at every position (the last one only when the run asked for no
/// prompt log-probabilities), log-probabilities within 1e-3, and the greedy tokens.
pub fn check_case(out: &Output, case: &Value, what: &str) {
    let argmax = ids(&case["argmax_per_position"]);
    let logits: Vec<Vec<f32>> = case["logits"].as_array().expect("logits").iter().map(floats).collect();
    let len = argmax.len();
    let first = if out.prompt_top.is_empty() { len - 1 } else { 0 };
    assert_eq!(out.prompt_top.len(), len - 1 - first, "{what}");
    let mut worst = 0.0f64;
    for p in first..len {
        let top = if p + 1 < len { &out.prompt_top[p] } else { &out.top[0] };
        assert_eq!(top[0].0, argmax[p], "{what}: argmax at position {p}");
        let want = log_softmax(&logits[p]);
        for &(id, lp) in top {
            worst = worst.max((want[id as usize] - lp as f64).abs());
        }
    }
    eprintln!("{what}: worst |log-probability diff| {worst:e}");
    assert!(worst < 1e-3, "{what}: {worst}");
    assert_eq!(out.ids, ids(&case["greedy_new_ids"]), "{what}: greedy tokens");
}
