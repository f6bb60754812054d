//! Q4_G (`q4_g`) weights and their integer matrix products: 4-bit quants whose every
//! sub-block of 32 columns has its own f16 scale and f16 min.
//!
//! **What it is for.** Published 4-bit checkpoints (GPTQ, AWQ, compressed-tensors W4A16) store
//! 4-bit quants `q ∈ 0..16` and, per group of `g` columns (32, 64, 128, ...) of each row, a
//! scale `s` and a zero point `z`: `w = s · (q − z)`. With `m = s · z` that is `w = s · q − m`,
//! and a group of `g` columns is `g / 32` sub-blocks with the same `s` and `m`. Q4_K's 6-bit
//! sub-scales of a super-block scale cannot hold those numbers; here every sub-block's `s` and
//! `m` are f16, so an f16 (or in-range BF16) scale is kept exactly, and so is `m` whenever
//! `s · z` fits f16's 11 significant bits (always for a symmetric checkpoint's `z = 8`;
//! otherwise `m` is rounded to nearest even, an error of at most `2^-11 · m`, 0.7% of one step
//! `s` for `z = 15`). [`pack_q4_g`] packs such numbers; there is no quantization from floats
//! ([`crate::quant::QuantBuffer::quantize_groups`] refuses `q4_g`).
//!
//! **The layout is Kylin's** ([`Q4GMatrix`]): rows in groups of [`GROUP_ROWS`] = 16 (the last
//! group padded with zero rows), columns a non-zero multiple of 64, in two planes:
//! - quants: exactly Q4_K's quants plane ([`crate::q4k`]), `[group][pair of sub-blocks:
//!   cols / 64][k4: 8][row: 16][4 consecutive columns]`, sub-block `2p` in the low nibbles and
//!   `2p + 1` in the high ones, so both formats share the unpacking code;
//! - scales `[group][sub-block: cols / 32][scale: 16 f16 (one per row)][min: 16 f16]`: 64 bytes
//!   per (group, sub-block).
//!
//! That is 320 bytes per 16 × 32 weights: 5.0 bits per weight.
//!
//! **Activations** are Q4_K's, quantized per token per 256-column super-block to int8 with
//! per-sub-block `dx` and `bx = f32(Σq) · dx` (see [`crate::q4k`]); in
//! [`crate::quant::matmul_many_quant`], Q4_K and Q4_G matrices sharing an input share one
//! quantization of it.
//!
//! **Canonical order** of one output (DESIGN.md invariant 7): `acc = 0`, then for every
//! sub-block `j` in order, with `isum_j = Σ q_w · q_x` its exact integer dot product (at most
//! 32 · 15 · 127 in magnitude), `s_j = f32(scale_j)` and `m_j = f32(min_j)` (f16 widened,
//! exactly):
//! `acc = fma(f32(isum_j), s_j · dx_j, acc); acc = fma(−bx_j, m_j, acc)`.
//! Every path (scalar, AVX2 `maddubs`, AVX-512 VNNI `vpdpbusd`, one token or a tile of eight,
//! any thread) computes those operations, so a token's outputs do not depend on its batch, nor
//! on the instruction set. The x86 tiles are Q4_K's (`q4k_x86.rs`), with the per-sub-block
//! `(s_j, m_j)` in place of Q4_K's `(d · sc_j, dmin · m_j)`.

use crate::packed::{PackedMatrix, PlaneLayout, plane_lens};
use crate::q4k::{PAIR_BYTES, SUB, activation_stride, isum_scalar, q4k_scratch_len, quant_at, quantize_tokens};
use crate::quant::GROUP_ROWS;
use crate::{Isa, ThreadPool};

/// Bytes of one sub-block's scales and mins of a group's 16 rows in the scales plane.
pub(crate) const SUB_SCALE_BYTES: usize = GROUP_ROWS * 4;

/// Q4_G's group layout: Q4_K's quants plane, and an f16 scale and min per row and sub-block
/// of 32 (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Q4GPlanes;

