//! Q5_0 and Q6_0 (`q5_0`, `q6_0`) weights and their integer matrix products: blocks of 32
//! columns with an f16 scale `d` and 5- or 6-bit quants, `w = d · (q − 16)` with `q ∈ 0..32`
//! (GGUF's Q5_0) or `w = d · (q − 32)` with `q ∈ 0..64` (ik_llama.cpp's Q6_0), in Kylin's
//! row-interleaved layout. The two differ only in how many high bits sit above Q4_K's
//! nibble ([`HighBitPlanes`]'s `H`: 1 or 2), so one generic code serves both.
//!
//! **What they are for.** `--quantize q4_k` mixes formats as llama.cpp's Q4_K_M does:
//! - a matrix whose columns are not whole 256-column super-blocks cannot hold Q4_K, and
//!   llama.cpp's Q4_K_M stores it as Q5_0 instead (`llama_tensor_get_type`'s fallback);
//!   Qwen2.5-0.5B's hidden size of 896 sends every projection reading the hidden state there.
//!   Q5_0 is 5.5 bits per weight against Q8_0's 8.5;
//! - where the recipe wants more bits (the head, and `v_proj`/`down_proj` in the layers of
//!   `use_more_bits`), llama.cpp stores Q6_K (6.5625 bits); Kylin stores Q6_0 (6.5 bits),
//!   which keeps the 32-column blocks its tiles are built on, where Q6_K's 16-column
//!   sub-blocks with int8 scales would need a tile of their own.
//!
//! **The numbers** are the reference quantizers' (`quantize_row_q5_0_ref` of llama.cpp,
//! `quantize_row_q6_0_ref` of ik_llama.cpp): per block of 32, `max` is the value of largest
//! magnitude (the first one on ties), `d = max / −half` with `half` 16 or 32, `id = 1 / d` (0
//! when `d` is 0), `q = min(2 · half − 1, trunc(x · id + half + 0.5))`. Q5_0 stores `f16(d)`;
//! Q6_0 refines the scale by weighted least squares before storing it: with `x̂ = x · id`,
//! `w = x̂²`, `sumqx = Σ w · x · (q − 32)` and `sumq2 = Σ w · (q − 32)²` (both summed in
//! ik_llama.cpp's order, the block's halves interleaved), it stores `f16(sumqx / sumq2)`, or
//! `f16(d)` when `sumq2` is 0.
//!
//! **The layout is Kylin's** ([`Q5Matrix`], [`Q6Matrix`]): rows in groups of [`GROUP_ROWS`] =
//! 16 (the last group padded with zero rows), columns a non-zero multiple of 64, in two
//! planes:
//! - quants: the low four bits of every quant, exactly Q4_K's quants plane ([`crate::q4k`]),
//!   `[group][pair of sub-blocks: cols / 64][k4: 8][row: 16][4 consecutive columns]`, so the
//!   formats share the unpacking code;
//! - scales `[group][pair of sub-blocks: cols / 64]`, each pair `[sub-block: 2][scale: 16
//!   f16 (one per row)]` then `[sub-block: 2][high bits: H vectors of 64 bytes]`: 96 (Q5_0)
//!   or 160 (Q6_0) bytes per (group, sub-block), every high-bit vector on a 64-byte line, in
//!   the order a tile reads them. A sub-block's quants are 8 weight vectors of 64 bytes
//!   (vector `k`: columns `4k .. 4k + 4`, byte `4 · row + c` for column `4k + c`, as the
//!   quants plane orders them). Each high-bit vector serves `8 / H` of them (its *slots*):
//!   byte `i` of high-bit vector `v` holds, at bits `H · s .. H · s + H`, bits `4 .. 4 + H`
//!   of byte `i`'s quant in weight vector `k = v · 8 / H + s`. So a tile unpacks a weight
//!   vector's high bits with one shift of its high-bit vector by `4 − H · s` bits (in 16-bit
//!   lanes: what crosses into the neighbouring byte lands outside bits `4 .. 4 + H`) and one
//!   masked OR onto the nibble.
//!
//! That is 352 (Q5_0) or 416 (Q6_0) bytes per 16 × 32 weights: 5.5 or 6.5 bits per weight,
//! as GGUF's `block_q5_0` and ik_llama.cpp's `block_q6_0`.
//!
//! **Activations** are Q8_0's, as llama.cpp's Q5_0 products read them: per token, blocks of 32
//! int8 with an f16-rounded scale `dx` and the correction `−128 · Σq_x` ([`crate::quant`]);
//! Q8_0, MXFP4, Q5_0 and Q6_0 matrices sharing an input share one quantization of it in
//! [`crate::quant::matmul_many_quant`].
//!
//! **Canonical order** of one output (DESIGN.md invariant 7): `acc = 0`, then for every
//! block `j` in order, with `isum_j = Σ (q_w − half) · q_x` its exact integer dot product (at
//! most 32 · 32 · 128 in magnitude, exact in f32), computed as `Σ q_w · q_x` plus the
//! correction over 8 (Q5_0) or 4 (Q6_0), and `d_j = f32(scale_j)` (f16 widened, exactly):
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
/// Bytes of one high-bit vector of one sub-block of a group's 16 rows: one bit for each of
/// the sub-block's 512 quants.
const HIGH_BYTES: usize = GROUP_ROWS * SUB / 8;

