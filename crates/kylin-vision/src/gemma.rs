//! transformers' Gemma 3 image processor (`Gemma3ImageProcessorPil`), which Gemma 3 checkpoints
//! name in their `preprocessor_config.json`, and the prompt text its processor (`Gemma3Processor`)
//! puts in place of an image.
//!
//! One image becomes one or more SigLIP inputs, each `pixel_values` of shape (3, height, width),
//! channel-first and row-major, as transformers gives `pixel_values[i]`:
//!
//! 1. With `do_pan_and_scan` on, [`Gemma3ImageProcessor::pan_and_scan_crops`] picks crops of an
//!    image whose aspect ratio reaches `pan_and_scan_min_ratio_to_activate`: 2 to
//!    `pan_and_scan_max_num_crops` side by side along the longer side (about the aspect
//!    ratio, rounded half up, and no more than fit `pan_and_scan_min_crop_size`), each
//!    `ceil(side / crops)` long, none at all when a crop would be shorter than the minimum. The
//!    last crop is cut off by the image's edge (NumPy's slicing), so it may be narrower, or even
//!    empty: Pillow resizes an empty image to black, and so does Kylin.
//! 2. The whole image, then every crop (rows of crops, then columns within a row), is resized
//!    to `size` with Pillow's resize (the config's filter, bilinear by default).
//! 3. The bytes are rescaled (`u8 as f64 * rescale_factor`, then to f32) and normalised in f32
//!    per channel (`(x - mean) / std`), in NumPy's order and precision: `np_rescale` upcasts to
//!    float64 and casts its result to float32, `np_normalize` subtracts and divides in float32.
//!
//! [`gemma3_image_prompt`] is the text `Gemma3Processor` writes for an image with its crops.
//!
//! Note: transformers' `Gemma3Processor` passes its own `images_kwargs` (`do_pan_and_scan`
//! false, crops of at least 256 pixels, at most 4, from an aspect ratio of 1.2) to the image
//! processor as call arguments, so a `processor(text=..., images=...)` call does not pan and
//! scan unless the caller asks for it, whatever `preprocessor_config.json` says. Kylin reads
//! the config as the image processor does, and uses those processor defaults where the config
//! leaves the pan-and-scan settings `null` (as published Gemma 3 configs do): set
//! `do_pan_and_scan` on the returned value to choose per request.

use serde_json::{Map, Value};

use crate::error::VisionError;
use crate::qwen::{PixelSettings, config_object, present, read_bool, read_count, read_pixel_settings};
use crate::resample::{ResampleFilter, resize};
use image::RgbImage;

/// transformers' `IMAGENET_STANDARD_MEAN` and `IMAGENET_STANDARD_STD`, the class defaults.
const IMAGENET_STANDARD_MEAN: [f64; 3] = [0.5, 0.5, 0.5];
const IMAGENET_STANDARD_STD: [f64; 3] = [0.5, 0.5, 0.5];

/// The class default of `size`: 224 x 224 (published Gemma 3 checkpoints say 896 x 896).
const DEFAULT_SIDE: usize = 224;
/// `Gemma3Processor`'s defaults for the pan-and-scan settings a config leaves `null`.
const DEFAULT_MIN_CROP_SIZE: usize = 256;
const DEFAULT_MAX_NUM_CROPS: usize = 4;
const DEFAULT_MIN_RATIO_TO_ACTIVATE: f64 = 1.2;

/// The largest side of `size` accepted, and the most pixels (2048 x 2048, over five times
/// Gemma 3's 896 x 896): with at most [`MAX_NUM_CROPS`] crops they bound every buffer the
/// processor allocates.
const MAX_SIDE: u64 = 1 << 14;
const MAX_CONFIG_PIXELS: u64 = 1 << 22;
/// The most crops accepted for `pan_and_scan_max_num_crops` (Gemma 3 uses 4).
const MAX_NUM_CROPS: u64 = 16;

/// The begin-of-image token of Gemma 3's tokenizer (`tokenizer.boi_token`), which the chat
/// template writes where an image goes.
pub const GEMMA3_BOI_TOKEN: &str = "<start_of_image>";

/// One SigLIP input: the whole image or one of its crops.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaPixels {
    /// Channel-first (3, height, width), row-major: `pixel_values[(c * height + y) * width + x]`.
    pub pixel_values: Vec<f32>,
    pub height: usize,
    pub width: usize,
}

/// What one image becomes: the whole image, then its pan-and-scan crops.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Processed {
    /// `images[0]` is the whole image, `images[1..]` its crops in transformers' order.
    pub images: Vec<GemmaPixels>,
}

impl Gemma3Processed {
    /// The number of crops (transformers' `num_crops` for the image): all but the whole image.
    pub fn num_crops(&self) -> usize {
        self.images.len().saturating_sub(1)
    }

