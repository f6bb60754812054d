//! Bounded decoding of image files to RGB.
//!
//! Only PNG, JPEG and WebP are accepted, recognised by their magic bytes (a file name or a
//! declared media type is never trusted). The encoded size is checked first, then the
//! dimensions the header declares, and only then is the image decoded, with the decoder's own
//! allocations capped too: a few bytes that claim a 100000 x 100000 image are refused without
//! allocating it.
//!
//! JPEG files are decoded by libjpeg-turbo's decoder (`crate::jpeg`), the one Pillow uses, so
//! their bytes equal Pillow's exactly; PNG and WebP by the `image` crate (png and image-webp),
//! whose output equals Pillow's too.
//!
//! The conversion to RGB is transformers' `convert_to_rgb` on the image Pillow opens: images
//! with an alpha channel (or a PNG `tRNS` chunk) are composited onto opaque white with Pillow's
//! integer `alpha_composite`, 16-bit samples are reduced the way Pillow's PNG reader and its
//! `I;16` to `RGB` conversion reduce them, and grayscale is repeated into the three channels.

use std::io::Cursor;

use image::{DynamicImage, ImageError, ImageFormat, ImageReader, Limits, RgbImage};

use crate::error::VisionError;

/// What an image file may be. The defaults suit a server: 20 MiB of encoded bytes and 50
/// megapixels once decoded (Pillow's own decompression-bomb error starts at about 179).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// The largest encoded file, in bytes.
    pub max_bytes: usize,
    /// The largest decoded image, in pixels (width * height).
    pub max_pixels: u64,
    /// The longest side of the decoded image, in pixels.
    pub max_side: u32,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits { max_bytes: 20 << 20, max_pixels: 50_000_000, max_side: 65_500 }
    }
}

/// The image formats Kylin decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormatKind {
    Png,
    Jpeg,
    WebP,
}

impl ImageFormatKind {
    pub fn name(self) -> &'static str {
        match self {
            ImageFormatKind::Png => "PNG",
            ImageFormatKind::Jpeg => "JPEG",
            ImageFormatKind::WebP => "WebP",
        }
    }

    fn image_format(self) -> ImageFormat {
        match self {
            ImageFormatKind::Png => ImageFormat::Png,
            // JPEG files go to libjpeg-turbo's decoder (crate::jpeg), never to `image`.
            ImageFormatKind::Jpeg => ImageFormat::Jpeg,
            ImageFormatKind::WebP => ImageFormat::WebP,
        }
    }
}

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";

/// The format of an image file from its first bytes, or `IMAGE_FORMAT` naming what the bytes
/// look like instead.
pub fn sniff_format(bytes: &[u8]) -> Result<ImageFormatKind, VisionError> {
    if bytes.starts_with(PNG_MAGIC) {
        return Ok(ImageFormatKind::Png);
    }
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return Ok(ImageFormatKind::Jpeg);
    }
    if bytes.len() >= 12 && &bytes[0..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        return Ok(ImageFormatKind::WebP);
    }
    Err(VisionError::format(format!("expected a PNG, JPEG or WebP image, got {}", describe_other_format(bytes))))
}

/// Names the formats people commonly send instead, for the refusal's message.
fn describe_other_format(bytes: &[u8]) -> String {
    let starts = |magic: &[u8]| bytes.starts_with(magic);
    let known = if bytes.is_empty() {
        "an empty file"
    } else if starts(b"GIF87a") || starts(b"GIF89a") {
        "a GIF image"
    } else if starts(b"BM") {
        "a BMP image"
    } else if starts(b"II*\0") || starts(b"MM\0*") {
        "a TIFF image"
    } else if bytes.len() >= 12 && &bytes[4..8] == b"ftyp" {
        "an ISO media file (AVIF, HEIC or video)"
    } else if starts(b"%PDF") {
        "a PDF document"
    } else if starts(b"<svg") || starts(b"<?xml") {
        "an SVG or XML document"
    } else if starts(b"\0\0\x01\0") {
        "an ICO image"
    } else if starts(b"RIFF") {
        "a RIFF file that is not WebP"
    } else {
        let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        return format!("an unknown format (first bytes {})", head.join(" "));
    };
    known.to_string()
}

