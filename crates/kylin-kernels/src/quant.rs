//! Q8_0 weights and their int8 matrix products.
//!
//! **The numbers are GGUF's.** Q8_0 splits every weight row into blocks of [`QK8_0`] = 32
//! columns; a block stores an f16 scale `d = amax / 127` and 32 int8 `q = roundf(w / d)`
//! (llama.cpp's `quantize_row_q8_0_ref`, rounding half away from zero), and the weight is
//! `d · q`. [`quantize_row_q8_0`] computes exactly those numbers, so Kylin's quantized weights
//! are llama.cpp's for the same source weights.
//!
//! **The layout is Kylin's** ([`Q8Matrix`]): rows in groups of [`GROUP_ROWS`] = 16 (the last
//! group padded with zero rows), in two planes:
//! - quants `[group][block][k4: 8][row: 16][4 consecutive columns]`: per (group, block) 512
//!   bytes, each 64 of them what one `vpdpbusd` multiplies (four columns of sixteen rows),
//!   each stored offset-binary (`q + 128` as a `u8`, so the weight is the instruction's
//!   unsigned operand);
//! - scales `[group][block][row: 16]` as f16: 32 bytes per (group, block).
//!
//! That is [`Q8_BLOCK_BYTES`] = 544 bytes per 16 × 32 weights, as GGUF's 34 per 32. A task that
//! owns a range of groups reads one contiguous stream in each plane; the quants of an aligned
//! buffer ([`QuantBuffer`]) are read in whole cache lines. The planes are what `kylin quantize`
//! stores (`weight` and `weight_scale`), so a quantized checkpoint loads without a copy.
//!
//! **Activations** are quantized once per matrix product, per token, in blocks of 32
//! ([`quantize_activations`]) as llama.cpp's SIMD `quantize_row_q8_0` does: the scale
//! `dx = amax / 127` rounded to f16 (kept as f32), `q = round_ties_even(x · 127 / amax)` (0
//! when `dx` rounds to 0), and the block's `−128 · Σq`, which removes the weights' offset from
//! the integer dot product. Per token, the scratch holds the `cols`
//! quants, then `nb` scales (f32), then `nb` corrections (i32), `nb = cols / 32`.
//!
//! **Canonical order** of one output (DESIGN.md invariant 7):
//! `acc = 0; for b in 0..nb { acc = fma(f32(isum_b), dx_b · dw_b, acc) }`, where
//! `isum_b = Σ_k q_w[k] · q_x[k]` over the block's 32 columns is an exact integer (at most
//! 32 · 127 · 127 in magnitude, exact in f32 too) and `dx_b · dw_b` one rounded f32 product.
//! Integer sums are exact in any order, so every path here — scalar, AVX2 (`maddubs`),
//! AVX-512 VNNI (`vpdpbusd`), one token or a tile of eight, any thread — gives the same bits:
//! a token's outputs do not depend on its batch, and not even on the instruction set.

use crate::matmul::{MatrixRows, OutPtr, split_rows};
use crate::packed::{PackedMatrix, PlaneLayout, plane_lens};
use crate::{Isa, ThreadPool, WeightMatrix, isa};

/// Columns per Q8_0 block.
pub const QK8_0: usize = 32;
/// Rows per packed group.
pub const GROUP_ROWS: usize = 16;
/// Bytes of one (group, block): 16 × 32 quants and 16 f16 scales.
pub const Q8_BLOCK_BYTES: usize = GROUP_ROWS * QK8_0 + GROUP_ROWS * 2;
/// Bytes of one block's quants in a group.
pub(crate) const QUANTS_BYTES: usize = GROUP_ROWS * QK8_0;

/// Bytes of one block's scales in a group.
pub(crate) const SCALES_BYTES: usize = GROUP_ROWS * 2;

/// Q8_0's group layout: per block of 32 columns, 16 × 32 quants and 16 f16 scales (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Q8Planes;

impl PlaneLayout for Q8Planes {
    fn group_lens(cols: usize) -> Option<(usize, usize)> {
        if !cols.is_multiple_of(QK8_0) {
            return None;
        }
        let blocks = cols / QK8_0;
        Some((blocks.checked_mul(QUANTS_BYTES)?, blocks.checked_mul(SCALES_BYTES)?))
    }
}

/// A Q8_0 weight matrix `[rows, cols]` in Kylin's packed layout (see the module docs): `cols`
/// is a multiple of 32.
pub type Q8Matrix<'a> = PackedMatrix<'a, Q8Planes>;

/// Bytes of the quants and scales planes of a packed `[rows, cols]` Q8_0 matrix (rows rounded
/// up to a group of 16); `None` if `cols` is not a multiple of 32 or a size overflows.
pub fn q8_0_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    plane_lens::<Q8Planes>(rows, cols)
}

/// The shapes `kylin quantize` gives the planes: quants `[groups, blocks, 512]` (U8) and scales
/// `[groups, blocks, 16]` (F16).
pub fn q8_0_plane_shapes(rows: usize, cols: usize) -> ([usize; 3], [usize; 3]) {
    let (groups, blocks) = (rows.div_ceil(GROUP_ROWS), cols / QK8_0);
    ([groups, blocks, QUANTS_BYTES], [groups, blocks, GROUP_ROWS])
}

/// GGUF's Q8_0 quantization of one row (llama.cpp's `quantize_row_q8_0_ref`): for each block of
/// 32, `d = amax / 127`, `q = roundf(x · (1 / d))` (0 when `d` is 0), `d` stored as f16 bits
/// (rounded to nearest even). `x.len()` must be a multiple of 32; `qs` holds `x.len()` and
/// `scales` `x.len() / 32` elements.
pub fn quantize_row_q8_0(x: &[f32], qs: &mut [i8], scales: &mut [u16]) {
    assert!(x.len().is_multiple_of(QK8_0), "row length {} is not a multiple of 32", x.len());
    assert_eq!(qs.len(), x.len());
    assert_eq!(scales.len(), x.len() / QK8_0);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: AVX-512 F/BW/VL were detected; the lengths were checked above.
        unsafe { crate::quant_x86::quantize_weights_avx512(x, qs, scales) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2Fma {
        // SAFETY: AVX2/FMA/F16C were detected; the lengths were checked above.
        unsafe { crate::quant_x86::quantize_weights_avx2(x, qs, scales) };
        return;
    }
    for ((block, q), scale) in x.chunks_exact(QK8_0).zip(qs.chunks_exact_mut(QK8_0)).zip(scales.iter_mut()) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        *scale = half::f16::from_f32(d).to_bits();
        for (q, v) in q.iter_mut().zip(block) {
            *q = round_half_away(v * id) as i8;
        }
    }
}

/// `roundf` for `|v| < 2^23` (here at most 127.x): rounds half away from zero, without the
/// library call `f32::round` compiles to on baseline x86_64.
#[inline]
fn round_half_away(v: f32) -> i32 {
    let a = v.abs();
    let t = a as i32;
    let r = t + ((a - t as f32) >= 0.5) as i32;
    if v < 0.0 { -r } else { r }
}

/// Writes groups `groups` of `w` (any float dtype), quantized to Q8_0, into `quants` and
/// `scales`, which hold exactly those groups' parts of the planes (`groups.len() · (cols / 32)`
/// times 512 and 32 bytes). `row` is scratch for one widened row (`cols` elements). Rows past
/// `w.rows` in the last group are zero.
pub fn quantize_q8_0_groups(
    w: WeightMatrix<'_>,
    groups: std::ops::Range<usize>,
    quants: &mut [u8],
    scales: &mut [u8],
    row: &mut [f32],
) {
    let nb = w.cols / QK8_0;
    assert!(w.cols.is_multiple_of(QK8_0), "Q8_0 needs columns in multiples of 32; got {}", w.cols);
    assert_eq!(quants.len(), groups.len() * nb * QUANTS_BYTES, "quants length != groups * group bytes");
    assert_eq!(scales.len(), groups.len() * nb * SCALES_BYTES, "scales length != groups * group bytes");
    assert_eq!(row.len(), w.cols);
    let mut qs = vec![0i8; w.cols];
    let mut row_scales = vec![0u16; nb];
    let planes = quants.chunks_exact_mut(nb * QUANTS_BYTES).zip(scales.chunks_exact_mut(nb * SCALES_BYTES));
    for (g, (gq, gs)) in groups.zip(planes) {
        for lane in 0..GROUP_ROWS {
            let r = g * GROUP_ROWS + lane;
            if r < w.rows {
                crate::widen_row(w, r, row);
                quantize_row_q8_0(row, &mut qs, &mut row_scales);
            } else {
                qs.fill(0);
                row_scales.fill(0);
            }
            write_lane(gq, gs, lane, &qs, &row_scales);
        }
    }
}

