//! Kylin's Gemma 3 image processing against transformers' `Gemma3ImageProcessorPil` and
//! `Gemma3Processor` on the fixtures of tests/fixtures/vision/gemma: `pixel_values` of every
//! reference image and of its pan-and-scan crops, the crop geometry on many sizes, and the
//! prompt text of an image with its crops.

mod support;

use kylin_vision::{
    GEMMA3_BOI_TOKEN, Gemma3ImageProcessor, Gemma3Processed, ImageLimits, RgbImage, decode_image,
    gemma3_full_image_sequence, gemma3_image_prompt,
};
use serde_json::Value;
use support::{pillow_rgb_file, read, read_f32, usize_of};

/// The tolerance on values: none beyond float rounding. The resize is Pillow's to the bit and
/// the arithmetic NumPy's, so the values are expected equal; any difference is a bug.
const TOLERANCE: f32 = 1e-6;

fn manifest() -> Value {
    serde_json::from_slice(&read("gemma/manifest.json")).expect("gemma/manifest.json is JSON")
}

fn cases() -> Vec<Value> {
    manifest()["images"].as_array().expect("images").clone()
}

fn processor(case: &Value) -> Gemma3ImageProcessor {
    Gemma3ImageProcessor::from_json(&case["config"].to_string()).expect("config")
}

/// What transformers' `convert_to_rgb` made of the case's file in Pillow.
fn pillow_rgb(case: &Value) -> RgbImage {
    pillow_rgb_file(case, &format!("gemma/{}", case["rgb"].as_str().unwrap()))
}

/// The case's reference, split into the whole image and its crops.
fn expected(case: &Value) -> Vec<(usize, usize, Vec<f32>)> {
    let name = case["name"].as_str().unwrap();
    let all = read_f32(&format!("gemma/{name}.pixel_values.bin"));
    let mut rest = all.as_slice();
    let mut out = Vec::new();
    for shape in case["shapes"].as_array().unwrap() {
        let (h, w) = (usize_of(&shape[0]), usize_of(&shape[1]));
        let (this, next) = rest.split_at(3 * h * w);
        out.push((h, w, this.to_vec()));
        rest = next;
    }
    assert!(rest.is_empty(), "{name}: the .bin file is longer than its shapes");
    out
}

/// Checks the shapes and the number of crops, and returns the largest difference.
fn compare(case: &Value, processed: &Gemma3Processed) -> f32 {
    let name = case["name"].as_str().unwrap();
    let expected = expected(case);
    assert_eq!(processed.num_crops(), usize_of(&case["num_crops"]), "{name}: num_crops");
    assert_eq!(processed.images.len(), expected.len(), "{name}: the image and its crops");
    let mut max = 0.0f32;
    for (i, (got, (h, w, values))) in processed.images.iter().zip(&expected).enumerate() {
        assert_eq!((got.height, got.width), (*h, *w), "{name}[{i}]: (height, width)");
        assert_eq!(got.pixel_values.len(), values.len(), "{name}[{i}]: length");
        let diff = got.pixel_values.iter().zip(values).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        max = max.max(diff);
    }
    max
}

#[test]
fn pixel_values_match_transformers_on_pillows_decoding() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let processed = processor(&case).process(&pillow_rgb(&case)).expect("process");
        let diff = compare(&case, &processed);
        println!("{name}: {} crops, max |kylin - transformers| = {diff:e}", processed.num_crops());
        assert!(diff <= TOLERANCE, "{name}: pixel_values differ from transformers' by {diff}");
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
        let diff = compare(case, &processor(case).process(&decoded).expect("process"));
        println!("{name}: end to end, max |kylin - transformers| = {diff:e}");
        assert!(diff <= TOLERANCE, "{name}: end to end, pixel_values differ by {diff}");
        checked += 1;
        jpegs += usize::from(case["file"].as_str().unwrap().ends_with(".jpg"));
    }
    assert!(checked >= 12, "only {checked} cases");
    assert!(jpegs >= 2, "only {jpegs} JPEG cases");
}

