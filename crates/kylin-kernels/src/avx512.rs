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

use crate::x86::{BF16, F16, load1, load8};

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
pub(crate) unsafe fn load16<const D: u8>(p: *const u8, i: usize) -> __m512 {
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

/// Step 3 of the canonical order for four pairs at once: `out[k] = hsum((a0 + a1) + (a2 + a3))`
/// for the pair `pk = [a0 | a1, a2 | a3]`, with exactly the additions of the GEMV (each
/// addition below is the GEMV's addition on the same two values, in other lanes).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn combine4(p0: [__m512; 2], p1: [__m512; 2], p2: [__m512; 2], p3: [__m512; 2], out: &mut [f32]) {
    // `v = (a0 + a1) + (a2 + a3)` for two pairs: 128-bit blocks 0-1 of the result are the first
    // pair's `v`, blocks 2-3 the second's.
    let v2 = |p: [__m512; 2], q: [__m512; 2]| {
        let a01 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(p[0], q[0]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(p[0], q[0]),
        );
        let a23 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(p[1], q[1]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(p[1], q[1]),
        );
        _mm512_add_ps(a01, a23)
    };
    let (v01, v23) = (v2(p0, p1), v2(p2, p3));
    // `hsum(v)`: `s_i = v_i + v_(i+4)` (block k of `s` is pair k's), then `s_0 + s_2` and
    // `s_1 + s_3`, then their sum, in lane 0 of each block.
    let s =
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(v01, v23), _mm512_shuffle_f32x4::<0b11_01_11_01>(v01, v23));
    let s = _mm512_add_ps(s, _mm512_permute_ps::<0b01_00_11_10>(s));
    let s = _mm512_add_ps(s, _mm512_permute_ps::<0b00_00_00_01>(s));
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` is 64 bytes, the size of one unaligned store.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s) };
    for (k, o) in out.iter_mut().enumerate().take(4) {
        *o = lanes[4 * k];
    }
}

/// One GEMM tile: `y[t * y_stride + r] = Σ_c w[r, c] · x[t * x_stride + c]` for `t < MT_`,
/// `r < NR_`, each output reduced in the GEMV's order (module header).
///
/// Per 32-column step: `2·NR_` weight vectors widened, `2·MT_` token vectors loaded,
/// `2·MT_·NR_` fused multiply-adds, and a share of the `pf_len` bytes at `pf` prefetched into
/// L1 (the driver passes the next row tile's weights, so memory streams while this tile
/// computes; `pf_len = 0` prefetches nothing).
///
/// # Safety
/// `w` must be valid for `NR_` rows of `cols` elements of dtype `D` (row stride `row_bytes`
/// bytes); `x` for reading `x[t * x_stride + c]`, `t < MT_`, `c < cols`; `y` for writing
/// `y[t * y_stride + r]`, `t < MT_`, `r < NR_`, with no one else accessing those meanwhile;
/// `pf..pf + pf_len` must lie inside one allocation (it is only prefetched, never read).
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
    pf: *const u8,
    pf_len: usize,
) {
    let main32 = cols & !31;
    let main8 = cols & !7;
    let pf_lines = pf_len.div_ceil(64);
    let pf_per_step = pf_lines.div_ceil((main32 / 32).max(1));
    let mut pf_next = 0;
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
            for _ in 0..pf_per_step {
                if pf_next < pf_lines {
                    // `pf_next * 64 < pf_len`: inside the caller's extent.
                    _mm_prefetch::<_MM_HINT_T1>(pf.add(pf_next * 64) as *const i8);
                    pf_next += 1;
                }
            }
            let wv: [[__m512; 2]; NR_] =
                std::array::from_fn(|r| [load16::<D>(rows[r], c), load16::<D>(rows[r], c + 16)]);
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
        // Step 3 for four pairs at a time, then step 4 per pair.
        let mut sums = [0.0f32; 16];
        let zero = [_mm512_setzero_ps(); 2];
        let pair = |i: usize| if i < MT_ * NR_ { acc[i / NR_][i % NR_] } else { zero };
        for g in (0..MT_ * NR_).step_by(4) {
            combine4(pair(g), pair(g + 1), pair(g + 2), pair(g + 3), &mut sums[g..g + 4]);
        }
        for t in 0..MT_ {
            for (r, row) in rows.iter().enumerate() {
                let mut sum = sums[t * NR_ + r];
                let mut k = main8;
                while k < cols {
                    sum += load1::<D>(*row, k) * *xs[t].add(k);
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
    pf: *const u8,
    pf_len: usize,
) {
    // SAFETY: the caller's contract, for the tile size chosen by `mt` and `nr`.
    unsafe {
        match (mt, nr) {
            (4, 3) => gemm_tile::<D, 4, 3>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (4, 2) => gemm_tile::<D, 4, 2>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (4, _) => gemm_tile::<D, 4, 1>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (3, 3) => gemm_tile::<D, 3, 3>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (3, 2) => gemm_tile::<D, 3, 2>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (3, _) => gemm_tile::<D, 3, 1>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (2, 3) => gemm_tile::<D, 2, 3>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (2, 2) => gemm_tile::<D, 2, 2>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (2, _) => gemm_tile::<D, 2, 1>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (_, 3) => gemm_tile::<D, 1, 3>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            (_, 2) => gemm_tile::<D, 1, 2>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
            _ => gemm_tile::<D, 1, 1>(w, row_bytes, cols, x, x_stride, y, y_stride, pf, pf_len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernel throughput with everything in L1 (a measuring aid, not a check):
    /// `TILE_COLS=1024 cargo test --release -p kylin-kernels --lib tile_throughput -- --ignored
    /// --nocapture` (default 512 columns).
    #[test]
    #[ignore]
    fn tile_throughput() {
        if crate::isa() != crate::Isa::Avx512 {
            return;
        }
        let cols: usize = std::env::var("TILE_COLS").ok().and_then(|v| v.parse().ok()).unwrap_or(512);
        // Weights near 0.5 in every dtype: 0x3F00 as BF16 and F32's upper half, 0x3800 as F16.
        let w: Vec<u8> = (0..NR * cols * 2).flat_map(|i| [(i % 7) as u8, 0x38, (i % 5) as u8, 0x3F]).collect();
        let x: Vec<f32> = (0..MT * cols).map(|i| (i % 13) as f32 * 0.01).collect();
        let mut y = [0.0f32; MT * NR];
        let reps = 50_000_000 / cols;
        let mut best = [f64::INFINITY; 3];
        for _round in 0..8 {
            for (v, b) in best.iter_mut().enumerate() {
                let start = std::time::Instant::now();
                for _ in 0..reps {
                    // SAFETY: `w` holds NR rows of `cols` elements of every dtype (`cols * 4`
                    // bytes per row), `x` MT rows, `y` MT × NR outputs; AVX-512 was detected.
                    unsafe {
                        let (w, x, y) = (std::hint::black_box(w.as_ptr()), x.as_ptr(), y.as_mut_ptr());
                        let c = cols;
                        match v {
                            0 => gemm_tile::<BF16, MT, NR>(w, c * 2, c, x, c, y, NR, w, 0),
                            1 => gemm_tile::<F16, MT, NR>(w, c * 2, c, x, c, y, NR, w, 0),
                            _ => gemm_tile::<{ crate::x86::F32 }, MT, NR>(w, c * 4, c, x, c, y, NR, w, 0),
                        }
                    }
                }
                *b = b.min(start.elapsed().as_secs_f64());
            }
        }
        for (name, t) in ["bf16", "f16", "f32"].iter().zip(best) {
            println!("{name} {MT}x{NR}: {:.1} GF/s per core", 2.0 * (MT * NR * cols * reps) as f64 / t / 1e9);
        }
    }
}