/// Packs a `[rows, cols]` matrix of int8 quants with per-block scales into the Q8_0 planes,
/// so that weight `(r, c)` is `f16(scales[r, c / 32]) · q[r, c]`: exactly the planes
/// [`quantize_q8_0_groups`] makes of weights it quantizes to those numbers (quants stored
/// offset-binary, padding rows of the last group with quants 0 and scales 0). For checkpoints
/// published with int8 weights and a scale per group of columns (a group of `g` columns is
/// `g / 32` blocks with the same scale).
///
/// `q` is row-major `[rows, cols]` (all of `-128..=127`); `scales` is row-major
/// `[rows, cols / 32]`, rounded to f16 to nearest even (a value beyond f16's range becomes an
/// infinity: the caller checks the checkpoint's numbers first). `quants_out` and `scales_out`
/// have the lengths [`q8_0_plane_lens`]`(rows, cols)` gives; every byte is written. Panics if
/// `cols` is not a multiple of 32 or a length disagrees (a caller bug). Allocates a row's
/// scales and, when the last group is partial, a row of zeros.
pub fn pack_q8_0(rows: usize, cols: usize, q: &[i8], scales: &[f32], quants_out: &mut [u8], scales_out: &mut [u8]) {
    assert!(cols.is_multiple_of(QK8_0), "Q8_0 needs columns in multiples of 32; got {cols}");
    let nb = cols / QK8_0;
    assert_eq!(rows.checked_mul(cols), Some(q.len()), "q is not [rows, cols]");
    assert_eq!(rows.checked_mul(nb), Some(scales.len()), "scales is not [rows, cols / 32]");
    assert_eq!(
        q8_0_plane_lens(rows, cols),
        Some((quants_out.len(), scales_out.len())),
        "packed q8_0 lengths for [{rows}, {cols}]"
    );
    if nb == 0 {
        return;
    }
    let mut bits = vec![0u16; nb];
    // The quants of the last group's padding rows (none when that group is full).
    let zeros = vec![0i8; if rows.is_multiple_of(GROUP_ROWS) { 0 } else { cols }];
    let planes = quants_out.chunks_exact_mut(nb * QUANTS_BYTES).zip(scales_out.chunks_exact_mut(nb * SCALES_BYTES));
    for (g, (gq, gs)) in planes.enumerate() {
        for lane in 0..GROUP_ROWS {
            let r = g * GROUP_ROWS + lane;
            if r < rows {
                for (b, s) in bits.iter_mut().zip(&scales[r * nb..(r + 1) * nb]) {
                    *b = half::f16::from_f32(*s).to_bits();
                }
                write_lane(gq, gs, lane, &q[r * cols..(r + 1) * cols], &bits);
            } else {
                // A padding row: quants 0 and scales 0, as `quantize_q8_0_groups` writes it.
                bits.fill(0);
                write_lane(gq, gs, lane, &zeros, &bits);
            }
        }
    }
}

/// Packs one row's GGUF numbers (`qs`, f16 `scales`) as lane `lane` of a group's planes.
fn write_lane(gq: &mut [u8], gs: &mut [u8], lane: usize, qs: &[i8], scales: &[u16]) {
    for (b, scale) in scales.iter().enumerate() {
        let block = &mut gq[b * QUANTS_BYTES..(b + 1) * QUANTS_BYTES];
        for (k4, four) in qs[b * QK8_0..(b + 1) * QK8_0].chunks_exact(4).enumerate() {
            let at = k4 * 64 + lane * 4;
            let bytes = [four[0] as u8, four[1] as u8, four[2] as u8, four[3] as u8];
            block[at..at + 4].copy_from_slice(&(u32::from_le_bytes(bytes) ^ 0x8080_8080).to_le_bytes());
        }
        let at = b * SCALES_BYTES + 2 * lane;
        gs[at..at + 2].copy_from_slice(&scale.to_le_bytes());
    }
}

/// The GGUF numbers of row `r`: its 32-column blocks' quants and f16 scales.
pub fn row_q8_0(m: Q8Matrix<'_>, r: usize, qs: &mut [i8], scales: &mut [u16]) {
    let (nb, g, lane) = (m.cols / QK8_0, r / GROUP_ROWS, r % GROUP_ROWS);
    assert!(r < m.rows && qs.len() == m.cols && scales.len() == nb);
    let (gq, gs) = m.group(g);
    for b in 0..nb {
        let block = &gq[b * QUANTS_BYTES..(b + 1) * QUANTS_BYTES];
        for k in 0..QK8_0 {
            qs[b * QK8_0 + k] = (block[(k / 4) * 64 + lane * 4 + k % 4] ^ 0x80) as i8;
        }
        let at = b * SCALES_BYTES + 2 * lane;
        scales[b] = u16::from_le_bytes([gs[at], gs[at + 1]]);
    }
}

/// Row `r` dequantized (`d · q`, exact in f32) into `out` (`cols` elements): an embedding lookup
/// in a quantized matrix.
pub fn dequantize_row_q8_0(m: Q8Matrix<'_>, r: usize, out: &mut [f32]) {
    let (nb, g, lane) = (m.cols / QK8_0, r / GROUP_ROWS, r % GROUP_ROWS);
    assert!(r < m.rows && out.len() == m.cols);
    let (gq, gs) = m.group(g);
    for (b, o) in out.chunks_exact_mut(QK8_0).enumerate().take(nb) {
        let block = &gq[b * QUANTS_BYTES..(b + 1) * QUANTS_BYTES];
        let at = b * SCALES_BYTES + 2 * lane;
        let d = half::f16::from_le_bytes([gs[at], gs[at + 1]]).to_f32();
        for (k, o) in o.iter_mut().enumerate() {
            *o = d * ((block[(k / 4) * 64 + lane * 4 + k % 4] ^ 0x80) as i8) as f32;
        }
    }
}

/// Bytes of one token's quantized activations for rows of `cols` columns.
fn activation_stride(cols: usize) -> usize {
    cols + 8 * (cols / QK8_0)
}

/// Bytes of the activation scratch [`matmul_many_q8`] needs for `n_tokens` tokens of `cols`
/// columns.
pub fn q8_scratch_len(n_tokens: usize, cols: usize) -> usize {
    n_tokens * activation_stride(cols)
}

/// Quantizes tokens `t0..t1` of `x` (`(n, cols)`) into their rows of `out` (the layout of the
/// module docs), on `isa`'s kernels (all give the same bytes).
fn quantize_tokens(isa: Isa, x: &[f32], cols: usize, t0: usize, t1: usize, out: &mut [u8]) {
    let stride = activation_stride(cols);
    for t in t0..t1 {
        let xt = &x[t * cols..(t + 1) * cols];
        let dst = &mut out[t * stride..(t + 1) * stride];
        match isa {
            // SAFETY: AVX-512 F/BW/VL, AVX2, FMA and F16C were detected; lengths as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { crate::quant_x86::quantize_row_avx512(xt, dst) },
            // SAFETY: AVX2, FMA and F16C were detected; lengths as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { crate::quant_x86::quantize_row_avx2(xt, dst) },
            _ => quantize_row_scalar(xt, dst),
        }
    }
}

