//! Matmul drivers: `y = x · Wᵀ` for one or several weight matrices sharing the same input,
//! split across the thread pool by output rows so each weight byte is read by one core.
//!
//! Two regimes, chosen per call by speed alone, since both give the same bits:
//! - **GEMV** (`n_tokens < GEMM_MIN_TOKENS`, decode): every task streams a contiguous block of
//!   weight rows once, one row at a time ([`crate::x86::gemv_rows`]).
//! - **GEMM** (`n_tokens >= GEMM_MIN_TOKENS`: batched decode and prefill): register tiles of a
//!   few tokens × a few weight rows, vectorised along the columns like the GEMV. AVX-512: 4
//!   tokens × 3 rows, token blocks whose `x` stays in L2 while each row tile (prefetched one
//!   tile ahead, and widened to an f32 panel on the stack when the block has enough tokens)
//!   serves all the block's tokens from L1. AVX2: 4 tokens × 3 rows, one of the GEMV's four
//!   chains at a time ([`crate::x86::gemm_tile_passes`]), row blocks in L2, each token tile
//!   one column block at a time across a row block so its token vectors stay in L1.
//!
//! Guarantees:
//! - **Batch invariance** (DESIGN.md invariant 7): within one process, every output `y[t, r]`
//!   is computed by the same sequence of f32 operations — the GEMV's: 32 lanes of fused
//!   multiply-adds over `c ≡ lane (mod 32)`, the 8-wide middle into the first 8 lanes, the
//!   fixed `hsum((a0 + a1) + (a2 + a3))` tree, then the scalar tail — whatever `n_tokens`, the
//!   token's place in the batch, the tile it lands in, the thread count or the grouping of
//!   matrices in [`matmul_many`]. The scalar path is a plain sequential sum per output, also
//!   independent of the batch. (The AVX2 and AVX-512 paths give the same bits, both being
//!   the GEMV's; the scalar path, a sequential sum, gives others.)
//! - No allocation on any path (the f32 panel is a 24 KiB stack array).
//! - f32 accumulation; the order differs from [`crate::reference::matmul`]'s, so results agree
//!   with it to about 1e-6 relative to `Σ|w·x|`.

use crate::{Isa, ThreadPool, WeightDType, WeightMatrix, isa};

/// From this many tokens on, the GEMM is used instead of per-token GEMV (measured on AVX-512:
/// with 2 tokens the GEMM reads the weights once and takes about the time of one GEMV; the
/// results are the same bits either way).
pub const GEMM_MIN_TOKENS: usize = 2;
/// Matrices handled by one fused pool job; longer lists are processed in chunks.
pub(crate) const MAX_FUSED: usize = 8;
/// Weight bytes below which a GEMV is not worth splitting across threads.
const MIN_PARALLEL_BYTES: usize = 64 * 1024;
/// Multiply-adds below which a GEMM is not worth splitting across threads.
const MIN_PARALLEL_MACS: usize = 1 << 20;

