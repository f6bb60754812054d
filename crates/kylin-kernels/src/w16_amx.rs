//! The weight-only products of [`crate::w16`] on Intel AMX tiles (`tdpbf16ps`): the same
//! packings (`q8_0_a16`, `q4_g_a16`, `f8_e4m3_a16`) and the same packed activations, a faster
//! family of kernels for prefill on CPUs with AMX-BF16.
//!
//! **Why.** The AVX-512 BF16 tiles of [`crate::w16`] widen every weight to BF16 for each tile
//! of 4 or 8 tokens and feed it to `vdpbf16ps`, which on Sapphire and Emerald Rapids does a
//! third of an FMA's work per cycle: prefill of a published W4A16 or FP8 checkpoint ran at a
//! quarter of the int8 products' speed. Here a group's weights are decoded once per chunk into
//! AMX's B-tile layout, and one `tdpbf16ps` multiplies a 32-column sub-block of 16 rows by up to
//! 16 tokens. Measured on an Emerald Rapids Xeon (2 cores, qwen3-0.6b-shaped, 512-token
//! prompt, BENCHMARKS.md): W4A16 prefill 91–109 → 265–311 tokens/s, FP8 112–130 → 296–341.
//!
//! **One token** runs [`one_token`] instead, without tiles: there a `tdpbf16ps`, its
//! `tilestored` and the vector loads of the sums cost more per sub-block than reading its
//! 4-bit weights from memory takes. Each sub-block's `d` comes from one of two kernels with
//! the same bits:
//! - **integer sums** on `vpdpbusd` ([`IntegerForm`]), when the token's activations of the
//!   sub-block are small integers times one power of two ([`crate::w16::IntegerBlock`]) and
//!   the codes' sums of them are exact in f32, so that the canonical order's only rounding is
//!   its last addition, which the integer sum's conversion to f32 makes: 3 `vpdpbusd` per 64
//!   weights and a sub-block. In decode steps on real text this took 9 sub-blocks in 10 of the
//!   4-bit codes' products (two published W4A16 checkpoints) and 56% of the int8 codes' (whose
//!   sums grow 8 times faster); FP8 values are not small integers;
//! - otherwise **f32 FMAs** in the canonical order, about 3 instructions per 16 weights. FP8
//!   codes decode there with E4M3's exponent field as f32's and the activations scaled by
//!   2^110 ([`fp8_scaled_chains`]), so that zero codes need no table: in an FP8_BLOCK copy of
//!   Qwen2.5-Coder-0.5B-Instruct 5% of the codes are zeros and 82% of the 64-byte chunks hold
//!   one, which took the table path before (decode 29.2–32.5 → 34.5–37.9 tokens/s).
//!
//! With the integer sums, W4A16 decode reads 83–84% of the machine's measured bandwidth in
//! weights (96% with the KV cache) where the FMAs alone read 77% (BENCHMARKS.md).
//!
//! **Tiles.** Per group of 16 weight rows and chunk of [`CHUNK_SUBS`] sub-blocks of 32 columns:
//! - **B** (16 pair rows × 64 bytes, one per sub-block `j`): pair row `i` holds, for the 16
//!   weight rows `n`, the BF16 words `(w[n][32j + 2i], w[n][32j + 2i + 1])`: the codes as
//!   [`crate::w16`] decodes them (an int8 or 4-bit code's value, an FP8 value times 2^8), made
//!   from one 64-byte `k4` chunk of the planes with a `vpermb` per pair row (the chunk holds
//!   columns `4k4 .. 4k4 + 4` of the 16 rows, so pair rows `2k4` and `2k4 + 1`).
//! - **A** (up to 16 rows × 64 bytes): the tokens' packed BF16 activations of the sub-block,
//!   loaded in place from [`crate::w16::pack_tokens`]'s rows with their stride.
//! - **C** (tokens × 16 f32): `d[t][n]`, the sub-block's dot product from zero, stored and
//!   then scaled in f32 ([`Unit`] says why one unit's scale step waits for the next's
//!   products).
//!
//! **Canonical order** of one output `y[t, r]` (DESIGN.md invariant 7), this family's own:
//! `acc = 0`; for each sub-block `j` in order, `d = tdpbf16ps` of the sub-block from zero (the
//! measured rounding of [`crate::amx`]: the 16 even products summed in order, the 16 odd ones,
//! then their sum), `acc = fma(d, s_j, acc)` and, for Q4_G, `acc = fma(−Σx_j, m_j, acc)`;
//! `y = acc`. For FP8, `s_j` is the stored scale times 2^−8. Every token runs that sequence
//! alone (a tile's rows never mix, and [`one_token`] computes the same bits), so its outputs
//! are the same in a batch of one or of many, on any thread. A process runs either this family
//! or the AVX-512 BF16 one for every `_a16` product ([`crate::w16::family`]), never both.

use std::arch::asm;
use std::arch::x86_64::*;

use crate::amx::{TILE, TileConfig};
use crate::q4g::SUB_SCALE_BYTES;
use crate::q4k::{PAIR_BYTES, SUB};
use crate::quant::{QUANTS_BYTES, SCALES_BYTES};
use crate::w16::Weights;

/// Sub-blocks of 32 columns whose B tiles one pass decodes before the token tiles run over
/// them: 16 KiB, which stays in the first-level cache.
pub(crate) const CHUNK_SUBS: usize = 16;

/// Bytes of one B tile.
const B_TILE_BYTES: usize = 16 * 64;

/// The B tiles of one chunk.
#[repr(C, align(64))]
struct BTiles([u8; CHUNK_SUBS * B_TILE_BYTES]);

/// How far ahead of the block it decodes a one-token product asks for the quants plane (as
/// [`crate::w16`]'s one-token tiles do).
const ONE_TOKEN_PREFETCH_BYTES: usize = 8192;

/// The `vpermb` indices that make pair row `2k4 + half` of a B tile from one 64-byte chunk
/// (byte `4n + c` is column `4k4 + c` of row `n`): word `w` of the result takes byte
/// `4(w / 2) + 2·half + w % 2`, into its high byte (`HIGH`) or its low one.
const fn pair_indices(half: usize, high: bool) -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut w = 0;
    while w < 32 {
        idx[2 * w + high as usize] = (4 * (w / 2) + 2 * half + w % 2) as u8;
        w += 1;
    }
    idx
}

/// Pair-row indices placing each byte in its word's high byte (8-bit codes: sign at bit 15).
static HIGH_INDICES: [[u8; 64]; 2] = [pair_indices(0, true), pair_indices(1, true)];
/// Pair-row indices placing each byte in its word's low byte (4-bit codes: table lookups).
static LOW_INDICES: [[u8; 64]; 2] = [pair_indices(0, false), pair_indices(1, false)];
/// Byte masks keeping the high or the low byte of every word (the other zeroed).
const HIGH_BYTES: __mmask64 = 0xAAAA_AAAA_AAAA_AAAA;
const LOW_BYTES: __mmask64 = 0x5555_5555_5555_5555;

/// Whether this process runs the AMX family: AMX-BF16 was granted ([`crate::bf16_kernels`],
/// which `KYLIN_KERNELS_ISA=avx512` turns off), and the CPU has the AVX-512 BF16 and VBMI
/// instructions of the decoding (every AMX CPU does).
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        crate::w16::available()
            && crate::bf16_kernels() == Some(crate::Bf16Kernels::Amx)
            && std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
fn load_indices(idx: &[u8; 64]) -> __m512i {
    // SAFETY: `idx` is 64 readable bytes.
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }
}

