//! Image input for vision-language models, from the bytes of an image file to what a vision
//! encoder reads.
//!
//! - [`decode_image`] turns PNG, JPEG or WebP bytes (recognised by their magic bytes) into an
//!   RGB image under [`ImageLimits`]: the header's dimensions are checked before anything is
//!   decoded, so a small file that claims a huge image is refused without allocating it, and
//!   transparency is composited onto white exactly as transformers' `convert_to_rgb` (Pillow's
//!   `alpha_composite`) does. JPEG goes through libjpeg-turbo's decoder, Pillow's, so every
//!   format decodes to Pillow's bytes exactly.
//! - [`resize`] is Pillow's `Image.resize` for RGB images (`ImagingResample`: separable,
//!   fixed-point coefficients, a horizontal then a vertical pass), bit for bit.
//! - [`QwenImageProcessor`] is transformers' Qwen2-VL image processor (the PIL backend, which
//!   Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 use) read from a `preprocessor_config.json`:
//!   `smart_resize`, rescale, normalize and the patch flattening, giving `pixel_values` and
//!   `image_grid_thw` equal to transformers' within float rounding.
//! - [`Gemma3ImageProcessor`] is transformers' Gemma 3 image processor (the PIL backend,
//!   `Gemma3ImageProcessorPil`) read from a `preprocessor_config.json`: pan and scan (the
//!   crops of an elongated image, [`Gemma3ImageProcessor::pan_and_scan_crops`]), Pillow's
//!   resize of the image and every crop to `size`, rescale and normalize, giving channel-first
//!   (3, height, width) `pixel_values` per SigLIP input ([`GemmaPixels`]) equal to
//!   transformers'; [`gemma3_image_prompt`] is the prompt text `Gemma3Processor` writes for an
//!   image and its crops.
//! - [`Gemma4ImageProcessor`] is transformers' Gemma 4 image processor (the PIL backend,
//!   `Gemma4ImageProcessorPil`) read from a `preprocessor_config.json`: the aspect-ratio-preserving
//!   resize to a patch budget ([`Gemma4ImageProcessor::target_size`]), rescale, optional
//!   normalize and the patches, channel last, giving `pixel_values` equal to transformers' real
//!   (unpadded) patches and the image's number of soft tokens ([`Gemma4Processed`]);
//!   [`gemma4_image_sequence`] is the text `Gemma4Processor` writes for an image.
//!
//! The crate knows nothing of HTTP or of the engine. Every failure is a [`VisionError`] with a
//! stable code; nothing here panics on outside data or allocates a size it has not checked.

mod decode;
mod error;
mod gemma;
mod gemma4;
mod jpeg;
mod qwen;
mod resample;

pub use decode::{ImageFormatKind, ImageLimits, decode_image, sniff_format};
pub use error::{VisionError, VisionErrorCode};
pub use gemma::{
    CropBox, GEMMA3_BOI_TOKEN, Gemma3ImageProcessor, Gemma3Processed, GemmaPixels, gemma3_full_image_sequence,
    gemma3_image_prompt,
};
pub use gemma4::{GEMMA4_SUPPORTED_SOFT_TOKENS, Gemma4ImageProcessor, Gemma4Processed, gemma4_image_sequence};
pub use image::RgbImage;
pub use qwen::{ProcessedImage, QwenImageProcessor, smart_resize};
pub use resample::{ResampleFilter, resize};
