//! An image file as a request sends it (issue 40): PNG, JPEG or WebP bytes decoded under limits,
//! then made into patches by Qwen2-VL's and Gemma 3's image processors at small sizes. Every
//! input gives an image or a `VisionError`; nothing panics, hangs or allocates past the limits.
#![no_main]

use kylin_vision::{Gemma3ImageProcessor, ImageLimits, QwenImageProcessor, decode_image};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    // Small limits keep one input well inside the 5 s timeout; the checks are the same code.
    let limits = ImageLimits { max_bytes: 1 << 20, max_pixels: 1 << 20, max_side: 4096 };
    let Ok(image) = decode_image(bytes, &limits) else { return };
    let qwen = QwenImageProcessor::from_json(
        r#"{"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
            "size": {"shortest_edge": 64, "longest_edge": 4096}}"#,
    )
    .expect("the fixed configuration parses");
    let _ = qwen.process(&image);
    let gemma = Gemma3ImageProcessor::from_json(
        r#"{"size": {"height": 28, "width": 28}, "do_pan_and_scan": true,
            "pan_and_scan_min_crop_size": 4, "pan_and_scan_max_num_crops": 4}"#,
    )
    .expect("the fixed configuration parses");
    let _ = gemma.process(&image);
});
