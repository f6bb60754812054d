//! Attention over a paged KV cache: a sequence's keys and values live in fixed-size blocks
//! scattered through one pool, found through the sequence's block table.
//!
//! Pool layout (what [`KvView`] describes): block-major, then layer, then KV head, then slot,
//! then `head_dim`, so the `block_size` rows of one (block, layer, head) are contiguous. Element
//! type F32, F16 or BF16 ([`WeightDType`]); attention widens to f32 in registers and
//! accumulates in f32.
//!
//! Guarantees: nothing here allocates; every block id is checked against the pool before any
//! read, so a wrong block table panics instead of reading out of bounds; the computation for a
//! query row depends only on that row, the cached rows and their order, never on other queries
//! (batch invariance).

use crate::{Isa, WeightDType, isa, reference};

/// One pool of keys (or values) with its geometry.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    pub dtype: WeightDType,
    /// The whole pool as little-endian bytes.
    pub data: &'a [u8],
    /// Elements per block (all layers and heads).
    pub block_stride: usize,
    /// Positions per block.
    pub block_size: usize,
    pub head_dim: usize,
}

impl KvView<'_> {
    /// Element offset of position `p` given the (layer, head) offset inside a block.
    #[inline]
    fn row(&self, blocks: &[u32], offset: usize, p: usize) -> usize {
        blocks[p / self.block_size] as usize * self.block_stride + offset + (p % self.block_size) * self.head_dim
    }

    /// Panics unless positions `0..len` of the (layer, head) at `offset` are inside the pool.
    fn check(&self, blocks: &[u32], offset: usize, len: usize) {
        let size = self.dtype.size_in_bytes();
        let elements = self.data.len() / size;
        assert!(offset + self.block_size * self.head_dim <= self.block_stride, "KV offset outside a block");
        assert!(blocks.len() * self.block_size >= len, "block table shorter than the sequence");
        for &b in &blocks[..len.div_ceil(self.block_size)] {
            assert!((b as usize + 1) * self.block_stride <= elements, "block {b} outside the KV pool");
        }
    }
}

/// Attention of one query head over positions `0..len` of one sequence.
///
/// `q`: `(head_dim)`; `blocks`: the sequence's block table; `offset`: element offset of the
/// (layer, KV head) inside a block; `scores`: scratch of at least `len`; `out`: `(head_dim)`.
/// `out = softmax(scale · K · q) · V`.
#[allow(clippy::too_many_arguments)]
pub fn attention_paged(
    q: &[f32],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    len: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = keys.head_dim;
    assert!(q.len() >= hd && out.len() >= hd && scores.len() >= len && values.head_dim == hd);
    keys.check(blocks, offset, len);
    values.check(blocks, offset, len);
    let scores = &mut scores[..len];
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            use crate::x86::{BF16, F16, F32};
            // SAFETY: AVX2/FMA/F16C were detected; every row read is inside the pool (checked).
            unsafe {
                match keys.dtype {
                    WeightDType::BF16 => x86_scores::<BF16>(q, keys, blocks, offset, scale, scores),
                    WeightDType::F16 => x86_scores::<F16>(q, keys, blocks, offset, scale, scores),
                    WeightDType::F32 => x86_scores::<F32>(q, keys, blocks, offset, scale, scores),
                }
                crate::x86::softmax(scores);
                match values.dtype {
                    WeightDType::BF16 => x86_weighted::<BF16>(scores, values, blocks, offset, out),
                    WeightDType::F16 => x86_weighted::<F16>(scores, values, blocks, offset, out),
                    WeightDType::F32 => x86_weighted::<F32>(scores, values, blocks, offset, out),
                }
            }
        }
        _ => {
            for (p, s) in scores.iter_mut().enumerate() {
                let base = keys.row(blocks, offset, p);
                let mut dot = 0.0f32;
                for (c, qv) in q[..hd].iter().enumerate() {
                    dot += qv * reference::load_f32(keys.dtype, keys.data, base + c);
                }
                *s = dot * scale;
            }
            reference::softmax(scores);
            let out = &mut out[..hd];
            out.fill(0.0);
            for (p, &s) in scores.iter().enumerate() {
                let base = values.row(blocks, offset, p);
                for (c, o) in out.iter_mut().enumerate() {
                    *o += s * reference::load_f32(values.dtype, values.data, base + c);
                }
            }
        }
    }
}

