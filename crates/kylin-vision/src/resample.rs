//! Pillow's resampling of 8-bit RGB images, bit for bit.
//!
//! This is a port of `ImagingResample` (Pillow 13's `src/libImaging/Resample.c`), which
//! transformers' PIL backend calls through `Image.resize`. The resize is separable: a
//! horizontal pass and a vertical pass, in the order Pillow 13 picks (the vertical first when
//! the height shrinks much more than the width), each skipped when its side keeps its size.
//! For every output pixel the filter, widened by the scale when shrinking, is evaluated in
//! `f64` at the input pixels within its support, normalised to sum to one, and turned into
//! fixed point with 22 fractional bits; each pass accumulates in `i32` from one half, and
//! rounds and clips to `u8` before the next pass reads it. Every conversion below is the C
//! code's (`(int)` truncates toward zero).

use image::RgbImage;

/// The resampling filters of transformers' Qwen2-VL (bicubic) and Gemma 3 (bilinear) processors,
/// numbered as Pillow's `Image.Resampling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResampleFilter {
    /// Pillow's `BILINEAR` (2): the triangle filter, support 1.
    Bilinear,
    /// Pillow's `BICUBIC` (3): Keys' cubic convolution with a = -0.5, support 2.
    Bicubic,
}

impl ResampleFilter {
    /// The filter of a `resample` value in a preprocessor config (Pillow's numbering), if Kylin
    /// implements it.
    pub fn from_pillow(code: i64) -> Option<ResampleFilter> {
        match code {
            2 => Some(ResampleFilter::Bilinear),
            3 => Some(ResampleFilter::Bicubic),
            _ => None,
        }
    }