/// An output pointer shared by the tasks of one job.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: tasks of one job write disjoint output rows through this pointer (see `run_chunk`),
// and the job's caller holds the `&mut [f32]` it came from until all tasks have returned.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// `y_i = x · W_iᵀ` for every `(W_i, y_i)` in `jobs`, as one pool job per chunk of matrices.
///
/// Shapes: `x` is `(n_tokens, cols)`, every `W_i` is `(rows_i, cols)`, `y_i` is
/// `(n_tokens, rows_i)`; all row-major. Panics if a shape or a data length disagrees (a caller
/// bug: the loader validated the weights).
pub fn matmul_many(pool: &ThreadPool, x: &[f32], n_tokens: usize, jobs: &mut [(WeightMatrix<'_>, &mut [f32])]) {
    for chunk in jobs.chunks_mut(MAX_FUSED) {
        run_chunk(pool, x, n_tokens, chunk);
    }
}

fn run_chunk(pool: &ThreadPool, x: &[f32], n_tokens: usize, jobs: &mut [(WeightMatrix<'_>, &mut [f32])]) {
    debug_assert!(jobs.len() <= MAX_FUSED);
    for (w, y) in jobs.iter() {
        // These checks make the unsafe reads and writes below sound.
        assert_eq!(w.data.len(), w.rows * w.cols * w.dtype.size_in_bytes(), "weight data length != rows * cols * size");
        assert_eq!(x.len(), n_tokens * w.cols, "x.len() != n_tokens * cols");
        assert_eq!(y.len(), n_tokens * w.rows, "y.len() != n_tokens * rows");
    }
    if n_tokens == 0 || jobs.is_empty() {
        return;
    }
    let isa = isa();
    let gemm = matches!(isa, Isa::Avx512 | Isa::Avx2Fma) && n_tokens >= GEMM_MIN_TOKENS;
    // Tasks own whole GEMV blocks (4 rows) or whole GEMM row tiles (a multiple of 3 rows).
    let unit = if gemm { 24 } else { 4 };

    let bytes: usize = jobs.iter().map(|(w, _)| w.data.len()).sum();
    let macs: usize = jobs.iter().map(|(w, _)| w.rows * w.cols * n_tokens).sum();
    let parallel = if gemm { macs >= MIN_PARALLEL_MACS } else { bytes >= MIN_PARALLEL_BYTES };
    let threads = if parallel { pool.threads() } else { 1 };
    // SAFETY: `split_rows` hands each task row ranges no other task gets, so each writes only
    // rows `r0..r1` of `out`; shapes were checked above.
    split_rows(pool, jobs, unit, threads, &|w, out, r0, r1| unsafe {
        compute_rows(isa, gemm, w, x, n_tokens, out, r0, r1)
    });
}

/// A float matrix and the row of the input it reads, for [`matmul_rows`].
#[derive(Debug, Clone, Copy)]
pub struct FloatRowInput<'a> {
    pub matrix: WeightMatrix<'a>,
    /// The row of `xs` this matrix multiplies.
    pub row: usize,
}

impl MatrixRows for FloatRowInput<'_> {
    fn rows(&self) -> usize {
        self.matrix.rows
    }
}

/// `y_i = xs[row_i] · W_iᵀ` for every `(FloatRowInput { W_i, row_i }, y_i)` in `jobs`: one
/// token per matrix, each reading its own row of `xs` `(input rows, cols)`, in one pool job per
/// [`MAX_FUSED`] matrices (the float twin of `quant::matmul_rows_quant`: a decode step's routed
/// experts, whose down products each read their own expert's activations).
///
/// Shapes: every `W_i` is `(rows_i, cols)`, `y_i` is `(1, rows_i)`. Row `r` of `y_i` has the
/// GEMV's bits, the same as [`matmul_many`] over `xs[row_i]` alone. Allocates nothing. Panics
/// on a shape disagreement or a row outside `xs` (a caller bug).
pub fn matmul_rows(pool: &ThreadPool, xs: &[f32], jobs: &mut [(FloatRowInput<'_>, &mut [f32])]) {
    let Some((first, _)) = jobs.first() else { return };
    let cols = first.matrix.cols;
    assert!(cols > 0 && xs.len().is_multiple_of(cols), "xs.len() is not a whole number of rows of {cols}");
    let inputs = xs.len() / cols;
    for (w, y) in jobs.iter() {
        // These checks make the unsafe reads and writes below sound.
        let m = w.matrix;
        assert_eq!(m.cols, cols, "every matrix of matmul_rows has the input's {cols} columns");
        assert_eq!(m.data.len(), m.rows * m.cols * m.dtype.size_in_bytes(), "weight data length != rows * cols * size");
        assert!(w.row < inputs, "input row {} of {inputs}", w.row);
        assert_eq!(y.len(), m.rows, "y.len() != rows");
    }
    let isa = isa();
    for chunk in jobs.chunks_mut(MAX_FUSED) {
        let bytes: usize = chunk.iter().map(|(w, _)| w.matrix.data.len()).sum();
        let threads = if bytes >= MIN_PARALLEL_BYTES { pool.threads() } else { 1 };
        // SAFETY: `split_rows` hands each task row ranges no other task gets, so each writes
        // only rows `r0..r1` of its own output; shapes were checked above.
        split_rows(pool, chunk, 4, threads, &|w: FloatRowInput<'_>, out, r0, r1| unsafe {
            compute_rows(isa, false, w.matrix, &xs[w.row * cols..(w.row + 1) * cols], 1, out, r0, r1)
        });
    }
}

/// Splits the output rows of every matrix in `jobs` (at most [`MAX_FUSED`]) into pieces of
/// `unit` rows, hands them to pool tasks for `threads` threads ([`guided_partition`]) and runs
/// `compute(w, out, r0, r1)` on each piece: rows `r0..r1` of matrix `w`, whose output starts at
/// `out`. Different calls of `compute` get disjoint rows.
pub(crate) fn split_rows<M: MatrixRows>(
    pool: &ThreadPool,
    jobs: &mut [(M, &mut [f32])],
    unit: usize,
    threads: usize,
    compute: &(dyn Fn(M, OutPtr, usize, usize) + Sync),
) {
    debug_assert!(jobs.len() <= MAX_FUSED);
    let mut mats: [Option<M>; MAX_FUSED] = [None; MAX_FUSED];
    let mut outs = [OutPtr(std::ptr::null_mut()); MAX_FUSED];
    let mut total_units = 0;
    for (i, (w, y)) in jobs.iter_mut().enumerate() {
        mats[i] = Some(*w);
        outs[i] = OutPtr(y.as_mut_ptr());
        total_units += w.rows().div_ceil(unit);
    }
    let mut bounds = [0usize; MAX_TASKS + 1];
    let n_tasks = guided_partition(total_units, threads, &mut bounds);
    pool.run(n_tasks, &|t: usize| {
        // The pool hands out task indices from the highest down; the highest are the largest.
        let (u0, u1) = (bounds[n_tasks - 1 - t], bounds[n_tasks - t]);
        let mut start = 0;
        for (w, out) in mats.iter().zip(outs.iter()) {
            let Some(w) = w else { break };
            let units = w.rows().div_ceil(unit);
            let (a, b) = (u0.max(start), u1.min(start + units));
            if a < b {
                // The unit ranges of different tasks are disjoint.
                compute(*w, *out, (a - start) * unit, ((b - start) * unit).min(w.rows()));
            }
            start += units;
        }
    });
}

/// A matrix whose output rows [`split_rows`] can split.
pub(crate) trait MatrixRows: Copy + Send + Sync {
    fn rows(&self) -> usize;
}

impl MatrixRows for WeightMatrix<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
}

/// Most tasks one matmul job is split into.
const MAX_TASKS: usize = 64;

/// Splits `units` into tasks of decreasing size for `threads` threads ("guided" scheduling):
/// each task takes `1 / (2 · threads)` of what is left (at least one unit), so the first tasks
/// are large (long sequential weight streams) and the last ones small, and whichever thread
/// finishes early takes the small ones: the threads end within a small task of each other.
/// Writes the boundaries to `bounds[0..=n]` (increasing, `bounds[n] == units`) and returns `n`.
fn guided_partition(units: usize, threads: usize, bounds: &mut [usize; MAX_TASKS + 1]) -> usize {
    bounds[0] = 0;
    if threads <= 1 || units <= 1 {
        bounds[1] = units;
        return 1;
    }
    let min_chunk = (units / (MAX_TASKS - threads)).max(1);
    let mut done = 0;
    let mut n = 0;
    while done < units {
        let left = units - done;
        let chunk = if n + threads >= MAX_TASKS { left } else { (left / (2 * threads)).max(min_chunk).min(left) };
        done += chunk;
        n += 1;
        bounds[n] = done;
    }
    n
}

/// Computes output rows `r0..r1` of `y = x · Wᵀ` for all tokens.
///
/// # Safety
/// `out` must point to the `(n_tokens, w.rows)` output, rows `r0..r1` of which no one else
/// accesses meanwhile; `w` and `x` must have the checked shapes; `gemm` only with `Avx512`.
#[allow(clippy::too_many_arguments)]
unsafe fn compute_rows(
    isa: Isa,
    gemm: bool,
    w: WeightMatrix<'_>,
    x: &[f32],
    n_tokens: usize,
    out: OutPtr,
    r0: usize,
    r1: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            use crate::x86::{BF16, F16, F32};
            // SAFETY: the caller's contract, AVX2/FMA/F16C were detected (`isa`), and AVX-512
            // too when `gemm` is set.
            unsafe {
                match (w.dtype, gemm) {
                    (WeightDType::BF16, false) => gemv_avx2::<BF16>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::F16, false) => gemv_avx2::<F16>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::F32, false) => gemv_avx2::<F32>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::BF16, true) if isa == Isa::Avx512 => gemm_avx512::<BF16>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::F16, true) if isa == Isa::Avx512 => gemm_avx512::<F16>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::F32, true) if isa == Isa::Avx512 => gemm_avx512::<F32>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::BF16, true) => gemm_avx2::<BF16>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::F16, true) => gemm_avx2::<F16>(w, x, n_tokens, out, r0, r1),
                    (WeightDType::F32, true) => gemm_avx2::<F32>(w, x, n_tokens, out, r0, r1),
                }
            }
        }
        _ => {
            let _ = gemm;
            for t in 0..n_tokens {
                let xt = &x[t * w.cols..(t + 1) * w.cols];
                for r in r0..r1 {
                    let base = r * w.cols;
                    let mut acc = 0.0f32;
                    for (c, xv) in xt.iter().enumerate() {
                        acc += crate::reference::load_f32(w.dtype, w.data, base + c) * xv;
                    }
                    // SAFETY: row `r` of token `t` is inside the output and owned by this task.
                    unsafe { *out.0.add(t * w.rows + r) = acc };
                }
            }
        }
    }
}

