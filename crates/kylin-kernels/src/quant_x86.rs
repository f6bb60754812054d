//! x86_64 kernels of the Q8_0 products (`quant.rs` defines the layout and the canonical order):
//! the activation quantization on AVX-512 and on AVX2, the tile on AVX-512 VNNI (`vpdpbusd`)
//! and on AVX2 (`vpmaddubsw`). Each computes every block's integer dot product exactly and
//! combines the blocks in the canonical order, so both tiles give the scalar tile's bits.

use std::arch::x86_64::*;

use crate::quant::{GROUP_ROWS, Q8_MT, QK8_0, QUANTS_BYTES, SCALES_BYTES};

/// One token's activation quantization (see `quant::quantize_row_scalar`, whose bytes this
/// reproduces): per block `d = f16(amax / 127)`, `q = round_ties_even(x · 127 / amax)` (the
/// default rounding of `vcvtps2dq`; 0 when `d` is 0), and `−128 · Σq`.
///
/// # Safety
/// AVX-512 F/BW/VL must be available; `x.len()` is a multiple of 32 and `dst` holds
/// `x.len() + 8 · x.len() / 32` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row_avx512(x: &[f32], dst: &mut [u8]) {
    let (cols, nb) = (x.len(), x.len() / QK8_0);
    assert!(dst.len() >= cols + 8 * nb);
    for b in 0..nb {
        // SAFETY: elements `32b..32b + 32` of `x` and bytes `32b..32b + 32` of `dst` exist.
        unsafe {
            let v0 = _mm512_loadu_ps(x.as_ptr().add(b * QK8_0));
            let v1 = _mm512_loadu_ps(x.as_ptr().add(b * QK8_0 + 16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let d = half::f16::from_f32(amax / 127.0).to_f32();
            let id = if d != 0.0 { 127.0 / amax } else { 0.0 };
            let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
            let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            let out = dst.as_mut_ptr().add(b * QK8_0);
            _mm_storeu_si128(out as *mut __m128i, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(q1));
            std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * b) as *mut f32, d);
            std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * nb + 4 * b) as *mut i32, -128 * sum);
        }
    }
}

/// [`quantize_row_avx512`] on AVX2 (the same bytes: `quant::quantize_row_scalar`'s).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `x.len()` is a multiple of 32 and `dst` holds
/// `x.len() + 8 · x.len() / 32` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row_avx2(x: &[f32], dst: &mut [u8]) {
    let (cols, nb) = (x.len(), x.len() / QK8_0);
    assert!(dst.len() >= cols + 8 * nb);
    let sign = _mm256_set1_ps(-0.0);
    for b in 0..nb {
        // SAFETY: elements `32b..32b + 32` of `x` and bytes `32b..32b + 32` of `dst` exist.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(x.as_ptr().add(b * QK8_0 + 8 * k)));
            let a: [__m256; 4] = v.map(|v| _mm256_andnot_ps(sign, v));
            let amax = crate::x86::hmax(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
            let d = half::f16::from_f32(amax / 127.0).to_f32();
            let id = _mm256_set1_ps(if d != 0.0 { 127.0 / amax } else { 0.0 });
            let q = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, id)));
            let sum = crate::x86::store_quants32(q, dst.as_mut_ptr().add(b * QK8_0));
            std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * b) as *mut f32, d);
            std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * nb + 4 * b) as *mut i32, -128 * sum);
        }
    }
}

/// [`quantize_weights_avx512`] on AVX2: the same numbers, eight lanes at a time. The sign goes
/// back with `vpsignd` on the scaled value's bits, which also leaves a quant of 0 at 0.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `x.len()` is a multiple of 32, `qs` as long,
/// `scales` a 32nd of it.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_weights_avx2(x: &[f32], qs: &mut [i8], scales: &mut [u16]) {
    let nb = x.len() / QK8_0;
    assert!(qs.len() == x.len() && scales.len() == nb);
    let (sign, half) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(0.5));
    for (b, scale) in scales.iter_mut().enumerate() {
        // SAFETY: elements `32b..32b + 32` of `x` and `qs` exist.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(x.as_ptr().add(b * QK8_0 + 8 * k)));
            let a = v.map(|v| _mm256_andnot_ps(sign, v));
            let amax = crate::x86::hmax(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            *scale = half::f16::from_f32(d).to_bits();
            let q = v.map(|v| {
                let scaled = _mm256_mul_ps(v, id);
                let a = _mm256_andnot_ps(sign, scaled);
                let t = _mm256_cvttps_epi32(a);
                let frac = _mm256_sub_ps(a, _mm256_cvtepi32_ps(t));
                // All ones (−1) where the fraction rounds up.
                let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half));
                _mm256_sign_epi32(_mm256_sub_epi32(t, up), _mm256_castps_si256(scaled))
            });
            crate::x86::store_quants32(q, qs.as_mut_ptr().add(b * QK8_0) as *mut u8);
        }
    }
}