/// The scalar definition of one token's activation quantization.
fn quantize_row_scalar(x: &[f32], dst: &mut [u8]) {
    let (cols, nb) = (x.len(), x.len() / QK8_0);
    for (b, block) in x.chunks_exact(QK8_0).enumerate() {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = half::f16::from_f32(amax / 127.0).to_f32();
        let id = if d != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (k, v) in block.iter().enumerate() {
            let q = (v * id).round_ties_even() as i32;
            let q = q.clamp(-128, 127);
            sum += q;
            dst[b * QK8_0 + k] = q as i8 as u8;
        }
        dst[cols + 4 * b..cols + 4 * b + 4].copy_from_slice(&d.to_le_bytes());
        dst[cols + 4 * nb + 4 * b..cols + 4 * nb + 4 * b + 4].copy_from_slice(&(-128 * sum).to_le_bytes());
    }
}

/// The activation quantization of [`matmul_many_q8`], exposed for tests: `x` is `(n, cols)`,
/// `out` holds [`q8_scratch_len`]`(n, cols)` bytes.
pub fn quantize_activations(x: &[f32], n_tokens: usize, cols: usize, out: &mut [u8]) {
    assert_eq!(x.len(), n_tokens * cols);
    assert!(cols.is_multiple_of(QK8_0));
    assert!(out.len() >= q8_scratch_len(n_tokens, cols));
    quantize_tokens(isa(), x, cols, 0, n_tokens, out)
}

/// The kernel family of the int8 products on this machine (`avx512-vnni`, `avx2`, `scalar`).
pub fn q8_kernels() -> &'static str {
    match int8_isa() {
        Int8Isa::Vnni => "avx512-vnni",
        Int8Isa::Avx2 => "avx2",
        Int8Isa::Scalar => "scalar",
    }
}

/// The kernel family of the products over 4-bit and 5/6-bit integer weights (Q4_K, Q4_G, Q5_0,
/// Q6_0): [`q8_kernels`]'s, with `+amx-int8` where prefill's integer sums run on AMX-INT8 tiles
/// ([`crate::amx_int8`]).
pub fn q4k_kernels() -> String {
    match int8_isa() {
        Int8Isa::Vnni if crate::amx_int8() => "avx512-vnni+amx-int8".to_string(),
        _ => q8_kernels().to_string(),
    }
}

/// Which int8 dot-product kernels run (Q8_0's, Q4_K's and Q4_G's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int8Isa {
    Vnni,
    Avx2,
    Scalar,
}

pub(crate) fn int8_isa() -> Int8Isa {
    static INT8_ISA: std::sync::OnceLock<Int8Isa> = std::sync::OnceLock::new();
    *INT8_ISA.get_or_init(detect_int8_isa)
}

fn detect_int8_isa() -> Int8Isa {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if std::arch::is_x86_feature_detected!("avx512vnni") => Int8Isa::Vnni,
        Isa::Avx512 | Isa::Avx2Fma => Int8Isa::Avx2,
        _ => Int8Isa::Scalar,
    }
}

/// Tokens per GEMM tile of the VNNI kernels, every format (8 weight vectors + 8 accumulators +
/// temporaries of the 32 zmm registers).
pub(crate) const Q8_MT: usize = 8;

/// `y_i = q8(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs` (all Q8_0 with the same columns),
/// with the activations quantized once into `scratch` (at least
/// [`q8_scratch_len`]`(n_tokens, cols)` bytes). [`matmul_many_quant`] for Q8_0 matrices.
pub fn matmul_many_q8(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u8],
    jobs: &mut [(Q8Matrix<'_>, &mut [f32])],
) {
    matmul_many_packed(pool, x, n_tokens, scratch, jobs)
}

/// `y_i = q8(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs`: quantized matrices of any format
/// with the same columns, in one pool job per [`crate::matmul::MAX_FUSED`] matrices. The
/// activations are quantized once per activation kind present ([`ActivationKind`]: Q8_0's,
/// and Q4_K's, which Q4_G shares) into `scratch` (at least
/// [`quant_scratch_len`]`(n_tokens, cols)` bytes; one kind needs only
/// [`q8_scratch_len`]`(n_tokens, cols)`).
///
/// Shapes: `x` is `(n_tokens, cols)`, every `W_i` is `(rows_i, cols)`, `y_i` is
/// `(n_tokens, rows_i)`. Every output follows its format's canonical order (module docs here,
/// in [`crate::q4k`] and in [`crate::q4g`]), so row `t` of `y_i` has the same bits whatever else is in `x` or in
/// `jobs`, on any pool and any instruction set. Allocates nothing. Panics on a shape
/// disagreement (a caller bug).
pub fn matmul_many_quant(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u8],
    jobs: &mut [(QuantMatrix<'_>, &mut [f32])],
) {
    matmul_many_packed(pool, x, n_tokens, scratch, jobs)
}

/// The driver of every quantized product: checks, activation quantization (tokens split across
/// the pool when there are many), then output rows split across the pool in groups of 16.
pub(crate) fn matmul_many_packed<'a, M: MatrixRows + Into<QuantMatrix<'a>>>(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u8],
    jobs: &mut [(M, &mut [f32])],
) {
    let Some((first, _)) = jobs.first() else { return };
    let cols = (*first).into().cols();
    for (w, y) in jobs.iter() {
        let w: QuantMatrix<'a> = (*w).into();
        assert_eq!(y.len(), n_tokens * w.rows(), "y.len() != n_tokens * rows");
    }
    let Some(activations) = quantize_inputs(pool, x, n_tokens, cols, scratch, jobs.iter().map(|(w, _)| (*w).into()))
    else {
        return;
    };
    let xq: &[u8] = &scratch[..activations.needed];
    let kernels = int8_isa();
    for chunk in jobs.chunks_mut(crate::matmul::MAX_FUSED) {
        let bytes: usize = chunk.iter().map(|(w, _)| (*w).into().byte_len()).sum();
        let macs: usize = chunk.iter().map(|(w, _)| w.rows() * cols * n_tokens).sum();
        let parallel = if n_tokens == 1 { bytes >= 64 * 1024 } else { macs >= 1 << 20 };
        let threads = if parallel { pool.threads() } else { 1 };
        split_rows(pool, chunk, GROUP_ROWS, threads, &|w: M, out: OutPtr, r0, r1| {
            let w: QuantMatrix<'a> = w.into();
            let kind = w.packing().activation_kind();
            let xq = activations.region(xq, kind);
            // SAFETY: `split_rows` hands this call rows `r0..r1` (whole groups, the last one
            // possibly partial) of `out`, which no other call touches; shapes were checked.
            unsafe {
                compute_groups(kernels, w, xq, kind.stride(cols), n_tokens, activations.integer_forms, out, r0, r1)
            }
        });
    }
}

/// A quantized matrix and the row of the input it reads, for [`matmul_rows_quant`].
#[derive(Debug, Clone, Copy)]
pub struct RowInput<'a> {
    pub matrix: QuantMatrix<'a>,
    /// The row of `xs` this matrix multiplies.
    pub row: usize,
}

impl MatrixRows for RowInput<'_> {
    fn rows(&self) -> usize {
        self.matrix.rows()
    }
}

