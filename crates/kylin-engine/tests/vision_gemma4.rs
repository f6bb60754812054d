//! Gemma 4's vision tower (`Gemma4VisionModel` and `embed_vision`) and images in its prompts,
//! against what transformers computes on tiny checkpoints
//! (`tests/fixtures/make_gemma4_vision_reference.py`: seeded patch rows in the image
//! processor's layout, float32 compute, eager attention, `mm_token_type_ids` marking the image
//! tokens).

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::serving::{ImageInput, Request};
use kylin_engine::vision::{PatchGrid, VisionTower};
use kylin_engine::{PrecisionChoice, Serving};
use kylin_kernels::ThreadPool;
use kylin_loader::vision::ImageAttention;
use serde_json::Value;
use support::{Output, floats, ids, log_softmax};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The shared fixture (one block, image tokens causal in the language model) and ours (two
/// blocks with grouped-query attention, clipped linears, standardized output; image tokens
/// bidirectional on the sliding layers, whose window is shorter than an image).
fn fixtures() -> [(PathBuf, Value); 2] {
    [
        ("tests/fixtures/families/fixtures/tiny-gemma4-vl", "tiny-gemma4-vl"),
        ("tests/fixtures/tiny-gemma4-vl-bidir", "tiny-gemma4-vl-bidir"),
    ]
    .map(|(dir, name)| {
        let path = repo().join(format!("tests/fixtures/vision_model/{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        (repo().join(dir), serde_json::from_str(&text).expect("the reference is JSON"))
    })
}

/// A reference image as the engine takes it: patch rows and the patch grid.
fn image_input(image: &Value) -> ImageInput {
    let grid = ids(&image["grid"]);
    let (h, w) = (grid[0] as usize, grid[1] as usize);
    ImageInput { pixels: Arc::from(floats(&image["pixel_values"])), grid: PatchGrid { t: 1, h, w } }
}

#[test]
fn the_tower_and_embedder_give_transformers_rows() {
    let pool = ThreadPool::new(2);
    for (dir, reference) in fixtures() {
        let loaded = kylin_loader::load(&dir, &Default::default()).expect("the fixture loads");
        let vision = loaded.vision.as_ref().expect("Gemma 4's vision tower is bound");
        assert!(loaded.unused_tensors.is_empty(), "{}: unused {:?}", dir.display(), loaded.unused_tensors);
        let bidirectional = dir.ends_with("tiny-gemma4-vl-bidir");
        let want_attention =
            if bidirectional { ImageAttention::BidirectionalOnSliding } else { ImageAttention::Causal };
        assert_eq!(vision.config.image_attention(), want_attention);
        let tower = VisionTower::new(vision).expect("the tower binds");
        let mut checked = 0;
        for case in reference["cases"].as_array().unwrap() {
            for image in case["images"].as_array().unwrap() {
                let input = image_input(image);
                let got = tower.encode(&pool, &input.pixels, input.grid).expect("the image encodes");
                let want = floats(&image["projected"]);
                assert_eq!(got.len(), want.len(), "{}", dir.display());
                let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                eprintln!("{}: {:?}: max |diff| {diff:e} (largest value {scale})", dir.display(), input.grid);
                assert!(diff < 5e-5, "{}: max |diff| {diff}", dir.display());
                checked += 1;
            }
        }
        assert_eq!(checked, 4);
    }
}

#[test]
fn an_image_the_tower_cannot_read_is_refused() {
    let (dir, _) = &fixtures()[1];
    let loaded = kylin_loader::load(dir, &Default::default()).unwrap();
    let tower = VisionTower::new(loaded.vision.as_ref().unwrap()).unwrap();
    let per_patch = tower.config().patch_values();
    assert_eq!(per_patch, 48);
    // Not pooled evenly, two frames, and more columns than the position table has (32).
    for (grid, says) in [
        (PatchGrid { t: 1, h: 6, w: 5 }, "multiples of the merge size 2"),
        (PatchGrid { t: 2, h: 6, w: 6 }, "at most 32 patches per row and column"),
        (PatchGrid { t: 1, h: 2, w: 34 }, "at most 32 patches per row and column"),
    ] {
        let err = tower.encode(&ThreadPool::new(1), &vec![0.0; grid.patches() * per_patch], grid).unwrap_err();
        assert_eq!(err.code.as_str(), "INPUT_INVALID", "{grid:?}: {err}");
        assert!(err.to_string().contains(says), "{grid:?}: {err}");
    }
    // The right grid with too few pixel values.
    let grid = PatchGrid { t: 1, h: 4, w: 4 };
    let err = tower.encode(&ThreadPool::new(1), &vec![0.0; 15 * per_patch], grid).unwrap_err();
    assert!(err.to_string().contains("expected 768 values, got 720"), "{err}");
}

fn engine(dir: &Path, opts: &EngineOptions) -> BatchEngine {
    let model = kylin_loader::load(dir, &Default::default()).expect("the fixture loads");
    BatchEngine::new(model, opts).expect("the engine builds")
}

fn options() -> EngineOptions {
    EngineOptions { threads: 2, ctx_size: Some(256), precision: PrecisionChoice::F32, ..EngineOptions::default() }
}

fn request(id: u64, case: &Value) -> Request {
    let mut r = Request::new(id, ids(&case["input_ids"]), 12);
    r.ignore_eos = true;
    r.detokenize = false;
    r.logprobs = Some(20);
    r.prompt_logprobs = Some(20);
    r.images = case["images"].as_array().unwrap().iter().map(image_input).collect();
    r
}

fn run(e: &mut BatchEngine, requests: Vec<Request>) -> Vec<Output> {
    support::run_requests(e, requests)
}

/// Checks a run against a case: the argmax at every position, log-probabilities within 1e-3,
/// and the greedy tokens.
fn check(out: &Output, case: &Value, what: &str) {
    let argmax = ids(&case["argmax_per_position"]);
    let logits: Vec<Vec<f32>> = case["logits"].as_array().unwrap().iter().map(floats).collect();
    let len = argmax.len();
    // Without prompt log-probabilities, the last position only.
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

#[test]
fn prompts_with_images_give_transformers_logits_and_greedy_tokens() {
    for (dir, reference) in fixtures() {
        for (c, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
            let mut r = request(1, case);
            if dir.ends_with("tiny-gemma4-vl-bidir") && c == 2 {
                // Its 90 image tokens run in one step, more logits rows than a step computes:
                // the last position's and the greedy tokens are checked.
                r.prompt_logprobs = None;
            }
            let out = run(&mut engine(&dir, &options()), vec![r]).remove(0);
            check(&out, case, &format!("{}: case {c}", dir.display()));
        }
    }
}

#[test]
fn small_steps_and_a_batch_of_both_cases_give_the_same_answers() {
    for (dir, reference) in fixtures() {
        let cases = reference["cases"].as_array().unwrap();
        // Steps of at most 12 tokens: an image of the bidirectional fixture (at most 12 tokens
        // in the first two cases) runs in one step, the causal fixture's are cut anywhere.
        let opts = EngineOptions { max_batch_tokens: 12, ..options() };
        let mut e = engine(&dir, &opts);
        let outs = run(&mut e, vec![request(1, &cases[0]), request(2, &cases[1])]);
        for (c, out) in outs.iter().enumerate() {
            check(out, &cases[c], &format!("{}: steps of 12, case {c} beside another", dir.display()));
        }
        // The large image (90 tokens) does not fit a step of 12 where its tokens see each other.
        let got = engine(&dir, &opts).add_request(request(1, &cases[2]));
        if dir.ends_with("tiny-gemma4-vl-bidir") {
            let err = got.unwrap_err();
            assert!(err.to_string().contains("raise --max-batch-tokens to at least 90"), "{err}");
        } else {
            got.expect("a causal image is cut into steps like text");
        }
    }
}
