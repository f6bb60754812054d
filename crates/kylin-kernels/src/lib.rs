//! Kylin's compute kernels: pure functions on slices.
//!
//! Weights arrive as little-endian bytes in their stored dtype ([`WeightMatrix`],
//! [`WeightVector`]); activations are `f32`. Every kernel has a scalar reference in
//! [`reference`]; SIMD versions are chosen at run time by CPU feature detection and tested
//! against the reference on odd sizes.

pub mod pool;
pub mod reference;

pub use pool::ThreadPool;

/// Stored element type of a weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDType {
    F32,
    F16,
    BF16,
}

impl WeightDType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            WeightDType::F32 => 4,
            WeightDType::F16 | WeightDType::BF16 => 2,
        }
    }
}

/// A row-major `[rows, cols]` weight matrix (HF `nn.Linear` layout: `[out_features, in_features]`).
///
/// Invariant (the caller checked it at load): `data.len() == rows * cols * dtype.size_in_bytes()`.
#[derive(Debug, Clone, Copy)]
pub struct WeightMatrix<'a> {
    pub dtype: WeightDType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

/// A weight vector (norm scales, biases): `data.len() / dtype.size_in_bytes()` elements.
#[derive(Debug, Clone, Copy)]
pub struct WeightVector<'a> {
    pub dtype: WeightDType,
    pub data: &'a [u8],
}

impl WeightVector<'_> {
    pub fn len(&self) -> usize {
        self.data.len() / self.dtype.size_in_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Element `i` widened to f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        reference::load_f32(self.dtype, self.data, i)
    }
}

/// `y = x · Wᵀ`: x is `(n_tokens, w.cols)`, y is `(n_tokens, w.rows)`, both row-major.
pub fn matmul(pool: &ThreadPool, w: WeightMatrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    reference::matmul(pool, w, x, n_tokens, y)
}

/// Row `row` of `w` widened to f32 into `out` (`out.len() == w.cols`): the embedding lookup.
pub fn widen_row(w: WeightMatrix<'_>, row: usize, out: &mut [f32]) {
    reference::widen_row(w, row, out)
}

/// `out = x / rms(x) * weight` for one row (`x.len() == weight.len() == out.len()`).
pub fn rms_norm(x: &[f32], weight: WeightVector<'_>, eps: f32, out: &mut [f32]) {
    reference::rms_norm(x, weight, eps, out)
}

/// In-place `x += bias`.
pub fn add_bias(x: &mut [f32], bias: WeightVector<'_>) {
    reference::add_bias(x, bias)
}

/// In-place `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    reference::add_assign(x, y)
}

/// HF rotate-half RoPE on one head: for `i < half`, `(x[i], x[i+half])` rotated by the angle
/// whose cosine and sine are `cos[i]`, `sin[i]` (`cos.len() == sin.len() == half`).
pub fn rope_rotate_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    reference::rope_rotate_half(x, cos, sin)
}

/// In-place numerically stable softmax.
pub fn softmax(x: &mut [f32]) {
    reference::softmax(x)
}

/// In-place `gate = silu(gate) * up` (SwiGLU).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    reference::silu_mul(gate, up)
}

/// Attention of one query head over `len` cached positions of its KV head.
///
/// `q`: `(head_dim)`; `keys`, `values`: `(len, head_dim)` row-major (at least `len * head_dim`
/// elements); `scores`: scratch of at least `len`; `out`: `(head_dim)`.
/// `out = softmax(scale * keys · q) · values`.
#[allow(clippy::too_many_arguments)]
pub fn attention_head(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    head_dim: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    reference::attention_head(q, keys, values, len, head_dim, scale, scores, out)
}
