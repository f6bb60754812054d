//! AVX-512 GEMM tile for x86_64: `y = x · Wᵀ` for a few tokens × a few weight rows at a time,
//! computed with exactly the floating-point operations of the GEMV ([`crate::x86::gemv_rows`]).
//!
//! The GEMV reduces one output `y[t, r] = Σ_c w[r, c] · x[t, c]` in a fixed order (the
//! canonical order of every matmul path, DESIGN.md invariant 7):
//! 1. four 8-lane accumulators `a0..a3` (32 lanes); lane `j` accumulates, by one fused
//!    multiply-add per column, the columns `c ≡ j (mod 32)` for `c < cols & !31`, in order;
//! 2. the columns `cols & !31 .. cols & !7`, eight at a time, into `a0` only;
//! 3. `sum = hsum((a0 + a1) + (a2 + a3))`, with [`crate::x86::hsum`]'s tree;
//! 4. the last `cols % 8` columns one at a time: `sum += w · x`, a rounded product then a
//!    rounded sum.
//!
//! A tile here keeps each `(token, row)` pair in two zmm registers: lanes 0-15 are `a0 | a1`
//! and lanes 16-31 are `a2 | a3`. An IEEE fused multiply-add per lane gives the same result in
//! a zmm as in a ymm, step 2 is a multiply-add masked to lanes 0-7, and steps 3 and 4 are the
//! GEMV's own code on the two halves, so every output is bit for bit the GEMV's whatever the
//! tile, the batch or the thread that computes it. What the tile gains is reuse: each weight
//! vector is widened to f32 once per step and used for `MT` tokens, each token vector is loaded
//! once and used for `NR` rows.
//!
//! Every function here carries `#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]`
//! and must only be called after [`crate::isa`] reported [`crate::Isa::Avx512`].

use std::arch::x86_64::*;

use crate::x86::{BF16, F16, hsum, load1, load8};

/// Tokens per full tile.
pub const MT: usize = 4;
/// Weight rows per full tile (`MT × NR × 2 = 24` accumulators of the 32 zmm registers).
pub const NR: usize = 3;

/// Sixteen weights starting at element `i`, widened to f32.
///
/// # Safety
/// `p` must be valid for reading elements `i..i + 16` of dtype `D`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn load16<const D: u8>(p: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees elements `i..i + 16` are readable; loads are unaligned.
    unsafe {
        match D {
            BF16 => {
                let h = _mm256_loadu_si256(p.add(i * 2) as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(i * 2) as *const __m256i)),
            _ => _mm512_loadu_ps(p.add(i * 4) as *const f32),
        }
    }
}

