//! N-gram speculative decoding in the batching engine (`EngineOptions::speculative_tokens`):
//! outputs equal those without speculation token for token and bit for bit (ids and
//! log-probabilities, which are computed from the raw logits), greedy and seeded sampling, with
//! several sequences at once, on prompts that repeat themselves (proposals accepted) and random
//! ones (proposals rejected); acceptance is real; blocks all return to the pool, also under
//! preemption; blocks registered in the prefix cache while speculating hold what their hashes
//! say; hybrid models (Gated DeltaNet, short convolutions) speculate with the same guarantees,
//! their recurrent state rolled back to the accepted tokens.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kylin_engine::batch::{BatchEngine, EngineOptions, KvBudget};
use kylin_engine::sampler::SamplingParams;
use kylin_engine::serving::{EngineStats, Event, EventKind, Request, Serving, StopReason};
use kylin_engine::speculative::Proposer;
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

/// Every family of the registry (`testdata/families`: Gemma 2/3/4, Phi-3, SmolLM3, OLMo 2,
/// Granite, the MoE families, Qwen3.5 and LFM2; and GLM-4.5's fixture): n-gram speculation
/// leaves the outputs as they are, greedy and sampled with seeds, several sequences per step.
#[test]
fn outputs_with_speculation_equal_those_without_on_every_family() {
    let mut names: Vec<String> = std::fs::read_dir(Path::new(SHARED).join("families/fixtures"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() >= 18, "{names:?}");
    names.push("tiny-glm4-moe-mtp".to_string());
    for name in &names {
        let path = fixture(name);
        for (what, requests) in [("greedy", mixed_requests(24)), ("seeded", seeded_requests(24))] {
            let (plain, _) = run(&path, &options(0), &requests);
            let (spec, stats) = run(&path, &options(3), &requests);
            assert_same(&plain, &spec, &format!("{name}, {what}, 3 speculative tokens"));
            assert!(stats.speculative_proposed_tokens > 0, "{name}, {what}: nothing was proposed");
            eprintln!(
                "{name}, {what}: {} of {} proposals accepted",
                stats.speculative_accepted_tokens, stats.speculative_proposed_tokens
            );
        }
    }
}

/// [`mixed_requests`] sampled with top-p and top-k, each with its own seed.
fn seeded_requests(max_tokens: usize) -> Vec<Request> {
    let mut requests = mixed_requests(max_tokens);
    for (i, r) in requests.iter_mut().enumerate() {
        r.sampling = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 50,
            seed: 100 + i as u64,
            ..SamplingParams::greedy()
        };
    }
    requests
}

