//! A decode step allocates nothing: with the model loaded and its state planned, `decode` runs
//! the whole forward pass (embedding, every layer, attention over the KV cache, the head)
//! without one heap allocation on any thread. A counting global allocator checks it; this file
//! holds one test so nothing else allocates concurrently.

use std::path::Path;
use std::sync::atomic::Ordering;

use kylin_engine::Backend;
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::sampler::argmax;

#[path = "../../kylin-kernels/tests/support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{ALLOCATIONS, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

#[test]
fn decode_steps_allocate_nothing() {
    // Qwen2 with biases (F16) and Qwen3 with q/k norms (BF16); then every family of the
    // registry's shared blocks: sliding windows and their own KV pool (Gemma 2/3, Mistral),
    // soft-caps and sandwich norms (Gemma 2), fused projections (Phi-3), NoPE (SmolLM3),
    // post-norms (OLMo 2), multipliers (Granite), and Gemma 4's per-layer inputs, wider global
    // heads and shared keys and values; the Mixture-of-Experts families (routing, grouping by
    // expert, shared experts, sinks); the hybrid families' recurrent layers (Qwen3.5's Gated
    // DeltaNet, LFM2's short convolutions), whose states are updated in place in the state
    // pool. The 39-token prompt and 33 decode steps cross the windows of 5 to 8, so sliding
    // blocks are released while decoding, and the delta rule's chunk boundaries (every 16
    // positions), so its states are folded while decoding.
    let families = [
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-gemma4",
        "tiny-mistral-swa",
        "tiny-phi3",
        "tiny-smollm3",
        "tiny-olmo2",
        "tiny-granite",
        "tiny-qwen3-moe",
        "tiny-qwen2-moe",
        "tiny-mixtral",
        "tiny-olmoe",
        "tiny-gpt-oss",
        "tiny-gemma4-moe",
        "tiny-qwen3.5",
        "tiny-qwen3.5-vl",
        "tiny-lfm2",
        "tiny-qwen3.5-moe",
    ];
    let more = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/families/fixtures");
    let models = ["tiny-qwen2-f16", "tiny-qwen3-yarn", "tiny-qwen3-sharded-f32"]
        .into_iter()
        .map(|name| (name, Path::new(SHARED).join("fixtures").join(name)))
        .chain(families.into_iter().map(|name| (name, Path::new(SHARED).join("families/fixtures").join(name))))
        .chain(std::iter::once(("tiny-gemma4-kvshare", Path::new(more).join("tiny-gemma4-kvshare"))));
    for (name, path) in models {
        let model = kylin_loader::load(&path, &kylin_loader::LoadOptions::default()).unwrap();
        let mut backend = NativeBackend::new(model, NativeOptions { threads: 2, ..Default::default() }).unwrap();
        let prompt: Vec<u32> = (1..40).collect();
        let mut next = argmax(backend.prefill(&prompt).unwrap());
        next = argmax(backend.decode(next).unwrap());

        let before = ALLOCATIONS.load(Ordering::SeqCst);
        let mut produced = 0u64;
        for _ in 0..32 {
            next = argmax(backend.decode(next).unwrap());
            produced += u64::from(next);
        }
        let after = ALLOCATIONS.load(Ordering::SeqCst);
        assert_eq!(after - before, 0, "{name}: 32 decode steps allocated {} times", after - before);
        assert_eq!(backend.position(), prompt.len() + 33);
        std::hint::black_box(produced);
    }
}
