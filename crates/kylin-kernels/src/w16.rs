//! Weight-only products: integer or FP8 weights with 16-bit (BF16) activations, the "A16" of
//! published `W4A16`, `W8A16`, GPTQ, AWQ and FP8 checkpoints.
//!
//! **Why.** The int8 products of [`crate::quant`] round the activations to 8 bits per block as
//! well as the weights; on a weight-only checkpoint that is a second rounding the producer never
//! made, and it costs a point or two of argmax agreement on small models. Here the activations
//! are rounded once to BF16 (8 significant bits, like `--precision bf16`) and every weight is
//! used exactly as stored: a 4-bit code, an int8 code or an FP8 E4M3 value, each of which BF16
//! holds exactly, times its scale in f32.
//!
//! **Formats** (the packings ending in `_a16`; the planes are the int8 formats' own):
//! - [`Packing::Q8_0A16`](crate::quant::Packing::Q8_0A16): Q8_0's planes ([`crate::quant`]),
//!   offset-binary int8 codes and an f16 scale per row and block of 32 columns;
//! - [`Packing::Q4GA16`](crate::quant::Packing::Q4GA16): Q4_G's planes ([`crate::q4g`]), 4-bit
//!   codes with an f16 scale and min per row and sub-block of 32;
//! - [`Packing::F8A16`](crate::quant::Packing::F8A16) ([`F8Matrix`]): FP8 E4M3 bytes in Q8_0's
//!   quants layout `[group][block][k4: 8][row: 16][4 consecutive columns]` and an f32 scale per
//!   row and block of 32 columns, `[group][block][row: 16]` (one per row for a per-channel
//!   checkpoint, repeated; a 128 × 128 block scale repeated over its rows and blocks): 544 + 32
//!   bytes per 16 × 32 weights, 9 bits per weight.
//!
//! **Activations** ([`pack_tokens`]): per token, the `cols` values rounded to BF16 (nearest
//! even), then per block of 32 the f32 sum of those BF16 values in column order (Q4_G's min
//! term needs it): [`activation_stride`] bytes. Under the AMX family, a lone token's row over
//! integer codes is followed by each block's [`IntegerBlock`], the same values as integers for
//! that family's one-token products.
//!
//! **Canonical order** of one output `y[t, r]` (DESIGN.md invariant 7). The lanes of a
//! `vdpbf16ps` accumulator are (row, half): half 0 sums columns `4k, 4k + 1` of every k4 step,
//! half 1 columns `4k + 2, 4k + 3`. For each block (sub-block) `j` in order:
//! `d_h = vdpbf16ps over k4 = 0..8 from zero` (the exact products of BF16 values, accumulated
//! in f32 as the instruction does), then `acc_h = fma(d_h, s_j, acc_h)` and, for Q4_G, on half 0
//! only, `acc_0 = fma(−Σx_j, m_j, acc_0)`; finally `y = acc_0 + acc_1`. A tile of `MT` tokens
//! runs that sequence for each token independently, so a token's outputs have the same bits in
//! a batch of one or of many, on any thread. These kernels exist where AVX-512 BF16 does
//! ([`available`]); the engine picks the `_a16` packings only there. The scalar tile
//! ([`tile_scalar`]) computes the same sums in f32 without the instruction's internal
//! rounding: it is the tests' reference, and the fallback that keeps a product defined on any
//! CPU.
//!
//! **Two families.** Where the kernel grants AMX-BF16 ([`crate::bf16_kernels`]), every `_a16`
//! product runs on [`crate::w16_amx`] instead: the same packings and packed activations, with
//! that module's own canonical order (one `tdpbf16ps` per sub-block, which its one-token FMA
//! kernel reproduces bit for bit), 2.4 to 2.9 times this module's prefill speed on an Emerald
//! Rapids Xeon. A process runs one family for all of them ([`family`]), so invariant 7 holds
//! within it; `KYLIN_KERNELS_ISA=avx512` keeps this module's tiles.

use crate::q4k::{PAIR_BYTES, SUB};
use crate::quant::{GROUP_ROWS, QK8_0, QUANTS_BYTES, SCALES_BYTES};

/// Tokens per tile of `weights`: as many as keep a token's sub-block accumulators in
/// registers (two per token over 8-bit weights, four over 4-bit ones) beside the weights.
fn tile_tokens(weights: Weights) -> usize {
    match weights {
        Weights::Int8 | Weights::Fp8 => 8,
        Weights::Int4 => 4,
    }
}

/// Bytes of one token's packed activations for rows of `cols` columns (a multiple of 32): the
/// BF16 values, then one f32 sum per block of 32.
pub(crate) fn activation_stride(cols: usize) -> usize {
    2 * cols + 4 * (cols / QK8_0)
}

/// Bytes after the packed rows for one token's integer forms ([`IntegerBlock`]), which a
/// one-token product under the AMX family reads right after its row.
pub(crate) fn integer_forms_len(cols: usize) -> usize {
    INTEGER_BLOCK_BYTES * (cols / QK8_0)
}

/// Bytes of one block's integer form in a packed token ([`IntegerBlock`]).
pub(crate) const INTEGER_BLOCK_BYTES: usize = 112;

/// Whether one-token products over integer codes read integer forms in this process: under
/// the AMX family ([`crate::w16_amx`]).
pub(crate) fn integer_forms_used() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::w16_amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where block `b`'s integer form starts, from the start of a lone packed token of `cols`
/// columns (right after its row).
pub(crate) fn integer_block_offset(cols: usize, b: usize) -> usize {
    activation_stride(cols) + INTEGER_BLOCK_BYTES * b
}

