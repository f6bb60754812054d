//! N-gram speculative decoding in the batching engine (`EngineOptions::speculative_tokens`):
//! outputs equal those without speculation token for token and bit for bit (ids and
//! log-probabilities, which are computed from the raw logits), greedy and seeded sampling, with
//! several sequences at once, on prompts that repeat themselves (proposals accepted) and random
//! ones (proposals rejected); acceptance is real; blocks all return to the pool, also under
//! preemption; blocks registered in the prefix cache while speculating hold what their hashes
//! say; a hybrid model refuses speculation with a typed error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kylin_engine::batch::{BatchEngine, EngineOptions, KvBudget};
use kylin_engine::kv_pool::KvPool;
use kylin_engine::sampler::SamplingParams;
use kylin_engine::serving::{EngineStats, Event, EventKind, Request, Serving, StopReason};
use kylin_loader::ErrorCode;

mod support;
use support::{prompt, request};

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");
const FAMILIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/families/fixtures");

/// A fixture of `testdata/fixtures`, the repository's family fixtures or `testdata/families`.
fn fixture(name: &str) -> PathBuf {
    [Path::new(SHARED).join("fixtures"), PathBuf::from(FAMILIES), Path::new(SHARED).join("families/fixtures")]
        .into_iter()
        .map(|dir| dir.join(name))
        .find(|p| p.is_dir())
        .unwrap_or_else(|| panic!("fixture {name} is missing"))
}

fn engine(path: &Path, opts: &EngineOptions) -> BatchEngine {
    let model = kylin_loader::load(path, &kylin_loader::LoadOptions::default()).unwrap();
    BatchEngine::new(model, opts).unwrap()
}

fn options(speculative_tokens: usize) -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx_size: Some(256),
        max_batch_tokens: 48,
        speculative_tokens,
        ..EngineOptions::default()
    }
}

/// What one choice produced: ids, the bits of their log-probabilities, and how it ended.
#[derive(Debug, Clone, PartialEq, Default)]
struct Output {
    ids: Vec<u32>,
    logprobs: Vec<u32>,
    top: Vec<(u32, u32)>,
    reason: Option<StopReason>,
}

type Outputs = BTreeMap<(u64, usize), Output>;

fn collect(events: &[Event], out: &mut Outputs) {
    for e in events {
        let o = out.entry((e.request, e.index)).or_default();
        match &e.kind {
            EventKind::Token { id, logprob, .. } => {
                assert!(o.reason.is_none(), "token after the end");
                o.ids.push(*id);
                if let Some(lp) = logprob {
                    o.logprobs.push(lp.logprob.to_bits());
                    o.top.extend(lp.top.iter().map(|&(id, p)| (id, p.to_bits())));
                }
            }
            EventKind::Finished { reason, usage, .. } => {
                assert!(o.reason.is_none(), "finished twice");
                o.reason = Some(*reason);
                assert_eq!(usage.completion_tokens, o.ids.len());
            }
            _ => {}
        }
    }
}

/// Runs `requests` together on `e` until idle.
fn drain(e: &mut BatchEngine, requests: &[Request]) -> Outputs {
    for r in requests {
        e.add_request(r.clone()).unwrap();
    }
    let mut out = Outputs::new();
    support::step_until_idle(e, |events| collect(events, &mut out));
    out
}

/// Runs `requests` together on a fresh engine; returns the outputs and the statistics.
fn run(path: &Path, opts: &EngineOptions, requests: &[Request]) -> (Outputs, EngineStats) {
    let mut e = engine(path, opts);
    let out = drain(&mut e, requests);
    assert_all_blocks_free(&e);
    (out, e.stats())
}

fn assert_all_blocks_free(e: &BatchEngine) {
    let stats = e.stats();
    assert_eq!(stats.kv_blocks_used, 0, "blocks still referenced after all requests ended");
    assert_eq!(e.core().free_blocks(), e.core().total_blocks());
    assert_eq!((stats.running, stats.waiting), (0, 0));
}

fn assert_same(want: &Outputs, got: &Outputs, what: &str) {
    assert_eq!(want.len(), got.len(), "{what}: choice count");
    for (key, a) in want {
        let b = &got[key];
        assert!(!a.ids.is_empty(), "{what}: request {key:?} generated nothing");
        assert_eq!(a, b, "{what}: request {key:?}");
    }
}

/// `len` ids made of a random piece of `period` ids repeated: the n-gram proposer finds the
/// last tokens earlier and proposes what followed them.
fn repeating_prompt(len: usize, period: usize, seed: u64) -> Vec<u32> {
    prompt(period, seed, 500).into_iter().cycle().take(len).collect()
}

