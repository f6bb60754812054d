//! BF16 matrix products with AVX-512 BF16 (`vdpbf16ps`), for CPUs that have it but no AMX
//! (AMD Zen 4, Intel Cooper Lake): `y = bf16(x) · Wᵀ`, f32 accumulation, BF16 weights read in
//! place.
//!
//! One `vdpbf16ps` multiplies 32 BF16 pairs into 16 f32 lanes (64 FLOP), twice an f32 FMA's
//! work, and needs no widening of the weights. The activations are rounded once per product into
//! BF16 rows of `cols.next_multiple_of(32)` elements, zero-padded ([`pack_rows`]).
//!
//! **Canonical order** (batch invariance, DESIGN.md invariant 7): an output `y[t, r]` is one
//! 16-lane accumulator, `acc = vdpbf16ps(acc, x[t, c..c + 32], w[r, c..c + 32])` for the column
//! chunks `c = 0, 32, 64, …` in order (the last one zero-masked on the weight side and
//! zero-padded on the activation side, so its padding adds exact zeros), then
//! `hsum(lo256 + hi256)` with [`crate::x86::hsum`]'s tree. A tile of `MT` tokens × `NR` rows runs
//! that sequence for each of its outputs independently, so every tile shape (decode's one token
//! included) gives the same bits. Wide tiles take the lane sums of sixteen accumulators in one
//! tree of shuffles ([`reduce_two_tokens`]) that adds exactly the same pairs.
//!
//! Every function here must only be called once [`crate::bf16_kernels`] returned `Avx512Bf16`.

use std::arch::x86_64::*;

/// Tokens per full tile.
pub const MT: usize = 4;
/// Weight rows per full tile (`MT × NR = 24` accumulators, `NR` weight vectors and one
/// activation vector: 31 of the 32 zmm registers).
pub const NR: usize = 6;
/// Tokens up to which a product reads its weights one row at a time (tiles of one weight row
/// and up to [`MT`] tokens), so that each thread reads its rows as one sequential stream (and
/// asks for the row [`ONE_ROW_PREFETCH_BYTES`] ahead of it meanwhile). With six rows in flight (six
/// streams a row apart) one token's decode read about 26 GB/s of BF16 weights on 2 Zen 4 cores
/// where one row at a time reads 32 (qwen3-0.6b-shaped 21.4 -> 26.9 tokens/s, qwen3.5-0.8b-shaped
/// 15.6 -> 20.3, qwen3-moe-shaped 23.4 -> 31.1; BENCHMARKS.md). From 3 tokens on, six-row tiles
/// that prefetch the next tile's rows into L2 ([`Prefetch`]) are as fast or faster: over the 28
/// layers of Qwen3-0.6B (`model_bf16_dot`, ms) one row at a time took 26.1, 20.9, 21.9 for 2
/// tokens against 27.2, 27.5, 26.8 in six-row tiles; 28.2, 26.2, 29.6 for 3 against 26.6, 27.3,
/// 27.4; 32.1, 32.1 for 4 against 26.5, 22.3. (Before the prefetch went to L2, six-row tiles
/// only won from 7 tokens on.) Each output row keeps its one accumulator chain over the
/// columns, so the bits are the same for every tile shape: batch invariance is untouched.
const ONE_ROW_MAX_TOKENS: usize = 2;
/// How far ahead of its row a one-row tile prefetches (a whole row, into L2, spread over the
/// tile's column chunks): with the hardware prefetcher alone the memory sat idle part of the
/// time. On 2 Zen 5 cores, qwen3-0.6b-shaped decode (16-token prompt, 64 tokens; old and new
/// binaries alternating) went from 45.5, 47.7, 46.9, 47.2 to 51.8, 51.3, 51.7, 50.6 tokens/s;
/// rows 8 to 64 KB ahead did about equally well in a sweep (the distance only has to cover the
/// memory's latency at full speed), 2 KB less than half as well.
const ONE_ROW_PREFETCH_BYTES: usize = 12 * 1024;
/// Columns per step.
const K: usize = 32;

