//! transformers' Qwen2-VL image processor (`Qwen2VLImageProcessorPil`), which Qwen2-VL,
//! Qwen2.5-VL, Qwen3-VL and Qwen3.5 checkpoints name in their `preprocessor_config.json`.
//!
//! One image becomes `pixel_values`, a (grid_t * grid_h * grid_w, 3 * temporal_patch_size *
//! patch_size^2) matrix of f32, and `image_grid_thw`, in five steps: `smart_resize` picks a
//! size whose sides are multiples of `patch_size * merge_size` with a pixel count within
//! `[min_pixels, max_pixels]`; Pillow's resize (the config's filter, bicubic by default) makes
//! it; the bytes are rescaled (`u8 as f64 * rescale_factor`, then to f32) and normalised in f32
//! per channel (`(x - mean) / std`), as NumPy computes them; the single image is repeated to
//! `temporal_patch_size` frames (so `grid_t` is 1); and the patches are flattened in
//! transformers' order: rows by (merged block row, merged block column, row in block, column in
//! block), columns by (channel, frame, row in patch, column in patch).

use serde_json::{Map, Value};

use crate::error::VisionError;
use crate::resample::{ResampleFilter, resize};
use image::RgbImage;

/// transformers' `OPENAI_CLIP_MEAN` and `OPENAI_CLIP_STD`, the class defaults.
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// The class defaults of `size`: 56 * 56 and 28 * 28 * 1280 pixels.
const DEFAULT_MIN_PIXELS: u64 = 56 * 56;
const DEFAULT_MAX_PIXELS: u64 = 28 * 28 * 1280;

/// The largest `max_pixels` accepted, twice Qwen3.5's 16777216: it bounds every buffer the
/// processor allocates.
const MAX_CONFIG_PIXELS: u64 = 1 << 25;
/// Bounds on the patch geometry (Qwen uses 14 or 16, merged 2 by 2, over 2 frames).
const MAX_PATCH_SIZE: u64 = 64;
const MAX_MERGE_SIZE: u64 = 8;
const MAX_TEMPORAL_PATCH_SIZE: u64 = 16;
/// transformers refuses images whose longer side is more than 200 times the shorter.
const MAX_ASPECT_RATIO: f64 = 200.0;

/// One image ready for the vision encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedImage {
    /// Row-major (grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size^2).
    pub pixel_values: Vec<f32>,
    /// `image_grid_thw`: frames, patch rows and patch columns.
    pub grid_thw: [usize; 3],
    /// The number of columns of `pixel_values`.
    pub patch_dim: usize,
    /// `merge_size`, for [`ProcessedImage::num_image_tokens`].
    pub merge_size: usize,
}

impl ProcessedImage {
    /// The number of rows of `pixel_values`, one per patch.
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// The number of tokens the image takes in the language model's prompt: the patches merged
    /// `merge_size` by `merge_size`.
    pub fn num_image_tokens(&self) -> usize {
        self.num_patches() / (self.merge_size * self.merge_size)
    }
}

/// The settings of a `preprocessor_config.json`, every missing field at transformers' default.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenImageProcessor {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// `size.shortest_edge`, or `min_pixels`: the fewest pixels after resizing.
    pub min_pixels: u64,
    /// `size.longest_edge`, or `max_pixels`: the most pixels after resizing.
    pub max_pixels: u64,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
    /// Read for completeness: [`crate::decode_image`] always converts to RGB, since the
    /// encoder reads three channels.
    pub do_convert_rgb: bool,
    pub resample: ResampleFilter,
}

impl Default for QwenImageProcessor {
    /// transformers' class defaults (Qwen2-VL's: patches of 14).
    fn default() -> Self {
        QwenImageProcessor {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: DEFAULT_MIN_PIXELS,
            max_pixels: DEFAULT_MAX_PIXELS,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
            do_convert_rgb: true,
            resample: ResampleFilter::Bicubic,
        }
    }
}

