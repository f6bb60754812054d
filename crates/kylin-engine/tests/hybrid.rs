//! The engine with hybrid models (recurrent mixers beside attention: Qwen3.5's Gated DeltaNet,
//! LFM2's short convolutions): the state pool's size and its place in the memory budget, live
//! states freed when sequences end, are cancelled or preempted, preempted sequences recomputed
//! to the same bits, the prefix cache resuming from state snapshots (a repeated prompt, the
//! next turn of a conversation), forked choices, and `kylin chat`'s rewind.
//!
//! Outputs are compared bit for bit (ids and log-probabilities, which are computed from the raw
//! logits) with the same request run alone on a fresh engine.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kylin_engine::Backend;
use kylin_engine::batch::{BatchEngine, EngineOptions, KvBudget, default_state_snapshots};
use kylin_engine::kv_pool::{KvPool, KvShape};
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::sampler::SamplingParams;
use kylin_engine::serving::{Event, EventKind, Request, Serving, StopReason};
use kylin_engine::state_pool::{RecurrentShape, StatePool};
use kylin_engine::{PrecisionChoice, QuantFormat};

mod support;
use support::{prompt, request};

const FAMILIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/families/fixtures");

/// The repository's own family fixtures (LFM2-MoE and Qwen3-Next are only there).
const MORE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/families/fixtures");

fn fixture(name: &str) -> PathBuf {
    let more = Path::new(MORE).join(name);
    if more.is_dir() { more } else { Path::new(FAMILIES).join(name) }
}

fn options() -> EngineOptions {
    EngineOptions { threads: 2, ctx_size: Some(256), precision: PrecisionChoice::F32, ..EngineOptions::default() }
}

fn engine(path: &Path, opts: &EngineOptions) -> BatchEngine {
    let model = kylin_loader::load(path, &kylin_loader::LoadOptions::default()).unwrap();
    BatchEngine::new(model, opts).unwrap()
}

/// What one choice produced: ids, the bits of their log-probabilities, how it ended, and the
/// prompt tokens the prefix cache supplied.
#[derive(Debug, Clone, PartialEq, Default)]
struct Output {
    ids: Vec<u32>,
    logprobs: Vec<u32>,
    reason: Option<StopReason>,
    cached: usize,
}

type Outputs = BTreeMap<(u64, usize), Output>;

fn collect(events: &[Event], out: &mut Outputs) {
    for e in events {
        let o = out.entry((e.request, e.index)).or_default();
        match &e.kind {
            EventKind::Token { id, logprob, .. } => {
                o.ids.push(*id);
                o.logprobs.push(logprob.as_ref().map_or(0, |l| l.logprob.to_bits()));
            }
            EventKind::Finished { reason, usage, .. } => {
                o.reason = Some(*reason);
                o.cached = usage.cached_prompt_tokens;
            }
            EventKind::PromptLogprobs { .. } | EventKind::Pooled { .. } => {}
        }
    }
}

fn drain(e: &mut BatchEngine) -> Outputs {
    let mut out = Outputs::new();
    support::step_until_idle(e, |events| collect(events, &mut out));
    out
}

fn alone(path: &Path, opts: &EngineOptions, requests: &[Request]) -> Outputs {
    let mut all = Outputs::new();
    for r in requests {
        let mut e = engine(path, opts);
        e.add_request(r.clone()).unwrap();
        all.extend(drain(&mut e));
    }
    all
}

/// Ids, log-probabilities and finish reasons equal (the prefix cache's share may differ).
fn assert_same(want: &Outputs, got: &Outputs, what: &str) {
    assert_eq!(want.len(), got.len(), "{what}: choice count");
    for (key, a) in want {
        let b = &got[key];
        assert_eq!((&a.ids, &a.logprobs, a.reason), (&b.ids, &b.logprobs, b.reason), "{what}: request {key:?}");
    }
}

