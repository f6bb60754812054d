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
