//! The AMX path of blocked attention under `Precision::Bf16`: `S = bf16(Q) · bf16(K)ᵀ` and
//! `O += bf16(P) · bf16(V)` on AMX tiles with f32 accumulation (what transformers computes
//! for a BF16 model: both products of attention take BF16 inputs), the online softmax in f32
//! on AVX-512 between them.
//!
//! Same structure as the f32 path of [`super`] (absolute partitions of [`PARTITION`]
//! positions folded in order), with tiles of [`AMX_TILE`] positions. Per tile:
//!
//! - the keys are packed into AMX's pair layout (B tiles: row `r` holds dimensions `2r, 2r + 1`
//!   of sixteen keys) and the values likewise along positions (row `r` holds positions `2r,
//!   2r + 1` of sixteen dimensions), rounded to BF16 (exact for a BF16 cache), zeros past the
//!   last position of the call;
//! - per block of 16 rows: `S` (16 × 64) from `hd / 32` steps of four tile products, stored;
//!   each row's online-softmax update in f32 (`m`, `corr = e^(m - m')`, `p = e^(s - m')` with
//!   positions `>= len` at 0, `l = fma(l, corr, sum p)` with the sum `((p0 + p1) + (p2 + p3))`
//!   then `hsum(lo + hi)`), `o = o · corr` when `corr != 1`, `p` rounded to BF16;
//!   `o += P · V` as one or two tile products per sixteen dimensions, `o` loaded into and
//!   stored from a C tile.
//!
//! Batch invariance: each element of a tile product depends only on its row of A and column of
//! B, so a row's `S`, `p` and `o` are the same whatever rows share its block; positions a row
//! does not attend to enter its products only as `p = 0` (adding zero; at most the sign of an
//! exact zero could differ).
//!
//! Conditions (checked by the caller): AMX permitted, `head_dim % 32 == 0`, `block_size % 16
//! == 0`.

// Register-blocked loops index several arrays by row on purpose (fixed trip counts the
// compiler unrolls into registers).
#![allow(clippy::needless_range_loop)]

use std::arch::asm;
use std::arch::x86_64::*;

use super::simd::Zmm;
use super::{DT_BF16, Job, KvView, Lanes, MAX_HEAD_DIM, MAX_ROWS, PARTITION, QueryRow};
use crate::amx::round16;

/// Positions per tile of the AMX path.
pub const AMX_TILE: usize = 64;
const _: () = assert!(PARTITION.is_multiple_of(AMX_TILE));

/// 64-byte aligned storage.
#[repr(C, align(64))]
struct Aligned<const N: usize>([u8; N]);

/// One pair row: `lo` and `hi` rounded, interleaved as `(lo[n], hi[n])` for `n = 0..16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn pair_row(lo: __m512, hi: __m512) -> __m512i {
    _mm512_or_si512(round16(lo), _mm512_slli_epi32::<16>(round16(hi)))
}

/// Sixteen BF16 values from `lo` and sixteen from `hi` (32 bytes each; the lanes of each mask
/// are read, zeros elsewhere) interleaved as `(lo[n], hi[n])`: a pair row of a BF16 cache, which
/// needs no rounding.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn pair_row_bf16(lo: *const u8, lo_mask: __mmask16, hi: *const u8, hi_mask: __mmask16) -> __m512i {
    // SAFETY: the caller guarantees the masked lanes are readable.
    unsafe {
        let a = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(lo_mask, lo as *const i16));
        let b = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(hi_mask, hi as *const i16));
        // Lane 2n takes a[n], lane 2n + 1 takes b[n] (index 32 + n).
        let idx = _mm512_set_epi16(
            47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
            1, 32, 0,
        );
        _mm512_permutex2var_epi16(a, idx, b)
    }
}

/// Tile register operations with the register number as a literal.
macro_rules! tile {
    (zero $t:literal) => {
        asm!(concat!("tilezero tmm", $t), options(nostack, nomem))
    };
    (load $t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{0} + {1}*1]"), in(reg) $p, in(reg) $stride, options(nostack, readonly))
    };
    (store $t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tilestored [{0} + {1}*1], tmm", $t), in(reg) $p, in(reg) $stride, options(nostack))
    };
    (dp $c:literal, $a:literal, $b:literal) => {
        asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
    };
}