/// Most query rows [`attention_paged_many`] computes together.
pub const MAX_QUERIES: usize = 4;

/// One query row of [`attention_paged_many`]: its vector `(head_dim)`, the positions it attends
/// to (`0..len`), its score scratch (at least `len`) and its output `(head_dim)`.
pub struct PagedQuery<'a> {
    pub q: &'a [f32],
    pub len: usize,
    pub scores: &'a mut [f32],
    pub out: &'a mut [f32],
}

/// [`attention_paged`] for up to [`MAX_QUERIES`] query rows over the same KV head (the query
/// heads of a GQA group, consecutive tokens of a prompt): each key and value row is read once
/// for all of them. Every query's output has the bits [`attention_paged`] gives it alone (the
/// same operations per query, interleaved), so grouping never changes a result.
pub fn attention_paged_many(
    queries: &mut [PagedQuery<'_>],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    scale: f32,
) {
    let hd = keys.head_dim;
    assert!(queries.len() <= MAX_QUERIES, "at most {MAX_QUERIES} queries per call");
    let Some(max_len) = queries.iter().map(|q| q.len).max() else { return };
    for q in queries.iter() {
        assert!(q.q.len() >= hd && q.out.len() >= hd && q.scores.len() >= q.len && values.head_dim == hd);
    }
    keys.check(blocks, offset, max_len);
    values.check(blocks, offset, max_len);
    let simd = matches!(isa(), Isa::Avx2Fma | Isa::Avx512);
    match queries.len() {
        // SAFETY (each arm): AVX2/FMA/F16C were detected (`simd`); every row read is inside the
        // pool (checked), every query's buffers hold what it needs (checked).
        #[cfg(target_arch = "x86_64")]
        4 if simd => unsafe { many_x86::<4>(queries, keys, values, blocks, offset, scale) },
        #[cfg(target_arch = "x86_64")]
        3 if simd => unsafe { many_x86::<3>(queries, keys, values, blocks, offset, scale) },
        #[cfg(target_arch = "x86_64")]
        2 if simd => unsafe { many_x86::<2>(queries, keys, values, blocks, offset, scale) },
        // One query, or the scalar kernels: each query alone.
        _ => {
            for q in queries.iter_mut() {
                attention_paged(q.q, keys, values, blocks, offset, q.len, scale, q.scores, q.out);
            }
        }
    }
}

/// The x86 body of [`attention_paged_many`] for `NQ` queries (dispatching on the dtypes).
///
/// # Safety
/// As [`attention_paged_many`] after its checks; AVX2/FMA/F16C are available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn many_x86<const NQ: usize>(
    queries: &mut [PagedQuery<'_>],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    scale: f32,
) {
    use crate::x86::{BF16, F16, F32};
    // SAFETY: the caller's contract.
    unsafe {
        match keys.dtype {
            WeightDType::BF16 => scores_many::<BF16, NQ>(queries, keys, blocks, offset, scale),
            WeightDType::F16 => scores_many::<F16, NQ>(queries, keys, blocks, offset, scale),
            WeightDType::F32 => scores_many::<F32, NQ>(queries, keys, blocks, offset, scale),
        }
        for q in queries.iter_mut() {
            crate::x86::softmax(&mut q.scores[..q.len]);
        }
        match values.dtype {
            WeightDType::BF16 => weighted_many::<BF16, NQ>(queries, values, blocks, offset),
            WeightDType::F16 => weighted_many::<F16, NQ>(queries, values, blocks, offset),
            WeightDType::F32 => weighted_many::<F32, NQ>(queries, values, blocks, offset),
        }
    }
}

/// Scores of `NQ` queries: positions every query attends to together, the rest per query.
///
/// # Safety
/// As [`many_x86`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_many<const D: u8, const NQ: usize>(
    queries: &mut [PagedQuery<'_>],
    keys: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    scale: f32,
) {
    let size = keys.dtype.size_in_bytes();
    let hd = keys.head_dim;
    let common = queries.iter().map(|q| q.len).min().unwrap_or(0);
    let qs: [*const f32; NQ] = std::array::from_fn(|i| queries[i].q.as_ptr());
    // SAFETY: rows `< max len` are inside the pool and every query holds `hd` elements and a
    // score row of its length (the caller's checks).
    unsafe {
        for p in 0..common {
            let row = keys.data.as_ptr().add(keys.row(blocks, offset, p) * size);
            let s = x86_score_many::<D, NQ>(row, qs, hd, scale);
            for (q, v) in queries.iter_mut().zip(s) {
                q.scores[p] = v;
            }
        }
        for q in queries.iter_mut() {
            for p in common..q.len {
                let row = keys.data.as_ptr().add(keys.row(blocks, offset, p) * size);
                q.scores[p] = x86_score_many::<D, 1>(row, [q.q.as_ptr()], hd, scale)[0];
            }
        }
    }
}

/// `out_i = Σ_p scores_i[p] · v_p` for `NQ` queries, 32 columns per pass, each column
/// accumulated over the positions in order (as [`x86_weighted`]): the shared positions for all
/// queries together, then each query's own.
///
/// # Safety
/// As [`many_x86`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted_many<const D: u8, const NQ: usize>(
    queries: &mut [PagedQuery<'_>],
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
) {
    use std::arch::x86_64::*;
    let hd = values.head_dim;
    let size = values.dtype.size_in_bytes();
    let main8 = hd & !7;
    let base = values.data.as_ptr();
    let common = queries.iter().map(|q| q.len).min().unwrap_or(0);
    let mut c0 = 0;
    // SAFETY (whole body): value reads are at rows named by the block table (inside the pool)
    // and columns `< hd`; writes are inside each query's `out` (`>= hd` elements).
    unsafe {
        while c0 < main8 {
            let width = (main8 - c0).min(32) / 8;
            let mut acc = [[_mm256_setzero_ps(); 4]; NQ];
            for p in 0..common {
                let row = base.add(values.row(blocks, offset, p) * size);
                let sv: [__m256; NQ] = std::array::from_fn(|i| _mm256_set1_ps(queries[i].scores[p]));
                for j in 0..width {
                    let v = crate::x86::load8::<D>(row, c0 + 8 * j);
                    for (a, s) in acc.iter_mut().zip(&sv) {
                        a[j] = _mm256_fmadd_ps(*s, v, a[j]);
                    }
                }
            }
            for (q, a) in queries.iter_mut().zip(acc.iter_mut()) {
                for p in common..q.len {
                    let row = base.add(values.row(blocks, offset, p) * size);
                    let sv = _mm256_set1_ps(q.scores[p]);
                    for (j, aj) in a.iter_mut().enumerate().take(width) {
                        *aj = _mm256_fmadd_ps(sv, crate::x86::load8::<D>(row, c0 + 8 * j), *aj);
                    }
                }
                for (j, aj) in a.iter().enumerate().take(width) {
                    _mm256_storeu_ps(q.out.as_mut_ptr().add(c0 + 8 * j), *aj);
                }
            }
            c0 += width * 8;
        }
        for q in queries.iter_mut() {
            for c in main8..hd {
                let mut sum = 0.0f32;
                for p in 0..q.len {
                    let row = base.add(values.row(blocks, offset, p) * size);
                    sum = q.scores[p].mul_add(crate::x86::load1::<D>(row, c), sum);
                }
                q.out[c] = sum;
            }
        }
    }
}

/// `scores[p] = scale · q · k_p` for every position.
///
/// # Safety
/// AVX2/FMA/F16C are available; every row of `keys` named by `blocks` is inside the pool.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x86_scores<const D: u8>(
    q: &[f32],
    keys: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let size = keys.dtype.size_in_bytes();
    let qp = q.as_ptr();
    for (p, s) in scores.iter_mut().enumerate() {
        // SAFETY: the row's `hd` elements are inside the pool (the caller's contract), and `q`
        // holds `hd` elements.
        unsafe {
            let row = keys.data.as_ptr().add(keys.row(blocks, offset, p) * size);
            *s = x86_score_many::<D, 1>(row, [qp], keys.head_dim, scale)[0];
        }
    }
}

