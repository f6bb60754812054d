//! Kylin's Gemma 4 image processing against transformers' `Gemma4ImageProcessorPil` and
//! `Gemma4Processor` on the fixtures of tests/fixtures/vision/gemma4: the real patches of every
//! reference image (all of them, or a sample and a checksum of all), the patch grid and soft
//! tokens, the cases without resizing, the resize geometry on many sizes and configs, and the
//! text of an image.

mod support;

use kylin_vision::{Gemma4ImageProcessor, Gemma4Processed, ImageLimits, RgbImage, decode_image, gemma4_image_sequence};
use serde_json::Value;
use support::{pillow_rgb_file, read, read_f32, usize_of};

/// The tolerance on values: none beyond float rounding. The resize is Pillow's to the bit and
/// the arithmetic NumPy's, so the values are expected equal; any difference is a bug.
const TOLERANCE: f32 = 1e-6;

fn manifest() -> Value {
    serde_json::from_slice(&read("gemma4/manifest.json")).expect("gemma4/manifest.json is JSON")
}

fn cases() -> Vec<Value> {
    manifest()["images"].as_array().expect("images").clone()
}

fn processor(config: &Value) -> Gemma4ImageProcessor {
    Gemma4ImageProcessor::from_json(&config.to_string()).expect("config")
}

/// What transformers' `convert_to_rgb` made of the case's file in Pillow.
fn pillow_rgb(case: &Value) -> RgbImage {
    pillow_rgb_file(case, case["rgb"].as_str().unwrap())
}

/// The checksum of the fixture script: the sum of `bits(value_i) * (i + 1)` modulo 2^64.
fn checksum(values: &[f32]) -> String {
    let sum = values
        .iter()
        .enumerate()
        .fold(0u64, |sum, (i, v)| sum.wrapping_add(u64::from(v.to_bits()).wrapping_mul(i as u64 + 1)));
    format!("{sum:016x}")
}

/// Checks the grid, the soft tokens and the stored patches, and returns the largest difference
/// from transformers' values.
fn compare(case: &Value, processed: &Gemma4Processed) -> f32 {
    let name = case["name"].as_str().unwrap();
    let (high, wide) = (usize_of(&case["patches_high"]), usize_of(&case["patches_wide"]));
    assert_eq!((processed.patches_high, processed.patches_wide), (high, wide), "{name}: the patch grid");
    assert_eq!(processed.num_patches(), high * wide, "{name}");
    assert_eq!(processed.patch_dim(), usize_of(&case["patch_dim"]), "{name}: patch_dim");
    assert_eq!(processed.num_soft_tokens(), usize_of(&case["num_soft_tokens"]), "{name}: num_soft_tokens");
    let dim = processed.patch_dim();
    assert_eq!(processed.pixel_values.len(), high * wide * dim, "{name}: length");
    let resized = case["resized"].as_array().unwrap();
    assert_eq!(
        (high * processed.patch_size, wide * processed.patch_size),
        (usize_of(&resized[0]), usize_of(&resized[1])),
        "{name}: the resized size"
    );
    let expected = read_f32(&format!("gemma4/{name}.pixel_values.bin"));
    let rows: Vec<usize> = match case["stored"].as_str().unwrap() {
        "all" => (0..high * wide).collect(),
        _ => case["sample"].as_array().unwrap().iter().map(usize_of).collect(),
    };
    assert_eq!(expected.len(), rows.len() * dim, "{name}: the .bin file holds the stored patches");
    let mut max = 0.0f32;
    for (&row, want) in rows.iter().zip(expected.chunks_exact(dim)) {
        let got = &processed.pixel_values[row * dim..(row + 1) * dim];
        let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        max = max.max(diff);
    }
    max
}

#[test]
fn pixel_values_match_transformers_on_pillows_decoding() {
    let cases = cases();
    assert!(cases.len() >= 15);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let processed = processor(&case["config"]).process(&pillow_rgb(case)).expect("process");
        let diff = compare(case, &processed);
        println!("{name}: {} soft tokens, max |kylin - transformers| = {diff:e}", processed.num_soft_tokens());
        assert!(diff <= TOLERANCE, "{name}: pixel_values differ from transformers' by {diff}");
        // Every value, not only the stored ones, to the bit.
        assert_eq!(checksum(&processed.pixel_values), case["checksum"].as_str().unwrap(), "{name}: checksum");
    }
}

/// transformers' `image_position_ids` of the real patches are (x, y), row-major; the fixture
/// script checked that, so `patch_position` is checked against the same rule.
#[test]
fn patch_positions_are_x_then_y_row_major() {
    for case in cases() {
        let processed = processor(&case["config"]).process(&pillow_rgb(&case)).expect("process");
        let wide = processed.patches_wide;
        for i in 0..processed.num_patches() {
            assert_eq!(processed.patch_position(i), (i % wide, i / wide));
        }
        let last = processed.num_patches() - 1;
        assert_eq!(processed.patch_position(last), (wide - 1, processed.patches_high - 1));
    }
}