/// Where a format with `h` high bits keeps the high bits of weight vector `k` (`0..8`) of a
/// sub-block: the high-bit vector's index and the bit `h · slot` its bits start at (module
/// docs).
pub(crate) const fn high_bit_slot(h: usize, k: usize) -> (usize, usize) {
    let per_vector = 8 / h;
    (k / per_vector, h * (k % per_vector))
}

/// Bytes of one sub-block's scales and high bits of a group's 16 rows in the scales plane of
/// a format with `h` high bits.
pub(crate) const fn sub_scale_bytes(h: usize) -> usize {
    SCALE_BYTES + h * HIGH_BYTES
}

/// Offset, in a group's scales plane of a format with `h` high bits, of sub-block `j`'s 16
/// f16 scales: a pair of sub-blocks keeps both sub-blocks' scales first (one 64-byte line),
/// then both sub-blocks' high-bit vectors, so every high-bit vector starts on a line of the
/// plane and a tile reads the plane in ascending order.
pub(crate) const fn scales_offset(h: usize, j: usize) -> usize {
    (j / 2) * 2 * sub_scale_bytes(h) + (j % 2) * SCALE_BYTES
}

/// Offset, in a group's scales plane of a format with `h` high bits, of sub-block `j`'s first
/// high-bit vector (its `h` vectors follow one another), after its pair's scales.
pub(crate) const fn high_bits_offset(h: usize, j: usize) -> usize {
    (j / 2) * 2 * sub_scale_bytes(h) + 2 * SCALE_BYTES + (j % 2) * h * HIGH_BYTES
}

/// The offset `half` of a format with `h` high bits: 16 for Q5_0, 32 for Q6_0.
const fn half(h: usize) -> i32 {
    8 << h
}

/// The group layout of a format with `H` high bits above Q4_K's nibble (1: Q5_0, 2: Q6_0):
/// Q4_K's quants plane for the low bits, and per row and sub-block of 32 an f16 scale and the
/// high bits (module docs).
#[derive(Debug, Clone, Copy)]
pub struct HighBitPlanes<const H: usize>;

/// Q5_0's group layout.
pub type Q5Planes = HighBitPlanes<1>;
/// Q6_0's group layout.
pub type Q6Planes = HighBitPlanes<2>;

impl<const H: usize> PlaneLayout for HighBitPlanes<H> {
    fn group_lens(cols: usize) -> Option<(usize, usize)> {
        if cols == 0 || !cols.is_multiple_of(2 * SUB) {
            return None;
        }
        Some(((cols / (2 * SUB)).checked_mul(PAIR_BYTES)?, (cols / SUB).checked_mul(sub_scale_bytes(H))?))
    }
}