/// The AMX body of `attention_rows` for dtype `D`.
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2, FMA, F16C and AMX-BF16 are available and permitted; the checks of
/// `attention_rows` passed; `head_dim % 32 == 0` and `block_size % 16 == 0`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn rows_amx<const D: u8>(rows: &mut [QueryRow<'_>], job: &Job<'_>) {
    let n = rows.len();
    let keys: &KvView<'_> = &job.keys;
    let (hd, bs, size) = (keys.head_dim, keys.block_size, keys.dtype.size_in_bytes());
    debug_assert!(hd % 32 == 0 && bs % 16 == 0 && hd <= MAX_HEAD_DIM && n <= MAX_ROWS);
    let max_len = rows.iter().map(|r| r.len).max().unwrap_or(0);
    let n16 = n.div_ceil(16) * 16;
    let half_hd = hd / 2;

    // Stack buffers (only the parts a call uses are written, and written before read):
    // queries in BF16, (n16, hd); keys as four quarter tiles of pair rows, (4, hd / 2, 16) u32;
    // values as pair rows per 16 dimensions, (hd / 16, 32, 16) u32; scores (16, 64) f32;
    // P in BF16, (16, 64); the partition's o, (MAX_ROWS, MAX_HEAD_DIM) f32.
    let mut qb = std::mem::MaybeUninit::<Aligned<{ MAX_ROWS * MAX_HEAD_DIM * 2 }>>::uninit();
    let mut kp = std::mem::MaybeUninit::<Aligned<{ 4 * (MAX_HEAD_DIM / 2) * 64 }>>::uninit();
    let mut vp = std::mem::MaybeUninit::<Aligned<{ (MAX_HEAD_DIM / 16) * 32 * 64 }>>::uninit();
    let mut sc = Aligned::<{ 16 * AMX_TILE * 4 }>([0; 16 * AMX_TILE * 4]);
    let mut pb = Aligned::<{ 16 * AMX_TILE * 2 }>([0; 16 * AMX_TILE * 2]);
    let mut o_rows = std::mem::MaybeUninit::<Aligned<{ MAX_ROWS * MAX_HEAD_DIM * 4 }>>::uninit();
    let qb = qb.as_mut_ptr() as *mut u16;
    let kp = kp.as_mut_ptr() as *mut u8;
    let vp = vp.as_mut_ptr() as *mut u8;
    let sc = sc.0.as_mut_ptr() as *mut f32;
    let pb = pb.0.as_mut_ptr() as *mut u16;
    let o = o_rows.as_mut_ptr() as *mut f32;

    let mut big_m = [f32::NEG_INFINITY; MAX_ROWS];
    let mut big_l = [0.0f32; MAX_ROWS];
    let mut m = [0.0f32; MAX_ROWS];
    let mut l = [0.0f32; MAX_ROWS];
    let mut corr = [1.0f32; MAX_ROWS];
    let mut valid = [0usize; MAX_ROWS];

    // SAFETY (whole body): every pointer below stays inside its buffer (row and column counts
    // bounded by n16 <= MAX_ROWS, hd <= MAX_HEAD_DIM, AMX_TILE); pool reads are at positions
    // `< max_len`, inside blocks of the table checked by the caller (sixteen positions from a
    // multiple of 16 share a block since block_size % 16 == 0), columns `< hd`.
    unsafe {
        // Queries rounded to BF16; rows n..n16 zero.
        for i in 0..n16 {
            let dst = qb.add(i * hd);
            for c in (0..hd).step_by(16) {
                let v = if i < n { _mm512_loadu_ps(rows[i].q.as_ptr().add(c)) } else { _mm512_setzero_ps() };
                _mm256_storeu_si256(dst.add(c) as *mut __m256i, _mm512_cvtepi32_epi16(round16(v)));
            }
        }
        for r in rows.iter_mut() {
            r.out[..hd].fill(0.0);
        }
        asm!("ldtilecfg [{0}]", in(reg) &crate::amx::CONFIG as *const crate::amx::TileConfig, options(nostack, readonly));
        let data_k = keys.data.as_ptr();
        let data_v = job.values.data.as_ptr();
        let scale = _mm512_set1_ps(job.scale);
        let o_stride = MAX_HEAD_DIM * 4;

        let mut part0 = 0;
        while part0 < max_len {
            let part_end = (part0 + PARTITION).min(max_len);
            for i in 0..n {
                m[i] = f32::NEG_INFINITY;
                l[i] = 0.0;
                std::ptr::write_bytes(o.add(i * MAX_HEAD_DIM), 0, hd);
            }
            let mut t0 = part0;
            while t0 < part_end {
                let tile_len = AMX_TILE.min(part_end - t0);
                for (i, r) in rows.iter().enumerate() {
                    valid[i] = r.len.saturating_sub(t0).min(AMX_TILE);
                }
                let quarters = tile_len.div_ceil(16);
                // Keys: quarter q, pair row r at kp + (q · hd/2 + r) · 64.
                for q in 0..quarters {
                    let first = t0 + 16 * q;
                    let base = data_k.add((keys.tile_base(job.blocks, job.offset, first) + first % bs) * size);
                    let live = (max_len - first).min(16);
                    for r in 0..half_hd {
                        let row = if D == DT_BF16 {
                            let mask = ((1u32 << live) - 1) as __mmask16;
                            pair_row_bf16(base.add(2 * r * bs * 2), mask, base.add((2 * r + 1) * bs * 2), mask)
                        } else {
                            let lo = Zmm::load::<D>(base, 2 * r * bs).keep(live, 0.0);
                            let hi = Zmm::load::<D>(base, (2 * r + 1) * bs).keep(live, 0.0);
                            pair_row(lo.0, hi.0)
                        };
                        _mm512_store_si512(kp.add((q * half_hd + r) * 64) as *mut __m512i, row);
                    }
                }
                // Values: 16-dimension block d, pair row r (positions 2r, 2r + 1) at
                // vp + (d · 32 + r) · 64; rows up to the used half of the tile.
                let pair_rows = if tile_len > 32 { 32 } else { 16 };
                for r in 0..pair_rows {
                    let row_ptr = |p: usize| {
                        (p < max_len).then(|| {
                            let at = job.values.tile_base(job.blocks, job.offset, p) + (p % bs) * hd;
                            data_v.add(at * size)
                        })
                    };
                    let (p0, p1) = (row_ptr(t0 + 2 * r), row_ptr(t0 + 2 * r + 1));
                    if D == DT_BF16 {
                        // A missing row reads nothing (empty mask) from a valid address.
                        let (m0, m1) = (if p0.is_some() { 0xFFFF } else { 0 }, if p1.is_some() { 0xFFFF } else { 0 });
                        let (a0, a1) = (p0.unwrap_or(data_v), p1.unwrap_or(data_v));
                        for d in 0..hd / 16 {
                            let row = pair_row_bf16(a0.add(32 * d), m0, a1.add(32 * d), m1);
                            _mm512_store_si512(vp.add((d * 32 + r) * 64) as *mut __m512i, row);
                        }
                    } else {
                        for d in 0..hd / 16 {
                            let lo = p0.map_or(Zmm::zero(), |p| Zmm::load::<D>(p, 16 * d));
                            let hi = p1.map_or(Zmm::zero(), |p| Zmm::load::<D>(p, 16 * d));
                            _mm512_store_si512(vp.add((d * 32 + r) * 64) as *mut __m512i, pair_row(lo.0, hi.0));
                        }
                    }
                }
                // Blocks of 16 rows.
                for r0 in (0..n).step_by(16) {
                    let count = (n - r0).min(16);
                    if valid[r0..r0 + count].iter().all(|&v| v == 0) {
                        continue;
                    }
                    // S = Q · Kᵀ: tmm2..tmm5 for the four quarters, hd / 32 steps.
                    tile!(zero 2);
                    tile!(zero 3);
                    tile!(zero 4);
                    tile!(zero 5);
                    // B tiles rotate through tmm1, tmm6 and tmm7 so a load need not wait for
                    // the product that reads the previous one.
                    for k in 0..hd / 32 {
                        tile!(load 0, qb.add(r0 * hd + 32 * k), hd * 2);
                        tile!(load 1, kp.add(16 * k * 64), 64usize);
                        tile!(dp 2, 0, 1);
                        if quarters > 1 {
                            tile!(load 6, kp.add((half_hd + 16 * k) * 64), 64usize);
                            tile!(dp 3, 0, 6);
                        }
                        if quarters > 2 {
                            tile!(load 7, kp.add((2 * half_hd + 16 * k) * 64), 64usize);
                            tile!(dp 4, 0, 7);
                        }
                        if quarters > 3 {
                            tile!(load 1, kp.add((3 * half_hd + 16 * k) * 64), 64usize);
                            tile!(dp 5, 0, 1);
                        }
                    }
                    let s_stride = AMX_TILE * 4;
                    tile!(store 2, sc, s_stride);
                    tile!(store 3, sc.add(16), s_stride);
                    tile!(store 4, sc.add(32), s_stride);
                    tile!(store 5, sc.add(48), s_stride);
                    // The online softmax of each row; P rounded to BF16.
                    for i in 0..16 {
                        let row = r0 + i;
                        let prow = pb.add(i * AMX_TILE);
                        let v = if i < count { valid[row] } else { 0 };
                        if v == 0 {
                            std::ptr::write_bytes(prow, 0, AMX_TILE);
                            continue;
                        }
                        let srow = sc.add(i * AMX_TILE);
                        let s: [Zmm; 4] = std::array::from_fn(|q| {
                            Zmm(_mm512_mul_ps(_mm512_load_ps(srow.add(16 * q)), scale))
                                .keep(v.saturating_sub(16 * q), f32::NEG_INFINITY)
                        });
                        let top = Zmm::max(Zmm::max(s[0], s[1]), Zmm::max(s[2], s[3])).reduce_max();
                        let m_new = m[row].max(top);
                        let c = Zmm::exp1(m[row] - m_new);
                        let mv = Zmm::splat(m_new);
                        let p: [Zmm; 4] =
                            std::array::from_fn(|q| Zmm::exp(Zmm::sub(s[q], mv)).keep(v.saturating_sub(16 * q), 0.0));
                        let sum = Zmm::add(Zmm::add(p[0], p[1]), Zmm::add(p[2], p[3])).reduce_add();
                        l[row] = Zmm::fma1(l[row], c, sum);
                        m[row] = m_new;
                        corr[row] = c;
                        for (q, pq) in p.iter().enumerate() {
                            _mm256_storeu_si256(prow.add(16 * q) as *mut __m256i, _mm512_cvtepi32_epi16(round16(pq.0)));
                        }
                        // o = o · corr (a multiplication by one changes nothing, so it is skipped).
                        if c != 1.0 {
                            let orow = o.add(row * MAX_HEAD_DIM);
                            let cv = _mm512_set1_ps(c);
                            for d in (0..hd).step_by(16) {
                                _mm512_storeu_ps(orow.add(d), _mm512_mul_ps(_mm512_loadu_ps(orow.add(d)), cv));
                            }
                        }
                    }
                    // o += P · V: A = P (tmm0: positions 0..32, tmm1: 32..64), B = value pairs
                    // (tmm7), C = 16 rows × 16 dimensions of o (tmm6).
                    let p_stride = AMX_TILE * 2;
                    tile!(load 0, pb, p_stride);
                    if tile_len > 32 {
                        tile!(load 1, pb.add(32), p_stride);
                    }
                    // Four C tiles (tmm2..tmm5: sixteen dimensions each) at a time, B tiles
                    // alternating between tmm6 and tmm7.
                    macro_rules! pv {
                        ($c:literal, $d:expr) => {
                            let oc = o.add(r0 * MAX_HEAD_DIM + 16 * $d);
                            tile!(load $c, oc, o_stride);
                            tile!(load 6, vp.add($d * 32 * 64), 64usize);
                            tile!(dp $c, 0, 6);
                            if tile_len > 32 {
                                tile!(load 7, vp.add(($d * 32 + 16) * 64), 64usize);
                                tile!(dp $c, 1, 7);
                            }
                        };
                    }
                    macro_rules! pv_store {
                        ($c:literal, $d:expr) => {
                            tile!(store $c, o.add(r0 * MAX_HEAD_DIM + 16 * $d), o_stride);
                        };
                    }
                    for d in (0..hd / 16).step_by(4) {
                        // hd % 32 == 0, so the dimension blocks come in pairs.
                        pv!(2, d);
                        pv!(3, d + 1);
                        if d + 2 < hd / 16 {
                            pv!(4, d + 2);
                            pv!(5, d + 3);
                        }
                        pv_store!(2, d);
                        pv_store!(3, d + 1);
                        if d + 2 < hd / 16 {
                            pv_store!(4, d + 2);
                            pv_store!(5, d + 3);
                        }
                    }
                }
                t0 += AMX_TILE;
            }
            // Fold the partition into the running state.
            for (i, r) in rows.iter_mut().enumerate() {
                if r.len <= part0 {
                    continue;
                }
                let big = big_m[i].max(m[i]);
                let a = Zmm::exp1(big_m[i] - big);
                let b = Zmm::exp1(m[i] - big);
                big_l[i] = Zmm::fma1(l[i], b, big_l[i] * a);
                let orow = o.add(i * MAX_HEAD_DIM);
                for (c, out) in r.out[..hd].iter_mut().enumerate() {
                    *out = Zmm::fma1(*orow.add(c), b, *out * a);
                }
                big_m[i] = big;
            }
            part0 = part_end;
        }
        asm!("tilerelease", options(nostack, nomem));
    }
    for (i, r) in rows.iter_mut().enumerate() {
        let inv = 1.0 / big_l[i];
        for out in &mut r.out[..hd] {
            *out *= inv;
        }
    }
}
