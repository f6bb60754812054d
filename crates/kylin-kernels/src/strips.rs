//! Weights repacked at load into column-major strips of 16 rows, for the f32 products on CPUs
//! with AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP), where every
//! model's float products run in f32 (BF16 checkpoints included: these CPUs have no BF16
//! instructions).
//!
//! **Why.** [`crate::matmul`] reads weights in place, row-major, and reduces each output in the
//! GEMV's order (four 8-lane chains along the columns) so that a token gives the same bits
//! alone or in a batch. On AVX2 that order leaves room for a 4-token × 3-row tile, which widens
//! and loads about as much as it multiplies: about 70% of the FMA ports in a BF16 prefill.
//! Here every output is one sequential chain of fused multiply-adds over the columns (the order
//! of [`crate::gemm_packed`]), which an outer-product tile computes with 16 rows in two vectors
//! and one broadcast per token: per column, one strip column (32 bytes in BF16) widened by two
//! instructions feeds 2 × `T` fused multiply-adds. The strips make the same order cheap for
//! decode too: a one-token product reads four strips as four sequential streams, 16 rows per
//! strip column, with no sum across lanes.
//!
//! **Layout.** Strip `s` holds rows `16s..16s + 16` (zeros past the last row); its column `c` is
//! 16 values of the stored dtype at element `(s · cols + c) · 16`. F32 and F16 keep the rows in
//! order. BF16 orders them so that the 8 u32 of one 32-byte load give rows `16s..16s + 8` from
//! their low halves (a `vpslld` by 16 widens them) and rows `16s + 8..16s + 16` from their high
//! halves (a `vpand` keeps them): position `2i` holds row `16s + i`, position `2i + 1` row
//! `16s + 8 + i`.
//!
//! **Order** (batch invariance, DESIGN.md invariant 7): `y[t, r]` is `acc = 0`, then
//! `acc = fma(w[r, c], x[t, c], acc)` for `c = 0, 1, …, cols - 1`, whatever the number of
//! tokens, the tile a token lands in, the thread count or the dtype the weight is stored in:
//! the bits of [`crate::gemm_packed`] on the row-major matrix (its scalar path is the
//! reference the tests compare with).

use crate::aligned::AlignedBytes;
use crate::matmul::{MAX_FUSED, MatrixRows, OutPtr, split_rows};
use crate::{Isa, ThreadPool, WeightDType, WeightMatrix};

/// Rows per strip: two 8-lane vectors.
pub const STRIP_ROWS: usize = 16;
/// Strips a pool task owns at least: one-token products run four strips at once.
const UNIT_STRIPS: usize = 4;
/// Tokens per register tile of a many-token product (12 accumulators, one strip).
const TILE_TOKENS: usize = 6;
/// Weight bytes below which a one-token product stays on the calling thread.
const MIN_PARALLEL_BYTES: usize = 64 * 1024;
/// Multiply-adds below which a many-token product stays on the calling thread.
const MIN_PARALLEL_MACS: usize = 1 << 20;

/// Whether float matrices are copied into strips: where the f32 products run on AVX2 without
/// AVX-512, unless `KYLIN_WEIGHT_STRIPS=0` keeps every weight in place in the map (other bits,
/// within f32 rounding; prefill slower; no copy at load).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::isa() == Isa::Avx2Fma && crate::env_switch(&ON, &["KYLIN_WEIGHT_STRIPS"])
}

/// A matrix in strips (see the module), in 64-byte aligned memory on huge pages where the
/// system has them.
pub struct StripBuffer {
    bytes: AlignedBytes,
    dtype: WeightDType,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for StripBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StripBuffer({:?}, {} x {})", self.dtype, self.rows, self.cols)
    }
}

/// A view of a [`StripBuffer`] for [`matmul_many_strips`].
#[derive(Clone, Copy, Debug)]
pub struct StripMatrix<'a> {
    /// `strips · cols · 16` values of `dtype`.
    data: &'a [u8],
    dtype: WeightDType,
    rows: usize,
    cols: usize,
}

