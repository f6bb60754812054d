//! The AVX-512 BF16 path of blocked attention under `Precision::Bf16`, for CPUs with
//! `vdpbf16ps` but no AMX (AMD Zen 4, Intel Cooper Lake): the same arithmetic contract as the
//! AMX path (`S = bf16(Q) · Kᵀ` and `O += bf16(P) · V` with f32 accumulation, the online
//! softmax in f32 between them), on sixteen-lane dot products of BF16 pairs.
//!
//! It reads the same BF16 pair-layout cache ([`super::KvLayout::Pairs`]), which is exactly the
//! operand layout `vdpbf16ps` wants on both sides, so nothing is packed per call:
//!
//! - keys: per 16 positions of a block, `(head_dim / 2, 16, 2)`: one 64-byte vector is one
//!   pair of dimensions of sixteen positions, multiplied by a broadcast pair of the query, so a
//!   lane accumulates one position's score;
//! - values: per block, `(block_size / 2, head_dim, 2)`: one 64-byte vector is one pair of
//!   positions of sixteen dimensions, multiplied by a broadcast pair of `P`, so a lane
//!   accumulates one output dimension.
//!
//! Same structure as the AMX path (absolute partitions of [`PARTITION`] positions folded in
//! order, tiles of [`AMX_TILE`] = 128 positions, the same softmax and fold code), with groups
//! of at most four query rows in registers, or eight for a GQA group of eight (see
//! [`rows_dpbf16`]).
//!
//! # The canonical computation of a row (batch invariance)
//!
//! For each tile that holds a position of the row's `from..len` (partitions and tiles at
//! absolute multiples, as in [`super`]; the others are skipped for the row):
//! - each score is one `vdpbf16ps` chain from zero over the dimension pairs in order (lane =
//!   position), then multiplied by the scale, then soft-capped if the call has a cap
//!   (`cap · tanh(s / cap)`, the lane operations of [`super`]); positions outside `from..len`
//!   are `-inf`;
//! - the online-softmax update of the AMX path, bit for bit the same operations;
//! - each output dimension is `o · corr` followed by one `vdpbf16ps` chain over the tile's
//!   position pairs in order (lane = dimension).
//!
//! A row's registers are its own: which rows share its group, how many there are and whether
//! other rows attend to a tile never changes an instruction applied to its lanes. Rows that do
//! not attend to a tile are left out of the tile entirely, exactly as when the row is computed
//! alone. Positions of a tile outside the row's `from..len` enter its value chains as `p = 0`:
//! a chain starts from `o · corr`, which is `+0` or not zero, so adding the products `±0`
//! changes no bit, and the row's result is the same whichever other rows set how many chunks
//! the tile has. Slots of a block past the sequence's length are loaded (their scores masked,
//! their values meeting `p = 0`), so they must be finite, which the pool guarantees by zeroing a
//! block's tile when its first position is written. Chunks wholly below the call's smallest
//! `from` are not read at all: their pointers repeat the first chunk that holds a position of
//! the window (the window's blocks may have been freed and reused).
//!
//! Conditions (checked by the caller): AVX-512 BF16, BF16 pair-layout cache, `head_dim % 32
//! == 0`, `block_size % 16 == 0`.

// Register-blocked loops index several arrays by row on purpose (fixed trip counts the
// compiler unrolls into registers).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::paged_amx::{RowStates, Scratch, round_queries, softmax_row};
use super::{Job, MAX_HEAD_DIM, MAX_ROWS, NextTile, PARTITION, QueryRow, Stats};

/// Positions per tile (the AMX path's, whose softmax `softmax_row` both paths run).
const TILE: usize = super::paged_amx::AMX_TILE;
const _: () = assert!(PARTITION.is_multiple_of(TILE));
/// 16-position chunks per tile.
const CHUNKS: usize = TILE / 16;
/// Chunks of 16 positions (and blocks of 16 output dimensions) a micro-kernel of `rows` rows
/// covers at once: 16 accumulators in all (up to four rows over four, five to eight rows over
/// two).
const fn chunks_for(rows: usize) -> usize {
    if rows > 4 { 2 } else { 4 }
}

/// The 32 bits at `p` (a pair of BF16 values) in every lane.
///
/// # Safety
/// `p` is readable for four bytes.
#[inline(always)]
unsafe fn broadcast_pair(p: *const u16) -> __m512bh {
    // SAFETY: as the caller promises.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32((p as *const i32).read_unaligned())) }
}

/// Sixty-four bytes at `p` as 32 BF16 values.
///
/// # Safety
/// `p` is readable for 64 bytes.
#[inline(always)]
unsafe fn load_pairs(p: *const u16) -> __m512bh {
    // SAFETY: as the caller promises.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i)) }
}