/// Decodes sub-blocks `j0..j1` (at most [`CHUNK_SUBS`]; even bounds for Q4_G) of one group's
/// quants plane `wq` into the B tiles `0..j1 - j0` at `out`, prefetching as the caller asks.
///
/// # Safety
/// `wq` holds the group's whole quants plane for sub-blocks `..j1`; `out` is a [`BTiles`]'
/// worth of writable bytes, 64-byte aligned.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
unsafe fn decode_chunk(weights: Weights, wq: *const u8, j0: usize, j1: usize, out: *mut u8, prefetch: Prefetch) {
    // SAFETY (whole body): reads stay inside blocks (pairs) `j0..j1` of the plane; writes
    // inside the `j1 - j0` tiles at `out`.
    unsafe {
        match weights {
            Weights::Int4 => {
                let table = crate::w16::x86::nibble_table();
                let idx = [load_indices(&LOW_INDICES[0]), load_indices(&LOW_INDICES[1])];
                for p in j0 / 2..j1 / 2 {
                    let pair = wq.add(p * PAIR_BYTES);
                    prefetch.block(pair, PAIR_BYTES);
                    let (low, high) = (out.add((2 * p - j0) * B_TILE_BYTES), out.add((2 * p + 1 - j0) * B_TILE_BYTES));
                    for k4 in 0..8 {
                        let chunk = _mm512_loadu_si512(pair.add(k4 * 64) as *const __m512i);
                        for (half, idx) in idx.iter().enumerate() {
                            let words = _mm512_maskz_permutexvar_epi8(LOW_BYTES, *idx, chunk);
                            let row = (2 * k4 + half) * 64;
                            let lo = _mm512_permutexvar_epi16(words, table);
                            let hi = _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(words), table);
                            _mm512_store_si512(low.add(row) as *mut __m512i, lo);
                            _mm512_store_si512(high.add(row) as *mut __m512i, hi);
                        }
                    }
                }
            }
            Weights::Int8 | Weights::Fp8 => {
                let sub = crate::w16::x86::subnormal_table();
                let idx = [load_indices(&HIGH_INDICES[0]), load_indices(&HIGH_INDICES[1])];
                for j in j0..j1 {
                    let block = wq.add(j * QUANTS_BYTES);
                    prefetch.block(block, QUANTS_BYTES);
                    let tile = out.add((j - j0) * B_TILE_BYTES);
                    for k4 in 0..8 {
                        let chunk = _mm512_loadu_si512(block.add(k4 * 64) as *const __m512i);
                        // Only FP8 chunks with a subnormal code need the table path; zero codes
                        // are cleared after the normal decode.
                        let (zero_exponent, normal) = if weights == Weights::Fp8 {
                            let (zero_exponent, subnormal) = crate::w16::x86::fp8_zero_exponents(chunk);
                            (zero_exponent, !subnormal)
                        } else {
                            (0, false)
                        };
                        for (half, idx) in idx.iter().enumerate() {
                            // Each code in its word's high byte, the low byte zero.
                            let words = _mm512_maskz_permutexvar_epi8(HIGH_BYTES, *idx, chunk);
                            let bf = if weights == Weights::Int8 {
                                int8_high_words(words)
                            } else if normal {
                                // `fp8_normal_words` of the sign-extended codes: shifted right
                                // by four, the code's sign extends and its bits land at 4–11.
                                let bf = _mm512_ternarylogic_epi32::<0xEA>(
                                    _mm512_srai_epi16::<4>(words),
                                    _mm512_set1_epi16(0x87F0u16 as i16),
                                    _mm512_set1_epi16(0x4000),
                                );
                                if zero_exponent == 0 {
                                    bf
                                } else {
                                    let nonzero = _mm512_test_epi16_mask(words, _mm512_set1_epi16(0x7800));
                                    _mm512_maskz_mov_epi16(nonzero, bf)
                                }
                            } else {
                                std::mem::transmute::<__m512bh, __m512i>(crate::w16::x86::fp8_words(
                                    _mm512_srli_epi16::<8>(words),
                                    sub,
                                ))
                            };
                            _mm512_store_si512(tile.add((2 * k4 + half) * 64) as *mut __m512i, bf);
                        }
                    }
                }
            }
        }
    }
}

/// 32 offset-binary int8 codes, each in its word's high byte, as BF16 of the signed values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
fn int8_high_words(words: __m512i) -> __m512i {
    // The code's top bit flipped makes the signed value times 256; shifted back, sign-extended.
    let signed = _mm512_srai_epi16::<8>(_mm512_xor_si512(words, _mm512_set1_epi16(0x8000u16 as i16)));
    let lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(signed)));
    let hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64::<1>(signed)));
    // SAFETY: a reinterpretation of the same 32 words.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
}

/// What a product asks the memory system for while it decodes (a hint; no result changes).
#[derive(Clone, Copy)]
enum Prefetch {
    /// Nothing (prefill: the arithmetic per byte hides the reads).
    None,
    /// One token: the quants [`ONE_TOKEN_PREFETCH_BYTES`] ahead.
    Ahead,
    /// Batched decode: the same block of the next group, `group_bytes` on.
    NextGroup(usize),
}

impl Prefetch {
    #[inline(always)]
    fn block(self, p: *const u8, bytes: usize) {
        match self {
            Prefetch::None => {}
            Prefetch::Ahead => crate::prefetch_lines(p.wrapping_add(ONE_TOKEN_PREFETCH_BYTES), bytes / 64),
            Prefetch::NextGroup(group) => crate::prefetch_lines(p.wrapping_add(group), bytes / 64),
        }
    }
}

/// The tile configuration for token tiles of `m` rows: tmm0 the sums (C, `m` × 64 bytes),
/// tmm4 the activations (A, `m` × 64), tmm5 the weights (B, 16 × 64).
fn config(m: usize) -> TileConfig {
    let m = m as u8;
    TileConfig::new([64, 0, 0, 0, 64, 64, 0, 0], [m, 0, 0, 0, m, 16, 0, 0])
}

/// All `n_tokens` tokens × one group of 16 weight rows, on AMX (module docs). With
/// `prefetch_next`, decoding also asks for the next group's weights.
///
/// # Safety
/// [`available`]; `y` is valid for writing rows `0..valid` of `n_tokens` tokens at row stride
/// `y_stride`; `wq`, `ws` are one whole group of the format's planes for `cols` columns; `xb`
/// holds `n_tokens` packed rows of `stride` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
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
    let subs = cols / SUB;
    let (quants_len, scales_len) = weights.group_lens(cols).expect("columns that fit the format");
    assert!(wq.len() >= quants_len && ws.len() >= scales_len && xb.len() >= n_tokens * stride);
    assert!(stride >= 2 * cols && valid <= TILE);
    assert!(!integer_forms || (n_tokens == 1 && xb.len() >= crate::w16::integer_block_offset(cols, subs)));
    if n_tokens == 0 {
        return;
    }
    let prefetch = if prefetch_next {
        Prefetch::NextGroup(quants_len)
    } else if n_tokens == 1 {
        Prefetch::Ahead
    } else {
        Prefetch::None
    };
    let (wq, ws, xb) = (wq.as_ptr(), ws.as_ptr(), xb.as_ptr());
    let mask: __mmask16 = if valid >= TILE { 0xffff } else { (1u16 << valid) - 1 };
    if n_tokens == 1 {
        // SAFETY: the caller's contract, for one token.
        unsafe { one_token(weights, wq, ws, cols, xb, integer_forms, y, mask, prefetch) };
        return;
    }
    // Left uninitialized (through raw pointers only): every byte read was written first, by
    // decoding or by `tilestored`.
    let mut tiles = std::mem::MaybeUninit::<BTiles>::uninit();
    let mut sums = std::mem::MaybeUninit::<Sums>::uninit();
    let (tiles, sums) = (tiles.as_mut_ptr() as *mut u8, sums.as_mut_ptr() as *mut f32);
    let planes = Planes { weights, ws, xb, cols, stride, y, y_stride, mask };
    let mut loaded = n_tokens.min(TILE);
    // The unit whose sums wait in `sums` for their scale step (see `Unit`).
    let mut pending: Option<Unit> = None;
    let mut half = 0;
    // SAFETY (whole body): AMX is permitted (`available`); decoding reads inside the group's
    // quants plane and writes `tiles`; each unit's A loads read its `m` packed rows inside
    // `xb` at its sub-blocks' columns, its B loads decoded tiles, its C stores its half of
    // `sums`; the scale steps read `ws`, `xb`'s sums and `sums`, and write rows `0..valid` of
    // the caller's tokens.
    unsafe {
        crate::amx::load_config(&config(loaded));
        for j0 in (0..subs).step_by(CHUNK_SUBS) {
            let j1 = (j0 + CHUNK_SUBS).min(subs);
            decode_chunk(weights, wq, j0, j1, tiles, prefetch);
            if prefetch_next {
                // The next group's scales of this chunk, a few lines.
                let (from, to) = (j0 * scales_len / subs, j1 * scales_len / subs);
                crate::prefetch_lines(ws.wrapping_add(scales_len + from), (to - from).div_ceil(64));
            }
            for t0 in (0..n_tokens).step_by(TILE) {
                let m = TILE.min(n_tokens - t0);
                if m != loaded {
                    crate::amx::load_config(&config(m));
                    loaded = m;
                }
                let unit = Unit { j0, j1, t0, m, sums: sums.add(half * CHUNK_SUBS * TILE * TILE) };
                products(&planes, &unit, tiles);
                if let Some(previous) = pending {
                    scale_step(&planes, &previous);
                }
                pending = Some(unit);
                half ^= 1;
            }
        }
        if let Some(last) = pending {
            scale_step(&planes, &last);
        }
        crate::amx::release();
    }
}

