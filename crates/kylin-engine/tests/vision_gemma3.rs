//! Gemma 3's vision tower (SigLIP and the multimodal projector) and images in its prompts,
//! against what transformers computes on tiny checkpoints
//! (`tests/fixtures/make_gemma3_vision_reference.py`: seeded channel-first `pixel_values`,
//! float32 compute, eager attention, `token_type_ids` so that an image's tokens see each other).

mod support;

use std::path::PathBuf;
use std::sync::Arc;

use kylin_engine::Serving;
use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::serving::{ImageInput, Request};
use kylin_engine::vision::{PatchGrid, VisionTower, siglip_patches};
use kylin_kernels::ThreadPool;
use serde_json::Value;
use support::{Output, check_case, engine, f32_options, floats, ids, repo};

/// The shared fixture (2 x 2 patches, no pooling, SigLIP's pooling head present) and ours
/// (6 x 6 patches pooled 2 x 2, a sliding window shorter than an image).
fn fixtures() -> [(PathBuf, Value); 2] {
    [
        ("tests/fixtures/families/fixtures/tiny-gemma3-vl", "tiny-gemma3-vl"),
        ("tests/fixtures/tiny-gemma3-vl-pooled", "tiny-gemma3-vl-pooled"),
    ]
    .map(|(dir, name)| {
        let path = repo().join(format!("tests/fixtures/vision_model/{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        (repo().join(dir), serde_json::from_str(&text).expect("the reference is JSON"))
    })
}

/// A reference image as the engine takes it: patch rows and the patch grid.
fn image_input(image: &Value, patch: usize) -> ImageInput {
    let size = image["size"].as_u64().unwrap() as usize;
    let pixels = siglip_patches(&floats(&image["pixel_values"]), size, patch).expect("a square channel-first image");
    ImageInput::new(Arc::from(pixels), PatchGrid { t: 1, h: size / patch, w: size / patch })
}

#[test]
fn the_tower_and_projector_give_transformers_rows() {
    let pool = ThreadPool::new(2);
    for (dir, reference) in fixtures() {
        let loaded = kylin_loader::load(&dir, &Default::default()).expect("the fixture loads");
        let vision = loaded.vision.as_ref().expect("Gemma 3's vision tower is bound");
        assert!(loaded.unused_tensors.is_empty(), "{}: unused {:?}", dir.display(), loaded.unused_tensors);
        // SigLIP's pooling head, where the checkpoint has one, is listed as not run.
        let head = loaded.not_run.iter().find(|p| p.part.contains("pooling head"));
        assert_eq!(head.is_some(), dir.ends_with("tiny-gemma3-vl"), "{}: {:?}", dir.display(), loaded.not_run);
        let tower = VisionTower::new(vision).expect("the tower binds");
        let mut checked = 0;
        for case in reference["cases"].as_array().unwrap() {
            for image in case["images"].as_array().unwrap() {
                let input = image_input(image, vision.config.patch_size);
                let got = tower.encode(&pool, &input.pixels, input.grid).expect("the image encodes");
                let want = floats(&image["projected"]);
                assert_eq!(got.len(), want.len(), "{}", dir.display());
                let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                eprintln!("{}: max |diff| {diff:e}", dir.display());
                assert!(diff < 2e-5, "{}: max |diff| {diff}", dir.display());
                checked += 1;
            }
        }
        assert_eq!(checked, 3);
    }
}

#[test]
fn an_image_that_is_not_the_towers_square_is_refused() {
    let (dir, _) = &fixtures()[1];
    let loaded = kylin_loader::load(dir, &Default::default()).unwrap();
    let tower = VisionTower::new(loaded.vision.as_ref().unwrap()).unwrap();
    let per_patch = tower.config().patch_values();
    for grid in [PatchGrid { t: 1, h: 6, w: 4 }, PatchGrid { t: 2, h: 6, w: 6 }, PatchGrid { t: 1, h: 8, w: 8 }] {
        let err = tower.encode(&ThreadPool::new(1), &vec![0.0; grid.patches() * per_patch], grid).unwrap_err();
        assert_eq!(err.code.as_str(), "INPUT_INVALID", "{grid:?}: {err}");
        assert!(err.to_string().contains("84 x 84"), "{err}");
    }
}

fn request(id: u64, case: &Value, patch: usize) -> Request {
    let mut r = Request::new(id, ids(&case["input_ids"]), 12);
    r.ignore_eos = true;
    r.detokenize = false;
    r.logprobs = Some(20);
    r.prompt_logprobs = Some(20);
    r.images = case["images"].as_array().unwrap().iter().map(|i| image_input(i, patch)).collect();
    r
}

fn run(e: &mut BatchEngine, requests: Vec<Request>) -> Vec<Output> {
    support::run_requests(e, requests)
}

#[test]
fn prompts_with_images_give_transformers_logits_and_greedy_tokens() {
    for (dir, reference) in fixtures() {
        let patch = kylin_loader::load(&dir, &Default::default()).unwrap().vision.unwrap().config.patch_size;
        for (c, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
            let out = run(&mut engine(&dir, &f32_options()), vec![request(1, case, patch)]).remove(0);
            check_case(&out, case, &format!("{}: case {c}", dir.display()));
        }
    }
}

#[test]
fn a_step_never_ends_inside_an_image_so_small_chunks_give_the_same_answer() {
    let (dir, reference) = &fixtures()[1];
    for (c, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        // Chunks of at most 10 tokens: each image (9 tokens) is computed in one step, the text
        // around it in the steps before and after.
        let opts = EngineOptions { max_batch_tokens: 10, ..f32_options() };
        let out = run(&mut engine(dir, &opts), vec![request(1, case, 14)]).remove(0);
        check_case(&out, case, &format!("chunks of 10: case {c}"));
    }
    // A step shorter than an image cannot hold it: refused with what to change.
    let opts = EngineOptions { max_batch_tokens: 8, ..f32_options() };
    let err = engine(dir, &opts).add_request(request(1, &reference["cases"][0], 14)).unwrap_err();
    assert_eq!(err.code.as_str(), "INPUT_INVALID");
    assert!(err.to_string().contains("raise --max-batch-tokens to at least 9"), "{err}");
}

#[test]
fn the_prefix_cache_reuses_an_image_and_its_answer_is_unchanged() {
    let (dir, reference) = &fixtures()[1];
    let case = &reference["cases"][0];
    let opts = EngineOptions { block_size: Some(4), ..f32_options() };
    let mut e = engine(dir, &opts);
    let plain = |id| Request { prompt_logprobs: None, ..request(id, case, 14) };
    let first = run(&mut e, vec![plain(1)]).remove(0);
    assert_eq!(first.ids, ids(&case["greedy_new_ids"]));
    // Again: the blocks through the image come from the cache (a hit may end inside the
    // image: its cached tokens saw the whole image when they were computed).
    let mut again = run(&mut e, vec![plain(2)]).remove(0);
    assert!(again.cached >= 12, "cached {}", again.cached);
    again.cached = first.cached;
    assert_eq!(again, first);
}

/// The pooled fixture with a tokenizer, a chat template and Gemma 3's image processor
/// configuration, and what transformers answers to a chat with a real image
/// (`tests/fixtures/make_gemma3_vision_reference.py`).
fn chat_fixture() -> (PathBuf, Value) {
    let path = repo().join("tests/fixtures/vision_model/chat_gemma3.json");
    let reference = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (repo().join("tests/fixtures/tiny-gemma3-vl-pooled"), reference)
}

#[test]
fn a_chat_with_an_image_file_gives_transformers_prompt_and_tokens() {
    let (dir, reference) = chat_fixture();
    let mut e = engine(&dir, &f32_options());
    let preparer = e.image_preparer().expect("the directory has a preprocessor_config.json");
    let png = std::fs::read(repo().join("tests/fixtures/vision_model/chat.png")).unwrap();
    let image = preparer.prepare(&png).expect("the PNG is prepared");
    // The 61 x 45 photograph resized to 84 x 84 as transformers' image processor does it.
    let want = siglip_patches(&floats(&reference["pixel_values"]), 84, 14).unwrap();
    assert_eq!(image.grid, PatchGrid { t: 1, h: 6, w: 6 });
    assert_eq!(image.pixels.len(), want.len());
    let diff = image.pixels.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff < 1e-6, "pixel values differ by {diff}");
    // The template's <start_of_image> becomes the image's sequence in the text, whose newlines
    // merge with the template's ("user\n" + "\n\n" is one token of three newlines).
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
    // A prompt given as ids with a bare <start_of_image> gets the image's tokens after it.
    let expanded = preparer.expand(&[2, 7, 1000, 9], std::slice::from_ref(&image)).unwrap();
    assert_eq!(expanded, [&[2, 7, 1000][..], &[1002; 9], &[1001, 9]].concat());
    // As many images as markers, or refused.
    let err = preparer.expand(&[2, 1000, 9], &[image.clone(), image.clone()]).unwrap_err();
    assert!(err.to_string().contains("1 image placeholder token(s) (1000) for 2 image(s)"), "{err}");
    let err = preparer.expand(&prompt, &[image.clone(), image]).unwrap_err();
    assert!(err.to_string().contains("1 run(s) of image tokens (1002) for 2 image(s)"), "{err}");
}

#[test]
fn pan_and_scan_gives_transformers_prompt_and_tokens() {
    use kylin_engine::vision::ImageOptions;
    let (dir, reference) = chat_fixture();
    let reference = &reference["pan_and_scan"];
    let mut e = engine(&dir, &f32_options());
    let preparer = e.image_preparer().unwrap();
    let png = std::fs::read(repo().join("tests/fixtures/vision_model/wide.png")).unwrap();
    // Off by default, as Gemma3Processor calls its image processor.
    assert_eq!(preparer.prepare_all(&png, &ImageOptions::default()).unwrap().len(), 1);
    let on = ImageOptions { do_pan_and_scan: Some(true), ..Default::default() };
    let images = preparer.prepare_all(&png, &on).unwrap();
    // The 520 x 260 picture, then its two 260 x 260 crops, each resized to 84 x 84.
    assert_eq!(images.len(), 3);
    assert_eq!(images[0].crops, reference["num_crops"].as_u64().unwrap() as usize);
    assert!(images[1..].iter().all(|c| c.crops == 0 && c.grid == PatchGrid { t: 1, h: 6, w: 6 }));
    let messages = [serde_json::json!({"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is in this picture?"}]})];
    let text = e.render_chat(&messages, true, &Default::default()).unwrap();
    let expanded = preparer.expand_text(&text, &images);
    assert!(expanded.contains("Here is the original image \n\n<start_of_image>"), "{expanded}");
    let prompt = preparer.expand(&e.tokenize(&expanded, false).unwrap(), &images).unwrap();
    assert_eq!(prompt, ids(&reference["prompt_ids"]));
    let mut r = Request::new(1, prompt, 10);
    r.ignore_eos = true;
    r.detokenize = false;
    r.logprobs = Some(1);
    r.images = images.clone();
    let out = run(&mut e, vec![r]).remove(0);
    assert_eq!(out.ids, ids(&reference["greedy_new_ids"]));
    // As token ids, the sentence around the crops cannot be written: refused.
    let err = preparer.expand(&[2, 1000, 9], &images).unwrap_err();
    assert!(err.to_string().contains("needs a text or chat prompt"), "{err}");
    // Other processors do not read it.
    let gemma4 = engine(&repo().join("tests/fixtures/tiny-gemma4-vl-bidir"), &f32_options()).image_preparer().unwrap();
    let err = gemma4.with_options(&on).unwrap_err();
    assert!(err.to_string().contains("do_pan_and_scan: Gemma 4's image processor does not read it"), "{err}");
}