/// A Q5_0 weight matrix `[rows, cols]` in Kylin's packed layout (see the module docs): `cols`
/// is a non-zero multiple of 64.
pub type Q5Matrix<'a> = PackedMatrix<'a, Q5Planes>;
/// A Q6_0 weight matrix `[rows, cols]`, as [`Q5Matrix`] with two high bits.
pub type Q6Matrix<'a> = PackedMatrix<'a, Q6Planes>;

/// Bytes of the quants and scales planes of a packed `[rows, cols]` Q5_0 matrix (rows rounded
/// up to a group of 16): `groups · (cols / 64) · 512` and `groups · (cols / 32) · 96`; `None`
/// if `cols` is not a non-zero multiple of 64 or a size overflows.
pub fn q5_0_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    plane_lens::<Q5Planes>(rows, cols)
}

/// As [`q5_0_plane_lens`] for Q6_0: `groups · (cols / 32) · 160` bytes of scales.
pub fn q6_0_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    plane_lens::<Q6Planes>(rows, cols)
}

/// The shapes `kylin quantize` gives the planes (both U8): quants `[groups, cols · 8]` and
/// scales `[groups, cols · 3]`. (Q4_K's scales are `[groups, 64 · super-blocks + cols]` and
/// Q6_0's `[groups, cols · 5]`, never the same length for the same columns, which is how a
/// loader tells them apart.)
pub fn q5_0_plane_shapes(rows: usize, cols: usize) -> ([usize; 2], [usize; 2]) {
    plane_shapes::<1>(rows, cols)
}

/// As [`q5_0_plane_shapes`] for Q6_0: scales `[groups, cols · 5]`.
pub fn q6_0_plane_shapes(rows: usize, cols: usize) -> ([usize; 2], [usize; 2]) {
    plane_shapes::<2>(rows, cols)
}

fn plane_shapes<const H: usize>(rows: usize, cols: usize) -> ([usize; 2], [usize; 2]) {
    let groups = rows.div_ceil(GROUP_ROWS);
    ([groups, cols * 8], [groups, cols / SUB * sub_scale_bytes(H)])
}

/// The value of largest magnitude in `x` (the first one on ties), as the reference
/// quantizers find it.
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// One block of 32 values quantized as llama.cpp's `quantize_row_q5_0_ref`: the scale `d`
/// (before its rounding to f16) and the 5-bit quants. Panics unless `x` holds 32 values (a
/// caller bug).
pub fn quantize_block_q5_0(x: &[f32]) -> (f32, [u8; SUB]) {
    assert_eq!(x.len(), SUB, "a Q5_0 block is 32 values");
    let d = signed_max(x) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    // `(int8_t)(x · id + 16.5f)` then `MIN(31, ·)`: truncation toward zero; a NaN gives 0.
    let q = std::array::from_fn(|k| ((x[k] * id + 16.5) as i8).min(31) as u8);
    (d, q)
}

/// One block of 32 values quantized as ik_llama.cpp's `quantize_row_q6_0_ref`: the scale
/// (refined by weighted least squares, before its rounding to f16) and the 6-bit quants.
/// Panics unless `x` holds 32 values (a caller bug).
pub fn quantize_block_q6_0(x: &[f32]) -> (f32, [u8; SUB]) {
    assert_eq!(x.len(), SUB, "a Q6_0 block is 32 values");
    let d = signed_max(x) / -32.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    // `MIN(63, (int8_t)(x · id + 32.5f))`: truncation toward zero; a NaN gives 0.
    let q: [u8; SUB] = std::array::from_fn(|k| ((x[k] * id + 32.5) as i8).min(63) as u8);
    // ik_llama.cpp walks the block's halves together: `j` and `j + 16` in one step, each
    // step's two terms added before they join the sums (no fused multiply-adds).
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for j in 0..SUB / 2 {
        let (a, b) = (j, j + SUB / 2);
        let (x0, x1) = (x[a] * id, x[b] * id);
        let (w0, w1) = (x0 * x0, x1 * x1);
        let (q0, q1) = (q[a] as f32 - 32.0, q[b] as f32 - 32.0);
        sumqx += w0 * x[a] * q0 + w1 * x[b] * q1;
        sumq2 += w0 * q0 * q0 + w1 * q1 * q1;
    }
    (if sumq2 > 0.0 { sumqx / sumq2 } else { d }, q)
}

