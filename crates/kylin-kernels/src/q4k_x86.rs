//! x86_64 kernels of the Q4_K products (`q4k.rs` defines the layout and the canonical order):
//! the activation quantization on AVX-512 and on AVX2, the tile on AVX-512 VNNI (`vpdpbusd`)
//! and on AVX2 (`vpmaddubsw`). Each computes every sub-block's integer dot product exactly
//! and combines the sub-blocks in the canonical order, so both tiles give the scalar tile's
//! bits. Also the weight quantization's search for sub-block scales and mins on AVX-512, 16
//! sub-blocks at once, with the scalar search's bits.
//!
//! The tiles also run Q4_G (`q4g.rs`), Q5_0 and Q6_0 (`q56.rs`), whose quants plane is
//! Q4_K's: their const parameter `SCALES` ([`Q4K_SCALES`], [`Q4G_SCALES`], [`Q5_0_SCALES`] or
//! [`Q6_0_SCALES`]) picks where sub-block `j`'s `(dsc_j, dm_j)` come from — Q4_K's
//! `(d · sc_j, dmin · m_j)` or Q4_G's f16 `(s_j, m_j)` — and for Q5_0 and Q6_0 ORs each
//! quant's high bits (16, and 32) onto its nibble from the scales plane's high-bit vectors
//! (one shift and one masked OR per weight vector) and reads Q8_0's activations,
//! whose per-block correction takes the offset of 16 (or 32) out of the integer sum
//! (`q56.rs`); everything else is the same code.

use std::arch::x86_64::*;

use crate::q4g::SUB_SCALE_BYTES as G_SUB_SCALE_BYTES;
use crate::q4k::{HEADER_BYTES, PAIR_BYTES, QK_K, SUB, SUB_SCALE_BYTES, SUPER_SCALE_BYTES, subs_in};
use crate::quant::GROUP_ROWS;

/// The tiles' `SCALES` for Q4_K's scales plane: `d`, `dmin` per super-block, 6-bit `sc`, `m`
/// per sub-block.
pub(crate) const Q4K_SCALES: u8 = 0;
/// The tiles' `SCALES` for Q4_G's scales plane: an f16 scale and min per sub-block.
pub(crate) const Q4G_SCALES: u8 = 1;
/// The tiles' `SCALES` for Q5_0's scales plane: an f16 scale and the quants' high bits per
/// sub-block.
pub(crate) const Q5_0_SCALES: u8 = 2;
/// The tiles' `SCALES` for Q6_0's scales plane: an f16 scale and the quants' two high bits
/// per sub-block.
pub(crate) const Q6_0_SCALES: u8 = 3;

/// How many high bits above the nibble the scales plane `SCALES` holds: 1 for Q5_0, 2 for
/// Q6_0, none for Q4_K and Q4_G.
#[inline(always)]
const fn high_bits<const SCALES: u8>() -> usize {
    match SCALES {
        Q5_0_SCALES => 1,
        Q6_0_SCALES => 2,
        _ => 0,
    }
}

/// Bytes of one sub-block's scales of 16 rows in a per-sub-block scales plane (Q4_G, Q5_0,
/// Q6_0).
#[inline(always)]
fn sub_scale_bytes<const SCALES: u8>() -> usize {
    match high_bits::<SCALES>() {
        0 => G_SUB_SCALE_BYTES,
        h => crate::q56::sub_scale_bytes(h),
    }
}

/// Bytes of a group's scales plane for rows of `cols` columns, in the layout `SCALES` picks.
#[inline(always)]
fn scales_len<const SCALES: u8>(cols: usize) -> usize {
    if SCALES == Q4K_SCALES {
        cols.div_ceil(QK_K) * HEADER_BYTES + cols / SUB * SUB_SCALE_BYTES
    } else {
        cols / SUB * sub_scale_bytes::<SCALES>()
    }
}

/// One token's activation quantization (see `q4k::quantize_row_scalar`, whose bytes this
/// reproduces): per super-block `iscale = 127 / amax`, `q = round_ties_even(x · iscale)` (the
/// default rounding of `vcvtps2dq`), `dx = 1 / iscale`; per sub-block `dx` and `f32(Σq) · dx`.
///
/// # Safety
/// AVX-512 F/BW/VL must be available; `x.len()` is a multiple of 32 and `dst` holds
/// `x.len() + 8 · x.len() / 32` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn quantize_row_avx512(x: &[f32], dst: &mut [u8]) {
    let (cols, nb) = (x.len(), x.len() / SUB);
    assert!(dst.len() >= cols + 8 * nb && cols.is_multiple_of(SUB));
    let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
    for s in 0..cols.div_ceil(QK_K) {
        let n_sub = subs_in(cols, s);
        let base = s * QK_K;
        // SAFETY: elements `base .. base + 32 · n_sub` of `x`, and the matching bytes of
        // `dst`, exist (checked above).
        unsafe {
            let mut m = _mm512_setzero_ps();
            for i in 0..2 * n_sub {
                m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x.as_ptr().add(base + 16 * i))));
            }
            let amax = _mm512_reduce_max_ps(m);
            let iscale = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let dx = if amax != 0.0 { 1.0 / iscale } else { 0.0 };
            let vs = _mm512_set1_ps(iscale);
            for jj in 0..n_sub {
                let j = s * (QK_K / SUB) + jj;
                let at = base + jj * SUB;
                let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(at)), vs));
                let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(at + 16)), vs));
                let (q0, q1) =
                    (_mm512_min_epi32(_mm512_max_epi32(q0, lo), hi), _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi));
                let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
                let out = dst.as_mut_ptr().add(at);
                _mm_storeu_si128(out as *mut __m128i, _mm512_cvtsepi32_epi8(q0));
                _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(q1));
                std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * j) as *mut f32, dx);
                std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * nb + 4 * j) as *mut f32, sum as f32 * dx);
            }
        }
    }
}

/// [`quantize_row_avx512`] on AVX2 (the same bytes: `q4k::quantize_row_scalar`'s).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `x.len()` is a multiple of 32 and `dst` holds
/// `x.len() + 8 · x.len() / 32` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row_avx2(x: &[f32], dst: &mut [u8]) {
    let (cols, nb) = (x.len(), x.len() / SUB);
    assert!(dst.len() >= cols + 8 * nb && cols.is_multiple_of(SUB));
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    let sign = _mm256_set1_ps(-0.0);
    for s in 0..cols.div_ceil(QK_K) {
        let n_sub = subs_in(cols, s);
        let base = s * QK_K;
        // SAFETY: elements `base .. base + 32 · n_sub` of `x`, and the matching bytes of
        // `dst`, exist (checked above).
        unsafe {
            let mut m = _mm256_setzero_ps();
            for i in 0..4 * n_sub {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x.as_ptr().add(base + 8 * i))));
            }
            let amax = crate::x86::hmax(m);
            let iscale = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let dx = if amax != 0.0 { 1.0 / iscale } else { 0.0 };
            let vs = _mm256_set1_ps(iscale);
            for jj in 0..n_sub {
                let j = s * (QK_K / SUB) + jj;
                let at = base + jj * SUB;
                let q: [__m256i; 4] = std::array::from_fn(|k| {
                    let q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(at + 8 * k)), vs));
                    _mm256_min_epi32(_mm256_max_epi32(q, lo), hi)
                });
                let sum = crate::x86::store_quants32(q, dst.as_mut_ptr().add(at));
                std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * j) as *mut f32, dx);
                std::ptr::write_unaligned(dst.as_mut_ptr().add(cols + 4 * nb + 4 * j) as *mut f32, sum as f32 * dx);
            }
        }
    }
}