impl MatrixRows for StripMatrix<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
}

impl StripBuffer {
    /// `w` in strips when this process runs its f32 products on AVX2 ([`enabled`]); `None`
    /// otherwise.
    pub fn new(w: WeightMatrix<'_>) -> Option<StripBuffer> {
        if !enabled() {
            return None;
        }
        Self::pack(w)
    }

    /// `w` in strips whatever the CPU (the tests compare the layout on any machine); `None`
    /// when `w` is empty or its data length disagrees with its shape.
    pub fn pack(w: WeightMatrix<'_>) -> Option<StripBuffer> {
        let size = w.dtype.size_in_bytes();
        if w.rows == 0 || w.cols == 0 || w.data.len() != w.rows * w.cols * size {
            return None;
        }
        let strips = w.rows.div_ceil(STRIP_ROWS);
        let strip_bytes = w.cols * STRIP_ROWS * size;
        let mut bytes = AlignedBytes::zeroed(strips * strip_bytes)?;
        // Strips are packed apart, one part per core: most of the time goes to the kernel
        // zeroing the new pages on first touch, which runs on each touching core.
        let parts = std::thread::available_parallelism().map_or(1, |n| n.get()).min(strips);
        let part_strips = strips.div_ceil(parts);
        std::thread::scope(|scope| {
            for (part, out) in bytes.chunks_mut(part_strips * strip_bytes).enumerate() {
                scope.spawn(move || {
                    for (i, strip) in out.chunks_exact_mut(strip_bytes).enumerate() {
                        pack_strip(w, part * part_strips + i, strip);
                    }
                });
            }
        });
        Some(StripBuffer { bytes, dtype: w.dtype, rows: w.rows, cols: w.cols })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held, padding rows included.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// The strips as a matrix view for [`matmul_many_strips`].
    pub fn matrix(&self) -> StripMatrix<'_> {
        StripMatrix { data: &self.bytes, dtype: self.dtype, rows: self.rows, cols: self.cols }
    }

    /// Row `r` widened to f32 into `out[..cols]`: the layout read back, which the tests compare
    /// with the matrix it was copied from. Panics if `r >= rows` or `out` is shorter than a row
    /// (caller bugs).
    pub fn widen_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let (s, i) = (r / STRIP_ROWS, r % STRIP_ROWS);
        let position = position(self.dtype, i);
        let size = self.dtype.size_in_bytes();
        for (c, o) in out[..self.cols].iter_mut().enumerate() {
            let at = ((s * self.cols + c) * STRIP_ROWS + position) * size;
            let value = WeightMatrix { dtype: self.dtype, rows: 1, cols: 1, data: &self.bytes[at..at + size] };
            crate::widen_row(value, 0, std::slice::from_mut(o));
        }
    }
}

/// Where row `i` of a strip sits in each of its columns (see the module's layout).
fn position(dtype: WeightDType, i: usize) -> usize {
    match dtype {
        WeightDType::BF16 if i < 8 => 2 * i,
        WeightDType::BF16 => 2 * (i - 8) + 1,
        WeightDType::F32 | WeightDType::F16 => i,
    }
}

/// Writes strip `s` of `w` (`cols × 16` values, see the module) into `out`.
fn pack_strip(w: WeightMatrix<'_>, s: usize, out: &mut [u8]) {
    match w.dtype {
        WeightDType::F32 => pack_strip_sized::<4>(w, s, out),
        WeightDType::F16 | WeightDType::BF16 => pack_strip_sized::<2>(w, s, out),
    }
}

