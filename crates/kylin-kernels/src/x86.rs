//! AVX2 + FMA + F16C kernels for x86_64 (no AVX-512 is assumed).
//!
//! Every function here carries `#[target_feature(enable = "avx2,fma,f16c")]` and must only be
//! called after [`crate::isa`] reported [`crate::Isa::Avx2Fma`] or [`crate::Isa::Avx512`]. Weights are read with
//! unaligned loads (they come from an mmap at 2-byte alignment) and widened to f32 in
//! registers (BF16: shift left by 16; F16: `vcvtph2ps`); all accumulation is in f32.
//!
//! [`gemv_rows`] defines the canonical summation order of every matmul output (see
//! `avx512.rs` and `matmul.rs`): any other matmul kernel must reproduce it bit for bit.
//!
//! Pointer arguments are raw because the matmul drivers hand disjoint output rows to several
//! threads; each function states the extents it reads and writes.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Dtype codes used as const generic parameters, so each kernel is compiled per dtype.
pub const BF16: u8 = 0;
pub const F16: u8 = 1;
pub const F32: u8 = 2;

/// Eight weights starting at element `i`, widened to f32.
///
/// # Safety
/// `p` must be valid for reading elements `i..i + 8` of dtype `D`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load8<const D: u8>(p: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller guarantees elements `i..i + 8` are readable; loads are unaligned.
    unsafe {
        match D {
            BF16 => {
                let h = _mm_loadu_si128(p.add(i * 2) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(i * 2) as *const __m128i)),
            _ => _mm256_loadu_ps(p.add(i * 4) as *const f32),
        }
    }
}

/// One weight at element `i`, widened to f32.
///
/// # Safety
/// `p` must be valid for reading element `i` of dtype `D`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load1<const D: u8>(p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees element `i` is readable; reads are unaligned.
    unsafe {
        match D {
            BF16 => f32::from_bits((std::ptr::read_unaligned(p.add(i * 2) as *const u16) as u32) << 16),
            F16 => {
                let bits = std::ptr::read_unaligned(p.add(i * 2) as *const u16);
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
            }
            _ => std::ptr::read_unaligned(p.add(i * 4) as *const f32),
        }
    }
}

/// Horizontal sum of one vector.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// Largest lane of one vector.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// Thirty-two int32 quants (`q[k]` holds elements `8k..8k + 8`) narrowed with signed
/// saturation to int8 and stored in order at `out`; returns their sum. The quantizers of the
/// activations use it (`quant_x86::quantize_row_avx2`, `q4k_x86::quantize_row_avx2`), whose
/// quants already lie in `-128..=127`, so the narrowing is exact.
///
/// # Safety
/// The 32 bytes from `out` are writable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn store_quants32(q: [__m256i; 4], out: *mut u8) -> i32 {
    // Per 128-bit lane, `packs` interleaves its two inputs in runs of four: the bytes come out
    // as the 4-byte runs q0[0..4] q1[0..4] q2[0..4] q3[0..4] q0[4..8] q1[4..8] q2[4..8]
    // q3[4..8], which the permutation puts back in order.
    let pairs = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    let ordered = _mm256_permutevar8x32_epi32(pairs, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: the caller's contract.
    unsafe { _mm256_storeu_si256(out as *mut __m256i, ordered) };
    let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
}

/// GEMV on a block of rows: `y[r] = Σ_c w[r, c] · x[c]` for `r in 0..y.len()`.
///
/// One row at a time, four 8-wide accumulators (32 columns per step). Rows are contiguous, so
/// the weights are read as one sequential stream, which the hardware prefetcher follows at full
/// memory bandwidth; reading four rows side by side instead (four short streams) halves the
/// bandwidth of BF16 rows of 2 KiB on Zen 4. `x` stays in L1.
///
/// # Safety
/// `w` must be valid for `y.len() * cols` elements of dtype `D` (row-major, row stride `cols`);
/// `x.len() >= cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemv_rows<const D: u8>(w: *const u8, cols: usize, x: &[f32], y: &mut [f32]) {
    debug_assert!(x.len() >= cols);
    let size = if D == F32 { 4 } else { 2 };
    let row_bytes = cols * size;
    let xp = x.as_ptr();
    let main32 = cols & !31;
    let main8 = cols & !7;
    // SAFETY (whole body): every weight element read is at row `< y.len()` and column `< cols`,
    // inside the extent the caller guaranteed; `x` reads are at columns `< cols <= x.len()`.
    unsafe {
        for (r, out) in y.iter_mut().enumerate() {
            let w0 = w.add(r * row_bytes);
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c < main32 {
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(load8::<D>(w0, c + 8 * j), _mm256_loadu_ps(xp.add(c + 8 * j)), *a);
                }
                c += 32;
            }
            while c < main8 {
                acc[0] = _mm256_fmadd_ps(load8::<D>(w0, c), _mm256_loadu_ps(xp.add(c)), acc[0]);
                c += 8;
            }
            let mut sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
            while c < cols {
                sum += load1::<D>(w0, c) * *xp.add(c);
                c += 1;
            }
            *out = sum;
        }
    }
}