/// Elements of one packed activation row for `cols` columns.
pub fn row_len(cols: usize) -> usize {
    cols.next_multiple_of(K)
}

/// Rounds tokens `t0..t1` of `x` (`(n_tokens, cols)` row-major) to BF16 rows of
/// [`row_len`]`(cols)` elements in `out`, zero-padded.
pub fn pack_rows(x: &[f32], cols: usize, t0: usize, t1: usize, out: &mut [u16]) {
    let kp = row_len(cols);
    assert!(x.len() >= t1 * cols && out.len() >= t1 * kp, "pack_rows: buffers too short");
    for t in t0..t1 {
        let row = &x[t * cols..(t + 1) * cols];
        // `kp` is a multiple of 32, so the row splits into whole chunks.
        let (chunks, _) = out[t * kp..(t + 1) * kp].as_chunks_mut::<K>();
        for (i, chunk) in chunks.iter_mut().enumerate() {
            let c = i * K;
            // SAFETY: this family exists only where AVX-512 F/BW was detected; `row[c..c + n]`
            // is readable.
            unsafe { crate::amx::round_chunk(row.as_ptr().add(c), K.min(cols - c), chunk) };
        }
    }
}

/// The sum of the 16 lanes in the canonical tree: `hsum(lo256 + hi256)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn reduce16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    crate::x86::hsum(_mm256_add_ps(lo, hi))
}

/// Cache lines a tile asks the memory system for while it computes, so that the next tile's
/// weights arrive while this one multiplies: `lines` lines of 64 bytes from `start`, spread
/// evenly over the tile's column chunks. Prefetches are hints; they change no result.
///
/// They go to the second-level cache (`prefetcht1`), not the first. Into L1 (`prefetcht0`),
/// each prefetch holds one of the core's few L1 miss buffers until its line arrives, and the
/// loads and products behind it wait for a free one: the tile's arithmetic and the next tile's
/// reads ran one after the other, not overlapped. Into L2, they did overlap: the 28 layers of
/// Qwen3-0.6B (`model_bf16_dot`) took 40.1 and 41.2 ms for 8 tokens with `prefetcht0`, 27.2
/// with `prefetcht1` (one token: 25.3), and 57.2 and 54.5 against 41.4 ms for 16
/// (BENCHMARKS.md). The tile then reads its weights from L2 on its first pass.
#[derive(Clone, Copy)]
struct Prefetch {
    start: *const u8,
    lines: usize,
}

/// The columns `c0..c1` a tile call runs its chains over (`c0` and, unless `c1 == cols`, `c1`
/// multiples of [`K`]), and where the chains wait between calls: a span that does not start at
/// column 0 loads its accumulators from `carry`, one that does not end at `cols` stores them
/// there instead of reducing. Each accumulator's chain is the same sequence of `vdpbf16ps` in
/// the same order however the columns are cut, so the spans change no bit.
#[derive(Clone, Copy)]
struct ColumnSpan {
    c0: usize,
    c1: usize,
    carry: *mut __m512,
}