    /// [`gemma3_image_prompt`] for this image's crops.
    pub fn prompt(&self, image: &str) -> String {
        gemma3_image_prompt(self.num_crops(), image)
    }
}

/// A crop of the image, in pixels of the image: rows `top..top + height`, columns
/// `left..left + width`. It lies within the image, and may be empty (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropBox {
    pub top: usize,
    pub left: usize,
    pub height: usize,
    pub width: usize,
}

/// The text `Gemma3Processor` (`replace_image_token`) puts in place of one image's
/// `<start_of_image>` in the prompt, given the image's number of crops and `image`, the text
/// of one image.
///
/// Without crops it is `image` itself; with `n` crops it is
/// `"Here is the original image {image} and here are some crops to help you see better "`
/// followed by `n` copies of `image` joined by single spaces (no space after the last).
///
/// transformers passes the expanded image, [`gemma3_full_image_sequence`]; older versions
/// inserted this text with [`GEMMA3_BOI_TOKEN`] for `image` first and expanded every
/// `<start_of_image>` after, which gives the same string. So an engine may call this with
/// `"<start_of_image>"` and expand each one, or with the full sequence.
pub fn gemma3_image_prompt(num_crops: usize, image: &str) -> String {
    if num_crops == 0 {
        return image.to_string();
    }
    let mut text = format!("Here is the original image {image} and here are some crops to help you see better ");
    for i in 0..num_crops {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(image);
    }
    text
}

/// `Gemma3Processor.full_image_sequence`, the text of one image (or crop) in the prompt:
/// `"\n\n{boi}{image_token * image_seq_length}{eoi}\n\n"`. For Gemma 3 the tokens are
/// `<start_of_image>`, `<image_soft_token>` and `<end_of_image>`, and `image_seq_length` is 256.
pub fn gemma3_full_image_sequence(boi: &str, image_token: &str, eoi: &str, image_seq_length: usize) -> String {
    let mut text = String::with_capacity(4 + boi.len() + eoi.len() + image_token.len() * image_seq_length);
    text.push_str("\n\n");
    text.push_str(boi);
    for _ in 0..image_seq_length {
        text.push_str(image_token);
    }
    text.push_str(eoi);
    text.push_str("\n\n");
    text
}

/// The settings of a Gemma 3 `preprocessor_config.json`, every missing field at transformers'
/// default (the pan-and-scan ones at `Gemma3Processor`'s, see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3ImageProcessor {
    /// `size.height`: the height of every SigLIP input.
    pub height: usize,
    /// `size.width`: the width of every SigLIP input.
    pub width: usize,
    pub resample: ResampleFilter,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    /// Read for completeness: [`crate::decode_image`] always converts to RGB, since the
    /// encoder reads three channels.
    pub do_convert_rgb: bool,
    pub do_pan_and_scan: bool,
    pub pan_and_scan_min_crop_size: usize,
    pub pan_and_scan_max_num_crops: usize,
    pub pan_and_scan_min_ratio_to_activate: f64,
}

impl Default for Gemma3ImageProcessor {
    /// transformers' class defaults (224 x 224, bilinear, mean and std 0.5), pan and scan off.
    fn default() -> Self {
        Gemma3ImageProcessor {
            height: DEFAULT_SIDE,
            width: DEFAULT_SIDE,
            resample: ResampleFilter::Bilinear,
            do_resize: true,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: IMAGENET_STANDARD_MEAN,
            image_std: IMAGENET_STANDARD_STD,
            do_convert_rgb: true,
            do_pan_and_scan: false,
            pan_and_scan_min_crop_size: DEFAULT_MIN_CROP_SIZE,
            pan_and_scan_max_num_crops: DEFAULT_MAX_NUM_CROPS,
            pan_and_scan_min_ratio_to_activate: DEFAULT_MIN_RATIO_TO_ACTIVATE,
        }
    }
}