impl PlaneLayout for Q4GPlanes {
    fn group_lens(cols: usize) -> Option<(usize, usize)> {
        if cols == 0 || !cols.is_multiple_of(2 * SUB) {
            return None;
        }
        Some(((cols / (2 * SUB)).checked_mul(PAIR_BYTES)?, (cols / SUB).checked_mul(SUB_SCALE_BYTES)?))
    }
}

/// A Q4_G weight matrix `[rows, cols]` in Kylin's packed layout (see the module docs): `cols`
/// is a non-zero multiple of 64.
pub type Q4GMatrix<'a> = PackedMatrix<'a, Q4GPlanes>;

/// Bytes of the quants and scales planes of a packed `[rows, cols]` Q4_G matrix (rows rounded
/// up to a group of 16): `groups · (cols / 64) · 512` and `groups · (cols / 32) · 64`; `None`
/// if `cols` is not a non-zero multiple of 64 or a size overflows.
pub fn q4_g_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    plane_lens::<Q4GPlanes>(rows, cols)
}

/// Packs a `[rows, cols]` matrix of 4-bit quants with per-sub-block scales and mins into the
/// Q4_G planes, so that weight `(r, c)` is `f16(scales[r, c / 32]) · q[r, c] −
/// f16(mins[r, c / 32])`.
///
/// `q` is row-major `[rows, cols]`, each value in `0..=15`; `scales` and `mins` are row-major
/// `[rows, cols / 32]`, rounded to f16 to nearest even (a value beyond f16's range becomes an
/// infinity: the caller checks the checkpoint's numbers first). `quants_out` and `scales_out`
/// have the lengths [`q4_g_plane_lens`]`(rows, cols)` gives; every byte of them is written
/// (the padding rows of the last group are zero). Panics if `cols` is not a non-zero multiple
/// of 64 or a length disagrees (a caller bug); a quant above 15 is a caller bug too (a debug
/// build panics, a release build keeps its low four bits).
pub fn pack_q4_g(
    rows: usize,
    cols: usize,
    q: &[u8],
    scales: &[f32],
    mins: &[f32],
    quants_out: &mut [u8],
    scales_out: &mut [u8],
) {
    pack_q4_g_groups(rows, cols, q, scales, mins, 0..rows.div_ceil(GROUP_ROWS), quants_out, scales_out)
}

/// [`pack_q4_g`] for groups `groups` of 16 rows only, so that a loader can pack a matrix in
/// parallel: `q`, `scales` and `mins` are the whole matrix's (as for [`pack_q4_g`]), while
/// `quants_out` and `scales_out` hold exactly those groups' parts of the planes
/// (`groups.len()` times `(cols / 64) · 512` and `(cols / 32) · 64` bytes).
#[allow(clippy::too_many_arguments)]
pub fn pack_q4_g_groups(
    rows: usize,
    cols: usize,
    q: &[u8],
    scales: &[f32],
    mins: &[f32],
    groups: std::ops::Range<usize>,
    quants_out: &mut [u8],
    scales_out: &mut [u8],
) {
    let (gq_len, gs_len) =
        Q4GPlanes::group_lens(cols).unwrap_or_else(|| panic!("Q4_G needs columns in multiples of 64; got {cols}"));
    let nb = cols / SUB;
    assert_eq!(rows.checked_mul(cols), Some(q.len()), "q is not [rows, cols]");
    assert_eq!(rows.checked_mul(nb), Some(scales.len()), "scales is not [rows, cols / 32]");
    assert_eq!(rows.checked_mul(nb), Some(mins.len()), "mins is not [rows, cols / 32]");
    assert!(groups.start <= groups.end && groups.end <= rows.div_ceil(GROUP_ROWS), "groups out of range");
    assert_eq!(quants_out.len(), groups.len() * gq_len, "quants length != groups * group bytes");
    assert_eq!(scales_out.len(), groups.len() * gs_len, "scales length != groups * group bytes");
    let planes = quants_out.chunks_exact_mut(gq_len).zip(scales_out.chunks_exact_mut(gs_len));
    for (g, (gq, gs)) in groups.zip(planes) {
        gq.fill(0);
        gs.fill(0);
        for lane in 0..GROUP_ROWS.min(rows - g * GROUP_ROWS) {
            let r = g * GROUP_ROWS + lane;
            let row = &q[r * cols..(r + 1) * cols];
            for j in 0..nb {
                let at = j * SUB_SCALE_BYTES + 2 * lane;
                gs[at..at + 2].copy_from_slice(&half::f16::from_f32(scales[r * nb + j]).to_le_bytes());
                let at = at + 2 * GROUP_ROWS;
                gs[at..at + 2].copy_from_slice(&half::f16::from_f32(mins[r * nb + j]).to_le_bytes());
                let block = &mut gq[(j / 2) * PAIR_BYTES..(j / 2 + 1) * PAIR_BYTES];
                let shift = if j.is_multiple_of(2) { 0 } else { 4 };
                for (k, &v) in row[j * SUB..(j + 1) * SUB].iter().enumerate() {
                    debug_assert!(v <= 15, "a 4-bit quant is at most 15; got {v} at row {r}, column {}", j * SUB + k);
                    block[(k / 4) * 64 + lane * 4 + k % 4] |= (v & 0xF) << shift;
                }
            }
        }
    }
}

