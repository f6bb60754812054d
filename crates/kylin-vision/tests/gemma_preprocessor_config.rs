//! A Gemma 3 `preprocessor_config.json` as transformers' `Gemma3ImageProcessorPil` reads it:
//! defaults, the published config, the forms of `size`, and typed refusals of bad values.

use kylin_vision::{Gemma3ImageProcessor, ResampleFilter, RgbImage};

fn refused(json: &str) -> String {
    let error = Gemma3ImageProcessor::from_json(json).expect_err(json);
    assert_eq!(error.code(), "PREPROCESSOR_CONFIG", "{json}: {error}");
    error.to_string()
}

/// Gemma 3's published preprocessor_config.json (gemma-3-4b-it and its siblings).
const GEMMA3_PUBLISHED: &str = r#"{
  "do_convert_rgb": null,
  "do_normalize": true,
  "do_pan_and_scan": null,
  "do_rescale": true,
  "do_resize": true,
  "image_mean": [0.5, 0.5, 0.5],
  "image_processor_type": "Gemma3ImageProcessor",
  "image_seq_length": 256,
  "image_std": [0.5, 0.5, 0.5],
  "pan_and_scan_max_num_crops": null,
  "pan_and_scan_min_crop_size": null,
  "pan_and_scan_min_ratio_to_activate": null,
  "processor_class": "Gemma3Processor",
  "resample": 2,
  "rescale_factor": 0.00392156862745098,
  "size": {"height": 896, "width": 896}
}"#;

#[test]
fn missing_fields_take_transformers_defaults() {
    let processor = Gemma3ImageProcessor::from_json("{}").unwrap();
    assert_eq!(processor, Gemma3ImageProcessor::default());
    assert_eq!((processor.height, processor.width), (224, 224));
    assert_eq!(processor.resample, ResampleFilter::Bilinear);
    assert_eq!((processor.image_mean, processor.image_std), ([0.5; 3], [0.5; 3]));
    assert_eq!(processor.rescale_factor, 1.0 / 255.0);
    assert!(processor.do_resize && processor.do_rescale && processor.do_normalize && processor.do_convert_rgb);
    // Gemma3Processor's defaults for the pan-and-scan settings.
    assert!(!processor.do_pan_and_scan);
    assert_eq!((processor.pan_and_scan_min_crop_size, processor.pan_and_scan_max_num_crops), (256, 4));
    assert_eq!(processor.pan_and_scan_min_ratio_to_activate, 1.2);
}

#[test]
fn published_config_is_read_with_nulls_as_defaults() {
    let processor = Gemma3ImageProcessor::from_json(GEMMA3_PUBLISHED).unwrap();
    assert_eq!((processor.height, processor.width), (896, 896));
    assert_eq!(processor, Gemma3ImageProcessor { height: 896, width: 896, ..Gemma3ImageProcessor::default() });
    // A 1000x500 photo: one 896x896 input, and with pan and scan on, two 500x500 crops more.
    let image = RgbImage::from_pixel(1000, 500, image::Rgb([255, 0, 128]));
    let processed = processor.process(&image).unwrap();
    assert_eq!(processed.num_crops(), 0);
    let pixels = &processed.images[0];
    assert_eq!((pixels.height, pixels.width, pixels.pixel_values.len()), (896, 896, 3 * 896 * 896));
    // Channel-first: all of red, then all of green, then all of blue.
    let plane = 896 * 896;
    assert!(pixels.pixel_values[..plane].iter().all(|&v| v == 1.0));
    assert!(pixels.pixel_values[plane..2 * plane].iter().all(|&v| v == -1.0));
    assert!(pixels.pixel_values[2 * plane..].iter().all(|&v| v == (128.0f64 / 255.0) as f32 / 0.5 - 1.0));
    let mut panning = processor.clone();
    panning.do_pan_and_scan = true;
    let crops = panning.pan_and_scan_crops(500, 1000);
    assert_eq!(crops.len(), 2);
    assert_eq!((crops[1].top, crops[1].left, crops[1].height, crops[1].width), (0, 500, 500, 500));
    assert_eq!(panning.process(&image).unwrap().images.len(), 3);
}

#[test]
fn pan_and_scan_settings_are_read() {
    let json = r#"{"do_pan_and_scan": true, "pan_and_scan_min_crop_size": 128, "pan_and_scan_max_num_crops": 8,
                   "pan_and_scan_min_ratio_to_activate": 2}"#;
    let processor = Gemma3ImageProcessor::from_json(json).unwrap();
    assert!(processor.do_pan_and_scan);
    assert_eq!((processor.pan_and_scan_min_crop_size, processor.pan_and_scan_max_num_crops), (128, 8));
    assert_eq!(processor.pan_and_scan_min_ratio_to_activate, 2.0);
}

