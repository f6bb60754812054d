//! A step of the batching engine with 8 running sequences allocates nothing: scheduling, block
//! allocation, the forward pass over the batch, sampling and the bookkeeping after it. The
//! requests stream ids only (text pieces are the one allocation a step makes for a request that
//! asks for text). A counting global allocator checks it; this file holds one test so nothing
//! else allocates concurrently.

use std::path::Path;
use std::sync::atomic::Ordering;

use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::serving::{Request, Serving};
use kylin_engine::{PrecisionChoice, QuantFormat};

#[path = "../../kylin-kernels/tests/support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{ALLOCATIONS, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

#[test]
fn a_step_with_eight_running_sequences_allocates_nothing() {
    // `Auto` on the BF16 fixture runs the BF16 products where the CPU has them; with
    // `--quantize q8_0` the int8 products. `--quantize q4_k` needs matrices of whole 256-column
    // super-blocks, which the fixtures do not have: SmolLM2's down_proj (1536 columns) is Q4_K,
    // its other matrices Q8_0.
    let fixture = |name: &str| Path::new(SHARED).join("fixtures").join(name);
    let models = std::env::var_os("KYLIN_MODELS").map_or_else(
        || std::path::PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/kylin-models"),
        std::path::PathBuf::from,
    );
    // The fourth element is `--speculative-tokens`: with it, the n-gram proposer proposes from
    // prompts that repeat themselves, and the verification rolls rejected proposals back. The
    // last is `--draft-model`: the draft's catch-up and proposal passes, its block tables and
    // its rollback after the verification allocate nothing either.
    let none = None::<std::path::PathBuf>;
    for (path, precision, quantize, speculative_tokens, draft_model) in [
        (fixture("tiny-qwen2-f16"), PrecisionChoice::F32, None, 0, none.clone()),
        (fixture("tiny-qwen3-yarn"), PrecisionChoice::F32, None, 0, none.clone()),
        (fixture("tiny-qwen3-yarn"), PrecisionChoice::Auto, None, 0, none.clone()),
        (fixture("tiny-qwen3-yarn"), PrecisionChoice::Auto, Some(QuantFormat::Q8_0), 0, none.clone()),
        (models.join("smollm2-135m-instruct"), PrecisionChoice::Auto, Some(QuantFormat::Q4K), 0, none.clone()),
        // A hybrid model: eight live states updated in place by the Gated DeltaNet layers.
        (Path::new(SHARED).join("families/fixtures/tiny-qwen3.5"), PrecisionChoice::F32, None, 0, none.clone()),
        (fixture("tiny-qwen3"), PrecisionChoice::F32, None, 4, none.clone()),
        (fixture("tiny-qwen3"), PrecisionChoice::F32, None, 4, Some(fixture("tiny-qwen3"))),
        // A draft whose proposals are all rejected (another model of the same vocabulary).
        (fixture("tiny-qwen3-yarn"), PrecisionChoice::F32, None, 4, Some(fixture("tiny-qwen2-f16"))),
    ] {
        let name = path.display();
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        let opts = EngineOptions {
            threads: 2,
            ctx_size: Some(256),
            max_seqs: 8,
            precision,
            quantize,
            speculative_tokens,
            draft_model,
            ..EngineOptions::default()
        };
        let mut engine = BatchEngine::new(model, &opts).unwrap();
        for i in 0..8u32 {
            let ids = (1..20 + 3 * i).map(|t| if speculative_tokens > 0 { 1 + t % 7 } else { t }).collect();
            let mut r = Request::new(u64::from(i), ids, if speculative_tokens > 0 { 200 } else { 64 });
            r.detokenize = false;
            r.ignore_eos = true;
            engine.add_request(r).unwrap();
        }
        let mut events = Vec::with_capacity(64);
        // Admission and prefill (which allocate the sequences' first blocks and samplers).
        for _ in 0..3 {
            events.clear();
            engine.step(&mut events).unwrap();
        }
        assert_eq!(engine.stats().running, 8);
        let proposed_before = engine.stats().speculative_proposed_tokens;
        let before = ALLOCATIONS.load(Ordering::SeqCst);
        for _ in 0..16 {
            events.clear();
            engine.step(&mut events).unwrap();
        }
        let after = ALLOCATIONS.load(Ordering::SeqCst);
        assert_eq!(
            after - before,
            0,
            "{name} {precision:?} {quantize:?}: 16 steps of 8 sequences allocated {} times",
            after - before
        );
        if speculative_tokens > 0 {
            assert!(events.len() >= 8, "at least one token per sequence per step");
            assert!(engine.stats().speculative_proposed_tokens > proposed_before, "{name}: nothing was proposed");
        } else {
            assert_eq!(events.len(), 8, "one token per sequence per step");
        }
        assert_eq!(engine.stats().running, 8);
    }
}
