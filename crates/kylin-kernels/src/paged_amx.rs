//! The AMX path of blocked attention under `Precision::Bf16`: `S = bf16(Q) · Kᵀ` and
//! `O += bf16(P) · V` on AMX tiles with f32 accumulation (what transformers computes for a BF16
//! model: both products of attention take BF16 inputs), the online softmax in f32 on AVX-512
//! between them.
//!
//! The cache is BF16 in the pair layout ([`super::KvLayout::Pairs`]), which is AMX's B-operand
//! layout, so the tiles load keys and values straight from the pool with no packing (a decode
//! step, one or two query rows, would otherwise spend most of its time packing):
//!
//! - keys: per 16 positions of a block, `(head_dim / 2, 16, 2)`: pair row `r` holds dimensions
//!   `2r, 2r + 1` of the sixteen keys; one B tile is sixteen pair rows (32 dimensions);
//! - values: per block, `(block_size / 2, head_dim, 2)`: pair row `r` holds positions `2r,
//!   2r + 1` of every dimension; one B tile is eight pair rows (16 positions, narrow) or sixteen
//!   (32 positions, wide: block sizes that are multiples of 32) of sixteen dimensions, rows
//!   `2·head_dim` elements apart.
//!
//! Same structure as the f32 path of [`super`] (absolute partitions of [`PARTITION`]
//! positions folded in order), with tiles of [`AMX_TILE`] = 128 positions. Per tile, per block
//! of up to 16 query rows: `S` (rows × 128) in two halves of 64 columns, each from `hd / 32`
//! steps of up to four tile products, stored; each row's online-softmax update in f32 (`m`,
//! `corr = e^(m - m')`, `p = e^(s - m')` with positions `>= len` at 0, `l = fma(l, corr, sum
//! p)` with the sum `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))` then `hsum(lo + hi)`),
//! `o = o · corr` when `corr != 1`, `p` rounded to BF16; then `o += P · V` per sixteen
//! dimensions as one tile product per sixteen positions (narrow) or thirty-two (wide), in
//! order, `o` loaded into and stored from a C tile once per tile of 128 positions.
//!
//! Batch invariance: each element of a tile product depends only on its row of A and column of
//! B, so a row's `S`, `p` and `o` are the same whatever rows share its block (the tiles are
//! configured with `min(rows, 16)` rows); positions a row does not attend to enter its products
//! only as `p = 0` (adding zero; at most the sign of an exact zero could differ). Slots of a
//! block past the sequence's length are loaded too: their scores are masked and their values
//! meet `p = 0`, so they must be finite, which the pool guarantees by zeroing a block's tile
//! when its first position is written.
//!
//! Conditions (checked by the caller): AMX permitted, BF16 pair-layout cache, `head_dim % 32
//! == 0`, `block_size % 16 == 0`.

// Register-blocked loops index several arrays by row on purpose (fixed trip counts the
// compiler unrolls into registers).
#![allow(clippy::needless_range_loop)]

use std::arch::asm;
use std::arch::x86_64::*;

use super::simd::Zmm;
use super::{Job, Lanes, MAX_HEAD_DIM, MAX_ROWS, PARTITION, PartialStats, QueryRow, Stats, fold_row, softcap_lanes};
use crate::amx::{TileConfig, round16};

/// Positions per tile of the AMX path.
pub const AMX_TILE: usize = 128;
// The softmax below sums and takes the maximum of exactly eight 16-lane vectors per row.
const _: () = assert!(PARTITION.is_multiple_of(AMX_TILE) && AMX_TILE == 128);
/// 16-position chunks per tile.
const CHUNKS: usize = AMX_TILE / 16;
/// 16-lane vectors per row of a tile's scores.
const QUARTERS: usize = AMX_TILE / 16;

/// 64-byte aligned storage.
#[repr(C, align(64))]
struct Aligned<T>(T);

