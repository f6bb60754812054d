//! BF16 matrix products on Intel AMX tiles (`tdpbf16ps`): `y = bf16(x) · Wᵀ` with f32
//! accumulation, for BF16 weights, under `Precision::Bf16`.
//!
//! One AMX instruction multiplies a 16 × 32 BF16 tile by a 32 × 16 one into a 16 × 16 f32 tile
//! (16 384 FLOP); a core sustains about one per 16 cycles, some 2 TFLOP/s, fifteen times what
//! the f32 FMA units deliver. The formulation here needs no repacking of the weights:
//!
//! - **A** (16 rows × 64 bytes): 16 weight rows × 32 columns, loaded straight from the
//!   row-major `[rows, cols]` weight with the row stride.
//! - **B** (16 rows × 64 bytes): the activations of 16 tokens × 32 columns in AMX's pair
//!   layout, row `i` holding `(x[t][2i], x[t][2i + 1])` for `t = 0..16`. [`pack_tokens`] writes
//!   this layout once per call, rounding to BF16 (round to nearest even) and padding with zeros
//!   to whole tiles.
//! - **C** (16 × 16 f32): `C[r][t] += Σ A[r][k] · B[k][t]`, stored and written transposed into
//!   `y[t][r]`.
//!
//! **Batch invariance** (DESIGN.md invariant 7): an output `y[t, r]` is `tdpbf16ps` applied
//! to `C[r][t] = 0` for column chunks `0..32, 32..64, …` in order, each chunk's contribution
//! depending only on weight row `r` and token `t`'s packed values; the last partial chunk is
//! zero-padded on both sides (zero products add exactly nothing). So every output has the same
//! bits whatever the number of tokens, the tile it lands in, the thread or the grouping of
//! matrices: decode (one token) runs this same code with a zero-padded B tile. What one
//! `tdpbf16ps` adds for a chunk was measured, not taken from the SDM's older pseudo-code (one
//! rounded addition per product, which matches 1 output in 32): the chunk's 16 even products
//! summed in order into one f32, the 16 odd ones into another, then `C += even + odd`, with
//! denormals read as zero and flushed. A test checks every output against that model.
//!
//! **Tiled weights** ([`tile_weights`], [`gemm_tiled_rows`]): under `Precision::Bf16` the
//! engine copies each matrix of whole 16 × 32 tiles at load into B-tile order (per 16-row block,
//! its 1 KiB tiles one after another), and the roles swap: the tokens are the A tiles (one row
//! in decode), the weights the B tiles, and a C tile is `y`'s own layout. Each output is the
//! same `tdpbf16ps` chain over the same chunks, so the bits are those of [`gemm_rows`]; decode
//! streams whole tiles in sequence instead of 16 strided rows, prefetched half a tile ahead.
//!
//! Every function here must only be called once [`crate::bf16_kernels`] returned `Amx` (which
//! also obtained the kernel's permission for this process to use AMX state).

use std::arch::asm;

#[cfg(test)]
use crate::reference::round_bf16;

/// Rows, tokens and packed pair rows per tile.
pub const TILE: usize = 16;
/// Columns (BF16 elements) per tile's K dimension.
pub const TILE_K: usize = 32;
/// `u16` elements of one packed B tile (16 pair rows × 16 tokens × 2).
pub const PACKED_TILE: usize = TILE * TILE_K;

/// The tile configuration (`ldtilecfg`'s 64-byte operand): palette 1, tiles 0-7 all 16 rows of
/// 64 bytes.
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

pub(crate) const CONFIG: TileConfig = TileConfig::new([64; 8], [16; 8]);

impl TileConfig {
    /// Palette 1 with tiles 0-7 of `bytes_per_row[t]` bytes and `rows[t]` rows each (tiles
    /// 8-15 unused).
    pub(crate) const fn new(bytes_per_row: [u16; 8], rows: [u8; 8]) -> TileConfig {
        let mut config =
            TileConfig { palette: 1, start_row: 0, reserved: [0; 14], bytes_per_row: [0; 16], rows: [0; 16] };
        let mut t = 0;
        while t < 8 {
            config.bytes_per_row[t] = bytes_per_row[t];
            config.rows[t] = rows[t];
            t += 1;
        }
        config
    }
}