#[test]
fn seeded_sampling_with_speculation_equals_sampling_without() {
    let path = fixture("tiny-qwen3");
    let mut requests = seeded_requests(40);
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
    let per_block = support::f32_block_bytes(&path);
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
    let mut e =
        BatchEngine::new(kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap(), &small(4)).unwrap();
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

/// The hybrid fixtures: Gated DeltaNet beside attention (Qwen3.5, Qwen3-Next with its grouped
/// projections, Qwen3.5's MoE), and LFM2's short convolutions.
const HYBRID: [&str; 4] = ["tiny-qwen3.5", "tiny-qwen3-next-gqa-sparse", "tiny-qwen3.5-moe-k3-interval", "tiny-lfm2"];

/// A proposer that knows the outputs decoding without speculation gives (per request, the
/// prompt and the output), and proposes them with every `miss`-th position (by a hash of the
/// request and the position) wrong, so that proposals are accepted in runs of every length and
/// rejected at every offset of a segment.
struct Oracle {
    expected: BTreeMap<u64, Vec<u32>>,
    vocab: u32,
    miss: u64,
}

impl Oracle {
    fn new(requests: &[Request], outputs: &Outputs, vocab: usize, miss: u64) -> Self {
        let expected = requests
            .iter()
            .map(|r| {
                let mut ids = r.prompt_ids.clone();
                ids.extend_from_slice(&outputs[&(r.id, 0)].ids);
                (r.id, ids)
            })
            .collect();
        Oracle { expected, vocab: vocab as u32, miss }
    }
}

impl Proposer for Oracle {
    fn propose(&mut self, request: u64, _index: usize, tokens: &[u32], k: usize, out: &mut Vec<u32>) -> usize {
        let full = &self.expected[&request];
        assert_eq!(&full[..tokens.len()], tokens, "request {request} left the expected output");
        let mut n = 0;
        for (position, &id) in full.iter().enumerate().skip(tokens.len()).take(k) {
            let wrong = (request * 7919 + position as u64 * 104_729).is_multiple_of(self.miss);
            out.push(if wrong { (id + 1) % self.vocab } else { id });
            n += 1;
        }
        n
    }
}

fn run_with_oracle(path: &Path, k: usize, requests: &[Request], plain: &Outputs, miss: u64) -> (Outputs, EngineStats) {
    let mut e = engine(path, &options(k));
    let vocab = e.core().model().dims().vocab;
    e.set_proposer(Box::new(Oracle::new(requests, plain, vocab, miss))).unwrap();
    let out = drain(&mut e, requests);
    assert_all_blocks_free(&e);
    (out, e.stats())
}

#[test]
fn hybrid_models_speculate_with_outputs_identical_to_decoding_without() {
    // 40 new tokens after prompts of 12 to 44 cross several chunks of the delta rule (16
    // positions): the proposals stop before a chunk's end, and rejected ones roll the
    // convolution rows back. Greedy and seeded sampling, six sequences at once; the n-gram
    // proposer (which the random fixtures rarely reward) and a proposer that knows the answer
    // but for every fifth or second position.
    for name in HYBRID {
        let path = fixture(name);
        for (what, requests) in [("greedy", mixed_requests(40)), ("seeded", seeded_requests(40))] {
            let (plain, plain_stats) = run(&path, &options(0), &requests);
            let (ngram, _) = run(&path, &options(4), &requests);
            assert_same(&plain, &ngram, &format!("{name}, {what}, n-gram proposals"));
            for (k, miss) in [(1, 5), (4, 5), (8, 5), (8, 2)] {
                let (spec, stats) = run_with_oracle(&path, k, &requests, &plain, miss);
                let what = format!("{name}, {what}, {k} speculative tokens, one in {miss} wrong");
                assert_same(&plain, &spec, &what);
                assert_eq!(stats.generation_tokens_total, plain_stats.generation_tokens_total);
                eprintln!(
                    "{what}: {} of {} proposals accepted; {} steps against {}",
                    stats.speculative_accepted_tokens,
                    stats.speculative_proposed_tokens,
                    stats.steps,
                    plain_stats.steps
                );
                // Both outcomes happen, so both the kept state and the rolled-back one are checked.
                assert!(stats.speculative_accepted_tokens > 0, "{what}: nothing accepted");
                assert!(
                    stats.speculative_accepted_tokens < stats.speculative_proposed_tokens,
                    "{what}: nothing rejected"
                );
                if miss > 2 {
                    assert!(stats.steps < plain_stats.steps, "{what}: accepted proposals must save steps");
                }
            }
        }
    }
}

#[test]
fn proposals_stop_before_a_chunk_of_the_delta_rule_ends() {
    use kylin_engine::batch::proposals_before_chunk_end;
    // Chunks of 16: positions 15, 31, ... complete one. After a last token at 0, proposals at
    // 1..=14 complete none; at 14, none fits; at 15 (which completes one itself), 16..=30 do.
    assert_eq!(proposals_before_chunk_end(0, 16), 14);
    assert_eq!(proposals_before_chunk_end(10, 16), 4);
    assert_eq!(proposals_before_chunk_end(13, 16), 1);
    assert_eq!(proposals_before_chunk_end(14, 16), 0);
    assert_eq!(proposals_before_chunk_end(15, 16), 15);
    assert_eq!(proposals_before_chunk_end(16, 16), 14);
    assert_eq!(proposals_before_chunk_end(47, 32), 15);
    assert_eq!(proposals_before_chunk_end(63, 32), 31);
}

/// A KV budget for the hybrid model at `path` with `max_seqs` sequences and `k` speculative
/// tokens: its recurrent states, and `blocks` KV blocks of its attention layers (a hybrid model
/// has few), measured on a probe engine.
fn hybrid_budget(path: &Path, max_seqs: usize, k: usize, blocks: u64) -> KvBudget {
    let probe = engine(path, &EngineOptions { max_seqs, ..options(k) });
    let per_block = probe.info().kv_bytes / probe.info().kv_blocks as u64;
    KvBudget::Bytes(probe.core().state_bytes() + blocks * per_block)
}

#[test]
fn a_hybrid_model_with_a_prefix_hit_and_preemption_keeps_speculative_outputs() {
    // Small KV budget: sequences are preempted and resume from the state snapshots; a second
    // round hits blocks (and snapshots) written while speculating.
    let path = fixture("tiny-qwen3.5");
    let requests: Vec<Request> = (0..6)
        .map(|i| {
            let p =
                if i % 2 == 0 { repeating_prompt(20 + i, 4 + i / 2, 70 + i as u64) } else { prompt(20 + i, 70, 500) };
            request(i as u64, p, 40)
        })
        .collect();
    let roomy = EngineOptions { ctx_size: Some(64), max_seqs: 6, ..options(0) };
    let (plain, _) = run(&path, &roomy, &requests);
    let small =
        EngineOptions { ctx_size: Some(64), kv_budget: hybrid_budget(&path, 6, 4, 9), max_seqs: 6, ..options(4) };
    let mut e = engine(&path, &small);
    let vocab = e.core().model().dims().vocab;
    e.set_proposer(Box::new(Oracle::new(&requests, &plain, vocab, 4))).unwrap();
    let spec = drain(&mut e, &requests);
    assert_same(&plain, &spec, "hybrid speculation with preemption");
    let stats = e.stats();
    assert!(stats.preemptions > 0, "six sequences of 4 blocks in 9 blocks must preempt: {stats:?}");
    assert!(stats.speculative_accepted_tokens > 0);
    assert_all_blocks_free(&e);
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

/// Three requests for a real model: one asking to repeat a function (its output copies the
/// prompt), two free-form, each generating up to `max_new` tokens.
fn copy_code_requests(path: &Path, opts: &EngineOptions, max_new: usize) -> Vec<Request> {
    let e = engine(path, opts);
    let code = "def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n    return result\n";
    let copy = format!("Here is a function:\n{code}\nHere is the same function again, unchanged:\n");
    [copy.as_str(), "Write a short poem about the sea.", "The capital of France is"]
        .iter()
        .enumerate()
        .map(|(i, text)| request(i as u64, e.tokenize(text, true).unwrap(), max_new))
        .collect()
}

#[test]
fn a_real_model_copying_code_accepts_proposals_with_identical_outputs() {
    // SmolLM2-135M asked to repeat a function: its output copies the prompt, so proposals are
    // accepted; a free-form request beside it rejects most of its own.
    let path = smollm2();
    let opts = EngineOptions { ctx_size: Some(512), max_batch_tokens: 128, ..options(0) };
    let requests = copy_code_requests(&path, &opts, 48);
    let (plain, plain_stats) = run(&path, &opts, &requests);
    let (spec, stats) = run(&path, &EngineOptions { speculative_tokens: 4, ..opts.clone() }, &requests);
    assert_same(&plain, &spec, "smollm2");
    eprintln!(
        "smollm2: {} of {} proposals accepted; {} steps against {}",
        stats.speculative_accepted_tokens, stats.speculative_proposed_tokens, stats.steps, plain_stats.steps
    );
    assert!(stats.speculative_accepted_tokens > 0, "{stats:?}");
}

// Draft-model speculative decoding (`EngineOptions::draft_model`): a second model with the
// target's vocabulary proposes the tokens; the outputs stay those of decoding without
// speculation.

fn draft_options(speculative_tokens: usize, draft: &Path) -> EngineOptions {
    EngineOptions { draft_model: Some(draft.to_path_buf()), ..options(speculative_tokens) }
}

/// A copy of tiny-qwen3 that keeps only its first layer (its weights and tokenizer linked, its
/// `config.json` rewritten): a smaller model with the same tokenizer whose guesses the target
/// rejects now and then.
fn first_layer_of_tiny_qwen3(dir: &Path) -> PathBuf {
    let source = fixture("tiny-qwen3");
    let out = dir.join("tiny-qwen3-one-layer");
    std::fs::create_dir_all(&out).unwrap();
    for name in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::os::unix::fs::symlink(source.join(name), out.join(name)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
    config["num_hidden_layers"] = 1.into();
    config["layer_types"] = serde_json::json!(["full_attention"]);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    out
}

/// Runs `requests` with draft model `draft` and `k` tokens; checks the pools are empty after.
fn run_with_draft(path: &Path, draft: &Path, k: usize, requests: &[Request]) -> (Outputs, EngineStats) {
    let mut e = engine(path, &draft_options(k, draft));
    let out = drain(&mut e, requests);
    assert_all_blocks_free(&e);
    assert_eq!(e.draft().unwrap().blocks_in_use(), 0, "draft blocks still held after all requests ended");
    assert_eq!(e.draft().unwrap().states_in_use(), 0, "draft state slots still held after all requests ended");
    (out, e.stats())
}

#[test]
fn greedy_outputs_with_a_draft_model_equal_those_without() {
    let tmp = tempfile::tempdir().unwrap();
    let one_layer = first_layer_of_tiny_qwen3(tmp.path());
    // (target, draft, the draft is the target): a layer-skipping draft sharing the tokenizer;
    // other fixtures of the same vocabulary (a Qwen2 in F16 and a Qwen3 with YaRN, two layers,
    // for a three-layer Qwen3); a sliding-window model drafting for itself (the draft's own
    // sliding pool).
    let pairs = [
        (fixture("tiny-qwen3"), one_layer.clone(), false),
        (fixture("tiny-qwen3-sharded-f32"), fixture("tiny-qwen2-f16"), false),
        (fixture("tiny-qwen3-sharded-f32"), fixture("tiny-qwen3-yarn"), false),
        (fixture("tiny-mistral-w5-mqa"), fixture("tiny-mistral-w5-mqa"), true),
    ];
    for (target, draft, same) in &pairs {
        let what = format!("{} drafted by {}", target.display(), draft.display());
        let requests = mixed_requests(40);
        let (plain, plain_stats) = run(target, &options(0), &requests);
        let mut rejected = 0;
        for k in [1, 4] {
            let (spec, stats) = run_with_draft(target, draft, k, &requests);
            assert_same(&plain, &spec, &format!("{what}, {k} draft tokens"));
            assert!(stats.speculative_proposed_tokens > 0, "{what}: nothing was proposed");
            assert_eq!(stats.draft_model_proposed_tokens, stats.speculative_proposed_tokens);
            assert_eq!(stats.draft_model_accepted_tokens, stats.speculative_accepted_tokens);
            assert!(stats.draft_model_computed_tokens > 0);
            assert!(stats.speculative_accepted_tokens <= stats.speculative_proposed_tokens);
            assert_eq!(stats.generation_tokens_total, plain_stats.generation_tokens_total);
            rejected += stats.speculative_proposed_tokens - stats.speculative_accepted_tokens;
            eprintln!(
                "{what}, k = {k}: {} of {} proposals accepted; {} steps against {}",
                stats.speculative_accepted_tokens, stats.speculative_proposed_tokens, stats.steps, plain_stats.steps
            );
        }
        if *same {
            assert_eq!(rejected, 0, "{what}: a model drafting for itself has every greedy proposal accepted");
        } else {
            assert!(rejected > 0, "{what}: a different draft must have some proposals rejected");
        }
    }
}

#[test]
fn seeded_sampling_with_a_draft_model_equals_sampling_without() {
    let tmp = tempfile::tempdir().unwrap();
    let draft = first_layer_of_tiny_qwen3(tmp.path());
    let path = fixture("tiny-qwen3");
    let mut requests = seeded_requests(40);
    // A request with two choices: its second choice forks after the prompt, and the draft
    // catches up on it from the start.
    requests[1].n = 2;
    let (plain, _) = run(&path, &options(0), &requests);
    for draft in [draft.as_path(), path.as_path()] {
        let (spec, stats) = run_with_draft(&path, draft, 4, &requests);
        assert_same(&plain, &spec, &format!("seeded sampling drafted by {}", draft.display()));
        assert!(stats.draft_model_proposed_tokens > 0);
        assert!(stats.draft_model_accepted_tokens > 0, "{stats:?}");
    }
}

#[test]
fn a_model_drafting_for_itself_has_every_greedy_proposal_accepted() {
    // The draft computes the target's logits bit for bit (batch invariance), so its greedy
    // guesses are what greedy sampling picks: every proposal is accepted and each step emits
    // `k + 1` tokens per sequence.
    let path = fixture("tiny-qwen3");
    let requests = mixed_requests(40);
    let (plain, plain_stats) = run(&path, &options(0), &requests);
    let (spec, stats) = run_with_draft(&path, &path, 4, &requests);
    assert_same(&plain, &spec, "self-draft");
    eprintln!(
        "self-draft: {} of {} proposals accepted; {} steps against {}",
        stats.speculative_accepted_tokens, stats.speculative_proposed_tokens, stats.steps, plain_stats.steps
    );
    assert!(stats.draft_model_proposed_tokens > 0);
    assert_eq!(stats.draft_model_accepted_tokens, stats.draft_model_proposed_tokens, "{stats:?}");
    assert!(stats.steps * 2 < plain_stats.steps, "every proposal accepted must save steps: {stats:?}");
}

#[test]
fn preemption_under_a_small_kv_budget_keeps_draft_model_outputs_identical() {
    let path = fixture("tiny-qwen2-f16");
    let draft = fixture("tiny-qwen3-yarn");
    let per_block = support::f32_block_bytes(&path);
    let requests: Vec<Request> = (0..8).map(|i| request(i as u64, prompt(20 + i, 50 + i as u64, 500), 40)).collect();
    let roomy = EngineOptions { ctx_size: Some(64), max_seqs: 8, ..options(0) };
    let (plain, _) = run(&path, &roomy, &requests);
    let small = EngineOptions { kv_budget: KvBudget::Bytes(12 * per_block), ..draft_options(4, &draft) };
    let mut e = BatchEngine::new(
        kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap(),
        &EngineOptions { ctx_size: Some(64), max_seqs: 8, ..small },
    )
    .unwrap();
    let spec = drain(&mut e, &requests);
    assert_same(&plain, &spec, "draft model with preemption");
    let stats = e.stats();
    assert!(stats.preemptions > 0, "8 sequences of 4 blocks in 12 blocks must preempt");
    assert!(stats.draft_model_proposed_tokens > 0);
    assert_all_blocks_free(&e);
    assert_eq!(e.draft().unwrap().blocks_in_use(), 0);
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused_with_a_typed_error() {
    let target = fixture("tiny-qwen3");
    let refuse = |draft: &Path| {
        let model = kylin_loader::load(&target, &kylin_loader::LoadOptions::default()).unwrap();
        BatchEngine::new(model, &draft_options(4, draft)).unwrap_err()
    };
    // Another vocabulary size: both directories and both sizes are named.
    let other = fixture("tiny-qwen2-f16");
    let err = refuse(&other);
    assert_eq!(err.code(), ErrorCode::VocabMismatch, "{err}");
    for part in [target.display().to_string(), other.display().to_string(), "151936".into(), "got 1024".into()] {
        assert!(err.message.contains(&part), "{part:?} missing from: {}", err.message);
    }
    // The same size, but a tokenizer that gives one token another string.
    let tmp = tempfile::tempdir().unwrap();
    let renamed = tmp.path().join("swapped-tokens");
    std::fs::create_dir_all(&renamed).unwrap();
    for name in ["model.safetensors", "config.json", "tokenizer_config.json", "generation_config.json"] {
        std::os::unix::fs::symlink(target.join(name), renamed.join(name)).unwrap();
    }
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(target.join("tokenizer.json")).unwrap()).unwrap();
    // "hello" and "world" swap ids (the merges still name tokens of the vocabulary).
    let vocab = tokenizer["model"]["vocab"].as_object_mut().unwrap();
    let (hello, world) = (vocab["hello"].as_u64().unwrap(), vocab["world"].as_u64().unwrap());
    vocab.insert("hello".into(), world.into());
    vocab.insert("world".into(), hello.into());
    std::fs::write(renamed.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let err = refuse(&renamed);
    assert_eq!(err.code(), ErrorCode::VocabMismatch, "{err}");
    // The differing token with the smaller id is named, with both ids.
    let (first, other) = (hello.min(world), hello.max(world));
    assert!(err.message.contains(&format!("expected id {first} (the target's), got {other}")), "{}", err.message);
    assert!(err.message.contains(&renamed.display().to_string()), "{}", err.message);
}

#[test]
fn hybrid_targets_and_hybrid_drafts_speculate_with_identical_outputs() {
    let hybrid = fixture("tiny-qwen3.5");
    let dense = fixture("tiny-qwen3-sharded-f32");
    let requests = mixed_requests(40);
    let seeded = seeded_requests(40);
    // A hybrid model drafting for itself computes the target's logits bit for bit, its state
    // cut back after every rejection: every greedy proposal is accepted.
    for name in ["tiny-qwen3.5", "tiny-lfm2", "tiny-qwen3-next-gqa-sparse"] {
        let path = fixture(name);
        let (plain, plain_stats) = run(&path, &options(0), &requests);
        let (spec, stats) = run_with_draft(&path, &path, 4, &requests);
        assert_same(&plain, &spec, &format!("{name} drafting for itself"));
        assert!(stats.draft_model_proposed_tokens > 0, "{name}: {stats:?}");
        assert_eq!(stats.draft_model_accepted_tokens, stats.draft_model_proposed_tokens, "{name}: {stats:?}");
        assert!(stats.steps * 2 < plain_stats.steps, "{name}: every proposal accepted must save steps: {stats:?}");
        // Seeded sampling rejects greedy proposals now and then; the draft rolls back.
        let (plain, _) = run(&path, &options(0), &seeded);
        let (spec, stats) = run_with_draft(&path, &path, 4, &seeded);
        assert_same(&plain, &spec, &format!("{name} drafting for itself, seeded"));
        assert!(stats.draft_model_accepted_tokens < stats.draft_model_proposed_tokens, "{name}: {stats:?}");
    }
    // Other drafts: dense for hybrid, hybrid for hybrid and for dense.
    for (target, draft) in [(&hybrid, &dense), (&hybrid, &fixture("tiny-qwen3.5-gqa-interval")), (&dense, &hybrid)] {
        for (what, requests) in [("greedy", &requests), ("seeded", &seeded)] {
            let (plain, _) = run(target, &options(0), requests);
            let (drafted, stats) = run_with_draft(target, draft, 4, requests);
            let what = format!("{} with the draft {}, {what}", target.display(), draft.display());
            assert_same(&plain, &drafted, &what);
            assert!(stats.draft_model_proposed_tokens > 0, "{what}: {stats:?}");
        }
    }
    // A draft model needs draft tokens.
    let model = kylin_loader::load(&dense, &kylin_loader::LoadOptions::default()).unwrap();
    let err = BatchEngine::new(model, &draft_options(0, &dense)).unwrap_err();
    assert_eq!(err.code(), ErrorCode::ConfigInvalid, "{err}");
    assert!(err.message.contains("--speculative-tokens"), "{}", err.message);
}

#[test]
fn a_draft_model_out_of_blocks_proposes_less_with_identical_outputs() {
    // A draft pool of 10 blocks of 16 positions for six sequences of up to 88 tokens: the
    // sequences that find no free draft block decode one token at a time until others end.
    let path = fixture("tiny-qwen3");
    let requests = mixed_requests(40);
    let (plain, _) = run(&path, &options(0), &requests);
    let (_, roomy) = run_with_draft(&path, &path, 4, &requests);
    let small = EngineOptions { draft_kv_tokens: Some(160), block_size: Some(16), ..draft_options(4, &path) };
    let mut e = engine(&path, &small);
    assert_eq!(e.draft().unwrap().total_blocks(), 10);
    let spec = drain(&mut e, &requests);
    assert_same(&plain, &spec, "a draft pool too small for every sequence");
    assert_all_blocks_free(&e);
    assert_eq!(e.draft().unwrap().blocks_in_use(), 0);
    let stats = e.stats();
    eprintln!(
        "{} proposals with a small draft pool, {} with a roomy one",
        stats.draft_model_proposed_tokens, roomy.draft_model_proposed_tokens
    );
    assert!(stats.draft_model_proposed_tokens > 0);
    assert!(stats.draft_model_proposed_tokens < roomy.draft_model_proposed_tokens);
    assert_eq!(stats.draft_model_accepted_tokens, stats.draft_model_proposed_tokens);
}

#[test]
fn a_real_model_with_a_draft_model_keeps_its_outputs() {
    // SmolLM2-135M drafting for itself (every greedy proposal accepted) and its first 8 of 30
    // layers as a draft (a layer-skipping draft with the real tokenizer: some proposals
    // accepted, some rejected), on a request that copies code and two free-form ones.
    let path = smollm2();
    let tmp = tempfile::tempdir().unwrap();
    let skip = tmp.path().join("smollm2-first-8-layers");
    std::fs::create_dir_all(&skip).unwrap();
    for entry in std::fs::read_dir(&path).unwrap() {
        let name = entry.unwrap().file_name();
        if name != "config.json" {
            std::os::unix::fs::symlink(path.join(&name), skip.join(&name)).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path.join("config.json")).unwrap()).unwrap();
    config["num_hidden_layers"] = 8.into();
    std::fs::write(skip.join("config.json"), config.to_string()).unwrap();

    let opts = EngineOptions { ctx_size: Some(512), max_batch_tokens: 128, ..options(0) };
    let requests = copy_code_requests(&path, &opts, 32);
    let (plain, plain_stats) = run(&path, &opts, &requests);
    for (draft, all_accepted) in [(path.clone(), true), (skip, false)] {
        let with_draft = EngineOptions { draft_model: Some(draft.clone()), speculative_tokens: 4, ..opts.clone() };
        let mut e = engine(&path, &with_draft);
        let spec = drain(&mut e, &requests);
        let stats = e.stats();
        assert_same(&plain, &spec, &format!("smollm2 drafted by {}", draft.display()));
        eprintln!(
            "smollm2 drafted by {}: {} of {} proposals accepted; {} steps against {}",
            draft.display(),
            stats.draft_model_accepted_tokens,
            stats.draft_model_proposed_tokens,
            stats.steps,
            plain_stats.steps
        );
        if all_accepted {
            assert!(stats.draft_model_accepted_tokens > 0, "{stats:?}");
            assert_eq!(stats.draft_model_accepted_tokens, stats.draft_model_proposed_tokens, "{stats:?}");
        } else {
            assert!(stats.draft_model_accepted_tokens < stats.draft_model_proposed_tokens, "{stats:?}");
            // Its guesses keep missing, so the sequences back off: far fewer proposals than the
            // four per step a fixed length would make (one per generated token at most).
            assert!(stats.draft_model_proposed_tokens < stats.generation_tokens_total, "{stats:?}");
        }
    }
}

#[test]
fn a_self_draft_accepts_everything_under_preemption_and_prefix_hits() {
    // The draft's cache follows each sequence through chunked prefill (computed beside the
    // target's chunks), preemption (released, then computed again) and prefix-cache hits (the
    // target skips the cached prompt blocks, the draft catches up on them): if it ever held
    // the wrong keys and values, a proposal would be rejected.
    let path = fixture("tiny-qwen2-f16");
    let per_block = support::f32_block_bytes(&path);
    let requests: Vec<Request> = (0..8).map(|i| request(i as u64, prompt(20 + i, 70 + i as u64, 500), 40)).collect();
    let sized = |o: EngineOptions| EngineOptions { ctx_size: Some(64), max_seqs: 8, max_batch_tokens: 24, ..o };
    let (plain, _) = run(&path, &sized(options(0)), &requests);
    let small = EngineOptions { kv_budget: KvBudget::Bytes(12 * per_block), ..sized(draft_options(4, &path)) };
    let mut e =
        BatchEngine::new(kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap(), &small).unwrap();
    let spec = drain(&mut e, &requests);
    assert_same(&plain, &spec, "self-draft with preemption");
    let stats = e.stats();
    assert!(stats.preemptions > 0, "8 sequences of 4 blocks in 12 blocks must preempt");
    assert!(stats.draft_model_proposed_tokens > 0);
    assert_eq!(stats.draft_model_accepted_tokens, stats.draft_model_proposed_tokens, "{stats:?}");
    assert_all_blocks_free(&e);
    assert_eq!(e.draft().unwrap().blocks_in_use(), 0);
    // On a pool with room for all: the same requests, then prompts that begin with a
    // first-round prompt and its first 8 outputs (prefix hits).
    let mut e = engine(&path, &sized(draft_options(4, &path)));
    assert_same(&plain, &drain(&mut e, &requests), "self-draft");
    let second: Vec<Request> = requests
        .iter()
        .map(|r| {
            let mut ids = r.prompt_ids.clone();
            ids.extend_from_slice(&spec[&(r.id, 0)].ids[..8]);
            request(100 + r.id, ids, 12)
        })
        .collect();
    let hits_before = e.stats().prefix_cache_hits;
    let reused = drain(&mut e, &second);
    assert!(e.stats().prefix_cache_hits > hits_before, "the second round must hit the cache");
    let (fresh, _) = run(&path, &sized(options(0)), &second);
    assert_same(&fresh, &reused, "self-draft over cached prefixes");
    let stats = e.stats();
    assert_eq!(stats.draft_model_accepted_tokens, stats.draft_model_proposed_tokens, "{stats:?}");
    assert_all_blocks_free(&e);
    assert_eq!(e.draft().unwrap().blocks_in_use(), 0);
}

/// A person as JSON: keys and punctuation forced by the grammar, strings and numbers sampled.
fn person_grammar(e: &BatchEngine) -> kylin_engine::grammar::Grammar {
    let codec = e.core().text().unwrap();
    let eos = codec.tokenize("<|im_end|>", false).unwrap();
    let compiler = codec.grammar_compiler(e.core().model().dims().vocab, &eos).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "note": {"type": "string", "maxLength": 60},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}
        },
        "required": ["name", "note", "age"],
        "additionalProperties": false
    });
    compiler.compile(&kylin_engine::grammar::GrammarSpec::JsonSchema(schema)).unwrap()
}

