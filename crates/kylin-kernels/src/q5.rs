//! Q5_0 (`q5_0`) weights and their integer matrix products: GGUF's Q5_0 numbers (blocks of
//! 32 columns, an f16 scale `d` and 5-bit quants `q ∈ 0..32`, `w = d · (q − 16)`) in Kylin's
//! row-interleaved layout.
//!
//! **What it is for.** `--quantize q4_k` mixes formats as llama.cpp's Q4_K_M does; a matrix
//! whose columns are not whole 256-column super-blocks cannot hold Q4_K, and llama.cpp's
//! Q4_K_M stores it as Q5_0 instead (`llama_tensor_get_type`'s fallback). Qwen2.5-0.5B's
//! hidden size of 896 sends every projection reading the hidden state there. Q5_0 is 5.5 bits
//! per weight against Q8_0's 8.5.
//!
//! **The numbers are llama.cpp's** (`quantize_row_q5_0_ref`): per block of 32, `max` is the
//! value of largest magnitude (the first one on ties), `d = max / −16`, `id = 1 / d` (0 when
//! `d` is 0), `q = min(31, trunc(x · id + 16.5))`, and the stored scale is `f16(d)`.
//!
//! **The layout is Kylin's** ([`Q5Matrix`]): rows in groups of [`GROUP_ROWS`] = 16 (the last
//! group padded with zero rows), columns a non-zero multiple of 64, in two planes:
//! - quants: the low four bits of every quant, exactly Q4_K's quants plane ([`crate::q4k`]),
//!   `[group][pair of sub-blocks: cols / 64][k4: 8][row: 16][4 consecutive columns]`, so the
//!   formats share the unpacking code;
//! - scales `[group][sub-block: cols / 32][scale: 16 f16 (one per row)][high bits: 8 u64]`:
//!   96 bytes per (group, sub-block). High-bit word `k` holds bit 4 of the quants of columns
//!   `4k .. 4k + 4` of the sub-block, bit `4 · row + c` for column `4k + c`: the same order as
//!   the bytes of one unpacked 64-byte weight vector, so a tile adds 16 where a mask bit is
//!   set.
//!
//! That is 352 bytes per 16 × 32 weights: 5.5 bits per weight, as GGUF's `block_q5_0`.
//!
//! **Activations** are Q8_0's, as llama.cpp's Q5_0 products read them: per token, blocks of 32
//! int8 with an f16-rounded scale `dx` and the correction `−128 · Σq_x` ([`crate::quant`]);
//! Q8_0, MXFP4 and Q5_0 matrices sharing an input share one quantization of it in
//! [`crate::quant::matmul_many_quant`].
//!
//! **Canonical order** of one output (DESIGN.md invariant 7): `acc = 0`, then for every
//! block `j` in order, with `isum_j = Σ (q_w − 16) · q_x` its exact integer dot product (at
//! most 32 · 16 · 128 in magnitude, exact in f32), computed as `Σ q_w · q_x` plus the
//! correction over 8, and `d_j = f32(scale_j)` (f16 widened, exactly):
//! `acc = fma(f32(isum_j), d_j · dx_j, acc)`, llama.cpp's `ggml_vec_dot_q5_0_q8_0` with the
//! sum taken in a fixed order. Every path (scalar, AVX2 `maddubs`, AVX-512 VNNI `vpdpbusd`, one
//! token or a tile of eight, any thread) computes those operations, so a token's outputs do not
//! depend on its batch, nor on the instruction set. The x86 tiles are Q4_K's (`q4k_x86.rs`)
//! with the high bits added and Q8_0's activations read.

use crate::ThreadPool;
use crate::WeightMatrix;
use crate::packed::{PackedMatrix, PlaneLayout, plane_lens};
use crate::q4k::{PAIR_BYTES, SUB, quant_at};
use crate::quant::{GROUP_ROWS, q8_scratch_len, quantize_activations};

/// Bytes of one sub-block's 16 f16 scales in the scales plane.
const SCALE_BYTES: usize = GROUP_ROWS * 2;
/// Bytes of one sub-block's scales and high bits of a group's 16 rows in the scales plane.
pub(crate) const SUB_SCALE_BYTES: usize = SCALE_BYTES + GROUP_ROWS * SUB / 8;

/// Q5_0's group layout: Q4_K's quants plane for the low bits, and per row and sub-block of 32
/// an f16 scale and the high bits (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Q5Planes;

