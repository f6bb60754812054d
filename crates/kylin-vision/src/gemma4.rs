//! transformers' Gemma 4 image processor (`Gemma4ImageProcessorPil`), which Gemma 4 checkpoints
//! name in their `preprocessor_config.json`, and the text its processor (`Gemma4Processor`)
//! puts in place of an image.
//!
//! One image becomes a (patches_high * patches_wide, patch_size * patch_size * 3) matrix of f32
//! and the number of soft tokens it takes in the prompt, in four steps:
//!
//! 1. The image is resized, keeping its aspect ratio, to the largest size whose sides are
//!    multiples of `pooling_kernel_size * patch_size` within `max_soft_tokens *
//!    pooling_kernel_size^2` patches ([`Gemma4ImageProcessor::target_size`], transformers'
//!    `get_aspect_ratio_preserving_size` in Python's arithmetic), with Pillow's resize (the
//!    config's filter, bicubic by default), and only when that size differs from the image's.
//! 2. The bytes are rescaled (`u8 as f64 * rescale_factor`, then to f32) and, only when
//!    `do_normalize` is on (Gemma 4's configs leave it off), normalised in f32 per channel
//!    (`(x - mean) / std`), in NumPy's order and precision as in [`crate::Gemma3ImageProcessor`].
//! 3. The image is cut into patches of `patch_size` x `patch_size`: row-major over the patch
//!    grid, and within a patch by (row, column, channel), the channel last (transformers'
//!    `convert_image_to_patches`, a transpose (1, 3, 2, 4, 0) of the channel-first image).
//! 4. The soft tokens are the patches pooled `pooling_kernel_size` by `pooling_kernel_size`.
//!
//! The position of patch `i` is `(i % patches_wide, i / patches_wide)`, as (x, y)
//! ([`Gemma4Processed::patch_position`]), transformers' `image_position_ids`.
//!
//! Note: transformers pads every image's patches to `max_soft_tokens * pooling_kernel_size^2`
//! rows with zeros, at position (-1, -1), so that a batch stacks into one array. Kylin does not
//! pad: [`Gemma4Processed`] holds the real patches only, and the engine, which drops the
//! padding anyway, adds none.

use serde_json::{Map, Value};

use crate::error::VisionError;
use crate::qwen::{PixelSettings, config_object, present, read_bool, read_count, read_pixel_settings};
use crate::resample::{ResampleFilter, resize};
use image::RgbImage;

/// The values transformers accepts for `max_soft_tokens`.
pub const GEMMA4_SUPPORTED_SOFT_TOKENS: [usize; 5] = [70, 140, 280, 560, 1120];

/// The class defaults: patches of 16 pooled 3 by 3, at most 280 soft tokens.
const DEFAULT_PATCH_SIZE: usize = 16;
const DEFAULT_POOLING_KERNEL_SIZE: usize = 3;
const DEFAULT_MAX_SOFT_TOKENS: usize = 280;

/// Bounds on the patch geometry read from a config (Gemma 4 uses patches of 16 pooled 3 by 3).
const MAX_PATCH_SIZE: u64 = 64;
const MAX_POOLING_KERNEL_SIZE: u64 = 8;
/// The most pixels a config may resize an image to, `max_soft_tokens * pooling_kernel_size^2 *
/// patch_size^2` (Gemma 4's largest, 1120 soft tokens, is 2580480): it bounds every buffer the
/// processor allocates when resizing.
const MAX_TARGET_PIXELS: u64 = 1 << 25;
/// The largest `height * width` whose arithmetic in f64 is exact, as Python's on integers is.
const MAX_EXACT: u64 = 1 << 53;

/// What one image becomes: its patches, without transformers' padding (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Processed {
    /// (patches_high * patches_wide, patch_size * patch_size * 3), row-major patches, channel last inside a patch.
    pub pixel_values: Vec<f32>,
    pub patches_high: usize,
    pub patches_wide: usize,
    pub patch_size: usize,
    pub pooling_kernel_size: usize,
}

impl Gemma4Processed {
    /// The number of rows of `pixel_values`, one per patch.
    pub fn num_patches(&self) -> usize {
        self.patches_high * self.patches_wide
    }

    /// The number of soft tokens the image takes in the prompt (transformers'
    /// `num_soft_tokens_per_image`): the patches pooled `pooling_kernel_size` by
    /// `pooling_kernel_size`.
    pub fn num_soft_tokens(&self) -> usize {
        self.num_patches() / (self.pooling_kernel_size * self.pooling_kernel_size).max(1)
    }