/// `scale · q_i · k` for `NQ` queries against one key row, each in the canonical order of a
/// score: two 8-lane accumulators over 16-column steps, an 8-column step into the first,
/// `hsum(a0 + a1)`, the scalar tail, then the scale. The queries share the key's loads; each
/// query's operations are the same whatever `NQ`, so its score has the same bits.
///
/// # Safety
/// AVX2/FMA/F16C are available; `row` holds `hd` elements of dtype `D`, each `q[i]` `hd` f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn x86_score_many<const D: u8, const NQ: usize>(
    row: *const u8,
    q: [*const f32; NQ],
    hd: usize,
    scale: f32,
) -> [f32; NQ] {
    use std::arch::x86_64::*;
    let main = hd & !7;
    let mut acc = [[_mm256_setzero_ps(); 2]; NQ];
    let mut out = [0.0f32; NQ];
    // SAFETY: reads stay inside the `hd` elements of `row` and of each query.
    unsafe {
        let mut c = 0;
        while c + 16 <= main {
            let (k0, k1) = (crate::x86::load8::<D>(row, c), crate::x86::load8::<D>(row, c + 8));
            for (a, qp) in acc.iter_mut().zip(q) {
                a[0] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(qp.add(c)), a[0]);
                a[1] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(qp.add(c + 8)), a[1]);
            }
            c += 16;
        }
        while c < main {
            let k0 = crate::x86::load8::<D>(row, c);
            for (a, qp) in acc.iter_mut().zip(q) {
                a[0] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(qp.add(c)), a[0]);
            }
            c += 8;
        }
        for ((o, a), qp) in out.iter_mut().zip(&acc).zip(q) {
            let mut dot = crate::x86::hsum(_mm256_add_ps(a[0], a[1]));
            let mut k = main;
            while k < hd {
                dot += crate::x86::load1::<D>(row, k) * *qp.add(k);
                k += 1;
            }
            *o = dot * scale;
        }
    }
    out
}

