//! A Gemma 4 `preprocessor_config.json` as transformers' `Gemma4ImageProcessorPil` reads it:
//! defaults, nulls, the values transformers refuses, typed refusals of bad values, and the
//! refusals of images the processor cannot cut into patches.

mod support;

use kylin_vision::{
    GEMMA4_SUPPORTED_SOFT_TOKENS, Gemma4ImageProcessor, Gemma4Processed, ResampleFilter, RgbImage,
    gemma4_image_sequence,
};
use support::read;

fn refused(json: &str) -> String {
    let error = Gemma4ImageProcessor::from_json(json).expect_err(json);
    assert_eq!(error.code(), "PREPROCESSOR_CONFIG", "{json}: {error}");
    error.to_string()
}

/// A Gemma 4 checkpoint's preprocessor config (the image processor's part), with the keys
/// transformers' other backends write.
const GEMMA4_LIKE: &str = r#"{
  "do_convert_rgb": true,
  "do_normalize": false,
  "do_rescale": true,
  "do_resize": true,
  "image_mean": [0.0, 0.0, 0.0],
  "image_processor_type": "Gemma4ImageProcessor",
  "image_std": [1.0, 1.0, 1.0],
  "max_soft_tokens": 280,
  "patch_size": 16,
  "pooling_kernel_size": 3,
  "resample": 3,
  "rescale_factor": 0.00392156862745098,
  "size": null
}"#;

#[test]
fn missing_fields_take_transformers_defaults() {
    let processor = Gemma4ImageProcessor::from_json("{}").unwrap();
    assert_eq!(processor, Gemma4ImageProcessor::default());
    assert_eq!((processor.patch_size, processor.pooling_kernel_size, processor.max_soft_tokens), (16, 3, 280));
    assert_eq!(processor.resample, ResampleFilter::Bicubic);
    assert_eq!((processor.image_mean, processor.image_std), ([0.0; 3], [1.0; 3]));
    assert_eq!(processor.rescale_factor, 1.0 / 255.0);
    assert!(processor.do_resize && processor.do_rescale && processor.do_convert_rgb);
    assert!(!processor.do_normalize);
    assert_eq!(Gemma4ImageProcessor::from_json(GEMMA4_LIKE).unwrap(), processor);
}

#[test]
fn null_is_a_missing_value() {
    let json = r#"{"patch_size": null, "pooling_kernel_size": null, "max_soft_tokens": null, "do_resize": null,
                   "do_rescale": null, "rescale_factor": null, "do_normalize": null, "image_mean": null,
                   "image_std": null, "resample": null, "do_convert_rgb": null}"#;
    assert_eq!(Gemma4ImageProcessor::from_json(json).unwrap(), Gemma4ImageProcessor::default());
}