/// The stack buffers of one call of a BF16 attention path (this one and `paged_dpbf16`), each
/// 64-byte aligned: the queries in BF16, (MAX_ROWS, MAX_HEAD_DIM); one group's scores in f32,
/// (ROWS, AMX_TILE); their P in BF16, (ROWS, AMX_TILE); the partition's o in f32, (MAX_ROWS,
/// MAX_HEAD_DIM). Only the parts a call uses are written, and written before read; scores and P
/// start zeroed.
pub(super) struct Scratch<const ROWS: usize> {
    queries: std::mem::MaybeUninit<Aligned<[[u16; MAX_HEAD_DIM]; MAX_ROWS]>>,
    scores: Aligned<[[f32; AMX_TILE]; ROWS]>,
    probs: Aligned<[[u16; AMX_TILE]; ROWS]>,
    out: std::mem::MaybeUninit<Aligned<[[f32; MAX_HEAD_DIM]; MAX_ROWS]>>,
}

impl<const ROWS: usize> Scratch<ROWS> {
    pub(super) fn new() -> Self {
        Scratch {
            queries: std::mem::MaybeUninit::uninit(),
            scores: Aligned([[0.0; AMX_TILE]; ROWS]),
            probs: Aligned([[0; AMX_TILE]; ROWS]),
            out: std::mem::MaybeUninit::uninit(),
        }
    }

    /// Pointers to the first element of the queries, scores, P and o buffers.
    pub(super) fn pointers(&mut self) -> (*mut u16, *mut f32, *mut u16, *mut f32) {
        (
            self.queries.as_mut_ptr() as *mut u16,
            self.scores.0.as_mut_ptr() as *mut f32,
            self.probs.0.as_mut_ptr() as *mut u16,
            self.out.as_mut_ptr() as *mut f32,
        )
    }
}

/// `ldtilecfg`'s operand for one call of `rows` query rows (1 to 16 per block): tmm0 the
/// queries (A, 32 dimensions), tmm2-5 scores or outputs (C, sixteen columns), and
///
/// - narrow (block size 16, 48, ...): tmm1 sixteen positions of P (A), tmm6 sixteen key pair
///   rows (B), tmm7 eight value pair rows (B);
/// - wide (block size a multiple of 32): tmm1 thirty-two positions of P (A), tmm6 and tmm7
///   sixteen pair rows each (B), used in turn for keys and for values, so that a tile load
///   never waits for the product reading the register before it.
fn tile_config(rows: u8, wide: bool) -> TileConfig {
    let r = rows;
    if wide {
        TileConfig::new([64; 8], [r, r, r, r, r, r, 16, 16])
    } else {
        TileConfig::new([64, 32, 64, 64, 64, 64, 64, 64], [r, r, r, r, r, r, 16, 8])
    }
}

/// Tile register operations with the register number as a literal.
macro_rules! tile {
    (zero $t:literal) => {
        asm!(concat!("tilezero tmm", $t), options(nostack, nomem))
    };
    (load $t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{0} + {1}*1]"), in(reg) $p, in(reg) $stride, options(nostack, readonly))
    };
    (store $t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tilestored [{0} + {1}*1], tmm", $t), in(reg) $p, in(reg) $stride, options(nostack))
    };
    (dp $c:literal, $a:literal, $b:literal) => {
        asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
    };
}