/// llama.cpp's `make_qkx2_quants(32, 15, x, weights, L, &min, Laux, -1, 0.1, 20, false)`
/// (`q4k::make_qkx2_quants`) with the weights `av_x + |x|` of `q4k::quantize_super_block`, on
/// 16 sub-blocks at once, one per lane: `x[i][lane]` is column `i` of lane `lane`'s sub-block,
/// and the result is every lane's scale and negated min, as the scalar function returns them.
///
/// Every lane performs the scalar code's f32 operations in the scalar order: the sums over the
/// 32 columns stay sequential, no multiply and add is fused, and `nearest_int` followed by the
/// clamp to `0..=15` is the clamp of the product followed by the default rounding (half to
/// even), which gives the same integer for every input, NaN and infinities included. The
/// branches become masks: the search runs in every lane, a lane whose `max == min` takes the
/// early return's numbers at the end, and the `det > 0`, `this_min > 0` and
/// `cur_error < best_error` tests select per lane. So each lane's results have the scalar
/// bits. The quants themselves are not returned: the caller recomputes them from the
/// super-block's scales, as llama.cpp does.
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn make_qkx2_quants_x16(x: &[[f32; GROUP_ROWS]; SUB]) -> ([f32; GROUP_ROWS], [f32; GROUP_ROWS]) {
    const NMAX: f32 = 15.0;
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let (zero, nmax) = (_mm512_setzero_ps(), _mm512_set1_ps(NMAX));
    let mut xv = [zero; SUB];
    for (v, column) in xv.iter_mut().zip(x) {
        // SAFETY: `column` holds 16 floats, read by one unaligned load.
        *v = unsafe { _mm512_loadu_ps(column.as_ptr()) };
    }
    let x = xv;
    // `quantize_super_block`'s weights: `av_x = sqrt(Σ x² / 32)` summed in column order, then
    // `av_x + |x|`.
    let mut sum_x2 = zero;
    for v in &x {
        sum_x2 = _mm512_add_ps(sum_x2, _mm512_mul_ps(*v, *v));
    }
    let av_x = _mm512_sqrt_ps(_mm512_div_ps(sum_x2, _mm512_set1_ps(SUB as f32)));
    let mut w = [zero; SUB];
    for (w, v) in w.iter_mut().zip(&x) {
        *w = _mm512_add_ps(av_x, _mm512_abs_ps(*v));
    }
    // `nearest_int(iscale · (x − min)).clamp(0, 15)` as a float.
    let quant = |iscale: __m512, x: __m512, min: __m512| {
        let v = _mm512_mul_ps(iscale, _mm512_sub_ps(x, min));
        // `max(v, 0)` is 0 for a NaN `v`, as `NaN as i32` is.
        let v = _mm512_min_ps(_mm512_max_ps(v, zero), nmax);
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
    };
    // `(a < b) ? a : b` is `_mm512_min_ps(a, b)`, so these are the scalar `if`s exactly.
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = _mm512_mul_ps(sum_w, x[0]);
    for i in 1..SUB {
        min = _mm512_min_ps(x[i], min);
        max = _mm512_max_ps(x[i], max);
        sum_w = _mm512_add_ps(sum_w, w[i]);
        sum_x = _mm512_add_ps(sum_x, _mm512_mul_ps(w[i], x[i]));
    }
    min = _mm512_mask_mov_ps(min, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(min, zero), zero);
    let flat = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(max, min);
    let flat_min = min;
    let iscale = _mm512_div_ps(nmax, _mm512_sub_ps(max, min));
    let mut scale = _mm512_div_ps(_mm512_set1_ps(1.0), iscale);
    let mut best_error = zero;
    for i in 0..SUB {
        let diff = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(scale, quant(iscale, x[i], min)), min), x[i]);
        best_error = _mm512_add_ps(best_error, _mm512_mul_ps(w[i], _mm512_mul_ps(diff, diff)));
    }
    let mut laux = [zero; SUB];
    for is in 0..=nstep {
        let iscale = _mm512_div_ps(_mm512_set1_ps(rmin + rdelta * is as f32 + NMAX), _mm512_sub_ps(max, min));
        let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
        for i in 0..SUB {
            let q = quant(iscale, x[i], min);
            laux[i] = q;
            let wq = _mm512_mul_ps(w[i], q);
            sum_l = _mm512_add_ps(sum_l, wq);
            sum_l2 = _mm512_add_ps(sum_l2, _mm512_mul_ps(wq, q));
            sum_xl = _mm512_add_ps(sum_xl, _mm512_mul_ps(wq, x[i]));
        }
        let det = _mm512_sub_ps(_mm512_mul_ps(sum_w, sum_l2), _mm512_mul_ps(sum_l, sum_l));
        let solvable = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(det, zero);
        let this_scale = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(sum_w, sum_xl), _mm512_mul_ps(sum_x, sum_l)), det);
        let this_min = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(sum_l2, sum_x), _mm512_mul_ps(sum_l, sum_xl)), det);
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(this_min, zero);
        let this_min = _mm512_mask_mov_ps(this_min, positive, zero);
        let this_scale = _mm512_mask_mov_ps(this_scale, positive, _mm512_div_ps(sum_xl, sum_l2));
        let mut cur_error = zero;
        for i in 0..SUB {
            let diff = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(this_scale, laux[i]), this_min), x[i]);
            cur_error = _mm512_add_ps(cur_error, _mm512_mul_ps(w[i], _mm512_mul_ps(diff, diff)));
        }
        let better = solvable & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(cur_error, best_error);
        best_error = _mm512_mask_mov_ps(best_error, better, cur_error);
        scale = _mm512_mask_mov_ps(scale, better, this_scale);
        min = _mm512_mask_mov_ps(min, better, this_min);
    }
    // The early return of a sub-block with `max == min`: scale 0, quants 0, its min.
    let scale = _mm512_mask_mov_ps(scale, flat, zero);
    let min = _mm512_mask_mov_ps(min, flat, flat_min);
    // `-min` flips the sign bit (also of a zero).
    let neg_min = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(min), _mm512_set1_epi32(i32::MIN)));
    let (mut scales, mut mins) = ([0.0f32; GROUP_ROWS], [0.0f32; GROUP_ROWS]);
    // SAFETY: both arrays hold 16 floats, written by one unaligned store each.
    unsafe {
        _mm512_storeu_ps(scales.as_mut_ptr(), scale);
        _mm512_storeu_ps(mins.as_mut_ptr(), neg_min);
    }
    (scales, mins)
}

/// [`make_qkx2_quants_x16`] on AVX2: the same search, eight lanes per call, for lanes
/// `8 · half .. 8 · half + 8` of `x` (the caller runs both halves). The operations are the
/// sixteen-lane function's, lane for lane, with AVX2's compare-and-blend in place of AVX-512's
/// masks: `_mm256_min_ps`/`_mm256_max_ps` return their second operand when either is NaN, as
/// the 512-bit ones do, and `_mm256_round_ps` to nearest rounds half to even as `roundscale`
/// does, so each lane's results have the scalar bits. It is a copy of that function's body
/// rather than one generic body over both register widths so that the AVX-512 search, which
/// only an AVX-512 machine can test, stays exactly as it was tested.
///
/// # Safety
/// AVX2 and FMA must be available; `half < 2`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn make_qkx2_quants_x8(x: &[[f32; GROUP_ROWS]; SUB], half: usize) -> ([f32; 8], [f32; 8]) {
    const NMAX: f32 = 15.0;
    debug_assert!(half < 2);
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let (zero, nmax) = (_mm256_setzero_ps(), _mm256_set1_ps(NMAX));
    let sign = _mm256_set1_ps(-0.0);
    let mut xv = [zero; SUB];
    for (v, column) in xv.iter_mut().zip(x) {
        // SAFETY: `column` holds 16 floats; eight from `8 · half <= 8`, one unaligned load.
        *v = unsafe { _mm256_loadu_ps(column.as_ptr().add(8 * half)) };
    }
    let x = xv;
    // `select(keep, mask, other)`: `other` in the lanes where `mask` is set.
    let select = |keep: __m256, mask: __m256, other: __m256| _mm256_blendv_ps(keep, other, mask);
    let mut sum_x2 = zero;
    for v in &x {
        sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(*v, *v));
    }
    let av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, _mm256_set1_ps(SUB as f32)));
    let mut w = [zero; SUB];
    for (w, v) in w.iter_mut().zip(&x) {
        *w = _mm256_add_ps(av_x, _mm256_andnot_ps(sign, *v));
    }
    let quant = |iscale: __m256, x: __m256, min: __m256| {
        let v = _mm256_mul_ps(iscale, _mm256_sub_ps(x, min));
        // `max(v, 0)` is 0 for a NaN `v`, as `NaN as i32` is.
        let v = _mm256_min_ps(_mm256_max_ps(v, zero), nmax);
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
    };
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = _mm256_mul_ps(sum_w, x[0]);
    for i in 1..SUB {
        min = _mm256_min_ps(x[i], min);
        max = _mm256_max_ps(x[i], max);
        sum_w = _mm256_add_ps(sum_w, w[i]);
        sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(w[i], x[i]));
    }
    min = select(min, _mm256_cmp_ps::<_CMP_GT_OQ>(min, zero), zero);
    let flat = _mm256_cmp_ps::<_CMP_EQ_OQ>(max, min);
    let flat_min = min;
    let iscale = _mm256_div_ps(nmax, _mm256_sub_ps(max, min));
    let mut scale = _mm256_div_ps(_mm256_set1_ps(1.0), iscale);
    let mut best_error = zero;
    for i in 0..SUB {
        let diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, quant(iscale, x[i], min)), min), x[i]);
        best_error = _mm256_add_ps(best_error, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
    }
    let mut laux = [zero; SUB];
    for is in 0..=nstep {
        let iscale = _mm256_div_ps(_mm256_set1_ps(rmin + rdelta * is as f32 + NMAX), _mm256_sub_ps(max, min));
        let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
        for i in 0..SUB {
            let q = quant(iscale, x[i], min);
            laux[i] = q;
            let wq = _mm256_mul_ps(w[i], q);
            sum_l = _mm256_add_ps(sum_l, wq);
            sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wq, q));
            sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wq, x[i]));
        }
        let det = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
        let solvable = _mm256_cmp_ps::<_CMP_GT_OQ>(det, zero);
        let this_scale = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l)), det);
        let this_min = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl)), det);
        let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(this_min, zero);
        let this_min = select(this_min, positive, zero);
        let this_scale = select(this_scale, positive, _mm256_div_ps(sum_xl, sum_l2));
        let mut cur_error = zero;
        for i in 0..SUB {
            let diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(this_scale, laux[i]), this_min), x[i]);
            cur_error = _mm256_add_ps(cur_error, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
        }
        let better = _mm256_and_ps(solvable, _mm256_cmp_ps::<_CMP_LT_OQ>(cur_error, best_error));
        best_error = select(best_error, better, cur_error);
        scale = select(scale, better, this_scale);
        min = select(min, better, this_min);
    }
    // The early return of a sub-block with `max == min`: scale 0, quants 0, its min.
    let scale = select(scale, flat, zero);
    let min = select(min, flat, flat_min);
    // `-min` flips the sign bit (also of a zero).
    let neg_min = _mm256_xor_ps(min, sign);
    let (mut scales, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
    // SAFETY: both arrays hold 8 floats, written by one unaligned store each.
    unsafe {
        _mm256_storeu_ps(scales.as_mut_ptr(), scale);
        _mm256_storeu_ps(mins.as_mut_ptr(), neg_min);
    }
    (scales, mins)
}