impl PlaneLayout for Q5Planes {
    fn group_lens(cols: usize) -> Option<(usize, usize)> {
        if cols == 0 || !cols.is_multiple_of(2 * SUB) {
            return None;
        }
        Some(((cols / (2 * SUB)).checked_mul(PAIR_BYTES)?, (cols / SUB).checked_mul(SUB_SCALE_BYTES)?))
    }
}

/// A Q5_0 weight matrix `[rows, cols]` in Kylin's packed layout (see the module docs): `cols`
/// is a non-zero multiple of 64.
pub type Q5Matrix<'a> = PackedMatrix<'a, Q5Planes>;

/// Bytes of the quants and scales planes of a packed `[rows, cols]` Q5_0 matrix (rows rounded
/// up to a group of 16): `groups · (cols / 64) · 512` and `groups · (cols / 32) · 96`; `None`
/// if `cols` is not a non-zero multiple of 64 or a size overflows.
pub fn q5_0_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    plane_lens::<Q5Planes>(rows, cols)
}

/// The shapes `kylin quantize` gives the planes (both U8): quants `[groups, cols · 8]` and
/// scales `[groups, cols · 3]`. (Q4_K's scales are `[groups, 64 · super-blocks + cols]`,
/// never the same length for the same columns, which is how a loader tells them apart.)
pub fn q5_0_plane_shapes(rows: usize, cols: usize) -> ([usize; 2], [usize; 2]) {
    let groups = rows.div_ceil(GROUP_ROWS);
    ([groups, cols * 8], [groups, cols / SUB * SUB_SCALE_BYTES])
}

/// One block of 32 values quantized as llama.cpp's `quantize_row_q5_0_ref`: the scale `d`
/// (before its rounding to f16) and the 5-bit quants. Panics unless `x` holds 32 values (a
/// caller bug).
pub fn quantize_block_q5_0(x: &[f32]) -> (f32, [u8; SUB]) {
    assert_eq!(x.len(), SUB, "a Q5_0 block is 32 values");
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    // `(int8_t)(x · id + 16.5f)` then `MIN(31, ·)`: truncation toward zero; a NaN gives 0.
    let q = std::array::from_fn(|k| ((x[k] * id + 16.5) as i8).min(31) as u8);
    (d, q)
}

