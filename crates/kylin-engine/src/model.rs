//! The decoder-only transformer every registered family runs on (`kylin_loader::family`).
//!
//! One layer is composed from shared blocks as the family's `DecoderSpec` says: attention with
//! grouped KV heads (a sliding window per layer, a score scale, a soft cap), rotate-half RoPE
//! from the layer's table (global, local, partial, or none), q/k RMSNorm per head or over the
//! projection, norms before and/or after each sub-block (`w` or Gemma's `1 + w`), a gated MLP
//! (SwiGLU or GeGLU), and scalar multipliers on the embedding, the residual branches and the
//! logits, plus a final soft cap. Every choice is made once in [`Model::new`]; `forward` reads
//! as the same numbered steps for every family and never looks at its name.
//!
//! Guarantees:
//! - Weights are read in place, in their stored dtype (BF16, F16 or F32); nothing is copied,
//!   except under [`Model::quantize`] (`--quantize q8_0`), which makes Q8_0 copies of the
//!   linear layers and the head at load, and [`Model::prepare_published`], which decodes a
//!   published quantized checkpoint (compressed-tensors, FP8, GPTQ, AWQ) into f32 weights or
//!   the integer kernels' planes: explicit, reported exceptions.
//! - Every shape is checked in [`Model::new`]; the forward pass never re-checks or branches on a
//!   format.
//! - Activations ([`Scratch`]) are planned by [`Model::plan_scratch`] from the configuration and
//!   the batch limits; the KV cache is the engine's paged [`KvPool`]; [`Model::forward`] allocates
//!   nothing.
//! - A forward pass runs a [`BatchPlan`]: segments of many sequences, each at its own positions.
//!   Linear layers run once over all tokens; norms and RoPE per token; attention per sequence
//!   over its own blocks. A token's result does not depend on the other segments (batch
//!   invariance), as long as the kernels reduce in the same order for any token count.
//! - Compute is float32 in the same order of operations as transformers' eager float32 path,
//!   except under `Precision::Bf16` ([`PrecisionChoice`]), where the inputs of the matrix
//!   products are rounded to BF16 (products and sums stay f32), as transformers computes a
//!   BF16 model's linear layers.

/// The arithmetic of the matrix products, as asked for (`--precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrecisionChoice {
    /// f32 activations: exact match with transformers' float32 references.
    #[default]
    F32,
    /// BF16 activations at every matrix product; needs BF16 weights and a BF16 kernel family,
    /// or Q8_0 weights (`--quantize q8_0`) and AVX-512 BF16 (`kylin_kernels::w16`).
    Bf16,
    /// `bf16` when the weights are BF16 and the CPU has a BF16 kernel family, else `f32`.
    Auto,
}

impl PrecisionChoice {
    /// Parses `f32`, `bf16` or `auto`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(PrecisionChoice::F32),
            "bf16" => Some(PrecisionChoice::Bf16),
            "auto" => Some(PrecisionChoice::Auto),
            _ => None,
        }
    }
}

/// A weight format the linear layers can be quantized to at load (`--quantize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// GGUF's Q8_0: blocks of 32 int8 with an f16 scale, int8 activations (`kylin_kernels::quant`).
    Q8_0,
    /// GGUF's Q4_K (super-blocks of 256 with 6-bit sub-block scales and mins; int8 activations,
    /// `kylin_kernels::q4k`), mixed as llama.cpp's Q4_K_M: see [`Model::quantize`].
    Q4K,
    /// A published quantized checkpoint (compressed-tensors, FP8, GPTQ, AWQ) repacked at load
    /// for the integer kernels ([`Model::prepare_published`]): `Q8_0` for 8-bit integers and
    /// FP8, `Q4G` for 4-bit groups. Not a `--quantize` value.
    Published(Packing),
}

impl QuantFormat {
    /// The name used by flags and reports (`q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Published(packing) => packing.name(),
        }
    }

    /// Parses `q8_0`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" => Some(QuantFormat::Q8_0),
            "q4_k" => Some(QuantFormat::Q4K),
            _ => None,
        }
    }
}

use std::sync::Arc;

use kylin_kernels::quant::{Packing, QuantBuffer, QuantMatrix};
use kylin_kernels::{self as kernels, Bf16Kernels, Precision, ThreadPool, WeightDType, WeightMatrix, WeightVector};
use kylin_loader::arch::Role;
use kylin_loader::family::{Activation, LayerRope, NormKind, QkNorm};
use kylin_loader::{DType, KylinError, LayerWeights, ModelConfig, ModelWeights, Result, RopeConfig, WeightTensor};

use crate::kv_pool::{KvPool, KvShape};
use crate::rope::Ropes;
use kylin_kernels::paged::{MAX_HEAD_DIM, MAX_ROWS, PARTITION, PartialStats, QueryRow, ScoreMap};

/// The largest number of prompt tokens run through the layers at once; longer prompts are
/// processed in chunks of this size so activation buffers stay bounded.
pub const DEFAULT_MAX_CHUNK: usize = 512;

/// Maps a stored dtype to the kernels' weight dtype; `TENSOR_DTYPE_UNSUPPORTED` for the
/// quantized ones (the loader rejects them first; this keeps the engine from panicking).
fn weight_dtype(t: &WeightTensor) -> Result<WeightDType> {
    match t.dtype {
        DType::F32 => Ok(WeightDType::F32),
        DType::F16 => Ok(WeightDType::F16),
        DType::BF16 => Ok(WeightDType::BF16),
        other => Err(KylinError::tensor_dtype_unsupported(format!(
            "tensor '{}' is stored as {}; the native engine computes on BF16, F16 or F32 weights",
            t.name,
            other.as_str()
        ))),
    }
}

fn shape_error(t: &WeightTensor, expected: &[usize]) -> KylinError {
    KylinError::tensor_shape_mismatch(format!(
        "tensor '{}' has wrong shape; expected {:?}, got {:?}",
        t.name, expected, t.shape
    ))
}

/// How one forward pass runs its matrix products: the pool, and the BF16 kernels under
/// `Precision::Bf16`.
#[derive(Clone, Copy)]
struct Matmul<'a> {
    pool: &'a ThreadPool,
    bf16: Option<Bf16Kernels>,
}

/// A vector weight (norm scale or bias) of a checked length.
#[derive(Debug, Clone)]
struct Vector {
    tensor: WeightTensor,
    dtype: WeightDType,
}

impl Vector {
    fn new(tensor: &WeightTensor, len: usize) -> Result<Self> {
        if tensor.shape != [len] {
            return Err(shape_error(tensor, &[len]));
        }
        Ok(Vector { tensor: tensor.clone(), dtype: weight_dtype(tensor)? })
    }

    fn optional(tensor: Option<&WeightTensor>, len: usize) -> Result<Option<Self>> {
        tensor.map(|t| Vector::new(t, len)).transpose()
    }

    #[inline]
    fn view(&self) -> WeightVector<'_> {
        WeightVector { dtype: self.dtype, data: self.tensor.bytes() }
    }

    /// The first element as f32 (a one-element tensor's value).
    fn scalar(&self) -> f32 {
        let mut out = [0.0f32];
        let one = WeightMatrix { dtype: self.dtype, rows: 1, cols: 1, data: self.tensor.bytes() };
        kernels::widen_row(one, 0, &mut out);
        out[0]
    }
}

/// A linear layer `y = x · Wᵀ (+ b)` with `W` stored `[rows, cols]` (`[out, in]`).
#[derive(Debug, Clone)]
struct Linear {
    weight: WeightTensor,
    dtype: WeightDType,
    rows: usize,
    cols: usize,
    bias: Option<Vector>,
    /// The quantized planes the products read instead of a float `weight`.
    quant: Option<QuantSource>,
}

/// Where a quantized linear layer's planes live.
#[derive(Debug, Clone)]
enum QuantSource {
    /// Made at load ([`Model::quantize`]).
    Owned(Arc<QuantBuffer>),
    /// Read in place from a checkpoint written by `kylin quantize`: `weight` (the `Linear`'s
    /// own tensor) holds the quants, `scales` the scales. Checked against the shape when bound.
    Mapped { scales: WeightTensor, packing: Packing },
    /// A published quantized matrix not yet decoded: [`Model::prepare_published`] replaces it
    /// by f32 weights or by packed planes before any product runs.
    Pending(Arc<kylin_loader::published::PublishedMatrix>),
}

impl Linear {
    fn new(weight: &WeightTensor, bias: Option<&WeightTensor>, rows: usize, cols: usize) -> Result<Self> {
        if weight.shape != [rows, cols] {
            return Err(shape_error(weight, &[rows, cols]));
        }
        Ok(Linear {
            weight: weight.clone(),
            dtype: weight_dtype(weight)?,
            rows,
            cols,
            bias: Vector::optional(bias, rows)?,
            quant: None,
        })
    }

    /// A linear layer stored quantized (`kylin quantize`): `quants` and `scales` are the planes
    /// (Q8_0 when the scales are F16, Q4_K when they are U8), checked against `[rows, cols]`
    /// (`TENSOR_SHAPE_MISMATCH` naming the tensors otherwise).
    fn stored_quant(
        quants: &WeightTensor,
        scales: &WeightTensor,
        bias: Option<&WeightTensor>,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let packing = if scales.dtype == DType::U8 { Packing::Q4K } else { Packing::Q8_0 };
        if QuantMatrix::new(packing, rows, cols, quants.bytes(), scales.bytes()).is_none() {
            return Err(KylinError::tensor_shape_mismatch(format!(
                "tensors '{}' ({} bytes) and '{}' ({} bytes) are not the {} planes of a [{rows}, {cols}] matrix",
                quants.name,
                quants.byte_len(),
                scales.name,
                scales.byte_len(),
                packing.name()
            )));
        }
        Ok(Linear {
            weight: quants.clone(),
            // Not read: the products use the planes.
            dtype: WeightDType::F32,
            rows,
            cols,
            bias: Vector::optional(bias, rows)?,
            quant: Some(QuantSource::Mapped { scales: scales.clone(), packing }),
        })
    }

    /// A float linear layer; a stored-quantized one when `weights.scales` has its weight's
    /// plane; a pending published one when `weight` is the values of one of
    /// `weights.published` (the loader checked its tensors against `[rows, cols]`).
    fn bind(
        weight: &WeightTensor,
        bias: Option<&WeightTensor>,
        rows: usize,
        cols: usize,
        weights: &ModelWeights,
    ) -> Result<Self> {
        if let Some(scale) = weights.scales.get(&weight.name) {
            return Linear::stored_quant(weight, scale, bias, rows, cols);
        }
        let Some(published) = weights.published_matrix(weight) else {
            return Linear::new(weight, bias, rows, cols);
        };
        if (published.rows, published.cols) != (rows, cols) {
            return Err(KylinError::tensor_shape_mismatch(format!(
                "module '{}' is a [{}, {}] matrix; the configuration implies [{rows}, {cols}]",
                published.module, published.rows, published.cols
            )));
        }
        Ok(Linear {
            weight: weight.clone(),
            // Not read: `Model::prepare_published` replaces the weight or adds planes.
            dtype: WeightDType::F32,
            rows,
            cols,
            bias: Vector::optional(bias, rows)?,
            quant: Some(QuantSource::Pending(Arc::new(published.clone()))),
        })
    }

