//! Kernels of the linear-attention mixers: Gated DeltaNet's delta rule (Qwen3.5, Qwen3-Next)
//! in chunks aligned to absolute positions, and the causal depthwise convolution in front of
//! it (and of LFM2's short-convolution blocks).
//!
//! # The delta rule, in chunks that start at multiples of the chunk size
//!
//! One value head keeps a state `S` of `(dk, dv)`. Token `t` (query `q_t` and key `k_t`
//! already L2-normalised, `q_t` scaled by `dk^-½`, value `v_t`, log decay `g_t ≤ 0`, write
//! strength `β_t`) does, in transformers' recurrent form:
//!
//! ```text
//! S ← e^{g_t} S;  u_t = β_t (v_t − Sᵀ k_t);  S ← S + k_t u_tᵀ;  o_t = Sᵀ q_t
//! ```
//!
//! Within a chunk that starts with the state `S₀` and `G_t = Σ g` from the chunk's first
//! token to `t` (inclusive), the same numbers are (the WY form transformers' chunked
//! kernel solves with a triangular system):
//!
//! ```text
//! u_t = β_t v_t − e^{G_t} S₀ᵀ(β_t k_t) − Σ_{i<t} e^{G_t − G_i} (β_t k_t · k_i) u_i
//! o_t = e^{G_t} S₀ᵀ q_t + Σ_{i≤t} e^{G_t − G_i} (q_t · k_i) u_i
//! S_end = e^{G_C} S₀ + Σ_i e^{G_C − G_i} k_i u_iᵀ
//! ```
//!
//! [`delta_rule`] computes exactly this, with chunks of `chunk` positions that start at
//! multiples of `chunk` in the sequence (absolute positions, not the call's first token). The
//! state it keeps between calls is `S₀` (the anchor, at the last chunk boundary) and, for the
//! chunk in progress, each token's `k_i`, `u_i` and `G_i` (the tail). Row `t`'s result depends
//! only on `S₀` and the chunk's rows up to `t`, each computed by the same operations in the same
//! order, and `S` changes only when a chunk is complete, summing its rows in order. So a
//! sequence gets the same bits whether its tokens come one at a time (decode), in one call, or
//! split anywhere (chunked prefill, prefix reuse, preemption): there is no separate recurrent
//! path whose rounding would differ from the chunk that later completes. Decoding a token
//! costs one pass over `S₀` (both products at once) and `O(tail · (dk + dv))`, plus one update
//! of `S` per chunk; prefill runs the same code on up to four rows per pass over `S₀`.
//!
//! Guarantees: nothing here allocates (work buffers are on the stack, sized by [`MAX_DIM`] and
//! [`MAX_CHUNK`]); the element-wise steps and the state products are fused multiply-adds in a
//! fixed order, identical on the scalar and AVX2 paths; only the dot products' reduction order
//! differs between the two paths, and each path gives the same bits for every split of a
//! sequence (`tests/delta.rs`).

use crate::{Isa, WeightMatrix, WeightVector, isa, reference};

/// Widest key or value head the delta rule takes.
pub const MAX_DIM: usize = 256;
/// Longest chunk (positions between two updates of the state).
pub const MAX_CHUNK: usize = 256;
/// Widest causal convolution (taps per channel).
pub const MAX_CONV_KERNEL: usize = 16;

/// The sizes of one delta-rule head and the chunk length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaDims {
    pub dk: usize,
    pub dv: usize,
    pub chunk: usize,
}

impl DeltaDims {
    /// Floats of the anchor state `S₀`, `(dk, dv)`.
    pub fn state_len(&self) -> usize {
        self.dk * self.dv
    }

    /// Floats of the tail: `chunk` keys, `chunk` corrected values and `chunk` decays.
    pub fn tail_len(&self) -> usize {
        self.chunk * (self.dk + self.dv + 1)
    }
}

/// One value head's state between calls.
pub struct DeltaState<'a> {
    /// `S₀` at the last chunk boundary, `(dk, dv)` row-major.
    pub s: &'a mut [f32],
    /// The chunk's keys so far, `(chunk, dk)`.
    pub keys: &'a mut [f32],
    /// Their corrected values `u`, `(chunk, dv)`.
    pub values: &'a mut [f32],
    /// Their cumulative log decays `G` since the chunk's start, `(chunk)`.
    pub decay: &'a mut [f32],
}

