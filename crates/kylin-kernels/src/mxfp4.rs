//! MXFP4 (`mxfp4`) weights and their integer matrix products: 4-bit FP4 (E2M1) values with one
//! E8M0 scale per block of 32 columns, as gpt-oss's published checkpoints store their experts.
//!
//! **The numbers.** A weight is `fp4(code) · 2^(e − 127)`: the code's 16 values are
//! `±{0, 0.5, 1, 1.5, 2, 3, 4, 6}` (bit 3 the sign), `e` the block's scale byte. Doubled, the
//! values are the integers `±{0, 1, 2, 3, 4, 6, 8, 12}` ([`VALUES_X2`]), so a block's dot
//! product with Q8_0 activations is an exact integer sum, scaled by `dx · 2^(e − 128)`
//! ([`scale_half`]; llama.cpp's `GGML_E8M0_TO_FP32_HALF`). Scales below `2^-126` (`e < 2`, whose
//! weights are below `2^-125`) are taken as zero, so every scale is a normal f32; `e = 255`
//! (NaN in the OCP format) is refused when packing.
//!
//! **The layout is Kylin's** ([`Mxfp4Matrix`]): rows in groups of [`GROUP_ROWS`] = 16 (the
//! last group padded with zero rows), columns a non-zero multiple of 32, in two planes:
//! - quants `[group][block: cols / 32][pair: 4][row: 16][4 bytes]`: byte `c` of `(pair p, row)`
//!   holds the code of column `8p + c` in its low nibble and of column `8p + 4 + c` in its high
//!   one; 256 bytes per (group, block);
//! - scales `[group][block][row: 16]`: the E8M0 bytes as stored.
//!
//! That is 272 bytes per 16 × 32 weights: 4.25 bits per weight, as stored. [`pack_mxfp4`]
//! repacks a checkpoint's `_blocks` and `_scales` (no value changes); there is no quantization
//! from floats.
//!
//! **Activations** are Q8_0's (`crate::quant`): int8 per block of 32 with an f16-rounded
//! scale `dx`, shared with Q8_0 matrices of the same input.
//!
//! **Canonical order** of one output (DESIGN.md invariant 7): `acc = 0`, then for every block
//! `b` in order, with `isum_b = Σ v_w · q_x` its exact integer dot product over the doubled
//! values (at most 32 · 12 · 127 in magnitude): `acc = fma(f32(isum_b), dx_b · s_b, acc)`,
//! `s_b = 2^(e_b − 128)`. The scalar tile, the AVX2 tile (`vpshufb` decoding, `vpmaddubsw`) and
//! the AVX-512 VNNI tile (`vpshufb` into offset-binary bytes, `vpdpbusd` from the activations'
//! `−128 · Σq`, the codes decoded once per block for all of a tile's tokens) compute exactly
//! those operations, so a token's outputs do not depend on its batch nor on the instruction
//! set.

use crate::packed::{PackedMatrix, PlaneLayout, plane_lens};
use crate::quant::{GROUP_ROWS, QK8_0};

/// The doubled FP4 (E2M1) values by code: bit 3 is the sign.
pub const VALUES_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Bytes of one (group, block) in the quants plane: 16 rows × 32 codes of 4 bits.
pub(crate) const BLOCK_BYTES: usize = GROUP_ROWS * QK8_0 / 2;

/// MXFP4's group layout (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Planes;

impl PlaneLayout for Mxfp4Planes {
    fn group_lens(cols: usize) -> Option<(usize, usize)> {
        if cols == 0 || !cols.is_multiple_of(QK8_0) {
            return None;
        }
        let blocks = cols / QK8_0;
        Some((blocks.checked_mul(BLOCK_BYTES)?, blocks.checked_mul(GROUP_ROWS)?))
    }
}

/// An MXFP4 weight matrix `[rows, cols]` in Kylin's packed layout (see the module docs).
pub type Mxfp4Matrix<'a> = PackedMatrix<'a, Mxfp4Planes>;

/// Bytes of the quants and scales planes of a packed `[rows, cols]` MXFP4 matrix: `groups ·
/// (cols / 32) · 256` and `groups · (cols / 32) · 16`; `None` if `cols` is not a non-zero
/// multiple of 32 or a size overflows.
pub fn mxfp4_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    plane_lens::<Mxfp4Planes>(rows, cols)
}

/// The scale of block scale byte `e` with the doubling of [`VALUES_X2`] undone:
/// `2^(e − 128)`, or 0 for `e < 2` (module docs).
#[inline]
pub fn scale_half(e: u8) -> f32 {
    if e < 2 { 0.0 } else { f32::from_bits(((e as u32) - 1) << 23) }
}

/// One pair's four packed bytes from the four stored bytes of its eight columns `8p..8p + 8`:
/// stored byte `k` holds columns `2k` (low nibble) and `2k + 1`; packed byte `c` holds
/// columns `c` (low nibble) and `4 + c` (module docs).
#[inline]
fn pair_of_fours(stored: [u8; 4]) -> [u8; 4] {
    let [b0, b1, b2, b3] = stored;
    [(b0 & 0x0f) | (b2 << 4), (b0 >> 4) | (b2 & 0xf0), (b1 & 0x0f) | (b3 << 4), (b1 >> 4) | (b3 & 0xf0)]
}