/// Quantizes groups `groups` of `w` into their parts of the planes (`groups.len()` times
/// `(cols / 64) · 512` and `(cols / 32) · 96` bytes); `row` is scratch for `cols` elements.
/// Panics if `cols` is not a non-zero multiple of 64 or a length disagrees (a caller bug).
pub fn quantize_q5_0_groups(
    w: WeightMatrix<'_>,
    groups: std::ops::Range<usize>,
    quants: &mut [u8],
    scales: &mut [u8],
    row: &mut [f32],
) {
    let (gq_len, gs_len) =
        Q5Planes::group_lens(w.cols).unwrap_or_else(|| panic!("Q5_0 needs columns in multiples of 64; got {}", w.cols));
    assert_eq!(quants.len(), groups.len() * gq_len, "quants length != groups * group bytes");
    assert_eq!(scales.len(), groups.len() * gs_len, "scales length != groups * group bytes");
    assert_eq!(row.len(), w.cols);
    for (g, (gq, gs)) in groups.zip(quants.chunks_exact_mut(gq_len).zip(scales.chunks_exact_mut(gs_len))) {
        gq.fill(0);
        gs.fill(0);
        for lane in 0..GROUP_ROWS.min(w.rows.saturating_sub(g * GROUP_ROWS)) {
            crate::widen_row(w, g * GROUP_ROWS + lane, row);
            for (j, block) in row.chunks_exact(SUB).enumerate() {
                let (d, q) = quantize_block_q5_0(block);
                let at = j * SUB_SCALE_BYTES + 2 * lane;
                gs[at..at + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                let pair = &mut gq[(j / 2) * PAIR_BYTES..(j / 2 + 1) * PAIR_BYTES];
                let shift = if j.is_multiple_of(2) { 0 } else { 4 };
                for (k, &v) in q.iter().enumerate() {
                    pair[(k / 4) * 64 + lane * 4 + k % 4] |= (v & 0xF) << shift;
                    if v >= 16 {
                        let bit = lane * 4 + k % 4;
                        gs[j * SUB_SCALE_BYTES + SCALE_BYTES + 8 * (k / 4) + bit / 8] |= 1 << (bit % 8);
                    }
                }
            }
        }
    }
}

/// Row `lane`'s scale of sub-block `j` (f16 widened to f32) in a group's scales plane `gs`.
#[inline]
fn scale_at(gs: &[u8], lane: usize, j: usize) -> f32 {
    let at = j * SUB_SCALE_BYTES + 2 * lane;
    half::f16::from_le_bytes([gs[at], gs[at + 1]]).to_f32()
}

/// Row `lane`'s 5-bit quant of column `k` of sub-block `j` of a group's planes.
#[inline]
fn quant5_at(gq: &[u8], gs: &[u8], lane: usize, j: usize, k: usize) -> u8 {
    let bit = lane * 4 + k % 4;
    let high = (gs[j * SUB_SCALE_BYTES + SCALE_BYTES + 8 * (k / 4) + bit / 8] >> (bit % 8)) & 1;
    quant_at(gq, lane, j, k) | (high << 4)
}

/// Row `r` dequantized into `out` (`cols` elements): `d · (q − 16)` in f32, `d` the block's
/// f16 scale widened (exactly). An embedding lookup in a quantized matrix.
pub fn dequantize_row_q5_0(m: Q5Matrix<'_>, r: usize, out: &mut [f32]) {
    assert!(r < m.rows && out.len() == m.cols);
    let lane = r % GROUP_ROWS;
    let (gq, gs) = m.group(r / GROUP_ROWS);
    for (j, o) in out.chunks_exact_mut(SUB).enumerate() {
        let d = scale_at(gs, lane, j);
        for (k, o) in o.iter_mut().enumerate() {
            *o = d * (quant5_at(gq, gs, lane, j, k) as f32 - 16.0);
        }
    }
}

/// The scalar definition of a tile: tokens `0..mt` of `xq` × the `valid` rows of the group
/// whose planes are `wq`, `ws`, each output in the canonical order.
///
/// # Safety
/// `y` is valid for writing rows `0..valid` of `mt` tokens at row stride `y_stride`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_scalar(
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
    let nb = cols / SUB;
    let f32_at = |b: &[u8], at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    for t in 0..mt {
        let xt = &xq[t * stride..(t + 1) * stride];
        for lane in 0..valid {
            let mut acc = 0.0f32;
            for j in 0..nb {
                let xs = &xt[j * SUB..(j + 1) * SUB];
                let isum: i32 = (0..SUB).map(|k| quant5_at(wq, ws, lane, j, k) as i32 * (xs[k] as i8 as i32)).sum();
                // `−128 · Σq_x` over 8: `isum` becomes `Σ (q − 16) · q_x`.
                let at = cols + 4 * nb + 4 * j;
                let correction = i32::from_le_bytes([xt[at], xt[at + 1], xt[at + 2], xt[at + 3]]) >> 3;
                let (d, dx) = (scale_at(ws, lane, j), f32_at(xt, cols + 4 * j));
                acc = ((isum + correction) as f32).mul_add(d * dx, acc);
            }
            // SAFETY: the caller's contract.
            unsafe { *y.add(t * y_stride + lane) = acc };
        }
    }
}

/// A Q5_0 product on the scalar tile, for tests: `y (n, rows) = q8(x) (n, cols) · Wᵀ`.
pub fn matmul_q5_0_scalar(w: Q5Matrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n_tokens * w.cols);
    assert_eq!(y.len(), n_tokens * w.rows);
    let stride = q8_scratch_len(1, w.cols);
    let mut xq = vec![0u8; q8_scratch_len(n_tokens, w.cols)];
    quantize_activations(x, n_tokens, w.cols, &mut xq);
    for g in 0..w.rows.div_ceil(GROUP_ROWS) {
        let valid = (w.rows - g * GROUP_ROWS).min(GROUP_ROWS);
        let (wq, ws) = w.group(g);
        for t in 0..n_tokens {
            // SAFETY: rows `g·16 .. g·16 + valid` of token `t` lie inside `y`.
            unsafe {
                tile_scalar(
                    1,
                    wq,
                    ws,
                    w.cols,
                    &xq[t * stride..(t + 1) * stride],
                    stride,
                    y.as_mut_ptr().add(t * w.rows + g * GROUP_ROWS),
                    w.rows,
                    valid,
                )
            };
        }
    }
}

/// `y_i = q8(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs` (all Q5_0 with the same columns),
/// with the activations quantized once into `scratch` (at least
/// [`q8_scratch_len`]`(n_tokens, cols)` bytes, as Q8_0's). Shapes: `x` `(n_tokens, cols)`,
/// `W_i` `(rows_i, cols)`, `y_i` `(n_tokens, rows_i)`.
pub fn matmul_many_q5_0(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u8],
    jobs: &mut [(Q5Matrix<'_>, &mut [f32])],
) {
    crate::quant::matmul_many_packed(pool, x, n_tokens, scratch, jobs)
}
