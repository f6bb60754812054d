//! The bidirectional encoder (BERT, RoBERTa, XLM-RoBERTa) and what turns its states into
//! embeddings (pooling, normalisation, Matryoshka truncation) or relevance scores (a
//! cross-encoder's classifier).
//!
//! Guarantees:
//! - Weights are read in place from the loader's views, in their stored dtype; nothing is
//!   copied.
//! - Compute is float32 in transformers' order of operations for `BertModel` /
//!   `XLMRobertaModel` (eager attention): embeddings summed then LayerNorm, post-norm layers
//!   (`LN(x + attention(x))`, `LN(x + FFN(x))`), erf GELU, full (bidirectional) attention over
//!   each sequence, never across sequences of a batch.
//! - A sequence's output does not depend on its batch: the products are the kernels' batch
//!   invariant matmul and attention runs per sequence and head.
//! - Inputs are checked before anything runs: ids inside the vocabulary, lengths within the
//!   position table (`CONTEXT_OVERFLOW` naming both numbers). A batch is cut into forward
//!   passes of at most `max_batch_tokens` tokens, so buffers are bounded by the options, not
//!   by a request.

use kylin_kernels::{self as kernels, ThreadPool, WeightDType, WeightMatrix, WeightVector};
use kylin_loader::encoder::{EncoderConfig, LoadedEncoder, Pooling, SentenceConfig};
use kylin_loader::{DType, KylinError, Result, WeightTensor};

/// One tokenized input: ids and token types (segment ids: 0 for a single text, 0 then 1 for a
/// pair under BERT).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EncoderInput {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
}

impl EncoderInput {
    /// A single text's ids, all of token type 0.
    pub fn single(ids: Vec<u32>) -> Self {
        let type_ids = vec![0; ids.len()];
        EncoderInput { ids, type_ids }
    }
}

/// Every element of a tensor widened to f32, in storage order (for small tensors read once at
/// load: norms, scalars, a projector).
pub(crate) fn widened(t: &WeightTensor) -> Result<Vec<f32>> {
    let v = WeightVector { dtype: dtype_of(t)?, data: t.bytes() };
    Ok((0..v.len()).map(|i| v.get(i)).collect())
}

pub(crate) fn dtype_of(t: &WeightTensor) -> Result<WeightDType> {
    match t.dtype {
        DType::F32 => Ok(WeightDType::F32),
        DType::F16 => Ok(WeightDType::F16),
        DType::BF16 => Ok(WeightDType::BF16),
        other => Err(KylinError::tensor_dtype_unsupported(format!(
            "tensor '{}' is {}; the encoder reads F32, F16 or BF16",
            t.name,
            other.as_str()
        ))),
    }
}

/// A linear layer `y = x · Wᵀ + b` over a checkpoint's tensors.
#[derive(Debug, Clone)]
pub(crate) struct Dense {
    weight: WeightTensor,
    dtype: WeightDType,
    /// The bias and its dtype, if the layer has one.
    bias: Option<(WeightTensor, WeightDType)>,
    rows: usize,
    cols: usize,
}

impl Dense {
    fn bind(e: &LoadedEncoder, role: &str) -> Result<Self> {
        Dense::new(e.tensor(&format!("{role}.weight"))?, e.tensor(&format!("{role}.bias"))?)
    }

    /// Over a weight of shape `[rows, ...]` (the trailing dimensions are the columns, as a
    /// convolution whose kernel equals its stride is a matrix over each patch) and its bias.
    pub(crate) fn new(weight: &WeightTensor, bias: &WeightTensor) -> Result<Self> {
        let mut dense = Dense::without_bias(weight)?;
        dense.bias = Some((bias.clone(), dtype_of(bias)?));
        Ok(dense)
    }

