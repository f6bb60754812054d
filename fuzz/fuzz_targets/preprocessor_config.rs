//! `preprocessor_config.json` (issue 40), read by Qwen2-VL's, Gemma 3's and Gemma 4's image processors: any
//! text gives a processor or a `VisionError`; a processor read from it then runs on a small
//! image without panicking or allocating a size the configuration did not bound.
#![no_main]

use kylin_vision::{Gemma3ImageProcessor, Gemma4ImageProcessor, QwenImageProcessor, RgbImage};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let pixels = (0..13 * 7 * 3).map(|i| (i * 37 % 256) as u8).collect();
    let image = RgbImage::from_raw(13, 7, pixels).expect("13 x 7 RGB pixels");
    if let Ok(qwen) = QwenImageProcessor::from_json(text)
        && qwen.max_pixels <= 1 << 16
    {
        let _ = qwen.process(&image);
    }
    if let Ok(gemma) = Gemma3ImageProcessor::from_json(text)
        && gemma.height * gemma.width <= 1 << 16
    {
        let _ = gemma.process(&image);
    }
    if let Ok(gemma4) = Gemma4ImageProcessor::from_json(text)
        && gemma4.max_soft_tokens * (gemma4.pooling_kernel_size * gemma4.patch_size).pow(2) <= 1 << 18
    {
        let _ = gemma4.process(&image);
    }
});