/// Every file, JPEG included (libjpeg-turbo's decoder, as Pillow's), PNG and WebP, decodes to
/// Pillow's bytes, so the whole path from the file is transformers'.
#[test]
fn every_file_decodes_as_pillow_and_processes_end_to_end() {
    let (mut checked, mut jpegs) = (0, 0);
    for case in cases().iter() {
        let name = case["name"].as_str().unwrap();
        let decoded = decode_image(&read(case["file"].as_str().unwrap()), &ImageLimits::default()).expect("decode");
        let expected = pillow_rgb(case);
        assert_eq!(decoded.dimensions(), expected.dimensions(), "{name}");
        assert!(decoded.as_raw() == expected.as_raw(), "{name}: the decoded bytes differ from Pillow's");
        let processed = processor(&case["config"]).process(&decoded).expect("process");
        let diff = compare(case, &processed);
        assert!(diff <= TOLERANCE, "{name}: end to end, pixel_values differ by {diff}");
        assert_eq!(checksum(&processed.pixel_values), case["checksum"].as_str().unwrap(), "{name}: checksum");
        checked += 1;
        jpegs += usize::from(case["file"].as_str().unwrap().ends_with(".jpg"));
    }
    assert!(checked >= 15, "only {checked} cases");
    assert!(jpegs >= 2, "only {jpegs} JPEG cases");
}

#[test]
fn processor_and_size_functions_agree() {
    for case in cases() {
        let processor = processor(&case["config"]);
        let (height, width) = (usize_of(&case["height"]), usize_of(&case["width"]));
        let resized = case["resized"].as_array().unwrap();
        let resized = (usize_of(&resized[0]), usize_of(&resized[1]));
        if processor.do_resize {
            assert_eq!(processor.target_size(height, width).unwrap(), resized, "{}", case["name"]);
        } else {
            assert_eq!((height, width), resized, "{}", case["name"]);
        }
        assert_eq!(processor.num_soft_tokens(height, width).unwrap(), usize_of(&case["num_soft_tokens"]));
    }
}

/// Without resizing transformers cuts the image as it is, or fails; Kylin matches it where the
/// sides are multiples of `pooling_kernel_size * patch_size` and refuses every other size.
#[test]
fn without_resize_sizes_match_or_are_refused() {
    let cases = manifest()["no_resize"].as_array().unwrap().clone();
    assert_eq!(cases.len(), 4);
    let mut floored = 0;
    for case in &cases {
        let processor = processor(&case["config"]);
        let rgb = decode_image(&read(case["file"].as_str().unwrap()), &ImageLimits::default()).expect("decode");
        let (height, width) = (usize_of(&case["height"]), usize_of(&case["width"]));
        let side_mult = processor.patch_size * processor.pooling_kernel_size;
        let result = processor.process(&rgb);
        if height % side_mult == 0 && width % side_mult == 0 {
            let processed = result.expect("a multiple of the pooled patch is processed");
            assert_eq!(case["transformers_refuses"], false);
            assert_eq!(processed.num_patches(), usize_of(&case["num_patches"]));
            assert_eq!(processed.num_soft_tokens(), usize_of(&case["num_soft_tokens"]));
        } else {
            let error = result.expect_err("refused");
            assert_eq!(error.code(), "IMAGE_SHAPE", "{error}");
            assert!(error.message.contains("multiples of `pooling_kernel_size * patch_size`"), "{error}");
            assert_eq!(processor.num_soft_tokens(height, width).unwrap_err(), error);
            if case["transformers_refuses"] == false {
                // transformers floors the soft tokens of a grid the pooling does not divide.
                let patches = (height / processor.patch_size) * (width / processor.patch_size);
                assert_eq!(usize_of(&case["num_patches"]), patches);
                assert!(!patches.is_multiple_of(processor.pooling_kernel_size * processor.pooling_kernel_size));
                floored += 1;
            }
        }
    }
    assert_eq!(floored, 1);
}

#[test]
fn resize_geometry_matches_transformers() {
    let cases = manifest()["geometry"].as_array().unwrap().clone();
    assert!(cases.len() >= 400);
    let mut elongated = 0;
    for case in &cases {
        let processor = Gemma4ImageProcessor {
            patch_size: usize_of(&case["patch_size"]),
            pooling_kernel_size: usize_of(&case["pooling_kernel_size"]),
            max_soft_tokens: usize_of(&case["max_soft_tokens"]),
            ..Gemma4ImageProcessor::default()
        };
        let (height, width) = (usize_of(&case["height"]), usize_of(&case["width"]));
        let got = processor.target_size(height, width);
        if case["target"].is_null() {
            let error = got.expect_err("transformers refuses this size");
            assert_eq!(error.code(), "IMAGE_SHAPE", "{case}: {error}");
            continue;
        }
        let target = case["target"].as_array().unwrap();
        let (target_height, target_width) = (usize_of(&target[0]), usize_of(&target[1]));
        assert_eq!(got.unwrap(), (target_height, target_width), "{case}");
        assert_eq!(processor.num_soft_tokens(height, width).unwrap(), usize_of(&case["num_soft_tokens"]), "{case}");
        let side_mult = processor.patch_size * processor.pooling_kernel_size;
        elongated += usize::from(target_height == side_mult || target_width == side_mult);
    }
    assert!(elongated > 20, "only {elongated} cases reach a side of one pooled patch");
}

#[test]
fn image_sequence_matches_gemma4_processor() {
    let cases = manifest()["sequences"].as_array().unwrap().clone();
    assert_eq!(cases.len(), 4);
    for case in &cases {
        let text = gemma4_image_sequence(
            case["boi"].as_str().unwrap(),
            case["image_token"].as_str().unwrap(),
            case["eoi"].as_str().unwrap(),
            usize_of(&case["num_soft_tokens"]),
        );
        assert_eq!(text, case["text"].as_str().unwrap());
    }
    assert_eq!(gemma4_image_sequence("<boi>", "<img>", "<eoi>", 3), "<boi><img><img><img><eoi>");
    assert_eq!(gemma4_image_sequence("<boi>", "<img>", "<eoi>", 0), "<boi><eoi>");
}