pub(crate) fn present<'a>(config: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    config.get(key).filter(|v| !v.is_null())
}

pub(crate) fn read_bool(config: &Map<String, Value>, key: &str, default: bool) -> Result<bool, VisionError> {
    match present(config, key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(VisionError::config(format!("`{key}` must be true or false, got {other}"))),
    }
}

pub(crate) fn read_count(value: &Value, key: &str, min: u64, max: u64) -> Result<u64, VisionError> {
    match value.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(VisionError::config(format!("`{key}` must be an integer from {min} to {max}, got {value}"))),
    }
}

fn read_size(config: &Map<String, Value>, key: &str, default: u64, min: u64, max: u64) -> Result<u64, VisionError> {
    present(config, key).map_or(Ok(default), |v| read_count(v, key, min, max))
}

/// A mean or std: one number for every channel, or a list of three.
pub(crate) fn read_channels(
    config: &Map<String, Value>,
    key: &str,
    default: [f64; 3],
) -> Result<[f64; 3], VisionError> {
    let finite = |v: &Value| v.as_f64().filter(|x| x.is_finite());
    let values = match present(config, key) {
        None => return Ok(default),
        Some(Value::Array(items)) if items.len() == 3 => {
            let mut out = [0.0; 3];
            for (slot, item) in out.iter_mut().zip(items) {
                *slot = finite(item).ok_or_else(|| {
                    VisionError::config(format!(
                        "`{key}` must hold three finite numbers, got {}",
                        Value::Array(items.clone())
                    ))
                })?;
            }
            out
        }
        Some(Value::Array(items)) => {
            return Err(VisionError::config(format!(
                "`{key}` must have 3 elements (one per RGB channel), got {}",
                items.len()
            )));
        }
        Some(other) => {
            let x = finite(other).ok_or_else(|| {
                VisionError::config(format!("`{key}` must be a number or a list of three, got {other}"))
            })?;
            [x; 3]
        }
    };
    Ok(values)
}

/// The JSON object of a `preprocessor_config.json` (`PREPROCESSOR_CONFIG` when it is not one).
pub(crate) fn config_object(text: &str) -> Result<Map<String, Value>, VisionError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| VisionError::config(format!("preprocessor_config.json is not valid JSON: {e}")))?;
    match value {
        Value::Object(config) => Ok(config),
        other => Err(VisionError::config(format!("preprocessor_config.json must be a JSON object, got {other}"))),
    }
}

/// The settings every image processor reads alike, each at its class default when absent.
pub(crate) struct PixelSettings {
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub rescale_factor: f64,
    pub resample: ResampleFilter,
}

/// Reads `image_mean`, `image_std` (no channel zero), `rescale_factor` (positive) and
/// `resample` (a filter Kylin implements), each at `defaults`' value when absent.
pub(crate) fn read_pixel_settings(
    config: &Map<String, Value>,
    defaults: PixelSettings,
) -> Result<PixelSettings, VisionError> {
    let image_mean = read_channels(config, "image_mean", defaults.image_mean)?;
    let image_std = read_channels(config, "image_std", defaults.image_std)?;
    if image_std.iter().any(|&s| s as f32 == 0.0) {
        return Err(VisionError::config(format!("`image_std` must not be zero, got {image_std:?}")));
    }
    let rescale_factor = match present(config, "rescale_factor") {
        None => defaults.rescale_factor,
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| VisionError::config(format!("`rescale_factor` must be a positive number, got {v}")))?,
    };
    let resample = match present(config, "resample") {
        None => defaults.resample,
        Some(v) => v.as_i64().and_then(ResampleFilter::from_pillow).ok_or_else(|| {
            VisionError::config(format!(
                "`resample` must be 2 (bilinear) or 3 (bicubic), the filters Kylin implements, got {v}"
            ))
        })?,
    };
    Ok(PixelSettings { image_mean, image_std, rescale_factor, resample })
}