/// `y_i = q(xs[row_i]) · W_iᵀ` for every `(RowInput { W_i, row_i }, y_i)` in `jobs`: one token
/// per matrix, each reading its own row of `xs` `(input rows, cols)`, in one pool job per
/// [`crate::matmul::MAX_FUSED`] matrices. A decode step's routed experts: each down product
/// reads its own expert's activations, and 0.9 MB matrices are too small for a pool job each.
/// `scratch` holds at least [`quant_scratch_len`]`(input rows, cols)` bytes.
///
/// Shapes: every `W_i` is `(rows_i, cols)`, `y_i` is `(1, rows_i)`. `y_i` has the same bits as
/// [`matmul_many_quant`] over `xs[row_i]` alone gives (one token's activations are quantized
/// alone, and each row follows its format's canonical order). Allocates nothing. Panics on a
/// shape disagreement or a row outside `xs` (a caller bug).
pub fn matmul_rows_quant(pool: &ThreadPool, xs: &[f32], scratch: &mut [u8], jobs: &mut [(RowInput<'_>, &mut [f32])]) {
    let Some((first, _)) = jobs.first() else { return };
    let cols = first.matrix.cols();
    assert!(cols > 0 && xs.len().is_multiple_of(cols), "xs.len() is not a whole number of rows of {cols}");
    let inputs = xs.len() / cols;
    for (w, y) in jobs.iter() {
        assert!(w.row < inputs, "input row {} of {inputs}", w.row);
        assert_eq!(y.len(), w.matrix.rows(), "y.len() != rows");
    }
    let Some(activations) = quantize_inputs(pool, xs, inputs, cols, scratch, jobs.iter().map(|(w, _)| w.matrix)) else {
        return;
    };
    let xq: &[u8] = &scratch[..activations.needed];
    let kernels = int8_isa();
    for chunk in jobs.chunks_mut(crate::matmul::MAX_FUSED) {
        let bytes: usize = chunk.iter().map(|(w, _)| w.matrix.byte_len()).sum();
        let threads = if bytes >= 64 * 1024 { pool.threads() } else { 1 };
        split_rows(pool, chunk, GROUP_ROWS, threads, &|w: RowInput<'_>, out: OutPtr, r0, r1| {
            let kind = w.matrix.packing().activation_kind();
            let stride = kind.stride(cols);
            // This job's one token (a lone input row's integer forms after it).
            let region = activations.region(xq, kind);
            let end = if activations.integer_forms { region.len() } else { (w.row + 1) * stride };
            let xq = &region[w.row * stride..end];
            // SAFETY: as in `matmul_many_packed`; `xq` is this job's one token.
            unsafe { compute_groups(kernels, w.matrix, xq, stride, 1, activations.integer_forms, out, r0, r1) }
        });
    }
}

/// Where [`quantize_inputs`] put each activation kind in the scratch.
struct Activations {
    present: [bool; ACTIVATION_KINDS.len()],
    n_tokens: usize,
    cols: usize,
    /// Bytes of the scratch in use.
    needed: usize,
    /// Whether the lone token's BF16 row has its integer forms after it.
    integer_forms: bool,
}

impl Activations {
    /// `kind`'s region of the scratch: `n_tokens` rows of its stride, after the regions of the
    /// kinds before it that are present.
    fn range(&self, kind: ActivationKind) -> std::ops::Range<usize> {
        let len = |k: ActivationKind| k.region_len(self.n_tokens, self.cols);
        let offset: usize =
            ACTIVATION_KINDS[..kind as usize].iter().filter(|k| self.present[**k as usize]).map(|&k| len(k)).sum();
        offset..offset + len(kind)
    }

    /// `kind`'s region of `xq`.
    fn region<'x>(&self, xq: &'x [u8], kind: ActivationKind) -> &'x [u8] {
        &xq[self.range(kind)]
    }
}

/// Checks `matrices` against `x (n_tokens, cols)` and quantizes `x` once per activation kind
/// they need into `scratch` (tokens split across the pool when there are many); `None` when
/// there are no tokens.
fn quantize_inputs<'a>(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    scratch: &mut [u8],
    matrices: impl Iterator<Item = QuantMatrix<'a>>,
) -> Option<Activations> {
    let mut present = [false; ACTIVATION_KINDS.len()];
    // Whether a one-token product over integer codes with BF16 activations is among them: its
    // packing adds each block's integer form (`w16::IntegerBlock`).
    let mut integer_a16 = false;
    for w in matrices {
        // These checks make the unsafe reads and writes of the products sound.
        assert_eq!(w.cols(), cols, "matrices sharing an input must have the same columns");
        assert_eq!(
            Some((w.quants().len(), w.scales().len())),
            w.packing().plane_lens(w.rows(), cols),
            "packed {} lengths",
            w.packing().name()
        );
        present[w.packing().activation_kind() as usize] = true;
        integer_a16 |= matches!(w.packing(), Packing::Q4GA16 | Packing::Q8_0A16);
    }
    assert_eq!(x.len(), n_tokens * cols, "x.len() != n_tokens * cols");
    let integer_forms = integer_a16 && n_tokens == 1 && crate::w16::integer_forms_used();
    let activations = Activations {
        present,
        n_tokens,
        cols,
        integer_forms,
        needed: ACTIVATION_KINDS.iter().filter(|k| present[**k as usize]).map(|&k| k.region_len(n_tokens, cols)).sum(),
    };
    assert!(
        scratch.len() >= activations.needed,
        "quantized-product scratch holds {} bytes, {} needed",
        scratch.len(),
        activations.needed
    );
    if n_tokens == 0 {
        return None;
    }
    let isa = isa();
    let shared = SharedBytes(scratch.as_mut_ptr(), activations.needed);
    let threads = if n_tokens * cols >= 1 << 16 { pool.threads().min(n_tokens) } else { 1 };
    pool.run(threads, &|t| {
        let (t0, t1) = (n_tokens * t / threads, n_tokens * (t + 1) / threads);
        // SAFETY: each task writes only the rows of its own tokens `t0..t1`, in each region.
        let all = unsafe { shared.slice() };
        for kind in ACTIVATION_KINDS {
            if present[kind as usize] {
                let out = &mut all[activations.range(kind)];
                match kind {
                    ActivationKind::Q8_0 => quantize_tokens(isa, x, cols, t0, t1, out),
                    ActivationKind::Q4K => crate::q4k::quantize_tokens(isa, x, cols, t0, t1, out),
                    ActivationKind::Bf16 => crate::w16::pack_tokens(x, cols, t0, t1, out, integer_forms),
                }
            }
        }
    });
    Some(activations)
}

/// One token × groups `g0..g0 + G` of the Q8_0 matrix `m` on `kernels`' tile (AVX2 or
/// VNNI), block by block in turn (`quant_x86::tile_avx2_one_token_groups`,
/// `quant_x86::tile_vnni_one_token_groups`), into `out` (the token's output row).
///
/// # Safety
/// The CPU has `kernels`' instructions, which are AVX2 or VNNI; the groups lie inside `m`,
/// their output rows inside `out` belong to the caller, and `xq` is one whole token row of
/// Q8_0 activations for `m`.
#[cfg(target_arch = "x86_64")]
unsafe fn one_token_q8_groups<const G: usize>(
    kernels: Int8Isa,
    m: Q8Matrix<'_>,
    g0: usize,
    blocks: usize,
    xq: &[u8],
    out: OutPtr,
) {
    let rows = m.rows();
    let planes: [(&[u8], &[u8]); G] = std::array::from_fn(|i| m.group(g0 + i));
    let valid: [usize; G] = std::array::from_fn(|i| (rows - (g0 + i) * GROUP_ROWS).min(GROUP_ROWS));
    // SAFETY: the caller's contract; each plane pair is one whole group.
    unsafe {
        let y: [*mut f32; G] = std::array::from_fn(|i| out.0.add((g0 + i) * GROUP_ROWS));
        let (wq, ws) = (planes.map(|p| p.0), planes.map(|p| p.1));
        if kernels == Int8Isa::Vnni {
            crate::quant_x86::tile_vnni_one_token_groups::<G>(wq, ws, blocks, xq, y, valid);
        } else {
            crate::quant_x86::tile_avx2_one_token_groups::<G>(wq, ws, blocks, xq, y, valid);
        }
    }
}

/// [`crate::q4k_x86::group_vnni_unpacked`] for one scales layout.
#[cfg(target_arch = "x86_64")]
type UnpackedGroup = unsafe fn(usize, &[u8], &[u8], usize, &[u8], usize, *mut f32, usize, usize);