/// One value head's inputs for `n` consecutive tokens. Row `t` of queries is
/// `q[t · qkv_stride..][..dk]` (likewise keys, and values with `dv`), and its log decay and
/// write strength are `g[t · gate_stride]` and `beta[t · gate_stride]`.
pub struct DeltaTokens<'a> {
    pub n: usize,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub qkv_stride: usize,
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub gate_stride: usize,
}

/// The delta rule over `tokens`, the first at position `start` of its sequence (see the module
/// documentation): writes `out (n, dv)` and advances `state`. `state`'s tail holds the
/// `start % chunk` earlier tokens of the current chunk (a fresh sequence starts at 0 with a
/// zero `S₀`).
///
/// Panics (an engine bug) when a size is out of range or a slice is too short.
pub fn delta_rule(d: DeltaDims, start: usize, tokens: &DeltaTokens<'_>, state: &mut DeltaState<'_>, out: &mut [f32]) {
    assert!(d.dk > 0 && d.dk <= MAX_DIM && d.dv > 0 && d.dv <= MAX_DIM, "delta_rule: head width out of range");
    assert!(d.chunk > 0 && d.chunk <= MAX_CHUNK, "delta_rule: chunk out of range");
    assert!(state.s.len() >= d.state_len(), "delta_rule: state too short");
    assert!(state.keys.len() >= d.chunk * d.dk && state.values.len() >= d.chunk * d.dv, "delta_rule: tail too short");
    assert!(state.decay.len() >= d.chunk && out.len() >= tokens.n * d.dv, "delta_rule: buffers too short");
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { run::<Avx2>(d, start, tokens, state, out) },
        // SAFETY: the scalar operations need no CPU feature.
        _ => unsafe { run::<Scalar>(d, start, tokens, state, out) },
    }
}

/// [`delta_rule`] on the portable path whatever the CPU (for tests comparing the two paths).
pub fn delta_rule_portable(
    d: DeltaDims,
    start: usize,
    tokens: &DeltaTokens<'_>,
    state: &mut DeltaState<'_>,
    out: &mut [f32],
) {
    assert!(d.dk > 0 && d.dk <= MAX_DIM && d.dv > 0 && d.dv <= MAX_DIM && d.chunk > 0 && d.chunk <= MAX_CHUNK);
    // SAFETY: the scalar operations need no CPU feature.
    unsafe { run::<Scalar>(d, start, tokens, state, out) }
}

/// The vector operations of the delta rule. Every one but `dot` computes each output element
/// by the same fused multiply-adds in the same order on every implementation.
trait Ops {
    /// `Σ a[i] · b[i]`.
    unsafe fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `y[i] = fma(a, x[i], y[i])`.
    unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]);
    /// `y[i] = fma(a, x[i], b · z[i])`.
    unsafe fn fma_scaled(y: &mut [f32], a: f32, x: &[f32], b: f32, z: &[f32]);
    /// `y[i] = a · x[i]`.
    unsafe fn scale_into(y: &mut [f32], a: f32, x: &[f32]);
    /// `out[r][j] = Σ_a x[r][a] · s[a][j]` (a chain of fused multiply-adds over `a`, from 0), for
    /// `rows ≤ 8` rows of `x (rows, dk)` and `s (dk, dv)`.
    unsafe fn state_products(s: &[f32], dk: usize, dv: usize, x: &[f32], rows: usize, out: &mut [f32]);
    /// `s[a][j] = decay · s[a][j] + Σ_i (keys[i][a] · w[i]) · values[i][j]` (multiplied, then
    /// fused multiply-adds over `i` in order), for `m` rows of `keys (m, dk)`, `values (m, dv)`.
    unsafe fn state_update(s: &mut [f32], dk: usize, dv: usize, decay: f32, keys: &[f32], w: &[f32], values: &[f32]);
}

/// The portable operations.
struct Scalar;

