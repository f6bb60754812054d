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

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared");

#[test]
fn decode_steps_allocate_nothing() {
    // Qwen2 with biases (F16) and Qwen3 with q/k norms (BF16): every optional path of the block.
    for name in ["tiny-qwen2-f16", "tiny-qwen3-yarn", "tiny-qwen3-sharded-f32"] {
        let path = Path::new(SHARED).join("fixtures").join(name);
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