/// Output rows `r0..r1` (`r0` a multiple of 16) of `y = q8(x) · Wᵀ` for all tokens, in tiles
/// of up to [`Q8_MT`] tokens × 16 rows on `kernels`' tile for `w`'s format.
///
/// # Safety
/// `out` points to the `(n_tokens, w.rows)` output whose rows `r0..r1` no one else accesses
/// meanwhile; `xq` holds `n_tokens` rows of `w`'s format's quantized activations, `stride`
/// bytes each; the CPU has `kernels`' instructions.
#[allow(clippy::too_many_arguments)]
unsafe fn compute_groups(
    kernels: Int8Isa,
    w: QuantMatrix<'_>,
    xq: &[u8],
    stride: usize,
    n_tokens: usize,
    integer_forms: bool,
    out: OutPtr,
    r0: usize,
    r1: usize,
) {
    debug_assert!(r0.is_multiple_of(GROUP_ROWS));
    let (rows, cols) = (w.rows(), w.cols());
    // Blocks of 32 columns per row, for the formats built on them (Q8_0, MXFP4).
    let blocks = cols / QK8_0;
    // Batched decode: the first token tile over a group prefetches the next group's weights.
    let prefetch_next = crate::prefetches_weights(n_tokens);
    let groups = r0 / GROUP_ROWS..r1.div_ceil(GROUP_ROWS);
    let mut first_single = groups.start;
    // One token through Q8_0 on AVX2 or VNNI: four groups at a time, in four streams (see
    // `tile_avx2_one_token_groups`), and the last one to three groups of the range together.
    #[cfg(target_arch = "x86_64")]
    if let (1, Int8Isa::Avx2 | Int8Isa::Vnni, QuantMatrix::Q8_0(m)) = (n_tokens, kernels, w) {
        const G: usize = crate::quant_x86::ONE_TOKEN_GROUPS;
        let mut g0 = groups.start;
        while g0 < groups.end {
            let n = (groups.end - g0).min(G);
            // SAFETY: groups `g0..g0 + n` lie inside the matrix and their output rows belong to
            // this call; `xq` is one whole token row of Q8_0 activations.
            unsafe {
                match n {
                    4 => one_token_q8_groups::<4>(kernels, m, g0, blocks, xq, out),
                    3 => one_token_q8_groups::<3>(kernels, m, g0, blocks, xq, out),
                    2 => one_token_q8_groups::<2>(kernels, m, g0, blocks, xq, out),
                    _ => one_token_q8_groups::<1>(kernels, m, g0, blocks, xq, out),
                }
            }
            g0 += n;
        }
        first_single = groups.end;
    }
    for g in first_single..groups.end {
        let valid = (rows - g * GROUP_ROWS).min(GROUP_ROWS);
        let (wq, ws) = match w {
            QuantMatrix::Q8_0(m) | QuantMatrix::Q8_0A16(m) => m.group(g),
            QuantMatrix::Q4K(m) => m.group(g),
            QuantMatrix::Q4G(m) | QuantMatrix::Q4GA16(m) => m.group(g),
            QuantMatrix::Q5_0(m) => m.group(g),
            QuantMatrix::Q6_0(m) => m.group(g),
            QuantMatrix::F8A16(m) => m.group(g),
            QuantMatrix::Mxfp4(m) => m.group(g),
        };
        let weights = match w.packing() {
            Packing::Q8_0A16 => Some(crate::w16::Weights::Int8),
            Packing::Q4GA16 => Some(crate::w16::Weights::Int4),
            Packing::F8A16 => Some(crate::w16::Weights::Fp8),
            Packing::Q8_0 | Packing::Q4K | Packing::Q4G | Packing::Q5_0 | Packing::Q6_0 | Packing::Mxfp4 => None,
        };
        if let Some(weights) = weights {
            // SAFETY: as below, for all the tokens; `xq` holds their packed BF16 rows.
            unsafe {
                let y = out.0.add(g * GROUP_ROWS);
                crate::w16::group(
                    weights,
                    n_tokens,
                    wq,
                    ws,
                    cols,
                    xq,
                    stride,
                    y,
                    rows,
                    valid,
                    prefetch_next,
                    integer_forms,
                )
            };
            continue;
        }
        // Prefill on the Q4_K-family tiles: unpack the group's nibbles (and high bits) once for
        // all the token tiles instead of once per tile.
        #[cfg(target_arch = "x86_64")]
        if kernels == Int8Isa::Vnni && n_tokens > Q8_MT && !prefetch_next {
            use crate::q4k_x86::{Q4G_SCALES, Q4K_SCALES, Q5_0_SCALES, Q6_0_SCALES, group_vnni_unpacked};
            // SAFETY: rows `g·16 .. g·16 + valid` of every token lie inside the output and
            // belong to this call; `wq`, `ws` are one whole group and `xq` `n_tokens` whole
            // token rows of the matrix's format.
            let y = unsafe { out.0.add(g * GROUP_ROWS) };
            let unpacked = match w.packing() {
                Packing::Q4K => Some(group_vnni_unpacked::<Q4K_SCALES> as UnpackedGroup),
                Packing::Q4G => Some(group_vnni_unpacked::<Q4G_SCALES> as UnpackedGroup),
                Packing::Q5_0 => Some(group_vnni_unpacked::<Q5_0_SCALES> as UnpackedGroup),
                Packing::Q6_0 => Some(group_vnni_unpacked::<Q6_0_SCALES> as UnpackedGroup),
                _ => None,
            };
            if let Some(run) = unpacked {
                // SAFETY: as above; `kernels` is VNNI, so this CPU has AVX-512 F/BW/VL/VNNI.
                unsafe { run(n_tokens, wq, ws, cols, xq, stride, y, rows, valid) };
                continue;
            }
        }
        let mut t = 0;
        while t < n_tokens {
            let mt = Q8_MT.min(n_tokens - t);
            let xt = &xq[t * stride..(t + mt) * stride];
            let pf = prefetch_next && t == 0;
            // SAFETY: rows `g·16 .. g·16 + valid` of tokens `t..t + mt` lie inside the output
            // and belong to this call; `wq`, `ws` are one whole group and `xt` `mt` whole
            // token rows of the matrix's format.
            unsafe {
                let y = out.0.add(t * rows + g * GROUP_ROWS);
                match (w.packing(), kernels) {
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q8_0, Int8Isa::Vnni) => {
                        crate::quant_x86::tile_vnni_dyn::<false>(mt, wq, ws, blocks, xt, stride, y, rows, valid, pf)
                    }
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q8_0, Int8Isa::Avx2) => {
                        crate::quant_x86::tile_avx2(mt, wq, ws, blocks, xt, stride, y, rows, valid)
                    }
                    (Packing::Q8_0, _) => tile_scalar(mt, wq, ws, blocks, xt, stride, y, rows, valid),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q4K, Int8Isa::Vnni) => crate::q4k_x86::tile_vnni_dyn::<{ crate::q4k_x86::Q4K_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid, pf,
                    ),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q4K, Int8Isa::Avx2) => crate::q4k_x86::tile_avx2::<{ crate::q4k_x86::Q4K_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid,
                    ),
                    (Packing::Q4K, _) => crate::q4k::tile_scalar(mt, wq, ws, cols, xt, stride, y, rows, valid),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q4G, Int8Isa::Vnni) => crate::q4k_x86::tile_vnni_dyn::<{ crate::q4k_x86::Q4G_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid, pf,
                    ),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q4G, Int8Isa::Avx2) => crate::q4k_x86::tile_avx2::<{ crate::q4k_x86::Q4G_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid,
                    ),
                    (Packing::Q4G, _) => crate::q4g::tile_scalar(mt, wq, ws, cols, xt, stride, y, rows, valid),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q5_0, Int8Isa::Vnni) => crate::q4k_x86::tile_vnni_dyn::<{ crate::q4k_x86::Q5_0_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid, pf,
                    ),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q5_0, Int8Isa::Avx2) => crate::q4k_x86::tile_avx2::<{ crate::q4k_x86::Q5_0_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid,
                    ),
                    (Packing::Q5_0, _) => crate::q56::tile_scalar::<1>(mt, wq, ws, cols, xt, stride, y, rows, valid),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q6_0, Int8Isa::Vnni) => crate::q4k_x86::tile_vnni_dyn::<{ crate::q4k_x86::Q6_0_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid, pf,
                    ),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Q6_0, Int8Isa::Avx2) => crate::q4k_x86::tile_avx2::<{ crate::q4k_x86::Q6_0_SCALES }>(
                        mt, wq, ws, cols, xt, stride, y, rows, valid,
                    ),
                    (Packing::Q6_0, _) => crate::q56::tile_scalar::<2>(mt, wq, ws, cols, xt, stride, y, rows, valid),
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Mxfp4, Int8Isa::Vnni) => {
                        crate::quant_x86::tile_vnni_dyn::<true>(mt, wq, ws, blocks, xt, stride, y, rows, valid, pf)
                    }
                    #[cfg(target_arch = "x86_64")]
                    (Packing::Mxfp4, Int8Isa::Avx2) => {
                        crate::quant_x86::tile_avx2_mxfp4(mt, wq, ws, cols / QK8_0, xt, stride, y, rows, valid)
                    }
                    (Packing::Mxfp4, _) => crate::mxfp4::tile_scalar(mt, wq, ws, blocks, xt, stride, y, rows, valid),
                    (Packing::Q8_0A16 | Packing::Q4GA16 | Packing::F8A16, _) => unreachable!("handled above"),
                }
            }
            t += mt;
        }
    }
}