/// One sub-block's quants in the weight quantization (`q4k::finish_super_block`):
/// `q[i] = nearest_int((x[i] + dm) / dj).clamp(0, 15)`, the division IEEE as the scalar one,
/// and the clamp done on the quotient before the default rounding (half to even), which gives
/// the same integer for every quotient, NaN (0) and infinities included.
///
/// # Safety
/// AVX-512 F/BW/VL must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn quantize_sub_block_avx512(x: &[f32; SUB], dm: f32, dj: f32, q: &mut [u8; SUB]) {
    let (zero, fifteen) = (_mm512_setzero_ps(), _mm512_set1_ps(15.0));
    let (dm, dj) = (_mm512_set1_ps(dm), _mm512_set1_ps(dj));
    for half in 0..2 {
        // SAFETY: `x` holds 32 floats and `q` 32 bytes: 16 of each at `16 · half`, one
        // unaligned load and one unaligned store.
        unsafe {
            let v = _mm512_div_ps(_mm512_add_ps(_mm512_loadu_ps(x.as_ptr().add(16 * half)), dm), dj);
            // `max(v, 0)` is 0 for a NaN `v`, as `NaN as i32` is.
            let v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, zero), fifteen));
            _mm_storeu_si128(q.as_mut_ptr().add(16 * half) as *mut __m128i, _mm512_cvtepi32_epi8(v));
        }
    }
}

/// How far ahead of the pair it reads a one-token [`tile_vnni`] asks for the quants plane (into
/// L2, one pair's lines per pair, so the stream stays this far ahead). Decode's tile does more
/// work per weight byte than Q8_0's (it unpacks nibbles, and for Q5_0 and Q6_0 ORs on the high
/// bits), and with only the hardware prefetcher its loads waited on memory at the start of every
/// few lines while decode read 63% of the machine's bandwidth. Measured on 2 Zen 5 cores
/// (`bench-worker`, 512-token prompt, alternating runs): Qwen2.5-Coder-0.5B `--quantize q4_k`
/// (mostly Q5_0, 896 columns) decoded at 117.4–122.5 tokens/s without, 133.4–140.1 at 4 KB
/// ahead, 115.4–121.9 at 2 KB, 129.1–131.6 at 8 KB; qwen3-0.6b-shaped `--quantize q4_k` (Q4_K)
/// at 92.7–96.4 without, 103.6–110.9 at 4 KB. The same prefetch in the Q8_0 tile (the head
/// here) made decode slightly slower (137.7–138.9 → 136.0–137.2), so that tile has none.
const ONE_TOKEN_PREFETCH_BYTES: usize = 4096;

/// For a group of `cols` columns in the format `SCALES` names: the scales bytes of one pair of
/// sub-blocks, and how far ahead one token's prefetch asks for the scales (as far ahead as
/// [`ONE_TOKEN_PREFETCH_BYTES`] in the quants, in proportion).
#[inline(always)]
fn one_token_prefetch_steps<const SCALES: u8>(cols: usize) -> (usize, usize) {
    let pairs = cols / SUB / 2;
    let (group_quants, group_scales) = (pairs * PAIR_BYTES, scales_len::<SCALES>(cols));
    (group_scales.div_ceil(pairs.max(1)), ONE_TOKEN_PREFETCH_BYTES * group_scales / group_quants.max(1))
}

/// One token's prefetch at pair `pair` of a group, whose quants start at `wb` and whose scales
/// plane at `sp`: the quants [`ONE_TOKEN_PREFETCH_BYTES`] ahead and the scales `scales_ahead`
/// ahead ([`one_token_prefetch_steps`]). The planes hold one group after another, so this runs
/// on into the next groups (and harmlessly past the matrix after its last: a prefetch never
/// faults).
#[inline(always)]
fn prefetch_pair_ahead(wb: *const u8, sp: *const u8, pair: usize, pair_scales: usize, scales_ahead: usize) {
    crate::prefetch_lines(wb.wrapping_add(ONE_TOKEN_PREFETCH_BYTES), PAIR_BYTES / 64);
    crate::prefetch_lines(sp.wrapping_add(pair * pair_scales + scales_ahead), pair_scales.div_ceil(64));
}

/// [`tile_vnni`] for `mt` (1..=8) tokens, on the scales plane `SCALES` picks.
///
/// # Safety
/// As [`tile_vnni`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_vnni_dyn<const SCALES: u8>(
    mt: usize,
    wq: &[u8],
    ws: &[u8],
    cols: usize,
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
            1 => tile_vnni::<1, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid, prefetch_next),
            2 => tile_vnni::<2, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid, prefetch_next),
            3 => tile_vnni::<3, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid, prefetch_next),
            4 => tile_vnni::<4, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid, prefetch_next),
            5 => tile_vnni::<5, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid, prefetch_next),
            6 => tile_vnni::<6, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid, prefetch_next),
            7 => tile_vnni::<7, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid, prefetch_next),
            _ => tile_vnni::<{ crate::quant::Q8_MT }, SCALES>(
                wq,
                ws,
                cols,
                xq,
                stride,
                y,
                y_stride,
                valid,
                prefetch_next,
            ),
        }
    }
}