/// Quantizes groups `groups` of `w` into their parts of the planes of the format with `H`
/// high bits (`groups.len()` times `(cols / 64) · 512` and `(cols / 32) · (32 + 64 · H)`
/// bytes). `row` (one row's scratch in [`crate::quant::QuantBuffer::quantize_groups`]'s
/// signature) is unused. Panics if `cols` is not a non-zero multiple of 64 or a length
/// disagrees (a caller bug).
///
/// A group's 16 rows are widened into a buffer (allocated per call; this runs at load), and
/// each block of 32 columns is quantized for the 16 rows at once ([`quantize_block_x16`]: a
/// row per lane, every lane doing [`quantize_block_q5_0`]'s or [`quantize_block_q6_0`]'s
/// operations in their order, so the bytes are theirs), compiled for AVX-512 where the CPU
/// has it.
pub fn quantize_groups<const H: usize>(
    w: WeightMatrix<'_>,
    groups: std::ops::Range<usize>,
    quants: &mut [u8],
    scales: &mut [u8],
    row: &mut [f32],
) {
    let cols = w.cols;
    let (gq_len, gs_len) = HighBitPlanes::<H>::group_lens(cols)
        .unwrap_or_else(|| panic!("Q5_0 and Q6_0 need columns in multiples of 64; got {cols}"));
    assert_eq!(quants.len(), groups.len() * gq_len, "quants length != groups * group bytes");
    assert_eq!(scales.len(), groups.len() * gs_len, "scales length != groups * group bytes");
    assert_eq!(row.len(), cols);
    let mut rows = vec![0.0f32; GROUP_ROWS * cols];
    for (g, (gq, gs)) in groups.zip(quants.chunks_exact_mut(gq_len).zip(scales.chunks_exact_mut(gs_len))) {
        for (lane, row) in rows.chunks_exact_mut(cols).enumerate() {
            let r = g * GROUP_ROWS + lane;
            if r < w.rows {
                crate::widen_row(w, r, row);
            } else {
                // Padding rows quantize to zero scales and quants `half`, whose low nibble is 0
                // and whose high bits are cleared below, so the padding stays all zero bytes.
                row.fill(0.0);
            }
        }
        let valid = GROUP_ROWS.min(w.rows.saturating_sub(g * GROUP_ROWS));
        gs.fill(0);
        for j in 0..cols / SUB {
            // `x[k][lane]`: column `k` of the block, row `lane`.
            let mut x = [[0.0f32; GROUP_ROWS]; SUB];
            for (lane, row) in rows.chunks_exact(cols).enumerate() {
                for (k, v) in row[j * SUB..(j + 1) * SUB].iter().enumerate() {
                    x[k][lane] = *v;
                }
            }
            let (d, q) = quantize_block_x16::<H>(&x);
            let scales = &mut gs[scales_offset(H, j)..scales_offset(H, j) + SCALE_BYTES];
            for lane in 0..valid {
                scales[2 * lane..2 * lane + 2].copy_from_slice(&half::f16::from_f32(d[lane]).to_le_bytes());
            }
            // Weight vector `k4`'s high bits: byte `4 · lane + c` of its high-bit vector, at
            // its slot's bits, holds bits `4 .. 4 + H` of column `4k4 + c`.
            for k4 in 0..SUB / 4 {
                let (v, shift) = high_bit_slot(H, k4);
                for lane in 0..valid {
                    for c in 0..4 {
                        let bits = (q[4 * k4 + c][lane] >> 4) & ((1 << H) - 1);
                        gs[high_bits_offset(H, j) + v * HIGH_BYTES + 4 * lane + c] |= bits << shift;
                    }
                }
            }
            // The low nibbles: byte `64 · k4 + 4 · lane + c` of the pair, low or high half.
            let pair = &mut gq[(j / 2) * PAIR_BYTES..(j / 2 + 1) * PAIR_BYTES];
            let (shift, keep) = if j.is_multiple_of(2) { (0, 0xF0) } else { (4, 0x0F) };
            for k4 in 0..SUB / 4 {
                for lane in 0..GROUP_ROWS {
                    for c in 0..4 {
                        let nibble = if lane < valid { q[4 * k4 + c][lane] & 0xF } else { 0 };
                        let byte = &mut pair[64 * k4 + 4 * lane + c];
                        *byte = (*byte & keep) | (nibble << shift);
                    }
                }
            }
        }
    }
}

