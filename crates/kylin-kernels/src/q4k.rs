//! Q4_K weights and their integer matrix products.
//!
//! **The numbers are GGUF's.** Q4_K splits a weight row into super-blocks of [`QK_K`] = 256
//! columns, each of 8 sub-blocks of 32. A sub-block's weights are `d·sc·q − dmin·m` with
//! `q ∈ 0..16`, `sc`, `m ∈ 0..64` per sub-block and `d`, `dmin` f16 per super-block.
//! [`quantize_super_block`] is llama.cpp's `quantize_row_q4_K_ref` (the quantization
//! `llama-quantize` uses without an importance matrix) step for step, so Kylin's Q4_K weights
//! are llama.cpp's for the same source weights ([`quantize_row_q4_k_gguf`] writes its
//! `block_q4_K` bytes, for the tests to compare with a GGUF file).
//!
//! **Rows of any multiple of 64 columns.** llama.cpp needs whole super-blocks and stores
//! other tensors in another type (Qwen2.5-0.5B's 896 columns go to Q5_0). Here the last
//! super-block of a row may hold fewer sub-blocks (896 = 3 · 256 + 4 · 32): its numbers are
//! exactly those of llama.cpp's quantization of the row padded with zeros (a zero sub-block
//! has scale and min 0, so it changes neither `d` nor `dmin`), and the padding is neither
//! stored nor multiplied.
//!
//! **The layout is Kylin's** ([`Q4KMatrix`]): rows in groups of [`GROUP_ROWS`] = 16 (the last
//! group padded with zero rows), in two planes:
//! - quants `[group][pair of sub-blocks: cols / 64][k4: 8][row: 16][4 consecutive columns]`, one
//!   byte holding sub-block `2p`'s quant in its low nibble and sub-block `2p + 1`'s in its
//!   high nibble (as GGUF pairs them): 512 bytes per pair, each 64 of them what one
//!   `vpdpbusd` multiplies once unpacked;
//! - scales `[group][super-block][d: 16 f16, dmin: 16 f16, then per sub-block sc: 16 u8,
//!   m: 16 u8]`: `64 + 32 · sub-blocks` bytes per (group, super-block).
//!
//! That is 2368 bytes per 16 × 256 weights (4.625 bits per weight; GGUF's `block_q4_K` is
//! 4.5: its 6-bit scales are packed, ours are bytes the kernels load directly).
//!
//! **Activations** are quantized once per matrix product, per token, per super-block (as
//! llama.cpp's `quantize_row_q8_K`): `iscale = 127 / amax`, `q = round_ties_even(x · iscale)`,
//! `dx = 1 / iscale` (0 and all-zero quants when `amax` is 0). Per token the scratch holds the
//! `cols` quants, then per sub-block `dx` (f32, the super-block's), then per sub-block
//! `bx = f32(Σq) · dx`, the sub-block's share of the min term. That is `cols + 8 · cols / 32`
//! bytes, as for Q8_0.
//!
//! **Canonical order** of one output (DESIGN.md invariant 7): `acc = 0`, then for every
//! sub-block `j` in order, with `isum_j = Σ q_w · q_x` its exact integer dot product (at most
//! 32 · 15 · 127 in magnitude), `dsc_j = f32(d) · sc_j` and `dm_j = f32(dmin) · m_j` (both exact
//! in f32):
//! `acc = fma(f32(isum_j), dsc_j · dx_j, acc); acc = fma(−bx_j, dm_j, acc)`.
//! Every path here (scalar, AVX2 `maddubs`, AVX-512 VNNI `vpdpbusd`, one token or a tile of
//! eight, any thread) computes those operations, so a token's outputs do not depend on its
//! batch, nor on the instruction set.

use crate::packed::{PackedMatrix, PlaneLayout, plane_lens};
use crate::quant::GROUP_ROWS;
use crate::{Isa, ThreadPool, WeightMatrix, isa};