/// Decodes a PNG, JPEG or WebP file into RGB within `limits`, converting as transformers'
/// `convert_to_rgb` does.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, VisionError> {
    // 1. The encoded size and the format, from the bytes alone.
    if bytes.len() > limits.max_bytes {
        return Err(VisionError::too_large(format!(
            "the image file is {} bytes; the limit is {} bytes",
            bytes.len(),
            limits.max_bytes
        )));
    }
    let kind = sniff_format(bytes)?;
    if kind == ImageFormatKind::Jpeg {
        // libjpeg-turbo's decoder, as Pillow's; it checks the header's dimensions itself.
        return crate::jpeg::decode_jpeg(bytes, limits);
    }

    // 2. The dimensions the header declares, read without decoding the pixels.
    let header = ImageReader::with_format(Cursor::new(bytes), kind.image_format());
    let (width, height) = header.into_dimensions().map_err(|e| decoder_error(kind, e))?;
    check_dimensions(kind, width, height, limits)?;

    // 3. The pixels, the decoder held to these dimensions and to a memory budget they imply
    // (the decoded image in 16-bit RGBA, twice over, plus room for the decoder's tables).
    let mut decoder_limits = Limits::default();
    decoder_limits.max_image_width = Some(width);
    decoder_limits.max_image_height = Some(height);
    decoder_limits.max_alloc = Some(u64::from(width) * u64::from(height) * 16 + (64 << 20));
    let mut reader = ImageReader::with_format(Cursor::new(bytes), kind.image_format());
    reader.limits(decoder_limits);
    let image = reader.decode().map_err(|e| decoder_error(kind, e))?;
    if (image.width(), image.height()) != (width, height) {
        return Err(VisionError::decode(format!(
            "the {} header declares {width}x{height} pixels but {}x{} were decoded",
            kind.name(),
            image.width(),
            image.height()
        )));
    }
    Ok(to_rgb_like_transformers(image))
}

/// Whether an end-of-image marker (`FF D9`) follows the JPEG's first start-of-scan. The marker
/// segments before the scan are walked by their lengths, so the end marker of an embedded
/// thumbnail (inside an APP1 segment) does not count; inside entropy-coded data a `FF` byte is
/// always followed by `00` or a marker, so `FF D9` there is the real end.
pub(crate) fn jpeg_has_end_of_image(bytes: &[u8]) -> bool {
    const START_OF_SCAN: u8 = 0xDA;
    let mut at = 2;
    while at + 4 <= bytes.len() {
        // Stray bytes between segments, which libjpeg skips with a warning.
        if bytes[at] != 0xFF {
            at += 1;
            continue;
        }
        match bytes[at + 1] {
            // Fill bytes before a marker.
            0xFF => at += 1,
            START_OF_SCAN => return bytes[at..].windows(2).any(|pair| pair == [0xFF, 0xD9]),
            // Markers without a length: TEM and the restart markers.
            0x01 | 0xD0..=0xD7 => at += 2,
            _ => at += 2 + usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]])),
        }
    }
    false
}

pub(crate) fn check_dimensions(
    kind: ImageFormatKind,
    width: u32,
    height: u32,
    limits: &ImageLimits,
) -> Result<(), VisionError> {
    if width == 0 || height == 0 {
        return Err(VisionError::decode(format!(
            "the {} header declares an empty image ({width}x{height} pixels)",
            kind.name()
        )));
    }
    let pixels = u64::from(width) * u64::from(height);
    if pixels > limits.max_pixels || width.max(height) > limits.max_side {
        return Err(VisionError::too_large(format!(
            "the {} image is {width}x{height} = {pixels} pixels; the limits are {} pixels and {} per side",
            kind.name(),
            limits.max_pixels,
            limits.max_side
        )));
    }
    Ok(())
}

fn decoder_error(kind: ImageFormatKind, error: ImageError) -> VisionError {
    let name = kind.name();
    match error {
        ImageError::Limits(e) => VisionError::too_large(format!("decoding the {name} image exceeds a limit: {e}")),
        ImageError::Unsupported(e) => VisionError::format(format!("this {name} variant is not supported: {e}")),
        other => VisionError::decode(format!("the {name} file could not be decoded: {other}")),
    }
}