/// `MT` tokens × one group of 16 rows on AVX-512 VNNI. Per pair of sub-blocks, the 8 weight
/// vectors (`[row: 16][4 columns]` of nibble pairs) are loaded, the low nibbles unpacked for
/// the first sub-block and the high ones for the second; each is multiplied by every token's
/// broadcast groups of four activations (`vpdpbusd`: unsigned weights × signed
/// activations), giving each row's exact `isum`; then per lane
/// `acc = fma(f32(isum), dsc · dx, acc); acc = fma(−bx, dm, acc)`, with `(dsc, dm)` Q4_K's
/// `(d · sc, dmin · m)` or Q4_G's `(s, m)` as `SCALES` says. For Q5_0 (Q6_0) each quant's fifth
/// bit (and sixth) is ORed onto its unpacked nibble ([`add_high_bits`]), and with Q8_0's
/// activations `acc = fma(f32(isum − half · Σq_x), d · dx, acc)`, `half` 16 (32). With
/// `prefetch_next`, each pair
/// also asks for the next group's same pair and its share of the next group's scales (both
/// planes hold the groups one after another), as the Q8_0 tile does. A one-token tile (decode)
/// instead asks, at each pair, for the quants [`ONE_TOKEN_PREFETCH_BYTES`] ahead and the
/// scales as far ahead in proportion.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI must be available; `wq`, `ws` are one whole group's planes for
/// `cols` columns (a multiple of 64) in the format `SCALES` names; `xq` holds `MT` token rows
/// of `stride` bytes; `y` is valid for writing rows `0..valid` (`<= 16`) of `MT` tokens at row
/// stride `y_stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_vnni<const MT: usize, const SCALES: u8>(
    wq: &[u8],
    ws: &[u8],
    cols: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
    prefetch_next: bool,
) {
    let nb = cols / SUB;
    let n_super = cols.div_ceil(QK_K);
    // One group's bytes in each plane, and the scales bytes of one pair of sub-blocks.
    let (group_quants, group_scales) = (nb / 2 * PAIR_BYTES, scales_len::<SCALES>(cols));
    let (pair_scales, scales_ahead) = one_token_prefetch_steps::<SCALES>(cols);
    assert!(wq.len() >= nb / 2 * PAIR_BYTES && ws.len() >= scales_len::<SCALES>(cols));
    assert!(xq.len() >= MT * stride && stride >= cols + 8 * nb);
    debug_assert!(valid <= GROUP_ROWS);
    let (wp, sp, xp) = (wq.as_ptr(), ws.as_ptr(), xq.as_ptr());
    let mut acc = [_mm512_setzero_ps(); MT];
    for s in 0..n_super {
        // `cols` is a multiple of 64, so every super-block holds whole pairs of sub-blocks.
        for jj in (0..subs_in(cols, s)).step_by(2) {
            let j = s * (QK_K / SUB) + jj;
            // SAFETY: sub-blocks `j` and `j + 1`'s scales (Q4_K's header and sub-block bytes,
            // or Q4_G's, Q5_0's and Q6_0's bytes per sub-block), their pair's quants and every
            // token's sub-blocks lie inside the slices (checked above against the layout
            // `SCALES` names); all loads are unaligned.
            unsafe {
                let (dsc_low, dm_low) = sub_block_scales::<SCALES>(sp, s, jj);
                let (dsc_high, dm_high) = sub_block_scales::<SCALES>(sp, s, jj + 1);
                let wb = wp.add((j / 2) * PAIR_BYTES);
                if prefetch_next {
                    // The next group's pair `j / 2`, in both planes.
                    crate::prefetch_lines(wb.wrapping_add(group_quants), PAIR_BYTES / 64);
                    let next_scales = sp.wrapping_add(group_scales + j / 2 * pair_scales);
                    crate::prefetch_lines(next_scales, pair_scales.div_ceil(64));
                }
                if MT == 1 && !prefetch_next {
                    prefetch_pair_ahead(wb, sp, j / 2, pair_scales, scales_ahead);
                }
                let (low, high) = unpack_pair::<SCALES>(wp, sp, j);
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xt = xp.add(t * stride);
                    accumulate_sub_block::<SCALES>(acc, &low, xt, cols, j, dsc_low, dm_low);
                    accumulate_sub_block::<SCALES>(acc, &high, xt, cols, j + 1, dsc_high, dm_high);
                }
            }
        }
    }
    let mask: __mmask16 = if valid >= GROUP_ROWS { 0xffff } else { (1u16 << valid) - 1 };
    for (t, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract: rows `0..valid` of token `t` are writable.
        unsafe { _mm512_mask_storeu_ps(y.add(t * y_stride), mask, *acc) };
    }
}

/// Sub-block `jj` of super-block `s`'s per-row `(dsc, dm)` for 16 rows, from the scales plane
/// at `sp` in the layout `SCALES` names: Q4_K's `(d · sc, dmin · m)`, Q4_G's f16 `(s, m)`, or
/// Q5_0's and Q6_0's f16 `d` with no min (their offset is taken out of the integer sum).
///
/// # Safety
/// AVX-512 F and F16C must be available; the scales of that sub-block lie at `sp`'s offsets.
#[inline(always)]
unsafe fn sub_block_scales<const SCALES: u8>(sp: *const u8, s: usize, jj: usize) -> (__m512, __m512) {
    let j = s * (QK_K / SUB) + jj;
    // SAFETY: the caller's contract.
    unsafe {
        if SCALES == Q4K_SCALES {
            // Q4_K's super-block header (`d`, `dmin` of the 16 rows), then the sub-block's
            // 6-bit `sc` and `m`.
            let header = sp.add(s * SUPER_SCALE_BYTES);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(header as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(header.add(32) as *const __m256i));
            let sub_scales = header.add(HEADER_BYTES + jj * SUB_SCALE_BYTES);
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sub_scales as *const __m128i)));
            let m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sub_scales.add(16) as *const __m128i)));
            return (_mm512_mul_ps(d, sc), _mm512_mul_ps(dmin, m));
        }
        let high = high_bits::<SCALES>();
        if high > 0 {
            let d = sp.add(crate::q56::scales_offset(high, j));
            return (_mm512_cvtph_ps(_mm256_loadu_si256(d as *const __m256i)), _mm512_setzero_ps());
        }
        // Q4_G: the sub-block's 16 f16 scales, then its 16 f16 mins.
        let sub_scales = sp.add(j * sub_scale_bytes::<SCALES>());
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(sub_scales as *const __m256i));
        (d, _mm512_cvtph_ps(_mm256_loadu_si256(sub_scales.add(32) as *const __m256i)))
    }
}

/// Sub-blocks `j` and `j + 1` (`j` even)'s weight vectors (`[row: 16][4 columns]` bytes
/// each), from one load of their pair's 8 vectors in the quants plane at `wp`: the low
/// nibbles for `j`, the high ones for `j + 1`. For Q4_K and Q4_G the high nibbles stay in
/// place (`raw & 0xF0`, each quant times 16, which saves a shift per vector;
/// [`accumulate_sub_block`] divides the exact integer sum by 16); for Q5_0 and Q6_0 they are
/// shifted down, and both sub-blocks get their quants' high bits from the scales plane at `sp`
/// ([`add_high_bits`]). The 8 vectors, then the high-bit vectors, are read in address order
/// ([`load_in_order`]).
///
/// # Safety
/// AVX-512 F/BW must be available; the pair and its scales lie at the planes' offsets.
#[inline(always)]
unsafe fn unpack_pair<const SCALES: u8>(wp: *const u8, sp: *const u8, j: usize) -> ([__m512i; 8], [__m512i; 8]) {
    debug_assert!(j.is_multiple_of(2));
    // SAFETY: the caller's contract.
    unsafe {
        let wb = wp.add((j / 2) * PAIR_BYTES);
        let raw: [__m512i; 8] = std::array::from_fn(|k| load_in_order(wb.add(64 * k)));
        let nibble = _mm512_set1_epi8(0x0F);
        let h = high_bits::<SCALES>();
        if h > 0 {
            // Each sub-block's `h` high-bit vectors, loaded once for the slots they serve.
            let [low_bits, high_bits] = [j, j + 1].map(|j| {
                let at = sp.add(crate::q56::high_bits_offset(h, j));
                let mut bits = [_mm512_setzero_si512(); 2];
                for (v, bits) in bits.iter_mut().enumerate().take(h) {
                    *bits = load_in_order(at.add(64 * v));
                }
                bits
            });
            let low = std::array::from_fn(|k| add_high_bits::<SCALES>(_mm512_and_si512(raw[k], nibble), &low_bits, k));
            let high = std::array::from_fn(|k| {
                let shifted = _mm512_srli_epi16(raw[k], 4);
                add_high_bits::<SCALES>(_mm512_and_si512(shifted, nibble), &high_bits, k)
            });
            return (low, high);
        }
        (raw.map(|v| _mm512_and_si512(v, nibble)), raw.map(|v| _mm512_and_si512(v, _mm512_set1_epi8(0xF0u8 as i8))))
    }
}