/// Three prompts that repeat themselves and three random ones.
fn mixed_requests(max_new: usize) -> Vec<Request> {
    let mut requests = Vec::new();
    for i in 0..3u64 {
        requests.push(request(i, repeating_prompt(30 + 7 * i as usize, 6 + i as usize, 10 + i), max_new));
        requests.push(request(10 + i, prompt(12 + 9 * i as usize, 20 + i, 500), max_new));
    }
    requests
}

#[test]
fn greedy_outputs_with_speculation_equal_those_without_on_several_fixtures() {
    // Full attention (Qwen3, Qwen2 in F16, Llama 3's RoPE) and sliding windows of 5 positions
    // (Mistral's own pool of sliding blocks, released as the window moves).
    for name in ["tiny-qwen3", "tiny-qwen2-f16", "tiny-llama-rope3", "tiny-mistral-w5-mqa", "tiny-gemma2-w5-mqa"] {
        let path = fixture(name);
        let requests = mixed_requests(40);
        let (plain, plain_stats) = run(&path, &options(0), &requests);
        assert_eq!(plain_stats.speculative_proposed_tokens, 0, "{name}: speculation off proposes nothing");
        for k in [1, 4] {
            let (spec, stats) = run(&path, &options(k), &requests);
            assert_same(&plain, &spec, &format!("{name}, {k} speculative tokens"));
            assert!(stats.speculative_proposed_tokens > 0, "{name}: nothing was proposed");
            assert!(stats.speculative_accepted_tokens <= stats.speculative_proposed_tokens);
            assert_eq!(stats.generation_tokens_total, plain_stats.generation_tokens_total);
            eprintln!(
                "{name}, k = {k}: {} of {} proposals accepted; {} steps against {}",
                stats.speculative_accepted_tokens, stats.speculative_proposed_tokens, stats.steps, plain_stats.steps
            );
        }
    }
}

#[test]
fn seeded_sampling_with_speculation_equals_sampling_without() {
    let path = fixture("tiny-qwen3");
    let mut requests = mixed_requests(40);
    for (i, r) in requests.iter_mut().enumerate() {
        r.sampling = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 50,
            seed: 100 + i as u64,
            ..SamplingParams::greedy()
        };
    }
    // A request with two choices: its second choice forks after the prompt and speculates too.
    requests[1].n = 2;
    let (plain, _) = run(&path, &options(0), &requests);
    let (spec, stats) = run(&path, &options(4), &requests);
    assert_same(&plain, &spec, "seeded sampling");
    assert!(stats.speculative_proposed_tokens > 0);
}

#[test]
fn proposals_on_a_repeating_prompt_are_accepted_and_save_steps() {
    // A low temperature would drift; greedy decoding of the fixture copies the prompt's cycle
    // once it is in it, so whole proposals are accepted and the 48 tokens take fewer steps.
    let path = fixture("tiny-qwen3");
    let requests = vec![request(1, repeating_prompt(60, 5, 3), 48)];
    let (plain, plain_stats) = run(&path, &options(0), &requests);
    let (spec, stats) = run(&path, &options(4), &requests);
    assert_same(&plain, &spec, "repeating prompt");
    eprintln!(
        "{} of {} proposals accepted; {} steps against {}",
        stats.speculative_accepted_tokens, stats.speculative_proposed_tokens, stats.steps, plain_stats.steps
    );
    assert!(stats.speculative_accepted_tokens > 0, "no proposal was accepted: {stats:?}");
    assert!(stats.steps < plain_stats.steps, "accepted proposals must save steps: {stats:?}");
}

