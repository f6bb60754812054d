//! Kylin's compute kernels: pure functions on slices.
//!
//! Weights arrive as little-endian bytes in their stored dtype ([`WeightMatrix`],
//! [`WeightVector`]); activations are `f32`. Every kernel has a scalar reference in
//! [`reference`]; SIMD versions are chosen at run time by CPU feature detection ([`isa`],
//! detected once and cached; never by build flags) and tested against the reference on odd
//! sizes.
//!
//! Guarantees: no function here allocates except [`measure_read_bandwidth`] (its probe buffer),
//! [`ThreadPool::new`] and the load-time quantization ([`quant::quantize_q8_0_groups`]'s row
//! buffers, [`quant::QuantBuffer::zeroed`]); accumulation is always in f32; [`matmul`] and [`matmul_many`] split
//! the output rows across the pool so each weight byte is read by one core.
//!
//! Setting the environment variable `KYLIN_KERNELS_ISA=scalar` before the first kernel call
//! forces the portable scalar kernels, `KYLIN_KERNELS_ISA=avx2` the AVX2 kernels on an AVX-512
//! machine, and `KYLIN_KERNELS_ISA=avx512` the AVX-512 BF16 products instead of AMX (for
//! debugging, comparison and tests of every path).
//!
//! Two arithmetics ([`Precision`]): f32 ([`matmul`], [`matmul_many`]: weights widened exactly,
//! f32 activations) and BF16 ([`matmul_many_bf16`]: activations rounded to BF16, products
//! summed in f32) on AMX (`amx.rs`) or AVX-512 BF16 (`avx512bf16.rs`), see [`bf16_kernels`];
//! and for quantized weights (Q8_0, Q4_K, and Q4_G packed from published 4-bit checkpoints),
//! int8 products ([`quant::matmul_many_quant`]) on AVX-512 VNNI, AVX2 or scalar code, which all
//! give the same bits.
//!
//! Batch invariance: within one process, every output element of [`matmul`] and
//! [`matmul_many`] is computed by the same sequence of floating-point operations whatever the
//! number of tokens, the token's position in the batch, the thread count or the grouping of
//! matrices (see `matmul.rs`), so a sequence's results do not depend on what shares its batch.

#[cfg(target_arch = "x86_64")]
pub mod aligned;
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
pub mod bf16_tiles;
pub mod delta;
mod gemm;
mod matmul;
pub mod mxfp4;
pub mod packed;
pub mod paged;
pub mod pool;
pub mod q4g;
pub mod q4k;
#[cfg(target_arch = "x86_64")]
mod q4k_x86;
pub mod q56;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod quant_x86;
pub mod reference;
pub mod strips;
pub mod w16;
#[cfg(target_arch = "x86_64")]
mod w16_amx;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use gemm::{PANEL_ROWS, TILE_TOKENS, gemm_packed};
pub use matmul::{FloatRowInput, GEMM_MIN_TOKENS, bf16_scratch_len};
pub use pool::{ThreadPool, physical_cores};

use std::sync::OnceLock;

/// Tokens up to which a matrix product prefetches the next weights while it computes the
/// current ones ([`prefetches_weights`]).
const PREFETCH_MAX_TOKENS: usize = 32;

/// Whether a product of `n_tokens` tokens has its tiles prefetch the next tile's (or group's)
/// weights: batched decode and short chunks, 2 to [`PREFETCH_MAX_TOKENS`] tokens, whose
/// arithmetic per weight byte is too short for the first pass over a tile to hide its memory
/// reads. One token streams faster without (the hardware prefetcher follows its rows), and
/// longer products reuse each tile long enough to hide them.
/// A prefetch is a hint: it changes no result.
pub(crate) fn prefetches_weights(n_tokens: usize) -> bool {
    (2..=PREFETCH_MAX_TOKENS).contains(&n_tokens)
}