/// F32 `0.0 ..= 15.0`: a 4-bit code's value by `vpermps` (which reads an index's low four bits).
static NIBBLE_VALUES: [f32; 16] =
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0];
/// F32 of an FP8 subnormal code's value times 2^8, `m · 2^−9 · 2^8`, by the low four bits
/// (the exponent's low bit, zero for these codes, and the mantissa `m`).
static SUBNORMAL_VALUES: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];

/// The 16 rows' weights of column `4k4 + C` of an 8-bit k4 chunk (`chunk`'s dword `n` holds
/// row `n`'s four columns) as f32: the int8 code's signed value (`chunk` with every byte's top
/// bit flipped), or the FP8 value times 2^8, both exactly what the B tiles hold as BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
fn column8<const C: u32>(weights: Weights, chunk: __m512i, plain: bool, sub: __m512) -> __m512 {
    // Byte `C` at the top of each dword.
    let top = match C {
        0 => _mm512_slli_epi32::<24>(chunk),
        1 => _mm512_slli_epi32::<16>(chunk),
        2 => _mm512_slli_epi32::<8>(chunk),
        _ => chunk,
    };
    if weights == Weights::Int8 {
        return _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(top));
    }
    // A normal code: the sign in bit 31, exponent and mantissa at bits 20–26, the exponent
    // rebiased by +128 (E4M3's bias is 7, f32's 127, and the 2^8).
    let normal = _mm512_ternarylogic_epi32::<0xEA>(
        _mm512_srai_epi32::<4>(top),
        _mm512_set1_epi32(0x87F0_0000u32 as i32),
        _mm512_set1_epi32(0x4000_0000),
    );
    if plain {
        return _mm512_castsi512_ps(normal);
    }
    // Codes with a zero exponent: the table's value, with the sign.
    let code = _mm512_srli_epi32::<24>(top);
    let zero_exponent = _mm512_testn_epi32_mask(code, _mm512_set1_epi32(0x78));
    let magnitude = _mm512_permutexvar_ps(code, sub);
    let signed = _mm512_or_si512(_mm512_castps_si512(magnitude), _mm512_and_si512(top, _mm512_set1_epi32(i32::MIN)));
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(normal, zero_exponent, signed))
}

/// One token × one group of 16 rows without AMX: the same sums as a one-row A tile gives,
/// from f32 FMAs. Per sub-block and row, two chains of 16 FMAs from zero, over the even and
/// the odd columns in order, are `tdpbf16ps`'s even and odd sums bit for bit (a BF16 × BF16
/// product is exact in f32, so each FMA rounds once, as each of its additions does; and no
/// partial sum can be denormal: [`crate::w16::pack_tokens`] zeroes activations below 2^−100
/// in this family, so every activation left is a multiple of 2^−107 and every weight value of
/// 2^−1, and every product and rounded partial sum a multiple of 2^−108, zero or far above
/// the denormals), then `d = (even + odd) + 0`, as `tdpbf16ps` adds to a zeroed C tile. Then the
/// scale step of [`scale_step`], with the same operations. Decode runs here: a `tdpbf16ps`,
/// its `tilestored` and the vector loads after it cost more per sub-block than reading four
/// bits per weight from memory takes.
///
/// # Safety
/// As [`group`] for one token.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn one_token(
    weights: Weights,
    wq: *const u8,
    ws: *const u8,
    cols: usize,
    xb: *const u8,
    integer_forms: bool,
    y: *mut f32,
    mask: __mmask16,
    prefetch: Prefetch,
) {
    let subs = cols / SUB;
    // SAFETY: both tables are 16 readable f32.
    let (nibbles, sub) =
        unsafe { (_mm512_loadu_ps(NIBBLE_VALUES.as_ptr()), _mm512_loadu_ps(SUBNORMAL_VALUES.as_ptr())) };
    let mut acc = _mm512_setzero_ps();
    let n = if weights == Weights::Int4 { 2 } else { 1 };
    // The token's BF16 activations of the sub-blocks `j .. j + n` the FMAs run, widened to f32
    // once for every row.
    let mut xf = [0.0f32; 2 * SUB];
    // SAFETY (whole body): reads stay inside the group's planes and the token's packed row.
    unsafe {
        for j in (0..subs).step_by(n) {
            let widen = |xf: &mut [f32; 2 * SUB]| widen_activations(xb, j, n, xf);
            // Column `k` of sub-block `j`, `32 + k` of `j + 1`, in every lane.
            let x = |xf: &[f32; 2 * SUB], k: usize| _mm512_set1_ps(*xf.get_unchecked(k));
            // The sub-blocks whose integer form gives `d` on `vpdpbusd`.
            let form = |i: usize| match weights {
                _ if !integer_forms => None,
                Weights::Int4 => IntegerForm::of::<15>(xb, cols, j + i),
                Weights::Int8 => IntegerForm::of::<128>(xb, cols, j + i),
                Weights::Fp8 => None,
            };
            let mut d = [_mm512_setzero_ps(); 2];
            match weights {
                Weights::Int4 => {
                    let pair = wq.add(j / 2 * PAIR_BYTES);
                    prefetch.block(pair, PAIR_BYTES);
                    let forms = (form(0), form(1));
                    if !matches!(forms, (Some(_), Some(_))) {
                        widen(&mut xf);
                    }
                    let x = |k: usize| x(&xf, k);
                    d = match forms {
                        (Some(a), Some(b)) => int4_integers::<true, true>(pair, [a, b]),
                        (Some(a), None) => {
                            let [low, _] = int4_integers::<true, false>(pair, [a, a]);
                            let [_, high] = int4_chains::<false, true>(pair, x, nibbles);
                            [low, high]
                        }
                        (None, Some(b)) => {
                            let [_, high] = int4_integers::<false, true>(pair, [b, b]);
                            let [low, _] = int4_chains::<true, false>(pair, x, nibbles);
                            [low, high]
                        }
                        (None, None) => int4_chains::<true, true>(pair, x, nibbles),
                    };
                }
                Weights::Int8 | Weights::Fp8 => {
                    let block = wq.add(j * QUANTS_BYTES);
                    prefetch.block(block, QUANTS_BYTES);
                    if let Some(form) = form(0) {
                        d[0] = int8_integer(block, form);
                    } else if weights == Weights::Fp8 && widen_fp8_scaled(xb, j, &mut xf) {
                        d[0] = if crate::w16::x86::fp8_may_hold_subnormals(ws.add(j * 2 * SCALES_BYTES)) {
                            fp8_scaled_chains::<true>(block, &xf, sub)
                        } else {
                            fp8_scaled_chains::<false>(block, &xf, sub)
                        };
                    } else {
                        widen(&mut xf);
                        let mut chains = [_mm512_setzero_ps(); 2];
                        for k4 in 0..8 {
                            let mut chunk = _mm512_loadu_si512(block.add(k4 * 64) as *const __m512i);
                            let plain = _mm512_testn_epi8_mask(chunk, _mm512_set1_epi8(0x78)) == 0;
                            if weights == Weights::Int8 {
                                chunk = _mm512_xor_si512(chunk, _mm512_set1_epi8(-128));
                            }
                            let w = [
                                column8::<0>(weights, chunk, plain, sub),
                                column8::<1>(weights, chunk, plain, sub),
                                column8::<2>(weights, chunk, plain, sub),
                                column8::<3>(weights, chunk, plain, sub),
                            ];
                            for (c, w) in w.into_iter().enumerate() {
                                chains[c % 2] = _mm512_fmadd_ps(w, x(&xf, 4 * k4 + c), chains[c % 2]);
                            }
                        }
                        d[0] = _mm512_add_ps(_mm512_add_ps(chains[0], chains[1]), _mm512_setzero_ps());
                    }
                }
            }
            for (i, d) in d.iter().enumerate().take(n) {
                acc = scale_one(weights, ws, xb, cols, j + i, *d, acc);
            }
        }
        _mm512_mask_storeu_ps(y, mask, acc);
    }
}

