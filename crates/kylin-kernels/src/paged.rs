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
    use std::arch::x86_64::*;
    let hd = keys.head_dim;
    let size = keys.dtype.size_in_bytes();
    let main = hd & !7;
    let qp = q.as_ptr();
    for (p, s) in scores.iter_mut().enumerate() {
        // SAFETY: the row's `hd` elements are inside the pool (the caller's contract), and `q`
        // holds `hd` elements.
        unsafe {
            let row = keys.data.as_ptr().add(keys.row(blocks, offset, p) * size);
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut c = 0;
            while c + 16 <= main {
                acc[0] = _mm256_fmadd_ps(crate::x86::load8::<D>(row, c), _mm256_loadu_ps(qp.add(c)), acc[0]);
                acc[1] = _mm256_fmadd_ps(crate::x86::load8::<D>(row, c + 8), _mm256_loadu_ps(qp.add(c + 8)), acc[1]);
                c += 16;
            }
            while c < main {
                acc[0] = _mm256_fmadd_ps(crate::x86::load8::<D>(row, c), _mm256_loadu_ps(qp.add(c)), acc[0]);
                c += 8;
            }
            let mut dot = crate::x86::hsum(_mm256_add_ps(acc[0], acc[1]));
            while c < hd {
                dot += crate::x86::load1::<D>(row, c) * *qp.add(c);
                c += 1;
            }
            *s = dot * scale;
        }
    }
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