    /// The quantized planes, if quantized.
    #[inline]
    fn quant_matrix(&self) -> Option<QuantMatrix<'_>> {
        match self.quant.as_ref()? {
            // The buffer was made for exactly these rows and columns (`Model::quantize`).
            QuantSource::Owned(buffer) => Some(buffer.matrix()),
            // Checked in `stored_quant`; a mismatch here would be a bug, and falls back to None.
            QuantSource::Mapped { scales, packing } => {
                QuantMatrix::new(*packing, self.rows, self.cols, self.weight.bytes(), scales.bytes())
            }
            // Decoded before any product runs (`Model::plan_scratch` refuses to plan otherwise).
            QuantSource::Pending(_) => None,
        }
    }

    #[inline]
    fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix { dtype: self.dtype, rows: self.rows, cols: self.cols, data: self.weight.bytes() }
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows) (+ b)`: int8 activations over the
    /// quantized planes when quantized, else BF16 inputs when `bf16` names the kernels, else f32 (`p`
    /// receives the quantized or rounded `x`).
    #[inline]
    fn forward(&self, mm: Matmul<'_>, x: &[f32], n: usize, y: &mut [f32], p: &mut ProductScratch) {
        self.product(mm, x, n, y, p);
        self.add_bias(y);
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows)`, without the bias.
    #[inline]
    fn product(&self, mm: Matmul<'_>, x: &[f32], n: usize, y: &mut [f32], p: &mut ProductScratch) {
        match (self.quant_matrix(), mm.bf16) {
            (Some(q), _) => q.matmul(mm.pool, x, n, &mut p.xq, y),
            (None, Some(k)) => kernels::matmul_many_bf16(mm.pool, k, x, n, &mut p.xb, &mut [(self.matrix(), y)]),
            (None, None) => kernels::matmul(mm.pool, self.matrix(), x, n, y),
        }
    }

    /// `y (n, rows) += b` on every row, when the layer has a bias.
    #[inline]
    fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.rows) {
                kernels::add_bias(row, bias.view());
            }
        }
    }

    /// Several linear layers over the same input in one pool job:
    /// `y_i (n, rows_i) = x (n, cols) · W_iᵀ (cols, rows_i) (+ b_i)`.
    #[inline]
    fn forward_many<const N: usize>(
        mm: Matmul<'_>,
        x: &[f32],
        n: usize,
        mut layers: [(&Linear, &mut [f32]); N],
        p: &mut ProductScratch,
    ) {
        // A layer's linears are usually all quantized or none (`Model::quantize`), not always
        // to one format (`QuantFormat::Q4K` keeps some at Q8_0): one fused product either way,
        // with the input quantized once per format. A published checkpoint's `--precision f32`
        // can leave some quantized and others not: one product each then.
        let linears: [&Linear; N] = layers.each_ref().map(|(l, _)| *l);
        let planes = linears.map(Linear::quant_matrix);
        let quantized = planes.iter().filter(|q| q.is_some()).count();
        if quantized == N {
            let mut planes = planes.into_iter().flatten();
            let mut mats = layers.each_mut().map(|(_, y)| (planes.next().expect("counted above"), &mut **y));
            kernels::quant::matmul_many_quant(mm.pool, x, n, &mut p.xq, &mut mats);
        } else if quantized == 0 {
            let mut mats: [(WeightMatrix<'_>, &mut [f32]); N] = layers.each_mut().map(|(l, y)| (l.matrix(), &mut **y));
            match mm.bf16 {
                Some(k) => kernels::matmul_many_bf16(mm.pool, k, x, n, &mut p.xb, &mut mats),
                None => kernels::matmul_many(mm.pool, x, n, &mut mats),
            }
        } else {
            for (l, y) in layers.iter_mut() {
                l.product(mm, x, n, y, p);
            }
        }
        for (l, y) in layers.iter_mut() {
            l.add_bias(y);
        }
    }

    fn element_count(&self) -> u64 {
        (self.rows * self.cols) as u64 + self.bias.as_ref().map_or(0, |b| b.tensor.element_count() as u64)
    }

    /// Bytes the products read: the quantized planes when quantized, else the stored weight.
    fn byte_len(&self) -> u64 {
        let weight = self.quant_matrix().map_or(self.weight.byte_len(), |q| q.byte_len());
        weight as u64 + self.bias.as_ref().map_or(0, |b| b.tensor.byte_len() as u64)
    }
}

/// What [`Model::prepare_published`] decodes a published matrix into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PublishedDecode {
    /// f32 weights, exactly `scale · (q − zero)`.
    F32,
    /// BF16 weights (the f32 values rounded to nearest even), for the BF16 kernels.
    Bf16,
    /// The integer kernels' planes.
    Integer,
}

/// Decodes one pending published matrix in place (see [`Model::prepare_published`]); returns
/// the packing chosen. A float linear (a module the checkpoint left unquantized) becomes Q8_0
/// for the integer kernels and stays as stored otherwise.
fn decode_published(linear: &mut Linear, mode: PublishedDecode) -> Result<Option<Packing>> {
    use kylin_kernels::quant::QK8_0;
    let Some(QuantSource::Pending(m)) = &linear.quant else {
        if linear.quant.is_some() || mode == PublishedDecode::F32 {
            return Ok(None);
        }
        if mode == PublishedDecode::Bf16 {
            // A module left unquantized in F16 or F32 (GPTQ checkpoints are F16): rounded to
            // BF16 so every product runs on the BF16 kernels.
            if linear.dtype != WeightDType::BF16 {
                let w = linear.matrix();
                let mut row = vec![0.0f32; linear.cols];
                let mut values = Vec::with_capacity(linear.rows * linear.cols);
                for r in 0..linear.rows {
                    kernels::widen_row(w, r, &mut row);
                    values.extend_from_slice(&row);
                }
                let name = linear.weight.name.clone();
                linear.weight = owned_weights(name, DType::BF16, linear.rows, linear.cols, &values)?;
                linear.dtype = WeightDType::BF16;
            }
            return Ok(None);
        }
        let buffer = quantize_q8_0(linear.matrix(), &linear.weight.name)?;
        // A tied head's pages are the embedding's: a lookup faults back only the rows it reads.
        linear.weight.advise_dont_need();
        linear.quant = Some(QuantSource::Owned(Arc::new(buffer)));
        return Ok(None);
    };
    let m = Arc::clone(m);
    let (rows, cols) = (m.rows, m.cols);
    let float_dtype = match mode {
        PublishedDecode::F32 => Some((DType::F32, WeightDType::F32)),
        PublishedDecode::Bf16 => Some((DType::BF16, WeightDType::BF16)),
        PublishedDecode::Integer => None,
    };
    if let Some((dtype, kernel_dtype)) = float_dtype {
        linear.weight = owned_weights(format!("{}.weight", m.module), dtype, rows, cols, &m.dequantize()?)?;
        linear.dtype = kernel_dtype;
        linear.quant = None;
        release_published(&m);
        return Ok(None);
    }
    // 16-bit activations, as the weight-only schemes (A16) and FP8 intend, where the CPU has
    // the BF16 kernels (`kylin_kernels::w16`); int8 activations for W8A8 and elsewhere.
    let a16 = kernels::w16::available() && !m.int8_activations;
    if a16 && let Some((codes, scales)) = m.fp8_codes()? {
        let mut buffer =
            QuantBuffer::zeroed(Packing::F8A16, rows, cols).ok_or_else(|| packing_error(&m, "f8_e4m3_a16"))?;
        let (quants, planes) = buffer.planes_mut();
        kernels::w16::pack_f8(rows, cols, codes, &scales, quants, planes);
        linear.quant = Some(QuantSource::Owned(Arc::new(buffer)));
        release_published(&m);
        return Ok(Some(Packing::F8A16));
    }
    let ints = m.integers()?;
    // Groups in column order whose width is whole Q8_0 blocks (no activation order).
    let uniform =
        |i: &kylin_loader::published::IntMatrix| i.group_of.is_none() && (cols / i.groups).is_multiple_of(QK8_0);
    let buffer = match ints {
        // Symmetric 8-bit (codes stored offset by 128): the same integers, one scale per block.
        Some(i) if i.bits == 8 && uniform(&i) && i.zeros.iter().all(|&z| z == 128) && cols.is_multiple_of(QK8_0) => {
            let packing = if a16 { Packing::Q8_0A16 } else { Packing::Q8_0 };
            let mut buffer =
                QuantBuffer::zeroed(packing, rows, cols).ok_or_else(|| packing_error(&m, packing.name()))?;
            let q: Vec<i8> = i.codes.iter().map(|&c| (c as i32 - 128) as i8).collect();
            let blocks = cols / QK8_0;
            let scales: Vec<f32> =
                (0..rows * blocks).map(|k| i.scales[(k / blocks) * i.groups + i.group((k % blocks) * QK8_0)]).collect();
            let (quants, planes) = buffer.planes_mut();
            kylin_kernels::quant::pack_q8_0(rows, cols, &q, &scales, quants, planes);
            buffer
        }
        // 4-bit groups: the same codes, `w = s·q − s·z` per sub-block of 32.
        Some(i) if i.bits == 4 && uniform(&i) && cols.is_multiple_of(64) => {
            let packing = if a16 { Packing::Q4GA16 } else { Packing::Q4G };
            let mut buffer =
                QuantBuffer::zeroed(packing, rows, cols).ok_or_else(|| packing_error(&m, packing.name()))?;
            let subs = cols / 32;
            let at = |k: usize| (k / subs) * i.groups + i.group((k % subs) * 32);
            let scales: Vec<f32> = (0..rows * subs).map(|k| i.scales[at(k)]).collect();
            let mins: Vec<f32> = (0..rows * subs).map(|k| i.scales[at(k)] * i.zeros[at(k)] as f32).collect();
            let (quants, planes) = buffer.planes_mut();
            kylin_kernels::q4g::pack_q4_g(rows, cols, &i.codes, &scales, &mins, quants, planes);
            buffer
        }
        // FP8, activation order, asymmetric 8-bit: dequantized, then Q8_0 (FP8 E4M3 holds 3
        // mantissa bits; Q8_0's grid is finer).
        _ => {
            let bytes = f32_bytes(&m.dequantize()?);
            quantize_q8_0(WeightMatrix { dtype: WeightDType::F32, rows, cols, data: &bytes }, &m.module)?
        }
    };
    let packing = buffer.matrix().packing();
    linear.quant = Some(QuantSource::Owned(Arc::new(buffer)));
    release_published(&m);
    Ok(Some(packing))
}

/// Releases a decoded matrix's stored tensors from resident memory (the map stays), so the
/// peak is near the decoded size, not the sum of both.
fn release_published(m: &kylin_loader::published::PublishedMatrix) {
    for t in [Some(&m.values), Some(&m.scale), m.zero.as_ref(), m.g_idx.as_ref()].into_iter().flatten() {
        t.advise_dont_need();
    }
}

/// `values` as little-endian f32 bytes.
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// An owned `[rows, cols]` weight tensor of `values` stored as `dtype` (F32 or BF16).
fn owned_weights(name: String, dtype: DType, rows: usize, cols: usize, values: &[f32]) -> Result<WeightTensor> {
    let bytes = match dtype {
        DType::BF16 => values.iter().flat_map(|&v| kernels::round_bf16(v).to_le_bytes()).collect(),
        _ => f32_bytes(values),
    };
    WeightTensor::owned(name.clone(), dtype, vec![rows, cols], bytes).ok_or_else(|| {
        KylinError::tensor_shape_mismatch(format!("'{name}': {} values for [{rows}, {cols}]", values.len()))
    })
}

/// A whole matrix quantized to Q8_0 (load time); `OPERATOR_UNSUPPORTED` naming `name` when its
/// columns are not whole blocks of 32.
fn quantize_q8_0(w: WeightMatrix<'_>, name: &str) -> Result<QuantBuffer> {
    let (rows, cols) = (w.rows, w.cols);
    let mut buffer = QuantBuffer::zeroed(Packing::Q8_0, rows, cols).ok_or_else(|| {
        KylinError::operator_unsupported(format!(
            "'{name}' ([{rows}, {cols}]) cannot be quantized to q8_0 (columns must be whole blocks of 32); run with --precision f32"
        ))
    })?;
    let groups = rows.div_ceil(kylin_kernels::quant::GROUP_ROWS);
    let mut row = vec![0.0f32; cols];
    let (quants, planes) = buffer.planes_mut();
    QuantBuffer::quantize_groups(Packing::Q8_0, w, 0..groups, quants, planes, &mut row);
    Ok(buffer)
}

fn packing_error(m: &kylin_loader::published::PublishedMatrix, packing: &str) -> KylinError {
    KylinError::operator_unsupported(format!(
        "module '{}' ([{}, {}]) cannot be packed as {packing}: its columns must be whole blocks of 32 (64 for 4 bits); run it with --precision f32",
        m.module, m.rows, m.cols
    ))
}

/// An RMSNorm's weight and how it scales (`w` or Gemma's `1 + w`).
#[derive(Debug, Clone)]
struct Norm {
    weight: Vector,
    unit_offset: bool,
}

impl Norm {
    fn new(tensor: &WeightTensor, len: usize, kind: NormKind) -> Result<Self> {
        Ok(Norm { weight: Vector::new(tensor, len)?, unit_offset: kind == NormKind::RmsUnitOffset })
    }

    /// An RMSNorm without a weight (Gemma 4's `with_scale=False`): a weight of ones, which
    /// multiplies by exactly one.
    fn unweighted(len: usize) -> Norm {
        let bytes = 1.0f32.to_le_bytes().repeat(len);
        let tensor = WeightTensor::owned("(ones)".into(), DType::F32, vec![len], bytes)
            .expect("len f32 values make a [len] tensor");
        Norm { weight: Vector { tensor, dtype: WeightDType::F32 }, unit_offset: false }
    }