/// One block's 32 BF16 activations as integers, for the AMX family's one-token products
/// ([`crate::w16_amx`]): with `e` the smallest exponent among its nonzero values, each value
/// is `X_k · unit`, `unit = 2^e` (the last bit of an 8-bit significand at that exponent), and
/// `X_k` an integer, split in three bytes for `vpdpbusd` as `X_k = 2^16 · top_k + 2^8 · mid_k
/// + low_k` (`top_k` signed, `mid_k` and `low_k` unsigned).
///
/// A block whose nonzero values are normal and span at most 14 binary orders has an integer
/// form (`|X_k| < 2^22`, so `top_k` fits a byte); otherwise `unit` is zero. Whether a product
/// may use it depends on its weight codes too: `crate::w16_amx`'s `IntegerForm` decides, by
/// `Σ|X_k|` over the even and the odd columns.
///
/// Layout ([`INTEGER_BLOCK_BYTES`], little-endian): `unit` f32, `Σ top_k` i32, `Σ |X_k|` over
/// even `k` i32, the same over odd `k` i32, the 32 `top_k`, the 32 `mid_k`, the 32 `low_k`.
pub(crate) struct IntegerBlock;

impl IntegerBlock {
    pub(crate) const UNIT: usize = 0;
    pub(crate) const TOP_SUM: usize = 4;
    /// `[Σ|X_k| over even k, over odd k]`.
    pub(crate) const ABS_SUMS: usize = 8;
    pub(crate) const TOP: usize = 16;
    pub(crate) const MID: usize = 48;
    pub(crate) const LOW: usize = 80;

    /// Writes the integer form of one block's BF16 values into `out`
    /// ([`INTEGER_BLOCK_BYTES`]), or its `unit` as zero when it has none: the reference for
    /// `crate::w16_amx::write_integer_block`, which packing runs.
    #[cfg(test)]
    pub(crate) fn write(values: &[u16; QK8_0], out: &mut [u8]) {
        let exponent = |h: u16| ((h >> 7) & 0xFF) as i32;
        let magnitude = |h: u16, lo: i32| ((0x80 | (h & 0x7F)) as i32) << (exponent(h) - lo);
        let nonzero = || values.iter().copied().filter(|h| h & 0x7FFF != 0);
        let (lo, hi) = (nonzero().map(exponent).min().unwrap_or(127), nonzero().map(exponent).max().unwrap_or(127));
        // Subnormal (zero exponent) or non-finite (0xFF) values have no integer form, nor do
        // spans past 14 orders or largest values past 2^73 (so that no exact sum of 32
        // products comes near f32's range).
        if lo < 8 || hi > 200 || hi - lo > 14 {
            out[..INTEGER_BLOCK_BYTES].fill(0);
            return;
        }
        let (mut top_sum, mut abs_sums) = (0i32, [0i32; 2]);
        for (k, &h) in values.iter().enumerate() {
            let m = if h & 0x7FFF == 0 { 0 } else { magnitude(h, lo) };
            let x = if h & 0x8000 != 0 { -m } else { m };
            // |x| < 2^22, so `x >> 16` fits an i8.
            out[Self::TOP + k] = (x >> 16) as i8 as u8;
            out[Self::MID + k] = (x >> 8) as u8;
            out[Self::LOW + k] = x as u8;
            top_sum += x >> 16;
            abs_sums[k % 2] += m;
        }
        // `2^(lo − 127 − 7)`: the exponent field `lo − 7`, at least 1.
        out[Self::UNIT..Self::UNIT + 4].copy_from_slice(&f32::from_bits(((lo - 7) as u32) << 23).to_le_bytes());
        out[Self::TOP_SUM..Self::TOP_SUM + 4].copy_from_slice(&top_sum.to_le_bytes());
        out[Self::ABS_SUMS..Self::ABS_SUMS + 4].copy_from_slice(&abs_sums[0].to_le_bytes());
        out[Self::ABS_SUMS + 4..Self::ABS_SUMS + 8].copy_from_slice(&abs_sums[1].to_le_bytes());
    }
}

/// Whether this process runs the AVX-512 BF16 tiles (else [`tile_scalar`]).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            crate::isa() == crate::Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// The kernel family that runs the `_a16` products in this process, for reports: `amx-bf16`
/// ([`crate::w16_amx`]) or `avx512-bf16` (this module's tiles).
pub fn family() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if crate::w16_amx::available() {
        return "amx-bf16";
    }
    "avx512-bf16"
}