/// No block referenced, no live state held, nothing running.
fn assert_all_free(e: &BatchEngine) {
    let stats = e.stats();
    assert_eq!(stats.kv_blocks_used, 0, "blocks still referenced");
    assert_eq!((stats.running, stats.waiting), (0, 0));
    let states = e.core().state_pool().expect("a hybrid model has a state pool");
    assert_eq!(states.live_in_use(), 0, "live states still held after every request ended");
}

/// tiny-qwen3.5: 3 Gated DeltaNet layers (4 value heads of 16 x 16, 2 key heads, a
/// convolution of 4 taps over 128 channels) and 1 attention layer (2 KV heads of 16).
fn qwen35_shapes() -> Vec<RecurrentShape> {
    vec![RecurrentShape::DeltaNet { heads: 4, dk: 16, dv: 16, channels: 128, taps: 4 }; 3]
}

#[test]
fn the_state_pool_is_sized_per_sequence_and_comes_out_of_the_budget() {
    let path = fixture("tiny-qwen3.5");
    let opts = EngineOptions { max_seqs: 4, ..options() };
    let e = engine(&path, &opts);
    let info = e.info();
    let pool = info.state_pool.expect("the state pool is reported");
    // Blocks of 16 positions: the chunk is 16.
    assert_eq!((pool.chunk, pool.live_slots, pool.snapshots), (16, 4, default_state_snapshots(4)));
    // Per DeltaNet layer: S 4·16·16, the chunk in progress 4·16·(16 + 16 + 1), the
    // convolution's 3 rows of 128 now and at the anchor; a snapshot keeps S and one set of rows.
    let live = 4 * (1024 + 2112 + 2 * 384) * 3;
    let snapshot = 4 * (1024 + 384) * 3;
    assert_eq!((pool.live_bytes, pool.snapshot_bytes), (live as u64, snapshot as u64));
    assert_eq!(StatePool::slot_bytes(&qwen35_shapes(), 16, 0), (live as u64, snapshot as u64));
    let total = 4 * live as u64 + default_state_snapshots(4) as u64 * snapshot as u64;
    assert_eq!(pool.bytes, total);
    assert_eq!(e.core().state_bytes(), total);

    // --kv-memory buys the state pool first, then KV blocks of the one attention layer.
    let per_block =
        KvPool::block_bytes(kylin_kernels::WeightDType::F32, &[KvShape { n_kv_heads: 2, head_dim: 16 }], 16).unwrap();
    let budget = total + 40 * per_block + per_block / 2;
    let e = engine(&path, &EngineOptions { kv_budget: KvBudget::Bytes(budget), ..opts.clone() });
    assert_eq!(e.info().kv_blocks, 40);
    // A budget that holds the states but not one sequence of the context is refused with the
    // numbers.
    let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
    let err =
        BatchEngine::new(model, &EngineOptions { kv_budget: KvBudget::Bytes(total + per_block), ..opts }).unwrap_err();
    assert_eq!(err.code(), kylin_loader::ErrorCode::ConfigInvalid);
    assert!(err.message.contains("needs 16 blocks"), "{}", err.message);
}