    /// `out (len) = rmsnorm(x (len))`.
    #[inline]
    fn apply(&self, x: &[f32], eps: f32, out: &mut [f32]) {
        if self.unit_offset {
            kernels::rms_norm_unit_offset(x, self.weight.view(), eps, out);
        } else {
            kernels::rms_norm(x, self.weight.view(), eps, out);
        }
    }

    /// Every row of `x (rows, width)` into `out (rows, width)`.
    #[inline]
    fn rows(&self, x: &[f32], width: usize, eps: f32, out: &mut [f32]) {
        for (x, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
            self.apply(x, eps, out);
        }
    }
}

/// Gemma 4's per-layer input block of one layer: after the MLP,
/// `x += post_norm(projection(gelu_tanh(gate(x)) · p))` with `p` the layer's input.
#[derive(Debug, Clone)]
struct PerLayerBlock {
    /// `[width, hidden]`.
    gate: Linear,
    /// `[hidden, width]`.
    projection: Linear,
    post_norm: Norm,
}

/// Gemma 4's per-layer inputs: for each token, `layers · width` values computed before the
/// layers from a second embedding and a projection of the first.
#[derive(Debug, Clone)]
struct PerLayerInputs {
    /// `embed_tokens_per_layer`, `[vocab, layers · width]`, rows widened on lookup.
    embed: Linear,
    /// `per_layer_model_projection`, `[layers · width, hidden]`.
    projection: Linear,
    /// `per_layer_projection_norm`, `[width]`.
    norm: Norm,
    width: usize,
    /// Rows of `embed`: ids at or past it take the padding row 0's values.
    vocab: usize,
    /// `√width` (the second embedding's scale), `hidden^-0.5` (the projection's) and `2^-0.5`
    /// (the sum's), as the f32 numbers transformers multiplies by.
    embed_scale: f32,
    projection_scale: f32,
    sum_scale: f32,
}

impl PerLayerInputs {
    fn new(weights: &ModelWeights, width: usize, vocab: usize, d: &Dims, kind: NormKind) -> Result<Self> {
        let global = |role: Role| {
            weights.globals.get(&role).ok_or_else(|| {
                KylinError::tensor_missing(format!("the per-layer inputs need the model's {role:?} tensor"))
            })
        };
        let all = d.n_layers * width;
        Ok(PerLayerInputs {
            embed: Linear::new(global(Role::EmbedPerLayer)?, None, vocab, all)?,
            projection: Linear::bind(global(Role::PerLayerModelProjection)?, None, all, d.hidden, weights)?,
            norm: Norm::new(global(Role::PerLayerProjectionNorm)?, width, kind)?,
            width,
            vocab,
            embed_scale: (width as f64).sqrt() as f32,
            projection_scale: (d.hidden as f64).powf(-0.5) as f32,
            sum_scale: 2f64.powf(-0.5) as f32,
        })
    }

    /// Every token's inputs for every layer: `e (n, hidden)` (the scaled embedding) ->
    /// `out (n, layers · width)`, each `(width)` chunk
    /// `(rmsnorm(projection(e) · hidden^-0.5) + embed_per_layer(id) · √width) · 2^-0.5`;
    /// `row (layers · width)` is scratch.
    fn compute(
        &self,
        mm: Matmul<'_>,
        ids: &[u32],
        e: &[f32],
        out: &mut [f32],
        row: &mut [f32],
        eps: f32,
        p: &mut ProductScratch,
    ) {
        let n = ids.len();
        let all = self.embed.cols;
        let w = self.width;
        // (n, hidden) -> (n, layers · width).
        self.projection.forward(mm, e, n, &mut out[..n * all], p);
        let embed = self.embed.matrix();
        for (&id, projected) in ids.iter().zip(out.chunks_exact_mut(all)) {
            kernels::scale(projected, self.projection_scale);
            // Each layer's chunk normalised in place (through `row` as the input copy).
            row.copy_from_slice(projected);
            for (x, y) in row.chunks_exact(w).zip(projected.chunks_exact_mut(w)) {
                self.norm.apply(x, eps, y);
            }
            let id = if (id as usize) < self.vocab { id as usize } else { 0 };
            kernels::widen_row(embed, id, row);
            kernels::scale(row, self.embed_scale);
            kernels::add_assign(projected, row);
            kernels::scale(projected, self.sum_scale);
        }
    }
}

/// One decoder layer with the family's choices already made (`DecoderSpec`): which norms
/// exist around each sub-block, the q/k/v norms, its sizes, the window, the rotary table and
/// where its keys and values live.
#[derive(Debug, Clone)]
struct Layer {
    /// Before attention (absent in OLMo 2).
    attn_norm: Option<Norm>,
    q_proj: Linear,
    /// Absent on a layer that reuses an earlier layer's keys and values (Gemma 4).
    k_proj: Option<Linear>,
    /// Absent as well when the values are the key projection's output (`attention_k_eq_v`).
    v_proj: Option<Linear>,
    o_proj: Linear,
    /// On q and k before RoPE: per head `(head_dim)` (Qwen3, Gemma 3) or over the whole
    /// projection (OLMo 2), as `Model::qk_norm` says.
    q_norm: Option<Norm>,
    k_norm: Option<Norm>,
    /// On each value head, without a weight (Gemma 4).
    v_norm: Option<Norm>,
    /// After attention, before the residual add (Gemma, OLMo 2).
    attn_post_norm: Option<Norm>,
    /// Before the MLP (absent in OLMo 2).
    mlp_norm: Option<Norm>,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    /// After the MLP, before the residual add (Gemma, OLMo 2).
    mlp_post_norm: Option<Norm>,
    /// Gemma 4's per-layer input block.
    per_layer: Option<PerLayerBlock>,
    /// The layer's output is multiplied by this (Gemma 4's `layer_scalar`).
    scalar: Option<f32>,
    head_dim: usize,
    n_kv_heads: usize,
    intermediate: usize,
    /// A sliding window of this many positions, the query's own included.
    window: Option<usize>,
    /// Where the layer's keys and values live: its index among the layers of its KV pool,
    /// and whether that is the sliding layers' pool ([`KvGroups`]). A layer that reuses an
    /// earlier layer's keys and values has that layer's place.
    kv_slot: usize,
    in_sliding_pool: bool,
    /// Index of the layer's table in [`Ropes`], or no RoPE.
    rope: Option<usize>,
}

impl Layer {
    /// `weights` holds the scale planes of a checkpoint stored quantized and the tensors of a
    /// published quantized one (both empty otherwise). Every shape is checked here. `rope`
    /// is the index of the layer's rotary table, when it has one.
    fn new(
        w: &LayerWeights,
        index: usize,
        d: &Dims,
        config: &ModelConfig,
        rope: Option<usize>,
        weights: &ModelWeights,
    ) -> Result<Self> {
        let spec = &config.decoder;
        let layer_spec =
            spec.layers.get(index).copied().ok_or_else(|| {
                KylinError::config_invalid(format!("internal: the decoder plan has no layer {index}"))
            })?;
        let (head_dim, n_kv_heads, intermediate) =
            (layer_spec.head_dim, layer_spec.num_kv_heads, layer_spec.intermediate);
        if head_dim == 0 || head_dim > MAX_HEAD_DIM {
            return Err(KylinError::operator_unsupported(format!(
                "layer {index}'s head_dim {head_dim} is outside the attention kernels' range 1..={MAX_HEAD_DIM}"
            )));
        }
        if n_kv_heads == 0 || !d.n_heads.is_multiple_of(n_kv_heads) {
            return Err(KylinError::config_invalid(format!(
                "layer {index}: num_attention_heads ({}) must be a non-zero multiple of its key-value heads ({n_kv_heads})",
                d.n_heads
            )));
        }
        let hidden = d.hidden;
        let (q_dim, kv_dim) = (d.n_heads * head_dim, n_kv_heads * head_dim);
        let linear = |weight: Role, bias: Role, rows: usize, cols: usize| -> Result<Linear> {
            Linear::bind(w.require(weight, index)?, w.get(bias), rows, cols, weights)
        };
        let norm = |role: Role, len: usize| -> Result<Norm> { Norm::new(w.require(role, index)?, len, spec.norm) };
        let optional_norm =
            |wanted: bool, role: Role| -> Result<Option<Norm>> { wanted.then(|| norm(role, hidden)).transpose() };
        let (q_norm_len, k_norm_len) = match spec.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::PerHead => (head_dim, head_dim),
            QkNorm::Projection => (q_dim, kv_dim),
        };
        let own_kv = layer_spec.has_kv_projections();
        let per_layer = match spec.per_layer_input {
            Some(p) => Some(PerLayerBlock {
                gate: Linear::bind(w.require(Role::PerLayerGate, index)?, None, p.width, hidden, weights)?,
                projection: Linear::bind(w.require(Role::PerLayerProjection, index)?, None, hidden, p.width, weights)?,
                post_norm: norm(Role::PostPerLayerNorm, hidden)?,
            }),
            None => None,
        };
        let scalar =
            if spec.layer_scalar { Some(Vector::new(w.require(Role::LayerScalar, index)?, 1)?.scalar()) } else { None };
        Ok(Layer {
            attn_norm: optional_norm(spec.attention_norms.pre(), Role::AttnNorm)?,
            q_proj: linear(Role::QProj, Role::QBias, q_dim, hidden)?,
            k_proj: own_kv.then(|| linear(Role::KProj, Role::KBias, kv_dim, hidden)).transpose()?,
            v_proj: layer_spec
                .has_value_projection()
                .then(|| linear(Role::VProj, Role::VBias, kv_dim, hidden))
                .transpose()?,
            o_proj: linear(Role::OProj, Role::OBias, hidden, q_dim)?,
            q_norm: (spec.qk_norm != QkNorm::None).then(|| norm(Role::QNorm, q_norm_len)).transpose()?,
            k_norm: (spec.qk_norm != QkNorm::None && own_kv).then(|| norm(Role::KNorm, k_norm_len)).transpose()?,
            v_norm: (spec.value_norm && own_kv).then(|| Norm::unweighted(head_dim)),
            attn_post_norm: optional_norm(spec.attention_norms.post(), Role::PostAttnNorm)?,
            mlp_norm: optional_norm(spec.mlp_norms.pre(), Role::MlpNorm)?,
            gate_proj: linear(Role::GateProj, Role::GateBias, intermediate, hidden)?,
            up_proj: linear(Role::UpProj, Role::UpBias, intermediate, hidden)?,
            down_proj: linear(Role::DownProj, Role::DownBias, hidden, intermediate)?,
            mlp_post_norm: optional_norm(spec.mlp_norms.post(), Role::PostMlpNorm)?,
            per_layer,
            scalar,
            head_dim,
            n_kv_heads,
            intermediate,
            window: layer_spec.window,
            kv_slot: index,
            in_sliding_pool: false,
            rope,
        })
    }

    /// The matrices of the layer's attention and MLP with their roles, in the order q, k, v, o,
    /// gate, up, down (k and v where the layer has them).
    fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        [
            (Role::QProj, Some(&self.q_proj)),
            (Role::KProj, self.k_proj.as_ref()),
            (Role::VProj, self.v_proj.as_ref()),
            (Role::OProj, Some(&self.o_proj)),
            (Role::GateProj, Some(&self.gate_proj)),
            (Role::UpProj, Some(&self.up_proj)),
            (Role::DownProj, Some(&self.down_proj)),
        ]
        .into_iter()
        .filter_map(|(role, m)| m.map(|m| (role, m)))
    }

    fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        [
            Some(&mut self.q_proj),
            self.k_proj.as_mut(),
            self.v_proj.as_mut(),
            Some(&mut self.o_proj),
            Some(&mut self.gate_proj),
            Some(&mut self.up_proj),
            Some(&mut self.down_proj),
        ]
        .into_iter()
        .flatten()
    }

    /// The per-layer input block's two matrices (Gemma 4), which stay as stored under
    /// `--quantize`.
    fn side_linears(&self) -> impl Iterator<Item = &Linear> {
        self.per_layer.iter().flat_map(|p| [&p.gate, &p.projection])
    }

    fn vectors(&self) -> impl Iterator<Item = &Vector> {
        [&self.attn_norm, &self.mlp_norm, &self.q_norm, &self.k_norm, &self.attn_post_norm, &self.mlp_post_norm]
            .into_iter()
            .flatten()
            .map(|n| &n.weight)
            .chain(self.per_layer.iter().map(|p| &p.post_norm.weight))
    }

    /// Keys and values this layer keeps per position.
    fn kv_shape(&self) -> KvShape {
        KvShape { n_kv_heads: self.n_kv_heads, head_dim: self.head_dim }
    }
}