/// Asks Linux for permission to use AMX tile data in this process (`arch_prctl(
/// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) after checking CPUID for AMX-TILE and AMX-BF16.
/// Returns whether AMX BF16 can be used.
pub fn request_permission() -> bool {
    // CPUID leaf 7 exists on every x86_64 CPU that reports AVX-512 (checked by the caller).
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
    if !(amx_bf16 && amx_tile) {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` only changes this
        // process's permitted XSAVE features; it takes two integer arguments and clobbers rcx
        // and r11 as every syscall does.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Whether this CPU has AMX-INT8 (CPUID leaf 7, EDX bit 25) besides what
/// [`request_permission`] checks; call after it granted AMX.
pub fn has_int8() -> bool {
    std::arch::x86_64::__cpuid_count(7, 0).edx & (1 << 25) != 0
}

/// The tiles of [`sub_block_sums_i8`]: tmm0 holds 16 token rows of 32 signed activation bytes,
/// tmm1 8 rows of 64 bytes (16 weight rows × 4 unsigned bytes, VNNI order), tmm2 the 16 × 16
/// i32 sums.
pub(crate) const INT8_CONFIG: TileConfig = TileConfig::new([32, 64, 64, 0, 0, 0, 0, 0], [16, 8, 16, 0, 0, 0, 0, 0]);

/// A 16 × 16 tile of i32 sums as [`sub_block_sums_i8`] stores it: row `u` (token) holds the 16
/// weight rows' sums.
#[repr(C, align(64))]
pub(crate) struct SumsTile(pub(crate) [i32; TILE * TILE]);

impl SumsTile {
    pub(crate) fn new() -> SumsTile {
        SumsTile([0; TILE * TILE])
    }
}

/// Loads `config` into the tile registers' configuration.
///
/// # Safety
/// AMX permission was granted ([`request_permission`]).
#[inline]
pub(crate) unsafe fn load_config(config: &TileConfig) {
    // SAFETY: the caller's contract; `config` is a valid 64-byte palette-1 configuration.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) config as *const TileConfig, options(nostack, readonly)) };
}

/// Releases the tile state ([`load_config`]'s counterpart).
///
/// # Safety
/// AMX permission was granted.
#[inline]
pub(crate) unsafe fn release() {
    // SAFETY: the caller's contract.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The exact integer sums of one 32-column sub-block for 16 tokens × 16 weight rows
/// (`tdpbsud`): `c[16u + r] = Σ_k x[u · x_stride + k] · w_r[k]`, the activations signed bytes at
/// `x` (token `u`'s 32 at `x + u · x_stride`), the weights 512 unsigned bytes at `w` in
/// `vpdpbusd` order (vector `k` of 64 bytes holds columns `4k..4k + 4` of the 16 rows), the same
/// integers `vpdpbusd` sums.
///
/// # Safety
/// AMX-INT8 is available and permitted, [`INT8_CONFIG`] is loaded ([`load_config`]); the 16
/// token rows, the 512 weight bytes and the 256 i32 at `c` are valid.
#[inline(always)]
pub(crate) unsafe fn sub_block_sums_i8(x: *const u8, x_stride: usize, w: *const u8, c: *mut i32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "tileloadd tmm0, [{x} + {xs}*1]",
            "tileloadd tmm1, [{w} + {ws}*1]",
            "tilezero tmm2",
            "tdpbsud tmm2, tmm0, tmm1",
            "tilestored [{c} + {ws}*1], tmm2",
            x = in(reg) x,
            xs = in(reg) x_stride,
            w = in(reg) w,
            ws = in(reg) 64usize,
            c = in(reg) c,
            options(nostack)
        )
    };
}

/// `u16` elements [`pack_tokens`] writes for `n_tokens` tokens of `cols` columns.
pub fn packed_len(n_tokens: usize, cols: usize) -> usize {
    n_tokens.div_ceil(TILE) * cols.div_ceil(TILE_K) * PACKED_TILE
}

/// Packs tokens `t0..t1` of `x` (`(n_tokens, cols)` row-major, `t0` a multiple of 16) into
/// their B tiles: for token block `b` and column chunk `c`, the tile at `out[(b · chunks + c) ·
/// 512 ..]` holds in row `i`, lane pair `t`, the BF16 values of `x[16b + t][32c + 2i ..= 32c +
/// 2i + 1]`, zero beyond the last token or column.
///
/// `out` is the whole packed buffer ([`packed_len`] of all tokens); only the tiles of blocks
/// `t0 / 16 .. t1.div_ceil(16)` are written. Rounding is `reference::round_bf16`'s, bit for bit.
pub fn pack_tokens(x: &[f32], cols: usize, t0: usize, t1: usize, out: &mut [u16]) {
    let chunks = cols.div_ceil(TILE_K);
    assert!(t0.is_multiple_of(TILE) && x.len() >= t1 * cols, "pack_tokens: bad token range");
    let b1 = t1.div_ceil(TILE);
    assert!(out.len() >= b1 * chunks * PACKED_TILE, "pack_tokens: output too short");
    // Padding tokens of the last block are zero in every tile.
    if t1 < b1 * TILE {
        let b = b1 - 1;
        for c in 0..chunks {
            let tile = &mut out[(b * chunks + c) * PACKED_TILE..(b * chunks + c + 1) * PACKED_TILE];
            for i in 0..TILE {
                for t in t1 - b * TILE..TILE {
                    tile[i * 2 * TILE + 2 * t] = 0;
                    tile[i * 2 * TILE + 2 * t + 1] = 0;
                }
            }
        }
    }
    for token in t0..t1 {
        let (b, t) = (token / TILE, token % TILE);
        let row = &x[token * cols..(token + 1) * cols];
        for c in 0..chunks {
            let k0 = c * TILE_K;
            let kn = TILE_K.min(cols - k0);
            let tile = &mut out[(b * chunks + c) * PACKED_TILE..(b * chunks + c + 1) * PACKED_TILE];
            let mut pairs = [0u16; TILE_K];
            // SAFETY: the AMX kernels exist only where AVX-512 F/BW was detected; `row[k0..k0 +
            // kn]` is readable and `pairs` holds 32 elements.
            unsafe { round_chunk(row.as_ptr().add(k0), kn, &mut pairs) };
            // Pair `i` (elements 2i, 2i + 1) goes to tile row `i`, lane pair `t`.
            for i in 0..TILE {
                tile[i * 2 * TILE + 2 * t] = pairs[2 * i];
                tile[i * 2 * TILE + 2 * t + 1] = pairs[2 * i + 1];
            }
        }
    }
}

/// Rounds `n <= 32` consecutive f32 at `src` to BF16 (as `reference::round_bf16`) into `out`, zeros
/// after them.
///
/// # Safety
/// AVX-512 F/BW are available; `src` is valid for reading `n` f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn round_chunk(src: *const f32, n: usize, out: &mut [u16; TILE_K]) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract; `out` is 64 bytes.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, round32(src, n)) };
}

/// `n <= 32` consecutive f32 at `src` rounded to BF16 (as `reference::round_bf16`), in order in
/// the 32 u16 lanes of one vector, zeros after them.
///
/// # Safety
/// AVX-512 F/BW are available; `src` is valid for reading `n` f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(crate) unsafe fn round32(src: *const f32, n: usize) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let lo_mask: __mmask16 = if n >= 16 { 0xFFFF } else { ((1u32 << n) - 1) as __mmask16 };
    let hi_mask: __mmask16 = if n >= 32 {
        0xFFFF
    } else if n > 16 {
        ((1u32 << (n - 16)) - 1) as __mmask16
    } else {
        0
    };
    // SAFETY: masked loads read only the `n` valid elements.
    unsafe {
        let r0 = round16(_mm512_maskz_loadu_ps(lo_mask, src));
        let r1 = round16(_mm512_maskz_loadu_ps(hi_mask, src.add(16.min(n))));
        // Each lane holds a value below 2^16, so the signed-saturating pack is exact; it packs
        // per 128-bit lane, which the permutation puts back in order.
        let packed = _mm512_packus_epi32(r0, r1);
        _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), packed)
    }
}