/// GGUF's Q8_0 of a weight row (`quant::quantize_row_q8_0`'s scalar loop, whose numbers this
/// reproduces): `d = amax / 127` stored as f16, `q = roundf(x · (1 / d))`, rounding half away
/// from zero computed exactly as `trunc(|v|) + (frac(|v|) >= 0.5)` with the sign put back.
///
/// # Safety
/// AVX-512 F/BW/VL and F16C must be available; `x.len()` is a multiple of 32, `qs` as long,
/// `scales` a 32nd of it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_weights_avx512(x: &[f32], qs: &mut [i8], scales: &mut [u16]) {
    let nb = x.len() / QK8_0;
    assert!(qs.len() == x.len() && scales.len() == nb);
    for (b, scale) in scales.iter_mut().enumerate() {
        // SAFETY: elements `32b..32b + 32` of `x` and `qs` exist.
        unsafe {
            let v = [_mm512_loadu_ps(x.as_ptr().add(b * QK8_0)), _mm512_loadu_ps(x.as_ptr().add(b * QK8_0 + 16))];
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            *scale = half::f16::from_f32(d).to_bits();
            for (h, v) in v.iter().enumerate() {
                let scaled = _mm512_mul_ps(*v, _mm512_set1_ps(id));
                let a = _mm512_abs_ps(scaled);
                let t = _mm512_cvttps_epi32(a);
                let frac = _mm512_sub_ps(a, _mm512_cvtepi32_ps(t));
                let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
                let r = _mm512_mask_add_epi32(t, up, t, _mm512_set1_epi32(1));
                let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(scaled, _mm512_setzero_ps());
                let r = _mm512_mask_sub_epi32(r, negative, _mm512_setzero_si512(), r);
                _mm_storeu_si128(qs.as_mut_ptr().add(b * QK8_0 + 16 * h) as *mut __m128i, _mm512_cvtsepi32_epi8(r));
            }
        }
    }
}

/// [`tile_vnni`] for `mt` (1..=8) tokens, over Q8_0 weights or (`MXFP4`) MXFP4 ones.
///
/// # Safety
/// As [`tile_vnni`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_vnni_dyn<const MXFP4: bool>(
    mt: usize,
    wq: &[u8],
    ws: &[u8],
    nb: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
    prefetch_next: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match mt {
            1 => tile_vnni::<1, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
            2 => tile_vnni::<2, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
            3 => tile_vnni::<3, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
            4 => tile_vnni::<4, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
            5 => tile_vnni::<5, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
            6 => tile_vnni::<6, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
            7 => tile_vnni::<7, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
            _ => tile_vnni::<Q8_MT, MXFP4>(wq, ws, nb, xq, stride, y, y_stride, valid, prefetch_next),
        }
    }
}

/// How far ahead of the block it reads a one-token MXFP4 tile asks for the codes (and the
/// scales as far ahead in proportion), into L2, one block's lines per block: decoding the codes
/// (`vpshufb`) makes it more work per byte than Q8_0, and with the hardware prefetcher alone
/// its loads waited on memory. One decode token through Qwen3-0.6B's 28 layers in MXFP4
/// (`model_quant_decode`, 2 Zen 5 cores, medians) read 37.6 to 38.4 GB/s without, 46.2 to 47.7
/// at 4 or 8 KB ahead, 43.1 to 43.4 at 16 KB. Q8_0's tile has none: the same prefetch made
/// Qwen2.5-Coder-0.5B's decode under `--quantize q4_k` (whose head is Q8_0) slightly slower,
/// 137.7 to 138.9 tokens/s against 136.0 to 137.2.
const MXFP4_ONE_TOKEN_PREFETCH_BYTES: usize = 8192;