/// "No block": an entry of a sliding table below the window, released (never read).
pub const NO_BLOCK: u32 = u32::MAX;

/// How a model's keys and values are split between two KV pools: the full-attention layers
/// keep every position (paged, prefix-cached); the sliding layers, when they share one window,
/// keep only the positions their window still reaches, in a pool of their own, so a long
/// context costs the full layers' memory plus a bounded window.
///
/// Only layers that compute their own keys and values hold a place; a layer reusing an
/// earlier layer's (Gemma 4) reads that layer's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// The full pool's layers in slot order, with their heads and widths.
    pub full: Vec<KvShape>,
    /// The sliding pool's (empty: every layer is in the full pool).
    pub sliding: Vec<KvShape>,
    /// Their window, when there is a sliding pool.
    pub window: Option<usize>,
}

/// The model's dimensions, from the resolved configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// RMSNorm epsilon as float32 (transformers adds it to a float32 variance).
    pub eps: f32,
    /// `head_dim ** -0.5`, the attention score scale.
    pub attn_scale: f32,
}

impl Dims {
    /// `num_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// One sequence's part of a batch: `n` consecutive tokens starting at position `start` of
/// the sequence, whose earlier positions are in the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index of the segment's first token in [`BatchPlan::ids`].
    pub t0: usize,
    pub n: usize,
    /// Position of the first token in its sequence.
    pub start: usize,
    /// The sequence's block table is `block_ids[b0..b0 + nb]` of the plan; it covers every
    /// position up to `start + n`.
    pub b0: usize,
    pub nb: usize,
    /// Its table in the sliding layers' pool (when they have one) is
    /// `sliding_block_ids[sb0..sb0 + snb]`: entries below the window of position `start` may
    /// be released ([`NO_BLOCK`]) and are never read.
    pub sb0: usize,
    pub snb: usize,
    /// Row of the logits buffer that receives the segment's last token's logits, if wanted.
    /// Rows are numbered `0..` in segment order.
    pub logits_row: Option<usize>,
}

/// What one forward pass computes: the tokens of every segment, back to back.
/// Built anew each step into the same buffers (their capacity is planned; nothing reallocates).
#[derive(Debug, Default)]
pub struct BatchPlan {
    pub ids: Vec<u32>,
    pub segments: Vec<Segment>,
    pub block_ids: Vec<u32>,
    pub sliding_block_ids: Vec<u32>,
    /// Segments whose logits are wanted.
    pub logit_rows: usize,
}

impl BatchPlan {
    /// Empty buffers with room for `max_tokens` tokens, `max_segments` segments and
    /// `max_blocks` block ids.
    pub fn with_capacity(max_tokens: usize, max_segments: usize, max_blocks: usize) -> Self {
        BatchPlan {
            ids: Vec::with_capacity(max_tokens),
            segments: Vec::with_capacity(max_segments),
            block_ids: Vec::with_capacity(max_blocks),
            sliding_block_ids: Vec::with_capacity(max_blocks),
            logit_rows: 0,
        }
    }

    pub fn clear(&mut self) {
        self.ids.clear();
        self.segments.clear();
        self.block_ids.clear();
        self.sliding_block_ids.clear();
        self.logit_rows = 0;
    }

    /// Adds a segment of `ids` at position `start` of a sequence with block table `blocks`
    /// (and `sliding` in the sliding layers' pool, empty without one); returns its logits row
    /// when `logits` is asked for.
    pub fn push(&mut self, ids: &[u32], start: usize, blocks: &[u32], sliding: &[u32], logits: bool) -> Option<usize> {
        let logits_row = logits.then(|| {
            self.logit_rows += 1;
            self.logit_rows - 1
        });
        self.segments.push(Segment {
            t0: self.ids.len(),
            n: ids.len(),
            start,
            b0: self.block_ids.len(),
            nb: blocks.len(),
            sb0: self.sliding_block_ids.len(),
            snb: sliding.len(),
            logits_row,
        });
        self.ids.extend_from_slice(ids);
        self.block_ids.extend_from_slice(blocks);
        self.sliding_block_ids.extend_from_slice(sliding);
        logits_row
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }
}

/// Activation buffers for up to `max_tokens` tokens and `max_segments` segments per forward
/// pass over sequences of up to `context` positions.
#[derive(Debug)]
pub struct Scratch {
    max_tokens: usize,
    max_segments: usize,
    /// Residual stream, `(max_tokens, hidden)`.
    x: Vec<f32>,
    /// Normalised input of a block, `(max_tokens, hidden)`.
    xn: Vec<f32>,
    /// Queries, `(max_tokens, n_heads * head_dim)`.
    q: Vec<f32>,
    /// Keys and values of the batch, `(max_tokens, n_kv_heads * head_dim)`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention output, `(max_tokens, n_heads * head_dim)`.
    attn: Vec<f32>,
    /// Block output before the residual add, `(max_tokens, hidden)`.
    proj: Vec<f32>,
    /// MLP gate and up projections, `(max_tokens, intermediate)`.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// First attention task of each segment, and the total, `(max_segments + 1)`.
    attention_tasks: Vec<usize>,
    /// Split-K decode: at most this many segments of a step are split, each over at most
    /// `split_parts` partitions.
    split_segments: usize,
    split_parts: usize,
    /// Their undivided outputs, `(split_segments, n_heads, split_parts, head_dim)`, and states,
    /// `(split_segments, n_heads, split_parts)`.
    split_outputs: Vec<f32>,
    split_stats: Vec<PartialStats>,
    /// One head (or, for a norm over the whole projection, one token's queries) for the
    /// in-place q/k norm, `(max(head_dim, n_heads * head_dim))`.
    head_tmp: Vec<f32>,
    /// Final-normed last rows of the segments that want logits, `(max_segments, hidden)`.
    logit_hidden: Vec<f32>,
    /// Their logits, `(max_segments, vocab)`.
    logits: Vec<f32>,
    /// Gemma 4's per-layer inputs, `(max_tokens, layers · width)`, one token's row of the
    /// second embedding, `(layers · width)`, and a layer's gate, `(max_tokens, width)` (empty
    /// for other families).
    ple: Vec<f32>,
    ple_row: Vec<f32>,
    ple_gate: Vec<f32>,
    /// The quantized or rounded activations of one matrix product.
    products: ProductScratch,
}

/// The activations of one matrix product in the form its kernels read.
#[derive(Debug, Default)]
pub struct ProductScratch {
    /// BF16 activations (`Precision::Bf16` only; else empty).
    xb: Vec<u16>,
    /// Int8 activations with their block scales (quantized models only; else empty).
    xq: Vec<u8>,
}

impl Scratch {
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Bytes of all buffers.
    pub fn bytes(&self) -> u64 {
        let elements = self.x.len()
            + self.xn.len()
            + self.q.len()
            + self.k.len()
            + self.v.len()
            + self.attn.len()
            + self.proj.len()
            + self.gate.len()
            + self.up.len()
            + self.head_tmp.len()
            + self.logit_hidden.len()
            + self.logits.len()
            + self.ple.len()
            + self.ple_row.len()
            + self.ple_gate.len()
            + self.split_outputs.len()
            + 2 * self.split_stats.len();
        (elements * std::mem::size_of::<f32>()
            + self.products.xb.len() * std::mem::size_of::<u16>()
            + self.products.xq.len()) as u64
    }

    /// Touches every buffer now, so their memory is resident from the start.
    pub fn prefault(&mut self) {
        for buffer in [
            &mut self.x,
            &mut self.xn,
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.attn,
            &mut self.proj,
            &mut self.gate,
            &mut self.up,
            &mut self.logit_hidden,
            &mut self.logits,
            &mut self.ple,
            &mut self.ple_gate,
            &mut self.split_outputs,
        ] {
            for page in buffer.chunks_mut(1024) {
                // A volatile write, so the compiler cannot drop it as a store of zero into
                // memory it knows to be zeroed.
                // SAFETY: `page` is a non-empty slice, so its first element is valid for writes.
                unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0.0) };
            }
        }
        for page in self.products.xb.chunks_mut(2048) {
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
        for page in self.products.xq.chunks_mut(4096) {
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
    }

    /// Logits row `row` of the last forward pass, `(vocab)`.
    pub fn logits(&self, row: usize, vocab: usize) -> &[f32] {
        &self.logits[row * vocab..(row + 1) * vocab]
    }
}

/// A `*mut f32` buffer that pool tasks write disjoint parts of.
#[derive(Clone, Copy)]
struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: a `SharedMut` is only built from a `&mut [T]` that outlives the pool run using it,
// and every task only forms slices that no other task forms (see `slice`).
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above; shared access only hands out disjoint sub-slices.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    fn new(buffer: &mut [T]) -> Self {
        SharedMut { ptr: buffer.as_mut_ptr(), len: buffer.len() }
    }

    /// `len` elements from `start`.
    ///
    /// # Safety
    /// No two slices obtained from the same buffer may be alive at the same time and overlap,
    /// and the buffer must outlive them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start <= self.len && len <= self.len - start, "SharedMut slice out of bounds");
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// Most segments of one step whose decode attention is split across threads by partition
/// (split-K is only wanted when a step has few attention tasks, so few segments).
const SPLIT_SEGMENTS: usize = 8;

/// The transformer: weights bound by role, with the architecture's choices made.
#[derive(Debug, Clone)]
pub struct Model {
    dims: Dims,
    /// The rotary tables the layers use, each with the head width it is built for: the
    /// global one first, then Gemma 3's local one, then tables for other head widths
    /// (Gemma 4's global layers).
    rope_configs: Vec<(RopeConfig, usize)>,
    max_position_embeddings: usize,
    /// `[vocab, hidden]`, rows widened to f32 on lookup.
    embed: Linear,
    /// Gemma 4's per-layer inputs, computed once per token before the layers.
    per_layer_inputs: Option<PerLayerInputs>,
    layers: Vec<Layer>,
    final_norm: Norm,
    /// `[vocab, hidden]`; the embedding's bytes when tied.
    lm_head: Linear,
    tied: bool,
    /// The family's constants (`DecoderSpec`), as f32 where they multiply activations.
    activation: Activation,
    qk_norm: QkNorm,
    /// Multiplies the embedding rows (Gemma, Granite); `None` for 1.
    embedding_scale: Option<f32>,
    /// Multiplies each sub-block's output before the residual add (Granite); 1 adds plainly.
    residual_scale: f32,
    /// `cap · tanh(s / cap)` on attention scores (Gemma 2).
    attention_softcap: Option<f32>,
    /// Logits are divided by this (Granite), then soft-capped (Gemma 2).
    logits_divisor: Option<f32>,
    final_softcap: Option<f32>,
    /// The BF16 kernels when the matrix products run in `Precision::Bf16`.
    bf16: Option<Bf16Kernels>,
    /// The format the linear layers and the head were quantized to at load, if any.
    quantization: Option<QuantFormat>,
    /// Quantized weights with BF16 activations (`--quantize q8_0 --precision bf16`: every
    /// Q8_0 matrix read as `q8_0_a16`).
    quantized_bf16: bool,
}