/// Sixteen f32 rounded to BF16 (nearest even, NaN kept quiet), each in the low half of a u32
/// lane: `reference::round_bf16` lane by lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(crate) fn round16(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let bits = _mm512_castps_si512(v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

/// Bytes of packed activations one token super-block may take (half of a 2 MiB L2).
const TOKEN_BLOCK_BYTES: usize = 1024 * 1024;

/// A 16 × 16 f32 result tile.
#[repr(C, align(64))]
struct CTile([f32; TILE * TILE]);

/// A zero-padded 16 × 32 BF16 weight tile, for row and column tails.
#[repr(C, align(64))]
struct ATile([u16; TILE * TILE_K]);

/// Writes `tile[r][t]` (`r < nr`, `t < nt`) to `y[t * y_stride + r]`.
///
/// # Safety
/// `y` must be valid for those writes.
#[inline]
unsafe fn store_transposed(tile: &CTile, nr: usize, nt: usize, y: *mut f32, y_stride: usize) {
    for t in 0..nt {
        for r in 0..nr {
            // SAFETY: the caller's contract.
            unsafe { *y.add(t * y_stride + r) = tile.0[r * TILE + t] };
        }
    }
}

/// Computes output rows `r0..r1` of `y = bf16(x) · Wᵀ` for all `n_tokens` tokens from the
/// packed activations.
///
/// Rows go in pairs of 16-row tiles (four C tiles for two A and two B tiles, 8 tile registers);
/// inside a row pair, token blocks go in pairs. Each weight tile is read from memory once per
/// token block pair and from cache after; `r0` must be a multiple of 16 or `r1 == rows`
/// (callers split work in 32-row units), so only the matrix's last rows take the padded path.
///
/// # Safety
/// AMX permission was granted ([`request_permission`]); `w` points to `rows × cols` BF16
/// weights (row stride `cols · 2` bytes) with `r1 <= rows`; `packed` holds [`packed_len`]
/// `(n_tokens, cols)` elements written by [`pack_tokens`]; `y` is valid for writing
/// `y[t * y_stride + r]` for `t < n_tokens`, `r0 <= r < r1`, which no one else accesses
/// meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_rows(
    w: *const u8,
    rows: usize,
    cols: usize,
    packed: &[u16],
    n_tokens: usize,
    y: *mut f32,
    y_stride: usize,
    r0: usize,
    r1: usize,
) {
    debug_assert!(r1 <= rows && packed.len() >= packed_len(n_tokens, cols));
    let row_bytes = cols * 2;
    let chunks = cols.div_ceil(TILE_K);
    // Chunks whose 32 columns all lie inside the row, loaded straight from the weights.
    let full_chunks = cols / TILE_K;
    let blocks = n_tokens.div_ceil(TILE);
    let mut c_tiles =
        [CTile([0.0; TILE * TILE]), CTile([0.0; TILE * TILE]), CTile([0.0; TILE * TILE]), CTile([0.0; TILE * TILE])];
    let mut pad = [ATile([0; TILE * TILE_K]), ATile([0; TILE * TILE_K])];
    // SAFETY (whole body): AMX is permitted; every tile load reads 16 rows of 64 bytes from
    // either weight rows `< r1 <= rows` at columns `< 32 · full_chunks <= cols`, a padded stack
    // tile, or a packed B tile inside `packed`; stores go to the stack C tiles.
    unsafe {
        load_config(&CONFIG);
        // Token super-blocks whose packed tiles (about `TOKEN_BLOCK_BYTES`) stay in L2 while
        // every row pair of the task runs over them; the weights are read once per super-block.
        let super_blocks = (TOKEN_BLOCK_BYTES / (chunks * PACKED_TILE * 2)).max(2) & !1;
        let mut sb = 0;
        while sb < blocks {
            let sb_end = (sb + super_blocks).min(blocks);
            let mut r = r0;
            while r < r1 {
                let nr = (r1 - r).min(2 * TILE);
                // Row tiles of this step: (rows in tile, direct pointer or None for the padded path).
                let rows_a = [nr.min(TILE), nr.saturating_sub(TILE)];
                let two_a = rows_a[1] > 0;
                let mut b = sb;
                while b < sb_end {
                    let two_b = b + 1 < sb_end;
                    asm!("tilezero tmm4", "tilezero tmm5", "tilezero tmm6", "tilezero tmm7", options(nostack, nomem));
                    for c in 0..chunks {
                        // A tiles: tmm0 (rows r..r+16), tmm1 (rows r+16..r+32).
                        for (i, &n_rows) in rows_a.iter().enumerate() {
                            if n_rows == 0 {
                                continue;
                            }
                            let first = r + i * TILE;
                            let (ptr, stride) = if n_rows == TILE && c < full_chunks {
                                (w.add(first * row_bytes + c * TILE_K * 2), row_bytes)
                            } else {
                                // The padded path: copy the rows' chunk, zeros elsewhere.
                                let k0 = c * TILE_K;
                                let kn = TILE_K.min(cols - k0);
                                let tile = &mut pad[i].0;
                                tile.fill(0);
                                for rr in 0..n_rows {
                                    let src = w.add((first + rr) * row_bytes + k0 * 2) as *const u16;
                                    for k in 0..kn {
                                        tile[rr * TILE_K + k] = std::ptr::read_unaligned(src.add(k));
                                    }
                                }
                                (tile.as_ptr() as *const u8, TILE_K * 2)
                            };
                            if i == 0 {
                                asm!("tileloadd tmm0, [{0} + {1}*1]", in(reg) ptr, in(reg) stride, options(nostack, readonly));
                            } else {
                                asm!("tileloadd tmm1, [{0} + {1}*1]", in(reg) ptr, in(reg) stride, options(nostack, readonly));
                            }
                        }
                        // B tiles: tmm2 (tokens 16b..16b+16), tmm3 (the next block).
                        let b0 = packed.as_ptr().add((b * chunks + c) * PACKED_TILE);
                        asm!("tileloadd tmm2, [{0} + {1}*1]", in(reg) b0, in(reg) 64usize, options(nostack, readonly));
                        if two_b {
                            let b1 = packed.as_ptr().add(((b + 1) * chunks + c) * PACKED_TILE);
                            asm!("tileloadd tmm3, [{0} + {1}*1]", in(reg) b1, in(reg) 64usize, options(nostack, readonly));
                        }
                        // C: tmm4 = A0·B0, tmm5 = A0·B1, tmm6 = A1·B0, tmm7 = A1·B1.
                        match (two_a, two_b) {
                            (true, true) => asm!(
                                "tdpbf16ps tmm4, tmm0, tmm2",
                                "tdpbf16ps tmm5, tmm0, tmm3",
                                "tdpbf16ps tmm6, tmm1, tmm2",
                                "tdpbf16ps tmm7, tmm1, tmm3",
                                options(nostack, nomem)
                            ),
                            (true, false) => {
                                asm!(
                                    "tdpbf16ps tmm4, tmm0, tmm2",
                                    "tdpbf16ps tmm6, tmm1, tmm2",
                                    options(nostack, nomem)
                                )
                            }
                            (false, true) => {
                                asm!(
                                    "tdpbf16ps tmm4, tmm0, tmm2",
                                    "tdpbf16ps tmm5, tmm0, tmm3",
                                    options(nostack, nomem)
                                )
                            }
                            (false, false) => asm!("tdpbf16ps tmm4, tmm0, tmm2", options(nostack, nomem)),
                        }
                    }
                    // Store the C tiles and write them transposed into y.
                    let stride = TILE * 4;
                    asm!(
                        "tilestored [{0} + {s}*1], tmm4",
                        "tilestored [{1} + {s}*1], tmm5",
                        "tilestored [{2} + {s}*1], tmm6",
                        "tilestored [{3} + {s}*1], tmm7",
                        in(reg) c_tiles[0].0.as_mut_ptr(),
                        in(reg) c_tiles[1].0.as_mut_ptr(),
                        in(reg) c_tiles[2].0.as_mut_ptr(),
                        in(reg) c_tiles[3].0.as_mut_ptr(),
                        s = in(reg) stride,
                        options(nostack)
                    );
                    let nt0 = TILE.min(n_tokens - b * TILE);
                    let nt1 = if two_b { TILE.min(n_tokens - (b + 1) * TILE) } else { 0 };
                    let y0 = y.add(b * TILE * y_stride + r);
                    store_transposed(&c_tiles[0], rows_a[0], nt0, y0, y_stride);
                    if two_b {
                        store_transposed(&c_tiles[1], rows_a[0], nt1, y0.add(TILE * y_stride), y_stride);
                    }
                    if two_a {
                        store_transposed(&c_tiles[2], rows_a[1], nt0, y0.add(TILE), y_stride);
                        if two_b {
                            store_transposed(&c_tiles[3], rows_a[1], nt1, y0.add(TILE * y_stride + TILE), y_stride);
                        }
                    }
                    b += if two_b { 2 } else { 1 };
                }
                r += nr;
            }
            sb = sb_end;
        }
        release();
    }
}