#[test]
fn constrained_sequences_speculate_with_identical_outputs_that_follow_their_grammar() {
    // Proposals are checked against the grammar before they are computed, verified under its
    // masks row by row, and stop where it forces tokens; outputs equal decoding without
    // speculation and every finished one is valid JSON. Half the requests are constrained.
    let path = fixture("tiny-qwen3");
    let grammar = person_grammar(&engine(&path, &options(0)));
    for (what, mut requests) in [("greedy", mixed_requests(60)), ("seeded", seeded_requests(60))] {
        for r in requests.iter_mut().step_by(2) {
            r.grammar = Some(grammar.clone());
        }
        let (plain, plain_stats) = run(&path, &options(0), &requests);
        let (ngram, _) = run(&path, &options(4), &requests);
        assert_same(&plain, &ngram, &format!("{what}, n-gram proposals under a grammar"));
        let (spec, stats) = run_with_oracle(&path, 4, &requests, &plain, 5);
        assert_same(&plain, &spec, &format!("{what}, proposals under a grammar"));
        eprintln!(
            "{what}: {} of {} proposals accepted; {} steps against {}",
            stats.speculative_accepted_tokens, stats.speculative_proposed_tokens, stats.steps, plain_stats.steps
        );
        assert!(stats.speculative_accepted_tokens > 0, "{what}: {stats:?}");
        assert!(stats.steps < plain_stats.steps, "{what}: {stats:?}");
        let codec = engine(&path, &options(0));
        let codec = codec.core().text().unwrap();
        for r in requests.iter().step_by(2) {
            let out = &spec[&(r.id, 0)];
            if out.reason == Some(StopReason::Eos) {
                let text = codec.detokenize(&out.ids, true).unwrap();
                let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
                assert!(v["age"].is_i64() && v["name"].is_string(), "{text}");
            }
        }
    }
}