/// One tile: `y[t * y_stride + r] = Σ_c w[r, c] · bf16(x)[t, c]` for `t < MT_`, `r < NR_`, in
/// the canonical order (module header), prefetching `prefetch` meanwhile if `PREFETCH` (a
/// separate instance, so that the one-row tiles of decode carry none of that code).
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 are available; `w` is valid for `NR_` rows of `cols` BF16 elements
/// (row stride `cols · 2` bytes); `xb` for `MT_` packed rows of [`row_len`]`(cols)` elements
/// (stride `kp`); `y` for writing the `MT_ × NR_` outputs, which no one else accesses meanwhile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const MT_: usize, const NR_: usize, const PREFETCH: bool>(
    w: *const u8,
    cols: usize,
    xb: *const u16,
    kp: usize,
    y: *mut f32,
    y_stride: usize,
    prefetch: Prefetch,
    span: ColumnSpan,
) {
    let ColumnSpan { c0, c1, carry } = span;
    let full = if c1 == cols { cols / K * K } else { c1 };
    // Lines to prefetch per full column chunk, and the next line's index.
    let per_chunk = prefetch.lines.div_ceil(((full - c0) / K).max(1));
    let mut next_line = 0;
    // SAFETY (whole body): weight reads stay inside rows `< NR_` and columns `< cols` (the tail
    // is a masked load), activation reads inside packed rows `< MT_` of `kp` elements, writes at
    // the caller's outputs; `carry` holds `MT_ × NR_` accumulators when a span needs it.
    unsafe {
        // The chains start from zero at column 0, or go on from where the previous span left
        // them.
        let mut acc: [[__m512; NR_]; MT_] = if c0 == 0 {
            [[_mm512_setzero_ps(); NR_]; MT_]
        } else {
            std::array::from_fn(|t| std::array::from_fn(|r| *carry.add(t * NR_ + r)))
        };
        let rows: [*const u16; NR_] = std::array::from_fn(|r| w.add(r * cols * 2) as *const u16);
        let mut c = c0;
        while c < full {
            let wv: [__m512bh; NR_] = std::array::from_fn(|r| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(rows[r].add(c) as *const __m512i))
            });
            // A prefetch of any address is harmless, so the pointer is only computed, wrapping.
            let end = if PREFETCH { (next_line + per_chunk).min(prefetch.lines) } else { 0 };
            while next_line < end {
                _mm_prefetch::<_MM_HINT_T1>(prefetch.start.wrapping_add(next_line * 64) as *const i8);
                next_line += 1;
            }
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xv =
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(xb.add(t * kp + c) as *const __m512i));
                for (r, a) in acc_t.iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, xv, wv[r]);
                }
            }
            c += K;
        }
        if c1 < cols {
            // Not the last span: the chains wait in `carry` for the next one.
            for (t, acc_t) in acc.iter().enumerate() {
                for (r, a) in acc_t.iter().enumerate() {
                    *carry.add(t * NR_ + r) = *a;
                }
            }
            return;
        }
        if c < cols {
            let mask: __mmask32 = ((1u64 << (cols - c)) - 1) as __mmask32;
            let wv: [__m512bh; NR_] = std::array::from_fn(|r| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, rows[r].add(c) as *const i16))
            });
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xv =
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(xb.add(t * kp + c) as *const __m512i));
                for (r, a) in acc_t.iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, xv, wv[r]);
                }
            }
        }
        if MT_ == MT && NR_ == NR {
            // The full tile's 24 sums in a tree of sixteen and a tree of eight
            // (`reduce_full_tile`): rows of tokens 0 and 1 in `a`, of 2 and 3 in `b`.
            let [a, b] = reduce_full_tile(std::array::from_fn(|i| acc[i / NR_][i % NR_]));
            store_token_pair::<NR_>(y, y_stride, a, true);
            store_token_pair::<NR_>(y.add(2 * y_stride), y_stride, b, true);
        } else if NR_ >= 4 && MT_ >= 2 {
            // Two tokens' rows per tree of shuffles (see `reduce_two_tokens`).
            let mut t = 0;
            while t < MT_ {
                let second = (t + 1 < MT_).then(|| &acc[t + 1]);
                let sums = reduce_two_tokens::<NR_>(&acc[t], second);
                store_token_pair::<NR_>(y.add(t * y_stride), y_stride, sums, t + 1 < MT_);
                t += 2;
            }
        } else {
            for (t, acc_t) in acc.iter().enumerate() {
                for (r, a) in acc_t.iter().enumerate() {
                    *y.add(t * y_stride + r) = reduce16(*a);
                }
            }
        }
    }
}

