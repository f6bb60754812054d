//! Linear layers and vector weights as the blocks use them: `y = x · Wᵀ (+ b)` over weights in
//! their stored dtype, quantized at load (`--quantize`), stored quantized (`kylin quantize`) or
//! published quantized (decoded by [`decode_published`]; under `--precision f32` with the input
//! quantized first as the checkpoint's scheme says, [`InputQuant`]); RMSNorm weights (`w` or
//! `1 + w`).

use std::sync::Arc;

use kylin_kernels::bf16_tiles::{Bf16TileBuffer, matmul_many_bf16_tiles};
use kylin_kernels::quant::{Packing, QuantBuffer, QuantMatrix};
use kylin_kernels::strips::{StripBuffer, StripMatrix, matmul_many_strips};
use kylin_kernels::{self as kernels, Bf16Kernels, ThreadPool, WeightDType, WeightMatrix, WeightVector};
use kylin_loader::family::NormKind;
use kylin_loader::{DType, KylinError, ModelWeights, Result, WeightTensor};

use super::input_quant::InputQuant;
use super::scratch::ProductScratch;

/// Maps a stored dtype to the kernels' weight dtype; `TENSOR_DTYPE_UNSUPPORTED` for the
/// quantized ones (the loader rejects them first; this keeps the engine from panicking).
pub(super) fn weight_dtype(t: &WeightTensor) -> Result<WeightDType> {
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

pub(super) fn shape_error(t: &WeightTensor, expected: &[usize]) -> KylinError {
    KylinError::tensor_shape_mismatch(format!(
        "tensor '{}' has wrong shape; expected {:?}, got {:?}",
        t.name, expected, t.shape
    ))
}

/// How one forward pass runs its matrix products: the pool, and the BF16 kernels under
/// `Precision::Bf16`.
#[derive(Clone, Copy)]
pub(super) struct Matmul<'a> {
    pub(super) pool: &'a ThreadPool,
    pub(super) bf16: Option<Bf16Kernels>,
}

/// A vector weight (norm scale or bias) of a checked length.
#[derive(Debug, Clone)]
pub(super) struct Vector {
    pub(super) tensor: WeightTensor,
    pub(super) dtype: WeightDType,
}

impl Vector {
    pub(super) fn new(tensor: &WeightTensor, len: usize) -> Result<Self> {
        if tensor.shape != [len] {
            return Err(shape_error(tensor, &[len]));
        }
        Ok(Vector { tensor: tensor.clone(), dtype: weight_dtype(tensor)? })
    }

    pub(super) fn optional(tensor: Option<&WeightTensor>, len: usize) -> Result<Option<Self>> {
        tensor.map(|t| Vector::new(t, len)).transpose()
    }

    #[inline]
    pub(super) fn view(&self) -> WeightVector<'_> {
        WeightVector { dtype: self.dtype, data: self.tensor.bytes() }
    }

    /// Every element as f32 (load time: small vectors such as router scales).
    pub(super) fn values(&self) -> Vec<f32> {
        let n = self.tensor.element_count();
        let mut out = vec![0.0f32; n];
        let all = WeightMatrix { dtype: self.dtype, rows: 1, cols: n, data: self.tensor.bytes() };
        kernels::widen_row(all, 0, &mut out);
        out
    }

    /// The first element as f32 (a one-element tensor's value).
    pub(super) fn scalar(&self) -> f32 {
        let mut out = [0.0f32];
        let one = WeightMatrix { dtype: self.dtype, rows: 1, cols: 1, data: self.tensor.bytes() };
        kernels::widen_row(one, 0, &mut out);
        out[0]
    }
}