/// # Safety
/// As [`compute_rows`], and AVX2/FMA/F16C are available.
#[cfg(target_arch = "x86_64")]
unsafe fn gemv_avx2<const D: u8>(w: WeightMatrix<'_>, x: &[f32], n_tokens: usize, out: OutPtr, r0: usize, r1: usize) {
    let row_bytes = w.cols * w.dtype.size_in_bytes();
    // One token: the whole block in one call. Several: blocks of 4 rows, so the block's weights
    // are still in L1 when the next token reuses them.
    let block = if n_tokens == 1 { r1 - r0 } else { 4 };
    let mut r = r0;
    while r < r1 {
        let n = block.min(r1 - r);
        for t in 0..n_tokens {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            // SAFETY: rows `r..r + n` of token `t` lie inside the output and belong to this task;
            // the weight rows `r..r + n` lie inside `w.data` (length checked by the caller).
            unsafe {
                let y = std::slice::from_raw_parts_mut(out.0.add(t * w.rows + r), n);
                crate::x86::gemv_rows::<D>(w.data.as_ptr().add(r * row_bytes), w.cols, xt, y);
            }
        }
        r += n;
    }
}

/// Bytes of `x` one GEMM token block may take: the block's `x` rows stay in L2 (about half
/// of a 1 MiB L2) while the task's weight rows stream past them once per block.
const TOKEN_BLOCK_BYTES: usize = 512 * 1024;
/// Widest rows the GEMM widens to f32 once per token block (3 rows of f32: 24 KiB, so the panel
/// and a token tile's `x` share L1; measured: 3072-column rows ran faster unwidened).
const PACK_MAX_COLS: usize = 2048;
/// Fewest tokens in a block for which widening the weights once pays (measured: with 8 or 16
/// tokens the widening pass costs more than it saves).
const PACK_MIN_TOKENS: usize = 32;