/// Vector `k` of a sub-block's unpacked nibbles `low` with Q5_0's fifth bits (and Q6_0's
/// sixth) put above them from the sub-block's high-bit vectors `bits` (the first H of them;
/// `q56.rs`' layout): the vector holding `k`'s slot, shifted so that the slot's bits sit at
/// bits `4 .. 4 + H` of every byte, masked to them and ORed onto the nibble, one shift and
/// one `vpternlogd`; `low` itself for Q4_K and Q4_G.
///
/// # Safety
/// AVX-512 F/BW must be available.
#[inline(always)]
unsafe fn add_high_bits<const SCALES: u8>(low: __m512i, bits: &[__m512i; 2], k: usize) -> __m512i {
    let high = high_bits::<SCALES>();
    if high == 0 {
        return low;
    }
    let (v, slot_bit) = crate::q56::high_bit_slot(high, k);
    // SAFETY: the caller's contract.
    unsafe {
        let placed = shift_bytes_to_bit4(bits[v], slot_bit);
        let mask = _mm512_set1_epi8((((1u8 << high) - 1) << 4) as i8);
        // `low | (placed & mask)`: 0xF8 is `A | (B & C)` in `vpternlogd`'s truth table.
        _mm512_ternarylogic_epi32::<0xF8>(low, placed, mask)
    }
}

/// The shift of `v` in 16-bit lanes (`$left` and `$right` are its ISA's immediate shifts) that
/// moves bit `from` (0..8) of every byte to bit 4; the bits crossing into the neighbouring
/// byte land outside bits `4 .. 4 + H`, which the caller masks.
macro_rules! shift_bytes_to_bit4 {
    ($v:expr, $from:expr, $left:ident, $right:ident) => {
        match $from {
            0 => $left::<4>($v),
            1 => $left::<3>($v),
            2 => $left::<2>($v),
            3 => $left::<1>($v),
            4 => $v,
            5 => $right::<1>($v),
            6 => $right::<2>($v),
            _ => $right::<3>($v),
        }
    };
}

/// [`shift_bytes_to_bit4!`] on AVX-512.
///
/// # Safety
/// AVX-512 BW must be available.
#[inline(always)]
unsafe fn shift_bytes_to_bit4(v: __m512i, from: usize) -> __m512i {
    // SAFETY: the caller's contract.
    unsafe { shift_bytes_to_bit4!(v, from, _mm512_slli_epi16, _mm512_srli_epi16) }
}

/// 64 bytes at any address: the type [`load_in_order`] reads.
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct Unaligned(__m512i);

/// The 64 bytes at `p`, as one unaligned load that the compiler keeps in program order with
/// the tile's other such loads (a volatile read). Decode streams the planes from memory, and
/// the order of a tile's loads is the order in which their cache lines are first asked for:
/// with the compiler free to schedule them, it asked for a Q6_0 pair's lines out of order
/// (the sixth weight vector first, the scales after the high bits), and one thread streamed
/// Q6_0 weights 1.6× slower than in order (`model_quant_decode`, `BENCHMARKS.md`). The value
/// is the plain load's.
///
/// # Safety
/// `p` is valid for reading 64 bytes (no alignment needed).
#[inline(always)]
unsafe fn load_in_order(p: *const u8) -> __m512i {
    // SAFETY: the caller's contract; `Unaligned` has alignment 1.
    unsafe { std::ptr::read_volatile(p as *const Unaligned).0 }
}

/// One Q5_0 or Q6_0 block `j` of 8 rows added to their sums `acc` in the canonical order:
/// `acc + f32(isum − half · Σq_x) · (d · dx)`, with `sum` the block's integer `Σ q_w · q_x`,
/// `d` the rows' scales and `xt` the token's Q8_0 activations row (`cols` quants, then the
/// blocks' `dx`, then their `−128 · Σq_x`, which over 8 (4) takes the offset of 16 (32) out of
/// the integer sum, as in the VNNI tile).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `xt` holds a whole activations row for `cols`.
#[inline(always)]
unsafe fn add_high_bits_block_avx2(
    acc: __m256,
    sum: __m256i,
    d: __m256,
    xt: *const u8,
    cols: usize,
    j: usize,
    high: usize,
) -> __m256 {
    let nb = cols / SUB;
    // SAFETY: the caller's contract: `dx` and the correction of block `j` lie inside the row.
    unsafe {
        let dx = _mm256_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * j) as *const f32));
        let corr = std::ptr::read_unaligned(xt.add(cols + 4 * nb + 4 * j) as *const i32) >> (4 - high);
        let isum = _mm256_add_epi32(sum, _mm256_set1_epi32(corr));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx), acc)
    }
}

/// [`shift_bytes_to_bit4!`] on AVX2.
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
unsafe fn shift_bytes_to_bit4_avx2(v: __m256i, from: usize) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe { shift_bytes_to_bit4!(v, from, _mm256_slli_epi16, _mm256_srli_epi16) }
}

/// One token's sub-block `j` into its 16 rows' `acc`: the exact integer sums of the weight
/// vectors `w` (unsigned) with the token's groups of four activations at `xt` (signed,
/// `vpdpbusd`), then `acc = fma(f32(isum), dsc · dx, acc); acc = fma(−bx, dm, acc)` with Q4_K's
/// activations, or `acc = fma(f32(isum − half · Σq_x), d · dx, acc)` with Q8_0's (Q5_0, Q6_0).
/// For Q4_K and Q4_G an odd `j`'s weights are the high nibbles in place (each quant times 16,
/// [`unpack_pair`]): the integer sum, exact and a multiple of 16 (at most `16 · 15 · 128 · 32
/// < 2^31` in magnitude), is shifted right by 4 first, which gives the same integer and so the
/// same bits.
///
/// # Safety
/// AVX-512 F/VNNI must be available; `xt` is one token's activation row for `cols` columns.
#[inline(always)]
unsafe fn accumulate_sub_block<const SCALES: u8>(
    acc: &mut __m512,
    w: &[__m512i; 8],
    xt: *const u8,
    cols: usize,
    j: usize,
    dsc: __m512,
    dm: __m512,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let xb = xt.add(j * SUB);
        let four = |k: usize| _mm512_set1_epi32(std::ptr::read_unaligned(xb.add(4 * k) as *const i32));
        let mut i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], four(0));
        let mut i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], four(1));
        i0 = _mm512_dpbusd_epi32(i0, w[2], four(2));
        i1 = _mm512_dpbusd_epi32(i1, w[3], four(3));
        i0 = _mm512_dpbusd_epi32(i0, w[4], four(4));
        i1 = _mm512_dpbusd_epi32(i1, w[5], four(5));
        i0 = _mm512_dpbusd_epi32(i0, w[6], four(6));
        i1 = _mm512_dpbusd_epi32(i1, w[7], four(7));
        finish_sub_block::<SCALES>(acc, _mm512_add_epi32(i0, i1), xt, cols, j, dsc, dm);
    }
}

/// The float part of [`accumulate_sub_block`] for the sub-block's exact integer sums `isum`
/// (16 rows, one token), however they were summed (`vpdpbusd` or AMX's `tdpbsud`).
///
/// # Safety
/// AVX-512 F must be available; `xt` is one token's activation row for `cols` columns.
#[inline(always)]
unsafe fn finish_sub_block<const SCALES: u8>(
    acc: &mut __m512,
    isum: __m512i,
    xt: *const u8,
    cols: usize,
    j: usize,
    dsc: __m512,
    dm: __m512,
) {
    let nb = cols / SUB;
    let high = high_bits::<SCALES>();
    // SAFETY: the caller's contract.
    unsafe {
        let dx = _mm512_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * j) as *const f32));
        if high > 0 {
            // Q8_0's activations: the block's `−128 · Σq_x` over 8 (4) is `−16 · Σq_x`
            // (`−32 · Σq_x`), which turns `Σ q · q_x` into `Σ (q − half) · q_x` (exact
            // integers).
            let corr = std::ptr::read_unaligned(xt.add(cols + 4 * nb + 4 * j) as *const i32) >> (4 - high);
            let isum = _mm512_add_epi32(isum, _mm512_set1_epi32(corr));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dsc, dx), *acc);
            return;
        }
        let bx = _mm512_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * nb + 4 * j) as *const f32));
        // An odd sub-block of Q4_K or Q4_G is the pair's high nibbles in place, times 16.
        let times_16 = !j.is_multiple_of(2);
        let isum = _mm512_cvtepi32_ps(if times_16 { _mm512_srai_epi32(isum, 4) } else { isum });
        *acc = _mm512_fmadd_ps(isum, _mm512_mul_ps(dsc, dx), *acc);
        *acc = _mm512_fnmadd_ps(bx, dm, *acc);
    }
}