/// One block of 32 columns of 16 rows (`x[k][lane]`) quantized as [`quantize_block_q5_0`]
/// (`H` = 1) or [`quantize_block_q6_0`] (`H` = 2) quantize each row: the scales (before their
/// rounding to f16) and the quants `q[k][lane]`. Each lane does the scalar operations in the
/// scalar order (Rust never fuses a multiply and an add), so the results are the scalar
/// ones bit for bit on whatever instructions the compiler picks; on AVX-512 CPUs the same
/// code runs compiled for AVX-512.
fn quantize_block_x16<const H: usize>(x: &[[f32; GROUP_ROWS]; SUB]) -> ([f32; GROUP_ROWS], [[u8; GROUP_ROWS]; SUB]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa() == crate::Isa::Avx512 {
        // SAFETY: `isa()` is AVX-512, so AVX-512 F/BW/VL are available.
        return unsafe { quantize_block_x16_avx512::<H>(x) };
    }
    quantize_block_lanes::<H>(x)
}

/// [`quantize_block_lanes`] compiled for AVX-512.
///
/// # Safety
/// AVX-512 F/BW/VL must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_block_x16_avx512<const H: usize>(
    x: &[[f32; GROUP_ROWS]; SUB],
) -> ([f32; GROUP_ROWS], [[u8; GROUP_ROWS]; SUB]) {
    quantize_block_lanes::<H>(x)
}

/// The body of [`quantize_block_x16`], lane by lane in the scalar quantizers' order.
#[inline(always)]
fn quantize_block_lanes<const H: usize>(x: &[[f32; GROUP_ROWS]; SUB]) -> ([f32; GROUP_ROWS], [[u8; GROUP_ROWS]; SUB]) {
    let offset = half(H) as f32;
    let top = (2 * half(H) - 1) as i8;
    // The value of largest magnitude, the first one on ties (`signed_max`).
    let (mut amax, mut max) = ([0.0f32; GROUP_ROWS], [0.0f32; GROUP_ROWS]);
    for column in x {
        for lane in 0..GROUP_ROWS {
            let a = column[lane].abs();
            let larger = amax[lane] < a;
            amax[lane] = if larger { a } else { amax[lane] };
            max[lane] = if larger { column[lane] } else { max[lane] };
        }
    }
    let mut d = [0.0f32; GROUP_ROWS];
    let mut id = [0.0f32; GROUP_ROWS];
    for lane in 0..GROUP_ROWS {
        d[lane] = max[lane] / -offset;
        id[lane] = if d[lane] != 0.0 { 1.0 / d[lane] } else { 0.0 };
    }
    let mut q = [[0u8; GROUP_ROWS]; SUB];
    for (qk, column) in q.iter_mut().zip(x) {
        for lane in 0..GROUP_ROWS {
            // `(int8_t)(x · id + half + 0.5)` then `MIN(top, ·)`: truncation; a NaN gives 0.
            qk[lane] = ((column[lane] * id[lane] + (offset + 0.5)) as i8).min(top) as u8;
        }
    }
    if H == 1 {
        return (d, q);
    }
    // Q6_0's weighted least squares, in `quantize_block_q6_0`'s order.
    let (mut sumqx, mut sumq2) = ([0.0f32; GROUP_ROWS], [0.0f32; GROUP_ROWS]);
    for j in 0..SUB / 2 {
        let (a, b) = (j, j + SUB / 2);
        for lane in 0..GROUP_ROWS {
            let (x0, x1) = (x[a][lane] * id[lane], x[b][lane] * id[lane]);
            let (w0, w1) = (x0 * x0, x1 * x1);
            let (q0, q1) = (q[a][lane] as f32 - 32.0, q[b][lane] as f32 - 32.0);
            sumqx[lane] += w0 * x[a][lane] * q0 + w1 * x[b][lane] * q1;
            sumq2[lane] += w0 * q0 * q0 + w1 * q1 * q1;
        }
    }
    for lane in 0..GROUP_ROWS {
        d[lane] = if sumq2[lane] > 0.0 { sumqx[lane] / sumq2[lane] } else { d[lane] };
    }
    (d, q)
}