    /// Over a weight of shape `[rows, ...]` alone: `y = x · Wᵀ`.
    pub(crate) fn without_bias(weight: &WeightTensor) -> Result<Self> {
        Ok(Dense {
            dtype: dtype_of(weight)?,
            bias: None,
            rows: weight.shape.first().copied().unwrap_or(0),
            cols: weight.shape.get(1..).unwrap_or(&[]).iter().product(),
            weight: weight.clone(),
        })
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix { dtype: self.dtype, rows: self.rows, cols: self.cols, data: self.weight.bytes() }
    }

    fn add_bias(&self, y: &mut [f32]) {
        let Some((bias, dtype)) = &self.bias else { return };
        let b = WeightVector { dtype: *dtype, data: bias.bytes() };
        for row in y.chunks_exact_mut(self.rows) {
            kernels::add_bias(row, b);
        }
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows) (+ b)` through the packed prefill product
    /// (`kernels::gemm_packed`: its own fixed order, not the GEMV's), for the vision towers.
    pub(crate) fn forward_packed(&self, pool: &ThreadPool, x: &[f32], n: usize, y: &mut [f32]) {
        kernels::gemm_packed(pool, self.matrix(), x, n, y);
        self.add_bias(y);
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows) (+ b)`.
    pub(crate) fn forward(&self, pool: &ThreadPool, x: &[f32], n: usize, y: &mut [f32]) {
        kernels::matmul(pool, self.matrix(), x, n, y);
        self.add_bias(y);
    }
}

/// LayerNorm with weight and bias: `(x - mean) / sqrt(var + eps) · w + b` per row.
#[derive(Debug, Clone)]
pub(crate) struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    eps: f32,
}

impl LayerNorm {
    fn bind(e: &LoadedEncoder, role: &str, eps: f32) -> Result<Self> {
        LayerNorm::new(e.tensor(&format!("{role}.weight"))?, e.tensor(&format!("{role}.bias"))?, eps)
    }

    pub(crate) fn new(weight: &WeightTensor, bias: &WeightTensor, eps: f32) -> Result<Self> {
        // Two vectors of `hidden` floats: the norms' parameters are widened once (a few KiB).
        Ok(LayerNorm { weight: widened(weight)?, bias: widened(bias)?, eps })
    }

    /// Normalises every row of `x (n, hidden)` in place.
    pub(crate) fn rows(&self, x: &mut [f32]) {
        let h = self.weight.len();
        for row in x.chunks_exact_mut(h) {
            // Mean and variance as PyTorch's CPU kernel computes them (biased variance), in
            // f64 here so the row's statistics are exact to f32 precision.
            let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / h as f64;
            let var = row.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (var + f64::from(self.eps)).sqrt();
            for ((v, &w), &b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
                *v = ((f64::from(*v) - mean) * inv) as f32 * w + b;
            }
        }
    }
}

/// The error function, to f32 precision (Abramowitz and Stegun 7.1.26 in f64: |error| below
/// 1.5e-7, about one f32 ulp near 1).
fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let poly =
        t * (0.254_829_592 + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let y = 1.0 - poly * (-x * x).exp();
    if x < 0.0 { -y } else { y }
}

/// `gelu(x) = x/2 · (1 + erf(x / √2))` in place (transformers' `gelu`).
pub(crate) fn gelu(x: &mut [f32]) {
    for v in x {
        let f = f64::from(*v);
        *v = (0.5 * f * (1.0 + erf(f * std::f64::consts::FRAC_1_SQRT_2))) as f32;
    }
}

#[derive(Debug, Clone)]
struct Layer {
    query: Dense,
    key: Dense,
    value: Dense,
    attention_out: Dense,
    attention_norm: LayerNorm,
    intermediate: Dense,
    output: Dense,
    output_norm: LayerNorm,
}

/// A cross-encoder's classifier on the first token: `out(tanh(dense(x₀)))`.
#[derive(Debug, Clone)]
struct Classifier {
    dense: Dense,
    out: Dense,
}