/// How far ahead of the weight tile being multiplied [`gemm_tiled_rows`] prefetches, in bytes
/// (measured in decode on qwen3-0.6b-shaped, 2 threads: 128 to 512 bytes all gave 29-31 GB/s,
/// 1024 and more 27-29, none 26.9-27.3).
const PREFETCH_AHEAD: usize = 512;

/// Bytes of one weight tile in the tiled layout ([`tile_weights`]): 16 pair rows × 16 weight
/// rows × 2 BF16.
pub const WEIGHT_TILE_BYTES: usize = TILE * TILE_K * 2;

/// Whether a `[rows, cols]` matrix takes the tiled layout: whole tiles of 16 rows and 32
/// columns.
pub fn tileable(rows: usize, cols: usize) -> bool {
    rows > 0 && cols > 0 && rows.is_multiple_of(TILE) && cols.is_multiple_of(TILE_K)
}

/// Copies a row-major `[rows, cols]` BF16 matrix (`w`, `rows · cols · 2` bytes, [`tileable`])
/// into its B tiles, `out` of the same length: for row block `rb` (rows `16rb..16rb + 16`)
/// and column chunk `c`, the 1 KiB tile at `out[(rb · chunks + c) · 1024 ..]` holds in row `i`,
/// lane pair `n`, the values `w[16rb + n][32c + 2i ..= 32c + 2i + 1]`. Each row block keeps the
/// bytes it had (its 16 rows, reordered inside), so a range of whole row blocks is the same
/// byte range in both layouts.
pub fn tile_weights(w: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    assert!(tileable(rows, cols) && w.len() == rows * cols * 2 && out.len() == w.len(), "tile_weights: bad shape");
    let (chunks, pairs_per_row) = (cols / TILE_K, cols / 2);
    for rb in 0..rows / TILE {
        for c in 0..chunks {
            let tile = &mut out[(rb * chunks + c) * WEIGHT_TILE_BYTES..(rb * chunks + c + 1) * WEIGHT_TILE_BYTES];
            for n in 0..TILE {
                // Row `16rb + n`'s 16 pairs of this chunk go down lane pair `n`.
                let row_pairs = ((rb * TILE + n) * pairs_per_row + c * TILE) * 4;
                for i in 0..TILE {
                    let src = row_pairs + i * 4;
                    let dst = (i * TILE + n) * 4;
                    tile[dst..dst + 4].copy_from_slice(&w[src..src + 4]);
                }
            }
        }
    }
}