/// Row `lane`'s scale of sub-block `j` (f16 widened to f32) in a group's scales plane `gs`.
#[inline]
fn scale_at<const H: usize>(gs: &[u8], lane: usize, j: usize) -> f32 {
    let at = scales_offset(H, j) + 2 * lane;
    half::f16::from_le_bytes([gs[at], gs[at + 1]]).to_f32()
}

/// Row `lane`'s whole quant of column `k` of sub-block `j` of a group's planes.
#[inline]
fn quant_high_at<const H: usize>(gq: &[u8], gs: &[u8], lane: usize, j: usize, k: usize) -> u8 {
    let (v, shift) = high_bit_slot(H, k / 4);
    let byte = gs[high_bits_offset(H, j) + v * HIGH_BYTES + 4 * lane + k % 4];
    quant_at(gq, lane, j, k) | (((byte >> shift) & ((1 << H) - 1)) << 4)
}

/// Row `r` dequantized into `out` (`cols` elements): `d · (q − half)` in f32, `d` the block's
/// f16 scale widened (exactly). An embedding lookup in a quantized matrix.
pub fn dequantize_row<const H: usize>(m: PackedMatrix<'_, HighBitPlanes<H>>, r: usize, out: &mut [f32]) {
    assert!(r < m.rows && out.len() == m.cols);
    let lane = r % GROUP_ROWS;
    let (gq, gs) = m.group(r / GROUP_ROWS);
    for (j, o) in out.chunks_exact_mut(SUB).enumerate() {
        let d = scale_at::<H>(gs, lane, j);
        for (k, o) in o.iter_mut().enumerate() {
            *o = d * (quant_high_at::<H>(gq, gs, lane, j, k) as f32 - half(H) as f32);
        }
    }
}

/// [`dequantize_row`] of a Q5_0 matrix.
pub fn dequantize_row_q5_0(m: Q5Matrix<'_>, r: usize, out: &mut [f32]) {
    dequantize_row::<1>(m, r, out)
}

/// [`dequantize_row`] of a Q6_0 matrix.
pub fn dequantize_row_q6_0(m: Q6Matrix<'_>, r: usize, out: &mut [f32]) {
    dequantize_row::<2>(m, r, out)
}