/// Tokens per AMX-INT8 tile of [`group_vnni_unpacked`].
const AMX_TOKENS: usize = crate::amx::TILE;

/// Super-blocks a prefill product unpacks at once ([`group_vnni_unpacked`]): 4, 1024 columns,
/// whose 16 rows' unpacked weights take 16 KB on the stack and stay in L1 while every token
/// tile reads them.
const UNPACK_SUPERS: usize = 4;

/// All `n_tokens` tokens × one group of 16 rows on AVX-512 VNNI, for products long enough
/// that unpacking the weights once pays (prefill): chunk by chunk of [`UNPACK_SUPERS`]
/// super-blocks, the chunk's sub-blocks are unpacked once ([`unpack_pair`]) into a stack
/// buffer, then every tile of up to 8 tokens runs over them, its accumulators carried from
/// one chunk to the next through `y`. Each output sees the same operations in the same order
/// as in [`tile_vnni`] (the integer sums are exact, the FMAs run sub-block by sub-block), so
/// the bits are the same as any other batch's.
///
/// # Safety
/// As [`tile_vnni`], for `n_tokens` token rows of `xq`; `y` is valid for reading and writing
/// rows `0..valid` of `n_tokens` tokens at row stride `y_stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn group_vnni_unpacked<const SCALES: u8>(
    n_tokens: usize,
    wq: &[u8],
    ws: &[u8],
    cols: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    let nb = cols / SUB;
    assert!(wq.len() >= nb / 2 * PAIR_BYTES && ws.len() >= scales_len::<SCALES>(cols));
    assert!(xq.len() >= n_tokens * stride && stride >= cols + 8 * nb);
    debug_assert!(valid <= GROUP_ROWS);
    let (wp, sp, xp) = (wq.as_ptr(), ws.as_ptr(), xq.as_ptr());
    let mask: __mmask16 = if valid >= GROUP_ROWS { 0xffff } else { (1u16 << valid) - 1 };
    let mut unpacked = [[_mm512_setzero_si512(); 8]; UNPACK_SUPERS * QK_K / SUB];
    let n_super = cols.div_ceil(QK_K);
    let amx = n_tokens >= AMX_TOKENS && crate::amx_int8();
    let mut sums = [crate::amx::SumsTile::new(), crate::amx::SumsTile::new()];
    if amx {
        // SAFETY: AMX was granted (`amx_int8`); released below.
        unsafe { crate::amx::load_config(&crate::amx::INT8_CONFIG) };
    }
    for s0 in (0..n_super).step_by(UNPACK_SUPERS) {
        let s1 = (s0 + UNPACK_SUPERS).min(n_super);
        let mut n = 0;
        for s in s0..s1 {
            for jj in (0..subs_in(cols, s)).step_by(2) {
                // SAFETY: sub-blocks `s · 8 + jj` and the next one: their pair and scales lie
                // inside the planes (checked above).
                let (low, high) = unsafe { unpack_pair::<SCALES>(wp, sp, s * (QK_K / SUB) + jj) };
                (unpacked[n], unpacked[n + 1]) = (low, high);
                n += 2;
            }
        }
        let mut t = 0;
        // Whole tiles of 16 tokens on AMX-INT8, when the CPU has it: the integer sums of each
        // sub-block in one `tdpbsud`, the float part as below, so every output's bits are the
        // same either way.
        while amx && n_tokens - t >= AMX_TOKENS {
            // SAFETY: AMX-INT8 was granted and `INT8_CONFIG` loaded (`amx`); tokens `t..t + 16`
            // exist, each sub-block's 32 activation bytes lie inside its token's row and
            // `unpacked[i]` is 512 contiguous bytes; as below otherwise.
            unsafe {
                let yt = y.add(t * y_stride);
                let mut acc = [_mm512_setzero_ps(); AMX_TOKENS];
                if s0 > 0 {
                    for (u, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm512_maskz_loadu_ps(mask, yt.add(u * y_stride));
                    }
                }
                // Sub-block `i` of the chunk is `j = 8 · s0 + i`. Sub-block `i + 1`'s tile
                // instructions go out before sub-block `i`'s float part reads its sums, so the
                // stored tile has time to land.
                let sub_sums = |i: usize, sums: &mut crate::amx::SumsTile| {
                    let j = s0 * (QK_K / SUB) + i;
                    let w = unpacked[i].as_ptr() as *const u8;
                    crate::amx::sub_block_sums_i8(xp.add(t * stride + j * SUB), stride, w, sums.0.as_mut_ptr())
                };
                sub_sums(0, &mut sums[0]);
                for i in 0..n {
                    if i + 1 < n {
                        sub_sums(i + 1, &mut sums[(i + 1) % 2]);
                    }
                    let j = s0 * (QK_K / SUB) + i;
                    let (dsc, dm) = sub_block_scales::<SCALES>(sp, j / (QK_K / SUB), j % (QK_K / SUB));
                    let sums = &sums[i % 2];
                    for (u, acc) in acc.iter_mut().enumerate() {
                        let isum = _mm512_load_si512(sums.0.as_ptr().add(u * GROUP_ROWS) as *const __m512i);
                        finish_sub_block::<SCALES>(acc, isum, xp.add((t + u) * stride), cols, j, dsc, dm);
                    }
                }
                for (u, acc) in acc.iter().enumerate() {
                    _mm512_mask_storeu_ps(yt.add(u * y_stride), mask, *acc);
                }
            }
            t += AMX_TOKENS;
        }
        while t < n_tokens {
            let mt = crate::quant::Q8_MT.min(n_tokens - t);
            // SAFETY: the caller's contract for tokens `t..t + mt`; the chunk's scales and
            // every token's activations lie inside the slices (checked above).
            unsafe {
                let yt = y.add(t * y_stride);
                let mut acc = [_mm512_setzero_ps(); crate::quant::Q8_MT];
                if s0 > 0 {
                    for (u, acc) in acc.iter_mut().enumerate().take(mt) {
                        *acc = _mm512_maskz_loadu_ps(mask, yt.add(u * y_stride));
                    }
                }
                let mut i = 0;
                for s in s0..s1 {
                    for jj in 0..subs_in(cols, s) {
                        let j = s * (QK_K / SUB) + jj;
                        let (dsc, dm) = sub_block_scales::<SCALES>(sp, s, jj);
                        for (u, acc) in acc.iter_mut().enumerate().take(mt) {
                            accumulate_sub_block::<SCALES>(
                                acc,
                                &unpacked[i],
                                xp.add((t + u) * stride),
                                cols,
                                j,
                                dsc,
                                dm,
                            );
                        }
                        i += 1;
                    }
                }
                for (u, acc) in acc.iter().enumerate().take(mt) {
                    _mm512_mask_storeu_ps(yt.add(u * y_stride), mask, *acc);
                }
            }
            t += mt;
        }
    }
    if amx {
        // SAFETY: loaded above.
        unsafe { crate::amx::release() };
    }
}

/// Weight vector `$k` of sub-block `$j` (whose pair starts at `$wb`), rows `8h .. 8h + 8`
/// for `$h`, in the AVX2 tile of `$scales`: its 32 nibbles and, for Q5_0 and Q6_0, the high
/// bits from the scales plane at `$sp` moved to bits `4 .. 4 + H` and ORed on (`63 · 128 · 2 <
/// 2^15`: no `vpmaddubsw` pair saturates). A macro, so that it is inlined into the tile's
/// loops whatever the compiler's inlining heuristics say (as a `#[target_feature]` function
/// the Q4_K tile ran 20% slower). Unsafe: the vector and its high bits must lie inside the
/// group's planes.
macro_rules! unpack_avx2 {
    ($scales:ident, $wb:expr, $sp:expr, $j:expr, $k:expr, $h:expr) => {{
        let (j, k, h) = ($j, $k, $h);
        let high = high_bits::<$scales>();
        let raw = _mm256_loadu_si256($wb.add(64 * k + 32 * h) as *const __m256i);
        let raw = if j.is_multiple_of(2) { raw } else { _mm256_srli_epi16(raw, 4) };
        let w = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
        if high == 0 {
            w
        } else {
            let (v, slot_bit) = crate::q56::high_bit_slot(high, k);
            let at = crate::q56::high_bits_offset(high, j) + 64 * v + 32 * h;
            let bits = _mm256_loadu_si256($sp.add(at) as *const __m256i);
            let placed = shift_bytes_to_bit4_avx2(bits, slot_bit);
            let high_mask = _mm256_set1_epi8((((1u16 << high) - 1) << 4) as u8 as i8);
            _mm256_or_si256(w, _mm256_and_si256(placed, high_mask))
        }
    }};
}