/// Pillow's `alpha_composite` of one channel of `(value, alpha)` over opaque white, in its
/// integer arithmetic (7 extra bits, rounded divisions by 255).
fn over_white(value: u8, alpha: u8) -> u8 {
    const PRECISION_BITS: u32 = 7;
    if alpha == 0 {
        return 255;
    }
    let (src, src_alpha) = (u32::from(value), u32::from(alpha));
    let (dst, dst_alpha) = (255u32, 255u32);
    let blend = dst_alpha * (255 - src_alpha);
    let out_alpha_255 = src_alpha * 255 + blend;
    let coef1 = src_alpha * 255 * 255 * (1 << PRECISION_BITS) / out_alpha_255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let mixed = src * coef1 + dst * coef2 + (0x80 << PRECISION_BITS);
    // SHIFTFORDIV255: a division by 255, rounded as Pillow rounds it.
    let divided = ((mixed >> 8) + mixed) >> 8;
    (divided >> PRECISION_BITS) as u8
}

/// Pillow's PNG reader keeps the high byte of a 16-bit colour sample.
fn high_byte(sample: u16) -> u8 {
    (sample >> 8) as u8
}

/// Pillow's `I;16` to `RGB` conversion clips a 16-bit gray value at 255.
fn clipped_gray(sample: u16) -> u8 {
    sample.min(255) as u8
}

pub(crate) fn from_gray(width: u32, height: u32, gray: impl Iterator<Item = u8>) -> RgbImage {
    let data: Vec<u8> = gray.flat_map(|v| [v, v, v]).collect();
    RgbImage::from_raw(width, height, data).unwrap_or_else(|| RgbImage::new(width, height))
}

pub(crate) fn from_rgb(width: u32, height: u32, rgb: impl Iterator<Item = [u8; 3]>) -> RgbImage {
    let data: Vec<u8> = rgb.flatten().collect();
    RgbImage::from_raw(width, height, data).unwrap_or_else(|| RgbImage::new(width, height))
}

/// The decoded image as transformers' `convert_to_rgb` leaves Pillow's image of the same file.
fn to_rgb_like_transformers(image: DynamicImage) -> RgbImage {
    let (width, height) = (image.width(), image.height());
    match image {
        DynamicImage::ImageRgb8(rgb) => rgb,
        DynamicImage::ImageLuma8(gray) => from_gray(width, height, gray.into_raw().into_iter()),
        DynamicImage::ImageLumaA8(gray_alpha) => {
            from_gray(width, height, gray_alpha.pixels().map(|p| over_white(p.0[0], p.0[1])))
        }
        DynamicImage::ImageRgba8(rgba) => from_rgb(
            width,
            height,
            rgba.pixels().map(|p| {
                let [r, g, b, a] = p.0;
                [over_white(r, a), over_white(g, a), over_white(b, a)]
            }),
        ),
        DynamicImage::ImageLuma16(gray) => from_gray(width, height, gray.pixels().map(|p| clipped_gray(p.0[0]))),
        DynamicImage::ImageLumaA16(gray_alpha) => {
            from_gray(width, height, gray_alpha.pixels().map(|p| over_white(high_byte(p.0[0]), high_byte(p.0[1]))))
        }
        DynamicImage::ImageRgb16(rgb) => from_rgb(width, height, rgb.pixels().map(|p| p.0.map(high_byte))),
        DynamicImage::ImageRgba16(rgba) => from_rgb(
            width,
            height,
            rgba.pixels().map(|p| {
                let [r, g, b, a] = p.0.map(high_byte);
                [over_white(r, a), over_white(g, a), over_white(b, a)]
            }),
        ),
        // The accepted decoders produce none of the other layouts; convert generically.
        other => {
            let rgba = other.to_rgba8();
            from_rgb(
                width,
                height,
                rgba.pixels().map(|p| {
                    let [r, g, b, a] = p.0;
                    [over_white(r, a), over_white(g, a), over_white(b, a)]
                }),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_white_keeps_opaque_and_whitens_transparent() {
        for v in 0..=255u8 {
            assert_eq!(over_white(v, 255), v);
            assert_eq!(over_white(v, 0), 255);
        }
    }
}