/// `size` as transformers' `get_size_dict` reads it for this class (`default_to_square`): an
/// integer is a square, a list is (height, width), an object has `height` and `width`. The
/// other forms (`shortest_edge`, `max_height`...) are not Gemma 3's and are refused.
fn read_target_size(config: &Map<String, Value>) -> Result<(u64, u64), VisionError> {
    let side = |value: &Value, key: &str| read_count(value, key, 1, MAX_SIDE);
    let (height, width) = match present(config, "size") {
        None => (DEFAULT_SIDE as u64, DEFAULT_SIDE as u64),
        Some(Value::Object(size)) => {
            let other: Vec<&String> =
                size.iter().filter(|(k, v)| !v.is_null() && *k != "height" && *k != "width").map(|(k, _)| k).collect();
            if !other.is_empty() {
                return Err(VisionError::config(format!(
                    "`size` must have `height` and `width` only (Gemma 3 resizes to a fixed size), got the keys {other:?}"
                )));
            }
            let (Some(h), Some(w)) = (present(size, "height"), present(size, "width")) else {
                return Err(VisionError::config(format!(
                    "`size` must have both `height` and `width`, got {}",
                    Value::Object(size.clone())
                )));
            };
            (side(h, "size.height")?, side(w, "size.width")?)
        }
        Some(Value::Array(items)) if items.len() == 2 => (side(&items[0], "size[0]")?, side(&items[1], "size[1]")?),
        Some(value @ Value::Number(_)) => {
            let n = side(value, "size")?;
            (n, n)
        }
        Some(other) => {
            return Err(VisionError::config(format!(
                "`size` must be {{\"height\": H, \"width\": W}}, an integer or [H, W], got {other}"
            )));
        }
    };
    if height * width > MAX_CONFIG_PIXELS {
        return Err(VisionError::config(format!(
            "`size` must have at most {MAX_CONFIG_PIXELS} pixels, got {height}x{width}"
        )));
    }
    Ok((height, width))
}

impl Gemma3ImageProcessor {
    /// Reads a `preprocessor_config.json` as transformers' `Gemma3ImageProcessorPil` does; keys
    /// it does not read are ignored, and `null` is a missing value.
    pub fn from_json(text: &str) -> Result<Gemma3ImageProcessor, VisionError> {
        Self::from_map(&config_object(text)?)
    }

    fn from_map(config: &Map<String, Value>) -> Result<Gemma3ImageProcessor, VisionError> {
        let defaults = Gemma3ImageProcessor::default();
        let (height, width) = read_target_size(config)?;
        let PixelSettings { image_mean, image_std, rescale_factor, resample } = read_pixel_settings(
            config,
            PixelSettings {
                image_mean: defaults.image_mean,
                image_std: defaults.image_std,
                rescale_factor: defaults.rescale_factor,
                resample: defaults.resample,
            },
        )?;
        let count = |key: &str, default: usize, min: u64, max: u64| -> Result<usize, VisionError> {
            present(config, key).map_or(Ok(default), |v| read_count(v, key, min, max).map(|n| n as usize))
        };
        let pan_and_scan_min_crop_size =
            count("pan_and_scan_min_crop_size", defaults.pan_and_scan_min_crop_size, 1, MAX_SIDE)?;
        let pan_and_scan_max_num_crops =
            count("pan_and_scan_max_num_crops", defaults.pan_and_scan_max_num_crops, 1, MAX_NUM_CROPS)?;
        let pan_and_scan_min_ratio_to_activate = match present(config, "pan_and_scan_min_ratio_to_activate") {
            None => defaults.pan_and_scan_min_ratio_to_activate,
            Some(v) => v.as_f64().filter(|x| x.is_finite() && *x >= 0.0).ok_or_else(|| {
                VisionError::config(format!(
                    "`pan_and_scan_min_ratio_to_activate` must be a nonnegative number, got {v}"
                ))
            })?,
        };
        Ok(Gemma3ImageProcessor {
            height: height as usize,
            width: width as usize,
            resample,
            do_resize: read_bool(config, "do_resize", defaults.do_resize)?,
            do_rescale: read_bool(config, "do_rescale", defaults.do_rescale)?,
            rescale_factor,
            do_normalize: read_bool(config, "do_normalize", defaults.do_normalize)?,
            image_mean,
            image_std,
            do_convert_rgb: read_bool(config, "do_convert_rgb", defaults.do_convert_rgb)?,
            do_pan_and_scan: read_bool(config, "do_pan_and_scan", defaults.do_pan_and_scan)?,
            pan_and_scan_min_crop_size,
            pan_and_scan_max_num_crops,
            pan_and_scan_min_ratio_to_activate,
        })
    }