/// Reads row `r` of a matrix in the tiled layout back as f32: the inverse of [`tile_weights`]
/// for one row, widened (the layout test reads every row back through it).
pub fn widen_tiled_row(tiles: &[u8], rows: usize, cols: usize, r: usize, out: &mut [f32]) {
    assert!(tileable(rows, cols) && tiles.len() == rows * cols * 2 && r < rows && out.len() >= cols);
    let (chunks, rb, n) = (cols / TILE_K, r / TILE, r % TILE);
    for c in 0..chunks {
        let tile = &tiles[(rb * chunks + c) * WEIGHT_TILE_BYTES..];
        for i in 0..TILE {
            let at = (i * TILE + n) * 4;
            for j in 0..2 {
                let bits = u16::from_le_bytes([tile[at + 2 * j], tile[at + 2 * j + 1]]);
                out[c * TILE_K + 2 * i + j] = f32::from_bits((bits as u32) << 16);
            }
        }
    }
}

/// Packs tokens `t0..t1` of `x` (`(n_tokens, cols)` row-major, `t0` a multiple of 16, `cols` a
/// multiple of 32) into A tiles, for the products over tiled weights ([`gemm_tiled_rows`]):
/// for token block `b` and column chunk `c`, the tile at `out[(b · chunks + c) · 512 ..]` holds
/// in row `t` the 32 BF16 values of `x[16b + t][32c..32c + 32]`, rows past the last token zero.
///
/// `out` is the whole packed buffer ([`packed_len`] of all tokens); only the tiles of blocks
/// `t0 / 16 .. t1.div_ceil(16)` are written. Rounding is `reference::round_bf16`'s, bit for bit.
pub fn pack_token_rows(x: &[f32], cols: usize, t0: usize, t1: usize, out: &mut [u16]) {
    let chunks = cols / TILE_K;
    assert!(
        cols.is_multiple_of(TILE_K) && t0.is_multiple_of(TILE) && x.len() >= t1 * cols,
        "pack_token_rows: bad token range or columns"
    );
    let b1 = t1.div_ceil(TILE);
    assert!(out.len() >= b1 * chunks * PACKED_TILE, "pack_token_rows: output too short");
    // Padding tokens of the last block are zero in every tile.
    if t1 < b1 * TILE {
        let b = b1 - 1;
        for c in 0..chunks {
            let tile = &mut out[(b * chunks + c) * PACKED_TILE..(b * chunks + c + 1) * PACKED_TILE];
            tile[(t1 - b * TILE) * TILE_K..].fill(0);
        }
    }
    for token in t0..t1 {
        let (b, t) = (token / TILE, token % TILE);
        let row = &x[token * cols..(token + 1) * cols];
        for c in 0..chunks {
            let at = (b * chunks + c) * PACKED_TILE + t * TILE_K;
            let dst: &mut [u16; TILE_K] = (&mut out[at..at + TILE_K]).try_into().expect("32 elements");
            // SAFETY: the AMX kernels exist only where AVX-512 F/BW was detected; `row[32c..32c
            // + 32]` is readable.
            unsafe { round_chunk(row.as_ptr().add(c * TILE_K), TILE_K, dst) };
        }
    }
}

