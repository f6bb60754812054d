//! Qwen3.5's vision tower and images in the prompt, against what transformers computes on the
//! tiny vision-language fixtures (`tests/fixtures/make_vision_model_reference.py`: seeded
//! `pixel_values`, float32 compute, eager attention).

mod support;

use std::path::PathBuf;

use std::sync::Arc;

use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::serving::{ImageInput, Request};
use kylin_engine::vision::{PatchGrid, VisionTower};
use kylin_engine::{EventKind, Serving};
use kylin_kernels::ThreadPool;
use serde_json::Value;
use support::{Output, engine, f32_options, floats, ids, log_softmax, repo};

/// The two fixtures: the shared one (2 rotary frequencies) and ours rotating every section.
fn fixtures() -> [(PathBuf, Value); 2] {
    [
        ("testdata/families/fixtures/tiny-qwen3.5-vl", "tiny-qwen3.5-vl"),
        ("tests/fixtures/tiny-qwen3.5-vl-mrope", "tiny-qwen3.5-vl-mrope"),
    ]
    .map(|(dir, name)| {
        let path = repo().join(format!("tests/fixtures/vision_model/{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        (repo().join(dir), serde_json::from_str(&text).expect("the reference is JSON"))
    })
}

fn grid(image: &Value) -> PatchGrid {
    let g: Vec<usize> = image["grid_thw"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    PatchGrid { t: g[0], h: g[1], w: g[2] }
}

#[test]
fn the_vision_tower_gives_transformers_merged_rows() {
    let pool = ThreadPool::new(2);
    for (dir, reference) in fixtures() {
        let loaded = kylin_loader::load(&dir, &Default::default()).expect("the fixture loads");
        let vision = loaded.vision.as_ref().expect("the Qwen3.5 vision tower is bound");
        assert!(loaded.not_run.iter().all(|p| !p.part.contains("vision")), "the tower is run, not listed as not run");
        let tower = VisionTower::new(vision).expect("the tower binds");
        let mut checked = 0;
        for case in reference["cases"].as_array().unwrap() {
            for image in case["images"].as_array().unwrap() {
                let grid = grid(image);
                let got = tower.encode(&pool, &floats(&image["pixel_values"]), grid).expect("the image encodes");
                let want = floats(&image["merged"]);
                assert_eq!(got.len(), want.len(), "{}: {grid:?}", dir.display());
                let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                eprintln!("{}: image {grid:?}: max |diff| {diff:e}", dir.display());
                assert!(diff < 2e-5, "{}: image {grid:?}: max |diff| {diff}", dir.display());
                checked += 1;
            }
        }
        assert_eq!(checked, 3);
    }
}

#[test]
fn an_image_larger_than_a_unit_of_work_is_encoded_right_however_it_is_cut() {
    let pool = ThreadPool::new(2);
    for (dir, reference) in fixtures() {
        let loaded = kylin_loader::load(&dir, &Default::default()).unwrap();
        let tower = VisionTower::new(loaded.vision.as_ref().unwrap()).unwrap();
        // 288 patches: the projections and the MLP run in units of 256 rows, attention in
        // units of 256 queries.
        let image = &reference["large_image"];
        let (grid, pixels) = (grid(image), floats(&image["pixel_values"]));
        let whole = tower.encode(&pool, &pixels, grid).unwrap();
        let want = floats(&image["merged"]);
        let diff = whole.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert_eq!(whole.len(), want.len());
        assert!(diff < 2e-5, "{}: max |diff| {diff}", dir.display());
        // One unit per call, as a step beside running sequences takes them (256 rows, where
        // `encode` takes all 288 at once): the same bits.
        let mut encoding = tower.begin(&pool, &pixels, grid).unwrap();
        let mut calls = 0;
        let sliced = loop {
            calls += 1;
            if let Some(out) = tower.advance(&pool, &mut encoding, &mut 1, kylin_engine::vision::UNIT_ROWS) {
                break out;
            }
        };
        assert_eq!(sliced, whole);
        // Per block: two projection units, two query units per head, two MLP units.
        let c = tower.config();
        assert_eq!(calls, c.depth * (2 + 2 * c.heads + 2), "{}", dir.display());
    }
}

#[test]
fn a_grid_that_does_not_match_its_pixels_is_refused() {
    let (dir, _) = &fixtures()[0];
    let loaded = kylin_loader::load(dir, &Default::default()).unwrap();
    let tower = VisionTower::new(loaded.vision.as_ref().unwrap()).unwrap();
    let pool = ThreadPool::new(1);
    let per_patch = tower.config().patch_values();
    // Rows and columns must be multiples of the merge size (2), and the values must fill the grid.
    for (grid, values) in [
        (PatchGrid { t: 1, h: 3, w: 4 }, 12 * per_patch),
        (PatchGrid { t: 1, h: 4, w: 4 }, 16 * per_patch - 1),
        (PatchGrid { t: 0, h: 4, w: 4 }, 0),
        (PatchGrid { t: usize::MAX, h: 2, w: 2 }, 4 * per_patch),
    ] {
        let err = tower.encode(&pool, &vec![0.0; values], grid).unwrap_err();
        assert_eq!(err.code.as_str(), "INPUT_INVALID", "{grid:?}: {err}");
    }
}

/// A case's prompt and images as a request: greedy, 12 tokens, with the top-20 log-probabilities
/// of every prompt position and generated token.
fn request(id: u64, case: &Value) -> Request {
    let mut r = Request::new(id, ids(&case["input_ids"]), 12);
    r.ignore_eos = true;
    r.detokenize = false;
    r.logprobs = Some(20);
    r.prompt_logprobs = Some(20);
    r.images = case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|image| ImageInput::new(Arc::from(floats(&image["pixel_values"])), grid(image)))
        .collect();
    r
}

fn run(e: &mut BatchEngine, requests: Vec<Request>) -> Vec<Output> {
    support::run_requests(e, requests)
}

#[test]
fn prompts_with_images_give_transformers_logits_and_greedy_tokens() {
    for (dir, reference) in fixtures() {
        for (c, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
            let mut e = engine(&dir, &f32_options());
            let out = run(&mut e, vec![request(1, case)]).remove(0);
            let argmax = ids(&case["argmax_per_position"]);
            let logits: Vec<Vec<f32>> = case["logits"].as_array().unwrap().iter().map(floats).collect();
            let len = argmax.len();
            assert_eq!(out.prompt_top.len(), len - 1);
            // Position p's top-20 (reported with token p + 1; the last with the first new token):
            // the same argmax, and each log-probability within 1e-3 of transformers'.
            let mut worst = 0.0f64;
            for p in 0..len {
                let top = if p + 1 < len { &out.prompt_top[p] } else { &out.top[0] };
                assert_eq!(top[0].0, argmax[p], "{}: case {c}: argmax at position {p}", dir.display());
                let want = log_softmax(&logits[p]);
                for &(id, lp) in top {
                    worst = worst.max((want[id as usize] - lp as f64).abs());
                }
            }
            eprintln!("{}: case {c}: worst |log-probability diff| {worst:e}", dir.display());
            assert!(worst < 1e-3, "{}: case {c}: {worst}", dir.display());
            assert_eq!(out.ids, ids(&case["greedy_new_ids"]), "{}: case {c}: greedy tokens", dir.display());
        }
    }
}

#[test]
fn chunks_that_split_an_image_give_the_same_bits() {
    let (dir, reference) = &fixtures()[1];
    let case = &reference["cases"][1];
    let whole = run(&mut engine(dir, &f32_options()), vec![request(1, case)]);
    // Chunks of 5 tokens cut the 8 x 4 image (8 tokens) and the 2 x 10 one (5 tokens).
    let opts = EngineOptions { max_batch_tokens: 5, ..f32_options() };
    let chunked = run(&mut engine(dir, &opts), vec![request(1, case)]);
    assert_eq!(whole, chunked);
}

#[test]
fn the_prefix_cache_reuses_an_image_and_never_confuses_two() {
    let (dir, reference) = &fixtures()[1];
    let case = &reference["cases"][1];
    let opts = EngineOptions { block_size: Some(4), ..f32_options() };
    let mut e = engine(dir, &opts);
    // Prompt log-probabilities compute every position: these requests ask for none.
    let request = |id: u64, case: &Value| Request { prompt_logprobs: None, ..request(id, case) };
    let first = run(&mut e, vec![request(1, case)]).remove(0);
    assert_eq!(first.ids, ids(&case["greedy_new_ids"]));
    // The same prompt and images again: served from the cache, with the same answer.
    let mut again = run(&mut e, vec![request(2, case)]).remove(0);
    assert!(again.cached >= 16, "cached {}", again.cached);
    again.cached = first.cached;
    assert_eq!(again, first);
    // The same ids with another first image: nothing after the image's first token is reused,
    // and the answer changes.
    let mut other = request(3, case);
    let mut pixels = other.images[0].pixels.to_vec();
    pixels.iter_mut().for_each(|v| *v = -*v);
    other.images[0].pixels = Arc::from(pixels);
    let changed = run(&mut e, vec![other]).remove(0);
    // The first image starts at token 1 (after the vision start token): no whole block of 4 is
    // shared.
    assert_eq!(changed.cached, 0);
    assert_ne!(changed.top, first.top);
}

#[test]
fn images_that_do_not_fit_the_prompt_are_refused_with_the_reason() {
    let (dir, reference) = &fixtures()[0];
    let case = &reference["cases"][0];
    let mut e = engine(dir, &f32_options());
    let refused = |e: &mut BatchEngine, r: Request, needle: &str| {
        let err = e.add_request(r).unwrap_err();
        assert_eq!(err.code.as_str(), "INPUT_INVALID", "{err}");
        assert!(err.to_string().contains(needle), "{err}");
    };
    // A prompt with image tokens and no image is text: the placeholder is an ordinary id.
    e.add_request(Request { images: Vec::new(), ..request(1, case) }).unwrap();
    support::step_until_idle(&mut e, |_| {});
    // Two images for one run of image tokens.
    let mut two = request(2, case);
    two.images.push(two.images[0].clone());
    refused(&mut e, two, "1 run(s) of the image token 1000 for 2 image(s)");
    // A grid that becomes 8 tokens for a run of 6.
    let mut wrong = request(3, case);
    wrong.images[0] = ImageInput::new(Arc::from(vec![0.0; 32 * 96]), PatchGrid { t: 1, h: 8, w: 4 });
    refused(&mut e, wrong, "becomes 8 tokens, but its run of image tokens has 6");
    // A model without a vision tower takes no images.
    let text_model = repo().join("testdata/families/fixtures/tiny-qwen3.5");
    let mut text = engine(&text_model, &f32_options());
    refused(&mut text, request(4, case), "no vision tower");
}

#[test]
fn choices_over_a_prompt_with_images_share_it_and_give_the_same_tokens() {
    let (dir, reference) = &fixtures()[1];
    for case in reference["cases"].as_array().unwrap() {
        let plain = |id| Request { prompt_logprobs: None, ..request(id, case) };
        let want = ids(&case["greedy_new_ids"]);
        // Two choices share the prompt's blocks and images.
        let mut e = engine(dir, &f32_options());
        e.add_request(Request { n: 2, ..plain(1) }).unwrap();
        let mut choices = [Vec::new(), Vec::new()];
        support::step_until_idle(&mut e, |events| {
            for ev in events {
                if let EventKind::Token { id, .. } = ev.kind {
                    choices[ev.index].push(id);
                }
            }
        });
        assert_eq!(choices, [want.clone(), want]);
    }
}

/// The chat fixture (`tests/fixtures/make_vision_chat_fixture.py`): the tiny model with a
/// tokenizer, a chat template and a preprocessor configuration, and what transformers answers
/// to a chat with a real image.
fn chat_fixture() -> (PathBuf, Value) {
    let path = repo().join("tests/fixtures/vision_model/chat.json");
    let reference = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (repo().join("tests/fixtures/tiny-qwen3.5-vl-mrope"), reference)
}

#[test]
fn a_chat_with_an_image_file_gives_transformers_prompt_and_tokens() {
    let (dir, reference) = chat_fixture();
    let mut e = engine(&dir, &f32_options());
    let preparer = e.image_preparer().expect("the directory has a preprocessor_config.json");
    let png = std::fs::read(repo().join("tests/fixtures/vision_model/chat.png")).unwrap();
    let image = preparer.prepare(&png).expect("the PNG is prepared");
    // The patches transformers' image processor makes of the same file.
    let want = floats(&reference["pixel_values"]);
    let g = &reference["image_grid_thw"];
    assert_eq!([image.grid.t, image.grid.h, image.grid.w], [0, 1, 2].map(|i| g[i].as_u64().unwrap() as usize));
    let diff = image.pixels.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert_eq!(image.pixels.len(), want.len());
    assert!(diff < 1e-6, "pixel values differ by {diff}");
    // The chat template places one placeholder, expanded to the image's tokens.
    let question = reference["question"].as_str().unwrap();
    let messages =
        [serde_json::json!({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})];
    let text = e.render_chat(&messages, true, &Default::default()).unwrap();
    assert_eq!(text, reference["rendered"].as_str().unwrap());
    let prompt = preparer.expand(&e.tokenize(&text, false).unwrap(), std::slice::from_ref(&image)).unwrap();
    assert_eq!(prompt, ids(&reference["prompt_ids"]));
    let mut r = Request::new(1, prompt, 10);
    r.ignore_eos = true;
    r.logprobs = Some(1);
    r.images = vec![image.clone()];
    let out = run(&mut e, vec![r]).remove(0);
    assert_eq!(out.ids, ids(&reference["greedy_new_ids"]));
    // A placeholder without its image, or an image without its placeholder, is refused.
    let one = e.tokenize(&text, false).unwrap();
    let err = preparer.expand(&one, &[image.clone(), image]).unwrap_err();
    assert!(err.to_string().contains("1 image placeholder token(s) (1000) for 2 image(s)"), "{err}");
}

#[test]
fn image_files_that_cannot_be_used_are_refused_with_their_code() {
    let (dir, _) = chat_fixture();
    let e = engine(&dir, &f32_options());
    let preparer = e.image_preparer().unwrap();
    let gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;".to_vec();
    let mut truncated = std::fs::read(repo().join("tests/fixtures/vision_model/chat.png")).unwrap();
    truncated.truncate(truncated.len() / 2);
    for (bytes, code) in [(gif, "IMAGE_FORMAT"), (truncated, "IMAGE_DECODE"), (b"hello".to_vec(), "IMAGE_FORMAT")] {
        let err = preparer.prepare(&bytes).unwrap_err();
        assert_eq!(err.code.as_str(), "IMAGE_INVALID", "{err}");
        assert!(err.message.starts_with(code), "{err}");
    }
    // The shared fixture has no preprocessor configuration: it takes images as patches only.
    let (shared, _) = &fixtures()[0];
    assert!(engine(shared, &f32_options()).image_preparer().is_none());
}

#[test]
fn a_request_cancelled_while_its_images_are_encoded_ends_and_frees_everything() {
    let (dir, reference) = &fixtures()[1];
    let case = &reference["cases"][1];
    let mut e = engine(dir, &f32_options());
    let r = Request { prompt_logprobs: None, ..request(1, case) };
    let cancel = r.cancel.clone();
    e.add_request(r).unwrap();
    cancel.cancel();
    let mut reasons = Vec::new();
    support::step_until_idle(&mut e, |events| {
        for ev in events {
            if let EventKind::Finished { reason, .. } = ev.kind {
                reasons.push(reason);
            }
        }
    });
    assert_eq!(reasons, [kylin_engine::StopReason::Cancelled]);
    // The engine goes on: the same request again is answered in full.
    let out = run(&mut e, vec![Request { prompt_logprobs: None, ..request(2, case) }]).remove(0);
    assert_eq!(out.ids, ids(&case["greedy_new_ids"]));
}