/// Tokens per tile of [`gemm_tile_passes`]; with [`PASS_NR`] rows, `4 × 3` ymm accumulators.
pub const PASS_MT: usize = 4;
/// Columns per block of [`gemm_tile_passes`] (a multiple of 32): 4 KiB of each token, so a
/// tile's token vectors (16 KiB) and weight rows (6 KiB in BF16) stay in L1 through the four
/// passes over a block. Blocks of 256 columns ran the 1024-column products of Qwen3-0.6B 11–13%
/// slower on a Zen 3 (`gemm_bf16`); wider than L1 (2048) ran the 2048-column ones 1.65× slower.
pub const PASS_KB: usize = 1024;
/// Weight rows per tile of [`gemm_tile_passes`].
pub const PASS_NR: usize = 3;

/// The four partial chains of every output of a [`gemm_tile_passes`] tile, carried from one
/// column block to the next by the caller.
pub type PassChains = [[[MaybeUninit<__m256>; 4]; PASS_NR]; PASS_MT];

/// The end of the column block of [`gemm_tile_passes`] that starts at `k0` (a multiple of
/// [`PASS_KB`], below the 8-wide columns `cols & !7` unless there are none): `PASS_KB` columns,
/// or through the 8-wide middle for the last block.
pub fn pass_block_end(k0: usize, cols: usize) -> usize {
    let (main32, main8) = (cols & !31, cols & !7);
    if k0 + PASS_KB < main32 { k0 + PASS_KB } else { main8 }
}