/// `S = Q · Kᵀ` for one block of query rows and up to four 16-position chunks (64 columns),
/// stored as f32 at `out` with row stride `out_stride` bytes: tmm2..tmm5 accumulate the chunks
/// over `hd / 32` steps; each step loads the queries' 32 dimensions (tmm0) and one key tile per
/// chunk (sixteen pair rows, 1 KiB, contiguous), in tmm6 only (narrow) or tmm6 and tmm7 in
/// turn (wide).
///
/// # Safety
/// The tile configuration of [`tile_config`] is loaded; `q` holds the block's rows (`hd`
/// BF16 each, padded to the configured row count); `kc[..chunks]` point at whole key chunks;
/// `out` has room for the configured rows × 64 f32 at `out_stride`; `1 <= chunks <= 4`.
#[inline(always)]
unsafe fn scores_half<const WIDE: bool>(
    q: *const u16,
    hd: usize,
    kc: &[*const u16],
    chunks: usize,
    out: *mut f32,
    out_stride: usize,
) {
    // SAFETY: as the caller promises.
    unsafe {
        tile!(zero 2);
        tile!(zero 3);
        tile!(zero 4);
        tile!(zero 5);
        for k in 0..hd / 32 {
            tile!(load 0, q.add(32 * k), hd * 2);
            tile!(load 6, kc[0].add(512 * k), 64usize);
            tile!(dp 2, 0, 6);
            if WIDE {
                if chunks > 1 {
                    tile!(load 7, kc[1].add(512 * k), 64usize);
                    tile!(dp 3, 0, 7);
                }
                if chunks > 2 {
                    tile!(load 6, kc[2].add(512 * k), 64usize);
                    tile!(dp 4, 0, 6);
                }
                if chunks > 3 {
                    tile!(load 7, kc[3].add(512 * k), 64usize);
                    tile!(dp 5, 0, 7);
                }
            } else {
                if chunks > 1 {
                    tile!(load 6, kc[1].add(512 * k), 64usize);
                    tile!(dp 3, 0, 6);
                }
                if chunks > 2 {
                    tile!(load 6, kc[2].add(512 * k), 64usize);
                    tile!(dp 4, 0, 6);
                }
                if chunks > 3 {
                    tile!(load 6, kc[3].add(512 * k), 64usize);
                    tile!(dp 5, 0, 6);
                }
            }
        }
        tile!(store 2, out, out_stride);
        tile!(store 3, out.add(16), out_stride);
        tile!(store 4, out.add(32), out_stride);
        tile!(store 5, out.add(48), out_stride);
    }
}

/// The query rows rounded to BF16, `(n_pad, hd)` at `qb`, rows past `rows.len()` zero. Shared
/// by both BF16 paths.
///
/// # Safety
/// AVX-512 F/BW/VL available; `qb` has room for `n_pad · hd` values; each row holds `hd`
/// elements, a multiple of 16.
#[inline(always)]
pub(super) unsafe fn round_queries(rows: &[QueryRow<'_>], hd: usize, n_pad: usize, qb: *mut u16) {
    // SAFETY: as the caller promises.
    unsafe {
        for i in 0..n_pad {
            let dst = qb.add(i * hd);
            for c in (0..hd).step_by(16) {
                let v = if i < rows.len() { _mm512_loadu_ps(rows[i].q.as_ptr().add(c)) } else { _mm512_setzero_ps() };
                _mm256_storeu_si256(dst.add(c) as *mut __m256i, _mm512_cvtepi32_epi16(round16(v)));
            }
        }
    }
}

/// One row's online-softmax update over a tile of [`AMX_TILE`] unscaled scores at `srow`
/// (64-byte aligned), of which positions `lo..hi` (`lo < hi`) are the row's, in f32:
/// `s = srow · scale`, then `s = cap · tanh(s / cap)` with a soft cap (`softcap`, only ever
/// given by the AVX-512 BF16 path), with positions outside `lo..hi` at `-inf`;
/// `m' = max(m, max s)`; `corr = e^(m - m')`; `p = e^(s - m')` with positions outside `lo..hi`
/// at 0; `l = fma(l, corr, sum p)`, the sum `((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`
/// then across lanes. Writes `p` rounded to BF16 at `prow` and returns `corr`. Shared by both
/// BF16 paths, so both compute a row's softmax with the same operations (the AMX path passes
/// `lo = 0` and no soft cap: its operations are the ones it always had).
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2 and FMA available; `srow` holds [`AMX_TILE`] f32, `prow` has room for
/// [`AMX_TILE`] BF16 values.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn softmax_row(
    srow: *const f32,
    scale: __m512,
    softcap: Option<f32>,
    lo: usize,
    hi: usize,
    m: &mut f32,
    l: &mut f32,
    prow: *mut u16,
) -> f32 {
    // SAFETY: as the caller promises.
    unsafe {
        let mut s: [Zmm; QUARTERS] =
            std::array::from_fn(|q| Zmm(_mm512_mul_ps(_mm512_load_ps(srow.add(16 * q)), scale)));
        if let Some(cap) = softcap {
            s = s.map(|x| softcap_lanes(x, cap));
        }
        let s: [Zmm; QUARTERS] =
            std::array::from_fn(|q| s[q].keep(lo.saturating_sub(16 * q), hi.saturating_sub(16 * q), f32::NEG_INFINITY));
        let top4 = |b: usize| Zmm::max(Zmm::max(s[b], s[b + 1]), Zmm::max(s[b + 2], s[b + 3]));
        let top = Zmm::max(top4(0), top4(4)).reduce_max();
        let m_new = m.max(top);
        let c = Zmm::exp1(*m - m_new);
        let mv = Zmm::splat(m_new);
        let p: [Zmm; QUARTERS] = std::array::from_fn(|q| {
            Zmm::exp(Zmm::sub(s[q], mv)).keep(lo.saturating_sub(16 * q), hi.saturating_sub(16 * q), 0.0)
        });
        let quad = |b: usize| Zmm::add(Zmm::add(p[b], p[b + 1]), Zmm::add(p[b + 2], p[b + 3]));
        let sum = Zmm::add(quad(0), quad(4)).reduce_add();
        *l = Zmm::fma1(*l, c, sum);
        *m = m_new;
        for (q, pq) in p.iter().enumerate() {
            _mm256_storeu_si256(prow.add(16 * q) as *mut __m256i, _mm512_cvtepi32_epi16(round16(pq.0)));
        }
        c
    }
}