/// `out = Σ_p scores[p] · v_p`, 64 output columns held in registers per pass over the positions.
///
/// # Safety
/// AVX2/FMA/F16C are available; every row of `values` named by `blocks` is inside the pool.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x86_weighted<const D: u8>(
    scores: &[f32],
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let hd = values.head_dim;
    let size = values.dtype.size_in_bytes();
    let main8 = hd & !7;
    let base = values.data.as_ptr();
    let mut c0 = 0;
    // SAFETY (whole body): value reads are at rows named by the block table (inside the pool,
    // the caller's contract) and columns `< hd`; writes are inside `out` (`out.len() >= hd`).
    unsafe {
        while c0 < main8 {
            let width = (main8 - c0).min(64) / 8;
            let mut acc = [_mm256_setzero_ps(); 8];
            for (p, &s) in scores.iter().enumerate() {
                let sv = _mm256_set1_ps(s);
                let row = base.add(values.row(blocks, offset, p) * size);
                for (j, a) in acc.iter_mut().enumerate().take(width) {
                    *a = _mm256_fmadd_ps(sv, crate::x86::load8::<D>(row, c0 + 8 * j), *a);
                }
            }
            for (j, a) in acc.iter().enumerate().take(width) {
                _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * j), *a);
            }
            c0 += width * 8;
        }
        for (c, o) in out.iter_mut().enumerate().take(hd).skip(main8) {
            let mut sum = 0.0f32;
            for (p, &s) in scores.iter().enumerate() {
                let row = base.add(values.row(blocks, offset, p) * size);
                sum = s.mul_add(crate::x86::load1::<D>(row, c), sum);
            }
            *o = sum;
        }
    }
}

/// Writes `src` (f32) into `dst` elements `at..at + src.len()` of a pool of element type `dtype`
/// (rounding to nearest even for F16 and BF16). Panics if out of range.
pub fn store_row(dtype: WeightDType, dst: &mut [u8], at: usize, src: &[f32]) {
    let size = dtype.size_in_bytes();
    let bytes = &mut dst[at * size..(at + src.len()) * size];
    match dtype {
        WeightDType::F32 => {
            for (b, v) in bytes.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        WeightDType::F16 => {
            for (b, v) in bytes.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        WeightDType::BF16 => {
            for (b, v) in bytes.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}