/// The upper eight lanes of a zmm.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn high8(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// One GEMM tile: `y[t * y_stride + r] = Σ_c w[r, c] · x[t * x_stride + c]` for `t < MT_`,
/// `r < NR_`, each output reduced in the GEMV's order (module header).
///
/// Per 32-column step: `2·NR_` weight vectors widened, `2·MT_` token vectors loaded,
/// `2·MT_·NR_` fused multiply-adds.
///
/// # Safety
/// `w` must be valid for `NR_` rows of `cols` elements of dtype `D` (row stride `row_bytes`
/// bytes); `x` for reading `x[t * x_stride + c]`, `t < MT_`, `c < cols`; `y` for writing
/// `y[t * y_stride + r]`, `t < MT_`, `r < NR_`, with no one else accessing those meanwhile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_tile<const D: u8, const MT_: usize, const NR_: usize>(
    w: *const u8,
    row_bytes: usize,
    cols: usize,
    x: *const f32,
    x_stride: usize,
    y: *mut f32,
    y_stride: usize,
) {
    let main32 = cols & !31;
    let main8 = cols & !7;
    let mut acc = [[[_mm512_setzero_ps(); 2]; NR_]; MT_];
    // SAFETY (whole body): weight reads are at rows `< NR_` and columns `< cols`, token reads at
    // tokens `< MT_` and columns `< cols`, output writes at tokens `< MT_` and rows `< NR_`: all
    // inside the extents the caller guaranteed.
    unsafe {
        let rows: [*const u8; NR_] = std::array::from_fn(|r| w.add(r * row_bytes));
        let xs: [*const f32; MT_] = std::array::from_fn(|t| x.add(t * x_stride));
        // Step 1: 32 columns per step, lanes 0-15 (a0 | a1) and 16-31 (a2 | a3).
        let mut c = 0;
        while c < main32 {
            let wv: [[__m512; 2]; NR_] = std::array::from_fn(|r| [load16::<D>(rows[r], c), load16::<D>(rows[r], c + 16)]);
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let x0 = _mm512_loadu_ps(xs[t].add(c));
                let x1 = _mm512_loadu_ps(xs[t].add(c + 16));
                for (r, a) in acc_t.iter_mut().enumerate() {
                    a[0] = _mm512_fmadd_ps(wv[r][0], x0, a[0]);
                    a[1] = _mm512_fmadd_ps(wv[r][1], x1, a[1]);
                }
            }
            c += 32;
        }
        // Step 2: eight columns per step into a0 (lanes 0-7) only.
        while c < main8 {
            let wv: [__m512; NR_] = std::array::from_fn(|r| _mm512_castps256_ps512(load8::<D>(rows[r], c)));
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xv = _mm512_castps256_ps512(_mm256_loadu_ps(xs[t].add(c)));
                for (r, a) in acc_t.iter_mut().enumerate() {
                    a[0] = _mm512_mask3_fmadd_ps(wv[r], xv, a[0], 0x00FF);
                }
            }
            c += 8;
        }
        // Steps 3 and 4: the GEMV's combination and scalar tail.
        for (t, acc_t) in acc.iter().enumerate() {
            for (r, a) in acc_t.iter().enumerate() {
                let s01 = _mm256_add_ps(_mm512_castps512_ps256(a[0]), high8(a[0]));
                let s23 = _mm256_add_ps(_mm512_castps512_ps256(a[1]), high8(a[1]));
                let mut sum = hsum(_mm256_add_ps(s01, s23));
                let mut k = main8;
                while k < cols {
                    sum += load1::<D>(rows[r], k) * *xs[t].add(k);
                    k += 1;
                }
                *y.add(t * y_stride + r) = sum;
            }
        }
    }
}

/// Dispatches to the tile for `mt <= MT` tokens and `nr <= NR` rows (arguments as
/// [`gemm_tile`]).
///
/// # Safety
/// As [`gemm_tile`] with `MT_ = mt` and `NR_ = nr`; `1 <= mt <= MT`, `1 <= nr <= NR`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_tile_dyn<const D: u8>(
    mt: usize,
    nr: usize,
    w: *const u8,
    row_bytes: usize,
    cols: usize,
    x: *const f32,
    x_stride: usize,
    y: *mut f32,
    y_stride: usize,
) {
    // SAFETY: the caller's contract, for the tile size chosen by `mt` and `nr`.
    unsafe {
        match (mt, nr) {
            (4, 3) => gemm_tile::<D, 4, 3>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (4, 2) => gemm_tile::<D, 4, 2>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (4, _) => gemm_tile::<D, 4, 1>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (3, 3) => gemm_tile::<D, 3, 3>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (3, 2) => gemm_tile::<D, 3, 2>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (3, _) => gemm_tile::<D, 3, 1>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (2, 3) => gemm_tile::<D, 2, 3>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (2, 2) => gemm_tile::<D, 2, 2>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (2, _) => gemm_tile::<D, 2, 1>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (_, 3) => gemm_tile::<D, 1, 3>(w, row_bytes, cols, x, x_stride, y, y_stride),
            (_, 2) => gemm_tile::<D, 1, 2>(w, row_bytes, cols, x, x_stride, y, y_stride),
            _ => gemm_tile::<D, 1, 1>(w, row_bytes, cols, x, x_stride, y, y_stride),
        }
    }
}