/// [`pack_strip`] for values of `SIZE` bytes: the strip written in order, column by column,
/// reading its 16 rows side by side.
fn pack_strip_sized<const SIZE: usize>(w: WeightMatrix<'_>, s: usize, out: &mut [u8]) {
    let row_bytes = w.cols * SIZE;
    // Source row of each strip position (`None` past the last row: the zeroed buffer's
    // padding stays zero).
    let mut sources: [Option<&[u8]>; STRIP_ROWS] = [None; STRIP_ROWS];
    for i in 0..STRIP_ROWS {
        let r = s * STRIP_ROWS + i;
        if r < w.rows {
            sources[position(w.dtype, i)] = Some(&w.data[r * row_bytes..(r + 1) * row_bytes]);
        }
    }
    // A whole strip of 16-bit values: eight columns at a time by two 8 × 8 transposes.
    #[cfg(target_arch = "x86_64")]
    let first = if SIZE == 2 && (s + 1) * STRIP_ROWS <= w.rows {
        let row = |i: usize| &w.data[(s * STRIP_ROWS + i) * row_bytes..(s * STRIP_ROWS + i + 1) * row_bytes];
        x86::pack_strip_16bit(std::array::from_fn(row), w.dtype == WeightDType::BF16, out)
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let first = 0;
    for (c, column) in out.chunks_exact_mut(STRIP_ROWS * SIZE).enumerate().skip(first) {
        for (value, source) in column.chunks_exact_mut(SIZE).zip(&sources) {
            if let Some(row) = source {
                value.copy_from_slice(&row[c * SIZE..(c + 1) * SIZE]);
            }
        }
    }
}

/// `y_i (n_tokens, rows_i) = x (n_tokens, cols) · W_iᵀ` for every `(W_i, y_i)` in `jobs`, each
/// `W_i` a [`StripBuffer::matrix`] of the same `cols`, every output one chain in the
/// module's order. Up to [`MAX_FUSED`] matrices share one pool job.
///
/// Panics if a shape disagrees (caller bugs) or the CPU lacks AVX2 and FMA.
pub fn matmul_many_strips(pool: &ThreadPool, x: &[f32], n_tokens: usize, jobs: &mut [(StripMatrix<'_>, &mut [f32])]) {
    assert!(matches!(crate::isa(), Isa::Avx2Fma | Isa::Avx512), "strip products need AVX2 and FMA");
    for chunk in jobs.chunks_mut(MAX_FUSED) {
        for (w, y) in chunk.iter() {
            // These checks make the unsafe reads and writes below sound.
            let size = w.dtype.size_in_bytes();
            assert_eq!(w.data.len(), w.rows.div_ceil(STRIP_ROWS) * w.cols * STRIP_ROWS * size, "strip data length");
            assert_eq!(x.len(), n_tokens * w.cols, "x.len() != n_tokens * cols");
            assert_eq!(y.len(), n_tokens * w.rows, "y.len() != n_tokens * rows");
        }
        if n_tokens == 0 || chunk.is_empty() {
            continue;
        }
        let bytes: usize = chunk.iter().map(|(w, _)| w.data.len()).sum();
        let macs: usize = chunk.iter().map(|(w, _)| w.rows * w.cols * n_tokens).sum();
        let parallel = if n_tokens == 1 { bytes >= MIN_PARALLEL_BYTES } else { macs >= MIN_PARALLEL_MACS };
        let threads = if parallel { pool.threads() } else { 1 };
        // SAFETY: `split_rows` hands each task rows no other task gets, in whole units of
        // `UNIT_STRIPS` strips (so `r0` starts a strip); shapes were checked above.
        split_rows(pool, chunk, UNIT_STRIPS * STRIP_ROWS, threads, &|w, out, r0, r1| unsafe {
            strip_rows(w, x, n_tokens, out, r0, r1)
        });
    }
}

/// Output rows `r0..r1` of `y = x · Wᵀ` for all tokens.
///
/// # Safety
/// `out` points to the `(n_tokens, w.rows)` output, rows `r0..r1` of which no one else
/// accesses meanwhile; `r0` is a multiple of [`STRIP_ROWS`]; shapes as checked by
/// [`matmul_many_strips`]; the CPU has AVX2 and FMA.
unsafe fn strip_rows(w: StripMatrix<'_>, x: &[f32], n_tokens: usize, out: OutPtr, r0: usize, r1: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let (s0, s1) = (r0 / STRIP_ROWS, r1.div_ceil(STRIP_ROWS));
        // Bytes per strip.
        let strip_len = w.cols * STRIP_ROWS * w.dtype.size_in_bytes();
        let tile = |s: usize, strips: usize, t0: usize, tokens: usize| {
            let tile = x86::Tile {
                w: w.data[s * strip_len..].as_ptr(),
                strip_len,
                cols: w.cols,
                x: x[t0 * w.cols..].as_ptr(),
                // SAFETY: token `t0`'s output row is inside `out` (`t0 < n_tokens`).
                y: unsafe { out.0.add(t0 * w.rows + s * STRIP_ROWS) },
                y_stride: w.rows,
                // Rows of the tile's last strip that exist.
                last_rows: (r1 - (s + strips - 1) * STRIP_ROWS).min(STRIP_ROWS),
            };
            // SAFETY: strips `s..s + strips` are below `s1` (inside `w.data`), tokens
            // `t0..t0 + tokens` inside `x` and `out`; rows `16s..16(s + strips)` clipped to
            // `r1` are this call's (the caller's contract).
            unsafe { x86::strip_tile(w.dtype, tokens, strips, tile) }
        };
        if n_tokens < TILE_TOKENS {
            // Few tokens (decode): as many strips per tile as the registers hold, each strip
            // read once for all the tokens.
            let per_tile = match n_tokens {
                1 => 4,
                2 => 3,
                3 => 2,
                _ => 1,
            };
            let mut s = s0;
            while s < s1 {
                let strips = per_tile.min(s1 - s);
                tile(s, strips, 0, n_tokens);
                s += strips;
            }
        } else {
            for s in s0..s1 {
                let mut t0 = 0;
                while t0 < n_tokens {
                    let tokens = TILE_TOKENS.min(n_tokens - t0);
                    tile(s, 1, t0, tokens);
                    t0 += tokens;
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, x, n_tokens, out, r0, r1);
        unreachable!("no strip products on this architecture")
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::WeightDType;

    /// Columns `0..8k` of a whole strip of 16-bit values (`rows`: its 16 rows in order)
    /// written into `out`, eight columns at a time: the eight values of each row loaded side by
    /// side, two 8 × 8 transposes (rows `0..8` and `8..16`), and each column's two halves
    /// either one after the other (F16: rows in order) or interleaved value by value
    /// (`interleave`: BF16, where position `2i` holds row `i` and `2i + 1` row `8 + i`).
    /// Returns the columns written; the caller copies the rest. SSE2, which every x86_64 CPU
    /// has.
    pub(super) fn pack_strip_16bit(rows: [&[u8]; super::STRIP_ROWS], interleave: bool, out: &mut [u8]) -> usize {
        let cols = out.len() / (2 * super::STRIP_ROWS);
        assert!(rows.iter().all(|r| r.len() >= 2 * cols), "16 source rows of the strip's columns");
        let halves: [[&[u8]; 8]; 2] = [std::array::from_fn(|i| rows[i]), std::array::from_fn(|i| rows[8 + i])];
        let chunks = cols / 8;
        for k in 0..chunks {
            // SAFETY: SSE2 is part of x86_64; every row holds the 16 bytes of columns
            // `8k..8k + 8` (`2 · cols` bytes, asserted), and `out` the 8 columns of 32 bytes.
            unsafe {
                let [a, b] = halves.map(|half| transpose8x8_u16(half.map(|r| r.as_ptr().add(16 * k))));
                for c in 0..8 {
                    let (lo, hi) = if interleave {
                        (_mm_unpacklo_epi16(a[c], b[c]), _mm_unpackhi_epi16(a[c], b[c]))
                    } else {
                        (a[c], b[c])
                    };
                    let column = out.as_mut_ptr().add((8 * k + c) * 32);
                    _mm_storeu_si128(column as *mut __m128i, lo);
                    _mm_storeu_si128(column.add(16) as *mut __m128i, hi);
                }
            }
        }
        8 * chunks
    }

    /// Eight 16-bit values from each of eight rows → the eight columns, each the rows' values
    /// in order.
    ///
    /// # Safety
    /// Each pointer is valid for 16 bytes.
    #[inline(always)]
    unsafe fn transpose8x8_u16(rows: [*const u8; 8]) -> [__m128i; 8] {
        // SAFETY: SSE2 is part of x86_64; the pointers are the caller's to vouch for.
        unsafe {
            let r = rows.map(|p| _mm_loadu_si128(p as *const __m128i));
            // Pairs of rows, then fours, then all eight, per column.
            let t = [
                _mm_unpacklo_epi16(r[0], r[1]),
                _mm_unpackhi_epi16(r[0], r[1]),
                _mm_unpacklo_epi16(r[2], r[3]),
                _mm_unpackhi_epi16(r[2], r[3]),
                _mm_unpacklo_epi16(r[4], r[5]),
                _mm_unpackhi_epi16(r[4], r[5]),
                _mm_unpacklo_epi16(r[6], r[7]),
                _mm_unpackhi_epi16(r[6], r[7]),
            ];
            let u = [
                _mm_unpacklo_epi32(t[0], t[2]),
                _mm_unpackhi_epi32(t[0], t[2]),
                _mm_unpacklo_epi32(t[1], t[3]),
                _mm_unpackhi_epi32(t[1], t[3]),
                _mm_unpacklo_epi32(t[4], t[6]),
                _mm_unpackhi_epi32(t[4], t[6]),
                _mm_unpacklo_epi32(t[5], t[7]),
                _mm_unpackhi_epi32(t[5], t[7]),
            ];
            [
                _mm_unpacklo_epi64(u[0], u[4]),
                _mm_unpackhi_epi64(u[0], u[4]),
                _mm_unpacklo_epi64(u[1], u[5]),
                _mm_unpackhi_epi64(u[1], u[5]),
                _mm_unpacklo_epi64(u[2], u[6]),
                _mm_unpackhi_epi64(u[2], u[6]),
                _mm_unpacklo_epi64(u[3], u[7]),
                _mm_unpackhi_epi64(u[3], u[7]),
            ]
        }
    }

    /// The dtypes of a tile, as const parameters.
    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;

    /// One tile's operands: `w` is the first strip's column 0 (strips `strip_len` bytes apart),
    /// `x` the first token's row of `cols` floats, `y` its output row (rows `y_stride` apart);
    /// the last strip writes its first `last_rows` rows only.
    #[derive(Clone, Copy)]
    pub(super) struct Tile {
        pub(super) w: *const u8,
        pub(super) strip_len: usize,
        pub(super) cols: usize,
        pub(super) x: *const f32,
        pub(super) y: *mut f32,
        pub(super) y_stride: usize,
        pub(super) last_rows: usize,
    }

    /// `y[t, 16s' + i] = chain over c of fma(w, x[t, c], ·)` for `tokens` tokens and `strips`
    /// strips of `dtype`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C present; `tile.w` valid for `strips · strip_len` bytes, `tile.x` for
    /// `tokens · cols` floats, `tile.y` for writing `tokens` rows of `y_stride` floats from its
    /// start, of which the tile writes `16 · (strips - 1) + last_rows` columns.
    pub(super) unsafe fn strip_tile(dtype: WeightDType, tokens: usize, strips: usize, tile: Tile) {
        // SAFETY: the caller's contract.
        unsafe {
            match dtype {
                WeightDType::F32 => shaped::<F32>(tokens, strips, tile),
                WeightDType::F16 => shaped::<F16>(tokens, strips, tile),
                WeightDType::BF16 => shaped::<BF16>(tokens, strips, tile),
            }
        }
    }

    /// [`strip_tile`] for dtype `D`, dispatched on the tile's shape.
    ///
    /// # Safety
    /// As [`strip_tile`].
    unsafe fn shaped<const D: u8>(tokens: usize, strips: usize, tile: Tile) {
        // SAFETY: the caller's contract, for the tile shape chosen.
        unsafe {
            match (tokens, strips) {
                (1, 4) => run::<D, 1, 4>(tile),
                (1, 3) => run::<D, 1, 3>(tile),
                (1, 2) => run::<D, 1, 2>(tile),
                (1, 1) => run::<D, 1, 1>(tile),
                (2, 3) => run::<D, 2, 3>(tile),
                (2, 2) => run::<D, 2, 2>(tile),
                (2, 1) => run::<D, 2, 1>(tile),
                (3, 2) => run::<D, 3, 2>(tile),
                (3, 1) => run::<D, 3, 1>(tile),
                (4, 1) => run::<D, 4, 1>(tile),
                (5, 1) => run::<D, 5, 1>(tile),
                (6, 1) => run::<D, 6, 1>(tile),
                _ => unreachable!("no {tokens}-token × {strips}-strip tile"),
            }
        }
    }

    /// [`strip_tile`] for dtype `D`, `T` tokens × `S` strips: `2 · S · T` accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const D: u8, const T: usize, const S: usize>(tile: Tile) {
        let Tile { w, strip_len, cols, x, y, y_stride, last_rows } = tile;
        // Bytes per strip column: 16 values.
        let column = if D == F32 { 64 } else { 32 };
        let mut acc = [[[_mm256_setzero_ps(); 2]; S]; T];
        let high = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
        // SAFETY (whole body): weight reads at `s · strip_len + c · column + 0..column`,
        // `s < S`, `c < cols`; token reads at `t · cols + c`, `t < T`; writes at
        // `t · y_stride + j`, `j < 16 (S - 1) + last_rows`: the caller's extents.
        unsafe {
            for c in 0..cols {
                let mut lo = [_mm256_setzero_ps(); S];
                let mut hi = [_mm256_setzero_ps(); S];
                for s in 0..S {
                    // One strip column (16 values) -> rows 0..8 and rows 8..16 as f32.
                    let p = w.add(s * strip_len + c * column);
                    if D == BF16 {
                        // Rows 0..8 in the low halves of the u32, rows 8..16 in the high.
                        let raw = _mm256_loadu_si256(p.cast());
                        lo[s] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                        hi[s] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
                    } else if D == F16 {
                        lo[s] = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
                        hi[s] = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast()));
                    } else {
                        lo[s] = _mm256_loadu_ps(p.cast());
                        hi[s] = _mm256_loadu_ps(p.add(32).cast());
                    }
                }
                for (t, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_broadcast_ss(&*x.add(t * cols + c));
                    for s in 0..S {
                        a[s][0] = _mm256_fmadd_ps(lo[s], xv, a[s][0]);
                        a[s][1] = _mm256_fmadd_ps(hi[s], xv, a[s][1]);
                    }
                }
            }
            for (t, a) in acc.iter().enumerate() {
                for (s, v) in a.iter().enumerate() {
                    let rows = if s + 1 < S { 16 } else { last_rows };
                    crate::x86::store_rows16(y.add(t * y_stride + s * 16), v[0], v[1], rows);
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    const DTYPES: [WeightDType; 3] = [WeightDType::BF16, WeightDType::F16, WeightDType::F32];

    /// Seeded values in [-1, 1) stored as `dtype`.
    fn matrix_bytes(dtype: WeightDType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let mut out = Vec::with_capacity(rows * cols * dtype.size_in_bytes());
        for _ in 0..rows * cols {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let value = ((state >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2.0;
            match dtype {
                WeightDType::BF16 => out.extend_from_slice(&half::bf16::from_f32(value).to_le_bytes()),
                WeightDType::F16 => out.extend_from_slice(&half::f16::from_f32(value).to_le_bytes()),
                WeightDType::F32 => out.extend_from_slice(&value.to_le_bytes()),
            }
        }
        out
    }

    fn tokens(n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 29.0).collect()
    }

    #[test]
    fn strips_read_back_the_matrix() {
        for dtype in DTYPES {
            for (rows, cols) in [(1, 1), (15, 3), (16, 7), (37, 19), (33, 40), (64, 64)] {
                let data = matrix_bytes(dtype, rows, cols, 3);
                let w = WeightMatrix { dtype, rows, cols, data: &data };
                let strips = StripBuffer::pack(w).expect("a whole matrix");
                let (mut got, mut want) = (vec![0.0; cols], vec![0.0; cols]);
                for r in 0..rows {
                    strips.widen_row(r, &mut got);
                    crate::widen_row(w, r, &mut want);
                    assert_eq!(got, want, "{dtype:?}: row {r} of {rows} × {cols}");
                }
            }
        }
    }

    #[test]
    fn strip_products_have_the_bits_of_gemm_packed_for_every_batch() {
        if !matches!(crate::isa(), Isa::Avx2Fma | Isa::Avx512) {
            return;
        }
        let pool = ThreadPool::new(2);
        // Odd shapes: partial strips, partial four-strip units, a remainder of every tile.
        let shapes = [(37, 19), (16, 1), (130, 67), (200, 300), (1100, 1030)];
        for (dtype, (rows, cols)) in DTYPES.into_iter().flat_map(|d| shapes.map(|s| (d, s))) {
            let data = matrix_bytes(dtype, rows, cols, rows as u32);
            let w = WeightMatrix { dtype, rows, cols, data: &data };
            let strips = StripBuffer::pack(w).expect("a whole matrix");
            for n in [1, 2, 3, 4, 5, 6, 7, 8, 13] {
                let x = tokens(n, cols);
                let mut want = vec![0.0; n * rows];
                crate::gemm_packed(&pool, w, &x, n, &mut want);
                let mut got = vec![f32::NAN; n * rows];
                matmul_many_strips(&pool, &x, n, &mut [(strips.matrix(), &mut got[..])]);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?}: {rows} × {cols}, {n} tokens");
                // Each token alone gives the same bits (batch invariance).
                for t in 0..n {
                    let mut alone = vec![0.0; rows];
                    matmul_many_strips(
                        &pool,
                        &x[t * cols..(t + 1) * cols],
                        1,
                        &mut [(strips.matrix(), &mut alone[..])],
                    );
                    assert!(alone.iter().zip(&got[t * rows..]).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
            }
        }
    }

    #[test]
    fn fused_strip_products_match_one_by_one() {
        if !matches!(crate::isa(), Isa::Avx2Fma | Isa::Avx512) {
            return;
        }
        let pool = ThreadPool::new(2);
        let cols = 96;
        let shapes = [40, 16, 75];
        let dtype = WeightDType::BF16;
        let data: Vec<Vec<u8>> = shapes.iter().map(|&rows| matrix_bytes(dtype, rows, cols, rows as u32 + 7)).collect();
        let strips: Vec<StripBuffer> = shapes
            .iter()
            .zip(&data)
            .map(|(&rows, data)| StripBuffer::pack(WeightMatrix { dtype, rows, cols, data }).expect("a whole matrix"))
            .collect();
        for n in [1, 9] {
            let x = tokens(n, cols);
            let mut fused: Vec<Vec<f32>> = shapes.iter().map(|&rows| vec![0.0; n * rows]).collect();
            let mut jobs: Vec<(StripMatrix<'_>, &mut [f32])> =
                strips.iter().zip(fused.iter_mut()).map(|(s, y)| (s.matrix(), &mut y[..])).collect();
            matmul_many_strips(&pool, &x, n, &mut jobs);
            for (s, y) in strips.iter().zip(&fused) {
                let mut alone = vec![0.0; n * s.rows()];
                matmul_many_strips(&pool, &x, n, &mut [(s.matrix(), &mut alone[..])]);
                assert_eq!(&alone, y);
            }
        }
    }
}