/// Asks the memory system for `lines` cache lines of 64 bytes from `p` on, into the
/// second-level cache (`prefetcht1`): the next weights of the tiles that [`prefetches_weights`]
/// lets prefetch, and attention's next KV blocks. The pointer is only computed (wrapping) and
/// may lie past the matrix, as the next group's or tile's address does after the last one: a
/// prefetch of any address is harmless, and it changes no result.
///
/// Why L2 and not L1 (`prefetcht0`): a prefetch into L1 holds one of the core's few L1 miss
/// buffers until its line arrives, and the tile's own loads and products behind it wait for a
/// free one, so a tile's arithmetic and the next tile's reads ran one after the other instead
/// of overlapping; into L2 they overlap, and L1 keeps the current tile. Batched decode of 8
/// sequences of qwen3-0.6b-shaped under `--quantize q8_0` went from 226 to 280 tokens/s, under
/// `q4_k` from 272 to 280, and the BF16 tile's 8-token pass over Qwen3-0.6B's layers
/// (`model_bf16_dot`) from about 41 to 27 ms (BENCHMARKS.md).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_lines(p: *const u8, lines: usize) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    for k in 0..lines {
        // SAFETY: SSE is part of x86_64's baseline, and a prefetch never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(64 * k) as *const i8) };
    }
}

/// The instruction set the kernels use on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// x86_64 with AVX-512 F/BW/VL as well as AVX2, FMA and F16C: the batched matmul runs the
    /// AVX-512 GEMM, every other kernel the AVX2 one.
    Avx512,
    /// x86_64 with AVX2, FMA and F16C.
    Avx2Fma,
    /// Portable scalar code.
    Scalar,
}

/// A switch for comparisons that is on unless one of the environment variables `names` is
/// `0`; read on first use into `cell`, then cached for the process.
pub(crate) fn env_switch(cell: &'static OnceLock<bool>, names: &[&str]) -> bool {
    *cell.get_or_init(|| names.iter().all(|name| std::env::var(name).map_or(true, |v| v != "0")))
}

/// The instruction set chosen for this process (detected on first use, then cached).
///
/// `KYLIN_KERNELS_ISA=scalar` or `KYLIN_KERNELS_ISA=avx2` caps it (a cap the CPU does not
/// reach is ignored).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("KYLIN_KERNELS_ISA").unwrap_or_default();
        if cap.eq_ignore_ascii_case("scalar") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                if !cap.eq_ignore_ascii_case("avx2")
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                {
                    return Isa::Avx512;
                }
                return Isa::Avx2Fma;
            }
        }
        Isa::Scalar
    })
}

/// How matrix products treat their inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Weights widened to f32 exactly, activations kept in f32, f32 accumulation: matches
    /// transformers' float32 references.
    F32,
    /// Activations rounded to BF16 (nearest even) at the input of each matrix product, BF16
    /// weights used as stored, products and accumulation in f32: what transformers computes for
    /// a BF16 model, and llama.cpp for a BF16 GGUF.
    Bf16,
}

/// The kernel family that runs [`Precision::Bf16`] matrix products on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Kernels {
    /// Intel AMX tiles (`tdpbf16ps`).
    Amx,
    /// AVX-512 BF16 dot products (`vdpbf16ps`), on CPUs without AMX (e.g. AMD Zen 4).
    Avx512Bf16,
}

impl Bf16Kernels {
    /// A short name for reports (`amx-bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernels::Amx => "amx-bf16",
            Bf16Kernels::Avx512Bf16 => "avx512-bf16",
        }
    }
}

/// Whether `KYLIN_KERNELS_ISA` leaves AMX on (`avx512` turns it off, for comparisons).
#[cfg(target_arch = "x86_64")]
fn amx_allowed() -> bool {
    !std::env::var("KYLIN_KERNELS_ISA").unwrap_or_default().eq_ignore_ascii_case("avx512")
}