    /// The number of columns of `pixel_values`: `patch_size * patch_size * 3`.
    pub fn patch_dim(&self) -> usize {
        self.patch_size * self.patch_size * 3
    }

    /// The position of patch `index` as transformers gives it in `image_position_ids`: (x, y),
    /// the patch's column and row in the grid.
    pub fn patch_position(&self, index: usize) -> (usize, usize) {
        let wide = self.patches_wide.max(1);
        (index % wide, index / wide)
    }
}

/// The text `Gemma4Processor` (`replace_image_token`) writes in place of one image token:
/// `boi`, then `image_token` `num_soft_tokens` times, then `eoi`, with nothing between them.
pub fn gemma4_image_sequence(boi: &str, image_token: &str, eoi: &str, num_soft_tokens: usize) -> String {
    let mut text = String::with_capacity(boi.len() + eoi.len() + image_token.len().saturating_mul(num_soft_tokens));
    text.push_str(boi);
    for _ in 0..num_soft_tokens {
        text.push_str(image_token);
    }
    text.push_str(eoi);
    text
}

/// The settings of a Gemma 4 `preprocessor_config.json`, every missing field at transformers'
/// default.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4ImageProcessor {
    pub patch_size: usize,
    /// The most soft tokens an image becomes: one of [`GEMMA4_SUPPORTED_SOFT_TOKENS`].
    pub max_soft_tokens: usize,
    pub pooling_kernel_size: usize,
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
}

impl Default for Gemma4ImageProcessor {
    /// transformers' class defaults: patches of 16 pooled 3 by 3, 280 soft tokens, bicubic,
    /// rescaled to [0, 1] and not normalised (mean 0, std 1).
    fn default() -> Self {
        Gemma4ImageProcessor {
            patch_size: DEFAULT_PATCH_SIZE,
            max_soft_tokens: DEFAULT_MAX_SOFT_TOKENS,
            pooling_kernel_size: DEFAULT_POOLING_KERNEL_SIZE,
            resample: ResampleFilter::Bicubic,
            do_resize: true,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: false,
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
            do_convert_rgb: true,
        }
    }
}

impl Gemma4ImageProcessor {
    /// Reads a `preprocessor_config.json` as transformers' `Gemma4ImageProcessorPil` does; keys
    /// it does not read (`size` among them: Gemma 4 sizes images by its patch budget) are
    /// ignored, and `null` is a missing value. `max_soft_tokens` must be one of
    /// [`GEMMA4_SUPPORTED_SOFT_TOKENS`], as transformers requires.
    pub fn from_json(text: &str) -> Result<Gemma4ImageProcessor, VisionError> {
        Self::from_map(&config_object(text)?)
    }