#[test]
fn proposals_stay_within_the_step_tokens_and_fade_out_as_the_batch_grows() {
    let path = fixture("tiny-qwen3");
    let one = vec![request(1, prompt(20, 5, 500), 40)];
    let (plain, plain_stats) = run(&path, &options(0), &one);
    // A proposer that is always right: each step emits every proposal and one more token.
    let with_step_tokens = |step_tokens: usize, requests: &[Request], plain: &Outputs| {
        let mut e = engine(&path, &EngineOptions { speculative_step_tokens: step_tokens, ..options(8) });
        let vocab = e.core().model().dims().vocab;
        e.set_proposer(Box::new(Oracle::new(requests, plain, vocab, u64::MAX))).unwrap();
        let out = drain(&mut e, requests);
        assert_same(plain, &out, &format!("{step_tokens} step tokens"));
        e.stats()
    };
    // 40 tokens: the first from the prompt's step, then 9 per step with 8 proposals, 3 per step
    // when a step holds 3 tokens, 1 when it holds 1 (no proposals).
    let roomy = with_step_tokens(32, &one, &plain);
    let three = with_step_tokens(3, &one, &plain);
    let none = with_step_tokens(1, &one, &plain);
    assert_eq!(none.speculative_proposed_tokens, 0, "{none:?}");
    assert_eq!(none.steps, plain_stats.steps);
    assert!(three.steps > 39 / 3 && three.steps < plain_stats.steps, "{three:?}");
    assert!(roomy.steps <= 1 + 39u64.div_ceil(9) + 1, "{roomy:?}");
    // Six sequences and 6 step tokens: once all six decode, nobody proposes.
    let six = mixed_requests(30);
    let (plain6, plain6_stats) = run(&path, &options(0), &six);
    let crowded = with_step_tokens(6, &six, &plain6);
    let spacious = with_step_tokens(64, &six, &plain6);
    assert!(crowded.speculative_proposed_tokens < spacious.speculative_proposed_tokens / 4, "{crowded:?} {spacious:?}");
    assert!(crowded.steps > spacious.steps && crowded.steps <= plain6_stats.steps, "{crowded:?} {spacious:?}");
}