/// Computes output rows `r0..r1` of `y = bf16(x) · Wᵀ` for all `n_tokens` tokens, over weights
/// in the tiled layout ([`tile_weights`]) and activations packed by [`pack_token_rows`]: the
/// roles of [`gemm_rows`] swapped, the tokens the A tiles (as many rows as the call has tokens,
/// up to 16) and the weights the B tiles, so a C tile is `y`'s own layout, stored straight into
/// it. Each output is the same chain of `tdpbf16ps` over the column chunks in order as
/// [`gemm_rows`] computes, so the bits are the same.
///
/// Decode (one token) reads each row block's 1 KiB tiles in sequence, two row blocks at a
/// time, with a one-row A tile. In qwen3-0.6b-shaped's decode on 2 threads the weights were
/// read at 29.5-30.8 GB/s against 21.1-21.5 for [`gemm_rows`], whose 16 weight rows are 16
/// strided streams (BENCHMARKS.md).
///
/// # Safety
/// AMX permission was granted ([`request_permission`]); `tiles` points to `rows × cols` BF16
/// weights in the tiled layout ([`tileable`]); `r0` and `r1` are multiples of 16 with `r1 <=
/// rows`; `packed` holds [`packed_len`]`(n_tokens, cols)` elements written by
/// [`pack_token_rows`]; `y` is valid for writing `y[t * y_stride + r]` for `t < n_tokens`, `r0
/// <= r < r1`, which no one else accesses meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_tiled_rows(
    tiles: *const u8,
    rows: usize,
    cols: usize,
    packed: &[u16],
    n_tokens: usize,
    y: *mut f32,
    y_stride: usize,
    r0: usize,
    r1: usize,
) {
    debug_assert!(tileable(rows, cols) && r1 <= rows && r0.is_multiple_of(TILE) && r1.is_multiple_of(TILE));
    debug_assert!(packed.len() >= packed_len(n_tokens, cols));
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    if n_tokens == 0 {
        return;
    }
    let chunks = cols / TILE_K;
    let blocks = n_tokens.div_ceil(TILE);
    // A and C tiles have as many rows as a token block has tokens (all blocks but the last are
    // full; a short last block of a longer call is zero-padded and stored through `spill`).
    let m = n_tokens.min(TILE) as u8;
    let config = TileConfig::new([64; 8], [m, m, 16, 16, m, m, m, m]);
    let block_bytes = chunks * WEIGHT_TILE_BYTES;
    let mut spill = CTile([0.0; TILE * TILE]);
    // SAFETY (whole body): AMX is permitted; every weight tile load reads 1 KiB inside row
    // blocks `r0 / 16 .. r1 / 16` of the tiled weights; every token tile load reads `m` rows of
    // 64 bytes inside `packed`; stores go to `y` rows `r0..r1` of the block's tokens (when the
    // block has `m` tokens) or to `spill`.
    unsafe {
        load_config(&config);
        // Token super-blocks whose packed tiles stay in L2 while every row pair of the task
        // runs over them; the weights are read once per super-block.
        let super_blocks = (TOKEN_BLOCK_BYTES / (chunks * PACKED_TILE * 2)).max(2) & !1;
        let mut store = |b: usize, r: usize, tile: u8| {
            let nt = TILE.min(n_tokens - b * TILE);
            let dst = y.add(b * TILE * y_stride + r);
            let (ptr, stride) = if nt == m as usize { (dst, y_stride * 4) } else { (spill.0.as_mut_ptr(), TILE * 4) };
            match tile {
                4 => asm!("tilestored [{0} + {1}*1], tmm4", in(reg) ptr, in(reg) stride, options(nostack)),
                5 => asm!("tilestored [{0} + {1}*1], tmm5", in(reg) ptr, in(reg) stride, options(nostack)),
                6 => asm!("tilestored [{0} + {1}*1], tmm6", in(reg) ptr, in(reg) stride, options(nostack)),
                _ => asm!("tilestored [{0} + {1}*1], tmm7", in(reg) ptr, in(reg) stride, options(nostack)),
            }
            if nt != m as usize {
                for t in 0..nt {
                    std::ptr::copy_nonoverlapping(spill.0.as_ptr().add(t * TILE), dst.add(t * y_stride), TILE);
                }
            }
        };
        let mut sb = 0;
        while sb < blocks {
            let sb_end = (sb + super_blocks).min(blocks);
            let mut r = r0;
            while r < r1 {
                // Weight tiles: tmm2 (rows r..r + 16), tmm3 (rows r + 16..r + 32).
                let two_w = r + TILE < r1;
                let w0 = tiles.add((r / TILE) * block_bytes);
                let w1 = w0.add(block_bytes);
                let mut b = sb;
                while b < sb_end {
                    // Token tiles: tmm0 (tokens 16b..16b + 16), tmm1 (the next block).
                    let two_x = b + 1 < sb_end;
                    let x0 = packed.as_ptr().add(b * chunks * PACKED_TILE);
                    let x1 = x0.add(chunks * PACKED_TILE);
                    asm!("tilezero tmm4", "tilezero tmm5", "tilezero tmm6", "tilezero tmm7", options(nostack, nomem));
                    for c in 0..chunks {
                        // The lines from half a tile ahead, for both weight streams: with
                        // them decode read 29.5-30.8 GB/s against 26.9-27.3 without.
                        for line in 0..WEIGHT_TILE_BYTES / 64 {
                            let ahead = c * WEIGHT_TILE_BYTES + PREFETCH_AHEAD + line * 64;
                            _mm_prefetch::<_MM_HINT_T0>(w0.wrapping_add(ahead) as *const i8);
                            if two_w {
                                _mm_prefetch::<_MM_HINT_T0>(w1.wrapping_add(ahead) as *const i8);
                            }
                        }
                        // C: tmm4 = X0·W0, tmm5 = X1·W0, tmm6 = X0·W1, tmm7 = X1·W1.
                        asm!(
                            "tileloadd tmm0, [{x} + {s}*1]",
                            "tileloadd tmm2, [{w} + {s}*1]",
                            "tdpbf16ps tmm4, tmm0, tmm2",
                            x = in(reg) x0.add(c * PACKED_TILE),
                            w = in(reg) w0.add(c * WEIGHT_TILE_BYTES),
                            s = in(reg) 64usize,
                            options(nostack, readonly)
                        );
                        if two_w {
                            asm!(
                                "tileloadd tmm3, [{w} + {s}*1]",
                                "tdpbf16ps tmm6, tmm0, tmm3",
                                w = in(reg) w1.add(c * WEIGHT_TILE_BYTES),
                                s = in(reg) 64usize,
                                options(nostack, readonly)
                            );
                        }
                        if two_x {
                            asm!(
                                "tileloadd tmm1, [{x} + {s}*1]",
                                "tdpbf16ps tmm5, tmm1, tmm2",
                                x = in(reg) x1.add(c * PACKED_TILE),
                                s = in(reg) 64usize,
                                options(nostack, readonly)
                            );
                            if two_w {
                                asm!("tdpbf16ps tmm7, tmm1, tmm3", options(nostack, nomem));
                            }
                        }
                    }
                    store(b, r, 4);
                    if two_x {
                        store(b + 1, r, 5);
                    }
                    if two_w {
                        store(b, r + TILE, 6);
                        if two_x {
                            store(b + 1, r + TILE, 7);
                        }
                    }
                    b += if two_x { 2 } else { 1 };
                }
                r += if two_w { 2 * TILE } else { TILE };
            }
            sb = sb_end;
        }
        release();
    }
}