/// The scalar definition of a tile: tokens `0..mt` of `xq` × the `valid` rows of the group
/// whose planes (of the format with `H` high bits) are `wq`, `ws`, each output in the
/// canonical order.
///
/// # Safety
/// `y` is valid for writing rows `0..valid` of `mt` tokens at row stride `y_stride`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_scalar<const H: usize>(
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
                let isum: i32 =
                    (0..SUB).map(|k| quant_high_at::<H>(wq, ws, lane, j, k) as i32 * (xs[k] as i8 as i32)).sum();
                // `−128 · Σq_x` over 8 (or 4): `isum` becomes `Σ (q − half) · q_x`.
                let at = cols + 4 * nb + 4 * j;
                let correction = i32::from_le_bytes([xt[at], xt[at + 1], xt[at + 2], xt[at + 3]]) >> (4 - H);
                let (d, dx) = (scale_at::<H>(ws, lane, j), f32_at(xt, cols + 4 * j));
                acc = ((isum + correction) as f32).mul_add(d * dx, acc);
            }
            // SAFETY: the caller's contract.
            unsafe { *y.add(t * y_stride + lane) = acc };
        }
    }
}

/// A Q5_0 or Q6_0 product on the scalar tile, for tests: `y (n, rows) = q8(x) (n, cols) · Wᵀ`.
pub fn matmul_scalar<const H: usize>(w: PackedMatrix<'_, HighBitPlanes<H>>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
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
                tile_scalar::<H>(
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

/// [`matmul_scalar`] of a Q5_0 matrix.
pub fn matmul_q5_0_scalar(w: Q5Matrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    matmul_scalar::<1>(w, x, n_tokens, y)
}

/// [`matmul_scalar`] of a Q6_0 matrix.
pub fn matmul_q6_0_scalar(w: Q6Matrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    matmul_scalar::<2>(w, x, n_tokens, y)
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

/// [`matmul_many_q5_0`] for Q6_0 matrices.
pub fn matmul_many_q6_0(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u8],
    jobs: &mut [(Q6Matrix<'_>, &mut [f32])],
) {
    crate::quant::matmul_many_packed(pool, x, n_tokens, scratch, jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-lane block quantizer (compiled for AVX-512 on this CPU when it has it) gives,
    /// lane for lane, the bits of the one-row quantizers on blocks of every kind, extreme
    /// ones included, which the end-to-end tests' random weights do not reach.
    #[test]
    fn sixteen_lanes_have_the_one_row_bits() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        };
        for batch in 0..3000 {
            let mut x = [[0.0f32; GROUP_ROWS]; SUB];
            for lane in 0..GROUP_ROWS {
                let kind = (batch + lane) % 10;
                for (k, column) in x.iter_mut().enumerate() {
                    let bits = next();
                    let unit = (bits >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    column[lane] = match kind {
                        0 => 0.0,
                        1 => [f32::NAN, unit][(k % 7 != 3) as usize],
                        2 => [f32::INFINITY, unit][(k % 5 != 1) as usize],
                        3 => unit * 3e38,
                        4 => unit * 1e-40,
                        5 => ((bits % 33) as f32 - 16.0) / 8.0,
                        6 => [-0.0, 0.0][(bits % 2) as usize],
                        7 => [unit, -unit][(k == 9) as usize] * [1.0, 4.0][(k % 9 == 0) as usize],
                        _ => unit,
                    };
                }
            }
            let one_row = |h: usize, lane: usize| {
                let row: Vec<f32> = x.iter().map(|column| column[lane]).collect();
                if h == 1 { quantize_block_q5_0(&row) } else { quantize_block_q6_0(&row) }
            };
            let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            let (d5, q5) = quantize_block_x16::<1>(&x);
            let (d6, q6) = quantize_block_x16::<2>(&x);
            for lane in 0..GROUP_ROWS {
                for (h, d, q) in [(1, d5[lane], &q5), (2, d6[lane], &q6)] {
                    let (d1, q1) = one_row(h, lane);
                    assert!(same(d, d1), "batch {batch} lane {lane} h {h}: {d} vs {d1}");
                    for k in 0..SUB {
                        assert_eq!(q[k][lane], q1[k], "batch {batch} lane {lane} h {h} column {k}");
                    }
                }
            }
        }
    }
}