#[test]
fn a_request_limits_its_own_proposals_within_the_engines() {
    let path = fixture("tiny-qwen3");
    let requests = vec![request(1, prompt(20, 5, 500), 40), request(2, prompt(20, 6, 500), 40)];
    let (plain, _) = run(&path, &options(0), &requests);
    let with_limits = |limits: [Option<usize>; 2]| {
        let mut requests = requests.clone();
        for (r, limit) in requests.iter_mut().zip(limits) {
            r.speculative_tokens = limit;
        }
        let mut e = engine(&path, &options(8));
        let vocab = e.core().model().dims().vocab;
        e.set_proposer(Box::new(Oracle::new(&requests, &plain, vocab, u64::MAX))).unwrap();
        let out = drain(&mut e, &requests);
        assert_same(&plain, &out, &format!("limits {limits:?}"));
        e.stats()
    };
    // Off for both: nothing proposed, one token per step each.
    let off = with_limits([Some(0), Some(0)]);
    assert_eq!(off.speculative_proposed_tokens, 0, "{off:?}");
    // Off for one, the engine's 8 for the other: only its tokens come from proposals.
    let one = with_limits([Some(0), None]);
    assert!(one.speculative_accepted_tokens > 0 && one.speculative_accepted_tokens < 40, "{one:?}");
    // Two per step for both: every step emits at most 3 tokens per sequence.
    let two = with_limits([Some(2), Some(2)]);
    let all = with_limits([None, None]);
    assert!(two.steps > 39 / 3 && two.steps > all.steps, "{two:?} {all:?}");
    // More than the engine's, or any without speculation, is refused with the field's name.
    let mut e = engine(&path, &options(8));
    let mut too_many = requests[0].clone();
    too_many.speculative_tokens = Some(9);
    let err = e.add_request(too_many.clone()).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InputInvalid, "{err}");
    assert!(err.message.contains("speculative_tokens 9") && err.message.contains("--speculative-tokens 8"), "{err}");
    let mut e = engine(&path, &options(0));
    let err = e.add_request(too_many).unwrap_err();
    assert!(err.message.contains("runs without"), "{err}");
    // Zero is always allowed.
    let mut off = requests[0].clone();
    off.speculative_tokens = Some(0);
    e.add_request(off).unwrap();
}