/// Stores the sums of one or two tokens as the trees leave them: lanes `r < NR_` of `sums` are
/// the first token's rows (to `y[0 .. NR_]`), lanes `8 + r` the second token's (to
/// `y[y_stride .. y_stride + NR_]`, when `second`).
///
/// # Safety
/// `y` is valid for writing `NR_` floats, and `y + y_stride` too when `second`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn store_token_pair<const NR_: usize>(y: *mut f32, y_stride: usize, sums: __m512, second: bool) {
    let mask: __mmask16 = ((1u32 << NR_) - 1) as __mmask16;
    // SAFETY: the caller's contract covers both masked stores.
    unsafe {
        _mm512_mask_storeu_ps(y, mask, sums);
        if second {
            _mm512_mask_storeu_ps(y.add(y_stride), mask, _mm512_shuffle_f32x4::<0x0E>(sums, sums));
        }
    }
}

/// The lane sums of up to sixteen accumulators at once, each exactly [`reduce16`]'s: lanes
/// `r < NR_` of the result hold `reduce16(first[r])`, lanes `8 + r` hold `reduce16(second[r])`
/// (the other lanes are zero sums of no use).
///
/// One tree of shuffles and adds over sixteen vectors, where [`reduce16`] spends about nine
/// instructions on each: level by level it adds exactly the pairs that [`reduce16`] adds (lanes
/// `i` and `i + 8`, then `j` and `j + 4`, then `k` and `k + 2`, then 0 and 1), each vector's
/// partial sums moving into a shrinking share of a register, so every sum keeps its bits. The
/// tree ends with the sum of input `i` in lane `4 · (i % 4) + i / 4`, so the inputs are placed
/// in that (self-inverse) order and the outputs come out in row order. At 512 tokens, where the
/// per-accumulator sums took about a tenth of the tile's time on 1024-column matrices (the
/// `gemm_dpbf16` kernel benchmark), this is most of that tenth back.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn reduce_two_tokens<const NR_: usize>(first: &[__m512; NR_], second: Option<&[__m512; NR_]>) -> __m512 {
    debug_assert!(NR_ <= 8);
    let zero = _mm512_setzero_ps();
    lane_sums16(std::array::from_fn(|i| {
        let lane = 4 * (i % 4) + i / 4;
        match (lane / 8, lane % 8) {
            (0, r) if r < NR_ => first[r],
            (1, r) if r < NR_ => second.map_or(zero, |s| s[r]),
            _ => zero,
        }
    }))
}

/// The lane sums of a full tile's 24 accumulators (`acc[t · NR + r]`), each exactly
/// [`reduce16`]'s, without [`reduce_two_tokens`]'s eight zero inputs: sixteen go through
/// [`lane_sums16`] (tokens 0 and 1, and token 2's first four rows), the other eight through
/// [`lane_sums8`], and one two-source permutation gathers tokens 2 and 3. The result is laid out
/// as [`reduce_two_tokens`]'s: the first vector holds token 0's rows in lanes `0..NR` and token
/// 1's in lanes `8..8 + NR`, the second tokens 2 and 3.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn reduce_full_tile(acc: [__m512; MT * NR]) -> [__m512; 2] {
    const _: () = assert!(MT == 4 && NR == 6);
    // Tree A's lane `l`: token 0's rows in 0..6, token 1's in 8..14, token 2's rows 0 and 1 in
    // lanes 6 and 7, its rows 2 and 3 in lanes 14 and 15.
    let a = lane_sums16(std::array::from_fn(|i| {
        let lane = 4 * (i % 4) + i / 4;
        match lane {
            0..6 => acc[lane],
            6 | 7 => acc[2 * NR + lane - 6],
            8..14 => acc[NR + lane - 8],
            _ => acc[2 * NR + lane - 12],
        }
    }));
    // Tree B's eight inputs: token 2's rows 4 and 5, then token 3's six rows; `lane_sums8`
    // leaves input `m` of that list in lane `4 · (m / 2) + m % 2`.
    let rest: [__m512; 8] = std::array::from_fn(|m| acc[2 * NR + 4 + m]);
    let b = lane_sums8(std::array::from_fn(|i| if i < 4 { rest[2 * i] } else { rest[2 * (i - 4) + 1] }));
    // Token 2's rows in lanes 0..6 (A's lanes 6, 7, 14, 15, then B's 0 and 1), token 3's in
    // lanes 8..14 (B's 4, 5, 8, 9, 12, 13); indices of 16 and up pick from `b`.
    let gather = _mm512_setr_epi32(6, 7, 14, 15, 16, 17, 0, 0, 20, 21, 24, 25, 28, 29, 0, 0);
    [a, _mm512_permutex2var_ps(a, gather, b)]
}