#[test]
fn preemption_under_a_small_kv_budget_keeps_speculative_outputs_identical() {
    let path = fixture("tiny-qwen2-f16");
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
    let c = &model.config;
    let shape = kylin_engine::kv_pool::KvShape { n_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
    let per_block = KvPool::block_bytes(kylin_kernels::WeightDType::F32, &vec![shape; c.num_layers], 16).unwrap();
    // Context 64 = 4 blocks per sequence; 12 blocks hold three of the eight sequences.
    let small =
        |k| EngineOptions { ctx_size: Some(64), kv_budget: KvBudget::Bytes(12 * per_block), max_seqs: 8, ..options(k) };
    let requests: Vec<Request> = (0..8)
        .map(|i| {
            let p =
                if i % 2 == 0 { repeating_prompt(20 + i, 4 + i / 2, 50 + i as u64) } else { prompt(20 + i, 50, 500) };
            request(i as u64, p, 40)
        })
        .collect();
    let roomy = EngineOptions { ctx_size: Some(64), max_seqs: 8, ..options(0) };
    let (plain, _) = run(&path, &roomy, &requests);
    let mut e = BatchEngine::new(model, &small(4)).unwrap();
    assert_eq!(e.info().kv_blocks, 12);
    let spec = drain(&mut e, &requests);
    assert_same(&plain, &spec, "speculation with preemption");
    let stats = e.stats();
    assert!(stats.preemptions > 0, "8 sequences of 4 blocks in 12 blocks must preempt");
    assert!(stats.speculative_proposed_tokens > 0);
    assert_all_blocks_free(&e);
    // Every sequence reached the end of the context or its 40 tokens.
    for (key, o) in &spec {
        assert!(matches!(o.reason, Some(StopReason::Length | StopReason::ContextFull)), "{key:?}: {:?}", o.reason);
    }
}

#[test]
fn blocks_cached_while_speculating_hold_the_accepted_tokens() {
    // Small blocks so that generated tokens fill many blocks, registered in the prefix cache
    // after each verification. A second round whose prompts are the first round's prompts and
    // outputs hits those blocks; its outputs must equal a fresh engine's.
    let path = fixture("tiny-qwen3");
    let opts = |k| EngineOptions { block_size: Some(4), ..options(k) };
    let first = mixed_requests(32);
    let mut e = engine(&path, &opts(4));
    let out = drain(&mut e, &first);
    let second: Vec<Request> = first
        .iter()
        .map(|r| {
            let mut ids = r.prompt_ids.clone();
            ids.extend_from_slice(&out[&(r.id, 0)].ids);
            request(100 + r.id, ids, 16)
        })
        .collect();
    let hits_before = e.stats().prefix_cache_hits;
    let reused = drain(&mut e, &second);
    assert!(e.stats().prefix_cache_hits - hits_before > 0, "the second round must hit the cache");
    assert_all_blocks_free(&e);
    let (fresh, _) = run(&path, &opts(0), &second);
    assert_same(&fresh, &reused, "prompts over blocks cached while speculating");
}

#[test]
fn a_hybrid_model_refuses_speculation_with_a_typed_error() {
    for name in ["tiny-qwen3.5", "tiny-qwen3-next-gqa-sparse"] {
        let path = fixture(name);
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        let err = BatchEngine::new(model, &options(4)).unwrap_err();
        assert_eq!(err.code(), ErrorCode::ConfigInvalid, "{name}: {err}");
        assert!(err.message.contains("speculative"), "{name}: {}", err.message);
        // Without speculation the model runs.
        let (out, _) = run(&path, &options(0), &mixed_requests(4));
        assert_eq!(out.len(), 6);
    }
}

#[test]
fn too_many_speculative_tokens_are_refused() {
    let path = fixture("tiny-qwen3");
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
    let err = BatchEngine::new(model, &options(1000)).unwrap_err();
    assert_eq!(err.code(), ErrorCode::ConfigInvalid);
    assert!(err.message.contains("--speculative-tokens"), "{}", err.message);
}

fn smollm2() -> PathBuf {
    let models = std::env::var("KYLIN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/kylin-models"));
    let path = models.join("smollm2-135m-instruct");
    assert!(path.is_dir(), "run testdata/models/fetch.sh first: {} is missing", path.display());
    path
}

#[test]
fn a_real_model_copying_code_accepts_proposals_with_identical_outputs() {
    // SmolLM2-135M asked to repeat a function: its output copies the prompt, so proposals are
    // accepted; a free-form request beside it rejects most of its own.
    let path = smollm2();
    let opts = EngineOptions { ctx_size: Some(512), max_batch_tokens: 128, ..options(0) };
    let e = engine(&path, &opts);
    let code = "def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n    return result\n";
    let copy = format!("Here is a function:\n{code}\nHere is the same function again, unchanged:\n");
    let requests: Vec<Request> = [copy.as_str(), "Write a short poem about the sea.", "The capital of France is"]
        .iter()
        .enumerate()
        .map(|(i, text)| request(i as u64, e.tokenize(text, true).unwrap(), 48))
        .collect();
    drop(e);
    let (plain, plain_stats) = run(&path, &opts, &requests);
    let (spec, stats) = run(&path, &EngineOptions { speculative_tokens: 4, ..opts.clone() }, &requests);
    assert_same(&plain, &spec, "smollm2");
    eprintln!(
        "smollm2: {} of {} proposals accepted; {} steps against {}",
        stats.speculative_accepted_tokens, stats.speculative_proposed_tokens, stats.steps, plain_stats.steps
    );
    assert!(stats.speculative_accepted_tokens > 0, "{stats:?}");
}