/// The scalar definition of a tile: tokens `0..mt` of `xq` × the `valid` rows of the group
/// whose planes are `wq`, `ws`, each output in the canonical order.
///
/// # Safety
/// `y` is valid for writing rows `0..valid` of `mt` tokens at row stride `y_stride`.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_scalar(
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
        let xt = &xq[t * stride..(t + 1) * stride];
        for lane in 0..valid {
            let mut acc = 0.0f32;
            for b in 0..nb {
                let block = &wq[b * QUANTS_BYTES..(b + 1) * QUANTS_BYTES];
                let mut isum = 0i32;
                for k in 0..QK8_0 {
                    let wq = (block[(k / 4) * 64 + lane * 4 + k % 4] ^ 0x80) as i8 as i32;
                    isum += wq * (xt[b * QK8_0 + k] as i8 as i32);
                }
                let at = b * SCALES_BYTES + 2 * lane;
                let dw = half::f16::from_le_bytes([ws[at], ws[at + 1]]);
                let dx = f32::from_le_bytes(xt[cols + 4 * b..cols + 4 * b + 4].try_into().expect("4 bytes"));
                acc = (isum as f32).mul_add(dx * dw.to_f32(), acc);
            }
            // SAFETY: the caller's contract.
            unsafe { *y.add(t * y_stride + lane) = acc };
        }
    }
}

/// A byte buffer that pool tasks write disjoint parts of.
#[derive(Clone, Copy)]
pub(crate) struct SharedBytes(pub(crate) *mut u8, pub(crate) usize);
// SAFETY: tasks write disjoint token rows through this pointer, and the caller holds the
// `&mut` it came from until all tasks have returned.
unsafe impl Send for SharedBytes {}
// SAFETY: as above.
unsafe impl Sync for SharedBytes {}

impl SharedBytes {
    /// # Safety
    /// Concurrent users must write disjoint parts of it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self) -> &mut [u8] {
        // SAFETY: the pointer and length came from one `&mut [u8]`; the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

/// The packed formats of quantized matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Packing {
    /// [`Q8Matrix`].
    Q8_0 = 0,
    /// [`crate::q4k::Q4KMatrix`].
    Q4K = 1,
    /// [`crate::q4g::Q4GMatrix`].
    Q4G = 2,
    /// [`Q8Matrix`]'s planes with BF16 activations ([`crate::w16`]).
    Q8_0A16 = 3,
    /// [`crate::q4g::Q4GMatrix`]'s planes with BF16 activations ([`crate::w16`]).
    Q4GA16 = 4,
    /// [`crate::w16::F8Matrix`]: FP8 E4M3 weights with BF16 activations.
    F8A16 = 5,
    /// [`crate::mxfp4::Mxfp4Matrix`]: FP4 values with E8M0 block scales, Q8_0 activations.
    Mxfp4 = 6,
    /// [`crate::q56::Q5Matrix`]: GGUF's Q5_0 numbers, Q8_0's activations.
    Q5_0 = 7,
    /// [`crate::q56::Q6Matrix`]: ik_llama.cpp's Q6_0 numbers, Q8_0's activations.
    Q6_0 = 8,
}

/// The activation quantizations the formats' products read; formats of the same kind share
/// one quantization of an input in [`matmul_many_quant`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationKind {
    /// Q8_0's: int8 per block of 32 columns with an f16-rounded scale (Q8_0, MXFP4, Q5_0,
    /// Q6_0).
    Q8_0 = 0,
    /// Q4_K's: int8 per super-block of 256 columns, with per-sub-block scales and sums (Q4_K
    /// and Q4_G).
    Q4K = 1,
    /// BF16 values and per-block sums ([`crate::w16`]): the `_a16` packings.
    Bf16 = 2,
}

/// Every [`ActivationKind`], in the order of their regions in the scratch.
const ACTIVATION_KINDS: [ActivationKind; 3] = [ActivationKind::Q8_0, ActivationKind::Q4K, ActivationKind::Bf16];

impl ActivationKind {
    /// Bytes of one token's activations of this kind for rows of `cols` columns.
    fn stride(self, cols: usize) -> usize {
        match self {
            ActivationKind::Q8_0 | ActivationKind::Q4K => activation_stride(cols),
            ActivationKind::Bf16 => crate::w16::activation_stride(cols),
        }
    }

    /// Bytes of this kind's region for `n_tokens` tokens: their rows, and for BF16 a lone
    /// token's integer forms ([`crate::w16::pack_tokens`]).
    fn region_len(self, n_tokens: usize, cols: usize) -> usize {
        let tail = if self == ActivationKind::Bf16 { crate::w16::integer_forms_len(cols) } else { 0 };
        n_tokens * self.stride(cols) + tail
    }
}

impl Packing {
    /// Bytes of the quants and scales planes of a packed `[rows, cols]` matrix; `None` when
    /// the columns do not suit the format (Q8_0: multiples of 32; Q4_K, Q4_G, Q5_0 and Q6_0:
    /// non-zero multiples of 64) or a size overflows.
    pub fn plane_lens(self, rows: usize, cols: usize) -> Option<(usize, usize)> {
        match self {
            Packing::Q8_0 => q8_0_plane_lens(rows, cols),
            Packing::Q4K => crate::q4k::q4_k_plane_lens(rows, cols),
            Packing::Q4G | Packing::Q4GA16 => crate::q4g::q4_g_plane_lens(rows, cols),
            Packing::Q5_0 => crate::q56::q5_0_plane_lens(rows, cols),
            Packing::Q6_0 => crate::q56::q6_0_plane_lens(rows, cols),
            Packing::Q8_0A16 => q8_0_plane_lens(rows, cols),
            Packing::F8A16 => crate::w16::f8_plane_lens(rows, cols),
            Packing::Mxfp4 => crate::mxfp4::mxfp4_plane_lens(rows, cols),
        }
    }

    /// The name used by flags, reports and checkpoints (`q8_0`, `q4_k`, `q4_g`).
    pub fn name(self) -> &'static str {
        match self {
            Packing::Q8_0 => "q8_0",
            Packing::Q4K => "q4_k",
            Packing::Q4G => "q4_g",
            Packing::Q8_0A16 => "q8_0_a16",
            Packing::Q4GA16 => "q4_g_a16",
            Packing::F8A16 => "f8_e4m3_a16",
            Packing::Mxfp4 => "mxfp4",
            Packing::Q5_0 => "q5_0",
            Packing::Q6_0 => "q6_0",
        }
    }

    /// The activation quantization the format's products read.
    pub fn activation_kind(self) -> ActivationKind {
        match self {
            Packing::Q8_0 | Packing::Mxfp4 | Packing::Q5_0 | Packing::Q6_0 => ActivationKind::Q8_0,
            Packing::Q4K | Packing::Q4G => ActivationKind::Q4K,
            Packing::Q8_0A16 | Packing::Q4GA16 | Packing::F8A16 => ActivationKind::Bf16,
        }
    }

    /// The 4-bit format of a `q4_k` matrix (the recipe's rule): Q4_K for whole 256-column
    /// super-blocks, Q5_0 otherwise.
    pub fn four_bit(cols: usize) -> Packing {
        if cols.is_multiple_of(crate::q4k::QK_K) { Packing::Q4K } else { Packing::Q5_0 }
    }

    /// The format of a stored `q4_k` matrix `[rows, cols]` whose scales plane is
    /// `scales_len` bytes (`kylin quantize`'s directories): Q6_0 when that is Q6_0's length
    /// (Q4_K's and Q5_0's are never the same for the same shape), else [`Packing::four_bit`].
    pub fn with_byte_scales(rows: usize, cols: usize, scales_len: usize) -> Packing {
        match Packing::Q6_0.plane_lens(rows, cols) {
            Some((_, s)) if s == scales_len => Packing::Q6_0,
            _ => Packing::four_bit(cols),
        }
    }

    /// Stored bits per weight of a `[rows, cols]` matrix, planes included.
    pub fn bits_per_weight(self, rows: usize, cols: usize) -> Option<f64> {
        let (q, s) = self.plane_lens(rows, cols)?;
        Some(8.0 * (q + s) as f64 / (rows * cols).max(1) as f64)
    }
}