/// Scores of `R` query rows against `C` 16-position chunks: `out[r][16c + j] = Σ_pairs
/// q_r · k_{c,j}` (unscaled), one chain per (row, chunk) over the `hd / 2` dimension pairs in
/// order, asking for `per_pair` lines of the next tile's blocks per pair ([`NextTile`]).
///
/// # Safety
/// AVX-512 F/BF16 available; `q[r]` holds `hd` BF16 values; `kc[c]` points at a whole key chunk
/// (`hd / 2` pair rows of 64 bytes); `out` has room for `R` rows of [`TILE`] f32.
#[inline(always)]
unsafe fn scores_micro<const R: usize, const C: usize, const G: usize>(
    q: &[*const u16; G],
    hd: usize,
    kc: &[*const u16; C],
    out: *mut f32,
    next: &mut NextTile,
    per_pair: usize,
) {
    // SAFETY: as the caller promises.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for k in 0..hd / 2 {
            next.step(per_pair);
            let kv: [__m512bh; C] = std::array::from_fn(|c| load_pairs(kc[c].add(32 * k)));
            for r in 0..R {
                let qp = broadcast_pair(q[r].add(2 * k));
                for c in 0..C {
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qp, kv[c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                _mm512_store_ps(out.add(r * TILE + 16 * c), acc[r][c]);
            }
        }
    }
}

/// [`scores_micro`] over all the tile's `chunks`, [`chunks_for`]`(R)` at a time.
///
/// # Safety
/// As [`scores_micro`], for every chunk of `kc`.
#[inline(always)]
unsafe fn scores_rows<const R: usize, const G: usize>(
    q: &[*const u16; G],
    hd: usize,
    kc: &[*const u16; CHUNKS],
    chunks: usize,
    sc: *mut f32,
    next: &mut NextTile,
    per_pair: usize,
) {
    const { assert!(CHUNKS.is_multiple_of(chunks_for(R))) };
    let c = chunks_for(R);
    // SAFETY: as the caller promises; `kc` has CHUNKS pointers, a multiple of `c`.
    unsafe {
        for part in 0..chunks.div_ceil(c) {
            let out = sc.add(16 * c * part);
            if c == 2 {
                let k2: [*const u16; 2] = std::array::from_fn(|i| kc[2 * part + i]);
                scores_micro::<R, 2, G>(q, hd, &k2, out, next, per_pair);
            } else {
                let k4: [*const u16; 4] = std::array::from_fn(|i| kc[4 * part + i]);
                scores_micro::<R, 4, G>(q, hd, &k4, out, next, per_pair);
            }
        }
    }
}

/// One group's `o = o · corr + P · V` over one tile: the operands [`values_micro`] and
/// [`values_rows`] read.
struct ValueTile<'a, const G: usize> {
    /// Each row's partition output, `hd` f32 (rows past the group's count repeat its last).
    o: &'a [*mut f32; G],
    /// Each row's rescaling of its output before this tile.
    corr: &'a [f32; G],
    /// The group's P in BF16, rows of [`TILE`] at a stride of `TILE`.
    p: *const u16,
    /// The tile's value chunks (eight pair rows of `2 · hd` elements each), `chunks` of them used.
    vc: &'a [*const u16; CHUNKS],
    chunks: usize,
    hd: usize,
}

/// `o_r = o_r · corr_r + P_r · V` for `R` rows and `D` sixteen-dimension blocks starting at
/// dimension `d0`, over the tile's `chunks` chunks of sixteen positions in order (eight pairs
/// each): one chain per (row, dimension block).
///
/// # Safety
/// AVX-512 F/BF16 available; `t.o[r]` holds `d0 + 16 · D` f32; `t.p` holds `R` rows of [`TILE`]
/// BF16 at a stride of `TILE`; `t.vc[..t.chunks]` point at whole value chunks.
#[inline(always)]
unsafe fn values_micro<const R: usize, const D: usize, const G: usize>(t: &ValueTile<'_, G>, d0: usize) {
    let (o, hd) = (t.o, t.hd);
    // SAFETY: as the caller promises.
    unsafe {
        let mut acc: [[__m512; D]; R] = std::array::from_fn(|r| {
            let c = _mm512_set1_ps(t.corr[r]);
            std::array::from_fn(|d| _mm512_mul_ps(_mm512_loadu_ps(o[r].add(d0 + 16 * d)), c))
        });
        for c in 0..t.chunks {
            for j in 0..8 {
                let row = t.vc[c].add(j * 2 * hd + 2 * d0);
                let vv: [__m512bh; D] = std::array::from_fn(|d| load_pairs(row.add(32 * d)));
                for r in 0..R {
                    let pp = broadcast_pair(t.p.add(r * TILE + 16 * c + 2 * j));
                    for d in 0..D {
                        acc[r][d] = _mm512_dpbf16_ps(acc[r][d], pp, vv[d]);
                    }
                }
            }
        }
        for r in 0..R {
            for d in 0..D {
                _mm512_storeu_ps(o[r].add(d0 + 16 * d), acc[r][d]);
            }
        }
    }
}