/// The lane sums of sixteen vectors, each [`reduce16`]'s bits: input `i`'s sum in lane
/// `4 · (i % 4) + i / 4` (see [`reduce_two_tokens`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn lane_sums16(v: [__m512; 16]) -> __m512 {
    let u: [__m512; 8] = std::array::from_fn(|k| halves(v[2 * k], v[2 * k + 1]));
    let w: [__m512; 4] = std::array::from_fn(|m| quarters(u[2 * m], u[2 * m + 1]));
    let x: [__m512; 2] = std::array::from_fn(|n| pairs(w[2 * n], w[2 * n + 1]));
    ends(x[0], x[1])
}

/// The lane sums of eight vectors, each [`reduce16`]'s bits, by [`lane_sums16`]'s levels with
/// the last one within one register: input `j < 4` in lane `4 · j`, input `4 + j` in lane
/// `4 · j + 1` (the other lanes repeat them).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn lane_sums8(v: [__m512; 8]) -> __m512 {
    let u: [__m512; 4] = std::array::from_fn(|k| halves(v[2 * k], v[2 * k + 1]));
    let w: [__m512; 2] = std::array::from_fn(|m| quarters(u[2 * m], u[2 * m + 1]));
    let x = pairs(w[0], w[1]);
    ends(x, x)
}

/// The tree's first level: lanes `i` and `i + 8` of `a` in lanes `0..8`, of `b` in `8..16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn halves(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b))
}

/// The second level, on two first-level results: lanes `j` and `j + 4` of each of their four
/// halves, one per 128-bit block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn quarters(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b))
}

/// The third level: lanes `k` and `k + 2` of each block's quarter, `a`'s then `b`'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn pairs(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b))
}

/// The last level: lanes 0 and 1 of each remaining pair, one sum per lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn ends(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0x88>(a, b), _mm512_shuffle_ps::<0xDD>(a, b))
}

/// Dispatches to the tile for `mt <= MT` tokens and `nr <= NR` rows (arguments as [`tile`]).
///
/// # Safety
/// As [`tile`] with `MT_ = mt`, `NR_ = nr`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_dyn(
    mt: usize,
    nr: usize,
    w: *const u8,
    cols: usize,
    xb: *const u16,
    kp: usize,
    y: *mut f32,
    ys: usize,
    pf: Prefetch,
    span: ColumnSpan,
) {
    macro_rules! rows {
        ($m:literal, $p:literal) => {
            match nr {
                6 => tile::<$m, 6, $p>(w, cols, xb, kp, y, ys, pf, span),
                5 => tile::<$m, 5, $p>(w, cols, xb, kp, y, ys, pf, span),
                4 => tile::<$m, 4, $p>(w, cols, xb, kp, y, ys, pf, span),
                3 => tile::<$m, 3, $p>(w, cols, xb, kp, y, ys, pf, span),
                2 => tile::<$m, 2, $p>(w, cols, xb, kp, y, ys, pf, span),
                _ => tile::<$m, 1, $p>(w, cols, xb, kp, y, ys, pf, span),
            }
        };
    }
    macro_rules! tokens {
        ($p:literal) => {
            match mt {
                4 => rows!(4, $p),
                3 => rows!(3, $p),
                2 => rows!(2, $p),
                _ => rows!(1, $p),
            }
        };
    }
    // SAFETY: the caller's contract, for the tile chosen by `mt` and `nr`.
    unsafe { if pf.lines > 0 { tokens!(true) } else { tokens!(false) } }
}