/// Row `lane`'s scale and min of sub-block `j` (f16 widened to f32) in a group's scales plane
/// `gs`.
#[inline]
pub(crate) fn scale_min(gs: &[u8], lane: usize, j: usize) -> (f32, f32) {
    let at = j * SUB_SCALE_BYTES + 2 * lane;
    let f16_at = |at: usize| half::f16::from_le_bytes([gs[at], gs[at + 1]]).to_f32();
    (f16_at(at), f16_at(at + 2 * GROUP_ROWS))
}

/// Row `r` dequantized into `out` (`cols` elements): `s · q − m` in f32, `s` and `m` the
/// sub-block's f16 scale and min widened (exactly). An embedding lookup in a quantized matrix.
pub fn dequantize_row_q4_g(m: Q4GMatrix<'_>, r: usize, out: &mut [f32]) {
    assert!(r < m.rows && out.len() == m.cols);
    let lane = r % GROUP_ROWS;
    let (gq, gs) = m.group(r / GROUP_ROWS);
    for (j, o) in out.chunks_exact_mut(SUB).enumerate() {
        let (s, min) = scale_min(gs, lane, j);
        for (k, o) in o.iter_mut().enumerate() {
            *o = s * quant_at(gq, lane, j, k) as f32 - min;
        }
    }
}

/// `y_i = q8(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs` (all Q4_G with the same columns),
/// with the activations quantized once into `scratch` (at least
/// [`q4k_scratch_len`]`(n_tokens, cols)` bytes, as Q4_K's):
/// [`crate::quant::matmul_many_quant`] for Q4_G matrices, each output in the canonical order
/// of the module docs. Shapes: `x` `(n_tokens, cols)`, `W_i` `(rows_i, cols)`, `y_i`
/// `(n_tokens, rows_i)`.
pub fn matmul_many_q4g(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u8],
    jobs: &mut [(Q4GMatrix<'_>, &mut [f32])],
) {
    crate::quant::matmul_many_packed(pool, x, n_tokens, scratch, jobs)
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
                let isum = isum_scalar(wq, lane, j, &xt[j * SUB..(j + 1) * SUB]);
                let (s, m) = scale_min(ws, lane, j);
                let (dx, bx) = (f32_at(xt, cols + 4 * j), f32_at(xt, cols + 4 * nb + 4 * j));
                acc = (isum as f32).mul_add(s * dx, acc);
                acc = (-bx).mul_add(m, acc);
            }
            // SAFETY: the caller's contract.
            unsafe { *y.add(t * y_stride + lane) = acc };
        }
    }
}

/// A Q4_G product on the scalar kernels, for tests: `y (n, rows) = q8(x) (n, cols) · Wᵀ`.
pub fn matmul_q4g_scalar(w: Q4GMatrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n_tokens * w.cols);
    assert_eq!(y.len(), n_tokens * w.rows);
    let stride = activation_stride(w.cols);
    let mut xq = vec![0u8; q4k_scratch_len(n_tokens, w.cols)];
    quantize_tokens(Isa::Scalar, x, w.cols, 0, n_tokens, &mut xq);
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