/// Each query row's online-softmax state: the current partition's running maximum and sum
/// (`m`, `l`) and the state `(M, L)` of the partitions folded so far. Shared by both BF16 paths.
pub(super) struct RowStates {
    pub(super) m: [f32; MAX_ROWS],
    pub(super) l: [f32; MAX_ROWS],
    big_m: [f32; MAX_ROWS],
    big_l: [f32; MAX_ROWS],
}

impl RowStates {
    /// Before any partition.
    pub(super) fn new() -> Self {
        RowStates {
            m: [0.0; MAX_ROWS],
            l: [0.0; MAX_ROWS],
            big_m: [f32::NEG_INFINITY; MAX_ROWS],
            big_l: [0.0; MAX_ROWS],
        }
    }

    /// Starts a partition for rows `0..n`: `m = -inf`, `l = 0`, and their undivided outputs `o`
    /// (row stride [`MAX_HEAD_DIM`]) zero over `hd` elements.
    ///
    /// # Safety
    /// `o` has room for `n` rows at that stride; `n <= MAX_ROWS`.
    #[inline(always)]
    pub(super) unsafe fn start_partition(&mut self, n: usize, o: *mut f32, hd: usize) {
        for i in 0..n {
            self.m[i] = f32::NEG_INFINITY;
            self.l[i] = 0.0;
            // SAFETY: as the caller promises.
            unsafe { std::ptr::write_bytes(o.add(i * MAX_HEAD_DIM), 0, hd) };
        }
    }