/// Widens the token's packed BF16 activations of sub-blocks `j .. j + n` (`n` ≤ 2) to f32 in
/// `xf`, for the FMA chains.
///
/// # Safety
/// `xb` is the token's packed row, holding sub-blocks `j .. j + n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn widen_activations(xb: *const u8, j: usize, n: usize, xf: &mut [f32; 2 * SUB]) {
    for (i, x16) in xf[..n * SUB].chunks_exact_mut(16).enumerate() {
        // SAFETY: the caller's contract; `x16` is 16 writable f32.
        unsafe { _mm512_storeu_ps(x16.as_mut_ptr(), widen16(xb.add(2 * (j * SUB + 16 * i)))) };
    }
}

/// The 16 packed BF16 activations at `p` in f32.
///
/// # Safety
/// `p` is valid for reading 32 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn widen16(p: *const u8) -> __m512 {
    // SAFETY: the caller's contract.
    let h = unsafe { _mm256_loadu_si256(p as *const __m256i) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// 2^e in f32, for `e` in f32's normal range.
const fn power_of_two(e: i32) -> f32 {
    f32::from_bits(((127 + e) as u32) << 23)
}

/// The binary order of the factor of the activations in [`fp8_scaled_chains`]: the codes'
/// values there are 2^−120 times theirs, 2^−128 times the canonical ones (which are 2^8 times
/// theirs), so products are the canonical ones times 2^(110 − 128).
const FP8_ACTIVATION_ORDER: i32 = 110;
const FP8_ACTIVATION_SCALE: f32 = power_of_two(FP8_ACTIVATION_ORDER);
/// 2^18: activations at least this large (or not finite) keep a sub-block off
/// [`fp8_scaled_chains`], whose scaled activations would overflow f32 (2^128).
const FP8_ACTIVATION_LIMIT: f32 = power_of_two(128 - FP8_ACTIVATION_ORDER);
/// 2^18: what [`fp8_scaled_chains`]' sums are multiplied by to be the canonical ones.
const FP8_SUM_SCALE: f32 = power_of_two(128 - FP8_ACTIVATION_ORDER);
/// 2^−64: what a table-decoded weight and its activation are each multiplied by in
/// [`fp8_scaled_chains`], to be on its scale without a denormal (2^−128) factor.
const FP8_TABLE_SCALE: f32 = power_of_two(-64);

/// Widens the token's packed BF16 activations of FP8 sub-block `j` to f32 times
/// [`FP8_ACTIVATION_SCALE`] in `xf` and says whether every one is below
/// [`FP8_ACTIVATION_LIMIT`] (so that [`fp8_scaled_chains`] may run); when one is not, `xf` is
/// left for [`widen_activations`] to overwrite.
///
/// # Safety
/// `xb` is the token's packed row, holding sub-block `j`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn widen_fp8_scaled(xb: *const u8, j: usize, xf: &mut [f32; 2 * SUB]) -> bool {
    let mut large = 0;
    for (i, x16) in xf[..SUB].chunks_exact_mut(16).enumerate() {
        // SAFETY: the caller's contract; `x16` is 16 writable f32.
        unsafe {
            let f = widen16(xb.add(2 * (j * SUB + 16 * i)));
            // Not below the limit, NaNs included.
            large |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(_mm512_abs_ps(f), _mm512_set1_ps(FP8_ACTIVATION_LIMIT));
            _mm512_storeu_ps(x16.as_mut_ptr(), _mm512_mul_ps(f, _mm512_set1_ps(FP8_ACTIVATION_SCALE)));
        }
    }
    large == 0
}

/// `d` of one FP8 sub-block for one token's 16 rows, on f32 FMAs over weights and activations
/// scaled so that zero codes need no table: `xf` holds the activations times 2^110
/// ([`widen_fp8_scaled`]).
///
/// **Why these are the canonical bits.** A code's f32 bits made with E4M3's exponent field as
/// f32's (no rebias) are its value times 2^−120 exactly: normal for every non-zero exponent
/// (E4M3's smallest normal, 2^−6, lands on f32's, 2^−126) and ±0 for the zero codes, in two
/// instructions where the canonical value (times 2^8, [`column8`]) needs a table for zeros and
/// subnormals alike. With activations times 2^110, each product is the canonical one times
/// 2^−18. The canonical products and partial sums are multiples of 2^−108 ([`one_token`]), so
/// these are multiples of 2^−126, zero or normal, and (activations below 2^18) finite: scaling
/// by 2^−18 commutes with every rounding of the chains and of `(even + odd) + 0`, and the
/// result times 2^18 is the canonical `d`.
///
/// **Subnormal codes** would be exact as f32 denormals too, but an FMA with a denormal operand
/// takes a microcode assist of some 150 cycles (measured on an Emerald Rapids Xeon), so a chunk
/// holding one (0.2–0.6% of the chunks of the FP8_BLOCK checkpoints in BENCHMARKS.md, where up
/// to 82% hold a zero code) decodes by [`column8`]'s table instead, each weight and activation
/// multiplied by 2^−64 (both exact and normal: weights are at least 2^−1, activations at least
/// 2^−100 times 2^110). Looking for one costs two of the sixteen vector operations of a chunk;
/// with `LOOK` false (a sub-block that `w16::x86::fp8_may_hold_subnormals` clears) no chunk is
/// looked at, which takes a tenth off the kernel's time in cache.
///
/// # Safety
/// `block` is one block of the quants plane ([`QUANTS_BYTES`]) of FP8 codes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn fp8_scaled_chains<const LOOK: bool>(block: *const u8, xf: &[f32; 2 * SUB], sub: __m512) -> __m512 {
    // A code in the high byte of a dword's high word, shifted right by four in its word (the
    // sign extended): the sign in bit 31, the exponent and mantissa at bits 20–26; the rest
    // cleared.
    let scaled =
        |words: __m512i| _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(0x87F0_0000u32 as i32)));
    let mut chains = [_mm512_setzero_ps(); 2];
    for k4 in 0..8 {
        // SAFETY: the caller's contract; `xf` holds the sub-block's 32 columns.
        unsafe {
            let chunk = _mm512_loadu_si512(block.add(k4 * 64) as *const __m512i);
            let subnormal = LOOK && crate::w16::x86::fp8_zero_exponents(chunk).1;
            let x = |c: usize| _mm512_set1_ps(*xf.get_unchecked(4 * k4 + c));
            if !subnormal {
                // Every word's high byte (columns 1 and 3 of a dword) and low byte (0 and 2),
                // shifted into place in its word: two columns per shift.
                let high = _mm512_srai_epi16::<4>(chunk);
                let low = _mm512_srai_epi16::<4>(_mm512_slli_epi16::<8>(chunk));
                let w = [
                    scaled(_mm512_slli_epi32::<16>(low)),
                    scaled(_mm512_slli_epi32::<16>(high)),
                    scaled(low),
                    scaled(high),
                ];
                for (c, w) in w.into_iter().enumerate() {
                    chains[c % 2] = _mm512_fmadd_ps(w, x(c), chains[c % 2]);
                }
            } else {
                let w = [
                    column8::<0>(Weights::Fp8, chunk, false, sub),
                    column8::<1>(Weights::Fp8, chunk, false, sub),
                    column8::<2>(Weights::Fp8, chunk, false, sub),
                    column8::<3>(Weights::Fp8, chunk, false, sub),
                ];
                let table_scale = _mm512_set1_ps(FP8_TABLE_SCALE);
                for (c, w) in w.into_iter().enumerate() {
                    let (w, x) = (_mm512_mul_ps(w, table_scale), _mm512_mul_ps(x(c), table_scale));
                    chains[c % 2] = _mm512_fmadd_ps(w, x, chains[c % 2]);
                }
            }
        }
    }
    let d = _mm512_add_ps(_mm512_add_ps(chains[0], chains[1]), _mm512_setzero_ps());
    _mm512_mul_ps(d, _mm512_set1_ps(FP8_SUM_SCALE))
}