/// Bytes of packed activations one token block may take (they stay in L2 while the task's
/// weight rows stream past them once per block).
const TOKEN_BLOCK_BYTES: usize = 512 * 1024;

/// Products with more columns than this run each tile's chains in spans of about
/// [`SPAN_COLS`] columns: all of a block's token tiles over one span of the tile's weight rows,
/// then the next span. A tile's working set (`NR` weight rows and `MT` packed activation rows
/// over its columns) then stays in the first-level cache while the token tiles pass. Over all
/// 3072 columns of Qwen3-0.6B's `down_proj` it is 60 KB against Zen 5's 48 KB, and the weights
/// came from L2 on every pass.
const SPAN_MAX_COLS: usize = 2048;
const SPAN_COLS: usize = 1024;
/// Token tiles of one block when a product runs in spans (the accumulator slots it keeps).
const CARRY_TILES: usize = 32;

/// [`gemm_rows`] for `MT_` (one or two) tokens: one weight row at a time, each row's tile
/// asking for the row [`ONE_ROW_PREFETCH_BYTES`] ahead (while that row is one of `r0..r1`).
/// A loop of its own, so that each row costs a tile call and no more: through `gemm_rows`'
/// general loop (spans, token blocks, `tile_dyn`'s dispatch) qwen3-0.6b-shaped decoded at 52.3,
/// 52.5, 51.4, 52.3, 52.6 tokens/s on 2 Zen 5 cores where this loop decodes at 54.1, 54.7,
/// 54.8, 55.1, 54.6 (alternating runs).
///
/// # Safety
/// As [`gemm_rows`], with `xb` pointing to `MT_` packed rows of `kp` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn one_row_tiles<const MT_: usize>(
    w: *const u8,
    cols: usize,
    xb: *const u16,
    kp: usize,
    y: *mut f32,
    y_stride: usize,
    r0: usize,
    r1: usize,
) {
    let row_bytes = cols * 2;
    let ahead = ONE_ROW_PREFETCH_BYTES.div_ceil(row_bytes.max(1));
    let whole_row = ColumnSpan { c0: 0, c1: cols, carry: std::ptr::null_mut() };
    for r in r0..r1 {
        let lines = if r + ahead < r1 { row_bytes.div_ceil(64) } else { 0 };
        let next = Prefetch { start: w.wrapping_add((r + ahead) * row_bytes), lines };
        // SAFETY: row `r < r1` exists and its outputs are the caller's; one whole-row span
        // never touches a carry.
        unsafe { tile::<MT_, 1, true>(w.add(r * row_bytes), cols, xb, kp, y.add(r), y_stride, next, whole_row) };
    }
}