impl QwenImageProcessor {
    /// Reads a `preprocessor_config.json` as transformers' `Qwen2VLImageProcessorPil` does:
    /// `size: {shortest_edge, longest_edge}` (without it, the class default), overridden by
    /// `min_pixels` / `max_pixels` where given; keys it does not read are ignored, and `null`
    /// is a missing value.
    pub fn from_json(text: &str) -> Result<QwenImageProcessor, VisionError> {
        Self::from_map(&config_object(text)?)
    }

    fn from_map(config: &Map<String, Value>) -> Result<QwenImageProcessor, VisionError> {
        let defaults = QwenImageProcessor::default();
        let patch_size = read_size(config, "patch_size", defaults.patch_size as u64, 1, MAX_PATCH_SIZE)?;
        let temporal_patch_size =
            read_size(config, "temporal_patch_size", defaults.temporal_patch_size as u64, 1, MAX_TEMPORAL_PATCH_SIZE)?;
        let merge_size = read_size(config, "merge_size", defaults.merge_size as u64, 1, MAX_MERGE_SIZE)?;

        // The pixel range: `size` replaces the default as a whole (transformers does not merge
        // a partial `size` with the default), then the flat keys override it.
        let (mut min_pixels, mut max_pixels) = (Some(DEFAULT_MIN_PIXELS), Some(DEFAULT_MAX_PIXELS));
        if let Some(size) = present(config, "size") {
            let Value::Object(size) = size else {
                return Err(VisionError::config(format!(
                    "`size` must be an object with `shortest_edge` and `longest_edge`, got {size}"
                )));
            };
            let edge =
                |key: &str| present(size, key).map(|v| read_count(v, &format!("size.{key}"), 0, u64::MAX)).transpose();
            min_pixels = edge("shortest_edge")?;
            max_pixels = edge("longest_edge")?;
        }
        if let Some(v) = present(config, "min_pixels") {
            min_pixels = Some(read_count(v, "min_pixels", 0, u64::MAX)?);
        }
        if let Some(v) = present(config, "max_pixels") {
            max_pixels = Some(read_count(v, "max_pixels", 0, u64::MAX)?);
        }
        let do_resize = read_bool(config, "do_resize", defaults.do_resize)?;
        let (min_pixels, max_pixels) = match (min_pixels, max_pixels) {
            (Some(lo), Some(hi)) if lo > 0 && hi > 0 => (lo, hi),
            _ if !do_resize => (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS),
            (lo, hi) => {
                return Err(VisionError::config(format!(
                    "`size` must have nonzero `shortest_edge` and `longest_edge` (or `min_pixels` and \
                     `max_pixels`), got shortest_edge {lo:?} and longest_edge {hi:?}"
                )));
            }
        };
        if min_pixels > max_pixels || max_pixels > MAX_CONFIG_PIXELS {
            return Err(VisionError::config(format!(
                "the pixel range must satisfy 0 < min_pixels <= max_pixels <= {MAX_CONFIG_PIXELS}, got \
                 min_pixels {min_pixels} and max_pixels {max_pixels}"
            )));
        }

        let PixelSettings { image_mean, image_std, rescale_factor, resample } = read_pixel_settings(
            config,
            PixelSettings {
                image_mean: defaults.image_mean,
                image_std: defaults.image_std,
                rescale_factor: defaults.rescale_factor,
                resample: defaults.resample,
            },
        )?;
        Ok(QwenImageProcessor {
            patch_size: patch_size as usize,
            temporal_patch_size: temporal_patch_size as usize,
            merge_size: merge_size as usize,
            min_pixels,
            max_pixels,
            image_mean,
            image_std,
            rescale_factor,
            do_resize,
            do_rescale: read_bool(config, "do_rescale", defaults.do_rescale)?,
            do_normalize: read_bool(config, "do_normalize", defaults.do_normalize)?,
            do_convert_rgb: read_bool(config, "do_convert_rgb", defaults.do_convert_rgb)?,
            resample,
        })
    }

