//! `preprocessor_config.json` as transformers' Qwen2-VL processor reads it: defaults, both forms
//! of the pixel range, and typed refusals of bad values.

use kylin_vision::{QwenImageProcessor, ResampleFilter};

fn refused(json: &str) -> String {
    let error = QwenImageProcessor::from_json(json).expect_err(json);
    assert_eq!(error.code(), "PREPROCESSOR_CONFIG", "{json}: {error}");
    error.to_string()
}

#[test]
fn missing_fields_take_transformers_defaults() {
    let processor = QwenImageProcessor::from_json("{}").unwrap();
    assert_eq!(processor, QwenImageProcessor::default());
    assert_eq!((processor.patch_size, processor.merge_size, processor.temporal_patch_size), (14, 2, 2));
    assert_eq!((processor.min_pixels, processor.max_pixels), (3136, 1003520));
    assert_eq!(processor.image_mean, [0.48145466, 0.4578275, 0.40821073]);
    assert_eq!(processor.resample, ResampleFilter::Bicubic);
    assert!(processor.do_resize && processor.do_rescale && processor.do_normalize && processor.do_convert_rgb);
    assert_eq!(processor.rescale_factor, 1.0 / 255.0);
}

#[test]
fn qwen3_5_published_config_is_read() {
    let json = r#"{
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"
    }"#;
    let processor = QwenImageProcessor::from_json(json).unwrap();
    assert_eq!((processor.min_pixels, processor.max_pixels), (65536, 16777216));
    assert_eq!(processor.factor(), 32);
    assert_eq!(processor.image_std, [0.5; 3]);
}

#[test]
fn flat_pixel_keys_override_size() {
    let json = r#"{"size": {"shortest_edge": 100, "longest_edge": 200000}, "min_pixels": 5000, "max_pixels": null}"#;
    let processor = QwenImageProcessor::from_json(json).unwrap();
    assert_eq!((processor.min_pixels, processor.max_pixels), (5000, 200000));
    // Qwen2-VL's older configs have only the flat keys.
    let processor = QwenImageProcessor::from_json(r#"{"min_pixels": 3136, "max_pixels": 12845056}"#).unwrap();
    assert_eq!((processor.min_pixels, processor.max_pixels), (3136, 12845056));
}

#[test]
fn scalar_mean_applies_to_every_channel() {
    let processor = QwenImageProcessor::from_json(r#"{"image_mean": 0.5, "image_std": 0.25}"#).unwrap();
    assert_eq!((processor.image_mean, processor.image_std), ([0.5; 3], [0.25; 3]));
}

#[test]
fn bad_values_are_refused_with_the_field_named() {
    for (json, field) in [
        ("[]", "JSON object"),
        ("{", "valid JSON"),
        (r#"{"patch_size": 0}"#, "patch_size"),
        (r#"{"patch_size": 14.5}"#, "patch_size"),
        (r#"{"patch_size": "14"}"#, "patch_size"),
        (r#"{"merge_size": 1000}"#, "merge_size"),
        (r#"{"temporal_patch_size": -2}"#, "temporal_patch_size"),
        (r#"{"size": {"shortest_edge": 3136}}"#, "longest_edge"),
        (r#"{"size": {"min_pixels": 3136, "max_pixels": 100000}}"#, "shortest_edge"),
        (r#"{"size": 224}"#, "size"),
        (r#"{"min_pixels": 0}"#, "shortest_edge"),
        (r#"{"min_pixels": 5000, "max_pixels": 4000}"#, "min_pixels <= max_pixels"),
        (r#"{"max_pixels": 1000000000000}"#, "max_pixels"),
        (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
        (r#"{"image_mean": [0.5, "a", 0.5]}"#, "image_mean"),
        (r#"{"image_std": [0.5, 0.0, 0.5]}"#, "image_std"),
        (r#"{"image_std": "wide"}"#, "image_std"),
        (r#"{"rescale_factor": 0}"#, "rescale_factor"),
        (r#"{"rescale_factor": -1}"#, "rescale_factor"),
        (r#"{"do_resize": "yes"}"#, "do_resize"),
        (r#"{"do_normalize": 1}"#, "do_normalize"),
        (r#"{"resample": 1}"#, "resample"),
        (r#"{"resample": 0}"#, "resample"),
        (r#"{"resample": "bicubic"}"#, "resample"),
    ] {
        let message = refused(json);
        assert!(message.contains(field), "{json}: {message}");
    }
}

#[test]
fn bilinear_is_read_from_pillows_number() {
    let processor = QwenImageProcessor::from_json(r#"{"resample": 2}"#).unwrap();
    assert_eq!(processor.resample, ResampleFilter::Bilinear);
}

#[test]
fn without_resize_the_sides_must_fit_the_patch_grid() {
    let processor = QwenImageProcessor::from_json(r#"{"do_resize": false, "patch_size": 4, "merge_size": 2}"#).unwrap();
    let fits = processor.process(&kylin_vision::RgbImage::new(16, 24)).unwrap();
    assert_eq!(fits.grid_thw, [1, 6, 4]);
    let error = processor.process(&kylin_vision::RgbImage::new(17, 24)).unwrap_err();
    assert_eq!(error.code(), "IMAGE_SHAPE", "{error}");
    assert!(error.to_string().contains("17x24"), "{error}");
}