/// Columns per super-block.
pub const QK_K: usize = 256;
/// Columns per sub-block.
pub const SUB: usize = 32;
/// Bytes of one pair of sub-blocks' quants in a group.
pub(crate) const PAIR_BYTES: usize = GROUP_ROWS * 2 * SUB / 2;
/// Bytes of a (group, super-block)'s header in the scales plane: `d` and `dmin` of 16 rows.
pub(crate) const HEADER_BYTES: usize = GROUP_ROWS * 4;
/// Bytes of one sub-block's `sc` and `m` of 16 rows in the scales plane.
pub(crate) const SUB_SCALE_BYTES: usize = GROUP_ROWS * 2;
/// Bytes of a whole super-block's scales in a group.
pub(crate) const SUPER_SCALE_BYTES: usize = HEADER_BYTES + (QK_K / SUB) * SUB_SCALE_BYTES;
/// Bytes of GGUF's `block_q4_K`: `d`, `dmin`, 12 bytes of packed 6-bit scales, 128 of quants.
pub const GGUF_BLOCK_BYTES: usize = 144;

/// Q4_K's group layout: pairs of sub-blocks of 4-bit quants, and per super-block the `d` and
/// `dmin` header and each sub-block's 6-bit scale and min (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Q4KPlanes;

impl PlaneLayout for Q4KPlanes {
    fn group_lens(cols: usize) -> Option<(usize, usize)> {
        if cols == 0 || !cols.is_multiple_of(2 * SUB) {
            return None;
        }
        let headers = cols.div_ceil(QK_K).checked_mul(HEADER_BYTES)?;
        let sub_scales = (cols / SUB).checked_mul(SUB_SCALE_BYTES)?;
        Some(((cols / (2 * SUB)).checked_mul(PAIR_BYTES)?, headers.checked_add(sub_scales)?))
    }
}

/// A Q4_K weight matrix `[rows, cols]` in Kylin's packed layout (see the module docs): `cols`
/// is a non-zero multiple of 64.
pub type Q4KMatrix<'a> = PackedMatrix<'a, Q4KPlanes>;

/// Sub-blocks in super-block `s` of a row of `cols` columns.
#[inline]
pub(crate) fn subs_in(cols: usize, s: usize) -> usize {
    ((cols - s * QK_K) / SUB).min(QK_K / SUB)
}

/// Bytes of the quants and scales planes of a packed `[rows, cols]` Q4_K matrix (rows rounded
/// up to a group of 16); `None` if `cols` is not a non-zero multiple of 64 or a size overflows.
pub fn q4_k_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    plane_lens::<Q4KPlanes>(rows, cols)
}

/// The shapes `kylin quantize` gives the planes (both U8): quants `[groups, cols · 8]` and
/// scales `[groups, 64 · super-blocks + cols]`.
pub fn q4_k_plane_shapes(rows: usize, cols: usize) -> ([usize; 2], [usize; 2]) {
    let groups = rows.div_ceil(GROUP_ROWS);
    let (q, s) = Q4KPlanes::group_lens(cols).expect("the columns of a Q4_K matrix");
    ([groups, q], [groups, s])
}