/// A row tile widened to f32, aligned to cache lines.
#[repr(C, align(64))]
struct Panel([f32; 3 * PACK_MAX_COLS]);

/// The AVX-512 GEMM on rows `r0..r1` (tiles of 4 tokens × 3 rows): token blocks whose `x` rows
/// (at most [`TOKEN_BLOCK_BYTES`]) stay in L2; inside a block, each row tile (whose weights stay
/// in L1) runs across the block's token tiles, the first of which prefetches the next row tile.
/// Each weight byte is read from memory once per token block, i.e. once per call up to
/// `TOKEN_BLOCK_BYTES / (4 · cols)` tokens. With enough tokens in a block, the row tile is
/// first widened to f32 (exactly: BF16 and F16 are subsets of f32) into a stack panel, and the
/// tiles read the panel as F32 weights: the same values, so the same results.
///
/// # Safety
/// As [`compute_rows`], and AVX-512 F/BW/VL, AVX2, FMA and F16C are available.
#[cfg(target_arch = "x86_64")]
unsafe fn gemm_avx512<const D: u8>(w: WeightMatrix<'_>, x: &[f32], n_tokens: usize, out: OutPtr, r0: usize, r1: usize) {
    use crate::avx512::{MT, NR, gemm_tile_dyn};
    use crate::x86::F32;
    let (mt_max, nr_max) = (MT, NR);
    let cols = w.cols;
    let row_bytes = cols * w.dtype.size_in_bytes();
    let block = (TOKEN_BLOCK_BYTES / (4 * cols).max(1) / mt_max * mt_max).max(mt_max);
    // The panel (24 KiB to clear) only exists when some block will be widened: batched decode
    // calls run many small tasks and would pay for clearing it in each.
    let packs = D != F32 && cols <= PACK_MAX_COLS && block.min(n_tokens) >= PACK_MIN_TOKENS;
    let mut big_panel;
    let mut no_panel = [0.0f32; 0];
    let panel: &mut [f32] = if packs {
        big_panel = Panel([0.0; 3 * PACK_MAX_COLS]);
        &mut big_panel.0
    } else {
        &mut no_panel
    };
    let mut t0 = 0;
    while t0 < n_tokens {
        let t1 = (t0 + block).min(n_tokens);
        let pack = packs && t1 - t0 >= PACK_MIN_TOKENS;
        let mut p = r0;
        while p < r1 {
            let nr = nr_max.min(r1 - p);
            // SAFETY: weight rows `p..p + nr` exist (`p + nr <= r1 <= rows`, data length checked
            // by the caller) and hold `nr * cols <= panel.len()` elements when packed.
            let (wp, stride) = unsafe {
                let wp = w.data.as_ptr().add(p * row_bytes);
                if pack {
                    crate::x86::widen::<D>(wp, &mut panel[..nr * cols]);
                    (panel.as_ptr() as *const u8, cols * 4)
                } else {
                    (wp, row_bytes)
                }
            };
            // The next row tile's weights, prefetched by this tile's first token tile.
            let next_rows = nr_max.min(r1 - p - nr);
            let mut t = t0;
            while t < t1 {
                let mt = mt_max.min(t1 - t);
                let (pf, pf_len) = if t == t0 {
                    (w.data.as_ptr().wrapping_add((p + nr) * row_bytes), next_rows * row_bytes)
                } else {
                    (wp, 0)
                };
                // SAFETY: `wp` holds `nr` rows of `cols` elements at stride `stride` (the weight
                // rows or their widened copy); tokens `t..t + mt` exist; rows `p..p + nr` of
                // the output belong to this task; the prefetched rows `p + nr..p + nr +
                // next_rows` lie inside `w.data` (`<= r1 <= rows`).
                unsafe {
                    let (x, y) = (x.as_ptr().add(t * cols), out.0.add(t * w.rows + p));
                    if pack {
                        gemm_tile_dyn::<F32>(mt, nr, wp, stride, cols, x, cols, y, w.rows, pf, pf_len)
                    } else {
                        gemm_tile_dyn::<D>(mt, nr, wp, stride, cols, x, cols, y, w.rows, pf, pf_len)
                    }
                };
                t += mt;
            }
            p += nr;
        }
        t0 = t1;
    }
}