/// [`values_micro`] over all `hd` dimensions, [`chunks_for`]`(R)` blocks of 16 at a time (two
/// for a last 32).
///
/// # Safety
/// As [`values_micro`] with `t.hd % 32 == 0`.
#[inline(always)]
unsafe fn values_rows<const R: usize, const G: usize>(t: &ValueTile<'_, G>) {
    // SAFETY: as the caller promises.
    unsafe {
        let mut d0 = 0;
        if chunks_for(R) == 4 {
            while d0 + 64 <= t.hd {
                values_micro::<R, 4, G>(t, d0);
                d0 += 64;
            }
        }
        while d0 < t.hd {
            values_micro::<R, 2, G>(t, d0);
            d0 += 32;
        }
    }
}

/// Query rows per group in registers, in general.
const SMALL_GROUP: usize = 4;
/// Query rows per group in registers for one decode step's GQA group of five to eight rows; also
/// the most rows one call may have for it to prefetch the next tile's blocks (decode).
const DECODE_GROUP: usize = 8;

/// The AVX-512 BF16 body of `attention_rows` over a BF16 pair-layout cache: each row's `out`
/// undivided, its state returned.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16, AVX2, FMA and F16C are available; the checks of `attention_rows`
/// passed; the cache is BF16 in the pair layout; `head_dim % 32 == 0` and
/// `block_size % 16 == 0`.
///
/// Rows are taken in groups of four, except the five to eight rows of one GQA group (a decode
/// step of a model with eight query heads per KV head: Qwen3-MoE, Gemma 4's full layers), which
/// are one group of eight: the eight rows then read each key and value vector once instead of
/// twice, for a third less time where the cache is long (`paged_attention_model`'s Gemma 4
/// shape). A row's bits are the same either way (see the module docs). The two are separate
/// instances, so fewer rows keep the code they had.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn rows_dpbf16(rows: &mut [QueryRow<'_>], job: &Job<'_>) -> Stats {
    // SAFETY: the caller's contract.
    unsafe {
        if (SMALL_GROUP + 1..=DECODE_GROUP).contains(&rows.len()) {
            rows_in_groups::<DECODE_GROUP>(rows, job)
        } else {
            rows_in_groups::<SMALL_GROUP>(rows, job)
        }
    }
}