/// The chains of one pair of 4-bit sub-blocks (`j` in the low nibbles, `j + 1` in the high
/// ones) for one token's 16 rows, on f32 FMAs ([`one_token`] says why these are the canonical
/// bits): `d` of the low sub-block when `LOW`, of the high one when `HIGH` (zero otherwise).
/// `x(k)` broadcasts the token's activation of column `k` of the low sub-block, `32 + k` of the
/// high one.
///
/// # Safety
/// `pair` is one pair block of the quants plane ([`PAIR_BYTES`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn int4_chains<const LOW: bool, const HIGH: bool>(
    pair: *const u8,
    x: impl Fn(usize) -> __m512,
    nibbles: __m512,
) -> [__m512; 2] {
    // [sub-block][even, odd].
    let mut chains = [[_mm512_setzero_ps(); 2]; 2];
    for k4 in 0..8 {
        // SAFETY: the caller's contract.
        let chunk = unsafe { _mm512_loadu_si512(pair.add(k4 * 64) as *const __m512i) };
        let columns =
            [chunk, _mm512_srli_epi32::<8>(chunk), _mm512_srli_epi32::<16>(chunk), _mm512_srli_epi32::<24>(chunk)];
        for (c, v) in columns.into_iter().enumerate() {
            let k = 4 * k4 + c;
            if LOW {
                let low = _mm512_permutexvar_ps(v, nibbles);
                chains[0][c % 2] = _mm512_fmadd_ps(low, x(k), chains[0][c % 2]);
            }
            if HIGH {
                let high = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), nibbles);
                chains[1][c % 2] = _mm512_fmadd_ps(high, x(32 + k), chains[1][c % 2]);
            }
        }
    }
    chains.map(|[even, odd]| _mm512_add_ps(_mm512_add_ps(even, odd), _mm512_setzero_ps()))
}

/// One sub-block's integer form in a packed token ([`crate::w16::IntegerBlock`]), when sums of
/// weight codes of magnitude at most `W` over it are exact in f32.
///
/// **Why the integers give the canonical `d`.** With `x_k = X_k · unit`, every product
/// `w_k · x_k` and every partial sum of the even chain of [`one_token`] (and of `tdpbf16ps`) is
/// an integer times `unit` of magnitude at most `W · Σ|X_k|` over the even columns `k`, and
/// the same for the odd chain. When both bounds are below 2^24, f32 holds each of those values
/// exactly, so both chains are exact, and `d = (even + odd) + 0` is the exact sum
/// `unit · Σ w_k X_k` rounded once to nearest even: which converting `vpdpbusd`'s exact integer
/// sum to f32 does (it is below 2^25), before scaling by `unit`, a normal power of two. The
/// weight codes' largest magnitudes `W` are 15 (4-bit codes) and 128 (int8); a sub-block gets
/// the same bits either way.
#[derive(Clone, Copy)]
struct IntegerForm {
    /// The block's integer form.
    at: *const u8,
    unit: __m512,
}

impl IntegerForm {
    /// Sub-block `j`'s integer form in the token's packed row `xb` of `cols` columns, if it has
    /// one whose sums of codes of magnitude at most `W` are exact.
    ///
    /// # Safety
    /// `xb` is a packed row of `cols` columns with its integer forms written, and `j` one of
    /// its sub-blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn of<const W: i64>(xb: *const u8, cols: usize, j: usize) -> Option<Self> {
        use crate::w16::IntegerBlock as Block;
        // SAFETY: the caller's contract.
        unsafe {
            let at = xb.add(crate::w16::integer_block_offset(cols, j));
            let unit = f32::from_le_bytes((at.add(Block::UNIT) as *const [u8; 4]).read());
            let abs_sum =
                |h: usize| i32::from_le_bytes((at.add(Block::ABS_SUMS + 4 * h) as *const [u8; 4]).read()) as i64;
            let exact = W * abs_sum(0).max(abs_sum(1)) < 1 << 24;
            (unit != 0.0 && exact).then(|| IntegerForm { at, unit: _mm512_set1_ps(unit) })
        }
    }

    /// The four bytes of columns `4k4 .. 4k4 + 4` of one of the form's byte planes, in every
    /// lane.
    ///
    /// # Safety
    /// `plane` is one of [`crate::w16::IntegerBlock`]'s byte planes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn bytes(self, plane: usize, k4: usize) -> __m512i {
        // SAFETY: the caller's contract.
        _mm512_set1_epi32(unsafe { (self.at.add(plane + 4 * k4) as *const i32).read_unaligned() })
    }

    /// `d` from the three sums `Σ w_k top_k`, `Σ w_k mid_k`, `Σ w_k low_k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn d(self, [top, mid, low]: [__m512i; 3]) -> __m512 {
        // Σ w_k X_k = 2^16 · Σ w_k top_k + 2^8 · Σ w_k mid_k + Σ w_k low_k, below 2^25.
        let sum = _mm512_add_epi32(_mm512_slli_epi32::<16>(top), _mm512_add_epi32(_mm512_slli_epi32::<8>(mid), low));
        _mm512_mul_ps(_mm512_cvtepi32_ps(sum), self.unit)
    }
}

/// `d` of a pair of 4-bit sub-blocks (`j` in the low nibbles, `j + 1` in the high ones) for
/// one token's 16 rows, from their integer forms on `vpdpbusd`: of the low sub-block when
/// `LOW`, of the high one when `HIGH` (zero otherwise, its form unread).
///
/// # Safety
/// `pair` is one pair block of the quants plane ([`PAIR_BYTES`]); the forms are the token's.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn int4_integers<const LOW: bool, const HIGH: bool>(pair: *const u8, forms: [IntegerForm; 2]) -> [__m512; 2] {
    use crate::w16::IntegerBlock as Block;
    // [sub-block][top, mid, low].
    let mut sums = [[_mm512_setzero_si512(); 3]; 2];
    let nibble = _mm512_set1_epi8(0x0F);
    for k4 in 0..8 {
        // SAFETY: the caller's contract.
        unsafe {
            let chunk = _mm512_loadu_si512(pair.add(k4 * 64) as *const __m512i);
            // Row `n`'s codes of columns `4k4 .. 4k4 + 4`, a byte each, in dword `n`.
            let codes = [_mm512_and_si512(chunk, nibble), _mm512_and_si512(_mm512_srli_epi16::<4>(chunk), nibble)];
            for (i, ((sums, codes), form)) in sums.iter_mut().zip(codes).zip(forms).enumerate() {
                if (i == 0 && !LOW) || (i == 1 && !HIGH) {
                    continue;
                }
                // `vpdpbusd` multiplies unsigned bytes (its first operand) by signed ones.
                sums[0] = _mm512_dpbusd_epi32(sums[0], codes, form.bytes(Block::TOP, k4));
                sums[1] = _mm512_dpbusd_epi32(sums[1], form.bytes(Block::MID, k4), codes);
                sums[2] = _mm512_dpbusd_epi32(sums[2], form.bytes(Block::LOW, k4), codes);
            }
        }
    }
    let d = |i: usize, taken: bool| if taken { forms[i].d(sums[i]) } else { _mm512_setzero_ps() };
    [d(0, LOW), d(1, HIGH)]
}

/// `d` of one int8 sub-block for one token's 16 rows, from its integer form on `vpdpbusd`.
///
/// # Safety
/// `block` is one block of the quants plane ([`QUANTS_BYTES`]); the form is the token's.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn int8_integer(block: *const u8, form: IntegerForm) -> __m512 {
    use crate::w16::IntegerBlock as Block;
    let mut sums = [_mm512_setzero_si512(); 3];
    for k4 in 0..8 {
        // SAFETY: the caller's contract.
        unsafe {
            // Offset-binary codes `w + 128` (unsigned) and the codes `w` (signed).
            let biased = _mm512_loadu_si512(block.add(k4 * 64) as *const __m512i);
            let signed = _mm512_xor_si512(biased, _mm512_set1_epi8(-128));
            sums[0] = _mm512_dpbusd_epi32(sums[0], biased, form.bytes(Block::TOP, k4));
            sums[1] = _mm512_dpbusd_epi32(sums[1], form.bytes(Block::MID, k4), signed);
            sums[2] = _mm512_dpbusd_epi32(sums[2], form.bytes(Block::LOW, k4), signed);
        }
    }
    // Σ (w_k + 128) · top_k − 128 · Σ top_k.
    // SAFETY: the form's fields lie inside the token's packed row.
    let top_sum = i32::from_le_bytes(unsafe { (form.at.add(Block::TOP_SUM) as *const [u8; 4]).read() });
    sums[0] = _mm512_sub_epi32(sums[0], _mm512_set1_epi32(128 * top_sum));
    form.d(sums)
}