/// How many weight vectors' `vpmaddubsw` pair sums the AVX2 tile adds in 16 bits before one
/// `vpmaddwd` widens them, for a format with `high` high bits (1: Q5_0, 2: Q6_0). A pair sum
/// is at most `2 · q_max · 128` in magnitude (Q8_0's activations lie in `−128..=127`): with
/// Q5_0's `q_max = 31` four of them make at most 31744, with Q6_0's 63 two make 32256, both
/// below `2^15`, so the 16-bit sums are exact.
#[inline(always)]
const fn run_steps(high: usize) -> usize {
    RUN_STEPS / high
}

/// The longest run of weight vectors the AVX2 tile holds unpacked at once (four ymm
/// registers).
const RUN_STEPS: usize = 4;

/// Whether the AVX2 tile for `mt` tokens asks for the quants [`ONE_TOKEN_PREFETCH_BYTES`] ahead
/// (and the scales as far ahead in proportion), as the VNNI tile does: for one token. With the
/// hardware prefetcher alone, its loads waited on memory although its arithmetic could go
/// faster. On the Zen 3 (2 cores, AVX2), one token through Qwen3-0.6B's 28 layers
/// (`model_quant_decode`, medians of 30, alternating rounds) took in Q4_K 8.54, 9.05, 9.77,
/// 9.36 ms without and 7.99, 8.57, 7.97, 7.56 ms with it; in Q5_0 13.61, 15.52, 13.96, 12.51
/// → 12.01, 13.03, 14.31, 11.79 ms, in Q6_0 13.48, 13.67, 14.65, 12.55 → 12.41, 13.21, 12.13,
/// 12.18 ms (once their one-token path shared its activations between the two halves of the
/// rows; before that they ran out of instructions first and the prefetch did not help them).
#[inline(always)]
const fn avx2_prefetches(mt: usize) -> bool {
    mt == 1
}

/// Up to how many tokens the AVX2 tile makes a Q4_K or Q4_G sub-block pair's two sums from
/// one load of the pair's shared quant bytes (low nibbles: the even sub-block, high: the odd
/// one) instead of loading the bytes once per sub-block and shifting for the odd one: fewer
/// instructions per weight byte where a decode step has the least arithmetic to hide its
/// loads under. Each token's two sums take twice the registers, so only a few tokens fit.
/// Qwen3-0.6B's 28 layers in Q4_K for one token (`model_quant_decode`, Zen 3, medians of 60,
/// alternating rounds): on one thread 16.2–22.9 → 14.3–17.8 ms (lower in three rounds of
/// four), on two 11.3–12.2 → 10.5–12.0 ms (lower in all four); two tokens level. The same
/// pairing for Q5_0 and Q6_0 (the two sub-blocks' high bits ORed on from their own vectors)
/// was level with their runs by halves (Q5_0 slower in four rounds of five, Q6_0 faster in
/// four, by a few percent) and was not kept. The integer sums are the same, so are the bits.
const PAIRED_MT: usize = 2;