    /// transformers' `pan_and_scan` on an image of `height` x `width` pixels, whether or not
    /// `do_pan_and_scan` is on: the crops in transformers' order, none when the image is not
    /// elongated enough or the crops would be too small. Python's arithmetic: true division
    /// in f64, `floor(x + 0.5)` for the number of crops, `ceil` for their size.
    pub fn pan_and_scan_crops(&self, height: usize, width: usize) -> Vec<CropBox> {
        if height == 0 || width == 0 {
            return Vec::new();
        }
        let (h, w) = (height as f64, width as f64);
        let min_crop = self.pan_and_scan_min_crop_size as f64;
        let max_crops = self.pan_and_scan_max_num_crops;
        let ratio = self.pan_and_scan_min_ratio_to_activate;
        // The number of crops along the longer side: about its ratio to the shorter side, no
        // more than fit the minimum crop size, from 2 to the maximum.
        let along = |long: f64, short: f64| -> usize {
            let by_ratio = (long / short + 0.5).floor() as usize;
            let by_size = (long / min_crop).floor() as usize;
            by_ratio.min(by_size).max(2).min(max_crops)
        };
        let (crops_h, crops_w) = if width >= height {
            if w / h < ratio {
                return Vec::new();
            }
            (1, along(w, h))
        } else {
            if h / w < ratio {
                return Vec::new();
            }
            (along(h, w), 1)
        };
        let crop_w = (w / crops_w as f64).ceil() as usize;
        let crop_h = (h / crops_h as f64).ceil() as usize;
        if crop_w.min(crop_h) < self.pan_and_scan_min_crop_size {
            return Vec::new();
        }
        // NumPy's slices stop at the image's edge (and start no further than it).
        let clip = |start: usize, len: usize, side: usize| {
            let start = start.min(side);
            (start, (start + len).min(side) - start)
        };
        let mut boxes = Vec::with_capacity(crops_h * crops_w);
        for i in 0..crops_h {
            let (top, height) = clip(crop_h * i, crop_h, height);
            for j in 0..crops_w {
                let (left, width) = clip(crop_w * j, crop_w, width);
                boxes.push(CropBox { top, left, height, width });
            }
        }
        boxes
    }

    /// The SigLIP inputs of one RGB image, as transformers computes them: the whole image,
    /// then its crops when `do_pan_and_scan` is on and the image qualifies.
    pub fn process(&self, image: &RgbImage) -> Result<Gemma3Processed, VisionError> {
        let (height, width) = (image.height() as usize, image.width() as usize);
        if height == 0 || width == 0 {
            return Err(VisionError::shape(format!("cannot process an empty {width}x{height} image")));
        }
        let boxes = if self.do_pan_and_scan { self.pan_and_scan_crops(height, width) } else { Vec::new() };

        // Rescale and normalise: one table per channel over the 256 byte values, each entry
        // computed exactly as NumPy computes the element.
        let lookup: [[f32; 256]; 3] = std::array::from_fn(|channel| {
            let (mean, std) = (self.image_mean[channel] as f32, self.image_std[channel] as f32);
            std::array::from_fn(|byte| {
                let value = if self.do_rescale { (byte as f64 * self.rescale_factor) as f32 } else { byte as f32 };
                if self.do_normalize { (value - mean) / std } else { value }
            })
        });

        let mut images = Vec::with_capacity(1 + boxes.len());
        images.push(self.finish(image, &lookup)?);
        for crop_box in &boxes {
            images.push(self.finish(&crop(image, crop_box)?, &lookup)?);
        }
        Ok(Gemma3Processed { images })
    }

    /// Resizes (when `do_resize`) and turns the bytes into channel-first values.
    fn finish(&self, image: &RgbImage, lookup: &[[f32; 256]; 3]) -> Result<GemmaPixels, VisionError> {
        let resized_image;
        let image = if self.do_resize && (image.height() as usize, image.width() as usize) != (self.height, self.width)
        {
            let (Ok(height), Ok(width)) = (u32::try_from(self.height), u32::try_from(self.width)) else {
                return Err(VisionError::too_large(format!(
                    "the resized image would be {}x{} pixels",
                    self.width, self.height
                )));
            };
            resized_image = resize(image, width, height, self.resample);
            &resized_image
        } else {
            image
        };
        let (height, width) = (image.height() as usize, image.width() as usize);
        let pixels = image.as_raw();
        let mut pixel_values = Vec::with_capacity(3 * height * width);
        for (channel, table) in lookup.iter().enumerate() {
            pixel_values.extend(pixels.chunks_exact(3).map(|rgb| table[rgb[channel] as usize]));
        }
        Ok(GemmaPixels { pixel_values, height, width })
    }
}

/// The pixels of `crop_box`, which lies within `image`.
fn crop(image: &RgbImage, crop_box: &CropBox) -> Result<RgbImage, VisionError> {
    let CropBox { top, left, height, width } = *crop_box;
    let stride = image.width() as usize * 3;
    let source = image.as_raw();
    let mut pixels = Vec::with_capacity(height * width * 3);
    for y in top..top + height {
        let start = y * stride + left * 3;
        let row = source.get(start..start + width * 3).ok_or_else(|| {
            VisionError::shape(format!(
                "the crop {crop_box:?} lies outside the {}x{} image",
                image.width(),
                image.height()
            ))
        })?;
        pixels.extend_from_slice(row);
    }
    // The crop's sides are at most the image's, so they fit in u32.
    RgbImage::from_raw(width as u32, height as u32, pixels)
        .ok_or_else(|| VisionError::shape(format!("the crop {crop_box:?} does not make an image")))
}