/// Writes the integer form ([`crate::w16::IntegerBlock`], whose `write` is the scalar
/// reference) of one block's 32 packed BF16 values into `out`, or its `unit` as zero when it
/// has none.
///
/// # Safety
/// AVX-512 F/BW are available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn write_integer_block(values: &[u16; SUB], out: &mut [u8]) {
    use crate::w16::IntegerBlock as Block;
    let out = &mut out[..crate::w16::INTEGER_BLOCK_BYTES];
    // SAFETY: `values` is 64 readable bytes.
    let words = unsafe { _mm512_loadu_si512(values.as_ptr() as *const __m512i) };
    // Columns 0..16 and 16..32, a value per dword.
    let halves = [
        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)),
        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(words)),
    ];
    let nonzero = halves.map(|h| _mm512_test_epi32_mask(h, _mm512_set1_epi32(0x7FFF)));
    let exponents = halves.map(|h| _mm512_and_si512(_mm512_srli_epi32::<7>(h), _mm512_set1_epi32(0xFF)));
    let lo = _mm512_mask_reduce_min_epi32(nonzero[0], exponents[0])
        .min(_mm512_mask_reduce_min_epi32(nonzero[1], exponents[1]));
    let hi = _mm512_mask_reduce_max_epi32(nonzero[0], exponents[0])
        .max(_mm512_mask_reduce_max_epi32(nonzero[1], exponents[1]));
    // All zeros take unit 2^-7, as the reference's.
    let (lo, hi) = if nonzero == [0, 0] { (127, 127) } else { (lo, hi) };
    if lo < 8 || hi > 200 || hi - lo > 14 {
        out.fill(0);
        return;
    }
    let (mut top_sum, mut abs_sums) = (0i32, [0i32; 2]);
    for (i, h) in halves.into_iter().enumerate() {
        let significand = _mm512_or_si512(_mm512_and_si512(h, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x80));
        let magnitude =
            _mm512_maskz_sllv_epi32(nonzero[i], significand, _mm512_sub_epi32(exponents[i], _mm512_set1_epi32(lo)));
        let negative = _mm512_test_epi32_mask(h, _mm512_set1_epi32(0x8000));
        let x = _mm512_mask_sub_epi32(magnitude, negative, _mm512_setzero_si512(), magnitude);
        let top = _mm512_srai_epi32::<16>(x);
        for (plane, bytes) in [(Block::TOP, top), (Block::MID, _mm512_srli_epi32::<8>(x)), (Block::LOW, x)] {
            // The low byte of each dword.
            let bytes = _mm512_cvtepi32_epi8(bytes);
            // SAFETY: 16 bytes inside `out` (`plane + 16i + 16 ≤ 112`).
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(plane + 16 * i) as *mut __m128i, bytes) };
        }
        top_sum += _mm512_reduce_add_epi32(top);
        abs_sums[0] += _mm512_mask_reduce_add_epi32(0x5555, magnitude);
        abs_sums[1] += _mm512_mask_reduce_add_epi32(0xAAAA, magnitude);
    }
    out[Block::UNIT..Block::UNIT + 4].copy_from_slice(&f32::from_bits(((lo - 7) as u32) << 23).to_le_bytes());
    out[Block::TOP_SUM..Block::TOP_SUM + 4].copy_from_slice(&top_sum.to_le_bytes());
    out[Block::ABS_SUMS..Block::ABS_SUMS + 4].copy_from_slice(&abs_sums[0].to_le_bytes());
    out[Block::ABS_SUMS + 4..Block::ABS_SUMS + 8].copy_from_slice(&abs_sums[1].to_le_bytes());
}

/// One sub-block's step of the scale order for one token's 16 rows: `acc = fma(d, s_j, acc)`
/// and, for Q4_G, `acc = fma(−Σx_j, m_j, acc)` ([`scale_step`]'s operations).
///
/// # Safety
/// Sub-block `j`'s scales lie inside `ws`; `xb` is the token's packed row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn scale_one(
    weights: Weights,
    ws: *const u8,
    xb: *const u8,
    cols: usize,
    j: usize,
    d: __m512,
    acc: __m512,
) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe {
        let [scale, min] = scales(weights, ws, j);
        let acc = _mm512_fmadd_ps(d, scale, acc);
        if weights == Weights::Int4 {
            let sum = (xb.add(2 * cols + 4 * j) as *const f32).read_unaligned();
            _mm512_fnmadd_ps(_mm512_set1_ps(sum), min, acc)
        } else {
            acc
        }
    }
}

/// Sub-block `j`'s 16 per-row scales (and Q4_G's mins; zero otherwise) in f32, FP8's times
/// 2^−8 (its decoded values are 2^8 times the codes').
///
/// # Safety
/// Sub-block `j`'s scales lie inside `ws`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn scales(weights: Weights, ws: *const u8, j: usize) -> [__m512; 2] {
    // SAFETY: the caller's contract.
    unsafe {
        match weights {
            Weights::Int4 => {
                let at = ws.add(j * SUB_SCALE_BYTES);
                [
                    _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i)),
                    _mm512_cvtph_ps(_mm256_loadu_si256(at.add(32) as *const __m256i)),
                ]
            }
            Weights::Int8 => {
                [_mm512_cvtph_ps(_mm256_loadu_si256(ws.add(j * SCALES_BYTES) as *const __m256i)), _mm512_setzero_ps()]
            }
            Weights::Fp8 => [
                _mm512_mul_ps(_mm512_loadu_ps(ws.add(j * 2 * SCALES_BYTES) as *const f32), _mm512_set1_ps(1.0 / 256.0)),
                _mm512_setzero_ps(),
            ],
        }
    }
}

/// Sub-blocks' sums of both units in flight: [`CHUNK_SUBS`] C tiles of up to 16 rows each.
#[repr(C, align(64))]
struct Sums([f32; 2 * CHUNK_SUBS * TILE * TILE]);

/// What the steps of one group share.
struct Planes {
    weights: Weights,
    ws: *const u8,
    xb: *const u8,
    cols: usize,
    stride: usize,
    y: *mut f32,
    y_stride: usize,
    mask: __mmask16,
}

/// Sub-blocks `j0..j1` (one chunk) × tokens `t0..t0 + m`. Its products are issued, then the
/// next unit's, and only then its scale step reads them: a vector load of a C tile right
/// after `tilestored` wrote it cost some 100 cycles per sub-block on an Emerald Rapids Xeon
/// (the load waits on, or replays behind, the tile store), which one unit's worth of other
/// work in between hides.
#[derive(Clone, Copy)]
struct Unit {
    j0: usize,
    j1: usize,
    t0: usize,
    m: usize,
    /// Where its C tiles go: sub-block `j` at `sums + (j − j0) · m · 16`, row `t` (token
    /// `t0 + t`) 16 f32 at `+ 16t`.
    sums: *mut f32,
}

/// Issues `unit`'s products: per sub-block, C = A · B from zero into its slot of `unit.sums`.
///
/// # Safety
/// As [`group`]'s body, with the unit's configuration (`m` rows) loaded.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn products(planes: &Planes, unit: &Unit, tiles: *const u8) {
    for j in unit.j0..unit.j1 {
        // SAFETY: the caller's contract.
        unsafe {
            asm!(
                "tileloadd tmm4, [{x} + {xs}*1]",
                "tileloadd tmm5, [{b} + {s64}*1]",
                "tilezero tmm0",
                "tdpbf16ps tmm0, tmm4, tmm5",
                "tilestored [{c} + {s64}*1], tmm0",
                x = in(reg) planes.xb.add(unit.t0 * planes.stride + 2 * j * SUB),
                xs = in(reg) planes.stride,
                b = in(reg) tiles.add((j - unit.j0) * B_TILE_BYTES),
                s64 = in(reg) 64usize,
                c = in(reg) unit.sums.add((j - unit.j0) * unit.m * TILE),
                options(nostack)
            );
        }
    }
}