/// AVX2 GEMM tile of `MT` tokens × `NR` weight rows with the GEMV's bits, in four passes, over
/// the column block `k0..k1` (from [`pass_block_end`]).
///
/// [`gemv_rows`] keeps four independent 8-lane chains per output, chain `j` over the columns
/// `32m + 8j` (and chain 0 also over the 8-wide middle), each in increasing column order, and
/// reduces them as `hsum((a0 + a1) + (a2 + a3))` before the scalar tail. Holding all four
/// chains of every output in registers would limit a tile to 3 outputs (12 of the 16 ymm), so
/// each weight vector would serve 3 products and each token vector 1: the loads, not the
/// multiplies, would bound it (the tile of 3 tokens × 1 row this replaced).
/// Here pass `j` runs chain `j` alone for all `MT × NR` outputs, one register each, so each
/// token vector serves `NR` products and each weight vector `MT`; the finished chains wait in
/// `chains` for the next block or the reduction. The four passes of a block find its token
/// vectors in L1. The caller runs the blocks in order with the same `chains`: the first block
/// (`k0 == 0`) starts the chains, the last (`k1 == cols & !7`) reduces them into `y`, so every
/// chain gets the same fused multiply-adds in the same order and the bits are [`gemv_rows`']
/// however the caller interleaves other tiles between the blocks.
///
/// # Safety
/// `w` must be valid for `NR` rows of `cols` elements of dtype `D` at `w_stride` bytes apart;
/// `x` for reading `x[t * x_stride + c]`, `t < MT`, `c < cols`; `y` for writing
/// `y[t * y_stride + r]`, `t < MT`, `r < NR`, with no one else accessing those meanwhile.
/// `MT <= PASS_MT`, `NR <= PASS_NR`; unless `k0 == 0`, the previous block of this tile wrote
/// `chains`.
#[target_feature(enable = "avx2,fma,f16c")]
// The chain index `j` picks columns as well as the slot in `chains`.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
pub unsafe fn gemm_tile_passes<const D: u8, const MT: usize, const NR: usize>(
    w: *const u8,
    w_stride: usize,
    cols: usize,
    (k0, k1): (usize, usize),
    chains: &mut PassChains,
    x: *const f32,
    x_stride: usize,
    y: *mut f32,
    y_stride: usize,
) {
    let main32 = cols & !31;
    let main8 = cols & !7;
    // SAFETY (whole body): weight reads are at rows `< NR` and columns `< cols`, token reads at
    // tokens `< MT` and columns `< cols`, output writes at tokens `< MT` and rows `< NR`: inside
    // the caller's extents.
    unsafe {
        let ws: [*const u8; NR] = std::array::from_fn(|r| w.add(r * w_stride));
        let xs: [*const f32; MT] = std::array::from_fn(|t| x.add(t * x_stride));
        if k0 < k1 {
            for j in 0..4 {
                let mut acc = [[_mm256_setzero_ps(); NR]; MT];
                if k0 > 0 {
                    for (t, a) in acc.iter_mut().enumerate() {
                        for (r, a) in a.iter_mut().enumerate() {
                            // SAFETY: the previous block's pass `j` wrote this chain.
                            *a = chains[t][r][j].assume_init();
                        }
                    }
                }
                // One step of chain `j` at column `c` for every output (a macro, not a closure,
                // so that it is compiled with this function's target features).
                macro_rules! step {
                    ($c:expr) => {{
                        let c = $c;
                        let mut wv = [_mm256_setzero_ps(); NR];
                        for (r, v) in wv.iter_mut().enumerate() {
                            *v = load8::<D>(ws[r], c);
                        }
                        for (t, a) in acc.iter_mut().enumerate() {
                            let xv = _mm256_loadu_ps(xs[t].add(c));
                            for (r, a) in a.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(wv[r], xv, *a);
                            }
                        }
                    }};
                }
                let mut c = k0 + 8 * j;
                while c + 32 - 8 * j <= k1.min(main32) {
                    step!(c);
                    c += 32;
                }
                if j == 0 && k1 == main8 {
                    // The 8-wide middle, after every 32-column step: chain 0's order.
                    let mut c = main32;
                    while c < main8 {
                        step!(c);
                        c += 8;
                    }
                }
                for (t, a) in acc.iter().enumerate() {
                    for (r, a) in a.iter().enumerate() {
                        chains[t][r][j] = MaybeUninit::new(*a);
                    }
                }
            }
        }
        if k1 < main8 {
            return;
        }
        for t in 0..MT {
            for r in 0..NR {
                // SAFETY: with `main8 > 0` the blocks wrote every chain; without it the chains
                // are empty sums.
                let a: [__m256; 4] = if main8 > 0 {
                    std::array::from_fn(|j| chains[t][r][j].assume_init())
                } else {
                    [_mm256_setzero_ps(); 4]
                };
                let mut sum = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
                let mut k = main8;
                while k < cols {
                    sum += load1::<D>(ws[r], k) * *xs[t].add(k);
                    k += 1;
                }
                *y.add(t * y_stride + r) = sum;
            }
        }
    }
}

/// [`gemm_tile_passes`] for `1 <= mt <= PASS_MT` tokens and `1 <= nr <= PASS_NR` rows.
///
/// # Safety
/// As [`gemm_tile_passes`] with `MT = mt`, `NR = nr`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_tile_passes_dyn<const D: u8>(
    mt: usize,
    nr: usize,
    w: *const u8,
    w_stride: usize,
    cols: usize,
    block: (usize, usize),
    chains: &mut PassChains,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
) {
    macro_rules! tile {
        ($nr:literal) => {
            match mt {
                4 => gemm_tile_passes::<D, 4, $nr>(w, w_stride, cols, block, chains, x, xs, y, ys),
                3 => gemm_tile_passes::<D, 3, $nr>(w, w_stride, cols, block, chains, x, xs, y, ys),
                2 => gemm_tile_passes::<D, 2, $nr>(w, w_stride, cols, block, chains, x, xs, y, ys),
                _ => gemm_tile_passes::<D, 1, $nr>(w, w_stride, cols, block, chains, x, xs, y, ys),
            }
        };
    }
    // SAFETY: the caller's contract, for the tile size chosen by `mt` and `nr`.
    unsafe {
        match nr {
            3 => tile!(3),
            2 => tile!(2),
            _ => tile!(1),
        }
    }
}