/// Weight bytes of one AVX2 GEMM row block: read from memory once, then from L2 by every token
/// tile (a quarter of a 1 MiB L2).
const ROW_BLOCK_BYTES: usize = 256 * 1024;

/// Row tiles of an AVX2 GEMM row block whose rows take more than one column block: each keeps
/// its chains between blocks (1.5 KiB each, 72 KiB on the stack).
const MAX_ROW_TILES: usize = 48;

/// The AVX2 GEMM on rows `r0..r1` (tiles of [`crate::x86::PASS_MT`] tokens ×
/// [`crate::x86::PASS_NR`] rows): row blocks of about [`ROW_BLOCK_BYTES`], and inside a block
/// each token tile runs one column block ([`crate::x86::PASS_KB`]) at a time across the block's
/// rows, so its token vectors stay in L1 while the weights come from L2. Each row tile carries
/// its chains from one column block to the next, so the bits are the GEMV's whatever the blocks.
///
/// # Safety
/// As [`compute_rows`], and AVX2, FMA and F16C are available.
#[cfg(target_arch = "x86_64")]
unsafe fn gemm_avx2<const D: u8>(w: WeightMatrix<'_>, x: &[f32], n_tokens: usize, out: OutPtr, r0: usize, r1: usize) {
    use crate::x86::{PASS_MT, PASS_NR, PassChains, gemm_tile_passes_dyn, pass_block_end};
    use std::mem::MaybeUninit;
    let cols = w.cols;
    let main8 = cols & !7;
    let row_bytes = cols * w.dtype.size_in_bytes();
    // With one column block, every tile finishes its chains in the call and one slot serves all.
    let one_block = pass_block_end(0, cols) == main8;
    let mut block = (ROW_BLOCK_BYTES / row_bytes.max(1)).max(1);
    if !one_block {
        block = block.min(MAX_ROW_TILES * PASS_NR);
    }
    // Never cleared: a row tile's first block writes its slot before any read (clearing 72 KiB
    // per call would cost the small products of batched decode more than they compute).
    let mut chains: [PassChains; MAX_ROW_TILES] =
        [const { [[[const { MaybeUninit::uninit() }; 4]; PASS_NR]; PASS_MT] }; MAX_ROW_TILES];
    let mut b0 = r0;
    while b0 < r1 {
        let b1 = (b0 + block).min(r1);
        let mut t = 0;
        while t < n_tokens {
            let mt = PASS_MT.min(n_tokens - t);
            let mut k0 = 0;
            loop {
                let k1 = pass_block_end(k0, cols);
                let (mut r, mut tile) = (b0, 0);
                while r < b1 {
                    let nr = PASS_NR.min(b1 - r);
                    let slot = &mut chains[if one_block { 0 } else { tile }];
                    // SAFETY: weight rows `r..r + nr < rows` exist (data length checked by the
                    // caller); tokens `t..t + mt` exist; rows `r..r + nr` of the output belong to
                    // this task; the blocks of this row tile run in order on its own `slot`.
                    unsafe {
                        let (wp, xp, yp) =
                            (w.data.as_ptr().add(r * row_bytes), x.as_ptr().add(t * cols), out.0.add(t * w.rows + r));
                        gemm_tile_passes_dyn::<D>(mt, nr, wp, row_bytes, cols, (k0, k1), slot, xp, cols, yp, w.rows)
                    };
                    r += nr;
                    tile += 1;
                }
                if k1 >= main8 {
                    break;
                }
                k0 = k1;
            }
            t += mt;
        }
        b0 = b1;
    }
}