    /// Folds the partition `part0..part_end` (undivided outputs `o` at a row stride of
    /// [`MAX_HEAD_DIM`]) into the state of every row with a position in it (`len > part0`,
    /// `from < part_end`): `M' = max(M, m)`, `a = e^(M - M')`,
    /// `b = e^(m - M')`, `L = fma(l, b, L · a)`, `out = fma(o, b, out · a)` (the fold
    /// `merge_partitions` repeats).
    ///
    /// # Safety
    /// AVX-512 F and FMA available; `o` holds `rows.len()` rows of `hd` f32 at that stride;
    /// every row's `out` holds at least `hd` elements.
    #[inline(always)]
    pub(super) unsafe fn fold_partition(
        &mut self,
        rows: &mut [QueryRow<'_>],
        hd: usize,
        (part0, part_end): (usize, usize),
        o: *const f32,
    ) {
        // SAFETY: as the caller promises.
        unsafe {
            for (i, r) in rows.iter_mut().enumerate() {
                if r.len <= part0 || r.from >= part_end {
                    continue;
                }
                let big = self.big_m[i].max(self.m[i]);
                let a = Zmm::exp1(self.big_m[i] - big);
                let b = Zmm::exp1(self.m[i] - big);
                self.big_l[i] = Zmm::fma1(self.l[i], b, self.big_l[i] * a);
                let orow = std::slice::from_raw_parts(o.add(i * MAX_HEAD_DIM), hd);
                fold_row::<Zmm>(&mut r.out[..hd], orow, a, b);
                self.big_m[i] = big;
            }
        }
    }

    /// Each row's state after the folded partitions.
    pub(super) fn stats(&self) -> Stats {
        std::array::from_fn(|i| PartialStats { m: self.big_m[i], l: self.big_l[i] })
    }
}

/// The AMX body of `attention_rows` over a BF16 pair-layout cache: each row's `out` undivided,
/// its state returned.
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2, FMA, F16C and AMX-BF16 are available and permitted; the checks of
/// `attention_rows` passed; the cache is BF16 in the pair layout; `head_dim % 32 == 0` and
/// `block_size % 16 == 0`; `WIDE` only if `block_size % 32 == 0`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn rows_amx<const WIDE: bool>(rows: &mut [QueryRow<'_>], job: &Job<'_>) -> Stats {
    let n = rows.len();
    let keys = &job.keys;
    let (hd, bs) = (keys.head_dim, keys.block_size);
    debug_assert!(hd % 32 == 0 && bs % 16 == 0 && hd <= MAX_HEAD_DIM && n <= MAX_ROWS);
    debug_assert!(!WIDE || bs % 32 == 0);
    let max_len = rows.iter().map(|r| r.len).max().unwrap_or(0);
    // Rows per block of the tile products, and the query rows with their padding to whole
    // blocks.
    let tile_rows = n.min(16);
    let n_pad = n.div_ceil(16) * tile_rows;

    // Stack buffers: queries (n_pad of the rows used), and scores and P for a block of 16 rows.
    let mut scratch = Scratch::<16>::new();
    let (qb, sc, pb, o) = scratch.pointers();

    let mut state = RowStates::new();
    let mut valid = [0usize; MAX_ROWS];