/// [`crate::gemm`]'s register tile: `y[t * y_stride + i] = Σ_c x[t * cols + c] · panel[c * 16 +
/// i]` for `t < mt <= 6`, `i < nr <= 16`, each output one sequential chain of fused
/// multiply-adds over `c` from zero (the order of [`crate::gemm`]'s scalar tile).
///
/// # Safety
/// `panel` valid for `cols * 16` floats, `x` for `(mt, cols)`, `y` for writing
/// `y[t * y_stride + i]`, `t < mt`, `i < nr`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gemm_packed_tile(
    mt: usize,
    panel: *const f32,
    cols: usize,
    x: *const f32,
    y: *mut f32,
    y_stride: usize,
    nr: usize,
) {
    // SAFETY: the caller's contract, for the tile size chosen by `mt`.
    unsafe {
        match mt {
            6 => packed_tile::<6>(panel, cols, x, y, y_stride, nr),
            5 => packed_tile::<5>(panel, cols, x, y, y_stride, nr),
            4 => packed_tile::<4>(panel, cols, x, y, y_stride, nr),
            3 => packed_tile::<3>(panel, cols, x, y, y_stride, nr),
            2 => packed_tile::<2>(panel, cols, x, y, y_stride, nr),
            _ => packed_tile::<1>(panel, cols, x, y, y_stride, nr),
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn packed_tile<const MT: usize>(
    panel: *const f32,
    cols: usize,
    x: *const f32,
    y: *mut f32,
    y_stride: usize,
    nr: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; MT];
    // SAFETY (whole body): panel reads at `c * 16 + 0..16`, `c < cols`; token reads at
    // `t * cols + c`, `t < MT`; writes at `t * y_stride + i`, `i < nr`: the caller's extents.
    unsafe {
        for c in 0..cols {
            let b0 = _mm256_loadu_ps(panel.add(c * 16));
            let b1 = _mm256_loadu_ps(panel.add(c * 16 + 8));
            for (t, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(&*x.add(t * cols + c));
                a[0] = _mm256_fmadd_ps(xv, b0, a[0]);
                a[1] = _mm256_fmadd_ps(xv, b1, a[1]);
            }
        }
        for (t, a) in acc.iter().enumerate() {
            store_rows16(y.add(t * y_stride), a[0], a[1], nr);
        }
    }
}

/// Stores the first `n` (at most 16) of the 16 floats `lo` (0..8) and `hi` (8..16) at `out`:
/// one row of an outer-product tile's 16 outputs, of which the last strip or panel may have
/// fewer.
///
/// # Safety
/// AVX present; `out` valid for writing `n` floats.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn store_rows16(out: *mut f32, lo: __m256, hi: __m256, n: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        if n == 16 {
            _mm256_storeu_ps(out, lo);
            _mm256_storeu_ps(out.add(8), hi);
        } else {
            let mut tmp = [0.0f32; 16];
            _mm256_storeu_ps(tmp.as_mut_ptr(), lo);
            _mm256_storeu_ps(tmp.as_mut_ptr().add(8), hi);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, n);
        }
    }
}

/// Widens `out.len()` elements of dtype `D` starting at `w` into `out`.
///
/// # Safety
/// `w` must be valid for `out.len()` elements of dtype `D`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen<const D: u8>(w: *const u8, out: &mut [f32]) {
    let n = out.len();
    let mut i = 0;
    // SAFETY: reads at elements `< n` of `w` (caller's extent) and writes inside `out`.
    unsafe {
        while i + 8 <= n {
            _mm256_storeu_ps(out.as_mut_ptr().add(i), load8::<D>(w, i));
            i += 8;
        }
        while i < n {
            out[i] = load1::<D>(w, i);
            i += 1;
        }
    }
}