/// `MT` tokens × one group of 16 rows on AVX-512 VNNI: per block, the 8 weight vectors
/// (`[row: 16][4 columns]` each, offset-binary bytes) are loaded once and multiplied by each
/// token's broadcast groups of four activations (`vpdpbusd`: unsigned offset weights × signed
/// activations), the accumulator starting at the token's `−128 · Σq`, so the 16 lanes end on
/// each row's exact dot product; then `acc = fma(f32(isum), dx · dw, acc)` per lane. With
/// `prefetch_next`, each block also asks for the same block of the next group (which follows
/// this one in both planes), so that a many-token tile, slower than memory alone, overlaps the
/// next group's reads with its arithmetic; a one-token MXFP4 tile asks for its planes
/// [`MXFP4_ONE_TOKEN_PREFETCH_BYTES`] ahead. A prefetch is a hint and changes no result.
///
/// Q8_0 stores those weight vectors as they are, with an f16 scale per row. `MXFP4`
/// ([`crate::mxfp4`]) makes them per block: each 64-byte load holds the codes of all 16 rows ×
/// 8 columns (low nibbles columns `8p..8p + 4`, high nibbles `8p + 4..8p + 8`), and `vpshufb`
/// turns each nibble into its doubled FP4 value plus 128 (`116..=140`), Q8_0's offset-binary
/// byte for that integer; the scale is `2^(e − 128)` from the row's E8M0 byte. So the same
/// integer sums and the same `fma`s give the scalar tile's bits, with the codes decoded once
/// per block for all `MT` tokens.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI must be available; `wq`, `ws` are one whole group's planes of the
/// format; `xq` holds `MT` Q8_0 token rows of `stride` bytes for `32 · nb` columns; `y` is
/// valid for writing rows `0..valid` (`<= 16`) of `MT` tokens at row stride `y_stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_vnni<const MT: usize, const MXFP4: bool>(
    wq: &[u8],
    ws: &[u8],
    nb: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
    prefetch_next: bool,
) {
    use crate::mxfp4::{BLOCK_BYTES, VALUES_X2};
    // Bytes of one block of the group in each plane.
    let (block_bytes, scale_bytes) = if MXFP4 { (BLOCK_BYTES, GROUP_ROWS) } else { (QUANTS_BYTES, SCALES_BYTES) };
    assert!(wq.len() >= nb * block_bytes && ws.len() >= nb * scale_bytes && xq.len() >= MT * stride);
    debug_assert!(valid <= GROUP_ROWS);
    let cols = nb * QK8_0;
    let (wp, sp, xp) = (wq.as_ptr(), ws.as_ptr(), xq.as_ptr());
    // MXFP4: the doubled FP4 values plus 128, in every 128-bit lane.
    let offset_values: [u8; 16] = std::array::from_fn(|i| (VALUES_X2[i] as i16 + 128) as u8);
    // SAFETY: `offset_values` holds 16 bytes.
    let lut = unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(offset_values.as_ptr() as *const __m128i)) };
    let (low, one) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi32(1));
    let mut acc = [_mm512_setzero_ps(); MT];
    // One MXFP4 token: the scales as far ahead as MXFP4_ONE_TOKEN_PREFETCH_BYTES is in the codes.
    let scales_ahead = MXFP4_ONE_TOKEN_PREFETCH_BYTES * scale_bytes / block_bytes;
    for b in 0..nb {
        // SAFETY: block `b` of the group and every token's block `b` lie inside the slices
        // (checked above); all loads are unaligned.
        unsafe {
            let wb = wp.add(b * block_bytes);
            let sb = sp.add(b * scale_bytes);
            if prefetch_next {
                // The next group's block `b`, in both planes.
                crate::prefetch_lines(wb.wrapping_add(nb * block_bytes), block_bytes / 64);
                crate::prefetch_lines(sb.wrapping_add(nb * scale_bytes), 1);
            }
            if MXFP4 && MT == 1 && !prefetch_next {
                crate::prefetch_lines(wb.wrapping_add(MXFP4_ONE_TOKEN_PREFETCH_BYTES), block_bytes / 64);
                crate::prefetch_lines(sb.wrapping_add(scales_ahead), 1);
            }
            let (w, dw): ([__m512i; 8], __m512) = if MXFP4 {
                // w[2p]: columns 8p..8p + 4 of the 16 rows; w[2p + 1]: columns 8p + 4..8p + 8.
                let mut w = [_mm512_setzero_si512(); 8];
                for p in 0..4 {
                    let codes = _mm512_loadu_si512(wb.add(64 * p) as *const _);
                    w[2 * p] = _mm512_shuffle_epi8(lut, _mm512_and_si512(codes, low));
                    w[2 * p + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(codes), low));
                }
                // E8M0 bytes -> 2^(e - 128) as f32 bits ((e - 1) << 23), 0 below e = 2.
                let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(sb as *const __m128i));
                let bits = _mm512_slli_epi32::<23>(_mm512_max_epi32(_mm512_sub_epi32(e, one), _mm512_setzero_si512()));
                (w, _mm512_castsi512_ps(bits))
            } else {
                let w = std::array::from_fn(|k| _mm512_loadu_si512(wb.add(64 * k) as *const _));
                (w, _mm512_cvtph_ps(_mm256_loadu_si256(sb as *const __m256i)))
            };
            for (t, acc) in acc.iter_mut().enumerate() {
                let xt = xp.add(t * stride);
                let xb = xt.add(b * QK8_0);
                let four = |k: usize| _mm512_set1_epi32(std::ptr::read_unaligned(xb.add(4 * k) as *const i32));
                let corr = _mm512_set1_epi32(std::ptr::read_unaligned(xt.add(cols + 4 * nb + 4 * b) as *const i32));
                let dx = _mm512_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * b) as *const f32));
                let isum = _mm512_cvtepi32_ps(block_sums_vnni(corr, |k| w[k], four));
                *acc = _mm512_fmadd_ps(isum, _mm512_mul_ps(dx, dw), *acc);
            }
        }
    }
    let mask: __mmask16 = if valid >= GROUP_ROWS { 0xffff } else { (1u16 << valid) - 1 };
    for (t, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract: rows `0..valid` of token `t` are writable.
        unsafe { _mm512_mask_storeu_ps(y.add(t * y_stride), mask, *acc) };
    }
}