#[test]
fn every_form_of_size_is_read() {
    for (json, expected) in [
        (r#"{"size": {"height": 40, "width": 56}}"#, (40, 56)),
        (r#"{"size": {"height": 40, "width": 56, "shortest_edge": null, "longest_edge": null}}"#, (40, 56)),
        (r#"{"size": 32}"#, (32, 32)),
        (r#"{"size": [24, 20]}"#, (24, 20)),
        (r#"{"size": null}"#, (224, 224)),
    ] {
        let processor = Gemma3ImageProcessor::from_json(json).unwrap();
        assert_eq!((processor.height, processor.width), expected, "{json}");
    }
}

#[test]
fn bad_values_are_refused_with_the_field_named() {
    for (json, field) in [
        ("[]", "JSON object"),
        ("{", "valid JSON"),
        (r#"{"size": {"height": 0, "width": 896}}"#, "size.height"),
        (r#"{"size": {"height": 896, "width": 0}}"#, "size.width"),
        (r#"{"size": {"height": 896, "width": 100000}}"#, "size.width"),
        (r#"{"size": {"height": 16384, "width": 16384}}"#, "at most 4194304 pixels"),
        (r#"{"size": {"height": 896}}"#, "both `height` and `width`"),
        (r#"{"size": {"height": 896.5, "width": 896}}"#, "size.height"),
        (r#"{"size": {"height": "896", "width": 896}}"#, "size.height"),
        (r#"{"size": {"shortest_edge": 896}}"#, "shortest_edge"),
        (r#"{"size": {"height": 896, "width": 896, "longest_edge": 1000}}"#, "longest_edge"),
        (r#"{"size": -3}"#, "size"),
        (r#"{"size": 0}"#, "size"),
        (r#"{"size": [896]}"#, "size"),
        (r#"{"size": "896x896"}"#, "size"),
        (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
        (r#"{"image_std": [0.5, 0.0, 0.5]}"#, "image_std"),
        (r#"{"image_std": "wide"}"#, "image_std"),
        (r#"{"rescale_factor": 0}"#, "rescale_factor"),
        (r#"{"rescale_factor": "1/255"}"#, "rescale_factor"),
        (r#"{"do_resize": "yes"}"#, "do_resize"),
        (r#"{"do_pan_and_scan": 1}"#, "do_pan_and_scan"),
        (r#"{"resample": 0}"#, "resample"),
        (r#"{"resample": "bilinear"}"#, "resample"),
        (r#"{"pan_and_scan_min_crop_size": 0}"#, "pan_and_scan_min_crop_size"),
        (r#"{"pan_and_scan_min_crop_size": 256.5}"#, "pan_and_scan_min_crop_size"),
        (r#"{"pan_and_scan_min_crop_size": 1000000}"#, "pan_and_scan_min_crop_size"),
        (r#"{"pan_and_scan_max_num_crops": 0}"#, "pan_and_scan_max_num_crops"),
        (r#"{"pan_and_scan_max_num_crops": 1000}"#, "pan_and_scan_max_num_crops"),
        (r#"{"pan_and_scan_max_num_crops": -4}"#, "pan_and_scan_max_num_crops"),
        (r#"{"pan_and_scan_min_ratio_to_activate": -1}"#, "pan_and_scan_min_ratio_to_activate"),
        (r#"{"pan_and_scan_min_ratio_to_activate": "1.2"}"#, "pan_and_scan_min_ratio_to_activate"),
    ] {
        let message = refused(json);
        assert!(message.contains(field), "{json}: {message}");
    }
}

#[test]
fn an_empty_image_is_refused() {
    let processor = Gemma3ImageProcessor::default();
    let error = processor.process(&RgbImage::new(0, 5)).unwrap_err();
    assert_eq!(error.code(), "IMAGE_SHAPE", "{error}");
}

#[test]
fn without_resize_every_entry_keeps_its_own_size() {
    let processor = Gemma3ImageProcessor::from_json(
        r#"{"do_resize": false, "do_pan_and_scan": true, "pan_and_scan_min_crop_size": 4}"#,
    )
    .unwrap();
    let processed = processor.process(&RgbImage::new(25, 10)).unwrap();
    let shapes: Vec<(usize, usize)> = processed.images.iter().map(|p| (p.height, p.width)).collect();
    // A ratio of 2.5 rounds half up to 3 crops of ceil(25 / 3) = 9 columns, the last cut to 7.
    assert_eq!(shapes, [(10, 25), (10, 9), (10, 9), (10, 7)]);
    assert!(processed.images.iter().all(|p| p.pixel_values.len() == 3 * p.height * p.width));
}