/// Rounds tokens `t0..t1` of `x` (`(n, cols)`, `cols` a multiple of 32) into their rows of
/// `out` ([`activation_stride`] bytes each): BF16 values, then per-block sums (module docs).
/// With `integers` (one token, for products over integer codes under the AMX family), each
/// block's [`IntegerBlock`] follows the row ([`integer_forms_len`] more bytes).
pub(crate) fn pack_tokens(x: &[f32], cols: usize, t0: usize, t1: usize, out: &mut [u8], integers: bool) {
    let stride = activation_stride(cols);
    assert!(!integers || ((t0, t1) == (0, 1) && integer_forms_used()), "integer forms are for one token, under AMX");
    let mut chunk = [0u16; QK8_0];
    #[cfg(target_arch = "x86_64")]
    let flush_tiny = crate::w16_amx::available();
    #[cfg(not(target_arch = "x86_64"))]
    let flush_tiny = false;
    for t in t0..t1 {
        let xt = &x[t * cols..(t + 1) * cols];
        let end = if integers { stride + integer_forms_len(cols) } else { (t + 1) * stride };
        let dst = &mut out[t * stride..end];
        let (values, sums) = dst.split_at_mut(2 * cols);
        for (b, block) in xt.chunks_exact(QK8_0).enumerate() {
            #[cfg(target_arch = "x86_64")]
            if available() {
                // SAFETY: AVX-512 F/BW were detected; `block` holds 32 readable f32.
                unsafe { crate::amx::round_chunk(block.as_ptr(), QK8_0, &mut chunk) };
            } else {
                round_scalar(block, &mut chunk);
            }
            #[cfg(not(target_arch = "x86_64"))]
            round_scalar(block, &mut chunk);
            let mut sum = 0.0f32;
            for (k, h) in chunk.iter_mut().enumerate() {
                if flush_tiny && (*h & 0x7FFF) < TINY_BF16 {
                    *h = 0;
                }
                values[2 * (b * QK8_0 + k)..2 * (b * QK8_0 + k) + 2].copy_from_slice(&h.to_le_bytes());
                sum += bf16_value(*h);
            }
            sums[4 * b..4 * b + 4].copy_from_slice(&sum.to_le_bytes());
            #[cfg(target_arch = "x86_64")]
            if integers {
                let at = integer_block_offset(cols, b) - 2 * cols;
                // SAFETY: the AMX family's CPUs have AVX-512 F/BW (`integer_forms_used`).
                unsafe { crate::w16_amx::write_integer_block(&chunk, &mut sums[at..at + INTEGER_BLOCK_BYTES]) };
            }
        }
    }
}

/// The BF16 bits of 2^−100: under the AMX family ([`crate::w16_amx`]) activations of smaller
/// magnitude are packed as zero, so that no partial sum of its two kernels is ever denormal
/// (see there). Their products are negligible beside any sum over activations of ordinary size.
const TINY_BF16: u16 = 0x0D80;

fn round_scalar(block: &[f32], out: &mut [u16; QK8_0]) {
    for (o, &v) in out.iter_mut().zip(block) {
        *o = crate::reference::round_bf16(v);
    }
}

#[inline]
fn bf16_value(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// FP8 E4M3 (`float8_e4m3fn`) to f32, exactly; the two NaN codes (`0x7F`, `0xFF`) give NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let (exp, man) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    let magnitude = if exp == 0xF && b & 7 == 7 {
        f32::NAN
    } else if exp == 0 {
        man * (2f32).powi(-9)
    } else {
        (8.0 + man) * (2f32).powi(exp - 10)
    };
    if b & 0x80 != 0 { -magnitude } else { magnitude }
}

/// FP8's group layout: Q8_0's quants plane of E4M3 bytes and an f32 scale per row and block
/// of 32 columns (module docs).
#[derive(Debug, Clone, Copy)]
pub struct F8Planes;

impl crate::packed::PlaneLayout for F8Planes {
    fn group_lens(cols: usize) -> Option<(usize, usize)> {
        let (q, s) = <crate::quant::Q8Planes as crate::packed::PlaneLayout>::group_lens(cols)?;
        Some((q, s.checked_mul(2)?))
    }
}

/// An FP8 E4M3 weight matrix `[rows, cols]` in Kylin's packed layout (module docs): `cols` is
/// a multiple of 32.
pub type F8Matrix<'a> = crate::packed::PackedMatrix<'a, F8Planes>;

/// Bytes of the quants and scales planes of a packed `[rows, cols]` FP8 matrix (rows rounded up
/// to a group of 16); `None` if `cols` is not a multiple of 32 or a size overflows.
pub fn f8_plane_lens(rows: usize, cols: usize) -> Option<(usize, usize)> {
    crate::packed::plane_lens::<F8Planes>(rows, cols)
}

