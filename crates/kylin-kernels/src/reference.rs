//! Scalar reference kernels: the definition of every kernel, simple enough to be obviously
//! right. SIMD versions are tested against these.

use crate::{ThreadPool, WeightDType, WeightMatrix, WeightVector};

/// Element `i` of little-endian `data` in `dtype`, widened to f32.
#[inline]
pub fn load_f32(dtype: WeightDType, data: &[u8], i: usize) -> f32 {
    match dtype {
        WeightDType::F32 => {
            let b = &data[i * 4..i * 4 + 4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
        WeightDType::F16 => half::f16::from_bits(u16::from_le_bytes([data[i * 2], data[i * 2 + 1]])).to_f32(),
        WeightDType::BF16 => f32::from_bits((u16::from_le_bytes([data[i * 2], data[i * 2 + 1]]) as u32) << 16),
    }
}

/// Reference `y = x · Wᵀ`. Rows are split across the pool so the reference is usable on real models.
pub fn matmul(pool: &ThreadPool, w: WeightMatrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n_tokens * w.cols);
    assert_eq!(y.len(), n_tokens * w.rows);
    for t in 0..n_tokens {
        let xt = &x[t * w.cols..(t + 1) * w.cols];
        let yt = &mut y[t * w.rows..(t + 1) * w.rows];
        let _ = pool;
        for (r, out) in yt.iter_mut().enumerate() {
            let base = r * w.cols;
            let mut acc = 0.0f32;
            for (c, xv) in xt.iter().enumerate() {
                acc += load_f32(w.dtype, w.data, base + c) * xv;
            }
            *out = acc;
        }
    }
}

pub fn widen_row(w: WeightMatrix<'_>, row: usize, out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate().take(w.cols) {
        *o = load_f32(w.dtype, w.data, row * w.cols + c);
    }
}

pub fn rms_norm(x: &[f32], weight: WeightVector<'_>, eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for (i, (o, v)) in out.iter_mut().zip(x).enumerate() {
        *o = v * inv * weight.get(i);
    }
}

pub fn add_bias(x: &mut [f32], bias: WeightVector<'_>) {
    for (i, v) in x.iter_mut().enumerate() {
        *v += bias.get(i);
    }
}

pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

pub fn rope_rotate_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let a = x[i];
        let b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

pub fn silu(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = *v / (1.0 + (-*v).exp());
    }
}

pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// gpt-oss's clamped SwiGLU: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
/// `gate = (u + 1) · (g · sigmoid(g · alpha))`, in PyTorch's order of operations.
pub fn clamped_swiglu_mul(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let g0 = g.min(limit);
        let u = u.clamp(-limit, limit);
        let sigmoid = 1.0 / (1.0 + (-(g0 * alpha)).exp());
        *g = (u + 1.0) * (g0 * sigmoid);
    }
}

/// [`clamped_swiglu_mul`] on interleaved pairs: `out[i]` from `gate_up[2i]` (gate) and
/// `gate_up[2i + 1]` (up).
pub fn clamped_swiglu_interleaved(gate_up: &[f32], out: &mut [f32], alpha: f32, limit: f32) {
    for (o, pair) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
        let g0 = pair[0].min(limit);
        let u = pair[1].clamp(-limit, limit);
        let sigmoid = 1.0 / (1.0 + (-(g0 * alpha)).exp());
        *o = (u + 1.0) * (g0 * sigmoid);
    }
}

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
    let scores = &mut scores[..len];
    for (p, s) in scores.iter_mut().enumerate() {
        let k = &keys[p * head_dim..(p + 1) * head_dim];
        *s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
    }
    softmax(scores);
    out[..head_dim].fill(0.0);
    for (p, s) in scores.iter().enumerate() {
        let v = &values[p * head_dim..(p + 1) * head_dim];
        for (o, vv) in out.iter_mut().zip(v) {
            *o += s * vv;
        }
    }
}