/// `unit`'s scale step: per sub-block in order and token, `acc = fma(d, s_j, acc)` (and the
/// Q4_G min term), the accumulators carried from the chunk before through `y`.
///
/// # Safety
/// As [`group`]'s body, after [`products`] issued `unit`'s products.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn scale_step(planes: &Planes, unit: &Unit) {
    let Planes { weights, ws, xb, cols, stride, y, y_stride, mask } = *planes;
    let (t0, m) = (unit.t0, unit.m);
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); TILE];
        if unit.j0 > 0 {
            for (t, acc_t) in acc.iter_mut().enumerate().take(m) {
                *acc_t = _mm512_maskz_loadu_ps(mask, y.add((t0 + t) * y_stride));
            }
        }
        for j in unit.j0..unit.j1 {
            let d = unit.sums.add((j - unit.j0) * m * TILE) as *const f32;
            let [scale, min] = scales(weights, ws, j);
            for (t, acc_t) in acc.iter_mut().enumerate().take(m) {
                *acc_t = _mm512_fmadd_ps(_mm512_load_ps(d.add(t * TILE)), scale, *acc_t);
                if weights == Weights::Int4 {
                    let sum = (xb.add((t0 + t) * stride + 2 * cols + 4 * j) as *const f32).read_unaligned();
                    *acc_t = _mm512_fnmadd_ps(_mm512_set1_ps(sum), min, *acc_t);
                }
            }
        }
        for (t, acc_t) in acc.iter().enumerate().take(m) {
            _mm512_mask_storeu_ps(y.add((t0 + t) * y_stride), mask, *acc_t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amx::tdpbf16ps_chunk;
    use crate::reference::round_bf16;

    /// A small xorshift generator.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// A value in `[-1, 1)`.
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// Kinds of token [`activation`] makes.
    const KINDS: usize = 9;

    /// One activation of a token of kind `kind`: of every magnitude (kind 0 and any past 7);
    /// within 8 binary orders (4-bit codes' integer sums), or within 3 (int8 codes' too); only
    /// tiny ones (BF16 denormals, which packing zeroes); only ones just above packing's
    /// 2^-100; or of one sign, within 8, 9 or 10 orders and mostly of large significands (the
    /// last kind in the even columns only), whose sums with the largest codes pass 2^24 units; or
    /// near FP8's scaled chains' limit of 2^18, at it in one column in 23.
    fn activation(rng: &mut Rng, kind: usize, column: usize) -> f32 {
        match (kind, rng.next() % 23) {
            (1, k) => rng.unit() * (2.0f32).powi(k as i32 % 8 - 3),
            (2, 0) => 0.0,
            (2, k) => rng.unit() * (2.0f32).powi(k as i32 % 3),
            (3, _) => rng.unit() * 1e-38,
            (4, _) => rng.unit() * 1e-29,
            // Within 8 orders: int8 codes' sums pass 2^24 units.
            (5, 0) => 1.0078125 * 0.125,
            (5, _) => 1.9921875 * 16.0,
            // Within 9 orders: 4-bit codes' sums pass 2^24 units, their chains' not.
            (6, 0) => 1.0078125 * 0.0625,
            (6, k) => [1.9921875, 1.0][k as usize % 2] * 16.0,
            // Within 10 orders, large ones in even columns: 4-bit codes' even chains pass 2^24
            // units (and the first or last 16 columns' sums do not).
            (7, k) if column.is_multiple_of(2) && k != 0 => 1.9921875 * 16.0,
            (7, _) => 1.0078125 * 0.03125,
            (8, 0) => [262144.0, -262144.0][column % 2],
            (8, 1) => -261120.0,
            (8, _) => rng.unit() * 131072.0,
            (_, 0) => 0.0,
            (_, 1) => rng.unit() * 1e-32,
            (_, 2) => rng.unit() * 1e-38,
            (_, k) => rng.unit() * [1e-3f32, 0.1, 1.0, 40.0][k as usize % 4],
        }
    }

    /// Packing's vector integer forms are the scalar reference's bytes, over blocks of every
    /// kind of activation and the edges of the form: zeros of both signs, spans of 14 and 15
    /// orders, exponents at the limits, infinities and NaNs.
    #[test]
    fn vector_integer_forms_are_the_reference_bytes() {
        if !available() {
            return;
        }
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        let bits = |v: f32| round_bf16(v);
        let mut blocks: Vec<[u16; SUB]> =
            (0..400).map(|b| std::array::from_fn(|c| bits(activation(&mut rng, b % KINDS, c)))).collect();
        let edge = |pairs: &[(usize, u16)]| {
            let base = pairs.first().map_or(bits(1.5), |&(c, h)| if c == 0 { h } else { bits(1.5) });
            let mut block = [base; SUB];
            for &(c, h) in pairs {
                block[c] = h;
            }
            block
        };
        blocks.extend([
            [0u16; SUB],
            [0x8000; SUB],
            edge(&[(3, bits(1.0 / 16384.0))]),
            edge(&[(3, bits(1.0 / 32768.0))]),
            edge(&[(7, bits(-1.0 / 16384.0)), (8, 0x8000)]),
            // Smallest and largest exponents: 8 and 200 have forms, 7 and 201 none (a pair at
            // column 0 sets every column but the others given).
            edge(&[(0, 0x0480), (5, 0x0400)]),
            edge(&[(0, 0x0480), (5, 0x0380)]),
            edge(&[(0, 0x6400), (5, 0xE3FF)]),
            edge(&[(0, 0x6400), (5, 0x6480)]),
            edge(&[(31, 0x7F80)]),
            edge(&[(31, 0xFFC1)]),
        ]);
        for (b, block) in blocks.iter().enumerate() {
            let (mut want, mut got) =
                ([0xAAu8; crate::w16::INTEGER_BLOCK_BYTES], [0x55u8; crate::w16::INTEGER_BLOCK_BYTES]);
            crate::w16::IntegerBlock::write(block, &mut want);
            // SAFETY: the AMX family's CPUs have AVX-512 F/BW.
            unsafe { write_integer_block(block, &mut got) };
            assert_eq!(got, want, "block {b}: {block:04x?}");
        }
    }

    /// Wherever a one-token product takes a sub-block's integer sums ([`IntegerForm`]), they
    /// are the canonical `d` bit for bit: the measured `tdpbf16ps` model's, for every row,
    /// over tokens of every kind (checked at `d`, before scaling could hide a last bit).
    #[test]
    fn integer_sums_are_the_canonical_ones_wherever_taken() {
        if !available() {
            return;
        }
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        let cols = 2 * SUB;
        let stride = crate::w16::activation_stride(cols);
        for weights in [Weights::Int4, Weights::Int8] {
            let (mut taken, mut refused) = (0, 0);
            for token in 0..400 {
                let (wq, ws) = planes(&mut rng, weights, cols);
                let x: Vec<f32> = (0..cols).map(|c| activation(&mut rng, token % KINDS, c)).collect();
                let mut xb = vec![0u8; stride + crate::w16::integer_forms_len(cols)];
                crate::w16::pack_tokens(&x, cols, 0, 1, &mut xb, true);
                let xs: Vec<u16> = (0..cols).map(|c| u16::from_le_bytes([xb[2 * c], xb[2 * c + 1]])).collect();
                for j in 0..2 {
                    // SAFETY: AMX (and so VNNI) is available; `xb` is one packed row with its
                    // integer forms, the planes one whole group.
                    let d = unsafe {
                        let form = match weights {
                            Weights::Int4 => IntegerForm::of::<15>(xb.as_ptr(), cols, j),
                            _ => IntegerForm::of::<128>(xb.as_ptr(), cols, j),
                        };
                        let Some(form) = form else {
                            refused += 1;
                            continue;
                        };
                        taken += 1;
                        let d = match weights {
                            Weights::Int4 if j == 0 => int4_integers::<true, false>(wq.as_ptr(), [form, form])[0],
                            Weights::Int4 => int4_integers::<false, true>(wq.as_ptr(), [form, form])[1],
                            _ => int8_integer(wq.as_ptr().add(j * QUANTS_BYTES), form),
                        };
                        let mut lanes = [0.0f32; 16];
                        _mm512_storeu_ps(lanes.as_mut_ptr(), d);
                        lanes
                    };
                    for (lane, got) in d.into_iter().enumerate() {
                        let w: Vec<u16> = (0..SUB).map(|k| weight(weights, &wq, &ws, lane, j, k)).collect();
                        let want = tdpbf16ps_chunk(0.0, &w, &xs[j * SUB..(j + 1) * SUB]);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{weights:?}, token {token}, sub-block {j}, row {lane}"
                        );
                    }
                }
            }
            assert!(
                taken > 100 && refused > 100,
                "{weights:?}: {taken} sub-blocks took the integer sums, {refused} not"
            );
        }
    }

    /// One group's planes for `cols` columns with random codes (FP8: every code but the NaNs,
    /// zeros and subnormals included) and random normal scales (and Q4_G mins).
    fn planes(rng: &mut Rng, weights: Weights, cols: usize) -> (Vec<u8>, Vec<u8>) {
        let (quants_len, scales_len) = weights.group_lens(cols).expect("a valid shape");
        let quants = (0..quants_len)
            .map(|i| {
                let b = rng.next() as u8;
                // FP8 64-byte chunks cycle through three kinds: no zero exponent; every fifth
                // code zero (of either sign) and no subnormal; every fifth code with a zero
                // exponent, subnormals among them. Rows 0 and 1 of integer codes hold the
                // largest code (every 64-byte chunk holds 4 bytes of each of the 16 rows), so
                // that their sums reach past 2^24 units.
                let zero_exponent = b & 0x78 == 0;
                match (weights, i / 64 % 3) {
                    (Weights::Int4 | Weights::Int8, _) if i % 64 < 8 => 0xFF,
                    (Weights::Fp8, _) if b & 0x7F == 0x7F => 0x7E,
                    (Weights::Fp8, 0) if zero_exponent => b | 0x08,
                    (Weights::Fp8, 1) if b.is_multiple_of(5) => b & 0x80,
                    (Weights::Fp8, 1) if zero_exponent => b | 0x08,
                    (Weights::Fp8, _) if b.is_multiple_of(5) => b & 0x87,
                    _ => b,
                }
            })
            .collect();
        let mut scales = Vec::with_capacity(scales_len);
        while scales.len() < scales_len {
            let v = rng.unit() * [1e-3f32, 0.02, 1.0][rng.next() as usize % 3];
            if weights == Weights::Fp8 {
                scales.extend_from_slice(&v.to_le_bytes());
            } else {
                scales.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        (quants, scales)
    }

    /// Row `lane`'s weight `k` of sub-block `j` as the B tiles hold it (BF16 bits) and its
    /// sub-block's scale and min, in the module docs' terms.
    fn weight(weights: Weights, wq: &[u8], ws: &[u8], lane: usize, j: usize, k: usize) -> u16 {
        let value = match weights {
            Weights::Int4 => crate::q4k::quant_at(wq, lane, j, k) as f32,
            Weights::Int8 => ((wq[j * QUANTS_BYTES + (k / 4) * 64 + lane * 4 + k % 4] ^ 0x80) as i8) as f32,
            Weights::Fp8 => crate::w16::e4m3_to_f32(wq[j * QUANTS_BYTES + (k / 4) * 64 + lane * 4 + k % 4]) * 256.0,
        };
        let bits = round_bf16(value);
        assert_eq!(f32::from_bits((bits as u32) << 16), value, "every weight is exact in BF16");
        let _ = ws;
        bits
    }

    fn scale_min(weights: Weights, ws: &[u8], lane: usize, j: usize) -> (f32, f32) {
        let f16_at = |at: usize| half::f16::from_le_bytes([ws[at], ws[at + 1]]).to_f32();
        match weights {
            Weights::Int4 => crate::q4g::scale_min(ws, lane, j),
            Weights::Int8 => (f16_at(j * SCALES_BYTES + 2 * lane), 0.0),
            Weights::Fp8 => {
                let at = j * 2 * SCALES_BYTES + 4 * lane;
                (f32::from_le_bytes([ws[at], ws[at + 1], ws[at + 2], ws[at + 3]]) * (1.0 / 256.0), 0.0)
            }
        }
    }

    /// Both kernels of the family (one token on FMAs, more on AMX tiles) give every output the
    /// bits of the module docs' order over the measured `tdpbf16ps` model, for every format,
    /// token counts across tiles and chunks, a chunk tail, short groups, and activations of
    /// every magnitude (zeros, tiny ones that packing zeroes, large ones).
    #[test]
    fn both_kernels_follow_the_canonical_order_bit_for_bit() {
        if !available() {
            return;
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for weights in [Weights::Int4, Weights::Int8, Weights::Fp8] {
            // Sub-blocks of one-token products that took the integer sums; FP8 ones that took
            // the scaled chains, and that did not.
            let mut integer_blocks = 0;
            let mut fp8_blocks = [0; 2];
            for cols in [64usize, 576] {
                let (wq, ws) = planes(&mut rng, weights, cols);
                let stride = crate::w16::activation_stride(cols);
                let cases = [
                    (1usize, 16usize),
                    (1, 11),
                    (1, 16),
                    (1, 5),
                    (2, 16),
                    (5, 7),
                    (16, 16),
                    (17, 16),
                    (35, 3),
                    (1, 16),
                    (1, 16),
                    (1, 16),
                    (1, 16),
                    (1, 16),
                    (1, 16),
                    (1, 16),
                    (1, 16),
                    (1, 16),
                ];
                for (case, &(n, valid)) in cases.iter().enumerate() {
                    let x: Vec<f32> =
                        (0..n * cols).map(|i| activation(&mut rng, (i / cols + case) % KINDS, i % cols)).collect();
                    let mut xb = vec![0u8; n * stride + crate::w16::integer_forms_len(cols)];
                    crate::w16::pack_tokens(&x, cols, 0, n, &mut xb, n == 1);
                    if n == 1 && weights == Weights::Fp8 {
                        for j in 0..cols / SUB {
                            let scaled = (0..SUB).all(|k| {
                                let at = 2 * (j * SUB + k);
                                f32::from_bits((u16::from_le_bytes([xb[at], xb[at + 1]]) as u32) << 16).abs()
                                    < FP8_ACTIVATION_LIMIT
                            });
                            fp8_blocks[scaled as usize] += 1;
                        }
                    }
                    if n == 1 {
                        integer_blocks += (0..cols / SUB)
                            .filter(|&j| {
                                let at = crate::w16::integer_block_offset(cols, j);
                                let unit = f32::from_le_bytes([xb[at], xb[at + 1], xb[at + 2], xb[at + 3]]);
                                let abs = |h: usize| {
                                    let at = at + 8 + 4 * h;
                                    i32::from_le_bytes([xb[at], xb[at + 1], xb[at + 2], xb[at + 3]]) as i64
                                };
                                let w = if weights == Weights::Int4 { 15 } else { 128 };
                                unit != 0.0 && w * abs(0).max(abs(1)) < 1 << 24
                            })
                            .count();
                    }
                    let mut y = vec![f32::NAN; n * 16];
                    // SAFETY: AMX is available; the planes are one whole group, `xb` `n` packed
                    // rows, `y` `n` rows of 16.
                    unsafe { group(weights, n, &wq, &ws, cols, &xb, stride, y.as_mut_ptr(), 16, valid, false, n == 1) };
                    for t in 0..n {
                        let row = &xb[t * stride..(t + 1) * stride];
                        let xs: Vec<u16> =
                            (0..cols).map(|c| u16::from_le_bytes([row[2 * c], row[2 * c + 1]])).collect();
                        for lane in 0..16 {
                            let got = y[t * 16 + lane];
                            if lane >= valid {
                                assert!(got.is_nan(), "row {lane} past `valid` is left alone");
                                continue;
                            }
                            let mut acc = 0.0f32;
                            for j in 0..cols / SUB {
                                let w: Vec<u16> = (0..SUB).map(|k| weight(weights, &wq, &ws, lane, j, k)).collect();
                                let d = tdpbf16ps_chunk(0.0, &w, &xs[j * SUB..(j + 1) * SUB]);
                                let (scale, min) = scale_min(weights, &ws, lane, j);
                                acc = d.mul_add(scale, acc);
                                if weights == Weights::Int4 {
                                    let at = 2 * cols + 4 * j;
                                    let sum = f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]);
                                    acc = (-sum).mul_add(min, acc);
                                }
                            }
                            assert_eq!(
                                got.to_bits(),
                                acc.to_bits(),
                                "{weights:?}, {cols} columns, {n} tokens: token {t}, row {lane}: {got:e} vs {acc:e}"
                            );
                        }
                    }
                }
            }
            if weights != Weights::Fp8 {
                assert!(integer_blocks > 0, "{weights:?}: no one-token sub-block took the integer sums");
            } else {
                assert!(
                    fp8_blocks.iter().all(|&b| b > 0),
                    "FP8 one-token sub-blocks off and on the scaled chains: {fp8_blocks:?}"
                );
            }
        }
    }
}