/// `MT` tokens × one group of 16 rows on AVX2, each weight vector loaded and unpacked (with
/// Q5_0's and Q6_0's high bits ORed on) once for all `MT` tokens; for Q4_K and Q4_G with at
/// most [`PAIRED_MT`] tokens, each pair of sub-blocks from one load of its shared bytes. For
/// Q4_K and Q4_G a sub-block's eight `vpmaddubsw` pair sums are added in 16 bits before one
/// `vpmaddwd` widens them (each lane sums 8 pairs, `8 · 2 · 15 · 127 = 30480 < 2^15`: exact).
/// With high bits and several tokens the tile runs one half of the rows at a time, in runs of
/// [`run_steps`] weight vectors (four for Q5_0, two for Q6_0) added in 16 bits. That needs one `vpmaddwd` per run where
/// each weight vector took one, and holds only one half's sums, so eight tokens fit in the
/// registers ([`tile_avx2`]). On the Zen 3 the 64-token 1024 × 1024 products
/// (`quant_1024x1024`, fastest of 100) went from 669–741 to 544–554 µs in Q5_0 and from
/// 655–717 to 581–600 µs in Q6_0, and Qwen2.5-Coder's `--quantize q4_k` prefill of 512 tokens
/// from 195–231 to 264–292 tokens/s (BENCHMARKS.md). Q4_K's and Q4_G's tile kept both
/// halves at once: run by halves, 8 tokens at a time, their products took 545 µs against 420.
/// One token (decode) through Q5_0 or Q6_0 takes both halves per weight vector index again,
/// so that the two halves share each broadcast of the token's activations and the compiler
/// keeps everything in registers: the halves one after the other had spilled the eight
/// broadcasts to the stack and reloaded them. One thread, one 256 × 1024 matrix in L2 (200
/// calls, medians of 30, three alternating rounds): Q5_0 2.19–2.58 → 1.91–1.96 ms, Q6_0
/// 2.28–4.76 → 2.03–2.09 ms. From memory, two threads, Qwen3-0.6B's 28 layers
/// (`model_quant_decode`, four alternating rounds, no prefetch yet): Q5_0 14.55, 14.17,
/// 13.62, 13.09 → 12.83, 12.22, 12.38, 12.05 ms; Q6_0 13.82, 13.82, 13.16, 12.82 → 12.54,
/// 12.57, 12.19, 12.09 ms.
/// The integer sums are exact, combined per token in the canonical order, so the bits are
/// the VNNI and scalar tiles'. With one token, [`avx2_prefetches`] says why each pair also asks
/// for the planes' bytes ahead.
///
/// # Safety
/// As [`tile_avx2`], for `mt = MT` tokens.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx2_shared<const MT: usize, const SCALES: u8>(
    wq: &[u8],
    ws: &[u8],
    cols: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    let nb = cols / SUB;
    let n_super = cols.div_ceil(QK_K);
    assert!(wq.len() >= nb / 2 * PAIR_BYTES && ws.len() >= scales_len::<SCALES>(cols));
    assert!(xq.len() >= MT * stride && stride >= cols + 8 * nb);
    debug_assert!(valid <= GROUP_ROWS);
    let grouped = SCALES != Q4K_SCALES;
    let (wp, sp, xp) = (wq.as_ptr(), ws.as_ptr(), xq.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let high = high_bits::<SCALES>();
    let mut acc = [[_mm256_setzero_ps(); 2]; MT];
    // Q4_K and Q4_G with at most `PAIRED_MT` tokens: the odd sub-block's sums, made with the
    // even one's.
    let mut odd_pairs = [[_mm256_setzero_si256(); 2]; MT];
    // One token: the planes' bytes `ONE_TOKEN_PREFETCH_BYTES` ahead of the pair being read
    // ([`avx2_prefetches`]).
    let prefetch = avx2_prefetches(MT);
    let (pair_scales, scales_ahead) = one_token_prefetch_steps::<SCALES>(cols);
    for s in 0..n_super {
        // SAFETY: every offset lies inside the group's planes and the tokens' rows, by the
        // asserts above.
        unsafe {
            let header = if grouped { sp } else { sp.add(s * SUPER_SCALE_BYTES) };
            for jj in 0..subs_in(cols, s) {
                let j = s * (QK_K / SUB) + jj;
                let wb = wp.add((j / 2) * PAIR_BYTES);
                if prefetch && jj.is_multiple_of(2) {
                    prefetch_pair_ahead(wb, sp, j / 2, pair_scales, scales_ahead);
                }
                if high > 0 && MT == 1 {
                    // One token through Q5_0 or Q6_0: both halves of the rows per weight vector
                    // index, sharing the token's broadcast activations, in runs of `run_steps`
                    // whose pair sums add in 16 bits.
                    let steps = run_steps(high);
                    let xb = xp.add(j * SUB);
                    let mut sums = [_mm256_setzero_si256(); 2];
                    for k0 in (0..8).step_by(steps) {
                        let mut run = [_mm256_setzero_si256(); 2];
                        for i in 0..steps {
                            let x4 = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(4 * (k0 + i)) as *const i32));
                            for (h, run) in run.iter_mut().enumerate() {
                                let products = _mm256_maddubs_epi16(unpack_avx2!(SCALES, wb, sp, j, k0 + i, h), x4);
                                *run = if i == 0 { products } else { _mm256_add_epi16(*run, products) };
                            }
                        }
                        for (sum, run) in sums.iter_mut().zip(run) {
                            *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(run, ones));
                        }
                    }
                    for (h, (acc, sum)) in acc[0].iter_mut().zip(sums).enumerate() {
                        let at = crate::q56::scales_offset(high, j) + 16 * h;
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(sp.add(at) as *const __m128i));
                        *acc = add_high_bits_block_avx2(*acc, sum, d, xp, cols, j, high);
                    }
                    continue;
                }
                if high > 0 {
                    // Q5_0 and Q6_0: one half of the rows (`8h .. 8h + 8`) at a time, the
                    // weight vectors in runs of `run_steps` whose pair sums add in 16 bits
                    // (exact, see there) before one `vpmaddwd` widens them into the token's
                    // 32-bit sum.
                    let steps = run_steps(high);
                    for h in 0..2 {
                        let mut sums = [_mm256_setzero_si256(); MT];
                        for k0 in (0..8).step_by(steps) {
                            let mut w = [_mm256_setzero_si256(); RUN_STEPS];
                            for (i, w) in w.iter_mut().enumerate().take(steps) {
                                *w = unpack_avx2!(SCALES, wb, sp, j, k0 + i, h);
                            }
                            for (t, sum) in sums.iter_mut().enumerate() {
                                let xb = xp.add(t * stride + j * SUB + 4 * k0);
                                let mut run = _mm256_setzero_si256();
                                for (i, w) in w.iter().enumerate().take(steps) {
                                    let x4 = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(4 * i) as *const i32));
                                    let products = _mm256_maddubs_epi16(*w, x4);
                                    run = if i == 0 { products } else { _mm256_add_epi16(run, products) };
                                }
                                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(run, ones));
                            }
                        }
                        let at = crate::q56::scales_offset(high, j) + 16 * h;
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(sp.add(at) as *const __m128i));
                        for (t, acc) in acc.iter_mut().enumerate() {
                            acc[h] = add_high_bits_block_avx2(acc[h], sums[t], d, xp.add(t * stride), cols, j, high);
                        }
                    }
                    continue;
                }
                // Q4_K and Q4_G: both halves of each weight vector at once, which kept this
                // faster than the runs above.
                let pairs = if MT > PAIRED_MT {
                    let mut pairs = [[_mm256_setzero_si256(); 2]; MT];
                    for k in 0..8 {
                        let w = [unpack_avx2!(SCALES, wb, sp, j, k, 0), unpack_avx2!(SCALES, wb, sp, j, k, 1)];
                        for (t, pairs) in pairs.iter_mut().enumerate() {
                            let xb = xp.add(t * stride + j * SUB);
                            let x4 = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(4 * k) as *const i32));
                            for h in 0..2 {
                                pairs[h] = _mm256_add_epi16(pairs[h], _mm256_maddubs_epi16(w[h], x4));
                            }
                        }
                    }
                    pairs
                } else if jj.is_multiple_of(2) {
                    // Few tokens: sub-blocks `j` and `j + 1` from one load of their shared
                    // bytes (low and high nibbles, see [`PAIRED_MT`]); `j + 1`'s sums wait in
                    // `odd_pairs` for the next sub-block.
                    let mut pairs = [[_mm256_setzero_si256(); 2]; MT];
                    let low = _mm256_set1_epi8(0x0F);
                    for k in 0..8 {
                        let mut x4 = [[_mm256_setzero_si256(); 2]; MT];
                        for (t, x4) in x4.iter_mut().enumerate() {
                            let xb = xp.add(t * stride + j * SUB + 4 * k);
                            x4[0] = _mm256_set1_epi32(std::ptr::read_unaligned(xb as *const i32));
                            x4[1] = _mm256_set1_epi32(std::ptr::read_unaligned(xb.add(SUB) as *const i32));
                        }
                        for h in 0..2 {
                            let raw = _mm256_loadu_si256(wb.add(64 * k + 32 * h) as *const __m256i);
                            let even = _mm256_and_si256(raw, low);
                            let odd = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                            for t in 0..MT {
                                pairs[t][h] = _mm256_add_epi16(pairs[t][h], _mm256_maddubs_epi16(even, x4[t][0]));
                                odd_pairs[t][h] =
                                    _mm256_add_epi16(odd_pairs[t][h], _mm256_maddubs_epi16(odd, x4[t][1]));
                            }
                        }
                    }
                    pairs
                } else {
                    std::mem::replace(&mut odd_pairs, [[_mm256_setzero_si256(); 2]; MT])
                };
                // Rows `8h .. 8h + 8`'s `(dsc_j, dm_j)`, shared by the tokens.
                let mut scales = [(_mm256_setzero_ps(), _mm256_setzero_ps()); 2];
                for (h, sc) in scales.iter_mut().enumerate() {
                    *sc = if grouped {
                        let sub_scales = sp.add(j * sub_scale_bytes::<SCALES>());
                        (
                            _mm256_cvtph_ps(_mm_loadu_si128(sub_scales.add(16 * h) as *const __m128i)),
                            _mm256_cvtph_ps(_mm_loadu_si128(sub_scales.add(32 + 16 * h) as *const __m128i)),
                        )
                    } else {
                        let sub_scales = header.add(HEADER_BYTES + jj * SUB_SCALE_BYTES);
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(header.add(16 * h) as *const __m128i));
                        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(header.add(32 + 16 * h) as *const __m128i));
                        let sc8 = _mm_loadl_epi64(sub_scales.add(8 * h) as *const __m128i);
                        let m8 = _mm_loadl_epi64(sub_scales.add(16 + 8 * h) as *const __m128i);
                        (
                            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8))),
                            _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8))),
                        )
                    };
                }
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xt = xp.add(t * stride);
                    let dx = _mm256_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * j) as *const f32));
                    let bx = _mm256_set1_ps(std::ptr::read_unaligned(xt.add(cols + 4 * nb + 4 * j) as *const f32));
                    for h in 0..2 {
                        let (dsc, dm) = scales[h];
                        let isum = _mm256_madd_epi16(pairs[t][h], ones);
                        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dsc, dx), acc[h]);
                        acc[h] = _mm256_fnmadd_ps(bx, dm, acc[h]);
                    }
                }
            }
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract: rows `0..valid` of token `t` are writable.
        unsafe { crate::quant_x86::store_group_avx2(acc, y.add(t * y_stride), valid) };
    }
}

/// `mt` tokens × one group of 16 rows on AVX2 (no VNNI): `vpmaddubsw(w, x)` multiplies the
/// unpacked nibbles (unsigned, at most 15; with Q5_0's and Q6_0's high bits at most 63) by the
/// signed activations without saturating (`2 · 63 · 127 < 2^15`), `vpmaddwd` by ones widens
/// the pairs to i32: the same exact sub-block sums as the VNNI tile, combined in the same
/// order, on the scales plane `SCALES` picks. Up to four tokens share each weight load
/// ([`tile_avx2_shared`]); eight for Q5_0 and Q6_0.
///
/// # Safety
/// AVX2, FMA and F16C must be available; otherwise as [`tile_vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_avx2<const SCALES: u8>(
    mt: usize,
    wq: &[u8],
    ws: &[u8],
    cols: usize,
    xq: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    use crate::quant_x86::{SharedTile, in_fours};
    if high_bits::<SCALES>() > 0 && mt == 8 {
        // SAFETY: the caller's contract, for `mt = 8` tokens.
        return unsafe { tile_avx2_shared::<8, SCALES>(wq, ws, cols, xq, stride, y, y_stride, valid) };
    }
    let tiles = [
        tile_avx2_shared::<1, SCALES> as SharedTile,
        tile_avx2_shared::<2, SCALES>,
        tile_avx2_shared::<3, SCALES>,
        tile_avx2_shared::<4, SCALES>,
    ];
    // SAFETY: the caller's contract.
    unsafe { in_fours(tiles, mt, wq, ws, cols, xq, stride, y, y_stride, valid) }
}