/// `nearest_int` of llama.cpp (round half to even, `|v| < 2^22`).
#[inline]
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// llama.cpp's `make_qkx2_quants(32, 15, x, weights, L, &min, Laux, -1, 0.1, 20, false)`:
/// the scale and the (negated) min of one sub-block, its quants in `l`.
fn make_qkx2_quants(x: &[f32; SUB], weights: &[f32; SUB], l: &mut [u8; SUB]) -> (f32, f32) {
    const NMAX: i32 = 15;
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..SUB {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = NMAX as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..SUB {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, NMAX);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut laux = [0u8; SUB];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + NMAX as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..SUB {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, NMAX);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..SUB {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                *l = laux;
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// One super-block's GGUF numbers: `d` and `dmin` (f16 bits), the 6-bit `sc` and `m` of each
/// sub-block, and the 4-bit quants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperBlock {
    pub d: u16,
    pub dmin: u16,
    pub sc: [u8; 8],
    pub m: [u8; 8],
    pub q: [u8; QK_K],
}

/// llama.cpp's `quantize_row_q4_K_ref` on one super-block of `x.len()` columns (a multiple of
/// 32, at most 256; fewer is the zero-padded super-block of the module docs, whose missing
/// sub-blocks get scale, min and quants 0).
pub fn quantize_super_block(x: &[f32]) -> SuperBlock {
    assert!(x.len() <= QK_K && x.len().is_multiple_of(SUB), "a super-block holds whole sub-blocks, at most 8");
    let n_sub = x.len() / SUB;
    let (mut scales, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
    for j in 0..n_sub {
        let xs: &[f32; SUB] = x[j * SUB..(j + 1) * SUB].try_into().expect("32 columns");
        let sum_x2 = xs.iter().fold(0.0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / SUB as f32).sqrt();
        let weights: [f32; SUB] = std::array::from_fn(|l| av_x + xs[l].abs());
        let mut l = [0u8; SUB];
        (scales[j], mins[j]) = make_qkx2_quants(xs, &weights, &mut l);
    }
    finish_super_block(Isa::Scalar, x, &scales, &mins)
}

/// The rest of [`quantize_super_block`] once every sub-block's scale and (negated) min are
/// known (`scales[j]`, `mins[j]` for `j < x.len() / 32`, as `make_qkx2_quants` gives them):
/// `d` and `dmin` from their maxima, the 6-bit `sc` and `m`, and the quants (on `isa`, with
/// the same bits on every one).
pub(crate) fn finish_super_block(isa: Isa, x: &[f32], scales: &[f32; 8], mins: &[f32; 8]) -> SuperBlock {
    let n_sub = x.len() / SUB;
    let mut out = SuperBlock { d: 0, dmin: 0, sc: [0; 8], m: [0; 8], q: [0; QK_K] };
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..n_sub {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    for j in 0..n_sub {
        // As llama.cpp: `nearest_int` stored in a `uint8_t`, then capped at 63.
        out.sc[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        out.m[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    out.d = half::f16::from_f32(max_scale / 63.0).to_bits();
    out.dmin = half::f16::from_f32(max_min / 63.0).to_bits();
    let (d, dmin) = (half::f16::from_bits(out.d).to_f32(), half::f16::from_bits(out.dmin).to_f32());
    for j in 0..n_sub {
        let dj = d * out.sc[j] as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * out.m[j] as f32;
        let xs: &[f32; SUB] = x[j * SUB..(j + 1) * SUB].try_into().expect("32 columns");
        let q: &mut [u8; SUB] = (&mut out.q[j * SUB..(j + 1) * SUB]).try_into().expect("32 quants");
        match isa {
            // SAFETY: the caller's `isa` is this CPU's, so AVX-512 F/BW/VL are available.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { crate::q4k_x86::quantize_sub_block_avx512(xs, dm, dj, q) },
            _ => {
                for (q, v) in q.iter_mut().zip(xs) {
                    *q = nearest_int((v + dm) / dj).clamp(0, 15) as u8;
                }
            }
        }
    }
    out
}

/// GGUF's `block_q4_K` bytes of a row whose length is a multiple of 256 (llama.cpp's
/// `quantize_row_q4_K_ref`): `out` holds `x.len() / 256 · 144` bytes.
pub fn quantize_row_q4_k_gguf(x: &[f32], out: &mut [u8]) {
    assert!(x.len().is_multiple_of(QK_K) && out.len() == x.len() / QK_K * GGUF_BLOCK_BYTES);
    for (xs, block) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(GGUF_BLOCK_BYTES)) {
        let sb = quantize_super_block(xs);
        block[0..2].copy_from_slice(&sb.d.to_le_bytes());
        block[2..4].copy_from_slice(&sb.dmin.to_le_bytes());
        let scales = &mut block[4..16];
        scales.fill(0);
        for j in 0..8 {
            let (ls, lm) = (sb.sc[j], sb.m[j]);
            if j < 4 {
                scales[j] = ls;
                scales[j + 4] = lm;
            } else {
                scales[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                scales[j - 4] |= (ls >> 4) << 6;
                scales[j] |= (lm >> 4) << 6;
            }
        }
        let qs = &mut block[16..];
        for (c, chunk) in qs.chunks_exact_mut(32).enumerate() {
            for (l, byte) in chunk.iter_mut().enumerate() {
                *byte = sb.q[64 * c + l] | (sb.q[64 * c + 32 + l] << 4);
            }
        }
    }
}

/// Writes groups `groups` of `w` (any float dtype), quantized to Q4_K, into `quants` and
/// `scales`, which hold exactly those groups' parts of the planes. `row` is scratch for one
/// widened row (`cols` elements). Rows past `w.rows` in the last group are zero.
///
/// On AVX-512 and AVX2 the group's 16 rows are widened first (into a buffer allocated per
/// call; `row` is unused), then the sub-blocks' scales and mins are found 16 rows at a time
/// (one row per SIMD lane, each lane doing the scalar operations in the scalar order; AVX2
/// takes the 16 in two halves of 8) and each row's super-block finished as
/// [`quantize_super_block`] does, so the bytes are the scalar path's.
pub fn quantize_q4_k_groups(
    w: WeightMatrix<'_>,
    groups: std::ops::Range<usize>,
    quants: &mut [u8],
    scales: &mut [u8],
    row: &mut [f32],
) {
    let (gq_len, gs_len) = Q4KPlanes::group_lens(w.cols)
        .unwrap_or_else(|| panic!("Q4_K needs columns in multiples of 64; got {}", w.cols));
    assert_eq!(quants.len(), groups.len() * gq_len, "quants length != groups * group bytes");
    assert_eq!(scales.len(), groups.len() * gs_len, "scales length != groups * group bytes");
    assert_eq!(row.len(), w.cols);
    let planes = quants.chunks_exact_mut(gq_len).zip(scales.chunks_exact_mut(gs_len));
    #[cfg(target_arch = "x86_64")]
    if matches!(isa(), Isa::Avx512 | Isa::Avx2Fma) {
        let isa = isa();
        let cols = w.cols;
        let mut rows = vec![0.0f32; GROUP_ROWS * cols];
        let mut xt = [[0.0f32; GROUP_ROWS]; SUB];
        for (g, (gq, gs)) in groups.zip(planes) {
            for (lane, row) in rows.chunks_exact_mut(cols).enumerate() {
                let r = g * GROUP_ROWS + lane;
                if r < w.rows {
                    crate::widen_row(w, r, row);
                } else {
                    row.fill(0.0);
                }
            }
            for s in 0..cols.div_ceil(QK_K) {
                let n_sub = subs_in(cols, s);
                let (mut sub_scales, mut sub_mins) = ([[0.0f32; 8]; GROUP_ROWS], [[0.0f32; 8]; GROUP_ROWS]);
                for j in 0..n_sub {
                    let at = s * QK_K + j * SUB;
                    for (lane, row) in rows.chunks_exact(cols).enumerate() {
                        for (i, v) in row[at..at + SUB].iter().enumerate() {
                            xt[i][lane] = *v;
                        }
                    }
                    let (sc, mn) = search_x16(isa, &xt);
                    for lane in 0..GROUP_ROWS {
                        sub_scales[lane][j] = sc[lane];
                        sub_mins[lane][j] = mn[lane];
                    }
                }
                for (lane, row) in rows.chunks_exact(cols).enumerate() {
                    let x = &row[s * QK_K..s * QK_K + n_sub * SUB];
                    let sb = finish_super_block(isa, x, &sub_scales[lane], &sub_mins[lane]);
                    write_super_block(gq, gs, cols, lane, s, &sb);
                }
            }
        }
        return;
    }
    for (g, (gq, gs)) in groups.zip(planes) {
        for lane in 0..GROUP_ROWS {
            let r = g * GROUP_ROWS + lane;
            if r < w.rows {
                crate::widen_row(w, r, row);
            } else {
                row.fill(0.0);
            }
            for s in 0..w.cols.div_ceil(QK_K) {
                let n_sub = subs_in(w.cols, s);
                let sb = quantize_super_block(&row[s * QK_K..s * QK_K + n_sub * SUB]);
                write_super_block(gq, gs, w.cols, lane, s, &sb);
            }
        }
    }
}

/// The scales and negated mins of 16 sub-blocks (`x[i][lane]`: column `i` of lane `lane`'s),
/// each with the bits of the scalar `make_qkx2_quants` (with `quantize_super_block`'s
/// weights): AVX-512's sixteen-lane search, or AVX2's eight-lane one twice.
///
/// Panics unless `isa` is AVX-512 or AVX2 (the caller passes this CPU's).
#[cfg(target_arch = "x86_64")]
fn search_x16(isa: Isa, x: &[[f32; GROUP_ROWS]; SUB]) -> ([f32; GROUP_ROWS], [f32; GROUP_ROWS]) {
    match isa {
        // SAFETY: `isa` is this CPU's, so AVX-512 F/BW/VL, AVX2 and FMA are available.
        Isa::Avx512 => unsafe { crate::q4k_x86::make_qkx2_quants_x16(x) },
        Isa::Avx2Fma => {
            // SAFETY: `isa` is this CPU's, so AVX2 and FMA are available.
            let ((s0, m0), (s1, m1)) =
                unsafe { (crate::q4k_x86::make_qkx2_quants_x8(x, 0), crate::q4k_x86::make_qkx2_quants_x8(x, 1)) };
            let join = |a: [f32; 8], b: [f32; 8]| std::array::from_fn(|i| if i < 8 { a[i] } else { b[i - 8] });
            (join(s0, s1), join(m0, m1))
        }
        Isa::Scalar => panic!("the sub-block search needs AVX2 or AVX-512"),
    }
}

/// Packs one row's super-block `s` as lane `lane` of a group's planes.
fn write_super_block(gq: &mut [u8], gs: &mut [u8], cols: usize, lane: usize, s: usize, sb: &SuperBlock) {
    let n_sub = subs_in(cols, s);
    let header = s * SUPER_SCALE_BYTES;
    gs[header + 2 * lane..header + 2 * lane + 2].copy_from_slice(&sb.d.to_le_bytes());
    gs[header + 32 + 2 * lane..header + 32 + 2 * lane + 2].copy_from_slice(&sb.dmin.to_le_bytes());
    for j in 0..n_sub {
        let at = header + HEADER_BYTES + j * SUB_SCALE_BYTES;
        gs[at + lane] = sb.sc[j];
        gs[at + GROUP_ROWS + lane] = sb.m[j];
    }
    for pair in 0..n_sub / 2 {
        let block = &mut gq[(s * 4 + pair) * PAIR_BYTES..(s * 4 + pair + 1) * PAIR_BYTES];
        for k in 0..SUB {
            let (lo, hi) = (sb.q[2 * pair * SUB + k], sb.q[(2 * pair + 1) * SUB + k]);
            block[(k / 4) * 64 + lane * 4 + k % 4] = lo | (hi << 4);
        }
    }
}

/// Row `r`'s super-block `s` as GGUF numbers (its missing sub-blocks 0).
pub fn super_block_q4_k(m: Q4KMatrix<'_>, r: usize, s: usize) -> SuperBlock {
    assert!(r < m.rows && s < m.cols.div_ceil(QK_K));
    let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
    let (gq, gs) = m.group(g);
    let header = s * SUPER_SCALE_BYTES;
    let f16_at = |at: usize| u16::from_le_bytes([gs[at], gs[at + 1]]);
    let mut sb = SuperBlock {
        d: f16_at(header + 2 * lane),
        dmin: f16_at(header + 32 + 2 * lane),
        sc: [0; 8],
        m: [0; 8],
        q: [0; QK_K],
    };
    let n_sub = subs_in(m.cols, s);
    for j in 0..n_sub {
        let at = header + HEADER_BYTES + j * SUB_SCALE_BYTES;
        sb.sc[j] = gs[at + lane];
        sb.m[j] = gs[at + GROUP_ROWS + lane];
        let block = &gq[(s * 4 + j / 2) * PAIR_BYTES..];
        for k in 0..SUB {
            let byte = block[(k / 4) * 64 + lane * 4 + k % 4];
            sb.q[j * SUB + k] = if j.is_multiple_of(2) { byte & 0xF } else { byte >> 4 };
        }
    }
    sb
}

/// Row `r` dequantized into `out` (`cols` elements) as llama.cpp's `dequantize_row_q4_K`:
/// `(d · sc) · q − dmin · m`. An embedding lookup in a quantized matrix.
pub fn dequantize_row_q4_k(m: Q4KMatrix<'_>, r: usize, out: &mut [f32]) {
    assert!(r < m.rows && out.len() == m.cols);
    for s in 0..m.cols.div_ceil(QK_K) {
        let sb = super_block_q4_k(m, r, s);
        let (d, dmin) = (half::f16::from_bits(sb.d).to_f32(), half::f16::from_bits(sb.dmin).to_f32());
        for j in 0..subs_in(m.cols, s) {
            let (d1, m1) = (d * sb.sc[j] as f32, dmin * sb.m[j] as f32);
            for k in 0..SUB {
                out[s * QK_K + j * SUB + k] = d1 * sb.q[j * SUB + k] as f32 - m1;
            }
        }
    }
}

/// Row `lane`'s quant at column `k` of sub-block `j`, in a group's quants plane `wq` (shared
/// by Q4_K and [`crate::q4g`]).
#[inline]
pub(crate) fn quant_at(wq: &[u8], lane: usize, j: usize, k: usize) -> u8 {
    let byte = wq[(j / 2) * PAIR_BYTES + (k / 4) * 64 + lane * 4 + k % 4];
    if j.is_multiple_of(2) { byte & 0xF } else { byte >> 4 }
}

/// The exact integer dot product of row `lane`'s quants in sub-block `j` of a group's quants
/// plane `wq` with the sub-block's 32 int8 activations `xs` (shared by Q4_K and
/// [`crate::q4g`]).
#[inline]
pub(crate) fn isum_scalar(wq: &[u8], lane: usize, j: usize, xs: &[u8]) -> i32 {
    (0..SUB).map(|k| quant_at(wq, lane, j, k) as i32 * (xs[k] as i8 as i32)).sum()
}

/// Bytes of one token's quantized activations for rows of `cols` columns (as Q8_0's).
pub(crate) fn activation_stride(cols: usize) -> usize {
    cols + 8 * (cols / SUB)
}

/// Bytes of the activation scratch [`matmul_many_q4k`] needs for `n_tokens` tokens of `cols`
/// columns (the same as [`crate::quant::q8_scratch_len`]).
pub fn q4k_scratch_len(n_tokens: usize, cols: usize) -> usize {
    n_tokens * activation_stride(cols)
}

/// The scalar definition of one token's activation quantization (module docs).
fn quantize_row_scalar(x: &[f32], dst: &mut [u8]) {
    let (cols, nb) = (x.len(), x.len() / SUB);
    for (s, xs) in x.chunks(QK_K).enumerate() {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let iscale = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let dx = if amax != 0.0 { 1.0 / iscale } else { 0.0 };
        for (jj, sub) in xs.chunks_exact(SUB).enumerate() {
            let j = s * (QK_K / SUB) + jj;
            let mut sum = 0i32;
            for (k, v) in sub.iter().enumerate() {
                let q = nearest_int(v * iscale).clamp(-127, 127);
                sum += q;
                dst[j * SUB + k] = q as i8 as u8;
            }
            dst[cols + 4 * j..cols + 4 * j + 4].copy_from_slice(&dx.to_le_bytes());
            dst[cols + 4 * nb + 4 * j..cols + 4 * nb + 4 * j + 4].copy_from_slice(&(sum as f32 * dx).to_le_bytes());
        }
    }
}

/// Quantizes tokens `t0..t1` of `x` (`(n, cols)`) into their rows of `out`.
pub(crate) fn quantize_tokens(isa: Isa, x: &[f32], cols: usize, t0: usize, t1: usize, out: &mut [u8]) {
    let stride = activation_stride(cols);
    for t in t0..t1 {
        let xt = &x[t * cols..(t + 1) * cols];
        let dst = &mut out[t * stride..(t + 1) * stride];
        match isa {
            // SAFETY: AVX-512 F/BW/VL were detected; lengths as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { crate::q4k_x86::quantize_row_avx512(xt, dst) },
            // SAFETY: AVX2, FMA and F16C were detected; lengths as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { crate::q4k_x86::quantize_row_avx2(xt, dst) },
            _ => quantize_row_scalar(xt, dst),
        }
    }
}

/// The activation quantization of [`matmul_many_q4k`], exposed for tests: `x` is
/// `(n, cols)`, `out` holds [`q4k_scratch_len`]`(n, cols)` bytes.
pub fn quantize_activations(x: &[f32], n_tokens: usize, cols: usize, out: &mut [u8]) {
    assert_eq!(x.len(), n_tokens * cols);
    assert!(cols.is_multiple_of(SUB));
    assert!(out.len() >= q4k_scratch_len(n_tokens, cols));
    quantize_tokens(isa(), x, cols, 0, n_tokens, out)
}

/// The activation quantization on the scalar path, for tests to compare the fast one with.
pub fn quantize_activations_scalar(x: &[f32], n_tokens: usize, cols: usize, out: &mut [u8]) {
    assert_eq!(x.len(), n_tokens * cols);
    assert!(out.len() >= q4k_scratch_len(n_tokens, cols));
    quantize_tokens(Isa::Scalar, x, cols, 0, n_tokens, out)
}

/// `y_i = q8(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs` (all Q4_K with the same columns),
/// with the activations quantized once into `scratch` (at least
/// [`q4k_scratch_len`]`(n_tokens, cols)` bytes): [`crate::quant::matmul_many_quant`] for Q4_K
/// matrices, each output in the canonical order of the module docs.
pub fn matmul_many_q4k(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u8],
    jobs: &mut [(Q4KMatrix<'_>, &mut [f32])],
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
    let f32_at = |b: &[u8], at: usize| f32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    for t in 0..mt {
        let xt = &xq[t * stride..(t + 1) * stride];
        for lane in 0..valid {
            let mut acc = 0.0f32;
            for s in 0..cols.div_ceil(QK_K) {
                let header = s * SUPER_SCALE_BYTES;
                let d = half::f16::from_le_bytes([ws[header + 2 * lane], ws[header + 2 * lane + 1]]).to_f32();
                let dmin = half::f16::from_le_bytes([ws[header + 32 + 2 * lane], ws[header + 33 + 2 * lane]]).to_f32();
                for jj in 0..subs_in(cols, s) {
                    let j = s * (QK_K / SUB) + jj;
                    let isum = isum_scalar(wq, lane, j, &xt[j * SUB..(j + 1) * SUB]);
                    let at = header + HEADER_BYTES + jj * SUB_SCALE_BYTES;
                    let (dsc, dm) = (d * ws[at + lane] as f32, dmin * ws[at + GROUP_ROWS + lane] as f32);
                    let (dx, bx) = (f32_at(xt, cols + 4 * j), f32_at(xt, cols + 4 * nb + 4 * j));
                    acc = (isum as f32).mul_add(dsc * dx, acc);
                    acc = (-bx).mul_add(dm, acc);
                }
            }
            // SAFETY: the caller's contract.
            unsafe { *y.add(t * y_stride + lane) = acc };
        }
    }
}

/// A Q4_K product on the scalar kernels, for tests: `y (n, rows) = q8(x) · Wᵀ`.
pub fn matmul_q4k_scalar(w: Q4KMatrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Value `i` of a test sub-block of kind `kind`; `bits` are fresh random bits, `c` the
    /// sub-block's constant.
    fn value(kind: u64, bits: u64, c: f32, i: usize) -> f32 {
        let unit = (bits >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        match kind {
            // Magnitudes across the exponents.
            0 => unit * 2f32.powi((bits % 80) as i32 - 40),
            // Zeros of both signs.
            1 => [0.0, -0.0][(bits & 1) as usize],
            2 => c,
            // All positive: the min is clamped to 0.
            3 => unit.abs() + 0.25,
            // Subnormal: `15 / (max − min)` overflows.
            4 => unit * 2f32.powi(-135),
            // Huge: `max − min` and the sums of squares overflow.
            5 => unit * 3e38,
            // Large, with finite sums.
            6 => unit * 1e17,
            // Multiples of 1/8: ties in the roundings.
            7 => ((bits % 33) as f32 - 16.0) / 8.0,
            // Zeros and one outlier.
            8 => [0.0, c * 1e4][(i == (bits % SUB as u64) as usize) as usize],
            _ => unit,
        }
    }

    /// The lane searches (`make_qkx2_quants_x16` on AVX-512, `make_qkx2_quants_x8` twice on
    /// AVX2, each where the CPU has it) return, lane for lane, the bits of the scalar
    /// `make_qkx2_quants` (NaN for NaN) on sub-blocks of every kind, which the end-to-end
    /// test in `tests/q4k.rs` cannot see: most last-bit differences of a scale vanish in the
    /// 6-bit rounding.
    #[test]
    fn the_lane_searches_have_the_scalar_bits() {
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl");
        let avx2 = std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
        // Every search this CPU can run: AVX-512's sixteen lanes and AVX2's eight.
        let isas: Vec<Isa> = [(avx512 && avx2, Isa::Avx512), (avx2, Isa::Avx2Fma)]
            .into_iter()
            .filter_map(|(has, isa)| has.then_some(isa))
            .collect();
        if isas.is_empty() {
            return;
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for batch in 0..2000 {
            let mut xt = [[0.0f32; GROUP_ROWS]; SUB];
            for lane in 0..GROUP_ROWS {
                let (kind, c) = (next() % 10, value(0, next(), 0.0, 0));
                let bits = next();
                for (i, column) in xt.iter_mut().enumerate() {
                    column[lane] = value(kind, if kind == 8 { bits } else { next() }, c, i);
                }
            }
            for &isa in &isas {
                let (scales, mins) = search_x16(isa, &xt);
                for lane in 0..GROUP_ROWS {
                    let xs: [f32; SUB] = std::array::from_fn(|i| xt[i][lane]);
                    let sum_x2 = xs.iter().fold(0.0f32, |s, v| s + v * v);
                    let av_x = (sum_x2 / SUB as f32).sqrt();
                    let weights: [f32; SUB] = std::array::from_fn(|l| av_x + xs[l].abs());
                    let (scale, min) = make_qkx2_quants(&xs, &weights, &mut [0; SUB]);
                    assert!(
                        same(scale, scales[lane]) && same(min, mins[lane]),
                        "{isa:?} batch {batch} lane {lane}: ({scale:e}, {min:e}) != ({:e}, {:e}) for {xs:?}",
                        scales[lane],
                        mins[lane]
                    );
                }
            }
        }
    }
}