/// Computes output rows `r0..r1` of `y = bf16(x) · Wᵀ` for all `n_tokens` tokens from the rows
/// [`pack_rows`] wrote: token blocks whose packed rows stay in L2; inside a block, each tile of
/// `NR` weight rows (in L1) runs across the block's token tiles, and those passes prefetch the
/// next tile's rows between them. Without that, batched decode (7 to 16 tokens) alternates
/// between waiting for memory (the first pass) and computing with the memory idle (the others);
/// with it, 8 tokens cost about what one does (BENCHMARKS.md, `model_bf16_dot`). Which
/// products prefetch is [`crate::prefetches_weights`]'s rule, except that up to
/// [`ONE_ROW_MAX_TOKENS`] tokens read one row at a time ([`one_row_tiles`]).
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 are available; `w` points to `rows × cols` BF16 weights with `r1 <=
/// rows`; `xb` holds `n_tokens` packed rows; `y` is valid for writing `y[t * y_stride + r]`,
/// `t < n_tokens`, `r0 <= r < r1`, which no one else accesses meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_rows(
    w: *const u8,
    cols: usize,
    xb: &[u16],
    n_tokens: usize,
    y: *mut f32,
    y_stride: usize,
    r0: usize,
    r1: usize,
) {
    let kp = row_len(cols);
    debug_assert!(xb.len() >= n_tokens * kp);
    const _: () = assert!(ONE_ROW_MAX_TOKENS == 2);
    // SAFETY (both): the caller's contract, for one or two tokens.
    match n_tokens {
        0 => return,
        1 => return unsafe { one_row_tiles::<1>(w, cols, xb.as_ptr(), kp, y, y_stride, r0, r1) },
        2 => return unsafe { one_row_tiles::<2>(w, cols, xb.as_ptr(), kp, y, y_stride, r0, r1) },
        _ => {}
    }
    let block = (TOKEN_BLOCK_BYTES / (kp * 2).max(1) / MT * MT).max(MT);
    let prefetching = crate::prefetches_weights(n_tokens);
    // Wide products run each tile's chains in column spans (see `SPAN_COLS`), their
    // accumulators waiting in `carry` (one slot of MT × NR per token tile of a block) between
    // spans.
    let spans = if cols <= SPAN_MAX_COLS { 1 } else { cols.div_ceil(SPAN_COLS) };
    let span_cols = cols.div_ceil(spans).next_multiple_of(K);
    let block = if spans > 1 { block.min(CARRY_TILES * MT) } else { block };
    let mut carry = std::mem::MaybeUninit::<[__m512; CARRY_TILES * MT * NR]>::uninit();
    let carry = carry.as_mut_ptr() as *mut __m512;
    let mut t0 = 0;
    while t0 < n_tokens {
        let t1 = (t0 + block).min(n_tokens);
        let passes = (t1 - t0).div_ceil(MT) * spans;
        let mut r = r0;
        while r < r1 {
            let nr = NR.min(r1 - r);
            // The next tile's rows follow this tile's in memory: each pass over this tile's
            // rows prefetches its share of them.
            let next = w.wrapping_add((r + nr) * cols * 2);
            let next_lines = if prefetching { (NR.min(r1 - (r + nr)) * cols * 2).div_ceil(64) } else { 0 };
            let per_pass = next_lines.div_ceil(passes);
            let mut pass = 0;
            let mut c0 = 0;
            while c0 < cols {
                let c1 = (c0 + span_cols).min(cols);
                let mut t = t0;
                while t < t1 {
                    let mt = MT.min(t1 - t);
                    let first = (pass * per_pass).min(next_lines);
                    let pf = Prefetch {
                        start: next.wrapping_add(first * 64),
                        lines: (first + per_pass).min(next_lines) - first,
                    };
                    // One span (c0 = 0, c1 = cols) never touches its carry slot.
                    let span = ColumnSpan { c0, c1, carry: carry.wrapping_add((t - t0) / MT * MT * NR) };
                    // SAFETY: rows `r..r + nr <= r1` and tokens `t..t + mt <= n_tokens` exist,
                    // and their outputs belong to the caller's range; the block has at most
                    // CARRY_TILES token tiles, each with its own slot of `carry`, which a span
                    // reads only after the span before it wrote it.
                    unsafe {
                        tile_dyn(
                            mt,
                            nr,
                            w.add(r * cols * 2),
                            cols,
                            xb.as_ptr().add(t * kp),
                            kp,
                            y.add(t * y_stride + r),
                            y_stride,
                            pf,
                            span,
                        )
                    };
                    t += mt;
                    pass += 1;
                }
                c0 = c1;
            }
            r += nr;
        }
        t0 = t1;
    }
}