impl Model {
    /// Binds the weights, checking every shape and dtype against the configuration.
    pub fn new(config: &ModelConfig, weights: &ModelWeights) -> Result<Self> {
        if config.num_heads == 0 || config.num_kv_heads == 0 || !config.num_heads.is_multiple_of(config.num_kv_heads) {
            return Err(KylinError::config_invalid(format!(
                "num_attention_heads ({}) must be a non-zero multiple of num_key_value_heads ({})",
                config.num_heads, config.num_kv_heads
            )));
        }
        if config.head_dim == 0 || config.head_dim > MAX_HEAD_DIM {
            return Err(KylinError::operator_unsupported(format!(
                "head_dim {} is outside the attention kernels' range 1..={MAX_HEAD_DIM}",
                config.head_dim
            )));
        }
        if weights.layers.len() != config.num_layers || config.decoder.layers.len() != config.num_layers {
            return Err(KylinError::config_invalid(format!(
                "num_hidden_layers is {} but {} layers were bound",
                config.num_layers,
                weights.layers.len()
            )));
        }
        let spec = &config.decoder;
        // The buffers are sized by the widest layer (Gemma 4's global layers are wider).
        let widest = |f: fn(&kylin_loader::family::LayerSpec) -> usize, global: usize| {
            spec.layers.iter().map(f).max().unwrap_or(global).max(global)
        };
        let dims = Dims {
            hidden: config.hidden_size,
            n_layers: config.num_layers,
            n_heads: config.num_heads,
            n_kv_heads: widest(|l| l.num_kv_heads, config.num_kv_heads),
            head_dim: widest(|l| l.head_dim, config.head_dim),
            intermediate: widest(|l| l.intermediate, config.intermediate_size),
            vocab: config.vocab_size,
            eps: config.rms_norm_eps as f32,
            attn_scale: spec.attention_scale as f32,
        };
        // Table 0 is the global RoPE; table 1 the local one when the family has it; then one
        // per other head width a layer needs.
        let mut rope_configs = vec![(config.rope.clone(), config.head_dim)];
        if let Some(local) = &spec.local_rope {
            rope_configs.push((local.clone(), config.head_dim));
        }
        let mut layers = Vec::with_capacity(config.num_layers);
        for (i, w) in weights.layers.iter().enumerate() {
            let l = &spec.layers[i];
            let rope = match l.rope {
                LayerRope::None => None,
                LayerRope::Global => Some(config.rope.clone()),
                LayerRope::Local => spec.local_rope.clone(),
            };
            let table = rope.map(|r| {
                let key = (r, l.head_dim);
                match rope_configs.iter().position(|c| *c == key) {
                    Some(t) => t,
                    None => {
                        rope_configs.push(key);
                        rope_configs.len() - 1
                    }
                }
            });
            layers.push(Layer::new(w, i, &dims, config, table, weights)?);
        }
        // The sliding layers get a KV pool of their own when they share one window: it holds
        // only the positions their windows still reach (`KvGroups`). A layer that reuses an
        // earlier layer's keys and values reads that layer's place and takes none of its own.
        let mut windows = layers.iter().filter_map(|l| l.window);
        let split = windows.next().is_some_and(|w| windows.all(|x| x == w));
        let (mut full, mut sliding) = (0, 0);
        for i in 0..layers.len() {
            if let Some(source) = spec.layers[i].kv_source {
                let (slot, in_sliding) = (layers[source].kv_slot, layers[source].in_sliding_pool);
                if layers[source].kv_shape() != layers[i].kv_shape() || layers[source].window != layers[i].window {
                    return Err(KylinError::config_invalid(format!(
                        "layer {i} reuses the keys and values of layer {source}, whose heads or window differ"
                    )));
                }
                layers[i].kv_slot = slot;
                layers[i].in_sliding_pool = in_sliding;
                continue;
            }
            let in_sliding = split && layers[i].window.is_some();
            let counter = if in_sliding { &mut sliding } else { &mut full };
            layers[i].kv_slot = *counter;
            layers[i].in_sliding_pool = in_sliding;
            *counter += 1;
        }
        let per_layer_inputs = match spec.per_layer_input {
            Some(p) => Some(PerLayerInputs::new(weights, p.width, p.vocab, &dims, spec.norm)?),
            None => None,
        };
        let lm_head = Linear::bind(&weights.lm_head, None, dims.vocab, dims.hidden, weights)?;
        let quantization = match config.quantization {
            None => None,
            Some(stored) => {
                let format = match stored {
                    kylin_loader::StoredQuantization::KylinQ8_0 => QuantFormat::Q8_0,
                    kylin_loader::StoredQuantization::KylinQ4K => QuantFormat::Q4K,
                };
                if lm_head.quant.is_none() {
                    return Err(KylinError::operator_unsupported(format!(
                        "a checkpoint stored in {} must store its head quantized (lm_head.weight and lm_head.weight_scale, tie_word_embeddings false), as kylin quantize writes it",
                        format.name()
                    )));
                }
                Some(format)
            }
        };
        let not_one = |v: f64| (v != 1.0).then_some(v as f32);
        Ok(Model {
            dims,
            rope_configs,
            max_position_embeddings: config.max_position_embeddings,
            embed: Linear::new(&weights.embed_tokens, None, dims.vocab, dims.hidden)?,
            per_layer_inputs,
            layers,
            final_norm: Norm::new(&weights.final_norm, dims.hidden, spec.norm)?,
            lm_head,
            tied: weights.lm_head.same_bytes(&weights.embed_tokens),
            activation: spec.activation,
            qk_norm: spec.qk_norm,
            embedding_scale: not_one(spec.embedding_scale),
            residual_scale: spec.residual_scale as f32,
            attention_softcap: spec.attention_softcap.map(|c| c as f32),
            logits_divisor: not_one(spec.logits_divisor),
            final_softcap: spec.final_softcap.map(|c| c as f32),
            bf16: None,
            quantized_bf16: false,
            quantization,
        })
    }