/// `y_i = bf16(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs` (all BF16), with the activations
/// rounded to BF16 once into `packed` (at least [`bf16_scratch_len`]`(n_tokens, cols)`
/// elements) and f32 accumulation, on the kernel family `kernels`.
///
/// Shapes as [`matmul_many`]. Panics if a shape or a data length disagrees, a weight is not
/// BF16 or `packed` is too short (caller bugs).
pub fn matmul_many_bf16(
    pool: &ThreadPool,
    kernels: crate::Bf16Kernels,
    x: &[f32],
    n_tokens: usize,
    packed: &mut [u16],
    jobs: &mut [(WeightMatrix<'_>, &mut [f32])],
) {
    #[cfg(target_arch = "x86_64")]
    match kernels {
        crate::Bf16Kernels::Amx => matmul_many_bf16_with(
            pool,
            x,
            n_tokens,
            packed,
            jobs,
            crate::amx::TILE,
            32,
            crate::amx::pack_tokens,
            // SAFETY: AMX permission was granted (`Bf16Kernels::Amx` exists only then); the
            // driver checked the shapes and hands each task its own rows.
            &|w, packed, out, r0, r1| unsafe {
                crate::amx::gemm_rows(w.data.as_ptr(), w.rows, w.cols, packed, n_tokens, out, w.rows, r0, r1)
            },
        ),
        crate::Bf16Kernels::Avx512Bf16 => matmul_many_bf16_with(
            pool,
            x,
            n_tokens,
            packed,
            jobs,
            1,
            4 * crate::avx512bf16::NR,
            crate::avx512bf16::pack_rows,
            // SAFETY: AVX-512 BF16 was detected (`Bf16Kernels::Avx512Bf16` exists only then);
            // the driver checked the shapes and hands each task its own rows.
            &|w, packed, out, r0, r1| unsafe {
                crate::avx512bf16::gemm_rows(w.data.as_ptr(), w.cols, packed, n_tokens, out, w.rows, r0, r1)
            },
        ),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pool, x, n_tokens, packed, jobs, kernels);
        unreachable!("no BF16 kernels on this architecture")
    }
}

/// [`matmul_many_bf16`] on one kernel: checks the shapes (which make the kernels' unsafe
/// reads and writes sound), packs the activations into the aligned part of `packed` (token
/// groups of `pack_unit` split across the pool), then runs `compute` on each matrix's output
/// rows in units of `unit` rows split across the pool.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
pub(crate) fn matmul_many_bf16_with(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    packed: &mut [u16],
    jobs: &mut [(WeightMatrix<'_>, &mut [f32])],
    pack_unit: usize,
    unit: usize,
    pack: fn(&[f32], usize, usize, usize, &mut [u16]),
    compute: &ComputeRows<'_>,
) {
    let Some((first, _)) = jobs.first() else { return };
    let cols = first.cols;
    for (w, y) in jobs.iter() {
        // These checks make the unsafe reads and writes below sound.
        assert_eq!(w.dtype, WeightDType::BF16, "matmul_many_bf16 needs BF16 weights");
        assert_eq!(w.cols, cols, "matrices sharing an input must have the same columns");
        assert_eq!(w.data.len(), w.rows * w.cols * 2, "weight data length != rows * cols * 2");
        assert_eq!(x.len(), n_tokens * cols, "x.len() != n_tokens * cols");
        assert_eq!(y.len(), n_tokens * w.rows, "y.len() != n_tokens * rows");
    }
    let needed = bf16_scratch_len(n_tokens, cols);
    assert!(packed.len() >= needed, "bf16 scratch holds {} elements, {needed} needed", packed.len());
    if n_tokens == 0 {
        return;
    }
    // The packed rows start on a cache line (see `PACKED_ALIGN`); `bf16_scratch_len` counts the
    // elements skipped to get there.
    let skip = packed.as_ptr().align_offset(PACKED_ALIGN * 2).min(PACKED_ALIGN);
    let packed = &mut packed[skip..skip + needed - PACKED_ALIGN];
    // 1. Round and pack the activations, token groups split across the pool.
    let groups = n_tokens.div_ceil(pack_unit);
    let out = SharedU16(packed.as_mut_ptr(), packed.len());
    let threads = if n_tokens * cols >= 1 << 16 { pool.threads().min(groups) } else { 1 };
    pool.run(threads, &|t| {
        let (g0, g1) = (groups * t / threads, groups * (t + 1) / threads);
        let (t0, t1) = (g0 * pack_unit, (g1 * pack_unit).min(n_tokens));
        // SAFETY: tasks write the disjoint parts of their own token groups.
        pack(x, cols, t0, t1, unsafe { out.slice() });
    });
    let packed: &[u16] = packed;
    // 2. The products, output rows split across the pool in `unit`-row pieces.
    for chunk in jobs.chunks_mut(MAX_FUSED) {
        let macs: usize = chunk.iter().map(|(w, _)| w.rows * w.cols * n_tokens.max(16)).sum();
        let threads = if macs >= 4 * MIN_PARALLEL_MACS { pool.threads() } else { 1 };
        split_rows(pool, chunk, unit, threads, &|w, out, r0, r1| compute(w, packed, out.0, r0, r1));
    }
}

/// Computes output rows `r0..r1` of one matrix from the packed activations into `out`:
/// `(weights, packed, out, r0, r1)`.
#[cfg(target_arch = "x86_64")]
type ComputeRows<'a> = dyn Fn(WeightMatrix<'_>, &[u16], *mut f32, usize, usize) + Sync + 'a;

/// BF16 elements in one cache line (64 bytes). [`matmul_many_bf16`] starts its packed
/// activations on a cache line, wherever the allocator put the caller's scratch, so that no
/// vector load of a packed row (each row a whole number of lines) straddles two lines. Qwen3-0.6B's 1024 × 2048 output projection at 512 tokens
/// (`gemm_dpbf16`, one thread) took 11.39 and 11.50 ms with the scratch 16 bytes past a line
/// against 10.26 and 10.67 with it aligned here; the other four matrices of the layer moved
/// within noise (BENCHMARKS.md).
const PACKED_ALIGN: usize = 32;

/// Elements of the BF16 activation scratch that [`matmul_many_bf16`] needs for `n_tokens`
/// tokens of `cols` columns: the packed rows, and up to one cache line skipped to align them.
pub fn bf16_scratch_len(n_tokens: usize, cols: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        crate::amx::packed_len(n_tokens, cols) + PACKED_ALIGN
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        n_tokens * cols + PACKED_ALIGN
    }
}

/// A `u16` buffer that pool tasks write disjoint parts of.
#[derive(Clone, Copy)]
struct SharedU16(*mut u16, usize);
// SAFETY: tasks write disjoint tiles through this pointer, and the caller holds the `&mut`
// it came from until all tasks have returned.
unsafe impl Send for SharedU16 {}
// SAFETY: as above.
unsafe impl Sync for SharedU16 {}

impl SharedU16 {
    /// The whole buffer.
    ///
    /// # Safety
    /// Concurrent users must write disjoint parts of it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self) -> &mut [u16] {
        // SAFETY: the pointer and length came from one `&mut [u16]`; the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guided_partition_covers_every_unit_once_in_decreasing_chunks() {
        for units in [0, 1, 2, 7, 64, 100, 853, 6_331, 37_984] {
            for threads in [1, 2, 3, 8] {
                let mut bounds = [0; MAX_TASKS + 1];
                let n = guided_partition(units, threads, &mut bounds);
                assert!((1..=MAX_TASKS).contains(&n), "units={units} threads={threads}: {n} tasks");
                assert_eq!(bounds[n], units);
                assert!(bounds[..=n].windows(2).all(|w| w[0] <= w[1]));
                let sizes: Vec<usize> = bounds[..=n].windows(2).map(|w| w[1] - w[0]).collect();
                // Non-increasing except for the final remainder.
                assert!(sizes.windows(2).take(n.saturating_sub(2)).all(|w| w[0] >= w[1]), "{sizes:?}");
            }
        }
    }
}