/// Packs a row-major `[rows, cols]` matrix of FP8 E4M3 codes with one f32 scale per row and
/// block of 32 columns (`scales` row-major `[rows, cols / 32]`) into the planes, so that weight
/// `(r, c)` is `e4m3(codes[r, c]) · scales[r, c / 32]`. The lengths are [`f8_plane_lens`]'s;
/// the padding rows of the last group are zero. Panics on a length disagreement (a caller bug).
///
/// **Subnormals are marked by the scale's sign.** A row's 32 codes of a block holding a
/// subnormal code (zero exponent, non-zero mantissa) are stored under a scale with its sign bit
/// set: when the checkpoint's is clear, the scale is negated and the codes' sign bits flipped.
/// Every weight, `e4m3(−c) · (−s)`, and every product and sum of the kernels is then the same
/// number (negation is exact, and round-to-nearest-even rounds `−a` to `−round(a)`), so every
/// reader computes the same bits. A block's 16 scales without a sign bit set guarantee that
/// its codes hold no subnormal, and [`crate::w16_amx`]'s one-token FMAs take it without looking
/// for one (the same skip in this module's tiles measured no faster); a checkpoint's own
/// negative scale only sends its block to the decode that looks.
pub fn pack_f8(rows: usize, cols: usize, codes: &[u8], scales: &[f32], quants_out: &mut [u8], scales_out: &mut [u8]) {
    let nb = cols / QK8_0;
    assert_eq!(f8_plane_lens(rows, cols), Some((quants_out.len(), scales_out.len())), "f8 plane lengths");
    assert_eq!(codes.len(), rows * cols);
    assert_eq!(scales.len(), rows * nb);
    let (group_q, group_s) = (nb * QUANTS_BYTES, nb * 2 * SCALES_BYTES);
    // Row by row, every byte of the planes is written once, four codes at a time, the padding
    // lanes' with zeros, so the planes need not come zeroed.
    for r in 0..rows.next_multiple_of(GROUP_ROWS) {
        let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
        for b in 0..nb {
            let block = &mut quants_out[g * group_q + b * QUANTS_BYTES..][..QUANTS_BYTES];
            let at = g * group_s + b * 2 * SCALES_BYTES + 4 * lane;
            if r < rows {
                let stored = &codes[r * cols + b * QK8_0..][..QK8_0];
                let scale = scales[r * nb + b];
                let mark = scale.is_sign_positive() && stored.iter().any(|&c| is_e4m3_subnormal(c));
                let flip = if mark { 0x80 } else { 0 };
                for (k4, four) in stored.chunks_exact(4).enumerate() {
                    for (packed, &code) in block[k4 * 64 + lane * 4..][..4].iter_mut().zip(four) {
                        *packed = code ^ flip;
                    }
                }
                let scale = if mark { -scale } else { scale };
                scales_out[at..at + 4].copy_from_slice(&scale.to_le_bytes());
            } else {
                for k4 in 0..QK8_0 / 4 {
                    block[k4 * 64 + lane * 4..][..4].fill(0);
                }
                scales_out[at..at + 4].fill(0);
            }
        }
    }
}

/// Whether FP8 E4M3 code `c` is subnormal: a zero exponent and a non-zero mantissa.
fn is_e4m3_subnormal(c: u8) -> bool {
    c & 0x78 == 0 && c & 0x07 != 0
}

/// Row `r` of an FP8 matrix in f32.
pub fn dequantize_row_f8(m: F8Matrix<'_>, r: usize, out: &mut [f32]) {
    assert!(r < m.rows && out.len() == m.cols);
    let (gq, gs) = m.group(r / GROUP_ROWS);
    let lane = r % GROUP_ROWS;
    for (b, o) in out.chunks_exact_mut(QK8_0).enumerate() {
        let s = f8_scale(gs, b, lane);
        for (k, o) in o.iter_mut().enumerate() {
            *o = e4m3_to_f32(gq[b * QUANTS_BYTES + (k / 4) * 64 + lane * 4 + k % 4]) * s;
        }
    }
}

fn f8_scale(gs: &[u8], b: usize, lane: usize) -> f32 {
    le_f32(gs, b * 2 * SCALES_BYTES + 4 * lane)
}

/// The little-endian f32 at byte `at` of `bytes`.
#[inline]
fn le_f32(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Which weights a tile reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Weights {
    /// Q8_0's planes.
    Int8,
    /// Q4_G's planes.
    Int4,
    /// [`F8Matrix`]'s planes.
    Fp8,
}

impl Weights {
    /// Bytes of one group's quants and scales planes for `cols` columns (the formats'
    /// [`crate::packed::PlaneLayout`]s); `None` if `cols` does not fit the format.
    pub(crate) fn group_lens(self, cols: usize) -> Option<(usize, usize)> {
        use crate::packed::PlaneLayout;
        match self {
            Weights::Int8 => crate::quant::Q8Planes::group_lens(cols),
            Weights::Int4 => crate::q4g::Q4GPlanes::group_lens(cols),
            Weights::Fp8 => F8Planes::group_lens(cols),
        }
    }
}

/// The scalar tile: tokens `0..mt` of `xb` (packed by [`pack_tokens`], `stride` bytes each) ×
/// the `valid` rows of one group whose planes are `wq`, `ws`, in the canonical structure with
/// f32 sums (module docs).
///
/// # Safety
/// `y` is valid for writing rows `0..valid` of `mt` tokens at row stride `y_stride`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_scalar(
    weights: Weights,
    mt: usize,
    wq: &[u8],
    ws: &[u8],
    cols: usize,
    xb: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
) {
    let nb = cols / QK8_0;
    for t in 0..mt {
        let xt = &xb[t * stride..(t + 1) * stride];
        let x = |c: usize| bf16_value(u16::from_le_bytes([xt[2 * c], xt[2 * c + 1]]));
        let sum = |b: usize| le_f32(xt, 2 * cols + 4 * b);
        for lane in 0..valid {
            let mut acc = [0.0f32; 2];
            for b in 0..nb {
                let (scale, min) = match weights {
                    Weights::Int8 => {
                        let at = b * SCALES_BYTES + 2 * lane;
                        (half::f16::from_le_bytes([ws[at], ws[at + 1]]).to_f32(), 0.0)
                    }
                    Weights::Fp8 => (f8_scale(ws, b, lane), 0.0),
                    Weights::Int4 => crate::q4g::scale_min(ws, lane, b),
                };
                let mut d = [0.0f32; 2];
                for k in 0..QK8_0 {
                    let at = || b * QUANTS_BYTES + (k / 4) * 64 + lane * 4 + k % 4;
                    let w = match weights {
                        Weights::Int8 => ((wq[at()] ^ 0x80) as i8) as f32,
                        Weights::Fp8 => e4m3_to_f32(wq[at()]),
                        Weights::Int4 => crate::q4k::quant_at(wq, lane, b, k) as f32,
                    };
                    let h = (k % 4) / 2;
                    d[h] = w.mul_add(x(b * QK8_0 + k), d[h]);
                }
                acc[0] = d[0].mul_add(scale, acc[0]);
                acc[1] = d[1].mul_add(scale, acc[1]);
                if weights == Weights::Int4 {
                    acc[0] = (-sum(b)).mul_add(min, acc[0]);
                }
            }
            // SAFETY: the caller's contract.
            unsafe { *y.add(t * y_stride + lane) = acc[0] + acc[1] };
        }
    }
}