/// Nine requests alone and together under a KV budget for three sequences: preemption and
/// recomputation give the same bits, and every state slot and block returns.
#[test]
fn preempted_hybrid_sequences_recompute_to_the_same_bits() {
    for name in ["tiny-qwen3.5", "tiny-lfm2", "tiny-qwen3-next-gqa-sparse", "tiny-lfm2-moe-dense2-bias"] {
        let path = fixture(name);
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        let c = &model.config;
        let shape = KvShape { n_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
        let attention =
            c.decoder.layers.iter().filter(|l| l.mixer == kylin_loader::family::MixerKind::Attention).count();
        let per_block = KvPool::block_bytes(kylin_kernels::WeightDType::F32, &vec![shape; attention], 16).unwrap();
        let probe = BatchEngine::new(model, &EngineOptions { max_seqs: 8, ctx_size: Some(64), ..options() }).unwrap();
        let states = probe.core().state_bytes();
        // Context 64 = 4 blocks per sequence; 12 blocks hold three sequences.
        let opts = EngineOptions {
            ctx_size: Some(64),
            max_seqs: 8,
            kv_budget: KvBudget::Bytes(states + 12 * per_block),
            ..options()
        };
        let requests: Vec<Request> = (0..8).map(|i| request(i, prompt(20 + i as usize, 50 + i, 1000), 40)).collect();
        let single = alone(&path, &opts, &requests);
        let mut e = engine(&path, &opts);
        assert_eq!(e.info().kv_blocks, 12);
        for r in &requests {
            e.add_request(r.clone()).unwrap();
        }
        let together = drain(&mut e);
        assert_same(&single, &together, name);
        assert!(e.stats().preemptions > 0, "{name}: 8 sequences of 4 blocks in 12 blocks must preempt");
        assert_all_free(&e);
    }
}

#[test]
fn cancelled_and_finished_sequences_give_their_states_back() {
    let path = fixture("tiny-qwen3.5");
    let mut e = engine(&path, &options());
    let requests: Vec<Request> = (0..4).map(|i| request(i, prompt(40, i + 9, 1000), 60)).collect();
    let cancel = requests[1].cancel.clone();
    for r in &requests {
        e.add_request(r.clone()).unwrap();
    }
    let mut out = Outputs::new();
    let mut events = Vec::new();
    for _ in 0..4 {
        events.clear();
        e.step(&mut events).unwrap();
        collect(&events, &mut out);
    }
    let states = |e: &BatchEngine| e.core().state_pool().unwrap().live_in_use();
    assert_eq!(states(&e), 4);
    cancel.cancel();
    events.clear();
    e.step(&mut events).unwrap();
    collect(&events, &mut out);
    assert_eq!(out[&(1, 0)].reason, Some(StopReason::Cancelled));
    assert_eq!(states(&e), 3, "the cancelled sequence's state is released at the next step");
    while e.has_work() {
        events.clear();
        e.step(&mut events).unwrap();
        collect(&events, &mut out);
    }
    assert_eq!(out[&(0, 0)].ids.len(), 60);
    assert_all_free(&e);
}

/// The prefix cache with recurrent layers: a repeated prompt resumes from the snapshot taken at
/// its last chunk boundary, the next turn of a conversation (the prompt, the answer and a new
/// message) from the one its answer left, and both give the bits of a fresh engine.
#[test]
fn prefix_reuse_resumes_from_state_snapshots() {
    for name in ["tiny-qwen3.5", "tiny-lfm2", "tiny-qwen3-next-gqa-sparse", "tiny-lfm2-moe-dense2-bias"] {
        let path = fixture(name);
        let opts = options();
        let first = request(1, prompt(70, 5, 1000), 30);
        let mut e = engine(&path, &opts);
        e.add_request(first.clone()).unwrap();
        let turn1 = drain(&mut e);
        assert!(e.core().state_pool().unwrap().snapshots_held() >= 2, "{name}: prompt and finish snapshots");

        // The same prompt again: the state at 64 (the last chunk boundary of 70 tokens) is reused.
        let again = Request { id: 2, ..first.clone() };
        e.add_request(again.clone()).unwrap();
        let repeat = drain(&mut e);
        assert_eq!(repeat[&(2, 0)].cached, 64, "{name}: a repeated prompt reuses its snapshot");
        assert_eq!((&repeat[&(2, 0)].ids, &repeat[&(2, 0)].logprobs), (&turn1[&(1, 0)].ids, &turn1[&(1, 0)].logprobs));

        // The next turn: 70 + 30 tokens of the first turn (99 computed when it ended: the state
        // at 96 was kept) and 20 new ones.
        let mut next = first.prompt_ids.clone();
        next.extend(&turn1[&(1, 0)].ids);
        next.extend(prompt(20, 6, 1000));
        let follow = request(3, next, 12);
        let cold = alone(&path, &opts, std::slice::from_ref(&follow));
        e.add_request(follow).unwrap();
        let warm = drain(&mut e);
        assert_eq!(warm[&(3, 0)].cached, 96, "{name}: the next turn resumes after the first turn's answer");
        assert_eq!(cold[&(3, 0)].cached, 0);
        assert_same(&cold, &warm, name);

        // A prompt sharing only a prefix with no snapshot of its own runs from the start, right.
        let mut partial = first.prompt_ids[..40].to_vec();
        partial.extend(prompt(30, 7, 1000));
        let other = request(4, partial, 10);
        let cold = alone(&path, &opts, std::slice::from_ref(&other));
        e.add_request(other).unwrap();
        assert_same(&cold, &drain(&mut e), name);
        assert_all_free(&e);
    }
}

/// `n > 1` on a hybrid model: the siblings continue from the leader's state and equal separate
/// requests with their seeds.
#[test]
fn forked_choices_continue_from_the_prompts_state() {
    let path = fixture("tiny-qwen3.5");
    let mut r = request(5, prompt(37, 3, 1000), 12);
    r.sampling = SamplingParams { temperature: 0.9, top_k: 40, seed: 11, ..SamplingParams::greedy() };
    r.n = 3;
    let mut e = engine(&path, &options());
    e.add_request(r.clone()).unwrap();
    let out = drain(&mut e);
    assert_eq!(out.len(), 3);
    for i in 0..3 {
        let mut single = r.clone();
        single.n = 1;
        single.sampling.seed = 11 + i as u64;
        let alone = alone(&path, &options(), &[single]);
        assert_eq!(alone[&(5, 0)].ids, out[&(5, i)].ids, "choice {i} equals seed {}", 11 + i);
    }
    assert_all_free(&e);
}

/// `kylin chat`'s path on the native backend: a turn, then the next turn keeps a prefix and
/// goes on. The sequence resumes from its own anchor or a snapshot and recomputes the rest;
/// the logits are those of a fresh prefill of the whole conversation, bit for bit.
#[test]
fn rewinding_a_hybrid_sequence_recomputes_from_its_last_state() {
    for name in ["tiny-qwen3.5", "tiny-lfm2"] {
        let path = fixture(name);
        let native = || {
            let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
            let engine = EngineOptions { ..options() };
            NativeBackend::new(model, NativeOptions { threads: 2, engine: Some(engine), ..Default::default() }).unwrap()
        };
        let turn1 = prompt(90, 5, 1000);
        for (keep, decoded) in [(95usize, 10usize), (99, 10), (70, 10), (85, 3)] {
            let mut b = native();
            b.prefill(&turn1).unwrap();
            let mut whole = turn1.clone();
            for i in 0..decoded {
                let id = 7 + i as u32;
                b.decode(id).unwrap();
                whole.push(id);
            }
            b.rewind(keep);
            whole.truncate(keep);
            whole.extend(prompt(30, 8, 1000));
            let got = b.prefill(&whole[keep..]).unwrap().to_vec();
            let want = native().prefill(&whole).unwrap().to_vec();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{name}: rewound to {keep} after {decoded} decoded tokens");
        }
    }
}

/// The quantized path runs the recurrent layers' projections quantized too, batch invariantly.
#[test]
fn quantized_hybrid_models_recompute_to_the_same_bits() {
    let path = fixture("tiny-qwen3.5");
    let opts = EngineOptions { quantize: Some(QuantFormat::Q8_0), precision: PrecisionChoice::Auto, ..options() };
    let requests: Vec<Request> = (0..3).map(|i| request(i, prompt(30 + 17 * i as usize, i, 1000), 20)).collect();
    let single = alone(&path, &opts, &requests);
    let mut e = engine(&path, &EngineOptions { max_batch_tokens: 24, ..opts });
    for r in &requests {
        e.add_request(r.clone()).unwrap();
    }
    assert_same(&single, &drain(&mut e), "q8_0");
    assert_all_free(&e);
}
