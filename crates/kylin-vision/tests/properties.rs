//! Properties of the processor over random configs and images: no panic, every refusal typed,
//! and the output's shape what the grid says.

use kylin_vision::{QwenImageProcessor, RgbImage, smart_resize};
use proptest::prelude::*;

fn config_json(patch: u64, merge: u64, temporal: u64, min_pixels: u64, max_pixels: u64, resample: u64) -> String {
    format!(
        r#"{{"patch_size": {patch}, "merge_size": {merge}, "temporal_patch_size": {temporal},
            "min_pixels": {min_pixels}, "max_pixels": {max_pixels}, "resample": {resample}}}"#
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn processing_random_images_keeps_its_shapes(
        patch in 1u64..6, merge in 1u64..4, temporal in 1u64..4,
        min_pixels in 1u64..4000, extra in 0u64..4000, resample in 2u64..4,
        width in 1u32..60, height in 1u32..60, seed in any::<u8>(),
    ) {
        let json = config_json(patch, merge, temporal, min_pixels, min_pixels + extra, resample);
        let processor = QwenImageProcessor::from_json(&json).expect("a valid config");
        let image = RgbImage::from_fn(width, height, |x, y| {
            image::Rgb([(x * 7 + y) as u8 ^ seed, (y * 13) as u8, seed.wrapping_mul(x as u8)])
        });
        match processor.process(&image) {
            Ok(processed) => {
                let [t, grid_h, grid_w] = processed.grid_thw;
                let (p, m, t_size) = (patch as usize, merge as usize, temporal as usize);
                prop_assert_eq!(t, 1);
                prop_assert_eq!(grid_h % m, 0);
                prop_assert_eq!(grid_w % m, 0);
                prop_assert_eq!(processed.patch_dim, 3 * t_size * p * p);
                prop_assert_eq!(processed.pixel_values.len(), grid_h * grid_w * processed.patch_dim);
                prop_assert_eq!(processed.num_image_tokens() * m * m, grid_h * grid_w);
                prop_assert!(processed.pixel_values.iter().all(|v| v.is_finite()));
            }
            Err(error) => prop_assert_eq!(error.code(), "IMAGE_SHAPE", "{}", error),
        }
    }

    #[test]
    fn smart_resize_gives_multiples_of_the_factor(
        height in 1usize..30000, width in 1usize..30000, factor in 1usize..64,
        min_pixels in 1u64..100_000, extra in 0u64..20_000_000,
    ) {
        let max_pixels = min_pixels + extra;
        match smart_resize(height, width, factor, min_pixels, max_pixels) {
            Ok((h, w)) => {
                prop_assert!(h >= factor && w >= factor);
                prop_assert_eq!(h % factor, 0);
                prop_assert_eq!(w % factor, 0);
            }
            Err(error) => {
                prop_assert_eq!(error.code(), "IMAGE_SHAPE");
                prop_assert!(height.max(width) as f64 / height.min(width) as f64 > 200.0);
            }
        }
    }

    #[test]
    fn random_json_never_panics(text in "\\PC{0,200}") {
        if let Err(error) = QwenImageProcessor::from_json(&text) {
            prop_assert_eq!(error.code(), "PREPROCESSOR_CONFIG");
        }
    }

    #[test]
    fn random_values_of_known_keys_are_read_or_refused(
        key in prop::sample::select(vec![
            "patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "size",
            "image_mean", "image_std", "rescale_factor", "do_resize", "do_normalize", "resample",
        ]),
        value in prop_oneof![
            Just("null".to_string()), Just("true".to_string()), Just("[]".to_string()),
            Just("{}".to_string()), Just("\"x\"".to_string()),
            any::<i64>().prop_map(|v| v.to_string()),
            any::<f64>().prop_filter("finite", |v| v.is_finite()).prop_map(|v| format!("{v:?}")),
            prop::collection::vec(-2.0f64..2.0, 0..5).prop_map(|v| format!("{v:?}")),
        ],
    ) {
        let json = format!(r#"{{"{key}": {value}}}"#);
        if let Err(error) = QwenImageProcessor::from_json(&json) {
            prop_assert_eq!(error.code(), "PREPROCESSOR_CONFIG");
        }
    }
}