/// A packed quantized matrix of any format.
#[derive(Debug, Clone, Copy)]
pub enum QuantMatrix<'a> {
    Q8_0(Q8Matrix<'a>),
    Q4K(crate::q4k::Q4KMatrix<'a>),
    Q4G(crate::q4g::Q4GMatrix<'a>),
    Q8_0A16(Q8Matrix<'a>),
    Q4GA16(crate::q4g::Q4GMatrix<'a>),
    F8A16(crate::w16::F8Matrix<'a>),
    Mxfp4(crate::mxfp4::Mxfp4Matrix<'a>),
    Q5_0(crate::q56::Q5Matrix<'a>),
    Q6_0(crate::q56::Q6Matrix<'a>),
}

impl<'a> QuantMatrix<'a> {
    /// A view of two planes in `packing`; `None` if their lengths are not those of a
    /// `[rows, cols]` matrix.
    pub fn new(packing: Packing, rows: usize, cols: usize, quants: &'a [u8], scales: &'a [u8]) -> Option<Self> {
        match packing {
            Packing::Q8_0 => Q8Matrix::new(rows, cols, quants, scales).map(QuantMatrix::Q8_0),
            Packing::Q4K => crate::q4k::Q4KMatrix::new(rows, cols, quants, scales).map(QuantMatrix::Q4K),
            Packing::Q4G => crate::q4g::Q4GMatrix::new(rows, cols, quants, scales).map(QuantMatrix::Q4G),
            Packing::Q8_0A16 => Q8Matrix::new(rows, cols, quants, scales).map(QuantMatrix::Q8_0A16),
            Packing::Q4GA16 => crate::q4g::Q4GMatrix::new(rows, cols, quants, scales).map(QuantMatrix::Q4GA16),
            Packing::F8A16 => crate::w16::F8Matrix::new(rows, cols, quants, scales).map(QuantMatrix::F8A16),
            Packing::Mxfp4 => crate::mxfp4::Mxfp4Matrix::new(rows, cols, quants, scales).map(QuantMatrix::Mxfp4),
            Packing::Q5_0 => crate::q56::Q5Matrix::new(rows, cols, quants, scales).map(QuantMatrix::Q5_0),
            Packing::Q6_0 => crate::q56::Q6Matrix::new(rows, cols, quants, scales).map(QuantMatrix::Q6_0),
        }
    }

    pub fn packing(&self) -> Packing {
        match self {
            QuantMatrix::Q8_0(_) => Packing::Q8_0,
            QuantMatrix::Q4K(_) => Packing::Q4K,
            QuantMatrix::Q4G(_) => Packing::Q4G,
            QuantMatrix::Q8_0A16(_) => Packing::Q8_0A16,
            QuantMatrix::Q4GA16(_) => Packing::Q4GA16,
            QuantMatrix::F8A16(_) => Packing::F8A16,
            QuantMatrix::Mxfp4(_) => Packing::Mxfp4,
            QuantMatrix::Q5_0(_) => Packing::Q5_0,
            QuantMatrix::Q6_0(_) => Packing::Q6_0,
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            QuantMatrix::Q8_0(m) => m.rows(),
            QuantMatrix::Q4K(m) => m.rows(),
            QuantMatrix::Q4G(m) => m.rows(),
            QuantMatrix::Q8_0A16(m) => m.rows(),
            QuantMatrix::Q4GA16(m) => m.rows(),
            QuantMatrix::F8A16(m) => m.rows(),
            QuantMatrix::Mxfp4(m) => m.rows(),
            QuantMatrix::Q5_0(m) => m.rows(),
            QuantMatrix::Q6_0(m) => m.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            QuantMatrix::Q8_0(m) => m.cols(),
            QuantMatrix::Q4K(m) => m.cols(),
            QuantMatrix::Q4G(m) => m.cols(),
            QuantMatrix::Q8_0A16(m) => m.cols(),
            QuantMatrix::Q4GA16(m) => m.cols(),
            QuantMatrix::F8A16(m) => m.cols(),
            QuantMatrix::Mxfp4(m) => m.cols(),
            QuantMatrix::Q5_0(m) => m.cols(),
            QuantMatrix::Q6_0(m) => m.cols(),
        }
    }

    /// The quants plane.
    pub fn quants(&self) -> &'a [u8] {
        match self {
            QuantMatrix::Q8_0(m) => m.quants(),
            QuantMatrix::Q4K(m) => m.quants(),
            QuantMatrix::Q4G(m) => m.quants(),
            QuantMatrix::Q8_0A16(m) => m.quants(),
            QuantMatrix::Q4GA16(m) => m.quants(),
            QuantMatrix::F8A16(m) => m.quants(),
            QuantMatrix::Mxfp4(m) => m.quants(),
            QuantMatrix::Q5_0(m) => m.quants(),
            QuantMatrix::Q6_0(m) => m.quants(),
        }
    }

    /// The scales plane.
    pub fn scales(&self) -> &'a [u8] {
        match self {
            QuantMatrix::Q8_0(m) => m.scales(),
            QuantMatrix::Q4K(m) => m.scales(),
            QuantMatrix::Q4G(m) => m.scales(),
            QuantMatrix::Q8_0A16(m) => m.scales(),
            QuantMatrix::Q4GA16(m) => m.scales(),
            QuantMatrix::F8A16(m) => m.scales(),
            QuantMatrix::Mxfp4(m) => m.scales(),
            QuantMatrix::Q5_0(m) => m.scales(),
            QuantMatrix::Q6_0(m) => m.scales(),
        }
    }

    /// Bytes the products read.
    pub fn byte_len(&self) -> usize {
        self.quants().len() + self.scales().len()
    }

    pub fn as_q8_0(&self) -> Option<Q8Matrix<'a>> {
        match self {
            QuantMatrix::Q8_0(m) => Some(*m),
            _ => None,
        }
    }

    pub fn as_q4k(&self) -> Option<crate::q4k::Q4KMatrix<'a>> {
        match self {
            QuantMatrix::Q4K(m) => Some(*m),
            _ => None,
        }
    }

    pub fn as_q4g(&self) -> Option<crate::q4g::Q4GMatrix<'a>> {
        match self {
            QuantMatrix::Q4G(m) => Some(*m),
            _ => None,
        }
    }

    /// Row `r` dequantized into `out` (`cols` elements).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self {
            QuantMatrix::Q8_0(m) => dequantize_row_q8_0(*m, r, out),
            QuantMatrix::Q4K(m) => crate::q4k::dequantize_row_q4_k(*m, r, out),
            QuantMatrix::Q4G(m) | QuantMatrix::Q4GA16(m) => crate::q4g::dequantize_row_q4_g(*m, r, out),
            QuantMatrix::Q8_0A16(m) => dequantize_row_q8_0(*m, r, out),
            QuantMatrix::F8A16(m) => crate::w16::dequantize_row_f8(*m, r, out),
            QuantMatrix::Mxfp4(m) => crate::mxfp4::dequantize_row_mxfp4(*m, r, out),
            QuantMatrix::Q5_0(m) => crate::q56::dequantize_row_q5_0(*m, r, out),
            QuantMatrix::Q6_0(m) => crate::q56::dequantize_row_q6_0(*m, r, out),
        }
    }

    /// `y (n, rows) = q8(x) (n, cols) · Wᵀ` alone ([`matmul_many_quant`]).
    pub fn matmul(&self, pool: &ThreadPool, x: &[f32], n_tokens: usize, scratch: &mut [u8], y: &mut [f32]) {
        matmul_many_quant(pool, x, n_tokens, scratch, &mut [(*self, y)])
    }
}

impl<'a> From<Q8Matrix<'a>> for QuantMatrix<'a> {
    fn from(m: Q8Matrix<'a>) -> Self {
        QuantMatrix::Q8_0(m)
    }
}