impl Ops for Scalar {
    unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).fold(0.0f32, |acc, (x, y)| x.mul_add(*y, acc))
    }

    unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y = a.mul_add(*x, *y);
        }
    }

    unsafe fn fma_scaled(y: &mut [f32], a: f32, x: &[f32], b: f32, z: &[f32]) {
        for ((y, x), z) in y.iter_mut().zip(x).zip(z) {
            *y = a.mul_add(*x, b * z);
        }
    }

    unsafe fn scale_into(y: &mut [f32], a: f32, x: &[f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y = a * x;
        }
    }

    unsafe fn state_products(s: &[f32], dk: usize, dv: usize, x: &[f32], rows: usize, out: &mut [f32]) {
        for r in 0..rows {
            let xr = &x[r * dk..(r + 1) * dk];
            for j in 0..dv {
                let mut acc = 0.0f32;
                for (a, &xa) in xr.iter().enumerate() {
                    acc = xa.mul_add(s[a * dv + j], acc);
                }
                out[r * dv + j] = acc;
            }
        }
    }

    unsafe fn state_update(s: &mut [f32], dk: usize, dv: usize, decay: f32, keys: &[f32], w: &[f32], values: &[f32]) {
        for a in 0..dk {
            for j in 0..dv {
                let mut acc = decay * s[a * dv + j];
                for (i, &wi) in w.iter().enumerate() {
                    acc = (keys[i * dk + a] * wi).mul_add(values[i * dv + j], acc);
                }
                s[a * dv + j] = acc;
            }
        }
    }
}