/// The fixtures with a multi-token-prediction head (`scripts/make_mtp_fixtures.py`): Qwen3.5,
/// Qwen3.5-MoE and Qwen3-Next (`mtp.*`) and GLM-4.5 (a NextN layer), their heads seeded random.
const MTP: [&str; 4] = ["tiny-qwen3.5-mtp", "tiny-qwen3.5-moe-mtp", "tiny-qwen3-next-mtp", "tiny-glm4-moe-mtp"];

fn mtp_engine(path: &Path, opts: &EngineOptions) -> kylin_loader::Result<BatchEngine> {
    let model = kylin_loader::load(path, &kylin_loader::LoadOptions { mtp: true, ..Default::default() })?;
    BatchEngine::new(model, opts)
}

#[test]
fn greedy_and_seeded_outputs_with_an_mtp_head_equal_those_without() {
    // Random heads propose badly: the point is that every proposal, accepted or not, leaves the
    // outputs as they are, with several sequences per step, a prompt the prefix cache holds
    // (its positions reach the head without the target's hidden states) and forked choices.
    for name in MTP {
        let path = fixture(name);
        let mut greedy = mixed_requests(40);
        greedy.push(request(99, greedy[0].prompt_ids.clone(), 40));
        let mut seeded = seeded_requests(40);
        seeded[1].n = 2;
        for (what, requests) in [("greedy", greedy), ("seeded", seeded)] {
            let (plain, _) = run(&path, &options(0), &requests);
            for k in [1, 3] {
                let mut e = mtp_engine(&path, &EngineOptions { mtp: true, ..options(k) }).unwrap();
                let out = drain(&mut e, &requests);
                assert_same(&plain, &out, &format!("{name}, {what}, MTP with {k} tokens"));
                let stats = e.stats();
                if what == "greedy" {
                    assert!(stats.prefix_cache_hits > 0, "{name}: the repeated prompt must hit the cache");
                }
                assert!(stats.draft_model_proposed_tokens > 0, "{name}: the head proposed nothing");
                assert_eq!(stats.speculative_proposed_tokens, stats.draft_model_proposed_tokens);
                assert_all_blocks_free(&e);
                assert_eq!(e.mtp().unwrap().blocks_in_use(), 0, "{name}: head blocks still held");
                eprintln!(
                    "{name}, {what}, k = {k}: {} of {} MTP proposals accepted",
                    stats.draft_model_accepted_tokens, stats.draft_model_proposed_tokens
                );
            }
        }
    }
}