/// One block's 16 exact row sums on VNNI: `corr` (the token's `−128 · Σq`) plus the 8 weight
/// vectors `w(k)` (offset-binary bytes, `[row: 16][4 columns]`) times the token's broadcast
/// groups of four activations `x4(k)`, in two chains of four `vpdpbusd`.
#[inline(always)]
unsafe fn block_sums_vnni(corr: __m512i, w: impl Fn(usize) -> __m512i, x4: impl Fn(usize) -> __m512i) -> __m512i {
    // SAFETY: the callers have AVX-512 VNNI (their target features); no memory is touched here.
    unsafe {
        let mut i0 = _mm512_dpbusd_epi32(corr, w(0), x4(0));
        let mut i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w(1), x4(1));
        i0 = _mm512_dpbusd_epi32(i0, w(2), x4(2));
        i1 = _mm512_dpbusd_epi32(i1, w(3), x4(3));
        i0 = _mm512_dpbusd_epi32(i0, w(4), x4(4));
        i1 = _mm512_dpbusd_epi32(i1, w(5), x4(5));
        i0 = _mm512_dpbusd_epi32(i0, w(6), x4(6));
        i1 = _mm512_dpbusd_epi32(i1, w(7), x4(7));
        _mm512_add_epi32(i0, i1)
    }
}