/// Packs a checkpoint's `[rows, cols]` MXFP4 matrix into the planes, rows taken in the order
/// `row_of(i)` gives for packed row `i` (the identity, or every other stored row to separate
/// gpt-oss's interleaved gate and up projections).
///
/// `blocks` is the stored `[stored_rows, cols / 32, 16]` (two codes per byte, the even column
/// in the low nibble), `scales` the stored `[stored_rows, cols / 32]` E8M0 bytes. Returns the
/// first scale byte of 255 found, as `(stored row, block)`, leaving the planes partly written;
/// the caller reports it. Panics if the lengths disagree (a caller bug: the loader checked the
/// shapes).
pub fn pack_mxfp4(
    rows: usize,
    cols: usize,
    blocks: &[u8],
    scales: &[u8],
    row_of: &dyn Fn(usize) -> usize,
    quants_out: &mut [u8],
    scales_out: &mut [u8],
) -> Result<(), (usize, usize)> {
    assert!(cols.is_multiple_of(QK8_0), "MXFP4 needs columns in multiples of 32; got {cols}");
    assert_eq!(mxfp4_plane_lens(rows, cols), Some((quants_out.len(), scales_out.len())), "packed mxfp4 lengths");
    let nb = cols / QK8_0;
    let stored_rows = blocks.len() / (cols / 2).max(1);
    assert_eq!(blocks.len(), stored_rows * cols / 2, "blocks are [rows, cols / 32, 16]");
    assert_eq!(scales.len(), stored_rows * nb, "scales are [rows, cols / 32]");
    // Group by group, lane by lane (so rows in order, and the first bad scale is the first in
    // row order): each stored row is read once, front to back, and every byte of the planes
    // is written once, the padding lanes' with zeros, so the planes need not come zeroed.
    for g in 0..rows.div_ceil(GROUP_ROWS) {
        let group_quants = &mut quants_out[g * nb * BLOCK_BYTES..(g + 1) * nb * BLOCK_BYTES];
        let group_scales = &mut scales_out[g * nb * GROUP_ROWS..(g + 1) * nb * GROUP_ROWS];
        for lane in 0..GROUP_ROWS {
            let r = g * GROUP_ROWS + lane;
            if r >= rows {
                for (block, scale) in
                    group_quants.chunks_exact_mut(BLOCK_BYTES).zip(group_scales.chunks_exact_mut(GROUP_ROWS))
                {
                    scale[lane] = 0;
                    for p in 0..4 {
                        block[p * 64 + lane * 4..p * 64 + lane * 4 + 4].fill(0);
                    }
                }
                continue;
            }
            let stored = row_of(r);
            assert!(stored < stored_rows, "row {r} maps to stored row {stored} of {stored_rows}");
            let row_codes = &blocks[stored * cols / 2..(stored + 1) * cols / 2];
            let row_scales = &scales[stored * nb..(stored + 1) * nb];
            let stored_blocks = row_codes.chunks_exact(QK8_0 / 2).zip(row_scales);
            let packed_blocks =
                group_quants.chunks_exact_mut(BLOCK_BYTES).zip(group_scales.chunks_exact_mut(GROUP_ROWS));
            for (b, ((codes, &e), (block, scale))) in stored_blocks.zip(packed_blocks).enumerate() {
                if e == 255 {
                    return Err((stored, b));
                }
                scale[lane] = e;
                for p in 0..4 {
                    let four = [codes[4 * p], codes[4 * p + 1], codes[4 * p + 2], codes[4 * p + 3]];
                    block[p * 64 + lane * 4..p * 64 + lane * 4 + 4].copy_from_slice(&pair_of_fours(four));
                }
            }
        }
    }
    Ok(())
}

/// The code of column `c` of packed row `r` (`0..16` within the group at `group_quants`).
#[inline]
fn packed_code(group_quants: &[u8], lane: usize, c: usize) -> u8 {
    let (b, k) = (c / QK8_0, c % QK8_0);
    let (p, half, byte) = (k / 8, (k % 8) / 4, k % 4);
    let v = group_quants[b * BLOCK_BYTES + p * 64 + lane * 4 + byte];
    if half == 0 { v & 0x0f } else { v >> 4 }
}

/// Row `r` of a packed matrix as f32 values, `fp4 · 2^(e − 127)` (exact).
pub fn dequantize_row_mxfp4(m: Mxfp4Matrix<'_>, r: usize, out: &mut [f32]) {
    let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
    let (wq, ws) = m.group(g);
    for (c, o) in out[..m.cols].iter_mut().enumerate() {
        let v = VALUES_X2[packed_code(wq, lane, c) as usize] as f32;
        *o = v * scale_half(ws[(c / QK8_0) * GROUP_ROWS + lane]);
    }
}

/// The scalar tile: `mt` tokens × one group of 16 rows in the canonical order (module docs).
/// `xq` holds `mt` token rows of Q8_0 activations `stride` bytes apart; `y` receives rows
/// `0..valid` of each token, `y_stride` apart.
///
/// # Safety
/// Rows `0..valid` of tokens `0..mt` at `y` (token `t`'s at `y + t · y_stride`) must be
/// writable by this call alone; `wq`, `ws` are one whole group of a `[_, nb · 32]` matrix.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_scalar(
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
    let cols = nb * QK8_0;
    for t in 0..mt {
        let xt = &xq[t * stride..];
        for lane in 0..valid {
            let mut acc = 0.0f32;
            for b in 0..nb {
                let mut isum = 0i32;
                for k in 0..QK8_0 {
                    let w = VALUES_X2[packed_code(wq, lane, b * QK8_0 + k) as usize] as i32;
                    isum += w * (xt[b * QK8_0 + k] as i8) as i32;
                }
                let dx = f32::from_le_bytes([
                    xt[cols + 4 * b],
                    xt[cols + 4 * b + 1],
                    xt[cols + 4 * b + 2],
                    xt[cols + 4 * b + 3],
                ]);
                acc = (isum as f32).mul_add(dx * scale_half(ws[b * GROUP_ROWS + lane]), acc);
            }
            // SAFETY: the caller's contract: row `lane < valid` of token `t` is ours.
            unsafe { *y.add(t * y_stride + lane) = acc };
        }
    }
}