/// What the encoder's batch buffers are sized for.
#[derive(Debug, Clone, Copy)]
pub struct EncoderOptions {
    pub threads: usize,
    /// Tokens in one forward pass; a longer batch runs in several.
    pub max_batch_tokens: usize,
}

impl Default for EncoderOptions {
    fn default() -> Self {
        EncoderOptions { threads: 1, max_batch_tokens: 8192 }
    }
}

/// The encoder model with its pooling and its planned buffers.
pub struct Encoder {
    config: EncoderConfig,
    sentence: Option<SentenceConfig>,
    word: WeightTensor,
    position: WeightTensor,
    token_type: WeightTensor,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
    classifier: Option<Classifier>,
    pool: ThreadPool,
    max_batch_tokens: usize,
    scratch: EncoderScratch,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder").field("config", &self.config).finish()
    }
}

/// Activations of one forward pass, `(tokens, width)` each; grown to the largest batch seen,
/// at most `max_batch_tokens`.
#[derive(Debug, Default)]
struct EncoderScratch {
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    inter: Vec<f32>,
}

impl Encoder {
    /// Binds the loaded tensors (views, no copy) and checks the options.
    pub fn new(loaded: &LoadedEncoder, opts: EncoderOptions) -> Result<Self> {
        let c = loaded.config.clone();
        if opts.max_batch_tokens == 0 {
            return Err(KylinError::config_invalid("--max-batch-tokens must be at least 1; got 0"));
        }
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let p = |r: &str| format!("layer.{l}.{r}");
            layers.push(Layer {
                query: Dense::bind(loaded, &p("query"))?,
                key: Dense::bind(loaded, &p("key"))?,
                value: Dense::bind(loaded, &p("value"))?,
                attention_out: Dense::bind(loaded, &p("attention_out"))?,
                attention_norm: LayerNorm::bind(loaded, &p("attention_norm"), c.layer_norm_eps)?,
                intermediate: Dense::bind(loaded, &p("intermediate"))?,
                output: Dense::bind(loaded, &p("output"))?,
                output_norm: LayerNorm::bind(loaded, &p("output_norm"), c.layer_norm_eps)?,
            });
        }
        let classifier = match c.num_labels {
            Some(_) => Some(Classifier {
                dense: Dense::bind(loaded, "classifier.dense")?,
                out: Dense::bind(loaded, "classifier.out")?,
            }),
            None => None,
        };
        for role in ["embeddings.word", "embeddings.position", "embeddings.token_type"] {
            dtype_of(loaded.tensor(role)?)?;
        }
        Ok(Encoder {
            sentence: loaded.sentence.clone(),
            word: loaded.tensor("embeddings.word")?.clone(),
            position: loaded.tensor("embeddings.position")?.clone(),
            token_type: loaded.tensor("embeddings.token_type")?.clone(),
            embed_norm: LayerNorm::bind(loaded, "embeddings.norm", c.layer_norm_eps)?,
            layers,
            classifier,
            pool: ThreadPool::new(opts.threads.max(1)),
            max_batch_tokens: opts.max_batch_tokens.max(c.max_tokens()),
            scratch: EncoderScratch::default(),
            config: c,
        })
    }

    pub fn config(&self) -> &EncoderConfig {
        &self.config
    }

    pub fn sentence(&self) -> Option<&SentenceConfig> {
        self.sentence.as_ref()
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The longest input, in tokens: the position table's, or sentence-transformers'
    /// `max_seq_length` when it is shorter.
    pub fn max_tokens(&self) -> usize {
        let table = self.config.max_tokens();
        self.sentence.as_ref().and_then(|s| s.max_seq_length).map_or(table, |m| m.min(table))
    }

    /// The pooling applied by [`Encoder::embed`]: the directory's, else the mean (no
    /// sentence-transformers files).
    pub fn pooling(&self) -> Pooling {
        self.sentence.as_ref().map_or(Pooling::Mean, |s| s.pooling)
    }

    /// Whether [`Encoder::embed`] normalises to unit length.
    pub fn normalizes(&self) -> bool {
        self.sentence.as_ref().is_some_and(|s| s.normalize)
    }

    /// Whether the model is a cross-encoder (a classifier on the first token).
    pub fn is_cross_encoder(&self) -> bool {
        self.classifier.is_some()
    }

    /// Checks one input: non-empty, ids in the vocabulary, types in the table, length within
    /// [`Encoder::max_tokens`].
    pub fn check(&self, input: &EncoderInput) -> Result<()> {
        let c = &self.config;
        if input.ids.is_empty() {
            return Err(KylinError::input_invalid("an input has no tokens"));
        }
        if input.ids.len() != input.type_ids.len() {
            return Err(KylinError::input_invalid("an input's token types do not match its tokens"));
        }
        let max = self.max_tokens();
        if input.ids.len() > max {
            return Err(KylinError::context_overflow(format!(
                "an input has {} tokens, but this model reads at most {max}; shorten it",
                input.ids.len()
            )));
        }
        if let Some(&bad) = input.ids.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(KylinError::input_invalid(format!(
                "token id {bad} is outside the model's vocabulary of {} ids",
                c.vocab_size
            )));
        }
        if let Some(&bad) = input.type_ids.iter().find(|&&t| t as usize >= c.type_vocab_size) {
            return Err(KylinError::input_invalid(format!(
                "token type {bad} is outside the model's {} token types",
                c.type_vocab_size
            )));
        }
        Ok(())
    }

    /// The last layer's states of every input, one `(len, hidden)` matrix each (row-major).
    pub fn hidden_states(&mut self, inputs: &[EncoderInput]) -> Result<Vec<Vec<f32>>> {
        for input in inputs {
            self.check(input)?;
        }
        let h = self.config.hidden;
        let mut out = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            // As many inputs as fit in one forward pass (at least one: each fits alone).
            let mut end = start;
            let mut tokens = 0;
            while end < inputs.len() && (end == start || tokens + inputs[end].ids.len() <= self.max_batch_tokens) {
                tokens += inputs[end].ids.len();
                end += 1;
            }
            self.forward(&inputs[start..end], tokens);
            let mut t0 = 0;
            for input in &inputs[start..end] {
                let n = input.ids.len();
                out.push(self.scratch.x[t0 * h..(t0 + n) * h].to_vec());
                t0 += n;
            }
            start = end;
        }
        Ok(out)
    }

    /// One embedding per input: the directory's pooling over the last states, normalised when
    /// its `modules.json` says so.
    pub fn embed(&mut self, inputs: &[EncoderInput]) -> Result<Vec<Vec<f32>>> {
        let states = self.hidden_states(inputs)?;
        let (pooling, normalize) = (self.pooling(), self.normalizes());
        let h = self.config.hidden;
        Ok(states.iter().map(|s| finish_embedding(pool_states(s, h, pooling), normalize)).collect())
    }

    /// A cross-encoder's raw logits for every input, `num_labels` each.
    pub fn classify(&mut self, inputs: &[EncoderInput]) -> Result<Vec<Vec<f32>>> {
        let Some(classifier) = self.classifier.clone() else {
            return Err(KylinError::input_invalid(
                "this encoder has no classification head (it is not a cross-encoder)",
            ));
        };
        let states = self.hidden_states(inputs)?;
        let h = self.config.hidden;
        // The first token of each input: (inputs, hidden) -> dense -> tanh -> (inputs, labels).
        let first: Vec<f32> = states.iter().flat_map(|s| s[..h].iter().copied()).collect();
        let n = states.len();
        let mut mid = vec![0.0f32; n * h];
        classifier.dense.forward(&self.pool, &first, n, &mut mid);
        for v in &mut mid {
            *v = v.tanh();
        }
        let labels = classifier.out.rows;
        let mut logits = vec![0.0f32; n * labels];
        classifier.out.forward(&self.pool, &mid, n, &mut logits);
        Ok(logits.chunks_exact(labels).map(<[f32]>::to_vec).collect())
    }

    /// The forward pass over `inputs` (`tokens` in all); the last states end in `scratch.x`.
    fn forward(&mut self, inputs: &[EncoderInput], tokens: usize) {
        let c = &self.config;
        let (h, inter, heads, hd) = (c.hidden, c.intermediate, c.heads, c.head_dim());
        let s = &mut self.scratch;
        for (buffer, width) in [
            (&mut s.x, h),
            (&mut s.q, h),
            (&mut s.k, h),
            (&mut s.v, h),
            (&mut s.attn, h),
            (&mut s.proj, h),
            (&mut s.inter, inter),
        ] {
            if buffer.len() < tokens * width {
                buffer.resize(tokens * width, 0.0);
            }
        }
        let n = tokens;
        let word = WeightMatrix {
            dtype: dtype_of(&self.word).unwrap_or(WeightDType::F32),
            rows: c.vocab_size,
            cols: h,
            data: self.word.bytes(),
        };
        let position = WeightMatrix {
            dtype: dtype_of(&self.position).unwrap_or(WeightDType::F32),
            rows: c.max_position_embeddings,
            cols: h,
            data: self.position.bytes(),
        };
        let types = WeightMatrix {
            dtype: dtype_of(&self.token_type).unwrap_or(WeightDType::F32),
            rows: c.type_vocab_size,
            cols: h,
            data: self.token_type.bytes(),
        };

        // 1. Embeddings: word + position + token type (n, hidden), then LayerNorm.
        let mut row = vec![0.0f32; h];
        let mut t = 0;
        for input in inputs {
            for (p, (&id, &tt)) in input.ids.iter().zip(&input.type_ids).enumerate() {
                let x = &mut s.x[t * h..(t + 1) * h];
                kernels::widen_row(word, id as usize, x);
                kernels::widen_row(types, tt as usize, &mut row);
                kernels::add_assign(x, &row);
                kernels::widen_row(position, c.position_offset + p, &mut row);
                kernels::add_assign(x, &row);
                t += 1;
            }
        }
        self.embed_norm.rows(&mut s.x[..n * h]);

        // 2. The layers: x = LN(x + O·attention(Q, K, V)); x = LN(x + W₂·gelu(W₁·x)).
        let scale = 1.0 / (hd as f32).sqrt();
        let max_len = inputs.iter().map(|i| i.ids.len()).max().unwrap_or(0);
        let mut keys = vec![0.0f32; max_len * hd];
        let mut values = vec![0.0f32; max_len * hd];
        let mut scores = vec![0.0f32; max_len];
        for layer in &self.layers {
            // x (n, h) -> q, k, v (n, h) each.
            let x = &s.x[..n * h];
            kernels::matmul_many(
                &self.pool,
                x,
                n,
                &mut [
                    (layer.query.matrix(), &mut s.q[..n * h]),
                    (layer.key.matrix(), &mut s.k[..n * h]),
                    (layer.value.matrix(), &mut s.v[..n * h]),
                ],
            );
            layer.query.add_bias(&mut s.q[..n * h]);
            layer.key.add_bias(&mut s.k[..n * h]);
            layer.value.add_bias(&mut s.v[..n * h]);
            // Per sequence and head: keys and values gathered into (len, head_dim), every query
            // row attending to every position of its sequence (no mask: bidirectional).
            let mut t0 = 0;
            for input in inputs {
                let len = input.ids.len();
                for head in 0..heads {
                    for p in 0..len {
                        let src = (t0 + p) * h + head * hd;
                        keys[p * hd..(p + 1) * hd].copy_from_slice(&s.k[src..src + hd]);
                        values[p * hd..(p + 1) * hd].copy_from_slice(&s.v[src..src + hd]);
                    }
                    for p in 0..len {
                        let at = (t0 + p) * h + head * hd;
                        kernels::attention_head(
                            &s.q[at..at + hd],
                            &keys,
                            &values,
                            len,
                            hd,
                            scale,
                            &mut scores,
                            &mut s.attn[at..at + hd],
                        );
                    }
                }
                t0 += len;
            }
            // attn (n, h) -> proj (n, h); x = LN(x + proj).
            layer.attention_out.forward(&self.pool, &s.attn[..n * h], n, &mut s.proj[..n * h]);
            kernels::add_assign(&mut s.x[..n * h], &s.proj[..n * h]);
            layer.attention_norm.rows(&mut s.x[..n * h]);
            // x (n, h) -> inter (n, intermediate) -> gelu -> proj (n, h); x = LN(x + proj).
            layer.intermediate.forward(&self.pool, &s.x[..n * h], n, &mut s.inter[..n * inter]);
            gelu(&mut s.inter[..n * inter]);
            layer.output.forward(&self.pool, &s.inter[..n * inter], n, &mut s.proj[..n * h]);
            kernels::add_assign(&mut s.x[..n * h], &s.proj[..n * h]);
            layer.output_norm.rows(&mut s.x[..n * h]);
        }
    }
}