    // SAFETY (whole body): every pointer below stays inside its buffer (row and column counts
    // bounded by n_pad <= MAX_ROWS, hd <= MAX_HEAD_DIM, AMX_TILE); a tile load from the pool
    // reads sixteen positions starting at a multiple of 16 below `max_len`, which lie in one
    // block of the table (block_size % 16 == 0), checked to be inside the pool by the caller.
    unsafe {
        round_queries(rows, hd, n_pad, qb);
        for r in rows.iter_mut() {
            r.out[..hd].fill(0.0);
        }
        let config = tile_config(tile_rows as u8, WIDE);
        crate::amx::load_config(&config);
        let data_k = keys.data.as_ptr() as *const u16;
        let data_v = job.values.data.as_ptr() as *const u16;
        debug_assert!(job.min_from == 0 && job.map.softcap.is_none());
        let scale = _mm512_set1_ps(job.map.scale);
        let o_stride = MAX_HEAD_DIM * 4;
        let v_stride = hd * 4;

        let (mut part0, end) = job.span(max_len);
        while part0 < end {
            let part_end = (part0 + PARTITION).min(max_len);
            state.start_partition(n, o, hd);
            let mut t0 = part0;
            while t0 < part_end {
                let tile_len = AMX_TILE.min(part_end - t0);
                for (i, r) in rows.iter().enumerate() {
                    valid[i] = r.len.saturating_sub(t0).min(AMX_TILE);
                }
                // The tile's 16-position chunks: in both layouts, the chunk at slot `j` of its
                // block starts `j · hd` elements into the block's (layer, head) tile.
                let chunks = tile_len.div_ceil(16);
                let mut kc = [data_k; CHUNKS];
                let mut vc = [data_v; CHUNKS];
                for c in 0..chunks {
                    let p = t0 + 16 * c;
                    let at = keys.tile_base(job.blocks, job.offset, p) + (p % bs) * hd;
                    kc[c] = data_k.add(at);
                    vc[c] = data_v.add(at);
                }
                for r0 in (0..n).step_by(16) {
                    let count = (n - r0).min(16);
                    if valid[r0..r0 + count].iter().all(|&v| v == 0) {
                        continue;
                    }
                    // S = Q · Kᵀ, per half tile of 64 positions: tmm2..tmm5 for its four chunks.
                    let s_stride = AMX_TILE * 4;
                    for half in 0..chunks.div_ceil(4) {
                        scores_half::<WIDE>(
                            qb.add(r0 * hd),
                            hd,
                            &kc[4 * half..],
                            (chunks - 4 * half).min(4),
                            sc.add(64 * half),
                            s_stride,
                        );
                    }
                    // The online softmax of each row; P rounded to BF16.
                    for i in 0..tile_rows {
                        let row = r0 + i;
                        let prow = pb.add(i * AMX_TILE);
                        let v = if i < count { valid[row] } else { 0 };
                        if v == 0 {
                            std::ptr::write_bytes(prow, 0, AMX_TILE);
                            continue;
                        }
                        // No window and no soft cap here (`run` asserts it).
                        let (m, l) = (&mut state.m[row], &mut state.l[row]);
                        let c = softmax_row(sc.add(i * AMX_TILE), scale, None, 0, v, m, l, prow);
                        // o = o · corr (a multiplication by one changes nothing, so it is skipped).
                        if c != 1.0 {
                            let orow = o.add(row * MAX_HEAD_DIM);
                            let cv = _mm512_set1_ps(c);
                            for d in (0..hd).step_by(16) {
                                _mm512_storeu_ps(orow.add(d), _mm512_mul_ps(_mm512_loadu_ps(orow.add(d)), cv));
                            }
                        }
                    }
                    // o += P · V, per group of four 16-dimension blocks (tmm2..tmm5, loaded from
                    // and stored to o), one product per chunk in order: A = P's chunk (tmm1),
                    // B = the chunk's value pair rows.
                    let p_stride = AMX_TILE * 2;
                    let blocks16 = hd / 16;
                    let mut d0 = 0;
                    while d0 < blocks16 {
                        // hd % 32 == 0, so the dimension blocks come in pairs.
                        let four = d0 + 2 < blocks16;
                        let oc = o.add(r0 * MAX_HEAD_DIM + 16 * d0);
                        tile!(load 2, oc, o_stride);
                        tile!(load 3, oc.add(16), o_stride);
                        if four {
                            tile!(load 4, oc.add(32), o_stride);
                            tile!(load 5, oc.add(48), o_stride);
                        }
                        if WIDE {
                            // Thirty-two positions per product (sixteen value pair rows, which
                            // lie in one block), values alternating between tmm6 and tmm7; the
                            // second half of a last chunk of sixteen meets p = 0.
                            for c in (0..chunks).step_by(2) {
                                tile!(load 1, pb.add(16 * c), p_stride);
                                let vp = vc[c].add(16 * 2 * d0);
                                tile!(load 6, vp, v_stride);
                                tile!(dp 2, 1, 6);
                                tile!(load 7, vp.add(32), v_stride);
                                tile!(dp 3, 1, 7);
                                if four {
                                    tile!(load 6, vp.add(64), v_stride);
                                    tile!(dp 4, 1, 6);
                                    tile!(load 7, vp.add(96), v_stride);
                                    tile!(dp 5, 1, 7);
                                }
                            }
                        } else {
                            // Sixteen positions per product (eight value pair rows, tmm7).
                            for c in 0..chunks {
                                tile!(load 1, pb.add(16 * c), p_stride);
                                let vp = vc[c].add(16 * 2 * d0);
                                tile!(load 7, vp, v_stride);
                                tile!(dp 2, 1, 7);
                                tile!(load 7, vp.add(32), v_stride);
                                tile!(dp 3, 1, 7);
                                if four {
                                    tile!(load 7, vp.add(64), v_stride);
                                    tile!(dp 4, 1, 7);
                                    tile!(load 7, vp.add(96), v_stride);
                                    tile!(dp 5, 1, 7);
                                }
                            }
                        }
                        tile!(store 2, oc, o_stride);
                        tile!(store 3, oc.add(16), o_stride);
                        if four {
                            tile!(store 4, oc.add(32), o_stride);
                            tile!(store 5, oc.add(48), o_stride);
                        }
                        d0 += 4;
                    }
                }
                t0 += AMX_TILE;
            }
            state.fold_partition(rows, hd, (part0, part_end), o);
            part0 = part_end;
        }
        crate::amx::release();
    }
    state.stats()
}