impl<'a> From<crate::q4k::Q4KMatrix<'a>> for QuantMatrix<'a> {
    fn from(m: crate::q4k::Q4KMatrix<'a>) -> Self {
        QuantMatrix::Q4K(m)
    }
}

impl<'a> From<crate::q56::Q5Matrix<'a>> for QuantMatrix<'a> {
    fn from(m: crate::q56::Q5Matrix<'a>) -> Self {
        QuantMatrix::Q5_0(m)
    }
}

impl<'a> From<crate::q56::Q6Matrix<'a>> for QuantMatrix<'a> {
    fn from(m: crate::q56::Q6Matrix<'a>) -> Self {
        QuantMatrix::Q6_0(m)
    }
}

impl<'a> From<crate::q4g::Q4GMatrix<'a>> for QuantMatrix<'a> {
    fn from(m: crate::q4g::Q4GMatrix<'a>) -> Self {
        QuantMatrix::Q4G(m)
    }
}

impl MatrixRows for QuantMatrix<'_> {
    fn rows(&self) -> usize {
        QuantMatrix::rows(self)
    }
}

/// Bytes of the activation scratch [`matmul_many_quant`] needs for matrices of any formats
/// sharing an input (each [`ActivationKind`]'s activations once: three regions, Q4_K and Q4_G
/// sharing one, the `_a16` packings another).
pub fn quant_scratch_len(n_tokens: usize, cols: usize) -> usize {
    ACTIVATION_KINDS.iter().map(|k| k.region_len(n_tokens, cols)).sum()
}

/// An owned, 64-byte aligned buffer holding the two planes of a packed matrix made at load
/// time (quants first, so the kernels read them in whole cache lines, then scales).
pub struct QuantBuffer {
    bytes: crate::aligned::AlignedBytes,
    packing: Packing,
    rows: usize,
    cols: usize,
    /// Bytes of the quants plane, at the start.
    quants_len: usize,
    /// Where the scales plane starts (the quants' end rounded up to a cache line); the scales
    /// run to the end of `bytes`.
    scales_at: usize,
}

impl std::fmt::Debug for QuantBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantBuffer")
            .field("packing", &self.packing)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl QuantBuffer {
    /// Zeroed planes for a `[rows, cols]` matrix in `packing`; `None` if the columns do not
    /// suit the format or a size overflows.
    pub fn zeroed(packing: Packing, rows: usize, cols: usize) -> Option<Self> {
        let (quants_len, s) = packing.plane_lens(rows, cols)?;
        let scales_at = quants_len.checked_next_multiple_of(64)?;
        let len = scales_at.checked_add(s)?;
        // Zero pages from the OS for any but a tiny matrix, on huge pages where the OS gives
        // them (`AlignedBytes`: a map of its own, or a part of a shared arena chunk): decode
        // streams every plane once per token.
        let bytes = crate::aligned::AlignedBytes::zeroed(len)?;
        Some(QuantBuffer { bytes, packing, rows, cols, quants_len, scales_at })
    }

    /// Reads the same planes as `packing` from now on, when its planes have the same lengths
    /// (Q8_0 as `q8_0_a16`, Q4G as `q4_g_a16`); returns whether it did.
    pub fn set_packing(&mut self, packing: Packing) -> bool {
        if packing.plane_lens(self.rows, self.cols) != self.packing.plane_lens(self.rows, self.cols) {
            return false;
        }
        self.packing = packing;
        true
    }

    /// The matrix the planes hold.
    pub fn matrix(&self) -> QuantMatrix<'_> {
        let bytes = &self.bytes[..];
        let (quants, scales) = (&bytes[..self.quants_len], &bytes[self.scales_at..]);
        let (rows, cols) = (self.rows, self.cols);
        match self.packing {
            Packing::Q8_0 => QuantMatrix::Q8_0(Q8Matrix::from_planes(rows, cols, quants, scales)),
            // The planes were sized by `plane_lens` in `zeroed`.
            Packing::Q4K => QuantMatrix::Q4K(crate::q4k::Q4KMatrix::from_planes(rows, cols, quants, scales)),
            Packing::Q4G => QuantMatrix::Q4G(crate::q4g::Q4GMatrix::from_planes(rows, cols, quants, scales)),
            Packing::Q8_0A16 => QuantMatrix::Q8_0A16(Q8Matrix::from_planes(rows, cols, quants, scales)),
            Packing::Q4GA16 => QuantMatrix::Q4GA16(crate::q4g::Q4GMatrix::from_planes(rows, cols, quants, scales)),
            Packing::F8A16 => QuantMatrix::F8A16(crate::w16::F8Matrix::from_planes(rows, cols, quants, scales)),
            Packing::Mxfp4 => QuantMatrix::Mxfp4(crate::mxfp4::Mxfp4Matrix::from_planes(rows, cols, quants, scales)),
            Packing::Q5_0 => QuantMatrix::Q5_0(crate::q56::Q5Matrix::from_planes(rows, cols, quants, scales)),
            Packing::Q6_0 => QuantMatrix::Q6_0(crate::q56::Q6Matrix::from_planes(rows, cols, quants, scales)),
        }
    }

    /// Writes groups `groups` of `w` into their parts of the planes (the two planes'
    /// slices for those groups, as [`QuantBuffer::planes_mut`] gives them split by
    /// [`QuantBuffer::group_bytes`]); `row` is scratch for `cols` elements.
    ///
    /// Q8_0, Q4_K, Q5_0 and Q6_0 only: Q4_G holds a published 4-bit checkpoint's own numbers, packed by
    /// [`crate::q4g::pack_q4_g`] into [`QuantBuffer::planes_mut`]; there is no Kylin
    /// quantization from floats to it, and asking for one panics (a caller bug).
    pub fn quantize_groups(
        packing: Packing,
        w: WeightMatrix<'_>,
        groups: std::ops::Range<usize>,
        quants: &mut [u8],
        scales: &mut [u8],
        row: &mut [f32],
    ) {
        match packing {
            Packing::Q8_0 => quantize_q8_0_groups(w, groups, quants, scales, row),
            Packing::Q4K => crate::q4k::quantize_q4_k_groups(w, groups, quants, scales, row),
            Packing::Q5_0 => crate::q56::quantize_groups::<1>(w, groups, quants, scales, row),
            Packing::Q6_0 => crate::q56::quantize_groups::<2>(w, groups, quants, scales, row),
            Packing::Q4G | Packing::Q8_0A16 | Packing::Q4GA16 | Packing::F8A16 | Packing::Mxfp4 => panic!(
                "{} is packed from a published checkpoint's own numbers, not quantized from floats",
                packing.name()
            ),
        }
    }

    /// Bytes of one group of 16 rows in each plane.
    pub fn group_bytes(&self) -> (usize, usize) {
        let groups = self.rows.div_ceil(GROUP_ROWS).max(1);
        (self.quants_len / groups, (self.bytes.len() - self.scales_at) / groups)
    }

    /// The two planes, to fill.
    pub fn planes_mut(&mut self) -> (&mut [u8], &mut [u8]) {
        let (quants_len, scales_at) = (self.quants_len, self.scales_at);
        let (quants, scales) = self.bytes.split_at_mut(scales_at);
        (&mut quants[..quants_len], scales)
    }
}