/// Pools `states (len, hidden)` into one vector.
pub fn pool_states(states: &[f32], hidden: usize, pooling: Pooling) -> Vec<f32> {
    let len = states.len() / hidden.max(1);
    let rows = states.chunks_exact(hidden);
    match pooling {
        Pooling::Cls => states[..hidden].to_vec(),
        Pooling::LastToken => states[(len - 1) * hidden..len * hidden].to_vec(),
        Pooling::Max => {
            let mut out = vec![f32::NEG_INFINITY; hidden];
            for row in rows {
                for (o, &v) in out.iter_mut().zip(row) {
                    *o = o.max(v);
                }
            }
            out
        }
        Pooling::Mean | Pooling::MeanSqrtLen => {
            // Summed in f32 in position order, as torch.sum over the sequence does.
            let mut sum = vec![0.0f32; hidden];
            for row in rows {
                for (o, &v) in sum.iter_mut().zip(row) {
                    *o += v;
                }
            }
            let div = if pooling == Pooling::Mean { len as f32 } else { (len as f32).sqrt() };
            sum.iter_mut().for_each(|v| *v /= div);
            sum
        }
    }
}

/// Divides by the L2 norm when `normalize` (sentence-transformers' `Normalize`, with its floor
/// of 1e-12).
pub fn finish_embedding(mut v: Vec<f32>, normalize: bool) -> Vec<f32> {
    if normalize {
        normalize_in_place(&mut v);
    }
    v
}

/// `v / max(‖v‖₂, 1e-12)` in place.
pub fn normalize_in_place(v: &mut [f32]) {
    let norm = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt().max(1e-12);
    for x in v {
        *x = (f64::from(*x) / norm) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_accurate_to_f32() {
        // Reference values of erf.
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (-2.0, -0.995_322_265_018_952_7),
        ] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x})");
        }
    }

    #[test]
    fn pooling_modes() {
        let states = [1.0f32, 2.0, 3.0, 6.0];
        assert_eq!(pool_states(&states, 2, Pooling::Cls), vec![1.0, 2.0]);
        assert_eq!(pool_states(&states, 2, Pooling::LastToken), vec![3.0, 6.0]);
        assert_eq!(pool_states(&states, 2, Pooling::Mean), vec![2.0, 4.0]);
        assert_eq!(pool_states(&states, 2, Pooling::Max), vec![3.0, 6.0]);
        let v = finish_embedding(vec![3.0, 4.0], true);
        assert!((v[0] - 0.6).abs() < 1e-7 && (v[1] - 0.8).abs() < 1e-7);
    }
}
