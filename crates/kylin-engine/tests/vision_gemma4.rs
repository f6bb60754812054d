//! Gemma 4's vision tower (`Gemma4VisionModel` and `embed_vision`) and images in its prompts,
//! against what transformers computes on tiny checkpoints
//! (`tests/fixtures/make_gemma4_vision_reference.py`: seeded patch rows in the image
//! processor's layout, float32 compute, eager attention, `mm_token_type_ids` marking the image
//! tokens).

mod support;

use std::path::PathBuf;
use std::sync::Arc;

use kylin_engine::Serving;
use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::serving::{ImageInput, Request};
use kylin_engine::vision::{PatchGrid, VisionTower};
use kylin_kernels::ThreadPool;
use kylin_loader::vision::ImageAttention;
use serde_json::Value;
use support::{Output, check_case, engine, f32_options, floats, ids, repo};

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
    ImageInput::new(Arc::from(floats(&image["pixel_values"])), PatchGrid { t: 1, h, w })
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
            let out = run(&mut engine(&dir, &f32_options()), vec![r]).remove(0);
            check_case(&out, case, &format!("{}: case {c}", dir.display()));
        }
    }
}

#[test]
fn small_steps_and_a_batch_of_both_cases_give_the_same_answers() {
    for (dir, reference) in fixtures() {
        let cases = reference["cases"].as_array().unwrap();
        // Steps of at most 12 tokens: an image of the bidirectional fixture (at most 12 tokens
        // in the first two cases) runs in one step, the causal fixture's are cut anywhere.
        let opts = EngineOptions { max_batch_tokens: 12, ..f32_options() };
        let mut e = engine(&dir, &opts);
        let outs = run(&mut e, vec![request(1, &cases[0]), request(2, &cases[1])]);
        for (c, out) in outs.iter().enumerate() {
            check_case(out, &cases[c], &format!("{}: steps of 12, case {c} beside another", dir.display()));
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

/// The bidirectional fixture with a tokenizer, a chat template and Gemma 4's image processor
/// configuration, and what transformers answers to a chat with a real image
/// (`tests/fixtures/make_gemma4_vision_reference.py`).
fn chat_fixture() -> (PathBuf, Value) {
    let path = repo().join("tests/fixtures/vision_model/chat_gemma4.json");
    let reference = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (repo().join("tests/fixtures/tiny-gemma4-vl-bidir"), reference)
}

#[test]
fn a_chat_with_an_image_file_gives_transformers_prompt_and_tokens() {
    let (dir, reference) = chat_fixture();
    let mut e = engine(&dir, &f32_options());
    let preparer = e.image_preparer().expect("the directory has a preprocessor_config.json");
    let png = std::fs::read(repo().join("tests/fixtures/vision_model/chat.png")).unwrap();
    let image = preparer.prepare(&png).expect("the PNG is prepared");
    // The 61 x 45 photograph resized within 70 tokens of 2 x 2 patches of 4 pixels (72 x 56)
    // as transformers' image processor does it.
    let want = floats(&reference["pixel_values"]);
    assert_eq!(image.grid, PatchGrid { t: 1, h: 14, w: 18 });
    assert_eq!(preparer.tokens(&image), reference["image_tokens"].as_u64().unwrap() as usize);
    assert_eq!(image.pixels.len(), want.len());
    let diff = image.pixels.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff < 1e-6, "pixel values differ by {diff}");
    // The template's <|image|> is tokenized as one token, then expanded to <|image>, the
    // image's tokens and <image|>, which is what transformers gets from expanding the text.
    let question = reference["question"].as_str().unwrap();
    let messages =
        [serde_json::json!({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})];
    let text = e.render_chat(&messages, true, &Default::default()).unwrap();
    assert_eq!(text, reference["rendered"].as_str().unwrap());
    let tokens = e.tokenize(&preparer.expand_text(&text, std::slice::from_ref(&image)), false).unwrap();
    let prompt = preparer.expand(&tokens, std::slice::from_ref(&image)).unwrap();
    assert_eq!(prompt, ids(&reference["prompt_ids"]));
    let mut r = Request::new(1, prompt.clone(), 10);
    r.ignore_eos = true;
    r.logprobs = Some(1);
    r.images = vec![image.clone()];
    let out = run(&mut e, vec![r]).remove(0);
    assert_eq!(out.ids, ids(&reference["greedy_new_ids"]));
    // An expanded prompt is kept; a placeholder beside an expanded image, or a count that
    // differs from the images', is refused.
    assert_eq!(preparer.expand(&prompt, std::slice::from_ref(&image)).unwrap(), prompt);
    let mixed = [&prompt[..], &[1000, 5]].concat();
    let err = preparer.expand(&mixed, &[image.clone(), image.clone()]).unwrap_err();
    assert!(err.to_string().contains("1 expanded image(s)") && err.to_string().contains("1 placeholder(s)"), "{err}");
    let err = preparer.expand(&[2, 1000, 9], &[image.clone(), image]).unwrap_err();
    assert!(err.to_string().contains("1 image placeholder token(s) (1000) for 2 image(s)"), "{err}");
}

#[test]
fn the_prefix_cache_reuses_an_image_and_its_answer_is_unchanged() {
    for (dir, reference) in fixtures() {
        let case = &reference["cases"][0];
        let opts = EngineOptions { block_size: Some(4), ..f32_options() };
        let mut e = engine(&dir, &opts);
        let plain = |id| Request { prompt_logprobs: None, ..request(id, case) };
        let first = run(&mut e, vec![plain(1)]).remove(0);
        assert_eq!(first.ids, ids(&case["greedy_new_ids"]));
        // Again: the blocks through the image (tokens 5 to 18) come from the cache.
        let mut again = run(&mut e, vec![plain(2)]).remove(0);
        assert!(again.cached >= 20, "{}: cached {}", dir.display(), again.cached);
        again.cached = first.cached;
        assert_eq!(again, first, "{}", dir.display());
    }
}