/// [`rows_dpbf16`] with groups of up to `GROUP` (4 or 8) rows in registers.
///
/// # Safety
/// As [`rows_dpbf16`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn rows_in_groups<const GROUP: usize>(rows: &mut [QueryRow<'_>], job: &Job<'_>) -> Stats {
    let n = rows.len();
    let keys = &job.keys;
    let (hd, bs) = (keys.head_dim, keys.block_size);
    debug_assert!(hd % 32 == 0 && bs % 16 == 0 && hd <= MAX_HEAD_DIM && n <= MAX_ROWS);
    let max_len = rows.iter().map(|r| r.len).max().unwrap_or(0);

    // Stack buffers: queries (n of the rows), and scores and P for one group of rows.
    let mut scratch = Scratch::<GROUP>::new();
    let (qb, sc, pb, o) = scratch.pointers();

    let mut state = RowStates::new();

    // SAFETY (whole body): every pointer below stays inside its buffer (row counts bounded by
    // n <= MAX_ROWS and GROUP, hd <= MAX_HEAD_DIM, TILE); a chunk read from the pool covers
    // sixteen positions starting at a multiple of 16 below `max_len` whose last is at or above
    // `min_from`, which lie in one block of the table (block_size % 16 == 0) from `min_from`'s
    // on, checked to be inside the pool by the caller.
    unsafe {
        round_queries(rows, hd, n, qb);
        for r in rows.iter_mut() {
            r.out[..hd].fill(0.0);
        }
        let data_k = keys.data.as_ptr() as *const u16;
        let data_v = job.values.data.as_ptr() as *const u16;
        let scale = _mm512_set1_ps(job.map.scale);
        let min_from = job.min_from;

        let (mut part0, end) = job.span(max_len);
        while part0 < end {
            let part_end = (part0 + PARTITION).min(max_len);
            state.start_partition(n, o, hd);
            // The tiles from the one holding `min_from` (the tiles before hold no row's position).
            let mut t0 = part0.max(min_from / TILE * TILE);
            while t0 < part_end {
                let tile_len = TILE.min(part_end - t0);
                // The tile's 16-position chunks: in both tiles of the pair layout, the chunk at
                // slot `j` of its block starts `j · hd` elements into the block's (layer,
                // head) tile. Chunks past the tile repeat its last one, and chunks wholly below
                // `min_from` the first that is not (their scores are computed and masked, their
                // values meet `p = 0`; it keeps every read inside the window's blocks). The
                // tile holds a position of `min_from..part_end`, so `first < chunks`.
                let chunks = tile_len.div_ceil(16);
                let first = min_from.saturating_sub(t0) / 16;
                debug_assert!(first < chunks);
                let mut kc = [data_k; CHUNKS];
                let mut vc = [data_v; CHUNKS];
                for c in 0..CHUNKS {
                    let p = t0 + 16 * c.min(chunks - 1).max(first);
                    let at = keys.tile_base(job.blocks, job.offset, p) + (p % bs) * hd;
                    kc[c] = data_k.add(at);
                    vc[c] = data_v.add(at);
                }
                // The rows with a position in this tile, in groups of GROUP.
                let mut active = [0usize; MAX_ROWS];
                let mut n_active = 0;
                for (i, r) in rows.iter().enumerate() {
                    if r.len > t0 && r.from < t0 + TILE {
                        active[n_active] = i;
                        n_active += 1;
                    }
                }
                // Decode (one group of rows: a GQA group of up to eight query heads, as Gemma 4's
                // full layers and Qwen3-MoE have) asks for the next tile's blocks while it
                // computes this tile's scores, as the f32 path does ([`NextTile`]); prefill's
                // groups reuse each tile long enough without.
                let mut next =
                    if n <= DECODE_GROUP { job.next_tile(t0 + TILE, t0 + 2 * TILE, max_len) } else { NextTile::none() };
                let first_rows = n_active.min(GROUP);
                let per_pair = next.remaining().div_ceil((chunks.div_ceil(chunks_for(first_rows)) * hd / 2).max(1));
                for group in active[..n_active].chunks(GROUP) {
                    let count = group.len();
                    let q: [*const u16; GROUP] =
                        std::array::from_fn(|g| qb.add(group[g.min(count - 1)] * hd) as *const u16);
                    let orow: [*mut f32; GROUP] =
                        std::array::from_fn(|g| o.add(group[g.min(count - 1)] * MAX_HEAD_DIM));
                    // S = Q · Kᵀ.
                    let (next, kc) = (&mut next, &kc);
                    match count {
                        1 => scores_rows::<1, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                        2 => scores_rows::<2, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                        3 => scores_rows::<3, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                        4 => scores_rows::<4, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                        // Only groups of eight have more rows.
                        _ if GROUP <= SMALL_GROUP => unreachable!(),
                        5 => scores_rows::<5, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                        6 => scores_rows::<6, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                        7 => scores_rows::<7, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                        _ => scores_rows::<8, GROUP>(&q, hd, kc, chunks, sc, next, per_pair),
                    }
                    // The online softmax of each row (the AMX path's operations); P rounded to
                    // BF16.
                    let mut corr = [1.0f32; GROUP];
                    for (g, &row) in group.iter().enumerate() {
                        let r = &rows[row];
                        let (lo, hi) = (r.from.saturating_sub(t0), r.len.saturating_sub(t0).min(TILE));
                        corr[g] = softmax_row(
                            sc.add(g * TILE),
                            scale,
                            job.map.softcap,
                            lo,
                            hi,
                            &mut state.m[row],
                            &mut state.l[row],
                            pb.add(g * TILE),
                        );
                    }
                    // o = o · corr + P · V.
                    let tile = ValueTile { o: &orow, corr: &corr, p: pb, vc: &vc, chunks, hd };
                    match count {
                        1 => values_rows::<1, GROUP>(&tile),
                        2 => values_rows::<2, GROUP>(&tile),
                        3 => values_rows::<3, GROUP>(&tile),
                        4 => values_rows::<4, GROUP>(&tile),
                        _ if GROUP <= SMALL_GROUP => unreachable!(),
                        5 => values_rows::<5, GROUP>(&tile),
                        6 => values_rows::<6, GROUP>(&tile),
                        7 => values_rows::<7, GROUP>(&tile),
                        _ => values_rows::<8, GROUP>(&tile),
                    }
                }
                t0 += TILE;
            }
            state.fold_partition(rows, hd, (part0, part_end), o);
            part0 = part_end;
        }
    }
    state.stats()
}