/// `mt` tokens × one group of 16 rows on AVX2 (no VNNI): the weights are turned back into
/// signed bytes, and `vpmaddubsw(|w|, sign(x, w))` multiplies them by the activations without
/// saturating (`|w| ≤ 128` read as an unsigned byte, `|x| ≤ 127`: Q8_0 activations are
/// rounded to `[-127, 127]`, while published int8 weights use all of `[-128, 127]`), and
/// `vpmaddwd` by ones widens the pairs to i32: the same exact block sums as the VNNI tile,
/// combined in the same order. Up to four tokens share each weight load
/// ([`tile_avx2_shared`]).
///
/// # Safety
/// AVX2, FMA and F16C must be available; otherwise as [`tile_vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_avx2(
    mt: usize,
    wq: &[u8],
    ws: &[u8],
    nb: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    let tiles =
        [tile_avx2_shared::<1> as SharedTile, tile_avx2_shared::<2>, tile_avx2_shared::<3>, tile_avx2_shared::<4>];
    // SAFETY: the caller's contract.
    unsafe { in_fours(tiles, mt, wq, ws, nb, xq, stride, y, y_stride, valid) }
}

/// An AVX2 tile for a fixed number of tokens `n` (`tiles[n - 1]` of [`in_fours`]), with the
/// arguments of [`tile_avx2`] but the token count: `(wq, ws, nb or cols, xq, stride, y,
/// y_stride, valid)`.
pub(crate) type SharedTile = unsafe fn(&[u8], &[u8], usize, &[u8], usize, *mut f32, usize, usize);

/// Runs `mt` tokens in tiles of up to four, the tile for `n` tokens being `tiles[n - 1]`.
///
/// # Safety
/// Each tile's contract holds for its tokens: the CPU has its instructions, and rows `0..valid`
/// of every token `t < mt` are writable at `y + t * y_stride`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn in_fours(
    tiles: [SharedTile; 4],
    mt: usize,
    wq: &[u8],
    ws: &[u8],
    size: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    assert!(xq.len() >= mt * stride);
    let mut t = 0;
    while t < mt {
        let n = (mt - t).min(4);
        // SAFETY: the caller's contract, for tokens `t..t + n`.
        unsafe { tiles[n - 1](wq, ws, size, &xq[t * stride..], stride, y.add(t * y_stride), y_stride, valid) };
        t += n;
    }
}

/// Writes rows `0..valid` of one token's 16-row group (`acc[0]`: rows 0-7, `acc[1]`: rows
/// 8-15) to `y`.
///
/// # Safety
/// AVX is available, and `y` is valid for writing `valid <= 16` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn store_group_avx2(acc: &[__m256; 2], y: *mut f32, valid: usize) {
    let mut lanes = [0.0f32; GROUP_ROWS];
    // SAFETY: `lanes` holds 16 floats, two unaligned 8-float stores; the caller's contract for
    // `y`.
    unsafe {
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
        std::ptr::copy_nonoverlapping(lanes.as_ptr(), y, valid.min(GROUP_ROWS));
    }
}

/// `MT` tokens × one group of 16 rows on AVX2: each weight vector is loaded, turned back into
/// signed bytes and its magnitude taken once for all `MT` tokens; each token then moves the
/// weights' signs onto its activations and multiplies. (Two tokens' pair sums cannot share one
/// `vpmaddwd`, as the Q4_K tile's do: one pair sum reaches `2 · 128 · 127`, so two overflow
/// 16 bits.) The block sums are exact and combined per token in [`tile_vnni`]'s order, so the
/// bits are the VNNI and scalar tiles'.
///
/// # Safety
/// As [`tile_avx2`], for `mt = MT` tokens.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx2_shared<const MT: usize>(
    wq: &[u8],
    ws: &[u8],
    nb: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    assert!(wq.len() >= nb * QUANTS_BYTES && ws.len() >= nb * SCALES_BYTES && xq.len() >= MT * stride);
    debug_assert!(valid <= GROUP_ROWS);
    let cols = nb * QK8_0;
    let (wp, sp, xp) = (wq.as_ptr(), ws.as_ptr(), xq.as_ptr());
    let (offset, ones) = (_mm256_set1_epi8(0x80u8 as i8), _mm256_set1_epi16(1));
    let mut acc = [[_mm256_setzero_ps(); 2]; MT];
    for b in 0..nb {
        // SAFETY: block `b` of the group and every token's block `b` lie inside the slices
        // (checked above); all loads are unaligned.
        unsafe {
            let wb = wp.add(b * QUANTS_BYTES);
            let mut ii = [[_mm256_setzero_si256(); 2]; MT];
            for k in 0..8 {
                // Rows `8h .. 8h + 8`, columns `4k .. 4k + 4` of the block: signed, and their
                // magnitudes (|-128| is 128 as an unsigned byte).
                let mut signed = [_mm256_setzero_si256(); 2];
                let mut magnitude = [_mm256_setzero_si256(); 2];
                for h in 0..2 {
                    signed[h] = _mm256_xor_si256(_mm256_loadu_si256(wb.add(64 * k + 32 * h) as *const __m256i), offset);
                    magnitude[h] = _mm256_abs_epi8(signed[h]);
                }
                for (t, ii) in ii.iter_mut().enumerate() {
                    let xb = xp.add(t * stride + b * QK8_0);
                    let x4 = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(4 * k) as *const i32));
                    for h in 0..2 {
                        let pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(x4, signed[h]));
                        ii[h] = _mm256_add_epi32(ii[h], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            let dw: [__m256; 2] = std::array::from_fn(|h| {
                _mm256_cvtph_ps(_mm_loadu_si128(sp.add(b * SCALES_BYTES + 16 * h) as *const __m128i))
            });
            for (t, acc) in acc.iter_mut().enumerate() {
                let xt = xp.add(t * stride);
                let dx = _mm256_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * b) as *const f32));
                for h in 0..2 {
                    acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ii[t][h]), _mm256_mul_ps(dx, dw[h]), acc[h]);
                }
            }
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract: rows `0..valid` of token `t` are writable.
        unsafe { store_group_avx2(acc, y.add(t * y_stride), valid) };
    }
}

