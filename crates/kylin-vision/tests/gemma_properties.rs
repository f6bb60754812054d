//! Properties of the Gemma 3 processor over random configs and images: no panic, every refusal
//! typed, crops inside the image and tiling it, and every entry the shape it claims.

use kylin_vision::{Gemma3ImageProcessor, RgbImage};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn processing_random_images_keeps_its_shapes(
        out_h in 1usize..40, out_w in 1usize..40, resample in 2u64..4, do_resize in any::<bool>(),
        min_crop in 1usize..30, max_crops in 1usize..9, ratio in 0.0f64..3.0,
        width in 1u32..90, height in 1u32..90, seed in any::<u8>(),
    ) {
        let json = format!(
            r#"{{"size": {{"height": {out_h}, "width": {out_w}}}, "resample": {resample}, "do_resize": {do_resize},
                "do_pan_and_scan": true, "pan_and_scan_min_crop_size": {min_crop},
                "pan_and_scan_max_num_crops": {max_crops}, "pan_and_scan_min_ratio_to_activate": {ratio:?}}}"#
        );
        let processor = Gemma3ImageProcessor::from_json(&json).expect("a valid config");
        let image = RgbImage::from_fn(width, height, |x, y| {
            image::Rgb([(x * 7 + y) as u8 ^ seed, (y * 13) as u8, seed.wrapping_mul(x as u8)])
        });
        let (h, w) = (height as usize, width as usize);
        let crops = processor.pan_and_scan_crops(h, w);
        prop_assert!(crops.len() <= max_crops);
        // The crops lie in the image and cut its longer side into consecutive pieces.
        let mut next = 0;
        for crop in &crops {
            prop_assert!(crop.top + crop.height <= h && crop.left + crop.width <= w, "{:?}", crop);
            if crop.height * crop.width > 0 {
                let start = if w >= h { crop.left } else { crop.top };
                prop_assert_eq!(start, next);
                next += if w >= h { crop.width } else { crop.height };
            }
        }
        if let Some(first) = crops.first() {
            prop_assert_eq!(next, if w >= h { w } else { h });
            // Every crop but the last is full size, at least the minimum on both sides.
            prop_assert!(first.height.min(first.width) >= min_crop, "{:?}", first);
        }
        let processed = processor.process(&image).expect("process");
        prop_assert_eq!(processed.num_crops(), crops.len());
        for (i, entry) in processed.images.iter().enumerate() {
            let expected = if do_resize {
                (out_h, out_w)
            } else if i == 0 {
                (h, w)
            } else {
                (crops[i - 1].height, crops[i - 1].width)
            };
            prop_assert_eq!((entry.height, entry.width), expected);
            prop_assert_eq!(entry.pixel_values.len(), 3 * entry.height * entry.width);
            prop_assert!(entry.pixel_values.iter().all(|v| v.is_finite() && (-1.0..=1.0).contains(v)));
        }
    }

    #[test]
    fn random_json_never_panics(text in "\\PC{0,200}") {
        if let Err(error) = Gemma3ImageProcessor::from_json(&text) {
            prop_assert_eq!(error.code(), "PREPROCESSOR_CONFIG");
        }
    }

    #[test]
    fn random_values_of_known_keys_are_read_or_refused(
        key in prop::sample::select(vec![
            "size", "resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
            "image_std", "do_convert_rgb", "do_pan_and_scan", "pan_and_scan_min_crop_size",
            "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate",
        ]),
        value in prop_oneof![
            Just("null".to_string()), Just("true".to_string()), Just("[]".to_string()),
            Just("{}".to_string()), Just("\"x\"".to_string()),
            Just(r#"{"height": 0, "width": 5}"#.to_string()),
            any::<i64>().prop_map(|v| v.to_string()),
            any::<f64>().prop_filter("finite", |v| v.is_finite()).prop_map(|v| format!("{v:?}")),
            prop::collection::vec(-2.0f64..2.0, 0..5).prop_map(|v| format!("{v:?}")),
            prop::collection::vec(0u64..100_000, 0..4).prop_map(|v| format!("{v:?}")),
        ],
    ) {
        let json = format!(r#"{{"{key}": {value}}}"#);
        match Gemma3ImageProcessor::from_json(&json) {
            Ok(processor) => {
                prop_assert!(processor.height * processor.width <= 1 << 22);
                prop_assert!((1..=16).contains(&processor.pan_and_scan_max_num_crops));
                prop_assert!(processor.pan_and_scan_min_crop_size >= 1);
            }
            Err(error) => prop_assert_eq!(error.code(), "PREPROCESSOR_CONFIG"),
        }
    }
}
