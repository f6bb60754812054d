//! Kylin's image preprocessing against transformers' `Qwen2VLImageProcessorPil` and Pillow on
//! the fixtures of tests/fixtures/vision: decoding, Pillow's resampling, `smart_resize`, and
//! `pixel_values` / `image_grid_thw` of every reference image.

mod support;

use kylin_vision::{ImageLimits, QwenImageProcessor, ResampleFilter, RgbImage, decode_image, resize, smart_resize};
use serde_json::Value;
use support::{manifest, pillow_rgb_file, read, read_f32, usize_of};

/// The tolerance on normalised values: float rounding only. The resize is Pillow's to the bit,
/// so any larger difference is a bug, not a reason to widen this.
const TOLERANCE: f32 = 1e-5;

fn images() -> Vec<Value> {
    manifest()["images"].as_array().expect("images").clone()
}

/// What transformers' `convert_to_rgb` made of the case's file in Pillow.
fn pillow_rgb(case: &Value) -> RgbImage {
    pillow_rgb_file(case, &format!("{}.rgb", case["name"].as_str().unwrap()))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn pixel_values_match_transformers_on_pillows_decoding() {
    for case in images() {
        let name = case["name"].as_str().unwrap();
        let processor = QwenImageProcessor::from_json(&case["config"].to_string()).expect("config");
        let processed = processor.process(&pillow_rgb(&case)).expect("process");
        let expected = read_f32(&format!("{name}.pixel_values.bin"));
        let grid: Vec<usize> = case["grid_thw"].as_array().unwrap().iter().map(usize_of).collect();
        assert_eq!(processed.grid_thw.to_vec(), grid, "{name}: grid_thw");
        assert_eq!(processed.patch_dim, usize_of(&case["cols"]), "{name}: columns");
        assert_eq!(processed.num_patches(), usize_of(&case["rows"]), "{name}: rows");
        let diff = max_abs_diff(&processed.pixel_values, &expected);
        println!("{name}: grid {grid:?}, max |kylin - transformers| = {diff:e}");
        assert!(diff <= TOLERANCE, "{name}: pixel_values differ from transformers' by {diff}");
    }
}

/// Every file, JPEG included (libjpeg-turbo's decoder, as Pillow's), PNG and WebP (lossless and
/// lossy: image-webp decodes as libwebp does), decodes to Pillow's bytes, so the whole path from
/// the file is transformers' to float rounding.
#[test]
fn every_file_decodes_as_pillow_and_processes_end_to_end() {
    let mut jpegs = 0;
    for case in images() {
        let (name, file) = (case["name"].as_str().unwrap(), case["file"].as_str().unwrap());
        let decoded = decode_image(&read(file), &ImageLimits::default()).expect("decode");
        let expected = pillow_rgb(&case);
        assert_eq!(decoded.dimensions(), expected.dimensions(), "{name}");
        let differing = decoded.as_raw().iter().zip(expected.as_raw()).filter(|(a, b)| a != b).count();
        assert_eq!(differing, 0, "{name} ({}): {differing} bytes differ from Pillow's RGB", case["mode"]);

        let processor = QwenImageProcessor::from_json(&case["config"].to_string()).expect("config");
        let processed = processor.process(&decoded).expect("process");
        let diff = max_abs_diff(&processed.pixel_values, &read_f32(&format!("{name}.pixel_values.bin")));
        println!("{name} ({file}): end to end, max |kylin - transformers| = {diff:e}");
        assert!(diff <= TOLERANCE, "{name}: end to end, pixel_values differ by {diff}");
        jpegs += usize::from(file.ends_with(".jpg"));
    }
    assert!(jpegs >= 1, "no JPEG case");
}

#[test]
fn resize_matches_pillow_bit_for_bit() {
    let mut failures = Vec::new();
    for case in manifest()["resample"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let size = |key: &str| -> (u32, u32) {
            let v = case[key].as_array().unwrap();
            (usize_of(&v[0]) as u32, usize_of(&v[1]) as u32)
        };
        let ((in_w, in_h), (out_w, out_h)) = (size("in"), size("out"));
        let filter = match case["filter"].as_str().unwrap() {
            "bicubic" => ResampleFilter::Bicubic,
            "bilinear" => ResampleFilter::Bilinear,
            other => panic!("unknown filter {other}"),
        };
        let bytes = read(&format!("resample/{name}.bin"));
        let input_len = (in_w * in_h * 3) as usize;
        let input = RgbImage::from_raw(in_w, in_h, bytes[..input_len].to_vec()).unwrap();
        let expected = &bytes[input_len..];
        let got = resize(&input, out_w, out_h, filter);
        let differing = got.as_raw().iter().zip(expected).filter(|(a, b)| a != b).count();
        assert_eq!(got.as_raw().len(), expected.len(), "{name}");
        if differing != 0 {
            failures.push(format!("{name}: {differing} bytes differ from Pillow's"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn smart_resize_matches_transformers() {
    for case in manifest()["smart_resize"].as_array().unwrap() {
        let (h, w, factor) = (usize_of(&case["height"]), usize_of(&case["width"]), usize_of(&case["factor"]));
        let (lo, hi) = (case["min_pixels"].as_u64().unwrap(), case["max_pixels"].as_u64().unwrap());
        let got = smart_resize(h, w, factor, lo, hi);
        match &case["expected"] {
            Value::Array(size) => {
                assert_eq!(got, Ok((usize_of(&size[0]), usize_of(&size[1]))), "{h}x{w} factor {factor} [{lo}, {hi}]")
            }
            Value::String(message) => {
                let error = got.expect_err(message);
                assert_eq!(error.code(), "IMAGE_SHAPE", "{h}x{w}: {error}");
                assert!(message.contains("aspect ratio"), "transformers refused with {message}");
            }
            other => panic!("unexpected {other}"),
        }
    }
}

#[test]
fn tiny_and_extreme_images_take_the_right_branch() {
    let processor = QwenImageProcessor::from_json(
        r#"{"patch_size": 16, "merge_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}"#,
    )
    .unwrap();
    // A single pixel is upscaled to the smallest allowed grid: 256 x 256 pixels.
    let one = processor.process(&RgbImage::from_pixel(1, 1, image::Rgb([1, 2, 3]))).unwrap();
    assert_eq!(one.grid_thw, [1, 16, 16]);
    assert_eq!(one.num_image_tokens(), 64);
    // A 1 x 200 strip is allowed, a 1 x 201 strip refused.
    assert!(processor.process(&RgbImage::new(200, 1)).is_ok());
    let error = processor.process(&RgbImage::new(201, 1)).unwrap_err();
    assert_eq!(error.code(), "IMAGE_SHAPE");
    assert!(error.to_string().contains("201x1"), "{error}");
}

#[test]
fn num_image_tokens_is_patches_over_merge_squared() {
    for case in images() {
        let processor = QwenImageProcessor::from_json(&case["config"].to_string()).unwrap();
        let processed = processor.process(&pillow_rgb(&case)).unwrap();
        let [t, h, w] = processed.grid_thw;
        let m = processor.merge_size;
        assert_eq!(processed.num_image_tokens(), t * h * w / (m * m));
        assert_eq!(processed.pixel_values.len(), processed.num_patches() * processed.patch_dim);
    }
}