    /// The side every resized dimension is a multiple of.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// The (height, width) an image of this size is resized to.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize), VisionError> {
        if !self.do_resize {
            let factor = self.factor();
            if !height.is_multiple_of(factor) || !width.is_multiple_of(factor) {
                return Err(VisionError::shape(format!(
                    "with `do_resize` off the image's sides must be multiples of patch_size * merge_size = \
                     {factor}, got {width}x{height}"
                )));
            }
            return Ok((height, width));
        }
        smart_resize(height, width, self.factor(), self.min_pixels, self.max_pixels)
    }

    /// `pixel_values` and `image_grid_thw` of one RGB image, as transformers computes them.
    pub fn process(&self, image: &RgbImage) -> Result<ProcessedImage, VisionError> {
        // 1. The size, then Pillow's resize.
        let (height, width) = self.target_size(image.height() as usize, image.width() as usize)?;
        let (Ok(height_u32), Ok(width_u32)) = (u32::try_from(height), u32::try_from(width)) else {
            return Err(VisionError::too_large(format!("the resized image would be {width}x{height} pixels")));
        };
        let resized_image;
        let resized = if (height, width) == (image.height() as usize, image.width() as usize) {
            image
        } else {
            resized_image = resize(image, width_u32, height_u32, self.resample);
            &resized_image
        };

        // 2. Rescale and normalise: one table per channel over the 256 byte values, each
        // entry computed exactly as NumPy computes the element.
        let lookup: [[f32; 256]; 3] = std::array::from_fn(|channel| {
            let (mean, std) = (self.image_mean[channel] as f32, self.image_std[channel] as f32);
            std::array::from_fn(|byte| {
                let value = if self.do_rescale { (byte as f64 * self.rescale_factor) as f32 } else { byte as f32 };
                if self.do_normalize { (value - mean) / std } else { value }
            })
        });

        // 3. Patches: (C, H, W) -> (gh/m, gw/m, m, m, C, T, p, p) flattened to
        // (gh * gw, C * T * p * p); every frame is the same image.
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (grid_h, grid_w) = (height / p, width / p);
        let patch_dim = 3 * t * p * p;
        let pixels = resized.as_raw();
        let mut pixel_values = Vec::with_capacity(grid_h * grid_w * patch_dim);
        for block_row in 0..grid_h / m {
            for block_col in 0..grid_w / m {
                for row_in_block in 0..m {
                    for col_in_block in 0..m {
                        let top = (block_row * m + row_in_block) * p;
                        let left = (block_col * m + col_in_block) * p;
                        for (channel, table) in lookup.iter().enumerate() {
                            for _frame in 0..t {
                                for y in top..top + p {
                                    let row = &pixels[(y * width + left) * 3..(y * width + left + p) * 3];
                                    pixel_values.extend(row.chunks_exact(3).map(|rgb| table[rgb[channel] as usize]));
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(ProcessedImage { pixel_values, grid_thw: [1, grid_h, grid_w], patch_dim, merge_size: m })
    }
}

/// transformers' `smart_resize`: the (height, width) nearest the image's with both sides
/// multiples of `factor` and `min_pixels <= height * width <= max_pixels` where rounding
/// allows, in Python's arithmetic (true division in f64, `round` to even, `floor`, `ceil`).
/// Refuses, as transformers does, an aspect ratio over 200.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize), VisionError> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(VisionError::shape(format!("cannot resize a {width}x{height} image to multiples of {factor}")));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > MAX_ASPECT_RATIO {
        return Err(VisionError::shape(format!(
            "the image is {width}x{height}, an aspect ratio of {ratio}; the ratio must be at most 200"
        )));
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    let (lo, hi) = (min_pixels as f64, max_pixels as f64);
    let pixels = h * w;
    if h_bar * w_bar > hi {
        let beta = (pixels / hi).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < lo {
        let beta = (lo / pixels).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    // The sides are whole multiples of `factor`, at least `factor`, and bounded by the pixel
    // range and the aspect ratio, so the conversions are exact.
    Ok((h_bar as usize, w_bar as usize))
}