/// Whether this process runs the integer sums of quantized prefill on AMX-INT8 tiles
/// (`tdpbsud`): the CPU has AMX-INT8, the kernel granted AMX, and `KYLIN_KERNELS_ISA` caps
/// nothing (`avx512` keeps the AVX-512 VNNI sums, which give the same integers). Detected once.
pub fn amx_int8() -> bool {
    static AMX_INT8: OnceLock<bool> = OnceLock::new();
    *AMX_INT8.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            isa() == Isa::Avx512
                && amx_allowed()
                && is_x86_feature_detected!("avx512vnni")
                && amx::request_permission()
                && amx::has_int8()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// The BF16 kernel family of this process, if the CPU (and OS) has one: AMX-BF16 (after this
/// process obtained the kernel's permission to use AMX state), else AVX-512 BF16. Detected once,
/// then cached; `KYLIN_KERNELS_ISA=avx512` skips AMX, `avx2|scalar` turns both off.
pub fn bf16_kernels() -> Option<Bf16Kernels> {
    static KERNELS: OnceLock<Option<Bf16Kernels>> = OnceLock::new();
    *KERNELS.get_or_init(|| {
        if isa() != Isa::Avx512 {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if amx_allowed() && amx::request_permission() {
                return Some(Bf16Kernels::Amx);
            }
            if is_x86_feature_detected!("avx512bf16") {
                return Some(Bf16Kernels::Avx512Bf16);
            }
        }
        None
    })
}

/// A short name of the kernel family that runs matrix products of `precision`: `amx-bf16`,
/// `avx512-bf16`, `avx512`, `avx2` or `scalar`.
pub fn kernel_family(precision: Precision) -> &'static str {
    if precision == Precision::Bf16
        && let Some(k) = bf16_kernels()
    {
        return k.name();
    }
    match isa() {
        Isa::Avx512 => "avx512",
        Isa::Avx2Fma => "avx2",
        Isa::Scalar => "scalar",
    }
}