    /// Quantizes every linear layer and the head to `format` (before
    /// [`Model::set_precision`] and [`Model::plan_scratch`]), with GGUF's numbers, made on
    /// `threads` threads, `progress(done, total)` called with the source bytes done after each
    /// piece. The embedding stays as stored (a lookup reads one row per token); a tied head is
    /// quantized from it. Each quantized matrix's source pages are released from resident
    /// memory as soon as it is done (the map stays: a lookup faults back the rows it reads).
    ///
    /// `Q8_0` quantizes every matrix to Q8_0. `Q4K` follows llama.cpp's Q4_K_M recipe with
    /// Q8_0 wherever that recipe asks for Q6_K (which Kylin does not implement; Q8_0 is the
    /// more accurate of the two): the head, and `v_proj` and `down_proj` in the layers
    /// llama.cpp's `use_more_bits` picks (the first and last eighth, and every third between);
    /// all other matrices are Q4_K. A matrix whose columns are not whole super-blocks of 256 is
    /// Q8_0 too, where llama.cpp falls back to Q5_0 (Qwen2.5-0.5B's 896 columns). The Q4_K
    /// kernels could run such a matrix with a partial last super-block, but measured on
    /// Qwen2.5-Coder-0.5B that costs ten times llama.cpp's KL divergence (BENCHMARKS.md).
    ///
    /// `OPERATOR_UNSUPPORTED` naming the tensor when a matrix's columns are not whole blocks
    /// of 32.
    pub fn quantize(
        &mut self,
        format: QuantFormat,
        threads: usize,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<()> {
        use kylin_kernels::quant::GROUP_ROWS;
        if let Some(m) = self.pending().next() {
            return Err(KylinError::config_invalid(format!(
                "--quantize {} does not apply to a published quantized checkpoint (module '{}' is stored quantized): it runs on the integer kernels as published; quantize its BF16 original instead",
                format.name(),
                m.module
            )));
        }
        if self.quantization.is_some() {
            return Ok(());
        }
        let n_layers = self.layers.len();
        // llama.cpp's `use_more_bits(i_layer, n_layers)` (llama-quant.cpp), by layer index.
        let more_bits = |i: usize| i < n_layers / 8 || i >= 7 * n_layers / 8 || (i - n_layers / 8) % 3 == 2;
        let mut matrices: Vec<(&Linear, Packing)> = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (role, m) in layer.linears() {
                let wants = match format {
                    QuantFormat::Q8_0 | QuantFormat::Published(_) => Packing::Q8_0,
                    QuantFormat::Q4K if matches!(role, Role::VProj | Role::DownProj) && more_bits(i) => Packing::Q8_0,
                    QuantFormat::Q4K => Packing::Q4K,
                };
                matrices.push((m, wants));
            }
        }
        matrices.push((&self.lm_head, Packing::Q8_0));
        let mut buffers = Vec::with_capacity(matrices.len());
        for (m, packing) in matrices.iter_mut() {
            if *packing == Packing::Q4K && !m.cols.is_multiple_of(kylin_kernels::q4k::QK_K) {
                *packing = Packing::Q8_0;
            }
            let buffer = QuantBuffer::zeroed(*packing, m.rows, m.cols).ok_or_else(|| {
                KylinError::operator_unsupported(format!(
                    "--quantize {} needs matrices whose columns are whole blocks of {}; tensor '{}' has {} columns",
                    format.name(),
                    kylin_kernels::quant::QK8_0,
                    m.weight.name,
                    m.cols
                ))
            })?;
            buffers.push(buffer);
        }
        // Work items of at most `CHUNK_GROUPS` groups of 16 rows, largest matrices first.
        const CHUNK_GROUPS: usize = 64;
        let mut items = Vec::new();
        for (index, ((m, packing), buffer)) in matrices.iter().zip(buffers.iter_mut()).enumerate() {
            let groups = m.rows.div_ceil(GROUP_ROWS);
            let (gq, gs) = buffer.group_bytes();
            let (quants, scales) = buffer.planes_mut();
            let pieces = quants.chunks_mut(CHUNK_GROUPS * gq).zip(scales.chunks_mut(CHUNK_GROUPS * gs));
            for (i, out) in pieces.enumerate() {
                let g0 = i * CHUNK_GROUPS;
                let g1 = (g0 + CHUNK_GROUPS).min(groups);
                let source_bytes = ((g1 * GROUP_ROWS).min(m.rows) - g0 * GROUP_ROWS) * m.cols * m.dtype.size_in_bytes();
                items.push((index, *packing, m.matrix(), g0..g1, out, source_bytes as u64));
            }
        }
        let total: u64 = items.iter().map(|item| item.5).sum();
        // Pieces left per matrix: whoever finishes a matrix's last piece releases its source
        // pages from resident memory, so the peak stays near the quantized size, not the sum.
        let left: Vec<std::sync::atomic::AtomicUsize> = (0..matrices.len())
            .map(|i| std::sync::atomic::AtomicUsize::new(items.iter().filter(|item| item.0 == i).count()))
            .collect();
        items.reverse();
        let queue = std::sync::Mutex::new(items);
        let done = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|scope| {
            for _ in 0..threads.max(1) {
                scope.spawn(|| {
                    let mut row = Vec::new();
                    loop {
                        let Some((index, packing, w, groups, (quants, scales), bytes)) =
                            queue.lock().unwrap_or_else(|e| e.into_inner()).pop()
                        else {
                            break;
                        };
                        row.resize(w.cols, 0.0);
                        QuantBuffer::quantize_groups(packing, w, groups, quants, scales, &mut row);
                        if left[index].fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                            // A tied head's pages are the embedding's: a lookup faults back
                            // only the rows it reads.
                            matrices[index].0.weight.advise_dont_need();
                        }
                        let now = done.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed) + bytes;
                        progress(now, total);
                    }
                });
            }
        });
        let linears = self.layers.iter_mut().flat_map(|l| l.linears_mut()).chain(std::iter::once(&mut self.lm_head));
        for (linear, buffer) in linears.zip(buffers) {
            linear.quant = Some(QuantSource::Owned(Arc::new(buffer)));
        }
        self.quantization = Some(format);
        Ok(())
    }

    /// The published quantized matrices still waiting for [`Model::prepare_published`].
    fn pending(&self) -> impl Iterator<Item = &kylin_loader::published::PublishedMatrix> {
        self.layers.iter().flat_map(|l| l.linears().map(|(_, m)| m)).chain(std::iter::once(&self.lm_head)).filter_map(
            |l| match &l.quant {
                Some(QuantSource::Pending(m)) => Some(&**m),
                _ => None,
            },
        )
    }

    /// Decodes a published quantized checkpoint (compressed-tensors, FP8, GPTQ, AWQ; before
    /// [`Model::set_precision`] and [`Model::plan_scratch`]; nothing to do for any other model),
    /// on `threads` threads:
    ///
    /// - `F32`: every quantized matrix is dequantized exactly to f32 (`scale · (q − zero)`, FP8
    ///   times its scale), the weights transformers computes with; the activations stay f32.
    /// - `Auto` (the default): the integer kernels. 8-bit symmetric integers with groups of a
    ///   multiple of 32 (W8A8, W8A16) keep their integers and scale per block in Q8_0's planes;
    ///   4-bit integers with groups of a multiple of 32 and no activation order (W4A16, GPTQ,
    ///   AWQ) keep theirs in Q4G's, with the scale and `scale · zero` per group (f16). Where the
    ///   CPU has AVX-512 BF16 ([`kernels::w16::available`]), every scheme but W8A8 (whose
    ///   producer quantized the activations to int8) runs with BF16 activations: `q8_0_a16`,
    ///   `q4_g_a16`, and FP8 as stored (`f8_e4m3_a16`, decoded in the kernel, one f32 scale
    ///   per row and 32 columns). Elsewhere the int8 products run (`q8_0`, `q4_g`) and FP8 is
    ///   dequantized and quantized to Q8_0. Activation order and asymmetric 8-bit are
    ///   dequantized and quantized to Q8_0 everywhere. Unquantized modules (`ignore`, usually
    ///   the head) become Q8_0, as under `--quantize`.
    /// - `Bf16`: every quantized matrix is dequantized and rounded to BF16, for the BF16 kernels
    ///   (BF16 activations; twice the bytes per token of Q8_0, four times Q4G's, for 16-bit
    ///   activations as the A16 schemes intend). `CONFIG_INVALID` without BF16 kernels.
    ///
    /// Errors name the tensor whose values are wrong (`FILE_CORRUPTED`, `TENSOR_SHAPE_MISMATCH`).
    pub fn prepare_published(&mut self, choice: PrecisionChoice, threads: usize) -> Result<()> {
        if self.pending().next().is_none() {
            return Ok(());
        }
        let mode = match choice {
            PrecisionChoice::F32 => PublishedDecode::F32,
            PrecisionChoice::Bf16 => PublishedDecode::Bf16,
            PrecisionChoice::Auto => PublishedDecode::Integer,
        };
        if mode == PublishedDecode::Bf16 && kernels::bf16_kernels().is_none() {
            return Err(KylinError::config_invalid(format!(
                "--precision bf16 needs BF16 matrix kernels (AMX-BF16 or AVX-512 BF16), which this CPU lacks (kernels: {}); use --precision auto (integer kernels, the default) or f32 (the exactly dequantized weights)",
                kernels::kernel_family(Precision::F32)
            )));
        }
        let integer = mode == PublishedDecode::Integer;
        let linears: Vec<&mut Linear> = self
            .layers
            .iter_mut()
            .flat_map(|l| l.linears_mut())
            .chain(std::iter::once(&mut self.lm_head))
            .filter(|l| {
                matches!(l.quant, Some(QuantSource::Pending(_))) || (mode != PublishedDecode::F32 && l.quant.is_none())
            })
            .collect();
        let queue = std::sync::Mutex::new(linears);
        let failure: std::sync::Mutex<Option<KylinError>> = std::sync::Mutex::new(None);
        let packings = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..threads.max(1) {
                scope.spawn(|| {
                    loop {
                        if failure.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                            break;
                        }
                        let Some(linear) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop() else { break };
                        match decode_published(linear, mode) {
                            Ok(p) => packings.lock().unwrap_or_else(|e| e.into_inner()).extend(p),
                            Err(e) => {
                                failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                                break;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(e);
        }
        if integer {
            // Reported by the packing most matrices got (Q4G for a 4-bit checkpoint); ties go
            // to the first in `Packing`'s order.
            let packings = packings.into_inner().unwrap_or_else(|e| e.into_inner());
            let mut counts: Vec<(Packing, usize)> = Vec::new();
            for p in packings {
                match counts.iter_mut().find(|(q, _)| *q == p) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((p, 1)),
                }
            }
            counts.sort_by_key(|&(p, n)| (std::cmp::Reverse(n), p as u8));
            let packing = counts.first().map_or(Packing::Q8_0, |&(p, _)| p);
            self.quantization = Some(QuantFormat::Published(packing));
        }
        Ok(())
    }

    /// The quantized matrices, for `kylin quantize` to store: `(name, planes)` for every layer's
    /// projections (their checkpoint names) and the head (`lm_head.weight`, also when it was
    /// tied to the embedding). Empty unless quantized.
    pub fn quantized_matrices(&self) -> Vec<(String, QuantMatrix<'_>)> {
        let layers = self.layers.iter().flat_map(|l| l.linears()).map(|(_, m)| (m.weight.name.clone(), m));
        layers
            .chain(std::iter::once(("lm_head.weight".to_string(), &self.lm_head)))
            .filter_map(|(name, m)| m.quant_matrix().map(|q| (name, q)))
            .collect()
    }

    /// The format the linear layers were quantized to at load, if any.
    pub fn quantization(&self) -> Option<QuantFormat> {
        self.quantization
    }

    /// The KV cache's element type when none is asked for: BF16 under `Precision::Bf16` (what
    /// transformers keeps for a BF16 model), F16 for a quantized model (llama.cpp's default;
    /// measured closest to f32 of the 16-bit types, see BENCHMARKS.md), f32 otherwise (exact
    /// against the float32 references).
    pub fn default_kv_dtype(&self) -> WeightDType {
        match (self.quantization, self.precision()) {
            (Some(_), _) => WeightDType::F16,
            (None, Precision::Bf16) => WeightDType::BF16,
            (None, Precision::F32) => WeightDType::F32,
        }
    }

    /// Chooses the arithmetic of the matrix products (before [`Model::plan_scratch`]).
    ///
    /// `CONFIG_INVALID` for `Bf16` when a matrix is not stored in BF16 (naming it and its
    /// dtype) or the CPU has no BF16 kernels.
    pub fn set_precision(&mut self, choice: PrecisionChoice) -> Result<()> {
        if let Some(format) = self.quantization {
            // The quantized products have their own arithmetic: int8 activations by default;
            // BF16 activations over Q8_0 weights on request.
            self.bf16 = None;
            return match choice {
                PrecisionChoice::Auto => Ok(()),
                PrecisionChoice::Bf16 => self.run_quantized_on_bf16_activations(format),
                PrecisionChoice::F32 => Err(KylinError::config_invalid(format!(
                    "--precision f32 does not apply to --quantize {}: its matrix products quantize the activations to int8 (or, with --precision bf16, round them to BF16); use --precision auto (the default)",
                    format.name()
                ))),
            };
        }
        let non_bf16 = self
            .layers
            .iter()
            .flat_map(|l| l.linears().map(|(_, m)| m).chain(l.side_linears()))
            .chain(self.per_layer_inputs.as_ref().map(|p| &p.projection))
            .chain(std::iter::once(&self.lm_head))
            .find(|m| m.dtype != WeightDType::BF16);
        self.bf16 = match choice {
            PrecisionChoice::F32 => None,
            PrecisionChoice::Auto => kernels::bf16_kernels().filter(|_| non_bf16.is_none()),
            PrecisionChoice::Bf16 => {
                if let Some(m) = non_bf16 {
                    return Err(KylinError::config_invalid(format!(
                        "--precision bf16 needs BF16 weights; tensor '{}' is stored as {:?}; use --precision f32 or auto",
                        m.weight.name, m.dtype
                    )));
                }
                let Some(k) = kernels::bf16_kernels() else {
                    return Err(KylinError::config_invalid(format!(
                        "--precision bf16 needs BF16 matrix kernels (AMX-BF16 or AVX-512 BF16), which this CPU lacks (kernels: {}); use --precision f32 or auto",
                        kernels::kernel_family(Precision::F32)
                    )));
                };
                Some(k)
            }
        };
        Ok(())
    }

    /// `--quantize q8_0 --precision bf16`: every Q8_0 matrix (made at load or stored by `kylin
    /// quantize`) is read as `q8_0_a16`, the same planes with BF16 activations. `CONFIG_INVALID`
    /// without AVX-512 BF16, for Q4_K (no BF16-activation kernel reads its 6-bit scales) and for
    /// a published checkpoint (whose `--precision bf16` path is decided at load).
    fn run_quantized_on_bf16_activations(&mut self, format: QuantFormat) -> Result<()> {
        if format != QuantFormat::Q8_0 {
            return Err(KylinError::config_invalid(format!(
                "--precision bf16 with --quantize {} is not supported: BF16 activations run over Q8_0 weights only; use --quantize q8_0, or --precision auto (int8 activations)",
                format.name()
            )));
        }
        if !kernels::w16::available() {
            return Err(KylinError::config_invalid(format!(
                "--precision bf16 with --quantize q8_0 needs AVX-512 BF16, which this CPU lacks (kernels: {}); use --precision auto (int8 activations)",
                kernels::quant::q8_kernels()
            )));
        }
        for linear in self.layers.iter_mut().flat_map(|l| l.linears_mut()).chain(std::iter::once(&mut self.lm_head)) {
            match &mut linear.quant {
                Some(QuantSource::Owned(buffer)) => {
                    // Made by `Model::quantize` and not shared yet.
                    let Some(buffer) = Arc::get_mut(buffer) else {
                        return Err(KylinError::config_invalid("the quantized matrices are already in use"));
                    };
                    buffer.set_packing(Packing::Q8_0A16);
                }
                Some(QuantSource::Mapped { packing, .. }) => {
                    if *packing == Packing::Q8_0 {
                        *packing = Packing::Q8_0A16;
                    }
                }
                Some(QuantSource::Pending(_)) | None => {}
            }
        }
        self.quantized_bf16 = true;
        Ok(())
    }

    /// The arithmetic of the matrix products.
    pub fn precision(&self) -> Precision {
        if self.bf16.is_some() { Precision::Bf16 } else { Precision::F32 }
    }

    /// The kernel family running the matrix products (`amx-bf16`, `avx512`, `avx2`, `scalar`,
    /// or for a quantized model `avx512-vnni q8_0`, ...).
    pub fn kernel_family(&self) -> String {
        match self.quantization {
            Some(format) if self.quantized_bf16 => format!("avx512-bf16 {}_a16", format.name()),
            Some(format) if self.bf16_activations(format) => format!("avx512-bf16 {}", format.name()),
            Some(format) => format!("{} {}", kernels::quant::q8_kernels(), format.name()),
            None => kernels::kernel_family(self.precision()).to_string(),
        }
    }

    /// Whether most of a quantized model's products run on BF16 activations (the `_a16`
    /// packings of `kylin_kernels::w16`).
    fn bf16_activations(&self, format: QuantFormat) -> bool {
        self.quantized_bf16
            || matches!(format, QuantFormat::Published(p) if p.activation_kind() == kernels::quant::ActivationKind::Bf16)
    }

    /// The arithmetic of the matrix products for reports: `f32`, `bf16`, `int8` (quantized, int8
    /// activations) or `bf16 activations` (quantized weights, BF16 activations).
    pub fn precision_name(&self) -> &'static str {
        match (self.quantization, self.precision()) {
            (Some(format), _) if self.bf16_activations(format) => "bf16 activations",
            (Some(_), _) => "int8",
            (None, Precision::Bf16) => "bf16",
            (None, Precision::F32) => "f32",
        }
    }

    /// What reports name as the kernels: the matrix products' family, and attention's path
    /// over a KV cache of `kv_dtype` when it differs (`amx-bf16`, or `avx512, attention f32`).
    pub fn kernels_report(&self, kv_dtype: WeightDType, block_size: usize) -> String {
        let attention = kernels::paged::attention_path(
            self.precision(),
            kv_dtype,
            self.attention_head_dim(),
            block_size,
            self.attention_needs(),
        );
        let family = self.kernel_family();
        if attention.name() == family { family } else { format!("{family}, attention {}", attention.name()) }
    }

    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    pub fn max_position_embeddings(&self) -> usize {
        self.max_position_embeddings
    }

    /// Number of parameters (a tied head counted once).
    pub fn parameter_count(&self) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                l.linears().map(|(_, m)| m).chain(l.side_linears()).map(Linear::element_count).sum::<u64>()
                    + l.vectors().map(|v| v.tensor.element_count() as u64).sum::<u64>()
            })
            .sum();
        let head = if self.tied { 0 } else { self.lm_head.element_count() };
        let per_layer = self.per_layer_inputs.as_ref().map_or(0, |p| {
            p.embed.element_count() + p.projection.element_count() + p.norm.weight.tensor.element_count() as u64
        });
        self.embed.element_count() + per_layer + layers + self.final_norm.weight.tensor.element_count() as u64 + head
    }

    /// Bytes of weights read to produce one token: every matrix and vector once, the head once,
    /// and one embedding row (and one row of the per-layer embedding).
    pub fn weight_bytes_per_token(&self) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                l.linears().map(|(_, m)| m).chain(l.side_linears()).map(Linear::byte_len).sum::<u64>()
                    + l.vectors().map(|v| v.tensor.byte_len() as u64).sum::<u64>()
            })
            .sum();
        let embed_row = (self.dims.hidden * self.embed.dtype.size_in_bytes()) as u64;
        let per_layer = self.per_layer_inputs.as_ref().map_or(0, |p| {
            (p.embed.cols * p.embed.dtype.size_in_bytes()) as u64
                + p.projection.byte_len()
                + p.norm.weight.tensor.byte_len() as u64
        });
        layers + per_layer + self.final_norm.weight.tensor.byte_len() as u64 + self.lm_head.byte_len() + embed_row
    }

    /// Plans the activation buffers for forward passes of up to `max_tokens` tokens in up to
    /// `max_segments` segments (attention needs no buffer sized by the context: its state is
    /// per tile). `CONFIG_INVALID` if a size overflows.
    pub fn plan_scratch(&self, max_tokens: usize, max_segments: usize, context: usize) -> Result<Scratch> {
        if let Some(m) = self.pending().next() {
            return Err(KylinError::config_invalid(format!(
                "internal: module '{}' of a published quantized checkpoint was not decoded (Model::prepare_published)",
                m.module
            )));
        }
        let d = &self.dims;
        let max_tokens = max_tokens.max(1);
        let max_segments = max_segments.clamp(1, max_tokens);
        let split_segments = SPLIT_SEGMENTS.min(max_segments);
        let split_parts = context.div_ceil(PARTITION).max(1);
        let split_rows = split_segments * d.n_heads * split_parts;
        let (ple_width, ple_all) = self.per_layer_inputs.as_ref().map_or((0, 0), |p| (p.width, p.embed.cols));
        let sized = |rows: usize, cols: usize, what: &str| -> Result<Vec<f32>> {
            let len = rows.checked_mul(cols).ok_or_else(|| {
                KylinError::config_invalid(format!(
                    "{what} buffer of {rows} x {cols} overflows; pass a smaller --ctx-size or --max-batch-tokens"
                ))
            })?;
            Ok(vec![0.0; len])
        };
        Ok(Scratch {
            max_tokens,
            max_segments,
            x: sized(max_tokens, d.hidden, "residual")?,
            xn: sized(max_tokens, d.hidden, "norm")?,
            q: sized(max_tokens, d.q_dim(), "query")?,
            k: sized(max_tokens, d.kv_dim(), "key")?,
            v: sized(max_tokens, d.kv_dim(), "value")?,
            attn: sized(max_tokens, d.q_dim(), "attention")?,
            proj: sized(max_tokens, d.hidden, "projection")?,
            gate: sized(max_tokens, d.intermediate, "gate")?,
            up: sized(max_tokens, d.intermediate, "up")?,
            attention_tasks: vec![0; max_segments + 1],
            split_segments,
            split_parts,
            split_outputs: sized(split_rows, d.head_dim, "split attention")?,
            split_stats: vec![PartialStats::EMPTY; split_rows],
            head_tmp: sized(1, d.q_dim().max(d.head_dim), "head")?,
            logit_hidden: sized(max_segments, d.hidden, "hidden")?,
            logits: sized(max_segments, d.vocab, "logits")?,
            ple: sized(max_tokens, ple_all, "per-layer input")?,
            ple_row: sized(1, ple_all, "per-layer input")?,
            ple_gate: sized(max_tokens, ple_width, "per-layer gate")?,
            products: {
                let widest = d.hidden.max(d.q_dim()).max(d.intermediate).max(ple_width);
                ProductScratch {
                    xb: if self.bf16.is_some() {
                        vec![0; kernels::bf16_scratch_len(max_tokens, widest)]
                    } else {
                        Vec::new()
                    },
                    xq: if self.quantization.is_some() {
                        vec![0; kernels::quant::quant_scratch_len(max_tokens, widest)]
                    } else {
                        Vec::new()
                    },
                }
            },
        })
    }

    /// RoPE tables for positions `0..context`, one per rotary table the layers use.
    pub fn rope(&self, context: usize) -> Result<Ropes> {
        Ropes::new(&self.rope_configs, context)
    }

    /// How the layers' keys and values are split between the KV pools.
    pub fn kv_groups(&self) -> KvGroups {
        // The layers that hold a place, in slot order (slots are given out in layer order).
        let owners = |sliding: bool| -> Vec<KvShape> {
            self.layers
                .iter()
                .filter(|l| l.k_proj.is_some() && l.in_sliding_pool == sliding)
                .map(Layer::kv_shape)
                .collect()
        };
        KvGroups {
            full: owners(false),
            sliding: owners(true),
            window: self.layers.iter().find(|l| l.in_sliding_pool).and_then(|l| l.window),
        }
    }

    /// The head width that decides the attention path (its kernels need every layer's width
    /// to be a multiple of 32): a width that is not, if some layer has one, else the widest.
    pub fn attention_head_dim(&self) -> usize {
        let widths = self.layers.iter().map(|l| l.head_dim);
        widths.clone().find(|w| !w.is_multiple_of(32)).unwrap_or_else(|| widths.max().unwrap_or(self.dims.head_dim))
    }

    /// Whether some layer slides (attention over a window of positions).
    pub fn has_window(&self) -> bool {
        self.layers.iter().any(|l| l.window.is_some())
    }

    /// What the attention layers ask of the kernels beyond plain causal attention (a window,
    /// a soft cap), for the choice of the attention path and the KV cache's layout.
    pub fn attention_needs(&self) -> kernels::paged::AttentionNeeds {
        kernels::paged::AttentionNeeds { window: self.has_window(), softcap: self.attention_softcap.is_some() }
    }

    /// One forward pass over every segment of `plan`: appends each segment's keys and values to
    /// its blocks in `kv` and writes the logits of the segments that want them into `s`
    /// (read them with [`Scratch::logits`]). With `all_logits`, the plan must hold one segment,
    /// and the logits of all its positions are written there, `(n, vocab)`.
    ///
    /// The caller guarantees (the engine plans it so): at most `max_tokens` tokens and
    /// `max_segments` segments, ids inside the vocabulary, block tables covering every position
    /// up to `start + n <= context`, and RoPE prepared for those positions. Allocates nothing.
    pub fn forward(
        &self,
        pool: &ThreadPool,
        kv: &mut KvPool,
        mut sliding_kv: Option<&mut KvPool>,
        rope: &Ropes,
        s: &mut Scratch,
        plan: &BatchPlan,
        all_logits: Option<&mut [f32]>,
    ) {
        let d = &self.dims;
        let n = plan.tokens();
        let h = d.hidden;
        let mm = Matmul { pool, bf16: self.bf16 };
        assert!(n <= s.max_tokens && plan.segments.len() <= s.max_segments, "batch larger than planned");

        // 1. Embedding lookup: ids (n) -> x (n, hidden), times the embedding scale if any.
        let embed = self.embed.matrix();
        for (&id, row) in plan.ids.iter().zip(s.x.chunks_exact_mut(h)) {
            kernels::widen_row(embed, id as usize, row);
            if let Some(scale) = self.embedding_scale {
                kernels::scale(row, scale);
            }
        }

        // Gemma 4's per-layer inputs: x (n, hidden) -> ple (n, layers · width).
        if let Some(p) = &self.per_layer_inputs {
            let all = p.embed.cols;
            p.compute(
                mm,
                &plan.ids,
                &s.x[..n * h],
                &mut s.ple[..n * all],
                &mut s.ple_row[..all],
                d.eps,
                &mut s.products,
            );
        }

        // 2. The decoder layers, each updating the residual stream x (n, hidden) in place.
        for (i, layer) in self.layers.iter().enumerate() {
            // The layer's pool: the sliding layers' own when it has one.
            let pool = match (&mut sliding_kv, layer.in_sliding_pool) {
                (Some(sliding), true) => &mut **sliding,
                _ => &mut *kv,
            };
            self.attention_block(mm, layer, pool, rope, s, plan);
            self.mlp_block(mm, layer, s, n);
            if let Some(block) = &layer.per_layer {
                self.per_layer_block(mm, block, i, s, n);
            }
            if let Some(scalar) = layer.scalar {
                kernels::scale(&mut s.x[..n * h], scalar);
            }
        }

        // 3. Final norm and head, only for the rows whose logits are wanted; then the logit
        //    divisor and soft-cap.
        match all_logits {
            Some(out) => {
                // x (n, hidden) -> xn (n, hidden) -> out (n, vocab).
                self.final_norm.rows(&s.x[..n * h], h, d.eps, &mut s.xn[..n * h]);
                self.lm_head.forward(mm, &s.xn[..n * h], n, out, &mut s.products);
                self.finish_logits(&mut out[..n * d.vocab]);
            }
            None => {
                let rows = plan.logit_rows;
                if rows == 0 {
                    return;
                }
                // Last row of each segment that wants logits: x[t0 + n - 1] (hidden) ->
                // logit_hidden[row] (hidden); then logit_hidden (rows, hidden) -> logits (rows, vocab).
                for seg in &plan.segments {
                    if let Some(row) = seg.logits_row {
                        let t = seg.t0 + seg.n - 1;
                        self.final_norm.apply(
                            &s.x[t * h..(t + 1) * h],
                            d.eps,
                            &mut s.logit_hidden[row * h..(row + 1) * h],
                        );
                    }
                }
                self.lm_head.forward(
                    mm,
                    &s.logit_hidden[..rows * h],
                    rows,
                    &mut s.logits[..rows * d.vocab],
                    &mut s.products,
                );
                self.finish_logits(&mut s.logits[..rows * d.vocab]);
            }
        }
    }

    /// `logits / divisor` (Granite), then `cap · tanh(logits / cap)` (Gemma 2), in place.
    fn finish_logits(&self, logits: &mut [f32]) {
        if let Some(divisor) = self.logits_divisor {
            for v in logits.iter_mut() {
                *v /= divisor;
            }
        }
        if let Some(cap) = self.final_softcap {
            kernels::softcap(logits, cap);
        }
    }

    /// `x += r · h` for a sub-block's output `h`: the residual add, scaled by Granite's
    /// multiplier.
    #[inline]
    fn residual_add(&self, x: &mut [f32], h: &[f32]) {
        if self.residual_scale == 1.0 {
            kernels::add_assign(x, h);
        } else {
            kernels::add_scaled(x, h, self.residual_scale);
        }
    }

    /// Self-attention with grouped KV heads over every segment of the batch, with the norms
    /// the family places around it:
    /// `x += r · post_norm?(o_proj(attention(rope(qk_norm?(q)), rope(qk_norm?(k)), v)))`,
    /// where q, k, v are projections of `norm?(x)`.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        mm: Matmul<'_>,
        layer: &Layer,
        kv: &mut KvPool,
        rope: &Ropes,
        s: &mut Scratch,
        plan: &BatchPlan,
    ) {
        let d = &self.dims;
        let n = plan.tokens();
        let hd = layer.head_dim;
        let (h, q_dim, kv_dim) = (d.hidden, d.n_heads * hd, layer.n_kv_heads * hd);
        // The layer's index in its pool, and each segment's table there.
        let index = layer.kv_slot;
        let table_range = |seg: &Segment| -> std::ops::Range<usize> {
            if layer.in_sliding_pool { seg.sb0..seg.sb0 + seg.snb } else { seg.b0..seg.b0 + seg.nb }
        };
        let tables = if layer.in_sliding_pool { &plan.sliding_block_ids } else { &plan.block_ids };

        // 1. RMSNorm (pre-norm families): x (n, hidden) -> xn (n, hidden); OLMo 2 projects x itself.
        if let Some(norm) = &layer.attn_norm {
            norm.rows(&s.x[..n * h], h, d.eps, &mut s.xn[..n * h]);
        }
        let input = if layer.attn_norm.is_some() { &s.xn[..n * h] } else { &s.x[..n * h] };

        // 2. Projections over all tokens of all segments: input (n, hidden) -> q (n, n_heads * head_dim),
        //    k and v (n, n_kv_heads * head_dim). A layer reusing an earlier layer's keys and
        //    values projects only q; one whose values are its keys' projection copies k to v
        //    before k is normed and rotated.
        let (q_out, k_out, v_out) = (&mut s.q[..n * q_dim], &mut s.k[..n * kv_dim], &mut s.v[..n * kv_dim]);
        match (&layer.k_proj, &layer.v_proj) {
            (Some(k_proj), Some(v_proj)) => Linear::forward_many(
                mm,
                input,
                n,
                [(&layer.q_proj, q_out), (k_proj, &mut *k_out), (v_proj, v_out)],
                &mut s.products,
            ),
            (Some(k_proj), None) => {
                Linear::forward_many(mm, input, n, [(&layer.q_proj, q_out), (k_proj, &mut *k_out)], &mut s.products);
                v_out.copy_from_slice(k_out);
            }
            (None, _) => layer.q_proj.forward(mm, input, n, q_out, &mut s.products),
        }

        // 3. The q/k norm (per head, or over the whole projection), then RoPE at each token's
        //    own position on the rotated part of every (token, head) row of q and k, viewed as
        //    (n, heads, head_dim); the value norm (Gemma 4) on each value head; then the token's
        //    keys and values go to its sequence's blocks.
        let tmp = &mut s.head_tmp;
        let table = layer.rope.map(|i| rope.table(i));
        let rotary = table.map_or(0, |t| t.rotary_dim());
        let writes_kv = layer.k_proj.is_some();
        for seg in &plan.segments {
            let blocks = &tables[table_range(seg)];
            for t in seg.t0..seg.t0 + seg.n {
                let pos = seg.start + (t - seg.t0);
                let rows = [
                    Some((&mut s.q[t * q_dim..(t + 1) * q_dim], q_dim, &layer.q_norm)),
                    writes_kv.then(|| (&mut s.k[t * kv_dim..(t + 1) * kv_dim], kv_dim, &layer.k_norm)),
                ];
                for (row, width, head_norm) in rows.into_iter().flatten() {
                    debug_assert_eq!(row.len(), width);
                    if let (Some(w), QkNorm::Projection) = (head_norm, self.qk_norm) {
                        // (width) -> (width): one norm over every head of the token.
                        tmp[..width].copy_from_slice(row);
                        w.apply(&tmp[..width], d.eps, row);
                    }
                    for head in row.chunks_exact_mut(hd) {
                        if let (Some(w), QkNorm::PerHead) = (head_norm, self.qk_norm) {
                            tmp[..hd].copy_from_slice(head);
                            w.apply(&tmp[..hd], d.eps, head);
                        }
                        if let Some(table) = table {
                            kernels::rope_rotate_half(&mut head[..rotary], table.cos(pos), table.sin(pos));
                        }
                    }
                }
                if !writes_kv {
                    continue;
                }
                let v_row = &mut s.v[t * kv_dim..(t + 1) * kv_dim];
                if let Some(norm) = &layer.v_norm {
                    for head in v_row.chunks_exact_mut(hd) {
                        tmp[..hd].copy_from_slice(head);
                        norm.apply(&tmp[..hd], d.eps, head);
                    }
                }
                // (n_kv_heads * head_dim) -> block slot of position `pos`, per KV head.
                kv.store(index, blocks, pos, &s.k[t * kv_dim..(t + 1) * kv_dim], &s.v[t * kv_dim..(t + 1) * kv_dim]);
            }
        }

        // 4. Causal attention, blocked: one pool task per (segment, KV head, chunk of up to
        //    MAX_ROWS of its (token, query head) rows, token-major), so each tile of the head's
        //    cached keys and values is read once for the whole chunk; query t of a segment attends
        //    to positions 0..=start + t of its own sequence. The kernel gives every row the same
        //    bits whatever chunk it is in (batch invariance).
        //    Split-K: when that makes fewer than two tasks per thread (one or a few sequences
        //    decoding on a model with few KV heads), each decode segment reaching past one
        //    partition gets one task per (KV head, partition of PARTITION positions), and the
        //    partitions' states are folded in order afterwards, which gives the same bits as
        //    one task.
        //    q (n, n_heads, head_dim) -> attn (n, n_heads, head_dim).
        let kv: &KvPool = kv;
        let (keys, values) = kv.views(index);
        let group = d.n_heads / layer.n_kv_heads;
        let scores = ScoreMap { scale: d.attn_scale, softcap: self.attention_softcap };
        // A sliding layer's query at position p attends to p + 1 - window ..= p.
        let window = layer.window;
        let first_position = |pos: usize| window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let (n_kv, n_heads) = (layer.n_kv_heads, d.n_heads);
        let q = &s.q[..n * q_dim];
        let attn = SharedMut::new(&mut s.attn[..n * q_dim]);
        let segments = &plan.segments;
        // Tasks of segment i are task_start[i]..task_start[i + 1]: its KV heads, each cut into
        // chunks of MAX_ROWS rows, or into partitions when split.
        let chunks = |seg: &Segment| (seg.n * group).div_ceil(MAX_ROWS);
        let parts = |seg: &Segment| (seg.start + seg.n).div_ceil(PARTITION);
        let unsplit: usize = segments.iter().map(|seg| n_kv * chunks(seg)).sum();
        let split_wanted = unsplit < 2 * mm.pool.threads() && segments.len() <= s.split_segments;
        let is_split = |seg: &Segment| split_wanted && seg.n == 1 && group <= MAX_ROWS && parts(seg) > 1;
        let max_parts = s.split_parts;
        let outputs = SharedMut::new(&mut s.split_outputs);
        let states = SharedMut::new(&mut s.split_stats);
        let task_start = &mut s.attention_tasks[..segments.len() + 1];
        task_start[0] = 0;
        for (i, seg) in segments.iter().enumerate() {
            let per_head = if is_split(seg) { parts(seg) } else { chunks(seg) };
            task_start[i + 1] = task_start[i] + n_kv * per_head;
        }
        let task_start = &*task_start;
        mm.pool.run(task_start[segments.len()], &|task| {
            // The task's segment, KV head and range of rows (or partition).
            let si = task_start.partition_point(|&t| t <= task) - 1;
            let seg = segments[si];
            let local = task - task_start[si];
            let blocks = &tables[table_range(&seg)];
            let mut rows: [QueryRow<'_>; MAX_ROWS] =
                std::array::from_fn(|_| QueryRow { q: &[], from: 0, len: 0, out: &mut [] });
            if is_split(&seg) {
                // One token: the group's query heads over one partition, into the split buffers
                // at (split slot, head, partition).
                let (kv_head, part) = (local / parts(&seg), local % parts(&seg));
                let slot = segments[..si].iter().filter(|s| is_split(s)).count();
                let first_row = (slot * n_heads + kv_head * group) * max_parts + part;
                for (g, row) in rows.iter_mut().enumerate().take(group) {
                    let at = seg.t0 * q_dim + (kv_head * group + g) * hd;
                    // SAFETY: the (split slot, head, partition) row belongs to this task alone.
                    let out = unsafe { outputs.slice((first_row + g * max_parts) * hd, hd) };
                    *row = QueryRow { q: &q[at..at + hd], from: first_position(seg.start), len: seg.start + 1, out };
                }
                let mut stats = [PartialStats::EMPTY; MAX_ROWS];
                let offset = kv.head_offset(index, kv_head);
                kernels::paged::attention_rows_partition(
                    &mut rows[..group],
                    keys,
                    values,
                    blocks,
                    offset,
                    scores,
                    part,
                    &mut stats,
                );
                for (g, st) in stats.iter().enumerate().take(group) {
                    // SAFETY: as above.
                    unsafe { states.slice(first_row + g * max_parts, 1)[0] = *st };
                }
                return;
            }
            let rows_total = seg.n * group;
            let (kv_head, chunk) = (local / chunks(&seg), local % chunks(&seg));
            let (row0, row_end) = (chunk * MAX_ROWS, ((chunk + 1) * MAX_ROWS).min(rows_total));
            let offset = kv.head_offset(index, kv_head);
            let mut first = row0;
            while first < row_end {
                let count = MAX_ROWS.min(row_end - first);
                for (slot, row) in rows.iter_mut().enumerate().take(count) {
                    let (t, head) = ((first + slot) / group, kv_head * group + (first + slot) % group);
                    let token = seg.t0 + t;
                    let at = token * q_dim + head * hd;
                    // SAFETY: the (token, head) block of attn belongs to this task's segment, KV
                    // head group and row range, which no other task touches, and each slot of
                    // this call is a different row.
                    let out = unsafe { attn.slice(at, hd) };
                    let pos = seg.start + t;
                    *row = QueryRow { q: &q[at..at + hd], from: first_position(pos), len: pos + 1, out };
                }
                kernels::paged::attention_rows(&mut rows[..count], keys, values, blocks, offset, scores);
                first += count;
            }
        });
        // The split segments' partitions folded in order into attn.
        if split_wanted {
            for (slot, seg) in segments.iter().filter(|seg| is_split(seg)).enumerate() {
                let np = parts(seg);
                for head in 0..n_heads {
                    let row = (slot * n_heads + head) * max_parts;
                    let at = seg.t0 * q_dim + head * hd;
                    kernels::paged::merge_partitions(
                        kv.layout,
                        &s.split_stats[row..row + np],
                        &s.split_outputs[row * hd..(row + np) * hd],
                        &mut s.attn[at..at + hd],
                    );
                }
            }
        }

        // 5. Output projection, post-norm (Gemma, OLMo 2) and residual:
        //    attn (n, n_heads * head_dim) -> proj (n, hidden); x += r · post_norm?(proj).
        layer.o_proj.forward(mm, &s.attn[..n * q_dim], n, &mut s.proj[..n * h], &mut s.products);
        if let Some(norm) = &layer.attn_post_norm {
            norm.rows(&s.proj[..n * h], h, d.eps, &mut s.xn[..n * h]);
            self.residual_add(&mut s.x[..n * h], &s.xn[..n * h]);
        } else {
            self.residual_add(&mut s.x[..n * h], &s.proj[..n * h]);
        }
    }

    /// Gemma 4's per-layer input block of layer `i`:
    /// `x += post_norm(projection(gelu_tanh(gate(x)) · ple_i))`.
    fn per_layer_block(&self, mm: Matmul<'_>, block: &PerLayerBlock, i: usize, s: &mut Scratch, n: usize) {
        let h = self.dims.hidden;
        let w = block.gate.rows;
        let all = s.ple.len() / s.max_tokens.max(1);
        // 1. gate: x (n, hidden) -> g (n, width); g = gelu_tanh(g) · ple[:, i] per token.
        block.gate.forward(mm, &s.x[..n * h], n, &mut s.ple_gate[..n * w], &mut s.products);
        for (t, g) in s.ple_gate[..n * w].chunks_exact_mut(w).enumerate() {
            let input = &s.ple[t * all + i * w..t * all + (i + 1) * w];
            kernels::gelu_tanh_mul(g, input);
        }
        // 2. projection: g (n, width) -> proj (n, hidden); x += post_norm(proj).
        block.projection.forward(mm, &s.ple_gate[..n * w], n, &mut s.proj[..n * h], &mut s.products);
        block.post_norm.rows(&s.proj[..n * h], h, self.dims.eps, &mut s.xn[..n * h]);
        self.residual_add(&mut s.x[..n * h], &s.xn[..n * h]);
    }

    /// The gated MLP with the family's norms around it:
    /// `x += r · post_norm?(down_proj(act(gate_proj(h)) * up_proj(h)))`, `h = norm?(x)`;
    /// `act` is SiLU (SwiGLU) or tanh-GELU (GeGLU).
    fn mlp_block(&self, mm: Matmul<'_>, layer: &Layer, s: &mut Scratch, n: usize) {
        let d = &self.dims;
        let (h, i) = (d.hidden, layer.intermediate);

        // 1. RMSNorm (pre-norm families): x (n, hidden) -> xn (n, hidden); OLMo 2 uses x itself.
        if let Some(norm) = &layer.mlp_norm {
            norm.rows(&s.x[..n * h], h, d.eps, &mut s.xn[..n * h]);
        }
        let input = if layer.mlp_norm.is_some() { &s.xn[..n * h] } else { &s.x[..n * h] };

        // 2. gate and up: input (n, hidden) -> (n, intermediate) each; gate = act(gate) * up.
        Linear::forward_many(
            mm,
            input,
            n,
            [(&layer.gate_proj, &mut s.gate[..n * i]), (&layer.up_proj, &mut s.up[..n * i])],
            &mut s.products,
        );
        match self.activation {
            Activation::Silu => kernels::silu_mul(&mut s.gate[..n * i], &s.up[..n * i]),
            Activation::GeluTanh => kernels::gelu_tanh_mul(&mut s.gate[..n * i], &s.up[..n * i]),
        }

        // 3. down, post-norm and residual: gate (n, intermediate) -> proj (n, hidden);
        //    x += r · post_norm?(proj).
        layer.down_proj.forward(mm, &s.gate[..n * i], n, &mut s.proj[..n * h], &mut s.products);
        if let Some(norm) = &layer.mlp_post_norm {
            norm.rows(&s.proj[..n * h], h, d.eps, &mut s.xn[..n * h]);
            self.residual_add(&mut s.x[..n * h], &s.xn[..n * h]);
        } else {
            self.residual_add(&mut s.x[..n * h], &s.proj[..n * h]);
        }
    }
}