    fn from_map(config: &Map<String, Value>) -> Result<Gemma4ImageProcessor, VisionError> {
        let defaults = Gemma4ImageProcessor::default();
        let PixelSettings { image_mean, image_std, rescale_factor, resample } = read_pixel_settings(
            config,
            PixelSettings {
                image_mean: defaults.image_mean,
                image_std: defaults.image_std,
                rescale_factor: defaults.rescale_factor,
                resample: defaults.resample,
            },
        )?;
        let count = |key: &str, default: usize, max: u64| -> Result<usize, VisionError> {
            present(config, key).map_or(Ok(default), |v| read_count(v, key, 1, max).map(|n| n as usize))
        };
        let patch_size = count("patch_size", defaults.patch_size, MAX_PATCH_SIZE)?;
        let pooling_kernel_size = count("pooling_kernel_size", defaults.pooling_kernel_size, MAX_POOLING_KERNEL_SIZE)?;
        let max_soft_tokens = match present(config, "max_soft_tokens") {
            None => defaults.max_soft_tokens,
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| GEMMA4_SUPPORTED_SOFT_TOKENS.contains(n))
                .ok_or_else(|| {
                    VisionError::config(format!(
                        "`max_soft_tokens` must be one of {GEMMA4_SUPPORTED_SOFT_TOKENS:?}, got {v}"
                    ))
                })?,
        };
        let processor = Gemma4ImageProcessor {
            patch_size,
            max_soft_tokens,
            pooling_kernel_size,
            resample,
            do_resize: read_bool(config, "do_resize", defaults.do_resize)?,
            do_rescale: read_bool(config, "do_rescale", defaults.do_rescale)?,
            rescale_factor,
            do_normalize: read_bool(config, "do_normalize", defaults.do_normalize)?,
            image_mean,
            image_std,
            do_convert_rgb: read_bool(config, "do_convert_rgb", defaults.do_convert_rgb)?,
        };
        processor.target_pixels()?;
        Ok(processor)
    }

    /// The patch geometry, checked (the fields are public, so they are checked on every use):
    /// `(patch_size, pooling_kernel_size * patch_size, max_patches * patch_size^2)`.
    fn target_pixels(&self) -> Result<(u64, u64, u64), VisionError> {
        let (patch, kernel) = (self.patch_size as u64, self.pooling_kernel_size as u64);
        if !(1..=MAX_PATCH_SIZE).contains(&patch) {
            return Err(VisionError::config(format!(
                "`patch_size` must be an integer from 1 to {MAX_PATCH_SIZE}, got {patch}"
            )));
        }
        if !(1..=MAX_POOLING_KERNEL_SIZE).contains(&kernel) {
            return Err(VisionError::config(format!(
                "`pooling_kernel_size` must be an integer from 1 to {MAX_POOLING_KERNEL_SIZE}, got {kernel}"
            )));
        }
        if !GEMMA4_SUPPORTED_SOFT_TOKENS.contains(&self.max_soft_tokens) {
            return Err(VisionError::config(format!(
                "`max_soft_tokens` must be one of {GEMMA4_SUPPORTED_SOFT_TOKENS:?}, got {}",
                self.max_soft_tokens
            )));
        }
        let side_mult = kernel * patch;
        // At most 1120 * 8^2 * 64^2: no overflow.
        let target_px = self.max_soft_tokens as u64 * side_mult * side_mult;
        if target_px > MAX_TARGET_PIXELS {
            return Err(VisionError::config(format!(
                "`max_soft_tokens` {} with `pooling_kernel_size` {kernel} and `patch_size` {patch} would resize \
                 images to {target_px} pixels, more than {MAX_TARGET_PIXELS}",
                self.max_soft_tokens
            )));
        }
        Ok((patch, side_mult, target_px))
    }

    /// (height, width) after the aspect-ratio-preserving resize.
    ///
    /// transformers' `get_aspect_ratio_preserving_size`, in Python's arithmetic (the integers
    /// involved are below 2^53, so f64 computes every division and product as Python does):
    /// the image is scaled by `sqrt(max_patches * patch_size^2 / (height * width))` and each
    /// side floored to a multiple of `pooling_kernel_size * patch_size`. A side that floors to
    /// 0 becomes one multiple, and the other `floor(long / short)` multiples, at most
    /// `max_soft_tokens` of them. The sizes transformers refuses (both sides 0, or more than
    /// `max_patches` patches: neither happens for sides of at least one pixel) are refused
    /// with `IMAGE_SHAPE`, as are empty images and ones too large for exact arithmetic. This is
    /// the size whether or not `do_resize` is on.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize), VisionError> {
        let (_, side_mult, target_px) = self.target_pixels()?;
        if height == 0 || width == 0 {
            return Err(VisionError::shape(format!("cannot process an empty {width}x{height} image")));
        }
        let (h, w) = (height as u64, width as u64);
        let total_px = h.checked_mul(w).filter(|&n| n <= MAX_EXACT).ok_or_else(|| {
            VisionError::too_large(format!("the image is {width}x{height} pixels, too many to resize"))
        })?;
        let factor = (target_px as f64 / total_px as f64).sqrt();
        let (ideal_height, ideal_width) = (factor * h as f64, factor * w as f64);
        let side = side_mult as f64;
        // Both are at most sqrt(target_px * max(h, w)) / side_mult, far below u64::MAX.
        let mut target_height = (ideal_height / side).floor() as u64 * side_mult;
        let mut target_width = (ideal_width / side).floor() as u64 * side_mult;
        if target_height == 0 && target_width == 0 {
            return Err(VisionError::shape(format!(
                "resizing the {width}x{height} image would give a 0 x 0 image: the resized sides must be \
                 multiples of `pooling_kernel_size * patch_size` = {side_mult}"
            )));
        }
        let max_side_length = self.max_soft_tokens as u64 * side_mult;
        if target_height == 0 {
            target_height = side_mult;
            target_width = ((w as f64 / h as f64).floor() as u64).saturating_mul(side_mult).min(max_side_length);
        } else if target_width == 0 {
            target_width = side_mult;
            target_height = ((h as f64 / w as f64).floor() as u64).saturating_mul(side_mult).min(max_side_length);
        }
        if target_height.saturating_mul(target_width) > target_px {
            return Err(VisionError::shape(format!(
                "resizing the {width}x{height} image to {target_width}x{target_height} would exceed {} patches \
                 of {}",
                target_px / (self.patch_size * self.patch_size) as u64,
                self.patch_size
            )));
        }
        // At most target_px, which fits in usize.
        Ok((target_height as usize, target_width as usize))
    }

    /// The (height, width) [`Gemma4ImageProcessor::process`] cuts into patches: the target
    /// size when `do_resize` is on, else the image's own size, which must then be a multiple
    /// of `pooling_kernel_size * patch_size` on both sides.
    ///
    /// Without resizing transformers fails (NumPy's reshape) on a side that is not a multiple
    /// of `patch_size`, and on a multiple of `patch_size` that is not one of
    /// `pooling_kernel_size * patch_size` it floors the soft tokens (`num_patches //
    /// pooling_kernel_size^2`), a count the encoder's pooling does not give: Kylin refuses
    /// both with `IMAGE_SHAPE`. Without resizing an image may have more than `max_soft_tokens`
    /// soft tokens, as in transformers (which then does not pad it).
    fn patched_size(&self, height: usize, width: usize) -> Result<(usize, usize), VisionError> {
        if self.do_resize {
            return self.target_size(height, width);
        }
        let (_, side_mult, _) = self.target_pixels()?;
        if height == 0 || width == 0 {
            return Err(VisionError::shape(format!("cannot process an empty {width}x{height} image")));
        }
        let side_mult = side_mult as usize;
        if !height.is_multiple_of(side_mult) || !width.is_multiple_of(side_mult) {
            return Err(VisionError::shape(format!(
                "with `do_resize` off the image's sides must be multiples of `pooling_kernel_size * patch_size` = \
                 {side_mult}, got {width}x{height}"
            )));
        }
        Ok((height, width))
    }

    /// The soft tokens an image of this size becomes (transformers' num_soft_tokens_per_image).
    pub fn num_soft_tokens(&self, height: usize, width: usize) -> Result<usize, VisionError> {
        let (height, width) = self.patched_size(height, width)?;
        let patches = (height / self.patch_size) * (width / self.patch_size);
        Ok(patches / (self.pooling_kernel_size * self.pooling_kernel_size))
    }

    /// The patches of one RGB image, as transformers computes them (without its padding).
    pub fn process(&self, image: &RgbImage) -> Result<Gemma4Processed, VisionError> {
        let (height, width) = (image.height() as usize, image.width() as usize);
        let (target_height, target_width) = self.patched_size(height, width)?;
        let resized_image;
        let image = if (target_height, target_width) != (height, width) {
            let (Ok(h), Ok(w)) = (u32::try_from(target_height), u32::try_from(target_width)) else {
                return Err(VisionError::too_large(format!(
                    "the resized image would be {target_width}x{target_height} pixels"
                )));
            };
            resized_image = resize(image, w, h, self.resample);
            &resized_image
        } else {
            image
        };

        // Rescale and normalise: one table per channel over the 256 byte values, each entry
        // computed exactly as NumPy computes the element.
        let lookup: [[f32; 256]; 3] = std::array::from_fn(|channel| {
            let (mean, std) = (self.image_mean[channel] as f32, self.image_std[channel] as f32);
            std::array::from_fn(|byte| {
                let value = if self.do_rescale { (byte as f64 * self.rescale_factor) as f32 } else { byte as f32 };
                if self.do_normalize { (value - mean) / std } else { value }
            })
        });

        // The image holds target_height * target_width * 3 bytes, so the f32s fit in memory's
        // bounds; every index below is within them (the sides are multiples of patch_size).
        let patch = self.patch_size;
        let (patches_high, patches_wide) = (target_height / patch, target_width / patch);
        let pixels = image.as_raw();
        let stride = target_width * 3;
        let mut pixel_values = Vec::with_capacity(target_height * target_width * 3);
        for row in 0..patches_high {
            for column in 0..patches_wide {
                for y in row * patch..(row + 1) * patch {
                    let start = y * stride + column * patch * 3;
                    let line = pixels
                        .get(start..start + patch * 3)
                        .ok_or_else(|| VisionError::shape(format!("patch ({column}, {row}) lies outside the image")))?;
                    pixel_values.extend(line.chunks_exact(3).flat_map(|rgb| {
                        [lookup[0][rgb[0] as usize], lookup[1][rgb[1] as usize], lookup[2][rgb[2] as usize]]
                    }));
                }
            }
        }
        Ok(Gemma4Processed {
            pixel_values,
            patches_high,
            patches_wide,
            patch_size: patch,
            pooling_kernel_size: self.pooling_kernel_size,
        })
    }
}