#[test]
fn pan_and_scan_crops_match_transformers() {
    let cases = manifest()["pan_and_scan"].as_array().unwrap().clone();
    assert!(cases.len() >= 400);
    let (mut with_crops, mut empty_crops) = (0, 0);
    for case in &cases {
        let processor = Gemma3ImageProcessor {
            do_pan_and_scan: true,
            pan_and_scan_min_crop_size: usize_of(&case["min_crop_size"]),
            pan_and_scan_max_num_crops: usize_of(&case["max_num_crops"]),
            pan_and_scan_min_ratio_to_activate: case["min_ratio_to_activate"].as_f64().unwrap(),
            ..Gemma3ImageProcessor::default()
        };
        let (height, width) = (usize_of(&case["height"]), usize_of(&case["width"]));
        let got = processor.pan_and_scan_crops(height, width);
        let expected = case["crops"].as_array().unwrap();
        assert_eq!(got.len(), expected.len(), "{case}");
        for (got, b) in got.iter().zip(expected) {
            assert_eq!((got.height, got.width), (usize_of(&b[2]), usize_of(&b[3])), "{case}");
            if got.height * got.width == 0 {
                // An empty crop has no pixels, and NumPy gives its slice no position.
                assert!(b[0].is_null() && b[1].is_null(), "{case}");
                assert!(got.top <= height && got.left <= width, "{case}: {got:?}");
            } else {
                assert_eq!((got.top, got.left), (usize_of(&b[0]), usize_of(&b[1])), "{case}");
                assert!(got.top + got.height <= height && got.left + got.width <= width, "{case}: {got:?}");
            }
        }
        with_crops += usize::from(!got.is_empty());
        empty_crops += got.iter().filter(|b| b.height * b.width == 0).count();
    }
    assert!(with_crops > 100, "only {with_crops} sizes are cropped");
    assert!(empty_crops > 0, "no case reaches an empty crop");
}

#[test]
fn pan_and_scan_off_gives_the_whole_image_only() {
    let case = cases().into_iter().find(|c| c["name"] == "logo_rgba_png_pas").unwrap();
    let mut processor = processor(&case);
    let image = pillow_rgb(&case);
    assert_eq!(processor.process(&image).unwrap().num_crops(), 3);
    processor.do_pan_and_scan = false;
    let whole = processor.process(&image).unwrap();
    assert_eq!(whole.num_crops(), 0);
    assert_eq!(whole.images.len(), 1);
    assert_eq!(whole.images[0].pixel_values, expected(&case)[0].2, "the whole image is the same either way");
}

#[test]
fn prompt_text_matches_gemma3_processor() {
    let cases = manifest()["prompts"].as_array().unwrap().clone();
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let num_crops = usize_of(&case["num_crops"]);
        let full = gemma3_full_image_sequence(
            GEMMA3_BOI_TOKEN,
            "<image_soft_token>",
            "<end_of_image>",
            usize_of(&case["image_seq_length"]),
        );
        assert_eq!(full, case["full_image_sequence"].as_str().unwrap());
        // transformers' processor end to end: the prompt's `<start_of_image>` replaced.
        let text = case["text"].as_str().unwrap();
        let expanded = text.replacen(GEMMA3_BOI_TOKEN, &gemma3_image_prompt(num_crops, &full), 1);
        assert_eq!(expanded, case["expanded"].as_str().unwrap(), "{num_crops} crops");
        // With the bare token, then every token expanded: the same text.
        let with_boi = gemma3_image_prompt(num_crops, GEMMA3_BOI_TOKEN);
        assert_eq!(with_boi, case["with_boi"].as_str().unwrap(), "{num_crops} crops");
        assert_eq!(text.replacen(GEMMA3_BOI_TOKEN, &with_boi, 1).replace(GEMMA3_BOI_TOKEN, &full), expanded);
    }
    assert_eq!(
        gemma3_image_prompt(2, "<start_of_image>"),
        "Here is the original image <start_of_image> and here are some crops to help you see better \
         <start_of_image> <start_of_image>"
    );
}

#[test]
fn processed_prompt_uses_its_number_of_crops() {
    let case = cases().into_iter().find(|c| c["name"] == "gray_png_portrait_pas").unwrap();
    let processed = processor(&case).process(&pillow_rgb(&case)).unwrap();
    assert_eq!(processed.num_crops(), 2);
    assert_eq!(processed.prompt("<img>"), gemma3_image_prompt(2, "<img>"));
    assert!(processed.prompt("<img>").ends_with("better <img> <img>"));
}