/// Groups of 16 rows that one decode token's Q8_0 product takes at a time on AVX2
/// ([`tile_avx2_one_token_groups`]) and on AVX-512 VNNI ([`tile_vnni_one_token_groups`]).
///
/// Why four: a group is one sequential run of weights (16 rows × the columns), and one token
/// has too little arithmetic per byte to keep a single stream's misses overlapped; reading
/// four groups' blocks in turn keeps four streams in flight, as the float strips' decode tile
/// does. Qwen3-0.6B's 28 layers under Q8_0 for one token (`model_quant_decode`'s `q8_0`, 2 Zen 3
/// cores, seven alternating rounds of medians): one group at a time 17.6–20.4 ms, two
/// 16.8–20.3 ms, four 15.6–18.3 ms (3 to 21% less than one in every round, 10% in the
/// middle one). On an Intel Xeon with AVX-512 VNNI (2 vCPUs, `bench-worker`, 512-token prompt,
/// alternating runs), four groups against one decoded qwen3-0.6b-shaped `--quantize q8_0` at
/// 29.96–30.24 tokens/s against 26.41–27.76, and Qwen2.5-Coder `--quantize q4_k` (whose head
/// is Q8_0) at 52.70–59.46 against 50.67–52.11. The same four streams for the Q4_K family's
/// VNNI tile gave nothing there, with or without its prefetch (35.38–39.21 against 38.39–47.18), so that
/// tile keeps one.
pub(crate) const ONE_TOKEN_GROUPS: usize = 4;