#[test]
fn an_mtp_head_under_preemption_keeps_outputs_identical() {
    // Six sequences of 4 blocks in 9 blocks: sequences are preempted, resume from the prefix
    // cache's blocks and state snapshots, and the head fills what the cache gave.
    let path = fixture(MTP[0]);
    let requests: Vec<Request> =
        (0..6).map(|i| request(i as u64, prompt(20 + 3 * i, 70 + i as u64, 500), 40)).collect();
    let roomy = EngineOptions { ctx_size: Some(64), max_seqs: 6, ..options(0) };
    let (plain, _) = run(&path, &roomy, &requests);
    let small = EngineOptions {
        ctx_size: Some(64),
        kv_budget: hybrid_budget(&path, 6, 3, 9),
        max_seqs: 6,
        mtp: true,
        ..options(3)
    };
    let mut e = mtp_engine(&path, &small).unwrap();
    let out = drain(&mut e, &requests);
    assert_same(&plain, &out, "MTP with preemption");
    assert!(e.stats().preemptions > 0, "the small pool must preempt");
    assert!(e.stats().draft_model_proposed_tokens > 0);
    assert_all_blocks_free(&e);
    assert_eq!(e.mtp().unwrap().blocks_in_use(), 0);
}

#[test]
fn an_mtp_head_is_refused_with_typed_errors_where_it_cannot_run() {
    // A checkpoint without a head, asked for one: TENSOR_MISSING naming the tensor.
    let err = mtp_engine(&fixture("tiny-qwen3.5"), &EngineOptions { mtp: true, ..options(2) }).unwrap_err();
    assert_eq!(err.code, ErrorCode::TensorMissing, "{err}");
    assert!(err.message.contains("mtp.fc.weight"), "{err}");
    // A model loaded without its head.
    let model = kylin_loader::load(&fixture(MTP[0]), &kylin_loader::LoadOptions::default()).unwrap();
    let err = BatchEngine::new(model, &EngineOptions { mtp: true, ..options(2) }).unwrap_err();
    assert_eq!(err.code, ErrorCode::TensorMissing, "{err}");
    // No tokens to propose.
    let err = mtp_engine(&fixture(MTP[0]), &EngineOptions { mtp: true, ..options(0) }).unwrap_err();
    assert_eq!(err.code, ErrorCode::ConfigInvalid, "{err}");
    assert!(err.message.contains("--speculative-tokens"), "{err}");
}

#[test]
fn an_mtp_head_under_quantize_keeps_the_quantized_outputs() {
    // The head reads the target's quantized head (shared planes) and runs its layer quantized.
    let path = fixture(MTP[1]);
    let quantized = |k| EngineOptions {
        quantize: Some(kylin_engine::model::QuantFormat::Q8_0),
        precision: kylin_engine::model::PrecisionChoice::Auto,
        ..options(k)
    };
    let requests = mixed_requests(32);
    let (plain, _) = run(&path, &quantized(0), &requests);
    let mut e = mtp_engine(&path, &EngineOptions { mtp: true, ..quantized(2) }).unwrap();
    let out = drain(&mut e, &requests);
    assert_same(&plain, &out, "MTP under --quantize q8_0");
    assert!(e.stats().draft_model_proposed_tokens > 0);
    assert_all_blocks_free(&e);
}