/// Runs tokens `0..n_tokens` of one group through `weights`' tile: the AMX family where it
/// runs ([`family`]), else AVX-512 BF16 where [`available`], else [`tile_scalar`]. With
/// `prefetch_next`, the first token tile also asks for the next group's weights
/// ([`crate::prefetches_weights`]; a hint, no result changes).
///
/// # Safety
/// `y` is valid for writing rows `0..valid` of `n_tokens` tokens at row stride `y_stride`;
/// `wq`, `ws` are one whole group of the format's planes for `cols` columns; `xb` holds
/// `n_tokens` packed rows of `stride` bytes, and with `integer_forms` (one token) its integer
/// forms after the row ([`pack_tokens`]).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn group(
    weights: Weights,
    n_tokens: usize,
    wq: &[u8],
    ws: &[u8],
    cols: usize,
    xb: &[u8],
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    valid: usize,
    prefetch_next: bool,
    integer_forms: bool,
) {
    debug_assert!(xb.len() >= n_tokens * stride && stride == activation_stride(cols));
    #[cfg(target_arch = "x86_64")]
    if crate::w16_amx::available() {
        // SAFETY: the caller's contract; AMX was granted.
        unsafe {
            crate::w16_amx::group(
                weights,
                n_tokens,
                wq,
                ws,
                cols,
                xb,
                stride,
                y,
                y_stride,
                valid,
                prefetch_next,
                integer_forms,
            )
        };
        return;
    }
    let mut t = 0;
    while t < n_tokens {
        let mt = tile_tokens(weights).min(n_tokens - t);
        let xt = &xb[t * stride..(t + mt) * stride];
        // SAFETY: the caller's contract, for tokens `t..t + mt`.
        unsafe {
            let yt = y.add(t * y_stride);
            #[cfg(target_arch = "x86_64")]
            if available() {
                x86::tile_dyn(weights, mt, wq, ws, cols, xt, stride, yt, y_stride, valid, prefetch_next && t == 0);
                t += mt;
                continue;
            }
            tile_scalar(weights, mt, wq, ws, cols, xt, stride, yt, y_stride, valid);
        }
        t += mt;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// A `vpermw` table of 32 BF16 words, entry `i` being `(i & mask) · step` (exact in BF16),
    /// made once at compile time.
    const fn word_table(mask: usize, step: f32) -> [u16; 32] {
        let mut t = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            t[i] = (((i & mask) as f32 * step).to_bits() >> 16) as u16;
            i += 1;
        }
        t
    }

    /// BF16 `0.0 ..= 15.0`, twice.
    static NIBBLES: [u16; 32] = word_table(15, 1.0);
    /// BF16 `m · 0.5`, `m = 0..8`, four times.
    static SUBNORMALS: [u16; 32] = word_table(7, 0.5);

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    fn load_table(t: &[u16; 32]) -> __m512i {
        // SAFETY: `t` is 64 readable bytes.
        unsafe { _mm512_loadu_si512(t.as_ptr() as *const __m512i) }
    }

    /// Sixteen words of a 4-bit code each (the low four bits of every word index the table's
    /// first sixteen entries, which the second sixteen repeat) as BF16 `0.0 ..= 15.0`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn nibble_table() -> __m512i {
        load_table(&NIBBLES)
    }

    /// Words of 4-bit codes (the low four bits of each; see [`nibble_table`]) as BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    fn nibbles(table: __m512i, v: __m512i) -> __m512bh {
        // SAFETY: a reinterpretation of the same 32 words.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_permutexvar_epi16(v, table)) }
    }

    /// BF16 of FP8 E4M3 subnormals times 2^8, `m · 2^-9 · 2^8`, `m = 0..8` (indexed by the
    /// low bits of the code; `m = 0` is zero).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn subnormal_table() -> __m512i {
        load_table(&SUBNORMALS)
    }

    /// How a chunk of 64 FP8 E4M3 codes must be decoded: the mask of its codes with a zero
    /// exponent (zeros and subnormals), and whether any of them is subnormal. The two-instruction
    /// decodes take a chunk without subnormals, clearing its zero codes when the mask is not
    /// empty; a chunk with a subnormal takes a table ([`fp8_words`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn fp8_zero_exponents(codes: __m512i) -> (__mmask64, bool) {
        let zero_exponent = _mm512_testn_epi8_mask(codes, _mm512_set1_epi8(0x78));
        (zero_exponent, _mm512_mask_test_epi8_mask(zero_exponent, codes, _mm512_set1_epi8(0x07)) != 0)
    }

    /// Whether the FP8 block whose 16 per-row f32 scales are at `scales` may hold a subnormal
    /// code: one of the scales is negative, the mark [`super::pack_f8`] puts on each row of a
    /// block holding one.
    ///
    /// # Safety
    /// `scales` is valid for reading 64 bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn fp8_may_hold_subnormals(scales: *const u8) -> bool {
        // SAFETY: the caller's contract.
        let scales = unsafe { _mm512_loadu_si512(scales as *const __m512i) };
        _mm512_test_epi32_mask(scales, _mm512_set1_epi32(i32::MIN)) != 0
    }

    /// 32 FP8 E4M3 codes (zero-extended words) as BF16 values times 2^8 (exactly: the products
    /// and sums of `vdpbf16ps` scale by the same power of two, which the block's scale takes
    /// back): a normal code's exponent and mantissa shifted into place with the exponent
    /// field's top bit set (`+128`, where E4M3's bias is 7 and BF16's 127), a code with a zero
    /// exponent (zero or subnormal) from the table, the sign moved to bit 15. NaN codes are
    /// refused when packing.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn fp8_words(w: __m512i, sub: __m512i) -> __m512bh {
        let magnitude = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
        let normal = _mm512_or_si512(_mm512_slli_epi16::<4>(magnitude), _mm512_set1_epi16(0x4000));
        let zero_exponent = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
        let value = _mm512_mask_permutexvar_epi16(normal, zero_exponent, w, sub);
        let sign = _mm512_slli_epi16::<8>(w);
        // (sign & 0x8000) | value: bit select with the constant as the selector.
        let bf = _mm512_ternarylogic_epi32::<0xAC>(_mm512_set1_epi16(0x7FFF), sign, value);
        // SAFETY: a reinterpretation of the same 32 words.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(bf) }
    }

    /// 32 FP8 E4M3 codes with a non-zero exponent (sign-extended words) as [`fp8_words`] makes
    /// them, in two instructions: shifted by four, the sign (extended) lands in bit 15 and the
    /// exponent and mantissa in bits 4–10; the rest is cleared and the exponent's `+128` set.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    fn fp8_normal_words(w: __m512i) -> __m512bh {
        // (x & 0x87F0) | 0x4000.
        let bf = _mm512_ternarylogic_epi32::<0xEA>(
            _mm512_slli_epi16::<4>(w),
            _mm512_set1_epi16(0x87F0u16 as i16),
            _mm512_set1_epi16(0x4000),
        );
        // SAFETY: a reinterpretation of the same 32 words.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(bf) }
    }

    /// 64 FP8 E4M3 codes at `p` (rows 0–7 and 8–15 of one k4 step) as two vectors of BF16
    /// values times 2^8: [`fp8_normal_words`] when no code is subnormal (all but a few chunks
    /// of real weights), with the zero codes' words cleared when there are some (82% of the
    /// chunks of an FP8_BLOCK copy of Qwen2.5-Coder-0.5B-Instruct); else [`fp8_words`]. All
    /// give the same bits, but for the sign of a zero weight, which no sum sees: a sum from
    /// `+0` never becomes `−0` by adding a zero product.
    ///
    /// # Safety
    /// `p` is valid for reading 64 bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    unsafe fn fp8_chunk(p: *const u8, sub: __m512i) -> [__m512bh; 2] {
        // SAFETY: the caller's contract.
        unsafe {
            let bytes = _mm512_loadu_si512(p as *const __m512i);
            let lo = _mm512_castsi512_si256(bytes);
            let hi = _mm512_extracti64x4_epi64::<1>(bytes);
            let (zero_exponent, subnormal) = fp8_zero_exponents(bytes);
            if zero_exponent == 0 {
                [fp8_normal_words(_mm512_cvtepi8_epi16(lo)), fp8_normal_words(_mm512_cvtepi8_epi16(hi))]
            } else if !subnormal {
                // Zero codes but no subnormal: the normal words, the zeros' cleared.
                [_mm512_cvtepi8_epi16(lo), _mm512_cvtepi8_epi16(hi)].map(|w| {
                    let nonzero = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x78));
                    let bf = std::mem::transmute::<__m512bh, __m512i>(fp8_normal_words(w));
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_mov_epi16(nonzero, bf))
                })
            } else {
                [fp8_words(_mm512_cvtepu8_epi16(lo), sub), fp8_words(_mm512_cvtepu8_epi16(hi), sub)]
            }
        }
    }

    /// 32 offset-binary int8 codes (32 bytes at `p`) as BF16 of the signed values, exactly.
    ///
    /// # Safety
    /// `p` is valid for reading 32 bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    unsafe fn int8_words(p: *const u8) -> __m512bh {
        // SAFETY: the caller's contract.
        unsafe {
            let signed = _mm256_xor_si256(_mm256_loadu_si256(p as *const __m256i), _mm256_set1_epi8(-128));
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(signed)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(signed)));
            _mm512_cvtne2ps_pbh(hi, lo)
        }
    }

    /// Sixteen per-row f32 scales `s` as the two (row, half) patterns `[s0, s0, s1, s1, …]`
    /// of rows 0–7 and 8–15.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    fn pairs(s: __m512) -> [__m512; 2] {
        let lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        let hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
        [_mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(hi, s)]
    }

    /// As [`pairs`] with the odd lanes zero: a term added once per row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    fn even_pairs(s: __m512) -> [__m512; 2] {
        let [lo, hi] = pairs(s);
        [_mm512_maskz_mov_ps(0x5555, lo), _mm512_maskz_mov_ps(0x5555, hi)]
    }

    /// `acc_0 + acc_1` over the (row, half) lanes of rows 0–7 (`a`) and 8–15 (`b`): the
    /// sixteen rows' outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    fn rows16(a: __m512, b: __m512) -> __m512 {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b))
    }

    /// Four BF16 activations at `p` broadcast as `[x0 x1, x2 x3]` pairs to all lanes.
    ///
    /// # Safety
    /// `p` is valid for reading 8 bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    unsafe fn quad(p: *const u8) -> __m512bh {
        // SAFETY: the caller's contract.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi64((p as *const i64).read_unaligned())) }
    }

    /// How far ahead of the block it reads a one-token tile asks for the quants plane (and the
    /// scales as far ahead in proportion), into L2, one block's lines per block. Each weight is
    /// widened to BF16 before its product, so a one-token tile does more work per byte than
    /// memory needs and, with the hardware prefetcher alone, its loads waited on memory. One
    /// decode token through Qwen3-0.6B's 28 layers (`model_quant_decode`, 2 Zen 5 cores,
    /// medians of four runs) read 41.4 to 41.5 GB/s without, 46.6 to 47.7 at 8 KB ahead, in
    /// FP8 (`f8_a16`); 40.8 to 41.5 against 45.1 to 47.0 in `q4_g_a16`; 37.9 to 43.8 against
    /// 46.3 to 51.0 in `q8_0_a16`. 4 KB did a little less, 16 and 32 KB less again.
    const ONE_TOKEN_PREFETCH_BYTES: usize = 8192;

    /// One tile of `MT_` tokens × 16 rows over an 8-bit format (module docs' canonical order).
    /// With `prefetch_next`, each block also asks for the same block of the next group, so that
    /// a many-token tile, slower than memory alone, overlaps the next group's reads with its
    /// arithmetic. A one-token tile asks for its planes [`ONE_TOKEN_PREFETCH_BYTES`] ahead.
    ///
    /// # Safety
    /// As [`super::group`], for exactly `MT_` tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile8<const MT_: usize, const FP8: bool>(
        wq: *const u8,
        ws: *const u8,
        cols: usize,
        xb: *const u8,
        stride: usize,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
        prefetch_next: bool,
    ) {
        let sub = subnormal_table();
        let nb = cols / QK8_0;
        // Bytes of one block's scales, and of the group's two planes.
        let block_scales = if FP8 { 2 * SCALES_BYTES } else { SCALES_BYTES };
        let (group_q, group_s) = (nb * QUANTS_BYTES, nb * block_scales);
        let mut acc = [[_mm512_setzero_ps(); 2]; MT_];
        // One token: the planes as far ahead as ONE_TOKEN_PREFETCH_BYTES is in the quants.
        let scales_ahead = ONE_TOKEN_PREFETCH_BYTES * group_s / group_q.max(1);
        // SAFETY (whole body): reads stay inside the group's planes (`cols / 32` blocks) and
        // the `MT_` packed rows; writes at the caller's `valid` rows.
        unsafe {
            for b in 0..nb {
                let mut d = [[_mm512_setzero_ps(); 2]; MT_];
                let block = wq.add(b * QUANTS_BYTES);
                if prefetch_next {
                    crate::prefetch_lines(block.wrapping_add(group_q), QUANTS_BYTES / 64);
                    crate::prefetch_lines(ws.wrapping_add(group_s + b * block_scales), 1);
                }
                if MT_ == 1 && !prefetch_next {
                    crate::prefetch_lines(block.wrapping_add(ONE_TOKEN_PREFETCH_BYTES), QUANTS_BYTES / 64);
                    crate::prefetch_lines(ws.wrapping_add(b * block_scales + scales_ahead), 1);
                }
                for k4 in 0..8 {
                    let chunk = block.add(k4 * 64);
                    let w: [__m512bh; 2] =
                        if FP8 { fp8_chunk(chunk, sub) } else { [int8_words(chunk), int8_words(chunk.add(32))] };
                    for (t, d_t) in d.iter_mut().enumerate() {
                        let x = quad(xb.add(t * stride + 2 * (b * QK8_0 + 4 * k4)));
                        d_t[0] = _mm512_dpbf16_ps(d_t[0], w[0], x);
                        d_t[1] = _mm512_dpbf16_ps(d_t[1], w[1], x);
                    }
                }
                let s = if FP8 {
                    // The decoded values are 2^8 times the codes' (`fp8_words`).
                    _mm512_mul_ps(
                        _mm512_loadu_ps(ws.add(b * 2 * SCALES_BYTES) as *const f32),
                        _mm512_set1_ps(1.0 / 256.0),
                    )
                } else {
                    _mm512_cvtph_ps(_mm256_loadu_si256(ws.add(b * SCALES_BYTES) as *const __m256i))
                };
                let s = pairs(s);
                for (acc_t, d_t) in acc.iter_mut().zip(&d) {
                    acc_t[0] = _mm512_fmadd_ps(d_t[0], s[0], acc_t[0]);
                    acc_t[1] = _mm512_fmadd_ps(d_t[1], s[1], acc_t[1]);
                }
            }
            let mask: __mmask16 = ((1u32 << valid) - 1) as __mmask16;
            for (t, acc_t) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(y.add(t * y_stride), mask, rows16(acc_t[0], acc_t[1]));
            }
        }
    }

    /// One tile of `MT_` tokens × 16 rows over Q4_G's planes (module docs' canonical order),
    /// prefetching as [`tile8`] does (a one-token tile too).
    ///
    /// # Safety
    /// As [`super::group`], for exactly `MT_` tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile4<const MT_: usize>(
        wq: *const u8,
        ws: *const u8,
        cols: usize,
        xb: *const u8,
        stride: usize,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
        prefetch_next: bool,
    ) {
        let table = nibble_table();
        // Bytes of one pair of sub-blocks' scales and mins, and of the group's two planes.
        let pair_scales = 2 * crate::q4g::SUB_SCALE_BYTES;
        let (group_q, group_s) = (cols / (2 * SUB) * PAIR_BYTES, cols / (2 * SUB) * pair_scales);
        let mut acc = [[_mm512_setzero_ps(); 2]; MT_];
        // One token: the planes as far ahead as ONE_TOKEN_PREFETCH_BYTES is in the quants.
        let scales_ahead = ONE_TOKEN_PREFETCH_BYTES * group_s / group_q.max(1);
        // SAFETY (whole body): as `tile8`, over Q4_G's planes (`cols / 64` pairs of sub-blocks).
        unsafe {
            for p in 0..cols / (2 * SUB) {
                // `d[t][s][h]`: sub-block `2p + s`, lanes of rows 0–7 (`h = 0`) or 8–15.
                let mut d = [[[_mm512_setzero_ps(); 2]; 2]; MT_];
                let pair = wq.add(p * PAIR_BYTES);
                if prefetch_next {
                    crate::prefetch_lines(pair.wrapping_add(group_q), PAIR_BYTES / 64);
                    crate::prefetch_lines(ws.wrapping_add(group_s + p * pair_scales), pair_scales / 64);
                }
                if MT_ == 1 && !prefetch_next {
                    crate::prefetch_lines(pair.wrapping_add(ONE_TOKEN_PREFETCH_BYTES), PAIR_BYTES / 64);
                    crate::prefetch_lines(ws.wrapping_add(p * pair_scales + scales_ahead), pair_scales / 64);
                }
                for k4 in 0..8 {
                    let chunk = pair.add(k4 * 64);
                    let b0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(chunk as *const __m256i));
                    let b1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(chunk.add(32) as *const __m256i));
                    let w = [
                        [nibbles(table, b0), nibbles(table, b1)],
                        [nibbles(table, _mm512_srli_epi16::<4>(b0)), nibbles(table, _mm512_srli_epi16::<4>(b1))],
                    ];
                    for (t, d_t) in d.iter_mut().enumerate() {
                        let row = xb.add(t * stride);
                        for (s, d_ts) in d_t.iter_mut().enumerate() {
                            let x = quad(row.add(2 * ((2 * p + s) * SUB + 4 * k4)));
                            d_ts[0] = _mm512_dpbf16_ps(d_ts[0], w[s][0], x);
                            d_ts[1] = _mm512_dpbf16_ps(d_ts[1], w[s][1], x);
                        }
                    }
                }
                // `s` picks the sub-block of every token's accumulators and of the scales.
                #[allow(clippy::needless_range_loop)]
                for s in 0..2 {
                    let j = 2 * p + s;
                    let at = ws.add(j * crate::q4g::SUB_SCALE_BYTES);
                    let scale = pairs(_mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i)));
                    let min = even_pairs(_mm512_cvtph_ps(_mm256_loadu_si256(at.add(32) as *const __m256i)));
                    for (t, acc_t) in acc.iter_mut().enumerate() {
                        let sum =
                            _mm512_set1_ps((xb.add(t * stride + 2 * cols + 4 * j) as *const f32).read_unaligned());
                        for h in 0..2 {
                            acc_t[h] = _mm512_fmadd_ps(d[t][s][h], scale[h], acc_t[h]);
                            acc_t[h] = _mm512_fnmadd_ps(sum, min[h], acc_t[h]);
                        }
                    }
                }
            }
            let mask: __mmask16 = ((1u32 << valid) - 1) as __mmask16;
            for (t, acc_t) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(y.add(t * y_stride), mask, rows16(acc_t[0], acc_t[1]));
            }
        }
    }

    /// Dispatches to the tile of `weights` for `mt <= tile_tokens(weights)` tokens.
    ///
    /// # Safety
    /// As [`super::group`] for `mt` tokens, on a CPU where [`super::available`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile_dyn(
        weights: Weights,
        mt: usize,
        wq: &[u8],
        ws: &[u8],
        cols: usize,
        xb: &[u8],
        stride: usize,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
        prefetch_next: bool,
    ) {
        let (wq, ws, xb) = (wq.as_ptr(), ws.as_ptr(), xb.as_ptr());
        macro_rules! tokens {
            ($tile:ident $(, $fp8:literal)?) => {
                match mt {
                    8 => $tile::<8 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                    7 => $tile::<7 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                    6 => $tile::<6 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                    5 => $tile::<5 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                    4 => $tile::<4 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                    3 => $tile::<3 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                    2 => $tile::<2 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                    _ => $tile::<1 $(, $fp8)?>(wq, ws, cols, xb, stride, y, y_stride, valid, prefetch_next),
                }
            };
        }
        // SAFETY: the caller's contract.
        unsafe {
            match weights {
                Weights::Int8 => tokens!(tile8, false),
                Weights::Fp8 => tokens!(tile8, true),
                Weights::Int4 => tokens!(tile4),
            }
        }
    }
}