/// One token × `G` groups of 16 rows on AVX2, block `b` of every group in turn
/// ([`ONE_TOKEN_GROUPS`]). Each row's sum is [`tile_avx2_shared`]'s for one token, term for
/// term, so the bits are the same.
///
/// # Safety
/// As [`tile_avx2`] for one token, for each group `i`: `wq[i]`, `ws[i]` are one whole group's
/// planes, and rows `0..valid[i]` are writable at `y[i]`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_avx2_one_token_groups<const G: usize>(
    wq: [&[u8]; G],
    ws: [&[u8]; G],
    nb: usize,
    xq: &[u8],
    y: [*mut f32; G],
    valid: [usize; G],
) {
    for (wq, ws) in wq.iter().zip(&ws) {
        assert!(wq.len() >= nb * QUANTS_BYTES && ws.len() >= nb * SCALES_BYTES);
    }
    debug_assert!(valid.iter().all(|&v| v <= GROUP_ROWS));
    let cols = nb * QK8_0;
    assert!(xq.len() >= cols + 4 * nb);
    let xp = xq.as_ptr();
    let (offset, ones) = (_mm256_set1_epi8(0x80u8 as i8), _mm256_set1_epi16(1));
    let mut acc = [[_mm256_setzero_ps(); 2]; G];
    for b in 0..nb {
        // SAFETY: block `b` of every group and the token's block `b` lie inside the slices
        // (checked above); all loads are unaligned.
        unsafe {
            let xb = xp.add(b * QK8_0);
            let dx = _mm256_set1_ps(std::ptr::read_unaligned(xp.add(cols + 4 * b) as *const f32));
            for ((acc, wq), ws) in acc.iter_mut().zip(wq).zip(ws) {
                let wb = wq.as_ptr().add(b * QUANTS_BYTES);
                let mut ii = [_mm256_setzero_si256(); 2];
                for k in 0..8 {
                    let x4 = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(4 * k) as *const i32));
                    for (h, ii) in ii.iter_mut().enumerate() {
                        let signed =
                            _mm256_xor_si256(_mm256_loadu_si256(wb.add(64 * k + 32 * h) as *const __m256i), offset);
                        let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(signed), _mm256_sign_epi8(x4, signed));
                        *ii = _mm256_add_epi32(*ii, _mm256_madd_epi16(pairs, ones));
                    }
                }
                let sp = ws.as_ptr().add(b * SCALES_BYTES);
                for (h, (acc, ii)) in acc.iter_mut().zip(ii).enumerate() {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(sp.add(16 * h) as *const __m128i));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ii), _mm256_mul_ps(dx, dw), *acc);
                }
            }
        }
    }
    for ((acc, y), valid) in acc.iter().zip(y).zip(valid) {
        // SAFETY: the caller's contract: rows `0..valid` of each group are writable at its `y`.
        unsafe { store_group_avx2(acc, y, valid) };
    }
}

/// One token × `G` groups of 16 rows of Q8_0 on AVX-512 VNNI, block `b` of every group in
/// turn: [`tile_avx2_one_token_groups`]'s four streams on [`tile_vnni`]'s arithmetic. Each
/// row's exact integer block sum and its `fma` into the row's accumulator are
/// [`tile_vnni`]'s for one token, in the same block order, so the bits are the same.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI must be available; for each group `i`: `wq[i]`, `ws[i]` are one whole
/// Q8_0 group's planes, and rows `0..valid[i]` are writable at `y[i]`; `xq` is one Q8_0 token
/// row for `32 · nb` columns.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile_vnni_one_token_groups<const G: usize>(
    wq: [&[u8]; G],
    ws: [&[u8]; G],
    nb: usize,
    xq: &[u8],
    y: [*mut f32; G],
    valid: [usize; G],
) {
    for (wq, ws) in wq.iter().zip(&ws) {
        assert!(wq.len() >= nb * QUANTS_BYTES && ws.len() >= nb * SCALES_BYTES);
    }
    debug_assert!(valid.iter().all(|&v| v <= GROUP_ROWS));
    let cols = nb * QK8_0;
    assert!(xq.len() >= cols + 8 * nb);
    let xp = xq.as_ptr();
    let mut acc = [_mm512_setzero_ps(); G];
    for b in 0..nb {
        // SAFETY: block `b` of every group and the token's block `b` lie inside the slices
        // (checked above); all loads are unaligned.
        unsafe {
            let xb = xp.add(b * QK8_0);
            let x4: [__m512i; 8] =
                std::array::from_fn(|k| _mm512_set1_epi32(std::ptr::read_unaligned(xb.add(4 * k) as *const i32)));
            let corr = _mm512_set1_epi32(std::ptr::read_unaligned(xp.add(cols + 4 * nb + 4 * b) as *const i32));
            let dx = _mm512_set1_ps(std::ptr::read_unaligned(xp.add(cols + 4 * b) as *const f32));
            for ((acc, wq), ws) in acc.iter_mut().zip(wq).zip(ws) {
                let wb = wq.as_ptr().add(b * QUANTS_BYTES);
                let w = |k: usize| _mm512_loadu_si512(wb.add(64 * k) as *const _);
                let isum = _mm512_cvtepi32_ps(block_sums_vnni(corr, w, |k| x4[k]));
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ws.as_ptr().add(b * SCALES_BYTES) as *const __m256i));
                *acc = _mm512_fmadd_ps(isum, _mm512_mul_ps(dx, dw), *acc);
            }
        }
    }
    for ((acc, y), valid) in acc.iter().zip(y).zip(valid) {
        let mask: __mmask16 = if valid >= GROUP_ROWS { 0xffff } else { (1u16 << valid) - 1 };
        // SAFETY: the caller's contract: rows `0..valid` of each group are writable at its `y`.
        unsafe { _mm512_mask_storeu_ps(y, mask, *acc) };
    }
}