/// The AVX2/FMA operations: eight lanes, the scalar tails by the same fused multiply-adds.
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Ops for Avx2 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        crate::x86::dot(a, b)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        use std::arch::x86_64::*;
        let n = y.len().min(x.len());
        let main = n & !7;
        let av = _mm256_set1_ps(a);
        let (yp, xp) = (y.as_mut_ptr(), x.as_ptr());
        // SAFETY: every access is below `main <= n`, inside both slices.
        unsafe {
            let mut i = 0;
            while i < main {
                _mm256_storeu_ps(
                    yp.add(i),
                    _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i))),
                );
                i += 8;
            }
        }
        for i in main..n {
            y[i] = a.mul_add(x[i], y[i]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma_scaled(y: &mut [f32], a: f32, x: &[f32], b: f32, z: &[f32]) {
        use std::arch::x86_64::*;
        let n = y.len().min(x.len()).min(z.len());
        let main = n & !7;
        let (av, bv) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let (yp, xp, zp) = (y.as_mut_ptr(), x.as_ptr(), z.as_ptr());
        // SAFETY: every access is below `main <= n`, inside the three slices.
        unsafe {
            let mut i = 0;
            while i < main {
                let bz = _mm256_mul_ps(bv, _mm256_loadu_ps(zp.add(i)));
                _mm256_storeu_ps(yp.add(i), _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), bz));
                i += 8;
            }
        }
        for i in main..n {
            y[i] = a.mul_add(x[i], b * z[i]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_into(y: &mut [f32], a: f32, x: &[f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y = a * x;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn state_products(s: &[f32], dk: usize, dv: usize, x: &[f32], rows: usize, out: &mut [f32]) {
        use std::arch::x86_64::*;
        debug_assert!(rows <= 8 && x.len() >= rows * dk && out.len() >= rows * dv && s.len() >= dk * dv);
        let main = dv & !7;
        let (sp, xp, op) = (s.as_ptr(), x.as_ptr(), out.as_mut_ptr());
        // SAFETY: `s` holds `dk · dv` elements, `x` `rows · dk`, `out` `rows · dv`; every index
        // below stays inside them (columns `j + 8 <= main <= dv`, rows `< rows`, `a < dk`).
        unsafe {
            let mut j = 0;
            // Up to two rows (decode): four column vectors per pass, so eight chains hide the
            // FMA latency; each element's chain over `a` is the same in every grouping.
            if rows <= 2 {
                while j + 32 <= main {
                    let mut acc = [[_mm256_setzero_ps(); 4]; 2];
                    for a in 0..dk {
                        let sv: [__m256; 4] = std::array::from_fn(|q| _mm256_loadu_ps(sp.add(a * dv + j + 8 * q)));
                        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
                            let xv = _mm256_set1_ps(*xp.add(r * dk + a));
                            for (q, acc) in acc.iter_mut().enumerate() {
                                *acc = _mm256_fmadd_ps(xv, sv[q], *acc);
                            }
                        }
                    }
                    for (r, acc) in acc.iter().enumerate().take(rows) {
                        for (q, acc) in acc.iter().enumerate() {
                            _mm256_storeu_ps(op.add(r * dv + j + 8 * q), *acc);
                        }
                    }
                    j += 32;
                }
            }
            while j < main {
                let mut acc = [_mm256_setzero_ps(); 8];
                for a in 0..dk {
                    let sv = _mm256_loadu_ps(sp.add(a * dv + j));
                    for (r, acc) in acc.iter_mut().enumerate().take(rows) {
                        *acc = _mm256_fmadd_ps(_mm256_set1_ps(*xp.add(r * dk + a)), sv, *acc);
                    }
                }
                for (r, acc) in acc.iter().enumerate().take(rows) {
                    _mm256_storeu_ps(op.add(r * dv + j), *acc);
                }
                j += 8;
            }
        }
        for r in 0..rows {
            for j in main..dv {
                let mut acc = 0.0f32;
                for a in 0..dk {
                    acc = x[r * dk + a].mul_add(s[a * dv + j], acc);
                }
                out[r * dv + j] = acc;
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn state_update(s: &mut [f32], dk: usize, dv: usize, decay: f32, keys: &[f32], w: &[f32], values: &[f32]) {
        use std::arch::x86_64::*;
        let m = w.len();
        debug_assert!(keys.len() >= m * dk && values.len() >= m * dv && s.len() >= dk * dv);
        let main = dv & !7;
        let dvec = _mm256_set1_ps(decay);
        let (sp, vp) = (s.as_mut_ptr(), values.as_ptr());
        // SAFETY: `s` holds `dk · dv` elements and `values` `m · dv`; columns stay below
        // `main <= dv`, rows below `dk` and `m`.
        // Four column vectors at a time, so four independent chains hide the FMA latency; each
        // element's chain is the same in every grouping.
        let main32 = dv & !31;
        unsafe {
            for a in 0..dk {
                let mut j = 0;
                while j < main32 {
                    let mut acc = [_mm256_setzero_ps(); 4];
                    for (q, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_mul_ps(dvec, _mm256_loadu_ps(sp.add(a * dv + j + 8 * q)));
                    }
                    for (i, &wi) in w.iter().enumerate() {
                        let coef = _mm256_set1_ps(keys[i * dk + a] * wi);
                        for (q, acc) in acc.iter_mut().enumerate() {
                            *acc = _mm256_fmadd_ps(coef, _mm256_loadu_ps(vp.add(i * dv + j + 8 * q)), *acc);
                        }
                    }
                    for (q, acc) in acc.iter().enumerate() {
                        _mm256_storeu_ps(sp.add(a * dv + j + 8 * q), *acc);
                    }
                    j += 32;
                }
                while j < main {
                    let mut acc = _mm256_mul_ps(dvec, _mm256_loadu_ps(sp.add(a * dv + j)));
                    for (i, &wi) in w.iter().enumerate() {
                        let coef = _mm256_set1_ps(keys[i * dk + a] * wi);
                        acc = _mm256_fmadd_ps(coef, _mm256_loadu_ps(vp.add(i * dv + j)), acc);
                    }
                    _mm256_storeu_ps(sp.add(a * dv + j), acc);
                    j += 8;
                }
            }
        }
        for a in 0..dk {
            for j in main..dv {
                let mut acc = decay * s[a * dv + j];
                for (i, &wi) in w.iter().enumerate() {
                    acc = (keys[i * dk + a] * wi).mul_add(values[i * dv + j], acc);
                }
                s[a * dv + j] = acc;
            }
        }
    }
}

/// Rows of one call processed per pass over `S₀` (each row needs two products).
const GROUP: usize = 4;

/// The delta rule (see [`delta_rule`]).
///
/// # Safety
/// `O`'s instruction set must be available.
unsafe fn run<O: Ops>(d: DeltaDims, start: usize, t: &DeltaTokens<'_>, st: &mut DeltaState<'_>, out: &mut [f32]) {
    let (dk, dv, c) = (d.dk, d.dv, d.chunk);
    // Up to GROUP query rows, then as many `β k` rows, and their products with S₀.
    let mut xs = [0.0f32; 2 * GROUP * MAX_DIM];
    let mut prod = [0.0f32; 2 * GROUP * MAX_DIM];
    let mut weights = [0.0f32; MAX_CHUNK];
    let q = |r: usize| &t.q[r * t.qkv_stride..r * t.qkv_stride + dk];
    let k = |r: usize| &t.k[r * t.qkv_stride..r * t.qkv_stride + dk];
    let v = |r: usize| &t.v[r * t.qkv_stride..r * t.qkv_stride + dv];
    let mut row = 0;
    // The index of the next token in its chunk.
    let mut at = start % c;
    while row < t.n {
        let group = (t.n - row).min(GROUP).min(c - at);
        // 1. S₀ᵀ q and S₀ᵀ (β k) for the group's rows, in one pass over S₀:
        //    (2 · group, dk) · (dk, dv) -> (2 · group, dv).
        for j in 0..group {
            let r = row + j;
            xs[j * dk..(j + 1) * dk].copy_from_slice(q(r));
            let beta = t.beta[r * t.gate_stride];
            for (x, &kv) in xs[(group + j) * dk..(group + j + 1) * dk].iter_mut().zip(k(r)) {
                *x = beta * kv;
            }
        }
        // SAFETY (this call and those below): the caller guarantees `O`'s instruction set.
        unsafe { O::state_products(st.s, dk, dv, &xs[..2 * group * dk], 2 * group, &mut prod[..2 * group * dv]) };
        // 2. Row by row, in order: the cumulative decay, the corrected value u (from the rows
        //    before it in the chunk), the output.
        for j in 0..group {
            let r = row + j;
            let ci = at + j;
            let g = t.g[r * t.gate_stride];
            let gc = if ci == 0 { g } else { st.decay[ci - 1] + g };
            st.decay[ci] = gc;
            let eg = gc.exp();
            let beta = t.beta[r * t.gate_stride];
            let kb = &xs[(group + j) * dk..(group + j + 1) * dk];
            st.keys[ci * dk..(ci + 1) * dk].copy_from_slice(k(r));
            let (before, rest) = st.values.split_at_mut(ci * dv);
            let u = &mut rest[..dv];
            // u = β v − e^G · S₀ᵀ(β k) − Σ_{i<ci} e^{G − G_i} (β k · k_i) u_i.
            unsafe { O::fma_scaled(u, -eg, &prod[(group + j) * dv..(group + j + 1) * dv], beta, v(r)) };
            for i in 0..ci {
                let coef = (gc - st.decay[i]).exp() * unsafe { O::dot(kb, &st.keys[i * dk..(i + 1) * dk]) };
                unsafe { O::axpy(u, -coef, &before[i * dv..(i + 1) * dv]) };
            }
            // o = e^G · S₀ᵀ q + Σ_{i≤ci} e^{G − G_i} (q · k_i) u_i.
            let o = &mut out[r * dv..(r + 1) * dv];
            unsafe { O::scale_into(o, eg, &prod[j * dv..(j + 1) * dv]) };
            for i in 0..=ci {
                let coef = (gc - st.decay[i]).exp() * unsafe { O::dot(q(r), &st.keys[i * dk..(i + 1) * dk]) };
                unsafe { O::axpy(o, coef, &st.values[i * dv..(i + 1) * dv]) };
            }
        }
        row += group;
        at += group;
        // 3. A complete chunk folds into S₀: S₀ = e^{G_C} S₀ + Σ_i e^{G_C − G_i} k_i u_iᵀ.
        if at == c {
            let total = st.decay[c - 1];
            for (w, &gi) in weights[..c].iter_mut().zip(&st.decay[..c]) {
                *w = (total - gi).exp();
            }
            unsafe {
                O::state_update(st.s, dk, dv, total.exp(), &st.keys[..c * dk], &weights[..c], &st.values[..c * dv])
            };
            at = 0;
        }
    }
}

/// `x *= 1 / √(Σ x² + eps)` (transformers' `l2norm`, as the FLA library computes it).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let sum_sq = match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { crate::x86::dot(x, x) },
        _ => x.iter().map(|v| v * v).sum::<f32>(),
    };
    let inv = 1.0 / (sum_sq + eps).sqrt();
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// PyTorch's `softplus` (β = 1, threshold 20): `ln(1 + eˣ)`, or `x` above 20.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `1 / (1 + e^{-x})`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// A causal depthwise convolution over `n` rows of `channels`, continuing a sequence:
/// `out[t][c] = act(bias[c] + Σ_j w[c][j] · in[t − (K−1) + j][c])` with `K = weight.cols` taps,
/// where the `K − 1` rows before the call's first are `state ((K−1), channels)` (zeros for a
/// fresh sequence) and `act` is SiLU with `silu`, else the identity. Afterwards `state` holds
/// the last `K − 1` input rows. With `anchor = Some((r, a))`, `a ((K−1), channels)` receives
/// the `K − 1` input rows before row `r` (the state a sequence had at that position).
///
/// `x` and `out` are `(n, channels)`. The taps are summed in order in f32; the weights are
/// read in their stored dtype (`weight` is `(channels, K)`).
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d(
    x: &[f32],
    n: usize,
    channels: usize,
    weight: WeightMatrix<'_>,
    bias: Option<WeightVector<'_>>,
    silu: bool,
    state: &mut [f32],
    anchor: Option<(usize, &mut [f32])>,
    out: &mut [f32],
) {
    let taps = weight.cols;
    assert!((1..=MAX_CONV_KERNEL).contains(&taps) && weight.rows == channels, "causal_conv1d: weight shape");
    let hist = taps - 1;
    assert!(x.len() >= n * channels && out.len() >= n * channels && state.len() >= hist * channels);
    // Row `r` of the extended input: the state's rows, then x's.
    let input = |state: &[f32], r: usize, c: usize| -> f32 {
        if r < hist { state[r * channels + c] } else { x[(r - hist) * channels + c] }
    };
    // Channels in blocks whose taps are widened once (transposed, tap-major), so each row's
    // block is read contiguously and the sums run eight channels at a time; per channel they are
    // `bias + w₀x₀ + w₁x₁ + ...` in tap order whatever the block.
    const BLOCK: usize = 64;
    let mut w = [[0.0f32; BLOCK]; MAX_CONV_KERNEL];
    let mut acc = [0.0f32; BLOCK];
    let mut c0 = 0;
    while c0 < channels {
        let width = BLOCK.min(channels - c0);
        for (j, tap) in w.iter_mut().enumerate().take(taps) {
            for (i, t) in tap.iter_mut().enumerate().take(width) {
                *t = reference::load_f32(weight.dtype, weight.data, (c0 + i) * taps + j);
            }
        }
        for t in 0..n {
            let acc = &mut acc[..width];
            match &bias {
                Some(b) => {
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = b.get(c0 + i);
                    }
                }
                None => acc.fill(0.0),
            }
            for (j, tap) in w.iter().enumerate().take(taps) {
                let r = t + j;
                let row = if r < hist { &state[r * channels + c0..] } else { &x[(r - hist) * channels + c0..] };
                for ((a, &wt), &v) in acc.iter_mut().zip(&tap[..width]).zip(&row[..width]) {
                    *a += wt * v;
                }
            }
            let dst = &mut out[t * channels + c0..t * channels + c0 + width];
            dst.copy_from_slice(acc);
            if silu {
                crate::silu(dst);
            }
        }
        c0 += width;
    }
    if let Some((r, a)) = anchor {
        assert!(r <= n && a.len() >= hist * channels, "causal_conv1d: anchor");
        for i in 0..hist {
            for c in 0..channels {
                a[i * channels + c] = input(state, r + i, c);
            }
        }
    }
    // The new state: extended rows n .. n + hist (reading ahead of the row being written when
    // the old state shifts left, so in place is safe).
    for i in 0..hist {
        let r = n + i;
        if r < hist {
            state.copy_within(r * channels..(r + 1) * channels, i * channels);
        } else {
            let from = (r - hist) * channels;
            state[i * channels..(i + 1) * channels].copy_from_slice(&x[from..from + channels]);
        }
    }
}
