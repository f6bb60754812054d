//! AVX2 + FMA + F16C kernels for x86_64 (no AVX-512 is assumed).
//!
//! Every function here carries `#[target_feature(enable = "avx2,fma,f16c")]` and must only be
//! called after [`crate::isa`] reported [`crate::Isa::Avx2Fma`]. Weights are read with
//! unaligned loads (they come from an mmap at 2-byte alignment) and widened to f32 in
//! registers (BF16: shift left by 16; F16: `vcvtph2ps`); all accumulation is in f32.
//!
//! Pointer arguments are raw because the matmul drivers hand disjoint output rows to several
//! threads; each function states the extents it reads and writes.

use std::arch::x86_64::*;

/// Dtype codes used as const generic parameters, so each kernel is compiled per dtype.
pub const BF16: u8 = 0;
pub const F16: u8 = 1;
pub const F32: u8 = 2;

/// Rows per packed GEMM panel (three 8-wide vectors).
pub const NR: usize = 24;
/// Depth of a packed GEMM panel: `NR * KC` f32 = 24 KiB, which stays in L1.
pub const KC: usize = 256;
/// Tokens per GEMM microkernel call.
pub const MR: usize = 4;

/// Packed-panel storage (aligned so the microkernel's loads never split a cache line).
#[repr(C, align(64))]
pub struct Panel(pub [f32; NR * KC]);

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

/// Transposes an 8×8 block held as eight row vectors into eight column vectors.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// Packs rows `0..nr` (`nr <= NR`) and columns `k0..k0 + kc` (`kc <= KC`) of the weight block
/// starting at `w` into `panel` as f32 in `[k][NR]` order; rows `nr..NR` are zero.
///
/// # Safety
/// `w` must be valid for `nr` rows of `cols` elements of dtype `D`; `k0 + kc <= cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn pack_panel<const D: u8>(w: *const u8, cols: usize, nr: usize, k0: usize, kc: usize, panel: &mut Panel) {
    debug_assert!(nr <= NR && kc <= KC && k0 + kc <= cols);
    let size = if D == F32 { 4 } else { 2 };
    let row_bytes = cols * size;
    let out = &mut panel.0;
    // SAFETY (whole body): weight reads are at rows `< nr` and columns `k0..k0 + kc`, inside the
    // caller's extent; writes are at `k * NR + r` with `k < kc <= KC`, `r < NR`, inside `panel`.
    unsafe {
        for g in 0..NR / 8 {
            let g0 = g * 8;
            let valid = nr.saturating_sub(g0).min(8);
            let mut k = 0;
            if valid == 8 {
                let rows: [*const u8; 8] = std::array::from_fn(|i| w.add((g0 + i) * row_bytes));
                while k + 8 <= kc {
                    let v: [__m256; 8] = std::array::from_fn(|i| load8::<D>(rows[i], k0 + k));
                    let cols8 = transpose8(v);
                    for (j, col) in cols8.iter().enumerate() {
                        _mm256_storeu_ps(out.as_mut_ptr().add((k + j) * NR + g0), *col);
                    }
                    k += 8;
                }
            }
            while k < kc {
                for i in 0..8 {
                    out[k * NR + g0 + i] =
                        if i < valid { load1::<D>(w.add((g0 + i) * row_bytes), k0 + k) } else { 0.0 };
                }
                k += 1;
            }
        }
    }
}

/// GEMM microkernel: for `MT` tokens and the `NR` rows of a packed panel of depth `kc`,
/// `y[t, r] (+)= Σ_k panel[k][r] · x[t, k]` for `r < nr`.
///
/// `MT × 3` ymm accumulators (12 for `MT = 4`): per `k`, three panel loads and `MT`
/// broadcasts feed `3·MT` FMAs.
///
/// # Safety
/// `x` must be valid for reading `x[t * x_stride + k]`, `t < MT`, `k < kc`; `y` must be valid
/// for reading and writing `y[t * y_stride + r]`, `t < MT`, `r < nr`, and not be written by
/// anyone else meanwhile.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_kernel<const MT: usize>(
    panel: &Panel,
    kc: usize,
    x: *const f32,
    x_stride: usize,
    y: *mut f32,
    y_stride: usize,
    nr: usize,
    accumulate: bool,
) {
    debug_assert!(kc <= KC && nr <= NR);
    let p = panel.0.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 3]; MT];
    // SAFETY: panel reads are at `k * NR + 0..24` with `k < kc <= KC`; `x` and `y` accesses
    // stay in the extents the caller guaranteed.
    unsafe {
        // One step of depth `k`: three panel vectors times one broadcast per token.
        let step = |k: usize, acc: &mut [[__m256; 3]; MT]| {
            let w0 = _mm256_load_ps(p.add(k * NR));
            let w1 = _mm256_load_ps(p.add(k * NR + 8));
            let w2 = _mm256_load_ps(p.add(k * NR + 16));
            for (t, a) in acc.iter_mut().enumerate() {
                let b = _mm256_broadcast_ss(&*x.add(t * x_stride + k));
                a[0] = _mm256_fmadd_ps(w0, b, a[0]);
                a[1] = _mm256_fmadd_ps(w1, b, a[1]);
                a[2] = _mm256_fmadd_ps(w2, b, a[2]);
            }
        };
        // Unrolled by four: the loop overhead and the dependency between a step's loads and
        // its FMAs are spread over four steps, which keeps both FMA pipes busy (1.6x faster
        // on Zen 4 than the plain loop).
        let mut k = 0;
        while k + 4 <= kc {
            step(k, &mut acc);
            step(k + 1, &mut acc);
            step(k + 2, &mut acc);
            step(k + 3, &mut acc);
            k += 4;
        }
        while k < kc {
            step(k, &mut acc);
            k += 1;
        }
        for (t, a) in acc.iter().enumerate() {
            let yp = y.add(t * y_stride);
            if nr == NR {
                for (j, v) in a.iter().enumerate() {
                    let dst = yp.add(j * 8);
                    let v = if accumulate { _mm256_add_ps(_mm256_loadu_ps(dst), *v) } else { *v };
                    _mm256_storeu_ps(dst, v);
                }
            } else {
                let mut tmp = [0.0f32; NR];
                for (j, v) in a.iter().enumerate() {
                    _mm256_storeu_ps(tmp.as_mut_ptr().add(j * 8), *v);
                }
                for (r, v) in tmp.iter().enumerate().take(nr) {
                    let dst = yp.add(r);
                    *dst = if accumulate { *dst + v } else { *v };
                }
            }
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
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1] {
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
        let s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
        let mut max = _mm_cvtss_f32(s);
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

/// `out[i] = x[i] · inv · w[i]` with `w` in dtype `D` (the scaling step of RMSNorm).
///
/// # Safety
/// `w` must be valid for `out.len()` elements of dtype `D`; `x.len() >= out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale_by_weights<const D: u8>(x: &[f32], inv: f32, w: *const u8, out: &mut [f32]) {
    let n = out.len();
    let iv = _mm256_set1_ps(inv);
    let mut i = 0;
    // SAFETY: every access is at elements `< n`, inside `x`, `out` and the caller's extent of `w`.
    unsafe {
        while i + 8 <= n {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), iv);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, load8::<D>(w, i)));
            i += 8;
        }
        while i < n {
            out[i] = x[i] * inv * load1::<D>(w, i);
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
        for c in main8..head_dim {
            let mut sum = 0.0f32;
            for (p, &s) in scores.iter().enumerate() {
                sum = s.mul_add(*vp.add(p * head_dim + c), sum);
            }
            out[c] = sum;
        }
    }
}