#[test]
fn every_field_is_read() {
    let json = r#"{"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70, "do_resize": false,
                   "do_rescale": false, "rescale_factor": 0.5, "do_normalize": true, "image_mean": 0.25,
                   "image_std": [0.2, 0.3, 0.4], "resample": 2, "do_convert_rgb": false}"#;
    let processor = Gemma4ImageProcessor::from_json(json).unwrap();
    assert_eq!(
        processor,
        Gemma4ImageProcessor {
            patch_size: 4,
            max_soft_tokens: 70,
            pooling_kernel_size: 2,
            resample: ResampleFilter::Bilinear,
            do_resize: false,
            do_rescale: false,
            rescale_factor: 0.5,
            do_normalize: true,
            image_mean: [0.25; 3],
            image_std: [0.2, 0.3, 0.4],
            do_convert_rgb: false,
        }
    );
    for tokens in GEMMA4_SUPPORTED_SOFT_TOKENS {
        let processor = Gemma4ImageProcessor::from_json(&format!(r#"{{"max_soft_tokens": {tokens}}}"#)).unwrap();
        assert_eq!(processor.max_soft_tokens, tokens);
    }
}

#[test]
fn bad_values_are_refused_with_the_field_named() {
    for (json, field) in [
        ("[]", "JSON object"),
        ("{", "valid JSON"),
        (r#"{"max_soft_tokens": 100}"#, "`max_soft_tokens` must be one of [70, 140, 280, 560, 1120], got 100"),
        (r#"{"max_soft_tokens": 0}"#, "max_soft_tokens"),
        (r#"{"max_soft_tokens": 2240}"#, "max_soft_tokens"),
        (r#"{"max_soft_tokens": -280}"#, "max_soft_tokens"),
        (r#"{"max_soft_tokens": 280.5}"#, "max_soft_tokens"),
        (r#"{"max_soft_tokens": "280"}"#, "max_soft_tokens"),
        (r#"{"patch_size": 0}"#, "patch_size"),
        (r#"{"patch_size": -16}"#, "patch_size"),
        (r#"{"patch_size": 16.5}"#, "patch_size"),
        (r#"{"patch_size": "16"}"#, "patch_size"),
        (r#"{"patch_size": 65}"#, "patch_size"),
        (r#"{"patch_size": [16]}"#, "patch_size"),
        (r#"{"pooling_kernel_size": 0}"#, "pooling_kernel_size"),
        (r#"{"pooling_kernel_size": 9}"#, "pooling_kernel_size"),
        (r#"{"pooling_kernel_size": "3"}"#, "pooling_kernel_size"),
        // 1120 * (8 * 64)^2 pixels: beyond the bound on the resized image.
        (r#"{"patch_size": 64, "pooling_kernel_size": 8, "max_soft_tokens": 1120}"#, "max_soft_tokens"),
        (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
        (r#"{"image_std": [1.0, 0.0, 1.0]}"#, "image_std"),
        (r#"{"image_std": "one"}"#, "image_std"),
        (r#"{"rescale_factor": 0}"#, "rescale_factor"),
        (r#"{"rescale_factor": "1/255"}"#, "rescale_factor"),
        (r#"{"do_resize": "yes"}"#, "do_resize"),
        (r#"{"do_rescale": 1}"#, "do_rescale"),
        (r#"{"do_normalize": "false"}"#, "do_normalize"),
        (r#"{"do_convert_rgb": 0}"#, "do_convert_rgb"),
        (r#"{"resample": 0}"#, "resample"),
        (r#"{"resample": "bicubic"}"#, "resample"),
    ] {
        let message = refused(json);
        assert!(message.contains(field), "{json}: {message}");
    }
}

/// transformers' own refusals of `max_soft_tokens`, from the fixture script.
#[test]
fn transformers_refusals_of_max_soft_tokens_are_kylins() {
    let manifest: serde_json::Value = serde_json::from_slice(&read("gemma4/manifest.json")).unwrap();
    let cases = manifest["refused_configs"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let message = refused(&case["config"].to_string());
        let got = case["config"]["max_soft_tokens"].to_string();
        assert!(case["error"].as_str().unwrap().contains(&format!("got {got}")), "{case}");
        assert!(message.contains("`max_soft_tokens`") && message.contains(&format!("got {got}")), "{message}");
    }
}

/// The fields are public: a value set by hand that `from_json` would refuse is refused on use,
/// not a panic (a division by zero) or a huge allocation.
#[test]
fn fields_set_by_hand_are_checked_on_use() {
    let image = RgbImage::new(10, 10);
    for (processor, field) in [
        (Gemma4ImageProcessor { patch_size: 0, ..Default::default() }, "patch_size"),
        (Gemma4ImageProcessor { pooling_kernel_size: 0, ..Default::default() }, "pooling_kernel_size"),
        (Gemma4ImageProcessor { max_soft_tokens: 100, ..Default::default() }, "max_soft_tokens"),
        (
            Gemma4ImageProcessor {
                patch_size: 64,
                pooling_kernel_size: 8,
                max_soft_tokens: 1120,
                ..Default::default()
            },
            "max_soft_tokens",
        ),
        (Gemma4ImageProcessor { patch_size: 0, do_resize: false, ..Default::default() }, "patch_size"),
    ] {
        for error in [
            processor.process(&image).unwrap_err(),
            processor.num_soft_tokens(10, 10).unwrap_err(),
            processor.target_size(10, 10).unwrap_err(),
        ] {
            assert_eq!(error.code(), "PREPROCESSOR_CONFIG", "{error}");
            assert!(error.message.contains(field), "{error}");
        }
    }
}

#[test]
fn empty_and_huge_images_are_refused() {
    let processor = Gemma4ImageProcessor::default();
    for image in [RgbImage::new(0, 5), RgbImage::new(5, 0)] {
        let error = processor.process(&image).unwrap_err();
        assert_eq!(error.code(), "IMAGE_SHAPE", "{error}");
    }
    assert_eq!(processor.target_size(0, 0).unwrap_err().code(), "IMAGE_SHAPE");
    let no_resize = Gemma4ImageProcessor { do_resize: false, ..Default::default() };
    assert_eq!(no_resize.num_soft_tokens(0, 48).unwrap_err().code(), "IMAGE_SHAPE");
    // Sides whose product Python computes exactly but f64 would not: refused, not guessed.
    let error = processor.target_size(1 << 30, 1 << 30).unwrap_err();
    assert_eq!(error.code(), "IMAGE_TOO_LARGE", "{error}");
    assert_eq!(processor.target_size(usize::MAX, usize::MAX).unwrap_err().code(), "IMAGE_TOO_LARGE");
}

#[test]
fn without_resize_a_side_off_the_pooled_grid_is_refused() {
    let processor = Gemma4ImageProcessor::from_json(r#"{"do_resize": false}"#).unwrap();
    // 48 = 3 * 16: 96 x 144 is 6 x 9 patches, 2 x 3 pooled, 6 soft tokens.
    let processed = processor.process(&RgbImage::new(144, 96)).unwrap();
    assert_eq!((processed.patches_high, processed.patches_wide, processed.num_soft_tokens()), (6, 9, 6));
    assert_eq!(processor.num_soft_tokens(96, 144).unwrap(), 6);
    // Beyond the budget without resizing: as transformers, all of the patches.
    assert_eq!(processor.num_soft_tokens(48 * 20, 48 * 20).unwrap(), 400);
    for (height, width) in [(96, 145), (97, 144), (32, 48), (16, 16)] {
        let error = processor.process(&RgbImage::new(width, height)).unwrap_err();
        assert_eq!(error.code(), "IMAGE_SHAPE", "{error}");
        assert!(error.message.contains("48"), "{error}");
        assert_eq!(processor.num_soft_tokens(height as usize, width as usize).unwrap_err(), error);
    }
}

#[test]
fn patches_are_row_major_with_the_channel_last() {
    // A 4 x 6 image in patches of 2 pooled 1 by 1 (no resizing): pixel (x, y) has red x,
    // green y and blue 7; the bytes stay bytes.
    let processor = Gemma4ImageProcessor::from_json(
        r#"{"patch_size": 2, "pooling_kernel_size": 1, "do_resize": false, "do_rescale": false}"#,
    )
    .unwrap();
    let image = RgbImage::from_fn(6, 4, |x, y| image::Rgb([x as u8, y as u8, 7]));
    let processed = processor.process(&image).unwrap();
    assert_eq!((processed.patches_high, processed.patches_wide), (2, 3));
    assert_eq!((processed.num_patches(), processed.patch_dim(), processed.num_soft_tokens()), (6, 12, 6));
    // Patch 4 is row 1, column 1: pixels x 2..4, y 2..4.
    let patch = &processed.pixel_values[4 * 12..5 * 12];
    assert_eq!(patch, [2., 2., 7., 3., 2., 7., 2., 3., 7., 3., 3., 7.]);
    assert_eq!(processed.patch_position(4), (1, 1));
    assert_eq!(processed.patch_position(5), (2, 1));
}

#[test]
fn the_default_config_gives_gemma4_budgets() {
    let processor = Gemma4ImageProcessor::default();
    // A square image: 16 x 16 patches of 48 pixels (768 x 768), 256 soft tokens.
    assert_eq!(processor.target_size(1000, 1000).unwrap(), (768, 768));
    assert_eq!(processor.num_soft_tokens(1000, 1000).unwrap(), 256);
    // One pixel high: one row of pooled patches, at most 280 of them.
    assert_eq!(processor.target_size(1, 100000).unwrap(), (48, 280 * 48));
    assert_eq!(processor.num_soft_tokens(1, 100000).unwrap(), 280);
    // Already the target size: not resized, so the pixels are the image's.
    let image = RgbImage::from_fn(912, 672, |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, 255]));
    assert_eq!(processor.target_size(672, 912).unwrap(), (672, 912));
    let processed: Gemma4Processed = processor.process(&image).unwrap();
    assert_eq!(processed.num_soft_tokens(), 266);
    assert_eq!(&processed.pixel_values[..6], [0.0, 0.0, 1.0, 1.0 / 255.0, 0.0, 1.0].map(|v: f64| v as f32));
}

#[test]
fn image_sequence_is_boi_tokens_eoi() {
    assert_eq!(gemma4_image_sequence("<boi>", "<t>", "<eoi>", 2), "<boi><t><t><eoi>");
    let long = gemma4_image_sequence("[", "x", "]", 280);
    assert_eq!(long.len(), 282);
    assert!(long.starts_with("[x") && long.ends_with("x]"));
}