/// `Σ a[i] · b[i]` over `min(a.len(), b.len())` elements, four 8-wide accumulators.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load is at indices `< n`, inside both slices.
    unsafe {
        while i + 32 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i + 8 * j)), _mm256_loadu_ps(bp.add(i + 8 * j)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i)), _mm256_loadu_ps(bp.add(i)), acc[0]);
            i += 8;
        }
    }
    let mut sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// Sum of the bytes of `data` read as u64 words (a streaming read for bandwidth probes).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn read_sum(data: &[u8]) -> u64 {
    let n = data.len();
    let p = data.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    // SAFETY: every 32-byte load is at offsets `i..i + 128 <= n`, inside `data`.
    unsafe {
        while i + 128 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_epi64(*a, _mm256_loadu_si256(p.add(i + 32 * j) as *const __m256i));
            }
            i += 128;
        }
    }
    let all = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` is 32 bytes, the size of one unaligned store.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, all) };
    let mut sum = lanes.iter().fold(0u64, |s, v| s.wrapping_add(*v));
    for b in &data[i..] {
        sum = sum.wrapping_add(*b as u64);
    }
    sum
}

/// `e^x` for eight lanes, within 2 ulp of a correctly rounded `expf` on `[-87.3, 88.7]`.
///
/// Cephes' method: `x = n·ln2 + r` with `|r| <= ln2/2` (ln2 split in two parts so `r` is
/// exact), a degree-6 polynomial for `e^r`, and `2^n` built in the exponent bits. Inputs are
/// clamped to that range, so very negative inputs give about 1e-38 instead of 0 (a difference
/// no softmax or SiLU can see).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.336_54)), _mm256_set1_ps(88.722_83));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    // 2^n: n + 127 in the exponent field. n is in [-126, 128]; 128 only for x near the top,
    // where the polynomial result is below 1 and the product stays finite.
    let n_i = _mm256_cvtps_epi32(n);
    let n_lo = _mm256_srai_epi32::<1>(n_i);
    let n_hi = _mm256_sub_epi32(n_i, n_lo);
    let bias = _mm256_set1_epi32(127);
    let two_lo = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n_lo, bias)));
    let two_hi = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n_hi, bias)));
    _mm256_mul_ps(_mm256_mul_ps(y, two_lo), two_hi)
}

/// [`exp8`] on sixteen lanes: the same operations in the same order on a zmm register, so each
/// lane's result is bit for bit [`exp8`]'s (IEEE rounding per lane does not depend on the
/// register width; `cvtps2dq` rounds to nearest under the default MXCSR in both).
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.336_54)), _mm512_set1_ps(88.722_83));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let n_i = _mm512_cvtps_epi32(n);
    let n_lo = _mm512_srai_epi32::<1>(n_i);
    let n_hi = _mm512_sub_epi32(n_i, n_lo);
    let bias = _mm512_set1_epi32(127);
    let two_lo = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n_lo, bias)));
    let two_hi = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n_hi, bias)));
    _mm512_mul_ps(_mm512_mul_ps(y, two_lo), two_hi)
}

/// Scalar twin of [`exp8`] for the tails, so every element gets the same function.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn exp1(x: f32) -> f32 {
    _mm256_cvtss_f32(exp8(_mm256_set1_ps(x)))
}

/// In-place softmax: max, `e^(x - max)` with [`exp8`], then division by the sum.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn softmax(x: &mut [f32]) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let main = n & !7;
    // SAFETY (whole body): every vector access is at `i..i + 8 <= main <= n`, inside `x`.
    unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < main {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
            i += 8;
        }
        let mut max = hmax(m);
        for v in &x[main..] {
            max = max.max(*v);
        }
        let mv = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        i = 0;
        while i < main {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
            _mm256_storeu_ps(p.add(i), e);
            sum = _mm256_add_ps(sum, e);
            i += 8;
        }
        let mut total = hsum(sum);
        for v in &mut x[main..] {
            *v = exp1(*v - max);
            total += *v;
        }
        let inv = _mm256_set1_ps(1.0 / total);
        i = 0;
        while i < main {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
            i += 8;
        }
        for v in &mut x[main..] {
            *v /= total;
        }
    }
}

/// In-place `gate = silu(gate) * up = gate / (1 + e^-gate) * up`.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let main = n & !7;
    let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
    let one = _mm256_set1_ps(1.0);
    let zero = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: every access is at `i..i + 8 <= main <= n`, inside both slices.
    unsafe {
        while i < main {
            let x = _mm256_loadu_ps(g.add(i));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(g.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(i))));
            i += 8;
        }
    }
    for j in main..n {
        let x = gate[j];
        gate[j] = x / (1.0 + exp1(-x)) * up[j];
    }
}

/// In-place `x = silu(x) = x / (1 + e^-x)`.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn silu(x: &mut [f32]) {
    let n = x.len();
    let main = n & !7;
    let p = x.as_mut_ptr();
    let one = _mm256_set1_ps(1.0);
    let zero = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: every access is at `i..i + 8 <= main <= n`, inside the slice.
    unsafe {
        while i < main {
            let v = _mm256_loadu_ps(p.add(i));
            _mm256_storeu_ps(p.add(i), _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v)))));
            i += 8;
        }
    }
    for v in &mut x[main..] {
        *v = *v / (1.0 + exp1(-*v));
    }
}

/// `tanh(u) = 1 − 2 / (e^{2u} + 1)` on eight lanes (finite for every finite `u`: [`exp8`]
/// clamps its input).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tanh8(u: __m256) -> __m256 {
    let one = _mm256_set1_ps(1.0);
    let e = exp8(_mm256_add_ps(u, u));
    _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0), _mm256_add_ps(e, one)))
}

/// In-place GeGLU with PyTorch's tanh approximation (see `crate::gelu_tanh_mul`).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    const KAPPA: f32 = 0.044715;
    let n = gate.len().min(up.len());
    let main = n & !7;
    let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
    let (beta, kappa, half, one) =
        (_mm256_set1_ps(BETA), _mm256_set1_ps(KAPPA), _mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let gelu = |x: __m256| {
        let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        let inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, x3)));
        _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh8(inner)))
    };
    let mut i = 0;
    // SAFETY: every access is at `i..i + 8 <= main <= n`, inside both slices.
    unsafe {
        while i < main {
            let y = gelu(_mm256_loadu_ps(g.add(i)));
            _mm256_storeu_ps(g.add(i), _mm256_mul_ps(y, _mm256_loadu_ps(u.add(i))));
            i += 8;
        }
    }
    // The tail through the same vector code (padded), so an element's bits do not depend on
    // where the slice ends (batch invariance).
    if main < n {
        let mut pad = [0.0f32; 8];
        pad[..n - main].copy_from_slice(&gate[main..n]);
        // SAFETY: `pad` holds eight elements.
        let y = unsafe { gelu(_mm256_loadu_ps(pad.as_ptr())) };
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(pad.as_mut_ptr(), y) };
        for (j, (g, u)) in gate[main..n].iter_mut().zip(&up[main..n]).enumerate() {
            *g = pad[j] * u;
        }
    }
}

/// In-place `x = cap · tanh(x / cap)` (see `crate::softcap`).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn softcap(x: &mut [f32], cap: f32) {
    let n = x.len();
    let main = n & !7;
    let p = x.as_mut_ptr();
    let c = _mm256_set1_ps(cap);
    let mut i = 0;
    // SAFETY: every access is at `i..i + 8 <= main <= n`, inside `x`.
    unsafe {
        while i < main {
            let v = _mm256_div_ps(_mm256_loadu_ps(p.add(i)), c);
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(tanh8(v), c));
            i += 8;
        }
    }
    // The tail through the same vector code (padded), as in `gelu_tanh_mul`.
    if main < n {
        let mut pad = [0.0f32; 8];
        pad[..n - main].copy_from_slice(&x[main..n]);
        // SAFETY: `pad` holds eight elements.
        unsafe {
            let v = _mm256_div_ps(_mm256_loadu_ps(pad.as_ptr()), c);
            _mm256_storeu_ps(pad.as_mut_ptr(), _mm256_mul_ps(tanh8(v), c));
        }
        x[main..n].copy_from_slice(&pad[..n - main]);
    }
}

/// `out[i] = x[i] · inv · w[i]` with `w` in dtype `D` (the scaling step of RMSNorm), or
/// `x[i] · inv · (1 + w[i])` with `UNIT` (Gemma's).
///
/// # Safety
/// `w` must be valid for `out.len()` elements of dtype `D`; `x.len() >= out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale_by_weights<const D: u8, const UNIT: bool>(x: &[f32], inv: f32, w: *const u8, out: &mut [f32]) {
    let n = out.len();
    let iv = _mm256_set1_ps(inv);
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    // SAFETY: every access is at elements `< n`, inside `x`, `out` and the caller's extent of `w`.
    unsafe {
        while i + 8 <= n {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), iv);
            let wv = load8::<D>(w, i);
            let wv = if UNIT { _mm256_add_ps(one, wv) } else { wv };
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, wv));
            i += 8;
        }
        while i < n {
            let wi = load1::<D>(w, i);
            out[i] = x[i] * inv * if UNIT { 1.0 + wi } else { wi };
            i += 1;
        }
    }
}