    fn support(self) -> f64 {
        match self {
            ResampleFilter::Bilinear => 1.0,
            ResampleFilter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            ResampleFilter::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            ResampleFilter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

/// Fractional bits of the fixed-point coefficients: 32 bits less 8 for the result and 2 for
/// the overshoot of filters with negative lobes.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// One pass's coefficients: for every output index, the first input index it reads and the
/// fixed-point weights of the inputs from there (`taps` at most).
struct PassCoefficients {
    first: Vec<usize>,
    count: Vec<usize>,
    weights: Vec<i32>,
    taps: usize,
}

impl PassCoefficients {
    /// Pillow's `precompute_coeffs` then `normalize_coeffs_8bpc`, for the whole input range.
    fn new(in_size: usize, out_size: usize, filter: ResampleFilter) -> PassCoefficients {
        // Pillow's box is `float`, so the input size passes through f32 (exact below 2^24).
        let scale = f64::from(in_size as f32) / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = filter.support() * filter_scale;
        let taps = support.ceil() as usize * 2 + 1;
        let mut first = Vec::with_capacity(out_size);
        let mut count = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * taps];
        let mut row = vec![0f64; taps];
        for out_index in 0..out_size {
            let center = (out_index as f64 + 0.5) * scale;
            let inverse_scale = 1.0 / filter_scale;
            let min = ((center - support + 0.5) as i64).max(0);
            let max = ((center + support + 0.5) as i64).min(in_size as i64);
            let len = (max - min).clamp(0, taps as i64) as usize;
            let mut sum = 0.0;
            for (x, w) in row.iter_mut().enumerate().take(len) {
                *w = filter.weight(((x as i64 + min) as f64 - center + 0.5) * inverse_scale);
                sum += *w;
            }
            let fixed = &mut weights[out_index * taps..out_index * taps + taps];
            for (x, k) in fixed.iter_mut().enumerate().take(len) {
                let normalised = if sum != 0.0 { row[x] / sum } else { row[x] };
                let scaled = normalised * f64::from(1u32 << PRECISION_BITS);
                *k = if normalised < 0.0 { (-0.5 + scaled) as i32 } else { (0.5 + scaled) as i32 };
            }
            first.push(min as usize);
            count.push(len);
        }
        PassCoefficients { first, count, weights, taps }
    }

    fn taps_of(&self, out_index: usize) -> (usize, &[i32]) {
        let start = out_index * self.taps;
        (self.first[out_index], &self.weights[start..start + self.count[out_index]])
    }
}

/// Pillow's `clip8`: drops the fractional bits (an arithmetic shift) and clamps to `u8`.
fn clip8(accumulator: i32) -> u8 {
    (accumulator >> PRECISION_BITS).clamp(0, 255) as u8
}

const HALF: i32 = 1 << (PRECISION_BITS - 1);

/// Resizes row-major RGB bytes along the width: (height, in_width, 3) -> (height, out_width, 3).
fn horizontal_pass(src: &[u8], height: usize, in_width: usize, out_width: usize, filter: ResampleFilter) -> Vec<u8> {
    let coefficients = PassCoefficients::new(in_width, out_width, filter);
    let mut out = vec![0u8; height * out_width * 3];
    for (src_row, out_row) in src.chunks_exact(in_width * 3).zip(out.chunks_exact_mut(out_width * 3)) {
        for (x, out_pixel) in out_row.chunks_exact_mut(3).enumerate() {
            let (first, weights) = coefficients.taps_of(x);
            let mut sums = [HALF; 3];
            for (tap, &k) in weights.iter().enumerate() {
                let pixel = &src_row[(first + tap) * 3..(first + tap) * 3 + 3];
                for (sum, &value) in sums.iter_mut().zip(pixel) {
                    *sum += i32::from(value) * k;
                }
            }
            for (dst, sum) in out_pixel.iter_mut().zip(sums) {
                *dst = clip8(sum);
            }
        }
    }
    out
}

/// Resizes row-major RGB bytes along the height: (in_height, width, 3) -> (out_height, width, 3).
fn vertical_pass(src: &[u8], width: usize, in_height: usize, out_height: usize, filter: ResampleFilter) -> Vec<u8> {
    let coefficients = PassCoefficients::new(in_height, out_height, filter);
    let row_len = width * 3;
    let mut out = vec![0u8; out_height * row_len];
    for (y, out_row) in out.chunks_exact_mut(row_len).enumerate() {
        let (first, weights) = coefficients.taps_of(y);
        for (i, dst) in out_row.iter_mut().enumerate() {
            let mut sum = HALF;
            for (tap, &k) in weights.iter().enumerate() {
                sum += i32::from(src[(first + tap) * row_len + i]) * k;
            }
            *dst = clip8(sum);
        }
    }
    out
}

/// Pillow 13's order of the passes (`ImagingResampleInner`): the vertical pass runs first when
/// the height shrinks by more than twice as many pixels as the width does. The order changes the
/// result, since the first pass is rounded to `u8` before the second reads it.
fn horizontal_first(in_width: usize, in_height: usize, out_width: usize, out_height: usize) -> bool {
    let height_loss = in_height as i64 - out_height as i64;
    let width_loss = in_width as i64 - out_width as i64;
    !(height_loss > 0 && height_loss > width_loss * 2)
}

/// Pillow's `image.resize((width, height), resample=filter)` of an RGB image. A side that keeps
/// its size skips its pass, as in Pillow; the caller bounds the output size.
pub fn resize(image: &RgbImage, width: u32, height: u32, filter: ResampleFilter) -> RgbImage {
    let (in_width, in_height) = (image.width() as usize, image.height() as usize);
    let (out_width, out_height) = (width as usize, height as usize);
    if out_width == 0 || out_height == 0 || in_width == 0 || in_height == 0 {
        return RgbImage::new(width, height);
    }
    let (need_horizontal, need_vertical) = (out_width != in_width, out_height != in_height);
    let mut pixels = image.as_raw().clone();
    if horizontal_first(in_width, in_height, out_width, out_height) {
        if need_horizontal {
            pixels = horizontal_pass(&pixels, in_height, in_width, out_width, filter);
        }
        if need_vertical {
            pixels = vertical_pass(&pixels, out_width, in_height, out_height, filter);
        }
    } else {
        if need_vertical {
            pixels = vertical_pass(&pixels, in_width, in_height, out_height, filter);
        }
        if need_horizontal {
            pixels = horizontal_pass(&pixels, out_height, in_width, out_width, filter);
        }
    }
    RgbImage::from_raw(width, height, pixels).unwrap_or_else(|| RgbImage::new(width, height))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_a_copy() {
        let image = RgbImage::from_fn(5, 3, |x, y| image::Rgb([x as u8 * 40, y as u8 * 90, 7]));
        assert_eq!(resize(&image, 5, 3, ResampleFilter::Bicubic), image);
    }

    #[test]
    fn coefficients_sum_to_one_in_fixed_point() {
        for (in_size, out_size) in [(37, 64), (131, 40), (1, 3), (5, 5)] {
            for filter in [ResampleFilter::Bilinear, ResampleFilter::Bicubic] {
                let c = PassCoefficients::new(in_size, out_size, filter);
                for i in 0..out_size {
                    let sum: i64 = c.taps_of(i).1.iter().map(|&k| i64::from(k)).sum();
                    assert!((sum - (1 << PRECISION_BITS)).abs() <= c.taps as i64, "{in_size}->{out_size} {i}: {sum}");
                }
            }
        }
    }
}