/// `y_i = bf16(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs`: [`Precision::Bf16`] products.
///
/// Shapes: `x` is `(n_tokens, cols)`; every `W_i` is `(rows_i, cols)` and stored in BF16;
/// `y_i` is `(n_tokens, rows_i)`. `scratch` receives the rounded activations and must hold
/// [`bf16_scratch_len`]`(n_tokens, cols)` elements. Batch invariant like [`matmul_many`]:
/// row `t` of `y_i` has the same bits whatever else is in `x` (a one-token call included).
/// Allocates nothing. Panics on a shape disagreement or a non-BF16 weight.
pub fn matmul_many_bf16(
    pool: &ThreadPool,
    kernels: Bf16Kernels,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut [u16],
    jobs: &mut [(WeightMatrix<'_>, &mut [f32])],
) {
    matmul::matmul_many_bf16(pool, kernels, x, n_tokens, scratch, jobs)
}

/// `f32` → BF16 bits, rounded to nearest even (NaN stays NaN): the rounding
/// [`matmul_many_bf16`] applies to its activations.
pub fn round_bf16(v: f32) -> u16 {
    reference::round_bf16(v)
}

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
///
/// Runs on `pool`, output rows split across its threads. With `n_tokens <
/// GEMM_MIN_TOKENS` (decode) it streams each weight once (GEMV); otherwise it runs a
/// register-blocked GEMM that reads each weight once per token block. Batch invariant: row `t`
/// of `y` has the same bits as `matmul` of token `t` alone, whatever else is in `x`, on any
/// pool. Allocates nothing. Panics if a length disagrees with the shapes.
pub fn matmul(pool: &ThreadPool, w: WeightMatrix<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    matmul::matmul_many(pool, x, n_tokens, &mut [(w, y)])
}

/// Several matmuls sharing the same input in one pool job: `y_i = x · W_iᵀ` for every
/// `(W_i, y_i)` in `jobs` (e.g. q/k/v projections, or gate/up).
///
/// Shapes: `x` is `(n_tokens, cols)`; every `W_i` is `(rows_i, cols)`; `y_i` is
/// `(n_tokens, rows_i)`. Same results (bit for bit) as calling [`matmul`] for each, with one
/// thread-pool synchronisation instead of one per matrix. Allocates nothing.
pub fn matmul_many(pool: &ThreadPool, x: &[f32], n_tokens: usize, jobs: &mut [(WeightMatrix<'_>, &mut [f32])]) {
    matmul::matmul_many(pool, x, n_tokens, jobs)
}

/// One token per matrix, each reading its own row of `xs`: `y_i = xs[row_i] · W_iᵀ` for every
/// `(FloatRowInput { W_i, row_i }, y_i)` in `jobs`, with one thread-pool synchronisation per
/// eight matrices (a decode step's routed experts' down products). Row `r` of `y_i` has the same
/// bits as [`matmul`] of `xs[row_i]` alone. Allocates nothing.
pub fn matmul_rows(pool: &ThreadPool, xs: &[f32], jobs: &mut [(FloatRowInput<'_>, &mut [f32])]) {
    matmul::matmul_rows(pool, xs, jobs)
}

/// Row `row` of `w` widened to f32 into `out` (`out.len() == w.cols`): the embedding lookup.
pub fn widen_row(w: WeightMatrix<'_>, row: usize, out: &mut [f32]) {
    let n = out.len().min(w.cols);
    let size = w.dtype.size_in_bytes();
    let start = row * w.cols * size;
    // This check makes the unsafe read below sound.
    assert!(row < w.rows && w.data.len() >= start + n * size, "widen_row: row {row} out of range");
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected; elements `0..n` of the row are inside `w.data`.
        Isa::Avx2Fma | Isa::Avx512 => unsafe {
            let p = w.data.as_ptr().add(start);
            match w.dtype {
                WeightDType::BF16 => x86::widen::<{ x86::BF16 }>(p, &mut out[..n]),
                WeightDType::F16 => x86::widen::<{ x86::F16 }>(p, &mut out[..n]),
                WeightDType::F32 => x86::widen::<{ x86::F32 }>(p, &mut out[..n]),
            }
        },
        _ => reference::widen_row(w, row, out),
    }
}

/// `out = x / rms(x) * weight` for one row (`x.len() == weight.len() == out.len()`).
pub fn rms_norm(x: &[f32], weight: WeightVector<'_>, eps: f32, out: &mut [f32]) {
    rms_norm_scaled::<false>(x, weight, eps, out)
}

/// `out = x / rms(x) * (1 + weight)` for one row: Gemma's RMSNorm, whose weights are stored
/// as offsets from one (`1 + w` is formed in f32 first, then multiplied, as transformers does).
pub fn rms_norm_unit_offset(x: &[f32], weight: WeightVector<'_>, eps: f32, out: &mut [f32]) {
    rms_norm_scaled::<true>(x, weight, eps, out)
}

/// Both RMSNorms: the weight is `w`, or `1 + w` with `UNIT`.
fn rms_norm_scaled<const UNIT: bool>(x: &[f32], weight: WeightVector<'_>, eps: f32, out: &mut [f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            // This check makes the unsafe weight reads below sound.
            assert!(weight.len() >= out.len() && x.len() >= out.len(), "rms_norm: lengths disagree");
            // SAFETY: AVX2/FMA/F16C were detected; `weight` holds at least `out.len()` elements.
            unsafe {
                let sum_sq = x86::dot(x, x);
                let inv = 1.0 / (sum_sq / x.len() as f32 + eps).sqrt();
                let w = weight.data.as_ptr();
                match weight.dtype {
                    WeightDType::BF16 => x86::scale_by_weights::<{ x86::BF16 }, UNIT>(x, inv, w, out),
                    WeightDType::F16 => x86::scale_by_weights::<{ x86::F16 }, UNIT>(x, inv, w, out),
                    WeightDType::F32 => x86::scale_by_weights::<{ x86::F32 }, UNIT>(x, inv, w, out),
                }
            }
        }
        _ if UNIT => reference::rms_norm_unit_offset(x, weight, eps, out),
        _ => reference::rms_norm(x, weight, eps, out),
    }
}

/// In-place GeGLU: `gate = gelu_tanh(gate) * up`, with PyTorch's tanh approximation
/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))` (`gelu_pytorch_tanh`). The SIMD
/// version's tanh is `1 − 2 / (e^{2u} + 1)` over the kernels' `exp`, within a few ulp of
/// the reference's.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::gelu_tanh_mul(gate, up) },
        _ => reference::gelu_tanh_mul(gate, up),
    }
}

/// In-place tanh soft-capping: `x = cap · tanh(x / cap)` (Gemma 2's final logits).
pub fn softcap(x: &mut [f32], cap: f32) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::softcap(x, cap) },
        _ => reference::softcap(x, cap),
    }
}

/// In-place `x *= factor` (embedding and logit multipliers).
pub fn scale(x: &mut [f32], factor: f32) {
    for v in x.iter_mut() {
        *v *= factor;
    }
}

/// In-place `x += y · factor` (a residual branch scaled by a multiplier): the product is
/// rounded, then added, as PyTorch's `residual + h * multiplier` does.
pub fn add_scaled(x: &mut [f32], y: &[f32], factor: f32) {
    for (x, &y) in x.iter_mut().zip(y) {
        *x += y * factor;
    }
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

/// In-place numerically stable softmax. The SIMD version's `exp` is within 2 ulp of the
/// reference's.
pub fn softmax(x: &mut [f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::softmax(x) },
        _ => reference::softmax(x),
    }
}

/// In-place `x = silu(x) = x / (1 + e^-x)`. The SIMD version's `exp` is within 2 ulp of the
/// reference's.
pub fn silu(x: &mut [f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::silu(x) },
        _ => reference::silu(x),
    }
}

/// In-place `gate = silu(gate) * up` (SwiGLU). The SIMD version's `exp` is within 2 ulp of the
/// reference's.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::silu_mul(gate, up) },
        _ => reference::silu_mul(gate, up),
    }
}

/// In-place gpt-oss clamped SwiGLU: `gate = (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)`
/// with `g = min(gate, limit)` (the experts' activation; scalar, the products dominate).
pub fn clamped_swiglu_mul(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    reference::clamped_swiglu_mul(gate, up, alpha, limit)
}

/// [`clamped_swiglu_mul`] over interleaved `(gate, up)` pairs: `out (n) <- gate_up (2n)`.
pub fn clamped_swiglu_interleaved(gate_up: &[f32], out: &mut [f32], alpha: f32, limit: f32) {
    reference::clamped_swiglu_interleaved(gate_up, out, alpha, limit)
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
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            let scores = &mut scores[..len];
            for (p, s) in scores.iter_mut().enumerate() {
                let k = &keys[p * head_dim..(p + 1) * head_dim];
                // SAFETY: AVX2/FMA/F16C were detected.
                *s = unsafe { x86::dot(&q[..head_dim], k) } * scale;
            }
            // SAFETY: AVX2/FMA/F16C were detected.
            unsafe {
                x86::softmax(scores);
                x86::weighted_sum(scores, &values[..len * head_dim], head_dim, out);
            }
        }
        _ => reference::attention_head(q, keys, values, len, head_dim, scale, scores, out),
    }
}

/// Measured streaming-read bandwidth in GB/s (10⁹ bytes per second): the best of
/// `repetitions` sums of a `bytes`-long buffer split across `pool`'s threads.
///
/// Allocates (and touches) the buffer once; used by benchmarks to put decode speed next to
/// what the memory can deliver. Returns 0 for an empty buffer or no repetitions.
pub fn measure_read_bandwidth(pool: &ThreadPool, bytes: usize, repetitions: usize) -> f64 {
    if bytes == 0 || repetitions == 0 {
        return 0.0;
    }
    let data = vec![1u8; bytes];
    let threads = pool.threads();
    let chunk = bytes.div_ceil(threads);
    let sink = std::sync::atomic::AtomicU64::new(0);
    let mut best = f64::INFINITY;
    for _ in 0..repetitions {
        let start = std::time::Instant::now();
        pool.run(threads, &|t| {
            let part = &data[(t * chunk).min(bytes)..((t + 1) * chunk).min(bytes)];
            let sum = read_sum(part);
            sink.fetch_add(sum, std::sync::atomic::Ordering::Relaxed);
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink.into_inner());
    bytes as f64 / best.max(1e-9) / 1e9
}

/// Sum of `data` read sequentially (the body of the bandwidth probe).
fn read_sum(data: &[u8]) -> u64 {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::read_sum(data) },
        _ => {
            let mut words = data.chunks_exact(8);
            let mut acc = [0u64; 4];
            for (i, w) in words.by_ref().enumerate() {
                let v = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
                acc[i % 4] = acc[i % 4].wrapping_add(v);
            }
            let tail = words.remainder().iter().fold(0u64, |s, b| s.wrapping_add(*b as u64));
            acc.iter().fold(tail, |s, v| s.wrapping_add(*v))
        }
    }
}