/// A linear layer `y = x · Wᵀ (+ b)` with `W` stored `[rows, cols]` (`[out, in]`).
#[derive(Debug, Clone)]
pub(super) struct Linear {
    pub(super) weight: WeightTensor,
    pub(super) dtype: WeightDType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) bias: Option<Vector>,
    /// The quantized planes the products read instead of a float `weight`.
    pub(super) quant: Option<QuantSource>,
    /// The run-time quantization of the input a published scheme asks for, applied before
    /// the product (`--precision f32` on a W8A8 or FP8 checkpoint; `None` otherwise).
    pub(super) input_quant: Option<InputQuant>,
    /// The BF16 weight repacked into AMX tiles, which the products read instead of `weight`
    /// under `Precision::Bf16` on AMX ([`Linear::tile_for_amx`]; `None` otherwise).
    pub(super) tiles: Option<Arc<Bf16TileBuffer>>,
    /// The float weight repacked into 16-row strips, which the f32 products read instead of
    /// `weight` on AVX2 without AVX-512 ([`Linear::strip_for_avx2`]; `None` otherwise).
    pub(super) strips: Option<Arc<StripBuffer>>,
}

/// Where a quantized linear layer's planes live.
#[derive(Debug, Clone)]
pub(super) enum QuantSource {
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
    pub(super) fn new(weight: &WeightTensor, bias: Option<&WeightTensor>, rows: usize, cols: usize) -> Result<Self> {
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
            input_quant: None,
            tiles: None,
            strips: None,
        })
    }

    /// A linear layer stored quantized (`kylin quantize`): `quants` and `scales` are the planes
    /// (Q8_0 when the scales are F16; with U8 scales Q6_0 when the scales have its length,
    /// else Q4_K when the columns are whole 256-column super-blocks, Q5_0 otherwise, as the
    /// loader checked them), checked against `[rows, cols]`
    /// (`TENSOR_SHAPE_MISMATCH` naming the tensors otherwise).
    pub(super) fn stored_quant(
        quants: &WeightTensor,
        scales: &WeightTensor,
        bias: Option<&WeightTensor>,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let packing = if scales.dtype == DType::U8 {
            Packing::with_byte_scales(rows, cols, scales.byte_len())
        } else {
            Packing::Q8_0
        };
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
            input_quant: None,
            tiles: None,
            strips: None,
        })
    }

    /// A float linear layer; a stored-quantized one when `weights.scales` has its weight's
    /// plane; a pending published one when `weight` is the values of one of
    /// `weights.published` (the loader checked its tensors against `[rows, cols]`).
    pub(super) fn bind(
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
            input_quant: None,
            tiles: None,
            strips: None,
        })
    }

    /// The quantized planes, if quantized.
    #[inline]
    pub(super) fn quant_matrix(&self) -> Option<QuantMatrix<'_>> {
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
    pub(super) fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix { dtype: self.dtype, rows: self.rows, cols: self.cols, data: self.weight.bytes() }
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows) (+ b)`: int8 activations over the
    /// quantized planes when quantized, else BF16 inputs when `bf16` names the kernels, else f32 (`p`
    /// receives the quantized or rounded `x`).
    #[inline]
    pub(super) fn forward(&self, mm: Matmul<'_>, x: &[f32], n: usize, y: &mut [f32], p: &mut ProductScratch) {
        self.product(mm, x, n, y, p);
        self.add_bias(y);
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows)`, without the bias (the input quantized
    /// first where the layer's scheme says so).
    #[inline]
    pub(super) fn product(&self, mm: Matmul<'_>, x: &[f32], n: usize, y: &mut [f32], p: &mut ProductScratch) {
        let ProductScratch { xb, xq, xa } = p;
        let x = match &self.input_quant {
            Some(q) => {
                // (n, cols) -> (n, cols): each token's values through the scheme's rounding.
                let xa = &mut xa[..n * self.cols];
                q.apply(&x[..n * self.cols], self.cols, xa);
                &*xa
            }
            None => x,
        };
        self.product_on(mm, x, n, y, xb, xq);
    }

    /// [`Linear::product`] of an input already in the form this layer reads.
    #[inline]
    fn product_on(&self, mm: Matmul<'_>, x: &[f32], n: usize, y: &mut [f32], xb: &mut [u16], xq: &mut [u8]) {
        match (self.quant_matrix(), mm.bf16, &self.tiles) {
            (Some(q), _, _) => q.matmul(mm.pool, x, n, xq, y),
            (None, Some(Bf16Kernels::Amx), Some(tiles)) => {
                matmul_many_bf16_tiles(mm.pool, x, n, xb, &mut [(tiles.matrix(), y)])
            }
            (None, Some(k), _) => kernels::matmul_many_bf16(mm.pool, k, x, n, xb, &mut [(self.matrix(), y)]),
            (None, None, _) => match &self.strips {
                Some(strips) => matmul_many_strips(mm.pool, x, n, &mut [(strips.matrix(), y)]),
                None => kernels::matmul(mm.pool, self.matrix(), x, n, y),
            },
        }
    }

    /// Under `Precision::Bf16` on AMX, copies a BF16 weight into AMX tile order for the
    /// products ([`kernels::bf16_tiles`]: the same bits, decode reading whole 1 KiB tiles in
    /// sequence) and lets the map's pages of the row-major weight go (a later read, such as a
    /// tied head's embedding lookup, faults them back in from the file). Leaves quantized
    /// layers, other dtypes and shapes that are not whole 16 × 32 tiles as they are.
    pub(super) fn tile_for_amx(&mut self) {
        if self.tiles.is_some() || self.quant.is_some() || self.dtype != WeightDType::BF16 {
            return;
        }
        self.tiles = Bf16TileBuffer::new(self.matrix()).map(Arc::new);
        if self.tiles.is_some() {
            self.weight.advise_dont_need();
        }
    }

    /// On AVX2 without AVX-512, where every float weight's products run in f32, copies the
    /// weight into 16-row strips ([`kernels::strips`]: every output one chain of fused
    /// multiply-adds over the columns, for prefill's outer-product tile and decode's four
    /// sequential streams) and lets the map's pages of the row-major weight go, as
    /// [`Linear::tile_for_amx`] does. Leaves quantized layers as they are, and weights made at
    /// load (a published checkpoint decoded to f32): their owned bytes would stay beside the
    /// copy.
    pub(super) fn strip_for_avx2(&mut self) {
        if self.strips.is_some() || self.quant.is_some() || !self.weight.is_mapped() {
            return;
        }
        self.strips = StripBuffer::new(self.matrix()).map(Arc::new);
        if self.strips.is_some() {
            self.weight.advise_dont_need();
        }
    }

    /// `y (n, rows) += b` on every row, when the layer has a bias.
    #[inline]
    pub(super) fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.rows) {
                kernels::add_bias(row, bias.view());
            }
        }
    }

    /// Several linear layers over the same input in one pool job:
    /// `y_i (n, rows_i) = x (n, cols) · W_iᵀ (cols, rows_i) (+ b_i)`.
    #[inline]
    pub(super) fn forward_many<const N: usize>(
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
        // The layers of one input share their scheme's input quantization (computed once),
        // unless a checkpoint's ignore list or a static scheme's per-layer input scales set
        // them apart: one product each then.
        let input_quant = linears.first().and_then(|l| l.input_quant);
        if linears.iter().any(|l| l.input_quant != input_quant) {
            for (l, y) in layers.iter_mut() {
                l.product(mm, x, n, y, p);
                l.add_bias(y);
            }
            return;
        }
        let ProductScratch { xb, xq, xa } = p;
        let x = match (&input_quant, linears.first()) {
            (Some(q), Some(l)) => {
                // (n, cols) -> (n, cols): each token's values through the scheme's rounding.
                let xa = &mut xa[..n * l.cols];
                q.apply(&x[..n * l.cols], l.cols, xa);
                &*xa
            }
            _ => x,
        };
        let planes = linears.map(Linear::quant_matrix);
        let quantized = planes.iter().filter(|q| q.is_some()).count();
        if quantized == N {
            let mut planes = planes.into_iter().flatten();
            let mut mats = layers.each_mut().map(|(_, y)| (planes.next().expect("counted above"), &mut **y));
            kernels::quant::matmul_many_quant(mm.pool, x, n, xq, &mut mats);
        } else if quantized == 0 && mm.bf16 == Some(Bf16Kernels::Amx) && linears.iter().all(|l| l.tiles.is_some()) {
            let mut mats: [(WeightMatrix<'_>, &mut [f32]); N] =
                layers.each_mut().map(|(l, y)| (l.tiles.as_ref().expect("checked above").matrix(), &mut **y));
            matmul_many_bf16_tiles(mm.pool, x, n, xb, &mut mats);
        } else if quantized == 0 && mm.bf16.is_none() && linears.iter().all(|l| l.strips.is_some()) {
            let mut mats: [(StripMatrix<'_>, &mut [f32]); N] =
                layers.each_mut().map(|(l, y)| (l.strips.as_ref().expect("checked above").matrix(), &mut **y));
            matmul_many_strips(mm.pool, x, n, &mut mats);
        } else if quantized == 0
            && !(mm.bf16 == Some(Bf16Kernels::Amx) && linears.iter().any(|l| l.tiles.is_some()))
            && !(mm.bf16.is_none() && linears.iter().any(|l| l.strips.is_some()))
        {
            let mut mats: [(WeightMatrix<'_>, &mut [f32]); N] = layers.each_mut().map(|(l, y)| (l.matrix(), &mut **y));
            match mm.bf16 {
                Some(k) => kernels::matmul_many_bf16(mm.pool, k, x, n, xb, &mut mats),
                None => kernels::matmul_many(mm.pool, x, n, &mut mats),
            }
        } else {
            for (l, y) in layers.iter_mut() {
                l.product_on(mm, x, n, y, xb, xq);
            }
        }
        for (l, y) in layers.iter_mut() {
            l.add_bias(y);
        }
    }

    pub(super) fn element_count(&self) -> u64 {
        (self.rows * self.cols) as u64 + self.bias.as_ref().map_or(0, |b| b.tensor.element_count() as u64)
    }

    /// Bytes the products read: the quantized planes when quantized, else the stored weight.
    pub(super) fn byte_len(&self) -> u64 {
        let weight = self.quant_matrix().map_or(self.weight.byte_len(), |q| q.byte_len());
        weight as u64 + self.bias.as_ref().map_or(0, |b| b.tensor.byte_len() as u64)
    }
}

/// What [`Model::prepare_published`] decodes a published matrix into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PublishedDecode {
    /// f32 weights, exactly `scale · (q − zero)`, and the input quantized as the scheme says
    /// ([`InputQuant`]).
    F32,
    /// BF16 weights (the f32 values rounded to nearest even), for the BF16 kernels.
    Bf16,
    /// The integer kernels' planes: BF16 activations (the `_a16` packings) for the weight-only
    /// schemes where the CPU has those kernels, int8 activations otherwise.
    Integer,
    /// The integer kernels' planes with int8 activations everywhere (`--precision int8`).
    Int8,
}

/// Decodes one pending published matrix in place (see [`Model::prepare_published`]); returns
/// the packing chosen. A float linear (a module the checkpoint left unquantized) becomes Q8_0
/// for the integer kernels and stays as stored otherwise.
pub(super) fn decode_published(linear: &mut Linear, mode: PublishedDecode) -> Result<Option<Packing>> {
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
        PublishedDecode::Integer | PublishedDecode::Int8 => None,
    };
    if let Some((dtype, kernel_dtype)) = float_dtype {
        if mode == PublishedDecode::F32 {
            // What compressed-tensors computes: the scheme's input quantization, then the
            // product with the dequantized weights.
            linear.input_quant = InputQuant::new(&m)?;
        }
        linear.weight = owned_weights(format!("{}.weight", m.module), dtype, rows, cols, &m.dequantize()?)?;
        linear.dtype = kernel_dtype;
        linear.quant = None;
        release_published(&m);
        return Ok(None);
    }
    // 16-bit activations, as the weight-only schemes (A16) and FP8 intend, where the CPU has
    // the BF16 kernels (`kylin_kernels::w16`); int8 activations for W8A8, under
    // `--precision int8` and elsewhere.
    let a16 = mode == PublishedDecode::Integer && kernels::w16::available() && !m.int8_activations;
    if a16 && let Some((codes, scales)) = m.fp8_codes()? {
        let mut buffer =
            QuantBuffer::zeroed(Packing::F8A16, rows, cols).ok_or_else(|| packing_error(&m, "f8_e4m3_a16"))?;
        let (quants, planes) = buffer.planes_mut();
        kernels::w16::pack_f8(rows, cols, codes, &scales, quants, planes);
        linear.quant = Some(QuantSource::Owned(Arc::new(buffer)));
        release_published(&m);
        return Ok(Some(Packing::F8A16));
    }
    if m.scheme == kylin_loader::published::Scheme::Mxfp4 {
        // MXFP4 experts keep their 4-bit codes and E8M0 scales, repacked for the kernels.
        let mut buffer = QuantBuffer::zeroed(Packing::Mxfp4, rows, cols).ok_or_else(|| packing_error(&m, "mxfp4"))?;
        let (quants, planes) = buffer.planes_mut();
        kernels::mxfp4::pack_mxfp4(rows, cols, m.values.bytes(), m.scale.bytes(), &|r| r, quants, planes).map_err(
            |(row, block)| {
                KylinError::file_corrupted(format!(
                    "tensor '{}' row {row} block {block} has the E8M0 scale 255 (NaN)",
                    m.scale.name
                ))
            },
        )?;
        linear.quant = Some(QuantSource::Owned(Arc::new(buffer)));
        release_published(&m);
        return Ok(Some(Packing::Mxfp4));
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
        // FP8 with a scale per whole block of 32 (every published layout), row by row.
        None if cols.is_multiple_of(QK8_0)
            && let Some((codes, scales)) = m.fp8_codes()? =>
        {
            fp8_q8_0(rows, cols, codes, &scales).ok_or_else(|| packing_error(&m, "q8_0"))?
        }
        // Activation order, asymmetric 8-bit, FP8 scales that split a block of 32: dequantized,
        // then Q8_0 (FP8 E4M3 holds 3 mantissa bits; Q8_0's grid is finer).
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

/// FP8 E4M3 codes (row-major `[rows, cols]`, none NaN) with a scale per row and block of 32
/// (`[rows, cols / 32]`) as Q8_0: each row's weights widened from their codes and quantized in
/// turn, the bytes [`quantize_q8_0`] makes of the dequantized matrix without an f32 copy of it.
/// `None` when the columns are not whole blocks of 32 or the planes' size overflows.
fn fp8_q8_0(rows: usize, cols: usize, codes: &[u8], scales: &[f32]) -> Option<QuantBuffer> {
    use kylin_kernels::quant::QK8_0;
    let mut buffer = QuantBuffer::zeroed(Packing::Q8_0, rows, cols)?;
    let blocks = cols / QK8_0;
    let (mut q, mut q_scales) = (vec![0i8; rows * cols], vec![0.0f32; rows * blocks]);
    let (mut row, mut row_scales) = (vec![0.0f32; cols], vec![0u16; blocks]);
    let rows_out = q.chunks_exact_mut(cols).zip(q_scales.chunks_exact_mut(blocks));
    for (r, (q, q_scales)) in rows_out.enumerate() {
        let row_codes = codes[r * cols..(r + 1) * cols].chunks_exact(QK8_0);
        for ((out, codes), &scale) in row.chunks_exact_mut(QK8_0).zip(row_codes).zip(&scales[r * blocks..]) {
            for (o, &code) in out.iter_mut().zip(codes) {
                *o = kylin_loader::published::fp8_e4m3_to_f32(code) * scale;
            }
        }
        kylin_kernels::quant::quantize_row_q8_0(&row, q, &mut row_scales);
        // The f16 scales in f32, exactly; `pack_q8_0` rounds them back to the same bits.
        for (o, &h) in q_scales.iter_mut().zip(&row_scales) {
            *o = half::f16::from_bits(h).to_f32();
        }
    }
    let (quants, planes) = buffer.planes_mut();
    kylin_kernels::quant::pack_q8_0(rows, cols, &q, &q_scales, quants, planes);
    Some(buffer)
}

/// Releases a decoded matrix's stored tensors from resident memory (the map stays), so the
/// peak is near the decoded size, not the sum of both.
pub(super) fn release_published(m: &kylin_loader::published::PublishedMatrix) {
    for t in [Some(&m.values), Some(&m.scale), m.zero.as_ref(), m.g_idx.as_ref()].into_iter().flatten() {
        t.advise_dont_need();
    }
}

/// `values` as little-endian f32 bytes.
pub(super) fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// An owned `[rows, cols]` weight tensor of `values` stored as `dtype` (F32 or BF16).
pub(super) fn owned_weights(
    name: String,
    dtype: DType,
    rows: usize,
    cols: usize,
    values: &[f32],
) -> Result<WeightTensor> {
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
pub(super) fn quantize_q8_0(w: WeightMatrix<'_>, name: &str) -> Result<QuantBuffer> {
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

pub(super) fn packing_error(m: &kylin_loader::published::PublishedMatrix, packing: &str) -> KylinError {
    KylinError::operator_unsupported(format!(
        "module '{}' ([{}, {}]) cannot be packed as {packing}: its columns must be whole blocks of 32 (64 for 4 bits); run it with --precision f32",
        m.module, m.rows, m.cols
    ))
}

/// An RMSNorm's weight and how it scales (`w` or Gemma's `1 + w`).
#[derive(Debug, Clone)]
pub(super) struct Norm {
    pub(super) weight: Vector,
    pub(super) unit_offset: bool,
}

impl Norm {
    pub(super) fn new(tensor: &WeightTensor, len: usize, kind: NormKind) -> Result<Self> {
        Ok(Norm { weight: Vector::new(tensor, len)?, unit_offset: kind == NormKind::RmsUnitOffset })
    }

    /// An RMSNorm without a weight (Gemma 4's `with_scale=False`): a weight of ones, which
    /// multiplies by exactly one.
    pub(super) fn unweighted(len: usize) -> Norm {
        let bytes = 1.0f32.to_le_bytes().repeat(len);
        let tensor = WeightTensor::owned("(ones)".into(), DType::F32, vec![len], bytes)
            .expect("len f32 values make a [len] tensor");
        Norm { weight: Vector { tensor, dtype: WeightDType::F32 }, unit_offset: false }
    }

    /// `out (len) = rmsnorm(x (len))`.
    #[inline]
    pub(super) fn apply(&self, x: &[f32], eps: f32, out: &mut [f32]) {
        if self.unit_offset {
            kernels::rms_norm_unit_offset(x, self.weight.view(), eps, out);
        } else {
            kernels::rms_norm(x, self.weight.view(), eps, out);
        }
    }

    /// Every row of `x (rows, width)` into `out (rows, width)`, rows split over `pool`.
    pub(super) fn rows(&self, pool: &ThreadPool, x: &[f32], width: usize, eps: f32, out: &mut [f32]) {
        super::for_row_slices(pool, &mut out[..x.len()], width, &|rows, out| {
            for (x, out) in x[rows.start * width..rows.end * width].chunks_exact(width).zip(out.chunks_exact_mut(width))
            {
                self.apply(x, eps, out);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FP8 weights quantized to Q8_0 row by row are byte for byte what quantizing the
    /// dequantized matrix gives: every code (subnormals and both zeros included), scales of
    /// many magnitudes, a last group of rows cut short.
    #[test]
    fn fp8_rows_quantize_to_the_bytes_of_the_dequantized_matrix() {
        let (rows, cols) = (21usize, 96usize);
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let codes: Vec<u8> = (0..rows * cols)
            .map(|i| if i < 256 { i as u8 } else { next() as u8 })
            .map(|b| if b & 0x7F == 0x7F { 0x80 } else { b })
            .collect();
        let scales: Vec<f32> = (0..rows * cols / 32)
            .map(|i| (1.0 + (next() % 1000) as f32 / 999.0) * (2.0f32).powi(i as i32 % 24 - 16))
            .collect();
        let got = fp8_q8_0(rows, cols, &codes, &scales).unwrap();
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                kylin_loader::published::fp8_e4m3_to_f32(codes[i]) * scales[(i / cols) * (cols / 32) + (i % cols) / 32]
            })
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let want = quantize_q8_0(WeightMatrix { dtype: WeightDType::F32, rows, cols, data: &bytes }, "m").unwrap();
        let (got, want) = (got.matrix(), want.matrix());
        assert!(got.quants() == want.quants(), "quants differ");
        assert!(got.scales() == want.scales(), "scales differ");
    }
}