/// `mt` tokens × one group of 16 MXFP4 rows on AVX2 ([`crate::mxfp4`]): each 32-byte load
/// holds the codes of 8 rows × 8 columns; `vpshufb` turns low and high nibbles into the doubled
/// FP4 values (signed bytes, `|w| ≤ 12`), `vpmaddubsw(|w|, sign(x, w))` multiplies them by the
/// activations and `vpmaddwd` by ones widens the pairs: the exact block sums of the scalar
/// tile, combined in its order with `dx · 2^(e − 128)` per block and row.
///
/// # Safety
/// AVX2, FMA and F16C must be available; otherwise as [`crate::mxfp4::tile_scalar`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_avx2_mxfp4(
    mt: usize,
    wq: &[u8],
    ws: &[u8],
    nb: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    use crate::mxfp4::{BLOCK_BYTES, VALUES_X2};
    assert!(wq.len() >= nb * BLOCK_BYTES && ws.len() >= nb * GROUP_ROWS && xq.len() >= mt * stride);
    debug_assert!(valid <= GROUP_ROWS);
    let cols = nb * QK8_0;
    let (wp, sp, xp) = (wq.as_ptr(), ws.as_ptr(), xq.as_ptr());
    // SAFETY: `VALUES_X2` holds 16 bytes.
    let lut = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(VALUES_X2.as_ptr() as *const __m128i)) };
    let (low, ones, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1), _mm256_set1_epi32(1));
    for t in 0..mt {
        let mut acc = [_mm256_setzero_ps(); 2];
        for b in 0..nb {
            // SAFETY: block `b` of the group and token `t`'s activations lie inside the slices
            // (checked above); the scales' 8-byte loads stay inside the group's 16 bytes.
            unsafe {
                let wb = wp.add(b * BLOCK_BYTES);
                let xt = xp.add(t * stride);
                let xb = xt.add(b * QK8_0);
                let mut ii = [_mm256_setzero_si256(); 2];
                for p in 0..4 {
                    let x_lo = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(8 * p) as *const i32));
                    let x_hi = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(8 * p + 4) as *const i32));
                    for (h, ii) in ii.iter_mut().enumerate() {
                        let codes = _mm256_loadu_si256(wb.add(64 * p + 32 * h) as *const __m256i);
                        let w_lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(codes, low));
                        let w_hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(codes, 4), low));
                        let a = _mm256_maddubs_epi16(_mm256_abs_epi8(w_lo), _mm256_sign_epi8(x_lo, w_lo));
                        let c = _mm256_maddubs_epi16(_mm256_abs_epi8(w_hi), _mm256_sign_epi8(x_hi, w_hi));
                        *ii = _mm256_add_epi32(*ii, _mm256_madd_epi16(a, ones));
                        *ii = _mm256_add_epi32(*ii, _mm256_madd_epi16(c, ones));
                    }
                }
                let dx = _mm256_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * b) as *const f32));
                for (h, acc) in acc.iter_mut().enumerate() {
                    // E8M0 bytes -> 2^(e - 128) as f32 bits ((e - 1) << 23), 0 below e = 2.
                    let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sp.add(b * GROUP_ROWS + 8 * h) as *const __m128i));
                    let bits =
                        _mm256_slli_epi32(_mm256_max_epi32(_mm256_sub_epi32(e, one), _mm256_setzero_si256()), 23);
                    let dw = _mm256_castsi256_ps(bits);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ii[h]), _mm256_mul_ps(dx, dw), *acc);
                }
            }
        }
        // SAFETY: the caller's contract: rows `0..valid` of token `t` are writable.
        unsafe { store_group_avx2(&acc, y.add(t * y_stride), valid) };
    }
}