#[cfg(test)]
/// `tdpbf16ps` on one 32-column chunk as measured on a Sapphire Rapids-class Xeon: the 16
/// even products of the chunk summed in order into one f32, the 16 odd ones into another
/// (each addition rounded to nearest even; BF16 × BF16 products are exact in f32), then
/// `acc + (even + odd)`, denormal inputs read as zero and denormal results flushed. (The
/// SDM's older pseudo-code, one rounded addition per product in pair order, is not what the
/// hardware does: it matched 1 output in 32 on random data.)
pub(crate) fn tdpbf16ps_chunk(acc: f32, w: &[u16], x: &[u16]) -> f32 {
    let flush = |v: f32| if v.is_subnormal() { 0.0f32.copysign(v) } else { v };
    let widen = |b: u16| flush(f32::from_bits((b as u32) << 16));
    let (mut even, mut odd) = (0.0f32, 0.0f32);
    for i in 0..TILE {
        even = flush(even + widen(w[2 * i]) * widen(x[2 * i]));
        odd = flush(odd + widen(w[2 * i + 1]) * widen(x[2 * i + 1]));
    }
    flush(acc + flush(even + odd))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised packing rounds exactly as `round_bf16` and puts every value at its tile
    /// position, with zeros in the padding (17 tokens and 45 columns: both padded).
    #[test]
    fn packing_rounds_like_the_scalar_rounding_and_pads_with_zeros() {
        if crate::isa() != crate::Isa::Avx512 {
            return;
        }
        let (n, cols) = (17, 45);
        let specials = [
            0.0f32,
            -0.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NAN,
            1e-40,
            -1e-40,
        ];
        let x: Vec<f32> = (0..n * cols)
            .map(|i| if i % 7 == 0 { specials[(i / 7) % specials.len()] } else { (i as f32 * 0.377).sin() * 3.1 })
            .collect();
        let mut out = vec![0xFFFFu16; packed_len(n, cols)];
        pack_tokens(&x, cols, 0, n, &mut out);
        let chunks = cols.div_ceil(TILE_K);
        for token in 0..32 {
            for k in 0..chunks * TILE_K {
                let (b, t, c, kk) = (token / TILE, token % TILE, k / TILE_K, k % TILE_K);
                let got = out[(b * chunks + c) * PACKED_TILE + (kk / 2) * 2 * TILE + 2 * t + (kk & 1)];
                let want = if token < n && k < cols { round_bf16(x[token * cols + k]) } else { 0 };
                assert_eq!(got, want, "token {token} column {k}");
            }
        }
    }
    /// The AMX product gives, for every output, the bits of the scalar model of `tdpbf16ps`
    /// above applied to the column chunks in order: the canonical order that decode, prefill
    /// and every batch shape share, pinned down on random weights and activations over several
    /// magnitudes, with exact zeros, rows at the edge of the denormal range, a row tail and a
    /// column tail.
    #[test]
    fn amx_products_follow_the_measured_tdpbf16ps_rounding_bit_for_bit() {
        if crate::bf16_kernels() != Some(crate::Bf16Kernels::Amx) {
            return;
        }
        for &(rows, cols, n) in &[(37usize, 1000usize, 17usize), (32, 4096, 1), (5, 7, 3)] {
            let mut state = 0x2545_F491_4F6C_DD1Du64 ^ (rows * cols) as u64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                match state % 31 {
                    0 => 0.0,
                    1 => unit * 1e-39,
                    k => unit * [1e-3f32, 0.1, 1.0, 40.0][k as usize % 4],
                }
            };
            // Every fourth row is scaled down to the edge of the denormal range (some of its
            // weights denormal, its partial sums near it), where reading denormals as zero and
            // flushing them change the result.
            let weights: Vec<u16> = (0..rows * cols)
                .map(|i| round_bf16(if (i / cols) % 4 == 3 { next() * 1e-36 } else { next() }))
                .collect();
            let x: Vec<f32> = (0..n * cols).map(|_| next()).collect();
            let mut packed = vec![0u16; packed_len(n, cols)];
            pack_tokens(&x, cols, 0, n, &mut packed);
            let mut y = vec![f32::NAN; n * rows];
            // SAFETY: AMX was granted; the buffers have the documented sizes.
            unsafe { gemm_rows(weights.as_ptr() as *const u8, rows, cols, &packed, n, y.as_mut_ptr(), rows, 0, rows) };
            let chunks = cols.div_ceil(TILE_K);
            for t in 0..n {
                let mut xb = vec![0u16; chunks * TILE_K];
                for (k, v) in x[t * cols..(t + 1) * cols].iter().enumerate() {
                    xb[k] = round_bf16(*v);
                }
                for r in 0..rows {
                    let mut wb = vec![0u16; chunks * TILE_K];
                    wb[..cols].copy_from_slice(&weights[r * cols..(r + 1) * cols]);
                    let mut want = 0.0f32;
                    for c in 0..chunks {
                        let span = c * TILE_K..(c + 1) * TILE_K;
                        want = tdpbf16ps_chunk(want, &wb[span.clone()], &xb[span]);
                    }
                    let got = y[t * rows + r];
                    assert_eq!(got.to_bits(), want.to_bits(), "{rows}x{cols}, token {t}, row {r}: {got:e} vs {want:e}");
                }
            }
        }
    }
}