/// `out = Σ_p scores[p] · values[p]` over `scores.len()` positions of `(head_dim)` rows,
/// with `out` held in registers: blocks of 64 columns (eight accumulators) per pass over the
/// positions, so nothing is stored until a block is done.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn weighted_sum(scores: &[f32], values: &[f32], head_dim: usize, out: &mut [f32]) {
    let len = scores.len();
    let out = &mut out[..head_dim];
    assert!(values.len() >= len * head_dim, "weighted_sum: values too short");
    let vp = values.as_ptr();
    let main8 = head_dim & !7;
    let mut c0 = 0;
    // SAFETY (whole body): value reads are at `p * head_dim + c` with `p < len` and
    // `c < head_dim`, inside `values` (checked above); output writes are inside `out`.
    unsafe {
        while c0 < main8 {
            let width = (main8 - c0).min(64) / 8;
            let mut acc = [_mm256_setzero_ps(); 8];
            for (p, &s) in scores.iter().enumerate() {
                let sv = _mm256_set1_ps(s);
                let row = vp.add(p * head_dim + c0);
                for (j, a) in acc.iter_mut().enumerate().take(width) {
                    *a = _mm256_fmadd_ps(sv, _mm256_loadu_ps(row.add(8 * j)), *a);
                }
            }
            for (j, a) in acc.iter().enumerate().take(width) {
                _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * j), *a);
            }
            c0 += width * 8;
        }
        for (c, o) in out.iter_mut().enumerate().skip(main8) {
            let mut sum = 0.0f32;
            for (p, &s) in scores.iter().enumerate() {
                sum = s.mul_add(*vp.add(p * head_dim + c), sum);
            }
            *o = sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp16` is `exp8` on sixteen lanes: every lane bit for bit, over the clamped range, its
    /// ends, the values past them, and a dense sweep of the softmax's inputs (`s - max <= 0`).
    #[test]
    fn exp16_matches_exp8_bit_for_bit() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
        {
            return;
        }
        let mut inputs: Vec<f32> =
            vec![0.0, -0.0, 1.0, -1.0, -87.336_54, 88.722_83, -1e30, 1e30, f32::MIN_POSITIVE, -104.0];
        inputs.extend((0..200_000).map(|i| -100.0 + i as f32 * 0.001));
        // A deterministic spread of bit patterns between -128 and 128.
        let mut state = 0x2545_f491_u32;
        inputs.extend((0..100_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32 - 0.5) * 256.0
        }));
        while !inputs.len().is_multiple_of(16) {
            inputs.push(0.5);
        }
        for chunk in inputs.chunks_exact(16) {
            // SAFETY: the features were detected above; the loads and stores are of 16 f32.
            let (wide, narrow) = unsafe {
                let mut wide = [0.0f32; 16];
                _mm512_storeu_ps(wide.as_mut_ptr(), exp16(_mm512_loadu_ps(chunk.as_ptr())));
                let mut narrow = [0.0f32; 16];
                _mm256_storeu_ps(narrow.as_mut_ptr(), exp8(_mm256_loadu_ps(chunk.as_ptr())));
                _mm256_storeu_ps(narrow.as_mut_ptr().add(8), exp8(_mm256_loadu_ps(chunk.as_ptr().add(8))));
                (wide, narrow)
            };
            for ((x, a), b) in chunk.iter().zip(wide).zip(narrow) {
                assert_eq!(a.to_bits(), b.to_bits(), "exp({x}): exp16 {a} vs exp8 {b}");
            }
        }
    }
}