/// Reference attention of one query row over positions `from..len` of contiguous `keys` and
/// `values` (`(len, head_dim)` each), with the scores `s = (q · k) · scale`, then
/// `s = cap · tanh(s / cap)` when `softcap` is given (Gemma 2), then the softmax over
/// `from..len`. The soft cap and everything after the scores in f64.
#[allow(clippy::too_many_arguments)]
pub fn attention_head_window(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    from: usize,
    len: usize,
    head_dim: usize,
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) {
    assert!(from < len, "a row attends to at least one position");
    let scores: Vec<f64> = (from..len)
        .map(|p| {
            let k = &keys[p * head_dim..(p + 1) * head_dim];
            let s = (q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale) as f64;
            match softcap {
                Some(cap) => cap as f64 * (s / cap as f64).tanh(),
                None => s,
            }
        })
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = weights.iter().sum();
    for (c, o) in out[..head_dim].iter_mut().enumerate() {
        let acc: f64 = weights.iter().enumerate().map(|(j, w)| w * values[(from + j) * head_dim + c] as f64).sum();
        *o = (acc / sum) as f32;
    }
}

/// `f32` → BF16 bits, rounded to nearest even (NaN stays a quiet NaN).
#[inline]
pub fn round_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// `y = bf16(x) · Wᵀ` for BF16 `w`, summed in f64 (the accuracy reference for the BF16
/// kernels): x is `(n_tokens, w.cols)`, y is `(n_tokens, w.rows)`.
pub fn matmul_bf16(w: WeightMatrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    for t in 0..n_tokens {
        for r in 0..w.rows {
            let mut acc = 0.0f64;
            for c in 0..w.cols {
                let xv = f32::from_bits((round_bf16(x[t * w.cols + c]) as u32) << 16);
                acc += load_f32(w.dtype, w.data, r * w.cols + c) as f64 * xv as f64;
            }
            y[t * w.rows + r] = acc as f32;
        }
    }
}

/// `out = x / rms(x) * (1 + w)` (Gemma's RMSNorm).
pub fn rms_norm_unit_offset(x: &[f32], weight: WeightVector<'_>, eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for (i, (o, v)) in out.iter_mut().zip(x).enumerate() {
        *o = v * inv * (1.0 + weight.get(i));
    }
}

/// `gelu_pytorch_tanh(x)`, PyTorch's formula in f32.
pub fn gelu_tanh(x: f32) -> f32 {
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    const KAPPA: f32 = 0.044715;
    let inner = BETA * (x + KAPPA * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x.iter_mut() {
        *v = (*v / cap).tanh() * cap;
    }
}

/// The gated delta rule of one value head token by token, in f64 (transformers'
/// `torch_recurrent_gated_delta_rule`): for each token, `S ← e^g S`, `u = β (v − Sᵀ k)`,
/// `S ← S + k uᵀ`, `o = Sᵀ q`. Rows `t` of `q`, `k` (`dk`) and `v` (`dv`) are contiguous;
/// `s` is `(dk, dv)` and is advanced; `out` is `(n, dv)`. The accuracy reference of
/// [`crate::delta::delta_rule`].
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent(
    dk: usize,
    dv: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f64],
    out: &mut [f32],
) {
    for t in 0..g.len() {
        let decay = (g[t] as f64).exp();
        for x in s.iter_mut() {
            *x *= decay;
        }
        let (qt, kt, vt) = (&q[t * dk..(t + 1) * dk], &k[t * dk..(t + 1) * dk], &v[t * dv..(t + 1) * dv]);
        for j in 0..dv {
            let mem: f64 = (0..dk).map(|a| s[a * dv + j] * kt[a] as f64).sum();
            let delta = (vt[j] as f64 - mem) * beta[t] as f64;
            for a in 0..dk {
                s[a * dv + j] += kt[a] as f64 * delta;
            }
        }
        for j in 0..dv {
            out[t * dv + j] = (0..dk).map(|a| s[a * dv + j] * qt[a] as f64).sum::<f64>() as f32;
        }
    }
}
